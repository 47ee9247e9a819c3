"""A draft model's best-first tree built on the device: levels 2.. of `DraftModelProposer`'s
EAGLE-2 tree with no host read between them, one CUDA graph replay per level on GPUs.

The host path (`DraftModelProposer.propose_trees`) reads each level's top-k back to pick the
next frontier, so every level costs a draft forward plus a round trip (8 levels on the H200:
~27 ms for trees whose forwards take a few). Here the tree's shape is fixed in advance, which
is what makes the levels launchable back to back: with K = `topk`, level 1 is the K most
probable children of the root, and every level d >= 2 adds the K most probable children of
each of the K nodes of level d - 1 with the most probable paths (K * K nodes). So row r of a
request's tree (row 0: the root, then the nodes level by level, each level's children grouped
by frontier node) always sits at depth `depth[r]`, cache index root + r and position
root + depth[r]; only its token, its parent and its ancestor mask depend on the draft's
output, and those are written on the device:
- level 1 (eagerly, from the catch-up step's root logits): the root's top K, path score =
  their log-probabilities;
- level d: one draft forward over rows [0, R_d) (the root and levels 1..d-1, each row
  attending to the context, its ancestors and itself through the tree mask), the logits of
  the frontier's K rows, their log-softmax's top K; the children's path scores are the
  parents' plus theirs, their mask words the parent's plus their own bit, and the next
  frontier is the K best of them (a stable sort: ties go to the lower row, as the host
  path's sort does).
The host reads the rows once, after the last level, and keeps the `tree_budget` nodes of
highest path score (`DraftModelProposer._best`). Path scores are sums of float32
log-probabilities where the host path multiplies probabilities; both order paths alike except
within rounding of a tie, and either way the tree only decides speed: acceptance keeps the
target's output (greedy: plain decoding's tokens).

Rules:
- Greedy drafting only (`chain.plain_argmax`: the draft's distribution is the softmax of its
  raw logits); sampled requests take the host path.
- One graph per (batch bucket, level): all levels of a step share the static inputs, which
  the host fills once (block tables, each row's KV slot, root positions and lengths). A
  padded request writes no KV (slot -1) and its rows are never read.
- On the CPU (or with --enforce-eager) the same body runs eagerly with no padding: still no
  host read until the end.
"""
from __future__ import annotations

import gc

import numpy as np
import torch

from ..models import AttnMetadata
from .tree import MAX_ROWS, masks_tensor

_BUCKETS = (1, 2, 4)  # trees pay at small batches; larger ones take the host path


def tree_levels(k: int, topk: int) -> int:
    """Levels of a device tree asked for k levels: at most k, and the rows of all its nodes
    (K + (levels - 1) K^2, plus the root) within `MAX_ROWS`."""
    levels = 0
    while levels < k and 1 + topk + levels * topk * topk <= MAX_ROWS:
        levels += 1
    return levels


