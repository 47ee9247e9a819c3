"""Unit tests for the speculative-decoding building blocks:
n-gram proposer (luceio.spec.ngram) and rejection sampler (luceio.spec.rejection)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from luceio.spec.ngram import NgramProposer, ngram_propose_flat
from luceio.spec.proposer import ProposalInput, Proposer
from luceio.spec.rejection import rejection_sample, rejection_sample_batch

P = ProposalInput

# Every chi-square check below rejects when its p-value < ALPHA, i.e. a false
# alarm rate of 1e-4 per check for a correct sampler (seeds are fixed, so CI is
# deterministic anyway).
ALPHA = 1e-4


# --------------------------------------------------------------------------
# n-gram proposer
# --------------------------------------------------------------------------


def _ngram_reference(tokens, k, min_n, max_n):
    """Straightforward reference: longest n first, most recent earlier occurrence."""
    tokens = list(tokens)
    L = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        for i in range(L - n - 1, -1, -1):  # occurrence tokens[i:i+n], i+n <= L-1
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_ngram_is_a_proposer():
    assert isinstance(NgramProposer(), Proposer)
    from luceio.spec.draft import DraftModelProposer
    assert issubclass(DraftModelProposer, Proposer)  # one interface for both proposers
    with pytest.raises(ValueError):
        NgramProposer(min_n=0)
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_ngram_longest_match_wins():
    # suffix "3" occurs most recently at index 5 (followed by 11), but the
    # longer suffix "1 2 3" occurs at 0..2 (followed by 10, 5, 3).
    toks = [1, 2, 3, 10, 5, 3, 11, 1, 2, 3]
    assert NgramProposer(1, 4).propose([P(toks, 3)]).drafts == [[10, 5, 3]]
    # with max_n=1 only the last token is matched: most recent "3" -> 11, 1, 2
    assert NgramProposer(1, 1).propose([P(toks, 3)]).drafts == [[11, 1, 2]]


def test_ngram_most_recent_occurrence():
    # "7 8" occurs at 0 (-> 1) and at 3 (-> 2): most recent wins
    toks = np.array([7, 8, 1, 7, 8, 2, 9, 7, 8], dtype=np.int64)
    assert NgramProposer().propose([P(toks, 2)]).drafts == [[2, 9]]


def test_ngram_truncated_continuation_and_overlap():
    # continuation after the match is only 3 tokens long though k=5
    assert NgramProposer().propose([P([5, 6, 7, 5, 6], 5)]).drafts == [[7, 5, 6]]
    # overlapping occurrence in a run of one token: "7 7 7" at 0..2 -> [7]
    assert NgramProposer().propose([P([7, 7, 7, 7], 3)]).drafts == [[7]]


def test_ngram_no_match_short_history_and_k0():
    prop = NgramProposer(1, 4)
    assert prop.propose([P([1, 2, 3, 4], 3)]).drafts == [[]]  # no repeat
    assert prop.propose([P([1], 3)]).drafts == [[]]  # history too short
    assert prop.propose([P([], 3)]).drafts == [[]]  # empty history
    assert prop.propose([P([1, 2, 1, 2], 0)]).drafts == [[]]  # k = 0
    assert prop.propose([]).drafts == []
    # min_n=2: only the last token repeats ("3"), no 2-gram match
    assert NgramProposer(2, 4).propose([P([3, 9, 1, 3], 2)]).drafts == [[]]
    assert NgramProposer(1, 4).propose([P([3, 9, 1, 3], 2)]).drafts == [[9, 1]]


def test_ngram_batch_different_k():
    reqs = [
        P([1, 2, 3, 4, 1, 2, 3, 9, 9, 1, 2, 3], 3),  # "1 2 3" most recent at 4 -> 9 9 1
        P([5, 6, 7, 5, 6], 5),  # truncated -> 7 5 6
        P([1, 2, 3], 2),  # no match
        P([4, 4], 0),  # k = 0
        P(np.array([8, 1, 8], dtype=np.int32), 1),  # other dtype -> 1
        P([2, 5, 2, 5, 2], 4),  # "2 5 2" at 0..2 -> 5 2
    ]
    expected = [[9, 9, 1], [7, 5, 6], [], [], [1], [5, 2]]
    assert NgramProposer().propose(reqs).drafts == expected


def test_ngram_flat_layout():
    tokens = np.array([1, 2, 1, 5, 6, 7, 5, 6, 3], dtype=np.int64)
    offsets = np.array([0, 3, 8, 9])
    ks = np.array([2, 4, 1])
    out, counts = ngram_propose_flat(tokens, offsets, ks, 1, 4)
    assert out.shape == (3, 4) and out.dtype == np.int64
    assert counts.tolist() == [2, 3, 0]
    assert out.tolist() == [[2, 1, -1, -1], [7, 5, 6, -1], [-1, -1, -1, -1]]
    out, counts = ngram_propose_flat(np.zeros(0), np.array([0]), np.zeros(0), 1, 4)
    assert out.shape == (0, 0) and counts.shape == (0,)


def test_ngram_matches_reference_on_random_histories():
    rng = np.random.default_rng(1234)
    for min_n, max_n in [(1, 4), (2, 3), (1, 1), (3, 5)]:
        prop = NgramProposer(min_n, max_n)
        reqs = []
        for _ in range(300):
            L = int(rng.integers(0, 40))
            vocab = int(rng.integers(2, 6))
            reqs.append(P(rng.integers(0, vocab, L), int(rng.integers(0, 7))))
        got = prop.propose(reqs).drafts
        want = [_ngram_reference(r.tokens.tolist(), r.k, min_n, max_n) for r in reqs]
        assert got == want


# --------------------------------------------------------------------------
# rejection sampler: greedy
# --------------------------------------------------------------------------

# argmax per row: 1, 0, 2, 3
_GP = torch.tensor(
    [
        [0.1, 0.6, 0.2, 0.1],
        [0.5, 0.2, 0.2, 0.1],
        [0.1, 0.2, 0.6, 0.1],
        [0.1, 0.1, 0.1, 0.7],
    ]
)


def test_greedy_all_accepted_plus_bonus():
    assert rejection_sample(_GP, [1, 0, 2], None, True, None) == [1, 0, 2, 3]


def test_greedy_first_rejected():
    assert rejection_sample(_GP, [3, 0, 2], None, True, None) == [1]


def test_greedy_middle_rejection():
    assert rejection_sample(_GP, [1, 1, 2], None, True, None) == [1, 0]
    assert rejection_sample(_GP, [1, 0, 0], None, True, None) == [1, 0, 2]


def test_greedy_k0_logits_and_draft_probs_ignored():
    assert rejection_sample(_GP[:1], [], None, True, None) == [1]
    logits = torch.log(_GP) - 3.0  # negative scores; argmax unchanged
    logits[0, 3] = float("-inf")
    assert rejection_sample(logits, [1, 0, 1], None, True, None) == [1, 0, 2]
    q = torch.full((3, 4), 0.25)
    assert rejection_sample(_GP, [1, 0, 2], q, True, None) == [1, 0, 2, 3]


def test_batch_mixed_greedy_and_sampled():
    # request 0: greedy, request 1: sampled with a point-mass target (always
    # accepted), request 2: greedy k=0.
    onehot = torch.eye(4)
    target = torch.cat([_GP, onehot[[2, 1, 0]], _GP[3:]])
    out = rejection_sample_batch(
        target, [[1, 1, 2], [2, 1], []], None, [True, False, True],
        [None, torch.Generator().manual_seed(0), None],
    )
    assert out == [[1, 0], [2, 1, 0], [3]]


def test_shape_validation():
    with pytest.raises(ValueError):
        rejection_sample(_GP, [1, 0], None, True, None)
    with pytest.raises(ValueError):
        rejection_sample(_GP, [1, 0, 2], torch.ones(2, 4), False, None)


# --------------------------------------------------------------------------
# rejection sampler: sampling is lossless (statistical tests)
# --------------------------------------------------------------------------

V, K = 6, 3


def _dists(seed: int, rows: int) -> torch.Tensor:
    """Random distributions with every entry >= 0.3 / V (keeps chi-square cells large)."""
    g = torch.Generator().manual_seed(seed)
    soft = torch.softmax(torch.randn(rows, V, generator=g, dtype=torch.float64) * 1.5, -1)
    return (0.7 * soft + 0.3 / V).float()


def _chi2_pvalue(samples, probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.as_tensor(samples, dtype=torch.long), minlength=V).double()
    n = counts.sum()
    expected = probs.double() / probs.double().sum() * n
    assert expected.min() >= 5, "too few samples for a chi-square test"
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((V - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def _position_pvalues(outs, p: torch.Tensor) -> list[float]:
    """For each position j: token j among outputs that reached j (all earlier
    drafts accepted) must be distributed as p_j."""
    pvals = []
    for j in range(K + 1):
        toks = [o[j] for o in outs if len(o) > j]
        pvals.append(_chi2_pvalue(toks, p[j]))
    return pvals


def _run_batch(p, q, drafts, draft_probs_given: bool):
    n = drafts.shape[0]
    target = p.repeat(n, 1)  # [n*(K+1), V]
    dp = q.repeat(n, 1) if draft_probs_given else None  # [n*K, V]
    return rejection_sample_batch(target, drafts.tolist(), dp, False, None)


def _check_structure(outs, drafts):
    for o, d in zip(outs, drafts.tolist()):
        assert 1 <= len(o) <= K + 1
        assert o[:-1] == d[: len(o) - 1]


N_TRIALS = 40_000
_NGRAM_DRAFT_DIST = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])


def test_speculative_sampling_matches_target_with_draft_probs():
    torch.manual_seed(0)
    p = _dists(1, K + 1)
    q = _dists(2, K)
    drafts = torch.stack(
        [torch.multinomial(q[j], N_TRIALS, replacement=True) for j in range(K)], 1
    )
    outs = _run_batch(p, q, drafts, True)
    _check_structure(outs, drafts)
    pvals = _position_pvalues(outs, p)
    assert min(pvals) > ALPHA, pvals
    # the drafts are not perfect, so some get rejected and some accepted
    lens = np.array([len(o) for o in outs])
    assert (lens == 1).any() and (lens == K + 1).any()


def test_speculative_sampling_matches_target_ngram_point_mass():
    torch.manual_seed(1)
    p = _dists(3, K + 1)
    # deterministic proposer: q is a point mass at the draft, whatever produced it.
    # Drafts are skewed on purpose: with uniform drafts the marginal would hide
    # a sampler that forgets to zero the draft in the residual.
    drafts = torch.multinomial(_NGRAM_DRAFT_DIST, N_TRIALS * K, replacement=True).view(N_TRIALS, K)
    outs = _run_batch(p, None, drafts, False)
    _check_structure(outs, drafts)
    pvals = _position_pvalues(outs, p)
    assert min(pvals) > ALPHA, pvals


def test_single_request_path_with_generator_matches_target():
    # the per-request generator path (seeded requests), one call per trial
    g = torch.Generator().manual_seed(7)
    p = _dists(4, K + 1)
    q = _dists(5, K)
    outs = []
    for _ in range(3000):
        d = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(K)]
        outs.append(rejection_sample(p, d, q, False, g))
    assert _chi2_pvalue([o[0] for o in outs], p[0]) > ALPHA
    outs = []
    for t in range(3000):
        outs.append(rejection_sample(p, [t % V, (t // V) % V, 2], None, False, g))
    assert _chi2_pvalue([o[0] for o in outs], p[0]) > ALPHA


def test_negative_controls_are_detected():
    """The chi-square check must catch wrong samplers at the same sample size."""
    g = torch.Generator().manual_seed(11)
    p = _dists(1, K + 1)
    q = _dists(2, K)
    n = N_TRIALS
    d0 = torch.multinomial(q[0], n, replacement=True, generator=g)
    # (a) always accept the draft: first token ~ q_0
    assert _chi2_pvalue(d0, p[0]) < ALPHA
    # (b) correct acceptance test but resample from p (not the residual) on rejection
    u = torch.rand(n, generator=g)
    acc = u * q[0][d0] < p[0][d0]
    resampled = torch.multinomial(p[0], n, replacement=True, generator=g)
    wrong = torch.where(acc, d0, resampled)
    assert _chi2_pvalue(wrong, p[0]) < ALPHA
    # (c) n-gram mode: on rejection sample from p without zeroing the draft
    #     (skewed drafts, as in the lossless n-gram test)
    d = torch.multinomial(_NGRAM_DRAFT_DIST, n, replacement=True, generator=g)
    acc_ng = torch.rand(n, generator=g) < p[0][d]
    wrong = torch.where(acc_ng, d, torch.multinomial(p[0], n, replacement=True, generator=g))
    assert _chi2_pvalue(wrong, p[0]) < ALPHA
    # sanity: the same hand-rolled construction done right passes
    residual = (p[0] - q[0]).clamp(min=0)
    right = torch.where(acc, d0, torch.multinomial(residual, n, replacement=True, generator=g))
    assert _chi2_pvalue(right, p[0]) > ALPHA


# --------------------------------------------------------------------------
# rejection sampler: determinism and numerical guards
# --------------------------------------------------------------------------


def test_seeded_determinism():
    p = _dists(6, K + 1)
    q = _dists(7, K)
    drafts = [[0, 1, 2], [3, 3, 3], [5, 4, 1], [2, 2, 0]] * 10

    def run(seed, dp):
        g = torch.Generator().manual_seed(seed)
        return [rejection_sample(p, d, dp, False, g) for d in drafts]

    for dp in (q, None):
        assert run(123, dp) == run(123, dp)
        assert run(123, dp) != run(124, dp)


def test_seeded_batch_equals_single_calls():
    p = _dists(8, K + 1)
    q = _dists(9, K)
    drafts = [[0, 1, 2], [3, 3, 3], [5, 4, 1]]
    seeds = [10, 20, 30]
    for dp in (q, None):
        single = [
            rejection_sample(p, d, dp, False, torch.Generator().manual_seed(s))
            for d, s in zip(drafts, seeds)
        ]
        batch = rejection_sample_batch(
            p.repeat(3, 1),
            drafts,
            None if dp is None else dp.repeat(3, 1),
            False,
            [torch.Generator().manual_seed(s) for s in seeds],
        )
        assert batch == single


def test_numerical_guards():
    g = torch.Generator().manual_seed(0)
    # q(d) = 0 with p(d) > 0: ratio is infinite -> always accepted
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    for _ in range(20):
        assert rejection_sample(p, [0], q, False, g)[0] == 0
    # q(d) = 0 and p(d) = 0: always rejected; residual = p - q clamped
    q2 = torch.tensor([[0.0, 0.0, 1.0]])
    p2 = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    for _ in range(20):
        out = rejection_sample(p2, [2], q2, False, g)
        assert len(out) == 1 and out[0] in (0, 1)
    # residual all zero (p <= q everywhere, unnormalised q): falls back to p
    p3 = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    q3 = torch.tensor([[0.6, 0.6]])
    seen = set()
    for _ in range(200):
        out = rejection_sample(p3, [0], q3, False, g)
        assert 1 <= len(out) <= 2 and all(t in (0, 1) for t in out)
        seen.add(len(out))
    assert seen == {1, 2}
    # point-mass target equal to the n-gram draft: always accepted
    onehot = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_sample(onehot, [1], None, False, g) == [1, 2]
    # n-gram draft the target forbids: always rejected, recovered from p
    for _ in range(20):
        assert rejection_sample(onehot, [0], None, False, g) == [1]
    # unnormalised p whose only mass is on the draft: rejection falls back to p
    p4 = torch.tensor([[0.9, 0.0, 0.0], [0.0, 0.0, 1.0]])
    for _ in range(50):
        out = rejection_sample(p4, [0], None, False, g)
        assert out in ([0], [0, 2])
