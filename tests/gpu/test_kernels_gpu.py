"""Triton kernels vs the torch references on a real GPU (CUDA or ROCm), bf16 and fp16, at
realistic sizes: 8K contexts, head_dim 128, GQA 7 (28 q / 4 kv heads) and 4 (32 / 8).

Attention is compared with the reference run in fp32 on the same (rounded) inputs:
  bf16: atol 1e-2, rtol 1e-2      fp16: atol 2e-3, rtol 2e-3
Elementwise kernels are compared with the reference in the same dtype:
  bf16: atol 2e-2, rtol 1e-2 (one or two bf16 ulps)      fp16: atol 2e-3, rtol 2e-3
write_kv must match exactly. The fused MoE kernel is compared in bf16 with the reference in
bf16 (atol 2e-2, rtol 2e-2: a token's k rows are rounded once where the reference rounds after
each add), and both with the reference in fp32 on the same inputs: the kernel's error may not
exceed 1.5x the bf16 reference's. Inputs are fresh random each run; the seed is in every message.
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

import luceio.kernels as K  # noqa: E402
from luceio.kernels import attention_triton, configs, triton_ops  # noqa: E402
from luceio.kernels.activation import silu_and_mul_ref  # noqa: E402
from luceio.kernels.attention import paged_attention_ref, write_kv_ref  # noqa: E402
from luceio.kernels.moe import fused_moe_ref, route_topk_ref  # noqa: E402
from luceio.kernels.norm import rms_norm_ref  # noqa: E402
from luceio.kernels.rotary import build_cos_sin_cache, rotary_ref  # noqa: E402

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16]
ATTN_TOL = {torch.bfloat16: dict(atol=1e-2, rtol=1e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=1e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}
HEADS = [(28, 4), (32, 8)]  # GQA 7 and 4


@pytest.fixture
def seed():
    s = int(os.environ.get("LUCEIO_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(s)
    return s


def check(out, ref, tol, seed, what):
    err = (out.float() - ref.float()).abs().max().item()
    assert torch.allclose(out.float(), ref.float(), **tol), \
        f"{what}: max abs err {err:.3g} (seed {seed})"


def make_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16):
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 8
    perm = torch.randperm(num_blocks, device=DEV)
    bt = torch.randint(0, num_blocks, (len(seq_lens), max(pages) + 2), device=DEV)
    used = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[used:used + n]
        used += n
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=DEV).to(dtype)
    vc = torch.randn_like(kc)
    q = (torch.randn(sum(q_lens), num_heads, head_dim, device=DEV) * 2).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    return (q, kc, vc, bt.int(), torch.tensor(seq_lens, dtype=torch.int32, device=DEV), qsl,
            max(q_lens), max(seq_lens), head_dim ** -0.5)


def fp32_ref(args):
    q, kc, vc, *rest = args
    return paged_attention_ref(q.float(), kc.float(), vc.float(), *rest)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_decode_8k(seed, dtype, heads):
    ctx = [8191, 8000, 5000, 1, 17, 3000, 129, 7777]
    args = make_batch([1] * len(ctx), ctx, *heads, 128, dtype)
    cfg = configs.get_config(args[0].device)
    splits, _ = attention_triton.decode_splits(cfg, len(ctx), heads[1], args[7],
                                               configs.num_sms(args[0].device), cfg.decode_block_n)
    out = triton_ops.paged_attention(*args)
    check(out, fp32_ref(args), ATTN_TOL[dtype], seed, f"decode ({splits} splits)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_long_single_request_splits(seed, dtype):
    args = make_batch([1], [32768], 32, 8, 128, dtype)
    cfg = configs.get_config(args[0].device)
    splits, _ = attention_triton.decode_splits(cfg, 1, 8, args[7], configs.num_sms(args[0].device),
                                               cfg.decode_block_n)
    assert splits >= 2
    check(triton_ops.paged_attention(*args), fp32_ref(args), ATTN_TOL[dtype], seed,
          f"decode 32K ({splits} splits)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_prefill_varlen_8k(seed, dtype, heads):
    # fresh prompt, chunked prefill on a 4K prefix, decode at 8K, speculative verification,
    # a short prefix hit
    q_lens = [1000, 512, 1, 5, 37]
    ctx = [0, 4096, 8000, 3000, 100]
    args = make_batch(q_lens, ctx, *heads, 128, dtype)
    check(triton_ops.paged_attention(*args), fp32_ref(args), ATTN_TOL[dtype], seed, "prefill")


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_cuda_graph(seed, dtype):
    args = make_batch([1] * 4, [4000, 10, 900, 2048], 32, 8, 128, dtype)
    out = triton_ops.paged_attention(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = triton_ops.paged_attention(*args)
    args[0].copy_(torch.randn_like(args[0]))
    graph.replay()
    torch.cuda.synchronize()
    check(out_g, fp32_ref(args), ATTN_TOL[dtype], seed, "decode replayed in a CUDA graph")
    assert out.shape == out_g.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(seed, dtype):
    kc = torch.randn(2000, 16, 8, 128, device=DEV).to(dtype)
    vc = torch.randn_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv = torch.randn(4096, 2, 8, 128, device=DEV).to(dtype)
    slots = torch.randperm(2000 * 16, device=DEV)[:4096]
    slots[::7] = -1
    triton_ops.write_kv(kv[:, 0], kv[:, 1], kc, vc, slots)
    write_kv_ref(kv[:, 0], kv[:, 1], kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), f"seed {seed}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [4096, 5120])
def test_rms_norm(seed, dtype, hidden):
    x = torch.randn(2048, hidden, device=DEV).to(dtype)
    r = (torch.randn(2048, hidden, device=DEV) * 4).to(dtype)
    w = (torch.rand(hidden, device=DEV) + 0.5).to(dtype)
    check(triton_ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), TOL[dtype], seed, "norm")
    out, res = triton_ops.rms_norm(x, w, 1e-5, r)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, r)
    check(res, ref_res, TOL[dtype], seed, "residual")
    check(out, ref_out, TOL[dtype], seed, "norm with residual")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(seed, dtype):
    x = (torch.randn(1024, 2 * 14336, device=DEV) * 2).to(dtype)
    check(triton_ops.silu_and_mul(x), silu_and_mul_ref(x), TOL[dtype], seed, "silu_and_mul")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(seed, dtype):
    T, H, Hkv, D = 4096, 32, 8, 128
    cs = build_cos_sin_cache(D, 131072, 500000.0).to(DEV)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=DEV).to(dtype)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    pos = torch.randint(0, 131072, (T,), device=DEV)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_ref(pos, q_ref, k_ref, cs)
    triton_ops.rotary(pos, q, k, cs)
    check(q, q_ref, TOL[dtype], seed, "q")
    check(k, k_ref, TOL[dtype], seed, "k")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,norm", [(28, 4, False), (14, 2, False), (32, 8, True)])
def test_qkv_rope_cache(seed, dtype, heads, kv_heads, norm):
    """The fused split / [q/k norm] / RoPE / KV write against the sequence of kernels it
    replaces, on a prefill-sized batch with skipped slots: q and the k cache within an ulp or
    two (the GPU may fuse the rotation's multiply-add), v copied exactly."""
    from luceio.kernels.qkv_rope import qkv_rope_cache_ref
    T, D, blocks, bs = 1000, 128 if heads != 14 else 64, 80, 16
    cs = build_cos_sin_cache(D, 32768, 1000000.0).to(DEV)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, device=DEV).to(dtype)
    pos = torch.randint(0, 32768, (T,), device=DEV)
    slots = torch.randperm(blocks * bs, device=DEV)[:T]
    slots[::7] = -1
    kc = torch.randn(blocks, bs, kv_heads, D, device=DEV).to(dtype)
    vc = torch.randn_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    norms = (1 + 0.1 * torch.randn(D, device=DEV).to(dtype),
             1 + 0.1 * torch.randn(D, device=DEV).to(dtype), 1e-6) if norm else ()
    q = triton_ops.qkv_rope_cache(qkv, pos, cs, kc, vc, slots, heads, kv_heads, *norms)
    # the sequence the model ran before (on a GPU: the Triton rms_norm, rotary, write_kv)
    q_ref = qkv_rope_cache_ref(qkv, pos, cs, kc_ref, vc_ref, slots, heads, kv_heads, *norms)
    check(q, q_ref, TOL[dtype], seed, "fused q")
    check(kc, kc_ref, TOL[dtype], seed, "k cache")
    assert torch.equal(vc, vc_ref), f"v cache (seed {seed})"


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_producers_write_the_gemv_input(seed, dtype, rows):
    """rms_norm and silu_and_mul with `xqs` (one row, and several: a tree level's or a small
    batch's): their output unchanged, and its int8 forms equal to what the GEMV's own
    quantizing launch makes of the rows, bit for bit."""
    from luceio.kernels.elementwise_triton import xq_layouts
    from luceio.kernels.quant_x import quantize_x
    for n in (896, 3584, 5120):
        x, r = (torch.randn(rows, n, device=DEV).to(dtype) for _ in range(2))
        w = torch.randn(n, device=DEV).to(dtype)
        xqs = xq_layouts((False, True), rows, n, DEV)
        out, _ = triton_ops.rms_norm(x, w, 1e-6, r, xqs=xqs)
        assert torch.equal(out, triton_ops.rms_norm(x, w, 1e-6, r)[0])
        for planes, got in xqs.items():
            want = quantize_x(out.reshape(-1), planes=planes)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (n, planes, seed)
    for d in (4864, 18944):
        gu = torch.randn(rows, 2 * d, device=DEV).to(dtype)
        xqs = xq_layouts((True,), rows, d, DEV)
        act = triton_ops.silu_and_mul(gu, xqs=xqs)
        want = quantize_x(act.reshape(-1), planes=True)
        assert all(torch.equal(a, b) for a, b in zip(xqs[True], want)), (d, seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_writes_the_o_input(seed, dtype):
    """One decode token (Qwen2.5 0.5B / 7B head layouts, short and long contexts: the direct
    and the split path) with `xqs`: output unchanged, its int8 forms equal to the GEMV's own
    quantizing launch's, bit for bit."""
    from luceio.kernels.elementwise_triton import xq_layouts
    from luceio.kernels.quant_x import quantize_x
    for heads, kv_heads, head_dim in ((14, 2, 64), (28, 4, 128)):
        for ctx in (40, 3000):
            bs, pages = 16, -(-(ctx + 1) // 16)
            kc, vc = (torch.randn(pages + 2, bs, kv_heads, head_dim, device=DEV).to(dtype)
                      for _ in range(2))
            q = torch.randn(1, heads, head_dim, device=DEV).to(dtype)
            bt = torch.randperm(pages + 2, device=DEV)[None, :pages].to(torch.int32)
            args = (q, kc, vc, bt, torch.tensor([ctx + 1], dtype=torch.int32, device=DEV),
                    torch.tensor([0, 1], dtype=torch.int32, device=DEV), 1, ctx + 1,
                    head_dim ** -0.5)
            xqs = xq_layouts((False, True), 1, heads * head_dim, DEV)
            out = triton_ops.paged_attention(*args, xqs=xqs)
            assert torch.equal(out, triton_ops.paged_attention(*args)), (heads, ctx, seed)
            for planes, got in xqs.items():
                want = quantize_x(out.reshape(-1), planes=planes)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (heads, ctx, planes)


def test_dispatch_uses_triton_on_gpu(monkeypatch):
    monkeypatch.delenv("LUCEIO_KERNELS", raising=False)
    x = torch.randn(4, 64, device=DEV)
    assert K.use_triton(x)
    assert configs.device_arch(x.device) != "cpu"


def moe_inputs(num_tokens, num_experts=128, hidden=2048, inter=768, top_k=8):
    """Qwen3-30B-A3B's expert shapes, bf16, outputs of magnitude ~1."""
    x = torch.randn(num_tokens, hidden, device=DEV).to(torch.bfloat16)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=DEV) * hidden ** -0.5)
    w_down = torch.randn(num_experts, hidden, inter, device=DEV) * inter ** -0.5
    logits = torch.randn(num_tokens, num_experts, device=DEV).to(torch.bfloat16)
    return (x, w_gate_up.to(torch.bfloat16), w_down.to(torch.bfloat16),
            *route_topk_ref(logits, top_k, renormalize=True))


