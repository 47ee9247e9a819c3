"""The CPU kernels that read each GGUF type in its own bits (luceio/kernels/qdot_cpu.py) against
the torch reference `quant.dequantize` (itself equal to gguf's dequantization), for every qtype,
N odd, K not a multiple of 256 where the type allows it; on random codes and scales
(`random_quant_weight`) and on GGUF blocks from gguf's own quantizer (`repack_gguf`).

Tolerances. `dequantize_rows` runs the oracle's fp32 operations: equal bit for bit (and its
bf16 output equals `Tensor.to(torch.bfloat16)` of that). `matvec` rounds each activation to
int16 steps of max|x of its group of 32| / 32767 and sums exactly in int32, then scales and
adds in fp32: each output is held to sum_k (step_k / 2) A_k + K 2^-24 sum_k |x_k| A_k, with
A = |w| + 2 |offset| the size of the terms summed (`magnitude`; ref in float64); measured
errors reach 0.04-0.28 of it. A kernel that drops a bit of the codes or reads the wrong type is
off by far more (the negative controls). The dense path (M >= dense_min_rows) rounds x
and W to bf16 (unit roundoff 2^-8 each): held to 2^-7 sum_k |x_k w_k|, plus the rounding of
the output to its dtype and of the bias add.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from luceio.kernels import quant_cpu as qc
from luceio.kernels.quant import QTYPES, dequantize, nbytes, random_quant_weight

qd = pytest.importorskip("luceio.kernels.qdot_cpu")
if not qd.available():
    pytest.skip("numba is not installed", allow_module_level=True)


def shapes(qtype: str) -> tuple[int, int]:
    return (37, 768) if qtype.endswith("_k") else (37, 96)


def weights(qtype: str, seed: int = 0):
    """Random codes and scales, then (32-element types) gguf's quantizer on N(0, 0.02) weights."""
    n, k = shapes(qtype)
    yield random_quant_weight(qtype, n, k, generator=torch.Generator().manual_seed(seed))
    if not qtype.endswith("_k"):  # test_quant_cpu's random k-quant blocks come from the above
        from test_quant_cpu import random_weight
        yield random_weight(qtype, n, k, seed)


def magnitude(w) -> torch.Tensor:
    """[N, K]: |w| + 2 |offset of its group| (q4_1/q5_1: m; q4_k/q5_k: dmin * mn)."""
    n, k = w.shape
    if w.qtype in ("q4_1", "q5_1"):
        offset = w.m.float()
    elif w.qtype in ("q4_k", "q5_k"):
        offset = w.m.float().repeat_interleave(8, dim=1) * w.mn.float()
    else:
        offset = torch.zeros(n, k // 32)
    return dequantize(w).abs() + 2 * offset.abs().repeat_interleave(32, dim=1)


def matvec_bound(x: torch.Tensor, w) -> torch.Tensor:
    a = magnitude(w).double()
    step = x.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1) / 32767
    return (step.double() / 2) @ a.t() + x.shape[1] * 2.0 ** -24 * (x.double().abs() @ a.t())


ACTIVATIONS = ["int16"] + (["int8"] if qd.int8_available() else [])
"""The matvec kernels this CPU runs (int8: AVX-512 VNNI or AVX2, tests/test_qdot8_cpu.py)."""


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_rows_is_the_oracle_bit_for_bit(qtype):
    for w in weights(qtype):
        cw = qd.prepare(w)
        n, k = w.shape
        out = np.empty((n - 3, k), np.float32)
        qd.dequantize_rows(cw, 3, out)  # rows 3.. of W
        want = dequantize(w)[3:]
        assert torch.equal(torch.from_numpy(out), want)
        bf16 = torch.empty(n - 3, k, dtype=torch.bfloat16)
        qd.dequantize_rows(cw, 3, bf16.view(torch.uint16).numpy())
        assert torch.equal(bf16, want.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 35])
def test_matvec_within_rounding_bound(qtype, m):
    """int16 activations at one row, two, and 3 or more in one call (35: two calls of at most
    `qdot_kernels_cpu.XN_MAX`)."""
    from luceio.kernels.qdot_kernels_cpu import XN_MAX
    assert XN_MAX < 35 <= 2 * XN_MAX
    for w in weights(qtype, seed=m):
        cw = qd.prepare(w, activations="int16")
        x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
        wd = dequantize(w)
        # into a column slice of a wider buffer, as a fused projection's parts are written
        buf = np.full((m, w.shape[0] + 5), np.nan, np.float32)
        qd.matvec(x.numpy(), cw, buf[:, 2:2 + w.shape[0]])
        y = torch.from_numpy(buf[:, 2:2 + w.shape[0]])
        err = (y.double() - reference(x, wd)).abs()
        assert bool((err <= matvec_bound(x, w)).all()), float((err / matvec_bound(x, w)).max())
        assert np.isnan(buf[:, :2]).all() and np.isnan(buf[:, -3:]).all()


