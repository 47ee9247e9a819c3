"""Attention of the CPU decode path (luceio/models/cpu_decode.py) by query lanes: every query
head of every row a request has in the step (a decode token, or a verify step's chain or tree
rows) against each key of the request's cache, read once for all of them.

`decode_cpu.decode_attention` takes a row at a time: a verify step's k + 1 rows read the
context k + 1 times, and each (query head, key) dot product ends in a horizontal sum of a
vector over the head's dimensions. Here the query heads that share a KV head, across all of a
request's rows, are lanes of a vector (`WIDTHS`: 8 or 16 of them a chunk): a key's dot
products with a chunk's lanes are one chain of vector FMAs over the head's dimensions (the query
transposed, the key's elements broadcast; LLVM IR in `rows_attention_ir_cpu.py`, 8 keys a call
as independent chains), then the softmax and the weighted sum of values run lane by lane,
vectorised over the lanes or the head dimension (a chunk's padding lanes skip the value sums).

Each lane's arithmetic is a fixed sequence over its own keys in cache order: the scores are
explicit `llvm.fma` chains over the dimensions in order, the softmax's max, exponentials and sum
and the value sums are per-lane sequences with no reassociation (`fastmath` is `contract`
only), and keys a lane does not see (a later row's, a tree's other branches) add exact zeros.
So a row's result depends only on the keys it sees: a verify row equals, bit for bit, the
decode step of the same position (tests/test_rows_attention_cpu.py), whatever the number of rows,
requests or threads, where that step takes this kernel too (`DECODE_MAX_HEAD_DIM`). Work items
(request, KV head, chunk of lanes) run on numba's threads.

No sliding windows (Gemma's step keeps `decode_cpu`), no tree span. numba's on-disk cache of
these functions is invalidated by changes to this file only: after editing `decode_cpu.py`
(`_rope_write`, `_store`), `rows_attention_ir_cpu.py` or `qdot_ir_cpu.py`, touch this file.
"""
from __future__ import annotations

import numpy as np

from .decode_cpu import _rope_write, _store, numba

DECODE_MAX_HEAD_DIM = 64
"""Steps that only decode (one row a request) over `decode_cpu._MIN_KEYS` keys or more with
wider heads take `decode_cpu`'s split kernel (`models/cpu_decode.py`): at head dim 128 one
decode row fills 6 of 8 lanes (the 1.5B) and the old kernel's horizontal sums cost relatively
less. Measured, real Qwen2.5-Coder-1.5B, one request, 2 threads, this kernel against the split
one (`bench/cpu_long_decode.py`): 0.98x / 0.96x at 8K keys, 0.99x at 2K; the 0.5B (heads of
64) 1.11x / 1.16x at 8K."""

PREFETCH_BLOCKS = 2
"""How far ahead (cache blocks) the keys' and values' rows are asked for."""

if numba is not None:
    from numba import prange

    from .rows_attention_ir_cpu import (WIDTHS, _prefetch_rows, _scores_8, _scores_16,
                                        _softmax_8, _softmax_16, _values_8, _values_16,
                                        _widen_rows)
    _njit = numba.njit(cache=True, nogil=True, fastmath={"contract"})
    _njit_inline = numba.njit(cache=True, nogil=True, fastmath={"contract"}, inline="always")
    _njit_parallel = numba.njit(cache=True, nogil=True, fastmath={"contract"}, parallel=True)
else:  # no numba: the CPU decode path is off
    def _njit(fn):
        return fn
    _njit_parallel = _njit_inline = _njit
    prange = range
    WIDTHS = (8, 16)


@_njit_inline
def _scores(qT, keys, at, step, scale, s, row, n, wide):
    """`_scores_intrinsic` of W = 16 (`wide`) or 8 lanes."""
    if wide:
        _scores_16(qT, keys, at, step, scale, s, row, n)
    else:
        _scores_8(qT, keys, at, step, scale, s, row, n)


