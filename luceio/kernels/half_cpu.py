"""16-bit dense weights (bf16, fp16) kept in 16 bits by an fp32 model on the CPU.

A checkpoint stored in bf16 or fp16 (most safetensors checkpoints; GGUF's BF16 and F16
tensors) loads into the CPU's fp32 model without a conversion: every bf16 or fp16 value is an
fp32 value exactly, so keeping the 16 bits loses nothing, and a decode step reads half the
bytes. `Linear` keeps such shards as a `CpuHalf` part (`keeps`), the tied LM head shares the
embedding's 16-bit table.

Every call runs a numba kernel: the weight's rows on numba's threads, each widened to fp32
exactly and multiplied with fp32 FMAs against one row of x at a time, so the outputs are those
of the fp32 model on the same values, reduced in another order (fp32 rounding;
tests/test_half_cpu.py). Decode and verify steps of fewer than `BLOCK_MIN_ROWS` rows take
`_rows_kernel` (one weight row at a time: the fastest stream out of memory), prefill steps and
larger ones `_blocks_kernel` (four weight rows against two rows of x: fewer loads); a row's
result depends only on its own x and which kernel runs, so a prompt's hidden states do not
depend on how its prefill was chunked, nor a decode row's on a batch of up to 7 others. The
prefill kernel beats the fp32 model's own GEMM (`bench/cpu_half.py --rows`: at 512 rows about
half the time of torch's fp32 matmul on a resident fp32 weight), so there is no dense path.

Why. On two cores, from 16-bit GGUFs of SmolLM2-135M, Qwen2.5-Coder-0.5B and 1.5B (real
shapes), decode as a share of llama.cpp's on the same files (`bench/cpu_half.py`, two runs):
the fp32 model with the weights widened at load 0.18-0.22x, the bf16 model (torch's bf16
matmuls on the module forward, ~100 small ops a layer) 0.26-0.51x, this path 0.74-1.17x. The
kernels are plain loops that LLVM vectorizes (a bf16 value is the top half of an fp32 word; an
fp16 one is widened by `vcvtph2ps`, numba having no fp16 type).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .numba_cache import depend_on
from . import qdot_cpu
from .quant_cpu import in_prefill

try:
    import numba
    from llvmlite import ir
    from numba import prange, types
    from numba.extending import intrinsic, overload

    from .qdot_kernels_cpu import task_rows
except ImportError:  # no numba: 16-bit weights are widened at load as before
    numba = None

QTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""The dtypes kept, as `weight_kind` names them."""
_BITS = {"bfloat16": torch.uint16, "float16": torch.int16}
"""How the kernel sees a type's bits: bf16 as uint16, fp16 as int16 (one compiled loop per
numpy dtype picks the widening)."""


BLOCK_MIN_ROWS = 8
"""Decode and verify steps of this many rows take the prefill kernel too (as quant_cpu's
`QDOT_DENSE_MIN_ROWS`): 9,728 x 896 at 4 / 16 rows, 0.48 / 2.79 ms on the decode kernel, 0.60 /
1.22 ms on the prefill one (`bench/cpu_half.py --rows`)."""


def available() -> bool:
    return numba is not None


