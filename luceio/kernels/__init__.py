"""Kernel dispatch: Triton kernels on GPUs, the pure-torch references everywhere else.

`LUCEIO_KERNELS=torch|triton|auto` (default auto) picks the implementation. `auto` uses Triton
for tensors on a GPU when Triton imports, else the torch reference; `triton` forces the Triton
kernels even on CPU tensors (only meaningful under `TRITON_INTERPRET=1`, for tests).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from .activation import silu_and_mul_ref
from .attention import paged_attention_ref, write_kv_ref
from .moe import fused_moe_ref
from .norm import gemma_rms_norm_ref, rms_norm_ref
from .qkv_rope import qkv_rope_cache_ref
from .rotary import build_cos_sin_cache, rotary_ref

__all__ = ["rms_norm", "gemma_rms_norm", "silu_and_mul", "rotary", "write_kv", "paged_attention",
           "qkv_rope_cache", "fused_moe", "build_cos_sin_cache", "use_triton"]


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


_HAS_TRITON = _triton_available()


def kernel_mode() -> str:
    return os.environ.get("LUCEIO_KERNELS", "auto")


def use_triton(x: torch.Tensor | torch.device) -> bool:
    """Whether the Triton kernels run for a tensor (or a device)."""
    mode = kernel_mode()
    if mode == "torch" or not _HAS_TRITON:
        return False
    return mode == "triton" or (x.type if isinstance(x, torch.device) else x.device.type) == "cuda"


def _impl(name: str, ref):
    """Returns a dispatcher to `kernels.triton_ops.<name>` or to `ref`."""
    def dispatch(*args, **kwargs):
        x = args[0] if isinstance(args[0], torch.Tensor) else args[1]
        if use_triton(x):
            from . import triton_ops
            return getattr(triton_ops, name)(*args, **kwargs)
        return ref(*args, **kwargs)
    dispatch.__name__ = name
    dispatch.__doc__ = ref.__doc__
    return dispatch


rms_norm = _impl("rms_norm", rms_norm_ref)
gemma_rms_norm = _impl("gemma_rms_norm", gemma_rms_norm_ref)
silu_and_mul = _impl("silu_and_mul", silu_and_mul_ref)
rotary = _impl("rotary", rotary_ref)
write_kv = _impl("write_kv", write_kv_ref)
paged_attention = _impl("paged_attention", paged_attention_ref)
qkv_rope_cache = _impl("qkv_rope_cache", qkv_rope_cache_ref)
fused_moe = _impl("fused_moe", fused_moe_ref)


# linear layers: dense or quantized weights -----------------------------------------------------
def prepare_weight(w, act_dtype: torch.dtype):
    """A QuantWeight in the form the device's kernels read: the repacked layout on GPUs, with
    q4_k/q5_k scale pairs interleaved (`quant.pair_scales`), the plain repacked layout for the
    torch reference (`LUCEIO_KERNELS=torch`), torch's packed CPU formats on the CPU."""
    if w.qs.device.type == "cpu" and kernel_mode() == "auto":
        from .quant_cpu import prepare_cpu_weight
        return prepare_cpu_weight(w, act_dtype)
    if w.qs.device.type != "cpu":
        from .quant import pair_scales
        return pair_scales(w)
    return w


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None,
           xqs: dict | None = None, tail=None) -> torch.Tensor:
    """y = x @ W^T + bias for a dense weight, a QuantWeight, a CPU-packed weight or a 16-bit
    one kept for an fp32 CPU model (half_cpu.py). `xqs`: x
    already quantized for the quantized GEMV (`gemv_input_buffers`), filled by x's producer.
    `tail` (`quant_gemv_tail`): the op after this projection, done by its quantized GEMV where
    that runs (`tail.done` is then set; otherwise the caller does it)."""
    if isinstance(w, torch.Tensor):
        if use_triton(x):
            from .dense_gemv import applies, dense_gemv
            if applies(x, w):  # a decode step's few rows: one launch, PDL (dense_gemv.py)
                return dense_gemv(x, w, bias)
        return torch.nn.functional.linear(x, w, bias)
    from .quant import QuantWeight, quant_linear_ref
    if isinstance(w, QuantWeight):
        if use_triton(x):
            from .quant_triton import quant_matmul
            return quant_matmul(x, w, bias, xqs=xqs, tail=tail)
        return quant_linear_ref(x, w, bias)
    from .half_cpu import CpuHalf
    if isinstance(w, CpuHalf):
        from .half_cpu import linear as half_linear
        return half_linear(x, w, bias)
    from .quant_cpu import cpu_quant_linear
    return cpu_quant_linear(x, w, bias)


