"""Mixture-of-experts at decode sizes (a few tokens): routing in one launch, the experts as
one-row GEMVs, no grouping of pairs by expert.

`moe_triton.fused_moe` groups the (token, expert) pairs by expert into tiles of at least 16 rows
for `tl.dot`, which at one token per expert leaves 15 of 16 rows empty and costs ~15 small torch
launches of sorting and aligning per layer. Here, for at most `moe.DECODE_MAX_TOKENS` tokens:
- `route_topk`: per token, the fp32 softmax over the experts, the top k by repeated maximum
  (ties: the lowest expert id; best first), renormalised when asked, cast to the logits' dtype
  (`moe.route_topk_ref`'s rules).
- `moe_decode` launch 1, per (pair, BLOCK_N columns of inter): the pair's token against its
  expert's gate and up rows, epilogue `silu_and_mul`'s (the reference's roundings).
- Launch 2, per (pair, BLOCK_N columns of hidden): the activations against the expert's down
  rows, rounded to the dtype, times the routing weight, rounded again, into the pair's own row
  (as `fused_moe`'s per-pair rows).
- Launch 3, per token: its k rows summed in rank order in fp32 and rounded once (as `fused_moe`
  sums them). With a shared expert (Qwen3.5-MoE, Qwen3-Next) it also adds sigmoid(its gate
  logit) * its output, each rounded as the torch ops round. Summing in a launch of its own
  rather than inside launch 2 keeps expert offload's rounds (below) bit for bit equal to
  resident experts: inside one kernel the compiler may fuse an fp32 product into the sum (FMA),
  which a product stored and summed later cannot reproduce.
Each expert's weights are read once per pair that picked it: at a few tokens that is what the
grouped path reads too. Nothing reads back to the host, so CUDA graphs capture it. With expert
offload's rounds, launches 1 and 2 run once per round over that round's pairs and launch 3
after the last: the same kernels, the same bits as resident experts. Read in place
(`moe.InPlace`, the offload's CUDA-graph path) they run once, each pair's expert read from
the device slot or host row the table names (`expert_base`), each expert counted once, by its
first pair's first column block in the gate/up launch (`count_expert`).
"""
from __future__ import annotations

from typing import Iterable

import torch
import triton
import triton.language as tl

from .configs import get_config
from .elementwise_triton import silu_mul
from .moe import InPlace


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, s_l, E, TOP_K: tl.constexpr, KP: tl.constexpr,
                  RENORM: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    es = tl.arange(0, BLOCK_E)
    em = es < E
    logit = tl.load(logits_ptr + t * s_l + es, mask=em, other=-float("inf")).to(tl.float32)
    e = tl.where(em, tl.exp(logit - tl.max(logit, 0)), 0.0)
    p = tl.where(em, e / tl.sum(e, 0), -1.0)
    ks = tl.arange(0, KP)
    picked = tl.zeros([KP], tl.float32)
    ids = tl.zeros([KP], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, es, BLOCK_E), 0)
        picked = tl.where(ks == j, best, picked)
        ids = tl.where(ks == j, idx.to(tl.int64), ids)
        p = tl.where(es == idx, -1.0, p)
    if RENORM:
        picked = picked / tl.sum(picked, 0)
    km = ks < TOP_K
    tl.store(w_ptr + t * TOP_K + ks, picked.to(w_ptr.dtype.element_ty), mask=km)
    tl.store(ids_ptr + t * TOP_K + ks, ids, mask=km)


