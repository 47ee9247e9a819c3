"""The quantized GEMV's tails (kernels/quant_gemv_tail.py) on CPU under TRITON_INTERPRET=1 (CI):
the SiLU after a gate/up GEMV and the residual add + RMSNorm after an o / down GEMV, done by the
GEMV's last programs to arrive, equal the launches they replace (`silu_and_mul`, `rms_norm`,
each with the int8 forms of its output for the next GEMV), with and without split-K, at one row
and at several, in one pass and in chunks; the arrival counters are left zero for the next
launch, and a tail that does not fit the launch is left to the caller (`done` stays False).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
triton = pytest.importorskip("triton")

from conftest import seed_for  # noqa: E402
from luceio.kernels import configs, quant, quant_gemv_tail as qt_tail  # noqa: E402
from luceio.kernels import quant_triton as qt  # noqa: E402
from luceio.kernels.configs import KernelConfig  # noqa: E402
from luceio.kernels.elementwise_triton import rms_norm, silu_and_mul, xq_layouts  # noqa: E402
from luceio.kernels.quant_x import quantize_x  # noqa: E402

INTERPRETED = type(qt._skinny_kernel).__name__ == "InterpretedFunction"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("the Triton kernels were defined without TRITON_INTERPRET=1 and there is no GPU",
                allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"
BASE = dict(gemv_block_k=64, gemv_split_min_programs=0, gemv_min_tiles_per_split=1,
            gemv_rows_per_launch=8, gemv_glu_tail_max_n=1 << 20, gemv_norm_tail_max_n=1 << 20,
            source="test")


def _cfg(block_n: int, split: bool) -> KernelConfig:
    return KernelConfig(**{**BASE, "gemv_block_n": block_n,
                           "gemv_split_min_programs": 1000 if split else 0})


def _gen(request):
    return torch.Generator().manual_seed(seed_for(request))


def _xqs(rows: int, n: int) -> dict:
    return xq_layouts([True, False], rows, n, torch.device(DEVICE))


def _same_xqs(got: dict, act: torch.Tensor, what: str) -> None:
    """`got` holds act's int8 forms as `quantize_x` makes them, bit for bit."""
    for planes, forms in got.items():
        want = quantize_x(act.reshape(-1).float().contiguous(), planes=planes)
        for g, w in zip(forms, want):
            assert torch.equal(g, w), f"{what}: int8 forms (planes={planes}) differ"


def _counters_zero() -> bool:
    return all(int(b.abs().sum()) == 0 for b in qt_tail._COUNTERS.values())


@pytest.mark.parametrize("qtype", ["q4_k", "q8_0"])
@pytest.mark.parametrize("block_n,split,rows", [(16, False, 1), (4, True, 3), (32, False, 3)])
def test_glu_tail_equals_silu_and_mul(request, qtype, block_n, split, rows):
    """block_n 16: 4 programs a 32-column group (2 gate, 2 up), 4 with split-K (the last
    split of each counts), 32: 2."""
    g = _gen(request)
    k, half = 256, 64
    w = quant.random_quant_weight(qtype, 2 * half, k, generator=g).to(DEVICE)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    with configs.use_config(_cfg(block_n, split)):
        plain = qt.quant_matmul_skinny(x, w)
        tail = qt_tail.GluTail(torch.empty(rows, half, dtype=x.dtype, device=DEVICE),
                               _xqs(rows, half))
        out = qt.quant_matmul_skinny(x, w, tail=tail)
        assert tail.done
        assert torch.equal(out, plain)  # the GEMV's own output is untouched
        want = silu_and_mul(plain)
        assert torch.equal(tail.out, want), f"{qtype} block_n {block_n}: SiLU differs"
        _same_xqs(tail.xqs, want, f"{qtype} glu")
        assert _counters_zero()
        again = qt_tail.GluTail(torch.empty_like(tail.out), _xqs(rows, half))
        qt.quant_matmul_skinny(x, w, tail=again)  # a second launch finds the counters zero
        assert torch.equal(again.out, want)


