"""The LLVM vector IR of the int8-activation CPU kernels (qdot8_kernels_cpu.py, whose docstring
tells the scheme): the weights' codes unsigned and in block order, `vpdpbusd`, and the dot
product intrinsic of 4 or 1 weight rows against a fixed or any number of activation rows.

The kernels that inline this IR live in qdot8_kernels_cpu.py, whose numba cache key includes
this file (`numba_cache.depend_on`).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .qdot_ir_cpu import (_CPU, _F32, _I8, _I16, _I32, BLOCK, _bit_plane, _call, _const, _fadd, _fma, _fmul,
                          _load, _nibbles, _prefetch, _row_pointers, _run_blocks, _scales, _vec,
                          _widen, bits_to_bytes, q6_k_high, row_loop, weight_group)

VNNI = "avx512vnni" in _CPU and "avx512bw" in _CPU
"""`vpdpbusd` in one instruction."""
AVX2_ONLY = not VNNI and "avx2" in _CPU
"""`vpdpbusd` made of AVX2's `vpmaddubsw` and `vpmaddwd` (`_dpbusd`)."""
SIGNED = AVX2_ONLY
"""q8_0's codes enter signed (`_dpbusd` takes |q| and moves q's sign onto x, as `vpsignb`
does) where there is no `vpdpbusd`; with it they enter as q + 128, its offset taken back
through sum(xq)."""
OFFSET = {"q4_0": 8, "q5_0": 16, "q6_k": 32, **({} if SIGNED else {"q8_0": 128})}
"""The code offsets taken back through sum(xq) (q6_k: per 16 codes; q8_0's codes enter as
q + 128 unless `SIGNED`)."""
QUARTERS = ((0, 0), (0, 1), (1, 0), (1, 1))
"""Block order: a block of 8 groups (256 codes) as four vectors of 64, vector 2c + h holding
codes 16h .. 16h + 16 of groups 4c .. 4c + 4, group by group; `_quantize_groups8` stores the
activations of whole blocks in this order, and of half a block (the first two vectors) where 4
to 7 groups are left after them (K = 896: 3 blocks and a half); the last 0-3 groups in order
(a pair of them in `_pair_codes`' order, which is theirs)."""
_LANES = 2 * BLOCK
"""Lanes of the offset terms (one per group, or per half group for q6_k), as wide as the
pair's accumulator they are added into."""


def _q8_0_codes(b, q):
    """q8_0's signed bytes as the kernel takes them: q + 128 (the sign bit flipped), or q
    itself where `SIGNED`."""
    return q if SIGNED else b.xor(q, _const(_I8, q.type.count, 0x80))


def _ucodes(qtype, b, p, g):
    """Group g of one row's codes as <32 x i8>, unsigned and before the offset (q8_0's: its
    signed bytes plus 128, `OFFSET`, or as they are where `SIGNED`)."""
    if qtype == "q8_0":
        return _q8_0_codes(b, _load(b, p["qs"], b.mul(g, ir.Constant(g.type, 32)), _I8, 32))
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
        return _q8_0_codes(b, _load(b, p["qs"], b.mul(g, ir.Constant(g.type, 32)), _I8, 64))
    both = _load(b, p["qs"], b.mul(g, ir.Constant(g.type, 16)), _I8, 32)
    lo = b.and_(both, _const(_I8, 32, 15))
    hi = b.lshr(both, _const(_I8, 32, 4))  # group g: lo[:16], hi[:16]; g + 1: lo[16:], hi[16:]
    q = b.shuffle_vector(lo, hi, _const(_I32, 64, [*range(16), *range(32, 48), *range(16, 32),
                                                   *range(48, 64)]))
    if qtype in ("q5_0", "q5_1", "q5_k"):  # both groups' 32-bit planes are adjacent
        bits = _load(b, p["qh"], b.mul(g, ir.Constant(g.type, 4)), ir.IntType(64))
        q = b.or_(q, bits_to_bytes(b, bits, 16))
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
            out.append(_q8_0_codes(b, b.bitcast(v, _vec(_I8, 64))))
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
            out[i] = b.or_(out[i], bits_to_bytes(b, b.bitcast(bits, ir.IntType(64)), 16))
    elif qtype == "q6_k":  # two bits per code, vector v's at bits 2v (`qdot_cpu._q6_k_high`)
        high = _load(b, p["qh"], b.mul(g0, ir.Constant(g0.type, 8)), _I8, 64)
        for v in range(len(quarters)):
            at4 = (b.shl(high, _const(_I8, 64, 4 - 2 * v)) if v < 2 else
                   b.lshr(high, _const(_I8, 64, 2 * v - 4)) if v > 2 else high)
            out[v] = b.or_(out[v], b.and_(at4, _const(_I8, 64, 0x30)))
    return out


