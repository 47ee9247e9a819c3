"""Quantized matmuls on the CPU: every GGUF type through torch's int4 packed kernel.

DOCSTRING-PLACEHOLDER
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .quant import QuantWeight, _codes

try:
    import numba
except ImportError:  # no numba: every M runs on the packed kernel (correct, slower prefill)
    numba = None

GROUP = 32
"""The packed kernel's group along K: one bf16 (scale, zero) per 32 codes of a row."""
ROW_ALIGN = 16
"""`_convert_weight_to_int4pack_for_cpu` takes N a multiple of 16: rows are padded with zeros."""
PACK_ROWS = 8192
"""Rows packed per call at load (a multiple of 64, the kernel's row block): bounds the int32
codes the packer takes to PACK_ROWS * K' * 4 bytes."""
DENSE_MIN_ROWS = {1: 40, 2: 24}
"""Planes -> the smallest M that takes the dense path (dequantize to bf16, then oneDNN)."""
DENSE_TILE_BYTES = 16 << 20
"""The dense path dequantizes at most this many bytes of bf16 weight at a time."""


@dataclass
class CpuPacked:
    """One [N, K] weight in the packed kernel's layout: `planes` 4-bit planes along K.

    Row n of the weight is, for every chunk of `chunk` elements along K, the sum over planes p of
    `factors[p] * ((code - 8) * scale + zero)`; the kernel gets that as one matmul with K' =
    planes * K, the activations expanded to [M, K'] (chunk by chunk, plane p's copy times
    factors[p]) and one (scale, zero) per 32 codes of K'."""
    qtype: str
    shape: tuple[int, int]  # (N, K)
    packed: torch.Tensor  # uint8 [N padded to 16, planes * K / 2], torch's int4pack layout
    scales_zeros: torch.Tensor  # bf16 [planes * K / 32, N padded to 16, 2]
    chunk: int  # 32, or 16 for q6_k (its scales cover 16 elements)
    factors: tuple[int, ...]  # one per plane; powers of two, so exact in bf16
    out_dtype: torch.dtype

    @property
    def planes(self) -> int:
        return len(self.factors)

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.scales_zeros.numel() * self.scales_zeros.element_size())


# ---- load: QuantWeight -> planes -> packed --------------------------------------------------

