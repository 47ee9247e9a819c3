"""Quantized and dense skinny GEMMs (kernels/quant_triton.py) compiled on a real GPU, bf16
activations, at real shapes: Llama-3.1-8B's o_proj (4096 x 4096) and Qwen2.5-0.5B's down_proj
(896 x 4864, a short N that takes split-K), every qtype, with bias, M in {1, 4, 8, 16} (skinny
kernel) and 64 (dequantize + cuBLAS), with the arch's own config.

The kernels are compared with the fp32 product of the same bf16 x and the fp32 dequantized
weight: atol 2e-2, rtol 1e-2 (the bf16 output rounds at 2^-9 relative, the tl.dot path also
rounds each weight to bf16, which moves |y| ~ 2 by about 5e-3). The bf16 reference
(`quant_linear_ref`, cuBLAS) is held to the same bound, so the test fails for the kernel, not
the bound. `dequantize_triton` in fp32 equals `dequantize` up to FMA contraction (d * q + m
rounded once): atol 1e-6 x max |w|. Inputs are fresh random each run; the seed is in every
message.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: these tests run the compiled kernels",
                allow_module_level=True)
pytest.importorskip("triton")

from luceio.kernels import configs, quant, quant_triton as qt  # noqa: E402
from luceio.kernels.quant import QTYPES, dequantize, quant_linear_ref  # noqa: E402
from luceio.kernels.quant_x import quantize_x_ref  # noqa: E402

DEV = "cuda"
TOL = dict(atol=2e-2, rtol=1e-2)
SHAPES = [(4096, 4096), (896, 4864)]
ROWS = [1, 4, 8, 16, 64]
GEMV_MAX_M = configs.get_config(torch.device(DEV)).gemv_max_m


@pytest.fixture
def seed():
    s = int(os.environ.get("LUCEIO_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(s)
    return s


def check(out, ref, seed, what):
    err = (out.float() - ref.float()).abs().max().item()
    assert torch.allclose(out.float(), ref.float(), **TOL), \
        f"{what}: max abs err {err:.3g} (seed {seed})"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quant_matmul_bf16(seed, qtype, shape):
    n, k = shape
    w = quant.random_quant_weight(qtype, n, k, device=DEV)
    w32 = dequantize(w)
    bias = torch.randn(n, device=DEV).to(torch.bfloat16)
    for m in ROWS:
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        exact = torch.addmm(bias.float(), x.float(), w32.T)
        what = f"{qtype} [{n}, {k}] M={m}"
        check(quant_linear_ref(x, w, bias), exact, seed, what + " (reference)")
        out = qt.quant_matmul(x, w, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        if m <= GEMV_MAX_M:  # the int8 GEMV: exact for the int8-rounded x (kernels/quant_gemv.py)
            exact = torch.addmm(bias.float(), quantize_x_ref(x), w32.T)
        check(out, exact, seed, what)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("row_blocks, prefetch", [(1, True), (2, True), (2, False)])
def test_gemv_rows_equal_one_row_each_bf16(seed, qtype, row_blocks, prefetch):
    """Natively: the GEMV's rows (a verify step's) give the bits each row gives alone (the
    decode steps they stand for), on a split-K shape and an unsplit one, at 3 / 5 / 6 / 7 / 8
    rows padded to a power of two and in two blocks (`gemv_row_blocks` 2: 4 + 1, 4 + 2, ...),
    with and without the rows' prefetch (`gemv_rows_prefetch`)."""
    base = configs.get_config(torch.device(DEV))
    cfg = configs.KernelConfig(**{**base.__dict__, "gemv_row_blocks": row_blocks,
                                  "gemv_rows_prefetch": prefetch})
    for n, k in SHAPES:
        w = quant.random_quant_weight(qtype, n, k, device=DEV)
        bias = torch.randn(n, device=DEV).to(torch.bfloat16)
        x = torch.randn(GEMV_MAX_M, k, device=DEV).to(torch.bfloat16)
        with configs.use_config(cfg):
            alone = torch.cat([qt.quant_matmul(x[i:i + 1], w, bias) for i in range(x.shape[0])])
            for m in sorted({3, 5, 6, 7, GEMV_MAX_M}):
                rows = qt.quant_matmul(x[:m], w, bias)
                assert torch.equal(rows, alone[:m]), \
                    f"{qtype} [{n}, {k}] {m} rows, row_blocks={row_blocks}, " \
                    f"prefetch={prefetch} (seed {seed})"


