"""Expert offload (`--expert-memory`, models/expert_offload.py) on tiny random Qwen3-MoE models
(fp32, CPU): an offloaded model equals the fully resident one bit for bit (layer outputs,
greedy tokens and their logprobs), with steps that need more experts than the slots (rounds);
the LRU's accounting against a hand-worked request sequence; calibration's counts against
transformers' own routing, and a placement's experts never missing; the flags' refusals."""
import json

import pytest
import torch

from conftest import engine_kwargs, make_tiny_moe
from luceio import LLM, SamplingParams
from luceio.models.expert_offload import ExpertCache, ExpertStore

NUM_EXPERTS = 8
# (conftest MOE_CONFIGS name, budget as a fraction): slots per layer = floor(8 * fraction)
CASES = [("e4k2", "0.3"), ("e4k2", "0.6"), ("e6k3", "0.4"), ("e6k3", "0.6")]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The two MOE_CONFIGS with 8 experts per sparse layer."""
    return {name: make_tiny_moe(str(tmp_path_factory.mktemp(name)), name, seed=10 + i,
                                num_experts=NUM_EXPERTS)
            for i, name in enumerate(("e4k2", "e6k3"))}


@pytest.fixture(scope="module")
def resident(models) -> dict:
    return {name: LLM(path, **engine_kwargs()) for name, path in models.items()}


def _prompts(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 40, (n,), generator=g).tolist()
    return [{"prompt_token_ids": torch.randint(3, 384, (k,), generator=g).tolist()}
            for k in lengths]


def _expert_bytes(llm) -> int:
    moe = llm.engine.runner.model.moe_cfg
    return 3 * moe.moe_intermediate_size * llm.engine.runner.cfg.hidden_size * 4  # fp32


def _logprobs(out) -> list[dict]:
    return [{t: lp.logprob for t, lp in d.items()} for d in out.outputs[0].logprobs]


@pytest.mark.parametrize("name,fraction", CASES)
def test_offloaded_equals_resident(models, resident, name, fraction):
    ref = resident[name]
    llm = LLM(models[name], **engine_kwargs(expert_memory=fraction))
    moe = llm.engine.runner.model.moe_cfg
    slots = int(NUM_EXPERTS * float(fraction))
    stats = llm.engine.stats().experts
    assert stats.num_slots == slots and stats.hits == stats.misses == 0
    for i in moe.sparse_layers:
        assert llm.engine.runner.model.layers[i].mlp.w_gate_up.shape[0] == slots
    # the layers: many tokens need every expert, so the slots are refilled in rounds
    torch.manual_seed(0)
    x = torch.randn(64, llm.engine.runner.cfg.hidden_size)
    rounds = []
    for i in moe.sparse_layers:
        block = llm.engine.runner.model.layers[i].mlp
        plan = block.store.cache.plan
        block.store.cache.plan = lambda needed, plan=plan: rounds.append(plan(needed)) or rounds[-1]
        with torch.inference_mode():
            assert torch.equal(block(x), ref.engine.runner.model.layers[i].mlp(x))
        del block.store.cache.plan
    assert all(len(r) > 1 for r in rounds)
    # the engine: batched prefill and decode, tokens and logprobs bit for bit
    prompts = _prompts(5, seed=1)
    got, want = llm.generate(prompts, GREEDY), ref.generate(prompts, GREEDY)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert _logprobs(g) == _logprobs(w)
    stats = llm.engine.stats().experts
    assert stats.hits > 0 and stats.misses > 0
    assert stats.bytes_loaded == stats.misses * _expert_bytes(llm)


def test_memory_in_bytes_buys_the_same_slots(models):
    llm = LLM(models["e4k2"], **engine_kwargs(expert_memory="0.3"))
    per_slot = len(llm.engine.runner.model.moe_cfg.sparse_layers) * _expert_bytes(llm)
    for memory, slots in ((f"{3 * per_slot}", 3), (f"{3 * per_slot - 1}", 2),
                          (f"{per_slot * 5 / 1024:.0f}K", 5)):
        other = LLM(models["e4k2"], **engine_kwargs(expert_memory=memory))
        assert other.engine.stats().experts.num_slots == slots
    everything = LLM(models["e4k2"], **engine_kwargs(expert_memory="1.0"))
    assert everything.engine.stats().experts is None  # all fit: nothing offloaded
    assert everything.engine.runner.model.layers[0].mlp.store is None


def test_counters_reach_the_server_metrics(models):
    from luceio.server.metrics import ServerMetrics

    class Engine:  # what the collector asks an AsyncEngine for
        def __init__(self, llm):
            self.stats, self.num_open_streams = llm.engine.stats, lambda: 0

    llm = LLM(models["e6k3"], **engine_kwargs(expert_memory="0.4"))
    llm.generate(_prompts(2, seed=5), GREEDY)
    st = llm.engine.stats().experts
    samples = _samples(ServerMetrics(Engine(llm)).render().decode())
    assert samples["luceio_expert_slots"] == st.num_slots == 3
    assert samples["luceio_expert_cache_hits_total"] == st.hits
    assert samples["luceio_expert_cache_misses_total"] == st.misses > 0
    assert samples["luceio_expert_bytes_loaded_total"] == st.bytes_loaded > 0
    resident = _samples(ServerMetrics(Engine(LLM(models["e6k3"], **engine_kwargs()))).render()
                        .decode())
    assert not [name for name in resident if name.startswith("luceio_expert")]


def _samples(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_lru_accounting_against_a_hand_worked_sequence():
    """3 slots, expert 5 pinned in slot 0, slots 1 and 2 the LRU."""
    torch.manual_seed(0)
    num_experts, inter, hidden = 8, 4, 6
    store = ExpertStore(num_experts, inter, hidden, ExpertCache(3, [5]), 3, torch.float32,
                        torch.device("cpu"))
    store.host_gate_up.normal_()
    store.host_down.normal_()
    store.place_pinned()
    steps = [  # needed -> rounds (loads, slots computed)
        ([0, 5], [([(0, 1)], {5: 0, 0: 1})]),
        ([1], [([(1, 2)], {1: 2})]),                  # the last free slot
        ([0], [([], {0: 1})]),                        # a hit: 1 is now the oldest
        ([2, 5], [([(2, 2)], {5: 0, 2: 2})]),         # evicts 1
        # 0 and 2 hit and fill the LRU slots: the misses wait for a second round, which
        # evicts them oldest first (0, then 2)
        ([0, 1, 2, 3], [([], {0: 1, 2: 2}), ([(1, 1), (3, 2)], {1: 1, 3: 2})]),
        ([3, 4, 5], [([(4, 1)], {3: 2, 5: 0, 4: 1})]),  # evicts 1, not 3 (needed now)
    ]
    for needed, expected in steps:
        ids = torch.tensor(needed).repeat(2, 1)  # two tokens, the same experts
        rows = list(store.rounds(ids))
        assert len(rows) == len(expected)
        for r, (_, slots) in zip(rows, expected):
            assert {e: s for e, s in enumerate(r.tolist()) if s >= 0} == slots
        for e, s in store.cache.slot_of.items():  # every resident expert's weights in its slot
            assert torch.equal(store.slot_gate_up[s], store.host_gate_up[e])
            assert torch.equal(store.slot_down[s], store.host_down[e])
    assert store.stats() == (1 + 0 + 1 + 1 + 2 + 2, 1 + 1 + 0 + 1 + 2 + 1,
                             6 * 3 * inter * hidden * 4)
    cache = ExpertCache(3, [5])
    assert [cache.plan(n) for n, _ in steps] == [e for _, e in steps]


def test_calibration_counts_and_placement_pins(models, tmp_path):
    from transformers import AutoModelForCausalLM

    from luceio.cli import main
    path = models["e6k3"]
    prompts = [p["prompt_token_ids"] for p in _prompts(4, seed=3)] + [[7, 8, 9]] * 2
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "placement.json"
    assert main(["calibrate-experts", "--model", path, "--prompts", str(prompt_file),
                 "--out", str(out), "--max-tokens", "1", "--device", "cpu", "--dtype", "float32",
                 "--num-kv-blocks", "64"]) == 0
    # the oracle: transformers' router choices over every prompt token (the repeated prompt
    # counted twice: calibration turns prefix caching off)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = {i: torch.zeros(NUM_EXPERTS, dtype=torch.int64) for i in (0, 2)}

    def count(layer):
        def hook(module, args, out):  # transformers' router returns (logits, weights, ids)
            expected[layer] += torch.bincount(out[2].flatten(), minlength=NUM_EXPERTS)
        return hook
    hooks = [hf.model.layers[i].mlp.gate.register_forward_hook(count(i)) for i in expected]
    with torch.no_grad():
        for p in prompts:
            hf(torch.tensor([p]))
    for h in hooks:
        h.remove()
    data = json.loads(out.read_text())
    assert sorted(data["layers"]) == ["0", "2"]
    for i, counts in expected.items():
        layer = data["layers"][str(i)]
        assert layer["counts"] == counts.tolist()
        assert sum(layer["counts"]) == 3 * sum(len(p) for p in prompts)
        assert layer["experts"] == sorted(range(NUM_EXPERTS), key=lambda e: (-counts[e], e))
    # 5 slots at 0.7: the top 2 experts of each layer pinned, 3 LRU slots; they never miss
    llm = LLM(path, **engine_kwargs(expert_memory="0.7", expert_placement=str(out)))
    loads = []
    for i in (0, 2):
        store = llm.engine.runner.model.layers[i].mlp.store
        assert store.cache.pinned == set(data["layers"][str(i)]["experts"][:2])
        copy = store._copy
        store._copy = lambda ld, i=i, copy=copy: loads.extend((i, e) for e, _ in ld) or copy(ld)
    llm.generate(_prompts(4, seed=4), GREEDY)
    assert loads and not any(e in set(data["layers"][str(i)]["experts"][:2]) for i, e in loads)
    stats = llm.engine.stats().experts
    assert stats.num_pinned == 4 and stats.misses == len(loads)


def test_refusals(models, tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="applies to mixture-of-experts models"):
        LLM(tiny_llama, **engine_kwargs(expert_memory="0.5"))
    with pytest.raises(ValueError, match="holds 1 experts per sparse layer; a step needs the "
                                         "top-2"):
        LLM(models["e4k2"], **engine_kwargs(expert_memory="0.2"))
    for memory, message in (("lots", "give bytes"), ("1.5", r"in \(0, 1\]"), ("0", "positive")):
        with pytest.raises(ValueError, match=message):
            LLM(models["e4k2"], **engine_kwargs(expert_memory=memory))
    with pytest.raises(ValueError, match="--expert-placement applies with --expert-memory"):
        LLM(models["e4k2"], **engine_kwargs(expert_placement="p.json"))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "luceio-expert-placement/1", "num_experts": 8,
                                 "layers": {"0": {"experts": list(range(8))}}}))
    with pytest.raises(ValueError, match="made for another model"):  # e6k3: layers 0 and 2
        LLM(models["e6k3"], **engine_kwargs(expert_memory="0.6", expert_placement=str(other)))
    with pytest.raises(ValueError, match="not a `luceio calibrate-experts` file"):
        other.write_text("{}")
        LLM(models["e6k3"], **engine_kwargs(expert_memory="0.6", expert_placement=str(other)))


def test_serve_flags():
    from luceio.server.args import make_parser, parse_args
    ns = make_parser().parse_args(["m", "--expert-memory", "12G", "--expert-placement", "p.json"])
    config = parse_args(ns)[1].expert_offload_config()
    assert (config.memory, config.placement) == (12 << 30, "p.json")


def _store_and_routing(dtype, seed: int, num_tokens: int, hidden: int, inter: int, top_k: int):
    """A CPU `ExpertStore` of NUM_EXPERTS random experts in 3 slots (expert 4 pinned), inputs
    x and their routing; `store.rounds` then refills the slots in several rounds."""
    from luceio.kernels.moe import route_topk_ref
    torch.manual_seed(seed)
    store = ExpertStore(NUM_EXPERTS, inter, hidden, ExpertCache(3, [4]), 3, dtype,
                        torch.device("cpu"))
    store.host_gate_up.copy_(torch.randn(store.host_gate_up.shape) * 0.3)
    store.host_down.copy_(torch.randn(store.host_down.shape) * 0.3)
    store.place_pinned()
    x = torch.randn(num_tokens, hidden).to(dtype)
    weights, ids = route_topk_ref(torch.randn(num_tokens, NUM_EXPERTS).to(dtype), top_k, True)
    return store, x, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_in_rounds_equals_resident(dtype):
    """The fused Triton kernel (under TRITON_INTERPRET=1 on the CPU) over 3 slots of 8 experts,
    in rounds, against itself over all 8 resident: the same tiles, so bit for bit."""
    pytest.importorskip("triton")
    from luceio.kernels import triton_ops
    store, x, weights, ids = _store_and_routing(dtype, 1, num_tokens=24, hidden=32, inter=16,
                                                top_k=2)
    want = triton_ops.fused_moe(x, store.host_gate_up, store.host_down, weights, ids)
    rounds = []
    got = triton_ops.fused_moe(x, store.slot_gate_up, store.slot_down, weights, ids,
                               rounds=(rounds.append(r) or r for r in store.rounds(ids)))
    assert len(rounds) > 2 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shared", [False, True])
def test_decode_kernel_in_rounds_equals_resident(dtype, shared):
    """The few-token kernels (`moe_decode_triton`, the path an offloaded model's decode steps
    take) over 3 slots of 8 experts, in rounds, against one launch over all 8 resident: bit for
    bit, a shared expert's sum included."""
    pytest.importorskip("triton")
    from test_kernels import INTERPRETED
    if not INTERPRETED:
        pytest.skip("CPU tensors on the Triton kernels need the interpreter")
    from luceio.kernels.moe_decode_triton import moe_decode
    num_tokens, hidden = 5, 48
    store, x, weights, ids = _store_and_routing(dtype, 2, num_tokens, hidden, inter=40, top_k=3)
    extra = (torch.randn(num_tokens, hidden).to(dtype), torch.randn(num_tokens, 1).to(dtype)) \
        if shared else ()
    want = moe_decode(x, store.host_gate_up, store.host_down, weights, ids, *extra)
    rounds = []
    got = moe_decode(x, store.slot_gate_up, store.slot_down, weights, ids, *extra,
                     rounds=(rounds.append(r) or r for r in store.rounds(ids)))
    assert len(rounds) > 2 and torch.equal(got, want)


def test_calibrate_refuses_a_model_without_experts(tiny_llama, tmp_path, capsys):
    from luceio.cli import main
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\n")
    assert main(["calibrate-experts", "--model", tiny_llama, "--prompts", str(prompts),
                 "--out", str(tmp_path / "p.json"), "--device", "cpu",
                 "--num-kv-blocks", "64"]) == 2
    assert "has no experts to calibrate" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
