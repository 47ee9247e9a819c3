"""GGUF-quantized matrix-vector products on the CPU, read straight from the repacked layout.

Every type of `quant.QuantWeight` (q4_0 ... q6_k) is multiplied in its own bits: a row's codes
are unpacked 32 at a time and multiplied by the activations group by group. The arrays hold
the GGUF's bytes (k-quants +0.125 bit per weight: their 6-bit sub-scales as bytes; q6_k's high
bits regrouped per 256-block, `_q6_k_high`): where K is whole 256-blocks and N a multiple of
4, four rows interleaved block by block (`interleave`, a copy made at `prepare`: one stream
from memory per 4 rows; the real Qwen2.5-Coder-1.5B's decode-step matvecs 1.16x on int8), but
with int8 activations not the long rows of `ROW_MAJOR_MIN_K`; else QuantWeight's own arrays,
row-major, shared with it.

  qtype  one group of 32 codes q (unsigned, qh's bits above qs's nibble)  w
  q4_0   qs nibbles                                                       d (q - 8)
  q4_1   qs nibbles                                                       d q + m
  q5_0   qs nibbles | qh bit << 4                                          d (q - 16)
  q5_1   qs nibbles | qh bit << 4                                          d q + m
  q8_0   qs as int8                                                       d q
  q4_k   qs nibbles                                                       (d sc) q - dmin mn
  q5_k   qs nibbles | qh bit << 4                                          (d sc) q - dmin mn
  q6_k   qs nibbles | qh 2 bits << 4 (regrouped per block)                 (d sc) (q - 32), sc per 16

Batch invariance: an activation row's outputs are the same bits whether `matvec` takes it
alone or beside other rows (any number, any order), whichever intrinsic form runs it, so a
speculative verify step's rows equal plain decode steps and a request's tokens do not depend
on the requests beside it (tests/test_qdot_invariance.py).

`dequantize_rows` writes w as fp32, equal bit for bit to `quant.dequantize` (the same fp32
operations; every product is exact), or rounded to bf16 (the prefill path).

`matvec` computes y = x W^T as sum over groups of s * dx * sum(q xq) (+ offset * sum(x)): the
activations are quantized per group of 32 to int16 (xq = round(x / dx), dx = max|x| / 32767),
and each group's products summed exactly in int32 by pairs (x86's pmaddwd). The one loss is
that rounding, at most max|x of the group| / 65534 per element: ~2e-5 relative on a dot
product (tests/test_qdot_cpu.py bounds it), where bf16 activations lose ~4e-3 (and the int8
ones of llama.cpp's CPU kernels take steps 258x coarser). Per 32 weights that is 3 vector
operations after the unpacking, where fp32 arithmetic takes 6 (convert, multiply, scale, for
two 16-lane halves): 2.1-3.6x faster per call on in-cache matrices (AVX-512, one run).

With `activations="int8"` (CPUs with AVX-512 VNNI or AVX2; `--cpu-activations`, by default where the
CPU has it) x is rounded to int8 instead and one `vpdpbusd` multiplies two groups
(qdot8_kernels_cpu.py): outputs ~1-2% off in norm, as llama.cpp's CPU kernels', and 1.2-1.5x
less time for a decode step's matrices of most types (`bench/cpu_quant.py --kernels`).

Why explicit vectors. numba's loop vectorizer does not vectorize a 32-element group loop (it is
fully unrolled first and numba leaves the SLP vectorizer off) and widens integer arithmetic to
64 bits, so the unpacking runs scalar. The group decoding is therefore written once per type as
LLVM vector IR (qdot_ir_cpu.py) in numba intrinsics (qdot_kernels_cpu.py), with the loops: weight rows on
numba's threads (`prange`), 4 at a time for one activation row (their chains interleave: q8_0
+20%), each group decoded once for 4 activation rows when there are several.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .quant import QuantWeight

try:
    import numba

    from . import qdot8_kernels_cpu
    from .qdot_ir_cpu import FIELDS, KINDS
    from .qdot_kernels_cpu import dequant_kernel, matvec_kernel
except ImportError:  # no numba: quant_cpu.py keeps torch's int4 packed kernel for every type
    numba = qdot8_kernels_cpu = None
    FIELDS = ("qs", "qh", "d", "m", "sc", "mn")
    KINDS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")

_HALF_FIELDS = ("d", "m")


def available() -> bool:
    return numba is not None


def int8_available() -> bool:
    """Whether `set_activations("int8")` can take effect: numba and AVX-512 VNNI or AVX2."""
    return numba is not None and qdot8_kernels_cpu.AVAILABLE


def _check_int8(kind: str) -> None:
    if kind == "int8" and not int8_available():
        raise ValueError("int8 activations need numba and a CPU with AVX-512 VNNI "
                         "(avx512vnni, avx512bw) or AVX2; this one lacks them")


ACTIVATIONS = ["int16"]
"""How `matvec` quantizes the activations of the weights `prepare`d from now on: "int16" (~2e-5
relative) or "int8" (qdot8_kernels_cpu.py: AVX-512 VNNI or AVX2; ~1% as llama.cpp's CPU kernels).
An engine sets it from `--cpu-activations` (`set_activations`) before it loads its weights;
each weight keeps its own (`CpuQuant.activations`), so engines of either kind coexist."""


def set_activations(kind: str) -> str:
    """Sets `ACTIVATIONS` ("auto": int8 where `int8_available`, else int16); returns the kind
    in effect. "int8" on a CPU without VNNI or AVX2 is refused."""
    if kind == "auto":
        kind = "int8" if int8_available() else "int16"
    if kind not in ("int16", "int8"):
        raise ValueError(f"activations must be auto, int16 or int8, not {kind!r}")
    _check_int8(kind)
    ACTIVATIONS[0] = kind
    return kind


@dataclass
class CpuQuant:
    """A QuantWeight as this module reads it: numpy views of its arrays, [N, ...] row-major
    each, integer fields as uint8 (q8_0's codes and q6_k's scales are int8 to the kernel), the
    fp16 `d` and `m` as uint16 (numba has no fp16; the kernel widens them); a field the type
    lacks is an empty [N, 0] array. `activations`: how `matvec` rounds x for this weight
    ("int16" or "int8", `ACTIVATIONS` when it was prepared). `interleaved`: the arrays are
    [N / 4, ...], four rows interleaved by 256-block (`interleave`)."""
    qtype: str
    shape: tuple[int, int]  # (N, K)
    arrays: tuple[np.ndarray, ...]  # in FIELDS order
    out_dtype: torch.dtype
    activations: str = "int16"
    interleaved: bool = False  # the arrays' rows are 4 rows each (`interleave`)

    @property
    def kind(self) -> int:
        return KINDS.index(self.qtype)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


INTERLEAVED = [True]
"""`prepare`'s default for `interleaved` (benchmarks and tests turn it off to compare)."""


def prepare(w: QuantWeight, out_dtype: torch.dtype = torch.float32,
            activations: str | None = None, interleaved: bool | None = None) -> CpuQuant:
    """`w`'s arrays, multiplied on `activations` (default `ACTIVATIONS`): interleaved by 4 rows
    (`interleave`, a copy) where `interleaved` (default `INTERLEAVED`) and the shape allows
    (`interleaves`), else as views (no copy); compiles the kernels (or reads numba's cache) at
    the first call, so that loading, not the first request, pays for it."""
    activations = activations or ACTIVATIONS[0]
    interleaved = INTERLEAVED[0] if interleaved is None else interleaved
    _check_int8(activations)
    warm_up(activations)
    n = w.shape[0]
    arrays = []
    for name in FIELDS:
        t = getattr(w, name)
        dtype = np.uint16 if name in _HALF_FIELDS else np.uint8
        if t is None:
            arrays.append(np.empty((n, 0), dtype))
        elif name == "qh" and w.qtype == "q6_k":
            arrays.append(_q6_k_high(t.numpy()))
        else:
            arrays.append(np.ascontiguousarray(t.contiguous().numpy().view(dtype)))
    if interleaved and interleaves(tuple(w.shape), w.qtype, activations):
        return CpuQuant(w.qtype, tuple(w.shape), interleave(arrays, w.shape[1]), out_dtype,
                        activations, True)
    return CpuQuant(w.qtype, tuple(w.shape), tuple(arrays), out_dtype, activations)


INTERLEAVE_ROWS = 4
"""Rows of a weight that `interleave` stores block by block in turn (qdot_ir_cpu.INTERLEAVE)."""


def interleaves(shape: tuple[int, int], qtype: str = "q4_k", activations: str = "int16") -> bool:
    """Whether `prepare` interleaves a weight of this shape, type and activations: whole
    256-blocks (every k-quant) and rows in fours, and (int8) K below `ROW_MAJOR_MIN_K`."""
    n, k = shape
    return k % 256 == 0 and k > 0 and n % INTERLEAVE_ROWS == 0 and n > 0 and \
        not (activations == "int8" and k >= ROW_MAJOR_MIN_K[qtype])


ROW_MAJOR_MIN_K = {"q4_0": 8192, "q4_1": 8192, "q5_0": 8192, "q5_1": 8192, "q8_0": 896,
                   "q4_k": 1 << 62, "q5_k": 8192, "q6_k": 3072}
"""int8 activations: weights of at least this K stay row-major (and go one row at a time,
`ONE_ROW_MIN_K`), which streams from memory as fast as 4 interleaved rows or faster for
these types. Random weights from DRAM, both layouts alternating in one process, 2 threads,
Zen 5, interleaved time over row-major (`python bench/cpu_interleave.py --models "" --random
...`, `bench/results/cpu/cpu_interleave_session31_random.json`, `_random2.json`): q8_0 0.77-0.93
at K = 1,536-14,336 (row-major one row from 896); q6_k 0.95-1.00 at 4,096-14,336, 1.24 at 1,536
(one row from 3,072); q4_0, q4_1, q5_0, q5_k 0.89-1.06 at 8,960-14,336, 1.01-1.34 at 4,096 and
1.05-1.26 at 1,536; q4_k 1.41 at 14,336, 1.14-1.76 below (its one-row kernel reads five
streams). int16 activations interleave at every K (their rows go 4 at a time either way;
`_random_int16.json`: q8_0 1.14-1.18, q5_0 1.02-1.68, q6_k 0.97-1.65)."""


def interleave(arrays, k: int) -> tuple[np.ndarray, ...]:
    """Each field [N, width] -> [N / 4, 4 width]: row j holds rows 4j .. 4j + 3's 256-blocks in
    turn (block 0 of the four rows, then block 1, ...). A matvec then reads one stream per 4
    weight rows instead of one per row and field (q4_k: 20 a thread), which the hardware
    prefetcher follows faster: random q4_k matrices from DRAM 1.14-1.76x on Zen 5 (int8; the
    other types' long rows: `ROW_MAJOR_MIN_K`)."""
    blocks, out = k // 256, []
    for a in arrays:
        n, width = a.shape
        if width == 0:
            out.append(np.empty((n // INTERLEAVE_ROWS, 0), a.dtype))
            continue
        per = width // blocks
        out.append(np.ascontiguousarray(
            a.reshape(n // INTERLEAVE_ROWS, INTERLEAVE_ROWS, blocks, per).transpose(0, 2, 1, 3)
        ).reshape(n // INTERLEAVE_ROWS, INTERLEAVE_ROWS * width))
    return tuple(out)


def _q6_k_high(qh: np.ndarray) -> np.ndarray:
    """q6_k's high bits, 2 per code (bits 2 (k % 4) and 2 (k % 4) + 1 of byte k / 4), regrouped
    per block of 8 groups in the int8 kernels' block order (qdot8_ir_cpu.QUARTERS): byte
    16j + t of a block's 64 holds in bits 2v, 2v + 1 those of code 16h + t of group 4c + j,
    v = 2c + h. The same bytes; a block's four vectors of codes take theirs from one 64-byte
    load, a shift and a mask each, a single group from 16 bytes. uint8 [N, K/4] -> [N, K/4]."""
    n = qh.shape[0]
    out = np.empty_like(qh)
    for r in range(0, n, 4096):  # bounded scratch (the LM head: 151,936 rows)
        part = qh[r:r + 4096]
        pairs = (part[..., None] >> np.arange(0, 8, 2, dtype=np.uint8)) & 3  # [R, K/4, 4]
        pairs = pairs.reshape(part.shape[0], -1, 2, 4, 2, 16)  # [R, block, c, j, h, t]: code k
        high = np.zeros((part.shape[0], pairs.shape[1], 4, 16), np.uint8)
        for c in (0, 1):
            for h in (0, 1):
                high |= pairs[:, :, c, :, h, :] << np.uint8(2 * (2 * c + h))
        out[r:r + 4096] = high.reshape(part.shape[0], -1)
    return out


@functools.cache
def warm_up(activations: str = "int16") -> None:
    """Compiles the kernels (or reads numba's cache): those of `activations` for `matvec`."""
    n, k = 4, 32
    w = CpuQuant("q8_0", (n, k), tuple(np.zeros((n, size), dtype) for size, dtype in (
        (k, np.uint8), (0, np.uint8), (1, np.uint16), (0, np.uint16), (0, np.uint8),
        (0, np.uint8))), torch.float32)
    x, out = np.zeros((2, k), np.float32), np.zeros((2, 2 * n), np.float32)
    kernel, bits = ((qdot8_kernels_cpu.matvec8_kernel, 8) if activations == "int8" else
                    (matvec_kernel, 16))
    for rows in (2, 1):  # a column slice (one part of a fused projection), then a whole buffer
        more = (False,) if bits == 8 else ()  # one_row
        kernel(w.kind, *w.arrays, x[:rows], *_scratch(4, k, bits), out[:rows, :n], 1, *more,
               False)
        kernel(w.kind, *w.arrays, x[:rows], *_scratch(4, k, bits), out[:rows, :n].copy(), 1,
               *more, False)
    dequantize_rows(w, 0, np.zeros((n, k), np.float32))
    dequantize_rows(w, 0, np.zeros((n, k), np.uint16))


def matvec(x: np.ndarray, w: CpuQuant, out: np.ndarray) -> None:
    """out[:, :] = x @ W^T. x: fp32 [M, K] C-contiguous; out: fp32 [M, N] (rows may be a
    strided view). Rows of W run on as many numba threads as torch uses, 4 at a time for one
    activation row; several activation rows go 4 at a time through each weight row
    (interleaved weights: 4 weight rows against 2 activation rows at a time)."""
    rows, k = x.shape
    if rows == 0:  # the kernel's one-row branch would write row 0 (a prefill chunk that is not
        return     # a prompt's last asks the LM head for no rows)
    padded = rows if rows == 1 else -(-rows // 4) * 4
    tasks = parallel_tasks()
    if w.activations == "int8":
        qdot8_kernels_cpu.matvec8_kernel(w.kind, *w.arrays, x, *_scratch(padded, k, 8), out,
                                         tasks, k >= ONE_ROW_MIN_K[w.qtype], w.interleaved)
    else:
        matvec_kernel(w.kind, *w.arrays, x, *_scratch(padded, k, 16), out, tasks,
                      w.interleaved)


ONE_ROW_MIN_K = {"q4_0": 3072, "q4_1": 3072, "q5_0": 3072, "q5_1": 3072, "q8_0": 896,
                 "q4_k": 8192, "q5_k": 4096, "q6_k": 3072}
"""int8 activations (`qdot8_kernels_cpu`), row-major weights (interleaved ones go 4 rows at a
time, `interleave`): one activation row against weight rows of at least
this many columns goes through them one weight row at a time (one stream from memory per
thread; the same sums, rounded within the same fp32 bound), shorter rows 4 at a time (their
dependent chains interleave). Chosen from `python bench/cpu_one_row.py --random ...` on Zen 5
(2 threads, weights from DRAM, both ways alternating in one process; 4-row time / 1-row time;
`bench/results/cpu/cpu_one_row_session30_random.json`, `_random2.json`, and two earlier runs
whose output was not kept): at K = 14,336 1.05-1.80 for every type; at 4,096 1.04-1.65; at
3,584 1.10-1.39 except q4_k (0.86-0.92) and q5_k (0.77-1.06); at 1,536-2,048 0.54-1.28 and
mixed, but q8_0 1.18-1.28 in every run; at 896 0.50-0.77 (q8_0 0.72 in one run, 1.16-1.28 in
three). The real 1.5B's down projections (K = 8,960): q6_k 1.39, q4_k 1.13; its whole decode
step's matvecs 1.05. The real 0.5B's q8_0 LM head (151,936 x 896) 1.17 / 1.18 in two runs,
its q8_0 v projections (128 x 896) 0.88 / 0.92 (0.015 ms a step), its step's matvecs 1.07 /
1.09 with q8_0 from 896 against 1.025 from 1,536 (the second run:
`cpu_one_row_session30_q8_896.json`). The int16 kernels stay at 4 rows (their q4_k lost 10% one
row at a time, their q6_k gained 15%)."""
SLOW_ONE_ROW_Q8_0 = qdot8_kernels_cpu is not None and qdot8_kernels_cpu.AVX2_ONLY
"""Without VNNI (q8_0's codes signed, `qdot8_ir_cpu.SIGNED`) q8_0 goes 4 rows at a time up to
K = 3,072. 2-core AVX2 EPYC, `python bench/cpu_one_row.py --random q8_0 --shapes
8960x1536,1536x8960,4096x3584,18944x896` (4-row / 1-row time): 0.80 at K = 896, 0.95 at 1,536,
1.34 at 3,584, 1.38 at 8,960; the real 0.5B's LM head 0.82, its decode step's matvecs 0.96
(`bench/results/cpu/cpu_one_row_avx2_session52*.json`). Its rows from K = 896 stay row-major
(`ROW_MAJOR_MIN_K`): 4 of them at a time ran as fast as 4 interleaved ones at K = 1,536 and
2,048 (0.99x, `cpu_interleave_avx2_session52_q8_0.json`)."""
if SLOW_ONE_ROW_Q8_0:
    ONE_ROW_MIN_K["q8_0"] = 3072
TASKS_PER_THREAD = 4
"""Parallel iterations of a matvec per thread (`qdot_kernels_cpu.task_rows`)."""


_SCRATCH: dict[tuple[int, int, int], tuple[np.ndarray, ...]] = {}


def _scratch(rows: int, k: int, bits: int) -> tuple[np.ndarray, ...]:
    """The quantized activations' buffers (xq, dx, xsum, and for int8 qsum), reused from call
    to call (an allocation per call costs as much as a small matmul): one caller at a time, as
    the model runner is."""
    bufs = _SCRATCH.get((rows, k, bits))
    if bufs is None:
        bufs = (np.zeros((rows, k), np.int16 if bits == 16 else np.int8),
                np.ones((rows, k // 32), np.float32), np.zeros((rows, k // 32), np.float32))
        if bits == 8:
            bufs += (np.zeros((rows, k // 16), np.float32),)
        _SCRATCH[rows, k, bits] = bufs
    return bufs


def dequantize_rows(w: CpuQuant, start: int, out: np.ndarray) -> None:
    """out[r] = row start + r of W (out: [rows, K] C-contiguous, fp32, or uint16 for bf16 bits
    rounded to nearest even, as `Tensor.to(torch.bfloat16)`)."""
    use_torch_threads()
    dequant_kernel(w.kind, *w.arrays, start, out, w.interleaved)


def dequantize_ids(w: CpuQuant, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of W as fp32 [len(ids), K] (an embedding table's), bit for bit as
    `quant.dequantize`."""
    out = torch.empty(len(ids), w.shape[1])
    for i, row in enumerate(ids.tolist()):
        dequantize_rows(w, row, out[i:i + 1].numpy())
    return out


_THREADS = threading.local()


def parallel_tasks() -> int:
    """`use_torch_threads`, then the parallel iterations a matvec runs in (`TASKS_PER_THREAD` a
    thread; half_cpu.py's too)."""
    use_torch_threads()
    return _THREADS.tasks


def use_torch_threads() -> None:
    """Runs numba's parallel kernels on as many threads as torch's (`--cpu-threads`), handing
    out their iterations one at a time (dynamic scheduling). numba's settings are per calling
    thread (the engine may step from its own)."""
    n = torch.get_num_threads()
    if getattr(_THREADS, "n", None) != n:
        threads = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(threads)
        numba.set_parallel_chunksize(1)
        _THREADS.n, _THREADS.tasks = n, TASKS_PER_THREAD * threads
