"""Quantized weights: the repacked layout every quantized kernel reads, and its torch reference.

A GGUF tensor's blocks interleave scales and codes; kernels want plain loads. `QuantWeight`
keeps one [out, in] = [N, K] matrix as separate arrays, each row-major over N (so fused
projections concatenate along dim 0, and rows can be permuted), bit for bit the information
the GGUF blocks hold:

| qtype | qs (codes)                 | qh (high bits)          | d (fp16)     | m (fp16)        | sc            | mn            |
|-------|----------------------------|-------------------------|--------------|-----------------|---------------|---------------|
| q4_0  | uint8 [N, K/2] 4-bit pairs | -                       | [N, K/32]    | -               | -             | -             |
| q4_1  | uint8 [N, K/2]             | -                       | [N, K/32]    | [N, K/32] (min) | -             | -             |
| q5_0  | uint8 [N, K/2]             | uint8 [N, K/8] 5th bit  | [N, K/32]    | -               | -             | -             |
| q5_1  | uint8 [N, K/2]             | uint8 [N, K/8]          | [N, K/32]    | [N, K/32] (min) | -             | -             |
| q8_0  | int8 [N, K]                | -                       | [N, K/32]    | -               | -             | -             |
| q4_k  | uint8 [N, K/2]             | -                       | [N, K/256]   | [N, K/256] dmin | uint8 [N,K/32]| uint8 [N,K/32]|
| q5_k  | uint8 [N, K/2]             | uint8 [N, K/8]          | [N, K/256]   | [N, K/256] dmin | uint8 [N,K/32]| uint8 [N,K/32]|
| q6_k  | uint8 [N, K/2]             | uint8 [N, K/4] 2 bits   | [N, K/256]   | -               | int8 [N,K/16] | -             |

Code order (the same for every 4-bit array): within each group of 32 consecutive elements of a
row, byte j (0..15) holds element j in its low nibble and element j + 16 in its high nibble.
`qh` for the 5-bit types: element k's fifth bit is bit k % 8 of byte k // 8. For q6_k: element
k's two high bits are bits 2*(k % 4) and 2*(k % 4) + 1 of byte k // 4.

Dequantization, in fp32 and in this order of operations (what `gguf.quants` computes, so the
results are equal bit for bit), with q the unsigned code (low | high << 4):
  q4_0: d * (q - 8)          q4_1: d * q + m          q8_0: q * d
  q5_0: d * (q - 16)         q5_1: d * q + m
  q4_k, q5_k: (d * sc) * q - (dmin * mn)   (d, dmin of the element's 256-block; sc, mn of its 32-group)
  q6_k: (d * sc) * (q - 32)                (sc of its 16-group)
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.nn.functional as F

QTYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")

_U8, _I8, _F16 = torch.uint8, torch.int8, torch.float16
LAYOUT: dict[str, dict[str, tuple[torch.dtype, int]]] = {
    "q4_0": {"qs": (_U8, 2), "d": (_F16, 32)},
    "q4_1": {"qs": (_U8, 2), "d": (_F16, 32), "m": (_F16, 32)},
    "q5_0": {"qs": (_U8, 2), "qh": (_U8, 8), "d": (_F16, 32)},
    "q5_1": {"qs": (_U8, 2), "qh": (_U8, 8), "d": (_F16, 32), "m": (_F16, 32)},
    "q8_0": {"qs": (_I8, 1), "d": (_F16, 32)},
    "q4_k": {"qs": (_U8, 2), "d": (_F16, 256), "m": (_F16, 256), "sc": (_U8, 32), "mn": (_U8, 32)},
    "q5_k": {"qs": (_U8, 2), "qh": (_U8, 8), "d": (_F16, 256), "m": (_F16, 256),
             "sc": (_U8, 32), "mn": (_U8, 32)},
    "q6_k": {"qs": (_U8, 2), "qh": (_U8, 4), "d": (_F16, 256), "sc": (_I8, 16)},
}
"""The table above as data: qtype -> {field: (dtype, weights per entry)}; a field is [N, K / that]."""


@dataclass
class QuantWeight:
    """One quantized [N, K] weight matrix in the repacked layout (see the module docstring)."""
    qtype: str
    shape: tuple[int, int]  # (N, K): out features, in features
    qs: torch.Tensor
    d: torch.Tensor
    qh: torch.Tensor | None = None
    m: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None

    def __post_init__(self):
        if self.qtype not in LAYOUT:
            raise ValueError(f"unknown qtype {self.qtype!r}; expected one of {', '.join(QTYPES)}")
        n, k = self.shape
        layout = LAYOUT[self.qtype]
        for name in (f.name for f in fields(self) if f.name not in ("qtype", "shape")):
            array = getattr(self, name)
            if name not in layout:
                if array is not None:
                    raise ValueError(f"{self.qtype} has no {name!r} array")
                continue
            dtype, per = layout[name]
            if k % per or array is None or array.dtype != dtype or tuple(array.shape) != (n, k // per):
                got = None if array is None else (array.dtype, tuple(array.shape))
                raise ValueError(f"{self.qtype} [N, K] = {list(self.shape)}: {name} must be {dtype} "
                                 f"[{n}, {k}/{per}], got {got}")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The arrays this qtype uses, by field name."""
        return {name: getattr(self, name) for name in LAYOUT[self.qtype]}

    def to(self, device) -> QuantWeight:
        return replace(self, **{name: t.to(device) for name, t in self.tensors().items()})


