"""The quantized GEMV of several rows on tensor cores: y = x @ W^T for gemv_max_m + 1 ..
`gemv_mma_max_m` rows of x (a draft tree's verify is up to ~23 rows, times the batch), W in the
repacked 4-6 bit layout of `quant.py`, x quantized per 32-group to int8 as for the dp4a GEMV
(`quant_gemv.py`, which keeps 1 .. gemv_max_m rows).

Why: past gemv_max_m rows luceio dequantized the layer into a bf16 scratch copy and ran
cuBLAS (writing and reading 4x W's bytes), or, up to 16 rows, multiplied bf16-rounded weights
with tl.dot: on an H200 23 rows of a 7B layer's gate/up cost 4.6x one row
(bench/results/h200/gemv_mma_session22.json). Here each program unpacks one 32-group of its
BLOCK_N weight rows to int8 at a time (work that does not grow with M) and one int8
tensor-core dot gives every (row, output) its exact int32 sum over the group:
[BLOCK_M, 32] x [32, BLOCK_N]; the group's scales are applied in fp32 as the dp4a GEMV applies
them (llama.cpp's MMQ works per block the same way). The next group's codes are loaded while
this one computes.

Numerics: each group's int32 sum is exact and its scales are applied as in the dp4a GEMV, but
the groups are summed in another order, so rows equal the dp4a GEMV's one-row result up to fp32
rounding, not bit for bit (a bit-exact form needs the one-row kernel's 32 group slots per row
and output in registers: measured ~20x slower, session 22). The dp4a GEMV therefore keeps the
rows where bit equality with decode steps is promised (up to gemv_max_m: a chain verify,
small batches).

Element order inside a group does not matter to its sum as long as x and W agree: code byte j
holds elements j (low nibble) and j + 16 (high nibble); the tile puts them at 2j and 2j + 1
(`tl.join`), and x is loaded in that order from its two planes. q6_k's two sub-scales need the
sums of a group's halves apart: two dots, x's other half zeroed in each. q8_0 (half-group
scales) is not taken.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv_sum import store_rows
from .pdl import pdl_enter, pdl_kwargs
from .quant_gemv import split_counters, x_forms

# the types whose groups are 32 elements under one (or, q6_k, two) integer sums
MMA_QTYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def mma_takes(cfg, qtype: str, rows: int) -> bool:
    """Whether `rows` rows of x times a `qtype` weight go to this GEMV under `cfg`."""
    return qtype in MMA_QTYPES and cfg.gemv_max_m < rows <= cfg.gemv_mma_max_m


@triton.jit
def _rows_tile(base, row0, N, stride, first, C: tl.constexpr, BN: tl.constexpr):
    """[BN, C]: base[row * stride + first + c] for rows row0 .. (< N), 0 past N."""
    rows = row0 + tl.arange(0, BN)
    col = first + tl.arange(0, C)[None, :]
    return tl.load(base + rows.to(tl.int64)[:, None] * stride + col, mask=(rows < N)[:, None],
                   other=0)


@triton.jit
def _per_row(base, row0, N, stride, at, BN: tl.constexpr):
    """[1, BN]: base[row * stride + at] for rows row0 .. (< N), 0 past N."""
    rows = row0 + tl.arange(0, BN)
    return tl.load(base + rows.to(tl.int64) * stride + at, mask=rows < N, other=0)[None, :]


@triton.jit
def _x_group(xb, M, KG, g, BM: tl.constexpr):
    """[BM, 32] int8: group g of x's rows < M in the tile's element order (2j + h: plane h,
    byte j), 0 past M; each plane's 16 bytes one contiguous load."""
    m = tl.arange(0, BM)[:, None]
    off = m * (KG * 16) + g * 16 + tl.arange(0, 16)[None, :]
    lo = tl.load(xb + off, mask=m < M, other=0)
    hi = tl.load(xb + M * KG * 16 + off, mask=m < M, other=0)
    return tl.reshape(tl.join(lo, hi), [BM, 32])


