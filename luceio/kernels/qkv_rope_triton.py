"""`qkv_rope_cache` in one Triton launch (see qkv_rope.py): one program per token holds all
its heads. Arithmetic as the reference's kernels do it: the per-head norm in fp32, rounded to
the activation dtype, then scaled by the weight and rounded again (HF's RMSNorm); the rotation
in fp32 from the rounded values, rounded once; k and v cast to the cache's dtype. Without the
norm the result equals the reference's bit for bit; with it, to the order of the norm's sum
of squares (two half sums added here)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import get_config
from .elementwise_triton import cos_sin_at
from .pdl import pdl_enter, pdl_kwargs


@triton.jit
def _heads(base, s_h, half, hmask, NUM: tl.constexpr, HALF: tl.constexpr,
           BLOCK_H: tl.constexpr):
    """[BLOCK_H, BLOCK_HALF] first and second halves of NUM heads at `base` (stride s_h)."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < NUM)[:, None] & hmask[None, :]
    p = base + h[:, None] * s_h + half[None, :]
    return tl.load(p, mask=mask, other=0.0), tl.load(p + HALF, mask=mask, other=0.0), mask


@triton.jit
def _norm_rotate(x1, x2, w_ptr, half, hmask, cos, sin, eps, NORM: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / HEAD_DIM + eps)
        w1 = tl.load(w_ptr + half, mask=hmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + half, mask=hmask, other=0.0).to(tl.float32)
        a = (w1[None, :] * (a * rstd[:, None]).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        b = (w2[None, :] * (b * rstd[:, None]).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a * cos[None, :] - b * sin[None, :], b * cos[None, :] + a * sin[None, :]


@triton.jit
def _qkv_rope_cache_kernel(qkv_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, q_ptr,
                           qn_ptr, kn_ptr, eps, s_t, s_cs, s_qt, s_kcb, s_kcs, s_vcb, s_vcs,
                           NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                           PAGE_SIZE: tl.constexpr, NORM: tl.constexpr,
                           BLOCK_HALF: tl.constexpr, BLOCK_Q: tl.constexpr,
                           BLOCK_KV: tl.constexpr,
                           PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    pdl_enter(PDL, PDL_EARLY)
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    half, hmask, cos, sin = cos_sin_at(t, pos_ptr, cs_ptr, s_cs, HALF, BLOCK_HALF)
    row = qkv_ptr + t * s_t
    x1, x2, mask = _heads(row, HEAD_DIM, half, hmask, NUM_Q, HALF, BLOCK_Q)
    y1, y2 = _norm_rotate(x1, x2, qn_ptr, half, hmask, cos, sin, eps, NORM, HEAD_DIM, HALF)
    hq = tl.arange(0, BLOCK_Q)
    out = q_ptr + t * s_qt + hq[:, None] * HEAD_DIM + half[None, :]
    tl.store(out, y1.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, y2.to(q_ptr.dtype.element_ty), mask=mask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        hk = tl.arange(0, BLOCK_KV)
        dst = page * s_kcb + off * s_kcs + hk[:, None] * HEAD_DIM + half[None, :]
        k1, k2, kmask = _heads(row + NUM_Q * HEAD_DIM, HEAD_DIM, half, hmask, NUM_KV, HALF,
                               BLOCK_KV)
        r1, r2 = _norm_rotate(k1, k2, kn_ptr, half, hmask, cos, sin, eps, NORM, HEAD_DIM, HALF)
        # the reference rounds the rotated k to the activation dtype, then to the cache's
        r1 = r1.to(k1.dtype).to(kc_ptr.dtype.element_ty)
        r2 = r2.to(k1.dtype).to(kc_ptr.dtype.element_ty)
        tl.store(kc_ptr + dst, r1, mask=kmask)
        tl.store(kc_ptr + dst + HALF, r2, mask=kmask)
        v1, v2, _ = _heads(row + (NUM_Q + NUM_KV) * HEAD_DIM, HEAD_DIM, half, hmask, NUM_KV,
                           HALF, BLOCK_KV)
        vdst = page * s_vcb + off * s_vcs + hk[:, None] * HEAD_DIM + half[None, :]
        tl.store(vc_ptr + vdst, v1.to(vc_ptr.dtype.element_ty), mask=kmask)
        tl.store(vc_ptr + vdst + HALF, v2.to(vc_ptr.dtype.element_ty), mask=kmask)


def qkv_rope_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   num_heads: int, num_kv_heads: int, q_norm: torch.Tensor | None = None,
                   k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Same contract as `qkv_rope.qkv_rope_cache_ref`."""
    n = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    for c in (k_cache, v_cache):
        if c.stride(-1) != 1 or c.stride(-2) != head_dim:
            raise ValueError("qkv_rope_cache: the cache's [heads, head_dim] must be contiguous")
    cs = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    norm = q_norm is not None
    qn = q_norm.contiguous() if norm else q
    kn = k_norm.contiguous() if norm else q
    block_half = triton.next_power_of_2(head_dim // 2)
    block_q = triton.next_power_of_2(num_heads)
    warps = max(1, min(8, block_q * block_half // 256))
    _qkv_rope_cache_kernel[(n,)](
        qkv, positions, cs, k_cache, v_cache, slot_mapping, q, qn, kn, float(eps),
        qkv.stride(0), cs.stride(0), q.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), NUM_Q=num_heads, NUM_KV=num_kv_heads,
        HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], NORM=norm, BLOCK_HALF=block_half,
        BLOCK_Q=block_q, BLOCK_KV=triton.next_power_of_2(num_kv_heads), num_warps=warps,
        **pdl_kwargs(qkv.device, get_config(qkv.device), n))
    return q
