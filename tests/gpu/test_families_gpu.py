"""The model families and paths added for issue 18, on the GPU with their Triton kernels:
expert offload (pinned host experts read in place by the MoE kernels inside CUDA graphs,
promoted into device slots on a side stream; long prefills in rounds) gives the fully resident
model's tokens and logprobs bit for bit (a GGUF's quantized experts too), and so do the kernels
reading pinned host rows; Gemma 3's sliding-window layers on the GPU kernels give the CPU
reference path's greedy tokens."""
import pytest
import torch

from conftest import engine_kwargs, make_tiny_gemma, make_tiny_moe
from luceio import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def prompts(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 384, (int(k),), generator=g).tolist()}
            for k in torch.randint(5, 60, (n,), generator=g)]


def logprobs(out) -> list[dict]:
    return [{t: lp.logprob for t, lp in d.items()} for d in out.outputs[0].logprobs]


def offloaded_equals_resident(offloaded, resident, seed: int):
    """Five short prompts and a 200-token one (prefill chunks of 96 in rounds, decode in
    place inside graphs): tokens and logprobs equal bit for bit; returns the expert stats with
    every step's counters folded in."""
    runner = offloaded.engine.runner
    assert runner.graphs is not None and runner.expert_offload.tables is not None
    ps = prompts(5, seed=seed) + [{"prompt_token_ids": list(range(3, 203))}]
    got, want = offloaded.generate(ps, GREEDY), resident.generate(ps, GREEDY)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert logprobs(g) == logprobs(w)
    torch.cuda.synchronize()
    runner.expert_offload.collect()
    return offloaded.engine.stats().experts


@pytest.mark.parametrize("name,fraction", [("e4k2", "0.3"), ("e6k3", "0.5")])
def test_offloaded_experts_equal_resident_on_the_gpu(tmp_path, name, fraction):
    path = make_tiny_moe(str(tmp_path / name), name, seed=3, num_experts=8)
    resident = LLM(path, **engine_kwargs(device="cuda", max_num_batched_tokens=96))
    # prefill chunks of 96 tokens run in rounds, decode steps in place inside graphs
    offloaded = LLM(path, **engine_kwargs(device="cuda", expert_memory=fraction,
                                          max_num_batched_tokens=96))
    stats = offloaded_equals_resident(offloaded, resident, seed=2)
    assert stats.hits > 0 and stats.misses > 0 and stats.bytes_loaded > 0


@pytest.mark.parametrize("num_tokens", [1, 6, 40])
def test_moe_kernels_read_pinned_host_rows(num_tokens):
    """The MoE kernels reading experts without a slot from pinned host memory (over the bus)
    equal the resident kernels bit for bit, captured in a CUDA graph, and after the table
    changes between replays."""
    from luceio.kernels.moe import InPlace, route_topk_ref
    from luceio.kernels.moe_decode_triton import moe_decode
    from luceio.kernels.moe_triton import fused_moe
    fn = moe_decode if num_tokens <= 8 else fused_moe
    torch.manual_seed(num_tokens)
    e, inter, hidden, k = 16, 256, 512, 4
    host_gu = (torch.randn(e, 2 * inter, hidden) * 0.05).bfloat16().pin_memory()
    host_d = (torch.randn(e, hidden, inter) * 0.05).bfloat16().pin_memory()
    dev_gu, dev_d = host_gu.cuda(), host_d.cuda()
    slot_gu, slot_d = dev_gu[[3, 9, 12]].clone(), dev_d[[3, 9, 12]].clone()
    where = torch.full((e,), -1, dtype=torch.int64, device="cuda")
    where[[3, 9, 12]] = torch.tensor([0, 1, 2], device="cuda")
    counts = torch.zeros(2, e, dtype=torch.int32, device="cuda")
    x = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    logits = torch.randn(num_tokens, e, device="cuda")
    logits[:, 9] += 3
    weights, ids = route_topk_ref(logits.bfloat16(), k, True)
    want = fn(x, dev_gu, dev_d, weights, ids)
    tables = InPlace(where, host_gu, host_d, counts)
    fn(x, slot_gu, slot_d, weights, ids, in_place=tables)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fn(x, slot_gu, slot_d, weights, ids, in_place=tables)
    counts.zero_()
    graph.replay()
    assert torch.equal(got, want)
    used = torch.bincount(ids.flatten(), minlength=e) > 0
    assert counts[1].tolist() == (used & (where < 0)).int().tolist()
    where[9] = -1  # expert 9 now read from the host, 5 from a slot holding it
    slot_gu[1], slot_d[1] = dev_gu[5], dev_d[5]
    where[5] = 1
    graph.replay()
    assert torch.equal(got, want)


