"""torch's CPU int4pack weights read back as bf16: the dense (prefill) path of quant_cpu.py.

`torch._convert_weight_to_int4pack_for_cpu` stores rows in blocks of BLOCK_N (64 where ATen runs
its AVX-512 kernels, 32 for AVX2), block after block. For each k a full block holds BLOCK_N / 2
bytes, byte b carrying row b in its low nibble and row b + BLOCK_N / 2 in its high one; the last,
partial block (16, 32 or 48 rows) holds row 2b and row 2b + 1 instead, as do all blocks where
ATen has no vector kernel. The layout is torch's internal: `layout()` finds it by packing a probe
at first use, and without numba or without a match `available()` is False.

`dequantize_t` writes W^T (bf16 [K, rows], what a GEMM with x [M, K] on the left reads) for a
range of rows that `tiles` cuts, from the packed bytes and the per-chunk scale and zero that
`fold_scales` derives from the kernel's (scale, zero) per 32 codes. Numba, one core, about
0.7-0.9 ns per weight on the machine of quant_cpu.py's numbers; serial, because numba's
parallel=True cost the inner loop its vectorization (3x slower on one thread).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

try:
    import numba
except ImportError:  # no numba: no dense path (quant_cpu runs every M on the packed kernel)
    numba = None

GROUP = 32
"""The packed kernel's group along K: one (scale, zero) per 32 codes of a row."""


def available() -> bool:
    return numba is not None and layout() is not None


