"""Triton kernels for the Gated DeltaNet's chunked prefill (`delta_rule.gated_delta_rule_chunked`,
its torch reference and the CPU path): a varlen batch, each sequence continuing from its state
slot, in chunks of BLOCK_T tokens with the chunk form of `delta_rule`'s module docstring.

Per chunk, with G_t = exp(cumsum g) and A[t, j] = beta_t (G_t / G_j) k_t.k_j for j < t:
- U = T diag(beta) (V - diag(G) K S) with T = (I + A)^-1;
- O = diag(G) Q S + QK U with QK[t, j] = (G_t / G_j) q_t.k_j for j <= t, else 0;
- S = G_L S + (K diag(G_L / G_j))^T U.
T and QK do not depend on the state, so two launches:
1. `_gdn_chunk_kernel`, one program per (chunk, v head), every chunk of the batch at once:
   T by forward substitution (row i = e_i - A[i, :] T, fp32) and QK (fp32 products), into
   fp32 scratch. (The product form (I - A)(I + A^2)(I + A^4)..., exact since A is nilpotent,
   is not stable: with correlated keys the powers of A grow by orders of magnitude before
   they cancel, and outputs went wrong or NaN in fp32 at 64-token chunks and in TF32.);
2. `_gdn_state_kernel`, one program per (sequence, v head, BLOCK_V state columns): the state
   tile [k_dim, BLOCK_V] stays in registers (fp32) while the program walks the sequence's
   chunks (five products a chunk), and is stored once at the end.
Every exponent is <= 0 (g <= 0, masked above the diagonal before exp), so nothing overflows.
Tokens past a sequence's end load as zeros (beta = g = 0): they add nothing and keep G_L. The
state pass's products take the arch config's `gdn_dot_precision` ("ieee" fp32, "tf32" or
"tf32x3" on tensor cores) for bf16/fp16 inputs; fp32 inputs always use "ieee".
q and k are l2-normalised here and q scaled by k_dim ** -0.5 (`delta_rule._prepare_qk`); v head
h reads k head h // GROUP, or h % k heads with TILED (llama.cpp's order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import get_config
from .delta_rule import L2NORM_EPS


@triton.jit
def _l2_rows(ptr, t, tm, kh, ks, km, s_qt, s_qh, eps):
    """Rows t of head kh of q or k, l2-normalised, fp32 [len(t), BLOCK_K] (rows past the end:
    zeros)."""
    x = tl.load(ptr + t[:, None] * s_qt + kh * s_qh + ks[None, :],
                mask=tm[:, None] & km[None, :], other=0.0).to(tl.float32)
    return x * (1.0 / tl.sqrt(tl.sum(x * x, 1) + eps))[:, None]


@triton.jit
def _load_qk(q_ptr, k_ptr, t, tm, kh, ks, km, s_qt, s_qh, eps, scale):
    """Rows t of q and k head kh, l2-normalised (q scaled), fp32 [BLOCK_T, BLOCK_K]."""
    q = _l2_rows(q_ptr, t, tm, kh, ks, km, s_qt, s_qh, eps) * scale
    return q, _l2_rows(k_ptr, t, tm, kh, ks, km, s_qt, s_qh, eps)


@triton.jit
def _k_head(h, num_heads, GROUP: tl.constexpr, TILED: tl.constexpr):
    if TILED:
        return h % (num_heads // GROUP)
    else:
        return h // GROUP


@triton.jit
def _gdn_chunk_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, cu_ptr, ccu_ptr, cseq_ptr, t_ptr, qk_ptr,
                      s_qt, s_qh, s_gt, eps, scale, GROUP: tl.constexpr, TILED: tl.constexpr,
                      K_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCKED: tl.constexpr):
    ci = tl.program_id(0)
    h = tl.program_id(1)
    kh = _k_head(h, tl.num_programs(1), GROUP, TILED)
    b = tl.load(cseq_ptr + ci)
    c0 = tl.load(cu_ptr + b).to(tl.int64) + (ci - tl.load(ccu_ptr + b)).to(tl.int64) * BLOCK_T
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    ts = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    t = c0 + ts
    tm = t < end          # chunks past the batch's last one (the grid is a bound) load nothing
    q, k = _load_qk(q_ptr, k_ptr, t, tm, kh, ks, ks < K_DIM, s_qt, s_qh, eps, scale)
    g = tl.load(g_ptr + t * s_gt + h, mask=tm, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + t * s_gt + h, mask=tm, other=0.0).to(tl.float32)
    causal = ts[:, None] >= ts[None, :]
    gc = tl.cumsum(g, 0)                                              # log G_t
    decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    qk = tl.where(causal, decay * tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)
    base = (ci.to(tl.int64) * tl.num_programs(1) + h) * (BLOCK_T * BLOCK_T)
    tile = base + ts[:, None] * BLOCK_T + ts[None, :]
    tl.store(qk_ptr + tile, qk)
    if BLOCKED:  # BLOCK_T = 32: two 16-token halves (see `_blocked_inverse`)
        _blocked_inverse(k_ptr, g_ptr, beta_ptr, t_ptr, base, c0, end, kh, h, ks, s_qt, s_qh,
                         s_gt, eps, K_DIM)
    else:
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        a = tl.where(ts[:, None] > ts[None, :], beta[:, None] * decay * kk, 0.0)
        rows = ts[:, None]
        inv = tl.where(rows == ts[None, :], 1.0, 0.0)                # (I + A)^-1, see above
        for i in range(1, BLOCK_T):  # row i = e_i - A[i, :] T (rows j < i are final)
            a_i = tl.sum(tl.where(rows == i, a, 0.0), 0)
            inv = tl.where(rows == i, inv - tl.sum(a_i[:, None] * inv, 0)[None, :], inv)
        tl.store(t_ptr + tile, inv)


@triton.jit
def _half(k_ptr, g_ptr, beta_ptr, t, end, kh, h, ks, s_qt, s_qh, s_gt, eps, K_DIM: tl.constexpr):
    """16 rows of k (l2-normalised), g and beta from token t[0] on."""
    tm = t < end
    k = _l2_rows(k_ptr, t, tm, kh, ks, ks < K_DIM, s_qt, s_qh, eps)
    g = tl.load(g_ptr + t * s_gt + h, mask=tm, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + t * s_gt + h, mask=tm, other=0.0).to(tl.float32)
    return k, g, beta


@triton.jit
def _blocked_inverse(k_ptr, g_ptr, beta_ptr, t_ptr, base, c0, end, kh, h, ks, s_qt, s_qh, s_gt,
                     eps, K_DIM: tl.constexpr):
    """T = (I + A)^-1 of a 32-token chunk from its 16 x 16 blocks: with L_ii = I + A_ii,
    T = [[L_00^-1, 0], [-L_11^-1 A_10 L_00^-1, L_11^-1]], the diagonal blocks' inverses by
    forward substitution side by side (15 row steps on 16 x 16 tiles instead of 31 on 32 x 32),
    stored into the chunk's [32, 32] tile of T."""
    hs = tl.arange(0, 16)
    rows, cols = hs[:, None], hs[None, :]
    strict = rows > cols
    k0, g0, b0 = _half(k_ptr, g_ptr, beta_ptr, c0 + hs, end, kh, h, ks, s_qt, s_qh, s_gt, eps,
                       K_DIM)
    k1, g1, b1 = _half(k_ptr, g_ptr, beta_ptr, c0 + 16 + hs, end, kh, h, ks, s_qt, s_qh, s_gt,
                       eps, K_DIM)
    gc0 = tl.cumsum(g0, 0)
    gc1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
    a00 = tl.where(strict, b0[:, None] * tl.exp(tl.where(strict, gc0[:, None] - gc0[None, :], 0.0))
                   * tl.dot(k0, tl.trans(k0), input_precision="ieee"), 0.0)
    a11 = tl.where(strict, b1[:, None] * tl.exp(tl.where(strict, gc1[:, None] - gc1[None, :], 0.0))
                   * tl.dot(k1, tl.trans(k1), input_precision="ieee"), 0.0)
    a10 = b1[:, None] * tl.exp(gc1[:, None] - gc0[None, :]) * \
        tl.dot(k1, tl.trans(k0), input_precision="ieee")             # every exponent <= 0
    inv0 = tl.where(rows == cols, 1.0, 0.0)
    inv1 = inv0
    for i in range(1, 16):
        r0 = tl.sum(tl.where(rows == i, a00, 0.0), 0)
        r1 = tl.sum(tl.where(rows == i, a11, 0.0), 0)
        inv0 = tl.where(rows == i, inv0 - tl.sum(r0[:, None] * inv0, 0)[None, :], inv0)
        inv1 = tl.where(rows == i, inv1 - tl.sum(r1[:, None] * inv1, 0)[None, :], inv1)
    inv10 = -tl.dot(tl.dot(inv1, a10, input_precision="ieee"), inv0, input_precision="ieee")
    tl.store(t_ptr + base + rows * 32 + cols, inv0)
    tl.store(t_ptr + base + rows * 32 + cols + 16, tl.zeros([16, 16], tl.float32))
    tl.store(t_ptr + base + (rows + 16) * 32 + cols, inv10)
    tl.store(t_ptr + base + (rows + 16) * 32 + cols + 16, inv1)


