"""Overlapped scheduling (issue 14 items 1-2), forced on for the CPU: the same code path as on a
GPU, where step N+1 is built while step N runs and its input ids are gathered on the device from
step N's sampled ids. The oracle is the synchronous engine (`async_scheduling=False`): outputs
must be identical token for token (and logprob for logprob) for greedy and seeded sampling, stop
strings, n > 1, max_tokens, penalties, preemption (both modes), speculation (which falls back to
synchronous steps), aborts at every step, structured output. Each engine test also checks which
steps overlapped and why the others ran synchronously (`stats`), and that the KV pool is whole
again at the end."""
import asyncio

import pytest
import torch

from conftest import engine_kwargs
from luceio import LLM, AsyncEngine, EngineArgs, SamplingParams
from luceio.sampling_params import RequestOutputKind, StructuredOutputsParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
DELTA = RequestOutputKind.DELTA


def prompts_of(n, seed=0, longest=70):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 384, (int(torch.randint(1, longest, (1,),
                                                                          generator=g)),),
                                               generator=g).tolist()} for _ in range(n)]


def run(path, prompts, params, overlap, **kw):
    llm = LLM(path, **engine_kwargs(async_scheduling=overlap, **kw))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
              _lps(c.logprobs)) for c in o.outputs] + [_lps(o.prompt_logprobs)]
            for o in outs], llm.engine


def _lps(lps):
    """Logprob entries as comparable tuples (None stays None)."""
    if lps is None:
        return None
    return [None if d is None else sorted((t, x.logprob, x.rank) for t, x in d.items())
            for d in lps]


def both(path, prompts, params, **kw):
    """(synchronous outputs, overlapped outputs, the overlapped engine)."""
    sync, _ = run(path, prompts, params, False, **kw)
    got, eng = run(path, prompts, params, True, **kw)
    return sync, got, eng


def assert_clean(eng):
    pool = eng.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not eng.has_unfinished_requests() and not eng.states and not eng.pipeline.busy
    assert eng.runner.host_store.request_ids() == [] and eng.kv.swapped == {}


def test_default_is_on_for_gpus_only_and_the_flag_parses():
    import argparse
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert not EngineArgs().resolved_async_scheduling(cpu)
    assert EngineArgs().resolved_async_scheduling(gpu)
    assert EngineArgs(async_scheduling=True).resolved_async_scheduling(cpu)
    assert not EngineArgs(async_scheduling=False).resolved_async_scheduling(gpu)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert [parser.parse_args(a).async_scheduling for a in
            ([], ["--async-scheduling"], ["--no-async-scheduling"])] == [None, True, False]


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 24}], ids=["plain", "chunked"])
def test_greedy_equals_synchronous(tiny_models, kw):
    prompts = prompts_of(12, seed=1)
    params = [SamplingParams(max_tokens=4 + 3 * i, **GREEDY) for i in range(12)]
    for arch in ("llama", "qwen3"):
        sync, got, eng = both(tiny_models[arch], prompts, params, **kw)
        assert got == sync, arch
        st = eng.stats()
        assert st.overlapped_steps > st.steps // 2
        assert set(st.sync_steps) <= {"idle"}  # nothing here needs a synchronous step
        # max_tokens is known in advance: no request is scheduled past it
        assert st.discarded_tokens == 0
        assert_clean(eng)


def test_seeded_sampling_penalties_and_logprobs_equal_synchronous(tiny_llama):
    prompts = prompts_of(8, seed=2)
    kinds = [dict(temperature=0.8, top_k=40, top_p=0.9),
             dict(temperature=1.2, min_p=0.05, logprobs=3, prompt_logprobs=2),
             dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4,
                  presence_penalty=0.3, logprobs=1),
             dict(temperature=0.0, repetition_penalty=1.5, min_tokens=6),
             dict(temperature=0.7, logit_bias={5: 3.0, 9: -2.0},
                  allowed_token_ids=list(range(3, 200)))]
    params = [SamplingParams(seed=100 + i, max_tokens=16, ignore_eos=True, **kinds[i % 5])
              for i in range(8)]
    sync, got, eng = both(tiny_llama, prompts, params, max_num_batched_tokens=40)
    assert got == sync
    assert eng.counters["overlapped_steps"] > 0
    assert_clean(eng)


