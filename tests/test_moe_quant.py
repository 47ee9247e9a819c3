"""Quantized experts on the GPU's graph-capturable decode path (`kernels/moe_quant_triton.py`),
on the CPU under TRITON_INTERPRET=1: the stacked-expert GEMVs equal the per-expert path
(`moe.per_expert_moe` over the same quantized weights) for Q8_0/Q5_0 and Q4_K/Q6_K stacks, a
shared expert included; a tiny GGUF with quantized gate/up and down stacks loads them stacked
(per-expert weights are views, the model keeps CUDA graphs) and decodes the torch reference's
greedy tokens on the Triton kernels (its prefill steps, of more than 8 tokens, run the
per-expert path on the quantized GEMM kernel: the test that covered that path alone, with a
dense down, moved here from test_moe.py). Expert offload of quantized stacks: read in place,
equal to the resident stacks and counted; a GGUF's offloaded experts equal to resident ones
(tokens, logprobs); budgets counted in quantized bytes."""
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


def _host_alloc(shape, dtype):
    return torch.empty(shape, dtype=dtype)


def offload_stacks(gate_up, down, inter: int, hidden: int, held: tuple, num_experts: int,
                   host_alloc, slot_alloc):
    """Quantized expert stacks as `ExpertStore.hold_quantized` lays them out: (host stacks
    holding every expert, slot stacks holding experts `held` in that order, the `where` table:
    each expert's slot or -1)."""
    from luceio.kernels.quant_args import laid_out
    host, slots = [], []
    for w, n in ((gate_up, 2 * inter), (down, hidden)):
        host.append(laid_out(w, w.shape[0], host_alloc, copy=True)[0])
        slot = laid_out(w, len(held) * n, slot_alloc, copy=False)[0]
        for s, e in enumerate(held):
            for name, t in slot.tensors().items():
                t[s * n:(s + 1) * n].copy_(w.tensors()[name][e * n:(e + 1) * n])
        slots.append(slot)
    where = torch.full((num_experts,), -1, dtype=torch.int64)
    where[list(held)] = torch.arange(len(held))
    return host, slots, where


@pytest.mark.parametrize("qgu,qd,inter,hidden", [("q8_0", "q5_0", 64, 96),
                                                 ("q4_k", "q6_k", 256, 256)])
def test_offloaded_stacks_read_in_place_equal_resident_and_count(qgu, qd, inter, hidden):
    """Expert offload read in place (`kernels.moe.InPlace` with quantized host stacks): slots
    holding experts 4, 1, 2 in that order, the others read from the host stacks (laid out as
    `ExpertStore.hold_quantized` lays them: q4_k's scale pairs interleaved); the output equals
    the resident stacks' bit for bit, and the gate/up launch counts each expert once (expert
    4 and 0 are picked by two tokens) and its host reads."""
    from luceio.kernels.moe import InPlace
    from luceio.kernels.moe_quant_triton import moe_decode_quant
    experts, held = 6, (4, 1, 2)
    g = torch.Generator().manual_seed(7)
    gate_up = cat_rows([random_quant_weight(qgu, inter, hidden, generator=g)
                        for _ in range(2 * experts)])
    down = cat_rows([random_quant_weight(qd, hidden, inter, generator=g) for _ in range(experts)])
    resident = [kernels.prepare_weight(w, torch.float32) for w in (gate_up, down)]
    host, slots, where = offload_stacks(gate_up, down, inter, hidden, held, experts,
                                        _host_alloc, _host_alloc)
    counts = torch.zeros(2, experts, dtype=torch.int32)
    ids = torch.tensor([[4, 0], [1, 5], [0, 4]])
    weights = torch.softmax(torch.randn(3, 2, generator=g), dim=-1)
    x = torch.randn(3, hidden, generator=g)
    with _wide_tiles():
        want = moe_decode_quant(x, *resident, inter, weights, ids)
        got = moe_decode_quant(x, *slots, inter, weights, ids,
                               in_place=InPlace(where, *host, counts))
    assert torch.equal(got, want)
    assert counts[0].tolist() == [1, 1, 0, 0, 1, 1]
    assert counts[1].tolist() == [1, 0, 0, 0, 0, 1]  # experts 0 and 5 read from the host