@triton.jit
def _gdn_state_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, cu_ptr, ccu_ptr,
                      t_ptr, qk_ptr, out_ptr, s_qt, s_qh, s_vt, s_vh, s_gt, s_ot, s_oh, s_ss, s_sh,
                      s_sk, eps, scale, GROUP: tl.constexpr, TILED: tl.constexpr,
                      K_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = _k_head(h, tl.num_programs(1), GROUP, TILED)
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    first = tl.load(ccu_ptr + b).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ts = tl.arange(0, BLOCK_T)
    km, vm = ks < K_DIM, vs < V_DIM
    slot = tl.load(slots_ptr + b)
    sp = state_ptr + slot * s_ss + h * s_sh + ks[:, None] * s_sk + vs[None, :]
    smask = km[:, None] & vm[None, :]
    s = tl.load(sp, mask=smask, other=0.0)                            # [BLOCK_K, BLOCK_V]
    tile = ts[:, None] * BLOCK_T + ts[None, :]
    for c0 in range(start, end, BLOCK_T):
        t = c0 + ts
        tm = t < end
        q, k = _load_qk(q_ptr, k_ptr, t, tm, kh, ks, km, s_qt, s_qh, eps, scale)
        v = tl.load(v_ptr + t[:, None] * s_vt + h * s_vh + vs[None, :],
                    mask=tm[:, None] & vm[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * s_gt + h, mask=tm, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * s_gt + h, mask=tm, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)                                          # log G_t
        base = ((first + (c0 - start) // BLOCK_T) * tl.num_programs(1) + h) * \
            (BLOCK_T * BLOCK_T)
        inv = tl.load(t_ptr + base + tile)
        qk = tl.load(qk_ptr + base + tile)
        rhs = beta[:, None] * (v - tl.exp(gc)[:, None] * tl.dot(k, s, input_precision=PREC))
        u = tl.dot(inv, rhs, input_precision=PREC)                    # [BLOCK_T, BLOCK_V]
        o = tl.exp(gc)[:, None] * tl.dot(q, s, input_precision=PREC) + \
            tl.dot(qk, u, input_precision=PREC)
        tl.store(out_ptr + t[:, None] * s_ot + h * s_oh + vs[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=tm[:, None] & vm[None, :])
        last = tl.sum(tl.where(ts == BLOCK_T - 1, gc, 0.0), 0)        # log G_L (pads add 0)
        to_end = tl.exp(last - gc)
        s = tl.exp(last) * s + tl.dot(tl.trans(k * to_end[:, None]), u, input_precision=PREC)
    tl.store(sp, s, mask=smask)


def _check_config(cfg) -> None:
    """Both tiles and the precision, whichever a launch would take (a user's JSON entry)."""
    tiles = (cfg.gdn_block_t, cfg.gdn_block_v, cfg.gdn_wide_block_t, cfg.gdn_wide_block_v)
    if cfg.gdn_dot_precision not in ("ieee", "tf32", "tf32x3") or not all(
            isinstance(x, int) and 16 <= x <= 256 and not x & (x - 1) for x in tiles):
        raise ValueError(f"gdn_prefill: kernel config gdn_dot_precision="
                         f"{cfg.gdn_dot_precision!r} (ieee, tf32 or tf32x3), tiles {tiles} "
                         f"(powers of two from 16 to 256)")
    if cfg.gdn_inverse_blocks and (cfg.gdn_block_t != 32 or cfg.gdn_wide_block_t != 32):
        raise ValueError("gdn_prefill: gdn_inverse_blocks needs 32-token chunks "
                         f"(gdn_block_t {cfg.gdn_block_t}, gdn_wide_block_t "
                         f"{cfg.gdn_wide_block_t})")


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                slots: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """`delta_rule.gated_delta_rule_chunked` on the GPU (same arguments and result): q, k
    [num_tokens, k_heads, k_dim]; v [num_tokens, v_heads, v_dim]; g, beta [num_tokens, v_heads];
    cu_seqlens [num_seqs + 1]; state [num_slots, v_heads, k_dim, v_dim] fp32, rows `slots`
    replaced by the state after each sequence's last token. No host sync: the chunk grid is
    bounded by num_tokens // BLOCK_T + num_seqs."""
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
    cfg = get_config(q.device)
    _check_config(cfg)
    block_t, block_v = cfg.gdn_block_t, cfg.gdn_block_v
    if cfg.gdn_wide_min_programs > 0 and \
            seqs * v_heads * triton.cdiv(v_dim, block_v) >= cfg.gdn_wide_min_programs:
        block_t, block_v = cfg.gdn_wide_block_t, cfg.gdn_wide_block_v
    prec = "ieee" if q.dtype == torch.float32 else cfg.gdn_dot_precision
    # chunk table: chunk i of the batch belongs to sequence cseq[i], whose chunks start at ccu
    cu = cu_seqlens.to(torch.int32)
    ccu = torch.zeros(seqs + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(torch.div(cu[1:] - cu[:-1] + block_t - 1, block_t, rounding_mode="floor"), 0,
                 out=ccu[1:])
    bound = n // block_t + seqs
    cseq = torch.searchsorted(ccu[1:], torch.arange(bound, dtype=torch.int32, device=q.device),
                              right=True).clamp_(max=seqs - 1)
    inv = torch.empty(bound, v_heads, block_t, block_t, dtype=torch.float32, device=q.device)
    qk = torch.empty_like(inv)
    block_k = max(16, triton.next_power_of_2(k_dim))
    common = dict(GROUP=v_heads // k_heads, TILED=tiled, K_DIM=k_dim, BLOCK_K=block_k,
                  BLOCK_T=block_t)
    _gdn_chunk_kernel[(bound, v_heads)](
        q, k, g, beta, cu, ccu, cseq, inv, qk, q.stride(0), q.stride(1), g.stride(0), L2NORM_EPS,
        k_dim ** -0.5, BLOCKED=cfg.gdn_inverse_blocks, num_warps=cfg.gdn_chunk_num_warps,
        **common)
    _gdn_state_kernel[(seqs, v_heads, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, state, slots, cu, ccu, inv, qk, out, q.stride(0), q.stride(1),
        v.stride(0), v.stride(1), g.stride(0), out.stride(0), out.stride(1), state.stride(0),
        state.stride(1), state.stride(2), L2NORM_EPS, k_dim ** -0.5, V_DIM=v_dim,
        BLOCK_V=block_v, PREC=prec, num_warps=cfg.gdn_num_warps,
        num_stages=cfg.gdn_num_stages, **common)
    return out
