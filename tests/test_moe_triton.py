"""The fused MoE Triton kernel (`kernels/moe_triton.py`) against `moe.fused_moe_ref`, on CPU
under TRITON_INTERPRET=1, and a tiny Qwen3-MoE run on the Triton kernels against the torch path.

Tolerances (kernel vs the reference in the same dtype, outputs of magnitude ~1):
  fp32: atol 1e-5, rtol 1e-5 (GEMM summation order only)
  fp16: atol 2e-3, rtol 2e-3 (an intermediate rounding that flips one ulp, and a token's k rows
        added with one rounding where the reference rounds after each add)
Inputs are random from a seed fixed per test (`conftest.seed_for`; LUCEIO_TEST_RANDOM=1 draws
fresh ones); every assertion message carries the seed (LUCEIO_TEST_SEED=<seed> replays one).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from conftest import engine_kwargs  # noqa: E402
from luceio import LLM, SamplingParams  # noqa: E402
from luceio.kernels import configs, triton_ops  # noqa: E402
from luceio.kernels.configs import KernelConfig  # noqa: E402
from luceio.kernels.moe import DECODE_MAX_TOKENS, fused_moe_ref, route_topk_ref  # noqa: E402
from luceio.kernels.moe_triton import align_pairs  # noqa: E402
from test_kernels import DEVICE, check, gen, rnd  # noqa: E402,F401  (gen: the seeded fixture)
from test_moe import _prompts, moe_models  # noqa: E402,F401  (moe_models: a fixture)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
# small tiles so hidden 64 / inter 48 cross column and K tile edges (48 = 32 + a masked 16)
SMALL = KernelConfig(moe_block_m=16, moe_block_n=32, moe_block_k=32, source="test")


def _routing(g, num_tokens, num_experts, top_k, dtype, idle=()):
    """Router logits that never pick the experts in `idle` (they get no pairs)."""
    logits = rnd(g, num_tokens, num_experts, dtype=torch.float32, scale=2.0)
    logits[:, list(idle)] = -1e4
    return route_topk_ref(logits.to(dtype), top_k, renormalize=bool(top_k % 2))


@pytest.mark.parametrize("num_tokens,num_experts,top_k,idle", [
    (1, 4, 1, ()), (1, 6, 3, ()), (5, 4, 2, (1,)), (40, 6, 3, (0, 4)), (40, 5, 2, ())])
def test_align_pairs(gen, num_tokens, num_experts, top_k, idle):
    """Every pair once, in stable expert order; each tile one expert's; padding past each group."""
    _, expert_ids = _routing(gen, num_tokens, num_experts, top_k, torch.float32, idle)
    block_m = 16
    sorted_ids, tile_expert = align_pairs(expert_ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    flat = expert_ids.flatten().cpu()
    tiles = sorted_ids.cpu().view(-1, block_m).tolist()
    got = []
    for expert, rows in zip(tile_expert.tolist(), tiles):
        pairs = [p for p in rows if p != num_pairs]
        assert rows == pairs + [num_pairs] * (block_m - len(pairs)), gen.seed_value
        if expert < 0:
            assert not pairs, gen.seed_value
        assert all(flat[p] == expert for p in pairs), gen.seed_value
        got += pairs
    assert got == torch.argsort(flat, stable=True).tolist(), gen.seed_value
    assert len(tiles) == num_pairs // block_m + min(num_experts, num_pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,idle", [
    (1, 4, 2, ()),          # decode: one token
    (3, 6, 3, (2,)),        # a few tokens, an idle expert
    (40, 4, 1, ()),         # prefill, top-1: groups longer than a tile
    (37, 6, 3, (0, 5)),     # prefill, two idle experts, ragged groups
])
def test_fused_moe_matches_reference(gen, dtype, num_tokens, num_experts, top_k, idle):
    from luceio.kernels.moe_triton import fused_moe
    hidden, inter = 64, 48
    x = rnd(gen, num_tokens, hidden, dtype=dtype)
    w_gate_up = rnd(gen, num_experts, 2 * inter, hidden, dtype=dtype, scale=hidden ** -0.5)
    w_down = rnd(gen, num_experts, hidden, inter, dtype=dtype, scale=inter ** -0.5)
    weights, expert_ids = _routing(gen, num_tokens, num_experts, top_k, dtype, idle)
    with configs.use_config(SMALL):
        out = fused_moe(x, w_gate_up, w_down, weights, expert_ids)
    ref = fused_moe_ref(x, w_gate_up, w_down, weights, expert_ids)
    assert out.dtype == dtype and out.shape == ref.shape
    check(out, ref, TOL[dtype], gen, f"fused_moe {dtype} T={num_tokens} E={num_experts} k={top_k}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,renorm", [
    (1, 6, 2, True), (3, 40, 8, True), (5, 7, 3, False)])