def silu_and_mul_linear(gate_up: torch.Tensor, w, bias: torch.Tensor | None = None):
    """linear(silu_and_mul(gate_up), w, bias): an MLP's down projection of its gate/up
    output. Where the dense GEMV runs (a few rows, a dense weight, Triton) the SiLU is done in
    its loads, one launch instead of two (`dense_gemv.py`, GLU)."""
    if isinstance(w, torch.Tensor) and use_triton(gate_up):
        from .dense_gemv import applies, dense_gemv
        if applies(gate_up, w):
            return dense_gemv(gate_up, w, bias, glu=True)
    return linear(silu_and_mul(gate_up), w, bias)


def glu_tail(x: torch.Tensor, half: int, xqs: dict):
    """A `quant_gemv_tail.GluTail` for the gate/up GEMV of x's rows (act [rows, half] in x's
    dtype, into the down GEMV's int8 forms `xqs`), or None without them or where the config
    table keeps the tail off at this size."""
    if not xqs:
        return None
    from .configs import get_config
    cfg = get_config(x.device)
    if not cfg.gemv_tails or 2 * half > cfg.gemv_glu_tail_max_n:
        return None
    from .quant_gemv_tail import GluTail
    return GluTail(torch.empty((x.numel() // x.shape[-1], half), dtype=x.dtype,
                               device=x.device), xqs)


def norm_tail(residual: torch.Tensor, weight: torch.Tensor, eps: float, xqs):
    """A `quant_gemv_tail.NormTail` (the residual add and RMSNorm after a projection, into
    the next GEMV's int8 forms `xqs`), or None where it cannot run. `xqs`: the buffers, or a
    function making them, called only where the config table lets the tail run."""
    if not xqs or not use_triton(residual):
        return None
    from .configs import get_config
    cfg = get_config(residual.device)
    if not cfg.gemv_tails or residual.shape[-1] > cfg.gemv_norm_tail_max_n:
        return None  # the GEMV would not take it (quant_gemv_tail.tail_launch)
    xqs = xqs() if callable(xqs) else xqs
    if not xqs:
        return None
    from .quant_gemv_tail import norm_tail as make
    return make(residual, weight, eps, xqs)


class Normed(NamedTuple):
    """A layer input whose residual add and RMSNorm the projection before it did
    (`norm_tail`): `out` normed, `residual` the new residual, `xqs` out's int8 forms."""
    out: torch.Tensor
    residual: torch.Tensor
    xqs: dict


class Summed(NamedTuple):
    """A residual stream already added by the projection before a norm (`linear_add`): h =
    that projection's output + the residual, rounded as `rms_norm`'s add rounds it, and ss
    [rows, P] fp32, partial sums of squares of h's rows (their sum is the row's). The norm
    after it takes h as its input with no residual, and h is also the next residual."""
    h: torch.Tensor
    ss: torch.Tensor


def linear_add(x: torch.Tensor, w, bias: torch.Tensor | None, residual: torch.Tensor | None,
               glu: bool = False) -> tuple:
    """(linear(x, w, bias), residual) for the projection before a norm (an attention's o, an
    MLP's down; `glu`: x is the gate/up output, SiLU-and-mul done on the way in), or, where
    the dense GEMV runs and `dense_gemv_sum_ahead` is on, (Summed, None): the residual add and
    the norm's sums of squares done in the GEMV's epilogue, so the norm after it needs no
    launch of its own (`dense_gemv_epilogue.py`)."""
    if residual is not None and isinstance(w, torch.Tensor) and use_triton(x) and \
            residual.dtype == x.dtype:
        from .configs import get_config
        from .dense_gemv import applies, dense_gemv
        if get_config(x.device).dense_gemv_sum_ahead and applies(x, w):
            return Summed(*dense_gemv(x, w, bias, glu=glu, add=residual)), None
    if glu:
        return silu_and_mul_linear(x, w, bias), residual
    return linear(x, w, bias), residual


def _gemv_norm_input(x, norm_weight, w, residual) -> torch.Tensor | None:
    """x's tensor (a `Summed`'s h) where the dense GEMV can take this norm's input in its
    loads (dense weight, Triton, one dtype), else None."""
    xt = x.h if isinstance(x, Summed) else x
    fits = isinstance(w, torch.Tensor) and use_triton(xt) and norm_weight.dtype == xt.dtype \
        and (residual is None or residual.dtype == xt.dtype)
    return xt if fits else None


def _norm_kw(x, norm_weight, eps, residual) -> dict:
    if isinstance(x, Summed):
        return dict(norm=(norm_weight, eps, None), ss=x.ss)
    return dict(norm=(norm_weight, eps, residual))


def rms_norm_linear(x, norm_weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None, w, bias: torch.Tensor | None = None):
    """(linear(rms_norm(x, norm_weight, eps, residual), w, bias), the residual after the norm)
    for a dense weight: the residual is x + residual (x itself without one), as `rms_norm`
    returns it. Where the dense GEMV runs and `dense_gemv.norm_pays`, the norm is done in the
    GEMV's loads: one launch instead of two, the normed input never stored
    (`dense_gemv.py`). x may be a `Summed` (residual None): its partial sums give the norm's
    scale, so the GEMV always takes the norm."""
    xt = _gemv_norm_input(x, norm_weight, w, residual)
    if xt is not None:
        from .dense_gemv import applies, dense_gemv, norm_pays
        if applies(xt, w) and (isinstance(x, Summed) or norm_pays(w)):
            return dense_gemv(xt, w, bias, **_norm_kw(x, norm_weight, eps, residual))
    if isinstance(x, Summed):
        x, residual = x.h, None
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), w, bias), x
    h, residual = rms_norm(x, norm_weight, eps, residual)
    return linear(h, w, bias), residual