def test_gemma_on_gpu_kernels_equals_cpu(tmp_path):
    folder = make_tiny_gemma(str(tmp_path / "gemma"), "gqa_tied", seed=0)
    ps = prompts(4, seed=5)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu = LLM(folder, **engine_kwargs()).generate(ps, params)
    gpu = LLM(folder, **engine_kwargs(device="cuda")).generate(ps, params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]


def test_qwen35_on_gpu_equals_cpu(tmp_path):
    """Qwen3.5's hybrid layers on the GPU (attention on the Triton kernels, the DeltaNet on its
    torch references with state slots on the device) give the CPU path's greedy tokens, with
    chunked prefill and several requests at once."""
    pytest.importorskip("transformers.models.qwen3_5")
    from conftest import make_tiny_qwen35
    folder = make_tiny_qwen35(str(tmp_path / "qwen35"), "gqa_tied", seed=0)
    ps = prompts(5, seed=7)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu = LLM(folder, **engine_kwargs()).generate(ps, params)
    gpu = LLM(folder, **engine_kwargs(device="cuda", max_num_batched_tokens=32)).generate(ps,
                                                                                           params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]


def test_qwen35_cuda_graphs_equal_eager(tmp_path):
    """Qwen3.5 decode steps replay CUDA graphs (state slots in a static buffer, padded requests
    on the scratch slot): tokens and logprobs equal to eager, with a one-token prompt (its first
    step is a graph step that zeroes its slot first) among longer ones."""
    pytest.importorskip("transformers.models.qwen3_5")
    from conftest import make_tiny_qwen35
    folder = make_tiny_qwen35(str(tmp_path / "qwen35"), "gqa_tied", seed=1)
    ps = [{"prompt_token_ids": [7]}] + prompts(4, seed=9)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    eager = LLM(folder, **engine_kwargs(device="cuda", enforce_eager=True)).generate(ps, params)
    llm = LLM(folder, **engine_kwargs(device="cuda"))
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    graphs = llm.generate(ps, params)
    for g, e in zip(graphs, eager):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for gl, el in zip(logprobs(g), logprobs(e)):
            assert gl.keys() == el.keys()
            assert all(abs(gl[t] - el[t]) < 1e-4 for t in gl)


def _greedy(llm, ps, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(ps, params)]


def test_qwen35_speculation_on_gpu_equals_plain(tmp_path):
    """Speculative decoding on the hybrid model on the GPU: verify steps eager with the
    DeltaNet's per-position states kept (hybrid_verify.py), decode steps on CUDA graphs; drafts
    of the target's own continuation with a wrong token after 0..k right ones."""
    pytest.importorskip("transformers.models.qwen3_5")
    from conftest import make_tiny_qwen35
    from test_qwen3_5_spec import Oracle
    folder = make_tiny_qwen35(str(tmp_path / "qwen35"), "gqa_tied", seed=2)
    ps = prompts(4, seed=12)
    plain = _greedy(LLM(folder, **engine_kwargs(device="cuda")), ps, 20)
    llm = LLM(folder, **engine_kwargs(device="cuda", speculative_method="ngram",
                                      num_speculative_tokens=4))
    spec = llm.engine.spec
    spec.proposer = Oracle({tuple(p["prompt_token_ids"]): t for p, t in zip(ps, plain)})
    spec.mode = lambda *a, **k: "chain"
    spec.k_for = lambda r, cap: max(0, min(cap, r.max_tokens - r.num_output_tokens - 1))
    assert _greedy(llm, ps, 20) == plain
    assert 0 < spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens


