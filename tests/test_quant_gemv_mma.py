"""The int8 tensor-core GEMV of several rows (kernels/quant_gemv_mma.py) on CPU under
TRITON_INTERPRET=1: against the exact product with the int8-rounded x (fp32 tolerance: each
group's sum is exact, only the float order differs), with and without split-K, one and two
launches of rows, both scale forms; a row's bits do not depend on the other rows (batched ==
solo within its rows); routing: which rows and types go to it. The seed is in every message
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
            gemv_min_tiles_per_split=1, gemv_max_m=2, gemv_rows_per_launch=8,
            gemv_mma_max_m=64, gemv_mma_rows_per_launch=16, gemv_mma_block_n=16,
            gemv_mma_split_min_programs=0, source="test")
ON = KernelConfig(**BASE)                                     # 3 .. 64 rows: the tensor-core GEMV
SPLIT = KernelConfig(**{**BASE, "gemv_mma_split_min_programs": 9})  # 3 programs < 9: K split
OFF = KernelConfig(**{**BASE, "gemv_mma_max_m": 0})


@pytest.fixture
def seed():
    return int(os.environ.get("LUCEIO_TEST_SEED", random.randrange(2**31)))


def randn(g, *shape):
    return torch.randn(*shape, generator=g).to(DEVICE)


@pytest.mark.parametrize("qtype", quant_gemv_mma.MMA_QTYPES)
def test_rows_match_the_exact_product(seed, qtype):
    """3 rows with K split (k-quants: 16 groups in splits of 8; others: 9 groups, unsplit as
    fewer than 16) and 18 rows unsplit (launches of 16 + 2) match the exact product with the
    int8-rounded x; rows 0-2 of the 18 give the bits they give as 3 rows of their own."""
    g = torch.Generator().manual_seed(seed)
    k = 512 if qtype.endswith("_k") else 288
    n = 37                                              # 3 programs of 16, the last partial
    w = quant.random_quant_weight(qtype, n, k, generator=g).to(DEVICE)
    if qtype in ("q4_k", "q5_k") and seed % 2:
        w = quant.pair_scales(w)                        # either scale form
    bias = randn(g, n)
    x = randn(g, 18, k)
    for rows, cfg in ((3, SPLIT), (18, ON), (3, ON)):
        with configs.use_config(cfg):
            got = qt.quant_matmul(x[:rows], w, bias)
        ref = quant_linear_ref(quantize_x_ref(x[:rows]), w, bias)
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), \
            f"{qtype} {rows} rows (seed {seed}): {(got - ref).abs().max():.3g}"
    with configs.use_config(ON):
        many = qt.quant_matmul(x, w, bias)
    assert torch.equal(many[:3], got), f"{qtype} (seed {seed})"


def test_routing(seed, monkeypatch):
    """Which launches take the tensor-core GEMV: past gemv_max_m rows up to gemv_mma_max_m, of
    its types, fused projections of those types past 16 rows too (no dequantized copy); never
    q8_0, never up to gemv_max_m rows, never when off."""
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
        qt.quant_matmul(x[:2], w4)
        qt.quant_matmul(x[:3], w8)
        assert calls == []
        out = qt.quant_matmul_parts(x, [w4, w6])
        assert calls == [40, 40]
        ref = torch.cat([quant_linear_ref(quantize_x_ref(x), w) for w in (w4, w6)], -1)
        assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), f"seed {seed}"
    calls.clear()
    with configs.use_config(OFF):
        qt.quant_matmul(x[:5], w4)
    with configs.use_config(KernelConfig(**{**BASE, "gemv_mma_max_m": 16})):
        qt.quant_matmul(x[:17], w4)    # past its rows: the dequantized copy
    assert calls == []
