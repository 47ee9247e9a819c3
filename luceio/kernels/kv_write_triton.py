"""Triton write of new keys and values into the paged KV cache (reference: `attention.write_kv_ref`):
one program per token writes all its KV heads to `slot_mapping[t]` (< 0: skipped)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import get_config
from .pdl import pdl_enter, pdl_kwargs


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     s_kt, s_kh, s_vt, s_vh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    pdl_enter(PDL, PDL_EARLY)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * s_kt + h[:, None] * s_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * s_vt + h[:, None] * s_vh + d[None, :], mask=mask)
    tl.store(kc_ptr + page * s_kcb + off * s_kcs + h[:, None] * s_kch + d[None, :],
             k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + page * s_vcb + off * s_vcs + h[:, None] * s_vch + d[None, :],
             v.to(vc_ptr.dtype.element_ty), mask=mask)



def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens], -1 = skip."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[-2:]
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v need a contiguous last dim"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
        **pdl_kwargs(k.device, get_config(k.device), num_tokens))
