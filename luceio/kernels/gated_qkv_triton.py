"""Qwen3.5's full-attention input stage in one launch: from the fused projection's output
(per q head [query | gate], then k, then v) to the rotated q, with k and v in the paged cache.

Per token (one program holds all its heads), as `qwen3_5.GatedAttention`'s torch sequence
rounds: each q and k head normed in fp32 and scaled by (1 + w) in fp32, rounded to the dtype
(Gemma's RMSNorm); the first `rotary_dim` dims rotated half against half in fp32 from the
rounded values and rounded once, the rest kept; k and v cast to the cache's dtype and written
at the token's slot (-1: not written). A rotated dim reads its partner dim (d +- rotary_dim / 2)
as a second load of the same head. The gates stay where they are: the caller takes them as a
view of the projection.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope(ptrs, mask, w_ptr, d, partner, rot, cos, sin, sign, eps,
               HEAD_DIM: tl.constexpr, dt: tl.constexpr):
    """[heads, BLOCK_D] heads at `ptrs` (+ d), normed and partly rotated, rounded to dt."""
    x = tl.load(ptrs + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(ptrs + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
    w = 1.0 + tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    wp = 1.0 + tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    a = (x * rstd[:, None] * w[None, :]).to(dt).to(tl.float32)
    ap = (xp * rstd[:, None] * wp[None, :]).to(dt).to(tl.float32)
    return tl.where(rot[None, :], a * cos[None, :] + sign[None, :] * ap * sin[None, :], a).to(dt)


@triton.jit
def _gated_qkv_kernel(qkv_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, q_ptr, qn_ptr, kn_ptr,
                      eps, s_t, s_cs, s_qt, s_kcb, s_kcs, s_vcb, s_vcs,
                      NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                      ROT: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    HALF: tl.constexpr = ROT // 2
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    rot = d < ROT
    first = d < HALF
    j = tl.where(first, d, d - HALF)
    cos = tl.load(cs_ptr + pos * s_cs + j, mask=rot, other=1.0)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + j, mask=rot, other=0.0)
    partner = tl.where(first, d + HALF, d - HALF)
    sign = tl.where(first, -1.0, 1.0)
    dt = q_ptr.dtype.element_ty
    row = qkv_ptr + t * s_t
    hq = tl.arange(0, BLOCK_Q)
    qmask = (hq < NUM_Q)[:, None] & dm[None, :]
    q = _norm_rope(row + hq[:, None] * (2 * HEAD_DIM), qmask, qn_ptr, d, partner, rot, cos, sin,
                   sign, eps, HEAD_DIM, dt)
    tl.store(q_ptr + t * s_qt + hq[:, None] * HEAD_DIM + d[None, :], q, mask=qmask)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        hk = tl.arange(0, BLOCK_KV)
        kmask = (hk < NUM_KV)[:, None] & dm[None, :]
        kbase = row + NUM_Q * 2 * HEAD_DIM
        k = _norm_rope(kbase + hk[:, None] * HEAD_DIM, kmask, kn_ptr, d, partner, rot, cos, sin,
                       sign, eps, HEAD_DIM, dt)
        v = tl.load(kbase + NUM_KV * HEAD_DIM + hk[:, None] * HEAD_DIM + d[None, :], mask=kmask,
                    other=0.0)
        block, off = slot // PAGE_SIZE, slot % PAGE_SIZE
        cache = hk[:, None] * HEAD_DIM + d[None, :]
        tl.store(kc_ptr + block * s_kcb + off * s_kcs + cache,
                 k.to(kc_ptr.dtype.element_ty), mask=kmask)
        tl.store(vc_ptr + block * s_vcb + off * s_vcs + cache,
                 v.to(vc_ptr.dtype.element_ty), mask=kmask)


def gated_qkv_rope_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                         rotary_dim: int, q_norm: torch.Tensor, k_norm: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """qkv [n, num_heads * 2 * head_dim + 2 * num_kv_heads * head_dim] (last dim contiguous);
    cos_sin [positions, rotary_dim] (cos | sin); caches [blocks, page, kv heads, head_dim]
    (heads and dims contiguous). Returns q [n, num_heads, head_dim], normed and rotated; writes
    k (normed, rotated) and v at `slot_mapping`."""
    n = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    if qkv.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or \
            k_cache.stride(-2) != head_dim or v_cache.stride(-2) != head_dim:
        raise ValueError("gated_qkv_rope_cache needs contiguous heads")
    q = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n:
        _gated_qkv_kernel[(n,)](
            qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, q, q_norm, k_norm,
            float(eps), qkv.stride(0), cos_sin.stride(0), q.stride(0), k_cache.stride(0),
            k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), NUM_Q=num_heads,
            NUM_KV=num_kv_heads, HEAD_DIM=head_dim, ROT=rotary_dim, PAGE_SIZE=k_cache.shape[1],
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_Q=triton.next_power_of_2(num_heads),
            BLOCK_KV=triton.next_power_of_2(num_kv_heads), num_warps=4)
    return q
