"""The CPU decode step: its numba kernels (luceio/kernels/decode_cpu.py) against the torch
references they stand in for, and the decoder (luceio/models/cpu_decode.py) against the module
forward: the same hidden states and KV cache on decode batches of one request and of several
with ragged lengths and blocks shuffled over the pool, for every architecture (dense fp32, to
fp32 rounding) and on quantized weights (to the int16 roundings of the matmul inputs).
The engine sends decode steps, and only those, down this path."""
from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, engine_kwargs
from luceio import LLM, SamplingParams
from luceio.kernels import decode_cpu
from luceio.kernels.activation import silu_and_mul_ref
from luceio.kernels.attention import paged_attention_ref, write_kv_ref
from luceio.kernels.norm import rms_norm_ref
from luceio.kernels.rotary import build_cos_sin_cache, rotary_ref
from luceio.models import AttnMetadata

pytest.importorskip("numba")
as_numpy = decode_cpu.as_numpy
BF16_ULP = 2 ** -7  # relative spacing of bf16 values: one rounding flip


def _assert_bf16_close(got, want):
    """bf16 `got` equals fp32 `want` rounded to bf16, but for values within fp32 noise of a
    rounding boundary (one ulp apart)."""
    assert got.dtype == torch.bfloat16
    diff = (got.float() - want.to(torch.bfloat16).float()).abs()
    assert bool((diff <= BF16_ULP * want.abs() + 1e-30).all())
    assert (diff == 0).float().mean() > 0.99


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("add", [False, True])
def test_add_rms_norm(x_dtype, out_dtype, add):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 576, generator=g) * 4).to(x_dtype)
    residual = torch.randn(3, 576, generator=g) * 4
    weight = torch.rand(576, generator=g) + 0.5
    if add:
        want, want_residual = rms_norm_ref(x.float(), weight, 1e-5, residual.clone())
    else:
        want, want_residual = rms_norm_ref(residual, weight, 1e-5), residual.clone()
    out = torch.empty(3, 576, dtype=out_dtype)
    decode_cpu.add_rms_norm(as_numpy(x), residual.numpy(), add, weight.numpy(), 1e-5,
                            as_numpy(out))
    assert torch.equal(residual, want_residual)
    if out_dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    else:
        _assert_bf16_close(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    gate_up = (torch.randn(2, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    want = silu_and_mul_ref(gate_up.float())
    out = torch.empty(2, 1536, dtype=dtype)
    decode_cpu.silu_and_mul(as_numpy(gate_up), as_numpy(out))
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    else:
        _assert_bf16_close(out, want)


def _random_cache(seq_lens, num_kv_heads, head_dim, g, num_blocks=40, block_size=16):
    """A random [2, ...] KV cache; each request's blocks drawn at random from the pool; its
    decode token is the last of its `seq_lens` and goes to `slots`."""
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    counts = [-(-n // block_size) for n in seq_lens]
    blocks = torch.randperm(num_blocks, generator=g)[:sum(counts)].split(counts)
    tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32)
    for i, b in enumerate(blocks):
        tables[i, :len(b)] = b
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    pos = (lens - 1).long()
    slots = tables[torch.arange(len(seq_lens)), pos // block_size].long() * block_size + \
        pos % block_size
    return kv, tables, lens, pos, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul(dtype):
    gate_up = (torch.randn(2, 2 * 96, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    gate, up = gate_up.float().chunk(2, -1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    out = torch.empty(2, 96, dtype=dtype)
    decode_cpu.gelu_tanh_and_mul(as_numpy(gate_up), as_numpy(out))
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    else:  # 1 + tanh(...) cancels for negative gates: fp32 noise there can flip a bf16 rounding
        torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,qk_norm,window", [
    (9, 3, 64, False, 0), (4, 4, 32, False, 0), (8, 2, 32, True, 0), (4, 2, 16, True, 7),
    (3, 3, 20, True, 30)])
@pytest.mark.parametrize("seq_lens", [[100], [5, 37, 20, 16]])
@pytest.mark.parametrize("io_dtype,kv_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.bfloat16)])
def test_decode_attention(num_heads, num_kv_heads, head_dim, qk_norm, window, seq_lens,
                          io_dtype, kv_dtype):
    """[q/k norm,] rotary, KV write and attention in one call == the references in sequence;
    with a sliding window (Gemma's local layers) and another scale where given; an fp32 or a
    bf16 cache (--kv-cache-dtype: written rounded, the reference reads the kernel's cache)."""
    scale = head_dim ** -0.5 if not window else 24 ** -0.5
    g = torch.Generator().manual_seed(2)
    kv, tables, lens, pos, slots = _random_cache(seq_lens, num_kv_heads, head_dim, g)
    kv = kv.to(kv_dtype)
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim,
                      generator=g).to(io_dtype)
    norms = (torch.rand(2, head_dim, generator=g) + 0.5) if qk_norm else torch.zeros(2, 0)
    cos_sin = build_cos_sin_cache(head_dim, 256, 10000.0)

    want_kv = kv.clone()
    q, k, v = qkv.float().clone().split([num_heads * head_dim, num_kv_heads * head_dim,
                                         num_kv_heads * head_dim], -1)
    q, k = (t.reshape(-1, n, head_dim) for t, n in ((q, num_heads), (k, num_kv_heads)))
    if qk_norm:
        q, k = (rms_norm_ref(t, w, 1e-6) for t, w in ((q, norms[0]), (k, norms[1])))
    q, k = q.contiguous(), k.contiguous()
    rotary_ref(pos, q, k, cos_sin)
    write_kv_ref(k, v.reshape(-1, num_kv_heads, head_dim), want_kv[0], want_kv[1], slots)
    out = torch.empty(len(seq_lens), num_heads * head_dim, dtype=io_dtype)
    decode_cpu.decode_attention(as_numpy(qkv), cos_sin.numpy(), pos.numpy(), as_numpy(kv),
                                slots.numpy(), tables.numpy(), lens.numpy(), num_heads,
                                norms[0].numpy(), norms[1].numpy(), 1e-6, as_numpy(out), scale,
                                window)
    if kv_dtype == torch.bfloat16:  # fp32 k / v rounded: one bf16 rounding flip at most
        torch.testing.assert_close(kv.float(), want_kv.float(), rtol=2 ** -8, atol=0)
        want_kv = kv  # the attention is compared over the kernel's own cache
    want = paged_attention_ref(q, want_kv[0], want_kv[1], tables, lens,
                               torch.arange(len(seq_lens) + 1, dtype=torch.int32), 1,
                               max(seq_lens), scale, window=window).reshape(len(seq_lens), -1)
    torch.testing.assert_close(kv, want_kv, rtol=1e-6, atol=1e-6)
    if io_dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    else:
        _assert_bf16_close(out, want)


@pytest.mark.parametrize("splits,window,kv_dtype", [
    (1, 0, torch.float32), (3, 0, torch.float32), (4, 9, torch.float32), (8, 0, torch.float32),
    (3, 0, torch.bfloat16), (4, 9, torch.bfloat16)])
@pytest.mark.parametrize("io_dtype", [torch.float32, torch.bfloat16])
def test_split_attention_equals_one_thread(splits, window, kv_dtype, io_dtype):
    """`decode_attention_split` (each request's keys in `splits` ranges on numba's threads,
    merged) == `decode_attention`: the same KV writes, outputs to fp32 rounding, including
    ranges left empty (8 splits of a 5-token request), a sliding window and a bf16 cache
    (--kv-cache-dtype)."""
    import numba
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    g = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, head_dim, seq_lens = 6, 2, 32, [70, 5, 33]
    kv, tables, lens, pos, slots = _random_cache(seq_lens, num_kv_heads, head_dim, g)
    kv = kv.to(kv_dtype)
    qkv = torch.randn(3, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(io_dtype)
    norms = torch.rand(2, head_dim, generator=g) + 0.5
    cos_sin = build_cos_sin_cache(head_dim, 256, 10000.0)
    outs, caches = [], []
    for split in (False, True):
        cache, out = kv.clone(), torch.empty(3, num_heads * head_dim, dtype=io_dtype)
        args = (as_numpy(qkv), cos_sin.numpy(), pos.numpy(), as_numpy(cache), slots.numpy(),
                tables.numpy(), lens.numpy(), num_heads, norms[0].numpy(), norms[1].numpy(),
                1e-6, as_numpy(out), 0.2, window)
        if split:
            decode_cpu.decode_attention_split(*args, splits)
        else:
            decode_cpu.decode_attention(*args)
        outs.append(out)
        caches.append(cache)
    # the same `_rope_write` writes both caches, but numba compiles it into each caller with
    # fastmath (the norm's sum may be reassociated differently): one full-suite run in session
    # 17 saw fp32 writes differ in the last bits, so written KV is compared to fp32 rounding
    assert not torch.equal(caches[0], kv)
    if kv_dtype == torch.bfloat16:  # (one bf16 rounding flip at most)
        torch.testing.assert_close(caches[1].float(), caches[0].float(), rtol=2 ** -8, atol=0)
    else:
        torch.testing.assert_close(caches[1], caches[0], rtol=1e-6, atol=1e-6)
    if io_dtype == torch.float32:
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    else:
        _assert_bf16_close(outs[1], outs[0].float())


def _decode_batch(runner, seq_lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    kv, tables, lens, pos, slots = _random_cache(seq_lens, runner.cfg.num_kv_heads,
                                                 runner.cfg.head_dim, g, runner.num_blocks,
                                                 runner.block_size)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    meta = AttnMetadata(slots, tables, lens, torch.arange(len(seq_lens) + 1, dtype=torch.int32),
                        1, max(seq_lens))
    return torch.randint(0, runner.cfg.vocab_size, (len(seq_lens),), generator=g), pos, meta


def _decoder_vs_module_forward(runner, seq_lens, seed=0):
    """(relative error of the hidden states, of the KV cache after the step)."""
    return decoder_vs_module_forward(runner, *_decode_batch(runner, seq_lens, seed))


@torch.inference_mode()
def decoder_vs_module_forward(runner, ids, pos, meta):
    """The CPU decoder's step of (ids, pos, meta) against the module forward's, from the same
    KV cache: (relative error of the hidden states, of the KV cache after the step)."""
    before = [kv.clone() for kv in runner.kv_caches]
    want = runner.model(ids, pos, runner.kv_caches, meta)
    want_kv = [kv.clone() for kv in runner.kv_caches]
    for kv, b in zip(runner.kv_caches, before):
        kv.copy_(b)
    got = runner.cpu_decoder(ids, pos, meta)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    kv_err = max(float((a.float() - b.float()).norm() / b.float().norm())
                 for a, b in zip(runner.kv_caches, want_kv))
    assert not all(torch.equal(a, b) for a, b in zip(runner.kv_caches, before))  # it wrote KV
    return float((got - want).norm() / want.norm()), kv_err


@pytest.mark.parametrize("arch", list(ARCHS))
def test_decoder_equals_module_forward(tiny_models, arch):
    runner = LLM(tiny_models[arch], **engine_kwargs()).engine.runner
    for seq_lens in ([37], [5, 37, 20, 16]):
        hidden_err, kv_err = _decoder_vs_module_forward(runner, seq_lens)
        assert hidden_err < 1e-5 and kv_err < 1e-6  # measured: 6e-7, 1e-8


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoder_with_bf16_kv_cache(tiny_models, arch):
    """--kv-cache-dtype bfloat16: the cache is bf16 (half the bytes a block), the CPU decoder
    writes and reads it as the module forward does (keys and values rounded to nearest even:
    where the two paths' fp32 keys differ in the last bits a bf16 rounding may flip)."""
    from luceio.memory import kv_dtype
    fp32 = LLM(tiny_models[arch], **engine_kwargs()).engine.runner
    runner = LLM(tiny_models[arch], **engine_kwargs(kv_cache_dtype="bfloat16")).engine.runner
    assert all(kv.dtype == torch.bfloat16 for kv in runner.kv_caches)
    assert runner.bytes_per_block * 2 == fp32.bytes_per_block
    for seq_lens in ([37], [5, 37, 20, 16]):
        hidden_err, kv_err = _decoder_vs_module_forward(runner, seq_lens)
        assert hidden_err < 1e-3 and kv_err < 2 ** -8
    assert kv_dtype("auto", torch.float16, "cuda") == torch.float16
    with pytest.raises(ValueError, match="needs a bfloat16 model"):
        kv_dtype("bfloat16", torch.float16, "cuda")


def test_decoder_cuts_long_contexts_into_work_items(tmp_path, monkeypatch):
    """Every step's requests go to `rows_attention_cpu` (each key read once for a request's
    rows), their keys cut into work items of `KEY_SPAN` on the threads; `decode_cpu`'s
    split kernel is not used (Gemma's windows keep it). The step equals the module forward."""
    from conftest import make_tiny_model
    from luceio.kernels import rows_attention_cpu
    path = make_tiny_model(str(tmp_path / "long"), "qwen3", seed=5, context=4096)
    runner = LLM(path, **engine_kwargs(cpu_threads=2, max_model_len=4096,
                                       num_kv_blocks=300)).engine.runner
    calls, items = [], []
    real_rows = rows_attention_cpu.RowsAttention.__call__
    for name in ("decode_attention_split", "decode_attention"):
        monkeypatch.setattr(decode_cpu, name, lambda *a: calls.append(a))
    monkeypatch.setattr(rows_attention_cpu.RowsAttention, "__call__",
                        lambda self, *a: items.append(self.work_items) or real_rows(self, *a))
    layers = runner.cfg.num_layers
    assert rows_attention_cpu.KEY_SPAN == 1024
    hidden_err, kv_err = _decoder_vs_module_forward(runner, [2600, 37])  # 2 x 2 KV heads
    assert hidden_err < 1e-5 and kv_err < 1e-6
    assert not calls and items == [2 * 3 + 2] * layers  # 2,600 keys: 3 items a KV head
    items.clear()
    monkeypatch.setattr(rows_attention_cpu, "KEY_SPAN", 100)
    hidden_err, kv_err = _decoder_vs_module_forward(runner, [2600, 37])
    assert hidden_err < 1e-5 and kv_err < 1e-6
    assert not calls and items == [2 * 26 + 2] * layers


@pytest.mark.parametrize("name", ["gqa_tied", "mha_odd_untied"])
def test_gemma3_decoder_equals_module_forward(tmp_path, name):
    """Gemma 3's own step ((1 + w) norms, post-norms, GELU, sliding windows, local RoPE, the
    query_pre_attn_scalar scale, the embedding scale) against its module forward; the engine
    decodes through it."""
    from conftest import make_tiny_gemma
    runner = LLM(make_tiny_gemma(str(tmp_path / name), name, seed=3),
                 **engine_kwargs()).engine.runner
    decoder = runner.cpu_decoder
    assert decoder.gemma and not decoder.module_forward
    assert any(layer.window for layer in decoder.layers)
    for seq_lens in ([37], [5, 37, 20, 16]):  # longer than the windows (5, 7)
        hidden_err, kv_err = _decoder_vs_module_forward(runner, seq_lens)
        assert hidden_err < 1e-5 and kv_err < 1e-6


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_on_quantized_weights(tmp_path, arch):
    """Both paths multiply the quantized weights with the same kernel (qdot_cpu.py), which
    rounds its inputs to int16 steps of 1/32767 of their group's largest: where fp32 noise
    tips such a rounding the other way, an input moves by a step (measured: 6e-5 and 8e-5 on
    the hidden states, 3e-6 and 9e-6 on the KV cache); the bound allows a few."""
    pytest.importorskip("gguf")
    from test_gguf import _write_gguf
    from test_quant_engine import MIXED
    path = tmp_path / "q.gguf"
    _write_gguf(path, arch, MIXED)
    runner = LLM(str(path), quantization="auto", **engine_kwargs(max_model_len=256)).engine.runner
    assert runner.cpu_decoder.layers[0].qkv.parts  # the quantized kernels
    hidden_err, kv_err = _decoder_vs_module_forward(runner, [5, 37, 20])
    assert hidden_err < 5e-4 and kv_err < 1e-4


def test_engine_sends_decode_steps_only(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama, **engine_kwargs())
    runner = llm.engine.runner
    calls = []
    decoder = runner.cpu_decoder
    runner.cpu_decoder = lambda ids, *args: calls.append(len(ids)) or decoder(ids, *args)
    prompts = [[5, 6, 7], list(range(10, 50))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert calls == [2] * 5  # both prompts prefill in one step, then five decode steps
    monkeypatch.setenv("LUCEIO_KERNELS", "torch")  # the references, as asked
    llm.generate([{"prompt_token_ids": prompts[0]}], params)
    assert len(calls) == 5
    assert LLM(tiny_llama, **engine_kwargs(dtype="bfloat16")).engine.runner.cpu_decoder is None
