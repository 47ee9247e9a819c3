"""The LLVM vector IR of `rows_attention_cpu.py` (numba intrinsics): a key's dot products
with a chunk of query lanes as `llvm.fma` chains (`_scores_intrinsic`), the per-lane softmax
with its key masks (`_softmax_intrinsic`), the value sums (`_values_intrinsic`), a bf16 cache's
rows widened to fp32 (`_widen_rows`) and prefetch hints (`_prefetch_rows`). Each intrinsic
takes the KV cache as a flat array of fp32 or of bf16 bits (uint16), widened exactly as loaded.

The jitted functions that inline these live in `rows_attention_cpu.py`, whose numba cache
key includes this file (`numba_cache.depend_on`).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .qdot_ir_cpu import _F32, _I32, _call, _load, _splat, _vec

WIDTHS = (8, 16)
"""Lanes a chunk: 8 (a 256-bit vector) where each request's rows have at most 8 query heads a
KV head (a decode token: the 0.5B's 7 fill 7 of 8), else 16. Measured with
`bench/cpu_verify_attention.py` (0.5B shape, 2,048 keys, 2 threads): 1 row 2.60 ms at 8 lanes,
3.36 at 16; 5 rows 9.37 / 8.36; 9 rows 14.08 / 10.96. The lanes' bits do not depend on it."""


def _cache_load(b, sig_arg, base, offset, n=None):
    """n fp32 values (one if n is None) of a KV cache array at base + offset: fp32 as
    stored, bf16 (uint16 bits) widened exactly."""
    if sig_arg.dtype != types.uint16:
        return _load(b, base, offset, _F32, n)
    raw = _load(b, base, offset, ir.IntType(16), n)
    wide = b.zext(raw, _I32 if n is None else _vec(_I32, n))
    shift = ir.Constant(_I32, 16) if n is None else _splat(b, ir.Constant(_I32, 16), n)
    return b.bitcast(b.shl(wide, shift), _F32 if n is None else _vec(_F32, n))


def _arrays(context, b, sig, args, *which):
    """The array structs of an intrinsic's arguments `which` (data pointer, shape)."""
    return [context.make_array(sig.args[i])(context, b, args[i]) for i in which]


def _scores_intrinsic(W: int):
    """s[t0 + i, :] = scale * (qT^T . key i) for the `n` keys (8 or 1) at kv[base + i * stride
    .. + D], qT fp32 [D, W]: per key one accumulator <W x float>, fma(qT[j], key[j], acc) for
    j = 0 .. D - 1 in order (the same chain whatever n or W is; eight keys are independent
    chains)."""
    @intrinsic
    def scores(typingctx, qT, kv, base, stride, scale, s, t0, n):
        def codegen(context, b, sig, args):
            q, flat, out = _arrays(context, b, sig, args, 0, 1, 5)
            at, step, sc, row = args[2], args[3], args[4], args[6]
            d = cgutils.unpack_tuple(b, q.shape, 2)[0]
            vt = _vec(_F32, W)

            def emit(keys):
                accs = [cgutils.alloca_once_value(b, ir.Constant(vt, [0.0] * W))
                        for _ in range(keys)]
                with cgutils.for_range(b, d) as loop:
                    j = loop.index
                    qv = _load(b, q.data, b.mul(j, ir.Constant(j.type, W)), _F32, W)
                    for i, acc in enumerate(accs):
                        off = b.add(b.add(at, b.mul(step, ir.Constant(step.type, i))), j)
                        k = _splat(b, _cache_load(b, sig.args[1], flat.data, off), W)
                        b.store(_call(b, "llvm.fma.v%df32" % W, vt, qv, k, b.load(acc)), acc)
                scale_v = _splat(b, sc, W)
                for i, acc in enumerate(accs):
                    r = b.mul(b.add(row, ir.Constant(row.type, i)), ir.Constant(row.type, W))
                    ptr = b.bitcast(b.gep(out.data, [r]), vt.as_pointer())
                    b.store(b.fmul(b.load(acc), scale_v), ptr, align=4)
            _eight_or_one(b, args[7], emit)
            return context.get_dummy_value()
        return types.void(qT, kv, base, stride, scale, s, t0, n), codegen
    return scores


def _eight_or_one(b, n, emit):
    """emit(8) where n == 8, else emit(1) (one key or value a call)."""
    with b.if_else(b.icmp_signed("==", n, ir.Constant(n.type, 8))) as (eight, one):
        with eight:
            emit(8)
        with one:
            emit(1)


_I64 = ir.IntType(64)
V = 16
"""Floats a vector of the value sums (over the head dimension)."""
_LOG2E, _LN2 = 1.4426950408889634, 0.6931471805599453
_EXP_POLY = (0.0013888889, 0.008333334, 0.041666668, 0.16666667, 0.5, 1.0, 1.0)


def _exp_vec(b, x):
    """e^x lane by lane for x <= 0, as `decode_cpu._exp` computes it (2^n 2^f, the Taylor
    polynomial of 2^f = e^(f ln 2) to degree 6, fma by fma; below -87, ~0): 2^n from its
    exponent bits (n >= -126)."""
    vt = x.type
    n_lanes = vt.count
    lo = _splat(b, ir.Constant(_F32, -87.0), n_lanes)
    y = b.fmul(b.select(b.fcmp_ordered(">", x, lo), x, lo),
               _splat(b, ir.Constant(_F32, _LOG2E), n_lanes))
    n = _call(b, "llvm.floor.v%df32" % n_lanes, vt,
              b.fadd(y, _splat(b, ir.Constant(_F32, 0.5), n_lanes)))
    f = b.fmul(b.fsub(y, n), _splat(b, ir.Constant(_F32, _LN2), n_lanes))
    p = _splat(b, ir.Constant(_F32, _EXP_POLY[0]), n_lanes)
    for c in _EXP_POLY[1:]:
        p = _call(b, "llvm.fma.v%df32" % n_lanes, vt, p, f,
                  _splat(b, ir.Constant(_F32, c), n_lanes))
    i32 = _vec(ir.IntType(32), n_lanes)
    bits = b.shl(b.add(b.fptosi(n, i32), _splat(b, ir.Constant(ir.IntType(32), 127), n_lanes)),
                 _splat(b, ir.Constant(ir.IntType(32), 23), n_lanes))
    return b.fmul(p, b.bitcast(bits, vt))


def _sees_vec(b, t, first, n_lane, words, W, lo, hi):
    """<W x i1>: which lanes see key t in the item of keys lo .. hi - 1: those whose row sees
    t keys or more (n_lane), where t >= first (the step's rows) only the rows their words
    name (bit t - first; from 64 on, all), and whose ordinal of t is in [lo, hi): t itself
    below first, else first + the lane's ancestors before t (a tree row's path as the decode
    of its path, once committed, holds it: at consecutive indices; a chain row's is t)."""
    ts = _splat(b, t, W)
    j = b.sub(ts, _splat(b, first, W))
    zero = _splat(b, ir.Constant(_I64, 0), W)
    shared = b.icmp_signed("<", j, zero)
    far = b.icmp_signed(">=", j, _splat(b, ir.Constant(_I64, 64), W))
    plain = b.or_(shared, far)
    jc = b.select(plain, zero, j)
    bit = b.trunc(b.lshr(words, jc), _vec(ir.IntType(1), W))
    one = _splat(b, ir.Constant(_I64, 1), W)
    before = b.and_(words, b.sub(b.shl(one, jc), one))
    vt = _vec(_I64, W)
    ordinal = b.select(plain, ts, b.add(_splat(b, first, W),
                                        _call(b, "llvm.ctpop.v%di64" % W, vt, before)))
    inside = b.and_(b.icmp_signed(">=", ordinal, _splat(b, lo, W)),
                    b.icmp_signed("<", ordinal, _splat(b, hi, W)))
    return b.and_(b.and_(b.icmp_signed("<", ts, n_lane), b.or_(plain, bit)), inside)


def _softmax_intrinsic(W: int):
    @intrinsic
    def softmax(typingctx, s, lo, hi, count, first, n_lane, words, top, tot):
        """Per lane of s [>= count, W] (the scores of keys lo .. lo + count), the keys it
        sees in the item of keys lo .. hi - 1 (`_sees_vec`): top = the max of their scores
        (-inf: none), s = e^(score - top) where it sees the key and 0 where not, tot = their
        sum in key order."""
        def codegen(context, b, sig, args):
            sa, nl, wd, tp, tt = _arrays(context, b, sig, args, 0, 5, 6, 7, 8)
            start, end, count, first_ = args[1], args[2], args[3], args[4]
            vt = _vec(_F32, W)
            nlv = _load(b, nl.data, ir.Constant(_I64, 0), _I64, W)
            wdv = _load(b, wd.data, ir.Constant(_I64, 0), _I64, W)
            best = cgutils.alloca_once_value(b, _splat(b, ir.Constant(_F32, float("-inf")), W))
            with cgutils.for_range(b, count) as loop:
                t = b.add(start, loop.index)
                sv = _load(b, sa.data, b.mul(loop.index, ir.Constant(_I64, W)), _F32, W)
                cur = b.load(best)
                up = b.and_(_sees_vec(b, t, first_, nlv, wdv, W, start, end), b.fcmp_ordered(">", sv, cur))
                b.store(b.select(up, sv, cur), best)
            top_v = b.load(best)
            total = cgutils.alloca_once_value(b, ir.Constant(vt, [0.0] * W))
            with cgutils.for_range(b, count) as loop:
                t = b.add(start, loop.index)
                at = b.mul(loop.index, ir.Constant(_I64, W))
                sv = _load(b, sa.data, at, _F32, W)
                ok = _sees_vec(b, t, first_, nlv, wdv, W, start, end)
                x = b.select(ok, b.fsub(sv, top_v), _splat(b, ir.Constant(_F32, -100.0), W))
                e = b.select(ok, _exp_vec(b, x), ir.Constant(vt, [0.0] * W))
                b.store(e, b.bitcast(b.gep(sa.data, [at]), vt.as_pointer()), align=4)
                b.store(b.fadd(b.load(total), e), total)
            b.store(top_v, b.bitcast(tp.data, vt.as_pointer()), align=4)
            b.store(b.load(total), b.bitcast(tt.data, vt.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(s, lo, hi, count, first, n_lane, words, top, tot), codegen
    return softmax


def _values_intrinsic(W: int):
    """acc[w, :] += s[t0 + i, w] * value i for the `n` values (8 or 1) at kv[base + i *
    stride .. + D], i in order, each an fma per element (vectors of `V`, then one by one), for
    the lanes w < live (the rest are a chunk's padding)."""
    @intrinsic
    def values(typingctx, acc, kv, base, stride, s, t0, live, n):
        def codegen(context, b, sig, args):
            arrays = _arrays(context, b, sig, args, 0, 1, 4)

            def emit(keys):
                for w in range(W):
                    with b.if_then(b.icmp_signed("<", ir.Constant(_I64, w), args[6])):
                        _value_lane(b, sig, args, arrays, keys, w, W)
            _eight_or_one(b, args[7], emit)
            return context.get_dummy_value()
        return types.void(acc, kv, base, stride, s, t0, live, n), codegen
    return values


def _value_lane(b, sig, args, arrays, keys, w, W):
    """Lane w's row of acc += its `keys` weights times the values, key by key (`values`'
    arguments)."""
    ac, flat, sa = arrays
    at, step, row = args[2], args[3], args[5]
    d = cgutils.unpack_tuple(b, ac.shape, 2)[1]
    vt = _vec(_F32, V)
    chunks = b.udiv(d, ir.Constant(_I64, V))
    es = [_load(b, sa.data, b.add(b.mul(b.add(row, ir.Constant(_I64, i)), ir.Constant(_I64, W)),
                                  ir.Constant(_I64, w)), _F32) for i in range(keys)]
    ev = [_splat(b, e, V) for e in es]
    acc_row = b.mul(ir.Constant(_I64, w), d)
    with cgutils.for_range(b, chunks) as loop:
        j = b.mul(loop.index, ir.Constant(_I64, V))
        r = _load(b, ac.data, b.add(acc_row, j), _F32, V)
        for i in range(keys):
            off = b.add(b.add(at, b.mul(step, ir.Constant(_I64, i))), j)
            r = _call(b, "llvm.fma.v%df32" % V, vt, ev[i],
                      _cache_load(b, sig.args[1], flat.data, off, V), r)
        b.store(r, b.bitcast(b.gep(ac.data, [b.add(acc_row, j)]), vt.as_pointer()), align=4)
    with cgutils.for_range(b, d, start=b.mul(chunks, ir.Constant(_I64, V))) as loop:
        j = loop.index
        r = _load(b, ac.data, b.add(acc_row, j), _F32)
        for i in range(keys):
            off = b.add(b.add(at, b.mul(step, ir.Constant(_I64, i))), j)
            r = _call(b, "llvm.fma.f32", _F32, es[i], _cache_load(b, sig.args[1], flat.data, off),
                      r)
        b.store(r, b.gep(ac.data, [b.add(acc_row, j)]))


@intrinsic
def _prefetch_rows(typingctx, kv, base, stride, rows, width):
    """Prefetch hints for `rows` rows of `width` floats at kv[base + i * stride] (never
    faults)."""
    def codegen(context, b, sig, args):
        flat = context.make_array(sig.args[0])(context, b, args[0])
        at, step, n, w = args[1], args[2], args[3], args[4]
        lines = b.udiv(b.add(w, ir.Constant(_I64, 15)), ir.Constant(_I64, 16))
        with cgutils.for_range(b, n) as rloop:
            row = b.add(at, b.mul(rloop.index, step))
            with cgutils.for_range(b, lines) as lloop:
                ptr = b.gep(flat.data, [b.add(row, b.mul(lloop.index, ir.Constant(_I64, 16)))])
                _call(b, "llvm.prefetch.p0", ir.VoidType(), ptr, ir.Constant(_I32, 0),
                      ir.Constant(_I32, 3), ir.Constant(_I32, 1))
        return context.get_dummy_value()
    return types.void(kv, base, stride, rows, width), codegen


@intrinsic
def _widen_rows(typingctx, kv, base, stride, rows, out):
    """out[i, :] = the fp32 values of kv[base + i * stride .. + D] for i < rows (out fp32
    [>= rows, D]; a bf16 cache's rows widened `V` at a time, then one by one)."""
    def codegen(context, b, sig, args):
        flat, dst = _arrays(context, b, sig, args, 0, 4)
        at, step, n = args[1], args[2], args[3]
        d = cgutils.unpack_tuple(b, dst.shape, 2)[1]
        chunks = b.udiv(d, ir.Constant(_I64, V))
        vt = _vec(_F32, V)
        with cgutils.for_range(b, n) as rloop:
            src = b.add(at, b.mul(rloop.index, step))
            row = b.mul(rloop.index, d)
            with cgutils.for_range(b, chunks) as loop:
                j = b.mul(loop.index, ir.Constant(_I64, V))
                v = _cache_load(b, sig.args[0], flat.data, b.add(src, j), V)
                ptr = b.bitcast(b.gep(dst.data, [b.add(row, j)]), vt.as_pointer())
                b.store(v, ptr, align=4)
            with cgutils.for_range(b, d, start=b.mul(chunks, ir.Constant(_I64, V))) as loop:
                j = loop.index
                b.store(_cache_load(b, sig.args[0], flat.data, b.add(src, j)),
                        b.gep(dst.data, [b.add(row, j)]))
        return context.get_dummy_value()
    return types.void(kv, base, stride, rows, out), codegen


_scores_8, _scores_16 = (_scores_intrinsic(w) for w in WIDTHS)
_values_8, _values_16 = (_values_intrinsic(w) for w in WIDTHS)
_softmax_8, _softmax_16 = (_softmax_intrinsic(w) for w in WIDTHS)
