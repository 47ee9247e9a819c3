"""Speculative prefill: the draft scores the prompt, the target prefills the kept spans at
their original positions (tiny random models, fp32, CPU)."""
import asyncio

import numpy as np
import pytest
import torch

from conftest import engine_kwargs, make_tiny_model
from luceio import LLM, AsyncEngine, EngineArgs, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=12)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("sp") / "d"), "qwen2", seed=7)


def long_prompt(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def test_keep_one_is_exactly_plain(tiny_llama, draft):
    p = long_prompt()
    plain = LLM(tiny_llama, **engine_kwargs()).generate([{"prompt_token_ids": p}],
                                                       SamplingParams(**GREEDY))[0]
    llm = LLM(tiny_llama, **engine_kwargs(draft_model=draft))
    out = llm.generate([{"prompt_token_ids": p}],
                       SamplingParams(spec_prefill_keep=1.0, **GREEDY))[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.prompt_token_ids == p


def test_kept_tokens_keep_their_positions(tiny_llama, draft):
    p = long_prompt(203)
    llm = LLM(tiny_llama, **engine_kwargs(draft_model=draft, spec_prefill_keep=0.3,
                                          spec_prefill_min_tokens=100))
    eng = llm.engine
    seen = []
    orig = eng.runner.prepare

    def spy(sched, tables):
        inp = orig(sched, tables)
        seen.append(inp.host)
        return inp
    eng.runner.prepare = spy
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(**GREEDY))[0]
    kept = eng.spec_prefill.select(p, 0.3)
    span = eng.spec_prefill.span
    assert kept[:span] == list(range(span))  # the first span
    assert kept[-(203 % span):] == list(range(203 - 203 % span, 203))  # the last (partial) span
    assert len(kept) < 0.45 * len(p) and kept == sorted(set(kept))
    first = seen[0]  # the target's prefill: kept tokens, original positions, compact slots
    assert first.input_ids.tolist() == [p[i] for i in kept]
    assert first.positions.tolist() == kept
    table = first.block_tables[0]
    cache_idx = np.arange(len(kept))
    assert first.slot_mapping.tolist() == (table[cache_idx // 16] * 16 + cache_idx % 16).tolist()
    # decoding continues at the original prompt's positions
    assert seen[1].positions.tolist() == [len(p)]
    assert seen[2].positions.tolist() == [len(p) + 1]
    assert out.prompt_token_ids == p and len(out.outputs[0].token_ids) == 12
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
    assert eng.spec_prefill.kv.pool.num_free_blocks == eng.spec_prefill.kv.pool.num_blocks


def test_short_prompts_and_threshold(tiny_llama, draft):
    llm = LLM(tiny_llama, **engine_kwargs(draft_model=draft, spec_prefill_keep=0.25,
                                          spec_prefill_min_tokens=500))
    assert llm.engine.spec_prefill_keep(200, SamplingParams()) is None
    assert llm.engine.spec_prefill_keep(600, SamplingParams()) == 0.25
    assert llm.engine.spec_prefill_keep(10, SamplingParams(spec_prefill_keep=0.5)) == 0.5
    with pytest.raises(ValueError, match="draft"):
        LLM(tiny_llama, **engine_kwargs(spec_prefill_keep=0.5))


def test_scores_match_a_dense_reference(tiny_llama, draft):
    """The chunked, windowed scorer equals max-over-heads-and-layers attention computed densely."""
    from transformers import AutoModelForCausalLM
    llm = LLM(tiny_llama, **engine_kwargs(draft_model=draft))
    sp = llm.engine.spec_prefill
    sp.chunk, sp.window = 48, 20
    p = long_prompt(130, seed=3)
    got = sp.scores(p)
    hf = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        att = hf(torch.tensor([p]), output_attentions=True).attentions  # per layer [1, H, n, n]
    dense = torch.stack([a[0, :, -20:, :] for a in att]).amax(0).amax(0).mean(0)
    torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-5)


async def test_async_engine_runs_scoring_off_loop(tiny_llama, draft):
    engine = AsyncEngine.from_engine_args(EngineArgs(model=tiny_llama, draft_model=draft,
                                                     spec_prefill_keep=0.5,
                                                     spec_prefill_min_tokens=64,
                                                     **engine_kwargs()))
    outs = []
    async for o in engine.generate({"prompt_token_ids": long_prompt(150)}, SamplingParams(**GREEDY), "x"):
        outs.append(o)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
    await engine.shutdown()
    await asyncio.sleep(0)


def test_spec_prefill_keep_is_refused_without_speculative_prefill(tiny_llama):
    """A request's spec_prefill_keep on an engine without speculative prefill (no draft model)
    is refused with a clear error, never silently ignored."""
    llm = LLM(tiny_llama, **engine_kwargs())
    with pytest.raises(ValueError, match="spec_prefill_keep needs speculative prefill"):
        llm.engine.add_request(None, [5, 6, 7], SamplingParams(spec_prefill_keep=0.5))
    assert not llm.engine.scheduler.waiting
