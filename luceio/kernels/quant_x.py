"""x's int8 quantization for the quantized GEMV (`quant_gemv.py`): per 32-group, scale =
max |x| / 127, round half away from zero (llama.cpp's q8_1 does the same), the int32 sums of
each group's two halves beside it; the kernel, its launcher, the store the norms and SiLU share
to hand the GEMV its input already quantized (`emit_xq`: elementwise_triton.py, the decode
attention's epilogue), and the torch reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import get_config
from .pdl import pdl_enter, pdl_kwargs


@triton.jit
def store_xq(x, grp, gmask, xq_ptr, xs_ptr, xsum_ptr, KG, BLOCK_G: tl.constexpr,
             PLANES: tl.constexpr):
    """Quantizes fp32 groups x [BLOCK_G, 32] (groups `grp` [BLOCK_G, 1], `gmask` the real ones)
    and stores them as `quantize_x` lays them out. Shared with the kernels that produce a
    GEMV's input and hand it over already quantized (elementwise_triton.py)."""
    col = tl.arange(0, 32)[None, :]
    amax = tl.max(tl.abs(x), 1)                                                 # [BG]
    scale = amax / 127.0
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)  # no 1/0 anywhere
    t = x * inv[:, None]
    q = tl.where(t >= 0, t + 0.5, t - 0.5).to(tl.int32)
    q = tl.minimum(tl.maximum(q, -127), 127)
    if PLANES:
        dst = (col // 16) * (KG * 16) + grp * 16 + (col % 16)
    else:
        dst = grp * 32 + col
    tl.store(xq_ptr + dst, q.to(tl.int8), mask=gmask)
    tl.store(xs_ptr + grp, scale[:, None], mask=gmask)
    halves = tl.reshape(q, [BLOCK_G, 2, 16])
    sums = tl.sum(halves, 2)                                                    # [BG, 2]
    tl.store(xsum_ptr + tl.arange(0, 2)[None, :] * KG + grp, sums, mask=gmask)


@triton.jit
def emit_xq(y, g0, g_end, KG, xq0, xs0, xsum0, xq1, xs1, xsum1, BLOCK: tl.constexpr,
            XQ_PLANES: tl.constexpr, XQ_GROUPS: tl.constexpr):
    """A produced GEMV input y [BLOCK] (groups g0 ... of 32, the real ones below g_end) also
    quantized, in the layouts asked for: how a norm, SiLU or the attention epilogue hands the
    next GEMV its input without a launch of `_quantize_x_kernel`."""
    if XQ_PLANES or XQ_GROUPS:
        grp = g0 + tl.arange(0, BLOCK // 32)[:, None]
        gmask = grp < g_end
        yg = tl.reshape(y, [BLOCK // 32, 32])
        if XQ_PLANES:
            store_xq(yg, grp, gmask, xq0, xs0, xsum0, KG, BLOCK // 32, True)
        if XQ_GROUPS:
            store_xq(yg, grp, gmask, xq1, xs1, xsum1, KG, BLOCK // 32, False)


@triton.jit
def _quantize_x_kernel(x_ptr, xq_ptr, xs_ptr, xsum_ptr, KG, BLOCK_G: tl.constexpr,
                       PLANES: tl.constexpr,
                       PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    """x [K] -> xq int8 [K], scale fp32 [K/32], and int32 sums of xq [2, K/32] (elements 0-15
    and 16-31 of each group). xq is in group order, or with PLANES in two planes [2, K/32, 16]
    (elements 0-15, then 16-31, of every group), which keeps the 4-bit GEMV's x loads
    contiguous: its code word j meets x words j of both planes."""
    pdl_enter(PDL, PDL_EARLY)
    grp = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)[:, None]          # [BG, 1]
    gmask = grp < KG
    col = tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + grp * 32 + col, mask=gmask, other=0.0).to(tl.float32)  # [BG, 32]
    store_xq(x, grp, gmask, xq_ptr, xs_ptr, xsum_ptr, KG, BLOCK_G, PLANES)


def xq_buffers(k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (xq, scale, sums) for a K-element x: what `quantize_x` returns."""
    kg = k // 32
    return (torch.empty(k, dtype=torch.int8, device=device),
            torch.empty(kg, dtype=torch.float32, device=device),
            torch.empty((2, kg), dtype=torch.int32, device=device))


def xq_args(xqs: dict, dummy: torch.Tensor) -> list:
    """The six pointer arguments of `emit_xq` for `xqs` (`xq_layouts`), `dummy` where absent."""
    args = []
    for planes in (True, False):
        args.extend(xqs.get(planes, (dummy,) * 3))
    return args


def xq_flags(xqs: dict) -> dict:
    """`emit_xq`'s constexpr flags for `xqs`."""
    return {"XQ_PLANES": True in xqs, "XQ_GROUPS": False in xqs} if xqs else {}


def quantize_x(x: torch.Tensor, planes: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [K] (K % 32 == 0) -> (xq int8 [K] (two planes, or group order), scale fp32 [K/32],
    xq sums int32 [2, K/32]); see `_quantize_x_kernel`."""
    k = x.numel()
    kg = k // 32
    xq, xs, xsum = xq_buffers(k, x.device)
    block_g = 16
    _quantize_x_kernel[(triton.cdiv(kg, block_g),)](
        x, xq, xs, xsum, kg, BLOCK_G=block_g, PLANES=planes, num_warps=4,
        **pdl_kwargs(x.device, get_config(x.device), triton.cdiv(kg, block_g)))
    return xq, xs, xsum


def quantize_x_ref(x: torch.Tensor) -> torch.Tensor:
    """The dequantized int8 x the GEMV multiplies (xq * scale), in fp32: its reference input."""
    g = x.float().reshape(-1, 32)
    amax = g.abs().amax(1, keepdim=True)
    # 127 / amax correctly rounded, as the kernel's fp32 division is: torch computes a python
    # number over a tensor as a reciprocal times the number (two roundings), which can move t
    # across a .5 tie and one code by one step
    inv = torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, torch.ones_like(amax))
    t = g * torch.where(amax > 0, inv, torch.zeros_like(amax))
    q = torch.where(t >= 0, t + 0.5, t - 0.5).trunc().clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(x.shape)
