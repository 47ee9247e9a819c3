"""Two one-row GEMVs of one x in one launch: a fused projection whose row segments are stored
in two types (a Q4_K_M file's q/k in Q4_K, v in Q6_K) would otherwise take a launch per
segment, and at one row a GEMV launch over a short matrix is mostly latency. The programs of
the one grid split between the parts; each part keeps the tiles, K-splits and sums it has
alone (`quant_gemv.gemv_body`), so the output equals one `quant_gemv.gemv` per part bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import get_config
from .pdl import pdl_enter, pdl_kwargs
from .quant_args import weight_args, words
from .quant_gemv import (gemv_body, prepare_launch, runtime_args, split_counters, use_asm,
                         x_forms)


@triton.jit
def _gemv_pair_kernel(a_xq, a_xs, a_xsum, a_qs, a_qh, a_d, a_m, a_sc, a_mn, a_bias, a_out,
                      a_part, a_cnt, a_M, a_N, a_KG, a_gps, a_s_om, a_s_qs, a_s_qh, a_s_d, a_s_sc,
                      b_xq, b_xs, b_xsum, b_qs, b_qh, b_d, b_m, b_sc, b_mn, b_bias, b_out,
                      b_part, b_cnt, b_M, b_N, b_KG, b_gps, b_s_om, b_s_qs, b_s_qh, b_s_d, b_s_sc,
                      programs_a, nsplit_a, nsplit_b,
                      BLOCK_M: tl.constexpr, G: tl.constexpr, PREFETCH: tl.constexpr,
                      ASM: tl.constexpr,
                      QTYPE_A: tl.constexpr, BLOCK_N_A: tl.constexpr, SPLIT_A: tl.constexpr,
                      HAS_BIAS_A: tl.constexpr, PAIRED_A: tl.constexpr,
                      QTYPE_B: tl.constexpr, BLOCK_N_B: tl.constexpr, SPLIT_B: tl.constexpr,
                      HAS_BIAS_B: tl.constexpr, PAIRED_B: tl.constexpr,
                      PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    """Two GEMVs of one x in one launch (a fused projection stored in two types: a Q4_K_M
    file's q/k in Q4_K, v in Q6_K): programs [0, programs_a) compute part a, the rest part b,
    each with its own K-splits (a program past its part's splits does nothing)."""
    pdl_enter(PDL, PDL_EARLY)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    if pid < programs_a:
        if split < nsplit_a:
            gemv_body(pid, split, nsplit_a, a_xq, a_xs, a_xsum, a_qs, a_qh, a_d, a_m, a_sc,
                       a_mn, a_bias, a_out, a_part, a_cnt, a_M, a_N, a_KG, a_gps, a_s_om,
                       a_s_qs, a_s_qh, a_s_d, a_s_sc, QTYPE_A, BLOCK_M, BLOCK_N_A, G, PREFETCH,
                       ASM, SPLIT_A, HAS_BIAS_A, PAIRED_A)
    else:
        if split < nsplit_b:
            gemv_body(pid - programs_a, split, nsplit_b, b_xq, b_xs, b_xsum, b_qs, b_qh, b_d,
                       b_m, b_sc, b_mn, b_bias, b_out, b_part, b_cnt, b_M, b_N, b_KG, b_gps,
                       b_s_om, b_s_qs, b_s_qh, b_s_d, b_s_sc, QTYPE_B, BLOCK_M, BLOCK_N_B, G,
                       PREFETCH, ASM, SPLIT_B, HAS_BIAS_B, PAIRED_B)


def gemv_pair(x1, parts: list, k: int, cfg, use_asm: bool, xqs: dict | None = None) -> None:
    """Two one-row GEMVs of x1 [1, K] in one launch (`_gemv_pair_kernel`): parts = [(weights,
    strides, qtype, n, bias, out [1, n]), ...] as `gemv` takes them. Each part computes as it
    would alone (the same tiles, splits and sums), so the output equals two `gemv` launches."""
    preps = [prepare_launch(w, st, qtype, n, k, 1, cfg) for w, st, qtype, n, _, _ in parts]
    programs = [prep[5] for prep in preps]
    splits = [prep[3] for prep in preps]
    # split-K arrival counters, disjoint: part b's past part a's
    counters = split_counters(x1.device, sum(programs)) if max(splits) > 1 else None
    args = []
    for i, ((_, _, qtype, n, bias, out), prep) in enumerate(zip(parts, preps)):
        weights, strides, _, split, gps, _, _ = prep
        xq, xs, xsum = x_forms(x1, qtype, 1, 0, 1, xqs)
        cnt = counters[programs[0] * i:] if counters is not None else None
        args += runtime_args(xq, xs, xsum, weights, strides, bias, out, split, gps, 1, n, k,
                              cnt)
    consts = {}
    for tag, (_, _, qtype, _, bias, _), prep in zip("AB", parts, preps):
        consts.update({f"QTYPE_{tag}": qtype, f"BLOCK_N_{tag}": prep[6],
                       f"SPLIT_{tag}": prep[3] > 1, f"HAS_BIAS_{tag}": bias is not None,
                       f"PAIRED_{tag}": prep[2]})
    _gemv_pair_kernel[(sum(programs), max(splits))](
        *args, programs[0], splits[0], splits[1], BLOCK_M=1, G=max(1, cfg.gemv_block_k // 32),
        PREFETCH=cfg.gemv_prefetch, ASM=use_asm, num_warps=cfg.gemv_num_warps, **consts,
        **pdl_kwargs(x1.device, cfg, sum(programs) * max(splits)))


def matmul_parts_pair(x: torch.Tensor, parts: list, bias: torch.Tensor | None,
                      out: torch.Tensor, xqs: dict) -> None:
    """`quant_triton.quant_matmul_parts` of one row over two QuantWeight parts: `gemv_pair`
    on their GEMV forms, writing `out`'s two column ranges."""
    k = x.shape[-1]
    x1 = x.reshape(1, k)
    x1 = x1 if x1.stride(-1) == 1 else x1.contiguous()
    out2, specs, start = out.view(1, -1), [], 0
    for w in parts:
        stop = start + w.shape[0]
        (qs, *rest), strides = weight_args(w)
        specs.append(((words(qs), *rest), (strides[0] // 4, *strides[1:]), w.qtype, w.shape[0],
                      bias[start:stop].contiguous() if bias is not None else None,
                      out2[:, start:stop]))
        start = stop
    gemv_pair(x1, specs, k, get_config(x.device), use_asm(x), xqs)
