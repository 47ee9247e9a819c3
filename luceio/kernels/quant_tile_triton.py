"""One quantized weight tile in registers, shared by the skinny matmul (`quant_triton.py`) and
`dequant_triton.py`: the codes of G groups of 32 and their scales, and the weights they make.
"""
from __future__ import annotations

import triton
import triton.language as tl


# A quantized tile is [BLOCK_N, G, 16] with G = BLOCK_K / 32 groups: byte j of a group's codes
# holds element j (low nibble, the "lo" half) and element j + 16 (high nibble, "hi"), so both
# halves come from one plain, vectorised load of 16 bytes, and each lane holds whole groups
# (per-group scales are one load per group, sums over a group stay inside a lane). The 5-bit
# high bits are one int32 per group (bit e = element e), q6_k's two (bits 2e, 2e + 1 of the
# first word for e < 16, of the second for the rest). Codes become floats by the exponent
# trick: (q | 0x4B000000) read as fp32 is exactly 2^23 + q for 0 <= q < 2^23, one integer op
# where a conversion instruction runs at a quarter of the rate.
_MAGIC = tl.constexpr(8388608.0)  # 2^23


@triton.jit
def _as_float(q, zero: tl.constexpr):
    """int32 codes 0 <= q < 2^23 -> fp32 q - zero, exactly."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (_MAGIC + zero)


@triton.jit
def _quant_tile(qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, row, nmask, g0, KG,
                s_qs, s_qh, s_d, s_sc, e_d, e_sc, QTYPE: tl.constexpr, G: tl.constexpr):
    """Groups g0 .. g0+G-1 of `row` ([BLOCK_N, 1] int64): (lo, hi), fp32 [BLOCK_N, G, 16] codes
    minus the zero point, and (scale_lo, scale_hi, offset), fp32 [BLOCK_N, G]: a weight is
    scale * code - offset, scale_hi for the hi half (differs from scale_lo only for q6_k).
    Rows >= N and groups >= KG read as 0. `e_d` / `e_sc`: element strides of d, m / sc, mn
    (1, or 2 in the paired form of `quant.pair_scales`)."""
    grp = g0 + tl.arange(0, G)[None, :]                                   # [1, G]
    j = tl.arange(0, 16)[None, None, :]
    gmask = nmask[:, None] & (grp < KG)                                   # [BLOCK_N, G]
    mask = gmask[:, :, None]
    if QTYPE == "q8_0":
        off = (row * s_qs + grp * 32)[:, :, None] + j
        lo = _as_float(tl.load(qs_ptr + off, mask=mask, other=0).to(tl.int32) + 128, 128.0)
        hi = _as_float(tl.load(qs_ptr + off + 16, mask=mask, other=0).to(tl.int32) + 128, 128.0)
    else:
        byte = tl.load(qs_ptr + (row * s_qs + grp * 16)[:, :, None] + j, mask=mask, other=0)
        byte = byte.to(tl.int32)
        q_lo = byte & 15
        q_hi = byte >> 4
        if QTYPE == "q5_0" or QTYPE == "q5_1" or QTYPE == "q5_k":
            word = tl.load(qh_ptr + row * s_qh + grp, mask=gmask, other=0)[:, :, None]
            q_lo |= ((word >> j) & 1) << 4
            q_hi |= ((word >> (j + 16)) & 1) << 4
        if QTYPE == "q6_k":
            w_lo = tl.load(qh_ptr + row * s_qh + 2 * grp, mask=gmask, other=0)[:, :, None]
            w_hi = tl.load(qh_ptr + row * s_qh + 2 * grp + 1, mask=gmask, other=0)[:, :, None]
            q_lo |= ((w_lo >> (2 * j)) & 3) << 4
            q_hi |= ((w_hi >> (2 * j)) & 3) << 4
        if QTYPE == "q4_0":
            lo, hi = _as_float(q_lo, 8.0), _as_float(q_hi, 8.0)
        elif QTYPE == "q5_0":
            lo, hi = _as_float(q_lo, 16.0), _as_float(q_hi, 16.0)
        elif QTYPE == "q6_k":
            lo, hi = _as_float(q_lo, 32.0), _as_float(q_hi, 32.0)
        else:
            lo, hi = _as_float(q_lo, 0.0), _as_float(q_hi, 0.0)

    if QTYPE == "q4_k" or QTYPE == "q5_k" or QTYPE == "q6_k":  # d (and dmin) per 8 groups
        d = tl.load(d_ptr + row * s_d + (grp // 8) * e_d, mask=gmask, other=0.0).to(tl.float32)
    else:
        d = tl.load(d_ptr + row * s_d + grp, mask=gmask, other=0.0).to(tl.float32)
    scale_lo = d
    scale_hi = d
    offset = tl.zeros_like(d)
    if QTYPE == "q4_1" or QTYPE == "q5_1":                 # d * q + m
        offset = -tl.load(m_ptr + row * s_d + grp, mask=gmask, other=0.0).to(tl.float32)
    if QTYPE == "q4_k" or QTYPE == "q5_k":                 # (d * sc) * q - dmin * mn
        sc = tl.load(sc_ptr + row * s_sc + grp * e_sc, mask=gmask, other=0).to(tl.float32)
        mn = tl.load(mn_ptr + row * s_sc + grp * e_sc, mask=gmask, other=0).to(tl.float32)
        dmin = tl.load(m_ptr + row * s_d + (grp // 8) * e_d, mask=gmask,
                       other=0.0).to(tl.float32)
        scale_lo = d * sc
        scale_hi = scale_lo
        offset = dmin * mn
    if QTYPE == "q6_k":                                    # (d * sc) * (q - 32), sc per 16
        sc_lo = tl.load(sc_ptr + row * s_sc + 2 * grp, mask=gmask, other=0)
        sc_hi = tl.load(sc_ptr + row * s_sc + 2 * grp + 1, mask=gmask, other=0)
        scale_lo = d * sc_lo.to(tl.float32)
        scale_hi = d * sc_hi.to(tl.float32)
    return lo, hi, scale_lo, scale_hi, offset


@triton.jit
def _weights(lo, hi, scale_lo, scale_hi, offset, QTYPE: tl.constexpr):
    """fp32 weights of both halves, in the reference's order of operations."""
    if QTYPE == "q8_0":
        return lo * scale_lo[:, :, None], hi * scale_hi[:, :, None]
    elif QTYPE == "q4_0" or QTYPE == "q5_0" or QTYPE == "q6_k":
        return scale_lo[:, :, None] * lo, scale_hi[:, :, None] * hi
    else:  # q4_1, q5_1: d * q + m (offset = -m); q4_k, q5_k: (d * sc) * q - dmin * mn
        return (scale_lo[:, :, None] * lo - offset[:, :, None],
                scale_hi[:, :, None] * hi - offset[:, :, None])


