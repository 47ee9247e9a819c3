"""Fused mixture-of-experts experts: two grouped GEMM launches over the (token, expert) pairs.

Rules (the reference is `moe.fused_moe_ref`; routing stays `moe.route_topk_ref`):
- Pair p = token * top_k + k. The pairs are sorted by expert, stably, and each expert's group
  is padded to a whole number of BLOCK_M-row tiles (`align_pairs`, vLLM's `moe_align_block_size`):
  `sorted_ids[tile * BLOCK_M + i]` is a pair id, or `num_pairs` for a padding slot, and
  `tile_expert[tile]` its tile's expert, or -1 for the tiles past the last one. The grid is a
  static bound on the tile count, so nothing here reads a count back to the host (no sync, and
  a CUDA graph can capture it).
- Launch 1, per (tile, BLOCK_N columns of inter): a tile's rows of x against its expert's gate
  and up rows for the same columns, two fp32 accumulators; the epilogue is `silu_and_mul`'s
  (gate and up rounded to the dtype as the reference's GEMM output is, SiLU rounded, times up),
  written per padded slot.
- Launch 2, per (tile, BLOCK_N columns of hidden): the activations against the expert's down
  rows, the result rounded to the dtype and times the pair's routing weight (the reference's
  order), written to the pair's own row of a [num_tokens, top_k, hidden] buffer.
- The k rows of a token are then summed (fp32 accumulation, one rounding). Per-pair rows rather
  than fp32 atomics into the tokens: the sum is deterministic, run to run and whatever the
  batch, no zeroed fp32 buffer and cast are needed, and a token's k rows are added in one pass.
  The reference adds them in ascending expert order, rounding after each add; this adds in
  rank order and rounds once, so outputs differ by rounding only (tests state the tolerances).
- Rounds (expert offload; `moe.py`'s rules): the pairs are aligned once over all experts, as
  with resident stacks, and each round launches both kernels with the tiles of its experts
  pointed at their stack rows (the others' tiles skip); every pair's row is written by its own
  round, and the tokens' sums are taken after the last. In place (`moe.InPlace`, the offload's
  CUDA-graph path): one pass, each tile's expert read from the device slot or host row its
  table names, each expert counted by its first tile.
- Under TRITON_INTERPRET=1 the dot operands go as fp32 (the interpreter's half-precision dot is
  wrong); fp32 inputs use IEEE fp32 dots (no TF32), as attention_triton does.
"""
from __future__ import annotations

import itertools
import os
from typing import Iterable

import torch
import triton
import triton.language as tl

from .attention_tile_triton import _dot
from .configs import get_config
from .elementwise_triton import silu_mul
from .moe import InPlace
from .moe_decode_triton import count_expert, expert_base


