"""Gemma 4 mixture-of-experts layers (`enable_moe_block`) against HF transformers (tiny random
models, fp32, CPU): the router and the experts against transformers' modules, greedy output
and logprobs token for token, batching and chunked prefill against requests run alone, the
interpreted Triton kernels against the reference, negative controls that the routed block
and its per-expert scales matter, and the refusals."""
import pytest
import torch

from conftest import assert_greedy_matches_transformers, assert_triton_engine_equals_reference, \
    engine_kwargs, gemma4_hf_config, random_prompts, save_tiny
from luceio import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
LONG = list(range(3, 30))  # well past both windows

CONFIGS = {
    # on GQA 2:1, tied, per-layer inputs, two KV-shared double-wide layers: 5 experts, top 2
    "ple_e5k2": ("gqa_ple_shared", dict(num_experts=5, top_k_experts=2,
                                        moe_intermediate_size=24)),
    # on MHA, odd widths, untied, keys as values, soft-capping: 7 experts of odd width, top 3
    "keqv_e7k3": ("mha_odd_keqv_untied", dict(num_experts=7, top_k_experts=3,
                                              moe_intermediate_size=19)),
}


def hf_config(name: str):
    base, moe = CONFIGS[name]
    return gemma4_hf_config(base, enable_moe_block=True, **moe)


def make_tiny_gemma4_moe(folder: str, name: str, seed: int) -> str:
    """A random Gemma 4 MoE checkpoint (fp32): norm weights, the router's input scale and the
    layer scalars drawn away from 1, per-expert scales in [0.5, 1.5], and a router with clear
    preferences (logits of unit size), so that all of them matter."""
    from transformers import Gemma4ForCausalLM
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(hf_config(name)).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("router.scale"):
                p.normal_(1.0, 0.3)
            elif pname.endswith("per_expert_scale"):
                p.uniform_(0.5, 1.5)
            elif pname.endswith("router.proj.weight"):
                p.normal_(0.0, 1.0)
        for pname, b in model.named_buffers():
            if pname.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    return save_tiny(model, folder)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    return {name: make_tiny_gemma4_moe(str(tmp_path_factory.mktemp(name)), name, seed)
            for seed, name in enumerate(CONFIGS)}


def _prompts() -> list[list[int]]:
    return random_prompts(3, seed=1) + [LONG]


def test_router_and_experts_match_transformers():
    """The router's weights and choices, and the experts grouped on the host, against
    transformers' `Gemma4TextRouter` and eager `Gemma4TextExperts` on random fp32 inputs in
    which every expert is chosen."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

    from luceio.models.gemma4_moe import Gemma4Router, experts_grouped
    config = hf_config("keqv_e7k3")
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    router, experts = Gemma4TextRouter(config), Gemma4TextExperts(config)
    for p in (*router.parameters(), *experts.parameters()):
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.5)
    ours = Gemma4Router(config.hidden_size, config.num_experts, config.top_k_experts,
                        config.rms_norm_eps)
    ours.load_state_dict(router.state_dict())
    x = torch.randn(41, config.hidden_size) * 3
    with torch.no_grad():
        _, want_weights, want_ids = router(x)
        weights, expert_ids = ours(x)
        want = experts(x, want_ids, want_weights)
        grouped = experts_grouped(x, experts.gate_up_proj, experts.down_proj, weights,
                                  expert_ids)
    assert torch.equal(expert_ids, want_ids)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grouped, want, rtol=1e-5, atol=1e-6)
    assert len(set(expert_ids.flatten().tolist())) == 7  # every expert ran on some token


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(moe_models, name):
    from transformers import AutoModelForCausalLM

    from luceio.loader import load_checkpoint
    from luceio.models import model_config
    from luceio.models.gemma4_moe import Gemma4MoeBlock
    path = moe_models[name]
    cfg = model_config(load_checkpoint(path).config)
    moe = CONFIGS[name][1]
    assert (cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size) == \
        (moe["num_experts"], moe["top_k_experts"], moe["moe_intermediate_size"])
    layers = LLM(path, **engine_kwargs()).engine.runner.model.layers
    assert all(isinstance(layer.moe, Gemma4MoeBlock) for layer in layers)
    # transformers' eager experts (its default grouped_mm needs 16-byte strides, which an odd
    # expert width has not); the logprobs too: a routing slip that keeps the argmax shows there
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              experts_implementation="eager")
    assert_greedy_matches_transformers(path, _prompts(), hf=hf)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_and_chunked_prefill_equal_alone(moe_models, name):
    path = moe_models[name]
    prompts = random_prompts(5, seed=2) + [LONG]
    params = SamplingParams(max_tokens=10, **GREEDY)
    llm = LLM(path, **engine_kwargs())
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids
             for p in prompts]
    for kw in ({}, {"max_num_batched_tokens": 7}):  # the second chunks the prefills
        batched = LLM(path, **engine_kwargs(**kw)).generate(
            [{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in batched] == alone


def test_the_routed_block_and_its_scales_matter(moe_models):
    """Negative controls on the loaded model: per-expert scales of 1, or experts that output
    nothing, give other logprobs (the first control needs top-k > 1: with one expert a token,
    the post-norm would cancel its scale). So the tests above exercise both."""
    path = moe_models["keqv_e7k3"]
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = SamplingParams(max_tokens=8, logprobs=1, **GREEDY)

    def logprobs(change=None) -> list[list[float]]:
        llm = LLM(path, **engine_kwargs())
        if change is not None:
            for layer in llm.engine.runner.model.layers:
                change(layer.moe)
        return [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in llm.generate(prompts, params)]
    base = logprobs()
    assert logprobs(lambda moe: moe.router.per_expert_scale.fill_(1.0)) != base
    assert logprobs(lambda moe: moe.experts.down_proj.zero_()) != base


def test_engine_on_triton_kernels_equals_reference(moe_models, monkeypatch):
    """The engine on the Triton kernels (interpreted on CPU) around the torch experts gives
    the torch reference path's tokens."""
    assert_triton_engine_equals_reference(moe_models["ple_e5k2"], monkeypatch)


def test_refuses_what_it_does_not_run(moe_models):
    """int8 / int4 and expert offload are refused; the experts' host-read routing keeps these
    models off CUDA graphs (`moe.routes_on_host`)."""
    from luceio.models.moe import routes_on_host
    path = moe_models["ple_e5k2"]
    assert routes_on_host(LLM(path, **engine_kwargs()).engine.runner.model)
    with pytest.raises(ValueError, match="Gemma 4 mixture-of-experts models load dense"):
        LLM(path, **engine_kwargs(quantization="int8"))
    with pytest.raises(ValueError, match="expert-memory.*Gemma 4 mixture-of-experts"):
        LLM(path, **engine_kwargs(expert_memory="0.5"))
