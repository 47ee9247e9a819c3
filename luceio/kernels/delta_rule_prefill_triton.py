"""Triton kernel for the Gated DeltaNet's chunked prefill (`delta_rule.gated_delta_rule_chunked`,
its torch reference and the CPU path): a varlen batch, each sequence continuing from its state
slot, in chunks of BLOCK_T tokens with the chunk form of `delta_rule`'s module docstring.

A program owns (sequence, v head, BLOCK_V columns of the state): the state tile [k_dim, BLOCK_V]
stays in registers (fp32) while the program walks the sequence's chunks, and is stored once at
the end. Per chunk, with G_t = exp(cumsum g) and A[t, j] = beta_t (G_t / G_j) k_t.k_j for j < t:
- U = (I + A)^-1 diag(beta) (V - diag(G) K S): A is strictly lower triangular, so A^BLOCK_T = 0
  and (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^(BLOCK_T / 2)), log2(BLOCK_T) - 1 matrix
  products instead of a sequential substitution (the reference solves the triangular system);
- O = diag(G) Q S + (causal (G_t / G_j) q_t.k_j) U;  S = G_L S + (K diag(G_L / G_j))^T U.
Every exponent is <= 0 (g <= 0, masked above the diagonal before exp), so nothing overflows.
Tokens past a sequence's end load as zeros (beta = g = 0): they add nothing and keep G_L. The
v-column blocks are independent (A does not depend on v), so programs share nothing. The
products run in fp32 (`input_precision="ieee"`, not TF32): outputs equal the reference up to
float rounding, as any other chunking of the same prompt does.
q and k are l2-normalised here and q scaled by k_dim ** -0.5 (`delta_rule._prepare_qk`); v head
h reads k head h // GROUP, or h % k heads with TILED (llama.cpp's order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .delta_rule import L2NORM_EPS

BLOCK_T = 32  # tokens a chunk
BLOCK_V = 32  # state columns a program


@triton.jit
def _gdn_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, cu_ptr,
                      out_ptr, s_qt, s_qh, s_vt, s_vh, s_gt, s_ot, s_oh, s_ss, s_sh, s_sk, eps,
                      scale, GROUP: tl.constexpr, TILED: tl.constexpr, K_DIM: tl.constexpr,
                      V_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                      BLOCK_T: tl.constexpr, LOG_T: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if TILED:
        kh = h % (tl.num_programs(1) // GROUP)
    else:
        kh = h // GROUP
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ts = tl.arange(0, BLOCK_T)
    km, vm = ks < K_DIM, vs < V_DIM
    causal = ts[:, None] >= ts[None, :]
    strict = ts[:, None] > ts[None, :]
    eye = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0)
    slot = tl.load(slots_ptr + b)
    sp = state_ptr + slot * s_ss + h * s_sh + ks[:, None] * s_sk + vs[None, :]
    smask = km[:, None] & vm[None, :]
    s = tl.load(sp, mask=smask, other=0.0)                            # [BLOCK_K, BLOCK_V]
    for c0 in range(start, end, BLOCK_T):
        t = c0 + ts
        tm = t < end
        qk_mask = tm[:, None] & km[None, :]
        q = tl.load(q_ptr + t[:, None] * s_qt + kh * s_qh + ks[None, :], mask=qk_mask,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t[:, None] * s_qt + kh * s_qh + ks[None, :], mask=qk_mask,
                    other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, 1) + eps))[:, None] * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, 1) + eps))[:, None]
        v = tl.load(v_ptr + t[:, None] * s_vt + h * s_vh + vs[None, :],
                    mask=tm[:, None] & vm[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * s_gt + h, mask=tm, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * s_gt + h, mask=tm, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)                                          # log G_t
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        a = tl.where(strict, beta[:, None] * decay * kk, 0.0)
        rhs = beta[:, None] * (v - tl.exp(gc)[:, None] * tl.dot(k, s, input_precision="ieee"))
        inv = eye - a                                                 # (I + A)^-1, see above
        p = tl.dot(a, a, input_precision="ieee")
        for _ in tl.static_range(1, LOG_T):
            inv = inv + tl.dot(inv, p, input_precision="ieee")
            p = tl.dot(p, p, input_precision="ieee")
        u = tl.dot(inv, rhs, input_precision="ieee")                  # [BLOCK_T, BLOCK_V]
        qk = tl.where(causal, decay * tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)
        o = tl.exp(gc)[:, None] * tl.dot(q, s, input_precision="ieee") + \
            tl.dot(qk, u, input_precision="ieee")
        tl.store(out_ptr + t[:, None] * s_ot + h * s_oh + vs[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=tm[:, None] & vm[None, :])
        last = tl.sum(tl.where(ts == BLOCK_T - 1, gc, 0.0), 0)        # log G_L (pads add 0)
        to_end = tl.exp(last - gc)
        s = tl.exp(last) * s + tl.dot(tl.trans(k * to_end[:, None]), u, input_precision="ieee")
    tl.store(sp, s, mask=smask)


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                slots: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """`delta_rule.gated_delta_rule_chunked` on the GPU (same arguments and result): q, k
    [num_tokens, k_heads, k_dim]; v [num_tokens, v_heads, v_dim]; g, beta [num_tokens, v_heads];
    cu_seqlens [num_seqs + 1]; state [num_slots, v_heads, k_dim, v_dim] fp32, rows `slots`
    replaced by the state after each sequence's last token."""
    n, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[1], v.shape[2]
    if q.stride(-1) != 1 or k.stride() != q.stride() or v.stride(-1) != 1 or \
            state.dtype != torch.float32 or not state[0].is_contiguous():
        raise ValueError("gdn_prefill: q, k, v need unit last strides (q and k alike) and a "
                         "contiguous fp32 state")
    g, beta = g.contiguous(), beta.contiguous()
    out = torch.empty_like(v)
    seqs = cu_seqlens.numel() - 1
    if n == 0 or seqs == 0:
        return out
    block_k = max(16, triton.next_power_of_2(k_dim))
    _gdn_chunk_kernel[(seqs, v_heads, triton.cdiv(v_dim, BLOCK_V))](
        q, k, v, g, beta, state, slots, cu_seqlens, out, q.stride(0), q.stride(1), v.stride(0),
        v.stride(1), g.stride(0), out.stride(0), out.stride(1), state.stride(0),
        state.stride(1), state.stride(2), L2NORM_EPS, k_dim ** -0.5,
        GROUP=v_heads // k_heads, TILED=tiled, K_DIM=k_dim, V_DIM=v_dim, BLOCK_K=block_k,
        BLOCK_V=BLOCK_V, BLOCK_T=BLOCK_T, LOG_T=BLOCK_T.bit_length() - 1, num_warps=4)
    return out
