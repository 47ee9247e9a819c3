"""The kernels of qdot_cpu.py (its docstring says what they compute and why): LLVM vector IR
of one group of 32 codes of each GGUF type, inside numba intrinsics, and the numba loops
around them. They share one file because numba's on-disk cache of a jitted function is
invalidated by changes to its own file only: the intrinsics it inlines must live beside it.

`_codes` unpacks a group's codes to <32 x i8> (the type's offset applied), `_scales` the
scales (and min terms) of `BLOCK` groups as vectors; `_pair_sums` multiplies by the int16
activations through pmaddwd's intrinsic on AVX-512BW and AVX2, generic vector IR elsewhere;
each stream of codes is prefetched `PREFETCH_GROUPS` groups ahead.
`dot_intrinsic(qtype, wrows, xrows)`: blocks of `wrows` weight rows times `xrows` activation
rows; `dequant_intrinsic(qtype)`: one weight row to fp32 or bf16 bits. `matvec_kernel` and
`dequant_kernel` run them over all rows on numba's threads.
"""
from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm, ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

KINDS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
"""The qtypes of these kernels; the index is their `kind` argument."""
FIELDS = ("qs", "qh", "d", "m", "sc", "mn")
"""The QuantWeight fields, in the order the kernels take them."""
PREFETCH_GROUPS = 256
"""How far ahead `matvec` asks for the codes: 256 groups of 32 weights (qs 4 KiB for 4-bit
types). A decode step streams its weights from DRAM once; without it the hardware prefetcher
left gate_up of Qwen2.5-0.5B (24 x [9728, 896] q5_0, 137 MiB) at 10.8 GB/s, with it 14.6-16.3
(2 threads; a plain fp32 sum over the same bytes: 24 GB/s)."""


_F32, _I8, _I32, _F16 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.HalfType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _const(t, n, values):
    return ir.Constant(_vec(t, n), list(values) if hasattr(values, "__iter__") else [values] * n)


def _load(b, base, offset, elt, n=None):
    """n elements of type elt (one scalar if n is None) at base + offset (elements of base)."""
    ptr = b.gep(base, [offset])
    return b.load(b.bitcast(ptr, (elt if n is None else _vec(elt, n)).as_pointer()), align=1)


def _splat(b, value, n=32):
    v = b.insert_element(ir.Constant(_vec(value.type, n), ir.Undefined), value,
                         ir.Constant(_I32, 0))
    return b.shuffle_vector(v, v, _const(_I32, n, 0))


def _nibbles(b, qs, g):
    """qs bytes g*16..+16 -> <32 x i8>: low nibbles are codes 0-15, high ones 16-31."""
    bytes16 = _load(b, qs, b.mul(g, ir.Constant(g.type, 16)), _I8, 16)
    lo = b.and_(bytes16, _const(_I8, 16, 15))
    hi = b.lshr(bytes16, _const(_I8, 16, 4))
    return b.shuffle_vector(lo, hi, _const(_I32, 32, range(32)))


def _bit_plane(b, qh, at, value):
    """The 32 bits at qh bytes at..at+4 (bit j for code j) -> <32 x i8> of 0 or value."""
    bits = b.bitcast(_load(b, qh, at, _I32), _vec(ir.IntType(1), 32))
    return b.select(bits, _const(_I8, 32, value), _const(_I8, 32, 0))


def q6_k_high(b, qh, g):
    """Group g's high bits (`qdot_cpu._q6_k_high`: 16 bytes of its block's 64, two bits per
    code, at bit 4c for codes 0-15 and 4c + 2 for 16-31) as <32 x i8>: bits 4 and 5 of each."""
    i64 = ir.IntType(64)
    one = ir.Constant(g.type, 1)
    c = b.and_(b.lshr(g, ir.Constant(g.type, 2)), one)
    at = b.add(b.mul(b.lshr(g, ir.Constant(g.type, 3)), ir.Constant(g.type, 64)),
               b.mul(b.and_(g, ir.Constant(g.type, 3)), ir.Constant(g.type, 16)))
    shift = _splat(b, b.trunc(b.mul(c, ir.Constant(g.type, 4)), i64) if g.type != i64 else
                   b.mul(c, ir.Constant(g.type, 4)), 2)
    bits = b.bitcast(b.lshr(_load(b, qh, at, i64, 2), shift), _vec(_I8, 16))
    lo = b.shl(b.and_(bits, _const(_I8, 16, 3)), _const(_I8, 16, 4))
    hi = b.and_(b.shl(bits, _const(_I8, 16, 2)), _const(_I8, 16, 0x30))
    return b.shuffle_vector(lo, hi, _const(_I32, 32, range(32)))