def _dpbusd(b, u, s, acc=None, signed=False, more=()):
    """acc + <64 x i8> unsigned u . <64 x i8> signed s -> <16 x i32>, lane j the sum of bytes
    4j..4j+3's products. With AVX-512 VNNI one `vpdpbusd`; on AVX2 (`AVX2_ONLY`) per 32 bytes
    `vpmaddubsw` (pairs of products summed to int16, saturating) then `vpmaddwd` by ones (pairs
    of those to int32): exact while a pair stays within int16, which codes u < 128 keep
    (|s| <= 127: 2 * 127 * 127). `signed` codes (q8_0's, `SIGNED`) go as |u| times s with u's
    sign (`vpabsb`, `vpsignb`): |u| <= 128, so a pair stays within 2 * 128 * 127.
    `more`: one more (u, s) whose products add into the same lanes: with VNNI a second
    `vpdpbusd`; on AVX2, for codes below 64 (not `signed`), the two `vpmaddubsw` results add in
    int16 before one `vpmaddwd` (exact: 2 * 2 * 63 * 127 < 2^15), which saves a `vpmaddwd` and an
    add per 32 bytes; `signed` ones each take their own `vpmaddwd`."""
    if acc is None:
        acc = ir.Constant(_vec(_I32, 16), [0] * 16)
    terms = [(u, s), *more]
    if not AVX2_ONLY:
        for uu, ss in terms:
            as32 = [b.bitcast(v, _vec(_I32, 16)) for v in (uu, ss)]  # the pre-LLVM-21
            acc = _call(b, "llvm.x86.avx512.vpdpbusd.512", _vec(_I32, 16), acc, *as32)  # form
        return acc
    assert len(terms) <= 2
    halves = []
    for h in (0, 32):
        pick = _const(_I32, 32, range(h, h + 32))
        pairs = []
        for uu, ss in terms:
            uh, sh = (b.shuffle_vector(v, v, pick) for v in (uu, ss))
            if signed:
                sh = _call(b, "llvm.x86.avx2.psign.b", _vec(_I8, 32), sh, uh)
                uh = _call(b, "llvm.abs.v32i8", _vec(_I8, 32), uh, ir.Constant(ir.IntType(1), 0))
            pairs.append(_call(b, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), uh, sh))
        if not signed:  # codes below 64: the pairs' int16 sum is exact
            pairs = [pairs[0] if len(pairs) == 1 else b.add(*pairs)]
        quads = [_call(b, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), v, _const(_I16, 16, 1))
                 for v in pairs]
        halves.append(quads[0] if len(quads) == 1 else b.add(*quads))
    return b.add(acc, b.shuffle_vector(halves[0], halves[1], _const(_I32, 16, range(16))))