def test_qwen3_next_and_gemma4_on_gpu_equal_cpu(tmp_path):
    """Qwen3-Next (regrouped DeltaNet projections, sparse and dense layers, a shared expert)
    and Gemma 4 (per-layer inputs, KV sharing, global layers of another KV shape) on the GPU
    kernels give the CPU path's greedy tokens, with chunked prefill."""
    pytest.importorskip("transformers.models.qwen3_next")
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from conftest import QWEN3_NEXT, make_tiny_gemma4, save_tiny, spread_qwen35_norms
    torch.manual_seed(8)
    folders = [save_tiny(spread_qwen35_norms(
        Qwen3NextForCausalLM(Qwen3NextConfig(**QWEN3_NEXT)).float()), str(tmp_path / "next"))]
    pytest.importorskip("transformers.models.gemma4")
    folders += [make_tiny_gemma4(str(tmp_path / name), name, seed=1)
                for name in ("gqa_ple_shared", "global_wide_keqv")]
    ps = prompts(4, seed=3)
    for folder in folders:
        cpu = _greedy(LLM(folder, **engine_kwargs()), ps)
        gpu = _greedy(LLM(folder, **engine_kwargs(device="cuda", max_num_batched_tokens=32)), ps)
        assert gpu == cpu, folder


@pytest.mark.parametrize("qtypes", [("q4_k", "q6_k"), ("q8_0", "q8_0")])
def test_stacked_quantized_experts_on_the_gpu(qtypes):
    """Quantized experts stacked per projection (`moe_quant_triton`), a Qwen3-30B-A3B layer's
    shape, bf16, captured in a CUDA graph: close to the per-expert path over the same weights
    (they differ in summation order: split-K partials, the k rows' roundings)."""
    from luceio import kernels
    from luceio.kernels.moe import per_expert_moe, route_topk_ref
    from luceio.kernels.moe_quant_triton import moe_decode_quant
    from luceio.kernels.quant import cat_rows, random_quant_weight
    g = torch.Generator().manual_seed(0)
    e, inter, hidden, k = 16, 768, 2048, 8
    gate_up = [cat_rows([random_quant_weight(qtypes[0], inter, hidden, generator=g)
                         for _ in "gu"]) for _ in range(e)]
    down = [random_quant_weight(qtypes[1], hidden, inter, generator=g) for _ in range(e)]
    stacks = [kernels.prepare_weight(cat_rows(ws).to("cuda"), torch.bfloat16)
              for ws in (gate_up, down)]
    each = [(kernels.prepare_weight(a.to("cuda"), torch.bfloat16),
             kernels.prepare_weight(b.to("cuda"), torch.bfloat16)) for a, b in zip(gate_up, down)]
    for n in (1, 4):
        x = torch.randn(n, hidden, generator=g).bfloat16().cuda()
        weights, ids = route_topk_ref(torch.randn(n, e, generator=g).bfloat16().cuda(), k, True)
        want = per_expert_moe(x, each, weights, ids, kernels.linear).float()
        moe_decode_quant(x, *stacks, inter, weights, ids)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = moe_decode_quant(x, *stacks, inter, weights, ids)
        graph.replay()
        torch.cuda.synchronize()
        err = (got.float() - want).abs().max().item()
        assert err <= 0.02 * want.abs().max().item(), (n, err)


def test_gguf_stacked_experts_keep_cuda_graphs(tmp_path, monkeypatch):
    """A tiny GGUF with Q8_0 gate/up and down expert stacks on the GPU: the model keeps CUDA
    graphs (stacked experts), and its greedy tokens equal the per-expert path's (eager, the
    stacks turned off), logprobs close."""
    import gguf

    from luceio.models.moe import SparseMoeBlock
    from test_moe import _write_gguf
    folder = make_tiny_moe(str(tmp_path / "moe"), "e4k2", seed=4, moe_intermediate_size=64)
    path = str(tmp_path / "q8.gguf")
    q8 = gguf.GGMLQuantizationType.Q8_0
    _write_gguf(folder, path, quant=q8, quant_down=q8)
    stacked = LLM(path, **engine_kwargs(device="cuda"))
    assert stacked.engine.runner.graphs is not None
    monkeypatch.setattr(SparseMoeBlock, "_stack_quantized", lambda self: False)
    each = LLM(path, **engine_kwargs(device="cuda"))
    assert each.engine.runner.graphs is None
    ps = prompts(4, seed=9)
    got, want = stacked.generate(ps, GREEDY), each.generate(ps, GREEDY)
    for g_, w in zip(got, want):
        assert g_.outputs[0].token_ids == w.outputs[0].token_ids
        for gl, wl in zip(logprobs(g_), logprobs(w)):
            assert all(abs(gl[t] - wl[t]) < 1e-3 for t in wl if t in gl)


