"""Attention of the CPU decode path (luceio/models/cpu_decode.py) by query lanes: every query
head of every row a request has in the step (a decode token, or a verify step's chain or tree
rows) against each key of the request's cache, read once for all of them.

`decode_cpu.decode_attention` takes a row at a time: a verify step's k + 1 rows read the
context k + 1 times, and each (query head, key) dot product ends in a horizontal sum of a
vector over the head's dimensions. Here the query heads that share a KV head, across all of a
request's rows, are lanes of a vector (`WIDTHS`: 8 or 16 of them a chunk): a key's dot products with a chunk's
lanes are one chain of vector FMAs over the head's dimensions (the query transposed, the key's
elements broadcast; LLVM IR in `_scores_intrinsic`, 8 keys a call as independent chains), then
the softmax and the weighted sum of values run lane by lane, vectorised over the lanes or the
head dimension (a chunk's padding lanes skip the value sums).

Each lane's arithmetic is a fixed sequence over its own keys in cache order: the scores are
explicit `llvm.fma` chains over the dimensions in order, the softmax's max, exponentials and sum
and the value sums are per-lane sequences with no reassociation (`fastmath` is `contract`
only), and keys a lane does not see (a later row's, a tree's other branches) add exact zeros.
So a row's result depends only on the keys it sees: a verify row equals, bit for bit, the
decode step of the same position (tests/test_rows_attention_cpu.py), whatever the number of rows,
requests or threads, where that step takes this kernel too (`DECODE_MAX_HEAD_DIM`). Work items
(request, KV head, chunk of lanes) run on numba's threads.

No sliding windows (Gemma's step keeps `decode_cpu`), no tree span. numba's on-disk cache of
these functions is invalidated by changes to this file only: after editing `decode_cpu.py`
(`_rope_write`, `_store`) or `qdot_ir_cpu.py`, touch this file.
"""
from __future__ import annotations

import numpy as np

from .decode_cpu import _rope_write, _store, numba

WIDTHS = (8, 16)
"""Lanes a chunk: 8 (a 256-bit vector) where each request's rows have at most 8 query heads a
KV head (a decode token: the 0.5B's 7 fill 7 of 8), else 16. Measured with
`bench/cpu_verify_attention.py` (0.5B shape, 2,048 keys, 2 threads): 1 row 2.60 ms at 8 lanes,
3.36 at 16; 5 rows 9.37 / 8.36; 9 rows 14.08 / 10.96. The lanes' bits do not depend on it."""

DECODE_MAX_HEAD_DIM = 64
"""Steps that only decode (one row a request) over `decode_cpu._MIN_KEYS` keys or more with
wider heads take `decode_cpu`'s split kernel (`models/cpu_decode.py`): at head dim 128 one
decode row fills 6 of 8 lanes (the 1.5B) and the old kernel's horizontal sums cost relatively
less. Measured, real Qwen2.5-Coder-1.5B, one request, 2 threads, this kernel against the split
one (`bench/cpu_long_decode.py`): 0.98x / 0.96x at 8K keys, 0.99x at 2K; the 0.5B (heads of
64) 1.11x / 1.16x at 8K."""

PREFETCH_BLOCKS = 2
"""How far ahead (cache blocks) the keys' and values' rows are asked for."""

