"""Speculative decoding on a Qwen3.5 hybrid model (luceio/models/hybrid_verify.py): a verify
step keeps each position's DeltaNet state and the engine commits the one after the last
accepted draft. Greedy output equals plain decoding token for token (logprobs to rounding)
with every acceptance length from none to all, with concurrent requests, chunked prefill,
preemption, the n-gram and draft-model proposers; a negative control commits the wrong
position and the output changes. fp32, CPU."""
import pytest

from conftest import engine_kwargs, make_tiny_model, make_tiny_qwen35, random_prompts
from luceio import LLM, SamplingParams
from luceio.spec.proposer import Proposal, Proposer

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_tiny_qwen35(str(tmp_path_factory.mktemp("q35spec") / "m"), "gqa_tied", seed=7)


class Oracle(Proposer):
    """Drafts the target's own greedy continuation (from a plain run) with a wrong token after
    `good` right ones, `good` a hash of the request's progress in 0..k: every acceptance length
    is verified."""

    def __init__(self, expected: dict[tuple, list[int]]):
        self.expected = expected

    def propose(self, batch):
        drafts = []
        for inp in batch:
            r = inp.request
            done = len(r.all_token_ids) - r.num_prompt_tokens
            right = self.expected[tuple(r.prompt_token_ids)][done:done + inp.k]
            good = (done * 2654435761 >> 7) % (inp.k + 1)
            d = right[:good] + [(t + 1) % 300 + 3 for t in right[good:good + 1]]
            drafts.append(d[:inp.k])
        return Proposal(drafts)


def _run(path, prompts, params=GREEDY, proposer=None, **kw):
    llm = LLM(path, **engine_kwargs(**kw))
    if proposer is not None:
        llm.engine.spec.proposer = proposer
        spec = llm.engine.spec  # draft every step, as many as allowed: no cost model
        spec.mode = lambda *a, **k: "chain"
        spec.k_for = lambda r, cap: max(0, min(cap, r.max_tokens - r.num_output_tokens - 1))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0] for o in outs], llm.engine


def _logprobs(out):
    return [[(t, lp.logprob) for t, lp in sorted(step.items())] for step in out.logprobs]


def _assert_same(got, plain):
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    for g, p in zip(got, plain):
        for a, b in zip(_logprobs(g), _logprobs(p)):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-4)


def _assert_released(eng):
    slots = eng.runner.state_slots
    assert not any(rid in eng.kv.block_tables for rid in slots.of)
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


@pytest.mark.parametrize("sched", [{}, {"max_num_batched_tokens": 9, "num_kv_blocks": 14,
                                        "block_size": 4}], ids=["plain", "chunked+preempt"])
def test_every_acceptance_length_gives_plain_decoding(hybrid, sched):
    prompts = random_prompts(4, seed=13, max_len=24)  # up to 4 running: k = 4 (batch_cap)
    plain, _ = _run(hybrid, prompts, **sched)
    oracle = Oracle({tuple(p): o.token_ids for p, o in zip(prompts, plain)})
    got, eng = _run(hybrid, prompts, proposer=oracle, speculative_method="ngram",
                    num_speculative_tokens=4, **sched)
    _assert_same(got, plain)
    st = eng.spec.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert len(st.accepted_histogram) >= 4  # 0, 1, 2, ... drafts accepted
    if sched:
        assert eng.scheduler.num_preemptions > 0
    _assert_released(eng)


def test_negative_control_committing_the_last_position_changes_the_output(hybrid, monkeypatch):
    """Keeping the state after every verified token (as if all drafts were accepted) instead of
    the last accepted one corrupts the state: the output departs from plain decoding."""
    import luceio.spec.commit as commit_mod
    prompts = random_prompts(3, seed=13, max_len=24)
    plain, _ = _run(hybrid, prompts)
    oracle = Oracle({tuple(p): o.token_ids for p, o in zip(prompts, plain)})
    right = commit_mod.commit_states

    def last_position(model, kept, accepted):
        right(model, kept, {rid: n - 1 for rid, n in zip(kept.request_ids, kept.lengths)})
    monkeypatch.setattr(commit_mod, "commit_states", last_position)
    got, _ = _run(hybrid, prompts, proposer=oracle, speculative_method="ngram",
                  num_speculative_tokens=4)
    assert [o.token_ids for o in got] != [o.token_ids for o in plain]


def test_ngram_and_draft_model_proposers_are_exact(hybrid, tmp_path):
    """The engine's own proposers: n-gram lookup over repetitive prompts, and a (non-hybrid)
    draft model of the same vocabulary."""
    draft = make_tiny_model(str(tmp_path / "draft"), "llama", seed=5)
    prompts = [([11 + i, 40, 41, 42, 43] * 4)[:12 + i] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    plain, _ = _run(hybrid, prompts, params)
    for spec in (dict(speculative_method="ngram"),
                 dict(speculative_method="draft", draft_model=draft)):
        got, eng = _run(hybrid, prompts, params, num_speculative_tokens=3, **spec)
        _assert_same(got, plain)
        assert eng.spec.stats.num_draft_tokens > 0
        _assert_released(eng)


def test_seeded_sampling_with_speculation_is_reproducible(hybrid):
    prompts = random_prompts(3, seed=2, max_len=16)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=16,
                            ignore_eos=True)
    plain, _ = _run(hybrid, prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                    ignore_eos=True))
    oracle = Oracle({tuple(p): o.token_ids for p, o in zip(prompts, plain)})
    runs = [_run(hybrid, prompts, params, proposer=oracle, speculative_method="ngram",
                 num_speculative_tokens=3) for _ in range(2)]
    assert [o.token_ids for o in runs[0][0]] == [o.token_ids for o in runs[1][0]]
    assert runs[0][1].spec.stats.num_draft_tokens > 0


def test_triton_engine_verifies_like_the_reference(hybrid, monkeypatch):
    """The verify step's per-token DeltaNet steps on the (interpreted) Triton decode kernel,
    over the step's working copy of the state rows."""
    from test_kernels import INTERPRETED
    if not INTERPRETED:
        pytest.skip("a CPU engine on the Triton kernels needs the interpreter")
    prompts = random_prompts(2, seed=4, max_len=12)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain, _ = _run(hybrid, prompts, params)
    oracle = Oracle({tuple(p): o.token_ids for p, o in zip(prompts, plain)})
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    got, eng = _run(hybrid, prompts, params, proposer=oracle, speculative_method="ngram",
                    num_speculative_tokens=3)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert eng.spec.stats.num_accepted_tokens > 0
