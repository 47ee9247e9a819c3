"""Engine core against HF transformers and its own invariants (tiny random models, fp32, CPU)."""
import asyncio
import threading

import pytest
import torch

from conftest import ARCHS, engine_kwargs
from luceio import LLM, AsyncEngine, EngineArgs, SamplingParams
from luceio.sampling_params import RequestOutputKind

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts_of(n, vocab=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(1, 70, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def hf_greedy(path, prompt, n):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers(tiny_models, arch):
    from transformers import AutoModelForCausalLM
    path = tiny_models[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, **engine_kwargs())
    prompts = prompts_of(4, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, **GREEDY))
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):]
        assert o.outputs[0].token_ids == ref.tolist()
        assert o.outputs[0].finish_reason == "length"


def _alone(path, prompts, params, **kw):
    llm = LLM(path, **engine_kwargs(**kw))
    return [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]


async def _concurrent(engine, prompts, params):
    async def one(i, p):
        last = None
        async for out in engine.generate({"prompt_token_ids": p}, params, f"r{i}"):
            last = out
        return last.outputs[0].token_ids
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 24},  # forces chunked prefill mixed with decodes
    {"num_kv_blocks": 12, "max_num_batched_tokens": 32},  # forces preemption by recompute
], ids=["plain", "chunked", "preempt"])
async def test_concurrent_equals_alone(tiny_llama, kw):
    prompts = prompts_of(18, seed=2)
    params = SamplingParams(max_tokens=20, **GREEDY)
    expected = _alone(tiny_llama, prompts, params)
    engine = AsyncEngine.from_engine_args(EngineArgs(model=tiny_llama, **engine_kwargs(**kw)))
    got = await _concurrent(engine, prompts, params)
    assert got == expected
    if "num_kv_blocks" in kw:
        assert engine.engine.scheduler.num_preemptions > 0
    if "max_num_batched_tokens" in kw:
        assert engine.engine.counters["steps"] > 20
    assert engine.engine.kv.pool.num_free_blocks == engine.engine.kv.pool.num_blocks
    await engine.shutdown()


def test_prefix_caching_computes_only_new_tokens(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs())
    eng = llm.engine
    shared = prompts_of(1, seed=3)[0] * 3  # long shared prefix
    shared = shared[:64]
    first = llm.generate([{"prompt_token_ids": shared + [5, 6, 7]}], SamplingParams(max_tokens=4))
    second_prompt = shared + [8, 9, 10, 11]
    scheduled = []
    orig = eng.scheduler.schedule

    def spy():
        out = orig()
        scheduled.extend(s.num_new_tokens for s in out.scheduled)
        return out
    eng.scheduler.schedule = spy
    out = llm.generate([{"prompt_token_ids": second_prompt}], SamplingParams(max_tokens=4, **GREEDY))
    assert out[0].num_cached_tokens == 64
    assert scheduled[0] == len(second_prompt) - 64  # only the new tokens were prefilled
    fresh = _alone(tiny_llama, [second_prompt], SamplingParams(max_tokens=4, **GREEDY),
                   enable_prefix_caching=False)
    assert out[0].outputs[0].token_ids == fresh[0] and first


async def test_abort_mid_stream_frees_blocks(tiny_llama):
    engine = AsyncEngine.from_engine_args(EngineArgs(model=tiny_llama, **engine_kwargs()))
    pool = engine.engine.kv.pool
    params = SamplingParams(max_tokens=200, **GREEDY)

    async def consume_then_break(i):
        n = 0
        async for _ in engine.generate({"prompt_token_ids": [3 + i] * 20}, params, f"b{i}"):
            n += 1
            if n == 3:
                break
    await asyncio.gather(*(consume_then_break(i) for i in range(4)))
    agen = engine.generate({"prompt_token_ids": [7] * 10}, params, "explicit")
    await agen.__anext__()
    await engine.abort("explicit")
    await agen.aclose()
    for _ in range(50):
        if pool.num_free_blocks == pool.num_blocks:
            break
        await asyncio.sleep(0.02)
    assert pool.num_free_blocks == pool.num_blocks
    assert not engine.engine.scheduler.running and not engine.engine.scheduler.waiting
    await engine.shutdown()


