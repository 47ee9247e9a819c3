"""RMSNorm, optionally fused with the residual add that precedes it."""
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
