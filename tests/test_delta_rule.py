"""Gated DeltaNet references (luceio/kernels/delta_rule.py) against transformers' own torch code.

Oracles: transformers' `torch_recurrent_gated_delta_rule`, `torch_chunk_gated_delta_rule`,
`causal_conv1d_fn` / `causal_conv1d_update`, `Qwen3NextRMSNormGated`, and a whole
`Qwen3_5GatedDeltaNet` layer run over the full sequence. fp32, small sizes, CPU.
"""
from __future__ import annotations

import inspect

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from luceio.kernels.delta_rule import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_rms_norm,
    gdn_gates,
)

ATOL = 1e-5
RTOL = 1e-5
NUM_K_HEADS, NUM_V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8   # two v heads per k head
KERNEL_SIZE, CONV_DIM = 4, 12
NUM_SLOTS = 6

# transformers swaps these for flash-linear-attention / causal-conv1d kernels when those packages are
# importable; the oracle must stay its own torch code.
TORCH_PATHS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
               "causal_conv1d_fn", "causal_conv1d_update")
torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule, causal_conv1d_fn, hf_conv_update = (
    inspect.unwrap(getattr(hf, name)) for name in TORCH_PATHS)


def _tokens(num_tokens: int, gen: torch.Generator):
    """Random q, k, v, g, beta for `num_tokens` flat tokens; g spans weak to strong decay."""
    q = torch.randn(num_tokens, NUM_K_HEADS, K_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_K_HEADS, K_DIM, generator=gen)
    v = torch.randn(num_tokens, NUM_V_HEADS, V_DIM, generator=gen)
    g = -torch.rand(num_tokens, NUM_V_HEADS, generator=gen) * 2.0
    beta = torch.rand(num_tokens, NUM_V_HEADS, generator=gen)
    return q, k, v, g, beta


def _state_pool(gen: torch.Generator):
    return torch.randn(NUM_SLOTS, NUM_V_HEADS, K_DIM, V_DIM, generator=gen)


def _hf_recurrent(q, k, v, g, beta, s0):
    """One sequence through transformers' token-by-token form; returns (o, final state)."""
    o, s = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                            initial_state=s0[None], output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    return o[0], s[0]


def _hf_chunk(q, k, v, g, beta, s0):
    o, s = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                        initial_state=s0[None], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    return o[0], s[0]