def rms_norm_qkv_rope_cache(x, norm_weight: torch.Tensor, eps: float,
                            residual: torch.Tensor | None, w, bias: torch.Tensor | None,
                            positions: torch.Tensor, cos_sin: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int):
    """(qkv_rope_cache(qkv, ...), residual) for (qkv, residual) = `rms_norm_linear(...)`: a
    layer's input norm, QKV projection, RoPE and KV-cache write (no q/k norm). Where the dense
    GEMV runs and `dense_gemv_rope` is on, the RoPE and the cache write in the GEMV's epilogue,
    and the norm in its loads where `dense_gemv.norm_pays` or x is a `Summed`
    (`dense_gemv.py`)."""
    xt = _gemv_norm_input(x, norm_weight, w, residual)
    if xt is not None:
        from .configs import get_config
        from .dense_gemv import applies, dense_gemv, norm_pays, rope_fits
        if applies(xt, w) and get_config(xt.device).dense_gemv_rope and \
                rope_fits(w, k_cache, num_heads, num_kv_heads) and \
                v_cache.stride(-1) == 1 and v_cache.stride(-2) == v_cache.shape[-1]:
            rope = (positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
            if isinstance(x, Summed) or norm_pays(w, rope=True):
                return dense_gemv(xt, w, bias, rope=rope,
                                  **_norm_kw(x, norm_weight, eps, residual))
            if residual is None:
                return dense_gemv(rms_norm(x, norm_weight, eps), w, bias, rope=rope), x
            h, residual = rms_norm(x, norm_weight, eps, residual)
            return dense_gemv(h, w, bias, rope=rope), residual
    qkv, residual = rms_norm_linear(x, norm_weight, eps, residual, w, bias)
    return qkv_rope_cache(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads,
                          num_kv_heads), residual


def linear_parts(x: torch.Tensor, parts: list, bias: torch.Tensor | None = None,
                 xqs: dict | None = None) -> torch.Tensor:
    """y = x @ [W_0; W_1; ...]^T + bias for a projection stored as several row segments: on
    GPUs, segments that are all quantized write one output (quant_triton.quant_matmul_parts);
    otherwise one matmul per segment, concatenated."""
    from .quant import QuantWeight
    if use_triton(x) and all(isinstance(p, QuantWeight) for p in parts):
        from .quant_triton import quant_matmul_parts
        return quant_matmul_parts(x, parts, bias, xqs=xqs)
    out = torch.cat([linear(x, p) for p in parts], dim=-1)
    return out + bias if bias is not None else out


def gemv_input_buffers(parts: list, rows: int, k: int, device: torch.device) -> dict:
    """Empty buffers for the int8 forms of a [rows, K] input that the quantized GEMV of
    `parts` reads (`quant_x.quantize_x` of the rows flattened: True = two planes, False =
    q8_0's group order), when that GEMV is what will run and takes all the rows in one launch
    (quantized parts, Triton, rows <= gemv_max_m, gemv_rows_per_launch and each part's
    `skinny_rows`); else {}. The kernel that produces the input (`rms_norm`, `silu_and_mul`
    with `xqs=`) fills them in the same launch, which saves the GEMV's own quantizing launch."""
    from .quant import QuantWeight
    if rows < 1 or not parts or k % 32 or not use_triton(torch.device(device)) or \
            not all(isinstance(p, QuantWeight) for p in parts):
        return {}
    if rows > 1:
        from .configs import get_config
        from .quant_triton import skinny_rows
        cfg = get_config(torch.device(device))
        if rows > min(cfg.gemv_max_m, max(1, cfg.gemv_rows_per_launch),
                      *(skinny_rows(cfg, p.qtype) for p in parts)):
            return {}
    from .elementwise_triton import xq_layouts
    return xq_layouts(sorted({p.qtype != "q8_0" for p in parts}), rows, k, device)


def weight_nbytes(w) -> int:
    """Bytes a dense, quantized or CPU-packed weight takes."""
    from .quant import QuantWeight, nbytes
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return nbytes(w) if isinstance(w, QuantWeight) else w.nbytes


def weight_kind(w) -> str:
    """`bfloat16`, `q4_k`, ... (the file's type, whatever form the device reads it in)."""
    if isinstance(w, torch.Tensor):
        return str(w.dtype).removeprefix("torch.")
    return w.qtype
