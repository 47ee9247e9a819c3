"""The dense GEMV of decode steps (kernels/dense_gemv.py) compiled on a real GPU in bf16 at
real shapes (Qwen2.5-0.5B's qkv with bias and its fused SiLU + down, Llama-3.1-8B's o and
down), with the arch's own config: against the fp32 product (atol 2e-2 x max |y|, rtol
1e-2), rows equal to each row alone bit for bit, the GLU input equal to the SiLU kernel's
output bit for bit. Inputs are fresh random each run; the seed is in every message."""
from __future__ import annotations

import dataclasses
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

from luceio.kernels import configs, silu_and_mul  # noqa: E402
from luceio.kernels.dense_gemv import dense_gemv, dense_gemv_ref  # noqa: E402

DEV = torch.device("cuda")
CASES = [(1152, 896, True, False), (896, 4864, False, True), (4096, 4096, False, False),
         (4096, 14336, False, True)]


@pytest.fixture
def seed():
    value = int(os.environ.get("LUCEIO_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(value)
    return value


def _cfg():
    return dataclasses.replace(configs.get_config(DEV), dense_gemv_max_m=8)


@pytest.mark.parametrize("n,k,bias,glu", CASES)
def test_dense_gemv_native(seed, n, k, bias, glu):
    w = (torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16)
    b = (torch.randn(n, device=DEV) * 0.1).to(torch.bfloat16) if bias else None
    x = torch.randn(4, 2 * k if glu else k, device=DEV).to(torch.bfloat16)
    with configs.use_config(_cfg()):
        out = dense_gemv(x, w, b, glu=glu)
        ref = dense_gemv_ref(x, w, b, glu=glu).float()
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=2e-2 * ref.abs().max().item(),
                                   msg=lambda e: f"seed {seed} [{n}, {k}]: {e}")
        for i in range(4):
            assert torch.equal(dense_gemv(x[i:i + 1], w, b, glu=glu), out[i:i + 1]), \
                f"seed {seed} [{n}, {k}] row {i} differs from the row alone"
        if glu:
            assert torch.equal(dense_gemv(silu_and_mul(x), w, b), out), f"seed {seed}"
