"""Qwen3.5 hybrid text models (luceio/models/qwen3_5.py) against transformers, fp32 on the CPU:
Gated DeltaNet layers with their per-request state slots beside full-attention layers with
gated outputs and partial RoPE. Greedy tokens (and logprobs) equal to transformers' `generate`,
batched equal to solo, chunked prefill equal to one-shot, preemption and slot reuse, and the
engine features the state cannot follow refused."""
import inspect

import pytest
import torch

from conftest import QWEN3_NEXT, QWEN35_CONFIGS, VOCAB, assert_greedy_matches_transformers, \
    assert_triton_engine_equals_reference, engine_kwargs, make_tiny_qwen35, random_prompts, \
    spread_qwen35_norms
from luceio import LLM, SamplingParams

@pytest.fixture(scope="module")
def qwen35_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35")
    return {name: make_tiny_qwen35(str(root / name), name, seed=i)
            for i, name in enumerate(QWEN35_CONFIGS)}


@pytest.fixture(autouse=True)
def transformers_torch_paths(monkeypatch):
    """transformers swaps in flash-linear-attention / causal-conv1d kernels when importable; the
    oracle stays its own torch code."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                 "causal_conv1d_fn", "causal_conv1d_update"):
        if hasattr(modeling_qwen3_5, name):
            monkeypatch.setattr(modeling_qwen3_5, name,
                                inspect.unwrap(getattr(modeling_qwen3_5, name)))


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("name", list(QWEN35_CONFIGS))
def test_greedy_matches_transformers(qwen35_models, name):
    assert_greedy_matches_transformers(qwen35_models[name], random_prompts(3, seed=5))


@pytest.mark.parametrize("name", list(QWEN35_CONFIGS))
def test_batched_and_chunked_prefill_equal_solo(qwen35_models, name):
    """Eight requests at once, prompts prefilled in chunks of 7 tokens (cut anywhere, mixed with
    other requests' decode steps), equal each request alone in one prefill."""
    prompts = random_prompts(8, seed=11, max_len=40)
    solo = [_tokens(LLM(qwen35_models[name], **engine_kwargs()), [p])[0] for p in prompts]
    chunked = LLM(qwen35_models[name], **engine_kwargs(max_num_batched_tokens=7))
    assert _tokens(chunked, prompts) == solo
    # the slots of finished requests are reused, from a zeroed state
    assert _tokens(chunked, prompts[::-1]) == solo[::-1]
    # no slot lost: the slots still held belong to requests of the last step, given back at
    # the next step (they are reclaimed once the KV manager no longer holds the request)
    slots, kv = chunked.engine.runner.state_slots, chunked.engine.kv
    assert len(slots.free) + len(slots.of) == chunked.engine.scheduler.config.max_num_seqs
    assert not any(rid in kv.block_tables for rid in slots.of)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """A `Qwen3_5ForConditionalGeneration` checkpoint (how Qwen3.5 is released: the text model
    under `model.language_model.`, a vision tower beside it) serves its text model: greedy
    tokens and logprobs equal to transformers' multimodal class on text-only prompts."""
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    from conftest import save_tiny
    torch.manual_seed(4)
    text = dict(QWEN35_CONFIGS["gqa_tied"], vocab_size=VOCAB, initializer_range=0.1,
                tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
                pad_token_id=None)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2)
    model = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)).float()
    path = save_tiny(model, str(tmp_path / "qwen35_vl"))
    assert_greedy_matches_transformers(path, random_prompts(2, seed=9), max_tokens=10, hf=model)


def test_triton_engine_equals_reference(qwen35_models, monkeypatch):
    """The GPU's path on the (interpreted) Triton kernels: attention layers, the DeltaNet's
    decode launches and its chunked prefill kernel (three prompts in one varlen batch)."""
    assert_triton_engine_equals_reference(qwen35_models["mha_untied"], monkeypatch)


