"""The GEMV of a decode step's dense (bf16 / fp16) projections: y = x @ W^T (+ bias) for a
few rows of x [M, K] (M <= `dense_gemv_max_m`) and a row-major W [N, K], in one launch, with
SiLU-and-mul optionally done on the way in.

Why not cuBLAS: at one row a projection of a small model is a few microseconds, mostly launch
and ramp; cuBLAS's GEMV cannot start while the kernel before it finishes (programmatic
dependent launch, `pdl.py`) and cannot take its input from two halves. Here:

* `GLU`: x is the gate/up projection's output [M, 2K] laid out [gate | up], and the input
  the weight multiplies is silu(gate) * up, computed per tile as `elementwise_triton.silu_mul`
  computes it (rounded to x's dtype where `silu_and_mul_ref` rounds), so the SiLU launch of
  the MLP goes away and the product equals the unfused one's input bit for bit.
* Each program owns BLOCK_N output features of every row of x and one K-split. It loads
  [BLOCK_N, BLOCK_K] weight tiles (contiguous along K), multiplies them with every row's
  [BLOCK_K] slice in fp32 and accumulates elementwise; the sum over K is taken once at the
  end. Every row is computed exactly as it would be alone (the same products and sums in the
  same order), so where the table lets several rows through, a verify step's rows equal the
  decode steps they replace.
* Tiles come from the config table (`dense_gemv_*`; wide, short-K matrices such as a small
  model's gate/up take the `dense_gemv_wide_*` tile). K is split (`skinny_split_k` with the
  dense_gemv_* fields) while N alone gives too few programs; the splits write fp32 partials
  and the last split of a row block to arrive (an acq_rel counter,
  `quant_gemv.split_counters`) sums them in split order (deterministic) and adds the bias, in
  the same launch.
* `NORM` (`kernels.rms_norm_linear`): x is a layer's hidden state and the input the weight
  multiplies is its RMSNorm (after the residual add), rounded as `rms_norm` rounds it; each
  program takes the row's sum of squares itself, the first writes the next residual. It pays
  only on launches of few programs (`dense_gemv_norm_max_programs`), unless the projection
  before already added the residual and wrote the row's partial sums of squares (`ADD` /
  `ss=`, `dense_gemv_epilogue.py`): then each program sums those partials, whatever the size.
* `ROPE` (`kernels.rms_norm_qkv_rope_cache`): a fused QKV projection whose programs own
  features j and j + head_dim/2 of one head, so the epilogue rotates them (q into q, k into
  the k cache) and writes v into the v cache, bit for bit as `qkv_rope_triton` would.
* The first weight tile loads before the PDL wait (`dense_gemv_prefetch`): weights are never
  written during a step, so it overlaps the kernel before.
* One row only in the sm_90 entry (`dense_gemv_max_m` = 1): past one row each row adds its
  own accumulators to the tile's registers; verify steps and batches go to cuBLAS.

Torch reference: `dense_gemv_ref` (F.linear of the same input, in fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .configs import get_config, skinny_split_k
from .dense_gemv_epilogue import _epilogue, _row_rstd
from .elementwise_triton import silu_mul
from .pdl import pdl_enter, pdl_kwargs


@triton.jit
def _src(x_ptr, r_ptr, mi, M, s_xm, s_rm, k, kmask, HAS_RES: tl.constexpr):
    """[BM, BK] x rows mi at columns k in x's dtype; HAS_RES: x + residual, rounded to x's
    dtype as `rms_norm`'s add rounds it."""
    mask = (mi < M)[:, None] & kmask[None, :]
    v = tl.load(x_ptr + mi[:, None].to(tl.int64) * s_xm + k[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + mi[:, None].to(tl.int64) * s_rm + k[None, :], mask=mask, other=0.0)
        v = (v.to(tl.float32) + r.to(tl.float32)).to(v.dtype)
    return v


@triton.jit
def _x_tile(x_ptr, r_ptr, nw_ptr, rstd, mi, M, s_xm, s_rm, k, kmask, K, out_ptr,
            GLU: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """[BM, 1, BK] fp32: x rows mi at columns k; with GLU silu(gate) * up of them; with NORM
    their RMSNorm (of x + residual with HAS_RES) as `rms_norm` computes it, given rstd [BM]."""
    if GLU:
        ptr = x_ptr + mi[:, None].to(tl.int64) * s_xm + k[None, :]
        mask = (mi < M)[:, None] & kmask[None, :]
        g = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(ptr + K, mask=mask, other=0.0).to(tl.float32)
        v = silu_mul(g, u, out_ptr).to(tl.float32)
    elif NORM:  # HF Llama: normalise in fp32, round, scale by the weight, round
        h = _src(x_ptr, r_ptr, mi, M, s_xm, s_rm, k, kmask, HAS_RES)
        y = (h.to(tl.float32) * rstd[:, None]).to(h.dtype).to(tl.float32)
        nw = tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        v = (nw[None, :] * y).to(h.dtype).to(tl.float32)
    else:
        v = _src(x_ptr, r_ptr, mi, M, s_xm, s_rm, k, kmask, False).to(tl.float32)
    return v[:, None, :]


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, r_ptr, nw_ptr,
                       res_out_ptr, ss_ptr, n_ss, eps, M, N, K, k_per_split, s_xm, s_wn, s_om,
                       s_rm, s_rom,
                       pos_ptr, cs_ptr, s_cs, q_ptr, s_q, kc_ptr, vc_ptr, slot_ptr,
                       s_kcb, s_kcs, s_vcb, s_vcs,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GLU: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       NORM: tl.constexpr = False, HAS_RES: tl.constexpr = False,
                       PREFETCH: tl.constexpr = False, ROPE: tl.constexpr = False,
                       NQ: tl.constexpr = 0, NKV: tl.constexpr = 0, HEAD_DIM: tl.constexpr = 2,
                       PAGE_SIZE: tl.constexpr = 1, ADD: tl.constexpr = False,
                       PRE_SS: tl.constexpr = False, BLOCK_SS: tl.constexpr = 1,
                       PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    r = tl.arange(0, BLOCK_N)
    if ROPE:  # features j and j + HEAD_DIM/2 of one head, interleaved, for the rotation
        tiles: tl.constexpr = HEAD_DIM // BLOCK_N
        rows = (pid_n // tiles) * HEAD_DIM + (pid_n % tiles) * (BLOCK_N // 2) + r // 2 + \
            (r % 2) * (HEAD_DIM // 2)
    else:
        rows = pid_n * BLOCK_N + r
    nmask = rows < N
    mi = tl.arange(0, BLOCK_M)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * s_wn
    k = k_start + tl.arange(0, BLOCK_K)
    kmask = k < k_end
    if PREFETCH:  # no kernel writes weights: the first tile loads while the one before runs
        w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    pdl_enter(PDL, PDL_EARLY)
    if not PREFETCH:
        w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM and PRE_SS:  # the row's sum of squares from the ADD epilogue's partials
        rstd = _row_rstd(ss_ptr, n_ss, mi, M, K, eps, BLOCK_M, BLOCK_SS)
    elif NORM:
        # every program takes the row's sum of squares itself (the row is a few KB, read from
        # L2); the first program also writes x + residual, the next residual
        first = (pid_n == 0) & (split == 0)
        ss = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for c0 in range(0, K, BLOCK_K):
            c = c0 + tl.arange(0, BLOCK_K)
            cmask = c < K
            h = _src(x_ptr, r_ptr, mi, M, s_xm, s_rm, c, cmask, HAS_RES)
            if HAS_RES:
                if first:
                    tl.store(res_out_ptr + mi[:, None].to(tl.int64) * s_rom + c[None, :], h,
                             mask=(mi < M)[:, None] & cmask[None, :])
            h = h.to(tl.float32)
            ss += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 1) / K + eps)
    x = _x_tile(x_ptr, r_ptr, nw_ptr, rstd, mi, M, s_xm, s_rm, k, kmask, K, out_ptr, GLU,
                NORM, HAS_RES)
    acc = w.to(tl.float32)[None, :, :] * x
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_end
        w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = _x_tile(x_ptr, r_ptr, nw_ptr, rstd, mi, M, s_xm, s_rm, k, kmask, K, out_ptr, GLU,
                    NORM, HAS_RES)
        acc += w.to(tl.float32)[None, :, :] * x
    y = tl.sum(acc, 2)                                                   # [BM, BN]
    omask = (mi < M)[:, None] & nmask[None, :]
    if SPLIT:
        # every split writes its partial; the last to arrive sums them in split order
        part = part_ptr + (split * M + mi[:, None]).to(tl.int64) * N + rows[None, :]
        tl.store(part, y, mask=omask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == nsplit - 1:
            y = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, nsplit):
                y += tl.load(part_ptr + (s * M + mi[:, None]).to(tl.int64) * N + rows[None, :],
                             mask=omask, other=0.0, cache_modifier=".cg")
            _epilogue(y, mi, M, N, rows, nmask, pid_n, bias_ptr, out_ptr, s_om, r_ptr, s_rm,
                      ss_ptr, n_ss, pos_ptr, cs_ptr, s_cs, q_ptr, s_q, kc_ptr, vc_ptr, slot_ptr,
                      s_kcb, s_kcs, s_vcb, s_vcs, HAS_BIAS, ROPE, ADD, BLOCK_M, BLOCK_N, NQ, NKV,
                      HEAD_DIM, PAGE_SIZE)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        _epilogue(y, mi, M, N, rows, nmask, pid_n, bias_ptr, out_ptr, s_om, r_ptr, s_rm,
                  ss_ptr, n_ss, pos_ptr, cs_ptr, s_cs, q_ptr, s_q, kc_ptr, vc_ptr, slot_ptr,
                  s_kcb, s_kcs, s_vcb, s_vcs, HAS_BIAS, ROPE, ADD, BLOCK_M, BLOCK_N, NQ, NKV,
                  HEAD_DIM, PAGE_SIZE)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `dense_gemv` is the kernel for x @ weight^T here: a dense float weight of at most
    `dense_gemv_max_n` rows (when set) and at most `dense_gemv_max_m` rows of x in its dtype
    (0 turns it off: cuBLAS)."""
    if weight.dim() != 2 or x.dtype != weight.dtype or \
            x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    cfg = get_config(x.device)
    return 0 < rows <= cfg.dense_gemv_max_m and \
        (cfg.dense_gemv_max_n <= 0 or weight.shape[0] <= cfg.dense_gemv_max_n)


def _launch_shape(cfg, n: int, k: int, wide_ok: bool = True) -> tuple:
    """(block_n, block_k, num_warps, programs, K splits, K tiles per split) of a launch."""
    block_n, block_k, warps = cfg.dense_gemv_block_n, cfg.dense_gemv_block_k, \
        cfg.dense_gemv_num_warps
    min_programs = None
    if wide_ok and 0 < cfg.dense_gemv_wide_min_n <= n and k <= cfg.dense_gemv_wide_max_k:
        block_n, block_k, warps = cfg.dense_gemv_wide_block_n, cfg.dense_gemv_wide_block_k, \
            cfg.dense_gemv_wide_num_warps
    elif 0 < cfg.dense_gemv_deep_min_ratio * n <= k and n * k <= cfg.dense_gemv_deep_max_elems:
        block_n, block_k, warps = cfg.dense_gemv_deep_block_n, cfg.dense_gemv_deep_block_k, \
            cfg.dense_gemv_deep_num_warps
        min_programs = cfg.dense_gemv_deep_split_min_programs
    programs = triton.cdiv(n, block_n)
    split, tiles = skinny_split_k(cfg, programs, triton.cdiv(k, block_k), dense=True,
                                  min_programs=min_programs)
    return block_n, block_k, warps, programs, split, tiles


def norm_pays(weight: torch.Tensor, rope: bool = False) -> bool:
    """Whether the norm before this projection is done in its GEMV (`norm=`): with
    `dense_gemv_norm` on and a launch of at most `dense_gemv_norm_max_programs` programs, as
    each program takes the row's sum of squares itself before its first product."""
    cfg = get_config(weight.device)
    programs, split = _launch_shape(cfg, *weight.shape, not rope)[3:5]
    return cfg.dense_gemv_norm and programs * split <= cfg.dense_gemv_norm_max_programs


def rope_fits(weight: torch.Tensor, k_cache: torch.Tensor, num_heads: int,
              num_kv_heads: int) -> bool:
    """Whether `dense_gemv(..., rope=)` takes this QKV projection: whole heads per tile (the
    normal tile's block_n divides head_dim) and caches of contiguous [heads, head_dim]."""
    from .configs import get_config
    hd = k_cache.shape[-1]
    bn = get_config(weight.device).dense_gemv_block_n
    return weight.shape[0] == (num_heads + 2 * num_kv_heads) * hd and bn % 2 == 0 and \
        hd % bn == 0 and k_cache.stride(-1) == 1 and k_cache.stride(-2) == hd


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               glu: bool = False, norm: tuple | None = None, rope: tuple | None = None,
               add: torch.Tensor | None = None, ss: torch.Tensor | None = None):
    """x [..., K] (glu: [..., 2K] as [gate | up]) @ weight [N, K]^T + bias -> [..., N] in x's
    dtype, for at most `dense_gemv_max_m` rows; one launch (see the module docstring).

    `norm` = (norm_weight [K], eps, residual [..., K] or None): the input is
    `rms_norm(x, norm_weight, eps, residual)` instead of x, done in the same launch; returns
    (y, x + residual) then (x itself without a residual), as `rms_norm` returns its residual.
    `ss` (with `norm`, no residual): x is an `add=` launch's h and `ss` its partial sums of
    squares, which give the norm's scale.

    `add` = residual [..., N]: returns (h, ss): h = y + residual rounded as `rms_norm`'s add
    ([..., N], x's dtype) and ss [rows, programs] fp32, each program's sum of squares of its
    features of h (`dense_gemv_epilogue.py`), for a `norm=..., ss=` launch after it.

    `rope` = (positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads),
    for a fused QKV projection that `rope_fits`: y is not stored; what
    `qkv_rope_cache(y, *rope)` does to it is done in the epilogue, and q [rows, num_heads,
    head_dim] is returned in y's place (bit for bit that function's, no q/k norm)."""
    from .quant_gemv import split_counters
    n, k = weight.shape
    if x.shape[-1] != (2 * k if glu else k):
        raise ValueError(f"x has {x.shape[-1]} features, the weight [N, K] = [{n}, {k}]"
                         + (" (glu: x is [gate | up], 2K)" if glu else ""))
    if glu and norm is not None or add is not None and (norm is not None or rope is not None):
        raise ValueError("dense_gemv: glu and norm, and add and norm / rope, are exclusive")
    if ss is not None and (norm is None or norm[2] is not None):
        raise ValueError("dense_gemv: ss= goes with norm= and no residual")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    num_m = x2.shape[0]
    out = torch.empty((num_m, 0 if rope is not None else n), dtype=x.dtype, device=x.device)
    r2 = res_out = x2
    nw, eps = x2, 0.0
    if norm is not None:
        nw, eps, residual = norm[0].contiguous(), float(norm[1]), norm[2]
        if residual is not None:
            r2 = residual.reshape(-1, k)
            r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
            res_out = torch.empty_like(x2)
    if add is not None:
        if add.shape[-1] != n or add.dtype != x.dtype:
            raise ValueError(f"dense_gemv: add= needs [..., {n}] in {x.dtype}")
        r2 = add.reshape(-1, n)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    cfg = get_config(x.device)
    rope_kw, rope_args = {}, (out, out, 0, out, 0, out, out, out, 0, 0, 0, 0)
    if rope is not None:
        positions, cos_sin, k_cache, v_cache, slots, nq, nkv = rope
        if glu or not rope_fits(weight, k_cache, nq, nkv) or v_cache.stride(-2) != \
                k_cache.shape[-1] or v_cache.stride(-1) != 1:
            raise ValueError("dense_gemv: this projection and cache do not fit rope= "
                             "(see rope_fits)")
        hd = k_cache.shape[-1]
        q = torch.empty((num_m, nq, hd), dtype=x.dtype, device=x.device)
        cs = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
        rope_args = (positions, cs, cs.stride(0), q, q.stride(0), k_cache, v_cache, slots,
                     k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
        rope_kw = dict(ROPE=True, NQ=nq, NKV=nkv, HEAD_DIM=hd, PAGE_SIZE=k_cache.shape[1])
        out = q.view(num_m, nq * hd)  # never written: its dtype rounds the projection
    block_n, block_k, warps, programs, split, tiles = _launch_shape(cfg, n, k, rope is None)
    ss_out = torch.empty((num_m, programs), dtype=torch.float32, device=x.device) \
        if add is not None else None
    ss_buf = ss if ss is not None else ss_out if ss_out is not None else out
    n_ss = ss_buf.shape[-1] if ss_buf is not out else 1
    if ss is not None and (ss.dtype != torch.float32 or ss.shape[0] != num_m or
                           ss.stride(-1) != 1):
        raise ValueError("dense_gemv: ss is [rows, partials] fp32, contiguous rows")
    if num_m and n:
        part = torch.empty((split, num_m, n), dtype=torch.float32, device=x.device) \
            if split > 1 else out
        counters = split_counters(x.device, programs) if split > 1 else out
        has_bias = bias is not None
        _dense_gemv_kernel[(programs, split)](
            x2, w, bias.contiguous() if has_bias else out, out, part, counters, r2, nw, res_out,
            ss_buf, n_ss, eps, num_m, n, k, tiles * block_k, x2.stride(0), w.stride(0),
            out.stride(0), r2.stride(0), res_out.stride(0), *rope_args,
            BLOCK_M=triton.next_power_of_2(num_m), BLOCK_N=block_n, BLOCK_K=block_k, GLU=glu,
            SPLIT=split > 1, HAS_BIAS=has_bias, NORM=norm is not None,
            HAS_RES=res_out is not x2, PREFETCH=cfg.dense_gemv_prefetch, num_warps=warps,
            ADD=add is not None, PRE_SS=ss is not None,
            BLOCK_SS=triton.next_power_of_2(n_ss),
            **rope_kw, **pdl_kwargs(x.device, cfg, programs * split))
    y = q if rope is not None else out.view(*lead, n)
    if add is not None:
        return y, ss_out
    if norm is None:
        return y
    return y, res_out.view(*lead, k) if res_out is not x2 else x


def dense_gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   glu: bool = False, norm: tuple | None = None):
    """The reference: F.linear in fp32 of x (or of `silu_and_mul_ref(x)` with glu, or of
    `rms_norm_ref(x, *norm)` with norm, in x's dtype as the unfused layer has it), rounded
    to x's dtype; with norm, (y, residual) as `dense_gemv` returns them."""
    res = None
    if glu:
        from .activation import silu_and_mul_ref
        x = silu_and_mul_ref(x)
    elif norm is not None:
        from .norm import rms_norm_ref
        nw, eps, residual = norm
        if residual is None:
            res, x = x, rms_norm_ref(x, nw, eps)
        else:
            x, res = rms_norm_ref(x, nw, eps, residual)
    y = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
    y = y.to(x.dtype)
    return y if norm is None else (y, res)


__all__ = ["applies", "dense_gemv", "dense_gemv_ref", "norm_pays", "rope_fits"]
