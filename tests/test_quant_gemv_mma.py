"""The tensor-core GEMV of a few rows (kernels/quant_gemv_mma.py) on CPU under TRITON_INTERPRET=1:
each row gives the bits the one-row int8 GEMV gives it alone (a verify step's rows equal the
decode steps they stand for), past one launch of rows too, with and without split-K and with
paired scales; the result is the exact product with the int8-rounded x up to fp32 rounding;
routing: which rows and types go to it. Small tiles (gemv_block_k 128: 4 group slots, so the
order the slots are summed in matters) so small shapes cross tile, 256-block and split
boundaries. The seed is in every message
(LUCEIO_TEST_SEED=<seed> replays one).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
triton = pytest.importorskip("triton")

from luceio.kernels import configs, quant, quant_gemv_mma, quant_triton as qt  # noqa: E402
from luceio.kernels.configs import KernelConfig  # noqa: E402
from luceio.kernels.quant import quant_linear_ref  # noqa: E402
from luceio.kernels.quant_x import quantize_x_ref  # noqa: E402

INTERPRETED = type(qt._skinny_kernel).__name__ == "InterpretedFunction"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("the Triton kernels were defined without TRITON_INTERPRET=1 and there is no GPU",
                allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"

BASE = dict(gemv_block_n=16, gemv_block_k=128, gemv_split_min_programs=0,
            gemv_min_tiles_per_split=1, gemv_max_m=8, gemv_rows_per_launch=8,
            gemv_mma_max_m=64, gemv_mma_rows_per_launch=16, gemv_mma_block_n=16,
            source="test")
OFF = KernelConfig(**BASE)                                     # rows: the dp4a GEMV
ON = KernelConfig(**BASE, gemv_mma_min_m=2)                    # rows: the tensor-core GEMV
SPLIT3 = KernelConfig(**{**BASE, "gemv_split_min_programs": 9}, gemv_mma_min_m=2)  # 3 < 9: split


@pytest.fixture
def seed():
    return int(os.environ.get("LUCEIO_TEST_SEED", random.randrange(2**31)))


def randn(g, *shape):
    return torch.randn(*shape, generator=g).to(DEVICE)


def one_row_each(x, w, bias, cfg):
    with configs.use_config(cfg):
        return torch.cat([qt.quant_matmul(x[i:i + 1], w, bias) for i in range(x.shape[0])])


@pytest.mark.parametrize("qtype", quant_gemv_mma.MMA_QTYPES)
def test_rows_equal_one_row_each(seed, qtype):
    """3 rows with K split in 3 and 18 rows unsplit (two launches: 16 + 2) through the
    tensor-core GEMV equal one-row GEMVs bit for bit and match the exact product with the
    int8-rounded x."""
    g = torch.Generator().manual_seed(seed)
    k = 512 if qtype.endswith("_k") else 224            # 4 tiles / 2 tiles, the last partial
    n = 37                                              # 3 programs of 16, the last partial
    w = quant.random_quant_weight(qtype, n, k, generator=g).to(DEVICE)
    if qtype in ("q4_k", "q5_k"):
        w = quant.pair_scales(w) if seed % 2 else w     # either scale form
    bias = randn(g, n)
    for rows, cfg in ((3, SPLIT3), (18, ON)):
        x = randn(g, rows, k)
        with configs.use_config(cfg):
            got = qt.quant_matmul(x, w, bias)
        alone = one_row_each(x, w, bias, cfg)
        assert torch.equal(got, alone), f"{qtype} {rows} rows (seed {seed})"
        ref = quant_linear_ref(quantize_x_ref(x), w, bias)
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), f"{qtype} {rows} (seed {seed})"


def test_routing(seed, monkeypatch):
    """Which launches take the tensor-core GEMV: the configured rows of its types, fused
    projections of those types past 16 rows (no dequantized copy); never q8_0 or one row."""
    g = torch.Generator().manual_seed(seed)
    calls = []
    real = quant_gemv_mma.gemv_mma
    monkeypatch.setattr(qt, "gemv_mma", lambda *a, **kw: calls.append(a[0].shape[0])
                        or real(*a, **kw))
    w4 = quant.random_quant_weight("q4_k", 16, 256, generator=g).to(DEVICE)
    w6 = quant.random_quant_weight("q6_k", 16, 256, generator=g).to(DEVICE)
    w8 = quant.random_quant_weight("q8_0", 16, 256, generator=g).to(DEVICE)
    x = randn(g, 40, 256)
    with configs.use_config(ON):
        qt.quant_matmul(x[:1], w4)
        assert calls == []
        qt.quant_matmul(x[:3], w8)
        assert calls == []
        out = qt.quant_matmul_parts(x, [w4, w6])
        assert calls == [40, 40]
        ref = torch.cat([quant_linear_ref(quantize_x_ref(x), w) for w in (w4, w6)], -1)
        assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), f"seed {seed}"
    with configs.use_config(OFF):
        calls.clear()
        qt.quant_matmul(x[:5], w4)
        assert calls == []
    with configs.use_config(KernelConfig(**{**BASE, "gemv_mma_max_m": 16}, gemv_mma_min_m=2)):
        qt.quant_matmul(x[:17], w4)    # past its rows: the dequantized copy
        assert calls == []
