"""End to end on the GPU: CUDA graphs vs eager, and the Triton path vs the torch reference."""
import pytest
import torch

from conftest import engine_kwargs
from luceio import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=48)


def prompts(n):
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 384, (5 + 9 * i,), generator=g).tolist()}
            for i in range(n)]


def run(path, **kw):
    llm = LLM(path, **engine_kwargs(device="cuda", **kw))
    return [o.outputs[0].token_ids for o in llm.generate(prompts(12), GREEDY)], llm.engine


def test_cuda_graphs_equal_eager_fp32(tiny_llama):
    eager, _ = run(tiny_llama, enforce_eager=True)
    graphs, eng = run(tiny_llama)
    assert eng.runner.graphs is not None and eng.runner.graphs.graphs
    assert graphs == eager


def test_triton_equals_torch_reference_fp32(tiny_models, monkeypatch):
    for arch, path in tiny_models.items():
        triton_out, _ = run(path, enforce_eager=True)
        monkeypatch.setenv("LUCEIO_KERNELS", "torch")
        ref_out, _ = run(path, enforce_eager=True)
        monkeypatch.delenv("LUCEIO_KERNELS")
        assert triton_out == ref_out, arch


def test_bf16_engine_runs_with_graphs(tiny_llama):
    out, eng = run(tiny_llama, dtype="bfloat16")
    assert all(len(o) == 48 for o in out)
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_verify_graphs_equal_eager_with_speculation(tiny_llama):
    """Speculative steps replay (batch, k+1) graphs; greedy output must equal plain eager."""
    eager, _ = run(tiny_llama, enforce_eager=True)
    spec, eng = run(tiny_llama, speculative_method="draft", draft_model=tiny_llama,
                    num_speculative_tokens=3)
    assert any(key[1] > 1 and not key[2] for key in eng.runner.graphs.graphs)
    assert eng.spec.stats.num_draft_tokens > 0
    assert spec == eager


def test_draft_model_fits_beside_a_memory_sized_target(tiny_llama):
    """With no explicit KV size, the target's cache is sized around the draft's weights and
    its cache, so a draft-model engine starts and runs (regression: the draft got no memory)."""
    llm = LLM(tiny_llama, dtype="float32", device="cuda", gpu_memory_utilization=0.03,
              speculative_method="draft", draft_model=tiny_llama, max_model_len=512)
    eng = llm.engine
    assert eng.spec.proposer.runner.num_blocks == eng.runner.num_blocks
    out = llm.generate(prompts(4), GREEDY)
    assert all(len(o.outputs[0].token_ids) == 48 for o in out)


def test_residency_on_gpu(tiny_llama):
    """Bounded residency with CUDA graphs: a budget covering the context equals plain; a small
    one offloads to pinned host memory, reloads, and leaves nothing behind."""
    long = [{"prompt_token_ids": p["prompt_token_ids"] * 6} for p in prompts(6)]

    def go(**kw):
        llm = LLM(tiny_llama, **engine_kwargs(device="cuda", **kw))
        return [o.outputs[0].token_ids for o in llm.generate(long, GREEDY)], llm.engine
    plain, _ = go()
    full, _ = go(kv_resident_tokens=1024)
    assert full == plain
    small, eng = go(kv_resident_tokens=96, kv_rescore_interval=4)
    assert all(len(o) == 48 for o in small)
    assert eng.runner.graphs.q_buf is not None
    # block scores from queries captured inside the graphs pick what eager probing picks
    eager, _ = go(kv_resident_tokens=96, kv_rescore_interval=4, enforce_eager=True)
    assert small == eager
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
    assert eng.runner.host_store.request_ids() == []
    assert eng.runner.graphs is not None and eng.runner.graphs.graphs


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tree_speculation_equals_plain_decoding(tiny_llama, method):
    """Tree verify steps (and the draft model's tree levels) run eagerly with the Triton
    tree-mask attention, the other steps on graphs; greedy output equals plain decoding."""
    from test_spec_tree import _branchy_prompts
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)
    prompts = [{"prompt_token_ids": p} for p in _branchy_prompts(12)]
    plain = LLM(tiny_llama, **engine_kwargs(device="cuda")).generate(prompts, params)
    spec = dict(speculative_method=method, num_speculative_tokens=4, spec_tree_budget=12)
    if method == "draft":
        spec["draft_model"] = tiny_llama
    llm = LLM(tiny_llama, **engine_kwargs(device="cuda", **spec))
    tree = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in tree] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.spec.stats.num_accepted_tokens > 0
