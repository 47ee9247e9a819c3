"""Triton kernels for the per-token ops: fused residual-add + RMSNorm, SiLU-and-mul, rotary.

Each matches its torch reference (norm.py, activation.py, rotary.py) rounding step by
rounding step: maths in fp32, with a cast to the tensor dtype wherever the reference has one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import get_config
from .pdl import pdl_enter, pdl_kwargs
from .quant_x import emit_xq, xq_args, xq_buffers, xq_flags


def _warps(block: int) -> int:
    return min(16, max(1, block // 512))


@triton.jit(do_not_specialize=["kg_all"])  # rows × groups: its parity varies by step
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, eps, s_x, s_r, s_o, s_ro,
                     xq0, xs0, xsum0, xq1, xs1, xsum1, kg_all,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
                     XQ_PLANES: tl.constexpr = False, XQ_GROUPS: tl.constexpr = False,
                     PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False,
                     GEMMA: tl.constexpr = False, OFFSET: tl.constexpr = 0.0,
                     HAS_W: tl.constexpr = True):
    pdl_enter(PDL, PDL_EARLY)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + t * s_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + t * s_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + t * s_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / N + eps)
    if GEMMA:  # HF Gemma: scaled by (offset + w) in fp32, then cast
        o = h * rstd
        if HAS_W:
            o = o * (OFFSET + tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32))
        o = o.to(out_ptr.dtype.element_ty)
    else:  # HF Llama: normalise in fp32, cast back, scale
        y = (h * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        o = (w * y).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * s_o + offs, o, mask=mask)
    # row t's groups of the rows' int8 forms: t * N / 32 .. of kg_all (quantize_x's layout of
    # the rows flattened)
    emit_xq(o.to(tl.float32), t * (N // 32), (t + 1) * (N // 32), kg_all, xq0, xs0, xsum0,
            xq1, xs1, xsum1, BLOCK, XQ_PLANES, XQ_GROUPS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, xqs: dict | None = None):
    """Same contract as `rms_norm_ref`: `out`, or `(out, x + residual)` with a residual.
    Inputs are not modified. `xqs` (from `xq_layouts`, for x's rows): filled with `out`
    quantized for the GEMV that reads it, in the same launch."""
    return _norm(x, weight, eps, residual, xqs or {})


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   offset: float = 1.0, residual: torch.Tensor | None = None):
    """Same contract as `norm.gemma_rms_norm_ref`; inputs are not modified. The same kernel
    as `rms_norm`, in its Gemma mode."""
    return _norm(x, weight, eps, residual, {}, gemma_offset=offset)


def _norm(x, weight, eps, residual, xqs: dict, gemma_offset: float | None = None):
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_dtype = torch.result_type(x, residual)
        res_out = torch.empty(x2.shape, dtype=res_dtype, device=x.device)
    else:
        r2 = res_out = x2
        res_dtype = x.dtype
    gemma = gemma_offset is not None
    # Llama's norm multiplies by the weight in its dtype; Gemma's casts its fp32 result
    out_dtype = res_dtype if gemma else torch.promote_types(weight.dtype, res_dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(n)
        w = weight.contiguous() if weight is not None else x2
        mode = dict(GEMMA=True, OFFSET=float(gemma_offset), HAS_W=weight is not None) \
            if gemma else {}
        _rms_norm_kernel[(rows,)](x2, r2, w, out, res_out, float(eps),
                                  x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
                                  *xq_args(xqs, out), rows * (n // 32), N=n, BLOCK=block,
                                  HAS_RES=residual is not None, num_warps=_warps(block),
                                  **xq_flags(xqs), **mode,
                                  **pdl_kwargs(x.device, get_config(x.device), rows))
    out = out.view(shape)
    return out if residual is None else (out, res_out.view(shape))


def xq_layouts(layouts, rows: int, n: int, device) -> dict:
    """The int8 forms (`quant_x.quantize_x` layouts: True = two planes, False = group
    order) that a [rows, n] output is also written in, as empty buffers for the kernel to
    fill: the forms `quantize_x` makes of the rows flattened, which one GEMV launch over all
    the rows reads."""
    if not layouts:
        return {}
    if rows < 1 or n % 32:
        raise ValueError(f"a quantized GEMV input is rows of a multiple of 32 elements, "
                         f"got [{rows}, {n}]")
    return {planes: xq_buffers(rows * n, device) for planes in layouts}


@triton.jit
def silu_mul(g, u, out_ptr):
    """silu(g) * u in `out_ptr`'s dtype, for fp32 g, u holding values of that dtype, rounded
    where `silu_and_mul_ref` rounds: F.silu to the dtype, then the product."""
    dt = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (s * u).to(dt)


@triton.jit(do_not_specialize=["kg_all"])  # rows × groups: its parity varies by step
def _silu_and_mul_kernel(x_ptr, out_ptr, s_x, s_o, xq0, xs0, xsum0, xq1, xs1, xsum1, kg_all,
                         D: tl.constexpr, BLOCK: tl.constexpr,
                         XQ_PLANES: tl.constexpr = False, XQ_GROUPS: tl.constexpr = False,
                         PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    pdl_enter(PDL, PDL_EARLY)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(x_ptr + t * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * s_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    o = silu_mul(g, u, out_ptr)
    tl.store(out_ptr + t * s_o + offs, o, mask=mask)
    emit_xq(o.to(tl.float32), t * (D // 32) + tl.program_id(1) * (BLOCK // 32),
            (t + 1) * (D // 32), kg_all, xq0, xs0, xsum0, xq1, xs1, xsum1, BLOCK,
            XQ_PLANES, XQ_GROUPS)


def silu_and_mul(x: torch.Tensor, xqs: dict | None = None) -> torch.Tensor:
    """x: [..., 2 * d] as [gate | up] → silu(gate) * up, [..., d]. `xqs`: as `rms_norm`'s."""
    xqs = xqs or {}
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        block = max(32, min(1024, triton.next_power_of_2(d)))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), *xq_args(xqs, out), x2.shape[0] * (d // 32),
            D=d, BLOCK=block,
            num_warps=_warps(block), **xq_flags(xqs),
            **pdl_kwargs(x.device, get_config(x.device), x2.shape[0] * triton.cdiv(d, block)))
    return out.view(*x.shape[:-1], d)


