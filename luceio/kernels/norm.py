"""RMSNorm, optionally fused with the residual add that precedes it: Llama's (cast, then scale)
and Gemma's (scale by offset + w in fp32, then cast)."""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """HF LlamaRMSNorm semantics: normalise in fp32, cast back, then scale.

    x, residual: [num_tokens, hidden]. With `residual`, computes
    `residual = x + residual` first and returns `(normed, residual)`; without it
    returns `normed` alone.
    """
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def gemma_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       offset: float = 1.0, residual: torch.Tensor | None = None):
    """HF GemmaRMSNorm semantics (also Qwen3.5's norms): normalise in fp32, scale by
    (offset + w) in fp32 (Gemma 3 and Qwen3.5: offset 1; Gemma 4: 0; `weight` None: no scale),
    then cast. `residual` as in `rms_norm_ref`: returns `(normed, x + residual)`."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        h = h * (offset + weight.float())
    out = h.to(x.dtype)
    return out if residual is None else (out, residual)
