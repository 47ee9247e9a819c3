"""16-bit dense weights kept by an fp32 CPU model (luceio/kernels/half_cpu.py): the kernel
against exact products, the prefill tiles against torch's fp32 matmul, and a bf16 / fp16
checkpoint decoding what the same values in fp32 decode, at half the bytes."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from conftest import engine_kwargs, make_tiny_model, random_prompts, save_tiny, seed_for
from luceio import LLM
from luceio.kernels import half_cpu
from luceio.kernels.quant_cpu import prefill_rows

pytest.importorskip("numba")
DTYPES = [torch.bfloat16, torch.float16]


def _exact(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ w^T in float64, and the bound of fp32 summation on it (|x| @ |w|^T times K eps)."""
    ref = x.double() @ w.double().T
    return ref, (x.abs().double() @ w.abs().double().T) * (x.shape[1] * 2 ** -23)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,m", [(37, 45, 1), (8, 64, 3), (13, 7, 5), (4, 576, 2), (130, 96, 1)])
def test_matvec_equals_exact_products(request, dtype, n, k, m):
    """Blocks of 4 rows and a tail of 1-3, odd K, several activation rows, into a column slice
    of a wider output (one part of a fused projection) that is left alone elsewhere."""
    g = torch.Generator().manual_seed(seed_for(request))
    w = (torch.randn(n, k, generator=g) * 3).to(dtype)
    x = torch.randn(m, k, generator=g)
    out = np.full((m, n + 7), 7.0, np.float32)
    ref, bound = _exact(x, w)
    for prefill in (False, True):  # the decode kernel, the prefill one
        out[:] = 7
        half_cpu.matvec(x.numpy(), half_cpu.prepare(w), out[:, 3:3 + n], prefill)
        assert bool(((torch.from_numpy(out[:, 3:3 + n]).double() - ref).abs() <= bound).all())
        assert (out[:, :3] == 7).all() and (out[:, 3 + n:] == 7).all()


def test_matvec_reads_each_type_as_its_own():
    """Negative control: bf16 bits read as fp16 (or the reverse) give other numbers, so the
    test above checks the widening of each type."""
    w = torch.randn(8, 64).to(torch.bfloat16)
    x = torch.randn(1, 64)
    wrong = half_cpu.CpuHalf("float16", w, w.view(torch.int16).numpy())
    out = np.zeros((1, 8), np.float32)
    half_cpu.matvec(x.numpy(), wrong, out)
    ref, bound = _exact(x, w)
    assert bool(((torch.from_numpy(out).double() - ref).abs() > bound).any())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefill", [False, True])
def test_linear_rows_do_not_depend_on_their_call(dtype, prefill):
    """`linear` gives torch's fp32 matmul on the widened weight to fp32 rounding, plus the
    bias; each row of x gets the same bits alone as in a call of 5 or 7 rows in a decode step,
    or of 40 in a prefill step (a prompt's hidden states do not depend on its chunking, a
    decode row's on a small batch)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(102, 64, generator=g).to(dtype)  # 25 blocks of 4 rows and a tail
    bias = torch.randn(102, generator=g)
    p = half_cpu.prepare(w)
    x = torch.randn(40 if prefill else half_cpu.BLOCK_MIN_ROWS - 1, 64, generator=g)
    with prefill_rows() if prefill else contextlib.nullcontext():
        got = half_cpu.linear(x, p, bias)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w.float(), bias),
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(half_cpu.linear(x[1:6], p, bias), got[1:6])
        assert torch.equal(half_cpu.linear(x[-1:], p, bias), got[-1:])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (fp32 checkpoint, bf16 one, fp16 one) of the same values (all fp16- and
    bf16-representable: the weights rounded to bf16, then to fp16 where that is exact too)."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("half")
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        src = make_tiny_model(str(root / f"{arch}_src"), arch, seed=11)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():  # bf16 values with few mantissa bits fit fp16 too
                p.copy_(p.to(torch.bfloat16).to(torch.float16).float())
        paths = []
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            path = str(root / f"{arch}_{str(dtype)[6:]}")
            save_tiny(model.to(dtype), path)
            paths.append(path)
        out[arch] = paths
    return out


def test_values_fit_both_types(checkpoints):
    """The fixture's premise: its bf16 and fp16 checkpoints hold the fp32 one's values."""
    from safetensors.torch import load_file
    f32, b16, h16 = (load_file(f"{p}/model.safetensors") for p in checkpoints["qwen3"])
    for name, value in f32.items():
        assert torch.equal(b16[name].float(), value) and torch.equal(h16[name].float(), value)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("which", [1, 2])  # bf16, fp16
def test_half_checkpoint_decodes_as_fp32(checkpoints, arch, which):
    """An fp32 engine on a bf16 / fp16 checkpoint keeps its projections and embedding in 16
    bits (tied heads reading the embedding's table) and decodes the fp32 checkpoint's greedy
    tokens with its logprobs within 1e-5: batched, chunked prefill, the CPU decode path."""
    from conftest import assert_same_model
    f32, half = checkpoints[arch][0], checkpoints[arch][which]
    engine = LLM(half, **engine_kwargs()).engine
    model = engine.runner.model
    dense = LLM(f32, **engine_kwargs()).engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert len(qkv.parts) == 1 and isinstance(qkv.parts[0], half_cpu.CpuHalf)
    assert engine.runner.cpu_decoder.layers[0].qkv.parts  # the decode step's kernel
    assert model.embed_tokens.weight.dtype == (torch.bfloat16, torch.float16)[which - 1]
    if model.cfg.tie_word_embeddings:
        assert model.lm_head.parts[0].tensor.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert model.weight_bytes() < 0.6 * dense.weight_bytes()
    prompts = random_prompts(5, seed=which) + [list(range(3, 90))]
    assert_same_model((f32, half), prompts, max_tokens=12, max_num_batched_tokens=32)


def test_reference_kernels_keep_fp32(checkpoints, monkeypatch):
    """`LUCEIO_KERNELS=torch` (the references) and a bf16 model keep today's weights."""
    monkeypatch.setenv("LUCEIO_KERNELS", "torch")
    model = LLM(checkpoints["llama"][1], **engine_kwargs()).engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    monkeypatch.delenv("LUCEIO_KERNELS")
    model = LLM(checkpoints["llama"][1], **engine_kwargs(dtype="bfloat16")).engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert not model.layers[0].self_attn.qkv_proj.parts


def test_gguf_half_matrices_stay_16_bit(tmp_path):
    """A GGUF's F16 matrices come out as fp16 tensors (norms and vectors fp32) when the engine
    keeps the file's types, with the values of the plain (fp32) read."""
    pytest.importorskip("gguf")
    from test_gguf import _write_gguf

    from luceio.loader import load_checkpoint
    path = tmp_path / "h.gguf"
    _write_gguf(path, "llama")
    ckpt = load_checkpoint(str(path))
    plain = dict(ckpt.weights())
    kept = dict(ckpt.weights(keep_quantized=True))
    assert kept.keys() == plain.keys()
    for name, value in kept.items():
        assert value.dtype == (torch.float16 if value.dim() == 2 else torch.float32), name
        assert torch.equal(value.float(), plain[name]), name
