"""What one fused kernel hands the next in a decoder layer's decode step, in place of a plain
tensor (see `kernels.linear_add`, `kernels.attention_for` and `dense_gemv_fused.py`)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class AttnPartials(NamedTuple):
    """A split decode attention left unmerged: po [rows, heads, splits, head_dim] normalised
    partial outputs and pl [rows, heads, splits] their log2-sum-exps (fp32)."""
    po: torch.Tensor
    pl: torch.Tensor


class Summed(NamedTuple):
    """A residual stream already added by the projection before a norm (`linear_add`): h =
    that projection's output + the residual, rounded as `rms_norm`'s add rounds it, and ss
    [rows, P] fp32, partial sums of squares of h's rows (their sum is the row's). The norm
    after it takes h as its input with no residual, and h is also the next residual."""
    h: torch.Tensor
    ss: torch.Tensor
