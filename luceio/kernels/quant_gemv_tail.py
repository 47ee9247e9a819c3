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
  GEMV after the norm. The norm needs the whole row, so it is the last program of the launch to
  arrive that computes it, all M rows. Its sums run in its own order (one chunk of at most 2,048
  elements, or a loop of 1,024-element chunks), which may differ from the standalone
  `rms_norm` kernel in the last bits: a decode step's row and a verify step's rows take the
  same tail, so they stay equal to each other.

Where they pay (H100, random Q4_K_M weights, batch-1 decode at context 512, `bench/step_profile.py
--set`; bench/results/h100/step_profile_tails_v1.json, _v2.json): the 0.5B shape (hidden 896,
gate/up 2 x 4,864) ran 1,254.7 / 1,231.6 tok/s with both tails against 972.8 without (257 ->
186 kernels a step). At the 1.5B and 7B shapes they cost more than the launches they save: one
program (one warp) normalising 1,536 or 3,584 elements is a serial tail on every o and down GEMV
(7B: 318 tok/s against 388), and a second design (every program adding the residual to its own
columns, the last few to arrive normalising a slice each after spinning on the counter) was
slower still at 0.5B and no better at 1.5B / 7B; the SiLU tail alone was within 2% either way
there. So the config table (`gemv_glu_tail_max_n`, `gemv_norm_tail_max_n`) takes them up to the
0.5B's sizes.

Counters live in their own zeroed buffer per device (`tail_counters`); the computing program
sets its counter back to zero, so every launch (and CUDA graph replay) finds them zero. A
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
_ONE_PASS_MAX = 2048  # a norm row up to this many elements is held in registers in one pass
_CHUNK = 1024


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
                cfg):
    """(runtime args, constexprs) of `gemv_tail` for a launch over all `rows` rows of `out2`
    [rows, n], or None where `tail` does not fit it or is past `cfg`'s sizes for it."""
    if tail is None or tail.done:
        return None
    if isinstance(tail, GluTail):
        half = n // 2
        if n > cfg.gemv_glu_tail_max_n or n % 64 or 32 % block_n or \
                tail.out.shape != (rows, half) or \
                not tail.out.is_contiguous() or not tail.xqs:
            return None
        cnt = tail_counters(out2.device, half // 32)
        a = b = c = tail.out
        arrivals, kg, s_a, kind, chunk, one = 2 * (32 // block_n), rows * half // 32, half, GLU, 32, True
        eps = 0.0
    else:
        if n > cfg.gemv_norm_tail_max_n or tail.residual.shape != (rows, n) or n % 32 or \
                out2.dtype != tail.residual.dtype:
            return None
        cnt = tail_counters(out2.device, 1)
        a, b, c = tail.residual, tail.weight, tail.res_out
        arrivals, kg, s_a, kind = programs, rows * n // 32, tail.residual.stride(0), NORM
        one = n <= _ONE_PASS_MAX
        chunk = triton.next_power_of_2(n) if one else _CHUNK
        eps = tail.eps
    d = tail.out
    flags = xq_flags(tail.xqs)
    args = (a, b, c, d, s_a, cnt, arrivals, eps, kg, *xq_args(tail.xqs, out2))
    consts = dict(TAIL=kind, TAIL_CHUNK=chunk, TAIL_ONE=one,
                  TAIL_XQ_PLANES=flags.get("XQ_PLANES", False),
                  TAIL_XQ_GROUPS=flags.get("XQ_GROUPS", False))
    return args, consts


@triton.jit
def gemv_tail(out_ptr, s_om, M, N, pid_n, t_a, t_b, t_c, t_d, s_a, t_cnt, t_arrivals, t_eps,
              t_kg, xq0, xs0, xsum0, xq1, xs1, xsum1, BLOCK_N: tl.constexpr,
              TAIL: tl.constexpr, CHUNK: tl.constexpr, ONE: tl.constexpr,
              XQ_PLANES: tl.constexpr, XQ_GROUPS: tl.constexpr):
    """After program pid_n stored its columns of out [M, N] (all M rows): counts it in, and
    the last program to arrive does the tail (see the module docstring). GLU: t_d act [M, N/2]
    (row stride s_a); NORM: t_a residual (row stride s_a), t_b weight, t_c residual out, t_d
    normed out ([M, N] contiguous). t_kg: groups of the int8 forms' rows flattened."""
    tl.debug_barrier()  # every thread of this program has stored its part
    if TAIL == 1:
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
        done = tl.atomic_add(t_cnt, 1, sem="acq_rel", scope="gpu")
        if done == t_arrivals - 1:
            dt = t_c.dtype.element_ty
            for m in range(0, M):
                if ONE:
                    offs = tl.arange(0, CHUNK)
                    mask = offs < N
                    y = tl.load(out_ptr + m * s_om + offs, mask=mask, other=0.0,
                                cache_modifier=".cg")
                    r = tl.load(t_a + m * s_a + offs, mask=mask, other=0.0)
                    w = tl.load(t_b + offs, mask=mask, other=0.0).to(tl.float32)
                    h = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
                    tl.store(t_c + m * N + offs, h, mask=mask)
                    hf = h.to(tl.float32)
                    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / N + t_eps)
                    o = (w * (hf * rstd).to(dt).to(tl.float32)).to(t_d.dtype.element_ty)
                    tl.store(t_d + m * N + offs, o, mask=mask)
                    emit_xq(o.to(tl.float32), m * (N // 32), (m + 1) * (N // 32), t_kg,
                            xq0, xs0, xsum0, xq1, xs1, xsum1, CHUNK, XQ_PLANES, XQ_GROUPS)
                else:
                    ss = tl.zeros([CHUNK], tl.float32)
                    for c0 in range(0, N, CHUNK):
                        offs = c0 + tl.arange(0, CHUNK)
                        mask = offs < N
                        y = tl.load(out_ptr + m * s_om + offs, mask=mask, other=0.0,
                                    cache_modifier=".cg")
                        r = tl.load(t_a + m * s_a + offs, mask=mask, other=0.0)
                        h = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
                        tl.store(t_c + m * N + offs, h, mask=mask)
                        hf = h.to(tl.float32)
                        ss += hf * hf
                    rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / N + t_eps)
                    tl.debug_barrier()
                    for c0 in range(0, N, CHUNK):
                        offs = c0 + tl.arange(0, CHUNK)
                        mask = offs < N
                        hf = tl.load(t_c + m * N + offs, mask=mask, other=0.0,
                                     cache_modifier=".cg").to(tl.float32)
                        w = tl.load(t_b + offs, mask=mask, other=0.0).to(tl.float32)
                        o = (w * (hf * rstd).to(dt).to(tl.float32)).to(t_d.dtype.element_ty)
                        tl.store(t_d + m * N + offs, o, mask=mask)
                        emit_xq(o.to(tl.float32), m * (N // 32) + c0 // 32, (m + 1) * (N // 32),
                                t_kg, xq0, xs0, xsum0, xq1, xs1, xsum1, CHUNK, XQ_PLANES,
                                XQ_GROUPS)
            tl.atomic_xchg(t_cnt, 0, sem="relaxed", scope="gpu")
