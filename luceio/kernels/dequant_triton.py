"""`dequantize_triton(w, dtype)`: a quantized weight as a dense [N, K] tensor on the device, in
one launch over (row tiles, K tiles), through the same tile decoding as the skinny GEMM
(quant_tile_triton.py `_quant_tile`, `_weights`). The prefill path's first half: past
`skinny_max_m` rows a layer is dequantized into a scratch buffer and multiplied by cuBLAS."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import get_config
from .quant import QuantWeight
from .quant_args import weight_args as _weight_args
from .quant_tile_triton import _quant_tile, _weights


@triton.jit
def _dequant_kernel(qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, out_ptr, N, KG,
                    s_qs, s_qh, s_d, s_sc, e_d, e_sc, s_o,
                    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    G: tl.constexpr = BLOCK_K // 32
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rows < N
    row = rows.to(tl.int64)[:, None]
    g0 = tl.program_id(1) * G
    lo, hi, scale_lo, scale_hi, offset = _quant_tile(
        qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, row, nmask, g0, KG,
        s_qs, s_qh, s_d, s_sc, e_d, e_sc, QTYPE, G)
    w_lo, w_hi = _weights(lo, hi, scale_lo, scale_hi, offset, QTYPE)
    grp = g0 + tl.arange(0, G)[None, :]
    off = (row * s_o + grp * 32)[:, :, None] + tl.arange(0, 16)[None, None, :]
    mask = (nmask[:, None] & (grp < KG))[:, :, None]
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + off, w_lo.to(dt), mask=mask)
    tl.store(out_ptr + off + 16, w_hi.to(dt), mask=mask)


def dequantize_triton(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight in `dtype`: fp32 values equal to `quant.dequantize`, rounded
    once to `dtype` (on GPUs a d * q + m may fuse into one FMA: at most 1 fp32 ulp off)."""
    n, k = w.shape
    out = torch.empty((n, k), dtype=dtype, device=w.qs.device)
    if n == 0 or k == 0:
        return out
    cfg = get_config(w.qs.device)
    weights, strides = _weight_args(w)
    block_n, block_k = cfg.dequant_block_n, cfg.dequant_block_k
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        *weights, out, n, k // 32, *strides, out.stride(0), QTYPE=w.qtype, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=cfg.dequant_num_warps)
    return out
