"""Work a quantized GEMV does after its output, in place of the launch that would follow it
(`quant_gemv.gemv`'s `tail`): at a decode step's few rows each of those launches is a few
microseconds of latency for a few kilobytes, and a Q4_K_M layer had two norms and a SiLU of
them (bench/results/h200/step_profile_session38.json: 97 of a 0.5B step's 257 kernels were
norms, SiLUs and attention reduces).

* `GluTail`, on an MLP's gate/up GEMV (output [M, 2I] as [gate | up]): act = silu(gate) * up,
  [M, I], and act's int8 forms for the down GEMV (`quant_x.emit_xq`). Each 32-column group of
  act needs the gate and the up columns of its group, computed by 2 * 32 / BLOCK_N programs;
  every program counts itself into its group's arrival counter after storing its output (an
  acq_rel atomic, as the GEMV's split-K sum does), and the last to arrive computes the group.
  The same expressions as `elementwise_triton.silu_and_mul` (`silu_mul`): the same bits.
* `NormTail`, on the projection before an RMSNorm (attention's o, an MLP's down; output [M, N]):
  h = out + residual (the next residual), the Llama RMSNorm of h and its int8 forms for the
  GEMV after the norm. Every program adds the residual to its own columns and stores their
  partial sums of squares; the last `t_w` programs to arrive each wait until all have (a spin
  on the counter: every program of the launch has started by then, so none waits on a program
  that cannot run), sum the partials in one fixed order (each gets the same rstd) and
  normalise `gemv_norm_tail_groups` 32-groups of every row. A first version had the one last
  program normalise the whole row: one warp over 3,584 elements made the 7B step 18% slower
  (bench/results/h100/step_profile_tails_v1.json). The sums run in another order than the
  standalone `rms_norm` kernel's, so the last bits may differ from it; a decode step's row and
  a verify step's rows take the same tail, so they stay equal to each other. Interpreted
  (programs run one after another) the last program alone normalises, waiting for no one.

Counters live in their own zeroed buffer per device (`tail_counters`); the programs that
computed set them back to zero, so every launch (and CUDA graph replay) finds them zero. A
launch's tail is the last thing it does, so a PDL-launched kernel after it (`pdl.py`) waits for
it like for any other store.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from .elementwise_triton import silu_mul
from .quant_x import emit_xq, xq_args, xq_flags

GLU = 1
NORM = 2


@dataclass
class GluTail:
    """silu(gate) * up of the GEMV's [M, 2I] output into `out` [M, I] (contiguous) and into
    `xqs` (`kernels.gemv_input_buffers` of the down projection, for M rows). `done` is set
    when a launch took it; otherwise the caller runs `silu_and_mul` itself."""
    out: torch.Tensor
    xqs: dict
    done: bool = False


@dataclass
class NormTail:
    """h = the GEMV's output + `residual` into `res_out`, rms_norm(h, weight, eps) (Llama's:
    normalise in fp32, cast, scale) into `out`, and into `xqs` (the next GEMV's int8 forms).
    `res_out` and `out` [M, N] contiguous; `done` as `GluTail`'s."""
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    xqs: dict
    res_out: torch.Tensor = field(default=None)
    out: torch.Tensor = field(default=None)
    done: bool = False


def norm_tail(residual: torch.Tensor, weight: torch.Tensor, eps: float, xqs: dict):
    """A `NormTail` with its outputs allocated, or None where it cannot run: no int8 forms
    asked for (the next GEMV does not run in one launch of the quantized GEMV), a residual
    not [M, N] contiguous, or a weight of another dtype than the residual (the norm's output
    dtype would change)."""
    if not xqs or residual.dim() != 2 or not residual.is_contiguous() or \
            weight.dtype != residual.dtype or residual.shape[-1] % 32:
        return None
    return NormTail(residual, weight.contiguous(), float(eps), xqs,
                    torch.empty_like(residual), torch.empty_like(residual))


_COUNTERS: dict = {}


def tail_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, left zero by every launch (one buffer per device: the
    forward passes of a device run on one stream)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def tail_launch(tail, out2: torch.Tensor, n: int, rows: int, block_n: int, programs: int,
                cfg, interpreted: bool):
    """(runtime args, constexprs) of `gemv_tail` for a launch over all `rows` rows of `out2`
    [rows, n], or None where `tail` does not fit it (or `cfg` keeps it off at this size)."""
    if tail is None or tail.done:
        return None
    w_ = 1
    if isinstance(tail, GluTail):
        half = n // 2
        if n > cfg.gemv_glu_tail_max_n or n % 64 or 32 % block_n or \
                tail.out.shape != (rows, half) or not tail.out.is_contiguous() or not tail.xqs:
            return None
        cnt = tail_counters(out2.device, half // 32)
        a = b = c = ss = tail.out
        arrivals, kg, s_a, kind, groups, eps = 2 * (32 // block_n), rows * half // 32, half, \
            GLU, 1, 0.0
    else:
        if n > cfg.gemv_norm_tail_max_n or tail.residual.shape != (rows, n) or n % 32 or \
                out2.dtype != tail.residual.dtype:
            return None
        cnt = tail_counters(out2.device, 2)
        a, b, c, s_a = tail.residual, tail.weight, tail.res_out, tail.residual.stride(0)
        arrivals, kg, kind, eps = programs, rows * n // 32, NORM, tail.eps
        ss = torch.empty(rows * programs, dtype=torch.float32, device=out2.device)
        ngroups = n // 32
        # the last w_ programs to arrive normalise `groups` 32-groups each; interpreted, the
        # programs run one after another, so the last one alone (it waits for no one)
        groups = triton.next_power_of_2(max(cfg.gemv_norm_tail_groups,
                                            triton.cdiv(ngroups, programs)))
        if interpreted:
            groups = triton.next_power_of_2(ngroups)
        w_ = triton.cdiv(ngroups, groups)
    d = tail.out
    flags = xq_flags(tail.xqs)
    args = (a, b, c, d, s_a, cnt, arrivals, eps, kg, w_, ss, *xq_args(tail.xqs, out2))
    consts = dict(TAIL=kind, TAIL_GROUPS=groups,
                  TAIL_PB=min(1024, triton.next_power_of_2(max(arrivals, 2))),
                  TAIL_XQ_PLANES=flags.get("XQ_PLANES", False),
                  TAIL_XQ_GROUPS=flags.get("XQ_GROUPS", False))
    return args, consts


@triton.jit
def gemv_tail(out_ptr, s_om, M, N, pid_n, t_a, t_b, t_c, t_d, s_a, t_cnt, t_arrivals, t_eps,
              t_kg, t_w, t_ss, xq0, xs0, xsum0, xq1, xs1, xsum1, BLOCK_N: tl.constexpr,
              TAIL: tl.constexpr, GROUPS: tl.constexpr, PB: tl.constexpr,
              XQ_PLANES: tl.constexpr, XQ_GROUPS: tl.constexpr):
    """After program pid_n stored its columns of out [M, N] (all M rows): the tail (see the
    module docstring). GLU: t_d act [M, N/2] (row stride s_a); the last of a group's programs
    to arrive computes it. NORM: t_a residual (row stride s_a), t_b weight, t_c residual out,
    t_d normed out ([M, N] contiguous), t_ss [M, t_arrivals] partial sums of squares; the last
    t_w programs to arrive each normalise GROUPS 32-groups of every row. t_kg: groups of the
    int8 forms' rows flattened."""
    if TAIL == 1:
        tl.debug_barrier()  # every thread of this program has stored its part
        half = N // 2
        grp = ((pid_n * BLOCK_N) % half) // 32
        done = tl.atomic_add(t_cnt + grp, 1, sem="acq_rel", scope="gpu")
        if done == t_arrivals - 1:
            offs = grp * 32 + tl.arange(0, 32)
            for m in range(0, M):
                g = tl.load(out_ptr + m * s_om + offs, cache_modifier=".cg").to(tl.float32)
                u = tl.load(out_ptr + m * s_om + half + offs,
                            cache_modifier=".cg").to(tl.float32)
                o = silu_mul(g, u, t_d)
                tl.store(t_d + m * s_a + offs, o)
                g0 = m * (half // 32) + grp
                emit_xq(o.to(tl.float32), g0, g0 + 1, t_kg, xq0, xs0, xsum0, xq1, xs1, xsum1,
                        32, XQ_PLANES, XQ_GROUPS)
            tl.atomic_xchg(t_cnt + grp, 0, sem="relaxed", scope="gpu")
    if TAIL == 2:
        dt = t_c.dtype.element_ty
        # this program's columns: h = out + residual (rounded as rms_norm's add), and the
        # partial sum of squares of each row's h over them
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        for m in range(0, M):
            y = tl.load(out_ptr + m * s_om + cols, mask=cmask, other=0.0, cache_modifier=".cg")
            r = tl.load(t_a + m * s_a + cols, mask=cmask, other=0.0)
            h = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
            tl.store(t_c + m * N + cols, h, mask=cmask)
            hf = h.to(tl.float32)
            tl.store(t_ss + m * t_arrivals + pid_n, tl.sum(hf * hf, 0))
        tl.debug_barrier()
        arrived = tl.atomic_add(t_cnt, 1, sem="acq_rel", scope="gpu")
        first = t_arrivals - t_w
        if arrived >= first:  # one of the last t_w: wait for the others, then normalise
            seen = arrived + 1
            while seen < t_arrivals:
                seen = tl.atomic_add(t_cnt, 0, sem="acquire", scope="gpu")
            g_lo = (arrived - first) * GROUPS
            offs = g_lo * 32 + tl.arange(0, GROUPS * 32)
            mask = offs < N
            w = tl.load(t_b + offs, mask=mask, other=0.0).to(tl.float32)
            for m in range(0, M):
                ss = tl.zeros([PB], tl.float32)  # every finisher sums in the same order
                for p0 in range(0, t_arrivals, PB):
                    pp = p0 + tl.arange(0, PB)
                    ss += tl.load(t_ss + m * t_arrivals + pp, mask=pp < t_arrivals, other=0.0,
                                  cache_modifier=".cg")
                rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / N + t_eps)
                hf = tl.load(t_c + m * N + offs, mask=mask, other=0.0,
                             cache_modifier=".cg").to(tl.float32)
                o = (w * (hf * rstd).to(dt).to(tl.float32)).to(t_d.dtype.element_ty)
                tl.store(t_d + m * N + offs, o, mask=mask)
                emit_xq(o.to(tl.float32), m * (N // 32) + g_lo, (m + 1) * (N // 32), t_kg,
                        xq0, xs0, xsum0, xq1, xs1, xsum1, GROUPS * 32, XQ_PLANES, XQ_GROUPS)
            tl.debug_barrier()
            if tl.atomic_add(t_cnt + 1, 1, sem="acq_rel", scope="gpu") == t_w - 1:
                tl.atomic_xchg(t_cnt, 0, sem="relaxed", scope="gpu")  # all finishers are past
                tl.atomic_xchg(t_cnt + 1, 0, sem="relaxed", scope="gpu")  # their waits
