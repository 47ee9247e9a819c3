"""Quantized experts on the GPU's graph-capturable decode path (`kernels/moe_quant_triton.py`),
on the CPU under TRITON_INTERPRET=1: the stacked-expert GEMVs equal the per-expert path
(`moe.per_expert_moe` over the same quantized weights) for Q8_0/Q5_0 and Q4_K/Q6_K stacks, a
shared expert included; a tiny GGUF with quantized gate/up and down stacks loads them stacked
(per-expert weights are views, the model keeps CUDA graphs) and decodes the torch reference's
greedy tokens on the Triton kernels (its prefill steps, of more than 8 tokens, run the
per-expert path on the quantized GEMM kernel: the test that covered that path alone, with a
dense down, moved here from test_moe.py)."""
import dataclasses

import pytest
import torch

from conftest import make_tiny_moe
from luceio import kernels
from luceio.kernels.moe import per_expert_moe, route_topk_ref
from luceio.kernels.configs import get_config, use_config
from luceio.kernels.quant import cat_rows, random_quant_weight

pytest.importorskip("triton")


def _wide_tiles():
    """The CPU's table with 16 GEMV rows a program: 4x fewer programs for the interpreter."""
    return use_config(dataclasses.replace(get_config(torch.device("cpu")), gemv_block_n=16))


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    from test_kernels import INTERPRETED
    if not INTERPRETED:
        pytest.skip("CPU tensors on the Triton kernels need the interpreter")
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")


@pytest.mark.parametrize("qgu,qd,experts,inter,hidden,tokens", [
    ("q8_0", "q5_0", 4, 64, 96, 1), ("q8_0", "q5_0", 4, 64, 96, 3),
    ("q4_k", "q6_k", 3, 256, 256, 1)])
def test_stacked_experts_equal_per_expert_path(qgu, qd, experts, inter, hidden, tokens):
    from luceio.kernels.moe_quant_triton import moe_decode_quant
    g = torch.Generator().manual_seed(tokens)
    gate_up = [cat_rows([random_quant_weight(qgu, inter, hidden, generator=g) for _ in "gu"])
               for _ in range(experts)]
    down = [random_quant_weight(qd, hidden, inter, generator=g) for _ in range(experts)]
    stacks = [kernels.prepare_weight(cat_rows(ws), torch.float32) for ws in (gate_up, down)]
    each = [(kernels.prepare_weight(a, torch.float32), kernels.prepare_weight(b, torch.float32))
            for a, b in zip(gate_up, down)]
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = route_topk_ref(torch.randn(tokens, experts, generator=g), 2, True)
    shared = (torch.randn(tokens, hidden, generator=g), torch.randn(tokens, 1, generator=g))
    with _wide_tiles():
        want = per_expert_moe(x, each, weights, ids, kernels.linear)
        got = moe_decode_quant(x, *stacks, inter, weights, ids)
        with_shared = moe_decode_quant(x, *stacks, inter, weights, ids, *shared)
    # fp32: the two paths differ in the order the k rows are summed only
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got = with_shared
    torch.testing.assert_close(got, want + torch.sigmoid(shared[1]) * shared[0], rtol=1e-5,
                               atol=1e-6)


def test_gguf_stacked_experts_decode_as_the_reference(tmp_path, monkeypatch):
    """Q8_0 gate/up and down stacks (expert width 64): on the Triton kernels the sparse layers
    hold stacks, the per-expert weights are views of them, no layer routes on the host; greedy
    tokens equal the torch reference's."""
    import gguf

    from conftest import engine_kwargs
    from luceio import LLM, SamplingParams
    from luceio.models.moe import routes_on_host
    from test_moe import _write_gguf
    folder = make_tiny_moe(str(tmp_path / "moe"), "e4k2", seed=4, moe_intermediate_size=64)
    path = str(tmp_path / "q8.gguf")
    q8 = gguf.GGMLQuantizationType.Q8_0
    _write_gguf(folder, path, quant=q8, quant_down=q8)
    model = LLM(path, **engine_kwargs()).engine.runner.model
    block = model.layers[1].mlp
    gate_up, down = block.q_stacks
    assert gate_up.shape == (4 * 2 * 64, 64) and down.shape == (4 * 64, 64)
    for e, (gu, d) in enumerate(block.q_experts):  # views into the stacks
        assert gu.qs.data_ptr() == gate_up.qs[e * 128].data_ptr()
        assert d.qs.data_ptr() == down.qs[e * 64].data_ptr()
    assert not routes_on_host(model)
    # a 12-token prompt's prefill (16 tokens in the first step: per expert), then decode steps
    # of 2 tokens (stacked)
    prompts = [{"prompt_token_ids": [5, 9, 33, 70] * 3}, {"prompt_token_ids": [6, 9, 34, 71]}]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kw = engine_kwargs(max_num_batched_tokens=16)
    from luceio.kernels import moe_quant_triton
    calls, run = [], moe_quant_triton.moe_decode_quant
    monkeypatch.setattr(moe_quant_triton, "moe_decode_quant",
                        lambda x, *a, **k: calls.append(x.shape[0]) or run(x, *a, **k))
    with _wide_tiles():
        got = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, params)]
    assert calls and max(calls) <= 8  # decode steps took the stacked path
    monkeypatch.setenv("LUCEIO_KERNELS", "torch")
    reference = LLM(path, **kw)
    assert reference.engine.runner.model.layers[1].mlp.q_stacks is None
    assert got == [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