@triton.jit
def _tile(sorted_ids_ptr, w_ptr, h_ptr, where_ptr, expert, num_pairs, num_cols, s_we, s_wn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          IN_PLACE: tl.constexpr):
    """This program's padded slots, their pairs (masked: padding), its output columns and
    pointers to the first BLOCK_K inputs of its expert's weight rows for them ([K, N]; in
    place: from the slot or host row the offload's table names)."""
    slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + slots)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    w_ptrs = (expert_base(w_ptr, h_ptr, where_ptr, expert.to(tl.int64), s_we, IN_PLACE)
              + cols[None, :].to(tl.int64) * s_wn + kk[:, None])
    return slots, pairs, pairs < num_pairs, cols, cols < num_cols, kk, w_ptrs


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, act_ptr, sorted_ids_ptr, tile_expert_ptr, h_ptr,
                         where_ptr, cnt_ptr, num_experts, num_pairs, top_k, hidden, inter, s_x,
                         s_we, s_wn, s_act, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr,
                         IN_PLACE: tl.constexpr):
    expert = tl.load(tile_expert_ptr + tl.program_id(0))
    if expert < 0:  # past the last tile
        return
    slots, pairs, rmask, cols, cmask, kk, gate_ptrs = _tile(
        sorted_ids_ptr, w_ptr, h_ptr, where_ptr, expert, num_pairs, inter, s_we, s_wn,
        BLOCK_M, BLOCK_N, BLOCK_K, IN_PLACE)
    if IN_PLACE:  # counted by the expert's first tile
        if tl.program_id(1) == 0:
            pid = tl.program_id(0)
            if tl.load(tile_expert_ptr + pid - 1, mask=pid > 0, other=-1) != expert:
                count_expert(cnt_ptr, where_ptr, expert, num_experts)
    tokens = (pairs // top_k).to(tl.int64)
    x_ptrs = x_ptr + tokens[:, None] * s_x + kk[None, :]                          # [M, K]
    up_ptrs = gate_ptrs + inter * s_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kmask = kk < hidden - k0
        x = tl.load(x_ptrs + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & cmask[None, :]
        gate = tl.load(gate_ptrs + k0, mask=wmask, other=0.0)
        up = tl.load(up_ptrs + k0, mask=wmask, other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            gate = gate.to(tl.float32)
            up = up.to(tl.float32)
        acc_gate += _dot(x, gate, DOT_IEEE)
        acc_up += _dot(x, up, DOT_IEEE)
    dt = act_ptr.dtype.element_ty  # rounded where the reference's F.linear and silu_and_mul round
    act = silu_mul(acc_gate.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32), act_ptr)
    tl.store(act_ptr + slots[:, None].to(tl.int64) * s_act + cols[None, :], act,
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, weights_ptr, out_ptr, sorted_ids_ptr, tile_expert_ptr, h_ptr,
                 where_ptr, num_pairs, inter, hidden, s_act, s_we, s_wn, s_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr, IN_PLACE: tl.constexpr):
    expert = tl.load(tile_expert_ptr + tl.program_id(0))
    if expert < 0:  # past the last tile
        return
    slots, pairs, rmask, cols, cmask, kk, w_ptrs = _tile(
        sorted_ids_ptr, w_ptr, h_ptr, where_ptr, expert, num_pairs, hidden, s_we, s_wn,
        BLOCK_M, BLOCK_N, BLOCK_K, IN_PLACE)
    a_ptrs = act_ptr + slots[:, None].to(tl.int64) * s_act + kk[None, :]          # [M, K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kmask = kk < inter - k0
        a = tl.load(a_ptrs + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += _dot(a, w, DOT_IEEE)
    dt = out_ptr.dtype.element_ty  # the reference rounds F.linear's output, then weights it
    route = tl.load(weights_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * route[:, None]
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * s_out + cols[None, :], y.to(dt),
             mask=rmask[:, None] & cmask[None, :])


def align_pairs(expert_ids: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [num_tokens, top_k] -> (sorted_ids [max_tiles * block_m], tile_expert
    [max_tiles] int32), on the device, without a host sync (see the module docstring).

    max_tiles bounds sum_e ceil(count_e / block_m): at most num_pairs // block_m full tiles
    plus one partial tile per expert that has pairs."""
    flat = expert_ids.flatten()
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync for its length
    tiles = (counts + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles, 0)
    max_tiles = num_pairs // block_m + min(num_experts, num_pairs)
    tile_expert = torch.searchsorted(tiles_end, torch.arange(max_tiles, device=flat.device),
                                     right=True)                   # num_experts past the end
    slot = torch.arange(max_tiles * block_m, device=flat.device)
    slot_expert = tile_expert[slot // block_m]
    e = slot_expert.clamp(max=num_experts - 1)
    local = slot - (tiles_end[e] - tiles[e]) * block_m             # row within the group
    first = torch.cumsum(counts, 0) - counts                       # group start in `order`
    valid = (slot_expert < num_experts) & (local < counts[e])
    pair = order[(first[e] + local).clamp(max=num_pairs - 1)]
    sorted_ids = torch.where(valid, pair, num_pairs).to(torch.int32)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_ids, tile_expert


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              weights: torch.Tensor, expert_ids: torch.Tensor,
              rounds: Iterable[torch.Tensor] | None = None,
              in_place: InPlace | None = None) -> torch.Tensor:
    """As `moe.fused_moe_ref`: x [num_tokens, hidden], w_gate_up [num_rows, 2 * inter, hidden],
    w_down [num_rows, hidden, inter], weights / expert_ids [num_tokens, top_k], rounds: None
    or per round [num_experts] stack rows; or `in_place` (`moe.InPlace`): one pass, each
    expert from the slot or host row its table names."""
    num_tokens, hidden = x.shape
    inter, top_k = w_down.shape[2], expert_ids.shape[1]
    num_pairs = num_tokens * top_k
    rounds = iter([None] if rounds is None else rounds)
    first = next(rounds)  # its length is the expert count when the stacks hold only some
    if in_place is not None and first is not None:
        raise ValueError("fused_moe takes rounds or in_place, not both")
    num_experts = w_gate_up.shape[0] if first is None and in_place is None else \
        (first if first is not None else in_place.where).numel()
    if num_pairs == 0:
        for _ in rounds:
            pass
        return torch.zeros_like(x)
    cfg = get_config(x.device)
    # tiles as tall as an expert's average group (decode: 16, tl.dot's least), up to the config's
    block_m = min(cfg.moe_block_m, max(16, triton.next_power_of_2(-(-num_pairs // num_experts))))
    sorted_ids, tile_expert = align_pairs(expert_ids, num_experts, block_m)
    x, weights = x.contiguous(), weights.contiguous()
    w_gu, w_d = w_gate_up.contiguous(), w_down.contiguous()  # rewritten in place between rounds
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    tables = in_place or InPlace(sorted_ids, w_gu, w_d, sorted_ids)  # unread unless in place
    flags = dict(BLOCK_M=block_m, BLOCK_N=cfg.moe_block_n, BLOCK_K=cfg.moe_block_k,
                 DOT_F32=interp and x.dtype != torch.float32,
                 DOT_IEEE=interp or x.dtype == torch.float32, IN_PLACE=in_place is not None,
                 num_warps=cfg.moe_num_warps, num_stages=cfg.moe_num_stages)
    num_tiles = tile_expert.numel()
    act = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_tokens, top_k, hidden, dtype=x.dtype, device=x.device)
    for stack_rows in itertools.chain([first], rounds):
        tile_row = tile_expert if stack_rows is None else torch.where(
            tile_expert >= 0, stack_rows.to(x.device)[tile_expert.clamp(min=0)], -1
        ).to(torch.int32)
        _gate_up_silu_kernel[(num_tiles, triton.cdiv(inter, cfg.moe_block_n))](
            x, w_gu, act, sorted_ids, tile_row, tables.host_gate_up, tables.where, tables.counts,
            num_experts, num_pairs, top_k, hidden, inter, x.stride(0), w_gu.stride(0),
            w_gu.stride(1), act.stride(0), **flags)
        _down_kernel[(num_tiles, triton.cdiv(hidden, cfg.moe_block_n))](
            act, w_d, weights, out, sorted_ids, tile_row, tables.host_down, tables.where,
            num_pairs, inter, hidden, act.stride(0), w_d.stride(0), w_d.stride(1),
            out.stride(1), **flags)
    return out.sum(dim=1, dtype=torch.float32).to(x.dtype)
