"""int8-activation kernels of qdot_cpu.py, for CPUs with AVX-512 VNNI (`vpdpbusd`: 64 unsigned
bytes times 64 signed bytes, summed by fours into 16 int32 lanes, in one instruction) or AVX2
(the same sums from `vpmaddubsw` and `vpmaddwd`, `qdot8_ir_cpu._dpbusd`).

The activations are quantized per group of 32 to int8 (xq = round(x / dx), dx = max|x| / 127,
as llama.cpp's CPU kernels do); the weights' codes enter unsigned, before their offset, so one
`vpdpbusd` multiplies two groups (64 codes) where the int16 path (qdot_kernels_cpu.py) needs a
widening and a `pmaddwd` per group. The offset comes back exactly through the group's integer
sum of xq: sum (q - o) xq = sum q xq - o sum xq.

Block order. A block of 8 groups (256 codes) goes as four 64-byte vectors (`qdot8_ir_cpu.QUARTERS`):
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
  q8_0         q + 128 (its bytes, sign bit flipped) + d * dx * (-128) * sum(xq); on AVX2
               q itself (`qdot8_ir_cpu.SIGNED`: |q| times xq with q's sign, no offset term)

Every integer sum is exact; what int8 activations lose is the rounding of xq, up to
max|x of the group| / 254 per element, 258x the int16 path's step: a projection's output moves
by 1-2% of its norm (measured on real SmolLM2's decode steps; the same estimate for bf16
activations gives ~0.1%, for int16 ~0.005%), as with llama.cpp's CPU kernels, which round the
same way. tests/test_qdot8_cpu.py checks the kernels against the exact dot of the same
quantized activations (to fp32 rounding) and bounds the loss against fp32.

Several activation rows (a few requests, a speculative verify): 4 weight rows go against one
or two activation rows a call with the accumulators in registers, and against 3 or more in one
call (`XN_MAX` at most) that unpacks each block's weight codes and scales once and loops over
the activation rows inside the block, each pair's accumulator on the stack. Unpacking a q4_k
block for 4 rows is ~80 instructions and a pair's products and scaling ~20, so with 2 rows a
call 5 rows unpacked the weights 3 times. In one call, against two rows a call (`python
bench/cpu_kernels_ab.py --base ff6f955 --rows 1,2,3,5,8`, Zen 5, 2 threads,
`bench/results/cpu/cpu_kernels_ab_session32_rows.json`), a decode step's matrices at 3 / 5 / 8
rows: Qwen2.5-Coder-1.5B 1.21x / 1.50x / 1.52x faster, 0.5B 1.01x / 1.24x / 1.40x, SmolLM2
0.98x / 1.21x / 1.30x; one and two rows run the same kernels as before.

The kernels' IR is qdot8_ir_cpu.py's, the IR helpers (code unpacking, scales, prefetch, loops
over rows) qdot_ir_cpu.py's, `group_step` (the activation groups' statistics) and the dispatch
on `kind` qdot_kernels_cpu.py's. numba's on-disk cache of these kernels is keyed on this file
and on those (`numba_cache.depend_on`, at the end).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .numba_cache import depend_on
from .qdot8_ir_cpu import AVX2_ONLY, VNNI as _VNNI, dot8_intrinsic
from .qdot_ir_cpu import KINDS, XN_MAX
from .qdot_kernels_cpu import _by_kind, group_step, task_rows

AVAILABLE = _VNNI or AVX2_ONLY
"""Whether this CPU runs these kernels (`qdot_cpu.int8_available`): AVX-512 VNNI, or AVX2."""
if AVAILABLE:
    _dot_w1x1, _dot_w4x1, _dot_w1x4, _dot_w4x2 = (
        _by_kind([dot8_intrinsic(q, w, x) for q in KINDS]) for w, x in ((1, 1), (4, 1), (1, 4),
                                                                        (4, 2)))
    _dot_i4x1, _dot_i4x2 = (_by_kind([dot8_intrinsic(q, 4, x, True) for q in KINDS])
                            for x in (1, 2))
    _dot_w4xn, _dot_i4xn = (_by_kind([dot8_intrinsic(q, 4, None, i) for q in KINDS])
                            for i in (False, True))


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


if AVAILABLE:
    @njit(nogil=True, inline="always")  # inlined: as a call, a decode step took 1.3x longer
    def _four_rows(kind, f, rows, xq, dx, xsum, qsum, out, col, interleaved, res):
        """4 weight rows (fields f: 4 rows, or one interleaved row) against `rows` activation
        rows into out[:rows, col:col + 4]: one or two rows in one call, 3 or more all at once
        (`XN_MAX` a call; res: fp32 [XN_MAX, 4] scratch)."""
        if rows > 2:
            for i in range(0, rows, XN_MAX):
                e = min(rows, i + XN_MAX)
                if interleaved:
                    _dot_i4xn(kind, *f, xq[i:e], dx[i:e], xsum[i:e], qsum[i:e], res)
                else:
                    _dot_w4xn(kind, *f, xq[i:e], dx[i:e], xsum[i:e], qsum[i:e], res)
                for j in range(e - i):
                    for r in range(4):
                        out[i + j, col + r] = res[j, r]
        elif rows == 2:
            if interleaved:
                y = _dot_i4x2(kind, *f, xq[:2], dx[:2], xsum[:2], qsum[:2])
            else:
                y = _dot_w4x2(kind, *f, xq[:2], dx[:2], xsum[:2], qsum[:2])
            for r in range(4):
                out[0, col + r] = y[2 * r]
                out[1, col + r] = y[2 * r + 1]
        else:
            if interleaved:
                y1 = _dot_i4x1(kind, *f, xq[:1], dx[:1], xsum[:1], qsum[:1])
            else:
                y1 = _dot_w4x1(kind, *f, xq[:1], dx[:1], xsum[:1], qsum[:1])
            for r in range(4):
                out[0, col + r] = y1[r]

    @njit(parallel=True, cache=True, nogil=True)
    def matvec8_kernel(kind, qs, qh, d, m, sc, mn, x, xq, dx, xsum, qsum, out, tasks, one_row,
                       interleaved):
        """qdot_kernels_cpu.matvec_kernel with int8 activations; `one_row`: one activation
        row goes through the weight rows one at a time, not 4 (`qdot_cpu.ONE_ROW_MIN_K`);
        `interleaved`: the fields are interleaved by 4 rows (`qdot_cpu.interleave`). 4 weight
        rows at a time go against the activation rows as `_four_rows` takes them."""
        rows = x.shape[0]
        _quantize_groups8(x, xq[:rows], dx[:rows], xsum[:rows], qsum[:rows])
        if interleaved:  # each array row is 4 weight rows
            n_groups = qs.shape[0]
            step = task_rows(4 * n_groups, tasks) // 4  # the same rows a task
            n_tasks = -(-n_groups // step)
            res = np.empty((n_tasks, XN_MAX if rows > 2 else 0, 4), np.float32)
            for c in prange(n_tasks):
                for g in range(step * c, min(n_groups, step * (c + 1))):
                    _four_rows(kind, (qs[g:g + 1], qh[g:g + 1], d[g:g + 1], m[g:g + 1],
                                      sc[g:g + 1], mn[g:g + 1]), rows, xq, dx, xsum, qsum, out,
                               4 * g, True, res[c])
            return
        n_rows = qs.shape[0]
        step = task_rows(n_rows, tasks)
        n_tasks = -(-n_rows // step)
        res = np.empty((n_tasks, XN_MAX if rows > 2 else 0, 4), np.float32)  # a task's scratch
        for c in prange(n_tasks):
            for n in range(step * c, min(n_rows, step * (c + 1)), 4):
                if n + 4 <= n_rows and (rows > 1 or not one_row):
                    _four_rows(kind, (qs[n:n + 4], qh[n:n + 4], d[n:n + 4], m[n:n + 4],
                                      sc[n:n + 4], mn[n:n + 4]), rows, xq, dx, xsum, qsum, out,
                               n, False, res[c])
                elif rows > 1:  # the last 1-3 weight rows
                    for r in range(n, n_rows):
                        for i in range(0, rows, 4):
                            y = _dot_w1x4(kind, qs[r:r + 1], qh[r:r + 1], d[r:r + 1],
                                          m[r:r + 1], sc[r:r + 1], mn[r:r + 1], xq[i:i + 4],
                                          dx[i:i + 4], xsum[i:i + 4], qsum[i:i + 4])
                            for j in range(min(4, rows - i)):
                                out[i + j, r] = y[j]
                else:  # one_row, or the last 1-3 rows
                    for r in range(n, min(n + 4, n_rows)):
                        out[0, r] = _dot_w1x1(kind, qs[r:r + 1], qh[r:r + 1], d[r:r + 1],
                                              m[r:r + 1], sc[r:r + 1], mn[r:r + 1], xq, dx,
                                              xsum, qsum)[0]


depend_on(globals(), "qdot_ir_cpu.py", "qdot8_ir_cpu.py", "qdot_kernels_cpu.py")  # in the cache key
