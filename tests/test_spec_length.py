"""How many tokens a request drafts (`luceio.spec.length`, `SpecDecoder.k_for`, `plan`): k from the
request's own conditional acceptance and the measured cost of a draft token
(`CostModel.draft_token_cost`)."""
import pytest
import torch

from luceio import SamplingParams
from luceio.request import Request
from luceio.spec import SpecDecoder
from luceio.spec.length import DraftLength, best_k


def _req(rid: str = "r") -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=100), eos_token_ids=set(),
                max_model_len=256)
    r.num_computed_tokens = r.num_tokens - 1  # decoding: its latest token not yet computed
    return r


def test_best_k_weighs_expected_tokens_against_draft_cost():
    # E(k) / (1 + d k) by hand: a = 0.5, d = 0.1: k=1 1.364, k=2 1.458, k=3 1.442
    assert best_k(0.5, 4, 0.1) == 2
    # a = 0.3: k=1 1.3/1.1 = 1.182 beats k=2 1.39/1.2 = 1.158
    assert best_k(0.3, 4, 0.1) == 1
    # a = 0.855: k=4 3.746/1.4 = 2.68 beats k=3 3.211/1.3 = 2.47: the cap
    assert best_k(0.855, 4, 0.1) == 4
    # a draft model's cost (0.35 a draft) at a = 0.78: k=2 2.389/1.7 = 1.405 beats k=1
    # 1.78/1.35 = 1.319 and k=3 2.864/2.05 = 1.397
    assert best_k(0.78, 8, 0.35) == 2
    assert best_k(0.78, 8, 0.02) == 8


def test_a_short_verify_does_not_cut_k_of_a_request_that_accepts_most():
    """Session 35's rule (k = ceil(moving average of accepted) + 1) drafted 3 after four full
    verifies and one rejected at its first draft; the request's acceptance stays above 0.8."""
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    r = _req()
    assert spec.k_for(r, 4) == 4  # nothing verified yet: the cap
    for accepted in (4, 4, 4, 4, 0):
        spec._record(r, 4, accepted)
    assert spec._length["r"].acceptance > 0.8
    assert spec.k_for(r, 4) == 4
    for _ in range(4):
        spec._record(r, 4, 0)  # five misses in a row: now it shortens
    assert spec.k_for(r, 4) < 4


def test_k_follows_each_requests_own_acceptance():
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    good, poor = _req("good"), _req("poor")
    for _ in range(6):
        spec._record(good, 4, 4)
        spec._record(poor, 2, 1)  # accepted the first, rejected the second: a = 0.5
    assert spec.k_for(good, 4) == 4
    assert spec.k_for(poor, 4) == 2  # best_k(0.5, 4, 0.1), the unmeasured draft cost


def test_a_request_whose_drafts_fail_goes_idle_and_probes_back():
    length = DraftLength(0.5, probe_every=8)
    for _ in range(4):
        length.record(4, 0)
    assert length.acceptance < 0.2
    ks = [length.k(4, 0.1) for _ in range(16)]
    assert ks == [0] * 7 + [1] + [0] * 7 + [1]
    length.record(1, 1)  # the probe's draft was accepted: it drafts again
    assert length.k(4, 0.1) >= 1


def test_draft_token_cost_is_the_slope_of_step_cost_over_drafts():
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    assert spec.draft_token_cost(1) == pytest.approx(0.1)  # unmeasured: the prior
    spec.observe(1, drafted=False, num_tokens=1, seconds=0.010)
    for _ in range(5):
        for k in (1, 2, 3, 4):  # a step costs 1.3 + 0.05 k plain steps
            spec.observe(1, drafted=True, num_tokens=2, seconds=0.010 * (1.3 + 0.05 * k),
                         drafting=1, drafts=k)
    assert spec.draft_token_cost(1) == pytest.approx(0.05, rel=1e-6)


def test_draft_token_cost_without_spread_in_k_is_an_upper_bound():
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    spec.observe(4, drafted=False, num_tokens=4, seconds=0.010)
    for _ in range(5):  # batch 4, one request drafting 4: the step costs 1.2 plain steps
        spec.observe(4, drafted=True, num_tokens=5, seconds=0.012, drafting=1, drafts=4)
    # 0.2 of a plain step is 0.8 of the drafting request's share (a quarter), over 4 drafts
    assert spec.draft_token_cost(4) == pytest.approx(0.2, rel=1e-6)
    assert spec.draft_token_cost(1) == pytest.approx(0.1)  # another bucket: unmeasured


def test_plan_drafts_fewer_where_drafts_cost_more():
    """`plan` looks up the draft cost of its batch's bucket: a cheap one drafts the cap, a dear
    one (a draft model's forwards) fewer at the same acceptance."""
    ks = {}
    for label, extra in (("cheap", 0.02), ("dear", 0.4)):
        spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
        spec.observe(1, drafted=False, num_tokens=1, seconds=0.010)
        for _ in range(5):
            for k in (1, 2, 3, 4):
                spec.observe(1, drafted=True, num_tokens=3, seconds=0.010 * (1.1 + extra * k),
                             drafting=1, drafts=k)
        r = _req()
        for _ in range(6):
            spec._record(r, 4, 3)  # a = 0.75
        spec._step = 16 * 3  # a step the cost model does not reserve for a probe
        reqs, k, _ = spec.plan([r])
        assert reqs == [r]
        ks[label] = k[0]
    assert ks == {"cheap": 4, "dear": 2}


def _tree_verify(spec: SpecDecoder, r: Request, tree, argmax: list[int]) -> list[int]:
    """`spec.verify` of one greedy request's draft tree against target rows whose argmax is
    `argmax[row]`; returns the emitted tokens."""
    from luceio.sampler import Sampler
    from luceio.scheduler.scheduler import ScheduledRequest

    spec.sampler = Sampler()
    logits = torch.full((tree.num_nodes + 1, 16), -10.0)
    logits[torch.arange(tree.num_nodes + 1), torch.tensor(argmax)] = 10.0
    s = ScheduledRequest(r, tree.num_nodes + 1, spec_tree=tree)
    tokens, _, _ = spec.verify(logits, {r.request_id: slice(0, tree.num_nodes + 1)}, [s])
    return tokens[r.request_id]


def test_a_tree_walk_ending_on_a_leaf_counts_no_rejection():
    """A tree of two levels (two children of the root, one grandchild under the first): when
    the walk takes the first child and then its child, it reached a leaf and nothing was
    rejected, though a sibling went unused; the request's acceptance reads as a chain's whose
    every draft was accepted, not 2 of 3 tried."""
    from luceio.spec.tree import DraftTree

    tree = DraftTree(tokens=[5, 6, 7], parents=[-1, -1, 0])  # rows: 1 = 5, 2 = 6, 3 = 7 under 1
    full, cut = SpecDecoder("ngram", 4, proposer=None, sampler=None), \
        SpecDecoder("ngram", 4, proposer=None, sampler=None)
    a, b = _req("a"), _req("b")
    for _ in range(6):
        # rows' argmax: root -> 5 (row 1), row 1 -> 7 (row 3), row 3 -> 9 (the bonus token)
        assert _tree_verify(full, a, tree, [5, 7, 0, 9]) == [5, 7, 9]
        # the second level rejected: root -> 5, row 1 -> 8 (not its child 7)
        assert _tree_verify(cut, b, tree, [5, 8, 0, 0]) == [5, 8]
    assert full._length["a"].acceptance > 0.9  # 12 of 12 tried (and the prior's 0.5 of 1)
    assert cut._length["b"].acceptance == pytest.approx(0.5, abs=0.05)  # 1 of 2 a verify
