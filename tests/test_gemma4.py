"""Gemma 4 text models against HF transformers (tiny random models, fp32, CPU): greedy output
and logprobs token for token, batching and chunked prefill against requests run alone, negative
controls that the window, the soft-capping and the KV sharing matter, and the refusals."""
import json
import shutil

import pytest

from conftest import GEMMA4_CONFIGS as CONFIGS, assert_greedy_matches_transformers, \
    assert_triton_engine_equals_reference, engine_kwargs, make_tiny_gemma4, \
    random_prompts as _prompts
from luceio import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
LONG = list(range(3, 30))  # well past both windows


@pytest.fixture(scope="module")
def gemma4_models(tmp_path_factory) -> dict[str, str]:
    return {name: make_tiny_gemma4(str(tmp_path_factory.mktemp(name)), name, seed)
            for seed, name in enumerate(CONFIGS)}


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _with_config(path: str, folder, **change) -> str:
    folder = shutil.copytree(path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    return str(folder)


def test_config_reads_what_transformers_builds(gemma4_models):
    from luceio.loader import load_checkpoint
    from luceio.models import model_config
    shared, keqv = (model_config(load_checkpoint(gemma4_models[n]).config)
                    for n in ("gqa_ple_shared", "mha_odd_keqv_untied"))
    assert shared.layer_windows == (5, 5, 0, 5, 0)
    assert shared.layer_kv_source == (0, 1, 2, 1, 2)  # the last of each type before sharing
    assert shared.layer_intermediate == (96, 96, 96, 192, 192)
    assert shared.per_layer_input_size == 8 and shared.rope_partial_factor == 0.25
    assert keqv.layer_windows == (7, 7, 7, 0)  # the default pattern, the last layer global
    assert keqv.layer_k_eq_v == (False, False, False, True)
    assert keqv.per_layer_input_size == 0 and keqv.rope_factor == 2.0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(gemma4_models, name):
    assert_greedy_matches_transformers(gemma4_models[name], _prompts(3, seed=1) + [LONG])


def test_the_window_softcap_and_sharing_matter(gemma4_models, tmp_path, monkeypatch):
    """Negative controls: the same weights without the window, or with the shared layers'
    KV of layer 3 read from layer 0 instead of layer 1, generate other tokens; without
    the soft-capping (monotonic: the same tokens) other logprobs. So the tests above exercise
    all three."""
    from luceio.models import gemma4
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, seed=1) + [LONG]]
    params = SamplingParams(max_tokens=14, logprobs=1, **GREEDY)

    def run(path):
        outs = LLM(path, **engine_kwargs()).generate(prompts, params)
        return _tokens(outs), [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                o.outputs[0].logprobs)]
                               for o in outs]
    shared = gemma4_models["gqa_ple_shared"]
    base = run(shared)[0]
    assert run(_with_config(shared, tmp_path / "nowindow", sliding_window=512))[0] != base
    keqv = gemma4_models["mha_odd_keqv_untied"]
    uncapped = _with_config(keqv, tmp_path / "uncapped", final_logit_softcapping=None)
    assert run(uncapped)[1] != run(keqv)[1]
    # layer 3 reads layer 0's KV instead of layer 1's
    monkeypatch.setattr(gemma4, "_kv_sources", lambda types, num_shared: (0, 1, 2, 0, 2))
    assert run(shared)[0] != base


def test_batched_and_chunked_prefill_equal_alone(gemma4_models):
    path = gemma4_models["gqa_ple_shared"]
    prompts = _prompts(5, seed=2) + [LONG]
    params = SamplingParams(max_tokens=10, **GREEDY)
    llm = LLM(path, **engine_kwargs())
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids
             for p in prompts]
    for kw in ({}, {"max_num_batched_tokens": 8, "block_size": 4}):  # chunks cross windows
        batched = LLM(path, **engine_kwargs(**kw)).generate(
            [{"prompt_token_ids": p} for p in prompts], params)
        assert _tokens(batched) == alone


@pytest.mark.parametrize("change,match", [
    # MoE layers run (tests/test_gemma4_moe.py), but not without their expert counts
    ({"enable_moe_block": True}, "enable_moe_block needs num_experts"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0},
                          "sliding_attention": {"rope_type": "default"}}}, "rope"),
])
def test_refuses_configs_it_does_not_run(gemma4_models, tmp_path, change, match):
    path = _with_config(gemma4_models["gqa_ple_shared"], tmp_path / "changed", **change)
    with pytest.raises(ValueError, match=match):
        LLM(path, **engine_kwargs())


def test_refusals_of_released_shapes_and_engine_features(gemma4_models):
    from luceio.models.gemma4 import Gemma4Config
    # a released-style config: global layers of head_dim 512 (transformers' default)
    config = {"architectures": ["Gemma4ForCausalLM"], "vocab_size": 384, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4}
    released = Gemma4Config.from_hf(config)  # global layers of head size 512, the rest 256
    assert released.kv_layer_shapes == ((4, 256),) * 5 + ((4, 512),)
    assert released.global_head_dim == 512 and released.head_dim == 256
    assert Gemma4Config.from_hf({**config, "global_head_dim": 256}).kv_layer_shapes is None
    path = gemma4_models["gqa_ple_shared"]
    with pytest.raises(ValueError, match="bounded KV residency"):
        LLM(path, **engine_kwargs(kv_resident_tokens=64))
    with pytest.raises(ValueError, match="speculative prefill.*Gemma 4"):
        LLM(path, **engine_kwargs(draft_model=path, spec_prefill_keep=0.5))


def test_engine_on_triton_kernels_equals_reference(gemma4_models, monkeypatch):
    """The engine (chunked prefill across the window, decode, the shared layers' query-only
    RoPE) on the Triton kernels (interpreted on CPU) gives the torch reference path's tokens."""
    assert_triton_engine_equals_reference(gemma4_models["gqa_ple_shared"], monkeypatch)


def test_global_layers_of_another_kv_shape(gemma4_models, tmp_path):
    """Released-style shapes (global head size 32 against 16, one KV head against two): a KV
    cache tensor per layer in its own shape, sized by the sum of the layers' bytes; batched and
    chunked prefill equal each request alone (greedy tokens equal transformers' above); on the
    interpreted Triton kernels equal to the reference; swap preemption refused."""
    path = gemma4_models["global_wide_keqv"]
    llm = LLM(path, **engine_kwargs())
    runner = llm.engine.runner
    assert runner.kv_pool is None
    assert [tuple(kv.shape[-2:]) for kv in runner.kv_caches] == \
        [(2, 16), (1, 32), (2, 16), (2, 16), (1, 32)]
    assert runner.bytes_per_block == 2 * 16 * 4 * (3 * 2 * 16 + 2 * 1 * 32)  # fp32, 16-token blocks
    prompts = _prompts(5, seed=4) + [LONG]
    params = SamplingParams(max_tokens=10, **GREEDY)
    alone = [_tokens(llm.generate([{"prompt_token_ids": p}], params))[0] for p in prompts]
    chunked = LLM(path, **engine_kwargs(max_num_batched_tokens=7))
    assert _tokens(chunked.generate([{"prompt_token_ids": p} for p in prompts], params)) == alone
    with pytest.raises(ValueError, match="swap"):
        LLM(path, **engine_kwargs(preemption_mode="swap"))


def test_global_wide_on_triton_kernels_equals_reference(gemma4_models, monkeypatch):
    assert_triton_engine_equals_reference(gemma4_models["global_wide_keqv"], monkeypatch)
