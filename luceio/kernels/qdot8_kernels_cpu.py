"""int8-activation kernels of qdot_cpu.py, for CPUs with AVX-512 VNNI (`vpdpbusd`: 64 unsigned
bytes times 64 signed bytes, summed by fours into 16 int32 lanes, in one instruction).

The activations are quantized per group of 32 to int8 (xq = round(x / dx), dx = max|x| / 127,
as llama.cpp's CPU kernels do); the weights' codes enter unsigned, before their offset, so one
`vpdpbusd` multiplies two groups (64 codes) where the int16 path (qdot_kernels_cpu.py) needs a
widening and a `pmaddwd` per group. The offset comes back exactly through the group's integer
sum of xq: sum (q - o) xq = sum q xq - o sum xq. Both groups of a pair are unpacked at once
in 64-byte vectors (`_ucodes_pair`: one load of their nibbles, one mask, one shift, one shuffle,
each bit plane one select), which took 25-30% off a call's time in cache and q6_k from DRAM
from 28-35 to 40-45 GB/s (2 threads, Zen 5). So per pair of groups:

  q4_0, q5_0   codes q (nibbles, fifth bit)        + d * dx * (-o) * sum(xq)   (o = 8, 16)
  q4_1, q5_1   codes q                             + m * sum(x)   (fp32 sum, as the int16 path)
  q4_k, q5_k   codes q                             - dmin mn * sum(x)
  q6_k         codes q (six bits)                  + (d sc) * dx * (-32) * sum(xq) per 16
  q8_0         |q| times xq with q's sign (codes are signed; xq is within +-127)

Every integer sum is exact; what int8 activations lose is the rounding of xq, up to
max|x of the group| / 254 per element, 258x the int16 path's step: a projection's output moves
by 1-2% of its norm (measured on real SmolLM2's decode steps; the same estimate for bf16
activations gives ~0.1%, for int16 ~0.005%), as with llama.cpp's CPU kernels, which round the
same way. tests/test_qdot8_cpu.py checks the kernels against the exact dot of the same
quantized activations (to fp32 rounding) and bounds the loss against fp32.

The IR helpers (code unpacking, scales, prefetch, loops over rows) and `group_step` (the
activation groups' statistics) are qdot_kernels_cpu.py's.
numba's on-disk cache of these kernels is invalidated by changes to this file only: after
editing those helpers, touch this file too.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .qdot_kernels_cpu import (_CPU, _F32, _I8, _I32, BLOCK, CHUNK, KINDS, _bit_plane, _by_kind,
                               _call, _const, _fadd, _fmul, _load, _nibbles, _prefetch,
                               _row_pointers, _run_blocks, _scales, _vec, _widen, group_step)

VNNI = "avx512vnni" in _CPU and "avx512bw" in _CPU
"""Whether this CPU runs these kernels (`qdot_cpu.int8_available`)."""
OFFSET = {"q4_0": 8, "q5_0": 16, "q6_k": 32}
"""The code offsets taken back through sum(xq) (q6_k: per 16 codes)."""
_LANES = 2 * BLOCK
"""Width of the offset accumulator: one lane per group, or per half group for q6_k."""


def _ucodes(qtype, b, p, g):
    """Group g of one row's codes as <32 x i8>: unsigned and before the offset, except q8_0's,
    which are its signed bytes."""
    if qtype == "q8_0":
        return _load(b, p["qs"], b.mul(g, ir.Constant(g.type, 32)), _I8, 32)
    q = _nibbles(b, p["qs"], g)
    if qtype in ("q5_0", "q5_1", "q5_k"):
        q = b.or_(q, _bit_plane(b, p["qh"], b.mul(g, ir.Constant(g.type, 4)), 16))
    if qtype == "q6_k":
        at = b.mul(g, ir.Constant(g.type, 8))
        for plane, value in ((0, 16), (4, 32)):
            q = b.or_(q, _bit_plane(b, p["qh"], b.add(at, ir.Constant(g.type, plane)), value))
    return q


def _ucodes_pair(qtype, b, p, g):
    """Groups g and g + 1 of one row's codes as <64 x i8> (as `_ucodes`), unpacked with 64-byte
    vectors: one load of both groups' nibbles (32 bytes), one mask, one shift, one shuffle, and
    each bit plane of both groups as one <64 x i1> select."""
    if qtype == "q8_0":
        return _load(b, p["qs"], b.mul(g, ir.Constant(g.type, 32)), _I8, 64)
    both = _load(b, p["qs"], b.mul(g, ir.Constant(g.type, 16)), _I8, 32)
    lo = b.and_(both, _const(_I8, 32, 15))
    hi = b.lshr(both, _const(_I8, 32, 4))  # group g: lo[:16], hi[:16]; g + 1: lo[16:], hi[16:]
    q = b.shuffle_vector(lo, hi, _const(_I32, 64, [*range(16), *range(32, 48), *range(16, 32),
                                                   *range(48, 64)]))
    if qtype in ("q5_0", "q5_1", "q5_k"):  # both groups' 32-bit planes are adjacent
        bits = _load(b, p["qh"], b.mul(g, ir.Constant(g.type, 4)), ir.IntType(64))
        q = b.or_(q, _plane_select(b, bits, 16))
    if qtype == "q6_k":  # [plane 0, plane 1] of g, then of g + 1 (`_q6_k_planes`)
        at = b.mul(g, ir.Constant(g.type, 8))
        both = _load(b, p["qh"], at, _I32, 4)
        for plane, value in ((0, 16), (1, 32)):
            pair = b.shuffle_vector(both, both, _const(_I32, 2, [plane, plane + 2]))
            q = b.or_(q, _plane_select(b, b.bitcast(pair, ir.IntType(64)), value))
    return q


def _plane_select(b, bits, value):
    """64 bits (bit j for code j) -> <64 x i8> of 0 or value."""
    mask = b.bitcast(bits, _vec(ir.IntType(1), 64))
    return b.select(mask, _const(_I8, 64, value), _const(_I8, 64, 0))


def _dpbusd(b, u, s):
    """<64 x i8> unsigned u . <64 x i8> signed s -> <16 x i32>, lane j the sum of bytes
    4j..4j+3's products."""
    zero = ir.Constant(_vec(_I32, 16), [0] * 16)
    as32 = [b.bitcast(v, _vec(_I32, 16)) for v in (u, s)]  # the pre-LLVM-21 signature; newer
    return _call(b, "llvm.x86.avx512.vpdpbusd.512", _vec(_I32, 16), zero, *as32)  # upgrade it


