"""What the quantized kernels are given for a `QuantWeight`: its arrays as kernel arguments
(4-bit codes and high bits as int32 words) and their strides, with the GPU's paired scale form
(`quant.pair_scales`) passed as it is; `laid_out`, a weight's arrays in fresh memory (pinned
host memory, device slots) in that form."""
from __future__ import annotations

from dataclasses import replace

import torch

from .quant import QuantWeight


def words(t: torch.Tensor) -> torch.Tensor:
    """uint8 [N, B] (B % 4 == 0) as int32 [N, B / 4]: one little-endian word per 4 bytes."""
    t = t.contiguous()
    if t.storage_offset() % 4:
        t = t.clone()
    return t.view(torch.int32)


def weight_args(w: QuantWeight) -> tuple:
    """(pointers qs, qh, d, m, sc, mn; strides s_qs, s_qh, s_d, s_sc (rows), e_d, e_sc (elements
    of d/m and of sc/mn)), qh as int32 words; absent arrays are replaced by qs (never read: the
    QTYPE branches skip them). The paired form of `quant.pair_scales` passes as it is (element
    stride 2); any other non-contiguous array is made contiguous."""
    qs = w.qs.contiguous()
    qh = words(w.qh) if w.qh is not None else qs
    d, m = _pair_or_contiguous(w.d, w.m)
    sc, mn = _pair_or_contiguous(w.sc, w.mn)
    m = m if m is not None else d
    sc = sc if sc is not None else qs
    mn = mn if mn is not None else qs
    return (qs, qh, d, m, sc, mn), (qs.stride(0), qh.stride(0), d.stride(0), sc.stride(0),
                                    d.stride(1), sc.stride(1))


def _pair_or_contiguous(a, b):
    if a is None:
        return a, b
    if b is not None and paired(a, b):
        return a, b
    return a.contiguous(), (b.contiguous() if b is not None else None)


def paired(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are the two halves of one [N, G, 2] array (`quant.pair_scales`)."""
    return (a.dim() == 2 and a.stride(1) == 2 and b.stride() == a.stride()
            and a.stride(0) == 2 * a.shape[1] and a.dtype == b.dtype
            and b.data_ptr() == a.data_ptr() + a.element_size())


def laid_out(w, rows: int, alloc, copy: bool):
    """A `QuantWeight` like w with `rows` rows in fresh arrays from alloc(shape, dtype), q4_k /
    q5_k's scale pairs interleaved as `quant.pair_scales` lays them out; copy: w's values (w
    has `rows` rows). Returns (the weight, its row-major arrays: what a row copy moves)."""
    src, arrays, bases = w.tensors(), {}, []
    pairs = (("sc", "mn"), ("d", "m")) if w.qtype in ("q4_k", "q5_k") else ()
    paired = {name for pair in pairs for name in pair}
    for name, t in src.items():
        if name not in paired:
            arrays[name] = alloc((rows, *t.shape[1:]), t.dtype)
            bases.append(arrays[name])
    for a, b in pairs:
        both = alloc((rows, *src[a].shape[1:], 2), src[a].dtype)
        arrays[a], arrays[b] = both[..., 0], both[..., 1]
        bases.append(both)
    if copy:
        for name, t in src.items():
            arrays[name].copy_(t)
    return replace(w, shape=(rows, w.shape[1]), **arrays), bases
