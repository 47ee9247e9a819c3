"""The pieces the paged attention kernels share (`attention_triton.py`'s prefill,
`attention_decode_triton.py`'s decode): the dot with its interpreter precision, and one
key/value tile of the online softmax read through the block table."""
from __future__ import annotations

import os

import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, DOT_IEEE: tl.constexpr):
    if DOT_IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, kc_ptr, vc_ptr, bt_ptr, n0, lim, row_pos, scale_log2,
                 s_kcb, s_kcs, s_vcb, s_vcs, offs_d, dmask,
                 BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, BOUNDED: tl.constexpr,
                 CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr,
                 TREE: tl.constexpr = False, words=None, ctx=0,
                 WINDOW: tl.constexpr = False, window=0, q_pos=None, pos_ptr=None, q_len=0):
    """One tile of BLOCK_N keys starting at n0: scores, online-softmax update, P @ V.

    kc_ptr / vc_ptr already point at this KV head; bt_ptr at this request's block table row.
    BOUNDED masks keys >= lim; CAUSAL masks keys > row_pos (per row); TREE (with CAUSAL) also
    masks query token j of the request (key ctx + j, j < 64) where bit j of the row's word is 0.
    WINDOW (with CAUSAL) masks keys at or past `window` positions behind the row's query: by
    cache index, or with TREE by position (q_pos per row; pos_ptr: the request's step tokens'
    positions, the keys ctx .. ctx + q_len - 1).
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if BOUNDED:
        nmask = offs_n < lim
        page = tl.load(bt_ptr + offs_n // PAGE_SIZE, mask=nmask, other=0).to(tl.int64)
    else:
        nmask = offs_n >= 0
        page = tl.load(bt_ptr + offs_n // PAGE_SIZE).to(tl.int64)
    in_page = offs_n % PAGE_SIZE
    k_off = page * s_kcb + in_page * s_kcs
    v_off = page * s_vcb + in_page * s_vcs
    kt = tl.load(kc_ptr + k_off[None, :] + offs_d[:, None],
                 mask=dmask[:, None] & nmask[None, :], other=0.0)          # [BLOCK_D, BLOCK_N]
    v = tl.load(vc_ptr + v_off[:, None] + offs_d[None, :],
                mask=nmask[:, None] & dmask[None, :], other=0.0)           # [BLOCK_N, BLOCK_D]
    if DOT_F32:
        kt = kt.to(tl.float32)
        v = v.to(tl.float32)
    else:
        kt = kt.to(q.dtype)
        v = v.to(q.dtype)
    s = _dot(q, kt, DOT_IEEE) * scale_log2                                 # [M, BLOCK_N], log2 units
    if CAUSAL:
        keep = offs_n[None, :] <= row_pos[:, None]
        if TREE:
            rel = offs_n - ctx
            sh = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)
            bit = (words[:, None] >> sh[None, :]) & 1
            keep = keep & (((rel < 0) | (rel >= 64))[None, :] | (bit != 0))
        if WINDOW:
            if TREE:
                step = offs_n - ctx
                in_step = (step >= 0) & (step < q_len)
                k_pos = tl.load(pos_ptr + tl.where(in_step, step, 0), mask=in_step, other=0)
                k_pos = tl.where(in_step, k_pos, offs_n.to(tl.int64))
                keep = keep & ((q_pos[:, None] - k_pos[None, :]) < window)
            else:
                keep = keep & ((row_pos[:, None] - offs_n[None, :]) < window)
        s = tl.where(keep, s, float("-inf"))
    elif BOUNDED:
        s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                  # rows with nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_IEEE)
    return acc, m_new, l_i