def _half(b, ptr, index):
    """The fp16 at ptr[index] (an array of uint16 bits) as fp32: exact."""
    return b.fpext(_load(b, b.bitcast(ptr, _F16.as_pointer()), index, _F16), _F32)


def _fmul(b, x, y):
    return b.fmul(x, y, flags=("fast",))


def _fadd(b, x, y):
    return b.fadd(x, y, flags=("fast",))


def _codes(qtype, b, p, g):
    """Group g of one row's codes, signed, offset applied: <32 x i8> (p: field pointers)."""
    if qtype == "q8_0":
        return _load(b, p["qs"], b.mul(g, ir.Constant(g.type, 32)), _I8, 32)
    q = _nibbles(b, p["qs"], g)
    if qtype in ("q5_0", "q5_1", "q5_k"):
        q = b.or_(q, _bit_plane(b, p["qh"], b.mul(g, ir.Constant(g.type, 4)), 16))
    if qtype == "q6_k":
        return b.sub(b.or_(q, q6_k_high(b, p["qh"], g)), _const(_I8, 32, 32))
    if qtype in ("q4_0", "q5_0"):
        return b.sub(q, _const(_I8, 32, 8 if qtype == "q4_0" else 16))
    return q


def _scales(qtype, b, p, g, n):
    """Groups g..g+n of one row: (scales, offsets) with w = code * scale + offset; scales
    <n x float> (q6_k: <2n x float>, one per half group), offsets <n x float> or None."""
    if qtype == "q6_k":  # g at a 256-block's start, or n == 1
        d256 = _splat(b, _half(b, p["d"], b.udiv(g, ir.Constant(g.type, 8))), n)
        sc = _load(b, p["sc"], b.mul(g, ir.Constant(g.type, 2)), _I8, 2 * n)
        d2 = b.shuffle_vector(d256, d256, _const(_I32, 2 * n, [j // 2 for j in range(2 * n)]))
        return _fmul(b, b.sitofp(sc, _vec(_F32, 2 * n)), d2), None
    if qtype in ("q4_k", "q5_k"):  # m holds dmin; sc and mn as one vector of 2n
        blk = b.udiv(g, ir.Constant(g.type, 8))
        pair = ir.Constant(_vec(_F32, 2), ir.Undefined)
        for i, value in enumerate((_half(b, p["d"], blk), b.fneg(_half(b, p["m"], blk)))):
            pair = b.insert_element(pair, value, ir.Constant(_I32, i))
        both = b.shuffle_vector(pair, pair, _const(_I32, 2 * n, [j // n for j in range(2 * n)]))
        codes = b.shuffle_vector(_load(b, p["sc"], g, _I8, n), _load(b, p["mn"], g, _I8, n),
                                 _const(_I32, 2 * n, range(2 * n)))
        out = _fmul(b, b.uitofp(codes, _vec(_F32, 2 * n)), both)
        return tuple(b.shuffle_vector(out, out, _const(_I32, n, range(h * n, h * n + n)))
                     for h in (0, 1))
    d = _halves(b, p["d"], g, n)
    return d, (_halves(b, p["m"], g, n) if qtype in ("q4_1", "q5_1") else None)


def _halves(b, ptr, index, n):
    """n fp16 at ptr[index] (uint16 bits) as <n x float>: exact."""
    v = _load(b, b.bitcast(ptr, _F16.as_pointer()), index, _F16, n)
    return b.fpext(v, _vec(_F32, n))


def _lane(b, v, i, n, halves):
    """<n x float> of lane i of v, or (halves: v holds two per group, q6_k) of lanes 2i and
    2i + 1, each in half of the n."""
    mask = [2 * i + 2 * j // n for j in range(n)] if halves else [i] * n
    return b.shuffle_vector(v, v, _const(_I32, n, mask))


def _prefetch(qtype, b, p, g):
    """Prefetch hints for the codes `PREFETCH_GROUPS` groups ahead of group g (one line of
    each stream per group: the hint may run past the array's end; it never faults)."""
    strides = {"qs": 32 if qtype == "q8_0" else 16}
    if qtype in ("q5_0", "q5_1", "q5_k", "q6_k"):
        strides["qh"] = 8 if qtype == "q6_k" else 4
    for name, stride in strides.items():
        at = b.mul(b.add(g, ir.Constant(g.type, PREFETCH_GROUPS)), ir.Constant(g.type, stride))
        _call(b, "llvm.prefetch.p0", ir.VoidType(), b.gep(p[name], [at]), ir.Constant(_I32, 0),
              ir.Constant(_I32, 3), ir.Constant(_I32, 1))


def _row_pointers(context, b, sig, args, rows=1):
    """Per row of the weight fields (2-D C-contiguous blocks of `rows` rows; 1-D for one
    row): {field: pointer to that row}."""
    arrays = [context.make_array(sig.args[i])(context, b, args[i]) for i in range(len(FIELDS))]
    if rows == 1:
        return [{name: a.data for name, a in zip(FIELDS, arrays)}]
    widths = [cgutils.unpack_tuple(b, a.shape, 2)[1] for a in arrays]
    return [{name: b.gep(a.data, [b.mul(width, ir.Constant(width.type, r))])
             for name, a, width in zip(FIELDS, arrays, widths)} for r in range(rows)]


def _hsum(b, v):
    n = v.type.count
    while n > 1:
        n //= 2
        lo = b.shuffle_vector(v, v, _const(_I32, n, range(n)))
        hi = b.shuffle_vector(v, v, _const(_I32, n, range(n, 2 * n)))
        v = _fadd(b, lo, hi)
    return b.extract_element(v, ir.Constant(_I32, 0))


_CPU = {name for name, on in llvm.get_host_cpu_features().items() if on}
_I16 = ir.IntType(16)


def _pair_sums(b, q, xq):
    """<32 x i8> codes . <32 x i16> activations -> <16 x i32> sums of adjacent products
    (exact: |code| <= 128, |xq| <= 32767)."""
    q16 = b.sext(q, _vec(_I16, 32))
    if "avx512bw" in _CPU:
        return _call(b, "llvm.x86.avx512.pmaddw.d.512", _vec(_I32, 16), q16, xq)
    if "avx2" in _CPU:
        halves = [[b.shuffle_vector(v, v, _const(_I32, 16, range(h, h + 16))) for v in (q16, xq)]
                  for h in (0, 16)]
        lo, hi = (_call(b, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), *h) for h in halves)
        return b.shuffle_vector(lo, hi, _const(_I32, 16, range(16)))
    even, odd = _const(_I32, 16, range(0, 32, 2)), _const(_I32, 16, range(1, 32, 2))
    return b.add(*(b.mul(b.sext(b.shuffle_vector(q16, q16, i), _vec(_I32, 16)),
                         b.sext(b.shuffle_vector(xq, xq, i), _vec(_I32, 16)))
                   for i in (even, odd)))


def _call(b, name, result, *args):
    fn = b.module.declare_intrinsic(name, fnty=ir.FunctionType(result, [a.type for a in args]))
    return b.call(fn, args)


@njit(nogil=True)
def task_rows(n_rows, tasks):
    """Weight rows per parallel iteration of the matvec kernels: `tasks` iterations (qdot_cpu.py
    asks for `TASKS_PER_THREAD` per thread) of whole blocks of 4 rows. qdot_cpu.py has numba
    hand them out one at a time as threads free up (its default splits them evenly up front:
    when another process holds one of the two cores, the free thread then waits for the
    other's half). A few long runs of rows stream from DRAM faster than many short ones: the
    1.5B's decode matrices (int8, 2 threads) at 8 tasks 35.2 GB/s, at 64-row tasks 33.4."""
    return max(1, -(-n_rows // (4 * max(1, tasks)))) * 4


BLOCK = 8
"""Groups whose scales `dot_intrinsic` converts as one vector (a k-quant's 256-block)."""


def dot_intrinsic(qtype, wrows, xrows):
    halves = qtype == "q6_k"

    @intrinsic
    def block_dot(typingctx, qs, qh, d, m, sc, mn, xq, dx, xsum):
        """sum_k w[r, k] x[i, k] for the `wrows` weight rows r (fields as 2-D C-contiguous
        blocks of rows) and `xrows` activation rows i, r-major: each group of codes is
        decoded once for all activation rows, and several weight rows interleave their
        independent chains. x as `_quantize_groups` leaves it: xq int16 [xrows, K], dx and
        xsum fp32 [xrows, K/32], C-contiguous. Groups go `BLOCK` at a time, their scales and
        offset terms as vectors; the rest (K/32 not a multiple of BLOCK) one by one."""
        def codegen(context, b, sig, args):
            rows = _row_pointers(context, b, sig, args, wrows)
            xs = [context.make_array(sig.args[i])(context, b, args[i]) for i in (6, 7, 8)]
            k, groups = (cgutils.unpack_tuple(b, a.shape, 2)[1] for a in xs[:2])
            xp = [[b.gep(a.data, [b.mul(width, ir.Constant(width.type, i))])
                   for a, width in zip(xs, (k, groups, groups))] for i in range(xrows)]
            pairs = [(p, x) for p in rows for x in xp]
            acc_p = [cgutils.alloca_once_value(b, ir.Constant(_vec(_F32, 16), [0.0] * 16))
                     for _ in pairs]
            off_p = [cgutils.alloca_once_value(b, ir.Constant(_vec(_F32, BLOCK), [0.0] * BLOCK))
                     for _ in pairs]

            def run(g0, n):  # groups g0 .. g0 + n
                scales = {id(p): _scales(qtype, b, p, g0, n) for p in rows}
                lanes = {}
                for (p, (x, dp, sp)), off in zip(pairs, off_p):
                    scale, offset = scales[id(p)]
                    step = _load(b, dp, g0, _F32, n)
                    if halves:  # one step per group, for both its scales
                        step = b.shuffle_vector(step, step,
                                                _const(_I32, 2 * n, [j // 2 for j in range(2 * n)]))
                    lanes[id(p), id(x)] = _fmul(b, scale, step)
                    if offset is not None:  # offset * sum(x), in fp32
                        term = _fmul(b, offset, _load(b, sp, g0, _F32, n))
                        term = _widen(b, term, BLOCK)
                        b.store(_fadd(b, b.load(off), term), off)
                for i in range(n):
                    g = b.add(g0, ir.Constant(g0.type, i))
                    codes = {id(p): _codes(qtype, b, p, g) for p in rows}
                    for p in rows:
                        _prefetch(qtype, b, p, g)
                    for (p, (x, dp, sp)), acc in zip(pairs, acc_p):
                        xv = _load(b, x, b.mul(g, ir.Constant(g.type, 32)), _I16, 32)
                        sums = b.sitofp(_pair_sums(b, codes[id(p)], xv), _vec(_F32, 16))
                        scale = _lane(b, lanes[id(p), id(x)], i, 16, halves)
                        b.store(_fadd(b, b.load(acc), _fmul(b, sums, scale)), acc)

            return _run_blocks(context, b, sig, groups, run, acc_p, off_p)
        out = types.UniTuple(types.float32, wrows * xrows)
        return out(qs, qh, d, m, sc, mn, xq, dx, xsum), codegen
    return block_dot


def _run_blocks(context, b, sig, groups, run, acc_p, off_p, tails=()):
    """Calls `run(g0, n)` over a row's groups, `BLOCK` at a time, then once each size of
    `tails` (decreasing, below `BLOCK`) if as many groups are left, then the rest one by one;
    returns the intrinsic's tuple: per (weight row, activation row) its accumulator's lanes
    plus its offset lanes, summed."""
    blocks = b.udiv(groups, ir.Constant(groups.type, BLOCK))
    with cgutils.for_range(b, blocks) as loop:
        run(b.mul(loop.index, ir.Constant(groups.type, BLOCK)), BLOCK)
    rest = b.mul(blocks, ir.Constant(groups.type, BLOCK))
    for n in tails:
        left = b.icmp_unsigned(">=", b.sub(groups, rest), ir.Constant(groups.type, n))
        with b.if_then(left):
            run(rest, n)
        rest = b.select(left, b.add(rest, ir.Constant(groups.type, n)), rest)
    with cgutils.for_range(b, groups, start=rest) as loop:
        run(loop.index, 1)
    sums = [_fadd(b, _hsum(b, b.load(acc)), _hsum(b, b.load(off)))
            for acc, off in zip(acc_p, off_p)]
    return context.make_tuple(b, sig.return_type, sums)


def _widen(b, v, n):
    """<k x float> -> <n x float>, zeros beyond k."""
    if v.type.count == n:
        return v
    zero = ir.Constant(v.type, [0.0] * v.type.count)
    return b.shuffle_vector(v, zero, _const(_I32, n, [j if j < v.type.count else v.type.count
                                                       for j in range(n)]))


def _to_bf16(b, v):
    """<32 x float> -> <32 x i16> bf16 bits, rounded to nearest even (finite values)."""
    u = b.bitcast(v, _vec(_I32, 32))
    odd = b.and_(b.lshr(u, _const(_I32, 32, 16)), _const(_I32, 32, 1))
    u = b.add(b.add(u, _const(_I32, 32, 0x7FFF)), odd)
    return b.trunc(b.lshr(u, _const(_I32, 32, 16)), _vec(_I16, 32))


def dequant_intrinsic(qtype):
    @intrinsic
    def row_dequant(typingctx, qs, qh, d, m, sc, mn, out):
        """out[k] = w[k] of one row (out: fp32 [K], or uint16 [K] for bf16 bits)."""
        bf16 = out.dtype == types.uint16

        def codegen(context, b, sig, args):
            p, = _row_pointers(context, b, sig, args)
            arr = context.make_array(sig.args[6])(context, b, args[6])
            k = cgutils.unpack_tuple(b, arr.shape, 1)[0]
            with cgutils.for_range(b, b.udiv(k, ir.Constant(k.type, 32))) as loop:
                g = loop.index
                scale, offset = _scales(qtype, b, p, g, 1)
                w = b.fmul(b.sitofp(_codes(qtype, b, p, g), _vec(_F32, 32)),
                           _lane(b, scale, 0, 32, qtype == "q6_k"))  # no fast flags: the
                # oracle's rounding, FMA-free
                if offset is not None:
                    w = b.fadd(w, _lane(b, offset, 0, 32, False))
                if bf16:
                    w = _to_bf16(b, w)
                ptr = b.gep(arr.data, [b.mul(g, ir.Constant(g.type, 32))])
                b.store(w, b.bitcast(ptr, w.type.as_pointer()), align=2)
            return context.get_dummy_value()
        return types.void(qs, qh, d, m, sc, mn, out), codegen
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
_dot_w1x1, _dot_w4x1, _dot_w1x4 = (_by_kind([dot_intrinsic(q, w, x) for q in KINDS])
                                   for w, x in ((1, 1), (4, 1), (1, 4)))


@njit(parallel=True, cache=True, nogil=True)
def dequant_kernel(kind, qs, qh, d, m, sc, mn, start, out):
    for r in prange(out.shape[0]):
        n = start + r
        _row_dequant(kind, qs[n], qh[n], d[n], m[n], sc[n], mn[n], out[r])


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


@njit(parallel=True, cache=True, nogil=True)
def matvec_kernel(kind, qs, qh, d, m, sc, mn, x, xq, dx, xsum, out, tasks):
    """xq, dx, xsum: scratch of M rows, or of M rounded up to 4 (4-row blocks; the rows
    beyond M hold what an earlier call left, and their sums are dropped). The weight rows go
    in `tasks` parallel iterations (`task_rows`)."""
    rows = x.shape[0]
    _quantize_groups(x, xq[:rows], dx[:rows], xsum[:rows])
    n_rows = qs.shape[0]
    step = task_rows(n_rows, tasks)
    for c in prange(-(-n_rows // step)):
        for n in range(step * c, min(n_rows, step * (c + 1)), 4):
            if rows > 1:  # each group decoded once for 4 activation rows
                for r in range(n, min(n + 4, n_rows)):
                    for i in range(0, rows, 4):
                        y = _dot_w1x4(kind, qs[r:r + 1], qh[r:r + 1], d[r:r + 1], m[r:r + 1],
                                      sc[r:r + 1], mn[r:r + 1], xq[i:i + 4], dx[i:i + 4],
                                      xsum[i:i + 4])
                        for j in range(min(4, rows - i)):
                            out[i + j, r] = y[j]
            elif n + 4 <= n_rows:
                y = _dot_w4x1(kind, qs[n:n + 4], qh[n:n + 4], d[n:n + 4], m[n:n + 4],
                              sc[n:n + 4], mn[n:n + 4], xq, dx, xsum)
                for j in range(4):
                    out[0, n + j] = y[j]
            else:
                for r in range(n, n_rows):
                    out[0, r] = _dot_w1x1(kind, qs[r:r + 1], qh[r:r + 1], d[r:r + 1],
                                          m[r:r + 1], sc[r:r + 1], mn[r:r + 1], xq, dx, xsum)[0]
