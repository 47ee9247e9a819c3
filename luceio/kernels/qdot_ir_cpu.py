"""The LLVM vector IR that the CPU quantized kernels are built from (qdot_kernels_cpu.py: the
int16-activation dot products, the dequantization and their numba loops; qdot8_kernels_cpu.py:
the int8 ones): the GGUF types' fields and codes, the groups' scales, prefetch hints, per-row
pointers, the loop over a row's blocks of groups, and small vector helpers.

`_codes` unpacks a group's codes to <32 x i8> (the type's offset applied), `_scales` the
scales (and min terms) of `BLOCK` groups as vectors; `_pair_sums` multiplies by the int16
activations through pmaddwd's intrinsic on AVX-512BW and AVX2, generic vector IR elsewhere;
each stream of codes is prefetched `PREFETCH_GROUPS` groups ahead.

The kernels that inline this IR live in the two files above, whose numba cache keys include
this file (`numba_cache.depend_on`).
"""
from __future__ import annotations

from llvmlite import binding as llvm, ir
from numba.core import cgutils

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
    return bits_to_bytes(b, _load(b, qh, at, _I32), value)


def bits_to_bytes(b, bits, value):
    """An n-bit integer (bit j for code j) -> <n x i8> of 0 or value. Without AVX-512's mask
    registers LLVM takes a <n x i1> select apart bit by bit (the 0.5B's q5_0 int8 matvecs ran
    at half the int16 path's rate on AVX2), so there byte j of the bits is spread to bytes
    8j .. 8j + 7, each compared with its bit."""
    n = bits.type.width
    if "avx512bw" in _CPU:
        mask = b.bitcast(bits, _vec(ir.IntType(1), n))
        return b.select(mask, _const(_I8, n, value), _const(_I8, n, 0))
    octets = b.bitcast(bits, _vec(_I8, n // 8))
    spread = b.shuffle_vector(octets, octets, _const(_I32, n, [j // 8 for j in range(n)]))
    bit = _const(_I8, n, [1 << (j % 8) for j in range(n)])
    on = b.icmp_unsigned("==", b.and_(spread, bit), bit)
    return b.and_(b.sext(on, _vec(_I8, n)), _const(_I8, n, value))


def q6_k_high(b, qh, g):
    """Group g's high bits (`qdot_cpu._q6_k_high`: 16 bytes of its block's 64, two bits per
    code, at bit 4c for codes 0-15 and 4c + 2 for 16-31) as <32 x i8>: bits 4 and 5 of each."""
    i64 = ir.IntType(64)
    at = b.add(b.mul(b.lshr(g, ir.Constant(g.type, 3)), ir.Constant(g.type, 64)),
               b.mul(b.and_(g, ir.Constant(g.type, 3)), ir.Constant(g.type, 16)))
    four_c = b.and_(g, ir.Constant(g.type, 4))  # 4c, c = (g mod 8) // 4
    shift = _splat(b, b.zext(four_c, i64) if g.type.width < 64 else four_c, 2)
    bits = b.bitcast(b.lshr(_load(b, qh, at, i64, 2), shift), _vec(_I8, 16))
    lo = b.shl(b.and_(bits, _const(_I8, 16, 3)), _const(_I8, 16, 4))
    hi = b.and_(b.shl(bits, _const(_I8, 16, 2)), _const(_I8, 16, 0x30))
    return b.shuffle_vector(lo, hi, _const(_I32, 32, range(32)))


def _half(b, ptr, index):
    """The fp16 at ptr[index] (an array of uint16 bits) as fp32: exact."""
    return b.fpext(_load(b, b.bitcast(ptr, _F16.as_pointer()), index, _F16), _F32)


def _fmul(b, x, y):
    """x * y with no fast-math flags: LLVM may neither reassociate nor contract to FMAs, so the
    dot intrinsics' forms (one, two or any number of activation rows; 1 or 4 weight rows) round
    a pair's sum through the same operations in the same order (batch invariance)."""
    return b.fmul(x, y)


def _fadd(b, x, y):
    """x + y, as `_fmul` (no fast-math flags)."""
    return b.fadd(x, y)


def _fma(b, x, y, acc):
    """x * y + acc in one rounding (`llvm.fma`): the dot intrinsics' accumulation, written out
    where the fast-math flags let LLVM contract it (without either, separate multiplies and
    adds cost the int16 kernels 7-10%)."""
    return _call(b, f"llvm.fma.v{x.type.count}f32", x.type, x, y, acc)


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


INTERLEAVE = 4
"""Rows of a weight interleaved by 256-block (`qdot_cpu.interleave`): row j of the array holds
rows 4j .. 4j + 3's blocks in turn, block by block, each field on its own."""


def _row_pointers(context, b, sig, args, rows=1, blocks=None, row=None):
    """Per row of the weight fields (2-D C-contiguous blocks of `rows` rows; 1-D for one
    row): {field: pointer to that row}. With `blocks` (a row's count of 256-blocks) the
    fields are interleaved (`INTERLEAVE`; one row of the array, 2-D, or 1-D with `row`, the
    one row of its `INTERLEAVE` to point at): a row's pointer is its first block's, and its
    block c is `INTERLEAVE` blocks further per c (`weight_group`)."""
    arrays = [context.make_array(sig.args[i])(context, b, args[i]) for i in range(len(FIELDS))]
    if blocks is None and rows == 1:
        return [{name: a.data for name, a in zip(FIELDS, arrays)}]
    widths = [cgutils.unpack_tuple(b, a.shape, sig.args[i].ndim)[-1]
              for i, a in enumerate(arrays)]
    if blocks is not None:  # one block of one row, each field
        widths = [b.udiv(w, b.mul(blocks, ir.Constant(w.type, INTERLEAVE))) for w in widths]
    if row is not None:
        return [{name: b.gep(a.data, [b.mul(width, row)])
                 for name, a, width in zip(FIELDS, arrays, widths)}]
    return [{name: b.gep(a.data, [b.mul(width, ir.Constant(width.type, r))])
             for name, a, width in zip(FIELDS, arrays, widths)} for r in range(rows)]


def weight_group(b, g, interleaved):
    """The group index that addresses a weight's fields at group g, a 256-block's start:
    `INTERLEAVE` g for interleaved fields (`_row_pointers`), whose blocks come `INTERLEAVE`
    rows' blocks apart (groups within the block add to it as they are)."""
    return b.mul(g, ir.Constant(g.type, INTERLEAVE)) if interleaved else g


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


BLOCK = 8
"""Groups whose scales `dot_intrinsic` converts as one vector (a k-quant's 256-block)."""


def _run_blocks(context, b, sig, groups, run, acc_p, tails=(), finish=None):
    """Calls `run(g0, n)` over a row's groups, `BLOCK` at a time, then once each size of
    `tails` (decreasing, below `BLOCK`) if as many groups are left, then the rest one by one;
    returns the intrinsic's tuple: per (weight row, activation row) its accumulator's lanes
    summed, the offset terms among them (or calls `finish`, which stores them, and returns
    none): one accumulator a pair in every form."""
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
    if finish is not None:
        finish()
        return context.get_dummy_value()
    sums = [_hsum(b, b.load(acc)) for acc in acc_p]  # the offset terms are in them
    return context.make_tuple(b, sig.return_type, sums)


XN_MAX = 32
"""Activation rows one call of a dot intrinsic's any-rows form takes at most (`row_loop`)."""


def row_loop(context, b, sig, args, rows, n_x, x_row, res_index):
    """The any-rows form of the dot intrinsics (qdot_kernels_cpu.dot_intrinsic and
    qdot8_ir_cpu.dot8_intrinsic with xrows=None): one <16 x float> accumulator per (weight row,
    activation row) on the stack (room for `XN_MAX` activation rows), zeroed, where the
    fixed-row forms keep it in a register; the offset terms go into it in both. Returns
    (each_x, finish): `each_x(body)` calls body(pairs, accumulators) inside a loop
    over the n_x activation rows (pairs: (weight row's pointers, x_row(i))); `finish()` stores
    each pair's sum, as `_run_blocks` sums a fixed form's, into the intrinsic's argument
    `res_index`, fp32 [>= n_x, len(rows)] C-contiguous. So a row's outputs are the same bits
    whichever form computed them and beside whichever other rows."""
    zero = ir.Constant(_vec(_F32, 16), [0.0] * 16)
    count = ir.Constant(n_x.type, len(rows))
    store = cgutils.alloca_once(b, zero.type, size=XN_MAX * len(rows))
    with cgutils.for_range(b, b.mul(n_x, count)) as loop:
        b.store(zero, b.gep(store, [loop.index]))

    def at(i, r):
        return b.gep(store, [b.add(b.mul(i, count), ir.Constant(n_x.type, r))])

    def each_x(body):
        with cgutils.for_range(b, n_x) as loop:
            acc = [at(loop.index, r) for r in range(len(rows))]
            xp = x_row(loop.index)
            body([(p, xp) for p in rows], acc)

    def finish():
        res = context.make_array(sig.args[res_index])(context, b, args[res_index])
        width = cgutils.unpack_tuple(b, res.shape, 2)[1]
        with cgutils.for_range(b, n_x) as loop:
            for r in range(len(rows)):
                b.store(_hsum(b, b.load(at(loop.index, r))), b.gep(res.data, [
                    b.add(b.mul(loop.index, width), ir.Constant(width.type, r))]))
    return each_x, finish


def _widen(b, v, n):
    """<k x float> -> <n x float>, zeros beyond k."""
    if v.type.count == n:
        return v
    zero = ir.Constant(v.type, [0.0] * v.type.count)
    count = v.type.count
    return b.shuffle_vector(v, zero, _const(_I32, n, [min(j, count) for j in range(n)]))


def _to_bf16(b, v):
    """<32 x float> -> <32 x i16> bf16 bits, rounded to nearest even (finite values)."""
    u = b.bitcast(v, _vec(_I32, 32))
    odd = b.and_(b.lshr(u, _const(_I32, 32, 16)), _const(_I32, 32, 1))
    u = b.add(b.add(u, _const(_I32, 32, 0x7FFF)), odd)
    return b.trunc(b.lshr(u, _const(_I32, 32, 16)), _vec(_I16, 32))