def test_seeded_sampling_is_reproducible(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs())
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    a = llm.generate([{"prompt_token_ids": [5, 6, 7]}], p)[0].outputs[0].token_ids
    # the same request inside a different batch gives the same tokens
    others = [{"prompt_token_ids": [9] * 5}] * 3
    b = llm.generate([{"prompt_token_ids": [5, 6, 7]}] + others,
                     [p] + [SamplingParams(temperature=1.0, max_tokens=10)] * 3)[0]
    assert a == b.outputs[0].token_ids
    c = llm.generate([{"prompt_token_ids": [5, 6, 7]}], p.clone(seed=99))[0].outputs[0].token_ids
    assert a != c


def test_n_samples_share_prompt_blocks(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs())
    prompt = prompts_of(1, seed=4)[0] * 2
    out = llm.generate([{"prompt_token_ids": prompt[:40]}],
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert llm.engine.kv.pool.num_hits >= 2 * (40 // 16)  # samples 2 and 3 hit sample 1's blocks


def test_stop_token_ids_and_strings(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs())
    base = llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=30, **GREEDY))[0]
    toks, text = base.outputs[0].token_ids, base.outputs[0].text
    stop_id = toks[5]
    out = llm.generate([{"prompt_token_ids": [11, 12, 13]}],
                       SamplingParams(max_tokens=30, stop_token_ids=[stop_id], **GREEDY))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == toks[:toks.index(stop_id) + 1]
    stop_str = text[len(text) // 2: len(text) // 2 + 3]
    assert stop_str.strip()
    out = llm.generate([{"prompt_token_ids": [11, 12, 13]}],
                       SamplingParams(max_tokens=30, stop=[stop_str], **GREEDY))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str
    assert out.text == text[:text.index(stop_str)]


async def test_stop_string_never_leaks_into_stream(tiny_llama):
    engine = AsyncEngine.from_engine_args(EngineArgs(model=tiny_llama, **engine_kwargs()))
    ref = LLM(tiny_llama, **engine_kwargs()).generate(
        [{"prompt_token_ids": [21, 22, 23]}], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0].text
    stop_str = ref[10:14]
    params = SamplingParams(max_tokens=30, stop=[stop_str], output_kind=RequestOutputKind.DELTA, **GREEDY)
    streamed = ""
    async for out in engine.generate({"prompt_token_ids": [21, 22, 23]}, params, "s"):
        streamed += out.outputs[0].text
        assert stop_str not in streamed
    assert streamed == ref[:ref.index(stop_str)]
    await engine.shutdown()


def test_logprobs_match_transformers(tiny_models):
    from transformers import AutoModelForCausalLM
    path = tiny_models["qwen2"]
    llm = LLM(path, **engine_kwargs())
    prompt = [5, 17, 33, 99, 150]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, **GREEDY))[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seq = prompt + out.outputs[0].token_ids
    ref = hf(torch.tensor([seq])).logits[0].log_softmax(-1)
    for i, d in enumerate(out.outputs[0].logprobs):
        pos = len(prompt) - 1 + i
        tok = seq[pos + 1]
        assert d[tok].logprob == pytest.approx(ref[pos, tok].item(), abs=1e-4)
        top = ref[pos].topk(3)
        for v, t in zip(top.values.tolist(), top.indices.tolist()):
            assert d[t].logprob == pytest.approx(v, abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i][prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)


def test_requests_that_can_never_fit_are_rejected(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs(max_model_len=64))
    with pytest.raises(ValueError, match="64"):
        llm.generate([{"prompt_token_ids": [3] * 70}], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([{"prompt_token_ids": [3] * 40}], SamplingParams(max_tokens=40))
    small = LLM(tiny_llama, **engine_kwargs(num_kv_blocks=2, max_model_len=64))
    with pytest.raises(ValueError, match="KV"):
        small.generate([{"prompt_token_ids": [3] * 20}], SamplingParams(max_tokens=30))
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


async def test_event_loop_stays_responsive(tiny_llama):
    """Every step runs off the loop, on the one engine thread: while a forward runs, the loop
    completes a coroutine the forward itself waits for. A forward run on the loop thread (or one
    that waited for the loop to finish its work) could never be served: the step would time out
    and the request fail. Each step waits for its probe, so a fast machine cannot finish the
    generation before the loop was tested."""
    engine = AsyncEngine.from_engine_args(EngineArgs(model=tiny_llama, **engine_kwargs()))
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    served, step_threads = [], []  # per step: the probe's thread, and the forward's
    execute = engine.engine.execute

    async def probe():
        await asyncio.sleep(0)
        return threading.get_ident()

    def waiting_execute(batch, *rest):
        step_threads.append(threading.get_ident())
        served.append(asyncio.run_coroutine_threadsafe(probe(), loop).result(timeout=60))
        return execute(batch, *rest)

    engine.engine.execute = waiting_execute
    outs = [o async for o in engine.generate({"prompt_token_ids": [3] * 40},
                                             SamplingParams(max_tokens=8, **GREEDY), "long")]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert len(served) == engine.engine.counters["steps"] == 8
    assert served == [loop_thread] * 8
    assert len(set(step_threads)) == 1 and loop_thread not in step_threads
    await engine.shutdown()


def test_bad_ids_are_rejected_without_harming_others(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs())
    eng = llm.engine
    eng.add_request("ok", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=5, **GREEDY))
    for bad, params in [({"prompt_token_ids": [1, 2, 100000]}, SamplingParams()),
                        ([1, 2, -1], SamplingParams()),
                        ([1, 2], SamplingParams(stop_token_ids=[10**6], min_tokens=2)),
                        ([1, 2], SamplingParams(seed=2**64))]:
        with pytest.raises(ValueError):
            eng.add_request(None, bad, params)
    eng.add_request("a", [5, 6], SamplingParams(n=2, max_tokens=3))
    with pytest.raises(ValueError, match="collides"):
        eng.add_request("a#1", [5, 6], SamplingParams(max_tokens=3))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    assert done["ok"].outputs[0].finish_reason == "length"


def test_stop_string_waits_for_min_tokens(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs())
    base = llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=30, **GREEDY))[0]
    text = base.outputs[0].text
    stop = text[:3]
    out = llm.generate([{"prompt_token_ids": [11, 12, 13]}],
                       SamplingParams(max_tokens=30, stop=[stop], min_tokens=20, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) >= 20


def test_prompt_logprobs_survive_prefix_hits_and_preemption(tiny_llama):
    prompt = list(range(40, 80))
    p = SamplingParams(max_tokens=4, prompt_logprobs=1, **GREEDY)
    llm = LLM(tiny_llama, **engine_kwargs())
    first = llm.generate([{"prompt_token_ids": prompt}], p)[0].prompt_logprobs
    second = llm.generate([{"prompt_token_ids": prompt}], p)[0].prompt_logprobs
    assert len(first) == len(second) == 40
    assert [d and d[prompt[i]].logprob for i, d in enumerate(first)] == \
        pytest.approx([d and d[prompt[i]].logprob for i, d in enumerate(second)])
    small = LLM(tiny_llama, **engine_kwargs(num_kv_blocks=8, max_num_batched_tokens=16))
    outs = small.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": list(range(90, 140))}],
                          [p, SamplingParams(max_tokens=60, **GREEDY)])
    again = outs[0].prompt_logprobs
    assert len(again) == 40
    assert [d and round(d[prompt[i]].logprob, 4) for i, d in enumerate(again)] == \
        [d and round(d[prompt[i]].logprob, 4) for i, d in enumerate(first)]
