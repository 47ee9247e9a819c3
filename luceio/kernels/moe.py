"""Mixture-of-experts: top-k routing and the experts' SwiGLU, as torch references.

Rules (transformers' `Qwen3MoeSparseMoeBlock`):
- Routing: softmax of the router logits in fp32, the top-k experts of each token, their
  probabilities renormalised to sum 1 when the model says so (`norm_topk_prob`), then cast to
  the activations' dtype.
- Experts: expert e holds `w_gate_up[e]` ([gate | up] rows, [2 * inter, hidden]) and
  `w_down[e]` ([hidden, inter]); a token's output is the weighted sum over its k experts of
  down_e(silu(gate_e x) * up_e x).
- The computation is grouped by expert: the (token, expert) pairs are sorted by expert (stably,
  so a token's contributions are added in ascending expert order, as transformers adds them),
  each expert runs two GEMMs on its contiguous group, and the weighted rows are scatter-added
  back to their tokens. A grouped-GEMM kernel reads the same grouping (`group_by_expert`).
- Rounds (expert offload, `models/expert_offload.py`): the stacks may hold only some experts,
  at rows other than their ids. `rounds` then yields, per round, each expert's row in the
  stacks during that round (-1: another round computes it), and may rewrite the stacks between
  rounds; every expert with pairs is in exactly one round. A pair's result does not depend on
  its round, and the tokens' sums are taken once, after the last round, in the same order: the
  output equals one round over fully resident stacks, bit for bit.
"""
from __future__ import annotations

import itertools
from typing import Iterable, NamedTuple

import torch
import torch.nn.functional as F

from .activation import silu_and_mul_ref


class InPlace(NamedTuple):
    """Expert offload read in place (`models/expert_offload.py`), for the Triton kernels and
    `fused_moe_ref`: the stacks they are given are the device slots; expert e is read from
    slot where[e], or at -1 from row e of the host stacks (pinned memory the device reads over
    the bus). counts [2, num_experts] int32: a launch adds 1 to counts[0][e] for each expert e
    it computes, and to counts[1][e] when e is read from the host. Nothing is read back to the
    host, so a CUDA graph captures it. Quantized experts (`moe_quant_triton.py`): the host
    stacks are `QuantWeight`s laid out as the device slots, expert e at rows e * n ... ."""
    where: torch.Tensor
    host_gate_up: torch.Tensor
    host_down: torch.Tensor
    counts: torch.Tensor


# steps of at most this many tokens take the few-token GPU path (`moe_decode_triton.py`)
DECODE_MAX_TOKENS = 8


def route_topk_ref(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] -> (weights [num_tokens, top_k] in the logits'
    dtype, expert_ids [num_tokens, top_k] int64), best expert first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), expert_ids


def group_by_expert(expert_ids: torch.Tensor,
                    num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """expert_ids [num_tokens, top_k] -> (order [num_tokens * top_k]: the flat pair indices
    sorted by expert, stable; counts: pairs per expert). Pair p is token p // top_k."""
    flat = expert_ids.flatten()
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist()


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  weights: torch.Tensor, expert_ids: torch.Tensor,
                  rounds: Iterable[torch.Tensor] | None = None,
                  in_place: InPlace | None = None) -> torch.Tensor:
    """x [num_tokens, hidden]; w_gate_up [num_rows, 2 * inter, hidden]; w_down
    [num_rows, hidden, inter]; weights, expert_ids [num_tokens, top_k] (`route_topk_ref`);
    rounds: None (expert e at row e) or [num_experts] int64 stack rows per round (see the
    module docstring); in_place: `InPlace` (the stacks are its slots; counted as the kernels
    count). Returns [num_tokens, hidden]."""
    if in_place is not None:
        where = in_place.where.to(torch.int64)
        used = torch.bincount(expert_ids.flatten(), minlength=where.numel()) > 0
        in_place.counts[0] += used.to(in_place.counts.dtype)
        in_place.counts[1] += (used & (where < 0)).to(in_place.counts.dtype)
        held = (where >= 0).to(x.device)
        w_gate_up, w_down = (torch.where(held[:, None, None], slots[where.clamp(min=0)], host)
                             for slots, host in ((w_gate_up, in_place.host_gate_up),
                                                 (w_down, in_place.host_down)))
    top_k = expert_ids.shape[1]
    order, counts = group_by_expert(expert_ids, w_gate_up.shape[0])
    token_ids = order // top_k
    rows = x[token_ids]  # [num_pairs, hidden], grouped by expert
    out = torch.empty_like(rows)
    starts = [0, *itertools.accumulate(counts)]
    for stack_rows in [range(len(counts))] if rounds is None else (r.tolist() for r in rounds):
        for expert, count in enumerate(counts):
            row = stack_rows[expert] if count else -1
            if row >= 0:
                group = slice(starts[expert], starts[expert + 1])
                act = silu_and_mul_ref(F.linear(rows[group], w_gate_up[row]))
                out[group] = F.linear(act, w_down[row])
    out *= weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, token_ids, out)


def per_expert_moe(x: torch.Tensor, experts: list, weights: torch.Tensor,
                   expert_ids: torch.Tensor, linear,
                   rounds: Iterable[torch.Tensor] | None = None,
                   num_experts: int | None = None) -> torch.Tensor:
    """`fused_moe_ref` over experts stored one by one (quantized ones: `QuantWeight`s or the
    CPU's packed forms): experts[e] = (gate_up, down), gate_up one [2 * inter, hidden] weight or
    a (gate, up) pair; `linear(x, w)` is `kernels.linear`. With `rounds` (expert offload, see
    the module docstring) `experts` are the device slots, expert e computed from
    experts[row] in the round whose row for it is >= 0, and `num_experts` counts the experts.
    The groups' sizes are read on the host, so a step that runs this cannot be a CUDA graph."""
    top_k = expert_ids.shape[1]
    order, counts = group_by_expert(expert_ids, num_experts or len(experts))
    token_ids = order // top_k
    rows = x[token_ids]
    out = torch.empty_like(rows)
    starts = [0, *itertools.accumulate(counts)]
    for stack_rows in [range(len(counts))] if rounds is None else (r.tolist() for r in rounds):
        for expert, count in enumerate(counts):
            row = stack_rows[expert] if count else -1
            if row < 0:
                continue
            gate_up, down = experts[row]
            group = slice(starts[expert], starts[expert + 1])
            if isinstance(gate_up, tuple):
                h = torch.cat([linear(rows[group], gate_up[0]),
                               linear(rows[group], gate_up[1])], dim=-1)
            else:
                h = linear(rows[group], gate_up)
            out[group] = linear(silu_and_mul_ref(h), down)
    out *= weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token_ids, out)
