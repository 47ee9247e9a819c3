"""Draft trees: several candidate continuations of a request verified in one target forward.

A tree hangs under the request's last committed token (the root). Its nodes are kept in
topological order (a parent before its children), so a verify step lays them out as rows
0 (the root), 1..N (the nodes) of the request's query tokens, each node at position
`root position + depth`, and the attention of row r sees the committed context plus the rows of
its ancestors and itself: `ancestor_masks()`, one bit per row (at most 64 rows), the form the
varlen attention kernels take (`kernels.paged_attention(tree_mask=...)`).

Acceptance (`accept`) walks from the root. At each accepted row the target's distribution p for
the next token is checked against that row's children in order:
- greedy: the child whose token is the target's argmax, if any;
- sampling: each child token t is accepted with probability p(t); when it is not, p loses t
  (p(t) = 0, renormalised) and the next child is tried; when no child is accepted, the token is
  drawn from what is left of p. The children are point masses (a deterministic top-k expansion,
  or the n-gram proposer's branches), and for point masses this is exactly sampling from p:
  P(t1) = p(t1), P(t2) = (1 - p(t1)) p(t2) / (1 - p(t1)) = p(t2), ..., the rest p(x) likewise
  (SpecInfer's multi-candidate rejection with deterministic candidates). So a tree never changes
  the output distribution, only how many tokens one target forward yields.
The walk ends at a row none of whose children is accepted; the token drawn there (the
recovered token, or the bonus token after a leaf) ends the step's output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_ROWS = 64  # root + nodes: one int64 attention-mask word per row


@dataclass
class DraftTree:
    """tokens[i] is node i's token, parents[i] its parent node (-1: the root); parents precede
    their children (parents[i] < i)."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        if len(self.tokens) + 1 > MAX_ROWS:
            raise ValueError(f"a draft tree has at most {MAX_ROWS - 1} nodes, got {len(self.tokens)}")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}'s parent {p} does not precede it")
        seen = set()
        for i, (p, t) in enumerate(zip(self.parents, self.tokens)):
            if (p, t) in seen:
                raise ValueError(f"node {i} repeats token {t} under the same parent")
            seen.add((p, t))

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        """k drafts in a line: what chain speculation verifies."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node (the root's children: 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def children(self) -> list[list[int]]:
        """Row -> its children's rows, in node order (row 0: the root; node i is row i + 1)."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i + 1)
        return out

    def ancestor_masks(self) -> list[int]:
        """Per row (root first), a bitmask of the rows it attends to among the tree's rows: its
        ancestors, the root and itself."""
        masks = [1]
        for i, p in enumerate(self.parents):
            masks.append(masks[p + 1] | (1 << (i + 1)))
        return masks

    def path_tokens(self, rows: list[int]) -> list[int]:
        return [self.tokens[r - 1] for r in rows]

    def truncated(self, n: int) -> "DraftTree":
        """The first n nodes (a subtree: parents come first)."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    def first_path(self) -> "DraftTree":
        """The chain from the root down its first children: what a consumer that walks drafts
        in a line (grammar masks) can take."""
        kids, rows, cur = self.children(), [], 0
        while kids[cur]:
            cur = kids[cur][0]
            rows.append(cur)
        return DraftTree.chain(self.path_tokens(rows))


def masks_tensor(masks: list[int], device=None) -> torch.Tensor:
    """Python bitmasks (< 2^64) as an int64 tensor, bit 63 wrapping to the sign bit."""
    return torch.tensor([m - (1 << 64) if m >= 1 << 63 else m for m in masks], dtype=torch.int64,
                        device=device)


def accept(tree: DraftTree, target: torch.Tensor, greedy: bool,
           generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """Walks the tree against the target's rows. `target` [num_nodes + 1, vocab]: per row (root
    first), logits when greedy, else the probabilities of the next token. Returns (the accepted
    rows from the root's child down, the tokens the step emits: the accepted nodes' tokens and
    the final drawn token)."""
    kids = tree.children()
    dev = generator.device if generator is not None else torch.device("cpu")
    rows: list[int] = []
    cur = 0
    while True:
        if greedy:
            best = int(torch.argmax(target[cur]))
            nxt = next((c for c in kids[cur] if tree.tokens[c - 1] == best), None)
            if nxt is None:
                return rows, tree.path_tokens(rows) + [best]
        else:
            p = target[cur].double().to(dev).clone()  # rejected children are zeroed in it
            nxt = None
            for c in kids[cur]:
                t = tree.tokens[c - 1]
                # accept with probability p(t) / (what is left of p); a child holding all that
                # is left is always accepted (u < 1), so p keeps some mass past this loop
                u = float(torch.rand((), generator=generator, dtype=torch.float64, device=dev))
                if u * float(p.sum()) < float(p[t]):
                    nxt = c
                    break
                p[t] = 0.0
            if nxt is None:
                t = int(torch.multinomial(p / p.sum(), 1, generator=generator))
                return rows, tree.path_tokens(rows) + [t]
        rows.append(nxt)
        cur = nxt
