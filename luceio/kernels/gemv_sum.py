"""What the quantized GEMVs share after their K loop (`quant_gemv.py`'s dp4a kernel and
`quant_gemv_mma.py`'s tensor-core one): the sum over a program's group slots in one fixed order,
and the store (with the split-K partials summed in split order).

Why a fixed order: a verify step's rows must give the bits each row gives alone (the decode
steps they stand for), and the two kernels lay their accumulators out differently (slots on
the lanes of one warp; slots as the batch axis of a batched tensor-core dot). `tl.sum` over an
axis adds in an order that follows the layout, so both sum their S slots as one explicit tree
instead: slot i + slot i + S/2, then the same on the S/2 results, ... (a size-2 axis sums as
one addition, and fp addition is commutative, so the tree fixes every rounding). With the slots
on the lanes this is the butterfly a warp reduction does anyway: no extra data movement.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _halve_last(acc, BM: tl.constexpr, BN: tl.constexpr, S: tl.constexpr):
    return tl.sum(tl.reshape(acc, [BM, BN, 2, S // 2]), 2)


@triton.jit
def slot_sum_last(acc, BM: tl.constexpr, BN: tl.constexpr, S: tl.constexpr):
    """[BM, BN, S] (S a power of two <= 256) -> [BM, BN]: the tree of the module docstring."""
    if S >= 2:
        acc = _halve_last(acc, BM, BN, S)
    if S >= 4:
        acc = _halve_last(acc, BM, BN, S // 2)
    if S >= 8:
        acc = _halve_last(acc, BM, BN, S // 4)
    if S >= 16:
        acc = _halve_last(acc, BM, BN, S // 8)
    if S >= 32:
        acc = _halve_last(acc, BM, BN, S // 16)
    if S >= 64:
        acc = _halve_last(acc, BM, BN, S // 32)
    if S >= 128:
        acc = _halve_last(acc, BM, BN, S // 64)
    if S >= 256:
        acc = _halve_last(acc, BM, BN, S // 128)
    return tl.reshape(acc, [BM, BN])


@triton.jit
def _halve_first(acc, BM: tl.constexpr, BN: tl.constexpr, S: tl.constexpr):
    return tl.sum(tl.reshape(acc, [2, S // 2, BM, BN]), 0)


@triton.jit
def slot_sum_first(acc, BM: tl.constexpr, BN: tl.constexpr, S: tl.constexpr):
    """[S, BM, BN] -> [BM, BN], the same tree as `slot_sum_last` (slot i + slot i + S/2 ...)."""
    if S >= 2:
        acc = _halve_first(acc, BM, BN, S)
    if S >= 4:
        acc = _halve_first(acc, BM, BN, S // 2)
    if S >= 8:
        acc = _halve_first(acc, BM, BN, S // 4)
    if S >= 16:
        acc = _halve_first(acc, BM, BN, S // 8)
    if S >= 32:
        acc = _halve_first(acc, BM, BN, S // 16)
    if S >= 64:
        acc = _halve_first(acc, BM, BN, S // 32)
    if S >= 128:
        acc = _halve_first(acc, BM, BN, S // 64)
    if S >= 256:
        acc = _halve_first(acc, BM, BN, S // 128)
    return tl.reshape(acc, [BM, BN])


@triton.jit
def store_rows(y, mi, rows, pid_n, split, nsplit, M, N, bias_ptr, out_ptr, part_ptr, cnt_ptr,
               s_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """Stores y [BLOCK_M, BLOCK_N] (rows `mi` of x, output features `rows`) + bias. With
    SPLIT, each split writes its partial; the last split of this row block to finish (an
    acq_rel counter) sums all partials in split order, so the result does not depend on which
    program finished last, and resets the counter for the next launch."""
    nmask = rows < N
    omask = (mi < M)[:, None] & nmask[None, :]
    cols = rows[None, :]
    if SPLIT:
        tl.store(part_ptr + (split * M + mi[:, None]).to(tl.int64) * N + cols, y, mask=omask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == nsplit - 1:
            y = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, nsplit):
                y += tl.load(part_ptr + (s * M + mi[:, None]).to(tl.int64) * N + cols,
                             mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                y += tl.load(bias_ptr + cols, mask=nmask[None, :], other=0.0).to(tl.float32)
            tl.store(out_ptr + mi[:, None] * s_om + cols, y.to(out_ptr.dtype.element_ty),
                     mask=omask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=nmask[None, :], other=0.0).to(tl.float32)
        tl.store(out_ptr + mi[:, None] * s_om + cols, y.to(out_ptr.dtype.element_ty),
                 mask=omask)