def ggml_to_qtype(ggml_type) -> str | None:
    """The repacked qtype of a `gguf.GGMLQuantizationType`, or None for every other type: F32, F16
    and BF16 stay dense, and quant types without a repacked form (Q2_K, Q3_K, IQ*, ...) are for
    the loader to dequantize to dense with `gguf.quants.dequantize`."""
    name = ggml_type.name.lower()
    return name if name in LAYOUT else None


def bits_per_weight(qtype: str) -> float:
    """Storage of the repacked layout per weight (GGUF: q4_k 4.5, here 4.625: sc/mn unpacked)."""
    return sum(8 * dtype.itemsize / per for dtype, per in LAYOUT[qtype].values())


def nbytes(w: QuantWeight) -> int:
    return sum(t.numel() * t.element_size() for t in w.tensors().values())


# ---- GGUF blocks -> repacked ------------------------------------------------------------------

def repack_gguf(data: np.ndarray, ggml_type, shape: tuple[int, int]) -> QuantWeight:
    """Splits the raw blocks of one GGUF tensor (`ReaderTensor.data`: uint8, [N, bytes per row]
    or flat; shape (N, K) as in PyTorch) into the repacked arrays, on the CPU."""
    from gguf import GGML_QUANT_SIZES

    qtype = ggml_to_qtype(ggml_type)
    if qtype is None:
        raise ValueError(f"GGUF type {ggml_type.name} has no repacked form (dequantize it to dense)")
    n, k = shape
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if k % block_size or data.nbytes != n * k // block_size * type_size:
        raise ValueError(f"{ggml_type.name} data of {data.nbytes} bytes cannot hold [{n}, {k}] "
                         f"(K must be a multiple of {block_size}; {type_size} bytes per block)")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)
    arrays = _REPACK[qtype](blocks)
    return QuantWeight(qtype, (n, k), **{name: torch.from_numpy(np.ascontiguousarray(a.reshape(n, -1)))
                                         for name, a in arrays.items()})


def _cols(blocks: np.ndarray, start: int, stop: int, dtype=np.uint8) -> np.ndarray:
    """Bytes [start, stop) of every block: a fresh C-contiguous array (never a view of `data`)."""
    return blocks[:, start:stop].copy().view(dtype)


_LOW = np.uint64(0x0F0F0F0F0F0F0F0F)


def _regroup_nibbles(pairs: np.ndarray) -> np.ndarray:
    """[..., 2] of 16-byte rows ('V16') -> the same shape: two rows whose low nibbles are one
    32-element group and high nibbles the next (k-quant order) become those two groups in the
    repacked order. Works on whole uint64 words: numpy is slow on strided or shifted uint8."""
    lo = np.ascontiguousarray(pairs[..., 0]).view(np.uint64)
    hi = np.ascontiguousarray(pairs[..., 1]).view(np.uint64)
    out = np.empty(pairs.shape, pairs.dtype)
    first = lo & _LOW
    first |= (hi & _LOW) << np.uint64(4)
    out[..., 0] = first.view(pairs.dtype)
    lo >>= np.uint64(4)
    lo &= _LOW
    hi &= ~_LOW
    lo |= hi
    out[..., 1] = lo.view(pairs.dtype)
    return out


def _delta_swap(x: np.ndarray, shift: int, mask: int) -> np.ndarray:
    """Swaps the bits of x under `mask` with those `shift` places above them."""
    shift, mask = x.dtype.type(shift), x.dtype.type(mask)
    t = (x ^ (x >> shift)) & mask
    return x ^ t ^ (t << shift)


