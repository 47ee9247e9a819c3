"""The int4pack CPU path (kernels/quant_cpu.py `pack_int4`, what runs without numba) against
the fp32 reference `F.linear(x, dequantize(w))`, for every qtype, on weights built by
`repack_gguf` from GGUF blocks: gguf's own quantizer on N(0, 0.02) weights for the 32-element
types, random blocks with realistic fp16 scales for the k-quants. N odd (a 16-row tail block),
K = 512; M = 1 and 4 run the packed kernel, M = 80 the dense path, M = 33 the packed kernel
for the one-plane types (4-bit) and the dense path for the two-plane ones (`DENSE_MIN_ROWS`).

Tolerances: the mapping onto int4 planes is exact in exact arithmetic, so the error is the bf16
rounding of the activations, of each group's scale and zero, and of the output (dense path: also
of the dequantized weight), each at most 2^-9 relative. Elementwise that bounds |y - ref| by
2^-9 (|x| @ (2|W| + A)^T + |ref|), A the sum over planes of |code - 8| |scale| + |zero| (the
worst element measured used 0.21 of it); over a whole output the relative error measured 3.2e-3
to 4.1e-3 (q5_1's zeros round the most), held to 1e-2. A wrong plane factor (the negative
control) breaks both by far.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from luceio.kernels import int4pack_cpu, quant_cpu as qc
from luceio.kernels.quant import QTYPES, dequantize, repack_gguf

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize as gguf_quantize  # noqa: E402

K_QUANT_FP16 = {"q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}
"""Byte offsets of the fp16 fields (d, dmin) inside one k-quant block."""
REL_TOL = 1e-2


def random_weight(qtype: str, n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ggml_type = gguf.GGMLQuantizationType[qtype.upper()]
    if qtype in K_QUANT_FP16:
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
        for offset in K_QUANT_FP16[qtype]:
            d = rng.uniform(1e-4, 1e-3, len(blocks)).astype(np.float16)
            blocks[:, offset:offset + 2] = d.view(np.uint8).reshape(-1, 2)
        data = blocks.reshape(n, -1)
    else:
        data = gguf_quantize((rng.standard_normal((n, k)) * 0.02).astype(np.float32), ggml_type)
    return repack_gguf(data, ggml_type, (n, k))


def plane_magnitude(w) -> torch.Tensor:
    """A [N, K]: the sum over planes of factor * (|code - 8| |scale| + |zero|), the size of what
    the bf16 roundings of scale and zero act on."""
    n, k = w.shape
    codes, scale, zero = qc._planes(w)
    chunk, factors = qc._PLANE_LAYOUT[w.qtype]
    mag = (codes.float() - 8).abs().view(n, -1, 32) * scale.abs()[..., None] + zero.abs()[..., None]
    mag = mag.view(n, k // chunk, len(factors), chunk) * torch.tensor(factors).view(-1, 1)
    return mag.sum(2).view(n, k)


def check(y: torch.Tensor, x: torch.Tensor, w, what: str) -> None:
    ref_w = dequantize(w)
    ref = F.linear(x.float(), ref_w)
    y = y.float()
    assert y.shape == ref.shape, what
    rel = ((y - ref).norm() / ref.norm()).item()
    assert rel < REL_TOL, f"{what}: relative error {rel:.3g}"
    magnitude = 2 * ref_w.abs() + plane_magnitude(w)
    bound = 2.0 ** -9 * (x.float().abs() @ magnitude.t() + ref.abs()) * 1.01 + 1e-6
    excess = ((y - ref).abs() / bound).max().item()
    assert excess <= 1, f"{what}: error {excess:.3g} times the rounding bound"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 4, 33, 80])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_matches_dequantized_reference(qtype, m, out_dtype):
    n, k = 203, 512
    w = random_weight(qtype, n, k, seed=m)
    packed = qc.pack_int4(w, out_dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(out_dtype)
    y = qc.cpu_quant_linear(x, packed)
    assert y.dtype == out_dtype
    check(y, x, w, f"{qtype} M={m} {out_dtype}")


def test_bias_and_small_n():
    w = random_weight("q5_0", 7, 64)
    packed = qc.pack_int4(w, torch.float32)
    x = torch.randn(3, 64)
    bias = torch.randn(7)
    y = qc.cpu_quant_linear(x, packed, bias)
    check(y - bias, x, w, "q5_0 N=7 with bias")


@pytest.mark.parametrize("factors", [(1, 8), (1, 32)])
def test_negative_control_wrong_plane_factor(factors):
    """The checks above must fail when the high plane is weighted wrongly."""
    w = random_weight("q8_0", 203, 512)
    good = qc.pack_int4(w, torch.float32)
    bad = qc.CpuPacked(good.qtype, good.shape, good.packed, good.scales_zeros, good.chunk,
                       factors, good.out_dtype)
    x = torch.randn(4, 512)
    with pytest.raises(AssertionError):
        check(qc.cpu_quant_linear(x, bad), x, w, "wrong factor")


def test_routes_by_rows(monkeypatch):
    """Small M runs the packed kernel, M >= DENSE_MIN_ROWS[planes] the dense path."""
    calls = []
    dense = qc._dense_linear
    monkeypatch.setattr(qc, "_dense_linear", lambda x, w: calls.append(x.shape[0]) or dense(x, w))
    for qtype in ("q4_0", "q5_0"):
        packed = qc.pack_int4(random_weight(qtype, 64, 64), torch.float32)
        threshold = qc.DENSE_MIN_ROWS[packed.planes]
        for m in (1, threshold - 1, threshold):
            qc.cpu_quant_linear(torch.randn(m, 64), packed)
    assert calls == [qc.DENSE_MIN_ROWS[1], qc.DENSE_MIN_ROWS[2]]


def test_nbytes_and_row_chunks(monkeypatch):
    """5 bits per weight and plane (4-bit code, bf16 scale and zero per 32), rows padded to 16;
    packing in row chunks (a multiple of the 64-row block) gives the same bytes."""
    w = random_weight("q6_k", 203, 512)
    whole = qc.pack_int4(w)
    assert whole.nbytes == 208 * 512 * whole.planes * 5 // 8
    monkeypatch.setattr(qc, "PACK_ROWS", 64)
    chunked = qc.pack_int4(w)
    assert torch.equal(whole.packed, chunked.packed)
    assert torch.equal(whole.scales_zeros, chunked.scales_zeros)


def pack_like_torch(codes: np.ndarray, block_n: int, halves: bool) -> np.ndarray:
    """The int4pack layouts int4pack_cpu.py's docstring describes, written independently."""
    n, k = codes.shape
    out = []
    for n0 in range(0, n, block_n):
        block = codes[n0:n0 + block_n]
        size = len(block)
        if size == block_n and halves:
            lo, hi = block[:size // 2], block[size // 2:]
        else:
            lo, hi = block[0::2], block[1::2]
        out.append((lo | (hi << 4)).T.astype(np.uint8).reshape(-1))  # [K, size / 2]
    return np.concatenate(out)


@pytest.mark.parametrize("block_n,halves", [(64, True), (32, True), (32, False)])
@pytest.mark.parametrize("chunk,factors", [(32, (1,)), (32, (1, 16)), (16, (1, 8))])
def test_dequantizer_reads_every_layout(block_n, halves, chunk, factors):
    rng = np.random.default_rng(1)
    n, k = 176, 64
    planes = len(factors)
    codes = rng.integers(0, 16, (n, planes * k), dtype=np.uint8)
    scale = rng.uniform(-1, 1, (k // chunk, n)).astype(np.float32)
    zero = rng.uniform(-1, 1, (k // chunk, n)).astype(np.float32)
    # W[n, k] = (sum over planes of factor * code) * scale + zero of k's chunk; plane p of
    # chunk c sits at K' = (c * planes + p) * chunk + i
    q = codes.reshape(n, k // chunk, planes, chunk).astype(np.int64)
    q = (q * np.asarray(factors)[:, None]).sum(2).reshape(n, k)
    deq = q * np.repeat(scale.T, chunk, axis=1) + np.repeat(zero.T, chunk, axis=1)
    expected = torch.from_numpy(deq.T.astype(np.float32)).to(torch.bfloat16)
    layout = (block_n, halves)
    tiles = []
    for a, b in int4pack_cpu.tiles(n, layout, 64):
        tiles.append(torch.empty(k, b - a, dtype=torch.bfloat16))
        int4pack_cpu.dequantize_t(pack_like_torch(codes, block_n, halves), scale, zero, chunk, factors,
                         layout, a, b, tiles[-1])
    torch.testing.assert_close(torch.cat(tiles, dim=1).float(), expected.float(), rtol=2 ** -8,
                               atol=1e-6)


def test_torch_packs_a_known_layout():
    """If torch changes its int4pack layout, the dense (prefill) path would switch off: fail."""
    assert int4pack_cpu.layout() in ((64, True), (32, True), (32, False), (64, False))
