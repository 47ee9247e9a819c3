"""The repacked quantized format on the GPU equals the CPU bit for bit: `dequantize` (the GPU's
large-M scratch path) and `quantize_rtn` (HF weights quantized at load, on whichever device holds
them). The CPU side is checked against gguf and llama.cpp in tests/test_quant_format.py."""
from __future__ import annotations

import pytest
import torch

from luceio.kernels.quant import (LAYOUT, QTYPES, QuantWeight, cat_rows, dequantize, permute_rows,
                                  quantize_rtn)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def random_weight(qtype: str, n: int, k: int, seed: int) -> QuantWeight:
    """Random bytes in every array; fp16 fields keep any finite bit pattern (subnormals too)."""
    g = torch.Generator().manual_seed(seed)
    arrays = {}
    for name, (dtype, per) in LAYOUT[qtype].items():
        bits = torch.randint(0, 1 << 16, (n, k // per), generator=g, dtype=torch.int32)
        if dtype == torch.float16:
            bits = torch.where((bits & 0x7C00) == 0x7C00, bits ^ 0x4000, bits)  # no inf/NaN
            arrays[name] = bits.to(torch.int16).view(torch.float16)
        else:
            arrays[name] = (bits & 0xFF).to(torch.uint8).view(dtype)
    return QuantWeight(qtype, (n, k), **arrays)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.int32)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_on_gpu_equals_cpu(qtype):
    w = random_weight(qtype, 333, 4096, seed=0)
    cpu = dequantize(w)
    on_gpu = w.to("cuda")
    assert all(t.is_cuda for t in on_gpu.tensors().values())
    assert torch.equal(bits(dequantize(on_gpu)), bits(cpu))
    index = torch.randperm(666, generator=torch.Generator().manual_seed(1))
    rows = permute_rows(cat_rows([on_gpu, on_gpu]), index.cuda())
    assert torch.equal(bits(dequantize(rows)), bits(torch.cat([cpu, cpu])[index]))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rtn_on_gpu_equals_cpu(mode, dtype):
    g = torch.Generator().manual_seed(2)
    weight = (torch.randn(4096, 4096, generator=g) * torch.logspace(-3, 1, 4096)[:, None]).to(dtype)
    cpu, gpu = quantize_rtn(weight, mode), quantize_rtn(weight.cuda(), mode)
    assert gpu.qs.is_cuda
    for name, t in cpu.tensors().items():
        assert torch.equal(gpu.tensors()[name].cpu().view(torch.uint8), t.view(torch.uint8)), name