@_njit
def _lanes(qT, kv, flat, table, h, first, n_lane, words, nmax, scale, s, top, tot, acc):
    """One work item: the W lanes of qT [D, W] (W: 8 or 16; KV head h) over the keys 0 ..
    nmax - 1 of the request's cache (`table`), keys below `first` seen by every lane, from
    `first` on those of its row (n_lane: the keys up to and including its own; words: bit j,
    the row at first + j, from 64 on all; `_sees_vec`). Leaves per lane the softmax's sum in
    `tot` and the unnormalised output in `acc` [W, D]; `s` [>= nmax, W] is scratch."""
    bs, kvh, d = kv.shape[2], kv.shape[3], kv.shape[4]
    wide = qT.shape[1] == 16
    bf16 = flat.itemsize == 2  # a bf16 cache: a block's keys widened to fp32 rows first
    kb = np.empty((bs if bf16 else 0, d), np.float32)
    kb_flat = kb.reshape(-1)
    live = np.int64(0)  # lanes past the last real one are padding: no value sums
    for w in range(qT.shape[1]):
        if n_lane[w] > 0:
            live = np.int64(w + 1)
    step = kvh * d
    for part in range(2):  # the scores (K, kv[0]), then the values (V, kv[1])
        t = 0
        while t < nmax:
            blk, off = table[t // bs], t % bs
            n = min(bs - off, nmax - t)
            base = ((np.int64(part) * kv.shape[1] + blk) * bs + off) * step + h * d
            ahead = t + PREFETCH_BLOCKS * bs
            if PREFETCH_BLOCKS and ahead < nmax:
                nxt = ((np.int64(part) * kv.shape[1] + table[ahead // bs]) * bs) * step + h * d
                _prefetch_rows(flat, nxt, np.int64(step), np.int64(bs), np.int64(d))
            if part == 0 and bf16:
                _widen_rows(flat, base, np.int64(step), np.int64(n), kb)
            i = 0
            while i < n:
                at, row = base + i * step, np.int64(t + i)
                # eight keys a call: independent chains, each value pass over a lane's row
                # adds eight (in key order)
                keys = np.int64(8 if i + 8 <= n else 1)
                if part == 0 and bf16:
                    _scores(qT, kb_flat, np.int64(i * d), np.int64(d), scale, s, row, keys,
                            wide)
                elif part == 0:
                    _scores(qT, flat, at, step, scale, s, row, keys, wide)
                elif wide:
                    _values_16(acc, flat, at, step, s, row, live, keys)
                else:
                    _values_8(acc, flat, at, step, s, row, live, keys)
                i += keys
            t += n
        if part == 0:
            if wide:
                _softmax_16(s, nmax, first, n_lane, words, top, tot)
            else:
                _softmax_8(s, nmax, first, n_lane, words, top, tot)
            acc[:] = 0


@_njit_parallel
def _run_items(qT, kv, flat, tables, items, firsts, n_lane, words, nmax, scale, s, top, tot,
               acc):
    """Every work item (items[i] = (request, KV head)) on numba's threads."""
    for i in prange(items.shape[0]):
        req, h = items[i, 0], items[i, 1]
        _lanes(qT[i], kv, flat, tables[req], h, firsts[req], n_lane[i], words[i], nmax[i],
               scale, s[i], top[i], tot[i], acc[i])


@_njit
def _plan(row_starts, seq_lens, words_in, group, kvh, W):
    """(items [I, 2]: request, KV head; per item and lane its row, its query head (-1: a
    chunk's padding), its row's key count and words [I, W] (padding: 0 keys); per item the
    most keys it reads)."""
    reqs = row_starts.shape[0] - 1
    count = 0
    for r in range(reqs):
        lanes = (row_starts[r + 1] - row_starts[r]) * group
        count += kvh * ((lanes + W - 1) // W)
    items = np.empty((count, 2), np.int64)
    lane_row = np.full((count, W), -1, np.int64)
    lane_head = np.full((count, W), -1, np.int64)
    n_lane = np.zeros((count, W), np.int64)
    words = np.zeros((count, W), np.int64)
    nmax = np.zeros(count, np.int64)
    i = 0
    for r in range(reqs):
        row0 = row_starts[r]
        lanes = (row_starts[r + 1] - row0) * group
        for h in range(kvh):
            for c0 in range(0, lanes, W):
                items[i, 0], items[i, 1] = r, h
                for w in range(min(W, lanes - c0)):
                    row = row0 + (c0 + w) // group
                    lane_row[i, w], lane_head[i, w] = row, h * group + (c0 + w) % group
                    n_lane[i, w] = seq_lens[row]
                    words[i, w] = words_in[row]
                    nmax[i] = max(nmax[i], seq_lens[row])
                i += 1
    return items, lane_row, lane_head, n_lane, words, nmax


@_njit
def _queries(qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, lane_row,
             lane_head, q_rows, qT):
    """Every row's q (normalised per head where q_norm is given, rotated) into q_rows [rows,
    H, D], its K and V written to the cache; then each item's lanes transposed into qT [I, D,
    W] (padding lanes 0)."""
    for b in range(qkv.shape[0]):
        _rope_write(b, qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps,
                    q_rows[b])
    qT[:] = 0
    for i, w in np.argwhere(lane_row >= 0):
        qT[i, :, w] = q_rows[lane_row[i, w], lane_head[i, w]]


@_njit
def _write_out(lane_row, lane_head, tot, acc, out):
    """out[row, head * D ..] = a lane's output over its softmax sum."""
    d = acc.shape[2]
    for i, w in np.argwhere(lane_row >= 0):
        for j in range(d):
            _store(out, lane_row[i, w], lane_head[i, w] * d + j, acc[i, w, j] / tot[i, w])


@_njit
def _attend(qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, out, scale,
            items, lane_row, lane_head, n_lane, words, nmax, tables, firsts, q_rows, qT, s, top,
            tot, acc):
    _queries(qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, lane_row,
             lane_head, q_rows, qT)
    _run_items(qT, kv, kv.reshape(-1), tables, items, firsts, n_lane, words, nmax,
               np.float32(scale), s, top, tot, acc)
    _write_out(lane_row, lane_head, tot, acc, out)


def lane_width(lanes: int) -> int:
    """Lanes a chunk for requests of up to `lanes` query lanes a KV head (`WIDTHS`)."""
    return WIDTHS[0] if lanes <= WIDTHS[0] else WIDTHS[1]


def decode_items(num_seqs: int, num_heads: int, kvh: int) -> int:
    """The work items of a step in which each of `num_seqs` requests decodes one token."""
    group = num_heads // kvh
    return num_seqs * kvh * -(-group // lane_width(group))


class RowsAttention:
    """One step's plan: its requests' rows as work items (`_plan`) and the scratch buffers;
    called once per layer. `row_starts` [requests + 1]: each request's first row (its rows
    are consecutive, in order); per row: `seq_lens` (the keys it sees up to and including its
    own), `words` (-1, or a tree row's ancestors among the step's rows, `tree_cpu`'s rule),
    `block_tables` (its request's)."""

    def __init__(self, row_starts, seq_lens, words, block_tables, num_heads: int, kvh: int,
                 head_dim: int):
        row_starts = row_starts.astype(np.int64)
        seq_lens = seq_lens.astype(np.int64)
        self.num_heads = num_heads
        group = num_heads // kvh
        W = lane_width(int(np.diff(row_starts).max()) * group)
        self.items, self.lane_row, self.lane_head, self.n_lane, self.words, self.nmax = _plan(
            row_starts, seq_lens, words.astype(np.int64), group, kvh, W)
        firsts = row_starts[:-1]
        self.tables = np.ascontiguousarray(block_tables[firsts])
        self.firsts = seq_lens[firsts] - 1
        count, longest = len(self.items), int(self.nmax.max())
        self.q_rows = np.empty((len(seq_lens), num_heads, head_dim), np.float32)
        self.qT = np.empty((count, head_dim, W), np.float32)
        self.s = np.empty((count, longest, W), np.float32)
        self.top = np.empty((count, W), np.float32)
        self.tot = np.empty((count, W), np.float32)
        self.acc = np.empty((count, W, head_dim), np.float32)

    @property
    def work_items(self) -> int:
        return len(self.items)

    def __call__(self, qkv, cos_sin, positions, kv, slots, q_norm, k_norm, eps, out, scale):
        """`decode_cpu.decode_attention`'s work for every row: q/k norm, rotary, K and V
        written at `slots`, attention, out [rows, H D]."""
        _attend(qkv, cos_sin, positions, kv, slots, self.num_heads, q_norm, k_norm, eps, out,
                scale, self.items, self.lane_row, self.lane_head, self.n_lane, self.words,
                self.nmax, self.tables, self.firsts, self.q_rows, self.qT, self.s, self.top,
                self.tot, self.acc)