def dot8_intrinsic(qtype, wrows, xrows, interleaved=False):
    """sum_k w[r, k] x[i, k] for `wrows` weight rows r and `xrows` activation rows i, r-major
    (as qdot_kernels_cpu.dot_intrinsic). x as `_quantize_groups8` leaves it: xq int8 [xrows, K]
    (whole blocks in block order), dx and xsum fp32 [xrows, K/32], qsum fp32 [xrows, K/16] (dx
    sum(xq) per 16 codes). Groups go `BLOCK` at a time: each quarter of a block one `vpdpbusd`,
    whose lanes 4j .. 4j + 3 are group j of its four, so that a block's two quarters of the same
    groups sum in integers (q6_k: each half group its own scale) before one conversion and
    multiply per four groups; a tail group alone.

    `xrows=None`: as many activation rows as xq has (at most `qdot_ir_cpu.XN_MAX`), a loop over them inside
    each block, so the weight rows' codes and scales are unpacked once a block for all of them
    (with 2 rows a call, 5 rows unpacked them 3 times: ~40% of the instructions); the sums go to
    a last argument, res fp32 [>= rows, wrows] C-contiguous, and each (weight row, activation
    row) keeps its accumulator on the stack (`row_loop`) where the fixed-row forms keep it in a
    register. Every form adds a pair's offset terms into its accumulator and rounds the same
    operations in the same order (no fast-math flags: `qdot_ir_cpu._fadd`), so an output's bits
    do not depend on the form or on the other rows of the call (batch invariance,
    tests/test_qdot_invariance.py)."""
    codegen = _dot8_codegen(qtype, wrows, xrows, interleaved)
    if xrows is None:
        @intrinsic
        def block_dot_rows(typingctx, qs, qh, d, m, sc, mn, xq, dx, xsum, qsum, res):
            return types.none(qs, qh, d, m, sc, mn, xq, dx, xsum, qsum, res), codegen
        return block_dot_rows

    @intrinsic
    def block_dot(typingctx, qs, qh, d, m, sc, mn, xq, dx, xsum, qsum):
        out = types.UniTuple(types.float32, wrows * xrows)
        return out(qs, qh, d, m, sc, mn, xq, dx, xsum, qsum), codegen
    return block_dot


