"""Swap preemption: a preempted request's KV goes to host memory and comes back bit-exact,
outputs equal recompute preemption and no preemption, and nothing is left behind. It is "offload
every block" through the host copies bounded residency uses: the same store, the same moves,
the same release path."""
from types import SimpleNamespace

import torch

from conftest import engine_kwargs, watch_host_copies
from luceio import LLM, SamplingParams
from luceio.cache import KVCacheManager
from luceio.cache.residency import OFFLOADED
from luceio.request import RequestStatus

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30)


def prompts():
    g = torch.Generator().manual_seed(11)
    return [{"prompt_token_ids": torch.randint(3, 384, (10 + 7 * i,), generator=g).tolist()}
            for i in range(12)]


def run(path, **kw):
    llm = LLM(path, **engine_kwargs(**kw))
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)], llm.engine


def test_swap_equals_recompute_equals_no_preemption(tiny_llama):
    plain, _ = run(tiny_llama)
    small = dict(num_kv_blocks=10, max_num_batched_tokens=48)
    recompute, eng_r = run(tiny_llama, preemption_mode="recompute", **small)
    swap, eng_s = run(tiny_llama, preemption_mode="swap", **small)
    assert eng_r.scheduler.num_preemptions > 0 and eng_s.scheduler.num_preemptions > 0
    assert swap == recompute == plain
    assert_clean(eng_s)


def assert_clean(eng):
    assert eng.runner.host_store.request_ids() == []
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
    assert eng.kv.swapped == {} and eng.kv.host.current == {}


def swapped_out(eng):
    """Preempted requests whose computed tokens were kept (their KV waits in host memory)."""
    return [r for r in eng.scheduler.waiting
            if r.status == RequestStatus.PREEMPTED and r.num_computed_tokens > 0]


def test_swapped_blocks_come_back_bit_identical(tiny_llama):
    """Every block a swap-out offloads comes back equal to what it held; the copies are the
    host store's moves, applied before the step's forward."""
    llm = LLM(tiny_llama, **engine_kwargs(num_kv_blocks=10, max_num_batched_tokens=48,
                                          preemption_mode="swap"))
    _, checked = watch_host_copies(llm.engine.runner)
    llm.generate(prompts(), GREEDY)
    assert checked, "no request was swapped out and back in"
    assert llm.engine.scheduler.num_preemptions > 0
    assert_clean(llm.engine)


def test_swap_out_offloads_every_block_into_the_residency_store(tiny_llama):
    """A request preempted in swap mode has every block offloaded: its table entries are all
    OFFLOADED and the runner's host store (bounded residency's) holds one copy per block."""
    llm = LLM(tiny_llama, **engine_kwargs(num_kv_blocks=10, max_num_batched_tokens=48,
                                          preemption_mode="swap"))
    eng = llm.engine
    for i, p in enumerate(prompts()):
        eng.add_request(f"q{i}", p, GREEDY)
    seen = 0
    while eng.has_unfinished_requests():
        eng.step()
        for r in swapped_out(eng):
            rid, n = r.request_id, -(-r.num_computed_tokens // 16)
            assert sorted(eng.runner.host_store.blocks.get(rid, {})) == list(range(n))
            assert eng.kv.blocks_of(rid) == [OFFLOADED] * n
            seen += 1
    assert seen, "nothing was swapped out"
    assert_clean(eng)


def test_abort_while_swapped_drops_host_copy(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs(num_kv_blocks=10, max_num_batched_tokens=48,
                                          preemption_mode="swap"))
    eng = llm.engine
    for i, p in enumerate(prompts()):
        eng.add_request(f"q{i}", p, GREEDY)
    for _ in range(200):
        eng.step()
        swapped = [r.request_id for r in swapped_out(eng)]
        if swapped:
            break
    assert swapped and set(swapped) <= set(eng.runner.host_store.request_ids())
    eng.abort_request(list(eng.states))
    eng.step()
    assert not eng.has_unfinished_requests()
    assert_clean(eng)


def test_swap_of_a_request_with_offloaded_blocks_round_trips_exactly(tiny_llama):
    """Bounded residency (`recency`: which blocks stay does not depend on free blocks) and swap
    preemption together: requests with blocks already offloaded by residency (prompts past the
    64-token budget) are swapped out and back in, and greedy output equals the same residency
    without any preemption (recompute preemption is not exact here: it re-prefills in chunks
    that attend to other resident blocks than the decode steps did)."""
    g = torch.Generator().manual_seed(5)
    ps = [{"prompt_token_ids": torch.randint(3, 384, (90 + 3 * i,), generator=g).tolist()}
          for i in range(4)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=100)
    kw = dict(kv_resident_tokens=64, kv_resident_policy="recency")
    ref = [o.outputs[0].token_ids for o in LLM(tiny_llama, **engine_kwargs(**kw)).generate(
        ps, params)]
    llm = LLM(tiny_llama, **engine_kwargs(num_kv_blocks=8, preemption_mode="swap", **kw))
    eng = llm.engine
    with_offloads = []
    preempt = eng.scheduler._preempt

    def spy(req):
        if OFFLOADED in eng.kv.blocks_of(req.request_id):
            with_offloads.append(req.request_id)
        preempt(req)
    eng.scheduler._preempt = spy
    outs = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    assert with_offloads, "no request with residency offloads was preempted"
    assert outs == ref
    assert_clean(eng)


def test_swap_moves_copy_each_block_once_and_the_written_partial_block_again():
    """Planner level (ids only): a swap-out copies every block; after a resume the full blocks'
    host copies stay current, so swapping out again frees them without a copy, but the partial
    last block, written meanwhile, is copied again. Swapping out before a resume's reloads ran
    cancels them and copies nothing. Freeing the request records the drop of its copies."""
    kv = KVCacheManager(8, 16)
    req = SimpleNamespace(request_id="r", num_computed_tokens=0)
    assert kv.allocate_slots(req, 40)
    req.num_computed_tokens = 40  # blocks 0, 1 full, block 2 half
    phys = list(kv.blocks_of("r"))
    kv.swap_out(req)
    moves = kv.take_moves()
    assert moves.offload == [("r", [2, 1, 0], phys[::-1])] and not moves.reload
    assert kv.blocks_of("r") == [OFFLOADED] * 3 and kv.pool.num_free_blocks == 8

    assert kv.swap_in(req, 1)
    moves = kv.take_moves()
    assert [(r, i) for r, i, _ in moves.reload] == [("r", [0, 1, 2])] and not moves.offload
    assert moves.repool == [("r", 2)]  # block 2 fills up from here
    assert OFFLOADED not in kv.blocks_of("r")
    req.num_computed_tokens = 41
    back = list(kv.blocks_of("r"))
    kv.swap_out(req)
    assert kv.take_moves().offload == [("r", [2], [back[2]])]

    assert kv.swap_in(req, 1)
    kv.swap_out(req)  # before the reloads were applied
    moves = kv.take_moves()
    assert not moves.reload and not moves.offload
    assert kv.pool.num_free_blocks == 8

    kv.free(req)
    assert kv.take_moves().drop == ["r"]
    assert kv.swapped == {} and kv.host.current == {} and kv.pool.num_free_blocks == 8
