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


@pytest.mark.parametrize("nq,nkv,hd,k,bias", [(14, 2, 64, 896, True), (32, 8, 128, 4096, False)])
def test_norm_and_rope_fused_native(seed, nq, nkv, hd, k, bias):
    """Norm in the loads and RoPE + KV write in the epilogue, compiled at real shapes: q and
    the caches bit for bit the GEMV's (with the same fused norm) followed by the RoPE kernel;
    the fused norm's output as linear(rms_norm(...)) to rounding."""
    from luceio.kernels import build_cos_sin_cache, qkv_rope_cache, rms_norm
    n = (nq + 2 * nkv) * hd
    w = (torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16)
    b = (torch.randn(n, device=DEV) * 0.1).to(torch.bfloat16) if bias else None
    x, res = (torch.randn(1, k, device=DEV).to(torch.bfloat16) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, device=DEV)).to(torch.bfloat16)
    cos_sin = build_cos_sin_cache(hd, 4096, 1e6, None).to(DEV)
    pos, slots = torch.tensor([3000], device=DEV), torch.tensor([37], device=DEV)
    caches = [[torch.zeros(8, 16, nkv, hd, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
              for _ in range(2)]
    with configs.use_config(_cfg()):
        q, r = dense_gemv(x, w, b, norm=(nw, 1e-6, res),
                          rope=(pos, cos_sin, *caches[0], slots, nq, nkv))
        qkv, r_ref = dense_gemv(x, w, b, norm=(nw, 1e-6, res))
        q_ref = qkv_rope_cache(qkv, pos, cos_sin, *caches[1], slots, nq, nkv)
        h, r2 = rms_norm(x, nw, 1e-6, res)
        unfused = dense_gemv(h, w, b).float()
    assert torch.equal(q, q_ref) and torch.equal(r, r_ref) and torch.equal(r, r2), f"seed {seed}"
    for a, e in zip(caches[0], caches[1]):
        assert torch.equal(a, e), f"seed {seed}"
    assert caches[0][0][2, 5].abs().sum() > 0  # slot 37 = block 2, offset 5
    torch.testing.assert_close(qkv.float(), unfused, rtol=2e-2,
                               atol=2e-2 * unfused.abs().max().item(), msg=lambda e: f"seed {seed}: {e}")


@pytest.mark.parametrize("k,n,glu", [(896, 896, False), (4864, 896, True), (4096, 4096, False),
                                     (14336, 4096, True)])
def test_add_epilogue_native(seed, k, n, glu):
    """The residual add and sums of squares in the o / down GEMV's epilogue at real shapes
    (0.5B and 8B), compiled: h bit for bit the residual the norm kernel hands on, the sums
    the row's, and the norm + gate/up-sized GEMV after it (`ss=`) as the unfused norm and
    GEMV to rounding."""
    from luceio.kernels import rms_norm, silu_and_mul
    x = torch.randn(1, 2 * k if glu else k, device=DEV).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16)
    res = torch.randn(1, n, device=DEV).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(n, device=DEV)).to(torch.bfloat16)
    w2 = (torch.randn(2048, n, device=DEV) * n ** -0.5).to(torch.bfloat16)
    with configs.use_config(_cfg()):
        h, ss = dense_gemv(x, w, add=res, glu=glu)
        y = dense_gemv(silu_and_mul(x), w) if glu else dense_gemv(x, w)
        normed, r = rms_norm(y, nw, 1e-6, res)
        z, r2 = dense_gemv(h, w2, norm=(nw, 1e-6, None), ss=ss)
        unfused = dense_gemv(normed, w2).float()
    assert torch.equal(h, r) and r2 is h, f"seed {seed}"
    torch.testing.assert_close(ss.sum(-1), h.float().pow(2).sum(-1), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(z.float(), unfused, rtol=2e-2, atol=2e-2 * unfused.abs().max().item(),
                               msg=lambda e: f"seed {seed}: {e}")


def test_current_stream_is_torchs():
    """`memory.current_stream` answers what torch.cuda.current_stream does, in and out of a
    stream context."""
    from luceio.memory import current_stream
    assert current_stream(DEV) == torch.cuda.current_stream(DEV)
    side = torch.cuda.Stream(DEV)
    with torch.cuda.stream(side):
        assert current_stream(DEV) == side == torch.cuda.current_stream(DEV)
    assert current_stream(torch.device("cuda", 0)) == torch.cuda.current_stream(0)