def prepare_cpu_weight(w: QuantWeight, act_dtype: torch.dtype = torch.bfloat16) -> CpuPacked:
    """Packs `w` (on the CPU) for `cpu_quant_linear`, once at load. The kernel computes with bf16
    activations and bf16 scales; `act_dtype` is the dtype of the outputs it hands back."""
    n, k = w.shape
    chunk, factors = _PLANE_LAYOUT[w.qtype]
    n_pad = -(-n // ROW_ALIGN) * ROW_ALIGN
    packed, scales, zeros = [], [], []
    for start in range(0, n, PACK_ROWS):
        stop = min(n, start + PACK_ROWS)
        rows = QuantWeight(w.qtype, (stop - start, k),
                           **{name: t[start:stop] for name, t in w.tensors().items()})
        codes, scale, zero = _planes(rows)
        pad = n_pad - n if stop == n else 0
        codes = torch.nn.functional.pad(codes.to(torch.int32), (0, 0, 0, pad), value=8)
        packed.append(torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        scales.append(scale)
        zeros.append(zero)
    scale = torch.nn.functional.pad(torch.cat(scales), (0, 0, 0, n_pad - n))
    zero = torch.nn.functional.pad(torch.cat(zeros), (0, 0, 0, n_pad - n))
    scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).to(torch.bfloat16).contiguous()
    if _dense_path_available():
        _warm_up(chunk, len(factors))  # now, not at the first prefill
    return CpuPacked(w.qtype, (n, k), torch.cat(packed), scales_zeros, chunk, factors, act_dtype)


_PLANE_LAYOUT = {"q4_0": (32, (1,)), "q4_1": (32, (1,)), "q4_k": (32, (1,)),
                 "q5_0": (32, (1, 16)), "q5_1": (32, (1, 16)), "q5_k": (32, (1, 16)),
                 "q8_0": (32, (1, 16)), "q6_k": (16, (1, 8))}
"""qtype -> (chunk, activation factor per plane), as in `CpuPacked`."""


def _planes(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K'] (0..15, K' = planes * K in the chunk-interleaved order), and fp32
    scale, zero [N, K' / 32], such that the planes sum to `dequantize(w)` exactly in fp32."""
    n, k = w.shape
    q = _codes(w)  # [N, K/32, 32]
    d = w.d.float()
    if w.qtype == "q6_k":  # value = s * (lo - 8) + 8 s * (2 hi - 3) = s * (q - 32)
        q = q.view(n, k // 16, 16)
        codes = torch.stack([q & 15, 2 * (q >> 4) + 5], dim=2)
        scale = d.repeat_interleave(16, dim=1) * w.sc.float()  # [N, K/16]: one K'-group each
        return codes.view(n, 2 * k), scale, torch.zeros_like(scale)
    if w.qtype in ("q4_k", "q5_k"):
        scale = d.repeat_interleave(8, dim=1) * w.sc.float()  # [N, K/32]
        offset = -w.m.float().repeat_interleave(8, dim=1) * w.mn.float()
    else:
        scale = d
        offset = w.m.float() if w.m is not None else torch.zeros_like(d)
    if w.qtype in ("q4_0", "q4_1", "q4_k"):  # (q - 8) s + (8 s + offset) = s q + offset
        zero = 8 * scale + offset if w.qtype != "q4_0" else offset
        return q.view(n, k), scale, zero
    # two planes: the low nibble, and the high bits (times 16 through the activations);
    # q5_0's offset -16 d and q8_0's sign live in the low plane's zero and the high codes
    if w.qtype == "q5_0":
        zero = -8 * scale
    elif w.qtype == "q8_0":  # q = lo + 16 * (q >> 4), q >> 4 in -8..7
        zero = 8 * scale
    else:
        zero = 8 * scale + offset
    codes = torch.stack([q & 15, (q >> 4) + 8], dim=2).to(torch.uint8)  # [N, K/32, 2, 32]
    scale2 = scale.repeat_interleave(2, dim=1)
    zero2 = torch.stack([zero, torch.zeros_like(zero)], dim=2).view(n, -1)
    return codes.view(n, 2 * k), scale2, zero2


# ---- the matmul -----------------------------------------------------------------------------

def cpu_quant_linear(x: torch.Tensor, w: CpuPacked, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in `w.out_dtype`: the packed kernel for small M (decode, verify), a
    dense bf16 matmul on a per-call dequantized copy for large M (prefill)."""
    m, k = x.shape
    n = w.shape[0]
    x = x.to(torch.bfloat16).contiguous()
    if m >= DENSE_MIN_ROWS[w.planes] and _dense_path_available():
        y = _dense_linear(x, w)
    else:
        y = torch._weight_int4pack_mm_for_cpu(_expand(x, w), w.packed, GROUP, w.scales_zeros)
    y = y[:, :n].to(w.out_dtype)
    return y if bias is None else y + bias


def _expand(x: torch.Tensor, w: CpuPacked) -> torch.Tensor:
    """[M, K] -> [M, K']: each chunk repeated once per plane, times the plane's factor."""
    if w.planes == 1:
        return x.contiguous()
    m, k = x.shape
    f = x.new_tensor(w.factors).view(1, 1, -1, 1)
    return (x.view(m, k // w.chunk, 1, w.chunk) * f).view(m, w.planes * k)


def _dense_linear(x: torch.Tensor, w: CpuPacked) -> torch.Tensor:
    layout = _int4pack_layout()
    k = w.shape[1]
    scale = w.scales_zeros[..., 0].float()
    zero = w.scales_zeros[..., 1].float() - 8 * scale  # so that a code q means q * scale + zero
    args = (w.packed.view(-1).numpy(), scale.numpy(), zero.numpy(), np.float32(w.factors[0]),
            np.float32(w.factors[-1]), w.planes, w.chunk, layout)
    tile = max(layout[0], DENSE_TILE_BYTES // (2 * k) // layout[0] * layout[0])
    outs = []
    for start, stop in _tiles(w.packed.shape[0], layout, tile):
        wt = _scratch(k * (stop - start)).view(k, stop - start)  # W^T of these rows
        _dequantize_t(*args, start, stop, wt)
        outs.append(x @ wt)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


# ---- dequantizing torch's int4pack layout -----------------------------------------------------
#
# `_convert_weight_to_int4pack_for_cpu` stores rows in blocks of BLOCK_N (64 where ATen runs its
# AVX-512 kernels, 32 for AVX2), block after block. For each k a full block holds BLOCK_N / 2
# bytes, byte b carrying row b in its low nibble and row b + BLOCK_N / 2 in its high one; the
# last, partial block (16, 32 or 48 rows) holds row 2b and row 2b + 1 instead, as do all blocks
# where ATen has no vector kernel. The layout is torch's internal: `_int4pack_layout` finds it
# by packing a probe, and without a match the dense path is off.

def _dense_path_available() -> bool:
    return numba is not None and _int4pack_layout() is not None


@functools.cache
def _int4pack_layout() -> tuple[int, bool] | None:
    """(BLOCK_N, whether full blocks split rows in halves) of this torch build and CPU."""
    if numba is None:
        return None
    g = torch.Generator().manual_seed(0)
    n, k = 176, 64  # two full 64-row blocks and a 48-row tail (or 5 32-row blocks and 16)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1).view(-1).numpy()
    scale, zero = np.ones((k // GROUP, n), np.float32), np.full((k // GROUP, n), -8, np.float32)
    expected = (codes - 8).t().to(torch.bfloat16)
    for layout in ((64, True), (32, True), (32, False), (64, False)):
        tiles = [torch.empty(k, b - a, dtype=torch.bfloat16) for a, b in _tiles(n, layout, 64)]
        for (a, b), out in zip(_tiles(n, layout, 64), tiles):
            _dequantize_t(packed, scale, zero, np.float32(1), np.float32(1), 1, GROUP, layout, a, b,
                          out)
        if torch.equal(torch.cat(tiles, dim=1), expected):
            return layout
    return None


def _tiles(n_pad: int, layout: tuple[int, bool], rows: int):
    """[start, stop) row ranges: whole blocks of the split layout, then the paired rest."""
    block_n, halves = layout
    split = n_pad // block_n * block_n if halves else 0
    yield from ((a, min(a + rows, split)) for a in range(0, split, rows))
    if split < n_pad:
        yield split, n_pad


def _dequantize_t(packed, scale, zero, f0, f1, planes, chunk, layout, start, stop, out) -> None:
    """Rows [start, stop) (one kind of block, as `_tiles` cuts them) of the weight, transposed,
    into out: contiguous bf16 [K, rows]. packed: the int4pack bytes, flat; code q means
    q * scale + zero."""
    block_n, halves = layout
    kp, n_pad = scale.shape[0] * GROUP, scale.shape[1]  # K' = planes * K
    bits = out.view(torch.int16).numpy().view(np.uint16)
    split = n_pad // block_n * block_n if halves else 0
    if stop <= split:
        blocks = packed[:split * kp // 2].reshape(-1, kp, block_n // 2)
        _dequantizer(block_n // 2, chunk, planes)(blocks, scale, zero, f0, f1, start // block_n, bits)
    else:
        _dequant_pairs(packed, scale, zero, f0, f1, planes, chunk, block_n, n_pad, start, bits)


_SCRATCH: list[torch.Tensor] = []


def _scratch(numel: int) -> torch.Tensor:
    """A bf16 buffer of numel, reused by every call: a fresh one costs its page faults on each
    call (a third of the dequantization's time). Valid until the next call."""
    if not _SCRATCH or _SCRATCH[0].numel() < numel:
        _SCRATCH[:] = [torch.empty(numel, dtype=torch.bfloat16)]
    return _SCRATCH[0][:numel]


def _warm_up(chunk: int, planes: int) -> None:
    """Compiles (or reads from numba's cache) the dequantizer for these weights."""
    block_n, halves = _int4pack_layout()
    if halves:
        _dequantizer(block_n // 2, chunk, planes)


def _njit(fn):
    return numba.njit(cache=True, nogil=True, fastmath=True)(fn) if numba else fn


def _njit_inline(fn):
    return numba.njit(cache=True, inline="always")(fn) if numba else fn


@_njit_inline
def _to_bf16(v):
    """fp32 -> bf16 bits, rounded to nearest even (as torch's `.to(torch.bfloat16)`)."""
    u = np.float32(v).view(np.uint32)
    rounded = np.uint32(u + np.uint32(0x7FFF) + np.uint32((u >> np.uint32(16)) & np.uint32(1)))
    return np.uint16(rounded >> np.uint32(16))


@functools.cache
def _dequantizer(half: int, chunk: int, planes: int):
    """Dequantizes the full blocks of a layout that splits their rows in halves of `half`, for
    weights of this chunk and number of planes. All three are constants of the compiled code: as
    arguments (or with the blocks seen through a reshape or a slice inside), LLVM vectorizes the
    inner loop worse or not at all, 1.5-10x slower. Serial: numba's parallel=True costs the same."""

    @numba.njit(cache=True, nogil=True, fastmath=True)
    def dequant(blocks, scale, zero, f0, f1, nb_start, out):
        """blocks: uint8 [num_blocks, planes * K, half], torch's int4pack of [n_pad, planes * K]
        cut by block; scale, zero: fp32 [planes * K / 32, n_pad], a code q meaning q * scale +
        zero. Writes blocks [nb_start, nb_start + out rows / (2 half)) transposed, rounded to
        bf16: out uint16 [K, rows]."""
        k = out.shape[0]
        for nb in range(nb_start, nb_start + out.shape[1] // (2 * half)):
            n0 = nb * 2 * half
            o = n0 - nb_start * 2 * half  # column of row n0 in out
            for kk in range(k):
                kq = kk // chunk * planes * chunk + kk % chunk  # plane 0's position in K'
                g = kq // 32
                if planes == 1:
                    for d in range(half):
                        b = blocks[nb, kq, d]
                        for h in range(2):
                            n = n0 + d + half * h
                            out[kk, o + d + half * h] = _to_bf16(
                                np.float32((b >> (4 * h)) & 15) * scale[g, n] + zero[g, n])
                else:
                    g1 = (kq + chunk) // 32
                    for d in range(half):
                        b = blocks[nb, kq, d]
                        b1 = blocks[nb, kq + chunk, d]
                        for h in range(2):
                            n = n0 + d + half * h
                            v = np.float32((b >> (4 * h)) & 15) * scale[g, n] + zero[g, n]
                            v1 = np.float32((b1 >> (4 * h)) & 15) * scale[g1, n] + zero[g1, n]
                            out[kk, o + d + half * h] = _to_bf16(f0 * v + f1 * v1)

    blocks = np.zeros((1, 32 * planes, half), np.uint8)  # compile now
    scale = np.zeros((planes, 2 * half), np.float32)
    dequant(blocks, scale, scale, np.float32(1), np.float32(1), 0, np.zeros((32, 2 * half), np.uint16))
    return dequant


@_njit
def _dequant_pairs(packed, scale, zero, f0, f1, planes, chunk, block_n, n_pad, start, out):
    """The same for rows [start, start + out rows) in blocks whose byte b holds rows 2b and 2b + 1
    (a partial last block, or every block where ATen has no vector kernel). packed: uint8 flat."""
    k = out.shape[0]
    kp = planes * k
    for n in range(start, start + out.shape[1]):
        n0 = n - n % block_n
        size = min(block_n, n_pad - n0)
        at = n0 * kp // 2 + (n - n0) // 2
        shift = 4 * ((n - n0) % 2)
        for kk in range(k):
            v = np.float32(0.0)
            for p in range(planes):
                kq = kk // chunk * planes * chunk + p * chunk + kk % chunk
                q = np.float32((packed[at + kq * size // 2] >> shift) & 15)
                v += (f0 if p == 0 else f1) * (q * scale[kq // 32, n] + zero[kq // 32, n])
            out[kk, n - start] = _to_bf16(v)
