"""The hybrid families' small fused kernels against their torch references: Gemma's RMSNorm
(Gemma 3/4 and Qwen3.5, with the residual add fused), and the Gated DeltaNet's decode-step
conv + gates and gated norm (kernels/delta_rule_triton.py). Interpreted on the CPU (fp32 to
1e-5, bf16 / fp16 to the references' roundings), natively on a GPU when there is one."""
import pytest
import torch

from test_kernels import DEVICE, DTYPES, INTERPRETED, TOL, Rng, check, rnd
from luceio.kernels import delta_rule
from luceio.kernels.norm import gemma_rms_norm_ref

if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("needs the Triton interpreter or a GPU", allow_module_level=True)


@pytest.fixture
def gen(request):
    from conftest import seed_for
    return Rng(seed_for(request))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 1000])
@pytest.mark.parametrize("offset, scaled", [(1.0, True), (0.0, True), (0.0, False)],
                         ids=["1+w", "w", "none"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm(gen, dtype, hidden, offset, scaled, with_residual):
    from luceio.kernels.elementwise_triton import gemma_rms_norm
    x = rnd(gen, 5, hidden, dtype=dtype)
    w = rnd(gen, hidden, dtype=dtype, scale=0.5) if scaled else None
    if not with_residual:
        check(gemma_rms_norm(x, w, 1e-6, offset), gemma_rms_norm_ref(x, w, 1e-6, offset),
              TOL[dtype], gen, "out")
        return
    r = rnd(gen, 5, hidden, dtype=dtype, scale=3.0)
    r_before = r.clone()
    out, res = gemma_rms_norm(x, w, 1e-6, offset, r)
    ref_out, ref_res = gemma_rms_norm_ref(x, w, 1e-6, offset, r_before)
    assert torch.equal(r, r_before)  # inputs are not modified
    check(res, ref_res, TOL[dtype], gen, "residual")
    check(out, ref_out, TOL[dtype], gen, "out")


def test_gemma_rms_norm_of_head_slices(gen):
    """q/k norms read a strided slice per head (Qwen3.5's [query | gate] rows)."""
    from luceio.kernels.elementwise_triton import gemma_rms_norm
    qg = rnd(gen, 3, 4, 32)
    w = rnd(gen, 16, scale=0.5)
    check(gemma_rms_norm(qg[..., :16], w, 1e-6), gemma_rms_norm_ref(qg[..., :16], w, 1e-6),
          TOL[torch.float32], gen, "slice")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv_dim, ksize, heads", [(40, 4, 4), (700, 3, 6), (24, 2, 3)])
def test_conv_gates_decode(gen, dtype, conv_dim, ksize, heads):
    """The conv's output and shifted state, g and beta, equal `causal_conv1d_update` +
    `gdn_gates` on rows of a wider projection (strided), other slots untouched."""
    from luceio.kernels.delta_rule_triton import conv_gates_decode
    n, num_slots = 3, 5
    proj = rnd(gen, n, conv_dim + 2 * heads + 5, dtype=dtype)
    x, b, a = proj[:, :conv_dim], proj[:, conv_dim:conv_dim + heads], \
        proj[:, conv_dim + heads:conv_dim + 2 * heads]
    a = a * 8  # softplus past its threshold of 20 too
    state = rnd(gen, num_slots, conv_dim, ksize - 1, dtype=dtype)
    weight = rnd(gen, conv_dim, ksize, dtype=dtype, scale=0.5)
    A_log = rnd(gen, heads, scale=0.5)
    dt_bias = rnd(gen, heads, scale=8.0)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    ref_state = state.clone()
    ref = delta_rule.causal_conv1d_update(x, ref_state, weight, slots)
    ref_g, ref_beta = delta_rule.gdn_gates(a, b, A_log, dt_bias)
    out, g, beta = conv_gates_decode(x, state, weight, a, b, A_log, dt_bias, slots)
    check(out, ref, TOL[dtype], gen, "conv")
    assert torch.equal(state.cpu(), ref_state.cpu())  # the shift moves values, no arithmetic
    check(g, ref_g, TOL[torch.float32], gen, "g")
    check(beta, ref_beta.float(), TOL[torch.float32], gen, "beta")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, v", [(4, 8), (3, 128)])
def test_gated_rms_norm(gen, dtype, heads, v):
    from luceio.kernels.delta_rule_triton import gated_rms_norm
    n = 3
    o = rnd(gen, n, heads, v, dtype=dtype)
    z = rnd(gen, n, heads * v + 7, dtype=dtype)[:, :heads * v].reshape(n, heads, v)
    w = rnd(gen, v, dtype=dtype, scale=0.5) + 1
    check(gated_rms_norm(o, z, w, 1e-6), delta_rule.gated_rms_norm(o, z, w, 1e-6), TOL[dtype],
          gen, "gated norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim", [(4, 2, 16, 4), (3, 3, 24, 12),
                                                                    (2, 1, 16, 16)])
def test_gated_qkv_rope_cache(gen, dtype, heads, kv_heads, head_dim, rotary_dim):
    """Qwen3.5's attention input stage in one launch against its torch sequence: (1 + w) q/k
    norms, partial RoPE, k and v written at their slots (-1: skipped), other slots untouched."""
    from luceio.kernels import write_kv_ref
    from luceio.kernels.gated_qkv_triton import gated_qkv_rope_cache
    from luceio.kernels.norm import gemma_rms_norm_ref as norm
    from luceio.kernels.rotary import build_cos_sin_cache
    from luceio.models.qwen3_5 import partial_rope
    n, page, blocks = 5, 4, 3
    qkv = rnd(gen, n, heads * 2 * head_dim + 2 * kv_heads * head_dim, dtype=dtype)
    qn, kn = rnd(gen, head_dim, scale=0.3), rnd(gen, head_dim, scale=0.3)
    cos_sin = build_cos_sin_cache(rotary_dim, 64, 10000.0).to(DEVICE)
    positions = torch.tensor([3, 9, 0, 40, 17], device=DEVICE)
    slots = torch.tensor([5, 0, -1, 11, 2], device=DEVICE)
    k_cache = rnd(gen, blocks, page, kv_heads, head_dim, dtype=dtype)
    v_cache = rnd(gen, blocks, page, kv_heads, head_dim, dtype=dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    qg, k, v = qkv.split([heads * 2 * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    qg = qg.reshape(n, heads, 2 * head_dim)
    cs = cos_sin.index_select(0, positions)
    want_q = partial_rope(norm(qg[..., :head_dim], qn, 1e-6), cs, rotary_dim)
    want_k = partial_rope(norm(k.reshape(n, kv_heads, head_dim), kn, 1e-6), cs, rotary_dim)
    write_kv_ref(want_k.contiguous(), v.reshape(n, kv_heads, head_dim).contiguous(), ref_k,
                 ref_v, slots)
    q = gated_qkv_rope_cache(qkv, positions, cos_sin, k_cache, v_cache, slots, heads, kv_heads,
                             rotary_dim, qn, kn, 1e-6)
    check(q, want_q, TOL[dtype], gen, "q")
    check(k_cache, ref_k, TOL[dtype], gen, "k cache")
    assert torch.equal(v_cache.cpu(), ref_v.cpu())


GDN_TILES = {"table": {},  # the arch's entry (interpreted: "default", 32-token chunks)
             "t64": dict(gdn_block_t=64, gdn_block_v=16, gdn_dot_precision="tf32"),
             "wide": dict(gdn_wide_min_programs=1, gdn_wide_block_t=16, gdn_wide_block_v=64),
             "blocked": dict(gdn_block_t=32, gdn_inverse_blocks=True)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_heads,v_heads,k_dim,v_dim,tiled,tile", [
    (2, 4, 32, 48, False, "table"), (1, 2, 128, 32, True, "table"),
    (2, 4, 32, 48, False, "t64"), (1, 2, 32, 48, True, "wide"),
    (2, 4, 128, 32, False, "blocked")])
def test_gdn_prefill(gen, dtype, k_heads, v_heads, k_dim, v_dim, tiled, tile):
    """The chunked prefill kernels (kernels/delta_rule_prefill_triton.py) against
    `gated_delta_rule_chunked`: sequences of 1, 37, 70 and 0 tokens (32-token chunks: one
    partial, one crossing two boundaries, an empty sequence) continuing from random states in
    slots 3, 0, 5, 1 (the other slots untouched), grouped and tiled v heads, a v_dim that is
    not a multiple of the state's column blocks; other tiles: 64-token chunks, 16-token chunks
    of the wide tile, the inverse from 16 x 16 blocks."""
    import dataclasses

    from luceio.kernels import configs
    from luceio.kernels.delta_rule_prefill_triton import gdn_prefill
    with configs.use_config(dataclasses.replace(configs.get_config(torch.device(DEVICE)), **GDN_TILES[tile])):
        _check_gdn_prefill(gen, dtype, k_heads, v_heads, k_dim, v_dim, tiled, gdn_prefill)


def _check_gdn_prefill(gen, dtype, k_heads, v_heads, k_dim, v_dim, tiled, gdn_prefill):
    import itertools
    lens = [1, 37, 70, 0]
    n = sum(lens)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)
    q, k = (rnd(gen, n, k_heads, k_dim, dtype=dtype) for _ in "qk")
    v = rnd(gen, n, v_heads, v_dim, dtype=dtype)
    g = (-torch.rand(n, v_heads, generator=gen.g) * 0.5).to(DEVICE)  # fp32, as gdn_gates gives
    beta = torch.rand(n, v_heads, generator=gen.g).to(dtype).to(DEVICE)
    state = rnd(gen, 6, v_heads, k_dim, v_dim, scale=0.5)
    slots = torch.tensor([3, 0, 5, 1], device=DEVICE)
    want_state = state.clone()
    want = delta_rule.gated_delta_rule_chunked(q, k, v, g, beta, want_state, cu, slots,
                                               tiled=tiled)
    got = gdn_prefill(q, k, v, g, beta, state, cu, slots, tiled=tiled)
    check(got, want, TOL[dtype], gen, "outputs")
    # natively, 16-bit inputs may take TF32 products (the arch config's gdn_dot_precision)
    check(state, want_state, TOL[torch.float32 if INTERPRETED else dtype], gen, "states")
    assert torch.equal(state[[2, 4]], want_state[[2, 4]])


@pytest.mark.parametrize("tile", ["table", "t64", "blocked"])
def test_gdn_prefill_correlated_keys(gen, tile):
    """Keys sharing one direction (mean cosine ~0.8 within a chunk, beta near 1, slow decay):
    the chunk's triangular system is far from the identity, where inverting it by products of
    powers of A lost every digit (errors of ~5 at 64-token chunks, NaN in TF32); forward
    substitution matches the reference. Two sequences of 130 and 64 tokens (whole chunks)."""
    import dataclasses

    from luceio.kernels import configs
    from luceio.kernels.delta_rule_prefill_triton import gdn_prefill
    lens, heads, dim = [130, 64], 2, 32
    n = sum(lens)
    cu = torch.tensor([0, 130, 194], dtype=torch.int32, device=DEVICE)
    shared = torch.randn(heads, dim, generator=gen.g) * 2.0
    q = rnd(gen, n, heads, dim, dtype=torch.float16)
    k = (torch.randn(n, heads, dim, generator=gen.g) + shared).to(torch.float16).to(DEVICE)
    v = rnd(gen, n, heads, dim, dtype=torch.float16)
    g = (-torch.rand(n, heads, generator=gen.g) * 0.02).to(DEVICE)
    beta = (0.9 + 0.1 * torch.rand(n, heads, generator=gen.g)).to(torch.float16).to(DEVICE)
    state = rnd(gen, 2, heads, dim, dim, scale=0.5)
    slots = torch.tensor([1, 0], device=DEVICE)
    want_state = state.clone()
    want = delta_rule.gated_delta_rule_chunked(q, k, v, g, beta, want_state, cu, slots)
    with configs.use_config(dataclasses.replace(configs.get_config(torch.device(DEVICE)),
                                                **GDN_TILES[tile])):
        got = gdn_prefill(q, k, v, g, beta, state, cu, slots)
    tol = dict(atol=2e-2, rtol=2e-2) if not INTERPRETED else TOL[torch.float16]
    check(got, want, tol, gen, "outputs")
    check(state, want_state, tol, gen, "states")