# Packed dequantization (`_packed_weights`): one PTX sequence per 4 code bytes (8 weights),
# two weights a 32-bit register throughout. prmt spreads bytes b0, b1 into the two 16-bit
# halves, lop3 keeps a nibble and ors in 0x4300, making bf16 128 + q exactly (bf16 holds 8
# significant bits), and a bf16x2 FMA gives (q - zero) exactly. The scale s and offset o come
# as bf16 pairs hi + lo (hi = bf16(v), lo = bf16(v - hi): a scale rounded to bf16 alone added a
# rounding a weight, and the GPU test of q4_0 at [4096, 4096], 32 rows, reached its bound);
# TAIL applies them. $0 $1: the lo half's 4 weights, $2 $3 the hi half's, $4 four code bytes,
# $5 $6 s_hi (a group's value in every lane), then the type's other pairs. NEG: -(128 + zero).
_PACKED_ASM = """{
.reg .b32 t0, t1, u0, u1, one, neg, a, v, zero;
mov.b32 one, 0x3F803F80;
mov.b32 neg, NEG;
mov.b32 zero, 0;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
lop3.b32 t0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 u0, u0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 u1, u1, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t0, t0, one, neg;
fma.rn.bf16x2 t1, t1, one, neg;
fma.rn.bf16x2 u0, u0, one, neg;
fma.rn.bf16x2 u1, u1, one, neg;
TAIL}"""


