"""Expert offload read in place (models/expert_tables.py, the offload's CUDA-graph path), on the
CPU under TRITON_INTERPRET=1: the MoE kernels reading each expert from its slot or its host
row equal the fully resident kernels bit for bit and count what they read; the slot tables
promote experts read from the host into LRU slots between steps and keep equal outputs while
they do; eager rounds and in-place steps share the slots; a whole engine reading in place
gives the resident engine's tokens and logprobs."""
import pytest
import torch

from conftest import engine_kwargs, make_tiny_moe
from luceio import LLM, SamplingParams
from luceio.kernels.moe import InPlace, route_topk_ref
from luceio.models.expert_offload import ExpertCache, ExpertOffload, ExpertStore
from luceio.models.expert_tables import SlotTables

pytest.importorskip("triton")
NUM_EXPERTS = 8


@pytest.fixture(autouse=True)
def _interpreted():
    from test_kernels import INTERPRETED
    if not INTERPRETED:
        pytest.skip("CPU tensors on the Triton kernels need the interpreter")


def _kernel(num_tokens: int):
    from luceio.kernels import triton_ops
    from luceio.kernels.moe_decode_triton import moe_decode
    return moe_decode if num_tokens <= 8 else triton_ops.fused_moe


def _stacks(dtype, seed: int, hidden: int = 48, inter: int = 40):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=g) * 0.3).to(dtype)
    down = (torch.randn(NUM_EXPERTS, hidden, inter, generator=g) * 0.3).to(dtype)
    return gate_up, down


def _routing(num_tokens: int, hidden: int, top_k: int, seed: int, dtype, favour=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=g)
    if favour is not None:  # steps that keep asking for a few experts
        logits[:, favour] += 4.0
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    weights, ids = route_topk_ref(logits.to(dtype), top_k, True)
    return x, weights, ids


