"""Catching a draft model up with new prompts (`SpecDecoder._catch_up`): a request whose draft
cache is cold drafts only where the catch-up's measured cost is below what drafting saves over
the tokens it has left; and a drafting way's worth counts only the requests that drafted."""
import pytest

from conftest import engine_kwargs, plain_and_self_draft
from luceio import LLM, SamplingParams
from luceio.request import Request
from luceio.spec import SpecDecoder


class Cold:
    """A proposer stand-in: tokens each request's state lacks."""

    def __init__(self, behind: dict[str, int]):
        self.behind = behind

    def uncached(self, request_id: str, num_tokens: int, tokens=None) -> int:
        return self.behind[request_id]


def requests(max_tokens: dict[str, int]) -> list[Request]:
    return [Request(rid, list(range(3, 13)), SamplingParams(max_tokens=m), eos_token_ids=set(),
                    max_model_len=4096) for rid, m in max_tokens.items()]


def test_unmeasured_catch_up_is_one_prompt_a_step():
    spec = SpecDecoder("draft", 4, Cold({"a": 500, "b": 500, "w": 0, "c": 500}), sampler=None)
    reqs = requests({"a": 100, "b": 100, "w": 100, "c": 100})
    picked = spec._catch_up([(r, 4) for r in reqs], 16, "chain", 2)
    assert [r.request_id for r, _ in picked] == ["a", "w"]  # the first cold one and the warm
    # a few tokens behind each (after plain steps): cold ones join until 64 are due
    spec.proposer = Cold({f"r{i}": 20 for i in range(5)})
    reqs = requests({f"r{i}": 100 for i in range(5)})
    picked = spec._catch_up([(r, 4) for r in reqs], 16, "chain", 2)
    assert [r.request_id for r, _ in picked] == ["r0", "r1", "r2", "r3"]
    # within k_max + 2 tokens a request is warm: it always drafts
    spec.proposer = Cold({"x": 6, "y": 6})
    assert len(spec._catch_up([(r, 4) for r in requests({"x": 9, "y": 9})], 16, "chain", 2)) == 2


def test_measured_catch_up_joins_where_it_pays():
    spec = SpecDecoder("draft", 4, Cold({"short": 500, "long": 500, "small": 200}), sampler=None)
    spec._feed_cost = 0.001  # s a fed token
    spec.observe(16, drafted=False, num_tokens=16, seconds=0.3)  # a plain step: 0.3 s
    reqs = requests({"short": 33, "long": 1001, "small": 33})
    # unmeasured drafting saves half a plain step's share a token: 32 tokens left save 0.3 s
    picked = spec._catch_up([(r, 4) for r in reqs], 16, "chain", 2)
    assert [r.request_id for r, _ in picked] == ["long", "small"]  # 0.5 s > 0.3 s; 0.2 < 0.3
    # drafting measured not to pay at this batch size: no cold request catches up
    spec.observe(16, drafted=True, num_tokens=16, seconds=0.6)
    picked = spec._catch_up([(r, 4) for r in reqs], 16, "chain", 2)
    assert picked == []


def test_a_probe_catches_up_as_an_unmeasured_way_does():
    """Plain steps leave a draft model's cache behind, so once drafting is measured not to pay
    every request is cold by the next probe: judged by that stale measurement, no probe would
    ever draft again and the way would stay off for good."""
    spec = SpecDecoder("draft", 4, Cold({"short": 500, "long": 500}), sampler=None)
    spec._feed_cost = 0.001
    spec.observe(16, drafted=False, num_tokens=16, seconds=0.3)
    spec.observe(16, drafted=True, num_tokens=16, seconds=0.6)  # drafting lost: worth 0.5
    reqs = requests({"short": 33, "long": 1001})
    probe = next(s for s in range(1, 64) if spec.mode(16, s) == "chain")
    assert probe % 16 == 8 and spec.mode(16, probe - 1) is None  # the probe, between plain steps
    spec._step = probe - 1
    assert spec._catch_up([(r, 4) for r in reqs], 16, "chain", 2) == []  # not a probe step
    spec._step = probe
    picked = spec._catch_up([(r, 4) for r in reqs], 16, "chain", 2)
    assert [r.request_id for r, _ in picked] == ["long"]  # as unmeasured: 0.5 s > 0.3 s fed