def _dot8_codegen(qtype, wrows, xrows, interleaved):
    halves = qtype == "q6_k"
    signed = qtype == "q8_0" and SIGNED  # signed codes (`_dpbusd`)

    def codegen(context, b, sig, args):
        xs = [context.make_array(sig.args[i])(context, b, args[i]) for i in (6, 7, 8, 9)]
        shapes = [cgutils.unpack_tuple(b, a.shape, 2) for a in xs]
        k, groups, _, halfs = (s[1] for s in shapes)
        rows = _row_pointers(context, b, sig, args, wrows, b.udiv(
            groups, ir.Constant(groups.type, BLOCK)) if interleaved else None)  # whole blocks

        def x_row(i):  # the activation fields' pointers at row i
            return [b.gep(a.data, [b.mul(width, i)])
                    for a, width in zip(xs, (k, groups, groups, halfs))]
        zero = ir.Constant(_vec(_F32, 16), [0.0] * 16)
        if xrows is None:
            each_x, finish = row_loop(context, b, sig, args, rows, shapes[0][0], x_row, 10)
            acc_p = ()
        else:
            xp = [x_row(ir.Constant(k.type, i)) for i in range(xrows)]
            pairs = [(p, x) for p in rows for x in xp]
            acc_p = [cgutils.alloca_once_value(b, zero) for _ in pairs]
            finish = None

            def each_x(body):
                body(pairs, acc_p)

        def run(g0, n):  # groups g0 .. g0 + n (n = BLOCK, or 1)
            gw = weight_group(b, g0, interleaved)  # the weight's fields at g0
            scales = {id(p): _scales(qtype, b, p, gw, n) for p in rows}
            codes = {id(p): row_codes(p, g0, gw, n) for p in rows}

            def body(pairs, acc_p):  # the offset terms go into the pairs' accumulators
                lanes = {}
                for (p, (x, dp, sp, hp)), acc in zip(pairs, acc_p):
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
                    b.store(_fadd(b, b.load(acc), _widen(b, term, _LANES)), acc)
                sums_of = lone if n == 1 else pair if n == 2 else block
                sums_of(g0, codes, lanes, pairs, acc_p)
            each_x(body)

        def row_codes(p, g0, gw, n):  # one weight row's codes at g0, and its lines asked for
            if n == 1:
                _prefetch(qtype, b, p, g0)
                c = _ucodes(qtype, b, p, g0)
                return b.shuffle_vector(c, ir.Constant(c.type, [0] * 32), _const(_I32, 64, range(64)))
            if n == 2:  # two groups of a tail, in order
                c = _pair_codes(qtype, b, p, g0)
                _prefetch(qtype, b, p, g0)  # a row's last line is asked for here (K = 576)
                return c
            c = _block_codes(qtype, b, p, gw, QUARTERS[:n // 2])  # a block, or half of one
            for j in range(0, n, 2 if qtype == "q8_0" else 4):
                _prefetch(qtype, b, p, b.add(gw, ir.Constant(g0.type, j)))  # a line each
            return c

        def block(g0, codes, lanes, pairs, acc_p):
            quarters = QUARTERS[:len(codes[id(rows[0])])]
            for (p, (x, dp, sp, hp)), acc in zip(pairs, acc_p):
                at = b.mul(g0, ir.Constant(g0.type, 32))
                xv = [_load(b, x, b.add(at, ir.Constant(at.type, 64 * i)), _I8, 64)
                      for i in range(len(quarters))]
                cw = codes[id(p)]
                if halves:  # each half group its own scale: a vector's sums alone
                    sums = {key: _dpbusd(b, cw[i], xv[i]) for i, key in enumerate(quarters)}
                else:  # a c's two vectors (the same groups) into the same lanes
                    sums = {quarters[i][0]: _dpbusd(b, cw[i], xv[i], signed=signed,
                                                    more=[(cw[i + 1], xv[i + 1])])
                            for i in range(0, len(quarters), 2)}
                total = b.load(acc)
                for key, v in sums.items():
                    c, h = key if halves else (key, 0)
                    mask = ([2 * (4 * c + j // 4) + h for j in range(16)] if halves else
                            [4 * c + j // 4 for j in range(16)])
                    v8 = lanes[id(p), id(x)]
                    scale = b.shuffle_vector(v8, v8, _const(_I32, 16, mask))
                    total = _fma(b, b.sitofp(v, _vec(_F32, 16)), scale, total)
                b.store(total, acc)

        def pair(g, codes, lanes, pairs, acc_p):
            for (p, (x, dp, sp, hp)), acc in zip(pairs, acc_p):
                xv = _load(b, x, b.mul(g, ir.Constant(g.type, 32)), _I8, 64)
                sums = b.sitofp(_dpbusd(b, codes[id(p)], xv, signed=signed), _vec(_F32, 16))
                v = lanes[id(p), id(x)]  # lanes 0-7 group g's, 8-15 g + 1's
                scale = b.shuffle_vector(v, v, _const(_I32, 16, [j // 8 for j in range(16)]))
                b.store(_fma(b, sums, scale, b.load(acc)), acc)

        def lone(g, codes, lanes, pairs, acc_p):
            for (p, (x, dp, sp, hp)), acc in zip(pairs, acc_p):
                xv = _load(b, x, b.mul(g, ir.Constant(g.type, 32)), _I8, 32)
                xv = b.shuffle_vector(xv, ir.Constant(xv.type, [0] * 32),
                                      _const(_I32, 64, range(64)))
                sums = b.sitofp(_dpbusd(b, codes[id(p)], xv, signed=signed), _vec(_F32, 16))
                v = lanes[id(p), id(x)]  # lanes 0-7 the group's (q6_k: 0-3, 4-7 its halves)
                scale = b.shuffle_vector(v, v, _const(
                    _I32, 16, [j // 4 if halves else 0 for j in range(16)]))
                b.store(_fma(b, sums, scale, b.load(acc)), acc)

        return _run_blocks(context, b, sig, groups, run, acc_p,
                           tails=(BLOCK // 2, 2), finish=finish)
    return codegen