def test_preemption_recomputes_from_a_zeroed_state(qwen35_models):
    """A pool too small for all requests at once preempts (recompute) and restarts requests;
    their output equals the unconstrained engine's."""
    path = qwen35_models["gqa_tied"]
    prompts = random_prompts(6, seed=3, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = _tokens(LLM(path, **engine_kwargs()), prompts, params)
    tight = LLM(path, **engine_kwargs(num_kv_blocks=16, block_size=4))
    assert _tokens(tight, prompts, params) == free
    assert tight.engine.scheduler.num_preemptions > 0


def test_kv_pool_holds_only_full_attention_layers_and_prefix_caching_is_off(qwen35_models):
    llm = LLM(qwen35_models["mha_untied"], **engine_kwargs())
    runner = llm.engine.runner
    assert runner.kv_pool.shape[0] == 2  # two full-attention layers of five
    assert runner.model.state.shape[:2] == (3, runner.model.state.shape[1])
    assert not llm.engine.kv.enable_prefix_caching
    # the same prompt twice: no KV reused, the second answer equal to the first
    p = random_prompts(1, seed=8)[0]
    assert _tokens(llm, [p]) == _tokens(llm, [p])


@pytest.mark.parametrize("over, flag", [
    (dict(speculative_method="ngram", num_speculative_tokens=2, spec_tree_budget=6),
     "--spec-tree-budget"),
    (dict(preemption_mode="swap"), "--preemption-mode swap"),
    (dict(kv_resident_tokens=64), "--kv-resident-tokens"),
])
def test_unsupported_engine_features_are_refused(qwen35_models, over, flag):
    with pytest.raises(ValueError, match=flag):
        LLM(qwen35_models["gqa_tied"], **engine_kwargs(**over))


def test_a_hybrid_model_cannot_draft(qwen35_models, tiny_llama):
    with pytest.raises(ValueError, match="cannot draft"):
        LLM(tiny_llama, **engine_kwargs(speculative_method="draft",
                                        draft_model=qwen35_models["gqa_tied"],
                                        num_speculative_tokens=2))


def test_negative_control_the_state_carries_across_steps(qwen35_models):
    """If the runner zeroed the state every step, decode would forget the prompt: the logprobs
    change (so the equalities above do test the state)."""
    path = qwen35_models["gqa_tied"]
    prompts = random_prompts(3, seed=21, max_len=20)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)

    def logprobs(llm):
        return [[sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs]
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    good = logprobs(LLM(path, **engine_kwargs()))
    assert logprobs(LLM(path, **engine_kwargs())) == good  # deterministic
    llm = LLM(path, **engine_kwargs())
    model = llm.engine.runner.model
    forward = model.forward

    def forgetful(*args, **kwargs):
        model.reset_state(args[3].state_slots)
        return forward(*args, **kwargs)
    model.forward = forgetful
    assert logprobs(llm) != good


QWEN35_MOE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6,
                  num_experts_per_tok=2)


@pytest.fixture(scope="module")
def qwen35_moe(tmp_path_factory):
    """A random Qwen3.5-MoE text checkpoint (fp32, untied): 6 experts, top-2, a shared expert
    of another width; norms drawn away from 0."""
    from transformers import Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    from conftest import save_tiny
    torch.manual_seed(6)
    cfg = Qwen3_5MoeTextConfig(vocab_size=VOCAB, max_position_embeddings=512,
                               initializer_range=0.1, eos_token_id=None, bos_token_id=None,
                               pad_token_id=None, **QWEN35_MOE)
    model = spread_qwen35_norms(Qwen3_5MoeForCausalLM(cfg).float())
    return save_tiny(model, str(tmp_path_factory.mktemp("qwen35moe") / "m"))


def test_moe_greedy_matches_transformers(qwen35_moe):
    assert_greedy_matches_transformers(qwen35_moe, random_prompts(3, seed=13))


def test_moe_batched_and_chunked_prefill_equal_solo(qwen35_moe):
    prompts = random_prompts(6, seed=17, max_len=40)
    solo = [_tokens(LLM(qwen35_moe, **engine_kwargs()), [p])[0] for p in prompts]
    assert _tokens(LLM(qwen35_moe, **engine_kwargs(max_num_batched_tokens=9)), prompts) == solo


def test_moe_offloaded_experts_equal_resident(qwen35_moe):
    """Half the routed experts in host memory (LRU device slots, rounds when a step needs more
    experts than slots): tokens and logprobs bit for bit those of the resident model."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, seed=29, max_len=30)]
    resident = LLM(qwen35_moe, **engine_kwargs()).generate(prompts, params)
    llm = LLM(qwen35_moe, **engine_kwargs(expert_memory="0.5"))
    offloaded = llm.generate(prompts, params)
    for g, w in zip(offloaded, resident):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in g.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in w.outputs[0].logprobs]
    stats = llm.engine.stats().experts
    assert stats.num_slots == 3 and stats.misses > 0


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """A random Qwen3-Next checkpoint (fp32): 2 key heads for 4 value heads (the interleaved
    projections regroup), layer 1 dense (`mlp_only_layers`), the rest sparse with a shared
    expert; full attention every 2nd layer."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from conftest import save_tiny
    torch.manual_seed(8)
    model = spread_qwen35_norms(Qwen3NextForCausalLM(Qwen3NextConfig(**QWEN3_NEXT)).float())
    return save_tiny(model, str(tmp_path_factory.mktemp("qwen3next") / "m"))


def test_qwen3_next_greedy_matches_transformers(qwen3_next, monkeypatch):
    from transformers.models.qwen3_next import modeling_qwen3_next
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                 "causal_conv1d_fn", "causal_conv1d_update"):
        if hasattr(modeling_qwen3_next, name):
            monkeypatch.setattr(modeling_qwen3_next, name,
                                inspect.unwrap(getattr(modeling_qwen3_next, name)))
    assert_greedy_matches_transformers(qwen3_next, random_prompts(3, seed=31))
    llm = LLM(qwen3_next, **engine_kwargs(max_num_batched_tokens=7))
    model = llm.engine.runner.model
    assert model.moe_cfg.sparse_layers == (0, 2, 3)
    prompts = random_prompts(4, seed=37, max_len=30)
    solo = [_tokens(LLM(qwen3_next, **engine_kwargs()), [p])[0] for p in prompts]
    assert _tokens(llm, prompts) == solo