def test_worth_counts_only_the_requests_that_drafted():
    spec = SpecDecoder("draft", 4, None, sampler=None)
    spec.observe(16, drafted=False, num_tokens=16, seconds=0.30)
    spec.observe(16, drafted=True, num_tokens=16 + 16 * 2, seconds=0.36)  # all drafted
    full = spec._worth(16, "chain", 2)
    assert full == pytest.approx(spec.expected_tokens(2) / 1.2)
    spec2 = SpecDecoder("draft", 4, None, sampler=None)
    spec2.observe(16, drafted=False, num_tokens=16, seconds=0.30)
    spec2.observe(16, drafted=True, num_tokens=18, seconds=0.36, drafting=1)  # one of 16
    one = spec2._worth(16, "chain", 2)
    assert one == pytest.approx((1 + (spec2.expected_tokens(2) - 1) / 16) / 1.2)
    assert one < 1 < full


def test_draft_model_reports_its_catch_up_and_output_stays_plain(tiny_llama):
    prompt = [(5 * i) % 300 + 3 for i in range(120)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain, llm = plain_and_self_draft(tiny_llama, prompt, params)
    spec = llm.engine.spec
    assert spec.proposer.uncached("new", 120) == 119  # nothing read yet
    assert spec._feed_cost is None
    out = llm.generate([{"prompt_token_ids": prompt}], params)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert spec.stats.num_draft_tokens > 0
    assert spec._feed_cost is not None and spec._feed_cost > 0  # 119 prompt tokens fed at once


def test_a_drafting_step_that_caught_up_is_not_drafting_cost():
    """The step whose proposal fed a prompt to the draft model is a one-off: not recorded as
    what drafting costs (it made drafting look 10x dearer and switched it off at batch 1)."""
    from types import SimpleNamespace as NS
    spec = SpecDecoder("draft", 4, None, sampler=None)
    sched = [NS(spec_token_ids=[1, 2], spec_tree=None), NS(spec_token_ids=[3], spec_tree=None)]
    batch = NS(sched=NS(scheduled=sched), decode_only=True)
    result = NS(overlapped=False, sampled={"a": [1, 2, 3], "b": [4, 5]}, seconds=0.5)
    spec._fed_last = 120  # as `draft` leaves it after feeding a 120-token prompt
    spec.observe_step(batch, result, overlap=False)
    assert (2, "chain") not in spec._cost and spec._fed_last == 0
    result.seconds = 0.05
    spec.observe_step(batch, result, overlap=False)  # a drafting step that fed nothing
    assert spec._cost[(2, "chain")] == 0.05


def test_draft_model_drafting_resumes_after_a_losing_stretch(tiny_llama):
    """End to end: step costs are set (drafting steps 10x a plain step while `slow`, 1x after),
    so the cost model switches a draft model off and its cache falls behind during the plain
    steps; once drafting pays again, the next probe catches the cache up and drafting resumes."""
    llm = LLM(tiny_llama, **engine_kwargs(speculative_method="draft", draft_model=tiny_llama,
                                          num_speculative_tokens=3))
    eng, spec = llm.engine, llm.engine.spec
    slow = {"on": True}
    observe, note_feed = spec.observe, spec._note_feed

    def set_cost(batch_size, drafted, num_tokens, seconds, **kw):
        observe(batch_size, drafted, num_tokens, 0.01 if drafted and slow["on"] else 0.001, **kw)

    def set_feed(fed, seconds, num_drafts):
        note_feed(fed, seconds, num_drafts)
        if spec._feed_cost is not None:
            spec._feed_cost = 1e-5  # s a fed token: the catch-up is cheap here

    spec.observe, spec._note_feed = set_cost, set_feed
    prompt = [(7 * i) % 300 + 3 for i in range(100)]  # fed at once: the feed cost is measured
    eng.add_request("r", prompt, SamplingParams(max_tokens=380, temperature=0.0, ignore_eos=True))
    for _ in range(60):
        eng.step()
        if spec._losses.get((1, "chain")):
            break
    assert spec._losses.get((1, "chain")) == 1  # a drafting step measured a loss: drafting off
    assert spec._feed_cost == 1e-5
    slow["on"] = False
    drafts = spec.stats.num_drafts
    for _ in range(16):
        eng.step()
    assert spec.stats.num_drafts == drafts  # backed off: plain steps, the draft's cache behind
    assert spec.proposer.uncached("r", eng.scheduler.running[0].num_tokens) > spec.k_max + 2
    for _ in range(64):
        eng.step()
    assert spec.stats.num_drafts > drafts + 8  # a probe caught up, then drafting every step