@triton.jit
def _rotate_heads(ptr, s_h, cos, sin, half, hmask,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    mask = (h < NUM_HEADS)[:, None] & hmask[None, :]
    p = ptr + h[:, None] * s_h + half[None, :]
    x1 = tl.load(p, mask=mask, other=0.0)
    x2 = tl.load(p + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(p, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(p + HALF, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def cos_sin_at(t, pos_ptr, cs_ptr, s_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token t's rotary (half index, its mask, cos, sin) in fp32, from the (cos | sin) cache at
    its position. Shared with qkv_rope_triton.py."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    hmask = half < HALF
    cos = tl.load(cs_ptr + pos * s_cs + half, mask=hmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + half, mask=hmask, other=0.0).to(tl.float32)
    return half, hmask, cos, sin


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cs_ptr, s_qt, s_qh, s_kt, s_kh, s_cs,
                   NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    half, hmask, cos, sin = cos_sin_at(t, pos_ptr, cs_ptr, s_cs, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr + t * s_qt, s_qh, cos, sin, half, hmask, NUM_Q, HALF, BLOCK_Q)
    _rotate_heads(k_ptr + t * s_kt, s_kh, cos, sin, half, hmask, NUM_K, HALF, BLOCK_K)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> None:
    """Rotates q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim]
    in place (strided views allowed, last dim contiguous) at `positions` [num_tokens]."""
    num_tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    if num_tokens == 0:
        return
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary: q and k need a contiguous last dim (they are updated in place)")
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_q = triton.next_power_of_2(num_q)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cs, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cs.stride(0),
        NUM_Q=num_q, NUM_K=num_k, HALF=half, BLOCK_HALF=block_half, BLOCK_Q=block_q,
        BLOCK_K=triton.next_power_of_2(num_k), num_warps=_warps(block_q * block_half))