def keeps(value: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a dense shard stays in its 16 bits: a bf16 or fp16 tensor for an fp32 model on
    the CPU, with numba and the default kernels (`LUCEIO_KERNELS=torch` keeps the references'
    fp32 weights)."""
    from . import kernel_mode
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and
            value.dtype in QTYPES and available() and kernel_mode() == "auto")


@dataclass
class CpuHalf:
    """A [N, K] weight in bf16 or fp16, and its bits as the kernel reads them."""
    qtype: str  # "bfloat16" | "float16"
    tensor: torch.Tensor  # [N, K] C-contiguous, bf16 or fp16
    bits: np.ndarray  # the same memory, uint16 (bf16) or int16 (fp16)
    out_dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * 2


def prepare(t: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> CpuHalf:
    """A 16-bit [N, K] tensor as a `CpuHalf` (no copy when it is contiguous)."""
    qtype = QTYPES[t.dtype]
    t = t.contiguous()
    warm_up()
    bits = t.view(_BITS[qtype]).numpy()
    return CpuHalf(qtype, t, bits, out_dtype)


def matvec(x: np.ndarray, w: CpuHalf, out: np.ndarray, prefill: bool | None = None) -> None:
    """out[:, :] = x @ W^T. x: fp32 [M, K] C-contiguous; out: fp32 [M, N], rows may be a
    strided view (one part of a fused projection's output). `prefill` (default: whether the
    model runner is in a prefill step, `quant_cpu.prefill_rows`) or M >= `BLOCK_MIN_ROWS`:
    `_blocks_kernel`, else `_rows_kernel`."""
    if x.shape[0] == 0:
        return
    if prefill is None:
        prefill = in_prefill()
    kernel = _blocks_kernel if prefill or x.shape[0] >= BLOCK_MIN_ROWS else _rows_kernel
    kernel(w.bits, x, out, qdot_cpu.parallel_tasks())


def linear(x: torch.Tensor, w: CpuHalf, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in `w.out_dtype` (`matvec`, any M)."""
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    matvec(x.numpy(), w, y.numpy())
    y = y.to(w.out_dtype)
    return y if bias is None else y + bias


@functools.cache
def warm_up() -> None:
    """Compiles the kernels for both types (or reads numba's cache) once, at load."""
    if numba is None:
        return
    for dtype in _BITS.values():
        w = torch.zeros(5, 3, dtype=dtype).numpy()
        for rows in (1, 2):
            out = np.zeros((rows, 10), np.float32)
            for kernel in (_rows_kernel, _blocks_kernel):
                kernel(w, np.ones((rows, 3), np.float32), out[:, :5], 2)


if numba is not None:
    @intrinsic
    def _from_f16(typingctx, bits):
        """fp16 bits (int16) -> fp32, exactly (LLVM's fpext: vcvtph2ps when vectorized)."""
        def codegen(context, b, sig, args):
            return b.fpext(b.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.int16), codegen

    def _widen(v):
        """A 16-bit weight as fp32: bf16 bits (uint16) or fp16 bits (int16)."""

    @overload(_widen, inline="always")
    def _widen_impl(v):
        if v == types.int16:
            return lambda v: _from_f16(v)
        return lambda v: np.uint32(np.uint32(v) << np.uint32(16)).view(np.float32)

    @numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
    def _row(w, x, out, r):
        """out[i, r] = w[r] . x[i] for every row i of x."""
        for i in range(x.shape[0]):
            a = np.float32(0)
            for j in range(w.shape[1]):
                a += _widen(w[r, j]) * x[i, j]
            out[i, r] = a

    @numba.njit(parallel=True, cache=True, nogil=True, fastmath=True)
    def _rows_kernel(w, x, out, tasks):
        """Decode: rows of w in `tasks` parallel iterations (qdot_kernels_cpu's `task_rows`),
        one at a time, each against every row of x. One weight row at a time streams faster
        than four interleaved (the hardware prefetchers follow fewer streams): bf16 out of
        cache, 2 threads, alternating, 17,920 x 1,536 61.0 against 43.9 GB/s, 151,936 x
        1,536 51.7 against 42.1, 896 x 896 59.8 against 50.3, 1,536 x 8,960 41.1 / 41.3."""
        n = w.shape[0]
        step = task_rows(n, tasks)
        for c in prange(-(-n // step)):
            for r in range(step * c, min(n, step * (c + 1))):
                _row(w, x, out, r)

    @numba.njit(parallel=True, cache=True, nogil=True, fastmath=True)
    def _blocks_kernel(w, x, out, tasks):
        """Prefill: as `_rows_kernel`, but 4 rows of w against 2 rows of x at a time (each
        weight load used twice, each x load four times; an odd last row of x is paired with
        itself, so every row goes through the same loop); a tail of 1-3 weight rows one by
        one. 9,728 x 896 at 512 rows of x: 23.6 ms, against 31.5 with one row of x at a time
        and 46.1 for torch's fp32 matmul on a resident fp32 weight."""
        n, k = w.shape
        m = x.shape[0]
        step = task_rows(n, tasks)
        for c in prange(-(-n // step)):
            for r in range(step * c, min(n, step * (c + 1)), 4):
                if r + 4 <= n:
                    for i in range(0, m, 2):
                        i1 = min(i + 1, m - 1)
                        a0 = np.float32(0)
                        a1 = np.float32(0)
                        a2 = np.float32(0)
                        a3 = np.float32(0)
                        b0 = np.float32(0)
                        b1 = np.float32(0)
                        b2 = np.float32(0)
                        b3 = np.float32(0)
                        for j in range(k):
                            xv = x[i, j]
                            yv = x[i1, j]
                            w0 = _widen(w[r, j])
                            w1 = _widen(w[r + 1, j])
                            w2 = _widen(w[r + 2, j])
                            w3 = _widen(w[r + 3, j])
                            a0 += w0 * xv
                            a1 += w1 * xv
                            a2 += w2 * xv
                            a3 += w3 * xv
                            b0 += w0 * yv
                            b1 += w1 * yv
                            b2 += w2 * yv
                            b3 += w3 * yv
                        out[i, r] = a0
                        out[i, r + 1] = a1
                        out[i, r + 2] = a2
                        out[i, r + 3] = a3
                        out[i1, r] = b0
                        out[i1, r + 1] = b1
                        out[i1, r + 2] = b2
                        out[i1, r + 3] = b3
                else:
                    for q in range(r, n):
                        _row(w, x, out, q)


if numba is not None:
    depend_on(globals(), "qdot_kernels_cpu.py")  # `task_rows`: in the cache key
