"""Triton matmuls that read the repacked quantized layout of `quant.py` (read its docstring).

* `quant_matmul_skinny(x, w)`: y = x @ W^T for M <= 32 rows of x (decode, speculative verify,
  small batches). Grid (cdiv(N, BLOCK_N), SPLIT_K): a program owns BLOCK_N output features for
  every row of x and walks its share of K in BLOCK_K tiles, dequantizing each weight tile in fp32
  and accumulating in fp32. With SPLIT_K > 1 (short N: too few programs to fill the GPU) the
  programs write fp32 partials [SPLIT_K, M, N] that `_reduce_kernel` sums in a fixed order
  (deterministic, no atomics), adding the bias there.
* `dense_matmul_skinny(x, weight)`: the same kernel for a dense fp16/bf16/fp32 [N, K] weight.
* `dequantize_triton(w, dtype)` (dequant_triton.py, re-exported here): the whole weight as a
  dense [N, K] tensor.
* `quant_matmul(x, w)`: the skinny kernel up to `skinny_rows(cfg, qtype)` rows, else
  `dequantize_triton` into a scratch weight and torch's GEMM (cuBLAS / rocBLAS): at prefill
  sizes the GEMM is compute-bound, and the scratch is freed after the call.

Two inner products: one row of x (decode) runs as a GEMV, multiply + add in fp32 with per-lane
partial sums reduced once after the K loop, and each group's scale applied once to its sum
(scale * sum(code * x) - offset * sum(x)); 2..32 rows run `tl.dot` on the dequantized tile
(the reference's per-weight formula, cast to x's dtype) with M padded to 16 or 32; with
`qgemm_swap` (the sm_90 entry) the tile is the dot's A operand and the product is transposed
(acc^T = W x^T: a Hopper warpgroup MMA reads A from registers, so the dequantized tile skips
shared memory; 0.82-0.83x the time at 16-25 rows on an H100, bench/skinny_sweep.py). With
`qgemm_packed` a q4_0, q4_k or q6_k tile is dequantized two bf16 weights a register by PTX in a
permuted K order that x's tile follows (`quant_tile_triton._packed_weights`). Under
TRITON_INTERPRET=1 bf16 dot operands go as fp32 (the interpreter's bf16 dot is wrong); fp32
activations always dot in IEEE fp32 (no TF32). bench/qgemm.py measures both against cuBLAS.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .configs import KernelConfig, get_config, skinny_split_k
from .pdl import pdl_enter, pdl_kwargs
from .quant import QuantWeight
from .quant_args import weight_args as _weight_args, words as _words
from .quant_tile_triton import (PACKED_QTYPES, _packed_scale_loads, _packed_scales,
                                _packed_weights, _quant_tile, _weights)


DENSE = "dense"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot_acc(acc, x, w, DOT_IEEE: tl.constexpr):
    """acc + x @ w^T; x [BLOCK_M, k], w [BLOCK_N, k], both already in the dot dtype."""
    if DOT_IEEE:
        return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        return acc + tl.dot(x, tl.trans(w))


@triton.jit
def _dot_acc_ab(acc, a, b, DOT_IEEE: tl.constexpr):
    """acc + a @ b; a [BLOCK_N, k], b [k, BLOCK_M], both already in the dot dtype."""
    if DOT_IEEE:
        return acc + tl.dot(a, b, input_precision="ieee")
    else:
        return acc + tl.dot(a, b)


@triton.jit
def _skinny_kernel(x_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, bias_ptr, out_ptr,
                   part_ptr, M, N, K, KG, tiles_per_split, s_xm, s_om,
                   s_qs, s_qh, s_d, s_sc, e_d, e_sc,
                   QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                   DOT_IEEE: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False,
                   SWAP: tl.constexpr = False, PACKED: tl.constexpr = False,
                   ASM: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    pdl_enter(PDL, PDL_EARLY)
    G: tl.constexpr = BLOCK_K // 32
    HALF: tl.constexpr = BLOCK_K // 2
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rows < N
    row = rows.to(tl.int64)[:, None]
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    if DOT_F32:
        dt = tl.float32
    else:
        dt = x_ptr.dtype.element_ty
    # x columns of a tile: dense [BLOCK_K]; quantized lo halves [HALF] (dot) / [G, 16] (gemv)
    kk = tl.arange(0, BLOCK_K)
    b = tl.arange(0, HALF)
    lo_cols = (b // 16) * 32 + b % 16
    lo_cols3 = (tl.arange(0, G) * 32)[:, None] + tl.arange(0, 16)[None, :]

    if USE_DOT and SWAP:  # the weights are the product's A operand: acc^T [BLOCK_N, BLOCK_M]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    elif USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    elif QTYPE == "dense":  # one row of x: per-lane partial sums, reduced once after the loop
        acc_w = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_N, G], tl.float32)
    t_end = tl.minimum((split + 1) * tiles_per_split, tl.cdiv(K, BLOCK_K))
    if PACKED and PREFETCH:  # the first tile's scales; each tile then loads the next one's
        sd, sb, sc_, se = _packed_scale_loads(d_ptr, m_ptr, sc_ptr, mn_ptr, row, nmask,
                                              split * tiles_per_split * G, KG, s_d, s_sc, e_d,
                                              e_sc, QTYPE, G)
    for t in range(split * tiles_per_split, t_end):
        k0 = t * BLOCK_K
        if QTYPE == "dense":
            cols = k0 + kk
            w = tl.load(qs_ptr + row * s_qs + cols[None, :],
                        mask=nmask[:, None] & (cols < K)[None, :], other=0.0)
            if USE_DOT and SWAP:
                x = tl.load(x_ptr + offs_m[None, :] * s_xm + cols[:, None],
                            mask=mmask[None, :] & (cols < K)[:, None], other=0.0)
                acc = _dot_acc_ab(acc, w.to(dt), x.to(dt), DOT_IEEE)
            elif USE_DOT:
                x = tl.load(x_ptr + offs_m[:, None] * s_xm + cols[None, :],
                            mask=mmask[:, None] & (cols < K)[None, :], other=0.0)
                acc = _dot_acc(acc, x.to(dt), w.to(dt), DOT_IEEE)
            else:
                x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
                acc_w += w.to(tl.float32) * x[None, :]
        elif PACKED:  # bf16 weights made two a register (`_packed_weights`)
            if PREFETCH:  # scales are byte loads, which Triton's pipeliner leaves in place
                nd, nb, nc, ne = _packed_scale_loads(d_ptr, m_ptr, sc_ptr, mn_ptr, row, nmask,
                                                     (t + 1) * G, KG, s_d, s_sc, e_d, e_sc,
                                                     QTYPE, G)
                scale, o = _packed_scales(sd, sb, sc_, se, QTYPE)
                sd, sb, sc_, se = nd, nb, nc, ne
            else:
                ld, lb, lc, le = _packed_scale_loads(d_ptr, m_ptr, sc_ptr, mn_ptr, row, nmask,
                                                     t * G, KG, s_d, s_sc, e_d, e_sc, QTYPE, G)
                scale, o = _packed_scales(ld, lb, lc, le, QTYPE)
            w = _packed_weights(qs_ptr, qh_ptr, scale, o, row, nmask, t * G, KG, s_qs, s_qh,
                                QTYPE, G, ASM)
            cols = k0 + kk
            x = tl.load(x_ptr + offs_m[:, None] * s_xm + cols[None, :],
                        mask=mmask[:, None] & (cols < K)[None, :], other=0.0)
            # element (c * GPC + gp) * 32 + 16h + 2qq + e to slot 16 (8 gp + qq) + 8h + 2c + e
            x = tl.reshape(x, [BLOCK_M, 4, BLOCK_K // 128, 2, 8, 2])   # [m, c, gp, h, qq, e]
            if SWAP:
                x = tl.reshape(tl.permute(x, (2, 4, 3, 1, 5, 0)), [BLOCK_K, BLOCK_M])
                acc = _dot_acc_ab(acc, w.to(dt), x.to(dt), DOT_IEEE)
            else:
                x = tl.reshape(tl.permute(x, (0, 2, 4, 3, 1, 5)), [BLOCK_M, BLOCK_K])
                acc = _dot_acc(acc, x.to(dt), w.to(dt), DOT_IEEE)
        else:
            lo, hi, scale_lo, scale_hi, offset = _quant_tile(
                qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, row, nmask, t * G, KG,
                s_qs, s_qh, s_d, s_sc, e_d, e_sc, QTYPE, G)
            if USE_DOT and SWAP:
                w_lo, w_hi = _weights(lo, hi, scale_lo, scale_hi, offset, QTYPE)
                cols = k0 + lo_cols
                xp = x_ptr + offs_m[None, :] * s_xm + cols[:, None]
                xmask = mmask[None, :] & (cols < K)[:, None]
                x_lo = tl.load(xp, mask=xmask, other=0.0)
                x_hi = tl.load(xp + 16, mask=xmask, other=0.0)
                acc = _dot_acc_ab(acc, tl.reshape(w_lo, [BLOCK_N, HALF]).to(dt), x_lo.to(dt),
                                  DOT_IEEE)
                acc = _dot_acc_ab(acc, tl.reshape(w_hi, [BLOCK_N, HALF]).to(dt), x_hi.to(dt),
                                  DOT_IEEE)
            elif USE_DOT:
                w_lo, w_hi = _weights(lo, hi, scale_lo, scale_hi, offset, QTYPE)
                cols = k0 + lo_cols
                xp = x_ptr + offs_m[:, None] * s_xm + cols[None, :]
                x_lo = tl.load(xp, mask=mmask[:, None] & (cols < K)[None, :], other=0.0)
                x_hi = tl.load(xp + 16, mask=mmask[:, None] & (cols < K)[None, :], other=0.0)
                acc = _dot_acc(acc, x_lo.to(dt), tl.reshape(w_lo, [BLOCK_N, HALF]).to(dt),
                               DOT_IEEE)
                acc = _dot_acc(acc, x_hi.to(dt), tl.reshape(w_hi, [BLOCK_N, HALF]).to(dt),
                               DOT_IEEE)
            else:
                # per group: scale * sum(code * x) - offset * sum(x), the scale applied once
                cols = k0 + lo_cols3
                x_lo = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
                x_hi = tl.load(x_ptr + cols + 16, mask=cols < K, other=0.0).to(tl.float32)
                p_lo = tl.sum(lo * x_lo[None, :, :], 2)
                p_hi = tl.sum(hi * x_hi[None, :, :], 2)
                if QTYPE == "q4_0" or QTYPE == "q5_0" or QTYPE == "q8_0":
                    acc_g += scale_lo * (p_lo + p_hi)
                elif QTYPE == "q6_k":
                    acc_g += scale_lo * p_lo + scale_hi * p_hi
                else:
                    x_sum = tl.sum(x_lo, 1) + tl.sum(x_hi, 1)
                    acc_g += scale_lo * (p_lo + p_hi) - offset * x_sum[None, :]

    if not USE_DOT:
        if QTYPE == "dense":
            acc = tl.sum(acc_w, 1)[None, :]
        else:
            acc = tl.sum(acc_g, 1)[None, :]
    if USE_DOT and SWAP:
        acc = tl.trans(acc)
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT:
        p = part_ptr + (split * M + offs_m[:, None]).to(tl.int64) * N + rows[None, :]
        tl.store(p, acc, mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * s_om + rows[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, num_splits, s_om,
                   BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    """out[m, n] = sum over splits (in order) of part[s, m, n] + bias[n]."""
    pdl_enter(PDL, PDL_EARLY)
    mi = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + (s * M + mi).to(tl.int64) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + mi * s_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# launchers

def _skinny(x: torch.Tensor, weights: tuple, strides: tuple, qtype: str, n: int, k: int,
            bias: torch.Tensor | None, out: torch.Tensor | None,
            xqs: dict | None = None, tail=None) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight [N, K] = [{n}, {k}]")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    num_m = x2.shape[0]
    if num_m > 32:
        raise ValueError(f"the skinny kernels take at most 32 rows of x, got {num_m}")
    if out is None:
        out = torch.empty((*lead, n), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    if out2.stride(-1) != 1 or out2.shape[0] != num_m:
        raise ValueError(f"out must be a [{num_m}, {n}] view with a contiguous last dim")
    if num_m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand_as(out) if bias is not None else torch.zeros_like(out))
    cfg = get_config(x.device)
    interp = _interpreting()
    gemv_rows = qtype != DENSE and num_m <= cfg.gemv_max_m
    use_dot = num_m > 1
    if use_dot:  # M padded to 16 or 32 rows; a dot takes K >= 16 (BLOCK_K / 2 per half)
        block_m = 16 if num_m <= 16 else 32
        block_n, num_warps = max(16, cfg.qgemm_block_n), cfg.qgemm_num_warps
        block_k = _dot_block_k(cfg)
    else:
        block_m, block_n, num_warps = 1, cfg.skinny_row_block_n, cfg.skinny_row_num_warps
        block_k = cfg.skinny_row_block_k
    if gemv_rows:
        from .quant_gemv import gemv, use_asm
        qs, *rest = weights
        gemv(x2, (_words(qs), *rest), (strides[0] // 4, *strides[1:]), qtype, n, k,
             bias.contiguous() if bias is not None else None, out2, cfg,
             use_asm=use_asm(x), xqs=xqs, tail=tail)
        return out
    swap = use_dot and cfg.qgemm_swap
    packed = use_dot and packed_tiles(cfg, qtype, block_k, x.dtype)
    asm = packed and x.is_cuda and torch.version.hip is None and not interp
    n_programs = triton.cdiv(n, block_n)
    split, tiles = skinny_split_k(cfg, n_programs, triton.cdiv(k, block_k))
    part = torch.empty((split, num_m, n), dtype=torch.float32, device=x.device) \
        if split > 1 else out2
    has_bias = bias is not None
    bias_arg = bias.contiguous() if has_bias else out2
    _skinny_kernel[(n_programs, split)](
        x2, *weights, bias_arg, out2, part, num_m, n, k, triton.cdiv(k, 32), tiles,
        x2.stride(0), out2.stride(0), *strides, QTYPE=qtype, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        DOT_F32=interp and x.dtype == torch.bfloat16, DOT_IEEE=x.dtype == torch.float32,
        SPLIT=split > 1, HAS_BIAS=has_bias, num_warps=num_warps,
        num_stages=cfg.qgemm_num_stages, SWAP=swap, PACKED=packed, ASM=asm,
        PREFETCH=packed and bool(cfg.qgemm_prefetch_scales),
        **pdl_kwargs(x.device, cfg, n_programs * split))
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _reduce_kernel[(num_m, triton.cdiv(n, block))](
            part, bias_arg, out2, num_m, n, split, out2.stride(0), BLOCK=block,
            HAS_BIAS=has_bias, num_warps=4,
            **pdl_kwargs(x.device, cfg, num_m * triton.cdiv(n, block)))
    return out


def packed_tiles(cfg: KernelConfig, qtype: str, block_k: int, dtype: torch.dtype) -> bool:
    """Whether the dot path dequantizes two weights a register (`qgemm_packed`: q4_0, q4_k
    and q6_k weights, bf16 x, K tiles of whole 128s)."""
    return bool(cfg.qgemm_packed) and qtype in PACKED_QTYPES and block_k % 128 == 0 \
        and dtype == torch.bfloat16


def quant_matmul_skinny(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, xqs: dict | None = None,
                        tail=None) -> torch.Tensor:
    """x [..., K] (at most 32 rows; fp16, bf16 or fp32) @ w^T + bias -> [..., N] in x's dtype,
    into `out` when given (a [..., N] tensor with a contiguous last dim). `xqs`: x's int8 forms
    when its producer made them (see `kernels.gemv_input_buffers`). `tail`: see
    `quant_gemv.gemv` (`tail.done` tells whether it ran)."""
    n, k = w.shape
    weights, strides = _weight_args(w)
    return _skinny(x, weights, strides, w.qtype, n, k, bias, out, xqs, tail)


def dense_matmul_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias, with the skinny kernel (any K, any float weight)."""
    n, k = weight.shape
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    return _skinny(x, (weight,) * 6, (weight.stride(0), 0, 0, 0, 1, 1), DENSE, n, k, bias, out)


