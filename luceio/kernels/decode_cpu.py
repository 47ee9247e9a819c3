"""Numba kernels of the CPU decode step (luceio/models/cpu_decode.py), each one call where its
torch reference takes several ops:

  kernel             reference                                        torch ops
  add_rms_norm       norm.rms_norm_ref (with the residual)            7
  silu_and_mul       activation.silu_and_mul_ref                      2
  gelu_tanh_and_mul  F.gelu(gate, approximate="tanh") * up (Gemma)    3
  decode_attention   [q/k norm], rotary_ref, write_kv_ref,            ~40
                     attention._decode_ref (one query per request,
                     a sliding window where given)

On two threads a decode step of a small model is mostly the fixed cost of its small ops, ~3 us
each however few bytes they touch: these kernels exist to cut their count
(tests/test_cpu_decode.py measures them against the references, luceio/models/cpu_decode.py
says what they save).

Dtypes. Activations arrive as fp32 or as bf16 bits (uint16: the packed matmul's output, read
without a conversion op) and leave in the dtype of the output array given: fp32, or bf16
rounded to nearest even (the packed matmul's input, as `Tensor.to(torch.bfloat16)` rounds it).
The residual stream and all arithmetic are fp32; the KV cache is fp32, or with
`--kv-cache-dtype bfloat16` bf16 (its uint16 bits: keys and values rounded to nearest even as
they are written, widened exactly as they are read). Reductions (sums of squares,
dot products, softmax sums) run in another order than ATen's, so results match the
references to fp32 rounding, not bit for bit.

Single-threaded: a decode step's tensors are small, and torch's threads run the matmuls
between these calls. The exception is attention over long contexts (`_MIN_KEYS` keys and up)
in an engine with several threads: `decode_attention_split` cuts each
request's keys into ranges on numba's threads and merges their softmaxes.
"""
from __future__ import annotations

import numpy as np
import torch

from .numba_cache import depend_on
from .int4pack_cpu import from_bf16, numba, to_bf16


def available() -> bool:
    return numba is not None


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's memory as the kernels read it: fp32 as is, bf16 as its uint16 bits."""
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


if numba is not None:
    from numba import types
    from numba.extending import overload

    def _load(v):
        """An element of an activation array as fp32 (bf16 bits or fp32)."""

    @overload(_load, inline="always")
    def _load_impl(v):
        if isinstance(v, types.Integer):
            return lambda v: from_bf16(v)
        return lambda v: np.float32(v)

    def _store(out, i, j, v):
        """out[i, j] = v, rounded to bf16 bits if out holds them."""

    @overload(_store, inline="always")
    def _store_impl(out, i, j, v):
        if isinstance(out.dtype, types.Integer):
            def store_bf16(out, i, j, v):
                out[i, j] = to_bf16(v)
            return store_bf16

        def store(out, i, j, v):
            out[i, j] = v
        return store

    def _put(row, j, v):
        """row[j] = v, rounded to bf16 bits if row holds them (a bf16 KV cache's row)."""

    @overload(_put, inline="always")
    def _put_impl(row, j, v):
        if isinstance(row.dtype, types.Integer):
            def put_bf16(row, j, v):
                row[j] = to_bf16(v)
            return put_bf16

        def put(row, j, v):
            row[j] = v
        return put

    _njit = numba.njit(cache=True, nogil=True, fastmath=True)
    _njit_parallel = numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
    _njit_inline = numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
    prange = numba.prange
else:  # no numba: the CPU decode path is off (models/cpu_decode.py)
    def _njit(fn):
        return fn
    _njit_parallel = _njit_inline = _njit
    prange = range


_POW2 = np.array([2.0 ** (i - 127) if i else 0.0 for i in range(128)], np.float32)
"""2^n for n = -127 .. 0 (index n + 127; 2^-127 read as 0): `_exp`'s exponent part."""


@_njit_inline
def _exp(x):
    """e^x for x <= 0 (softmax scores less their max), vectorizable (no libm call): 2^n 2^f with
    n = round(x log2 e), 2^f = e^(f ln 2) by its Taylor polynomial to degree 6 (|f ln 2| <=
    0.35: relative error < 2e-7, about one fp32 rounding); below -87, 0."""
    y = max(x, np.float32(-87.0)) * np.float32(1.4426950408889634)
    n = np.floor(y + np.float32(0.5))
    f = (y - n) * np.float32(0.6931471805599453)
    p = np.float32(0.0013888889)
    for c in (0.008333334, 0.041666668, 0.16666667, 0.5, 1.0, 1.0):
        p = p * f + np.float32(c)
    return p * _POW2[np.int32(n) + np.int32(127)]


