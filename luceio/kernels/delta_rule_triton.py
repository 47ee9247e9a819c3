"""Triton kernel for the Gated DeltaNet's decode step (`delta_rule.gated_delta_rule_recurrent`,
its torch reference and the CPU path): one token per sequence, the state read and written once.

A program owns (sequence, v head, BLOCK_V columns of the state): it loads the state tile
[k_dim, BLOCK_V] of the sequence's slot in fp32, decays it, writes the delta rule's correction
and stores it back, then reads the output off the new state; q and k (l2-normalised here, q
scaled by k_dim ** -0.5) are the token's key head's. Nothing is shared between programs, so the
state moves through memory exactly once per step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .delta_rule import L2NORM_EPS


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr,
                       s_qt, s_qh, s_vt, s_vh, s_gt, s_ot, s_oh, s_ss, s_sh, s_sk, eps, scale,
                       GROUP: tl.constexpr, TILED: tl.constexpr, K_DIM: tl.constexpr,
                       V_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if TILED:  # llama.cpp's v-head order: v heads cycle over the k heads
        kh = h % (tl.num_programs(1) // GROUP)
    else:
        kh = h // GROUP
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    km, vm = ks < K_DIM, vs < V_DIM
    q = tl.load(q_ptr + b * s_qt + kh * s_qh + ks, mask=km, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * s_qt + kh * s_qh + ks, mask=km, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + eps)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + eps))
    v = tl.load(v_ptr + b * s_vt + h * s_vh + vs, mask=vm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * s_gt + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * s_gt + h).to(tl.float32)
    slot = tl.load(slots_ptr + b)
    sp = state_ptr + slot * s_ss + h * s_sh + ks[:, None] * s_sk + vs[None, :]
    mask = km[:, None] & vm[None, :]
    s = tl.load(sp, mask=mask, other=0.0) * tl.exp(g)                 # [BLOCK_K, BLOCK_V]
    delta = (v - tl.sum(s * k[:, None], 0)) * beta                      # [BLOCK_V]
    s = s + k[:, None] * delta[None, :]
    tl.store(sp, s, mask=mask)
    o = tl.sum(s * q[:, None], 0)
    tl.store(out_ptr + b * s_ot + h * s_oh + vs, o.to(out_ptr.dtype.element_ty), mask=vm)


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
               tiled: bool = False) -> torch.Tensor:
    """`delta_rule.gated_delta_rule_recurrent` on the GPU (same arguments and result): q, k
    [num_seqs, k_heads, k_dim]; v [num_seqs, v_heads, v_dim]; g, beta [num_seqs, v_heads];
    state [num_slots, v_heads, k_dim, v_dim] fp32, rows `slots` updated in place."""
    n, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[1:]
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError("the DeltaNet state must be fp32 with a contiguous last dim")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if k.stride() != q.stride():
        k = k.contiguous()
        q = q.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty_like(v)
    if n == 0:
        return out
    block_v = min(32, triton.next_power_of_2(v_dim))
    _gdn_decode_kernel[(n, v_heads, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, state, slots, out, q.stride(0), q.stride(1), v.stride(0), v.stride(1),
        g.stride(0), out.stride(0), out.stride(1), state.stride(0), state.stride(1),
        state.stride(2), L2NORM_EPS, k_dim ** -0.5, GROUP=v_heads // k_heads, TILED=tiled, K_DIM=k_dim,
        V_DIM=v_dim, BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v,
        num_warps=4 if k_dim * block_v >= 4096 else 2)
    return out
