"""The int8-activation CPU kernels (luceio/kernels/qdot8_kernels_cpu.py, AVX-512 VNNI or AVX2) for every
GGUF type: the dot products against the exact dot of the same quantized activations, the loss
against fp32, the quantization of x against its definition, the choice of kernels
(`set_activations`, `--cpu-activations`), and a quantized engine on them.

Tolerances. Given the kernel's own xq and dx (`_quantize_groups8`), the code part of every
output is an exact integer sum scaled in fp32, and the offsets are fp32 products: each output is
held to K 2^-22 sum_k |x_k| A_k, A = |w| + 2 |offset| (test_qdot_cpu.py's `magnitude`); against
fp32 x, to that plus sum_k (step_k / 2) A_k with step = max|x of the group| / 127. The kernels
run only where the CPU has VNNI or AVX2 (skipped elsewhere); the refusal test runs everywhere.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from luceio.kernels.quant import QTYPES, dequantize, random_quant_weight

qd = pytest.importorskip("luceio.kernels.qdot_cpu")
if not qd.available():
    pytest.skip("numba is not installed", allow_module_level=True)
from test_qdot_cpu import magnitude  # noqa: E402

vnni = pytest.mark.skipif(not qd.int8_available(), reason="the CPU has neither AVX-512 VNNI nor AVX2")


@contextlib.contextmanager
def activations(kind: str):
    old = qd.ACTIVATIONS[0]
    qd.set_activations(kind)
    try:
        yield
    finally:
        qd.ACTIVATIONS[0] = old


def shapes(qtype: str) -> list[tuple[int, int]]:
    """N odd; K of whole 8-group blocks, and (32-element types) of a block, half a block and
    a tail pair, of half a block alone, of a tail pair and one group (`QUARTERS`); and rows in
    fours of whole 256-blocks, which `prepare` interleaves (`qdot_cpu.interleave`)."""
    if qtype.endswith("_k"):
        return [(37, 768), (5, 256), (12, 512)]
    return [(37, 32 * 14), (6, 32 * 16), (5, 32 * 4), (3, 32 * 3), (8, 32 * 16)]


def offsets(w) -> torch.Tensor:
    """[N, K]: the part of each weight that the kernel multiplies by sum(x) in fp32 (q4_1 /
    q5_1: m; q4_k / q5_k: -dmin mn), zero for the other types."""
    n, k = w.shape
    if w.qtype in ("q4_1", "q5_1"):
        off = w.m.float()
    elif w.qtype in ("q4_k", "q5_k"):
        off = -(w.m.float().repeat_interleave(8, dim=1) * w.mn.float())
    else:
        off = torch.zeros(n, k // 32)
    return off.repeat_interleave(32, dim=1)


def quantized_x(x: np.ndarray):
    from luceio.kernels import qdot8_kernels_cpu as q8
    m, k = x.shape
    xq, dx = np.zeros((m, k), np.int8), np.zeros((m, k // 32), np.float32)
    xsum, qsum = np.zeros((m, k // 32), np.float32), np.zeros((m, k // 16), np.float32)
    q8._quantize_groups8(x, xq, dx, xsum, qsum)
    return q8.natural_order(xq), dx, xsum, qsum


@vnni
def test_quantize_groups_is_its_definition():
    """xq = round(x / dx) within +-127 (to half a step, plus fp32 rounding), dx = max|x| / 127,
    xsum the fp32 sum, qsum = dx sum(xq) per 16; an all-zero group is
    zeros with dx 1. K = 14 groups: a block, half a block and two groups in order; xq read back
    through `natural_order` (whose inverse the kernels read: test_matvec_... below)."""
    x = np.random.default_rng(0).standard_normal((3, 32 * 14), dtype=np.float32)
    x[1, 32:64] = 0
    x[2, :32] *= 1e-30  # tiny values: no division by zero, no overflow
    xq, dx, xsum, qsum = quantized_x(x)
    g = x.reshape(3, -1, 32)
    top = np.abs(g).max(-1)
    np.testing.assert_allclose(dx, np.where(top > 0, top / 127, 1), rtol=1e-6)
    assert dx[1, 1] == 1 and not xq[1, 32:64].any()
    want = g / dx[..., None]
    assert np.abs(xq.reshape(3, -1, 32) - want).max() <= 0.5 + 1e-4
    assert np.abs(xq).max() <= 127 and (np.abs(xq.reshape(3, -1, 32)).max(-1)[top > 0] == 127).all()
    np.testing.assert_allclose(xsum, g.sum(-1), rtol=1e-5, atol=1e-6)
    halves = xq.reshape(3, -1, 16).astype(np.int64).sum(-1)
    np.testing.assert_array_equal(qsum, (np.repeat(dx, 2, axis=1) * halves).astype(np.float32))


@vnni
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m,one_row", [(1, False), (1, True), (2, False), (3, False), (7, False),
                                       (35, False)])
def test_matvec_equals_the_exact_dot_of_its_quantized_activations(qtype, m, one_row, monkeypatch):
    """One activation row goes through 4 weight rows at a time or one (`ONE_ROW_MIN_K`); two
    rows go against 4 weight rows at once, 3 or more all at once (35: two calls of at most
    `XN_MAX`), the last 1-3 weight rows of a row-major matrix against 4 activation rows."""
    monkeypatch.setitem(qd.ONE_ROW_MIN_K, qtype, 0 if one_row else 1 << 30)
    assert qd.qdot8_kernels_cpu.XN_MAX < 35 <= qd.qdot8_kernels_cpu.XN_MAX * 2
    for n, k in shapes(qtype):
        w = random_quant_weight(qtype, n, k, generator=torch.Generator().manual_seed(m + n))
        cw = qd.prepare(w, activations="int8")
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).numpy()
        buf = np.full((m, n + 5), np.nan, np.float32)
        qd.matvec(x, cw, buf[:, 2:2 + n])
        y = torch.from_numpy(buf[:, 2:2 + n]).double()
        assert np.isnan(buf[:, :2]).all() and np.isnan(buf[:, -3:]).all()
        xq, dx, _, _ = quantized_x(x)
        xdeq = torch.from_numpy(xq.reshape(m, -1, 32) * dx[..., None]).reshape(m, k).double()
        wd, off = dequantize(w).double(), offsets(w).double()
        xt = torch.from_numpy(x).double()
        exact = xdeq @ (wd - off).t() + xt @ off.t()
        a = magnitude(w).double()
        fp32 = k * 2.0 ** -22 * (xt.abs() @ a.t())
        err = (y - exact).abs()
        assert bool((err <= fp32).all()), (n, k, float((err / fp32).max()))
        step = torch.from_numpy(np.repeat(dx, 32, axis=1)).double()
        loss = (y - xt @ wd.t()).abs()
        bound = (step / 2) @ a.t() + fp32
        assert bool((loss <= bound).all()), (n, k, float((loss / bound).max()))


@vnni
def test_matvec_asks_for_one_weight_row_at_a_time_where_the_table_says(monkeypatch):
    """`matvec` passes the kernel one_row exactly where K reaches `ONE_ROW_MIN_K[qtype]` (the
    outputs of both ways are held to the exact dot above), for one activation row."""
    asked = []
    kernel = qd.qdot8_kernels_cpu.matvec8_kernel
    monkeypatch.setattr(qd.qdot8_kernels_cpu, "matvec8_kernel",
                        lambda *a: asked.append(a[-2]) or kernel(*a))  # (.., one_row, interleaved)
    assert qd.ONE_ROW_MIN_K.keys() == set(QTYPES)
    for qtype in QTYPES:
        n, k = shapes(qtype)[0]
        cw = qd.prepare(random_quant_weight(qtype, n, k), activations="int8")
        for threshold, one_row in ((k, True), (k + 1, False)):
            monkeypatch.setitem(qd.ONE_ROW_MIN_K, qtype, threshold)
            qd.matvec(np.ones((1, k), np.float32), cw, np.empty((1, n), np.float32))
            assert asked.pop() is one_row


@vnni
@pytest.mark.parametrize("qtype,wrong", [("q5_0", "q4_0"), ("q6_k", "q5_k"), ("q8_0", "q4_0"),
                                         ("q4_1", "q4_0"), ("q4_0", "q4_1")])
def test_negative_control_wrong_type(qtype, wrong):
    """Reading a weight as a type that drops its high bits, its offset or its sign fails."""
    n, k = shapes(qtype)[0]
    w = random_quant_weight(qtype, n, k, generator=torch.Generator().manual_seed(1))
    cw = qd.prepare(w, activations="int8")
    bad = qd.CpuQuant(wrong, cw.shape, cw.arrays, cw.out_dtype, "int8")
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5))
    y = np.empty((2, n), np.float32)
    qd.matvec(x.numpy(), bad, y)
    wd = dequantize(w).double()
    a = magnitude(w).double()
    step = x.abs().view(2, -1, 32).amax(-1).repeat_interleave(32, dim=1).double() / 127
    bound = (step / 2) @ a.t() + k * 2.0 ** -22 * (x.double().abs() @ a.t())
    assert not bool(((torch.from_numpy(y).double() - x.double() @ wd.t()).abs() <= bound).all())


def test_set_activations_refuses_what_the_cpu_cannot_run(monkeypatch):
    with activations("int16"):
        with pytest.raises(ValueError, match="auto, int16 or int8"):
            qd.set_activations("int4")
        monkeypatch.setattr(qd.qdot8_kernels_cpu, "AVAILABLE", False)
        with pytest.raises(ValueError, match="VNNI"):
            qd.set_activations("int8")
        assert qd.set_activations("auto") == "int16" and qd.ACTIVATIONS == ["int16"]
        monkeypatch.setattr(qd.qdot8_kernels_cpu, "AVAILABLE", True)
        assert qd.set_activations("auto") == "int8"


@vnni
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_decodes_on_int8_activations(tmp_path, arch, monkeypatch):
    """`--cpu-activations int8` reaches the kernels: every projection of the int8 engine's CPU
    decode step runs the int8 kernel (an int16 engine loaded beside it keeps its own), the
    step differs from the int16 engine's on the same batch and KV by int8's rounding carried
    through a tiny random model (measured: 0.030 llama, 0.16 qwen2, from per-projection
    differences of 0.6-2.6%; test_matvec_* above hold each product to its bound), and the
    engine generates."""
    pytest.importorskip("gguf")
    from conftest import engine_kwargs
    from test_cpu_decode import _decode_batch
    from test_gguf import _write_gguf
    from test_quant_engine import MIXED

    from luceio import LLM, SamplingParams
    path = tmp_path / "q.gguf"
    _write_gguf(path, arch, MIXED)
    with activations("int16"):
        llms = {kind: LLM(str(path), quantization="auto",
                          **engine_kwargs(max_model_len=256, cpu_activations=kind))
                for kind in ("int8", "int16")}
    calls = {"int8": 0, "int16": 0}
    for module, name, kind in ((qd.qdot8_kernels_cpu, "matvec8_kernel", "int8"),
                               (qd, "matvec_kernel", "int16")):
        monkeypatch.setattr(module, name, lambda *a, _r=getattr(module, name), _k=kind:
                            calls.__setitem__(_k, calls[_k] + 1) or _r(*a))
    hidden = {}
    for kind, llm in llms.items():
        runner = llm.engine.runner
        ids, pos, meta = _decode_batch(runner, [5, 37, 20], seed=0)  # the same KV and batch
        with torch.inference_mode():
            hidden[kind] = runner.cpu_decoder(ids, pos, meta).clone()
        assert calls[kind] >= 4 * runner.cfg.num_layers  # qkv, o, gate_up, down (or parts)
        assert calls["int8" if kind == "int16" else "int16"] == 0
        calls[kind] = 0
    rel = float((hidden["int8"] - hidden["int16"]).norm() / hidden["int16"].norm())
    assert 1e-5 < rel < 0.5, rel
    out = llms["int8"].generate(["hello"], SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8 and calls["int8"] > 0


@vnni
@pytest.mark.parametrize("one_row", [False, True])
def test_q8_0_extreme_codes_are_exact(one_row, monkeypatch):
    """q8_0's codes at -128 and 127 against activations at +-127 (every group's largest
    |x| repeated): the sums the kernel makes in int16 pairs (`vpmaddubsw` on AVX2: |q| times x
    with q's sign, 2 * 128 * 127 at most; with VNNI q + 128 in int32) stay exact, so the output
    equals the exact dot of the quantized activations within fp32 rounding."""
    monkeypatch.setitem(qd.ONE_ROW_MIN_K, "q8_0", 0 if one_row else 1 << 30)
    n, k = 8, 32 * 14
    w = random_quant_weight("q8_0", n, k, generator=torch.Generator().manual_seed(3))
    codes = torch.tensor([-128, 127, -128, -128, 127, 127, -127, 0], dtype=torch.int8)
    w.qs.copy_(codes.repeat(n, k // 8).view(w.qs.dtype))
    x = np.where(np.arange(k) % 3 == 0, -2.0, 2.0).astype(np.float32)[None].repeat(2, 0)
    x[1] *= np.where(np.arange(k) % 5 == 0, -1, 1)  # two sign patterns; |xq| = 127 everywhere
    y = np.empty((2, n), np.float32)
    qd.matvec(x, qd.prepare(w, activations="int8"), y)
    xq, dx, _, _ = quantized_x(x)
    assert (np.abs(xq) == 127).all()
    xdeq = torch.from_numpy(xq.reshape(2, -1, 32) * dx[..., None]).reshape(2, k).double()
    exact = xdeq @ dequantize(w).double().t()
    fp32 = k * 2.0 ** -22 * (torch.from_numpy(x).double().abs() @ magnitude(w).double().t())
    assert bool(((torch.from_numpy(y).double() - exact).abs() <= fp32).all())