def _signed_pair(b, q, x):
    """q8_0: (|q|, x with q's sign), so that |q| . (sign(q) x) = q . x in `_dpbusd`."""
    neg = b.icmp_signed("<", q, ir.Constant(q.type, [0] * 64))
    zero = ir.Constant(q.type, [0] * 64)
    return b.select(neg, b.sub(zero, q), q), b.select(neg, b.sub(zero, x), x)


def _pair_lanes(b, v, i, halves, last):
    """<16 x float> lane scales for groups 2i and 2i + 1 of a block (`_dpbusd`'s lanes 0-7 and
    8-15) from v, one scale per group (<n>) or per half group (halves, <2n>); `last`: a lone
    group (lanes 8-15 multiply zeros)."""
    if halves:
        mask = [4 * i + j // 4 for j in range(8)] + [4 * i + (2 if not last else 0) + j // 4
                                                     for j in range(8)]
    else:
        mask = [2 * i] * 8 + [2 * i + (0 if last else 1)] * 8
    return b.shuffle_vector(v, v, _const(_I32, 16, mask))


def dot8_intrinsic(qtype, wrows, xrows):
    halves = qtype == "q6_k"

    @intrinsic
    def block_dot(typingctx, qs, qh, d, m, sc, mn, xq, dx, xsum, qsum):
        """sum_k w[r, k] x[i, k] for `wrows` weight rows r and `xrows` activation rows i,
        r-major (as qdot_kernels_cpu.dot_intrinsic). x as `_quantize_groups8` leaves it: xq int8
        [xrows, K], dx and xsum fp32 [xrows, K/32], qsum fp32 [xrows, K/16] (dx sum(xq) per 16
        codes). Groups go `BLOCK` at a time, in pairs; an odd last group alone."""
        def codegen(context, b, sig, args):
            rows = _row_pointers(context, b, sig, args, wrows)
            xs = [context.make_array(sig.args[i])(context, b, args[i]) for i in (6, 7, 8, 9)]
            k, groups, _, halfs = (cgutils.unpack_tuple(b, a.shape, 2)[1] for a in xs)
            xp = [[b.gep(a.data, [b.mul(width, ir.Constant(width.type, i))])
                   for a, width in zip(xs, (k, groups, groups, halfs))] for i in range(xrows)]
            pairs = [(p, x) for p in rows for x in xp]
            acc_p = [cgutils.alloca_once_value(b, ir.Constant(_vec(_F32, 16), [0.0] * 16))
                     for _ in pairs]
            off_p = [cgutils.alloca_once_value(b, ir.Constant(_vec(_F32, _LANES), [0.0] * _LANES))
                     for _ in pairs]

            def run(g0, n):  # groups g0 .. g0 + n (n = BLOCK, or 1)
                scales = {id(p): _scales(qtype, b, p, g0, n) for p in rows}
                lanes = {}
                for (p, (x, dp, sp, hp)), off in zip(pairs, off_p):
                    scale, offset = scales[id(p)]
                    step = _load(b, dp, g0, _F32, n)
                    if halves:
                        step = b.shuffle_vector(step, step,
                                                _const(_I32, 2 * n, [j // 2 for j in range(2 * n)]))
                    lanes[id(p), id(x)] = _fmul(b, scale, step)
                    if qtype in OFFSET:  # (-o) * scale * dx sum(xq)
                        both = _load(b, hp, b.mul(g0, ir.Constant(g0.type, 2)), _F32, 2 * n)
                        if halves:
                            sums = both
                        else:  # a group's two halves
                            sums = _fadd(b, *(b.shuffle_vector(both, both, _const(
                                _I32, n, range(h, 2 * n, 2))) for h in (0, 1)))
                        neg = _const(_F32, sums.type.count, -float(OFFSET[qtype]))
                        term = _fmul(b, _fmul(b, scale, neg), sums)
                    elif offset is not None:  # offset * sum(x), in fp32
                        term = _fmul(b, offset, _load(b, sp, g0, _F32, n))
                    else:
                        continue
                    b.store(_fadd(b, b.load(off), _widen(b, term, _LANES)), off)
                for i in range(0, n, 2):
                    last = i + 1 == n
                    g = b.add(g0, ir.Constant(g0.type, i))
                    codes = {}
                    for p in rows:
                        if last:
                            c = _ucodes(qtype, b, p, g)
                            codes[id(p)] = b.shuffle_vector(c, ir.Constant(c.type, [0] * 32),
                                                            _const(_I32, 64, range(64)))
                        else:
                            codes[id(p)] = _ucodes_pair(qtype, b, p, g)
                        _prefetch(qtype, b, p, g)
                        if not last:
                            _prefetch(qtype, b, p, b.add(g, ir.Constant(g.type, 1)))
                    for (p, (x, dp, sp, hp)), acc in zip(pairs, acc_p):
                        at = b.mul(g, ir.Constant(g.type, 32))
                        if last:
                            xv = _load(b, x, at, _I8, 32)
                            xv = b.shuffle_vector(xv, ir.Constant(xv.type, [0] * 32),
                                                  _const(_I32, 64, range(64)))
                        else:
                            xv = _load(b, x, at, _I8, 64)
                        u, s = codes[id(p)], xv
                        if qtype == "q8_0":
                            u, s = _signed_pair(b, u, s)
                        sums = b.sitofp(_dpbusd(b, u, s), _vec(_F32, 16))
                        scale = _pair_lanes(b, lanes[id(p), id(x)], i // 2, halves, last)
                        b.store(_fadd(b, b.load(acc), _fmul(b, sums, scale)), acc)

            return _run_blocks(context, b, sig, groups, run, acc_p, off_p)
        out = types.UniTuple(types.float32, wrows * xrows)
        return out(qs, qh, d, m, sc, mn, xq, dx, xsum, qsum), codegen
    return block_dot


if VNNI:
    _dot_w1x1, _dot_w4x1, _dot_w1x4 = (_by_kind([dot8_intrinsic(q, w, x) for q in KINDS])
                                       for w, x in ((1, 1), (4, 1), (1, 4)))


@njit(cache=True, nogil=True, fastmath=True)
def _quantize_groups8(x, xq, dx, xsum, qsum):
    """x fp32 [M, K] -> xq int8 [M, K]; dx, xsum (sum of x) fp32 [M, K/32]; qsum fp32 [M, K/16]
    (dx times the sum of xq over each 16 codes)."""
    for i in range(x.shape[0]):
        for g in range(x.shape[1] // 32):
            step = group_step(x, i, g, 127, dx, xsum)
            inv = np.float32(1) / step
            for h in range(2):
                s = 0
                for j in range(16 * h, 16 * h + 16):
                    q = min(127, max(-127, np.int32(np.round(x[i, g * 32 + j] * inv))))
                    xq[i, g * 32 + j] = np.int8(q)
                    s += q
                qsum[i, 2 * g + h] = step * np.float32(s)


if VNNI:
    @njit(parallel=True, cache=True, nogil=True)
    def matvec8_kernel(kind, qs, qh, d, m, sc, mn, x, xq, dx, xsum, qsum, out):
        """qdot_kernels_cpu.matvec_kernel with int8 activations."""
        rows = x.shape[0]
        _quantize_groups8(x, xq[:rows], dx[:rows], xsum[:rows], qsum[:rows])
        n_rows = qs.shape[0]
        for c in prange(-(-n_rows // (4 * CHUNK))):
            for n in range(4 * CHUNK * c, min(n_rows, 4 * CHUNK * (c + 1)), 4):
                if rows > 1:
                    for r in range(n, min(n + 4, n_rows)):
                        for i in range(0, rows, 4):
                            y = _dot_w1x4(kind, qs[r:r + 1], qh[r:r + 1], d[r:r + 1],
                                          m[r:r + 1], sc[r:r + 1], mn[r:r + 1], xq[i:i + 4],
                                          dx[i:i + 4], xsum[i:i + 4], qsum[i:i + 4])
                            for j in range(min(4, rows - i)):
                                out[i + j, r] = y[j]
                elif n + 4 <= n_rows:
                    y = _dot_w4x1(kind, qs[n:n + 4], qh[n:n + 4], d[n:n + 4], m[n:n + 4],
                                  sc[n:n + 4], mn[n:n + 4], xq, dx, xsum, qsum)
                    for j in range(4):
                        out[0, n + j] = y[j]
                else:
                    for r in range(n, n_rows):
                        out[0, r] = _dot_w1x1(kind, qs[r:r + 1], qh[r:r + 1], d[r:r + 1],
                                              m[r:r + 1], sc[r:r + 1], mn[r:r + 1], xq, dx,
                                              xsum, qsum)[0]
