"""A draft model's best-first tree built on the device: levels 2.. of `DraftModelProposer`'s
EAGLE-2 tree with no host read between them, one CUDA graph replay per level on GPUs.

The host path (`DraftModelProposer.propose_trees`) reads each level's top-k back to pick the
next frontier and feeds the whole tree so far to every level's forward, so each level costs a
many-row draft forward plus a round trip (8 levels on the H200: ~26 ms). Here the tree's shape
is fixed in advance, which is what makes the levels launchable back to back: with K = `topk`,
level 1 is the K most probable children of the root, and every level d >= 2 adds the K most
probable children of each of the K nodes of level d - 1 with the most probable paths (the
frontier; K * K nodes). So node row r (rows 1..: level by level, each level's children grouped
by frontier node) always sits at depth `depth[r]`; only its token, parent and path score
depend on the draft's output, and those are written on the device:
- level 1 (eagerly, from the catch-up step's root logits): the root's top K, path score =
  their log-probabilities; all K are the frontier;
- level d: one draft forward over the K frontier nodes of level d - 1 only (K rows a request,
  the decode-sized path), at position root + d - 1 and cache entries root + 1 + (d - 2) K ..
  (fed row j: cache entry root + 1 + j). Only frontier nodes get children, so a node's
  ancestors were all fed before it, and its mask word holds their fed rows' bits and its own:
  the attention's `tree_span` ((d - 1) K keys) makes the words cover every fed row, not only
  this step's. Then the log-softmax's top K of each frontier row; the children's path scores
  are the parents' plus theirs, and the next frontier is the K best of them (a stable sort:
  ties go to the lower row, as the host path's sort does).
The host reads the rows once, after the last level, and keeps the `tree_budget` nodes of
highest path score (`DraftModelProposer._best`). Path scores are sums of float32
log-probabilities where the host path multiplies probabilities; both order paths alike except
within rounding of a tie, and either way the tree only decides speed: acceptance keeps the
target's output (greedy: plain decoding's tokens).

Rules:
- Greedy drafting only (`chain.plain_argmax`: the draft's distribution is the softmax of its
  raw logits), batches of at most 4 requests, draft models whose attention takes a tree span
  (`LlamaForCausalLM.tree_span`: no sliding windows, no recurrent state); the rest take the
  host path.
- One graph per (batch bucket, level): all levels of a step share the static inputs, which
  the host fills once (block tables, each fed row's KV slot, root positions and lengths). A
  padded request writes no KV (slot -1) and its rows are never read.
- On the CPU (or with --enforce-eager) the same body runs eagerly with no padding: still no
  host read until the end.
"""
from __future__ import annotations

import numpy as np
import torch

