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
the same order), so a verify step's rows equal the decode steps they replace.

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
from .quant_x import quantize_x


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """Per int32 lane: c + the sum over its 4 bytes of signed a_byte * signed b_byte."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        acc = c + ((a << 24) >> 24) * ((b << 24) >> 24)
        acc += ((a << 16) >> 24) * ((b << 16) >> 24)
        acc += ((a << 8) >> 24) * ((b << 8) >> 24)
        return acc + (a >> 24) * (b >> 24)


@triton.jit
def _spread1(t):
    """4 bits (t < 16) -> bit i moved to bit 8i + 4: a fifth bit for each code byte."""
    return (t * 0x02040810) & 0x10101010


@triton.jit
def _spread2(b):
    """4 two-bit fields of a byte (b < 256) -> field i moved to bits 8i + 4, 8i + 5."""
    even = ((b & 0x33) * 0x00010010) & 0x00300030
    odd = ((b & 0xCC) * 0x00400400) & 0x30003000
    return even | odd


@triton.jit
def _row_tile(base, row0, N, stride, first, limit, BN: tl.constexpr, C: tl.constexpr):
    """[BN, C]: base[row * stride + first + c] for rows row0.. (< N) and c < C (first + c <
    limit), 0 outside. Contiguous along C, so the load gets threads along C whatever Triton
    version infers the layout (with a tie between rows and columns, Triton 3.6 put threads
    across rows and then moved every tile through shared memory)."""
    rows = row0 + tl.arange(0, BN)
    col = first + tl.arange(0, C)[None, :]
    mask = (rows < N)[:, None] & (col < limit)
    return tl.load(base + rows.to(tl.int64)[:, None] * stride + col, mask=mask, other=0)


@triton.jit
def _shared_tile(base, row0, N, stride, g0, g_end, BN: tl.constexpr, G: tl.constexpr,
                 PER: tl.constexpr):
    """[BN, G]: base[row * stride + g // PER] for g = g0 .. g0 + G - 1 (a value shared by PER
    consecutive groups: d of a 256-block, PER = 8); loaded as one flat [BN * G] vector
    (element i: row i // G, group i % G) and reshaped, so its layout matches the [BN, G] tiles
    instead of depending on a tie-break."""
    i = tl.arange(0, BN * G)
    rows = row0 + i // G
    grp = g0 + i % G
    v = tl.load(base + rows.to(tl.int64) * stride + grp // PER,
                mask=(rows < N) & (grp < g_end), other=0)
    return tl.reshape(v, [BN, G])


@triton.jit
def _x_rows(base, mi, M, s_m, first, limit, G: tl.constexpr, W: tl.constexpr,
            BM: tl.constexpr):
    """[BM, 1, G, W] words of x rows mi (< M) from base[m * s_m + first ..] (contiguous along
    the words), 0 at and past `limit` within a row."""
    c = first + tl.arange(0, G * W)[None, :]
    v = tl.load(base + mi[:, None] * s_m + c, mask=(mi[:, None] < M) & (c < limit), other=0)
    return tl.reshape(v, [BM, 1, G, W])


@triton.jit
def _x_groups(base, mi, M, s_m, grp, gm):
    """[BM, 1, G]: base[m * s_m + grp] of rows mi (< M), 0 where not `gm`."""
    v = tl.load(base + mi[:, None] * s_m + grp[None, :], mask=(mi[:, None] < M) & gm[None, :],
                other=0)
    return v[:, None, :]


@triton.jit
def gemv_body(pid_n, split, nsplit, xq_ptr, xs_ptr, xsum_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr,
               sc_ptr, mn_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, KG, groups_per_split,
               s_om, s_qs, s_qh, s_d, s_sc, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, G: tl.constexpr, PREFETCH: tl.constexpr,
               ASM: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
               PAIRED: tl.constexpr, PDL: tl.constexpr = False,
               PDL_EARLY: tl.constexpr = False, EARLY_LOAD: tl.constexpr = False):
    """Program (pid_n, split) of `nsplit` K-splits: output rows pid_n * BLOCK_N ... . `PDL`:
    waits for the kernel before (`pdl_enter`) itself, after loading its first code words
    with PREFETCH and EARLY_LOAD (no kernel of a step writes weights)."""
    # q8_0's 8 words per group are handled as two half-groups of 4 words (H = 2 per group),
    # so every type's tile is [BN, G * H, 4] with one thread per (half-)group; the M rows of x
    # are a leading axis that every weight tile is broadcast over (loaded and decoded once)
    H: tl.constexpr = 2 if QTYPE == "q8_0" else 1
    GH: tl.constexpr = G * H
    K_QUANT: tl.constexpr = QTYPE == "q4_k" or QTYPE == "q5_k" or QTYPE == "q6_k"
    FIVE: tl.constexpr = QTYPE == "q5_0" or QTYPE == "q5_1" or QTYPE == "q5_k"
    row0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    nmask = rows < N
    mi = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, 4)[None, None, :]                                  # [1, 1, 4]
    g_start = split * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, KG)

    acc = tl.zeros([BLOCK_M, BLOCK_N, GH], tl.float32)
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
        shape4: tl.constexpr = [BLOCK_M, BLOCK_N, GH, 4]
        zero = tl.zeros(shape4, tl.int32)
        if QTYPE == "q8_0":  # x in group order; per half-group: its group's scale, d * xs
            half = g0 * 2 + tl.arange(0, GH)
            xs = _x_groups(xs_ptr, mi, M, KG, half // 2, half < g_end * 2)  # [BM, 1, GH]
            xw = tl.broadcast_to(_x_rows(xq_ptr, mi, M, KG * 8, g0 * 8, g_end * 8, GH, 4,
                                         BLOCK_M), shape4)
            s_lo = tl.sum(_dp4a(tl.broadcast_to(words[None], shape4), xw, zero, ASM), 3)
        else:  # x in two planes: elements 0-15 and 16-31 of every group (all rows' low
            # halves, then all rows' high halves)
            grp = g0 + tl.arange(0, G)
            gm = grp < g_end
            xs = _x_groups(xs_ptr, mi, M, KG, grp, gm)                   # [BM, 1, G]
            sum_lo = _x_groups(xsum_ptr, mi, M, KG, grp, gm)             # int32 [BM, 1, G]
            sum_hi = _x_groups(xsum_ptr + M * KG, mi, M, KG, grp, gm)
            x_lo = tl.broadcast_to(_x_rows(xq_ptr, mi, M, KG * 4, g0 * 4, g_end * 4, G, 4,
                                           BLOCK_M), shape4)
            x_hi = tl.broadcast_to(_x_rows(xq_ptr + M * KG * 4, mi, M, KG * 4, g0 * 4,
                                           g_end * 4, G, 4, BLOCK_M), shape4)
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
            lo = tl.broadcast_to(lo[None], shape4)
            hi = tl.broadcast_to(hi[None], shape4)
            if QTYPE == "q6_k":
                s_lo = tl.sum(_dp4a(lo, x_lo, zero, ASM), 3)             # [BM, BN, G] int32
                s_hi = tl.sum(_dp4a(hi, x_hi, zero, ASM), 3)
            else:
                s_lo = tl.sum(_dp4a(hi, x_hi, _dp4a(lo, x_lo, zero, ASM), ASM), 3)
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
        if QTYPE != "q8_0":
            x_sum = sum_lo + sum_hi
        if QTYPE == "q4_0":
            acc += (d * xs) * (s_lo - 8 * x_sum).to(tl.float32)
        elif QTYPE == "q5_0":
            acc += (d * xs) * (s_lo - 16 * x_sum).to(tl.float32)
        elif QTYPE == "q8_0":
            acc += (d * xs) * s_lo.to(tl.float32)
        elif QTYPE == "q4_1" or QTYPE == "q5_1":
            mm = _row_tile(m_ptr, row0, N, s_d, g0, g_end, BLOCK_N, G).to(tl.float32)[None]
            acc += xs * (d * s_lo.to(tl.float32) + mm * x_sum.to(tl.float32))
        elif QTYPE == "q6_k":
            # a group's two int8 sub-scales are adjacent: one 16-bit load (little-endian)
            pair = _row_tile(sc_ptr.to(tl.pointer_type(tl.int16)), row0, N, s_sc // 2, g0,
                             g_end, BLOCK_N, G).to(tl.int32)[None]
            sc_lo = ((pair << 24) >> 24).to(tl.float32)
            sc_hi = (pair >> 8).to(tl.float32)
            acc += (d * xs) * (sc_lo * (s_lo - 32 * sum_lo).to(tl.float32)
                               + sc_hi * (s_hi - 32 * sum_hi).to(tl.float32))
        else:  # q4_k, q5_k: (d * sc) * q - dmin * mn
            if not PAIRED:
                sc = _row_tile(sc_ptr, row0, N, s_sc, g0, g_end, BLOCK_N, G)
                mn = _row_tile(mn_ptr, row0, N, s_sc, g0, g_end, BLOCK_N, G)
                dmin = _shared_tile(m_ptr, row0, N, s_d, g0, g_end, BLOCK_N, G, 8)
            acc += xs * ((d * sc.to(tl.float32)[None]) * s_lo.to(tl.float32)
                         - (dmin.to(tl.float32) * mn.to(tl.float32))[None]
                         * x_sum.to(tl.float32))

    y = tl.sum(acc, 2)                                                   # [BM, BN]
    omask = (mi < M)[:, None] & nmask[None, :]
    cols = rows[None, :]
    if SPLIT:
        # Each split writes its partial; the last split of this row block to finish (an
        # acq_rel counter) sums all partials in split order, so the result does not depend on
        # which program finished last, and resets the counter for the next launch.
        tl.store(part_ptr + (split * M + mi[:, None]).to(tl.int64) * N + cols, y, mask=omask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == nsplit - 1:
            y = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, nsplit):
                y += tl.load(part_ptr + (s * M + mi[:, None]).to(tl.int64) * N + cols,
                             mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                y += tl.load(bias_ptr + cols, mask=nmask[None, :], other=0.0).to(tl.float32)
            tl.store(out_ptr + mi[:, None] * s_om + cols, y.to(out_ptr.dtype.element_ty),
                     mask=omask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=nmask[None, :], other=0.0).to(tl.float32)
        tl.store(out_ptr + mi[:, None] * s_om + cols, y.to(out_ptr.dtype.element_ty),
                 mask=omask)


@triton.jit
def _gemv_kernel(xq_ptr, xs_ptr, xsum_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                 bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, KG, groups_per_split, s_om, s_qs,
                 s_qh, s_d, s_sc, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, G: tl.constexpr, PREFETCH: tl.constexpr,
                 ASM: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PAIRED: tl.constexpr,
                 EARLY_LOAD: tl.constexpr = False,
                 PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    gemv_body(tl.program_id(0), tl.program_id(1), tl.num_programs(1), xq_ptr, xs_ptr,
               xsum_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, bias_ptr, out_ptr,
               part_ptr, cnt_ptr, M, N, KG, groups_per_split, s_om, s_qs, s_qh, s_d, s_sc,
               QTYPE, BLOCK_M, BLOCK_N, G, PREFETCH, ASM, SPLIT, HAS_BIAS, PAIRED, PDL,
               PDL_EARLY, EARLY_LOAD)


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


def gemv(x2, weights: tuple, strides: tuple, qtype: str, n: int, k: int, bias, out2, cfg,
         use_asm: bool, xqs: dict | None = None) -> None:
    """out2 [M, N] = x2 [M, K] @ W^T (+ bias), x quantized to int8 per group on the way, for
    M up to `gemv_max_m`: the rows go `gemv_rows_per_launch` at a time, each launch reading
    the weight once for all its rows (a row's result does not depend on the other rows).
    `weights` / `strides` as `quant_args.weight_args` gives them, with qs as int32 words;
    K is split by `skinny_split_k(..., gemv=True)` (the gemv_* fields). Two launches: x's
    quantization and the GEMV (split-K partials are summed by the GEMV's last split). `xqs`:
    quantized forms of this x already made (layout, or (layout, first row, rows) past one row
    -> `quantize_x`'s triple), shared by the parts of a fused projection, which then quantize
    x once."""
    num_m = x2.shape[0]
    weights, strides, pair, split, gps, programs, block_n = prepare_launch(
        weights, strides, qtype, n, k, num_m, cfg)
    step = max(1, cfg.gemv_rows_per_launch)
    for r0 in range(0, num_m, step):
        rows = min(step, num_m - r0)
        x_r, out_r = x2[r0:r0 + rows], out2[r0:r0 + rows]
        xq, xs, xsum = x_forms(x_r, qtype, num_m, r0, rows, xqs)
        counters = split_counters(x2.device, programs) if split > 1 else None
        _gemv_kernel[(programs, split)](
            *runtime_args(xq, xs, xsum, weights, strides, bias, out_r, split, gps, rows, n, k,
                           counters),
            QTYPE=qtype, BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=block_n,
            G=max(1, cfg.gemv_block_k // 32), PREFETCH=cfg.gemv_prefetch, ASM=use_asm,
            SPLIT=split > 1, HAS_BIAS=bias is not None, PAIRED=pair,
            EARLY_LOAD=cfg.gemv_early_load, num_warps=cfg.gemv_num_warps,
            **pdl_kwargs(x2.device, cfg, programs * split))