def _transpose_bits(x: np.ndarray) -> np.ndarray:
    """uint64 words as 8x8 bit matrices: bit 8r + c -> bit 8c + r."""
    x = _delta_swap(x, 7, 0x00AA00AA00AA00AA)
    x = _delta_swap(x, 14, 0x0000CCCC0000CCCC)
    return _delta_swap(x, 28, 0x00000000F0F0F0F0)


def _transpose_crumbs(x: np.ndarray) -> np.ndarray:
    """uint32 words as 4x4 matrices of 2-bit fields: field 4r + c -> field 4c + r."""
    return _delta_swap(_delta_swap(x, 6, 0x00CC00CC), 12, 0x0000F0F0)


def _repack_32(blocks: np.ndarray, has_min: bool, has_high: bool) -> dict[str, np.ndarray]:
    """q4_0, q4_1, q5_0, q5_1: [d][m][qh as uint32, bit k = element k][qs, already repacked order]."""
    arrays = {"d": _cols(blocks, 0, 2, np.float16)}
    at = 2
    if has_min:
        arrays["m"] = _cols(blocks, 2, 4, np.float16)
        at = 4
    if has_high:  # a little-endian uint32 read as 4 bytes is byte k // 8, bit k % 8
        arrays["qh"] = _cols(blocks, at, at + 4)
        at += 4
    arrays["qs"] = _cols(blocks, at, at + 16)
    return arrays


def _repack_q8_0(blocks: np.ndarray) -> dict[str, np.ndarray]:
    return {"d": _cols(blocks, 0, 2, np.float16), "qs": _cols(blocks, 2, 34, np.int8)}


def _repack_kquant_scales(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """q4_k, q5_k: d, dmin, and the 12 bytes of 6-bit scales and mins unpacked to one byte each
    (`gguf.quants.Q4_K.get_scale_min` on whole words: bytes 0-3 hold the low 6 bits of scales
    0-3 and their top 2 bits those of scales 4-7, bytes 4-7 the same for mins, bytes 8-11 the
    low 4 bits of scale and min 4-7)."""
    scales, mins, low4 = _cols(blocks, 4, 16, np.uint32).T
    six, four, top = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x30303030)
    sc = np.stack([scales & six, (low4 & four) | ((scales >> np.uint32(2)) & top)], axis=-1)
    mn = np.stack([mins & six, ((low4 >> np.uint32(4)) & four) | ((mins >> np.uint32(2)) & top)],
                  axis=-1)
    return {"d": _cols(blocks, 0, 2, np.float16), "m": _cols(blocks, 2, 4, np.float16),
            "sc": sc.view(np.uint8), "mn": mn.view(np.uint8)}


def _repack_q4_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # qs byte 32c + j: element 64c + j in its low nibble, element 64c + 32 + j in its high one
    qs = _regroup_nibbles(_cols(blocks, 16, 144, "V16").reshape(-1, 4, 2))
    return {**_repack_kquant_scales(blocks), "qs": qs.view(np.uint8)}


def _repack_q5_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # qh byte j, bit s: the fifth bit of element 32s + j. As 8x8 bit matrices (bytes 8t..8t+7),
    # transposed, byte s of word t is repacked byte 4s + t.
    qh = _transpose_bits(_cols(blocks, 16, 48, np.uint64)).view(np.uint8).reshape(-1, 4, 8)
    qs = _regroup_nibbles(_cols(blocks, 48, 176, "V16").reshape(-1, 4, 2))
    return {**_repack_kquant_scales(blocks), "qh": qh.transpose(0, 2, 1), "qs": qs.view(np.uint8)}


def _repack_q6_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # ql byte 64h + 32r + 16·half + i: element 128h + 32r + 16·half + i in its low nibble, + 64 in
    # its high one, so [h, r, half] regroups to [h, r, s], stored in group order [h, s, r]
    qs = np.ascontiguousarray(_regroup_nibbles(_cols(blocks, 0, 128, "V16").reshape(-1, 2, 2, 2))
                              .swapaxes(2, 3))
    # qh byte 32h + 4t + u, bits 2s, 2s+1: element 128h + 32s + 4t + u, repacked into byte
    # 32h + 8s + t, bits 2u, 2u+1: a 4x4 transpose of 2-bit fields within each uint32
    qh = _transpose_crumbs(_cols(blocks, 128, 192, np.uint32)).view(np.uint8).reshape(-1, 2, 8, 4)
    return {"qs": qs.view(np.uint8), "qh": qh.transpose(0, 1, 3, 2),
            "sc": _cols(blocks, 192, 208, np.int8), "d": _cols(blocks, 208, 210, np.float16)}


