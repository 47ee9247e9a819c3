"""N-gram (prompt-lookup) draft proposer.

For each request, find the longest suffix of its token history (length between
``min_n`` and ``max_n``) that also occurs earlier in the same history, take the
most recent earlier occurrence, and propose the (up to ``k``) tokens that
followed it. Among equally long matches the most recent one wins. If the
continuation after the chosen occurrence is shorter than ``k`` (the occurrence
sits near the end of the history), only the tokens that exist are proposed.

The search runs in one numba-compiled function over a flat batched layout so a
single call serves the whole batch.

Tree mode (``tree_budget`` > 0, ``spec.tree``): every earlier occurrence of the
suffix offers its continuation (longest suffixes first, then the most recent
occurrence first, at most ``_TREE_MATCHES`` per suffix length); the continuations
are merged into a trie of at most ``tree_budget`` nodes and ``k`` levels, in that
order of preference, so different continuations of a repeated phrase are
verified in one target forward. numpy over each request's history: O(history x
max_n) per request and step.
"""
from __future__ import annotations

import numpy as np

try:
    import numba
    _jit = numba.njit(cache=False, nogil=True)
except ImportError:  # an image without numba runs the same code interpreted (slower, same result)
    def _jit(fn):
        return fn

from luceio.spec.proposer import Proposal, ProposalInput, Proposer
from luceio.spec.tree import MAX_ROWS, DraftTree

_TREE_MATCHES = 8


@_jit
def _ngram_kernel(tokens, offsets, ks, min_n, max_n, out, counts):
    """Fill ``out[r, :counts[r]]`` with the proposal for request ``r``.

    tokens: int64[total], all histories concatenated.
    offsets: int64[num_reqs + 1], history r is tokens[offsets[r]:offsets[r+1]].
    ks: int64[num_reqs], max drafts per request (<= out.shape[1]).
    out: int64[num_reqs, k_max], pre-filled with -1 by the caller.
    counts: int64[num_reqs], written here.

    One backwards scan per request: for every candidate end position ``e`` of
    an earlier occurrence (most recent first) measure how many trailing tokens
    match the suffix, capped at ``max_n``; keep the first (most recent)
    position reaching the best length, stop as soon as ``max_n`` is reached.
    Most positions cost a single comparison.
    """
    num_reqs = ks.shape[0]
    for r in range(num_reqs):
        counts[r] = 0
        start = offsets[r]
        end = offsets[r + 1]
        length = end - start
        k = ks[r]
        if k <= 0 or length < min_n + 1:
            continue
        last = end - 1
        best_len = 0
        best_e = -1
        # e: index (relative to start) of the last token of a candidate earlier
        # occurrence; it must leave at least one following token, so e <= length-2.
        for e in range(length - 2, min_n - 2, -1):
            cap = max_n
            if e + 1 < cap:
                cap = e + 1
            n = 0
            while n < cap and tokens[start + e - n] == tokens[last - n]:
                n += 1
            if n > best_len:
                best_len = n
                best_e = e
                if n == max_n:
                    break
        if best_len < min_n:
            continue
        avail = length - 1 - best_e
        m = k if k < avail else avail
        src = start + best_e + 1
        for j in range(m):
            out[r, j] = tokens[src + j]
        counts[r] = m


def ngram_propose_flat(
    tokens: np.ndarray,
    offsets: np.ndarray,
    ks: np.ndarray,
    min_n: int = 1,
    max_n: int = 4,
) -> tuple[np.ndarray, np.ndarray]:
    """Batched n-gram lookup over a flat layout.

    tokens: 1-D int array, the histories of all requests concatenated.
    offsets: 1-D int array of length num_reqs + 1 (offsets[0] == 0, non-decreasing).
    ks: 1-D int array of length num_reqs, max drafts per request (0 allowed).

    Returns ``(drafts, counts)``: ``drafts`` is int64[num_reqs, max(ks)] padded
    with -1; request r's proposal is ``drafts[r, :counts[r]]``.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    ks = np.ascontiguousarray(ks, dtype=np.int64)
    num_reqs = ks.shape[0]
    if offsets.shape[0] != num_reqs + 1:
        raise ValueError("offsets must have num_reqs + 1 entries")
    k_max = int(ks.max()) if num_reqs else 0
    k_max = max(k_max, 0)
    out = np.full((num_reqs, k_max), -1, dtype=np.int64)
    counts = np.zeros(num_reqs, dtype=np.int64)
    if num_reqs:
        _ngram_kernel(tokens, offsets, np.maximum(ks, 0), int(min_n), int(max_n), out, counts)
    return out, counts


class NgramProposer(Proposer):
    """Prompt-lookup proposer (deterministic; use ``draft_probs=None`` when verifying)."""

    def __init__(self, min_n: int = 1, max_n: int = 4, tree_budget: int = 0):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if not 0 <= tree_budget < MAX_ROWS:
            raise ValueError(f"the tree budget is 0 (chains) to {MAX_ROWS - 1} nodes, got "
                             f"{tree_budget}")
        self.min_n = min_n
        self.max_n = max_n
        self.tree_budget = tree_budget

    def propose(self, requests: list[ProposalInput]) -> Proposal:
        if not requests:
            return Proposal([])
        if self.tree_budget and all(r.tree for r in requests):
            trees = [self.tree(np.asarray(r.tokens, dtype=np.int64).reshape(-1), r.k)
                     for r in requests]
            return Proposal([t.tokens for t in trees], trees=trees)
        arrays = [np.asarray(r.tokens, dtype=np.int64).reshape(-1) for r in requests]
        lens = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        tokens = np.concatenate(arrays) if offsets[-1] else np.zeros(0, dtype=np.int64)
        ks = np.fromiter((r.k for r in requests), dtype=np.int64, count=len(requests))
        out, counts = ngram_propose_flat(tokens, offsets, ks, self.min_n, self.max_n)
        return Proposal([out[i, : counts[i]].tolist() for i in range(len(requests))])

    def tree(self, tokens: np.ndarray, depth: int) -> DraftTree:
        """The trie of the continuations of every earlier occurrence of the history's suffix
        (see the module docstring), at most `depth` levels and `tree_budget` nodes."""
        nodes: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        toks: list[int] = []
        parents: list[int] = []
        length = tokens.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            if depth <= 0 or len(toks) >= self.tree_budget:
                break
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
            starts = np.flatnonzero((windows == tokens[length - n:]).all(1))[::-1]
            for i in starts[:_TREE_MATCHES]:
                parent = -1
                for t in tokens[i + n:i + n + depth].tolist():
                    node = nodes.get((parent, t))
                    if node is None:
                        if len(toks) >= self.tree_budget:
                            break
                        node = nodes[(parent, t)] = len(toks)
                        toks.append(t)
                        parents.append(parent)
                    parent = node
        return DraftTree(toks, parents)

    def warmup(self) -> None:
        """Compile the numba kernel now instead of on the first real step."""
        self.propose([ProposalInput(tokens=[1, 2, 1], k=1)])