@pytest.mark.parametrize("qtype,wrong", [("q5_0", "q4_0"), ("q5_k", "q4_k"), ("q8_0", "q4_0"),
                                         ("q4_1", "q4_0")])
def test_negative_control_wrong_type(qtype, wrong):
    """Reading a weight as a type that drops its high bits or its offset fails the bound."""
    w = next(weights(qtype))
    cw = qd.prepare(w)
    bad = qd.CpuQuant(wrong, cw.shape, cw.arrays, cw.out_dtype)
    x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(5))
    y = np.empty((2, w.shape[0]), np.float32)
    qd.matvec(x.numpy(), bad, y)
    wd = dequantize(w)
    err = (torch.from_numpy(y).double() - reference(x, wd)).abs()
    assert not bool((err <= matvec_bound(x, w)).all())


def test_arrays_are_the_quant_weights_own():
    """No copy: the CPU form holds the QuantWeight's bytes (what the GGUF stores), where it
    does not interleave them (N not in fours here; test_qdot_interleave_cpu.py)."""
    w = random_quant_weight("q5_0", 63, 256)
    cw = qd.prepare(w)
    assert cw.nbytes == nbytes(w)
    assert np.shares_memory(cw.arrays[0], w.qs.numpy())


@pytest.mark.parametrize("qtype", ["q5_0", "q6_k", "q8_0"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dense", [torch.bfloat16, torch.float32])
def test_linear_routes_by_rows(qtype, out_dtype, dense, monkeypatch):
    """`cpu_quant_linear` multiplies few rows with `matvec` (fp32 bound) and from
    `dense_min_rows` on dequantizes tiles (several, when the tile budget is small), in bf16 or
    in fp32 (`dense_dtype`: CPUs without bf16 instructions) within the bf16 bound."""
    monkeypatch.setattr(qc, "DENSE_TILE_BYTES", 8 * 1024)
    monkeypatch.setattr(qc, "DENSE_DTYPE", dense)
    w = next(weights(qtype))
    cw = qc.prepare_cpu_weight(w, out_dtype)
    assert isinstance(cw, qd.CpuQuant)
    wd = dequantize(w)
    bias = torch.randn(w.shape[0]).to(out_dtype)  # a bias in the model's dtype
    calls = []
    matvec = qd.matvec
    monkeypatch.setattr(qd, "matvec", lambda *a: calls.append(a[0].shape[0]) or matvec(*a))
    least = qc.dense_min_rows(cw)
    assert least == qc.QDOT_DENSE_MIN_ROWS[cw.activations]
    for m in (1, least - 1, least, 40):
        x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
        y = qc.cpu_quant_linear(x, cw, bias)
        assert y.dtype == out_dtype and y.shape == (m, w.shape[0])
        err = (y.double() - reference(x, wd) - bias.double()).abs()
        ref = reference(x, wd)  # y is rounded to out_dtype, then y + bias is
        out_round = (ref.abs() + (ref + bias.double()).abs()) * (
            2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -24)
        scale = matvec_bound(x, w) if m < least else \
            2.0 ** -7 * (x.double().abs() @ wd.double().abs().t())
        assert bool((err <= 1.01 * (scale + out_round) + 1e-6).all()), m
    assert calls == [1, least - 1]


def test_dense_dtype_follows_the_cpus_bf16_instructions(monkeypatch):
    """The dense path multiplies in bf16 only where the CPU has bf16 instructions (oneDNN
    emulates bf16 elsewhere, 5.6x slower than fp32 on an AVX2 EPYC); `DENSE_DTYPE` overrides."""
    from luceio.kernels import qdot_ir_cpu
    for features, dtype in (({"avx2", "fma"}, torch.float32),
                            ({"avx2", "avx512f", "avx512vnni"}, torch.float32),
                            ({"avx512f", "avx512bf16"}, torch.bfloat16),
                            ({"amx-tile", "amx-bf16"}, torch.bfloat16),
                            ({"neon", "bf16"}, torch.bfloat16)):
        monkeypatch.setattr(qdot_ir_cpu, "_CPU", features)
        assert qc.dense_dtype() == dtype, features
        monkeypatch.setattr(qc, "DENSE_DTYPE", torch.bfloat16)
        assert qc.dense_dtype() == torch.bfloat16
        monkeypatch.setattr(qc, "DENSE_DTYPE", None)


def test_prompt_rows_choose_their_path_by_rows(monkeypatch):
    """Inside `prefill_rows` (a step computing prompt tokens) a quantized weight still picks
    its path by M: a prompt's short tail (a prefix-cache hit, a last chunk) runs `matvec`, as
    decode rows do, with the same bits as outside it; from `dense_min_rows` rows on, the
    dequantized tiles (no matvec call)."""
    w = next(weights("q4_k"))
    cw = qc.prepare_cpu_weight(w, torch.float32)
    least = qc.dense_min_rows(cw)
    calls = []
    matvec = qd.matvec
    monkeypatch.setattr(qd, "matvec", lambda *a: calls.append(a[0].shape[0]) or matvec(*a))
    x = torch.randn(least, w.shape[1], generator=torch.Generator().manual_seed(3))
    outside = qc.cpu_quant_linear(x[:9], cw)
    with qc.prefill_rows():
        tail = qc.cpu_quant_linear(x[:9], cw)
        qc.cpu_quant_linear(x, cw)
    assert calls == [9, 9]
    assert torch.equal(tail, outside)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through libc")
@pytest.mark.parametrize("acts", ACTIVATIONS)
def test_kernels_read_nothing_past_their_arrays(acts):
    """The hand-written vector code has no bounds checks: every weight array and x is placed so
    it ends right before an unreadable page, and matvec (N not a multiple of the 4-row blocks,
    M from 1 to 5) and dequantize_rows run without a fault and give the same numbers."""
    import ctypes
    import mmap
    libc, page, maps = ctypes.CDLL(None), mmap.PAGESIZE, []

    def at_page_end(a: np.ndarray) -> np.ndarray:
        if not a.size:
            return a
        pages = -(-a.nbytes // page) + 1
        m = mmap.mmap(-1, pages * page)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert libc.mprotect(ctypes.c_void_p(base + (pages - 1) * page), page, 0) == 0
        out = np.frombuffer(m, dtype=a.dtype, count=a.size,
                            offset=(pages - 1) * page - a.nbytes).reshape(a.shape)
        out[...] = a
        maps.append((m, out))
        return out

    for qtype in qd.KINDS:
        odd = () if qtype.endswith("_k") else ((5, 32 * 11),)  # a block of 8 groups, then 3 alone
        for n, k in ((7, 256), (13, 512), (1, 256), (8, 256), (12, 512)) + odd:  # 8, 12:
            cw = qd.prepare(random_quant_weight(qtype, n, k), activations=acts)  # interleaved
            fenced = qd.CpuQuant(cw.qtype, cw.shape, tuple(at_page_end(a) for a in cw.arrays),
                                 cw.out_dtype, acts, cw.interleaved)
            for m in (1, 3, 5):
                x = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
                got, want = np.zeros((m, n), np.float32), np.zeros((m, n), np.float32)
                qd.matvec(at_page_end(x), fenced, got)
                qd.matvec(x, cw, want)
                assert np.array_equal(got, want), (qtype, n, k, m)
            rows, want = np.zeros((n, k), np.float32), np.zeros((n, k), np.float32)
            qd.dequantize_rows(fenced, 0, rows)
            qd.dequantize_rows(cw, 0, want)
            assert np.array_equal(rows, want), (qtype, n, k)


@pytest.mark.parametrize("acts", ACTIVATIONS)
def test_matvec_writes_only_its_rows(acts):
    """The kernel has no bounds checks on its output either: matvec's result rows are a view
    into a larger buffer filled with a sentinel, which must be left as it was past the M rows,
    for M = 0 too (a prefill chunk that is not a prompt's last computes the logits of no rows:
    the kernel's one-row branch wrote row 0 of an empty output, which corrupted the heap of a
    real 1.5B serving a 4K-token prompt in two chunks)."""
    for qtype in qd.KINDS:
        n, k = 13, 256
        cw = qd.prepare(random_quant_weight(qtype, n, k), activations=acts)
        for m in (0, 1, 2, 5):
            x = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
            buf = np.full((m + 4, n), 7.0, np.float32)
            qd.matvec(x, cw, buf[:m])
            assert (buf[m:] == 7.0).all(), (qtype, m)
        y = qc.qdot_linear(torch.zeros(0, k), cw)
        assert tuple(y.shape) == (0, n)
