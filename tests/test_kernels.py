"""Triton kernels vs their torch references, on CPU under TRITON_INTERPRET=1 (CI).

Inputs are random from a seed fixed per test (`conftest.seed_for`; LUCEIO_TEST_RANDOM=1 draws
fresh ones); every assertion message carries it (LUCEIO_TEST_SEED=<seed> replays one). On a machine with a GPU and no interpreter the same
tests run natively on the GPU.

Tolerances (kernel vs the reference in the same dtype):
  fp32: atol 1e-4, rtol 1e-4
  fp16: atol 2e-3, rtol 2e-3 (elementwise ops: 1-2 fp16 ulps)
  fp16 attention: atol 3e-3, rtol 3e-3 (both sides round P@V differently)
bf16 is left to tests/gpu: the interpreter rounds bf16 casts differently from torch.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Must happen before the Triton kernels are defined (tests/conftest.py should do it before
    # anything imports triton; see the skip below).
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from conftest import seed_for  # noqa: E402
from luceio.kernels import attention_triton, configs, triton_ops  # noqa: E402
from luceio.kernels.activation import silu_and_mul_ref  # noqa: E402
from luceio.kernels.attention import paged_attention_ref, write_kv_ref  # noqa: E402
from luceio.kernels.configs import KernelConfig  # noqa: E402
from luceio.kernels.norm import rms_norm_ref  # noqa: E402
from luceio.kernels.rotary import build_cos_sin_cache, rotary_ref  # noqa: E402

INTERPRETED = type(attention_triton._decode_kernel).__name__ == "InterpretedFunction"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("the Triton kernels were defined without TRITON_INTERPRET=1 (triton was imported "
                "before this module set it) and there is no GPU: set TRITON_INTERPRET=1 in "
                "tests/conftest.py before anything imports luceio", allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}
ATTN_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}
DTYPES = [torch.float32, torch.float16]

# small tiles so the tiny test shapes still cross tile, page and split boundaries
SMALL = KernelConfig(decode_block_n=16, decode_min_tokens_per_split=32, decode_max_splits=4,
                     prefill_block_m=32, prefill_block_n=16, source="test")


class Rng:
    """A seeded torch.Generator that remembers its seed for assertion messages."""

    def __init__(self, seed: int | None = None):
        self.seed_value = seed_for() if seed is None else seed
        self.g = torch.Generator().manual_seed(self.seed_value)


@pytest.fixture
def gen(request):
    return Rng(seed_for(request))


def rnd(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g.g) * scale).to(dtype).to(DEVICE)


def check(out, ref, tol, g, what):
    out, ref = out.float().cpu(), ref.float().cpu()
    err = (out - ref).abs().max().item() if out.numel() else 0.0
    assert torch.allclose(out, ref, **tol), f"{what}: max abs err {err:.3g} (seed {g.seed_value})"


# ---------------------------------------------------------------------------------- elementwise

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(gen, dtype, hidden, with_residual):
    x = rnd(gen, 7, hidden, dtype=dtype)
    w = rnd(gen, hidden, dtype=dtype, scale=0.5) + 1
    if not with_residual:
        check(triton_ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), TOL[dtype], gen, "out")
        return
    r = rnd(gen, 7, hidden, dtype=dtype, scale=3.0)
    r_before = r.clone()
    out, res = triton_ops.rms_norm(x, w, 1e-5, r)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, r_before.clone())
    check(res, ref_res, TOL[dtype], gen, "residual")
    check(out, ref_out, TOL[dtype], gen, "out")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(gen, dtype):
    x = rnd(gen, 5, 2 * 300, dtype=dtype, scale=2.0)
    out = triton_ops.silu_and_mul(x)
    assert out.shape == (5, 300)
    check(out, silu_and_mul_ref(x), TOL[dtype], gen, "silu_and_mul")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_on_qkv_views(gen, dtype, head_dim):
    T, H, Hkv = 9, 12, 4
    cs = build_cos_sin_cache(head_dim, 4096, 500000.0,
                             {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 1024}).to(DEVICE)
    qkv = rnd(gen, T, (H + 2 * Hkv) * head_dim, dtype=dtype)
    q = qkv[:, :H * head_dim].view(T, H, head_dim)
    k = qkv[:, H * head_dim:(H + Hkv) * head_dim].view(T, Hkv, head_dim)
    v_before = qkv[:, (H + Hkv) * head_dim:].clone()
    pos = torch.randint(0, 4096, (T,), generator=gen.g).to(DEVICE)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_ref(pos, q_ref, k_ref, cs)
    assert triton_ops.rotary(pos, q, k, cs) is None
    check(q, q_ref, TOL[dtype], gen, "q")
    check(k, k_ref, TOL[dtype], gen, "k")
    assert torch.equal(qkv[:, (H + Hkv) * head_dim:], v_before), "rotary wrote outside q/k"


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_skips_negative_slots(gen, dtype):
    blocks, bs, Hkv, D = 10, 16, 3, 64
    kc = rnd(gen, blocks, bs, Hkv, D, dtype=dtype)
    vc = rnd(gen, blocks, bs, Hkv, D, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv = rnd(gen, 6, 2, Hkv, D, dtype=dtype)  # k = kv[:, 0], v = kv[:, 1]: strided views
    slots = torch.tensor([3, -1, 17, blocks * bs - 1, 40, -1]).to(DEVICE)
    triton_ops.write_kv(kv[:, 0], kv[:, 1], kc, vc, slots)
    write_kv_ref(kv[:, 0], kv[:, 1], kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), f"seed {gen.seed_value}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads,norm", [(64, 14, 2, False), (128, 12, 4, True),
                                                          (64, 6, 6, True)])
def test_qkv_rope_cache_equals_the_sequence(gen, dtype, head_dim, heads, kv_heads, norm):
    """Split, [q/k norm,] rotary and the KV write in one launch == the reference sequence: the
    same q, the same cache (skipped slots untouched), the projection output unchanged."""
    from luceio.kernels.qkv_rope import qkv_rope_cache_ref
    T, blocks, bs = 7, 6, 16
    cs = build_cos_sin_cache(head_dim, 2048, 1000000.0).to(DEVICE)
    wide = rnd(gen, T, (heads + 2 * kv_heads) * head_dim + 8, dtype=dtype)
    qkv = wide[:, 8:]  # a strided view, as a part of a wider buffer
    before = qkv.clone()
    pos = torch.randint(0, 2048, (T,), generator=gen.g).to(DEVICE)
    slots = torch.tensor([5, -1, 17, blocks * bs - 1, 40, 41, -1]).to(DEVICE)
    kc, vc = (rnd(gen, blocks, bs, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    norms = (1 + 0.1 * rnd(gen, head_dim, dtype=dtype), 1 + 0.1 * rnd(gen, head_dim, dtype=dtype),
             1e-6) if norm else ()
    q = triton_ops.qkv_rope_cache(qkv, pos, cs, kc, vc, slots, heads, kv_heads, *norms)
    q_ref = qkv_rope_cache_ref(qkv, pos, cs, kc_ref, vc_ref, slots, heads, kv_heads, *norms)
    assert q.shape == (T, heads, head_dim) and q.is_contiguous()
    check(q, q_ref, TOL[dtype], gen, "q")
    check(kc, kc_ref, TOL[dtype], gen, "k cache")
    assert torch.equal(vc, vc_ref), f"v cache, seed {gen.seed_value}"
    assert torch.equal(qkv, before), "the projection output was modified"
    if not norm and INTERPRETED:  # same fp32 operations in the same order: exact
        assert torch.equal(q, q_ref) and torch.equal(kc, kc_ref), f"seed {gen.seed_value}"


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("layouts", [(True,), (False,), (False, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_producers_also_write_the_gemv_input(gen, layouts, dtype, rows):
    """`rms_norm` and `silu_and_mul` given `xqs` write the same output as without, and the
    int8 forms `quantize_x` makes of that output's rows flattened (what one GEMV launch over
    the rows reads; both layouts, bit for bit)."""
    from luceio.kernels.elementwise_triton import xq_layouts
    from luceio.kernels.quant_x import quantize_x
    n, d = 224, 1088  # 7 groups (one norm program, masked tail); 34 groups over two programs
    x, r = rnd(gen, rows, n, dtype=dtype), rnd(gen, rows, n, dtype=dtype)
    w = rnd(gen, n, dtype=dtype)
    gu = rnd(gen, rows, 2 * d, dtype=dtype)
    xqs = xq_layouts(layouts, rows, n, DEVICE)
    out, res = triton_ops.rms_norm(x, w, 1e-6, r, xqs=xqs)
    plain, plain_res = triton_ops.rms_norm(x, w, 1e-6, r)
    assert torch.equal(out, plain) and torch.equal(res, plain_res)
    act_xqs = xq_layouts(layouts, rows, d, DEVICE)
    act = triton_ops.silu_and_mul(gu, xqs=act_xqs)
    assert torch.equal(act, triton_ops.silu_and_mul(gu))
    for y, made in ((out, xqs), (act, act_xqs)):
        assert sorted(made) == sorted(layouts)
        for planes, got in made.items():
            want = quantize_x(y.reshape(-1), planes=planes)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (planes, gen.seed_value)
    with pytest.raises(ValueError, match="multiple of 32"):
        xq_layouts((True,), rows, n + 16, DEVICE)


# ------------------------------------------------------------------------------------ attention

def make_batch(g, q_lens, ctx_lens, num_kv_heads, group, head_dim, dtype, block_size=16):
    """A varlen step: request b has ctx_lens[b] cached tokens plus q_lens[b] new ones, all
    already in a paged cache whose pages are shuffled (and with spare pages holding junk)."""
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=g.g)
    bt = torch.randint(0, num_blocks, (len(seq_lens), max(pages) + 1), generator=g.g)
    used = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[used:used + n]
        used += n
    kc = rnd(g, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    vc = rnd(g, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    q = rnd(g, sum(q_lens), num_kv_heads * group, head_dim, dtype=dtype, scale=2.0)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (q, kc, vc, bt.to(torch.int32).to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32)
            .to(DEVICE), qsl.to(DEVICE), max(q_lens), max(seq_lens), head_dim ** -0.5)


def run_attention(g, cfg, args, dtype, what):
    with configs.use_config(cfg):
        out = triton_ops.paged_attention(*args)
    check(out, paged_attention_ref(*args), ATTN_TOL[dtype], g, what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_multi_split(gen, dtype, group, head_dim):
    # ragged contexts: partial pages, a split-boundary length, one shorter than a split
    ctx = [100, 40, 7, 63]
    args = make_batch(gen, [1, 1, 1, 1], ctx, 2, group, head_dim, dtype)
    splits, tokens = attention_triton.decode_splits(SMALL, 4, 2, args[7], 0, 16)
    assert splits >= 2 and tokens % 16 == 0
    run_attention(gen, SMALL, args, dtype, f"decode ({splits} splits of {tokens})")


@pytest.mark.parametrize("bound", [100, 129, 1000, 5000])
def test_decode_splits_follow_the_real_context(gen, bound):
    """A decode launch sized for a longer context than the batch holds (as a CUDA graph
    captured for max_model_len is) cuts each sequence's real length over its splits: the
    same attention whatever the bound, with contexts shorter than one split, exactly one
    split, and ragged over several."""
    ctx = [99, 31, 7, 64]
    args = make_batch(gen, [1, 1, 1, 1], ctx, 2, 4, 64, torch.float32)
    with configs.use_config(SMALL):
        out = triton_ops.paged_attention(*args[:7], bound, *args[8:])
    check(out, paged_attention_ref(*args), ATTN_TOL[torch.float32], gen,
          f"decode sized for {bound} tokens")


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_single_split_default_config(gen, dtype):
    args = make_batch(gen, [1, 1, 0, 1], [50, 3, 30, 129], 2, 4, 64, dtype)
    run_attention(gen, configs.TABLE["default"], args, dtype, "decode, one split")


@pytest.mark.parametrize("layouts", [(True,), (False, True)])
@pytest.mark.parametrize("ctx", [20, 100])  # one split (the decode kernel writes), four (the reduce)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_also_writes_the_o_input(gen, layouts, ctx, dtype):
    """One decode token with `xqs`: the same output as without, and the int8 forms
    `quantize_x` makes of it for the o projection, bit for bit, from the kernel that writes
    the output (a group of 7 heads: padded rows of a program must not spill into the next)."""
    from luceio.kernels.elementwise_triton import xq_layouts
    from luceio.kernels.quant_x import quantize_x
    group, kv_heads, head_dim = 7, 2, 64
    args = make_batch(gen, [1, 0], [ctx, 9], kv_heads, group, head_dim, dtype)
    splits, _ = attention_triton.decode_splits(SMALL, 2, kv_heads, args[7], 0, 16)
    assert (splits == 1) == (ctx == 20)
    xqs = xq_layouts(layouts, 1, kv_heads * group * head_dim, DEVICE)
    with configs.use_config(SMALL):
        out = triton_ops.paged_attention(*args, xqs=xqs)
        assert torch.equal(out, triton_ops.paged_attention(*args)), gen.seed_value
    for planes, got in xqs.items():
        want = quantize_x(out.reshape(-1), planes=planes)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (planes, gen.seed_value)
    with pytest.raises(ValueError, match="one decode token"):
        triton_ops.paged_attention(*make_batch(gen, [1, 1], [5, 9], kv_heads, group, head_dim,
                                               dtype), xqs=xqs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_varlen_mix(gen, dtype, group, head_dim):
    # fresh prefill, prefix-cache hit + new tokens, decode, chunked prefill across pages,
    # speculative verification (a few tokens after a long context)
    q_lens = [5, 9, 1, 20, 4]
    ctx = [0, 37, 20, 33, 70]
    args = make_batch(gen, q_lens, ctx, 2, group, head_dim, dtype)
    run_attention(gen, SMALL, args, dtype, "prefill (small tiles)")


@pytest.mark.parametrize("case", ["varlen", "window", "tree", "tree-span", "tree-window"])
def test_prefill_key_splits(gen, case):
    """Prefill launches split over the keys (`prefill_split_max_programs`: a verify step's or a
    tree's few programs) and merged: the reference's output for plain varlen batches, a
    sliding window, tree masks, a tree span and a tree under a window, with splits that
    hold no visible key (past the context, below the window)."""
    split_cfg = dataclasses.replace(SMALL, prefill_split_max_programs=10_000)
    q_lens, ctx = ([5, 9, 1, 20, 4], [0, 37, 20, 33, 70]) if case == "varlen" else \
        ([3, 7, 2], [70, 40, 9])
    args = make_batch(gen, q_lens, ctx, 2, 4, 64, torch.float32)
    kw = {}
    if case.startswith("tree"):
        span = 10 if case == "tree-span" else 0
        words = []
        for q in q_lens:  # the rows' own bits set, random bits below them
            for i in range(q):
                own = max(span, q) - q + i
                bits = int(torch.randint(0, 1 << own, (1,), generator=gen.g)) if own else 0
                words.append(bits | (1 << own))
        kw = dict(tree_mask=torch.tensor(words, dtype=torch.int64, device=DEVICE),
                  tree_span=span)
        if case == "tree-window":
            kw["positions"] = torch.cat([c + torch.arange(q) for q, c in zip(q_lens, ctx)]) \
                .to(DEVICE)
    if "window" in case:
        kw["window"] = 24
    assert configs.prefill_splits(split_cfg, 3, args[7], 0, 16) > 1
    with configs.use_config(split_cfg):
        out = triton_ops.paged_attention(*args, **kw)
    check(out, paged_attention_ref(*args, **kw), ATTN_TOL[torch.float32], gen,
          f"prefill with key splits ({case})")


def test_prefill_split_choice():
    cfg = dataclasses.replace(configs.TABLE["sm_90"], decode_waves=1.0)
    assert configs.prefill_splits(cfg, 2, 512, 132, 64) == 8  # 512 keys in runs of 64
    assert configs.prefill_splits(cfg, 4, 32768, 132, 64) == 32  # 33 by SMs, 1024-key runs
    assert configs.prefill_splits(cfg, 65, 32768, 132, 64) == 1  # a full launch: no split
    assert configs.prefill_splits(configs.TABLE["default"], 2, 32768, 132, 64) == 1  # off


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_default_config(gen, dtype):
    args = make_batch(gen, [70, 3, 1], [0, 90, 15], 1, 7, 64, dtype)
    run_attention(gen, configs.TABLE["default"], args, dtype, "prefill (default tiles)")


def _random_tree_masks(g, n: int) -> list[int]:
    """Ancestor masks (spec.tree) of a random tree of n - 1 nodes under a root."""
    from luceio.spec.tree import DraftTree
    parents = [int(torch.randint(-1, i, (1,), generator=g.g)) for i in range(n - 1)]
    return DraftTree(list(range(n - 1)), parents).ancestor_masks()


def _tree_attention_dense(q, kc, vc, bt, seq_lens, qsl, scale, words, span=0):
    """The definition, one query at a time: keys = the context + the query tokens (with a
    `span`: the last max(span, query tokens) keys) its word allows (never one after the
    query), softmax in fp64."""
    out = torch.empty_like(q, dtype=torch.float64)
    block = kc.shape[1]
    group = q.shape[1] // kc.shape[2]
    for b in range(len(seq_lens)):
        start, end = int(qsl[b]), int(qsl[b + 1])
        ctx = int(seq_lens[b]) - (end - start)
        first = int(seq_lens[b]) - max(end - start, span)  # the key of bit 0
        for t in range(start, end):
            i = t - start
            keys = [n for n in range(ctx + i + 1)
                    if n < first or n - first >= 64 or (int(words[t]) >> (n - first)) & 1]
            pages, slots = bt[b, torch.tensor(keys) // block].long(), torch.tensor(keys) % block
            k, v = kc[pages, slots].double(), vc[pages, slots].double()  # [L, Hkv, D]
            for h in range(q.shape[1]):
                p = torch.softmax(k[:, h // group] @ q[t, h].double() * scale, 0)
                out[t, h] = p @ v[:, h // group]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_tree_mask(gen, dtype, group):
    """Draft-tree verification: trees of 1-12 rows beside a plain request (word -1) and a prefill
    chunk longer than 64 tokens; kernel vs reference vs the definition."""
    q_lens, ctx = [7, 12, 1, 3, 80], [37, 5, 20, 0, 16]
    args = make_batch(gen, q_lens, ctx, 2, group, 64, dtype)
    words = _random_tree_masks(gen, 7) + _random_tree_masks(gen, 12) + [1] + [-1] * 3 + [-1] * 80
    tree_mask = torch.tensor(words, dtype=torch.int64, device=DEVICE)
    with configs.use_config(SMALL):
        out = triton_ops.paged_attention(*args, tree_mask=tree_mask)
    ref = paged_attention_ref(*args, tree_mask=tree_mask)
    check(out, ref, ATTN_TOL[dtype], gen, "tree mask, kernel vs reference")
    q, kc, vc, bt, seq_lens, qsl = (a.cpu() for a in args[:6])
    dense = _tree_attention_dense(q, kc, vc, bt, seq_lens, qsl, args[8], words)
    check(ref.cpu().double(), dense, ATTN_TOL[dtype], gen, "tree mask, reference vs definition")
    plain = paged_attention_ref(*args)
    assert not torch.allclose(ref[:19].float(), plain[:19].float(), atol=1e-3)  # the trees mask
    assert torch.equal(ref[19:], plain[19:])  # words of -1: plain causal attention


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_tree_span(gen, dtype):
    """A step feeding only a tree's frontier (`spec.tree_graph`): the words cover the last
    `tree_span` keys, cached before the step's queries too; kernel vs reference vs the
    definition, and not what the words mean without the span."""
    span, q_lens, ctx = 10, [2, 3, 2], [30, 9, 12]
    args = make_batch(gen, q_lens, ctx, 2, 2, 64, dtype)
    words = []
    for q in q_lens:  # random bits over the span, each query's own bit set
        for i in range(q):
            own = span - q + i
            rnd_bits = int(torch.randint(0, 1 << own, (1,), generator=gen.g)) if own else 0
            words.append(rnd_bits | (1 << own))
    tree_mask = torch.tensor(words, dtype=torch.int64, device=DEVICE)
    with configs.use_config(SMALL):
        out = triton_ops.paged_attention(*args, tree_mask=tree_mask, tree_span=span)
    ref = paged_attention_ref(*args, tree_mask=tree_mask, tree_span=span)
    check(out, ref, ATTN_TOL[dtype], gen, "tree span, kernel vs reference")
    q, kc, vc, bt, seq_lens, qsl = (a.cpu() for a in args[:6])
    dense = _tree_attention_dense(q, kc, vc, bt, seq_lens, qsl, args[8], words, span)
    check(ref.cpu().double(), dense, ATTN_TOL[dtype], gen, "tree span, reference vs definition")
    no_span = paged_attention_ref(*args, tree_mask=tree_mask)
    assert not torch.allclose(ref.float(), no_span.float(), atol=1e-3)
    with pytest.raises(ValueError, match="span"):
        paged_attention_ref(*args, tree_mask=tree_mask, tree_span=span, window=4,
                            positions=torch.zeros(7, dtype=torch.int64, device=DEVICE))


def test_dispatch_goes_to_triton(gen, monkeypatch):
    import luceio.kernels as K
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    called = []
    orig = triton_ops.silu_and_mul
    monkeypatch.setattr(triton_ops, "silu_and_mul", lambda x: called.append(1) or orig(x))
    x = rnd(gen, 3, 64)
    check(K.silu_and_mul(x), silu_and_mul_ref(x), TOL[torch.float32], gen, "dispatch")
    assert called


# -------------------------------------------------------------------------------------- configs

def test_config_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCEIO_CACHE", str(tmp_path))
    assert configs.load_config("gfx9999") == configs.TABLE["default"]
    assert configs.load_config("gfx1201") == configs.TABLE["gfx1201"]
    for arch in ("sm_86", "sm_89", "sm_90", "gfx1201", "gfx1151", "default"):
        src = configs.TABLE[arch].source
        # an entry either says it is unmeasured or names the card and date it was measured on
        assert src == "starting point, not measured" or ("measured" in src and "2026" in src)
    assert configs.device_arch(torch.device("cpu")) == "cpu"

    path = tmp_path / "kernel_configs" / "sm_90.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"arch": "sm_90", "decode_block_n": 32, "source": "tuned"}))
    cfg = configs.load_config("sm_90")
    assert cfg.decode_block_n == 32 and cfg.source == "tuned"
    assert cfg.prefill_block_m == configs.TABLE["sm_90"].prefill_block_m  # rest from the table
    assert configs.user_config_path("sm_90") == path

    path.write_text("{not json")
    with pytest.warns(UserWarning):
        assert configs.load_config("sm_90") == configs.TABLE["sm_90"]

    with configs.use_config(SMALL):
        assert configs.get_config(torch.device("cpu")) is SMALL
    configs.clear_cache()


def test_decode_split_choice():
    cfg = KernelConfig(decode_block_n=64, decode_min_tokens_per_split=512, decode_max_splits=32,
                       decode_waves=2.0)
    split = attention_triton.decode_splits
    assert split(cfg, 1, 8, 100, 132, 64) == (1, 128)           # short context: one split
    s, t = split(cfg, 1, 8, 8192, 132, 64)                      # long context, tiny batch
    assert s == 16 and t == 512
    assert split(cfg, 64, 8, 8192, 132, 64)[0] == 1             # batch already fills the GPU
    s, t = split(cfg, 1, 1, 1_000_000, 0, 64)                   # no SM count: capped by max
    assert s <= 32 and s * t >= 1_000_000 and t % 64 == 0


def test_decode_warps_by_head_dim():
    """The table's wide-head warps apply from head_dim 128 up; unset, every head_dim takes
    decode_num_warps (sm_90's row: 2 for head_dim 64, 8 for 128 and 256)."""
    assert configs.decode_warps(KernelConfig(decode_num_warps=4), 256) == 4
    cfg = KernelConfig(decode_num_warps=2, decode_num_warps_wide=8)
    assert [configs.decode_warps(cfg, d) for d in (64, 96, 128, 256)] == [2, 2, 8, 8]
    sm90 = configs.TABLE["sm_90"]
    assert (configs.decode_warps(sm90, 64), configs.decode_warps(sm90, 128)) == (2, 8)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_greedy_with_triton_kernels_equals_reference(tiny_models, monkeypatch, arch):
    """The whole engine (chunked prefill, prefix hits, decode) with every op on the Triton
    kernels (interpreted on CPU) gives the torch reference path's greedy tokens.
    tests/gpu/test_engine_gpu.py has the native counterpart."""
    if not INTERPRETED:
        pytest.skip("a CPU engine on the Triton kernels needs the interpreter")
    from conftest import engine_kwargs
    from luceio import LLM, SamplingParams
    prompts = [{"prompt_token_ids": [5 + i, 9, 33, 70 + i] * (2 + i)} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = engine_kwargs(max_num_batched_tokens=16)
    monkeypatch.setenv("LUCEIO_KERNELS", "torch")
    ref = [o.outputs[0].token_ids for o in LLM(tiny_models[arch], **kw).generate(prompts, params)]
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    got = [o.outputs[0].token_ids for o in LLM(tiny_models[arch], **kw).generate(prompts, params)]
    assert got == ref
