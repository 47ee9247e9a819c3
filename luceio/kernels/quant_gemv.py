"""The quantized GEMV of decode and speculative verify: y = x @ W^T for a few rows of x [M, K]
(M <= `gemv_max_m`) and W in the repacked layout of `quant.py`, on integer dot products. Each
weight tile is loaded and its codes unpacked once, then multiplied with every row of x (a
leading axis of the tiles): at M rows the weight is read once, where a kernel per row would read
it M times.

Why integers: at one row a GEMV must turn every 4-6 bit code into a number and multiply it, and
done in fp32 that is ~10 instructions a weight, which caps a Triton kernel at ~15-20% of HBM
bandwidth on an H200 (measured, bench/gemv_sweep.py). Here x is first quantized per 32-group
to int8 (`quant_x.py`: scale = max |x| / 127, round half away from zero; llama.cpp's
q8_1 does the same), so four codes times four activations are one `dp4a` (an int8 4-way dot
product with an int32 accumulator): codes are unpacked four at a time with 32-bit masks
(`w & 0x0F0F0F0F` is four low nibbles), and the only float work is once per group. The result
equals the exact product of W with the dequantized int8 x (xq * scale) up to fp32 rounding;
x's quantization error is the price (relative ~1/254 of a group's largest |x|).

Layout facts used (see `quant.py`): in a 32-group, code byte j holds element j (low nibble) and
element j + 16 (high nibble), so word j's low nibbles are elements 4j..4j+3 and its high nibbles
16+4j..16+4j+3, which match word j of x's two int8 planes (elements 0-15 and 16-31). The q5
fifth bits of a group are one word (bit e = element e); q6_k's high bits of element e = 4j + i + 16h are bits 8j + 2i and
8j + 2i + 1 of the group's high word h. Both are moved next to their nibbles with one multiply
each (`_spread1`, `_spread2`). q6_k's sub-scales cover 16 elements: the low-nibble half (h = 0)
and the high half (h = 1) of a group.

`dp4a` is PTX inline assembly on NVIDIA GPUs (sm_61 and later); elsewhere (ROCm, the CPU
interpreter) `_dp4a` runs the same product with shifts and multiplies, exactly.

Layout: one warp per program, one thread per 32-group (16 bytes of codes; q8_0 as two 16-byte
half-groups), the program's BLOCK_N rows in each thread's registers. Every tile is loaded from
addresses contiguous along the thread axis (`_row_tile`, `_shared_tile`, `_x_rows`), so
Triton gives the load the layout the dot products use: with a tie between rows and groups in its
contiguity order, Triton 3.6 put threads across rows and moved each tile through shared memory,
which held this kernel at ~37% of copy bandwidth (`bench/results/h200/gemv_sweep_history/`).

Every row of x is computed exactly as it would be alone (the same integer products and fp32 sums in
the same order), so a verify step's rows equal the decode steps they replace. The rows of a
launch are one power-of-two block, or two where that pads less (`gemv_row_blocks`, 5 = 4 + 1: a
padded row costs its dot products as a real one does); both blocks run the same expressions
(`quant_gemv_tiles._block_acc`), so a row's bits do not depend on its block.

The grid is (cdiv(N, BLOCK_N), SPLIT_K); with SPLIT_K > 1 the programs write fp32 partials and
the last one of a row block to arrive sums them in split order (deterministic), in the same
launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import skinny_split_k
from .pdl import pdl_enter, pdl_kwargs
from .quant_gemv_tiles import (_block_acc, _block_dots, _row_tile, _shared_tile, _spread1,
                               _spread2, _x_block)
from .quant_gemv_tail import gemv_tail, tail_launch
from .quant_x import quantize_x


@triton.jit
def _store_rows(y, mi, M, N, cols, nmask, bias_ptr, out_ptr, s_om, HAS_BIAS: tl.constexpr):
    """out[mi, cols] = y (+ bias) for rows mi < M."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=nmask[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + mi[:, None] * s_om + cols, y.to(out_ptr.dtype.element_ty),
             mask=(mi < M)[:, None] & nmask[None, :])