if numba is not None:
    from llvmlite import ir
    from numba import prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from .qdot_ir_cpu import _F32, _I32, _call, _load, _splat, _vec

    def _cache_load(b, sig_arg, base, offset, n=None):
        """n fp32 values (one if n is None) of a KV cache array at base + offset: fp32 as
        stored, bf16 (uint16 bits) widened exactly."""
        if sig_arg.dtype != types.uint16:
            return _load(b, base, offset, _F32, n)
        raw = _load(b, base, offset, ir.IntType(16), n)
        wide = b.zext(raw, _I32 if n is None else _vec(_I32, n))
        shift = ir.Constant(_I32, 16) if n is None else _splat(b, ir.Constant(_I32, 16), n)
        return b.bitcast(b.shl(wide, shift), _F32 if n is None else _vec(_F32, n))

    def _scores_intrinsic(keys: int, W: int):
        """s[t0 + i, :] = scale * (qT^T . key i) for `keys` keys at kv[base + i * stride ..
        + D], qT fp32 [D, W]: per key one accumulator <W x float>, fma(qT[j], key[j], acc) for
        j = 0 .. D - 1 in order (the same chain whatever `keys` or W is)."""
        @intrinsic
        def scores(typingctx, qT, kv, base, stride, scale, s, t0):
            def codegen(context, b, sig, args):
                q = context.make_array(sig.args[0])(context, b, args[0])
                flat = context.make_array(sig.args[1])(context, b, args[1])
                out = context.make_array(sig.args[5])(context, b, args[5])
                at, step, sc, row = args[2], args[3], args[4], args[6]
                d = cgutils.unpack_tuple(b, q.shape, 2)[0]
                vt = _vec(_F32, W)
                fma = cgutils.get_or_insert_function(
                    b.module, ir.FunctionType(vt, [vt, vt, vt]), "llvm.fma.v%df32" % W)
                accs = [cgutils.alloca_once_value(b, ir.Constant(vt, [0.0] * W))
                        for _ in range(keys)]
                with cgutils.for_range(b, d) as loop:
                    j = loop.index
                    qv = _load(b, q.data, b.mul(j, ir.Constant(j.type, W)), _F32, W)
                    for i, acc in enumerate(accs):
                        off = b.add(b.add(at, b.mul(step, ir.Constant(step.type, i))), j)
                        k = _splat(b, _cache_load(b, sig.args[1], flat.data, off), W)
                        b.store(b.call(fma, [qv, k, b.load(acc)]), acc)
                scale_v = _splat(b, sc, W)
                for i, acc in enumerate(accs):
                    r = b.mul(b.add(row, ir.Constant(row.type, i)), ir.Constant(row.type, W))
                    ptr = b.bitcast(b.gep(out.data, [r]), vt.as_pointer())
                    b.store(b.fmul(b.load(acc), scale_v), ptr, align=4)
                return context.get_dummy_value()
            return types.void(qT, kv, base, stride, scale, s, t0), codegen
        return scores

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

    def _sees_vec(b, t, first, n_lane, words, W):
        """<W x i1>: which lanes see key t: those whose row sees t keys or more (n_lane), where
        t >= first (the step's rows) only the rows their words name (bit t - first; from 64
        on, all)."""
        ts = _splat(b, t, W)
        j = b.sub(ts, _splat(b, first, W))
        zero = _splat(b, ir.Constant(_I64, 0), W)
        shared = b.icmp_signed("<", j, zero)
        far = b.icmp_signed(">=", j, _splat(b, ir.Constant(_I64, 64), W))
        jc = b.select(b.or_(shared, far), zero, j)
        bit = b.trunc(b.lshr(words, jc), _vec(ir.IntType(1), W))
        return b.and_(b.icmp_signed("<", ts, n_lane), b.or_(b.or_(shared, far), bit))

    def _softmax_intrinsic(W: int):
        @intrinsic
        def softmax(typingctx, s, nmax, first, n_lane, words, top, tot):
            """Per lane of s [>= nmax, W] (the scores): top = the max of the scores it sees, s =
            e^(score - top) where it sees the key and 0 where not, tot = their sum in key order."""
            def codegen(context, b, sig, args):
                sa = context.make_array(sig.args[0])(context, b, args[0])
                nl, wd, tp, tt = (context.make_array(sig.args[i])(context, b, args[i])
                                  for i in (3, 4, 5, 6))
                count, first_ = args[1], args[2]
                vt = _vec(_F32, W)
                nlv = _load(b, nl.data, ir.Constant(_I64, 0), _I64, W)
                wdv = _load(b, wd.data, ir.Constant(_I64, 0), _I64, W)
                best = cgutils.alloca_once_value(b, _splat(b, ir.Constant(_F32, float("-inf")), W))
                with cgutils.for_range(b, count) as loop:
                    t = loop.index
                    sv = _load(b, sa.data, b.mul(t, ir.Constant(_I64, W)), _F32, W)
                    cur = b.load(best)
                    up = b.and_(_sees_vec(b, t, first_, nlv, wdv, W), b.fcmp_ordered(">", sv, cur))
                    b.store(b.select(up, sv, cur), best)
                top_v = b.load(best)
                total = cgutils.alloca_once_value(b, ir.Constant(vt, [0.0] * W))
                with cgutils.for_range(b, count) as loop:
                    t = loop.index
                    at = b.mul(t, ir.Constant(_I64, W))
                    sv = _load(b, sa.data, at, _F32, W)
                    ok = _sees_vec(b, t, first_, nlv, wdv, W)
                    x = b.select(ok, b.fsub(sv, top_v), _splat(b, ir.Constant(_F32, -100.0), W))
                    e = b.select(ok, _exp_vec(b, x), ir.Constant(vt, [0.0] * W))
                    b.store(e, b.bitcast(b.gep(sa.data, [at]), vt.as_pointer()), align=4)
                    b.store(b.fadd(b.load(total), e), total)
                b.store(top_v, b.bitcast(tp.data, vt.as_pointer()), align=4)
                b.store(b.load(total), b.bitcast(tt.data, vt.as_pointer()), align=4)
                return context.get_dummy_value()
            return types.void(s, nmax, first, n_lane, words, top, tot), codegen
        return softmax

    def _values_intrinsic(keys: int, W: int):
        """acc[w, :] += s[t0 + i, w] * value i for the `keys` values at kv[base + i * stride
        .. + D], i in order, each an fma per element (vectors of `V`, then one by one), for
        the lanes w < live (the rest are a chunk's padding)."""
        @intrinsic
        def values(typingctx, acc, kv, base, stride, s, t0, live):
            def codegen(context, b, sig, args):
                ac = context.make_array(sig.args[0])(context, b, args[0])
                flat = context.make_array(sig.args[1])(context, b, args[1])
                sa = context.make_array(sig.args[4])(context, b, args[4])
                at, step, row, live = args[2], args[3], args[5], args[6]
                d = cgutils.unpack_tuple(b, ac.shape, 2)[1]
                vt = _vec(_F32, V)
                chunks = b.udiv(d, ir.Constant(_I64, V))
                for w in range(W):
                    live_w = b.icmp_signed("<", ir.Constant(_I64, w), live)
                    with b.if_then(live_w):
                        es = [_load(b, sa.data, b.add(b.mul(b.add(row, ir.Constant(_I64, i)),
                                                            ir.Constant(_I64, W)),
                                                      ir.Constant(_I64, w)), _F32)
                              for i in range(keys)]
                        ev = [_splat(b, e, V) for e in es]
                        acc_row = b.mul(ir.Constant(_I64, w), d)
                        with cgutils.for_range(b, chunks) as loop:
                            j = b.mul(loop.index, ir.Constant(_I64, V))
                            r = _load(b, ac.data, b.add(acc_row, j), _F32, V)
                            for i in range(keys):
                                off = b.add(b.add(at, b.mul(step, ir.Constant(_I64, i))), j)
                                r = _call(b, "llvm.fma.v%df32" % V, vt, ev[i],
                                          _cache_load(b, sig.args[1], flat.data, off, V), r)
                            ptr = b.gep(ac.data, [b.add(acc_row, j)])
                            b.store(r, b.bitcast(ptr, vt.as_pointer()), align=4)
                        with cgutils.for_range(b, d, start=b.mul(chunks, ir.Constant(_I64, V))) as loop:
                            j = loop.index
                            r = _load(b, ac.data, b.add(acc_row, j), _F32)
                            for i in range(keys):
                                off = b.add(b.add(at, b.mul(step, ir.Constant(_I64, i))), j)
                                r = _call(b, "llvm.fma.f32", _F32, es[i],
                                          _cache_load(b, sig.args[1], flat.data, off), r)
                            b.store(r, b.gep(ac.data, [b.add(acc_row, j)]))
                return context.get_dummy_value()
            return types.void(acc, kv, base, stride, s, t0, live), codegen
        return values

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
            flat = context.make_array(sig.args[0])(context, b, args[0])
            dst = context.make_array(sig.args[4])(context, b, args[4])
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

    _scores8_8, _scores1_8, _scores8_16, _scores1_16 = (
        _scores_intrinsic(k, w) for w in WIDTHS for k in (8, 1))
    _values8_8, _values1_8, _values8_16, _values1_16 = (
        _values_intrinsic(k, w) for w in WIDTHS for k in (8, 1))
    _softmax_8, _softmax_16 = (_softmax_intrinsic(w) for w in WIDTHS)
    _njit = numba.njit(cache=True, nogil=True, fastmath={"contract"})
    _njit_inline = numba.njit(cache=True, nogil=True, fastmath={"contract"}, inline="always")
    _njit_parallel = numba.njit(cache=True, nogil=True, fastmath={"contract"}, parallel=True)