def _scaled(his, los, tmp: str) -> str:
    """PTX: output $i = (q s_hi + (q s_lo)) for the codes (q - zero) in t0, t1, u0, u1 and the
    pairs' registers his[i], los[i]; with s_lo's few bits q s_lo is exact, so one rounding."""
    return "".join(f"fma.rn.bf16x2 {tmp}, {c}, {lo}, zero;\nfma.rn.bf16x2 ${i}, {c}, {hi}, {tmp};\n"
                   for i, (c, hi, lo) in enumerate(zip(("t0", "t1", "u0", "u1"), his, los)))


# q4_0 (zero point 8, no offset): w = q s_hi + (q s_lo), q s_lo exact (s_lo has <= 3 bits), so
# the one rounding is of q d: $5 $6 s_hi, $7 $8 s_lo
_PACKED_ZERO8 = tl.constexpr(_PACKED_ASM.replace("NEG", "0xC308C308").replace(
    "TAIL", _scaled(("$5", "$6", "$5", "$6"), ("$7", "$8", "$7", "$8"), "a")))
# q4_k (zero point 0): w = (q s_hi + o_hi) + (q s_lo + o_lo), $5 $6 s_hi, $7 $8 o_hi, $9 $10
# s_lo, $11 $12 o_lo: two roundings of the size of w's, none of a whole group's scale
_PACKED_ZERO0 = tl.constexpr(_PACKED_ASM.replace("NEG", "0xC300C300").replace("TAIL", "".join(
    f"fma.rn.bf16x2 a, {c}, {sl}, {ol};\nfma.rn.bf16x2 v, {c}, {sh}, {oh};\n"
    f"fma.rn.bf16x2 ${i}, v, one, a;\n"
    for i, (c, sh, oh, sl, ol) in enumerate(zip(
        ("t0", "t1", "u0", "u1"), ("$5", "$6") * 2, ("$7", "$8") * 2, ("$9", "$10") * 2,
        ("$11", "$12") * 2)))))
# q6_k: the same with each code's two high bits ored in at bits 4-5 of its 16-bit half. $9 (and
# its copies $10-$12) holds the 8 high bits of the lo half's 4 codes (code k: bits 2k, 2k + 1),
# $13 the hi half's; a multiply moves two 2-bit fields to bits 4-5 and 20-21 at once (h * 0x10
# and h * 0x40000, or h and h * 0x4000, do not overlap). $5 $6 / $7 $8: the lo / hi scales
# (q6_k's sub-scales cover 16 elements), $17 $18 / $19 $20 their low parts (as q4_0's), no
# offset; zero point 32.
_PACKED_Q6K = tl.constexpr("""{
.reg .b32 t0, t1, u0, u1, a, b, one, neg, zero;
mov.b32 one, 0x3F803F80;
mov.b32 neg, 0xC320C320;
mov.b32 zero, 0;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
mul.lo.u32 a, $9, 0x00040010;
lop3.b32 a, a, 0x00300030, 0x43004300, 0xEA;
lop3.b32 t0, t0, 0x000F000F, a, 0xEA;
mul.lo.u32 a, $9, 0x00004001;
lop3.b32 a, a, 0x00300030, 0x43004300, 0xEA;
lop3.b32 t1, t1, 0x000F000F, a, 0xEA;
mul.lo.u32 a, $13, 0x00040010;
lop3.b32 a, a, 0x00300030, 0x43004300, 0xEA;
lop3.b32 u0, u0, 0x000F000F, a, 0xEA;
mul.lo.u32 a, $13, 0x00004001;
lop3.b32 a, a, 0x00300030, 0x43004300, 0xEA;
lop3.b32 u1, u1, 0x000F000F, a, 0xEA;
fma.rn.bf16x2 t0, t0, one, neg;
fma.rn.bf16x2 t1, t1, one, neg;
fma.rn.bf16x2 u0, u0, one, neg;
fma.rn.bf16x2 u1, u1, one, neg;
""" + _scaled(("$5", "$6", "$7", "$8"), ("$17", "$18", "$19", "$20"), "b") + "}")
# q4_1 is not among them: with its offset (the group's minimum, as large as the weights) rounded
# to bf16 it failed the GPU test (max error 0.029 at [4096, 4096], 32 rows, against 0.02 + 1%;
# session 49, before the hi + lo pairs; not tried since)
PACKED_QTYPES = ("q4_0", "q4_k", "q6_k")