@_njit
def add_rms_norm(x, residual, add, weight, eps, out):
    """With `add`: residual += x. Then out = weight * residual / rms(residual), row by row.
    x: [M, >= D] activations; residual: fp32 [M, D]; weight: fp32 [D]; out: [M, D]."""
    m, d = residual.shape
    for i in range(m):
        sum_sq = np.float32(0)
        for j in range(d):
            r = residual[i, j]
            if add:
                r += _load(x[i, j])
                residual[i, j] = r
            sum_sq += r * r
        inv = np.float32(1) / np.sqrt(sum_sq / np.float32(d) + np.float32(eps))
        for j in range(d):
            _store(out, i, j, weight[j] * (residual[i, j] * inv))


@_njit
def silu_and_mul(gate_up, out):
    """gate_up: [M, >= 2 I] activations as [gate | up]; out: [M, I] = silu(gate) * up."""
    m, n = out.shape
    for i in range(m):
        for j in range(n):
            g = _load(gate_up[i, j])
            _store(out, i, j, g / (np.float32(1) + np.exp(-g)) * _load(gate_up[i, n + j]))


@_njit
def gelu_tanh_and_mul(gate_up, out):
    """gate_up: [M, >= 2 I] activations as [gate | up]; out: [M, I] = gelu_tanh(gate) * up,
    the tanh approximation: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))."""
    m, n = out.shape
    c = np.float32(np.sqrt(2.0 / np.pi))
    for i in range(m):
        for j in range(n):
            g = _load(gate_up[i, j])
            t = np.tanh(c * (g + np.float32(0.044715) * g * g * g))
            _store(out, i, j, np.float32(0.5) * g * (np.float32(1) + t) * _load(gate_up[i, n + j]))


@_njit
def _rms_norm_row(x, weight, eps):
    sum_sq = np.float32(0)
    for j in range(x.shape[0]):
        sum_sq += x[j] * x[j]
    inv = np.float32(1) / np.sqrt(sum_sq / np.float32(x.shape[0]) + np.float32(eps))
    for j in range(x.shape[0]):
        x[j] = weight[j] * (x[j] * inv)


@_njit
def _rope_write(b, qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, q):
    """Request b's q (into q [H, D]) and k normalised per head (q_norm, k_norm of size head_dim,
    else size 0) and rotated (rotate-half); k and v written to the cache at slots[b] (an fp32
    cache, or a bf16 one as its uint16 bits: rounded to nearest even)."""
    block_size, num_kv_heads, head_dim = kv.shape[2], kv.shape[3], kv.shape[4]
    half = head_dim // 2
    blk, off = slots[b] // block_size, slots[b] % block_size
    cos, sin = cos_sin[positions[b], :half], cos_sin[positions[b], half:]
    k = np.empty(head_dim, np.float32)
    for head in range(num_heads + num_kv_heads):
        x = q[head] if head < num_heads else k
        for j in range(head_dim):
            x[j] = _load(qkv[b, head * head_dim + j])
        if q_norm.shape[0]:
            _rms_norm_row(x, q_norm if head < num_heads else k_norm, eps)
        for j in range(half):
            x1, x2 = x[j], x[half + j]
            x[j], x[half + j] = x1 * cos[j] - x2 * sin[j], x2 * cos[j] + x1 * sin[j]
        if head >= num_heads:
            row = kv[0, blk, off, head - num_heads]
            for j in range(head_dim):
                _put(row, j, k[j])
    v_at = (num_heads + num_kv_heads) * head_dim
    for h in range(num_kv_heads):
        row = kv[1, blk, off, h]
        for j in range(head_dim):
            _put(row, j, _load(qkv[b, v_at + h * head_dim + j]))


@_njit_inline
def _dots(q, key, g, width, scale, scores, t):
    """scores[g .. g + width, t] = scale * q[g + i] . key (width 4, 2 or 1: independent
    sums, sharing the key's loads)."""
    d0 = d1 = d2 = d3 = np.float32(0)
    for j in range(key.shape[0]):
        k = _load(key[j])
        d0 += q[g, j] * k
        if width > 1:
            d1 += q[g + 1, j] * k
        if width > 3:
            d2 += q[g + 2, j] * k
            d3 += q[g + 3, j] * k
    scores[g, t] = d0 * scale
    if width > 1:
        scores[g + 1, t] = d1 * scale
    if width > 3:
        scores[g + 2, t] = d2 * scale
        scores[g + 3, t] = d3 * scale


