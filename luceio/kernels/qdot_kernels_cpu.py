"""The kernels of qdot_cpu.py (its docstring says what they compute and why) with int16
activations, and the dequantization: numba intrinsics over the LLVM vector IR of
qdot_ir_cpu.py, and the numba loops around them (qdot8_kernels_cpu.py: the int8 ones).

`dot_intrinsic(qtype, wrows, xrows)`: blocks of `wrows` weight rows times `xrows` activation
rows (`None`: all of them, up to `XN_MAX`, with the codes decoded once; session 32: at 3 / 5 /
8 rows the Qwen2.5-Coder-1.5B's decode-step matrices 1.23x / 1.41x / 1.42x faster than two
rows a call, the 0.5B's 1.28x / 1.62x / 1.66x; `cpu_kernels_ab_session32_rows_int16.json`);
`dequant_intrinsic(qtype)`: one weight row to fp32 or bf16 bits. `matvec_kernel` and
`dequant_kernel` run them over all rows on numba's threads. numba's on-disk cache of these
is keyed on this file and qdot_ir_cpu.py (`numba_cache.depend_on`, at the end).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .numba_cache import depend_on
from .qdot_ir_cpu import (_F32, _I16, _I32, BLOCK, KINDS, _codes, _const, _fadd, _fma, _fmul,
                          _lane, XN_MAX, _load, _pair_sums, _prefetch, _row_pointers, _run_blocks, _scales,
                          _to_bf16, _vec, _widen, row_loop, weight_group)


@njit(nogil=True)
def task_rows(n_rows, tasks):
    """Weight rows per parallel iteration of the matvec kernels: `tasks` iterations (qdot_cpu.py
    asks for `TASKS_PER_THREAD` per thread) of whole blocks of 4 rows. qdot_cpu.py has numba
    hand them out one at a time as threads free up (its default splits them evenly up front:
    when another process holds one of the two cores, the free thread then waits for the
    other's half). A few long runs of rows stream from DRAM faster than many short ones: the
    1.5B's decode matrices (int8, 2 threads) at 8 tasks 35.2 GB/s, at 64-row tasks 33.4."""
    return max(1, -(-n_rows // (4 * max(1, tasks)))) * 4


def dot_intrinsic(qtype, wrows, xrows, interleaved=False):
    """sum_k w[r, k] x[i, k] for the `wrows` weight rows r (fields as 2-D C-contiguous blocks
    of rows) and `xrows` activation rows i, r-major: each group of codes is decoded once for
    all activation rows, and several weight rows interleave their independent chains. x as
    `_quantize_groups` leaves it: xq int16 [xrows, K], dx and xsum fp32 [xrows, K/32],
    C-contiguous. Groups go `BLOCK` at a time, their scales and offset terms as vectors; the
    rest (K/32 not a multiple of BLOCK) one by one. `interleaved`: the fields are one row of 4
    rows interleaved (`qdot_cpu.interleave`; whole blocks only). `xrows=None`: every row of
    xq (at most `XN_MAX`), the block's codes decoded once and a loop over the activation rows
    inside it, each pair's accumulator on the stack (offset terms in it, as in the fixed-row
    forms), the sums into a last argument res fp32 [>= rows, wrows] (as
    qdot8_ir_cpu.dot8_intrinsic, whose docstring tells why an output's bits do not depend on
    the form or the other rows)."""
    halves = qtype == "q6_k"

    def codegen(context, b, sig, args):
        xs = [context.make_array(sig.args[i])(context, b, args[i]) for i in (6, 7, 8)]
        shapes = [cgutils.unpack_tuple(b, a.shape, 2) for a in xs]
        k, groups = shapes[0][1], shapes[1][1]
        rows = _row_pointers(context, b, sig, args, wrows, b.udiv(
            groups, ir.Constant(groups.type, BLOCK)) if interleaved else None)

        def x_row(i):
            return [b.gep(a.data, [b.mul(width, i)]) for a, width in zip(xs, (k, groups, groups))]
        zero = ir.Constant(_vec(_F32, 16), [0.0] * 16)
        if xrows is None:
            each_x, finish = row_loop(context, b, sig, args, rows, shapes[0][0], x_row, 9)
            acc_p = ()
        else:
            xp = [x_row(ir.Constant(k.type, i)) for i in range(xrows)]
            pairs = [(p, x) for p in rows for x in xp]
            acc_p = [cgutils.alloca_once_value(b, zero) for _ in pairs]
            finish = None

            def each_x(body):
                body(pairs, acc_p)

        def run(g0, n):  # groups g0 .. g0 + n
            gw = weight_group(b, g0, interleaved)  # the weight's fields at g0
            scales = {id(p): _scales(qtype, b, p, gw, n) for p in rows}
            codes = []  # per group i, per row (decoded here only for every x row at once)

            def lanes_of(pairs, acc_p):  # the offset terms go into the pairs' accumulators
                lanes = {}
                for (p, (x, dp, sp)), acc in zip(pairs, acc_p):
                    scale, offset = scales[id(p)]
                    step = _load(b, dp, g0, _F32, n)
                    if halves:  # one step per group, for both its scales
                        step = b.shuffle_vector(step, step,
                                                _const(_I32, 2 * n, [j // 2 for j in range(2 * n)]))
                    lanes[id(p), id(x)] = _fmul(b, scale, step)
                    if offset is not None:  # offset * sum(x), in fp32
                        term = _fmul(b, offset, _load(b, sp, g0, _F32, n))
                        term = _widen(b, term, acc.type.pointee.count)
                        b.store(_fadd(b, b.load(acc), term), acc)
                return lanes

            def group(i, pairs, acc_p, lanes):
                g = b.add(g0, ir.Constant(g0.type, i))
                if xrows is None:
                    mine = codes[i]
                else:
                    mine = group_codes(i)
                for (p, (x, dp, sp)), acc in zip(pairs, acc_p):
                    xv = _load(b, x, b.mul(g, ir.Constant(g.type, 32)), _I16, 32)
                    sums = b.sitofp(_pair_sums(b, mine[id(p)], xv), _vec(_F32, 16))
                    scale = _lane(b, lanes[id(p), id(x)], i, 16, halves)
                    b.store(_fma(b, sums, scale, b.load(acc)), acc)

            def group_codes(i):
                at = b.add(gw, ir.Constant(g0.type, i))
                mine = {id(p): _codes(qtype, b, p, at) for p in rows}
                for p in rows:
                    _prefetch(qtype, b, p, at)
                return mine

            def body(pairs, acc_p):
                lanes = lanes_of(pairs, acc_p)
                for i in range(n):
                    group(i, pairs, acc_p, lanes)
            if xrows is None:
                codes.extend(group_codes(i) for i in range(n))
            each_x(body)

        return _run_blocks(context, b, sig, groups, run, acc_p, finish=finish)

    if xrows is None:
        @intrinsic
        def block_dot_rows(typingctx, qs, qh, d, m, sc, mn, xq, dx, xsum, res):
            return types.none(qs, qh, d, m, sc, mn, xq, dx, xsum, res), codegen
        return block_dot_rows

    @intrinsic
    def block_dot(typingctx, qs, qh, d, m, sc, mn, xq, dx, xsum):
        out = types.UniTuple(types.float32, wrows * xrows)
        return out(qs, qh, d, m, sc, mn, xq, dx, xsum), codegen
    return block_dot


def dequant_intrinsic(qtype):
    @intrinsic
    def row_dequant(typingctx, qs, qh, d, m, sc, mn, row, out):
        """out[k] = w[k] of one row (out: fp32 [K], or uint16 [K] for bf16 bits). row < 0:
        the fields are that row's; else they are one row of 4 interleaved rows
        (`qdot_cpu.interleave`) and `row` (0-3) is the one of them to write."""
        bf16 = out.dtype == types.uint16

        def codegen(context, b, sig, args):
            arr = context.make_array(sig.args[7])(context, b, args[7])
            k = cgutils.unpack_tuple(b, arr.shape, 1)[0]
            blocks = b.udiv(k, ir.Constant(k.type, 32 * BLOCK))  # (interleaved rows: >= 1)
            blocks = b.select(b.icmp_unsigned("==", blocks, ir.Constant(k.type, 0)),
                              ir.Constant(k.type, 1), blocks)
            at = b.sext(args[6], k.type) if args[6].type.width < k.type.width else args[6]
            own, = _row_pointers(context, b, sig, args)
            one, = _row_pointers(context, b, sig, args, 1, blocks, at)
            mine = b.icmp_signed("<", at, ir.Constant(at.type, 0))
            p = {name: b.select(mine, own[name], one[name]) for name in own}
            with cgutils.for_range(b, b.udiv(k, ir.Constant(k.type, 32))) as loop:
                g = loop.index  # interleaved: block g / 8 is 4 blocks further per block
                block = b.and_(g, ir.Constant(g.type, -BLOCK))
                inner = b.sub(g, block)
                gw = b.select(mine, g, b.add(weight_group(b, block, True), inner))
                scale, offset = _scales(qtype, b, p, gw, 1)
                w = b.fmul(b.sitofp(_codes(qtype, b, p, gw), _vec(_F32, 32)),
                           _lane(b, scale, 0, 32, qtype == "q6_k"))  # no fast flags: the
                # oracle's rounding, FMA-free
                if offset is not None:
                    w = b.fadd(w, _lane(b, offset, 0, 32, False))
                if bf16:
                    w = _to_bf16(b, w)
                ptr = b.gep(arr.data, [b.mul(g, ir.Constant(g.type, 32))])
                b.store(w, b.bitcast(ptr, w.type.as_pointer()), align=2)
            return context.get_dummy_value()
        return types.void(qs, qh, d, m, sc, mn, row, out), codegen
    return row_dequant


# ---- the loops (numba) around the intrinsics --------------------------------------------------


def _by_kind(intrinsics):
    """kind -> a call of that type's intrinsic (a branch chain on one integer)."""
    f0, f1, f2, f3, f4, f5, f6, f7 = intrinsics

    @njit
    def call(kind, *args):
        if kind == 0:
            return f0(*args)
        if kind == 1:
            return f1(*args)
        if kind == 2:
            return f2(*args)
        if kind == 3:
            return f3(*args)
        if kind == 4:
            return f4(*args)
        if kind == 5:
            return f5(*args)
        if kind == 6:
            return f6(*args)
        return f7(*args)
    return call


_row_dequant = _by_kind([dequant_intrinsic(q) for q in KINDS])
_dot_w1x1, _dot_w4x1, _dot_w1x4, _dot_w4x2 = (_by_kind([dot_intrinsic(q, w, x) for q in KINDS])
                                              for w, x in ((1, 1), (4, 1), (1, 4), (4, 2)))
_dot_i4x1, _dot_i4x2 = (_by_kind([dot_intrinsic(q, 4, x, True) for q in KINDS]) for x in (1, 2))
_dot_w4xn, _dot_i4xn = (_by_kind([dot_intrinsic(q, 4, None, i) for q in KINDS])
                        for i in (False, True))


@njit(parallel=True, cache=True, nogil=True)
def dequant_kernel(kind, qs, qh, d, m, sc, mn, start, out, interleaved):
    """out[r] = row start + r; `interleaved`: the fields' rows are 4 rows each."""
    for r in prange(out.shape[0]):
        n = start + r
        if interleaved:
            j = n // 4
            _row_dequant(kind, qs[j], qh[j], d[j], m[j], sc[j], mn[j], n % 4, out[r])
        else:
            _row_dequant(kind, qs[n], qh[n], d[n], m[n], sc[n], mn[n], -1, out[r])


@njit(nogil=True, fastmath=True)
def group_step(x, i, g, levels, dx, xsum):
    """Group g of row i of x: its rounding step max|x| / levels (1 for an all-zero group) into
    dx[i, g], its fp32 sum into xsum[i, g]; returns the step (both quantizers' statistics)."""
    top = np.float32(0)
    total = np.float32(0)
    for j in range(32):
        top = max(top, abs(x[i, g * 32 + j]))
        total += x[i, g * 32 + j]
    step = top / np.float32(levels) if top > 0 else np.float32(1)
    dx[i, g], xsum[i, g] = step, total
    return step


@njit(cache=True, nogil=True, fastmath=True)
def _quantize_groups(x, xq, dx, xsum):
    """x fp32 [M, K] -> xq int16 [M, K], dx and xsum fp32 [M, K/32] (see the module
    docstring)."""
    for i in range(x.shape[0]):
        for g in range(x.shape[1] // 32):
            step = group_step(x, i, g, 32767, dx, xsum)
            inv = np.float32(1) / step
            for j in range(32):
                xq[i, g * 32 + j] = np.int16(np.round(x[i, g * 32 + j] * inv))


@njit(nogil=True, inline="always")
def _four_rows(kind, f, rows, xq, dx, xsum, out, col, interleaved, res):
    """4 weight rows (fields f: 4 rows, or one interleaved row) against `rows` activation rows
    into out[:rows, col:col + 4]: one or two a call, 3 or more all at once (`XN_MAX` a call;
    res: fp32 [XN_MAX, 4] scratch). Inlined: as a call it slowed the int8 decode step 1.3x."""
    if rows > 2:
        for i in range(0, rows, XN_MAX):
            e = min(rows, i + XN_MAX)
            if interleaved:
                _dot_i4xn(kind, *f, xq[i:e], dx[i:e], xsum[i:e], res)
            else:
                _dot_w4xn(kind, *f, xq[i:e], dx[i:e], xsum[i:e], res)
            for j in range(e - i):
                for r in range(4):
                    out[i + j, col + r] = res[j, r]
    elif rows == 2:
        if interleaved:
            y = _dot_i4x2(kind, *f, xq[:2], dx[:2], xsum[:2])
        else:
            y = _dot_w4x2(kind, *f, xq[:2], dx[:2], xsum[:2])
        for r in range(4):
            out[0, col + r] = y[2 * r]
            out[1, col + r] = y[2 * r + 1]
    else:
        if interleaved:
            y1 = _dot_i4x1(kind, *f, xq[:1], dx[:1], xsum[:1])
        else:
            y1 = _dot_w4x1(kind, *f, xq[:1], dx[:1], xsum[:1])
        for r in range(4):
            out[0, col + r] = y1[r]


@njit(parallel=True, cache=True, nogil=True)
def matvec_kernel(kind, qs, qh, d, m, sc, mn, x, xq, dx, xsum, out, tasks, interleaved):
    """xq, dx, xsum: scratch of M rows, or of M rounded up to 4 (4-row blocks; the rows
    beyond M hold what an earlier call left, and their sums are dropped). The weight rows go
    in `tasks` parallel iterations (`task_rows`), 4 at a time against the activation rows as
    `_four_rows` takes them; `interleaved`: the fields' rows are 4 rows each
    (`qdot_cpu.interleave`)."""
    rows = x.shape[0]
    _quantize_groups(x, xq[:rows], dx[:rows], xsum[:rows])
    if interleaved:  # each array row is 4 weight rows (`qdot_cpu.interleave`)
        n_groups = qs.shape[0]
        step = task_rows(4 * n_groups, tasks) // 4  # the same rows a task
        n_tasks = -(-n_groups // step)
        res = np.empty((n_tasks, XN_MAX if rows > 2 else 0, 4), np.float32)
        for c in prange(n_tasks):
            for g in range(step * c, min(n_groups, step * (c + 1))):
                _four_rows(kind, (qs[g:g + 1], qh[g:g + 1], d[g:g + 1], m[g:g + 1],
                                  sc[g:g + 1], mn[g:g + 1]), rows, xq, dx, xsum, out, 4 * g,
                           True, res[c])
        return
    n_rows = qs.shape[0]
    step = task_rows(n_rows, tasks)
    n_tasks = -(-n_rows // step)
    res = np.empty((n_tasks, XN_MAX if rows > 2 else 0, 4), np.float32)  # a task's scratch
    for c in prange(n_tasks):
        for n in range(step * c, min(n_rows, step * (c + 1)), 4):
            if n + 4 <= n_rows:
                _four_rows(kind, (qs[n:n + 4], qh[n:n + 4], d[n:n + 4], m[n:n + 4],
                                  sc[n:n + 4], mn[n:n + 4]), rows, xq, dx, xsum, out, n, False,
                           res[c])
            elif rows > 1:  # the last 1-3 weight rows: each group decoded once for 4 x rows
                for r in range(n, n_rows):
                    for i in range(0, rows, 4):
                        y = _dot_w1x4(kind, qs[r:r + 1], qh[r:r + 1], d[r:r + 1], m[r:r + 1],
                                      sc[r:r + 1], mn[r:r + 1], xq[i:i + 4], dx[i:i + 4],
                                      xsum[i:i + 4])
                        for j in range(min(4, rows - i)):
                            out[i + j, r] = y[j]
            else:
                for r in range(n, n_rows):
                    out[0, r] = _dot_w1x1(kind, qs[r:r + 1], qh[r:r + 1], d[r:r + 1],
                                          m[r:r + 1], sc[r:r + 1], mn[r:r + 1], xq, dx, xsum)[0]


depend_on(globals(), "qdot_ir_cpu.py")  # the IR these kernels inline: in their cache key