@functools.cache
def layout() -> tuple[int, bool] | None:
    """(BLOCK_N, whether full blocks split rows in halves) of this torch build and CPU."""
    if numba is None:
        return None
    g = torch.Generator().manual_seed(0)
    n, k = 176, 64  # two full 64-row blocks and a 48-row tail (or 5 32-row blocks and 16)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1).view(-1).numpy()
    scale, zero = np.ones((k // GROUP, n), np.float32), np.full((k // GROUP, n), -8, np.float32)
    expected = (codes - 8).t().to(torch.bfloat16)
    for candidate in ((64, True), (32, True), (32, False), (64, False)):
        outs = [torch.empty(k, b - a, dtype=torch.bfloat16) for a, b in tiles(n, candidate, 64)]
        for (a, b), out in zip(tiles(n, candidate, 64), outs):
            dequantize_t(packed, scale, zero, GROUP, (1,), candidate, a, b, out)
        if torch.equal(torch.cat(outs, dim=1), expected):
            return candidate
    return None


def fold_scales(scales_zeros: torch.Tensor, chunk: int, factors: tuple[int, ...]):
    """The kernel's bf16 [planes * K / 32, N padded, 2] (scale, zero) -> fp32 [K / chunk,
    N padded] scale and zero of each chunk, all planes folded in, codes taken unsigned: W[n, k] =
    (sum over planes of factor * code) * scale + zero. The planes of a chunk must share their
    scale (quant_cpu's mappings put the high bits' weight in the factor, not the scale)."""
    kp, n_pad = scales_zeros.shape[0] * GROUP, scales_zeros.shape[1]
    scale = torch.empty(kp // len(factors) // chunk, n_pad)
    zero = torch.empty_like(scale)
    _fold_scales(scales_zeros.view(torch.int16).numpy().view(np.uint16), chunk,
                 np.asarray(factors, np.int64), scale.numpy(), zero.numpy())
    return scale, zero


def tiles(n_pad: int, layout: tuple[int, bool], rows: int):
    """[start, stop) row ranges: whole blocks of the split layout, then the paired rest."""
    block_n, halves = layout
    split = n_pad // block_n * block_n if halves else 0
    yield from ((a, min(a + rows, split)) for a in range(0, split, rows))
    if split < n_pad:
        yield split, n_pad


def dequantize_t(packed, scale, zero, chunk, factors, layout, start, stop, out) -> None:
    """Rows [start, stop) (one kind of block, as `tiles` cuts them) of the weight, transposed,
    into out: contiguous bf16 [K, rows]. packed: the int4pack bytes, flat, of [N padded,
    planes * K] (planes = len(factors)); scale, zero: numpy fp32 [K / chunk, N padded], as
    `fold_scales`: W[n, k] = (sum over planes of factor * code) * scale + zero."""
    block_n, halves = layout
    k, n_pad = out.shape[0], scale.shape[1]
    bits = out.view(torch.int16).numpy().view(np.uint16)
    split = n_pad // block_n * block_n if halves else 0
    if stop <= split:
        blocks = packed[:split * len(factors) * k // 2].reshape(-1, len(factors) * k, block_n // 2)
        _dequantizer(block_n // 2, chunk, factors)(blocks, scale, zero, start // block_n, bits)
    else:
        _dequant_pairs(packed, scale, zero, chunk, np.asarray(factors, np.int64), block_n, n_pad,
                       start, bits)


_SCRATCH: list[torch.Tensor] = []


def scratch(numel: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A buffer of numel `dtype` elements, the same memory for every call: a fresh one costs
    its page faults on each call (a third of the dequantization's time). Valid until the next
    call."""
    nbytes = numel * dtype.itemsize
    if not _SCRATCH or _SCRATCH[0].numel() < nbytes:
        _SCRATCH[:] = [torch.empty(nbytes, dtype=torch.uint8)]
    return _SCRATCH[0][:nbytes].view(dtype)


def warm_up(chunk: int, factors: tuple[int, ...]) -> None:
    """Compiles (or reads from numba's cache) the code for these weights: at load, not at the
    first prefill."""
    block_n, halves = layout()
    if halves:
        _dequantizer(block_n // 2, chunk, factors)
    fold_scales(torch.zeros(len(factors), 16, 2, dtype=torch.bfloat16), chunk, factors)


def _njit(fn):
    return numba.njit(cache=True, nogil=True, fastmath=True)(fn) if numba else fn


def _njit_inline(fn):
    return numba.njit(cache=True, inline="always")(fn) if numba else fn


@_njit_inline
def from_bf16(bits):
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@_njit_inline
def to_bf16(v):
    """fp32 -> bf16 bits, rounded to nearest even (as torch's `.to(torch.bfloat16)`)."""
    u = np.float32(v).view(np.uint32)
    rounded = np.uint32(u + np.uint32(0x7FFF) + np.uint32((u >> np.uint32(16)) & np.uint32(1)))
    return np.uint16(rounded >> np.uint32(16))


@functools.cache
def _dequantizer(half: int, chunk: int, factors: tuple[int, ...]):
    """Dequantizes the full blocks of a layout that splits their rows in halves of `half`, for
    weights of this chunk and these plane factors. All are constants of the compiled code: as
    arguments (or with the blocks seen through a reshape or a slice inside), LLVM vectorizes the
    inner loop worse or not at all, 1.5-10x slower. Serial: numba's parallel=True costs the same."""
    planes = len(factors)
    f1 = factors[-1]

    @numba.njit(cache=True, nogil=True, fastmath=True)
    def dequant(blocks, scale, zero, nb_start, out):
        """blocks: uint8 [num_blocks, planes * K, half], torch's int4pack of [n_pad, planes * K]
        cut by block; scale, zero: fp32 [K / chunk, n_pad] (`fold_scales`). Writes blocks
        [nb_start, nb_start + out rows / (2 half)) transposed, rounded to bf16: out uint16
        [K, rows]."""
        k = out.shape[0]
        for nb in range(nb_start, nb_start + out.shape[1] // (2 * half)):
            n0 = nb * 2 * half
            o = n0 - nb_start * 2 * half  # column of row n0 in out
            for kk in range(k):
                c = kk // chunk
                kq = c * planes * chunk + kk % chunk  # plane 0's position in K'
                for d in range(half):
                    b = blocks[nb, kq, d]
                    b1 = blocks[nb, kq + chunk, d] if planes == 2 else 0
                    for h in range(2):
                        n = n0 + d + half * h
                        q = (b >> (4 * h)) & 15
                        if planes == 2:
                            q += f1 * ((b1 >> (4 * h)) & 15)
                        out[kk, o + d + half * h] = to_bf16(np.float32(q) * scale[c, n]
                                                             + zero[c, n])

    blocks = np.zeros((1, 32 * planes, half), np.uint8)  # compile now
    scale = np.zeros((32 // chunk, 2 * half), np.float32)
    dequant(blocks, scale, scale, 0, np.zeros((32, 2 * half), np.uint16))
    return dequant


@_njit
def _fold_scales(sz, chunk, factors, scale, zero):
    """sz: bf16 bits [planes * K / 32, n_pad, 2] -> `fold_scales` into scale, zero."""
    planes = len(factors)
    for c in range(scale.shape[0]):
        for n in range(scale.shape[1]):
            zero[c, n] = 0
        for p in range(planes):
            g = (c * planes + p) * chunk // 32
            for n in range(scale.shape[1]):
                s = from_bf16(sz[g, n, 0])
                if p == 0:
                    scale[c, n] = s
                zero[c, n] += factors[p] * (from_bf16(sz[g, n, 1]) - 8 * s)  # codes unsigned


@_njit
def _dequant_pairs(packed, scale, zero, chunk, factors, block_n, n_pad, start, out):
    """The same for rows [start, start + out rows) in blocks whose byte b holds rows 2b and 2b + 1
    (a partial last block, or every block where ATen has no vector kernel). packed: uint8 flat."""
    k = out.shape[0]
    planes = len(factors)
    for n in range(start, start + out.shape[1]):
        n0 = n - n % block_n
        size = min(block_n, n_pad - n0)
        at = n0 * planes * k // 2 + (n - n0) // 2
        shift = 4 * ((n - n0) % 2)
        for kk in range(k):
            c = kk // chunk
            q = 0
            for p in range(planes):
                kq = c * planes * chunk + p * chunk + kk % chunk
                q += factors[p] * ((packed[at + kq * size // 2] >> shift) & 15)
            out[kk, n - start] = to_bf16(np.float32(q) * scale[c, n] + zero[c, n])
