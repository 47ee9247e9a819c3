"""The dense GEMV's epilogues (`dense_gemv.py`): what is done with a program's finished sums.

* plain: + bias, stored in x's dtype.
* `ROPE` (`_rope_store`): a fused QKV projection's rotation and KV-cache write.
* `ADD` (`dense_gemv(..., add=residual)`, `kernels.linear_add`): the projection before an
  RMSNorm (o, down) also adds the residual stream, rounded as `rms_norm`'s add rounds it, and
  stores that sum h instead of its own output; each program writes the sum of squares of its
  features of h ([rows, programs], fp32). The GEMV after the norm (`NORM` with `ss=`) then
  takes the row's sum of squares from those partials instead of from h: the norm's own launch
  goes away, and no program repeats the row's sum.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rope_store(y, mi, M, pid_n, out_ptr, pos_ptr, cs_ptr, s_cs, q_ptr, s_q, kc_ptr, vc_ptr,
                slot_ptr, s_kcb, s_kcs, s_vcb, s_vcs, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr,
                HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """ROPE's epilogue: y [BM, BN] holds features j and j + HEAD_DIM/2 of one head, interleaved
    (the kernel's ROPE row order). Rounded to x's dtype as the stored projection would be, then as
    `qkv_rope_triton` does it: q rotated into q, k rotated into the k cache, v into the v
    cache, at each row's slot (-1: not written)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    HB: tl.constexpr = BLOCK_N // 2
    head = pid_n // (HALF // HB)
    j = (pid_n % (HALF // HB)) * HB + tl.arange(0, HB)
    v = y.to(out_ptr.dtype.element_ty)
    v1, v2 = tl.split(tl.reshape(v, [BLOCK_M, HB, 2]))
    a = v1.to(tl.float32)
    b = v2.to(tl.float32)
    mmask = mi < M
    rmask = mmask[:, None] & (j < HALF)[None, :]
    pos = tl.load(pos_ptr + mi, mask=mmask, other=0).to(tl.int64)
    cs = cs_ptr + pos[:, None] * s_cs + j[None, :]
    cos = tl.load(cs, mask=rmask, other=0.0).to(tl.float32)
    sin = tl.load(cs + HALF, mask=rmask, other=0.0).to(tl.float32)
    r1 = a * cos - b * sin
    r2 = b * cos + a * sin
    if head < NQ:
        dst = q_ptr + mi[:, None].to(tl.int64) * s_q + head * HEAD_DIM + j[None, :]
        tl.store(dst, r1.to(q_ptr.dtype.element_ty), mask=rmask)
        tl.store(dst + HALF, r2.to(q_ptr.dtype.element_ty), mask=rmask)
    else:
        slot = tl.load(slot_ptr + mi, mask=mmask, other=-1).to(tl.int64)
        smask = rmask & (slot >= 0)[:, None]
        page = tl.where(slot >= 0, slot, 0) // PAGE_SIZE
        off = tl.where(slot >= 0, slot, 0) % PAGE_SIZE
        if head < NQ + NKV:  # rounded to x's dtype, then to the cache's, as the reference does
            dst = kc_ptr + page[:, None] * s_kcb + off[:, None] * s_kcs + \
                (head - NQ) * HEAD_DIM + j[None, :]
            dt = kc_ptr.dtype.element_ty
            tl.store(dst, r1.to(v.dtype).to(dt), mask=smask)
            tl.store(dst + HALF, r2.to(v.dtype).to(dt), mask=smask)
        else:
            dst = vc_ptr + page[:, None] * s_vcb + off[:, None] * s_vcs + \
                (head - NQ - NKV) * HEAD_DIM + j[None, :]
            tl.store(dst, v1.to(vc_ptr.dtype.element_ty), mask=smask)
            tl.store(dst + HALF, v2.to(vc_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _epilogue(y, mi, M, N, rows, nmask, pid_n, bias_ptr, out_ptr, s_om, r_ptr, s_rm, ss_ptr,
              n_ss, pos_ptr, cs_ptr, s_cs, q_ptr, s_q, kc_ptr, vc_ptr, slot_ptr, s_kcb, s_kcs,
              s_vcb, s_vcs, HAS_BIAS: tl.constexpr, ROPE: tl.constexpr, ADD: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NQ: tl.constexpr,
              NKV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The finished sums y [BM, BN] of features `rows`: + bias, then stored (or ROPE's), with
    ADD as x's dtype + the residual, and this program's sums of squares of that."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows[None, :], mask=nmask[None, :], other=0.0).to(tl.float32)
    if ROPE:
        _rope_store(y, mi, M, pid_n, out_ptr, pos_ptr, cs_ptr, s_cs, q_ptr, s_q, kc_ptr, vc_ptr,
                    slot_ptr, s_kcb, s_kcs, s_vcb, s_vcs, BLOCK_M, BLOCK_N, NQ, NKV, HEAD_DIM,
                    PAGE_SIZE)
    else:
        omask = (mi < M)[:, None] & nmask[None, :]
        v = y.to(out_ptr.dtype.element_ty)
        if ADD:  # the projection as stored, + the residual, rounded: rms_norm's add
            r = tl.load(r_ptr + mi[:, None].to(tl.int64) * s_rm + rows[None, :], mask=omask,
                        other=0.0)
            v = (v.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
            h = tl.where(omask, v.to(tl.float32), 0.0)
            tl.store(ss_ptr + mi * n_ss + pid_n, tl.sum(h * h, 1), mask=mi < M)
        tl.store(out_ptr + mi[:, None] * s_om + rows[None, :], v, mask=omask)


@triton.jit
def _row_rstd(ss_ptr, n_ss, mi, M, K, eps, BLOCK_M: tl.constexpr, BLOCK_SS: tl.constexpr):
    """[BM] 1 / sqrt(mean square + eps) of rows mi from the ADD epilogue's n_ss partial sums
    of squares a row (summed in program order: the same on every run)."""
    j = tl.arange(0, BLOCK_SS)
    ss = tl.load(ss_ptr + mi[:, None] * n_ss + j[None, :],
                 mask=(mi < M)[:, None] & (j < n_ss)[None, :], other=0.0)
    return 1.0 / tl.sqrt(tl.sum(ss, 1) / K + eps)
