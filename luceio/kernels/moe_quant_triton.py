"""Mixture-of-experts at decode sizes with quantized experts (a GGUF's Q4_K / Q6_K / Q8_0 ...
expert stacks), on the GPU: no host read of the routing, so CUDA graphs capture it.

`moe.per_expert_moe` groups the (token, expert) pairs on the host (a sync per layer) and runs
each routed expert's projections as launches of their own; a model doing so decodes eagerly.
Here a layer's experts are stacked row-wise into one quantized weight per projection
(`gate_up` [E * 2 * inter, hidden], `down` [E * hidden, inter]; expert e's rows are the e-th
block, `models/moe.py` keeps the per-expert weights as views of them) and each projection is
one launch over (column blocks, pairs):
- `_expert_gemv_kernel`: program (j, p) reads pair p's expert e = ids[p] and runs the quantized
  GEMV's body (`quant_gemv.gemv_body`, int8 dp4a) on rows j * BLOCK_N ... of expert e's block
  against one row of x: the pair's token (gate/up) or the pair itself (down), quantized to int8
  per 32-group once for all rows (`quant_x.quantize_x`). No split-K: the pairs fill the grid.
- Between them `silu_and_mul`; after, each pair's row times its routing weight (rounded to the
  dtype, as `per_expert_moe` rounds it) and the k rows of a token summed in rank order in fp32
  and rounded once (`moe_decode_triton._sum_pairs_kernel`, a shared expert's gated output
  added there). `per_expert_moe` adds the rows in expert order rounding after each add, so the
  two differ by rounding only (tests state the tolerance).
- Expert offload read in place (`kernels.moe.InPlace`, `models/expert_tables.py`): the stacks
  are the device slots, expert e at slot where[e] or, at -1, at rows e * N ... of the host
  stacks (pinned, the same layout: `ExpertStore.hold_quantized`), each pointer picked per
  program; the gate/up launch counts each expert once (by its first pair) and its host reads.
Each expert's weights are read once per pair that picked it (at a few tokens, what the
per-expert path reads too); at many pairs this reads far more than grouping would, so eager
steps of more than `moe.DECODE_MAX_TOKENS` tokens keep the per-expert path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import get_config
from .moe import InPlace
from .moe_decode_triton import count_expert
from .quant import QuantWeight
from .quant_args import weight_args, words
from .quant_gemv import gemv_body, prepare_launch, use_asm
from .quant_x import quantize_x


@triton.jit
def _expert_gemv_kernel(ids_ptr, top_k, xq_ptr, xs_ptr, xsum_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr,
                        sc_ptr, mn_ptr, hqs_ptr, hqh_ptr, hd_ptr, hm_ptr, hsc_ptr, hmn_ptr,
                        where_ptr, cnt_ptr, num_experts, out_ptr, M, N, KG, s_om, s_qs, s_qh,
                        s_d, s_sc, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
                        PREFETCH: tl.constexpr, ASM: tl.constexpr, PAIRED: tl.constexpr,
                        X_BY_TOKEN: tl.constexpr, IN_PLACE: tl.constexpr, COUNT: tl.constexpr,
                        PAIRS: tl.constexpr):
    pair = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    row = pair // top_k if X_BY_TOKEN else pair       # the row of x this pair reads
    if IN_PLACE:  # offloaded: the expert's device slot, or at -1 its rows of the host stacks
        slot = tl.load(where_ptr + expert)
        held = slot >= 0
        first = tl.where(held, slot, expert) * N
        qs_ptr = tl.where(held, qs_ptr, hqs_ptr)
        qh_ptr = tl.where(held, qh_ptr, hqh_ptr)
        d_ptr = tl.where(held, d_ptr, hd_ptr)
        m_ptr = tl.where(held, m_ptr, hm_ptr)
        sc_ptr = tl.where(held, sc_ptr, hsc_ptr)
        mn_ptr = tl.where(held, mn_ptr, hmn_ptr)
        if COUNT:  # once per expert a launch computes: by its first pair
            if tl.program_id(0) == 0:
                before = tl.arange(0, PAIRS)
                earlier = tl.load(ids_ptr + before, mask=before < pair, other=-1)
                if tl.sum((earlier == expert).to(tl.int32), 0) == 0:
                    count_expert(cnt_ptr, where_ptr, expert, num_experts)
    else:
        first = expert * N  # the expert's first row in the stacks
    gemv_body(tl.program_id(0), 0, 1, xq_ptr, xs_ptr, xsum_ptr, qs_ptr + first * s_qs,
              qh_ptr + first * s_qh, d_ptr + first * s_d, m_ptr + first * s_d,
              sc_ptr + first * s_sc, mn_ptr + first * s_sc, out_ptr,
              out_ptr + (pair - row) * s_om, out_ptr, out_ptr, M, N, KG, KG, s_om, s_qs, s_qh,
              s_d, s_sc, QTYPE, 1, BLOCK_N, G, PREFETCH, ASM, False, False, PAIRED, M0=row)


def _launch_args(stack: QuantWeight, rows_per_expert: int, k: int, cfg):
    (qs, *rest), strides = weight_args(stack)
    return prepare_launch((words(qs), *rest), (strides[0] // 4, *strides[1:]), stack.qtype,
                          rows_per_expert, k, 1, cfg)


def expert_gemv(x: torch.Tensor, ids: torch.Tensor, top_k: int, stack: QuantWeight,
                rows_per_expert: int, out: torch.Tensor, by_token: bool,
                in_place: tuple | None = None) -> torch.Tensor:
    """out [pairs, N] (pair p = token * top_k + rank): row p = x[p // top_k if by_token else p]
    @ W_e^T for e = ids.flatten()[p], W_e rows e * N ... of `stack` (N = rows_per_expert).
    in_place: (where, host stack, counts or None): expert offload read in place
    (`kernels.moe.InPlace`): W_e is rows where[e] * N ... of `stack` (the device slots) or, at
    -1, rows e * N ... of the host stack (pinned, same layout); with counts the launch counts
    its experts as `moe_decode_triton.count_expert` does."""
    num_m, k = x.shape
    if stack.shape[1] != k or stack.shape[0] % rows_per_expert:
        raise ValueError(f"expert stack [{stack.shape[0]}, {stack.shape[1]}] against x with {k} "
                         f"features and {rows_per_expert} rows an expert")
    cfg = get_config(x.device)
    weights, strides, paired, _, _, programs, block_n = _launch_args(stack, rows_per_expert,
                                                                     k, cfg)
    where = counts = None
    host = weights
    if in_place is not None:
        where, host_stack, counts = in_place
        host, host_strides, host_paired, *_ = _launch_args(host_stack, rows_per_expert, k, cfg)
        own = {t.data_ptr() for t in host_stack.tensors().values()}
        if host_strides != strides or host_paired != paired or any(
                t.data_ptr() not in own for t in host):
            raise ValueError("the host expert stack's layout differs from the device slots' "
                             "(or would need a copy, which the kernel cannot read in place)")
    xq, xs, xsum = quantize_x(x.contiguous().reshape(-1), planes=stack.qtype != "q8_0")
    pairs = ids.numel()
    if pairs:
        _expert_gemv_kernel[(programs, pairs)](
            ids.contiguous(), top_k, xq.view(torch.int32), xs, xsum, *weights, *host,
            where if where is not None else ids, counts if counts is not None else ids,
            where.numel() if where is not None else 0, out, num_m,
            rows_per_expert, k // 32, out.stride(0), *strides, QTYPE=stack.qtype,
            BLOCK_N=block_n, G=max(1, cfg.gemv_block_k // 32), PREFETCH=cfg.gemv_prefetch,
            ASM=use_asm(x), PAIRED=paired, X_BY_TOKEN=by_token, IN_PLACE=where is not None,
            COUNT=counts is not None, PAIRS=triton.next_power_of_2(pairs),
            num_warps=cfg.gemv_num_warps)
    return out


def moe_decode_quant(x: torch.Tensor, gate_up: QuantWeight, down: QuantWeight, inter: int,
                     weights: torch.Tensor, expert_ids: torch.Tensor,
                     shared: torch.Tensor | None = None,
                     shared_gate: torch.Tensor | None = None,
                     in_place: InPlace | None = None) -> torch.Tensor:
    """`moe.per_expert_moe` for a few tokens over stacked quantized experts (see the module
    docstring): x [n, hidden], gate_up [E * 2 * inter, hidden], down [E * hidden, inter],
    weights / expert_ids [n, k]; + sigmoid(shared_gate) * shared when given. in_place: expert
    offload (`kernels.moe.InPlace`; gate_up / down are then the device slots, its host stacks
    quantized weights of the same layout), counted by the gate/up launch."""
    from . import silu_and_mul
    from .moe_decode_triton import _sum_pairs_kernel
    n, hidden = x.shape
    top_k = expert_ids.shape[1]
    out = torch.empty_like(x)
    if n == 0:
        return out
    ids = expert_ids.reshape(-1)
    h = torch.empty((n * top_k, 2 * inter), dtype=x.dtype, device=x.device)
    gu_place = down_place = None
    if in_place is not None:
        gu_place = (in_place.where, in_place.host_gate_up, in_place.counts)
        down_place = (in_place.where, in_place.host_down, None)
    expert_gemv(x, ids, top_k, gate_up, 2 * inter, h, by_token=True, in_place=gu_place)
    act = silu_and_mul(h)
    y = torch.empty((n * top_k, hidden), dtype=x.dtype, device=x.device)
    expert_gemv(act, ids, top_k, down, hidden, y, by_token=False, in_place=down_place)
    y.mul_(weights.reshape(-1, 1).to(y.dtype))
    sh = shared if shared is not None else out
    sg = shared_gate if shared_gate is not None else out
    _sum_pairs_kernel[(n, triton.cdiv(hidden, 256))](
        y, out, sh, sg, hidden, y.stride(0), out.stride(0), sh.stride(0), sg.stride(0),
        TOP_K=top_k, SHARED=shared is not None, BLOCK_N=256, num_warps=4)
    return out
