"""Quantized and dense skinny GEMMs (kernels/quant_triton.py) vs the torch reference
(`quant.quant_linear_ref`, `quant.dequantize`), on CPU under TRITON_INTERPRET=1 (CI).

Ragged shapes on small tiles (BLOCK_N 16, BLOCK_K 64): N = 7 and 33 (a partial row tile),
K = 96 and 160 for the 32-element types (a partial K tile), K = 512 for the k-quants (tiles
inside 256-blocks), M = 1 (the multiply + sum path), 3 and 16 (the tl.dot path), split-K on
and off. Inputs are random from a seed fixed per test
(`conftest.seed_for`; LUCEIO_TEST_RANDOM=1 draws fresh ones); the seed is in every message
(LUCEIO_TEST_SEED=<seed> replays one).

Tolerances (kernel vs the reference in the same dtype; both accumulate in fp32, the kernel
in another order, and on the multiply + sum path with the weight unrounded):
  fp32: atol 1e-4, rtol 1e-4      fp16: atol 2e-3, rtol 2e-3 (about 2 fp16 ulps at |y| ~ 1)
  bf16 (one case, for the interpreter's fp32 stand-in for bf16 dots): atol 2e-2, rtol 2e-2
`dequantize_triton` must equal `dequantize` bit for bit (the interpreter does not fuse FMAs).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
triton = pytest.importorskip("triton")

from conftest import seed_for  # noqa: E402
from luceio.kernels import configs, quant, quant_gemv, quant_triton as qt  # noqa: E402
from luceio.kernels.configs import KernelConfig  # noqa: E402
from luceio.kernels.quant import QTYPES, dequantize, quant_linear_ref  # noqa: E402
from luceio.kernels.quant_args import paired  # noqa: E402
from luceio.kernels.quant_x import quantize_x_ref  # noqa: E402

INTERPRETED = type(qt._skinny_kernel).__name__ == "InterpretedFunction"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("the Triton kernels were defined without TRITON_INTERPRET=1 and there is no GPU: "
                "set TRITON_INTERPRET=1 before anything imports triton", allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# small tiles so the small shapes cross row, K-tile, 256-block and split boundaries
SMALL = KernelConfig(qgemm_block_n=16, qgemm_block_k=64, gemv_block_n=16, gemv_block_k=64,
                     skinny_row_block_n=16, skinny_row_block_k=64,
                     qgemm_split_k_min_programs=0,
                     qgemm_max_split_k=4, qgemm_min_tiles_per_split=1, gemv_split_min_programs=0,
                     gemv_min_tiles_per_split=1, dequant_block_n=8, dequant_block_k=64,
                     source="test")
SPLIT = KernelConfig(**{**SMALL.__dict__, "qgemm_split_k_min_programs": 1000,
                        "gemv_split_min_programs": 1000})


class Rng:
    def __init__(self, seed: int | None = None):
        self.seed_value = seed_for() if seed is None else seed
        self.g = torch.Generator().manual_seed(self.seed_value)

    def randn(self, *shape, dtype=torch.float32):
        return torch.randn(*shape, generator=self.g).to(dtype).to(DEVICE)


@pytest.fixture
def gen(request):
    return Rng(seed_for(request))


def check(out, ref, tol, g, what):
    out, ref = out.float().cpu(), ref.float().cpu()
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = (out - ref).abs().max().item() if out.numel() else 0.0
    assert torch.allclose(out, ref, **tol), f"{what}: max abs err {err:.3g} (seed {g.seed_value})"


def weight(g, qtype, n, k):
    return quant.random_quant_weight(qtype, n, k, generator=g.g).to(DEVICE)


# (M, activation dtype, split-K, bias): every M with both dtypes and both split settings
CASES = [(1, torch.float32, False, True), (1, torch.float16, True, False),
         (3, torch.float16, False, True), (3, torch.float32, True, True),
         (16, torch.float32, False, False), (16, torch.float16, True, True)]


@pytest.mark.parametrize("qtype", QTYPES)
def test_quant_skinny_matches_reference(gen, qtype):
    shapes = [(33, 512), (7, 256)] if qtype.endswith("_k") else [(33, 160), (7, 96)]
    for n, k in shapes:
        w = weight(gen, qtype, n, k)
        bias = gen.randn(n)
        for m, dtype, split, with_bias in CASES:
            x = gen.randn(m, k, dtype=dtype)
            b = bias.to(dtype) if with_bias else None
            with configs.use_config(SPLIT if split else SMALL):
                out = qt.quant_matmul_skinny(x, w, b)
            xr = gemv_input(x)
            check(out, quant_linear_ref(xr, w, b.to(xr.dtype) if with_bias else None),
                  TOL[dtype], gen,
                  f"{qtype} [{n}, {k}] M={m} {dtype} split={split} bias={with_bias}")
            assert out.dtype == dtype


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q8_0", "q5_1"])
def test_swapped_operands_give_the_same_product(gen, qtype):
    """`qgemm_swap` (the weights as the dot's A operand, the product transposed) computes
    the same sums: it matches the reference, and the plain dot path to fp32 rounding."""
    n, k = (33, 512) if qtype.endswith("_k") else (33, 160)
    w = weight(gen, qtype, n, k)
    bias = gen.randn(n)
    for m, dtype, split, with_bias in CASES[2:]:  # the dot path: M > 1 (no int8 GEMV rows)
        x = gen.randn(m, k, dtype=dtype)
        b = bias.to(dtype) if with_bias else None
        base = KernelConfig(**{**(SPLIT if split else SMALL).__dict__, "gemv_max_m": 1})
        with configs.use_config(base):
            plain = qt.quant_matmul_skinny(x, w, b)
        with configs.use_config(KernelConfig(**{**base.__dict__, "qgemm_swap": True})):
            swapped = qt.quant_matmul_skinny(x, w, b)
            dense = qt.dense_matmul_skinny(x, dequantize(w).to(dtype), b)
        what = f"{qtype} M={m} {dtype} split={split} bias={with_bias}"
        check(swapped, quant_linear_ref(x, w, b.to(x.dtype) if with_bias else None), TOL[dtype],
              gen, what)
        check(swapped, plain, dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else TOL[dtype],
              gen, what + " vs the plain dot")
        check(dense, torch.nn.functional.linear(x, dequantize(w).to(dtype), b), TOL[dtype], gen,
              what + " dense")


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q4_0"])
def test_packed_tiles_give_the_product(gen, qtype):
    """`qgemm_packed` (q4_0, q4_k and q6_k tiles dequantized two weights a register, in a
    permuted K order that x follows) matches the reference: K tiles of 128 and 256 (one and
    two groups a fragment column), a partial last tile (K = 160 for the 32-element types),
    split-K, bias, M padded to 16 and to 32, the weights as the dot's A operand (`qgemm_swap`)
    and as its B. Under the interpreter this runs the kernel's fp32 stand-in for the PTX (the
    same formula); the GPU tests run the PTX."""
    n, k = (33, 512) if qtype.endswith("_k") else (33, 160)
    w = weight(gen, qtype, n, k)
    bias = gen.randn(n).to(torch.bfloat16)
    for block_k, split, with_bias, m, swap in ((128, False, True, 3, True),
                                               (256, True, False, 17, True),
                                               (128, True, True, 16, False)):
        cfg = KernelConfig(**{**(SPLIT if split else SMALL).__dict__, "gemv_max_m": 1,
                              "qgemm_block_k": block_k, "qgemm_swap": swap,
                              "qgemm_packed": True, "skinny_max_m": 32})
        assert qt.packed_tiles(cfg, qtype, block_k, torch.bfloat16)
        x = gen.randn(m, k, dtype=torch.bfloat16)
        b = bias if with_bias else None
        with configs.use_config(cfg):
            got = qt.quant_matmul_skinny(x, w, b)
        check(got, quant_linear_ref(x, w, b), TOL[torch.bfloat16], gen,
              f"{qtype} M={m} block_k={block_k} split={split} bias={with_bias} swap={swap}")
    assert not qt.packed_tiles(cfg, "q5_k", 128, torch.bfloat16)
    assert not qt.packed_tiles(cfg, "q4_1", 128, torch.bfloat16)  # see PACKED_QTYPES
    assert not qt.packed_tiles(cfg, qtype, 128, torch.float16)
    assert not qt.packed_tiles(cfg, qtype, 64, torch.bfloat16)


@pytest.mark.parametrize("qtype", ["q4_0", "q6_k", "q4_k"])
def test_packed_tiles_round_like_the_reference(gen, qtype):
    """The packed tile's bf16 weights, read back exactly through rows of the identity (each
    output is one weight times 1): q4_0's are the reference's bf16 weights bit for bit (scale
    as bf16 hi + lo, q * lo exact, one rounding of q * d); q6_k's all but the rare near-tie;
    q4_k's (two roundings: q s_hi + o_hi, then + (q s_lo + o_lo)) within one bf16 ulp but where
    the two nearly cancel, and over 3 in 4 equal (a scale and offset rounded to bf16 before one
    FMA, session 49's tiles: 65%, q4_0 86%, q6_k 80%). The stand-in for the PTX under the
    interpreter rounds to nearest even as the PTX does (`_rne_bf16`); the GPU tests run the
    PTX."""
    n, k = (40, 512)
    w = weight(gen, qtype, n, k)
    cfg = KernelConfig(**{**SMALL.__dict__, "gemv_max_m": 1, "qgemm_block_k": 128,
                          "qgemm_swap": True, "qgemm_packed": True, "skinny_max_m": 32})
    ref = dequantize(w).cpu()
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEVICE)
    with configs.use_config(cfg):
        got = torch.cat([qt.quant_matmul_skinny(eye[i:i + 32], w) for i in range(0, k, 32)])
    got = got.float().cpu().T  # [N, K]
    same = (got == ref.to(torch.bfloat16).float()).float().mean().item()
    what = f"{qtype}: {same:.4f} of the weights equal the reference's bf16 (seed {gen.seed_value})"
    assert ((got - ref).abs() <= 2.0**-7 * ref.abs() + 2.0**-15 * ref.abs().max()).all(), what
    assert same == 1.0 if qtype == "q4_0" else same > (0.99 if qtype == "q6_k" else 0.75), what


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q4_0"])
def test_prefetched_scales_change_nothing(gen, qtype):
    """`qgemm_prefetch_scales` (packed tiles load the next K tile's scales one tile ahead) gives
    the same bits as loading them in their own tile: split K (the last split's prefetch runs
    past K: q4_0 K = 640, splits of 3 and 2 tiles of 128; the k-quants K = 768, 3 splits of 2),
    M padded to 16 and 32, bias, the weights as the dot's A and B operand."""
    n, k = (40, 768) if qtype.endswith("_k") else (40, 640)
    w = weight(gen, qtype, n, k)
    bias = gen.randn(n).to(torch.bfloat16)
    for m, swap, split in ((5, True, True), (17, False, True), (3, True, False)):
        base = KernelConfig(**{**(SPLIT if split else SMALL).__dict__, "gemv_max_m": 1,
                               "qgemm_block_k": 128, "qgemm_swap": swap, "qgemm_packed": True,
                               "skinny_max_m": 32, "qgemm_min_tiles_per_split": 2})
        if split:
            assert qt.skinny_split_k(base, -(-n // base.qgemm_block_n), k // 128) == \
                ((3, 2) if qtype.endswith("_k") else (2, 3))
        x = gen.randn(m, k, dtype=torch.bfloat16)
        out = []
        for prefetch in (False, True):
            with configs.use_config(KernelConfig(**{**base.__dict__,
                                                    "qgemm_prefetch_scales": prefetch})):
                out.append(qt.quant_matmul_skinny(x, w, bias))
        what = f"{qtype} M={m} swap={swap} split={split} (seed {gen.seed_value})"
        assert torch.equal(out[0], out[1]), what
        check(out[1], quant_linear_ref(x, w, bias), TOL[torch.bfloat16], gen, what)


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k"])
def test_paired_scales_change_nothing_but_the_layout(gen, qtype):
    """`quant.pair_scales` (the form GPUs keep q4_k/q5_k in) moves (sc, mn) and (d, dmin) into
    pairs: same bytes, same dequantized values, and every kernel gives the same bits."""
    n, k = 33, 512
    w = weight(gen, qtype, n, k)
    wp = quant.pair_scales(w)
    assert paired(wp.sc, wp.mn) and paired(wp.d, wp.m)
    assert not paired(w.sc, w.mn)
    assert quant.nbytes(wp) == quant.nbytes(w)
    assert torch.equal(dequantize(wp), dequantize(w))
    assert torch.equal(qt.dequantize_triton(wp), qt.dequantize_triton(w))
    for m, dtype, split, with_bias in CASES:
        x = gen.randn(m, k, dtype=dtype)
        with configs.use_config(SPLIT if split else SMALL):
            plain, pair = qt.quant_matmul_skinny(x, w), qt.quant_matmul_skinny(x, wp)
        assert torch.equal(plain, pair), f"{qtype} M={m} split={split} (seed {gen.seed_value})"
    rows = quant.permute_rows(wp, [3, 1, 2])  # row operations give back the plain layout
    assert not paired(rows.sc, rows.mn) and torch.equal(dequantize(rows), dequantize(w)[[3, 1, 2]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_skinny_matches_linear(gen, dtype):
    n, k = 33, 100  # K not a multiple of 32: masked elements inside the last group
    w = gen.randn(n, k, dtype=dtype) * 0.1
    bias = gen.randn(n, dtype=dtype)
    for m, _, split, with_bias in CASES:
        x = gen.randn(m, k, dtype=dtype)
        b = bias if with_bias else None
        with configs.use_config(SPLIT if split else SMALL):
            out = qt.dense_matmul_skinny(x, w, b)
        check(out, torch.nn.functional.linear(x, w, b), TOL[dtype], gen,
              f"dense M={m} split={split}")


def test_bf16_activations(gen):
    """bf16 dots run as fp32 in the interpreter; the multiply + sum path runs as on GPUs."""
    w = weight(gen, "q4_k", 7, 256)
    for m in (1, 3):
        x = gen.randn(m, 256, dtype=torch.bfloat16)
        with configs.use_config(SMALL):
            out = qt.quant_matmul_skinny(x, w)
        check(out, quant_linear_ref(gemv_input(x), w), TOL[torch.bfloat16], gen,
              f"bf16 q4_k M={m}")


def gemv_input(x):
    """What the kernel multiplies: up to `gemv_max_m` rows go through the int8 GEMV (x quantized
    per group)."""
    rows = x.numel() // x.shape[-1]
    return quantize_x_ref(x) if rows <= SMALL.gemv_max_m else x


@pytest.mark.parametrize("qtype", ["q4_0", "q4_k", "q6_k", "q8_0"])
def test_gemv_error_within_the_int8_bound(gen, qtype):
    """The one-row GEMV's only error beyond fp32 rounding is x's int8 rounding: at most half a
    step (max |x| of the group / 254) per element, so |y - y_exact| <= sum_k |w_k| * step_k / 2."""
    n, k = 9, 512
    w = weight(gen, qtype, n, k)
    x = gen.randn(1, k)
    with configs.use_config(SMALL):
        out = qt.quant_matmul_skinny(x, w).cpu()
    step = (x.cpu().reshape(-1, 32).abs().amax(1) / 127.0).repeat_interleave(32)
    bound = (dequantize(w).cpu().abs() * step / 2).sum(1) * (1 + 1e-5) + 1e-6
    err = (out - quant_linear_ref(x, w).cpu()).abs()[0]
    assert bool((err <= bound).all()), f"{qtype}: error {err.max():.3g} over bound (seed {gen.seed_value})"
    assert err.max() > 0  # x really went through int8 (a check that can fail on a float path)


@pytest.mark.parametrize("m", [1, 3])
def test_parts_write_one_output(gen, m, monkeypatch):
    """A projection stored as parts of different types (q4_k, q6_k, q8_0, q4_k) equals the
    concatenation of the parts' references, bias included; x is quantized once per layout (the
    4-bit planes and q8_0's group order), not once per part."""
    k, sizes = 512, [24, 8, 16, 9]
    ws = [weight(gen, q, n, k) for q, n in zip(["q4_k", "q6_k", "q8_0", "q4_k"], sizes)]
    bias = gen.randn(sum(sizes))
    x = gen.randn(m, k)
    calls = []
    quantize = quant_gemv.quantize_x
    monkeypatch.setattr(quant_gemv, "quantize_x",
                        lambda *a, **kw: calls.append(kw.get("planes")) or quantize(*a, **kw))
    with configs.use_config(SMALL):
        out = qt.quant_matmul_parts(x, ws, bias)
    ref = torch.cat([quant_linear_ref(gemv_input(x), w) for w in ws], dim=-1) + bias
    check(out, ref, TOL[torch.float32], gen, f"parts M={m}")
    assert calls == [True, False]


@pytest.mark.parametrize("types,sizes,min_programs", [
    (("q4_k", "q6_k"), (40, 8), 0),       # no split-K in either part
    (("q4_k", "q6_k"), (48, 16), 2),      # the short part splits K, the long one not
    (("q8_0", "q5_0"), (20, 12), 64)])    # both split K; two x layouts
def test_two_parts_in_one_launch_equal_two_launches(gen, types, sizes, min_programs,
                                                    monkeypatch):
    """One decode row over a projection of two types (a Q4_K_M file's q/k + v) runs as one
    `_gemv_pair_kernel` launch: bit for bit what one GEMV launch per part gives (each part
    keeps its own tiles, K-splits and sums), and the parts' reference within the int8 bound."""
    from dataclasses import replace
    k = 512
    cfg = replace(SMALL, gemv_split_min_programs=min_programs, gemv_min_tiles_per_split=1)
    ws = [weight(gen, q, n, k) for q, n in zip(types, sizes)]
    bias = gen.randn(sum(sizes))
    x = gen.randn(1, k)
    splits = [qt.skinny_split_k(cfg, -(-n // cfg.gemv_block_n), k // cfg.gemv_block_k,
                                gemv=True)[0] for n in sizes]
    assert (max(splits) > 1) == (min_programs > 0)
    real, single = quant_gemv.gemv, []
    monkeypatch.setattr(quant_gemv, "gemv", lambda *a, **kw: single.append(a[3]) or real(*a, **kw))
    with configs.use_config(cfg):
        pair = qt.quant_matmul_parts(x, ws, bias)
        assert single == []  # no per-part launch
        apart = torch.cat([qt.quant_matmul(x, w, bias[sum(sizes[:i]):sum(sizes[:i + 1])])
                           for i, w in enumerate(ws)], dim=-1)
    assert single == list(types)
    assert torch.equal(pair, apart)
    ref = torch.cat([quant_linear_ref(gemv_input(x), w) for w in ws], dim=-1) + bias
    check(pair, ref, TOL[torch.float32], gen, f"pair {types}")


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows_block_n", [0, 4])
def test_gemv_rows_equal_one_row_each(gen, qtype, rows_block_n):
    """The GEMV reads the weight once for several rows of x, and each row's result is the bits
    that row gives alone: a verify step's rows equal the decode steps they stand for. Rows go in
    launches of `gemv_rows_per_launch` (2 here: 5 rows are 2 + 2 + 1), with and without split-K,
    and with a block_n of their own (`gemv_rows_block_n` 4 against one row's 16: 3 programs
    along N where one row has 1, which must not change how K is split: with
    `gemv_split_min_programs` 3 one row splits K in 3, and so must the rows)."""
    k = 512 if qtype.endswith("_k") else 160
    w = weight(gen, qtype, 9, k)
    bias = gen.randn(9)
    x = gen.randn(5, k)
    three = KernelConfig(**{**SMALL.__dict__, "gemv_split_min_programs": 3})
    for base in (SMALL, SPLIT, three):
        cfg = KernelConfig(**{**base.__dict__, "gemv_rows_per_launch": 2,
                              "gemv_rows_block_n": rows_block_n})
        with configs.use_config(cfg):
            rows = qt.quant_matmul_skinny(x, w, bias)
            alone = torch.cat([qt.quant_matmul_skinny(x[i:i + 1], w, bias) for i in range(5)])
        assert torch.equal(rows, alone), \
            f"{qtype} {base.gemv_split_min_programs} rows_block_n={rows_block_n} (seed {gen.seed_value})"
        check(rows, quant_linear_ref(quantize_x_ref(x), w, bias), TOL[torch.float32], gen,
              f"{qtype} 5 rows")


def test_row_blocks():
    """Rows padded to a power of two, or with `gemv_row_blocks` 2 in two blocks where that pads
    less (7 stays 8)."""
    assert [quant_gemv.row_blocks(m, 1) for m in (1, 2, 3, 5, 6, 7, 8)] == \
        [(1, 0), (2, 0), (4, 0), (8, 0), (8, 0), (8, 0), (8, 0)]
    assert [quant_gemv.row_blocks(m, 2) for m in (1, 2, 3, 4, 5, 6, 7, 8)] == \
        [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (8, 0), (8, 0)]
    assert quant_gemv.row_blocks(12, 2) == (8, 4)


@pytest.mark.parametrize("qtype", QTYPES)
def test_gemv_row_blocks_equal_one_row_each(gen, qtype, monkeypatch):
    """Rows in two blocks (`gemv_row_blocks` 2: 3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2; 7 padded to 8)
    give each row the bits it gives alone, with and without split-K and the rows' prefetch, and
    the launch really takes those blocks."""
    k = 512 if qtype.endswith("_k") else 160
    w = weight(gen, qtype, 9, k)
    bias = gen.randn(9)
    x = gen.randn(7, k)
    blocks = []
    real = quant_gemv.row_blocks
    monkeypatch.setattr(quant_gemv, "row_blocks",
                        lambda rows, most: blocks.append(real(rows, most)) or blocks[-1])
    for base, prefetch in ((SMALL, True), (SPLIT, True), (SMALL, False)):
        cfg = KernelConfig(**{**base.__dict__, "gemv_row_blocks": 2,
                              "gemv_rows_prefetch": prefetch})
        with configs.use_config(cfg):
            alone = torch.cat([qt.quant_matmul_skinny(x[i:i + 1], w, bias) for i in range(7)])
            for m in (3, 5, 6, 7):
                blocks.clear()
                rows = qt.quant_matmul_skinny(x[:m], w, bias)
                assert blocks == [real(m, 2)]
                assert (blocks[0][1] > 0 and sum(blocks[0]) == m) if m < 7 else blocks[0] == (8, 0)
                assert torch.equal(rows, alone[:m]), \
                    f"{qtype} {m} rows split={base is SPLIT} prefetch={prefetch} " \
                    f"(seed {gen.seed_value})"


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_triton_is_exact(gen, qtype):
    k = 512 if qtype.endswith("_k") else 160
    w = weight(gen, qtype, 11, k)
    ref = dequantize(w)
    with configs.use_config(SMALL):
        assert torch.equal(qt.dequantize_triton(w), ref), f"{qtype} fp32 (seed {gen.seed_value})"
        assert torch.equal(qt.dequantize_triton(w, torch.float16), ref.half()), \
            f"{qtype} fp16 (seed {gen.seed_value})"


def test_quant_matmul_routes_by_rows(gen, monkeypatch):
    """Up to skinny_max_m rows: the skinny kernel; more: dequantize + torch GEMM. Leading dims
    and `out=` are kept on both paths."""
    w = weight(gen, "q5_1", 7, 96)
    bias = gen.randn(7)
    calls = []
    skinny = qt.quant_matmul_skinny
    monkeypatch.setattr(qt, "quant_matmul_skinny", lambda *a: calls.append(1) or skinny(*a))
    cfg = KernelConfig(**{**SMALL.__dict__, "skinny_max_m": 4})
    for lead, expect_skinny in (((2, 2), True), ((5,), False), ((3, 7), False)):
        x = gen.randn(*lead, 96)
        out = torch.empty(*lead, 7, device=DEVICE)
        calls.clear()
        with configs.use_config(cfg):
            got = qt.quant_matmul(x, w, bias, out=out)
        assert got is out and bool(calls) == expect_skinny, f"{lead}: skinny={bool(calls)}"
        ref = quant_linear_ref(gemv_input(x) if expect_skinny else x, w, bias)
        check(out, ref, TOL[torch.float32], gen, f"x {list(lead)}")


def test_rows_past_16_and_the_q6_k_bound(gen, monkeypatch):
    """17..32 rows run the skinny tl.dot with M padded to 32 (`skinny_max_m` up to 32);
    `skinny_max_m_q6_k` bounds q6_k weights alone (their dot tile lost to the dequantized copy
    at 9-16 rows on an H200), fused projections included (a part past its bound goes alone)."""
    calls = []
    skinny = qt.quant_matmul_skinny
    monkeypatch.setattr(qt, "quant_matmul_skinny", lambda *a: calls.append(a[1].qtype)
                        or skinny(*a))
    w5, w6 = weight(gen, "q5_1", 7, 96), weight(gen, "q6_k", 9, 256)
    cfg = KernelConfig(**{**SMALL.__dict__, "skinny_max_m": 24, "skinny_max_m_q6_k": 3})
    with configs.use_config(cfg):
        assert qt.skinny_rows(cfg, "q6_k") == 3 and qt.skinny_rows(cfg, "q5_1") == 24
        for rows, expect in ((20, ["q5_1"]), (25, [])):
            x = gen.randn(rows, 96)
            calls.clear()
            check(qt.quant_matmul(x, w5), quant_linear_ref(x, w5), TOL[torch.float32], gen,
                  f"q5_1 {rows} rows")
            assert calls == expect, rows
        for rows, expect in ((3, ["q6_k"]), (4, [])):
            x = gen.randn(rows, 256)
            calls.clear()
            check(qt.quant_matmul(x, w6), quant_linear_ref(gemv_input(x) if expect else x, w6),
                  TOL[torch.float32], gen, f"q6_k {rows} rows")
            assert calls == expect, rows
        w5b = weight(gen, "q5_1", 5, 256)
        for rows, expect in ((3, []), (4, ["q5_1"])):  # the fused path calls _skinny itself
            x = gen.randn(rows, 256)
            calls.clear()
            got = qt.quant_matmul_parts(x, [w5b, w6])
            ref = torch.cat([quant_linear_ref(x, w5b), quant_linear_ref(x, w6)], -1)
            assert calls == expect and got.shape == (rows, 14), (rows, calls)
            check(got, ref, dict(atol=2e-2, rtol=2e-2), gen, f"parts {rows} rows")  # int8 x


def test_linear_dispatch_goes_to_triton(gen, monkeypatch):
    import luceio.kernels as K
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    called = []
    orig = qt.quant_matmul
    monkeypatch.setattr(qt, "quant_matmul", lambda *a, **kw: called.append(1) or orig(*a, **kw))
    w = weight(gen, "q8_0", 7, 64)
    x = gen.randn(2, 64)
    with configs.use_config(SMALL):
        check(K.linear(x, w), quant_linear_ref(gemv_input(x), w), TOL[torch.float32], gen,
              "dispatch")
    assert called


def test_split_k_choice():
    cfg = KernelConfig(qgemm_split_k_min_programs=264, qgemm_max_split_k=16,
                       qgemm_min_tiles_per_split=2)
    split = qt.skinny_split_k
    assert split(cfg, 128, 16) == (3, 6)        # 4096 features / 32: ~2 waves on 132 SMs
    assert split(cfg, 300, 16) == (1, 16)       # N alone fills the GPU
    assert split(cfg, 28, 19) == (7, 3)         # 896 features: at least 2 tiles a split
    assert split(cfg, 1, 1000) == (16, 63)      # capped by qgemm_max_split_k
    assert split(cfg, 1, 1) == (1, 1)
    for n_prog, tiles in ((28, 19), (5, 7), (1, 1000), (3, 33)):
        s, t = split(cfg, n_prog, tiles)
        assert (s - 1) * t < tiles <= s * t     # every split has work, all tiles covered
    # the one-row GEMV has its own fields; the qgemm ones do not move it
    g = KernelConfig(qgemm_split_k_min_programs=0, gemv_split_min_programs=4096,
                     gemv_min_tiles_per_split=1, qgemm_max_split_k=16)
    assert split(g, 1024, 14) == (1, 14)
    assert split(g, 1024, 14, gemv=True) == (4, 4)    # 8B down: 4 warps of work per row block
    assert split(g, 1152, 4, gemv=True) == (4, 1)     # short K: one tile a split
    assert split(g, 9472, 4, gemv=True) == (1, 4)     # gate_up alone fills the GPU


def test_config_table_qgemm_fields():
    for arch, cfg in configs.TABLE.items():
        assert cfg.qgemm_block_k >= 32 and cfg.qgemm_block_k & (cfg.qgemm_block_k - 1) == 0, arch
        assert cfg.dequant_block_k >= 32 and cfg.dequant_block_k & (cfg.dequant_block_k - 1) == 0
        assert cfg.gemv_block_k >= 32 and cfg.gemv_block_k & (cfg.gemv_block_k - 1) == 0, arch
        assert 1 <= cfg.skinny_max_m <= 32 and 0 <= cfg.skinny_max_m_q6_k <= 32, arch
