"""CUDA graphs for decode and speculative-verify steps.

A graph is captured per (batch-size bucket, tokens per request q): q = 1 for plain decode and
q = k + 1 for verifying k drafts. Captures share one memory pool, largest batch first. A step
replays the smallest bucket that fits, each request padded to q tokens and the batch padded
to the bucket: a padded token writes no KV (slot -1) and sits after the request's real tokens
(its sequence length grows by the padding), so causal attention keeps real tokens blind to it;
a padded request attends to its own first q positions. Attention inside a graph sees
`max_seq_len` = the model's context, a static bound; kernels read the real lengths from
`seq_lens`. Steps that do not fit (prefill chunks, bigger batches, more drafts) run eagerly.
Tree speculation (`spec.tree`) has graphs of its own, captured with a static per-row attention
mask (`words`): a tree of N nodes is padded to the `tree_rows` rows of the budget, the padding
rows attending causally (-1) and no real row seeing them.
Hybrid models (Qwen3.5) replay decode graphs with a static buffer of state slots: a padded
request reads and writes the state pool's scratch row (`scratch_slot`, one past the slots
requests take).
Buckets of at most `LOGITS_ROWS` padded rows also compute the logits of every row inside the
graph (the step then gathers the rows it needs): at batch 1 the lm_head's launches from Python
were ~10% of the host's step time (bench/results/h200/host_variance.json). Larger buckets
compute the logits of the needed rows only, after the replay. Works on ROCm through the same
`torch.cuda` API."""
from __future__ import annotations

import contextlib
import gc

import numpy as np
import torch

from .models import AttnMetadata

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
_MAX_VERIFY_BATCH = 32  # the speculative planner drafts nothing for larger batches
LOGITS_ROWS = 16  # the skinny GEMM's rows: logits of padded rows cost little bandwidth there


@contextlib.contextmanager
def gc_paused():
    """The garbage collector off while graphs are captured: a collection during a capture
    that frees an earlier engine's tensors (reference cycles) can make CUDA calls that
    invalidate the capture (seen once on the H200: "operation failed due to a previous error
    during capture", building a second engine after `del` of the first)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_in_pool(owner, device, body) -> torch.cuda.CUDAGraph:
    """`body()` once eagerly (it compiles the kernels), then captured into a graph in
    `owner.pool`, the memory pool the runner's graphs share (made by the first capture)."""
    body()
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=owner.pool):
        body()
    if owner.pool is None:
        owner.pool = g.pool()
    return g


class StepGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, max_spec_tokens: int = 0, staging=None,
                 capture_queries: bool = False, tree_rows: int = 0,
                 scratch_slot: int | None = None):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.max_model_len, self.block_size = max_model_len, block_size
        buckets = [b for b in _BUCKETS if b <= max_num_seqs] or [1]
        # (tokens per request, tree) -> batch buckets
        self.buckets: dict[tuple[int, bool], list[int]] = {(1, False): buckets}
        for k in range(1, max_spec_tokens + 1):
            self.buckets[k + 1, False] = [b for b in buckets if b <= _MAX_VERIFY_BATCH]
        if tree_rows > 1:
            self.buckets[tree_rows, True] = [b for b in buckets if b <= _MAX_VERIFY_BATCH]
        self.max_blocks = -(-max_model_len // block_size)
        self.max_seqs = buckets[-1]
        rows = max(q * b[-1] for (q, _), b in self.buckets.items())
        i32 = dict(dtype=torch.int32, device=device)
        self.tok = torch.zeros(3, rows, dtype=torch.long, device=device)  # ids, positions, slots
        self.tables = torch.zeros(self.max_seqs, self.max_blocks, **i32)
        self.lens = torch.zeros(self.max_seqs, **i32)
        self.words = torch.full((rows,), -1, dtype=torch.long, device=device)  # tree masks
        # hybrid models: each request's state slot (padding: the scratch slot)
        self.scratch_slot = scratch_slot
        self.slots = torch.full((self.max_seqs,), scratch_slot, dtype=torch.long,
                                device=device) if scratch_slot is not None else None
        self.qsl = {q: torch.arange(self.max_seqs + 1, **i32) * q for q, _ in self.buckets}
        # keyed by (batch bucket, tokens per request, tree)
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, bool], torch.Tensor] = {}
        self.logits: dict[tuple[int, int, bool], torch.Tensor] = {}  # fp32 [bs * q, vocab]
        self.pool = None
        self.staging = staging
        # bounded residency (keys policy): every replay also leaves each layer's rotated
        # queries in q_buf [num_layers, rows, num_heads, head_dim], for block scoring
        self.q_buf = None
        if capture_queries:
            cfg = model.cfg
            self.q_buf = torch.zeros(cfg.num_layers, rows, cfg.num_heads, cfg.head_dim,
                                     dtype=kv_caches[0].dtype, device=device)

    def _inputs(self, bs: int, q: int, tree: bool):
        n = bs * q
        meta = AttnMetadata(self.tok[2, :n], self.tables[:bs], self.lens[:bs], self.qsl[q][:bs + 1],
                            q, self.max_model_len, tree_mask=self.words[:n] if tree else None,
                            state_slots=self.slots[:bs] if self.slots is not None else None)
        return self.tok[0, :n], self.tok[1, :n], meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket (the garbage collector off meanwhile: `gc_paused`)."""
        with gc_paused():
            self._capture_all()

    def _capture_all(self) -> None:
        empty = np.zeros(0, np.int64)
        for (q, tree), buckets in sorted(self.buckets.items(),
                                         key=lambda kv: -kv[0][0] * kv[1][-1]):
            for bs in reversed(buckets):
                self._fill(*self._pad(empty, empty, empty, np.zeros((0, 1), np.int32),
                                      np.zeros(0, np.int32), np.zeros(0, np.int64), bs, q))
                self.words.fill_(-1)
                ids, pos, meta = self._inputs(bs, q, tree)
                warm = self.model(ids, pos, self.kv_caches, meta)  # warm-up compiles the kernels
                if bs * q <= LOGITS_ROWS:
                    self.model.compute_logits(warm)
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                key = (bs, q, tree)
                with torch.cuda.graph(g, pool=self.pool):
                    self.outputs[key] = self.model(ids, pos, self.kv_caches, meta,
                                                   probe=self._capture_probe(bs * q))
                    if bs * q <= LOGITS_ROWS:
                        self.logits[key] = self.model.compute_logits(self.outputs[key])
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[key] = g
        torch.cuda.synchronize(self.device)

    def _bucket(self, h) -> tuple[int, int, bool] | None:
        """(batch bucket, tokens per request, tree) of the graph that runs host batch `h`."""
        q_lens = h.q_lens
        q = int(q_lens.max())
        tree = h.tree_mask is not None
        if tree:  # the tree graphs' rows, whatever the tree's size
            q = next((rows for rows, t in self.buckets if t and rows >= q), 0)
        if (q, tree) not in self.buckets or len(q_lens) > self.buckets[q, tree][-1]:
            return None
        if int((h.seq_lens + (q - q_lens)).max()) > self.max_model_len:
            return None
        return next(b for b in self.buckets[q, tree] if b >= len(q_lens)), q, tree

    def _capture_probe(self, n: int):
        if self.q_buf is None:
            return None
        layer = iter(range(self.q_buf.shape[0]))

        def probe(q, k_cache, meta, scale):  # runs once, while capturing: the copy is recorded
            self.q_buf[next(layer), :n].copy_(q)
        return probe

    def queries(self, h, token_row: int) -> torch.Tensor:
        """[num_layers, num_heads, head_dim]: the queries of the last replay's token at flat
        row `token_row` of host batch `h` (rows are padded to q per request in a graph)."""
        _, q, _ = self._bucket(h)
        r = int(np.searchsorted(h.query_start_loc, token_row, side="right")) - 1
        return self.q_buf[:, r * q + token_row - int(h.query_start_loc[r])]

    def fits(self, h) -> bool:
        return bool(self.graphs) and self._bucket(h) is not None

    def _pad(self, ids, pos, slots, bt, seq_lens, q_lens, bs: int, q: int):
        """Host arrays padded to q tokens per request and bs requests: (tokens [3, bs*q],
        block tables [bs, the batch's widest table], seq lens [bs]). Only the columns the
        batch uses are staged (`_fill`): the kernels read a request's table only as far as its
        length, so the static table's columns past them may keep an earlier step's ids. With
        a 32K context the full width was 16 KB of int64 a request a step."""
        n = len(seq_lens)
        tok = np.zeros((3, bs, q), dtype=np.int64)
        tok[1] = np.arange(q)[None, :]  # padded requests: positions 0..q-1
        tok[2] = -1  # padding writes no KV
        tables = np.zeros((bs, max(bt.shape[1], 1)), dtype=np.int64)
        lens = np.full(bs, q, dtype=np.int64)
        if n and q == 1 and len(ids) == n:  # one token a request (decode): no scatter
            tok[:, :n, 0] = ids, pos, slots
            tables[:n, :bt.shape[1]] = bt
            lens[:n] = seq_lens
        elif n:
            r = np.repeat(np.arange(n), q_lens)
            j = np.arange(len(ids)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
            first = (seq_lens - q_lens).astype(np.int64)  # position of each request's first query
            tok[1, :n] = first[:, None] + np.arange(q)[None, :]  # padding continues after the real
            tok[0, r, j], tok[1, r, j], tok[2, r, j] = ids, pos, slots
            tables[:n, :bt.shape[1]] = bt
            lens[:n] = seq_lens + (q - q_lens)
        return tok.reshape(3, -1), tables, lens

    def _fill(self, tok, tables, lens, extra=()) -> list[torch.Tensor]:
        """One pinned host→device copy (the runner's staging), then on-device copies into the
        static inputs. Returns the `extra` int64 arrays, copied along, on the device."""
        t, b, l_, *extra = self.staging.to_device(np.int64, [tok, tables, lens, *extra])
        n_tok, bs, width = tok.shape[1], lens.size, tables.shape[1]
        self.tok[:, :n_tok].copy_(t.view(3, n_tok))
        self.tables[:bs, :width].copy_(b.view(bs, width))
        self.lens[:bs].copy_(l_)
        return extra

    def run(self, h, ids_from=None):
        """Replays the graph for host batch `h`; returns (hidden [bs*q, H], device row index of
        each logits row, the logits of all bs*q rows or None where the graph has none).
        `ids_from` (a `runner.DeviceTokenIds`): input ids taken on the device from the previous
        step's sampled ids (overlapped scheduling)."""
        bs, q, tree = key = self._bucket(h)
        q_lens = h.q_lens
        # token t of request r sits at row r * q + (t - query_start_loc[r]) after padding
        if q == 1 and len(h.input_ids) == len(q_lens):  # one token a request: token t is row t
            rows_of_tok = np.arange(len(q_lens))
        else:
            r = np.repeat(np.arange(len(q_lens)), q_lens)
            rows_of_tok = r * q + (np.arange(len(r)) - np.repeat(h.query_start_loc[:-1], q_lens))
        extra = [rows_of_tok[h.logits_indices]]
        if tree:  # every row's mask word; padding rows attend causally
            words = np.full(bs * q, -1, dtype=np.int64)
            words[rows_of_tok] = h.tree_mask
            extra.append(words)
        if self.slots is not None:  # hybrid models: state slots, padding on the scratch one
            slots = np.full(bs, self.scratch_slot, dtype=np.int64)
            slots[:len(q_lens)] = h.state_slots
            extra.append(slots)
        if ids_from is not None:
            extra += [ids_from.src, rows_of_tok[ids_from.dst]]
        rows, *more = self._fill(*self._pad(h.input_ids, h.positions, h.slot_mapping,
                                            h.block_tables, h.seq_lens, q_lens, bs, q), extra)
        if tree:
            self.words[:bs * q].copy_(more.pop(0))
        if self.slots is not None:
            self.slots[:bs].copy_(more.pop(0))
        if more:
            self.tok[0].index_copy_(0, more[1], ids_from.token_ids[more[0]])
        self.graphs[key].replay()
        return self.outputs[key], rows, self.logits.get(key)
