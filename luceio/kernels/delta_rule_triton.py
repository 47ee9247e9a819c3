"""Triton kernels for the Gated DeltaNet's decode step (`delta_rule.gated_delta_rule_recurrent`,
its torch reference and the CPU path): one token per sequence, the state read and written once.

A program owns (sequence, v head, BLOCK_V columns of the state): it loads the state tile
[k_dim, BLOCK_V] of the sequence's slot in fp32, decays it, writes the delta rule's correction
and stores it back, then reads the output off the new state; q and k (l2-normalised here, q
scaled by k_dim ** -0.5) are the token's key head's. Nothing is shared between programs, so the
state moves through memory exactly once per step.

Around it, one launch each: `conv_gates_decode` (the causal conv + SiLU, the conv state's
shift, the decay and write gates) and `gated_rms_norm` (the output's gated norm), in place of
~25 small torch ops per layer; each follows its torch reference's roundings.
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


@triton.jit
def _conv_gates_kernel(x_ptr, cs_ptr, w_ptr, slots_ptr, out_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr,
                       g_ptr, beta_ptr, s_xt, s_cs, s_cc, s_wc, s_ot, s_at, s_bt, C, H,
                       KSIZE: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    """One token per sequence: the depthwise causal conv + SiLU over BLOCK_C channels, the conv
    state shifted by the token; the first channel block also computes the token's gates."""
    t = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + t)
    cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    js = tl.arange(0, KP)
    cm = cs < C
    x = tl.load(x_ptr + t * s_xt + cs, mask=cm, other=0.0).to(tl.float32)
    sp = cs_ptr + slot * s_cs + cs[:, None] * s_cc + js[None, :]
    past = tl.load(sp, mask=cm[:, None] & (js[None, :] < KSIZE - 1), other=0.0).to(tl.float32)
    window = tl.where(js[None, :] == KSIZE - 1, x[:, None], past)     # [BLOCK_C, KP]
    w = tl.load(w_ptr + cs[:, None] * s_wc + js[None, :],
                mask=cm[:, None] & (js[None, :] < KSIZE), other=0.0).to(tl.float32)
    # the reference's roundings: products in the dtype, their sum, then SiLU
    acc = tl.sum((w * window).to(dt).to(tl.float32), 1).to(dt).to(tl.float32)
    tl.store(out_ptr + t * s_ot + cs, (acc / (1.0 + tl.exp(-acc))).to(dt), mask=cm)
    # the state keeps the last KSIZE - 1 inputs: [past[1:], x]; every load of the row is done
    # before any thread overwrites it
    nxt = tl.load(sp + 1, mask=cm[:, None] & (js[None, :] < KSIZE - 2), other=0.0)
    nxt = tl.where(js[None, :] == KSIZE - 2, x[:, None].to(nxt.dtype), nxt)
    tl.debug_barrier()
    tl.store(sp, nxt, mask=cm[:, None] & (js[None, :] < KSIZE - 1))
    if cb == 0:
        hs = tl.arange(0, BLOCK_H)
        hm = hs < H
        a = tl.load(a_ptr + t * s_at + hs, mask=hm, other=0.0).to(tl.float32)
        a = a + tl.load(dtb_ptr + hs, mask=hm, other=0.0).to(tl.float32)
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        decay = tl.exp(tl.load(alog_ptr + hs, mask=hm, other=0.0).to(tl.float32))
        tl.store(g_ptr + t * H + hs, -decay * softplus, mask=hm)
        b = tl.load(b_ptr + t * s_bt + hs, mask=hm, other=0.0)
        beta = (1.0 / (1.0 + tl.exp(-b.to(tl.float32)))).to(b.dtype).to(tl.float32)
        tl.store(beta_ptr + t * H + hs, beta, mask=hm)


def conv_gates_decode(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                      a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                      dt_bias: torch.Tensor, slots: torch.Tensor):
    """`delta_rule.causal_conv1d_update` and `delta_rule.gdn_gates` in one launch: x [n,
    conv_dim] (last dim contiguous), conv_state [num_slots, conv_dim, kernel - 1] (rows `slots`
    shifted in place), weight [conv_dim, kernel]; a, b [n, v_heads]. Returns (the conv's output
    [n, conv_dim] in x's dtype, g and beta [n, v_heads] fp32)."""
    n, conv_dim = x.shape
    ksize = weight.shape[-1]
    heads = a.shape[-1]
    if x.stride(-1) != 1 or conv_state.stride(-1) != 1 or weight.stride(-1) != 1 or \
            a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("conv_gates_decode needs contiguous last dims")
    if ksize < 2:
        raise ValueError(f"a causal conv of kernel {ksize}: at least 2 taps")
    out = torch.empty((n, conv_dim), dtype=x.dtype, device=x.device)
    g = torch.empty((n, heads), dtype=torch.float32, device=x.device)
    beta = torch.empty_like(g)
    if n:
        block_c = min(512, triton.next_power_of_2(conv_dim))
        _conv_gates_kernel[(n, triton.cdiv(conv_dim, block_c))](
            x, conv_state, weight, slots, out, a, b, A_log, dt_bias, g, beta, x.stride(0),
            conv_state.stride(0), conv_state.stride(1), weight.stride(0), out.stride(0),
            a.stride(0), b.stride(0), conv_dim, heads, KSIZE=ksize,
            KP=triton.next_power_of_2(ksize), BLOCK_C=block_c,
            BLOCK_H=triton.next_power_of_2(heads), num_warps=4)
    return out, g, beta


@triton.jit
def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, eps, H, s_xt, s_xh, s_zt, s_zh, s_ot, s_oh,
                       V: tl.constexpr, BLOCK: tl.constexpr):
    """One (token, head) row: rmsnorm in fp32, cast, times the weight in the dtype, times
    silu(z) in fp32, cast (`delta_rule.gated_rms_norm`'s roundings)."""
    row = tl.program_id(0).to(tl.int64)
    t, h = row // H, row % H
    vs = tl.arange(0, BLOCK)
    m = vs < V
    x = tl.load(x_ptr + t * s_xt + h * s_xh + vs, mask=m, other=0.0)
    hf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / V + eps)
    y = (hf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + vs, mask=m, other=0.0).to(tl.float32)
    y = (w * y).to(x.dtype).to(tl.float32)
    z = tl.load(z_ptr + t * s_zt + h * s_zh + vs, mask=m, other=0.0).to(tl.float32)
    o = y * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + t * s_ot + h * s_oh + vs, o.to(out_ptr.dtype.element_ty), mask=m)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """`delta_rule.gated_rms_norm` for x, gate [n, heads, v_dim] (last dims contiguous)."""
    n, heads, v = x.shape
    if x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("gated_rms_norm needs contiguous last dims")
    out = torch.empty((n, heads, v), dtype=x.dtype, device=x.device)
    if n:
        _gated_norm_kernel[(n * heads,)](
            x, gate, weight.contiguous(), out, float(eps), heads, x.stride(0), x.stride(1),
            gate.stride(0), gate.stride(1), out.stride(0), out.stride(1), V=v,
            BLOCK=triton.next_power_of_2(v), num_warps=1 if v <= 256 else 4)
    return out
