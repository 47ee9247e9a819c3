"""int8-activation kernels of qdot_cpu.py, for CPUs with AVX-512 VNNI (`vpdpbusd`: 64 unsigned
bytes times 64 signed bytes, summed by fours into 16 int32 lanes, in one instruction).

The activations are quantized per group of 32 to int8 (xq = round(x / dx), dx = max|x| / 127,
as llama.cpp's CPU kernels do); the weights' codes enter unsigned, before their offset, so one
`vpdpbusd` multiplies two groups (64 codes) where the int16 path (qdot_kernels_cpu.py) needs a
widening and a `pmaddwd` per group. The offset comes back exactly through the group's integer
sum of xq: sum (q - o) xq = sum q xq - o sum xq.

Block order. A block of 8 groups (256 codes) goes as four 64-byte vectors (`QUARTERS`):
vector 2c + h holds codes 16h .. 16h + 16 of groups 4c .. 4c + 4, which is how the nibbles of
four groups come out of one 64-byte load (mask: codes 0-15 of each, shift: codes 16-31), and
`_quantize_groups8` stores the activations in that order. `vpdpbusd` lanes 4j .. 4j + 3 are
then group j of the four in both vectors of a c, so their products add in the int32
accumulator (the instruction's own add) and a block costs two conversions and two multiplies
per row where pairs of groups in order cost four of each and a shuffle per pair (the q4_k
block loop of 4 rows: 266 -> 170 instructions; 2,048 x 1,536 in cache 50 -> 57 GB/s, Zen 5).
Half a block (4 groups) goes the same way; of the last 0-3 groups of a row, two go as a pair
in order (one `vpdpbusd`, lanes 0-7 and 8-15 the two groups), the third alone, and both ask
for their lines ahead as the blocks do (without that, the last line of each of SmolLM2's
576-wide rows went unasked: its matvecs from DRAM ran 5-14% slower than session 27's). Per
block:

  q4_0, q5_0   codes q (nibbles, fifth bit)        + d * dx * (-o) * sum(xq)   (o = 8, 16)
  q4_1, q5_1   codes q                             + m * sum(x)   (fp32 sum, as the int16 path)
  q4_k, q5_k   codes q                             - dmin mn * sum(x)
  q6_k         codes q (six bits)                  + (d sc) * dx * (-32) * sum(xq) per 16
  q8_0         q + 128 (its bytes, sign bit flipped) + d * dx * (-128) * sum(xq)

Every integer sum is exact; what int8 activations lose is the rounding of xq, up to
max|x of the group| / 254 per element, 258x the int16 path's step: a projection's output moves
by 1-2% of its norm (measured on real SmolLM2's decode steps; the same estimate for bf16
activations gives ~0.1%, for int16 ~0.005%), as with llama.cpp's CPU kernels, which round the
same way. tests/test_qdot8_cpu.py checks the kernels against the exact dot of the same
quantized activations (to fp32 rounding) and bounds the loss against fp32.

The IR helpers (code unpacking, scales, prefetch, loops over rows) are qdot_ir_cpu.py's,
`group_step` (the activation groups' statistics) and the dispatch on `kind` qdot_kernels_cpu.py's.
numba's on-disk cache of these kernels is invalidated by changes to this file only: after
editing either of those, touch this file too.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .qdot_ir_cpu import (_CPU, _F32, _I8, _I16, _I32, BLOCK, KINDS, _bit_plane, _call, _const,
                          _fadd, _fmul, _load, _nibbles, _prefetch, _row_pointers, _run_blocks,
                          _scales, _vec, _widen, q6_k_high, weight_group)
from .qdot_kernels_cpu import _by_kind, group_step, task_rows

VNNI = "avx512vnni" in _CPU and "avx512bw" in _CPU
"""Whether this CPU runs these kernels (`qdot_cpu.int8_available`)."""
OFFSET = {"q4_0": 8, "q5_0": 16, "q6_k": 32, "q8_0": 128}
"""The code offsets taken back through sum(xq) (q6_k: per 16 codes; q8_0's codes enter as
q + 128)."""
QUARTERS = ((0, 0), (0, 1), (1, 0), (1, 1))
"""Block order: a block of 8 groups (256 codes) as four vectors of 64, vector 2c + h holding
codes 16h .. 16h + 16 of groups 4c .. 4c + 4, group by group; `_quantize_groups8` stores the
activations of whole blocks in this order, and of half a block (the first two vectors) where 4
to 7 groups are left after them (K = 896: 3 blocks and a half); the last 0-3 groups in order
(a pair of them in `_pair_codes`' order, which is theirs)."""
_LANES = 2 * BLOCK
"""Width of the offset accumulator: one lane per group, or per half group for q6_k."""


def _ucodes(qtype, b, p, g):
    """Group g of one row's codes as <32 x i8>, unsigned and before the offset (q8_0's: its
    signed bytes plus 128, `OFFSET`)."""
    if qtype == "q8_0":
        q = _load(b, p["qs"], b.mul(g, ir.Constant(g.type, 32)), _I8, 32)
        return b.xor(q, _const(_I8, 32, 0x80))
    q = _nibbles(b, p["qs"], g)
    if qtype in ("q5_0", "q5_1", "q5_k"):
        q = b.or_(q, _bit_plane(b, p["qh"], b.mul(g, ir.Constant(g.type, 4)), 16))
    if qtype == "q6_k":
        q = b.or_(q, q6_k_high(b, p["qh"], g))
    return q


def _pair_codes(qtype, b, p, g):
    """Groups g and g + 1 of one row's codes in order as <64 x i8> (as `_ucodes`; a tail's
    pair, so not q6_k, whose rows are whole blocks): one 32-byte load of their nibbles, one
    mask, one shift, one shuffle; their fifth bits one 64-bit select."""
    if qtype == "q8_0":
        q = _load(b, p["qs"], b.mul(g, ir.Constant(g.type, 32)), _I8, 64)
        return b.xor(q, _const(_I8, 64, 0x80))
    both = _load(b, p["qs"], b.mul(g, ir.Constant(g.type, 16)), _I8, 32)
    lo = b.and_(both, _const(_I8, 32, 15))
    hi = b.lshr(both, _const(_I8, 32, 4))  # group g: lo[:16], hi[:16]; g + 1: lo[16:], hi[16:]
    q = b.shuffle_vector(lo, hi, _const(_I32, 64, [*range(16), *range(32, 48), *range(16, 32),
                                                   *range(48, 64)]))
    if qtype in ("q5_0", "q5_1", "q5_k"):  # both groups' 32-bit planes are adjacent
        bits = _load(b, p["qh"], b.mul(g, ir.Constant(g.type, 4)), ir.IntType(64))
        q = b.or_(q, _plane_select(b, bits, 16))
    return q


def _block_codes(qtype, b, p, g0, quarters=QUARTERS):
    """Groups g0 .. g0 + 8 of one row (a block) as four <64 x i8> in block order (`QUARTERS`;
    the first two: half a block, groups g0 .. g0 + 4),
    unsigned and before the offset as `_ucodes`: the nibble types' 128 bytes are two 64-byte
    loads, each one mask and one shift; q8_0's 256 bytes four loads and two qword shuffles per
    pair; fifth bits one 16-bit shuffle and one select per vector; q6_k's high bits one
    64-byte load (`qdot_cpu._q6_k_high`), a shift and a mask per vector."""
    if qtype == "q8_0":
        at = b.mul(g0, ir.Constant(g0.type, 32))
        words = [_load(b, p["qs"], b.add(at, ir.Constant(g0.type, 64 * i)), ir.IntType(64), 8)
                 for i in range(len(quarters))]
        out = []
        for c, h in quarters:  # group j of the four: qwords 4j + 2h, + 1 of the pair's 16
            v = b.shuffle_vector(words[2 * c], words[2 * c + 1], _const(
                _I32, 8, [4 * j + 2 * h + t for j in range(4) for t in (0, 1)]))
            out.append(b.xor(b.bitcast(v, _vec(_I8, 64)), _const(_I8, 64, 0x80)))
        return out
    halves = [_load(b, p["qs"], b.add(b.mul(g0, ir.Constant(g0.type, 16)),
                                      ir.Constant(g0.type, 64 * c)), _I8, 64)
              for c in range(len(quarters) // 2)]
    out = [b.and_(halves[c], _const(_I8, 64, 15)) if h == 0 else
           b.lshr(halves[c], _const(_I8, 64, 4)) for c, h in quarters]
    if qtype in ("q5_0", "q5_1", "q5_k"):  # 32-bit plane per group: 16-bit chunk 2g + h
        planes = _load(b, p["qh"], b.mul(g0, ir.Constant(g0.type, 4)), _I16,
                       4 * len(quarters))
        for i, (c, h) in enumerate(quarters):
            bits = b.shuffle_vector(planes, planes, _const(
                _I32, 4, [2 * (4 * c + j) + h for j in range(4)]))
            out[i] = b.or_(out[i], _plane_select(b, b.bitcast(bits, ir.IntType(64)), 16))
    elif qtype == "q6_k":  # two bits per code, vector v's at bits 2v (`qdot_cpu._q6_k_high`)
        high = _load(b, p["qh"], b.mul(g0, ir.Constant(g0.type, 8)), _I8, 64)
        for v in range(len(quarters)):
            at4 = (b.shl(high, _const(_I8, 64, 4 - 2 * v)) if v < 2 else
                   b.lshr(high, _const(_I8, 64, 2 * v - 4)) if v > 2 else high)
            out[v] = b.or_(out[v], b.and_(at4, _const(_I8, 64, 0x30)))
    return out


def _plane_select(b, bits, value):
    """64 bits (bit j for code j) -> <64 x i8> of 0 or value."""
    mask = b.bitcast(bits, _vec(ir.IntType(1), 64))
    return b.select(mask, _const(_I8, 64, value), _const(_I8, 64, 0))


def _dpbusd(b, u, s, acc=None):
    """acc + <64 x i8> unsigned u . <64 x i8> signed s -> <16 x i32>, lane j the sum of bytes
    4j..4j+3's products."""
    if acc is None:
        acc = ir.Constant(_vec(_I32, 16), [0] * 16)
    as32 = [b.bitcast(v, _vec(_I32, 16)) for v in (u, s)]  # the pre-LLVM-21 signature; newer
    return _call(b, "llvm.x86.avx512.vpdpbusd.512", _vec(_I32, 16), acc, *as32)  # upgrade it


def dot8_intrinsic(qtype, wrows, xrows, interleaved=False):
    halves = qtype == "q6_k"

    @intrinsic
    def block_dot(typingctx, qs, qh, d, m, sc, mn, xq, dx, xsum, qsum):
        """sum_k w[r, k] x[i, k] for `wrows` weight rows r and `xrows` activation rows i,
        r-major (as qdot_kernels_cpu.dot_intrinsic). x as `_quantize_groups8` leaves it: xq int8
        [xrows, K] (whole blocks in block order), dx and xsum fp32 [xrows, K/32], qsum fp32
        [xrows, K/16] (dx sum(xq) per 16 codes). Groups go `BLOCK` at a time: each quarter of
        a block one `vpdpbusd`, whose lanes 4j .. 4j + 3 are group j of its four, so that a
        block's two quarters of the same groups sum in integers (q6_k: each half group its own
        scale) before one conversion and multiply per four groups; a tail group alone."""
        def codegen(context, b, sig, args):
            xs = [context.make_array(sig.args[i])(context, b, args[i]) for i in (6, 7, 8, 9)]
            k, groups, _, halfs = (cgutils.unpack_tuple(b, a.shape, 2)[1] for a in xs)
            rows = _row_pointers(context, b, sig, args, wrows, b.udiv(
                groups, ir.Constant(groups.type, BLOCK)) if interleaved else None)  # whole blocks
            xp = [[b.gep(a.data, [b.mul(width, ir.Constant(width.type, i))])
                   for a, width in zip(xs, (k, groups, groups, halfs))] for i in range(xrows)]
            pairs = [(p, x) for p in rows for x in xp]
            acc_p = [cgutils.alloca_once_value(b, ir.Constant(_vec(_F32, 16), [0.0] * 16))
                     for _ in pairs]
            off_p = [cgutils.alloca_once_value(b, ir.Constant(_vec(_F32, _LANES), [0.0] * _LANES))
                     for _ in pairs]

            def run(g0, n):  # groups g0 .. g0 + n (n = BLOCK, or 1)
                gw = weight_group(b, g0, interleaved)  # the weight's fields at g0
                scales = {id(p): _scales(qtype, b, p, gw, n) for p in rows}
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
                if n == 1:
                    lone(g0, lanes)
                elif n == 2:
                    pair(g0, lanes)
                else:  # a block, or half of one
                    block(g0, gw, lanes, QUARTERS[:n // 2])

            def block(g0, gw, lanes, quarters):
                codes = {id(p): _block_codes(qtype, b, p, gw, quarters) for p in rows}
                for p in rows:
                    for j in range(0, 2 * len(quarters), 2 if qtype == "q8_0" else 4):
                        _prefetch(qtype, b, p, b.add(gw, ir.Constant(g0.type, j)))  # a line each
                for (p, (x, dp, sp, hp)), acc in zip(pairs, acc_p):
                    at = b.mul(g0, ir.Constant(g0.type, 32))
                    xv = [_load(b, x, b.add(at, ir.Constant(at.type, 64 * i)), _I8, 64)
                          for i in range(len(quarters))]
                    sums = {}
                    for i, (c, h) in enumerate(quarters):
                        key = (c, h) if halves else c
                        sums[key] = _dpbusd(b, codes[id(p)][i], xv[i], sums.get(key))
                    total = b.load(acc)
                    for key, v in sums.items():
                        c, h = key if halves else (key, 0)
                        mask = ([2 * (4 * c + j // 4) + h for j in range(16)] if halves else
                                [4 * c + j // 4 for j in range(16)])
                        v8 = lanes[id(p), id(x)]
                        scale = b.shuffle_vector(v8, v8, _const(_I32, 16, mask))
                        total = _fadd(b, total, _fmul(b, b.sitofp(v, _vec(_F32, 16)), scale))
                    b.store(total, acc)

            def pair(g, lanes):  # two groups of a tail, in order
                codes = {id(p): _pair_codes(qtype, b, p, g) for p in rows}
                for p in rows:  # a row's last line is asked for here (K = 576: 4.5 lines)
                    _prefetch(qtype, b, p, g)
                for (p, (x, dp, sp, hp)), acc in zip(pairs, acc_p):
                    xv = _load(b, x, b.mul(g, ir.Constant(g.type, 32)), _I8, 64)
                    sums = b.sitofp(_dpbusd(b, codes[id(p)], xv), _vec(_F32, 16))
                    v = lanes[id(p), id(x)]  # lanes 0-7 group g's, 8-15 g + 1's
                    scale = b.shuffle_vector(v, v, _const(_I32, 16, [j // 8 for j in range(16)]))
                    b.store(_fadd(b, b.load(acc), _fmul(b, sums, scale)), acc)

            def lone(g, lanes):
                codes = {}
                for p in rows:
                    _prefetch(qtype, b, p, g)
                    c = _ucodes(qtype, b, p, g)
                    codes[id(p)] = b.shuffle_vector(c, ir.Constant(c.type, [0] * 32),
                                                    _const(_I32, 64, range(64)))
                for (p, (x, dp, sp, hp)), acc in zip(pairs, acc_p):
                    xv = _load(b, x, b.mul(g, ir.Constant(g.type, 32)), _I8, 32)
                    xv = b.shuffle_vector(xv, ir.Constant(xv.type, [0] * 32),
                                          _const(_I32, 64, range(64)))
                    sums = b.sitofp(_dpbusd(b, codes[id(p)], xv), _vec(_F32, 16))
                    v = lanes[id(p), id(x)]  # lanes 0-7 the group's (q6_k: 0-3, 4-7 its halves)
                    scale = b.shuffle_vector(v, v, _const(
                        _I32, 16, [j // 4 if halves else 0 for j in range(16)]))
                    b.store(_fadd(b, b.load(acc), _fmul(b, sums, scale)), acc)

            return _run_blocks(context, b, sig, groups, run, acc_p, off_p,
                               tails=(BLOCK // 2, 2))
        out = types.UniTuple(types.float32, wrows * xrows)
        return out(qs, qh, d, m, sc, mn, xq, dx, xsum, qsum), codegen
    return block_dot


if VNNI:
    _dot_w1x1, _dot_w4x1, _dot_w1x4, _dot_w4x2 = (
        _by_kind([dot8_intrinsic(q, w, x) for q in KINDS]) for w, x in ((1, 1), (4, 1), (1, 4),
                                                                        (4, 2)))
    _dot_i4x1, _dot_i4x2 = (_by_kind([dot8_intrinsic(q, 4, x, True) for q in KINDS])
                            for x in (1, 2))


@njit(cache=True, nogil=True, fastmath=True)
def _quantize_groups8(x, xq, dx, xsum, qsum):
    """x fp32 [M, K] -> xq int8 [M, K], whole blocks of 8 groups in block order (`QUARTERS`),
    the rest in order; dx, xsum (sum of x) fp32 [M, K/32]; qsum fp32 [M, K/16] (dx times the
    sum of xq over each 16 codes, in order)."""
    groups = x.shape[1] // 32
    whole = groups // 4 * 4  # blocks, and half a block
    for i in range(x.shape[0]):
        for g in range(groups):
            step = group_step(x, i, g, 127, dx, xsum)
            inv = np.float32(1) / step
            for h in range(2):
                if g < whole:
                    to = (g // 8) * 256 + (2 * ((g % 8) // 4) + h) * 64 + (g % 4) * 16
                else:
                    to = g * 32 + 16 * h
                s = 0
                for j in range(16):
                    q = min(127, max(-127, np.int32(np.round(x[i, g * 32 + 16 * h + j] * inv))))
                    xq[i, to + j] = np.int8(q)
                    s += q
                qsum[i, 2 * g + h] = step * np.float32(s)


def natural_order(xq: np.ndarray) -> np.ndarray:
    """`_quantize_groups8`'s xq [M, K] back in the order of x (tests)."""
    m, k = xq.shape
    whole = k // 128 * 128  # blocks and half a block: quarters of 4 groups (c) in order
    quarters = xq[:, :whole].reshape(m, -1, 2, 4, 16)  # [4 groups, h, group, 16]
    ordered = quarters.transpose(0, 1, 3, 2, 4).reshape(m, whole)  # [4 groups, group, h, 16]
    return np.concatenate([ordered, xq[:, whole:]], axis=1)


if VNNI:
    @njit(parallel=True, cache=True, nogil=True)
    def matvec8_kernel(kind, qs, qh, d, m, sc, mn, x, xq, dx, xsum, qsum, out, tasks, one_row,
                       interleaved):
        """qdot_kernels_cpu.matvec_kernel with int8 activations; `one_row`: one activation
        row goes through the weight rows one at a time, not 4 (`qdot_cpu.ONE_ROW_MIN_K`);
        `interleaved`: the fields are interleaved by 4 rows (`qdot_cpu.interleave`), which
        go together against one activation row or two at a time."""
        rows = x.shape[0]
        _quantize_groups8(x, xq[:rows], dx[:rows], xsum[:rows], qsum[:rows])
        if interleaved:  # each array row is 4 weight rows
            n_groups = qs.shape[0]
            step = task_rows(4 * n_groups, tasks) // 4  # the same rows a task
            for c in prange(-(-n_groups // step)):
                for g in range(step * c, min(n_groups, step * (c + 1))):
                    for i in range(0, rows - 1, 2):
                        y = _dot_i4x2(kind, qs[g:g + 1], qh[g:g + 1], d[g:g + 1], m[g:g + 1],
                                      sc[g:g + 1], mn[g:g + 1], xq[i:i + 2], dx[i:i + 2],
                                      xsum[i:i + 2], qsum[i:i + 2])
                        for r in range(4):
                            out[i, 4 * g + r] = y[2 * r]
                            out[i + 1, 4 * g + r] = y[2 * r + 1]
                    if rows % 2:
                        i = rows - 1
                        y1 = _dot_i4x1(kind, qs[g:g + 1], qh[g:g + 1], d[g:g + 1], m[g:g + 1],
                                       sc[g:g + 1], mn[g:g + 1], xq[i:i + 1], dx[i:i + 1],
                                       xsum[i:i + 1], qsum[i:i + 1])
                        for r in range(4):
                            out[i, 4 * g + r] = y1[r]
            return
        n_rows = qs.shape[0]
        step = task_rows(n_rows, tasks)
        for c in prange(-(-n_rows // step)):
            for n in range(step * c, min(n_rows, step * (c + 1)), 4):
                if rows > 1 and n + 4 <= n_rows:  # 4 weight rows against 2 activation rows
                    for i in range(0, rows - 1, 2):
                        y = _dot_w4x2(kind, qs[n:n + 4], qh[n:n + 4], d[n:n + 4], m[n:n + 4],
                                      sc[n:n + 4], mn[n:n + 4], xq[i:i + 2], dx[i:i + 2],
                                      xsum[i:i + 2], qsum[i:i + 2])
                        for r in range(4):
                            out[i, n + r] = y[2 * r]
                            out[i + 1, n + r] = y[2 * r + 1]
                    if rows % 2:
                        i = rows - 1
                        y1 = _dot_w4x1(kind, qs[n:n + 4], qh[n:n + 4], d[n:n + 4], m[n:n + 4],
                                       sc[n:n + 4], mn[n:n + 4], xq[i:i + 1], dx[i:i + 1],
                                       xsum[i:i + 1], qsum[i:i + 1])
                        for r in range(4):
                            out[i, n + r] = y1[r]
                elif rows > 1:  # the last 1-3 weight rows
                    for r in range(n, n_rows):
                        for i in range(0, rows, 4):
                            y = _dot_w1x4(kind, qs[r:r + 1], qh[r:r + 1], d[r:r + 1],
                                          m[r:r + 1], sc[r:r + 1], mn[r:r + 1], xq[i:i + 4],
                                          dx[i:i + 4], xsum[i:i + 4], qsum[i:i + 4])
                            for j in range(min(4, rows - i)):
                                out[i + j, r] = y[j]
                elif n + 4 <= n_rows and not one_row:
                    y = _dot_w4x1(kind, qs[n:n + 4], qh[n:n + 4], d[n:n + 4], m[n:n + 4],
                                  sc[n:n + 4], mn[n:n + 4], xq, dx, xsum, qsum)
                    for j in range(4):
                        out[0, n + j] = y[j]
                else:  # one_row, or the last 1-3 rows
                    for r in range(n, min(n + 4, n_rows)):
                        out[0, r] = _dot_w1x1(kind, qs[r:r + 1], qh[r:r + 1], d[r:r + 1],
                                              m[r:r + 1], sc[r:r + 1], mn[r:r + 1], xq, dx,
                                              xsum, qsum)[0]