def test_recurrent_matches_transformers_with_slots():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = _tokens(3, gen)
    state = _state_pool(gen)
    slots = torch.tensor([4, 0, 2])
    before = state.clone()
    o = gated_delta_rule_recurrent(q, k, v, g, beta, state, slots)
    for i, slot in enumerate(slots.tolist()):
        ref_o, ref_s = _hf_recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1],
                                     before[slot])
        torch.testing.assert_close(o[i], ref_o[0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(state[slot], ref_s, atol=ATOL, rtol=RTOL)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("chunk_size", [64, 5])
def test_chunked_varlen_matches_transformers(chunk_size):
    """A varlen batch equals each sequence alone through transformers (token-by-token and its own
    chunked form), from a non-zero initial state, for chunks that do and do not divide lengths."""
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 7, 70, 20]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, g, beta = _tokens(sum(lengths), gen)
    state = _state_pool(gen)
    before = state.clone()
    slots = torch.tensor([3, 5, 1, 0])
    o = gated_delta_rule_chunked(q, k, v, g, beta, state, cu_seqlens, slots, chunk_size=chunk_size)
    for i, slot in enumerate(slots.tolist()):
        seq = slice(cu_seqlens[i], cu_seqlens[i + 1])
        args = (q[seq], k[seq], v[seq], g[seq], beta[seq], before[slot])
        for oracle in (_hf_recurrent, _hf_chunk):
            ref_o, ref_s = oracle(*args)
            torch.testing.assert_close(o[seq], ref_o, atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(state[slot], ref_s, atol=ATOL, rtol=RTOL)
    assert torch.equal(state[[2, 4]], before[[2, 4]])


@pytest.mark.parametrize("cuts", [[], [37], [1, 64], [10, 11, 50]])
def test_chunked_prefill_split_anywhere(cuts):
    """A 90-token prompt fed as engine chunks cut at `cuts` gives the outputs and final state of
    one chunk; a second sequence in the same batches is cut differently."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta = _tokens(90, gen)
    pool = _state_pool(gen)
    whole = pool.clone()
    o_whole = gated_delta_rule_chunked(q, k, v, g, beta, whole, torch.tensor([0, 90]),
                                       torch.tensor([2]), chunk_size=16)
    pieces = pool.clone()
    bounds = [0, *cuts, 90]
    o_pieces = torch.cat([
        gated_delta_rule_chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], pieces,
                                 torch.tensor([0, b - a]), torch.tensor([2]), chunk_size=16)
        for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(o_pieces, o_whole, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(pieces, whole, atol=ATOL, rtol=RTOL)


def test_decode_after_prefill_equals_one_prefill():
    """Chunked prefill of 25 tokens then 6 recurrent decode steps == the chunked form over all 31,
    for two sequences decoded together."""
    gen = torch.Generator().manual_seed(3)
    seq_len, prompt_len = 31, 25
    inputs = [_tokens(seq_len, gen) for _ in range(2)]
    pool = _state_pool(gen)
    slots = torch.tensor([1, 4])
    ref_pool = pool.clone()
    ref = [gated_delta_rule_chunked(*x, ref_pool, torch.tensor([0, seq_len]), slots[i:i + 1])
           for i, x in enumerate(inputs)]
    prompt = [torch.cat([x[j][:prompt_len] for x in inputs]) for j in range(5)]
    gated_delta_rule_chunked(*prompt, pool, torch.tensor([0, prompt_len, 2 * prompt_len]), slots)
    for t in range(prompt_len, seq_len):
        step = [torch.stack([x[j][t] for x in inputs]) for j in range(5)]
        o = gated_delta_rule_recurrent(*step, pool, slots)
        for i in range(2):
            torch.testing.assert_close(o[i], ref[i][t], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(pool, ref_pool, atol=ATOL, rtol=RTOL)


def test_negative_control_decay_sign_and_beta():
    """The tolerance used above does catch the classic mistakes: a decay applied as exp(-g), and
    a write without beta, each miss transformers' output by far more than ATOL."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, g, beta = _tokens(12, gen)
    s0 = _state_pool(gen)[0]
    ref_o, ref_s = _hf_recurrent(q, k, v, g, beta, s0)
    cu_seqlens, slots = torch.tensor([0, 12]), torch.tensor([0])
    for wrong_g, wrong_beta in ((-g, beta), (g, torch.ones_like(beta)), (g, beta * 0.5)):
        state = s0[None].clone()
        o = gated_delta_rule_chunked(q, k, v, wrong_g, wrong_beta, state, cu_seqlens, slots)
        assert (o - ref_o).abs().max() > 100 * ATOL
        assert (state[0] - ref_s).abs().max() > 100 * ATOL
    state = s0[None].clone()
    o = gated_delta_rule_chunked(q, k, v, g, beta, state, cu_seqlens, slots)
    torch.testing.assert_close(o, ref_o, atol=ATOL, rtol=RTOL)


def test_causal_conv_varlen_matches_transformers():
    """Fresh sequences (zeroed slots) equal transformers' causal_conv1d_fn; each slot then holds
    the last kernel_size - 1 inputs, zero-padded for a sequence shorter than that."""
    gen = torch.Generator().manual_seed(5)
    lengths = [2, 9, 1]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(sum(lengths), CONV_DIM, generator=gen)
    weight = torch.randn(CONV_DIM, KERNEL_SIZE, generator=gen)
    conv_state = torch.randn(NUM_SLOTS, CONV_DIM, KERNEL_SIZE - 1, generator=gen)
    slots = torch.tensor([5, 0, 3])
    conv_state[slots] = 0
    out = causal_conv1d_varlen(x, conv_state, weight, cu_seqlens, slots)
    for i, slot in enumerate(slots.tolist()):
        seq = x[cu_seqlens[i]:cu_seqlens[i + 1]]
        ref = causal_conv1d_fn(seq.T[None], weight, None, activation="silu")[0].T
        torch.testing.assert_close(out[cu_seqlens[i]:cu_seqlens[i + 1]], ref, atol=ATOL, rtol=RTOL)
        padded = torch.cat([torch.zeros(KERNEL_SIZE - 1, CONV_DIM), seq])
        assert torch.equal(conv_state[slot], padded[-(KERNEL_SIZE - 1):].T)


def test_causal_conv_update_matches_transformers_and_split():
    """Decode steps equal transformers' causal_conv1d_update; and a sequence fed as pieces of
    1, 2 and 5 tokens (varlen, then the decode form) equals it fed whole."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(CONV_DIM, KERNEL_SIZE, generator=gen)
    conv_state = torch.randn(NUM_SLOTS, CONV_DIM, KERNEL_SIZE - 1, generator=gen)
    slots = torch.tensor([2, 4])
    # transformers keeps kernel_size inputs; the oldest one never reaches a decode output
    hf_state = torch.cat([torch.randn(2, CONV_DIM, 1, generator=gen), conv_state[slots]], dim=-1)
    for _ in range(3):
        x = torch.randn(2, CONV_DIM, generator=gen)
        ref = hf_conv_update(x[:, :, None], hf_state, weight, None, "silu")[:, :, 0]
        torch.testing.assert_close(causal_conv1d_update(x, conv_state, weight, slots), ref,
                                   atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(conv_state[slots], hf_state[:, :, 1:], atol=0, rtol=0)

    x = torch.randn(8, CONV_DIM, generator=gen)
    whole, pieces = conv_state.clone(), conv_state.clone()
    out_whole = causal_conv1d_varlen(x, whole, weight, torch.tensor([0, 8]), torch.tensor([1]))
    out_pieces = [causal_conv1d_varlen(x[0:1], pieces, weight, torch.tensor([0, 1]), torch.tensor([1])),
                  causal_conv1d_varlen(x[1:3], pieces, weight, torch.tensor([0, 2]), torch.tensor([1]))]
    out_pieces += [causal_conv1d_update(x[t:t + 1], pieces, weight, torch.tensor([1])) for t in range(3, 8)]
    torch.testing.assert_close(torch.cat(out_pieces), out_whole, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(pieces, whole, atol=ATOL, rtol=RTOL)


def test_gated_rms_norm_matches_transformers():
    gen = torch.Generator().manual_seed(7)
    norm = hf.Qwen3NextRMSNormGated(V_DIM, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(V_DIM, generator=gen))
    x, z = torch.randn(2, 5, NUM_V_HEADS, V_DIM, generator=gen).unbind(0)
    with torch.no_grad():
        ref = norm(x.reshape(-1, V_DIM), z.reshape(-1, V_DIM)).reshape(x.shape)
    torch.testing.assert_close(gated_rms_norm(x, z, norm.weight, 1e-6), ref, atol=ATOL, rtol=RTOL)


def _tiny_layer(gen: torch.Generator) -> modeling_qwen3_5.Qwen3_5GatedDeltaNet:
    config = Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=NUM_K_HEADS,
                               linear_num_value_heads=NUM_V_HEADS, linear_key_head_dim=K_DIM,
                               linear_value_head_dim=V_DIM, linear_conv_kernel_dim=KERNEL_SIZE,
                               num_hidden_layers=1, layer_types=["linear_attention"])
    layer = modeling_qwen3_5.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.ndim > 1 else 1.0))
    return layer


def _our_layer(layer, hidden, conv_state, state, cu_seqlens, slots, decode: bool):
    """The layer composed from delta_rule's functions over flat tokens: hidden [num_tokens, 32]."""
    key_dim = NUM_K_HEADS * K_DIM
    mixed = layer.in_proj_qkv(hidden)
    weight = layer.conv1d.weight[:, 0]                                # [conv_dim, kernel_size]
    if decode:
        mixed = causal_conv1d_update(mixed, conv_state, weight, slots)
    else:
        mixed = causal_conv1d_varlen(mixed, conv_state, weight, cu_seqlens, slots)
    q, k, v = mixed.split([key_dim, key_dim, NUM_V_HEADS * V_DIM], dim=-1)
    q, k = (x.reshape(-1, NUM_K_HEADS, K_DIM) for x in (q, k))
    v = v.reshape(-1, NUM_V_HEADS, V_DIM)
    g, beta = gdn_gates(layer.in_proj_a(hidden), layer.in_proj_b(hidden), layer.A_log, layer.dt_bias)
    if decode:
        o = gated_delta_rule_recurrent(q, k, v, g, beta, state, slots)
    else:
        o = gated_delta_rule_chunked(q, k, v, g, beta, state, cu_seqlens, slots, chunk_size=8)
    z = layer.in_proj_z(hidden).reshape(-1, NUM_V_HEADS, V_DIM)
    o = gated_rms_norm(o, z, layer.norm.weight, layer.norm.variance_epsilon)
    return layer.out_proj(o.reshape(o.shape[0], -1))


@torch.no_grad()
def test_whole_layer_prefill_pieces_then_decode_matches_transformers(monkeypatch):
    """Qwen3_5GatedDeltaNet over whole sequences (no cache) == our functions composed: gates,
    head grouping, conv, norm; two sequences prefilled together in two engine chunks, then
    decoded together token by token."""
    for name in TORCH_PATHS:
        monkeypatch.setattr(modeling_qwen3_5, name, inspect.unwrap(getattr(modeling_qwen3_5, name)))
    gen = torch.Generator().manual_seed(8)
    layer = _tiny_layer(gen)
    seq_len = 20
    hidden = torch.randn(2, seq_len, 32, generator=gen)
    ref = layer(hidden)                                               # [2, seq_len, 32]
    conv_state = torch.zeros(NUM_SLOTS, layer.conv_dim, KERNEL_SIZE - 1)
    state = torch.zeros(NUM_SLOTS, NUM_V_HEADS, K_DIM, V_DIM)
    slots = torch.tensor([3, 1])
    for a, b in ((0, 5), (5, 14)):                                    # unequal engine chunks
        flat = torch.cat([hidden[0, a:b], hidden[1, a:b]])
        out = _our_layer(layer, flat, conv_state, state, torch.tensor([0, b - a, 2 * (b - a)]), slots,
                         decode=False)
        torch.testing.assert_close(out, torch.cat([ref[0, a:b], ref[1, a:b]]), atol=ATOL, rtol=RTOL)
    for t in range(14, seq_len):
        out = _our_layer(layer, hidden[:, t], conv_state, state, None, slots, decode=True)
        torch.testing.assert_close(out, ref[:, t], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("k_heads, v_heads, k_dim, v_dim", [(2, 4, 16, 8), (3, 3, 8, 40)])
def test_triton_decode_kernel_matches_reference(k_heads, v_heads, k_dim, v_dim):
    """kernels/delta_rule_triton.py's decode step (interpreted on the CPU) against the torch
    reference: outputs and the updated state rows, the other rows untouched; v_dim 40 spans a
    partial BLOCK_V tile."""
    from test_kernels import INTERPRETED
    if not INTERPRETED:
        pytest.skip("needs the Triton interpreter")
    from luceio.kernels.delta_rule_triton import gdn_decode
    gen = torch.Generator().manual_seed(31)
    n, num_slots = 3, 5
    q = torch.randn(n, k_heads, k_dim, generator=gen)
    k = torch.randn(n, k_heads, k_dim, generator=gen)
    v = torch.randn(n, v_heads, v_dim, generator=gen)
    g = -torch.rand(n, v_heads, generator=gen) * 2.0
    beta = torch.rand(n, v_heads, generator=gen)
    state = torch.randn(num_slots, v_heads, k_dim, v_dim, generator=gen)
    slots = torch.tensor([4, 0, 2])
    ref_state = state.clone()
    ref = gated_delta_rule_recurrent(q, k, v, g, beta, ref_state, slots)
    out = gdn_decode(q, k, v, g, beta, state, slots)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state, ref_state, atol=ATOL, rtol=RTOL)
    assert torch.equal(state[[1, 3]], ref_state[[1, 3]])


def _to_tiled(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Grouped v heads (NUM_K_HEADS groups of 2) -> llama.cpp's tiled order along `dim`."""
    per_k = NUM_V_HEADS // NUM_K_HEADS
    order = torch.arange(NUM_V_HEADS).reshape(NUM_K_HEADS, per_k).T.reshape(-1)
    return x.index_select(dim, order)


def test_tiled_v_head_order_is_the_grouped_one_reordered():
    """The `tiled` forms (GGUF files' v-head order) give the grouped forms' outputs and states
    with the v heads reordered, for decode, chunked prefill and the Triton decode kernel."""
    gen = torch.Generator().manual_seed(41)
    q, k, v, g, beta = _tokens(3, gen)
    state = _state_pool(gen)
    slots = torch.tensor([5, 0, 2])
    want_state = state.clone()
    want = gated_delta_rule_recurrent(q, k, v, g, beta, want_state, slots)
    tiled_state = _to_tiled(state, 1)
    got = gated_delta_rule_recurrent(q, k, _to_tiled(v, 1), _to_tiled(g, 1), _to_tiled(beta, 1),
                                     tiled_state, slots, tiled=True)
    torch.testing.assert_close(got, _to_tiled(want, 1), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(tiled_state, _to_tiled(want_state, 1), atol=ATOL, rtol=RTOL)
    cu = torch.tensor([0, 2, 3])
    q, k, v, g, beta = _tokens(3, gen)
    want_state = state.clone()
    want = gated_delta_rule_chunked(q, k, v, g, beta, want_state, cu, slots[:2], chunk_size=2)
    tiled_state = _to_tiled(state, 1)
    got = gated_delta_rule_chunked(q, k, _to_tiled(v, 1), _to_tiled(g, 1), _to_tiled(beta, 1),
                                   tiled_state, cu, slots[:2], chunk_size=2, tiled=True)
    torch.testing.assert_close(got, _to_tiled(want, 1), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(tiled_state, _to_tiled(want_state, 1), atol=ATOL, rtol=RTOL)
    from test_kernels import INTERPRETED
    if INTERPRETED:
        from luceio.kernels.delta_rule_triton import gdn_decode
        q, k, v, g, beta = _tokens(3, gen)
        ref_state, tri_state = state.clone(), state.clone()
        ref = gated_delta_rule_recurrent(q, k, v, g, beta, ref_state, slots, tiled=True)
        tri = gdn_decode(q, k, v, g, beta, tri_state, slots, tiled=True)
        torch.testing.assert_close(tri, ref, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(tri_state, ref_state, atol=ATOL, rtol=RTOL)
