"""SiLU-and-mul: the gated activation of Llama-family MLPs."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] laid out as [gate | up]; returns silu(gate) * up, [num_tokens, d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