@pytest.mark.parametrize("num_tokens", [1, 256])
def test_fused_moe(seed, num_tokens):
    args = moe_inputs(num_tokens)
    out, ref = triton_ops.fused_moe(*args), fused_moe_ref(*args)
    check(out, ref, dict(atol=2e-2, rtol=2e-2), seed, f"fused_moe, {num_tokens} tokens")
    exact = fused_moe_ref(*(a.float() if a.is_floating_point() else a for a in args))
    err, ref_err = ((o.float() - exact).abs().max().item() for o in (out, ref))
    assert err <= 1.5 * ref_err, f"kernel err {err:.3g}, bf16 reference {ref_err:.3g} (seed {seed})"


def test_fused_moe_cuda_graph(seed):
    """Decode in a CUDA graph: the tile layout is built on the device, with no host sync."""
    args = moe_inputs(4)
    triton_ops.fused_moe(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_ops.fused_moe(*args)
    x, w_gate_up, w_down, weights, expert_ids = args
    x.copy_(torch.randn_like(x))
    expert_ids.copy_(torch.randperm(w_gate_up.shape[0], device=DEV)[:expert_ids.numel()]
                     .view_as(expert_ids))
    graph.replay()
    torch.cuda.synchronize()
    check(out, fused_moe_ref(*args), dict(atol=2e-2, rtol=2e-2), seed, "fused_moe in a graph")