def test_a_token_on_the_device_counts_as_if_appended():
    """Sampler: a row's pending token (overlapped scheduling) joins the penalty counts and the
    min_tokens count exactly as the same token appended to the request does."""
    from luceio.request import Request
    from luceio.sampler import Pending, Sampler
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.6,
                             presence_penalty=0.4),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7, 9]),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7, 9])]
    prompt, outputs, nxt = [1, 2, 3], [[5, 6, 5], [5], [5]], [6, 8, 8]

    def reqs(pending: bool):
        out = []
        for i, p in enumerate(params):
            r = Request(str(i), prompt, p, {11}, 64)
            r.all_token_ids += outputs[i] + ([] if pending else [nxt[i]])
            r.num_pending_tokens = int(pending)
            out.append(r)
        return out
    appended = Sampler().process(logits, reqs(False))
    pending = Sampler().process(logits, reqs(True), pending=Pending([0, 1, 2], torch.tensor(nxt)))
    assert torch.equal(pending, appended)
    assert torch.isinf(appended[1, [7, 9, 11]]).all() and not torch.isinf(appended[2]).any()
    assert not torch.equal(appended, Sampler().process(logits, reqs(True)))


def test_n_samples_equal_synchronous_and_share_the_prompt(tiny_llama):
    prompt = [{"prompt_token_ids": prompts_of(1, seed=4)[0]["prompt_token_ids"] * 2}]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    sync, got, eng = both(tiny_llama, prompt, params)
    assert got == sync and len({tuple(c[0]) for c in got[0][:3]}) > 1
    assert eng.kv.pool.num_hits >= 2 * (len(prompt[0]["prompt_token_ids"]) // 16)
    assert_clean(eng)


def test_stops_end_outputs_as_synchronous_and_extra_tokens_are_dropped(tiny_llama):
    prompts = prompts_of(6, seed=5)
    base, _ = run(tiny_llama, prompts, SamplingParams(max_tokens=30, **GREEDY), False)
    params = []
    for i, out in enumerate(base):
        tokens, stop = out[0][0], _stop_string(out[0][1])
        if i % 2 or stop is None:
            params.append(SamplingParams(max_tokens=30, stop_token_ids=[tokens[5 + i]], **GREEDY))
        else:
            params.append(SamplingParams(max_tokens=30, stop=[stop], **GREEDY))
    assert any(p.stop for p in params)
    sync, got, eng = both(tiny_llama, prompts, params)
    assert got == sync
    assert all(o[0][2] == "stop" and len(o[0][0]) < 30 for o in got)
    # each request ran one step past its stop before the host saw the stop
    assert eng.counters["discarded_tokens"] > 0
    assert_clean(eng)


def _stop_string(text: str) -> str | None:
    """Two printable characters from the middle of a (random model's) text, if it has any."""
    for j in range(len(text) // 3, len(text) - 1):
        if text[j:j + 2].isprintable() and "\ufffd" not in text[j:j + 2] and text[j:j + 2].strip():
            return text[j:j + 2]
    return None


def _stream(eng, prompts, params) -> dict[str, list]:
    """Runs an engine step by step; DELTA outputs per request: (tokens, text) chunks."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp.clone(output_kind=DELTA))
    streamed: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            streamed.setdefault(o.request_id, []).append(
                (list(o.outputs[0].token_ids), o.outputs[0].text, o.finished))
    return streamed


def test_a_finished_request_never_streams_its_extra_token(tiny_llama):
    prompts = prompts_of(5, seed=6)
    base, _ = run(tiny_llama, prompts, SamplingParams(max_tokens=24, **GREEDY), False)
    params = [SamplingParams(max_tokens=24, stop_token_ids=[o[0][0][3 + 2 * i]], **GREEDY)
              for i, o in enumerate(base)]
    sync = _stream(LLM(tiny_llama, **engine_kwargs(async_scheduling=False)).engine, prompts,
                   params)
    eng = LLM(tiny_llama, **engine_kwargs(async_scheduling=True)).engine
    got = _stream(eng, prompts, params)
    assert eng.counters["discarded_tokens"] >= len(prompts)
    for rid, chunks in got.items():
        tokens = [t for c in chunks for t in c[0]]
        assert tokens == [t for c in sync[rid] for t in c[0]]
        assert "".join(c[1] for c in chunks) == "".join(c[1] for c in sync[rid])
        assert [c[2] for c in chunks].count(True) == 1 and chunks[-1][2]
    assert_clean(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_equals_synchronous(tiny_llama, mode):
    prompts = prompts_of(12, seed=11)
    params = SamplingParams(max_tokens=30, **GREEDY)
    plain, _ = run(tiny_llama, prompts, params, False)
    small = dict(num_kv_blocks=12, max_num_batched_tokens=48, preemption_mode=mode)
    sync, got, eng = both(tiny_llama, prompts, params, **small)
    assert got == sync == plain
    assert eng.scheduler.num_preemptions > 0
    # preemption is decided synchronously; the other steps overlap
    assert eng.counters["sync_steps"]["preemption"] > 0 and eng.counters["overlapped_steps"] > 0
    assert_clean(eng)


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_speculation_falls_back_per_step_and_equals_synchronous(tiny_llama, spec):
    span = [[(7 * i + j) % 300 + 3 for j in range(3 + i % 5)] for i in range(10)]
    prompts = [{"prompt_token_ids": (s * (2 + i % 4))[:8 + 5 * i]} for i, s in enumerate(span)]
    params = SamplingParams(max_tokens=40, **GREEDY)
    plain, _ = run(tiny_llama, prompts, params, False)
    kw = dict(speculative_method=spec, num_speculative_tokens=3,
              draft_model=tiny_llama if spec == "draft" else None)
    got, eng = run(tiny_llama, prompts, params, True, **kw)
    assert [o[0][0] for o in got] == [o[0][0] for o in plain]  # lossless
    assert [o[0][1] for o in got] == [o[0][1] for o in plain]  # and the same text
    assert [o[0][2] for o in got] == [o[0][2] for o in plain]
    assert eng.spec.stats.num_draft_tokens > 0
    assert eng.counters["sync_steps"]["speculation"] > 0
    # the cost model's periodic plain step (and what follows it) overlaps
    assert eng.counters["overlapped_steps"] > 0
    assert_clean(eng)


def test_aborts_at_every_step(tiny_llama):
    """One request of four is aborted after k steps, for every k until it would finish: the
    others equal the synchronous engine, the aborted one streamed a prefix of its output, and
    nothing is left behind (KV blocks, swapped copies, in-flight steps)."""
    prompts = prompts_of(4, seed=12, longest=40)
    params = SamplingParams(max_tokens=12, **GREEDY)
    ref, _ = run(tiny_llama, prompts, params, False)
    for mode in ("recompute", "swap"):
        eng = LLM(tiny_llama, **engine_kwargs(async_scheduling=True, num_kv_blocks=8,
                                              max_num_batched_tokens=24,
                                              preemption_mode=mode)).engine
        for k in range(16):
            for i, p in enumerate(prompts):
                eng.add_request(f"{k}-{i}", p, params.clone(output_kind=DELTA))
            victim, tokens, finish = f"{k}-{k % 4}", {}, {}
            for step in range(200):
                if step == k:
                    eng.abort_request(victim)
                for o in eng.step():
                    tokens.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
                    if o.finished:
                        finish[o.request_id] = o.outputs[0].finish_reason
                if not eng.has_unfinished_requests():
                    break
            for i in range(4):
                rid = f"{k}-{i}"
                if rid == victim and finish[rid] == "abort":
                    assert tokens.get(rid, []) == ref[i][0][0][:len(tokens.get(rid, []))]
                else:
                    assert tokens[rid] == ref[i][0][0] and finish[rid] == "length", (mode, k)
            assert_clean(eng)
        assert eng.scheduler.num_preemptions > 0, mode
        assert eng.counters["overlapped_steps"] > 0


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "age": {"type": "integer", "minimum": 0,
                                                  "maximum": 99}},
          "required": ["name", "age"]}


@pytest.mark.parametrize("seed", [None, 5])
def test_structured_output_overlaps_and_equals_synchronous(tiny_llama, seed):
    """Constrained steps stay in flight: the next step's forward is launched before the step in
    flight is processed, and its masks are built after (`before_masks`). Greedy and seeded
    sampling give the synchronous engine's output, grammars that terminate while a step is in
    flight included (their extra token dropped); only-constrained batches overlap too (every
    step was synchronous before)."""
    sampling = GREEDY if seed is None else dict(temperature=0.8, seed=seed)
    constrained = SamplingParams(max_tokens=60, **sampling, structured_outputs=
                                 StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    for prompts, params in ((["{", "name:", "x"], [constrained] * 3),
                            (["{", "name:", "x"] + prompts_of(3, seed=13),
                             [constrained] * 3 + [SamplingParams(max_tokens=60, **GREEDY)] * 3)):
        sync, got, eng = both(tiny_llama, prompts, params)
        assert got == sync
        assert all(o[0][2] == "stop" for o in got[:3])
        assert "structured output" not in eng.counters["sync_steps"]
        assert eng.counters["overlapped_steps"] > 0
        assert eng.structured.num_active == 0
        assert_clean(eng)


def test_residency_runs_synchronously(tiny_llama):
    prompts = prompts_of(3, seed=15, longest=200)
    params = SamplingParams(max_tokens=20, **GREEDY)
    sync, got, eng = both(tiny_llama, prompts, params, kv_resident_tokens=64)
    assert got == sync
    assert eng.counters["overlapped_steps"] == 0 and eng.counters["sync_steps"]["residency"] > 0
    assert_clean(eng)


async def test_async_engine_streams_equal_synchronous(tiny_llama):
    prompts = prompts_of(10, seed=14)
    base, _ = run(tiny_llama, prompts, SamplingParams(max_tokens=20, **GREEDY), False)
    stops = [_stop_string(o[0][1]) for o in base]
    params = [SamplingParams(max_tokens=20, output_kind=DELTA,
                             stop=[stops[i]] if i % 3 == 0 and stops[i] else None,
                             stop_token_ids=[o[0][0][6]] if i % 3 == 1 else None, **GREEDY)
              for i, o in enumerate(base)]
    assert any(p.stop for p in params)
    ref, _ = run(tiny_llama, prompts, [p.clone(output_kind=RequestOutputKind.CUMULATIVE)
                                       for p in params], False)
    engine = AsyncEngine.from_engine_args(EngineArgs(model=tiny_llama,
                                                     **engine_kwargs(async_scheduling=True)))

    async def one(i):
        outs = [o async for o in engine.generate(prompts[i], params[i], f"a{i}")]
        return ([t for o in outs for t in o.outputs[0].token_ids],
                "".join(o.outputs[0].text for o in outs), outs[-1].outputs[0].finish_reason)
    got = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(10))), 60)
    assert got == [(r[0][0], r[0][1], r[0][2]) for r in ref]
    eng = engine.engine
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert eng.counters["overlapped_steps"] > 0 and eng.counters["discarded_tokens"] > 0
    assert_clean(eng)
    await engine.shutdown()
