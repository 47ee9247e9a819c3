"""Swap preemption: a preempted request's KV goes to host memory and comes back bit-exact,
outputs equal recompute preemption and no preemption, and nothing is left behind."""
import pytest
import torch

from conftest import engine_kwargs
from luceio import LLM, SamplingParams

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
    assert eng_s.runner.host_kv == {}
    assert eng_s.kv.pool.num_free_blocks == eng_s.kv.pool.num_blocks


def test_swapped_blocks_come_back_bit_identical(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs(num_kv_blocks=10, max_num_batched_tokens=48,
                                          preemption_mode="swap"))
    runner = llm.engine.runner
    saved, checked = {}, []
    original = runner.swap

    def spy(out):
        for rid, blocks in out.swap_out:
            saved[rid] = torch.stack([kv[:, blocks].clone() for kv in runner.kv_caches])
        original(out)
        for rid, blocks in out.swap_in:
            back = torch.stack([kv[:, blocks] for kv in runner.kv_caches])
            assert torch.equal(back, saved.pop(rid))
            checked.append(rid)
    runner.swap = spy
    llm.generate(prompts(), GREEDY)
    assert checked, "no request was swapped out and back in"
    assert runner.host_kv == {} and not saved


def test_abort_while_swapped_drops_host_copy(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs(num_kv_blocks=10, max_num_batched_tokens=48,
                                          preemption_mode="swap"))
    eng = llm.engine
    for i, p in enumerate(prompts()):
        eng.add_request(f"q{i}", p, GREEDY)
    for _ in range(200):
        eng.step()
        if eng.runner.host_kv:
            break
    assert eng.runner.host_kv, "nothing was swapped out"
    eng.abort_request(list(eng.states))
    eng.step()
    assert eng.runner.host_kv == {}
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
