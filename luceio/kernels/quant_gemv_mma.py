"""The quantized GEMV of a few rows on tensor cores: y = x @ W^T for 2 .. `gemv_mma_max_m` rows of
x (a speculative verify: a chain of k drafts is k + 1 rows, a draft tree up to ~23, times the
batch), W in the repacked 4-6 bit layout of `quant.py`, x quantized per 32-group to int8 as for
the one-row GEMV (`quant_gemv.py`).

Why: the one-row GEMV multiplies codes with `dp4a`, one instruction per 4 codes per row, so
past one row it is bound by integer throughput, not by reading W: 5 rows cost ~2.5x one row
on an H200 (bench/results/h200/draft_cost_7b_profile_nopdl_session21.json), which is what kept
speculation from paying there. Here each program unpacks its weight tile to int8 once (M-free
work) and one batched int8 tensor-core dot gives every (row, output, group) its exact int32 sum
of 32 products: [G, BLOCK_M, 32] x [G, 32, BLOCK_N] -> [G, BLOCK_M, BLOCK_N], the group as the
batch axis, because every group has scales of its own (llama.cpp's MMQ works per block too).

Bit-exact with one row alone: the int32 sums are the ones `dp4a` gives; the float work per
(row, output, group) is the same expression as `quant_gemv.gemv_body`'s on the same operands;
the groups go to the same G slots (one tile of G = gemv_block_k / 32 groups per step, slot i
taking groups g_start + i, g_start + G + i, ...), K is split as for one row and the partials
summed in split order, and the slots are summed in the fixed tree of `gemv_sum.py`. So a verify
step's rows give the bits of the decode steps they stand for (tested on the interpreter and
natively). q6_k's two sub-scales need the sums of a group's halves apart: two dots, x's other
half zeroed in each. q8_0 (sums per half-group, 16 products) stays on the dp4a GEMV.

Element order inside a group does not matter to a sum as long as x and W agree: code byte j
holds elements j (low nibble) and j + 16 (high nibble); the tile puts them at 2j and 2j + 1
(`tl.join`), and x is loaded in that order from its two planes.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_sum import slot_sum_first, store_rows
from .pdl import pdl_enter, pdl_kwargs
from .quant_gemv import _row_tile, prepare_launch, runtime_args, split_counters, x_forms

# the types whose groups are 32 elements under one (or, q6_k, two) integer sums
MMA_QTYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def mma_takes(cfg, qtype: str, rows: int) -> bool:
    """Whether `rows` rows of x times a `qtype` weight go to this GEMV under `cfg`."""
    return (qtype in MMA_QTYPES and cfg.gemv_mma_min_m > 0
            and cfg.gemv_mma_min_m <= rows <= cfg.gemv_mma_max_m)


@triton.jit
def _g_tile(base, row0, N, stride, g0, g_end, BN: tl.constexpr, G: tl.constexpr,
            PER: tl.constexpr):
    """[G, 1, BN]: base[row * stride + g // PER] for groups g0 .. g0 + G - 1 (< g_end) and
    rows row0 .. (< N), 0 outside."""
    g = g0 + tl.arange(0, G)[:, None, None]
    rows = row0 + tl.arange(0, BN)[None, None, :]
    return tl.load(base + rows.to(tl.int64) * stride + g // PER, mask=(rows < N) & (g < g_end),
                   other=0)


@triton.jit
def _x_tile(xb, M, KG, g0, g_end, G: tl.constexpr, BM: tl.constexpr):
    """[G, BM, 32] int8: x's quantized elements of groups g0 .. (< g_end), rows < M, in the
    tile's order (position 2j + h: plane h, byte j), 0 outside."""
    g = g0 + tl.arange(0, G)[:, None, None]
    m = tl.arange(0, BM)[None, :, None]
    e = tl.arange(0, 32)[None, None, :]
    off = (e % 2) * (M * KG * 16) + m * (KG * 16) + g * 16 + e // 2
    return tl.load(xb + off, mask=(m < M) & (g < g_end), other=0)


@triton.jit
def _x_groups3(base, M, KG, g0, g_end, G: tl.constexpr, BM: tl.constexpr):
    """[G, BM, 1]: base[m * KG + g], 0 outside."""
    g = g0 + tl.arange(0, G)[:, None, None]
    m = tl.arange(0, BM)[None, :, None]
    return tl.load(base + m * KG + g, mask=(m < M) & (g < g_end), other=0)


@triton.jit
def _w_tile(qs_ptr, qh_ptr, row0, N, s_qs, s_qh, g0, g_end, codes, QTYPE: tl.constexpr,
            BN: tl.constexpr, G: tl.constexpr):
    """[G, 32, BN] int8: the unsigned code values (with their fifth / sixth bits) of the
    tile's groups, position 2j + h of a group = element j + 16 h. `codes`: the tile's code
    bytes [BN, G * 16] (int32)."""
    b = tl.reshape(codes, [BN, G, 16])
    lo = b & 15
    hi = b >> 4
    j = tl.arange(0, 16)[None, None, :]
    if QTYPE == "q5_0" or QTYPE == "q5_1" or QTYPE == "q5_k":
        hw = _row_tile(qh_ptr, row0, N, s_qh, g0, g_end, BN, G)[:, :, None]      # bit e: element e
        lo |= ((hw >> j) & 1) << 4
        hi |= ((hw >> (16 + j)) & 1) << 4
    if QTYPE == "q6_k":
        h01 = _row_tile(qh_ptr.to(tl.pointer_type(tl.int64)), row0, N, s_qh // 2, g0, g_end,
                        BN, G)[:, :, None]
        h0 = (h01 & 0xFFFFFFFF).to(tl.int32)     # bits 2j, 2j + 1: element j's high bits
        h1 = ((h01 >> 32) & 0xFFFFFFFF).to(tl.int32)
        lo |= ((h0 >> (2 * j)) & 3) << 4
        hi |= ((h1 >> (2 * j)) & 3) << 4
    w = tl.reshape(tl.join(lo, hi), [BN, G, 32]).to(tl.int8)
    return tl.permute(w, (1, 2, 0))


@triton.jit
def _mma_kernel(xq_ptr, xs_ptr, xsum_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, KG, groups_per_split, s_om, s_qs,
                s_qh, s_d, s_sc, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, G: tl.constexpr, PREFETCH: tl.constexpr,
                SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, PAIRED: tl.constexpr,
                PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    """Program (pid_n, split): output features pid_n * BLOCK_N .. of rows < M, groups of
    split `split` (see the module docstring); the float work mirrors `gemv_body`'s."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    K_QUANT: tl.constexpr = QTYPE == "q4_k" or QTYPE == "q5_k" or QTYPE == "q6_k"
    row0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    mi = tl.arange(0, BLOCK_M)
    g_start = split * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, KG)
    qb = qs_ptr.to(tl.pointer_type(tl.uint8))
    xb = xq_ptr.to(tl.pointer_type(tl.int8))
    if PREFETCH:
        nxt = _row_tile(qb, row0, N, s_qs * 4, g_start * 16, g_end * 16, BLOCK_N, G * 16)
    pdl_enter(PDL, PDL_EARLY)
    acc = tl.zeros([G, BLOCK_M, BLOCK_N], tl.float32)
    for g0 in range(g_start, g_end, G):
        if PREFETCH:
            codes = nxt
            nxt = _row_tile(qb, row0, N, s_qs * 4, (g0 + G) * 16, g_end * 16, BLOCK_N, G * 16)
        else:
            codes = _row_tile(qb, row0, N, s_qs * 4, g0 * 16, g_end * 16, BLOCK_N, G * 16)
        w = _w_tile(qs_ptr, qh_ptr, row0, N, s_qs, s_qh, g0, g_end, codes.to(tl.int32), QTYPE,
                    BLOCK_N, G)
        x = _x_tile(xb, M, KG, g0, g_end, G, BLOCK_M)                         # [G, BM, 32]
        xs = _x_groups3(xs_ptr, M, KG, g0, g_end, G, BLOCK_M)                 # [G, BM, 1]
        sum_lo = _x_groups3(xsum_ptr, M, KG, g0, g_end, G, BLOCK_M)           # int32
        sum_hi = _x_groups3(xsum_ptr + M * KG, M, KG, g0, g_end, G, BLOCK_M)
        if QTYPE == "q6_k":
            half = (tl.arange(0, 32) % 2)[None, None, :]
            s_lo = tl.dot(tl.where(half == 0, x, 0).to(tl.int8), w, out_dtype=tl.int32)
            s_hi = tl.dot(tl.where(half == 1, x, 0).to(tl.int8), w, out_dtype=tl.int32)
        else:
            s_lo = tl.dot(x, w, out_dtype=tl.int32)                           # [G, BM, BN]
        if PAIRED:  # q4_k / q5_k in `quant.pair_scales` form: (d, dmin) and (sc, mn) pairs
            dd = _g_tile(d_ptr.to(tl.pointer_type(tl.int32)), row0, N, s_d // 2, g0, g_end,
                         BLOCK_N, G, 8)
            d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = ((dd >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
            scmn = _g_tile(sc_ptr.to(tl.pointer_type(tl.int16)), row0, N, s_sc // 2, g0,
                           g_end, BLOCK_N, G, 1).to(tl.int32)
            sc = (scmn & 0xFF).to(tl.float32)
            mn = ((scmn >> 8) & 0xFF).to(tl.float32)
        elif K_QUANT:
            d = _g_tile(d_ptr, row0, N, s_d, g0, g_end, BLOCK_N, G, 8).to(tl.float32)
        else:
            d = _g_tile(d_ptr, row0, N, s_d, g0, g_end, BLOCK_N, G, 1).to(tl.float32)
        x_sum = sum_lo + sum_hi
        if QTYPE == "q4_0":
            acc += (d * xs) * (s_lo - 8 * x_sum).to(tl.float32)
        elif QTYPE == "q5_0":
            acc += (d * xs) * (s_lo - 16 * x_sum).to(tl.float32)
        elif QTYPE == "q4_1" or QTYPE == "q5_1":
            mm = _g_tile(m_ptr, row0, N, s_d, g0, g_end, BLOCK_N, G, 1).to(tl.float32)
            acc += xs * (d * s_lo.to(tl.float32) + mm * x_sum.to(tl.float32))
        elif QTYPE == "q6_k":
            pair = _g_tile(sc_ptr.to(tl.pointer_type(tl.int16)), row0, N, s_sc // 2, g0,
                           g_end, BLOCK_N, G, 1).to(tl.int32)
            sc_lo = ((pair << 24) >> 24).to(tl.float32)
            sc_hi = (pair >> 8).to(tl.float32)
            acc += (d * xs) * (sc_lo * (s_lo - 32 * sum_lo).to(tl.float32)
                               + sc_hi * (s_hi - 32 * sum_hi).to(tl.float32))
        else:  # q4_k, q5_k: (d * sc) * q - dmin * mn
            if not PAIRED:
                sc = _g_tile(sc_ptr, row0, N, s_sc, g0, g_end, BLOCK_N, G, 1)
                mn = _g_tile(mn_ptr, row0, N, s_sc, g0, g_end, BLOCK_N, G, 1)
                dmin = _g_tile(m_ptr, row0, N, s_d, g0, g_end, BLOCK_N, G, 8)
            acc += xs * ((d * sc.to(tl.float32)) * s_lo.to(tl.float32)
                         - (dmin.to(tl.float32) * mn.to(tl.float32)) * x_sum.to(tl.float32))
    y = slot_sum_first(acc, BLOCK_M, BLOCK_N, G)
    store_rows(y, mi, rows, pid_n, split, nsplit, M, N, bias_ptr, out_ptr, part_ptr, cnt_ptr,
               s_om, BLOCK_M, BLOCK_N, SPLIT, HAS_BIAS)


def gemv_mma(x2, weights: tuple, strides: tuple, qtype: str, n: int, k: int, bias, out2, cfg,
             xqs: dict | None = None) -> None:
    """out2 [M, N] = x2 [M, K] @ W^T (+ bias) for M rows (`mma_takes`), launches of up to
    `gemv_mma_rows_per_launch` rows, each reading W once; arguments as `quant_gemv.gemv`."""
    num_m = x2.shape[0]
    weights, strides, pair, split, gps, _, _ = prepare_launch(weights, strides, qtype, n, k,
                                                              1, cfg)
    block_n = max(16, cfg.gemv_mma_block_n)
    programs = triton.cdiv(n, block_n)
    step = max(16, cfg.gemv_mma_rows_per_launch)
    for r0 in range(0, num_m, step):
        rows = min(step, num_m - r0)
        x_r, out_r = x2[r0:r0 + rows], out2[r0:r0 + rows]
        xq, xs, xsum = x_forms(x_r, qtype, num_m, r0, rows, xqs)
        counters = split_counters(x2.device, programs) if split > 1 else None
        _mma_kernel[(programs, split)](
            *runtime_args(xq, xs, xsum, weights, strides, bias, out_r, split, gps, rows, n, k,
                          counters),
            QTYPE=qtype, BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n,
            G=max(1, cfg.gemv_block_k // 32), PREFETCH=cfg.gemv_prefetch,
            SPLIT=split > 1, HAS_BIAS=bias is not None, PAIRED=pair,
            num_warps=cfg.gemv_mma_num_warps,
            **pdl_kwargs(x2.device, cfg, programs * split))
