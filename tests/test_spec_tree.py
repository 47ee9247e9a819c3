"""Draft trees (luceio.spec.tree): layout facts, greedy acceptance, and that sampling acceptance
leaves the target's distribution unchanged (chi-square, with negative controls that the same
test catches)."""
from __future__ import annotations

import pytest
import torch

from luceio.spec.tree import MAX_ROWS, DraftTree, accept, masks_tensor

V = 6
ALPHA = 1e-4
N = 30_000
# root -> 2 -> {5, 1 -> 3}; root -> 4 -> 0   (rows: root 0, then nodes 1..6)
TREE = DraftTree(tokens=[2, 4, 5, 1, 0, 3], parents=[-1, -1, 0, 0, 1, 3])


def _dists(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    soft = torch.softmax(torch.randn(rows, V, generator=g, dtype=torch.float64) * 1.5, -1)
    return (0.7 * soft + 0.3 / V).float()


def _chi2_pvalue(samples, probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.as_tensor(samples, dtype=torch.long), minlength=V).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    assert expected.min() >= 5, "too few samples for a chi-square test"
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((V - 1) / 2, dtype=torch.float64), stat / 2))


def test_layout():
    assert TREE.depths() == [1, 1, 2, 2, 2, 3]
    assert TREE.children() == [[1, 2], [3, 4], [5], [], [6], [], []]
    m = TREE.ancestor_masks()
    assert m[0] == 0b1 and m[1] == 0b11 and m[2] == 0b101
    assert m[4] == 0b10011 and m[6] == 0b1010011  # row 6 (token 3): root, 2, 1, itself
    chain = DraftTree.chain([7, 8, 9])
    assert chain.parents == [-1, 0, 1] and chain.depths() == [1, 2, 3]
    assert chain.ancestor_masks() == [0b1, 0b11, 0b111, 0b1111]  # causal
    assert masks_tensor([1 << 63, 5]).tolist() == [-(1 << 63), 5]


@pytest.mark.parametrize("tokens,parents,match", [
    ([1, 2], [-1], "parents"), ([1, 2], [1, -1], "precede"), ([1, 1], [-1, -1], "repeats"),
    (list(range(MAX_ROWS)), [-1] * MAX_ROWS, "at most")])
def test_bad_trees_are_refused(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        DraftTree(tokens, parents)


def _logits_with_argmax(best: list[int]) -> torch.Tensor:
    out = torch.zeros(len(best), V)
    out[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return out


def test_greedy_takes_the_matching_branch():
    # root predicts 4 (row 2), row 2 predicts 0 (row 5), row 5 predicts 3: leaf -> bonus 3
    rows, toks = accept(TREE, _logits_with_argmax([4, 1, 0, 1, 1, 3, 1]), greedy=True)
    assert rows == [2, 5] and toks == [4, 0, 3]
    # root predicts 2, row 1 predicts 1 (row 4), row 4 predicts 2: no child 2 -> stop
    rows, toks = accept(TREE, _logits_with_argmax([2, 1, 0, 0, 2, 0, 0]), greedy=True)
    assert rows == [1, 4] and toks == [2, 1, 2]
    rows, toks = accept(TREE, _logits_with_argmax([3, 0, 0, 0, 0, 0, 0]), greedy=True)
    assert rows == [] and toks == [3]  # nothing under the root matches


def test_greedy_chain_equals_chain_verification():
    chain = DraftTree.chain([1, 2, 3])
    rows, toks = accept(chain, _logits_with_argmax([1, 2, 5, 0]), greedy=True)
    assert rows == [1, 2] and toks == [1, 2, 5]


def _sample_paths(target, generator, n=N):
    return [accept(TREE, target, greedy=False, generator=generator)[1] for _ in range(n)]


def test_sampling_keeps_the_target_distribution():
    """The first token is distributed as the root's p; the second, given a first token that was a
    node, as that node's p (here p of row 1 given 2, of row 2 given 4)."""
    g = torch.Generator().manual_seed(0)
    p = _dists(1, TREE.num_nodes + 1)
    outs = _sample_paths(p, g)
    assert _chi2_pvalue([o[0] for o in outs], p[0]) > ALPHA
    assert _chi2_pvalue([o[1] for o in outs if o[0] == 2], p[1]) > ALPHA
    assert _chi2_pvalue([o[1] for o in outs if o[0] == 4], p[2]) > ALPHA
    # every accepted path emits one token past its accepted nodes, and follows the tree
    for o in outs[:2000]:
        assert 1 <= len(o) <= 4


def test_a_point_mass_child_is_always_accepted():
    p = torch.zeros(TREE.num_nodes + 1, V)
    p[:, 1] = 1.0
    p[0] = torch.nn.functional.one_hot(torch.tensor(4), V).float()  # root: all on token 4
    p[2] = torch.nn.functional.one_hot(torch.tensor(0), V).float()  # row 2: all on 0
    rows, toks = accept(TREE, p, greedy=False, generator=torch.Generator().manual_seed(0))
    assert rows == [2, 5] and toks == [4, 0, 1]


def test_negative_controls_are_caught():
    """The same chi-square test rejects two wrong acceptance rules."""
    g = torch.Generator().manual_seed(1)
    p = _dists(2, TREE.num_nodes + 1)
    kids = [TREE.tokens[c - 1] for c in TREE.children()[0]]
    firsts_wrong_a, firsts_wrong_b = [], []
    for _ in range(N):
        # (a) accept a child with p(t) but on rejection resample from the full p
        t = next((k for k in kids if float(torch.rand((), generator=g)) < float(p[0, k])), None)
        firsts_wrong_a.append(t if t is not None else int(torch.multinomial(p[0], 1, generator=g)))
        # (b) accept the first child with probability 1/2, whatever p says
        firsts_wrong_b.append(kids[0] if float(torch.rand((), generator=g)) < 0.5
                              else int(torch.multinomial(p[0], 1, generator=g)))
    assert _chi2_pvalue(firsts_wrong_a, p[0]) < ALPHA
    assert _chi2_pvalue(firsts_wrong_b, p[0]) < ALPHA
