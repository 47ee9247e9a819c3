"""The engine on quantized weights on the GPU: CUDA graphs equal eager, and the Triton kernels
equal the torch reference end to end (tiny checkpoint quantized at load with int8 / int4)."""
import pytest
import torch

from conftest import engine_kwargs
from luceio import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)


def prompts(n):
    g = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(3, 384, (4 + 7 * i,), generator=g).tolist()}
            for i in range(n)]


def run(path, **kw):
    llm = LLM(path, **engine_kwargs(device="cuda", **kw))
    assert llm.engine.runner.model.layers[0].mlp.down_proj.quantized
    return [o.outputs[0].token_ids for o in llm.generate(prompts(10), GREEDY)], llm.engine


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_cuda_graphs_equal_eager(tiny_llama, mode, dtype):
    eager, _ = run(tiny_llama, quantization=mode, dtype=dtype, enforce_eager=True)
    graphs, eng = run(tiny_llama, quantization=mode, dtype=dtype)
    assert eng.runner.graphs is not None and eng.runner.graphs.graphs
    assert graphs == eager
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_quantized_triton_equals_torch_reference_fp32(tiny_llama, monkeypatch):
    triton_out, _ = run(tiny_llama, quantization="int8", enforce_eager=True)
    monkeypatch.setenv("LUCEIO_KERNELS", "torch")
    ref_out, _ = run(tiny_llama, quantization="int8", enforce_eager=True)
    assert triton_out == ref_out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_programmatic_dependent_launch_changes_no_output(tiny_llama, dtype):
    """PDL (kernels/pdl.py) only lets a kernel launch before the one ahead finishes: with it
    on and off, CUDA graphs and eager each give the same tokens and logprobs, bit for bit."""
    import dataclasses

    from luceio.kernels import configs, pdl
    base = configs.get_config(torch.device("cuda"))
    if not pdl.pdl_enabled(torch.device("cuda"), dataclasses.replace(base, pdl=True)):
        pytest.skip("PDL needs sm_90 or later")
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, logprobs=2)
    results = {}
    for on in (True, False):
        for eager in (False, True):
            with configs.use_config(dataclasses.replace(base, pdl=on)):
                llm = LLM(tiny_llama, **engine_kwargs(device="cuda", quantization="int4",
                                                      dtype=dtype, enforce_eager=eager))
                outs = llm.generate(prompts(6), params)
            results[on, eager] = [(o.outputs[0].token_ids,
                                   [sorted(lp.items()) for lp in o.outputs[0].logprobs])
                                  for o in outs]
    assert results[True, False] == results[False, False]
    assert results[True, True] == results[False, True]


def test_speculation_with_gemv_tails_equals_plain(tiny_llama, monkeypatch):
    """The quantized GEMVs' tails (`quant_gemv_tail`: the SiLU after gate/up, the residual add
    and norm after o and down) run in a decode step's one row and a verify step's few rows
    alike, so greedy chain speculation (one request at a time: 5-row verify steps, inside the
    GEMV's rows) equals plain decoding token for token, CUDA graphs on."""
    from luceio.kernels import quant_gemv
    from luceio.spec import decoding
    tails, launch = [], quant_gemv.tail_launch

    def recorded(t, *a):
        got = launch(t, *a)
        if got is not None:
            tails.append(type(t).__name__)
        return got
    monkeypatch.setattr(quant_gemv, "tail_launch", recorded)
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "chain")
    kw = dict(device="cuda", quantization="int4", dtype="bfloat16")
    plain_llm = LLM(tiny_llama, **engine_kwargs(**kw))
    spec_llm = LLM(tiny_llama, **engine_kwargs(speculative_method="draft", draft_model=tiny_llama,
                                               num_speculative_tokens=4, **kw))
    for p in prompts(3):
        plain = plain_llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        spec = spec_llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert spec == plain
    assert {"GluTail", "NormTail"} <= set(tails), set(tails)
    assert spec_llm.engine.spec.stats.num_accepted_tokens > 0  # verify steps of several rows