@pytest.mark.parametrize("qtype,split,rows,one_pass", [
    ("q4_k", False, 1, True), ("q6_k", True, 2, False), ("q5_0", True, 1, True),
    ("q5_0", False, 2, False)])
def test_norm_tail_equals_rms_norm(request, monkeypatch, qtype, split, rows, one_pass):
    g = _gen(request)
    k = 256
    n = 160 if not qtype.endswith("_k") else 256
    if not one_pass:  # chunks of 64: 160 = 64 + 64 + 32, 256 = 4 x 64
        monkeypatch.setattr(qt_tail, "_ONE_PASS_MAX", 32)
        monkeypatch.setattr(qt_tail, "_CHUNK", 64)
    w = quant.random_quant_weight(qtype, n, k, generator=g).to(DEVICE)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(rows, n, generator=g).to(torch.bfloat16).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16).to(DEVICE)
    with configs.use_config(_cfg(16, split)):
        plain = qt.quant_matmul_skinny(x, w)
        tail = qt_tail.norm_tail(residual, norm_w, 1e-6, _xqs(rows, n))
        out = qt.quant_matmul_skinny(x, w, tail=tail)
        assert tail.done
        assert torch.equal(out, plain)
        want, want_res = rms_norm(plain, norm_w, 1e-6, residual)
        assert torch.equal(tail.res_out, want_res)  # the add rounds as rms_norm's does
        # the sum of squares may run in another order: a bf16 step at most, rarely
        diff = (tail.out.float() - want.float()).abs()
        assert float(diff.max()) <= float(want.float().abs().max()) * 2 ** -7, float(diff.max())
        assert float((diff > 0).float().mean()) < 0.02
        _same_xqs(tail.xqs, tail.out, f"{qtype} norm")
        assert _counters_zero()


def test_a_tail_that_does_not_fit_is_left_to_the_caller(request):
    """A GLU tail needs whole 32-column groups a program (block_n 64 spans two) and rows in one
    launch; a norm tail a residual of the output's shape."""
    g = _gen(request)
    w = quant.random_quant_weight("q8_0", 128, 64, generator=g).to(DEVICE)
    x = torch.randn(3, 64, generator=g).to(DEVICE)
    with configs.use_config(_cfg(64, False)):
        tail = qt_tail.GluTail(torch.empty(3, 64, device=DEVICE), _xqs(3, 64))
        qt.quant_matmul_skinny(x, w, tail=tail)
        assert not tail.done
    with configs.use_config(KernelConfig(**{**BASE, "gemv_block_n": 16,
                                            "gemv_rows_per_launch": 2})):
        tail = qt_tail.GluTail(torch.empty(3, 64, device=DEVICE), _xqs(3, 64))
        qt.quant_matmul_skinny(x, w, tail=tail)
        assert not tail.done
    for off in ({"gemv_tails": False}, {"gemv_glu_tail_max_n": 64}):  # 128 columns
        with configs.use_config(KernelConfig(**{**BASE, "gemv_block_n": 16, **off})):
            tail = qt_tail.GluTail(torch.empty(3, 64, device=DEVICE), _xqs(3, 64))
            qt.quant_matmul_skinny(x, w, tail=tail)
            assert not tail.done
    with configs.use_config(KernelConfig(**{**BASE, "gemv_block_n": 16,
                                            "gemv_norm_tail_max_n": 64})):
        tail = qt_tail.norm_tail(torch.zeros(3, 128, device=DEVICE), torch.ones(128), 1e-6,
                                 _xqs(3, 128))
        qt.quant_matmul_skinny(x, w, tail=tail)
        assert not tail.done
    assert qt_tail.norm_tail(torch.zeros(3, 96, device=DEVICE), torch.ones(96), 1e-6, {}) is None
    with configs.use_config(_cfg(16, False)):
        tail = qt_tail.norm_tail(torch.zeros(2, 128, device=DEVICE), torch.ones(128), 1e-6,
                                 _xqs(2, 128))
        qt.quant_matmul_skinny(x, w, tail=tail)  # 3 rows against a 2-row residual
        assert not tail.done