@pytest.mark.parametrize("shape", SHAPES)
def test_dense_skinny_bf16(seed, shape):
    n, k = shape
    w = (torch.randn(n, k, device=DEV) * 0.03).to(torch.bfloat16)
    bias = torch.randn(n, device=DEV).to(torch.bfloat16)
    for m in ROWS[:-1]:
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        exact = torch.addmm(bias.float(), x.float(), w.float().T)
        check(qt.dense_matmul_skinny(x, w, bias), exact, seed, f"dense [{n}, {k}] M={m}")


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_triton(seed, qtype):
    w = quant.random_quant_weight(qtype, 1024, 4096, device=DEV)
    ref = dequantize(w)
    got = qt.dequantize_triton(w)
    atol = 1e-6 * ref.abs().max().item()
    assert torch.allclose(got, ref, atol=atol, rtol=0), f"{qtype} (seed {seed})"
    bf16 = qt.dequantize_triton(w, torch.bfloat16)
    assert torch.allclose(bf16.float(), ref.bfloat16().float(), atol=atol, rtol=2**-8), qtype


def test_skinny_in_cuda_graph(seed):
    """Split-K allocates its partial buffer inside the capture; replay reads the new x."""
    w = quant.random_quant_weight("q4_k", 896, 4864, device=DEV)
    x = torch.randn(4, 4864, device=DEV).to(torch.bfloat16)
    qt.quant_matmul(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qt.quant_matmul(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    xr = quantize_x_ref(x) if x.shape[0] <= GEMV_MAX_M else x.float()
    check(out, xr @ dequantize(w).T, seed, "replayed")


@pytest.mark.parametrize("qtype", ["q4_0", "q6_k", "q4_k"])
@pytest.mark.parametrize("swap", [True, False])
def test_packed_tiles_round_like_the_reference_gpu(qtype, swap):
    """The PTX's bf16 weights (`qgemm_packed`, as the dot's A and B operand), read back exactly
    through rows of the identity: q4_0's equal the reference's bf16 weights bit for bit, q6_k's
    but for rare near-ties, q4_k's (two roundings) within one ulp where they do not nearly
    cancel, and over 3 in 4 equal; tests/test_quant_triton.py holds the interpreter's stand-in to
    the same."""
    from dataclasses import replace
    cfg = replace(configs.get_config(torch.device(DEV)), skinny_max_m=32, skinny_max_m_q6_k=0,
                  gemv_max_m=1, qgemm_swap=swap, qgemm_packed=True,
                  qgemm_block_k=max(128, configs.get_config(torch.device(DEV)).qgemm_block_k))
    n, k = 896, 4864
    w = quant.random_quant_weight(qtype, n, k, device=DEV)
    ref = dequantize(w)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEV)
    with configs.use_config(cfg):
        got = torch.cat([qt.quant_matmul(eye[i:i + 32], w) for i in range(0, k, 32)]).float().T
    same = (got == ref.to(torch.bfloat16).float()).float().mean().item()
    what = f"{qtype} swap={swap}: {same:.4f} of the weights equal the reference's bf16"
    assert ((got - ref).abs() <= 2.0**-7 * ref.abs() + 2.0**-15 * ref.abs().max()).all(), what
    assert same == 1.0 if qtype == "q4_0" else same > (0.99 if qtype == "q6_k" else 0.75), what


@pytest.mark.parametrize("qtype", ["q4_0", "q6_k", "q4_k"])
def test_prefetched_scales_change_nothing_gpu(seed, qtype):
    """`qgemm_prefetch_scales` (the packed tile's scales loaded one K tile ahead) gives the same
    bits as the scales loaded in their own tile, in the PTX: the 1.5B shapes' split-K (gate/up
    [17920, 1536]), the unsplit down projection [1536, 8960] and a K of whole tiles but for a
    partial last one (K 4864), 5 / 17 / 25 rows, bias, in the form the engine keeps
    (`prepare_weight`: q4_k's scales paired)."""
    from dataclasses import replace

    from luceio.kernels import prepare_weight
    cfg = replace(configs.get_config(torch.device(DEV)), skinny_max_m=32, skinny_max_m_q6_k=0,
                  gemv_max_m=1, qgemm_swap=True, qgemm_packed=True,
                  qgemm_block_k=max(128, configs.get_config(torch.device(DEV)).qgemm_block_k))
    for n, k in ((17920, 1536), (1536, 8960), (896, 4864)):
        w = prepare_weight(quant.random_quant_weight(qtype, n, k, device=DEV), torch.bfloat16)
        bias = torch.randn(n, device=DEV).to(torch.bfloat16)
        for m in (5, 17, 25):
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            out = []
            for prefetch in (False, True):
                with configs.use_config(replace(cfg, qgemm_prefetch_scales=prefetch)):
                    out.append(qt.quant_matmul(x, w, bias))
            what = f"{qtype} [{n}, {k}] M={m} (seed {seed})"
            assert torch.equal(out[0], out[1]), what
            if k <= 4864:  # as the other tests' shapes (their tolerance does not grow with K)
                check(out[1], torch.addmm(bias.float(), x.float(), dequantize(w).float().T),
                      seed, what)


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q5_0", "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("swap", [False, True, "packed", "packed_b"])
def test_skinny_dot_past_16_rows(seed, qtype, swap):
    """Natively, the skinny tl.dot (`skinny_max_m` 32, forced; the int8 GEMV off) at 12 rows
    (M padded to 16), 17, 24 and 32 (padded to 32) on both shapes, both scale forms, with the
    weights as the dot's B operand and as its A operand (`qgemm_swap`, a warpgroup MMA from
    registers on Hopper), and dequantized by the packed PTX (`qgemm_packed`, K tiles of 128,
    q4_0, q4_k and q6_k) as the A operand and as the B, match the fp32 product; so does the
    dense dot path."""
    from dataclasses import replace

    from luceio.kernels import prepare_weight
    cfg = replace(configs.get_config(torch.device(DEV)), skinny_max_m=32, skinny_max_m_q6_k=0,
                  gemv_max_m=1, qgemm_swap=swap in (True, "packed"),
                  qgemm_packed=swap in ("packed", "packed_b"))
    if cfg.qgemm_packed:
        cfg = replace(cfg, qgemm_block_k=max(128, cfg.qgemm_block_k))
        assert qt.packed_tiles(cfg, qtype, cfg.qgemm_block_k, torch.bfloat16) == \
            (qtype in ("q4_k", "q6_k", "q4_0"))
    for n, k in SHAPES:
        w = quant.random_quant_weight(qtype, n, k, device=DEV)
        bias = torch.randn(n, device=DEV).to(torch.bfloat16)
        x = torch.randn(12, k, device=DEV).to(torch.bfloat16)
        wd = dequantize(w).to(torch.bfloat16)
        with configs.use_config(cfg):
            got = qt.dense_matmul_skinny(x, wd, bias)
        check(got, torch.addmm(bias.float(), x.float(), wd.float().T), seed,
              f"dense [{n}, {k}] M=12 swap={swap}")
        for form in (w, prepare_weight(w, torch.bfloat16)):
            for m in (12, 17, 24, 32):
                x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
                with configs.use_config(cfg):
                    got = qt.quant_matmul(x, form, bias)
                exact = torch.addmm(bias.float(), x.float(), dequantize(form).float().T)
                check(got, exact, seed, f"{qtype} [{n}, {k}] M={m} swap={swap} (skinny dot)")