def test_route_topk_kernel_matches_reference(gen, dtype, num_tokens, num_experts, top_k, renorm):
    from luceio.kernels.moe_decode_triton import route_topk
    # distinct logits in every row: a tie (two fp16 draws rounding to one value) may be broken
    # either way, which would fail the exact id comparison for some seeds
    ranks = torch.stack([torch.randperm(num_experts, generator=gen.g) for _ in range(num_tokens)])
    logits = ((ranks.float() - num_experts / 2) * 0.125
              + 0.01 * torch.rand(num_tokens, num_experts, generator=gen.g)).to(dtype).to(DEVICE)
    weights, ids = route_topk(logits, top_k, renorm)
    ref_w, ref_ids = route_topk_ref(logits, top_k, renorm)
    assert torch.equal(ids.cpu(), ref_ids.cpu()), gen.seed_value
    assert weights.dtype == dtype
    check(weights, ref_w, TOL[dtype], gen, "routing weights")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (3, 6, 3), (8, 5, 5)])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_decode_matches_reference(gen, dtype, num_tokens, num_experts, top_k, shared):
    """The few-token path (one-row GEMVs per pair, hidden 200 / inter 150 across its K and
    column tiles), with a shared expert's sum in its epilogue."""
    from luceio.kernels.moe_decode_triton import moe_decode
    hidden, inter = 200, 150
    x = rnd(gen, num_tokens, hidden, dtype=dtype)
    w_gate_up = rnd(gen, num_experts, 2 * inter, hidden, dtype=dtype, scale=hidden ** -0.5)
    w_down = rnd(gen, num_experts, hidden, inter, dtype=dtype, scale=inter ** -0.5)
    weights, expert_ids = _routing(gen, num_tokens, num_experts, top_k, dtype)
    ref = fused_moe_ref(x, w_gate_up, w_down, weights, expert_ids)
    extra = ()
    if shared:
        extra = (rnd(gen, num_tokens, hidden, dtype=dtype), rnd(gen, num_tokens, 1, dtype=dtype))
        ref = ref + torch.sigmoid(extra[1]) * extra[0]
    out = moe_decode(x, w_gate_up, w_down, weights, expert_ids, *extra)
    check(out, ref, TOL[dtype], gen, f"moe_decode {dtype} T={num_tokens} k={top_k}")


@pytest.mark.parametrize("arch", ["sm_90"])
def test_moe_decode_on_a_table_rows_tiles(gen, arch):
    """The few-token path with an arch's own tiles (sm_90: 4 gate/up columns a program and K in
    steps of 1024, past hidden here; down 8 columns, K in 256s): a tile shape is checked here
    before a GPU runs it."""
    from dataclasses import replace

    from luceio.kernels.moe_decode_triton import moe_decode
    row = configs.TABLE[arch]
    cfg = replace(configs.TABLE["default"], **{f: getattr(row, f) for f in (
        "moe_decode_gu_block_n", "moe_decode_gu_block_k", "moe_decode_gu_num_warps",
        "moe_decode_down_block_n", "moe_decode_down_block_k", "moe_decode_down_num_warps")})
    hidden, inter, num_tokens, num_experts, top_k = 200, 150, 3, 6, 3
    x = rnd(gen, num_tokens, hidden)
    w_gate_up = rnd(gen, num_experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w_down = rnd(gen, num_experts, hidden, inter, scale=inter ** -0.5)
    weights, expert_ids = _routing(gen, num_tokens, num_experts, top_k, torch.float32)
    with configs.use_config(cfg):
        out = moe_decode(x, w_gate_up, w_down, weights, expert_ids)
    check(out, fused_moe_ref(x, w_gate_up, w_down, weights, expert_ids), TOL[torch.float32], gen,
          f"moe_decode on {arch}'s tiles")


def test_greedy_on_triton_kernels_matches_torch_path(moe_models, monkeypatch):
    """A tiny Qwen3-MoE (4 experts, top-2) with LUCEIO_KERNELS=triton: the sparse blocks run
    the fused kernel, and prefill and decode give the torch path's greedy tokens."""
    from test_kernels import INTERPRETED
    if not INTERPRETED:
        pytest.skip("a CPU engine on the Triton kernels needs the interpreter")
    path = moe_models["e4k2"]
    prompts = _prompts(2, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)

    def run():
        outs = LLM(path, **engine_kwargs()).generate([{"prompt_token_ids": p} for p in prompts],
                                                    params)
        return [o.outputs[0] for o in outs]

    monkeypatch.setenv("LUCEIO_KERNELS", "torch")
    torch_outs = run()
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    from luceio.kernels import moe_decode_triton
    row_counts, decode_counts = [], []
    kernel, decode = triton_ops.fused_moe, moe_decode_triton.moe_decode
    monkeypatch.setattr(triton_ops, "fused_moe",
                        lambda x, *a, **kw: row_counts.append(x.shape[0]) or kernel(x, *a, **kw))
    monkeypatch.setattr(moe_decode_triton, "moe_decode",
                        lambda x, *a, **kw: decode_counts.append(x.shape[0]) or decode(x, *a, **kw))
    triton_outs = run()
    # the prefills ran the grouped kernel, the decode steps of both requests the few-token path
    assert min(row_counts) > DECODE_MAX_TOKENS
    assert decode_counts and decode_counts[-1] == len(prompts)
    for t, r in zip(triton_outs, torch_outs):
        assert t.token_ids == r.token_ids
        for step, (tok, lp) in enumerate(zip(t.token_ids, t.logprobs)):
            assert lp[tok].logprob == pytest.approx(r.logprobs[step][tok].logprob, abs=1e-4)