def quant_matmul_parts(x: torch.Tensor, parts: list, bias: torch.Tensor | None = None,
                       xqs: dict | None = None) -> torch.Tensor:
    """x [..., K] @ [W_0; W_1; ...]^T + bias: a fused projection whose row segments are
    quantized in different types (a Q4_K_M file's q/k in Q4_K, v in Q6_K). Up to
    `skinny_rows` rows each part writes its columns of one output (no concatenation, the
    bias added by the kernels), and at one row x is quantized once for all the parts."""
    num_m = x.numel() // max(x.shape[-1], 1)
    cfg = get_config(x.device)
    if any(num_m > skinny_rows(cfg, w.qtype, x.dtype) for w in parts):
        out = torch.cat([quant_matmul(x, w) for w in parts], dim=-1)
        return out + bias if bias is not None else out
    n = sum(w.shape[0] for w in parts)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    xqs = {} if xqs is None else xqs
    if num_m == 1 and len(parts) == 2 and x.shape[-1] == parts[0].shape[1]:
        from .quant_gemv_pair import matmul_parts_pair
        matmul_parts_pair(x, parts, bias, out, xqs)  # one launch for both (one decode row)
        return out
    start = 0
    for w in parts:
        stop = start + w.shape[0]
        weights, strides = _weight_args(w)
        _skinny(x, weights, strides, w.qtype, w.shape[0], w.shape[1],
                bias[start:stop] if bias is not None else None, out[..., start:stop], xqs)
        start = stop
    return out


