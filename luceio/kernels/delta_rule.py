"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): torch references, the CPU path.

A Gated DeltaNet layer keeps, per request, a fixed-size recurrent state instead of a KV cache:
  state: [num_slots, num_v_heads, k_dim, v_dim]            (fp32; one row per request slot)
  conv_state: [num_slots, conv_dim, kernel_size - 1]       (the last kernel_size - 1 conv inputs)
Both pools are indexed by `slots` ([num_seqs] int64, distinct): sequence i reads and writes row
slots[i]. A fresh request's rows must be zero before its first chunk: zeros are exactly "no past".

Rules (what transformers' Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet compute):
  - Token layout is flat, like the attention kernels: [num_tokens, ...] with `cu_seqlens`
    ([num_seqs + 1], int) marking where each sequence's tokens start.
  - Causal conv: depthwise over the time axis, kernel_size taps, no bias, then SiLU. Each output
    sees the previous kernel_size - 1 inputs of its own sequence; conv_state supplies those that
    came before this chunk.
  - Gates: beta = sigmoid(b) is the write strength; g = -exp(A_log) * softplus(a + dt_bias) is
    the log decay (g <= 0: the state is multiplied by exp(g) each token).
  - Heads: q/k have num_k_heads, v has num_v_heads; k head h serves the num_v_heads // num_k_heads
    consecutive v heads h * group .. (h + 1) * group - 1 (HF's order). `tiled=True` takes
    llama.cpp's GGUF order instead, where v heads cycle over the k heads: v head j reads k head
    j % num_k_heads (its converter reorders every v-head tensor that way).
  - q and k are l2-normalised over k_dim (eps 1e-6 inside the rsqrt), then q is scaled by
    k_dim ** -0.5.
  - Per token t, per v head (S: [k_dim, v_dim]):
        S = exp(g_t) * S
        S = S + k_t (beta_t * (v_t - S^T k_t))^T      (the delta rule: write only the error)
        o_t = S^T q_t
  - The output is normalised per head by the gated RMSNorm: weight * rmsnorm(o) * silu(z).

Chunked prefill solves a chunk of L tokens at once. With G_t = exp(g_1 + .. + g_t) inside the
chunk and S0 the state before it, the deltas u_t = beta_t * (v_t - (decayed state)^T k_t) satisfy
    (I + A) U = diag(beta) (V - diag(G) K S0),   A[t, j] = beta_t (G_t / G_j) k_t.k_j  for j < t,
a unit lower-triangular system; then o_t = G_t S0^T q_t + sum_{j<=t} (G_t / G_j) (q_t.k_j) u_j and
S_L = G_L S0 + sum_j (G_L / G_j) k_j u_j^T. This is the recurrence above regrouped, so a prompt
split into engine chunks anywhere gives the same outputs and final state up to float rounding,
whatever `chunk_size` is.

GPU kernels: flash-linear-attention (PyPI `flash-linear-attention` 0.6.0, its kernels in `fla-core`,
MIT) has Triton kernels for exactly this math: `chunk_gated_delta_rule` (varlen via `cu_seqlens`),
`fused_recurrent_gated_delta_rule`, a causal-conv1d module. transformers calls them when fla is
importable. It asks for triton>=3.3 with no upper pin and torch>=2.7. Under TRITON_INTERPRET=1 on
the CPU (triton 3.9), the fused recurrent kernel runs and matches transformers' reference (fp32, ~1e-7).
The chunked kernels do not run: their autotuner benchmarks through a GPU driver, and with one
config forced the state-passing kernel (`chunk_delta_h`) stops on an interpreter error. So CI on
the CPU could check only fla's decode kernel; the chunked one needs the GPU tests. Its state is one
row per batch entry with no slot index: the engine would gather and scatter state rows around each
call, as `slots` does here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from luceio.kernels.norm import rms_norm_ref

L2NORM_EPS = 1e-6


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """a, b: [num_tokens, num_v_heads] projections; A_log, dt_bias: [num_v_heads].

    Returns (g, beta), both [num_tokens, num_v_heads]: g the fp32 log decay (<= 0), beta in (0, 1).
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """x, gate: [..., v_dim]; weight: [v_dim]. HF Qwen3NextRMSNormGated: norm in fp32, cast back,
    scale, then multiply by silu(gate) in fp32; the result is in x's dtype."""
    return (rms_norm_ref(x, weight, eps) * F.silu(gate.float())).to(x.dtype)


def causal_conv1d_varlen(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         cu_seqlens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over a varlen batch, continuing each sequence's conv_state.

    x: [num_tokens, conv_dim]; weight: [conv_dim, kernel_size]; conv_state: [num_slots, conv_dim,
    kernel_size - 1], rows slots[i] read and then overwritten with the last kernel_size - 1 inputs
    (old state included when the chunk is shorter). Returns [num_tokens, conv_dim] in x's dtype.
    """
    kernel_size = weight.shape[-1]
    out = torch.empty_like(x)
    starts = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        start, end = starts[i], starts[i + 1]
        past = conv_state[slot].transpose(0, 1)                       # [kernel_size - 1, conv_dim]
        window = torch.cat([past.to(weight.dtype), x[start:end].to(weight.dtype)])
        taps = window.unfold(0, kernel_size, 1)                       # [seq_len, conv_dim, kernel_size]
        out[start:end] = F.silu((taps * weight).sum(-1)).to(x.dtype)
        conv_state[slot] = window[-(kernel_size - 1):].transpose(0, 1).to(conv_state.dtype)
    return out


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """Decode step of `causal_conv1d_varlen`: one token per sequence, x: [num_seqs, conv_dim]."""
    window = torch.cat([conv_state[slots].to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=-1)
    conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)         # [num_seqs, conv_dim, k - 1]
    return F.silu((window * weight).sum(-1)).to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, tiled: bool = False):
    """q, k: [num_tokens, num_k_heads, k_dim] -> fp32 [num_tokens, num_v_heads, k_dim], l2-normed,
    q scaled by k_dim ** -0.5, each k head repeated for its v heads (grouped, or `tiled`)."""
    group = num_v_heads // q.shape[1]
    q, k = (_l2norm(x.float()) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    if tiled:
        return q.repeat(1, group, 1), k.repeat(1, group, 1)
    return q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor,
                               slots: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """Decode: one token per sequence.

    q, k: [num_seqs, num_k_heads, k_dim]; v: [num_seqs, num_v_heads, v_dim]; g, beta: [num_seqs,
    num_v_heads]; state: [num_slots, num_v_heads, k_dim, v_dim], rows slots[i] updated in place.
    Returns o: [num_seqs, num_v_heads, v_dim] in v's dtype.
    """
    q, k = _prepare_qk(q, k, v.shape[1], tiled)
    s = state[slots].float() * g.float().exp()[:, :, None, None]      # [num_seqs, h, k_dim, v_dim]
    predicted = torch.einsum("nhkv,nhk->nhv", s, k)
    delta = (v.float() - predicted) * beta.float()[:, :, None]
    s = s + k[:, :, :, None] * delta[:, :, None, :]
    state[slots] = s.to(state.dtype)
    return torch.einsum("nhkv,nhk->nhv", s, q).to(v.dtype)


def _chunk_step(q, k, v, g, beta, s0):
    """One chunk of one sequence, all heads. q, k: [h, L, k_dim]; v: [h, L, v_dim]; g, beta: [h, L];
    s0: [h, k_dim, v_dim]. Returns (o [h, L, v_dim], final state). See the module docstring."""
    length = q.shape[1]
    g_cum = g.cumsum(-1)                                              # [h, L], log G_t
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    # log(G_t / G_j), masked above the diagonal before exp so it cannot overflow
    decay = (g_cum[:, :, None] - g_cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    system = beta[:, :, None] * decay * (k @ k.transpose(1, 2))       # diagonal ignored: unit
    rhs = beta[:, :, None] * (v - g_cum.exp()[:, :, None] * (k @ s0))
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = g_cum.exp()[:, :, None] * (q @ s0) + (decay * (q @ k.transpose(1, 2))) @ u
    to_end = (g_cum[:, -1:] - g_cum).exp()                            # [h, L], G_L / G_j
    s = g_cum[:, -1].exp()[:, None, None] * s0 + (k * to_end[:, :, None]).transpose(1, 2) @ u
    return o, s


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                             slots: torch.Tensor, chunk_size: int = 64,
                             tiled: bool = False) -> torch.Tensor:
    """Prefill: a varlen batch, each sequence continuing from state[slots[i]].

    q, k: [num_tokens, num_k_heads, k_dim]; v: [num_tokens, num_v_heads, v_dim]; g, beta:
    [num_tokens, num_v_heads]; cu_seqlens: [num_seqs + 1]; state rows slots[i] are replaced by the
    state after the sequence's last token. Returns o: [num_tokens, num_v_heads, v_dim], v's dtype.
    """
    q, k = _prepare_qk(q, k, v.shape[1], tiled)
    v32, g32, beta32 = v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    starts = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        s = state[slot].float()                                       # [h, k_dim, v_dim]
        for start in range(starts[i], starts[i + 1], chunk_size):
            end = min(start + chunk_size, starts[i + 1])
            heads_first = (x[start:end].transpose(0, 1) for x in (q, k, v32, g32, beta32))
            o, s = _chunk_step(*heads_first, s)
            out[start:end] = o.transpose(0, 1).to(v.dtype)
        state[slot] = s.to(state.dtype)
    return out
