"""The tiles of the quantized GEMV (`quant_gemv.py`, whose docstring has the layout facts):
loads whose layout does not depend on a tie-break, the code-bit spreads, `dp4a`, and one
block of x rows times one decoded weight tile (`_x_block`, `_block_dots`, `_block_acc`)."""
from __future__ import annotations

import triton
import triton.language as tl


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
def _x_block(mi, M, KG, g0, g_end, xq_ptr, xs_ptr, xsum_ptr, QTYPE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, GH: tl.constexpr):
    """What a tile's products take from x rows `mi`: (the int8 words [BM, BN, GH, 4] of the low
    plane (q8_0: all), of the high plane, the group scales [BM, 1, GH], the planes' int sums
    [BM, 1, G]); loaded before the weight tile is decoded, as the one-row kernel always did."""
    shape4: tl.constexpr = [BLOCK_M, BLOCK_N, GH, 4]
    if QTYPE == "q8_0":  # x in group order; per half-group: its group's scale
        half = g0 * 2 + tl.arange(0, GH)
        xs = _x_groups(xs_ptr, mi, M, KG, half // 2, half < g_end * 2)  # [BM, 1, GH]
        x_lo = tl.broadcast_to(_x_rows(xq_ptr, mi, M, KG * 8, g0 * 8, g_end * 8, GH, 4,
                                       BLOCK_M), shape4)
        x_hi = x_lo
        sum_lo = xs
        sum_hi = xs
    else:  # x in two planes: elements 0-15 and 16-31 of every group (all rows' low halves,
        # then all rows' high halves)
        grp = g0 + tl.arange(0, G)
        gm = grp < g_end
        xs = _x_groups(xs_ptr, mi, M, KG, grp, gm)                       # [BM, 1, G]
        sum_lo = _x_groups(xsum_ptr, mi, M, KG, grp, gm)                 # int32 [BM, 1, G]
        sum_hi = _x_groups(xsum_ptr + M * KG, mi, M, KG, grp, gm)
        x_lo = tl.broadcast_to(_x_rows(xq_ptr, mi, M, KG * 4, g0 * 4, g_end * 4, G, 4,
                                       BLOCK_M), shape4)
        x_hi = tl.broadcast_to(_x_rows(xq_ptr + M * KG * 4, mi, M, KG * 4, g0 * 4,
                                       g_end * 4, G, 4, BLOCK_M), shape4)
    return x_lo, x_hi, xs, sum_lo, sum_hi


@triton.jit
def _block_dots(lo, hi, x_lo, x_hi, QTYPE: tl.constexpr, ASM: tl.constexpr):
    """The int32 dot products [BM, BN, GH] of one x block with a decoded tile's code words `lo`
    / `hi` [BN, GH, 4] (q8_0: `lo` holds the words): (both planes' sum, or for q6_k the low
    plane's, the high plane's)."""
    zero = tl.zeros(x_lo.shape, tl.int32)
    lo4 = tl.broadcast_to(lo[None], x_lo.shape)
    if QTYPE == "q8_0":
        s_lo = tl.sum(_dp4a(lo4, x_lo, zero, ASM), 3)
        s_hi = s_lo
    else:
        hi4 = tl.broadcast_to(hi[None], x_lo.shape)
        if QTYPE == "q6_k":
            s_lo = tl.sum(_dp4a(lo4, x_lo, zero, ASM), 3)                # [BM, BN, G] int32
            s_hi = tl.sum(_dp4a(hi4, x_hi, zero, ASM), 3)
        else:
            s_lo = tl.sum(_dp4a(hi4, x_hi, _dp4a(lo4, x_lo, zero, ASM), ASM), 3)
            s_hi = s_lo
    return s_lo, s_hi


@triton.jit
def _block_acc(acc, s_lo, s_hi, xs, sum_lo, sum_hi, w1, w2, w3, QTYPE: tl.constexpr):
    """acc [BM, BN, GH] + one tile's products of an x block (`_block_dots`) times the tile's
    scale terms `w1`-`w3` ([1, BN, G(H)], per type: see `quant_gemv.gemv_body`). The same
    expression whatever rows the block holds, so a row's bits do not depend on its block."""
    if QTYPE == "q8_0":  # w1 = d (per half-group)
        acc += (w1 * xs) * s_lo.to(tl.float32)
    elif QTYPE == "q6_k":  # w1 = d, w2 / w3 = the low / high half's sub-scale
        acc += (w1 * xs) * (w2 * (s_lo - 32 * sum_lo).to(tl.float32)
                            + w3 * (s_hi - 32 * sum_hi).to(tl.float32))
    else:
        x_sum = sum_lo + sum_hi
        if QTYPE == "q4_0":
            acc += (w1 * xs) * (s_lo - 8 * x_sum).to(tl.float32)
        elif QTYPE == "q5_0":
            acc += (w1 * xs) * (s_lo - 16 * x_sum).to(tl.float32)
        elif QTYPE == "q4_1" or QTYPE == "q5_1":  # w1 = d, w2 = m
            acc += xs * (w1 * s_lo.to(tl.float32) + w2 * x_sum.to(tl.float32))
        else:  # q4_k, q5_k: (d * sc) * q - dmin * mn; w1 = d * sc, w2 = dmin * mn
            acc += xs * (w1 * s_lo.to(tl.float32) - w2 * x_sum.to(tl.float32))
    return acc