@pytest.mark.parametrize("qtypes,slots", [(("Q8_0", "Q8_0"), 3), (("Q4_0", "Q5_0"), 4)])
def test_gguf_quantized_experts_offloaded_with_graphs(tmp_path, qtypes, slots):
    """A tiny GGUF's quantized expert stacks offloaded (`slots` of 8 experts a layer, in
    quantized bytes) on the GPU: CUDA graphs kept, decode read in place from pinned host
    stacks and slots, prefill chunks of 96 in rounds; tokens and logprobs equal the resident
    model's bit for bit, and experts were promoted. (gguf's writer cannot quantize K-quants;
    their paired scales read in place are tested on the CPU, test_moe_quant.py.)"""
    import gguf

    from luceio.kernels import weight_nbytes
    from test_moe import _write_gguf
    folder = make_tiny_moe(str(tmp_path / "moe"), "e4k2", seed=4, num_experts=8,
                           moe_intermediate_size=64)
    path = str(tmp_path / "q.gguf")
    t = gguf.GGMLQuantizationType
    _write_gguf(folder, path, quant=t[qtypes[0]], quant_down=t[qtypes[1]])
    kw = engine_kwargs(device="cuda", max_num_batched_tokens=96)
    resident = LLM(path, **kw)
    model = resident.engine.runner.model
    sparse = model.moe_cfg.sparse_layers
    expert = sum(weight_nbytes(w) for w in model.layers[sparse[0]].mlp.q_stacks) // 8
    offloaded = LLM(path, **engine_kwargs(device="cuda", max_num_batched_tokens=96,
                                          expert_memory=str(len(sparse) * slots * expert)))
    assert offloaded.engine.runner.model.layers[sparse[0]].mlp.store.host_gate_up.qs.is_pinned()
    stats = offloaded_equals_resident(offloaded, resident, seed=3)
    assert stats.num_slots == slots and stats.misses > 0 and stats.bytes_loaded > 0


@pytest.mark.parametrize("qtypes", [("q4_k", "q6_k"), ("q8_0", "q5_0")])
def test_quantized_expert_stacks_read_pinned_host_rows(qtypes):
    """The stacked expert GEMV reading offloaded experts in place on the GPU: slots hold
    experts 4, 1, 2, the rest are read from pinned host stacks laid out as
    `ExpertStore.hold_quantized` lays them (K-quant scale pairs interleaved), at Qwen3-30B-A3B's
    expert shape; equal to the resident stacks bit for bit, host reads counted."""
    from luceio import kernels
    from luceio.kernels.moe import InPlace
    from luceio.kernels.moe_quant_triton import moe_decode_quant
    from luceio.kernels.quant import cat_rows, random_quant_weight
    from test_moe_quant import offload_stacks
    experts, held, inter, hidden = 8, (4, 1, 2), 768, 2048
    g = torch.Generator().manual_seed(3)
    gate_up = cat_rows([random_quant_weight(qtypes[0], inter, hidden, generator=g)
                        for _ in range(2 * experts)])
    down = cat_rows([random_quant_weight(qtypes[1], hidden, inter, generator=g)
                     for _ in range(experts)])
    resident = [kernels.prepare_weight(w.to("cuda"), torch.bfloat16) for w in (gate_up, down)]
    host, slots, where = offload_stacks(
        gate_up, down, inter, hidden, held, experts,
        lambda s, d: torch.empty(s, dtype=d, pin_memory=True),
        lambda s, d: torch.empty(s, dtype=d, device="cuda"))
    where = where.cuda()
    counts = torch.zeros(2, experts, dtype=torch.int32, device="cuda")
    ids = torch.tensor([[4, 0], [1, 5], [0, 4]], device="cuda")
    weights = torch.softmax(torch.randn(3, 2, generator=g), dim=-1).to("cuda", torch.bfloat16)
    x = torch.randn(3, hidden, generator=g).to("cuda", torch.bfloat16)
    want = moe_decode_quant(x, *resident, inter, weights, ids)
    got = moe_decode_quant(x, *slots, inter, weights, ids, in_place=InPlace(where, *host, counts))
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert counts.tolist() == [[1, 1, 0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0]]