@triton.jit
def _w_group(codes, qh_ptr, row0, N, s_qh, g, QTYPE: tl.constexpr, BN: tl.constexpr):
    """[32, BN] int8: the unsigned code values (with their fifth / sixth bits) of group g of
    rows row0 .., position 2j + h = element j + 16 h. `codes`: the group's bytes [BN, 16]."""
    b = codes.to(tl.int32)
    lo = b & 15
    hi = b >> 4
    j = tl.arange(0, 16)[None, :]
    if QTYPE == "q5_0" or QTYPE == "q5_1" or QTYPE == "q5_k":
        hw = tl.reshape(_per_row(qh_ptr, row0, N, s_qh, g, BN), [BN, 1])  # bit e: element e
        lo |= ((hw >> j) & 1) << 4
        hi |= ((hw >> (16 + j)) & 1) << 4
    if QTYPE == "q6_k":
        h0 = tl.reshape(_per_row(qh_ptr, row0, N, s_qh, 2 * g, BN), [BN, 1])
        h1 = tl.reshape(_per_row(qh_ptr, row0, N, s_qh, 2 * g + 1, BN), [BN, 1])
        lo |= ((h0 >> (2 * j)) & 3) << 4         # bits 2j, 2j + 1: element j's high bits
        hi |= ((h1 >> (2 * j)) & 3) << 4
    w = tl.reshape(tl.join(lo, hi), [BN, 32]).to(tl.int8)
    return tl.trans(w)