def test_gguf_quantized_experts_offloaded_equal_resident(tmp_path, monkeypatch):
    """A Q8_0 GGUF's experts under --expert-memory for 3 of 4 experts a layer (counted in
    quantized bytes): the stores hold quantized host stacks and slots (no dense stacks), decode
    steps read in place on the stacked kernels, prefill steps of more than 8 tokens run in the
    store's rounds on the per-expert path; greedy tokens and logprobs equal the resident
    model's bit for bit, and the counters saw misses."""
    import gguf

    from conftest import engine_kwargs
    from luceio import LLM, SamplingParams
    from luceio.kernels import moe_quant_triton, weight_nbytes
    from luceio.kernels.quant import QuantWeight
    from test_moe import _write_gguf
    folder = make_tiny_moe(str(tmp_path / "moe"), "e4k2", seed=5, moe_intermediate_size=64)
    path = str(tmp_path / "q8.gguf")
    q8 = gguf.GGMLQuantizationType.Q8_0
    _write_gguf(folder, path, quant=q8, quant_down=q8)
    prompts = [{"prompt_token_ids": [5, 9, 33, 70] * 3}, {"prompt_token_ids": [6, 9, 34, 71]}]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    kw = engine_kwargs(max_num_batched_tokens=16)
    with _wide_tiles():
        resident = LLM(path, **kw)
        model = resident.engine.runner.model
        sparse = model.moe_cfg.sparse_layers
        expert_bytes = sum(weight_nbytes(w) for w in model.layers[sparse[0]].mlp.q_stacks) // 4
        want = resident.generate(prompts, params)
        llm = LLM(path, **engine_kwargs(max_num_batched_tokens=16,
                                        expert_memory=str(len(sparse) * 3 * expert_bytes)))
        store = llm.engine.runner.model.layers[sparse[0]].mlp.store
        assert store.quantized and store.num_slots == 3
        assert isinstance(store.host_gate_up, QuantWeight) and store.host_gate_up.shape[0] == 512
        assert store.slot_down.shape[0] == 3 * 64
        from luceio.kernels import moe
        calls, run = [], moe_quant_triton.moe_decode_quant
        monkeypatch.setattr(moe_quant_triton, "moe_decode_quant", lambda x, *a, **k: calls.append(
            k.get("in_place") is not None) or run(x, *a, **k))
        rounds, each = [], moe.per_expert_moe
        monkeypatch.setattr(moe, "per_expert_moe", lambda x, *a, **k: rounds.append(
            (x.shape[0], k.get("rounds") is not None)) or each(x, *a, **k))
        got = llm.generate(prompts, params)
    assert calls and all(calls)  # decode steps read in place
    assert rounds and all(r for _, r in rounds) and max(n for n, _ in rounds) > 8  # prefill
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs]
    llm.engine.runner.expert_offload.collect()
    stats = llm.engine.stats().experts
    assert stats.num_slots == 3 and stats.misses > 0 and stats.hits > 0


def test_gguf_quantized_expert_budgets(tmp_path, monkeypatch):
    """A fraction counts quantized experts (0.5: 2 of 4 slots, though half the fp32 experts'
    bytes would hold them all); a byte budget that holds every quantized expert offloads
    nothing; one below top-k quantized experts a layer is refused, naming the bytes needed;
    without the Triton kernels (the CPU's packed forms) offloading them is refused."""
    import gguf

    from conftest import engine_kwargs
    from luceio import LLM
    from test_moe import _write_gguf
    folder = make_tiny_moe(str(tmp_path / "moe"), "e4k2", seed=6, moe_intermediate_size=64)
    path = str(tmp_path / "q8.gguf")
    q8 = gguf.GGMLQuantizationType.Q8_0
    _write_gguf(folder, path, quant=q8, quant_down=q8)
    with _wide_tiles():
        assert LLM(path, **engine_kwargs(expert_memory="0.5")).engine.stats().experts \
            .num_slots == 2
        llm = LLM(path, **engine_kwargs(expert_memory="1G"))
        model = llm.engine.runner.model
        assert llm.engine.stats().experts is None
        assert all(model.layers[i].mlp.store is None and model.layers[i].mlp.q_stacks
                   for i in model.moe_cfg.sparse_layers)
        with pytest.raises(ValueError, match="a step needs the top-2: give at least"):
            LLM(path, **engine_kwargs(expert_memory="20000"))
    monkeypatch.setenv("LUCEIO_KERNELS", "auto")  # the CPU's packed forms: no stacks to offload
    with pytest.raises(ValueError, match="quantized experts needs the Triton kernels"):
        LLM(path, **engine_kwargs(expert_memory="0.5"))