from ..cuda_graphs import capture_in_pool, gc_paused
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
        self.K = K = topk
        self.levels = L = tree_levels(max_levels, topk)
        most = runner.graphs.max_seqs if runner.graphs is not None else _BUCKETS[-1]
        self.buckets = [b for b in _BUCKETS if b <= most] or [1]
        # the first row of each level's nodes, and all rows of a tree of L levels (+ the root)
        self.level_row = {d: 1 + K + (d - 2) * K * K for d in range(2, L + 1)}
        self.rows = 1 + K + max(L - 1, 0) * K * K
        self.depth = [0] + [1] * K + [d for d in range(2, L + 1) for _ in range(K * K)]
        n, dev = _BUCKETS[-1], self.device
        i64 = dict(dtype=torch.long, device=dev)
        # fed row j's bit (the last level's frontier is never fed: its bits are placeholders)
        self.bits = masks_tensor([1 << min(j, 63) for j in range(L * K)], dev)
        self.tok = torch.zeros(n, self.rows, **i64)  # per request: the nodes' tokens by row
        self.par = torch.zeros(n, self.rows, **i64)  # parent row (0: the root)
        self.score = torch.zeros(n, self.rows, dtype=torch.float32, device=dev)
        self.front = torch.zeros(n, K, **i64)  # the frontier's rows
        self.front_score = torch.zeros(n, K, dtype=torch.float32, device=dev)
        self.front_tok = torch.zeros(n, K, **i64)
        self.front_word = torch.zeros(n, K, **i64)  # its mask word when it is fed
        self.slot = torch.full((n, max(L - 1, 1) * K), -1, **i64)  # KV slot of each fed row
        self.root_pos = torch.zeros(n, **i64)
        self.base_len = torch.zeros(n, dtype=torch.int32, device=dev)  # cache length before the root
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=dev) * K
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def fed_rows(self, levels: int) -> int:
        """Cache entries from the root on that a tree of `levels` levels writes."""
        return 1 + max(levels - 1, 0) * self.K

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    @torch.inference_mode()
    def capture(self) -> None:
        """A graph per (bucket, level), in the draft runner's graph pool (GPU only)."""
        with gc_paused():
            for b in reversed(self.buckets):
                for d in range(self.levels, 1, -1):
                    self.slot[:b].fill_(-1)
                    self.base_len[:b].fill_(0)
                    self.graphs[b, d] = capture_in_pool(
                        self.runner.graphs, self.device, lambda: self._level(b, d))
        torch.cuda.synchronize(self.device)

    def _first(self, bs: int, root_logits: torch.Tensor) -> None:
        """Level 1: the root's K most probable children (rows 1..K), all of them the frontier
        (fed rows 0..K-1, their parent the root, cached before the tree's span)."""
        K = self.K
        top = torch.topk(torch.log_softmax(root_logits.float(), -1), K, dim=-1)
        self.tok[:bs, 1:1 + K] = top.indices
        self.par[:bs, 1:1 + K] = 0
        self.score[:bs, 1:1 + K] = top.values
        self.front[:bs] = torch.arange(1, 1 + K, device=self.device)
        self.front_score[:bs] = top.values
        self.front_tok[:bs] = top.indices
        self.front_word[:bs] = self.bits[:K]

    def _level(self, bs: int, d: int, max_seq: int | None = None) -> None:
        """Level d over requests [:bs]: a draft forward over the K frontier nodes of level
        d - 1, then the K best children of each as rows [level_row[d], + K^2) and the next
        frontier. `max_seq`: the longest cache length before the root, where the host knows it
        (eagerly; a graph takes the static bound, the context)."""
        K, first, span = self.K, self.level_row[d], (d - 1) * self.K
        pos = (self.root_pos[:bs] + (d - 1)).repeat_interleave(K)  # contiguous (kernels index it)
        torch.add(self.base_len[:bs], 1 + span, out=self.lens[:bs])
        meta = AttnMetadata(self.slot[:bs, span - K:span].reshape(-1), self.tables[:bs],
                            self.lens[:bs], self.qsl[:bs + 1], K,
                            self.max_model_len if max_seq is None else max_seq + 1 + span,
                            self.front_word[:bs].reshape(-1), tree_span=span)
        hidden = self.model(self.front_tok[:bs].reshape(-1), pos, self.kv_caches, meta)
        logp = torch.log_softmax(self.model.compute_logits(hidden).float(), -1)
        top = torch.topk(logp, K, dim=-1)  # [bs * K, K]: the children of each frontier node
        toks = top.indices.view(bs, K * K)
        scores = (self.front_score[:bs, :, None] + top.values.view(bs, K, K)).view(bs, K * K)
        new = slice(first, first + K * K)
        self.tok[:bs, new] = toks
        self.par[:bs, new] = self.front[:bs].repeat_interleave(K, dim=1)
        self.score[:bs, new] = scores
        best = torch.sort(scores, dim=1, descending=True, stable=True)
        pick = best.indices[:, :K]
        word = torch.gather(self.front_word[:bs], 1, pick // K) | self.bits[span:span + K]
        self.front_word[:bs] = word
        self.front_tok[:bs] = torch.gather(toks, 1, pick)
        self.front[:bs] = pick + first
        self.front_score[:bs] = best.values[:, :K]

    def run(self, root_logits: torch.Tensor, seqs, levels: int, kv) -> tuple[list, list, list]:
        """Builds the trees of `levels` levels under `seqs` (each holds its context up to and
        including the root, and cache room for `fed_rows(levels)` entries from the root on),
        from the root's logits [n, vocab]. Returns per request the nodes' (tokens, parent
        rows, path scores), rows 1.., read in one transfer."""
        self.launch(root_logits, seqs, levels, kv)
        return self.read(len(seqs), levels)

    def launch(self, root_logits: torch.Tensor, seqs, levels: int, kv) -> None:
        """`run` up to the read: queues every level, reads nothing back."""
        n = len(seqs)
        graphed = self.device.type == "cuda" and self.runner.graphs is not None
        bs = self.bucket(n) if graphed else n
        fed = self.fed_rows(levels) - 1  # entries past the root
        bsz = self.block_size
        root_pos = np.zeros(bs, np.int64)
        base = np.zeros(bs, np.int64)
        slots = np.full((bs, self.slot.shape[1]), -1, np.int64)
        attn = [kv.attention_table(s.request_id) for s in seqs]
        # only the columns in use (the kernels read a table only as far as its length)
        tables = np.zeros((bs, max([len(t) for t, _ in attn], default=1) or 1), np.int64)
        for i, s in enumerate(seqs):
            table, skipped = attn[i]
            root = len(s.all_token_ids) - 1
            root_pos[i], base[i] = root, root - skipped
            idx = root + 1 - skipped + np.arange(fed)
            slots[i, :fed] = np.asarray(table, np.int64)[idx // bsz] * bsz + idx % bsz
            tables[i, :len(table)] = table
        p, b_, sl, t = self.runner.staging.to_device(np.int64, [root_pos, base, slots, tables])
        self.root_pos[:bs].copy_(p)
        self.base_len[:bs].copy_(b_)
        self.slot[:bs].copy_(sl.view(bs, -1))
        self.tables[:bs, :tables.shape[1]].copy_(t.view(bs, -1))
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
