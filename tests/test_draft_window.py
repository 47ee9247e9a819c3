"""The draft model's context window (`--spec-draft-window`, `spec.draft_cache`): a long
prompt is read by the draft as its first KV block and its last N tokens, so the draft's
prefill is bounded; verification keeps the output the target's."""
from __future__ import annotations

import pytest

from conftest import engine_kwargs
from luceio import LLM, EngineArgs, SamplingParams

PROMPT = [(7 * i) % 300 + 3 for i in range(80)]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _spec_llm(path, window: int, **kw) -> LLM:
    llm = LLM(path, **engine_kwargs(speculative_method="draft", draft_model=path,
                                    num_speculative_tokens=3, spec_draft_window=window, **kw))
    llm.engine.spec.mode = lambda batch_size, step=None: "tree" if kw else "chain"
    return llm


def _spy(prop) -> list[int]:
    seen, execute = [], prop.runner.execute

    def spy(inp, probe=None):
        seen.append(int(inp.host.q_lens.max()))
        return execute(inp, probe)
    prop.runner.execute = spy
    return seen


@pytest.mark.parametrize("tree", [False, True])
def test_a_long_prompt_is_read_through_the_window(tiny_llama, tree):
    """With a 16-token window, an 80-token prompt's first draft feed is its first block (the
    sink) and the last 16 tokens before the draft's input, not the whole prompt; the draft's
    view is exactly those tokens followed by what was generated; greedy output (chains and
    trees) equals plain decoding's."""
    want = LLM(tiny_llama, **engine_kwargs()).generate([{"prompt_token_ids": PROMPT}], GREEDY)
    llm = _spec_llm(tiny_llama, 16, **({"spec_tree_budget": 6} if tree else {}))
    prop = llm.engine.spec.proposer
    bs = prop.kv.block_size
    seen = _spy(prop)
    views = []
    sync = prop._sync

    def spy_sync(request_id, tokens):
        s = sync(request_id, tokens)
        views.append((list(tokens), list(s.all_token_ids), s.sink, s.skip))
        return s
    prop._sync = spy_sync
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0]
    assert out.outputs[0].token_ids == want[0].outputs[0].token_ids
    assert llm.engine.spec.stats.num_verify_steps > 0
    assert seen[0] == bs + 16  # the sink block and the window, the draft's input last
    tokens, view, sink, skip = views[-1]
    assert sink == bs and skip == len(PROMPT) + 1 - bs - 16  # decided at the first look
    assert view[:len(tokens) - skip] == tokens[:bs] + tokens[bs + skip:]
    assert max(seen[1:]) < bs  # after it, only new tokens (and drafts) are fed


def test_the_window_s_blocks_are_cached_under_their_own_hashes(tiny_llama):
    """The draft's prefix cache registers a windowed request's blocks under the chained hashes
    of the tokens it read (the view), and nothing under the whole prompt's hashes at those
    indices; a second request with the same prompt adopts them (its first feed starts past
    the cached view blocks) and decodes as plain decoding does."""
    from luceio.cache.block_pool import hash_block
    llm = _spec_llm(tiny_llama, 16)
    prop = llm.engine.spec.proposer
    bs = prop.kv.block_size
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids
    pool = prop.kv.pool
    tokens = PROMPT + list(out[:1])  # the draft first saw the prompt and the first token
    view = tokens[:bs] + tokens[len(tokens) - 16:]
    h = hash_block(None, tuple(view[:bs]))
    h = hash_block(h, tuple(view[bs:2 * bs]))  # the view's second block: the window
    assert pool.lookup(h, tuple(view[bs:2 * bs])) is not None
    full = hash_block(hash_block(None, tuple(PROMPT[:bs])), tuple(PROMPT[bs:2 * bs]))
    assert pool.lookup(full, tuple(PROMPT[bs:2 * bs])) is None
    seen = _spy(prop)
    again = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0]
    assert seen[0] < bs + 16  # the sink and part of the window came from the cache
    assert again.outputs[0].token_ids == LLM(tiny_llama, **engine_kwargs()).generate(
        [{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids


def test_a_short_prompt_is_read_whole(tiny_llama):
    """A prompt that fits the window is fed to the draft whole, as without one."""
    llm = _spec_llm(tiny_llama, 128)
    seen = _spy(llm.engine.spec.proposer)
    llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)
    assert seen[0] == len(PROMPT) + 1


def test_uncached_counts_the_window(tiny_llama):
    """The cost model's estimate of a cold request's catch-up (`uncached`) is what the draft
    will feed through its window: the sink and the window, less the last token."""
    prop = _spec_llm(tiny_llama, 16).engine.spec.proposer
    bs = prop.kv.block_size
    assert prop.uncached("r", len(PROMPT), PROMPT) == bs + 16 - 1
    assert prop.seqs["r"].skip == len(PROMPT) - bs - 16
    prop.release("r")
    assert _spec_llm(tiny_llama, 0).engine.spec.proposer.uncached("r", len(PROMPT), PROMPT) \
        == len(PROMPT) - 1


@pytest.mark.parametrize("kw", [dict(spec_draft_window=-1, speculative_method="draft"),
                                dict(spec_draft_window=64, speculative_method="ngram")])
def test_the_window_is_checked(tiny_llama, kw):
    """A negative window, or a window without a draft model, is refused at startup."""
    from luceio.engine import LLMEngine
    with pytest.raises(ValueError, match="spec-draft-window"):
        LLMEngine(EngineArgs(model=tiny_llama, draft_model=tiny_llama,
                             **engine_kwargs(**kw)))