def route_topk(router_logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route_topk_ref` in one launch: (weights [n, top_k] in the logits' dtype, expert ids
    [n, top_k] int64), best first."""
    n, num_experts = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty((n, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((n, top_k), dtype=torch.int64, device=logits.device)
    if n:
        _route_kernel[(n,)](logits, weights, ids, logits.stride(0), num_experts, TOP_K=top_k,
                            KP=triton.next_power_of_2(top_k), RENORM=renormalize,
                            BLOCK_E=triton.next_power_of_2(num_experts), num_warps=4)
    return weights, ids


@triton.jit
def expert_base(w_ptr, h_ptr, where_ptr, expert, s_we, IN_PLACE: tl.constexpr):
    """The first weight of `expert` in the stacks: row `expert` of w, or IN_PLACE (expert
    offload read in place) the device slot `where[expert]`, or at -1 the expert's row of the
    host stack h (pinned, mapped: read over the bus)."""
    base = w_ptr + expert * s_we
    if IN_PLACE:
        slot = tl.load(where_ptr + expert)
        base = tl.where(slot >= 0, w_ptr + slot * s_we, h_ptr + expert * s_we)
    return base


@triton.jit
def count_expert(cnt_ptr, where_ptr, expert, num_experts):
    """Expert offload's counters, once per expert a launch computes: cnt[expert] += 1, and
    cnt[num_experts + expert] += 1 when it is read from host memory (no slot in the table)."""
    slot = tl.load(where_ptr + expert)
    tl.atomic_add(cnt_ptr + expert, 1)
    tl.atomic_add(cnt_ptr + num_experts + expert, (slot < 0).to(tl.int32))


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, h_ptr, where_ptr, cnt_ptr, num_experts,
                    top_k, hidden, inter, s_x, s_we, s_wn, s_act, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IN_PLACE: tl.constexpr, PAIRS: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    t = p // top_k
    expert = tl.load(ids_ptr + p)
    if expert < 0:  # another round's pair
        return
    if IN_PLACE:  # counted by the expert's first pair (PAIRS: a power of two >= the pairs)
        if tl.program_id(1) == 0:
            before = tl.arange(0, PAIRS)
            earlier = tl.load(ids_ptr + before, mask=before < p, other=-1)
            if tl.sum((earlier == expert).to(tl.int32), 0) == 0:
                count_expert(cnt_ptr, where_ptr, expert, num_experts)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < inter
    gate_ptrs = expert_base(w_ptr, h_ptr, where_ptr, expert, s_we, IN_PLACE) + \
        cols[:, None].to(tl.int64) * s_wn
    up_ptrs = gate_ptrs + inter * s_wn
    acc_gate = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        km = ks < hidden
        x = tl.load(x_ptr + t * s_x + ks, mask=km, other=0.0).to(tl.float32)
        m = cm[:, None] & km[None, :]
        gate = tl.load(gate_ptrs + ks[None, :], mask=m, other=0.0).to(tl.float32)
        up = tl.load(up_ptrs + ks[None, :], mask=m, other=0.0).to(tl.float32)
        acc_gate += tl.sum(gate * x[None, :], 1)
        acc_up += tl.sum(up * x[None, :], 1)
    dt = act_ptr.dtype.element_ty
    act = silu_mul(acc_gate.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32), act_ptr)
    tl.store(act_ptr + p * s_act + cols, act, mask=cm)


@triton.jit
def _pair_down(act_ptr, w_base, route_ptr, p, cols, cm, inter, s_act, s_wn,
               dt: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A pair's down projection for `cols` (its expert's rows from `w_base`), rounded, times
    its routing weight, rounded (fp32 holding dtype values)."""
    w_ptrs = w_base + cols[:, None].to(tl.int64) * s_wn
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        km = ks < inter
        a = tl.load(act_ptr + p * s_act + ks, mask=km, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + ks[None, :], mask=cm[:, None] & km[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :], 1)
    route = tl.load(route_ptr + p).to(tl.float32)
    return (acc.to(dt).to(tl.float32) * route).to(dt).to(tl.float32)


@triton.jit
def _finish(total, t, cols, cm, out_ptr, sh_ptr, sg_ptr, s_out, s_sh, s_sg,
            SHARED: tl.constexpr):
    """A token's summed pairs rounded once, + sigmoid(gate) * shared rounded as torch rounds."""
    dt = out_ptr.dtype.element_ty
    y = total.to(dt)
    if SHARED:
        g = tl.load(sg_ptr + t * s_sg).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        s = tl.load(sh_ptr + t * s_sh + cols, mask=cm, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + (gate * s).to(dt).to(tl.float32)).to(dt)
    tl.store(out_ptr + t * s_out + cols, y, mask=cm)


@triton.jit
def _down_pairs_kernel(act_ptr, w_ptr, ids_ptr, route_ptr, y_ptr, h_ptr, where_ptr, inter,
                       hidden, s_act, s_we, s_wn, s_y, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, IN_PLACE: tl.constexpr):
    """Per (pair, columns): the pair's row into y [pairs, hidden] (pairs of another round of
    expert offload skip)."""
    p = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + p)
    if expert < 0:  # another round's pair
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < hidden
    w_base = expert_base(w_ptr, h_ptr, where_ptr, expert, s_we, IN_PLACE)
    y = _pair_down(act_ptr, w_base, route_ptr, p, cols, cm, inter, s_act, s_wn,
                   y_ptr.dtype.element_ty, BLOCK_N, BLOCK_K)
    tl.store(y_ptr + p * s_y + cols, y.to(y_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _sum_pairs_kernel(y_ptr, out_ptr, sh_ptr, sg_ptr, hidden, s_y, s_out, s_sh, s_sg,
                      TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_N: tl.constexpr):
    """After the last round: a token's k rows summed in rank order."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < hidden
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        total += tl.load(y_ptr + (t * TOP_K + j) * s_y + cols, mask=cm, other=0.0).to(tl.float32)
    _finish(total, t, cols, cm, out_ptr, sh_ptr, sg_ptr, s_out, s_sh, s_sg, SHARED)


def moe_decode(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
               weights: torch.Tensor, expert_ids: torch.Tensor,
               shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
               rounds: Iterable[torch.Tensor] | None = None,
               in_place: InPlace | None = None) -> torch.Tensor:
    """`moe.fused_moe_ref` for a few tokens: x [n, hidden], w_gate_up [rows, 2 * inter,
    hidden], w_down [rows, hidden, inter], weights / expert_ids [n, k]. With `shared` [n,
    hidden] and `shared_gate` [n, 1] (a shared expert's output and gate logit) returns routed +
    sigmoid(shared_gate) * shared. `rounds` (expert offload, `kernels/moe.py`'s rules): per
    round the [num_experts] stack rows (-1: another round); each round's pairs are written to
    their own rows and the tokens' sums taken after the last, in the order the one-round launch
    adds them, so the output is the resident one's bit for bit. `in_place` (expert offload
    read in place, `moe.InPlace`): w_gate_up / w_down are the device slots, each expert read
    from the slot its table names or from the host stacks, and counted; one pass, no rounds."""
    n, hidden = x.shape
    inter, top_k = w_down.shape[2], expert_ids.shape[1]
    x, weights, ids = x.contiguous(), weights.contiguous(), expert_ids.contiguous()
    if w_gate_up.stride(-1) != 1 or w_down.stride(-1) != 1:
        raise ValueError("moe_decode needs the expert stacks' rows contiguous")
    out = torch.empty_like(x)
    if n == 0:
        for _ in rounds or ():
            pass
        return out
    act = torch.empty((n * top_k, inter), dtype=x.dtype, device=x.device)
    sh = shared if shared is not None else out
    sg = shared_gate if shared_gate is not None else out
    tail = (sh.stride(0), sg.stride(0))
    cfg = get_config(x.device)
    y = torch.empty((n * top_k, hidden), dtype=x.dtype, device=x.device)
    bn = cfg.moe_decode_down_block_n
    if in_place is not None and rounds is not None:
        raise ValueError("moe_decode takes rounds or in_place, not both")
    tables = in_place or InPlace(ids, w_gate_up, w_down, ids)  # unread unless in place
    for stack_rows in [None] if rounds is None else rounds:
        # each pair's stack row this round, or -1
        rows = ids if stack_rows is None else stack_rows.to(x.device)[ids]
        _gate_up(x, w_gate_up, rows, act, top_k, cfg, tables, in_place is not None)
        _down_pairs_kernel[(n * top_k, triton.cdiv(hidden, bn))](
            act, w_down, rows, weights, y, tables.host_down, tables.where, inter, hidden,
            act.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0), BLOCK_N=bn,
            BLOCK_K=cfg.moe_decode_down_block_k, IN_PLACE=in_place is not None,
            num_warps=cfg.moe_decode_down_num_warps)
    _sum_pairs_kernel[(n, triton.cdiv(hidden, 256))](
        y, out, sh, sg, hidden, y.stride(0), out.stride(0), *tail, TOP_K=top_k,
        SHARED=shared is not None, BLOCK_N=256, num_warps=4)
    return out


def _gate_up(x, w_gate_up, ids, act, top_k, cfg, tables: InPlace, in_place: bool):
    inter, bn = act.shape[1], cfg.moe_decode_gu_block_n
    _gate_up_kernel[(ids.numel(), triton.cdiv(inter, bn))](
        x, w_gate_up, ids, act, tables.host_gate_up, tables.where, tables.counts,
        tables.where.shape[0], top_k, x.shape[1], inter, x.stride(0), w_gate_up.stride(0),
        w_gate_up.stride(1), act.stride(0), BLOCK_N=bn, BLOCK_K=cfg.moe_decode_gu_block_k,
        IN_PLACE=in_place, PAIRS=triton.next_power_of_2(ids.numel()) if in_place else 1,
        num_warps=cfg.moe_decode_gu_num_warps)
