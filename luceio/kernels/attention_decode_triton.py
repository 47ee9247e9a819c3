"""The split decode attention's kernels (`attention_triton.paged_attention` launches them;
its docstring describes the split and the reduce): one query token a request, a program per
(request, KV head, split), and the reduce that merges a request's splits in use."""
from __future__ import annotations

import triton
import triton.language as tl

from .attention_tile_triton import _attend_tile
from .pdl import pdl_enter
from .quant_x import emit_xq


@triton.jit
def _split_range(seq_len, window, num_splits, min_tokens_per_split, BLOCK_N: tl.constexpr):
    """(first key, keys per split, splits in use, >= 1) of one decode query: its keys from
    `lo` cut evenly over the splits, at least `min_tokens_per_split` and whole tiles each."""
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    tokens_per_split = tl.cdiv(tl.maximum(tl.cdiv(seq_len - lo, num_splits),
                                          min_tokens_per_split), BLOCK_N) * BLOCK_N
    used = tl.minimum(tl.maximum(tl.cdiv(seq_len - lo, tokens_per_split), 1), num_splits)
    return lo, tokens_per_split, used


@triton.jit(do_not_specialize=["s_bt"])  # eager steps' tables vary in width
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, po_ptr, pl_ptr,
                   scale_log2, min_tokens_per_split, num_splits, window,
                   s_qt, s_qh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch, s_bt, s_ot, s_oh,
                   xq0, xs0, xsum0, xq1, xs1, xsum1,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   DIRECT_OUT: tl.constexpr, DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr,
                   XQ_PLANES: tl.constexpr = False, XQ_GROUPS: tl.constexpr = False,
                   PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    pdl_enter(PDL, PDL_EARLY)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    if tl.load(qsl_ptr + b + 1) - q_start == 0:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    num_heads = tl.num_programs(1) * GROUP

    rows = tl.arange(0, BLOCK_H)
    hmask = rows < GROUP
    heads = kvh * GROUP + rows
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    qmask = hmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + q_start.to(tl.int64) * s_qt + heads[:, None] * s_qh + offs_d[None, :],
                mask=qmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # this sequence's own split of its real length (a graph's grid is sized for the longest
    # context it may see): splits past its end return at once, and the reduce reads only the
    # splits in use (`_split_range`). A sliding window: the splits cut only the keys the
    # query sees, from `lo`
    lo, tokens_per_split, used = _split_range(seq_len, window, num_splits, min_tokens_per_split,
                                              BLOCK_N)
    if split >= used:
        return
    start = lo + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    kc = kc_ptr + kvh * s_kch
    vc = vc_ptr + kvh * s_vch
    bt = bt_ptr + b.to(tl.int64) * s_bt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, kc, vc, bt, n0, end, rows, scale_log2,
                                     s_kcb, s_kcs, s_vcb, s_vcs, offs_d, dmask, BLOCK_N, PAGE_SIZE,
                                     False, False, DOT_F32, DOT_IEEE)
    for n0 in range(full_end, end, BLOCK_N):  # at most one partial tile
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, kc, vc, bt, n0, end, rows, scale_log2,
                                     s_kcb, s_kcs, s_vcb, s_vcs, offs_d, dmask, BLOCK_N, PAGE_SIZE,
                                     True, False, DOT_F32, DOT_IEEE)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if DIRECT_OUT:
        o = o.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + q_start.to(tl.int64) * s_ot + heads[:, None] * s_oh + offs_d[None, :],
                 o, mask=qmask)
        # one token: the group's heads are consecutive groups of 32 of the o projection's input
        g0 = kvh * (GROUP * HEAD_DIM // 32)
        emit_xq(tl.reshape(o.to(tl.float32), [BLOCK_H * BLOCK_D]), g0,
                g0 + GROUP * HEAD_DIM // 32, num_heads * HEAD_DIM // 32,
                xq0, xs0, xsum0, xq1, xs1, xsum1, BLOCK_H * BLOCK_D, XQ_PLANES, XQ_GROUPS)
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 domain
        part = (b.to(tl.int64) * num_heads + heads) * num_splits + split   # [B, H, S] index
        tl.store(pl_ptr + part, lse, mask=hmask)
        tl.store(po_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=qmask)


@triton.jit
def _decode_reduce_kernel(po_ptr, pl_ptr, qsl_ptr, seq_lens_ptr, out_ptr, num_splits,
                          min_tokens_per_split, window, s_ot, s_oh,
                          xq0, xs0, xsum0, xq1, xs1, xsum1,
                          HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_N: tl.constexpr,
                          XQ_PLANES: tl.constexpr = False, XQ_GROUPS: tl.constexpr = False,
                          PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    pdl_enter(PDL, PDL_EARLY)
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(qsl_ptr + b)
    if tl.load(qsl_ptr + b + 1) - q_start == 0:
        return
    _, _, used = _split_range(tl.load(seq_lens_ptr + b), window, num_splits,
                              min_tokens_per_split, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < used  # the splits past the sequence's end wrote nothing
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    base = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
    lse = tl.load(pl_ptr + base + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(po_ptr + (base + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    den = tl.sum(w, 0)
    den = tl.where(den == 0.0, 1.0, den)
    res = (tl.sum(o * w[:, None], 0) / den).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + q_start.to(tl.int64) * s_ot + h * s_oh + offs_d, res, mask=dmask)
    g0 = h * (HEAD_DIM // 32)  # one token: head h is groups g0 ... of the o projection's input
    emit_xq(res.to(tl.float32), g0, g0 + HEAD_DIM // 32, tl.num_programs(1) * HEAD_DIM // 32,
            xq0, xs0, xsum0, xq1, xs1, xsum1, BLOCK_D, XQ_PLANES, XQ_GROUPS)