@_njit
def _attend_range(q, kv, table, t0, t1, scale, top, total, acc):
    """Every query head of q [H, D] (head g reads KV head g // group) over the keys at cache
    indices [t0, t1) (t1 > t0): per head the scores' max (`top` [H]), the sum of their
    exponentials (`total` [H]) and the unnormalised output (`acc` [H, D]). Keys go block by
    block of the cache (no division per key) and each key's KV heads one after the other, so
    the cache is read front to back (a token's K, or V, of every KV head is one contiguous
    row; a KV head at a time read a third or a half of each row. Measured at the SmolLM2 shape,
    30 layers of 2,048 keys from memory (94 MB) on two threads: 6.4-7.7 -> 4.0-4.4 ms). Four
    heads' dots at a time share a key's loads; values four keys at a time into each head's
    output row."""
    block_size, num_kv_heads = kv.shape[2], kv.shape[3]
    num_heads = q.shape[0]
    group = num_heads // num_kv_heads
    scores = np.empty((num_heads, t1 - t0), np.float32)
    t = t0
    while t < t1:
        blk, off = table[t // block_size], t % block_size
        n = min(block_size - off, t1 - t)
        for i in range(n):
            for h in range(num_kv_heads):
                key = kv[0, blk, off + i, h]
                g, end = h * group, (h + 1) * group
                while g < end:
                    width = 4 if end - g >= 4 else (2 if end - g >= 2 else 1)
                    _dots(q, key, g, width, scale, scores, t - t0 + i)
                    g += width
        t += n
    for g in range(num_heads):
        top[g] = scores[g].max()
        s = np.float32(0)
        for i in range(t1 - t0):
            e = _exp(scores[g, i] - top[g])
            scores[g, i] = e
            s += e
        total[g] = s
    acc[:] = 0
    t = t0
    while t < t1:
        blk, off = table[t // block_size], t % block_size
        n = min(block_size - off, t1 - t)
        i = 0
        while i + 4 <= n:
            c = t - t0 + i
            for h in range(num_kv_heads):
                v0, v1 = kv[1, blk, off + i, h], kv[1, blk, off + i + 1, h]
                v2, v3 = kv[1, blk, off + i + 2, h], kv[1, blk, off + i + 3, h]
                for g in range(h * group, (h + 1) * group):
                    s0, s1, s2, s3 = scores[g, c], scores[g, c + 1], scores[g, c + 2], scores[g, c + 3]
                    row = acc[g]
                    for j in range(row.shape[0]):
                        row[j] += s0 * _load(v0[j]) + s1 * _load(v1[j]) + s2 * _load(v2[j]) \
                            + s3 * _load(v3[j])
            i += 4
        for i in range(i, n):
            for h in range(num_kv_heads):
                v = kv[1, blk, off + i, h]
                for g in range(h * group, (h + 1) * group):
                    s0 = scores[g, t - t0 + i]
                    row = acc[g]
                    for j in range(row.shape[0]):
                        row[j] += s0 * _load(v[j])
        t += n


@_njit
def decode_attention(qkv, cos_sin, positions, kv, slots, block_tables, seq_lens, num_heads,
                     q_norm, k_norm, eps, out, scale, window):
    """One decode token per request: q and k normalised per head (Qwen3: q_norm, k_norm of
    size head_dim, else size 0) and rotated (rotate-half), k and v written to the cache at
    `slots`, then attention over the request's `seq_lens` cached tokens (`window` > 0: only
    its last `window`, a sliding window), scores scaled by `scale`. One thread; the long
    contexts of a multi-threaded engine take `decode_attention_split`.

    qkv: [num_seqs, (H + 2 Hkv) D] activations; cos_sin: fp32 [max_positions, D] (cos | sin);
    positions, slots: int64 [num_seqs]; kv: fp32 [2, num_blocks, block_size, Hkv, D];
    block_tables: int32 [num_seqs, max_blocks]; seq_lens: int32 [num_seqs];
    out: [num_seqs, H D]."""
    head_dim = kv.shape[4]
    q = np.empty((num_heads, head_dim), np.float32)
    acc = np.empty_like(q)
    top, total = np.empty(num_heads, np.float32), np.empty(num_heads, np.float32)
    scale = np.float32(scale)
    for b in range(qkv.shape[0]):
        _rope_write(b, qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, q)
        seq_len = seq_lens[b]
        start = max(seq_len - window, 0) if window > 0 else 0
        _attend_range(q, kv, block_tables[b], start, seq_len, scale, top, total, acc)
        for g in range(num_heads):
            for j in range(head_dim):
                _store(out, b, g * head_dim + j, acc[g, j] / total[g])


@_njit
def _rope_write_all(qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, q):
    for b in range(qkv.shape[0]):
        _rope_write(b, qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, q[b])


@_njit_parallel
def _attend_split(q, kv, block_tables, seq_lens, window, scale, top, total, acc):
    """Every (request, split) on numba's threads: split s of S covers the s-th S-th of the
    request's attended keys, for every head (an empty one: total 0)."""
    num_seqs, splits = top.shape[0], top.shape[1]
    for item in prange(num_seqs * splits):
        b, s = item // splits, item % splits
        end = seq_lens[b]
        start = max(end - window, 0) if window > 0 else 0
        chunk = (end - start + splits - 1) // splits
        t0, t1 = start + s * chunk, min(start + (s + 1) * chunk, end)
        if t0 >= t1:
            total[b, s, :] = 0
            continue
        _attend_range(q[b], kv, block_tables[b], t0, t1, scale, top[b, s], total[b, s], acc[b, s])


@_njit
def _merge_splits(top, total, acc, out):
    """out = the splits' partial softmaxes merged: sum_s e^(top_s - max) acc_s over the same
    sum of the totals."""
    num_seqs, splits, num_heads, head_dim = acc.shape
    merged = np.empty(head_dim, np.float32)
    for b in range(num_seqs):
        for g in range(num_heads):
            best = np.float32(-np.inf)
            for s in range(splits):
                if total[b, s, g] > 0:
                    best = max(best, top[b, s, g])
            merged[:] = 0
            norm = np.float32(0)
            for s in range(splits):
                if total[b, s, g] > 0:
                    w = np.exp(top[b, s, g] - best)
                    norm += w * total[b, s, g]
                    for j in range(head_dim):
                        merged[j] += w * acc[b, s, g, j]
            for j in range(head_dim):
                _store(out, b, g * head_dim + j, merged[j] / norm)


_SPLIT_KEYS = 128  # the fewest keys a split takes (of every head)
_MIN_KEYS = 256
"""The longest request's keys from which attention runs on several threads (two threads, the
1.5B's two KV heads, keys in cache: 256 keys 27 -> 19 us, 1,024 keys 105 -> 59 us; 128 keys
15 -> 19 us)."""


def attention_splits(seq_lens: np.ndarray, window: int) -> int:
    """How many key ranges `decode_attention_split` cuts each request into on numba's threads
    (a range covers every head, `_attend_range`), or 0: `decode_attention` on one. The caller
    sets numba's threads (the CPU decoder: as many as torch's, `qdot_cpu.use_torch_threads`,
    once a step)."""
    threads = numba.get_num_threads()
    longest = int(seq_lens.max())
    if window:
        longest = min(longest, window)
    if threads < 2 or longest < _MIN_KEYS:
        return 0
    # four ranges a thread: numba hands them out one at a time, so threads finish together
    return max(1, min(-(-4 * threads // len(seq_lens)), longest // _SPLIT_KEYS))


def decode_attention_split(qkv, cos_sin, positions, kv, slots, block_tables, seq_lens,
                           num_heads, q_norm, k_norm, eps, out, scale, window, splits: int):
    """`decode_attention` with each request's keys cut into `splits` ranges, every (request,
    range) on numba's threads, then the ranges' softmaxes merged (flash-decoding): for long
    contexts on several threads. Same arguments and results, to fp32 rounding."""
    num_seqs, head_dim = qkv.shape[0], kv.shape[4]
    q = np.empty((num_seqs, num_heads, head_dim), np.float32)
    _rope_write_all(qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, q)
    top = np.empty((num_seqs, splits, num_heads), np.float32)
    total = np.empty_like(top)
    acc = np.empty((num_seqs, splits, num_heads, head_dim), np.float32)
    _attend_split(q, kv, block_tables, seq_lens, window, np.float32(scale), top, total, acc)
    _merge_splits(top, total, acc, out)


if numba is not None:
    depend_on(globals(), "int4pack_cpu.py")  # the bf16 helpers inlined: in the cache key
