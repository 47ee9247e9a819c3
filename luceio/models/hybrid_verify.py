"""Speculative decoding on hybrid models: a verify step keeps every position's DeltaNet state,
and the engine keeps the one after the last accepted token.

A verify step's request runs its tokens [last, d1 .. dk] through each Gated DeltaNet layer one
token at a time: the recurrent step plain decoding takes (the same functions, the Triton decode
kernel on GPUs), so the state after the last accepted draft is the state plain decoding reaches
after those tokens. After each token the layer stores the recurrent state and the conv state in
buffers of the step, [requests, k + 1, ...] per layer (`KeptStates`); the pool rows of a
verifying request are not written during the step. Once the target's tokens are known,
`commit` copies, for a requests that accepted a drafts, its states after input a (the last token
that stays in the sequence; the token the target emits after it is the next step's input) into
its pool rows. A request the step finished or aborted is not committed: its slot is freed.

Cost: the buffers hold (k + 1) states per verifying request and linear layer for the step, freed
after it (a Qwen3.5-9B-like shape keeps ~50 MB of fp32 state per position: 24 layers x 32 heads
x 128 x 128); the verifying tokens run as k + 1 recurrent steps instead of one chunk. Requests of
the same step without drafts (decode, prefill chunks) take the layer's usual path. Draft trees
are refused for these models (`qwen3_5.check_engine_support`): a tree's branches would each need
their own state."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class KeptStates:
    """The verifying sequences of one step and, once its forward ran, their per-position
    states (one entry per linear layer, in layer order)."""
    request_ids: list[str]
    seqs: list[int]  # each one's index among the step's sequences
    lengths: list[int]  # its tokens this step: 1 + drafts
    slots: torch.Tensor | None = None  # their state rows, set by the first layer
    state: list[torch.Tensor] = field(default_factory=list)  # [n, T, v heads, k dim, v dim]
    conv: list[torch.Tensor] = field(default_factory=list)  # [n, T, conv dim, kernel - 1]
    plan: "_Plan | None" = None  # the step's index tensors, built by the first layer

    @classmethod
    def of(cls, scheduled) -> "KeptStates | None":
        """The step's sequences with drafts to verify (chains), or None when there are none."""
        seqs = [i for i, s in enumerate(scheduled) if s.spec_token_ids]
        if not seqs:
            return None
        return cls([scheduled[i].req.request_id for i in seqs], seqs,
                   [1 + len(scheduled[i].spec_token_ids) for i in seqs])


@dataclass
class _Plan:
    """What every linear layer of the step indexes with (built once a step): the verifying
    tokens' rows, and per position t the rows of the sequences that have a token t and their
    lanes; the other sequences' rows and their metadata (None: every sequence verifies)."""
    rows: torch.Tensor
    steps: list[tuple[torch.Tensor, torch.Tensor]]
    other_rows: torch.Tensor | None
    other_meta: object


def _plan(kept: KeptStates, meta, device) -> _Plan:
    starts = meta.query_start_loc.tolist()
    verifying = set(kept.seqs)
    others = [i for i in range(len(starts) - 1) if i not in verifying]
    kept.slots = meta.state_slots[torch.tensor(kept.seqs, device=device)]
    offsets = np.concatenate([[0], np.cumsum(kept.lengths)[:-1]])
    steps = []
    for t in range(max(kept.lengths)):
        lanes = [i for i, n in enumerate(kept.lengths) if n > t]
        steps.append((torch.tensor(offsets[lanes] + t, device=device),
                      torch.tensor(lanes, device=device)))
    other_rows = other_meta = None
    if others:
        lens = [starts[i + 1] - starts[i] for i in others]
        other_rows = _rows(starts, others, device)
        other_meta = dataclasses.replace(
            meta, kept=None, max_query_len=max(lens),
            query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(lens)]),
                                         dtype=meta.query_start_loc.dtype, device=device),
            state_slots=meta.state_slots[torch.tensor(others, device=device)])
    return _Plan(_rows(starts, kept.seqs, device), steps, other_rows, other_meta)


def forward_keeping(gdn, x: torch.Tensor, meta, state: torch.Tensor,
                    conv_state: torch.Tensor) -> torch.Tensor:
    """`GatedDeltaNet.forward` of a step with verifying sequences (`meta.kept`): those token by
    token, keeping each position's states; the other sequences through the usual path."""
    kept = meta.kept
    if kept.plan is None:
        kept.plan = _plan(kept, meta, x.device)
    plan = kept.plan
    out = x.new_empty(x.shape)
    if plan.other_rows is not None:
        out[plan.other_rows] = gdn(x[plan.other_rows], plan.other_meta, state, conv_state)
    mixed, z, b, a = gdn.in_proj(x[plan.rows]).split(gdn.sizes, dim=-1)
    n, T = len(kept.seqs), len(plan.steps)
    s_work, c_work = state[kept.slots].clone(), conv_state[kept.slots].clone()
    s_kept = state.new_empty((n, T, *state.shape[1:]))
    c_kept = conv_state.new_empty((n, T, *conv_state.shape[1:]))
    o = mixed.new_empty((len(plan.rows), gdn.v_heads, gdn.v_dim))
    for t, (idx, lane) in enumerate(plan.steps):
        o[idx] = gdn.recurrent_step(mixed[idx], b[idx], a[idx], s_work, c_work, lane)
        s_kept[lane, t] = s_work[lane]
        c_kept[lane, t] = c_work[lane]
    kept.state.append(s_kept)
    kept.conv.append(c_kept)
    out[plan.rows] = gdn.output(o, z)
    return out


def commit(model, kept: KeptStates, accepted: dict[str, int]) -> None:
    """Writes each verifying request's states after its last accepted input into its pool rows:
    `accepted[request id]` drafts were accepted (requests not in it are left alone)."""
    lanes = [i for i, rid in enumerate(kept.request_ids) if rid in accepted]
    if not lanes or kept.slots is None:
        return
    if len(kept.state) != model.state.shape[0]:
        raise RuntimeError(f"a verify step kept {len(kept.state)} layers' states, the model has "
                           f"{model.state.shape[0]} linear layers")
    device = model.state.device
    lane = torch.tensor(lanes, device=device)
    pos = torch.tensor([accepted[kept.request_ids[i]] for i in lanes], device=device)
    slots = kept.slots[lane]
    for j, (s, c) in enumerate(zip(kept.state, kept.conv)):
        model.state[j, slots] = s[lane, pos]
        model.conv_state[j, slots] = c[lane, pos]


def _rows(starts: list[int], seqs: list[int], device) -> torch.Tensor:
    return torch.tensor([r for i in seqs for r in range(starts[i], starts[i + 1])], device=device)
