"""Overlapped scheduling on the GPU, with CUDA graphs: the overlapped engine (`async_scheduling`,
the GPU default) against the synchronous one, token for token, and decode steps that launch
without a single host synchronisation."""
import pytest
import torch

from conftest import engine_kwargs
from luceio import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts(n):
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 384, (5 + 9 * i,), generator=g).tolist()}
            for i in range(n)]


def run(path, params, overlap, **kw):
    llm = LLM(path, **engine_kwargs(device="cuda", async_scheduling=overlap, **kw))
    outs = llm.generate(prompts(12), params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.cumulative_logprob) for c in o.outputs]
            for o in outs], llm.engine


def both(path, params, **kw):
    sync, _ = run(path, params, False, **kw)
    got, eng = run(path, params, True, **kw)
    assert eng.runner.graphs is not None and eng.runner.graphs.graphs
    assert eng.counters["overlapped_steps"] > 0
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
    assert not eng.has_unfinished_requests()
    return sync, got, eng


def test_overlap_is_the_gpu_default(tiny_llama):
    assert LLM(tiny_llama, **engine_kwargs(device="cuda")).engine.pipeline.overlap


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_overlapped_equals_synchronous_with_graphs(tiny_llama, dtype):
    # every prompt is admitted in the first step and ends by length, so both engines run the
    # same batch shapes: bf16 must match exactly too
    sync, got, eng = both(tiny_llama, SamplingParams(max_tokens=48, **GREEDY), dtype=dtype)
    assert got == sync
    assert eng.counters["discarded_tokens"] == 0


def test_seeded_sampling_penalties_logprobs_equal_synchronous(tiny_llama):
    params = [SamplingParams(seed=i, max_tokens=32, ignore_eos=True, logprobs=2,
                             **[dict(temperature=0.9, top_k=30, top_p=0.9),
                                dict(temperature=1.1, min_p=0.05),
                                dict(temperature=1.0, repetition_penalty=1.3,
                                     frequency_penalty=0.3)][i % 3]) for i in range(12)]
    sync, got, _ = both(tiny_llama, params)
    assert [[(t, f) for t, f, _ in o] for o in got] == [[(t, f) for t, f, _ in o] for o in sync]
    for a, b in zip(got, sync):
        assert a[0][2] == pytest.approx(b[0][2], abs=1e-5)


def test_stop_tokens_drop_the_extra_token(tiny_llama):
    base, _ = run(tiny_llama, SamplingParams(max_tokens=40, **GREEDY), False)
    params = [SamplingParams(max_tokens=40, stop_token_ids=[o[0][0][4 + i % 9]], **GREEDY)
              for i, o in enumerate(base)]
    sync, got, eng = both(tiny_llama, params)
    assert got == sync and all(o[0][1] == "stop" for o in got)
    assert eng.counters["discarded_tokens"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_overlapped_equals_synchronous(tiny_llama, mode):
    sync, got, eng = both(tiny_llama, SamplingParams(max_tokens=48, **GREEDY), num_kv_blocks=14,
                          max_num_batched_tokens=64, preemption_mode=mode)
    assert got == sync
    assert eng.scheduler.num_preemptions > 0 and eng.counters["sync_steps"]["preemption"] > 0
    assert eng.runner.host_store.request_ids() == [] and eng.kv.swapped == {}


def test_speculation_with_verify_graphs(tiny_llama):
    plain, _ = run(tiny_llama, SamplingParams(max_tokens=48, **GREEDY), False, enforce_eager=True)
    got, eng = run(tiny_llama, SamplingParams(max_tokens=48, **GREEDY), True,
                   speculative_method="draft", draft_model=tiny_llama, num_speculative_tokens=3)
    assert [o[0][0] for o in got] == [o[0][0] for o in plain]
    assert eng.spec.stats.num_draft_tokens > 0 and eng.counters["sync_steps"]["speculation"] > 0
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_graphed_decode_steps_launch_without_a_host_sync(tiny_llama):
    """With torch's sync debug mode set to "error", any host synchronisation inside `execute`
    (a `.tolist()`, a pageable copy, a stream synchronize) raises: decode steps replayed from a
    graph, with sampling and logprobs, must launch without one."""
    llm = LLM(tiny_llama, **engine_kwargs(device="cuda", async_scheduling=True))
    eng = llm.engine
    execute, checked = eng.execute, []

    def strict(batch, *rest):
        if batch.decode_only and batch.inputs.device_ids and \
                eng.runner.graphs.fits(batch.inputs.host):
            torch.cuda.set_sync_debug_mode("error")
            try:
                result = execute(batch, *rest)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            checked.append(len(batch.sched.scheduled))
            return result
        return execute(batch, *rest)

    eng.execute = strict
    params = [SamplingParams(max_tokens=24, ignore_eos=True, seed=i, logprobs=1,
                             **(dict(temperature=0.8, top_k=20, top_p=0.9) if i % 2 else
                                dict(temperature=0.0))) for i in range(12)]
    outs = llm.generate(prompts(12), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert len(checked) > 10
