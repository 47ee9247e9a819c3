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

Long contexts: a lane group's keys are cut into work items at ordinals that are multiples of
`KEY_SPAN` (a key's ordinal: its index, for a tree row's ancestors the index it takes on the
row's path once committed), each item's softmax kept apart (its max, sum and unnormalised
output), and a lane's items merged in key order (`_write_out`). The cut depends on nothing but
the keys, so the items spread a long request over the threads and a row's bits still do not
depend on the step.

Each lane's arithmetic is a fixed sequence over its own keys in cache order: the scores are
explicit `llvm.fma` chains over the dimensions in order, the softmax's max, exponentials and sum
and the value sums are per-lane sequences with no reassociation (`fastmath` is `contract`
only), and keys a lane does not see (a later row's, a tree's other branches) add exact zeros;
items where it sees none are left out of the merge. So a row's result depends only on the keys
it sees: a verify row equals, bit for bit, the decode step of the same position, a tree row the
decode step of its path (tests/test_rows_attention_cpu.py), whatever the number of rows,
requests or threads. Work items (request, KV head, chunk of lanes, key span) run on numba's
threads.

No sliding windows (Gemma's step keeps `decode_cpu`), no tree span. numba's on-disk cache of
these functions is keyed on this file and on the ones they inline (`decode_cpu.py`,
`rows_attention_ir_cpu.py`, `qdot_ir_cpu.py`, `int4pack_cpu.py`: `numba_cache.depend_on`).
"""
from __future__ import annotations

import numpy as np

from .numba_cache import depend_on
from .decode_cpu import _exp, _rope_write, _store, numba

KEY_SPAN = 1024
"""Keys a work item takes at most: a lane group's keys are cut at multiples of it, whatever
the step, the threads or the other rows, so long contexts spread over the threads and a row's
bits still depend only on its own keys. One step's attention at 8,192 keys, the 0.5B's shape,
2 threads (`python bench/cpu_verify_attention.py --contexts 8192 --spans ...`,
`bench/results/cpu/cpu_verify_attention_spans_session43.json`): 1 row 11.2 /
11.6 / 9.8 / 9.8 / 9.3 ms at 256 / 512 / 1,024 / 2,048 / 4,096 keys, 5 rows 34.1 / 34.2 /
32.4 / 32.5 / 32.4 ms: longer spans gain little past 1,024, shorter ones leave threads idle."""

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
def _lanes(qT, kv, flat, table, h, first, n_lane, words, lo, hi, t1, scale, s, top, tot,
           acc):
    """One work item: the W lanes of qT [D, W] (W: 8 or 16; KV head h) over the keys of the
    request's cache (`table`) whose ordinal is in [lo, hi) (`_sees_vec`; read from lo to t1),
    keys below `first` seen by every lane, from `first` on those of its row (n_lane: the keys
    up to and including its own; words: bit j, the row at first + j, from 64 on all). Leaves
    per lane the max of its scores in `top`, the softmax's sum in `tot` (0: it sees none of
    these keys) and the unnormalised output in `acc` [W, D]; `s` [>= t1 - lo, W] is
    scratch."""
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
    acc[:] = 0
    for part in range(2):  # the scores (K, kv[0]), then the values (V, kv[1])
        t = lo
        while t < t1:
            blk, off = table[t // bs], t % bs
            n = min(bs - off, t1 - t)
            base = ((np.int64(part) * kv.shape[1] + blk) * bs + off) * step + h * d
            ahead = t + PREFETCH_BLOCKS * bs
            if PREFETCH_BLOCKS and ahead < t1:
                nxt = ((np.int64(part) * kv.shape[1] + table[ahead // bs]) * bs) * step + h * d
                _prefetch_rows(flat, nxt, np.int64(step), np.int64(bs), np.int64(d))
            if part == 0 and bf16:
                _widen_rows(flat, base, np.int64(step), np.int64(n), kb)
            i = 0
            while i < n:
                at, row = base + i * step, np.int64(t - lo + i)
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
                _softmax_16(s, lo, hi, t1 - lo, first, n_lane, words, top, tot)
            else:
                _softmax_8(s, lo, hi, t1 - lo, first, n_lane, words, top, tot)


@_njit_parallel
def _run_items(qT, kv, flat, tables, items, firsts, n_lane, words, scale, s, top, tot, acc):
    """Every work item (items[i] = (request, KV head, ordinals lo, hi, lane group, the key
    after its last)) on numba's threads."""
    for i in prange(items.shape[0]):
        req, h, g = items[i, 0], items[i, 1], items[i, 4]
        _lanes(qT[g], kv, flat, tables[req], h, firsts[req], n_lane[g], words[g], items[i, 2],
               items[i, 3], items[i, 5], scale, s[i], top[i], tot[i], acc[i])


@_njit
def _plan(row_starts, seq_lens, words_in, group, kvh, W, span):
    """The lane groups (a request's KV head and chunk of W lanes) and their work items.
    Per group and lane its row, its query head (-1: a chunk's padding), its row's key count
    and words [G, W] (padding: 0 keys); per group its first item [G + 1]; items [I, 6]:
    (request, KV head, ordinals lo, hi, group, the key after its last), a group's keys cut
    at ordinals that are multiples of `span` (at least one item a group). Where the step's
    rows are a tree's, an item whose ordinals reach them reads keys to the group's last (a
    tree row's ordinals are below its keys' indices)."""
    reqs = row_starts.shape[0] - 1
    count = 0
    for r in range(reqs):
        lanes = (row_starts[r + 1] - row_starts[r]) * group
        count += kvh * ((lanes + W - 1) // W)
    lane_row = np.full((count, W), -1, np.int64)
    lane_head = np.full((count, W), -1, np.int64)
    n_lane = np.zeros((count, W), np.int64)
    words = np.zeros((count, W), np.int64)
    nmax = np.zeros(count, np.int64)
    owner = np.empty((count, 2), np.int64)
    firsts = np.zeros(count + 1, np.int64)
    i = 0
    for r in range(reqs):
        row0 = row_starts[r]
        lanes = (row_starts[r + 1] - row0) * group
        for h in range(kvh):
            for c0 in range(0, lanes, W):
                owner[i, 0], owner[i, 1] = r, h
                for w in range(min(W, lanes - c0)):
                    row = row0 + (c0 + w) // group
                    lane_row[i, w], lane_head[i, w] = row, h * group + (c0 + w) % group
                    n_lane[i, w] = seq_lens[row]
                    words[i, w] = words_in[row]
                    nmax[i] = max(nmax[i], seq_lens[row])
                firsts[i + 1] = firsts[i] + max(1, (nmax[i] + span - 1) // span)
                i += 1
    items = np.empty((firsts[count], 6), np.int64)
    for g in range(count):
        r = owner[g, 0]
        first = seq_lens[row_starts[r]] - 1  # the index of the request's first row
        tree = False
        for row in range(row_starts[r], row_starts[r + 1]):
            tree = tree or words_in[row] != -1
        for j in range(firsts[g + 1] - firsts[g]):
            lo = j * span
            hi = min(lo + span, nmax[g])
            end = nmax[g] if tree and hi > first else hi
            items[firsts[g] + j] = (r, owner[g, 1], lo, hi, g, end)
    return items, firsts, lane_row, lane_head, n_lane, words


@_njit
def _queries(qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, lane_row,
             lane_head, q_rows, qT):
    """Every row's q (normalised per head where q_norm is given, rotated) into q_rows [rows,
    H, D], its K and V written to the cache; then each group's lanes transposed into qT [G, D,
    W] (padding lanes 0)."""
    for b in range(qkv.shape[0]):
        _rope_write(b, qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps,
                    q_rows[b])
    qT[:] = 0
    for g, w in np.argwhere(lane_row >= 0):
        qT[g, :, w] = q_rows[lane_row[g, w], lane_head[g, w]]


@_njit
def _write_out(firsts, lane_row, lane_head, top, tot, acc, out, merged):
    """out[row, head * D ..] = a lane's output over its softmax sum: one item's, or its
    items' merged in key order (each scaled by e^(its max - the lanes' max), the items that
    saw none of its keys left out: `merged` [D] scratch)."""
    d = acc.shape[2]
    for g, w in np.argwhere(lane_row >= 0):
        i0, i1 = firsts[g], firsts[g + 1]
        row, col = lane_row[g, w], lane_head[g, w] * d
        if i1 - i0 == 1:
            for j in range(d):
                _store(out, row, col + j, acc[i0, w, j] / tot[i0, w])
            continue
        best = np.float32(-np.inf)
        for i in range(i0, i1):
            if tot[i, w] > 0 and top[i, w] > best:
                best = top[i, w]
        total = np.float32(0)
        merged[:] = 0
        for i in range(i0, i1):
            if tot[i, w] > 0:
                f = _exp(top[i, w] - best)
                total += tot[i, w] * f
                for j in range(d):
                    merged[j] += acc[i, w, j] * f
        for j in range(d):
            _store(out, row, col + j, merged[j] / total)


@_njit
def _attend(qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, out, scale,
            items, firsts, lane_row, lane_head, n_lane, words, tables, req_firsts, q_rows, qT,
            s, top, tot, acc, merged):
    _queries(qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, lane_row,
             lane_head, q_rows, qT)
    _run_items(qT, kv, kv.reshape(-1), tables, items, req_firsts, n_lane, words,
               np.float32(scale), s, top, tot, acc)
    _write_out(firsts, lane_row, lane_head, top, tot, acc, out, merged)


def lane_width(lanes: int) -> int:
    """Lanes a chunk for requests of up to `lanes` query lanes a KV head (`WIDTHS`)."""
    return WIDTHS[0] if lanes <= WIDTHS[0] else WIDTHS[1]


class RowsAttention:
    """One step's plan: its requests' rows as lane groups and work items (`_plan`) and the
    scratch buffers; called once per layer. `row_starts` [requests + 1]: each request's first
    row (its rows are consecutive, in order); per row: `seq_lens` (the keys it sees up to and
    including its own), `words` (-1, or a tree row's ancestors among the step's rows,
    `spec.tree.masks_tensor`'s rule), `block_tables` (its request's)."""

    def __init__(self, row_starts, seq_lens, words, block_tables, num_heads: int, kvh: int,
                 head_dim: int, span: int | None = None):
        row_starts = row_starts.astype(np.int64)
        seq_lens = seq_lens.astype(np.int64)
        self.num_heads = num_heads
        group = num_heads // kvh
        W = lane_width(int(np.diff(row_starts).max()) * group)
        span = span or KEY_SPAN
        (self.items, self.firsts, self.lane_row, self.lane_head, self.n_lane,
         self.words) = _plan(row_starts, seq_lens, words.astype(np.int64), group, kvh, W, span)
        firsts = row_starts[:-1]
        self.tables = np.ascontiguousarray(block_tables[firsts])
        self.req_firsts = seq_lens[firsts] - 1
        count, groups = len(self.items), len(self.lane_row)
        longest = int((self.items[:, 5] - self.items[:, 2]).max())
        self.q_rows = np.empty((len(seq_lens), num_heads, head_dim), np.float32)
        self.qT = np.empty((groups, head_dim, W), np.float32)
        self.s = np.empty((count, longest, W), np.float32)
        self.top = np.empty((count, W), np.float32)
        self.tot = np.empty((count, W), np.float32)
        self.acc = np.empty((count, W, head_dim), np.float32)
        self.merged = np.empty(head_dim, np.float32)

    @property
    def work_items(self) -> int:
        return len(self.items)

    def __call__(self, qkv, cos_sin, positions, kv, slots, q_norm, k_norm, eps, out, scale):
        """`decode_cpu.decode_attention`'s work for every row: q/k norm, rotary, K and V
        written at `slots`, attention, out [rows, H D]."""
        _attend(qkv, cos_sin, positions, kv, slots, self.num_heads, q_norm, k_norm, eps, out,
                scale, self.items, self.firsts, self.lane_row, self.lane_head, self.n_lane,
                self.words, self.tables, self.req_firsts, self.q_rows, self.qT, self.s,
                self.top, self.tot, self.acc, self.merged)


if numba is not None:  # the IR and jitted helpers these functions inline: in their cache key
    depend_on(globals(), "rows_attention_ir_cpu.py", "qdot_ir_cpu.py", "decode_cpu.py",
              "int4pack_cpu.py")