@triton.jit
def _rne_bf16(v):
    """fp32 -> bf16 rounded to nearest even, also under TRITON_INTERPRET=1 (whose casts
    truncate): the stand-in for the PTX rounds as the PTX does (finite v)."""
    u = v.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _packed_scale_loads(d_ptr, m_ptr, sc_ptr, mn_ptr, row, nmask, g0, KG, s_d, s_sc, e_d, e_sc,
                        QTYPE: tl.constexpr, G: tl.constexpr):
    """The scales of groups g0 .. g0+G-1 of `row` ([BLOCK_N, 1]) as loaded, [BLOCK_N, G] each,
    no arithmetic on them (so a load issued one K tile ahead, `qgemm_prefetch_scales`, has its
    first use in the next tile): q4_k (d, sc, mn, dmin), q6_k (d, sc of the lo half, sc of the
    hi half, d), q4_0 (d, d, d, d). `_packed_scales` makes them a scale and an offset."""
    grp = g0 + tl.arange(0, G)[None, :]                                   # [1, G]
    gmask = nmask[:, None] & (grp < KG)                                   # [BLOCK_N, G]
    if QTYPE == "q4_k" or QTYPE == "q6_k":                  # d (and dmin) per 8 groups
        d = tl.load(d_ptr + row * s_d + (grp // 8) * e_d, mask=gmask, other=0.0)
    else:
        d = tl.load(d_ptr + row * s_d + grp, mask=gmask, other=0.0)
    b = d
    c = d
    e = d
    if QTYPE == "q4_k":
        b = tl.load(sc_ptr + row * s_sc + grp * e_sc, mask=gmask, other=0)
        c = tl.load(mn_ptr + row * s_sc + grp * e_sc, mask=gmask, other=0)
        e = tl.load(m_ptr + row * s_d + (grp // 8) * e_d, mask=gmask, other=0.0)
    elif QTYPE == "q6_k":
        b = tl.load(sc_ptr + row * s_sc + 2 * grp, mask=gmask, other=0)
        c = tl.load(sc_ptr + row * s_sc + 2 * grp + 1, mask=gmask, other=0)
    return d, b, c, e


@triton.jit
def _packed_scales(d, b, c, e, QTYPE: tl.constexpr):
    """(scale, o), fp32 [BLOCK_N, G], from `_packed_scale_loads`: a weight is scale * (q - zero)
    + o (q6_k: o is the hi half's scale, and it has no offset)."""
    if QTYPE == "q4_k":
        scale = d.to(tl.float32) * b.to(tl.float32)
        o = -(e.to(tl.float32) * c.to(tl.float32))
    elif QTYPE == "q6_k":
        scale = d.to(tl.float32) * b.to(tl.float32)
        o = d.to(tl.float32) * c.to(tl.float32)
    else:  # q4_0
        scale = d.to(tl.float32)
        o = tl.zeros_like(scale)
    return scale, o


@triton.jit
def _packed_weights(qs_ptr, qh_ptr, scale, o, row, nmask, g0, KG, s_qs, s_qh,
                    QTYPE: tl.constexpr, G: tl.constexpr, ASM: tl.constexpr):
    """The bf16 weights [BLOCK_N, 32 * G] of groups g0 .. g0+G-1 of a `PACKED_QTYPES` type
    (4-bit codes, and q6_k's 4 + 2; G a multiple of 4), from the scale s and offset o
    (= -offset; `_packed_scales`) as bf16 pairs hi + lo. q4_0: bf16((q - 8) s_hi + (q - 8) s_lo), the inner
    product exact, so the weights are `_weights`' (the fp32 weight rounded once) bit for bit;
    q6_k: the same but for rare near-ties; q4_k: bf16(bf16(q s_hi + o_hi) + bf16(q s_lo +
    o_lo)), two roundings (GPU, [4096, 4096], 32 rows, worst error over 8 seeds in units of the
    test's bound: q4_0 0.69 and q6_k 0.43 as unpacked, q4_k 0.57 against 0.37; with s and o
    rounded to bf16 whole, q4_0 reached 1.0). ASM: the packed PTX above (NVIDIA); else the
    same roundings in fp32 (`_rne_bf16`).

    The K slots are a permutation of the tile's elements (`quant_triton._skinny_kernel`
    permutes x's tile to match): slot 16q + 8h + 2c + e holds nibble h of byte
    c * (NB / 4) + 2q + e of the tile's NB = 16 G code bytes. An MMA's A fragment gives a
    thread slots 2c, 2c + 1, 2c + 8, 2c + 9 of each 16: both nibbles of two adjacent bytes,
    and over the K tile a thread's bytes are NB / 4 contiguous ones, so the codes arrive in
    whole 32-bit registers of 4 bytes (a K order that keeps each group's 16 bytes together
    had the bytes read from shared memory one at a time and packed by prmt). Triton 3.9 still
    moves the bf16 tile to the MMA's layout through shared memory (stmatrix / ldmatrix). The
    sm_90 machine code (M 16, K tile 128): 6.0 instructions a weight in the K loop against 9.1
    for q4_k, 6.9 against 10.5 for q6_k, 4.6 against 7.5 for q4_0 (`bench/sass_stats.py
    --packed 0,1`; 4.7 / 6.1 / 4.0 with s and o rounded to bf16 whole)."""
    GPC: tl.constexpr = G // 4                                           # groups per c
    BN: tl.constexpr = row.shape[0]
    NB: tl.constexpr = 16 * G
    b = tl.arange(0, NB)[None, :]
    byte = tl.load(qs_ptr + row * s_qs + g0 * 16 + b,
                   mask=nmask[:, None] & (g0 * 16 + b < KG * 16), other=0)
    # [BN, c, gp, i, p, e]: byte c * (NB / 4) + 16 gp + 4i + 2p + e (a quad i of 4 bytes)
    byte6 = tl.reshape(byte, [BN, 4, GPC, 4, 2, 2])
    # scale and offset as bf16 pairs hi + lo: hi = bf16(v), lo = bf16(v - hi)
    s_hi = scale.to(tl.bfloat16)
    o_hi = o.to(tl.bfloat16)
    s_lo = (scale - s_hi.to(tl.float32)).to(tl.bfloat16)
    o_lo = (o - o_hi.to(tl.float32)).to(tl.bfloat16)
    s6 = tl.broadcast_to(tl.reshape(s_hi, [BN, 4, GPC, 1, 1, 1]), byte6.shape)
    o6 = tl.broadcast_to(tl.reshape(o_hi, [BN, 4, GPC, 1, 1, 1]), byte6.shape)
    sl6 = tl.broadcast_to(tl.reshape(s_lo, [BN, 4, GPC, 1, 1, 1]), byte6.shape)
    ol6 = tl.broadcast_to(tl.reshape(o_lo, [BN, 4, GPC, 1, 1, 1]), byte6.shape)
    if QTYPE == "q6_k":
        # the high bits of quad i: byte i of the group's first word (lo half), second (hi)
        f = tl.arange(0, 4 * G)[None, :]
        hq = qh_ptr.to(tl.pointer_type(tl.uint8)) + row * (4 * s_qh) + (g0 + f // 4) * 8 + f % 4
        hmask = nmask[:, None] & (g0 + f // 4 < KG)
        h0 = tl.reshape(tl.load(hq, mask=hmask, other=0).to(tl.int32), [BN, 4, GPC, 4, 1, 1])
        h1 = tl.reshape(tl.load(hq + 4, mask=hmask, other=0).to(tl.int32),
                        [BN, 4, GPC, 4, 1, 1])
        h0 = tl.broadcast_to(h0, byte6.shape)
        h1 = tl.broadcast_to(h1, byte6.shape)
    if ASM:
        if QTYPE == "q6_k":
            lo, hi = tl.inline_asm_elementwise(
                _PACKED_Q6K, "=r,=r,=r,=r" + ",r" * 17, [byte6, s6, o6, h0, h1, sl6, ol6],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        elif QTYPE == "q4_0":
            lo, hi = tl.inline_asm_elementwise(_PACKED_ZERO8, "=r,=r,=r,=r,r,r,r,r,r",
                                               [byte6, s6, sl6],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                               pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_PACKED_ZERO0, "=r,=r,=r,=r" + ",r" * 9,
                                               [byte6, s6, o6, sl6, ol6],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                               pack=4)
    else:
        code = byte6.to(tl.int32)
        q_lo = code & 15
        q_hi = code >> 4
        zero: tl.constexpr = 8.0 if QTYPE == "q4_0" else (32.0 if QTYPE == "q6_k" else 0.0)
        sh, sl = s6.to(tl.float32), sl6.to(tl.float32)
        oh, ol = o6.to(tl.float32), ol6.to(tl.float32)
        if QTYPE == "q6_k":
            k = (2 * tl.arange(0, 2)[:, None] + tl.arange(0, 2)[None, :])[None, None, None, None]
            q_lo |= ((h0 >> (2 * k)) & 3) << 4
            q_hi |= ((h1 >> (2 * k)) & 3) << 4
            lo = _rne_bf16((q_lo.to(tl.float32) - zero) * (sh + sl))
            hi = _rne_bf16((q_hi.to(tl.float32) - zero) * (oh + ol))
        elif QTYPE == "q4_0":
            lo = _rne_bf16((q_lo.to(tl.float32) - zero) * (sh + sl))
            hi = _rne_bf16((q_hi.to(tl.float32) - zero) * (sh + sl))
        else:  # the two roundings of the PTX, then their sum rounded
            ql, qh = q_lo.to(tl.float32), q_hi.to(tl.float32)
            lo = _rne_bf16(_rne_bf16(ql * sh + oh).to(tl.float32)
                           + _rne_bf16(ql * sl + ol).to(tl.float32))
            hi = _rne_bf16(_rne_bf16(qh * sh + oh).to(tl.float32)
                           + _rne_bf16(qh * sl + ol).to(tl.float32))
    lo = tl.reshape(lo, [BN, 4, GPC, 8, 2])
    hi = tl.reshape(hi, [BN, 4, GPC, 8, 2])
    # [BN, c, gp, qq, e, h] -> [BN, gp, qq, h, c, e]: slot 16 (8 gp + qq) + 8h + 2c + e
    w = tl.permute(tl.join(lo, hi), (0, 2, 3, 5, 1, 4))
    return tl.reshape(w, [BN, 32 * G])