class DraftTreeGraph:
    def __init__(self, runner, topk: int, max_levels: int):
        self.runner, self.model, self.kv_caches = runner, runner.model, runner.kv_caches
        self.device, self.block_size = runner.device, runner.block_size
        self.max_model_len = runner.max_model_len
        self.max_blocks = -(-self.max_model_len // self.block_size)
        self.K = topk
        self.levels = tree_levels(max_levels, topk)
        most = runner.graphs.max_seqs if runner.graphs is not None else _BUCKETS[-1]
        self.buckets = [b for b in _BUCKETS if b <= most] or [1]
        K, dev = topk, self.device
        # rows fed by level d's forward (root + levels 1..d-1); all rows of a tree of L levels
        self.rows_fed = {d: 1 + K + (d - 2) * K * K for d in range(2, self.levels + 1)}
        self.rows = 1 + K + max(self.levels - 1, 0) * K * K
        depth = [0] + [1] * K + [d for d in range(2, self.levels + 1) for _ in range(K * K)]
        n = _BUCKETS[-1]
        i64 = dict(dtype=torch.long, device=dev)
        self.depth = torch.tensor(depth, **i64)
        self.bits = masks_tensor([1 << r for r in range(self.rows)], dev)
        self.tok = torch.zeros(n, self.rows, **i64)  # per request: row tokens
        self.par = torch.full((n, self.rows), -1, **i64)  # parent row (the root's: -1)
        self.score = torch.zeros(n, self.rows, dtype=torch.float32, device=dev)
        self.words = torch.full((n, self.rows), -1, **i64)
        self.front = torch.zeros(n, K, **i64)  # the frontier's rows
        self.front_score = torch.zeros(n, K, dtype=torch.float32, device=dev)
        self.root_logits = None  # [n, vocab] fp32, allocated at the first run / capture
        self.slot = torch.full((n, self.rows), -1, **i64)  # KV slot of each row
        self.root_pos = torch.zeros(n, **i64)
        self.base_len = torch.zeros(n, dtype=torch.int32, device=dev)  # cache length before the root
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.qsl_d = {d: self.qsl * r for d, r in self.rows_fed.items()}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    @torch.inference_mode()
    def capture(self) -> None:
        """A graph per (bucket, level), in the draft runner's graph pool (GPU only)."""
        graphs = self.runner.graphs
        enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            for b in reversed(self.buckets):
                for d in range(self.levels, 1, -1):
                    self.slot[:b].fill_(-1)
                    self.base_len[:b].fill_(0)
                    self.front[:b].copy_(torch.arange(1, self.K + 1, device=self.device))
                    self._level(b, d)  # warm-up
                    torch.cuda.synchronize(self.device)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=graphs.pool):
                        self._level(b, d)
                    if graphs.pool is None:
                        graphs.pool = g.pool()
                    self.graphs[b, d] = g
        finally:
            if enabled:
                gc.enable()
        torch.cuda.synchronize(self.device)

    def _first(self, bs: int, root_logits: torch.Tensor) -> None:
        """Level 1: the root's K most probable children (rows 1..K)."""
        K = self.K
        top = torch.topk(torch.log_softmax(root_logits.float(), -1), K, dim=-1)
        self.tok[:bs, 1:1 + K] = top.indices
        self.par[:bs, 1:1 + K] = 0
        self.score[:bs, 0] = 0.0
        self.score[:bs, 1:1 + K] = top.values
        self.words[:bs, 0] = 1
        self.words[:bs, 1:1 + K] = self.bits[1:1 + K] | 1
        self.front[:bs] = torch.arange(1, 1 + K, device=self.device)
        self.front_score[:bs] = top.values

    def _level(self, bs: int, d: int, max_seq: int | None = None) -> None:
        """Level d over requests [:bs]: a draft forward over rows [0, R_d), then the K best
        children of each frontier row as rows [R_d, R_d + K^2) and the next frontier.
        `max_seq`: the longest sequence's length before the root, where the host knows it
        (eagerly; a graph takes the static bound, the context)."""
        K, R = self.K, self.rows_fed[d]
        ids = self.tok[:bs, :R].reshape(-1)
        pos = (self.root_pos[:bs, None] + self.depth[None, :R]).reshape(-1)
        torch.add(self.base_len[:bs], R, out=self.lens[:bs])
        meta = AttnMetadata(self.slot[:bs, :R].reshape(-1), self.tables[:bs], self.lens[:bs],
                            self.qsl_d[d][:bs + 1], R,
                            self.max_model_len if max_seq is None else max_seq + R,
                            self.words[:bs, :R].reshape(-1))
        hidden = self.model(ids, pos, self.kv_caches, meta)
        flat = (self.front[:bs] + (torch.arange(bs, device=self.device) * R)[:, None]).reshape(-1)
        logp = torch.log_softmax(self.model.compute_logits(hidden[flat]).float(), -1)
        top = torch.topk(logp, K, dim=-1)  # [bs * K, K]
        new = slice(R, R + K * K)
        self.tok[:bs, new] = top.indices.view(bs, K * K)
        self.par[:bs, new] = self.front[:bs].repeat_interleave(K, dim=1)
        scores = (self.front_score[:bs, :, None] + top.values.view(bs, K, K)).view(bs, K * K)
        self.score[:bs, new] = scores
        self.words[:bs, new] = torch.gather(self.words[:bs], 1, self.front[:bs]) \
            .repeat_interleave(K, dim=1) | self.bits[new]
        best = torch.sort(scores, dim=1, descending=True, stable=True)
        self.front[:bs] = best.indices[:, :K] + R
        self.front_score[:bs] = best.values[:, :K]

    def run(self, root_logits: torch.Tensor, seqs, levels: int, kv) -> tuple[list, list, list]:
        """Builds the trees of `levels` levels under `seqs` (each holds its context up to and
        including the root, and cache room for the `rows_fed[levels]` rows from the root),
        from the root's logits [n, vocab]. Returns per request the rows' (tokens, parent rows,
        path scores), rows 1.. (the nodes), read in one transfer."""
        self.launch(root_logits, seqs, levels, kv)
        return self.read(len(seqs), levels)

    def launch(self, root_logits: torch.Tensor, seqs, levels: int, kv) -> None:
        """`run` up to the read: queues every level, reads nothing back."""
        n = len(seqs)
        graphed = self.device.type == "cuda" and self.runner.graphs is not None
        bs = self.bucket(n) if graphed else n
        fed = self.rows_fed.get(levels, 1)
        bsz = self.block_size
        root_pos = np.zeros(bs, np.int64)
        base = np.zeros(bs, np.int64)
        slots = np.full((bs, self.rows), -1, np.int64)
        tables = np.zeros((bs, self.max_blocks), np.int64)
        for i, s in enumerate(seqs):
            table, skipped = kv.attention_table(s.request_id)
            root = len(s.all_token_ids) - 1
            root_pos[i], base[i] = root, root - skipped
            idx = root - skipped + np.arange(fed)
            slots[i, :fed] = np.asarray(table, np.int64)[idx // bsz] * bsz + idx % bsz
            tables[i, :len(table)] = table
        roots = np.zeros(bs, np.int64)
        roots[:n] = [s.all_token_ids[-1] for s in seqs]
        p, b_, sl, t, r = self.runner.staging.to_device(np.int64, [root_pos, base, slots, tables,
                                                                   roots])
        self.root_pos[:bs].copy_(p)
        self.base_len[:bs].copy_(b_)
        self.slot[:bs].copy_(sl.view(bs, self.rows))
        self.tables[:bs].copy_(t.view(bs, self.max_blocks))
        self.tok[:bs, 0].copy_(r)
        logits = root_logits
        if bs > n:
            logits = torch.cat([root_logits, root_logits[:1].expand(bs - n, -1)])
        self._first(bs, logits)
        for d in range(2, levels + 1):
            if graphed:
                self.graphs[bs, d].replay()
            else:
                self._level(bs, d, int(base.max()))

    def read(self, n: int, levels: int) -> tuple[list, list, list]:
        last = 1 + self.K + (levels - 1) * self.K * self.K
        ints = torch.stack([self.tok[:n, 1:last], self.par[:n, 1:last]]).cpu()
        scores = self.score[:n, 1:last].cpu()
        return ints[0].tolist(), ints[1].tolist(), scores.tolist()