else:  # no numba: the CPU decode path is off
    def _njit(fn):
        return fn
    _njit_parallel = _njit_inline = _njit
    prange = range


@_njit_inline
def _scores_block(qT, keys, at, step, scale, s, row, eight, wide):
    """`_scores_intrinsic` for eight keys or one, W = 16 (`wide`) or 8."""
    if wide:
        if eight:
            _scores8_16(qT, keys, at, step, scale, s, row)
        else:
            _scores1_16(qT, keys, at, step, scale, s, row)
    elif eight:
        _scores8_8(qT, keys, at, step, scale, s, row)
    else:
        _scores1_8(qT, keys, at, step, scale, s, row)


@_njit
def _lanes(qT, kv, flat, table, h, first, n_lane, words, nmax, scale, s, top, tot, acc):
    """One work item: the W lanes of qT [D, W] (W: 8 or 16; KV head h) over the keys 0 ..
    nmax - 1 of the request's cache (`table`), keys below `first` seen by every lane, from
    `first` on those of its row (n_lane: the keys up to and including its own; words: bit j,
    the row at first + j, from 64 on all; `_sees_vec`). Leaves per lane the softmax's sum in
    `tot` and the unnormalised output in `acc` [W, D]; `s` [>= nmax, W] is scratch."""
    bs, kvh, d = kv.shape[2], kv.shape[3], kv.shape[4]
    wide = qT.shape[1] == 16
    bf16 = flat.itemsize == 2  # a bf16 cache: a block's keys widened to fp32 rows first
    kb = np.empty((bs if bf16 else 0, d), np.float32)
    kb_flat = kb.reshape(-1)
    live = np.int64(0)  # lanes past the last real one are padding: no value sums
    for w in range(qT.shape[1]):
        if n_lane[w] > 0:
            live = np.int64(w + 1)
    step = kvh * d
    for part in range(2):  # the scores (K, kv[0]), then the values (V, kv[1])
        t = 0
        while t < nmax:
            blk, off = table[t // bs], t % bs
            n = min(bs - off, nmax - t)
            base = ((np.int64(part) * kv.shape[1] + blk) * bs + off) * step + h * d
            ahead = t + PREFETCH_BLOCKS * bs
            if PREFETCH_BLOCKS and ahead < nmax:
                nxt = ((np.int64(part) * kv.shape[1] + table[ahead // bs]) * bs) * step + h * d
                _prefetch_rows(flat, nxt, np.int64(step), np.int64(bs), np.int64(d))
            if part == 0 and bf16:
                _widen_rows(flat, base, np.int64(step), np.int64(n), kb)
            i = 0
            while i < n:
                at, row = base + i * step, np.int64(t + i)
                eight = i + 8 <= n  # eight keys a call: independent chains, each value
                # pass over a lane's row adds eight (in key order)
                if part == 0 and bf16:
                    _scores_block(qT, kb_flat, np.int64(i * d), np.int64(d), scale, s, row,
                                  eight, wide)
                elif part == 0:
                    _scores_block(qT, flat, at, step, scale, s, row, eight, wide)
                elif wide:
                    if eight:
                        _values8_16(acc, flat, at, step, s, row, live)
                    else:
                        _values1_16(acc, flat, at, step, s, row, live)
                elif eight:
                    _values8_8(acc, flat, at, step, s, row, live)
                else:
                    _values1_8(acc, flat, at, step, s, row, live)
                i += 8 if eight else 1
            t += n
        if part == 0:
            if wide:
                _softmax_16(s, nmax, first, n_lane, words, top, tot)
            else:
                _softmax_8(s, nmax, first, n_lane, words, top, tot)
            acc[:] = 0


@_njit_parallel
def _run_items(qT, kv, flat, tables, items, firsts, n_lane, words, nmax, scale, s, top, tot,
               acc):
    """Every work item (items[i] = (request, KV head, first row, first lane)) on numba's
    threads."""
    for i in prange(items.shape[0]):
        req, h = items[i, 0], items[i, 1]
        _lanes(qT[i], kv, flat, tables[req], h, firsts[req], n_lane[i], words[i], nmax[i],
               scale, s[i], top[i], tot[i], acc[i])


@_njit
def _plan(row_starts, seq_lens, words_in, group, kvh, W):
    """(items [I, 4]: request, KV head, first row, first lane; per item its lanes' key counts
    and words [I, W] (padding lanes: 0 keys) and the most keys it reads)."""
    reqs = row_starts.shape[0] - 1
    count = 0
    for r in range(reqs):
        lanes = (row_starts[r + 1] - row_starts[r]) * group
        count += kvh * ((lanes + W - 1) // W)
    items = np.empty((count, 4), np.int64)
    n_lane = np.zeros((count, W), np.int64)
    words = np.zeros((count, W), np.int64)
    nmax = np.zeros(count, np.int64)
    i = 0
    for r in range(reqs):
        row0 = row_starts[r]
        lanes = (row_starts[r + 1] - row0) * group
        for h in range(kvh):
            for c0 in range(0, lanes, W):
                items[i, 0], items[i, 1], items[i, 2], items[i, 3] = r, h, row0, c0
                for w in range(min(W, lanes - c0)):
                    row = row0 + (c0 + w) // group
                    n_lane[i, w] = seq_lens[row]
                    words[i, w] = words_in[row]
                    nmax[i] = max(nmax[i], seq_lens[row])
                i += 1
    return items, n_lane, words, nmax


@_njit
def _queries(qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, items,
             n_lane, q_rows, qT):
    """Every row's q (normalised per head where q_norm is given, rotated) into q_rows [rows,
    H, D], its K and V written to the cache; then each item's lanes transposed into qT [I, D,
    W] (padding lanes 0)."""
    W = qT.shape[2]
    for b in range(qkv.shape[0]):
        _rope_write(b, qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps,
                    q_rows[b])
    group = num_heads // kv.shape[3]
    qT[:] = 0
    for i in range(items.shape[0]):
        h, row0, c0 = items[i, 1], items[i, 2], items[i, 3]
        for w in range(W):
            if n_lane[i, w] == 0:
                continue
            lane = c0 + w
            row, head = row0 + lane // group, h * group + lane % group
            for j in range(kv.shape[4]):
                qT[i, j, w] = q_rows[row, head, j]


@_njit
def _write_out(items, tot, acc, n_lane, num_heads, kvh, out):
    """out[row, head * D ..] = a lane's output over its softmax sum."""
    group = num_heads // kvh
    W, d = acc.shape[1], acc.shape[2]
    for i in range(items.shape[0]):
        h, row0, c0 = items[i, 1], items[i, 2], items[i, 3]
        for w in range(W):
            if n_lane[i, w] == 0:
                continue
            lane = c0 + w
            row, head = row0 + lane // group, h * group + lane % group
            for j in range(d):
                _store(out, row, head * d + j, acc[i, w, j] / tot[i, w])


@_njit
def _attend(qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, out, scale,
            items, n_lane, words, nmax, tables, firsts, q_rows, qT, s, top, tot, acc):
    _queries(qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, items, n_lane,
             q_rows, qT)
    _run_items(qT, kv, kv.reshape(-1), tables, items, firsts, n_lane, words, nmax,
               np.float32(scale), s, top, tot, acc)
    _write_out(items, tot, acc, n_lane, num_heads, kv.shape[3], out)


class RowsAttention:
    """One step's plan: its requests' rows as work items (`_plan`) and the scratch buffers;
    called once per layer. `row_starts` [requests + 1]: each request's first row (its rows
    are consecutive, in order); per row: `seq_lens` (the keys it sees up to and including its
    own), `words` (-1, or a tree row's ancestors among the step's rows, `tree_cpu`'s rule),
    `block_tables` (its request's)."""

    def __init__(self, row_starts, seq_lens, words, block_tables, num_heads: int, kvh: int,
                 head_dim: int):
        row_starts = row_starts.astype(np.int64)
        seq_lens = seq_lens.astype(np.int64)
        self.num_heads = num_heads
        group = num_heads // kvh
        lanes = int(np.diff(row_starts).max()) * group
        W = WIDTHS[0] if lanes <= WIDTHS[0] else WIDTHS[1]
        self.items, self.n_lane, self.words, self.nmax = _plan(
            row_starts, seq_lens, words.astype(np.int64), group, kvh, W)
        firsts = row_starts[:-1]
        self.tables = np.ascontiguousarray(block_tables[firsts])
        self.firsts = seq_lens[firsts] - 1
        count, longest = len(self.items), int(self.nmax.max())
        self.q_rows = np.empty((len(seq_lens), num_heads, head_dim), np.float32)
        self.qT = np.empty((count, head_dim, W), np.float32)
        self.s = np.empty((count, longest, W), np.float32)
        self.top = np.empty((count, W), np.float32)
        self.tot = np.empty((count, W), np.float32)
        self.acc = np.empty((count, W, head_dim), np.float32)

    @property
    def work_items(self) -> int:
        return len(self.items)

    def __call__(self, qkv, cos_sin, positions, kv, slots, q_norm, k_norm, eps, out, scale):
        """`decode_cpu.decode_attention`'s work for every row: q/k norm, rotary, K and V
        written at `slots`, attention, out [rows, H D]."""
        _attend(qkv, cos_sin, positions, kv, slots, self.num_heads, q_norm, k_norm, eps, out,
                scale, self.items, self.n_lane, self.words, self.nmax, self.tables,
                self.firsts, self.q_rows, self.qT, self.s, self.top, self.tot, self.acc)