@triton.jit
def _mma_kernel(xq_ptr, xs_ptr, xsum_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, KG, groups_per_split, s_om, s_qs,
                s_qh, s_d, s_sc, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                PAIRED: tl.constexpr, PDL: tl.constexpr = False,
                PDL_EARLY: tl.constexpr = False):
    """Program (pid_n, split): output features pid_n * BLOCK_N .. of rows < M over the
    groups of split `split`, one group a step (see the module docstring)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    K_QUANT: tl.constexpr = QTYPE == "q4_k" or QTYPE == "q5_k" or QTYPE == "q6_k"
    row0 = pid_n * BLOCK_N
    mi = tl.arange(0, BLOCK_M)
    mrow = mi < M
    g_start = split * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, KG)
    qb = qs_ptr.to(tl.pointer_type(tl.uint8))
    xb = xq_ptr.to(tl.pointer_type(tl.int8))
    nxt = _rows_tile(qb, row0, N, s_qs * 4, g_start * 16, 16, BLOCK_N)
    pdl_enter(PDL, PDL_EARLY)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(g_start, g_end):
        codes = nxt
        nxt = _rows_tile(qb, row0, N, s_qs * 4, tl.minimum(g + 1, g_end - 1) * 16, 16, BLOCK_N)
        w = _w_group(codes, qh_ptr, row0, N, s_qh, g, QTYPE, BLOCK_N)           # [32, BN]
        x = _x_group(xb, M, KG, g, BLOCK_M)                                    # [BM, 32]
        xs = tl.load(xs_ptr + mi * KG + g, mask=mrow, other=0)[:, None]        # [BM, 1]
        sum_lo = tl.load(xsum_ptr + mi * KG + g, mask=mrow, other=0)[:, None]
        sum_hi = tl.load(xsum_ptr + M * KG + mi * KG + g, mask=mrow, other=0)[:, None]
        if QTYPE == "q6_k":
            half = (tl.arange(0, 32) % 2)[None, :]
            s_lo = tl.dot(tl.where(half == 0, x, 0).to(tl.int8), w, out_dtype=tl.int32)
            s_hi = tl.dot(tl.where(half == 1, x, 0).to(tl.int8), w, out_dtype=tl.int32)
        else:
            s_lo = tl.dot(x, w, out_dtype=tl.int32)                            # [BM, BN]
        if PAIRED:  # q4_k / q5_k in `quant.pair_scales` form: (d, dmin) and (sc, mn) pairs
            dd = _per_row(d_ptr.to(tl.pointer_type(tl.int32)), row0, N, s_d // 2, g // 8,
                          BLOCK_N)
            d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = ((dd >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
            scmn = _per_row(sc_ptr.to(tl.pointer_type(tl.int16)), row0, N, s_sc // 2, g,
                            BLOCK_N).to(tl.int32)
            sc = (scmn & 0xFF).to(tl.float32)
            mn = ((scmn >> 8) & 0xFF).to(tl.float32)
        elif K_QUANT:
            d = _per_row(d_ptr, row0, N, s_d, g // 8, BLOCK_N).to(tl.float32)
        else:
            d = _per_row(d_ptr, row0, N, s_d, g, BLOCK_N).to(tl.float32)
        x_sum = sum_lo + sum_hi
        if QTYPE == "q4_0":
            acc += (d * xs) * (s_lo - 8 * x_sum).to(tl.float32)
        elif QTYPE == "q5_0":
            acc += (d * xs) * (s_lo - 16 * x_sum).to(tl.float32)
        elif QTYPE == "q4_1" or QTYPE == "q5_1":
            mm = _per_row(m_ptr, row0, N, s_d, g, BLOCK_N).to(tl.float32)
            acc += xs * (d * s_lo.to(tl.float32) + mm * x_sum.to(tl.float32))
        elif QTYPE == "q6_k":
            pair = _per_row(sc_ptr.to(tl.pointer_type(tl.int16)), row0, N, s_sc // 2, g,
                            BLOCK_N).to(tl.int32)
            sc_lo = ((pair << 24) >> 24).to(tl.float32)
            sc_hi = (pair >> 8).to(tl.float32)
            acc += (d * xs) * (sc_lo * (s_lo - 32 * sum_lo).to(tl.float32)
                               + sc_hi * (s_hi - 32 * sum_hi).to(tl.float32))
        else:  # q4_k, q5_k: (d * sc) * q - dmin * mn
            if not PAIRED:
                sc = _per_row(sc_ptr, row0, N, s_sc, g, BLOCK_N)
                mn = _per_row(mn_ptr, row0, N, s_sc, g, BLOCK_N)
                dmin = _per_row(m_ptr, row0, N, s_d, g // 8, BLOCK_N)
            acc += xs * ((d * sc.to(tl.float32)) * s_lo.to(tl.float32)
                         - (dmin.to(tl.float32) * mn.to(tl.float32)) * x_sum.to(tl.float32))
    store_rows(acc, mi, row0 + tl.arange(0, BLOCK_N), pid_n, split, tl.num_programs(1), M, N,
               bias_ptr, out_ptr, part_ptr, cnt_ptr, s_om, BLOCK_M, BLOCK_N, SPLIT, HAS_BIAS)


def gemv_mma(x2, weights: tuple, strides: tuple, qtype: str, n: int, k: int, bias, out2, cfg,
             xqs: dict | None = None) -> None:
    """out2 [M, N] = x2 [M, K] @ W^T (+ bias) for M rows (`mma_takes`), in launches of up to
    `gemv_mma_rows_per_launch` rows, each reading W once; `weights` / `strides` as
    `quant_gemv.gemv` takes them. K is split while N alone gives fewer than
    `gemv_mma_split_min_programs` programs, into splits of >= 8 groups."""
    from .quant_args import paired
    qs, qh, d, m, sc, mn = weights
    pair = qtype in ("q4_k", "q5_k") and paired(d, m) and paired(sc, mn)
    if not pair and d.stride(-1) != 1:  # half of a pair: the plain kernel reads stride 1
        d, m, sc, mn = (t.contiguous() for t in (d, m, sc, mn))
    if qtype == "q6_k" and sc.data_ptr() % 2:  # its sub-scales are read in pairs
        sc = sc.clone()
    num_m, kg = x2.shape[0], k // 32
    block_n = max(16, cfg.gemv_mma_block_n)
    programs = triton.cdiv(n, block_n)
    split = 1
    if programs < cfg.gemv_mma_split_min_programs:
        split = max(1, min(triton.cdiv(cfg.gemv_mma_split_min_programs, programs), kg // 8, 32))
    gps = triton.cdiv(kg, split)
    split = triton.cdiv(kg, gps)
    step = max(16, cfg.gemv_mma_rows_per_launch)
    for r0 in range(0, num_m, step):
        rows = min(step, num_m - r0)
        x_r, out_r = x2[r0:r0 + rows], out2[r0:r0 + rows]
        xq, xs, xsum = x_forms(x_r, qtype, num_m, r0, rows, xqs)
        part = torch.empty((split, rows, n), dtype=torch.float32, device=x2.device) \
            if split > 1 else out_r
        counters = split_counters(x2.device, programs) if split > 1 else xsum
        _mma_kernel[(programs, split)](
            xq.view(torch.int32), xs, xsum, qs, qh, d, m, sc, mn,
            bias if bias is not None else out_r, out_r, part, counters, rows, n, kg, gps,
            out_r.stride(0), strides[0], qh.stride(0), d.stride(0), sc.stride(0),
            QTYPE=qtype, BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n,
            SPLIT=split > 1, HAS_BIAS=bias is not None, PAIRED=pair,
            num_warps=cfg.gemv_mma_num_warps, num_stages=1,
            **pdl_kwargs(x2.device, cfg, programs * split))
