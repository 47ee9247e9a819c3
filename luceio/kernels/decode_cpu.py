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
The residual stream, the KV cache and all arithmetic are fp32. Reductions (sums of squares,
dot products, softmax sums) run in another order than ATen's, so results match the
references to fp32 rounding, not bit for bit.

Single-threaded: a decode step's tensors are small, and torch's threads run the matmuls
between these calls.
"""
from __future__ import annotations

import numpy as np
import torch

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

    _njit = numba.njit(cache=True, nogil=True, fastmath=True)
else:  # no numba: the CPU decode path is off (models/cpu_decode.py)
    def _njit(fn):
        return fn


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
def decode_attention(qkv, cos_sin, positions, kv, slots, block_tables, seq_lens, num_heads,
                     q_norm, k_norm, eps, out, scale, window):
    """One decode token per request: q and k normalised per head (Qwen3: q_norm, k_norm of
    size head_dim, else size 0) and rotated (rotate-half), k and v written to the cache at
    `slots`, then attention over the request's `seq_lens` cached tokens (`window` > 0: only
    its last `window`, a sliding window), scores scaled by `scale`.

    qkv: [num_seqs, (H + 2 Hkv) D] activations; cos_sin: fp32 [max_positions, D] (cos | sin);
    positions, slots: int64 [num_seqs]; kv: fp32 [2, num_blocks, block_size, Hkv, D];
    block_tables: int32 [num_seqs, max_blocks]; seq_lens: int32 [num_seqs];
    out: [num_seqs, H D]."""
    num_seqs = qkv.shape[0]
    block_size, num_kv_heads, head_dim = kv.shape[2], kv.shape[3], kv.shape[4]
    group, half = num_heads // num_kv_heads, head_dim // 2
    scale = np.float32(scale)
    q = np.empty((num_heads, head_dim), np.float32)
    acc = np.empty((group, head_dim), np.float32)
    total = np.empty(group, np.float32)
    for b in range(num_seqs):
        blk, off = slots[b] // block_size, slots[b] % block_size
        cos, sin = cos_sin[positions[b], :half], cos_sin[positions[b], half:]
        for head in range(num_heads + num_kv_heads):
            x = q[head] if head < num_heads else kv[0, blk, off, head - num_heads]
            for j in range(head_dim):
                x[j] = _load(qkv[b, head * head_dim + j])
            if q_norm.shape[0]:
                _rms_norm_row(x, q_norm if head < num_heads else k_norm, eps)
            for j in range(half):
                x1, x2 = x[j], x[half + j]
                x[j], x[half + j] = x1 * cos[j] - x2 * sin[j], x2 * cos[j] + x1 * sin[j]
        v_at = (num_heads + num_kv_heads) * head_dim
        for h in range(num_kv_heads):
            for j in range(head_dim):
                kv[1, blk, off, h, j] = _load(qkv[b, v_at + h * head_dim + j])
        seq_len = seq_lens[b]
        start = max(seq_len - window, 0) if window > 0 else 0
        scores = np.empty((group, seq_len), np.float32)
        for h in range(num_kv_heads):
            for t in range(start, seq_len):
                key = kv[0, block_tables[b, t // block_size], t % block_size, h]
                for g in range(group):
                    dot = np.float32(0)
                    for j in range(head_dim):
                        dot += q[h * group + g, j] * key[j]
                    scores[g, t] = dot * scale
            for g in range(group):
                top = scores[g, start:].max()
                total[g] = 0
                for t in range(start, seq_len):
                    scores[g, t] = np.exp(scores[g, t] - top)
                    total[g] += scores[g, t]
            acc[:] = 0
            for t in range(start, seq_len):
                value = kv[1, block_tables[b, t // block_size], t % block_size, h]
                for g in range(group):
                    for j in range(head_dim):
                        acc[g, j] += scores[g, t] * value[j]
            for g in range(group):
                for j in range(head_dim):
                    _store(out, b, (h * group + g) * head_dim + j, acc[g, j] / total[g])