def _dot_block_k(cfg: KernelConfig) -> int:
    """BLOCK_K of the skinny kernel's dot path (2-32 rows)."""
    return max(cfg.qgemm_block_k, 32 if _interpreting() else 64)


def skinny_rows(cfg: KernelConfig, qtype: str, dtype: torch.dtype | None = None) -> int:
    """How many rows of x times a `qtype` weight the skinny kernels take (<= 32): past it
    `quant_matmul` dequantizes the weight for cuBLAS. `skinny_max_m`, or `skinny_max_m_q6_k`
    for q6_k (on an H200 its tl.dot tile costs more than the dequantized copy at 9-16 rows,
    bench/results/h200/gemv_mma_pergroup_session22.json) unless x's `dtype` gets packed tiles
    (`packed_tiles`; on an H100 a 24-node tree verify of the 1.5B Q4_K_M shape took 3.25 ms with
    its q6_k matrices on packed tiles against 3.73 ms dequantized,
    bench/results/h100/tree_verify_q4km_packed_ab_session49.json)."""
    limit = cfg.skinny_max_m
    if qtype == "q6_k" and cfg.skinny_max_m_q6_k and not (
            dtype is not None and packed_tiles(cfg, qtype, _dot_block_k(cfg), dtype)):
        limit = cfg.skinny_max_m_q6_k
    return min(32, limit)


def quant_matmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, xqs: dict | None = None,
                 tail=None) -> torch.Tensor:
    """x [..., K] @ w^T + bias in x's dtype: the skinny kernel for up to `skinny_rows` rows,
    else a dequantized scratch copy of w and torch's GEMM. `tail`: see `quant_gemv.gemv`."""
    num_m = x.numel() // max(x.shape[-1], 1)
    if num_m <= skinny_rows(get_config(x.device), w.qtype, x.dtype):
        return quant_matmul_skinny(x, w, bias, out, xqs, tail)
    y = F.linear(x, dequantize_triton(w, x.dtype), bias)
    return y if out is None else out.copy_(y)


from .dequant_triton import dequantize_triton  # noqa: E402  (it reads this module's tiles)

__all__ = ["quant_matmul", "quant_matmul_parts", "quant_matmul_skinny", "dense_matmul_skinny",
           "dequantize_triton",
           "skinny_split_k"]