@pytest.mark.parametrize("num_tokens", [1, 5, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_in_place_kernels_equal_resident_and_count(num_tokens, dtype):
    """3 of 8 experts in slots (in another order), the rest read from the host stacks: the
    output is the resident one's bit for bit; counts[0] has each routed expert once, counts[1]
    those without a slot."""
    gate_up, down = _stacks(dtype, 1)
    slot_gu, slot_d = torch.zeros_like(gate_up[:3]), torch.zeros_like(down[:3])
    where = torch.full((NUM_EXPERTS,), -1, dtype=torch.int64)
    for s, e in enumerate((5, 1, 6)):
        slot_gu[s], slot_d[s], where[e] = gate_up[e], down[e], s
    x, weights, ids = _routing(num_tokens, 48, 3, seed=num_tokens, dtype=dtype, favour=[5])
    counts = torch.zeros(2, NUM_EXPERTS, dtype=torch.int32)
    fn = _kernel(num_tokens)
    want = fn(x, gate_up, down, weights, ids)
    got = fn(x, slot_gu, slot_d, weights, ids,
             in_place=InPlace(where, gate_up, down, counts))
    assert torch.equal(got, want)
    used = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS) > 0
    assert counts[0].tolist() == used.int().tolist()
    assert counts[1].tolist() == (used & (where < 0)).int().tolist()
    assert counts[1].sum() > 0 and counts[1].sum() < counts[0].sum()
    # the torch reference reads in place by the same rules and counts the same
    from luceio.kernels.moe import fused_moe_ref
    ref_counts = torch.zeros_like(counts)
    ref = fused_moe_ref(x, slot_gu, slot_d, weights, ids,
                        in_place=InPlace(where, gate_up, down, ref_counts))
    assert torch.equal(ref, fused_moe_ref(x, gate_up, down, weights, ids))
    assert torch.equal(ref_counts, counts)


def _tables(dtype, num_slots: int, pinned=(4,)):
    gate_up, down = _stacks(dtype, 2)
    store = ExpertStore(NUM_EXPERTS, 40, 48, ExpertCache(num_slots, list(pinned)), num_slots,
                        dtype, torch.device("cpu"))
    store.layer = 3
    store.host_gate_up.copy_(gate_up)
    store.host_down.copy_(down)
    store.place_pinned()
    return store, SlotTables({3: store}, torch.device("cpu"))


def test_tables_promote_misses_and_outputs_stay_exact():
    """Steps that favour experts 0 and 2 read them from the host at first; between steps they
    are promoted into the LRU slots and later steps read them from the device. Every step
    equals the resident kernels; the counters match a count of the routing."""
    dtype = torch.float32
    store, tables = _tables(dtype, num_slots=4)
    assert tables.host[0].tolist() == [-1, -1, -1, -1, 0, -1, -1, -1]  # the pinned expert
    fn = _kernel(1)
    seen_hits = seen_misses = 0
    for step in range(6):
        tables.before_step()
        x, weights, ids = _routing(2, 48, 2, seed=100 + step, dtype=dtype, favour=[0, 2])
        held = tables.where[0].clone()
        got = fn(x, store.slot_gate_up, store.slot_down, weights, ids,
                 in_place=store.in_place_for(x))
        tables.after_step()
        want = fn(x, store.host_gate_up, store.host_down, weights, ids)
        assert torch.equal(got, want)
        used = sorted(set(ids.flatten().tolist()))
        seen_misses += sum(int(held[e]) < 0 for e in used)
        seen_hits += sum(int(held[e]) >= 0 for e in used)
        tables.collect()
        assert (store.cache.hits, store.cache.misses) == (seen_hits, seen_misses)
        if step == 0:
            assert {0, 2} <= set(store.cache.slot_of)  # promoted, copies under way
            assert store.loaded > 0
    tables.before_step()  # the last promotions land
    where = tables.where[0]
    for e, s in store.cache.slot_of.items():  # the table is the cache's, the slots hold them
        assert int(where[e]) == s
        assert torch.equal(store.slot_gate_up[s], store.host_gate_up[e])
        assert torch.equal(store.slot_down[s], store.host_down[e])
    assert int(where[0]) >= 0 and int(where[2]) >= 0 and int(where[4]) == 0
    assert int((where >= 0).sum()) == len(store.cache.slot_of)


def test_promotion_never_evicts_an_expert_the_step_used():
    cache = ExpertCache(3, [7])
    assert cache.promote([1, 2], {1, 2}) == [(1, 1, None), (2, 2, None)]
    # slots full: 1 and 2 are both in use, so 3 finds no victim
    assert cache.promote([3], {1, 2, 3}) == []
    cache.touch([1])  # 2 is now the least recently used
    assert cache.promote([3], {3}) == [(3, 2, 2)]
    assert cache.slot_of == {7: 0, 1: 1, 3: 2}


def test_rounds_after_in_place_steps_share_the_slots():
    """An eager step of many tokens (rounds) after in-place steps with promotions in flight:
    the pending promotions land first, the rounds refill slots, and the table is rebuilt from
    the cache; the next in-place step reads it and stays exact."""
    dtype = torch.float32
    store, tables = _tables(dtype, num_slots=3)
    fn = _kernel(1)
    for step in range(2):
        tables.before_step()
        x, weights, ids = _routing(1, 48, 2, seed=7 + step, dtype=dtype)
        fn(x, store.slot_gate_up, store.slot_down, weights, ids, in_place=store.in_place)
        tables.after_step()
        tables.collect()
    from luceio.kernels import triton_ops
    x, weights, ids = _routing(80, 48, 2, seed=9, dtype=dtype)
    assert store.in_place_for(x) is None  # too many tokens to read in place: rounds
    got = triton_ops.fused_moe(x, store.slot_gate_up, store.slot_down, weights, ids,
                               rounds=store.rounds(ids))
    assert torch.equal(got, triton_ops.fused_moe(x, store.host_gate_up, store.host_down,
                                                 weights, ids))
    assert not tables.pending[3]
    tables.before_step()
    assert {e: int(tables.where[0][e]) for e in store.cache.slot_of} == store.cache.slot_of
    x, weights, ids = _routing(3, 48, 2, seed=11, dtype=dtype)
    got = fn(x, store.slot_gate_up, store.slot_down, weights, ids, in_place=store.in_place)
    assert torch.equal(got, fn(x, store.host_gate_up, store.host_down, weights, ids))


def test_engine_reading_in_place_equals_resident(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE on the Triton kernels (interpreted) with 3 of 8 experts per layer in
    slots, read in place (forced on the CPU): greedy tokens and logprobs equal the resident
    model's; decode steps promoted experts (copies happened, the tables hold slots)."""
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    start = ExpertOffload.start
    monkeypatch.setattr(ExpertOffload, "start",
                        lambda self, device, in_place=None: start(self, device, True))
    path = make_tiny_moe(str(tmp_path / "moe"), "e4k2", seed=5, num_experts=NUM_EXPERTS)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [5 + i, 9, 33, 70 + i] * (2 + i)} for i in range(3)]
    kw = engine_kwargs(max_num_batched_tokens=16)
    want = LLM(path, **kw).generate(prompts, params)
    llm = LLM(path, **kw, expert_memory="0.4")
    offload = llm.engine.runner.expert_offload
    assert offload.tables is not None
    got = llm.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in g.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in w.outputs[0].logprobs]
    offload.collect()
    stats = offload.stats()
    assert stats.hits > 0 and stats.misses > 0 and stats.bytes_loaded > 0