@triton.jit
def _sum_parts(part_ptr, nsplit, mi, M, N, cols, nmask, BM: tl.constexpr, BN: tl.constexpr):
    """The split partials of rows mi summed in split order."""
    y = tl.zeros([BM, BN], tl.float32)
    omask = (mi < M)[:, None] & nmask[None, :]
    for s in range(0, nsplit):
        y += tl.load(part_ptr + (s * M + mi[:, None]).to(tl.int64) * N + cols, mask=omask,
                     other=0.0, cache_modifier=".cg")
    return y


@triton.jit
def gemv_body(pid_n, split, nsplit, xq_ptr, xs_ptr, xsum_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr,
               sc_ptr, mn_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, KG, groups_per_split,
               s_om, s_qs, s_qh, s_d, s_sc, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, G: tl.constexpr, PREFETCH: tl.constexpr,
               ASM: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
               PAIRED: tl.constexpr, PDL: tl.constexpr = False,
               PDL_EARLY: tl.constexpr = False, EARLY_LOAD: tl.constexpr = False,
               BLOCK_M2: tl.constexpr = 0, M0=0, t_a=0, t_b=0, t_c=0, t_d=0, s_a=0, t_cnt=0,
               t_arrivals=0, t_eps=0.0, t_kg=0, txq0=0, txs0=0, txsum0=0, txq1=0, txs1=0,
               txsum1=0, TAIL: tl.constexpr = 0, TAIL_CHUNK: tl.constexpr = 32,
               TAIL_ONE: tl.constexpr = True, TAIL_XQ_PLANES: tl.constexpr = False,
               TAIL_XQ_GROUPS: tl.constexpr = False):
    """Program (pid_n, split) of `nsplit` K-splits: output rows pid_n * BLOCK_N ... . `PDL`:
    waits for the kernel before (`pdl_enter`) itself, after loading its first code words
    with PREFETCH and EARLY_LOAD (no kernel of a step writes weights). x's rows are one block
    of BLOCK_M (0 .. BLOCK_M - 1) or, with BLOCK_M2 > 0, two: BLOCK_M rows and the next
    BLOCK_M2 (5 rows as 4 + 1 instead of 8 with 3 masked; every weight tile is decoded once for
    both). M0: the first row of x (and of out) this program computes (`moe_quant_triton`:
    one row of many per program). TAIL (`quant_gemv_tail.gemv_tail`, its t_* arguments):
    after its output is stored, the work of the launch that would follow (M0 = 0, all rows)."""
    # q8_0's 8 words per group are handled as two half-groups of 4 words (H = 2 per group),
    # so every type's tile is [BN, G * H, 4] with one thread per (half-)group; the M rows of x
    # are a leading axis that every weight tile is broadcast over (loaded and decoded once)
    H: tl.constexpr = 2 if QTYPE == "q8_0" else 1
    GH: tl.constexpr = G * H
    K_QUANT: tl.constexpr = QTYPE == "q4_k" or QTYPE == "q5_k" or QTYPE == "q6_k"
    FIVE: tl.constexpr = QTYPE == "q5_0" or QTYPE == "q5_1" or QTYPE == "q5_k"
    TWO: tl.constexpr = BLOCK_M2 > 0
    BM2: tl.constexpr = BLOCK_M2 if BLOCK_M2 > 0 else 1
    row0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    nmask = rows < N
    mi = M0 + tl.arange(0, BLOCK_M)
    mi2 = M0 + BLOCK_M + tl.arange(0, BM2)
    jj = tl.arange(0, 4)[None, None, :]                                  # [1, 1, 4]
    g_start = split * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, KG)

    acc = tl.zeros([BLOCK_M, BLOCK_N, GH], tl.float32)
    acc2 = tl.zeros([BM2, BLOCK_N, GH], tl.float32)
    WG: tl.constexpr = 4 * H                                             # words per group
    if PREFETCH and EARLY_LOAD:  # the next tile's code words load while this tile computes
        nxt = _row_tile(qs_ptr, row0, N, s_qs, g_start * WG, g_end * WG, BLOCK_N, G * WG)
    pdl_enter(PDL, PDL_EARLY)
    if PREFETCH and not EARLY_LOAD:
        nxt = _row_tile(qs_ptr, row0, N, s_qs, g_start * WG, g_end * WG, BLOCK_N, G * WG)
    for g0 in range(g_start, g_end, G):
        if PREFETCH:
            words = nxt
            nxt = _row_tile(qs_ptr, row0, N, s_qs, (g0 + G) * WG, g_end * WG, BLOCK_N, G * WG)
        else:
            words = _row_tile(qs_ptr, row0, N, s_qs, g0 * WG, g_end * WG, BLOCK_N, G * WG)
        words = tl.reshape(words, [BLOCK_N, GH, 4])                      # [BN, GH, 4] int32
        x_lo, x_hi, xs, sum_lo, sum_hi = _x_block(mi, M, KG, g0, g_end, xq_ptr, xs_ptr,
                                                  xsum_ptr, QTYPE, BLOCK_M, BLOCK_N, G, GH)
        if TWO:
            x_lo2, x_hi2, xs2, sum_lo2, sum_hi2 = _x_block(mi2, M, KG, g0, g_end, xq_ptr,
                                                           xs_ptr, xsum_ptr, QTYPE, BM2,
                                                           BLOCK_N, G, GH)
        if QTYPE == "q8_0":
            lo = words
            hi = words
        else:
            lo = words & 0x0F0F0F0F
            hi = (words >> 4) & 0x0F0F0F0F
            if FIVE:
                hw = _row_tile(qh_ptr, row0, N, s_qh, g0, g_end, BLOCK_N, G)[:, :, None]
                lo |= _spread1((hw >> (4 * jj)) & 15)
                hi |= _spread1((hw >> (16 + 4 * jj)) & 15)
            if QTYPE == "q6_k":
                # the group's two high-bit words are adjacent: one 64-bit load
                h01 = _row_tile(qh_ptr.to(tl.pointer_type(tl.int64)), row0, N, s_qh // 2, g0,
                                g_end, BLOCK_N, G)[:, :, None]
                h0 = (h01 & 0xFFFFFFFF).to(tl.int32)
                h1 = ((h01 >> 32) & 0xFFFFFFFF).to(tl.int32)
                lo |= _spread2((h0 >> (8 * jj)) & 255)
                hi |= _spread2((h1 >> (8 * jj)) & 255)
        s_lo, s_hi = _block_dots(lo, hi, x_lo, x_hi, QTYPE, ASM)
        if TWO:
            s_lo2, s_hi2 = _block_dots(lo, hi, x_lo2, x_hi2, QTYPE, ASM)
        if PAIRED:  # q4_k / q5_k in `quant.pair_scales` form: (d, dmin) and (sc, mn) pairs
            dd = _shared_tile(d_ptr.to(tl.pointer_type(tl.int32)), row0, N, s_d // 2, g0,
                              g_end, BLOCK_N, G, 8)
            d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = ((dd >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
            scmn = _row_tile(sc_ptr.to(tl.pointer_type(tl.int16)), row0, N, s_sc // 2, g0,
                             g_end, BLOCK_N, G).to(tl.int32)
            sc = (scmn & 0xFF).to(tl.float32)
            mn = ((scmn >> 8) & 0xFF).to(tl.float32)
        elif K_QUANT:
            d = _shared_tile(d_ptr, row0, N, s_d, g0, g_end, BLOCK_N, G, 8).to(tl.float32)
        elif QTYPE == "q8_0":
            d = _shared_tile(d_ptr, row0, N, s_d, g0 * 2, g_end * 2, BLOCK_N, GH,
                             2).to(tl.float32)
        else:
            d = _row_tile(d_ptr, row0, N, s_d, g0, g_end, BLOCK_N, G).to(tl.float32)
        d = d[None]                                                      # [1, BN, G]
        # the tile's scale terms, per type (what `_block_acc` multiplies them with)
        w2 = d
        w3 = d
        if QTYPE == "q4_0" or QTYPE == "q5_0" or QTYPE == "q8_0":
            w1 = d
        elif QTYPE == "q4_1" or QTYPE == "q5_1":
            w1 = d
            w2 = _row_tile(m_ptr, row0, N, s_d, g0, g_end, BLOCK_N, G).to(tl.float32)[None]
        elif QTYPE == "q6_k":
            # a group's two int8 sub-scales are adjacent: one 16-bit load (little-endian)
            pair = _row_tile(sc_ptr.to(tl.pointer_type(tl.int16)), row0, N, s_sc // 2, g0,
                             g_end, BLOCK_N, G).to(tl.int32)[None]
            w1 = d
            w2 = ((pair << 24) >> 24).to(tl.float32)
            w3 = (pair >> 8).to(tl.float32)
        else:  # q4_k, q5_k
            if not PAIRED:
                sc = _row_tile(sc_ptr, row0, N, s_sc, g0, g_end, BLOCK_N, G)
                mn = _row_tile(mn_ptr, row0, N, s_sc, g0, g_end, BLOCK_N, G)
                dmin = _shared_tile(m_ptr, row0, N, s_d, g0, g_end, BLOCK_N, G, 8)
            w1 = d * sc.to(tl.float32)[None]
            w2 = (dmin.to(tl.float32) * mn.to(tl.float32))[None]
        acc = _block_acc(acc, s_lo, s_hi, xs, sum_lo, sum_hi, w1, w2, w3, QTYPE)
        if TWO:
            acc2 = _block_acc(acc2, s_lo2, s_hi2, xs2, sum_lo2, sum_hi2, w1, w2, w3, QTYPE)

    y = tl.sum(acc, 2)                                                   # [BM, BN]
    y2 = tl.sum(acc2, 2)
    cols = rows[None, :]
    if SPLIT:
        # Each split writes its partial; the last split of this row block to finish (an
        # acq_rel counter) sums all partials in split order, so the result does not depend on
        # which program finished last, and resets the counter for the next launch.
        tl.store(part_ptr + (split * M + mi[:, None]).to(tl.int64) * N + cols, y,
                 mask=(mi < M)[:, None] & nmask[None, :])
        if TWO:
            tl.store(part_ptr + (split * M + mi2[:, None]).to(tl.int64) * N + cols, y2,
                     mask=(mi2 < M)[:, None] & nmask[None, :])
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == nsplit - 1:
            y = _sum_parts(part_ptr, nsplit, mi, M, N, cols, nmask, BLOCK_M, BLOCK_N)
            _store_rows(y, mi, M, N, cols, nmask, bias_ptr, out_ptr, s_om, HAS_BIAS)
            if TWO:
                y2 = _sum_parts(part_ptr, nsplit, mi2, M, N, cols, nmask, BM2, BLOCK_N)
                _store_rows(y2, mi2, M, N, cols, nmask, bias_ptr, out_ptr, s_om, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            if TAIL > 0:
                gemv_tail(out_ptr, s_om, M, N, pid_n, t_a, t_b, t_c, t_d, s_a, t_cnt,
                          t_arrivals, t_eps, t_kg, txq0, txs0, txsum0, txq1, txs1, txsum1,
                          BLOCK_N, TAIL, TAIL_CHUNK, TAIL_ONE, TAIL_XQ_PLANES, TAIL_XQ_GROUPS)
    else:
        _store_rows(y, mi, M, N, cols, nmask, bias_ptr, out_ptr, s_om, HAS_BIAS)
        if TWO:
            _store_rows(y2, mi2, M, N, cols, nmask, bias_ptr, out_ptr, s_om, HAS_BIAS)
        if TAIL > 0:
            gemv_tail(out_ptr, s_om, M, N, pid_n, t_a, t_b, t_c, t_d, s_a, t_cnt, t_arrivals,
                      t_eps, t_kg, txq0, txs0, txsum0, txq1, txs1, txsum1, BLOCK_N, TAIL,
                      TAIL_CHUNK, TAIL_ONE, TAIL_XQ_PLANES, TAIL_XQ_GROUPS)


@triton.jit
def _gemv_kernel(xq_ptr, xs_ptr, xsum_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                 bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, KG, groups_per_split, s_om, s_qs,
                 s_qh, s_d, s_sc, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, G: tl.constexpr, PREFETCH: tl.constexpr,
                 ASM: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PAIRED: tl.constexpr,
                 EARLY_LOAD: tl.constexpr = False,
                 PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False,
                 BLOCK_M2: tl.constexpr = 0, t_a=0, t_b=0, t_c=0, t_d=0, s_a=0, t_cnt=0,
                 t_arrivals=0, t_eps=0.0, t_kg=0, txq0=0, txs0=0, txsum0=0, txq1=0, txs1=0,
                 txsum1=0, TAIL: tl.constexpr = 0, TAIL_CHUNK: tl.constexpr = 32,
                 TAIL_ONE: tl.constexpr = True, TAIL_XQ_PLANES: tl.constexpr = False,
                 TAIL_XQ_GROUPS: tl.constexpr = False):
    gemv_body(tl.program_id(0), tl.program_id(1), tl.num_programs(1), xq_ptr, xs_ptr,
               xsum_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, bias_ptr, out_ptr,
               part_ptr, cnt_ptr, M, N, KG, groups_per_split, s_om, s_qs, s_qh, s_d, s_sc,
               QTYPE, BLOCK_M, BLOCK_N, G, PREFETCH, ASM, SPLIT, HAS_BIAS, PAIRED, PDL,
               PDL_EARLY, EARLY_LOAD, BLOCK_M2, 0, t_a, t_b, t_c, t_d, s_a, t_cnt, t_arrivals,
               t_eps, t_kg, txq0, txs0, txsum0, txq1, txs1, txsum1, TAIL, TAIL_CHUNK, TAIL_ONE,
               TAIL_XQ_PLANES, TAIL_XQ_GROUPS)


_COUNTERS: dict = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the in-kernel split-K reduction, one per row block;
    each launch leaves them zero again. One buffer per device: luceio runs its forward passes
    on one stream per device, so two GEMVs never use the counters at the same time."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def prepare_launch(weights: tuple, strides: tuple, qtype: str, n: int, k: int, num_m: int,
                   cfg):
    """What a launch over one weight needs besides x: (weights, strides, paired scales, the
    split count, tiles per split * G, programs, block_n)."""
    from .quant_args import paired
    qs, qh, d, m, sc, mn = weights
    if qtype == "q6_k":  # sub-scales are read in pairs, high-bit words two at a time
        qh = qh.clone() if qh.data_ptr() % 8 else qh
        sc = sc.clone() if sc.data_ptr() % 2 else sc
    pair = qtype in ("q4_k", "q5_k") and paired(d, m) and paired(sc, mn)
    if not pair and d.stride(-1) != 1:  # half of a pair: the plain kernel reads stride 1
        d, m, sc, mn = (t.contiguous() for t in (d, m, sc, mn))
    g = max(1, cfg.gemv_block_k // 32)
    # K is split as one row splits it (whatever the rows' block_n), so every row sums its
    # partials exactly as it would alone
    split, tiles = skinny_split_k(cfg, triton.cdiv(n, cfg.gemv_block_n), triton.cdiv(k // 32, g),
                                  gemv=True)
    block_n = cfg.gemv_rows_block_n if num_m > 1 and cfg.gemv_rows_block_n else cfg.gemv_block_n
    strides = (strides[0], qh.stride(0), d.stride(0), sc.stride(0))
    return (qs, qh, d, m, sc, mn), strides, pair, split, tiles * g, triton.cdiv(n, block_n), block_n


def x_forms(x_r, qtype: str, num_m: int, r0: int, rows: int, xqs: dict | None):
    """x rows r0 .. r0 + rows quantized for `qtype` (shared through `xqs`, see `gemv`)."""
    planes = qtype != "q8_0"
    key = planes if rows == num_m else (planes, r0, rows)  # all rows: what producers fill
    if xqs is not None and key in xqs:
        return xqs[key]
    forms = quantize_x(x_r.reshape(-1), planes=planes)
    if xqs is not None:
        xqs[key] = forms
    return forms


def runtime_args(xq, xs, xsum, weights, strides, bias, out_r, split, gps, rows, n, k,
                  counters) -> tuple:
    """The runtime arguments of `gemv_body` after (pid_n, split, nsplit)."""
    qs, qh, d, m, sc, mn = weights
    part = torch.empty((split, rows, n), dtype=torch.float32, device=out_r.device) \
        if split > 1 else out_r
    return (xq.view(torch.int32), xs, xsum, qs, qh, d, m, sc, mn,
            bias if bias is not None else out_r, out_r, part,
            counters if split > 1 else xsum, rows, n, k // 32, gps, out_r.stride(0), *strides)


def use_asm(x: torch.Tensor) -> bool:
    """Whether `dp4a` runs as PTX inline assembly for x's device (NVIDIA, not interpreted)."""
    import os
    return x.is_cuda and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"


def row_blocks(rows: int, blocks: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_M2) of a launch over `rows` rows of x: one power-of-two block, or with
    `blocks` >= 2 (`gemv_row_blocks`) two where that pads less: 3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2
    (7 stays one block of 8: three blocks, 4 + 2 + 1, measured no faster on the H200, session
    23). Each row costs its dot products whether or not it is padding."""
    whole = triton.next_power_of_2(rows)
    first, rest = whole // 2, rows - whole // 2
    if blocks >= 2 and whole != rows and rest & (rest - 1) == 0:
        return first, rest
    return whole, 0


def gemv(x2, weights: tuple, strides: tuple, qtype: str, n: int, k: int, bias, out2, cfg,
         use_asm: bool, xqs: dict | None = None, tail=None) -> None:
    """out2 [M, N] = x2 [M, K] @ W^T (+ bias), x quantized to int8 per group on the way, for
    M up to `gemv_max_m`: the rows go `gemv_rows_per_launch` at a time, each launch reading
    the weight once for all its rows (a row's result does not depend on the other rows), in
    the blocks `row_blocks` gives.
    `weights` / `strides` as `quant_args.weight_args` gives them, with qs as int32 words;
    K is split by `skinny_split_k(..., gemv=True)` (the gemv_* fields). Two launches: x's
    quantization and the GEMV (split-K partials are summed by the GEMV's last split). `xqs`:
    quantized forms of this x already made (layout, or (layout, first row, rows) past one row
    -> `quantize_x`'s triple), shared by the parts of a fused projection, which then quantize
    x once. `tail` (`quant_gemv_tail`: GluTail, NormTail): done in the launch where all the
    rows go in one and it fits (then `tail.done` is set)."""
    num_m = x2.shape[0]
    weights, strides, pair, split, gps, programs, block_n = prepare_launch(
        weights, strides, qtype, n, k, num_m, cfg)
    step = max(1, cfg.gemv_rows_per_launch)
    fused = tail_launch(tail, out2, n, num_m, block_n, programs, cfg) \
        if num_m <= step and cfg.gemv_tails else None
    tail_kw = {}
    if fused is not None:
        targs, tconsts = fused
        tail_kw = dict(zip(("t_a", "t_b", "t_c", "t_d", "s_a", "t_cnt", "t_arrivals", "t_eps",
                            "t_kg", "txq0", "txs0", "txsum0", "txq1", "txs1", "txsum1"), targs))
        tail_kw.update(tconsts)
        tail.done = True
    for r0 in range(0, num_m, step):
        rows = min(step, num_m - r0)
        x_r, out_r = x2[r0:r0 + rows], out2[r0:r0 + rows]
        xq, xs, xsum = x_forms(x_r, qtype, num_m, r0, rows, xqs)
        counters = split_counters(x2.device, programs) if split > 1 else None
        bm, bm2 = row_blocks(rows, cfg.gemv_row_blocks)
        _gemv_kernel[(programs, split)](
            *runtime_args(xq, xs, xsum, weights, strides, bias, out_r, split, gps, rows, n, k,
                           counters),
            QTYPE=qtype, BLOCK_M=bm, BLOCK_M2=bm2, BLOCK_N=block_n,
            G=max(1, cfg.gemv_block_k // 32),
            PREFETCH=cfg.gemv_prefetch if rows == 1 else cfg.gemv_rows_prefetch, ASM=use_asm,
            SPLIT=split > 1, HAS_BIAS=bias is not None, PAIRED=pair,
            EARLY_LOAD=cfg.gemv_early_load, num_warps=cfg.gemv_num_warps, **tail_kw,
            **pdl_kwargs(x2.device, cfg, programs * split))