_REPACK = {
    "q4_0": lambda b: _repack_32(b, has_min=False, has_high=False),
    "q4_1": lambda b: _repack_32(b, has_min=True, has_high=False),
    "q5_0": lambda b: _repack_32(b, has_min=False, has_high=True),
    "q5_1": lambda b: _repack_32(b, has_min=True, has_high=True),
    "q8_0": _repack_q8_0,
    "q4_k": _repack_q4_k,
    "q5_k": _repack_q5_k,
    "q6_k": _repack_q6_k,
}


# ---- the torch reference ----------------------------------------------------------------------

def dequantize(w: QuantWeight) -> torch.Tensor:
    """fp32 [N, K] on w's device, equal bit for bit to `gguf.quants.dequantize`. Every product in
    these formulas is exact in fp32 (an fp16 d has 11 significant bits; d * sc * q needs at most
    23), so the one rounding is the final `+ m` or `- dmin * mn`: any fp32 order of operations,
    FMA or not, gives these same bits (fp16/bf16 arithmetic would not)."""
    n, k = w.shape
    q = unpacked_codes(w).float()  # [N, K/32, 32]
    d = w.d.float()
    if w.qtype == "q8_0":
        out = q * d[..., None]
    elif w.qtype in ("q4_0", "q5_0"):
        out = d[..., None] * (q - (8 if w.qtype == "q4_0" else 16))
    elif w.qtype in ("q4_1", "q5_1"):
        out = d[..., None] * q + w.m.float()[..., None]
    elif w.qtype in ("q4_k", "q5_k"):
        scale = _per_group(d, 8) * w.sc.float()  # [N, K/32]
        offset = _per_group(w.m.float(), 8) * w.mn.float()
        out = scale[..., None] * q - offset[..., None]
    else:  # q6_k, whose scales cover 16 elements
        scale = _per_group(d, 16) * w.sc.float()  # [N, K/16]
        out = scale[..., None] * (q.view(n, k // 16, 16) - 32)
    return out.reshape(n, k)


def unpacked_codes(w: QuantWeight) -> torch.Tensor:
    """The unsigned codes, uint8 [N, K/32, 32] (int8 for q8_0)."""
    n, k = w.shape
    if w.qtype == "q8_0":
        return w.qs.view(n, k // 32, 32)
    qs = w.qs.view(n, k // 32, 16)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    if w.qh is None:
        return q
    width = w.qh.shape[1] * 8 // k  # high bits per element: 1 (qh [N, K/8]) or 2 ([N, K/4])
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=w.qh.device)
    high = (w.qh.unsqueeze(-1) >> shifts) & ((1 << width) - 1)
    return q | (high.view(n, k // 32, 32) << 4)


def _per_group(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """[N, B] -> [N, B * repeat]: a per-256-block value for each of its groups."""
    return x.unsqueeze(-1).expand(*x.shape, repeat).reshape(x.shape[0], -1)


def quant_linear_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference every quantized matmul kernel is tested against."""
    return F.linear(x, dequantize(w).to(x.dtype), bias)


# ---- HF checkpoints: round-to-nearest at load -------------------------------------------------

def quantize_rtn(weight: torch.Tensor, mode: str) -> QuantWeight:
    """Group-wise (32 along K) round-to-nearest, on weight's device. "int8" -> q8_0: d = absmax/127,
    |error| <= d/2. "int4" -> q4_1: d = (max - min)/15, m = min, |error| <= d/2 up to the fp16
    rounding of d and m (both fp16; codes are rounded against the stored fp16 values)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_rtn takes a 2-D [N, K] weight, got shape {list(weight.shape)}")
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"K = {k} is not a multiple of 32, the quantization group; keep this "
                         f"weight dense")
    groups = weight.float().reshape(n, k // 32, 32)
    if mode == "int8":
        d = _true_div(groups.abs().amax(-1), 127).half()
        _check_finite(weight, d)
        q = torch.round(groups / _nonzero(d)[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantWeight("q8_0", (n, k), qs=q.reshape(n, k), d=d)
    if mode == "int4":
        low, high = groups.amin(-1), groups.amax(-1)
        d, m = _true_div(high - low, 15).half(), low.half()
        _check_finite(weight, d, m)
        q = torch.round((groups - m.float()[..., None]) / _nonzero(d)[..., None]).clamp(0, 15)
        q = q.to(torch.uint8).view(n, k // 32, 2, 16)
        qs = q[..., 0, :] | (q[..., 1, :] << 4)
        return QuantWeight("q4_1", (n, k), qs=qs.reshape(n, k // 2), d=d, m=m)
    raise ValueError(f"quantize_rtn mode must be 'int8' or 'int4', got {mode!r}")


def _true_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor correctly rounded on every device, as llama.cpp computes scales: CUDA turns a
    division by a Python number into a product with its reciprocal, off by an ulp at times."""
    return x / x.new_tensor(divisor)


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    """fp32 d, with 1 for d = 0 (an all-zero int8 group, a constant int4 one): their codes are 0."""
    d = d.float()
    return torch.where(d == 0, torch.ones_like(d), d)


def _check_finite(weight: torch.Tensor, *params: torch.Tensor) -> None:
    if not all(bool(torch.isfinite(p).all()) for p in params):
        raise ValueError(f"weight {list(weight.shape)} has non-finite values or values beyond the "
                         f"fp16 range of the group scale; keep it dense")


# ---- fused projections and row orders ---------------------------------------------------------

def cat_rows(ws: list[QuantWeight]) -> QuantWeight:
    """[N1, K], [N2, K], ... -> [N1 + N2 + ..., K] (fused QKV, gate-up)."""
    first = ws[0]
    if any(w.qtype != first.qtype or w.shape[1] != first.shape[1] for w in ws):
        raise ValueError("cat_rows needs one qtype and one K: got "
                         + ", ".join(f"{w.qtype} {list(w.shape)}" for w in ws))
    arrays = {name: torch.cat([w.tensors()[name] for w in ws]) for name in first.tensors()}
    return QuantWeight(first.qtype, (sum(w.shape[0] for w in ws), first.shape[1]), **arrays)


def pair_scales(w: QuantWeight) -> QuantWeight:
    """q4_k / q5_k with (sc, mn) stored as one [N, K/32, 2] array and (d, dmin) as one
    [N, K/256, 2] array, the fields being views of their halves: the same values and bytes, but
    a kernel reads each (sc, mn) or (d, dmin) pair with one load (`quant_gemv`; the one-row GEMV
    is bound by its count of small loads). Other qtypes are returned as they are. Row operations
    (`cat_rows`, `permute_rows`) give back the plain layout."""
    if w.qtype not in ("q4_k", "q5_k"):
        return w
    scmn = torch.stack([w.sc, w.mn], dim=-1)
    dm = torch.stack([w.d, w.m], dim=-1)
    return replace(w, sc=scmn[..., 0], mn=scmn[..., 1], d=dm[..., 0], m=dm[..., 1])


def permute_rows(w: QuantWeight, index) -> QuantWeight:
    """Row i of the result is row index[i] of w (a gather; index may repeat or drop rows)."""
    index = torch.as_tensor(index, dtype=torch.long, device=w.qs.device)
    arrays = {name: t.index_select(0, index) for name, t in w.tensors().items()}
    return QuantWeight(w.qtype, (len(index), w.shape[1]), **arrays)


# Largest |code| x |sub-scale| of each qtype, for `random_quant_weight`'s scale choice.
_CODE_RANGE = {"q4_0": 8, "q4_1": 15, "q5_0": 16, "q5_1": 31, "q8_0": 127,
               "q4_k": 15 * 63, "q5_k": 31 * 63, "q6_k": 32 * 127}


def random_quant_weight(qtype: str, n: int, k: int, device="cpu",
                        generator: torch.Generator | None = None) -> QuantWeight:
    """Random codes and scales in every array of `qtype`'s layout (tests, tuning, benchmarks):
    weights of about 0.05 in magnitude, so y = x @ W^T stays O(1) in fp16 for x ~ N(0, 1)."""
    arrays = {}
    scale = 0.05 / _CODE_RANGE[qtype]
    for name, (dtype, per) in LAYOUT[qtype].items():
        shape = (n, k // per)
        if dtype == torch.float16:
            t = (torch.rand(shape, generator=generator) + 0.5) * scale
            if name == "m" and qtype in ("q4_1", "q5_1"):  # a group minimum: centre the codes
                t = t * -_CODE_RANGE[qtype] / 2
            arrays[name] = t.half()
        else:
            info = torch.iinfo(dtype)
            top = 64 if name in ("sc", "mn") and dtype == torch.uint8 else info.max + 1
            arrays[name] = torch.randint(info.min, top, shape, generator=generator, dtype=dtype)
    return QuantWeight(qtype, (n, k), **{a: t.to(device) for a, t in arrays.items()})
