"""Engine hardening (issue 12): per-step output work that does not grow with the output, request
id reuse, stop-string limits and one-pass matching, one owning event loop, batch admission,
and KV cache sizing and memory reporting. Tiny random models, fp32, CPU; no assertion depends
on wall-clock speed."""
import asyncio
import json
import logging
import os
import random
import threading
import types

import pytest
from safetensors import safe_open

import luceio.output_processor as output_processor
import luceio.runner as runner_module
from conftest import engine_kwargs, make_tiny_model
from luceio import AsyncEngine, EngineArgs, LLMEngine, SamplingParams
from luceio.config import CPU_KV_MAX_FRACTION, CPU_KV_TOKENS, MIN_FITTED_CONTEXT
from luceio.output_processor import SampleState, StopStrings
from luceio.request import Request, RequestStatus
from luceio.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, RequestOutputKind
from luceio.server.metrics import ServerMetrics
from luceio.server.protocol import APIError, ModelContext, ParsedRequest, parse_completion
from luceio.server.run import Run

GREEDY = dict(temperature=0.0, ignore_eos=True)
LONG_CONTEXT = 32768  # a model context larger than the CPU KV default holds, like Qwen2.5's


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> str:
    """The tiny llama with a 32768-token context."""
    return make_tiny_model(str(tmp_path_factory.mktemp("long") / "llama"), "llama",
                           context=LONG_CONTEXT)


def _async_engine(path, **kw) -> AsyncEngine:
    return AsyncEngine.from_engine_args(EngineArgs(model=path, **engine_kwargs(**kw)))


def _values(lps):
    return [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in d.items()} for d in lps]


async def _until(condition, what: str) -> None:
    """Waits for a condition the step task brings about (bounded, so a bug cannot hang)."""
    for _ in range(6000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


# item 1: logprobs are built once per position ----------------------------------------------------
def test_logprobs_built_once_per_position(long_llama, monkeypatch):
    built = [0]

    class CountedLogprob(output_processor.Logprob):
        def __init__(self, *a, **kw):
            built[0] += 1
            super().__init__(*a, **kw)

    monkeypatch.setattr(output_processor, "Logprob", CountedLogprob)
    eng = LLMEngine(EngineArgs(model=long_llama, **engine_kwargs()))
    num_tokens, k = 1000, 20
    kinds = {"cumulative": RequestOutputKind.CUMULATIVE, "delta": RequestOutputKind.DELTA,
             "final": RequestOutputKind.FINAL_ONLY}
    for rid, kind in kinds.items():
        eng.add_request(rid, {"prompt_token_ids": [5, 6, 7]},
                        SamplingParams(max_tokens=num_tokens, logprobs=k, output_kind=kind,
                                       **GREEDY))
    outs = {rid: [] for rid in kinds}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].append(o.outputs[0])
    final = outs["final"][-1]
    assert len(final.token_ids) == len(final.logprobs) == num_tokens
    assert all(len(d) in (k, k + 1) and tok in d for tok, d in zip(final.token_ids, final.logprobs))
    entries = sum(len(d) for d in final.logprobs)
    # each request built each position's entries once: linear in the output, not quadratic
    assert built[0] == 3 * entries <= 3 * num_tokens * (k + 1)
    cumulative = outs["cumulative"]
    assert len(cumulative) == num_tokens
    assert _values(cumulative[-1].logprobs) == _values(final.logprobs)
    for i, c in enumerate(cumulative):  # earlier outputs keep their own length: lists are copies
        assert len(c.logprobs) == len(c.token_ids) == i + 1
    assert _values(cumulative[1].logprobs) == _values(final.logprobs[:2])
    delta = [d for c in outs["delta"] for d in c.logprobs]
    assert _values(delta) == _values(final.logprobs)
    assert sum(d[t].logprob for t, d in zip(final.token_ids, final.logprobs)) == \
        pytest.approx(final.cumulative_logprob)


# item 2: a request id names one request at a time ---------------------------------------------


@pytest.mark.parametrize("stale", ["drain", "close"])
async def test_stale_consumer_leaves_reused_id_alone(tiny_llama, stale):
    """A finished request's consumer that lags behind must not remove or abort a newer request
    that reuses its id."""
    engine = _async_engine(tiny_llama)
    old = engine.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, **GREEDY),
                          "x")
    assert not (await old.__anext__()).finished
    # finished in the engine; its final output waits in the stale consumer's queue
    await _until(lambda: "x" not in engine.engine.states, "x finished")
    new = engine.generate({"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=6, **GREEDY), "x")
    outs = [await new.__anext__()]
    if stale == "drain":
        assert [o.finished for o in [o async for o in old]] == [True]
    else:
        await old.aclose()

    async def rest():
        return [o async for o in new]
    outs += await asyncio.wait_for(rest(), 60)  # the old code left `new` without a stream
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert len(outs[-1].outputs[0].token_ids) == 6
    pool = engine.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not engine.engine.states
    await engine.shutdown()


async def test_reusing_a_running_id_is_refused(tiny_llama):
    """The engine's second step waits until the second request is queued, so "x" is still
    running when the engine takes it, however fast the machine generates (before, a fast
    machine finished all 12 tokens of the first before the second arrived)."""
    engine = _async_engine(tiny_llama)
    gate, steps, step = threading.Event(), [0], engine.engine.step

    def gated_step():
        steps[0] += 1
        if steps[0] == 2:
            gate.wait(60)
        return step()
    engine.engine.step = gated_step
    first = engine.generate({"prompt_token_ids": [5, 6, 7]},
                            SamplingParams(max_tokens=12, **GREEDY), "x")
    await first.__anext__()
    second = asyncio.ensure_future(
        engine.generate({"prompt_token_ids": [8]}, SamplingParams(**GREEDY), "x").__anext__())
    await _until(lambda: engine._inbox, "the second request queued")
    gate.set()
    with pytest.raises(ValueError, match="'x' is already in use"):
        await second
    outs = [o async for o in first]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert len(outs[-1].outputs[0].token_ids) == 12
    await engine.shutdown()


# item 4: stop strings ----------------------------------------------------------------------------
def test_stop_string_limits():
    SamplingParams(stop=["a" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)
    for stop in (["x"] * 200_000, ["x"] * (MAX_STOP_STRINGS + 1),
                 ["a" * (MAX_STOP_STRING_CHARS + 1)]):
        with pytest.raises(ValueError) as e:
            SamplingParams(stop=stop)
        msg = str(e.value)
        assert msg.startswith("stop ") and len(msg) < 200
        assert f"{MAX_STOP_STRINGS} strings" in msg and f"{MAX_STOP_STRING_CHARS} characters" in msg
    ctx = ModelContext(["m"], None, 384, 512, 4096, lambda n, m: None)
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": [1, 2, 3], "stop": ["x"] * 200_000}, ctx)
    assert e.value.status == 400 and e.value.param == "stop"
    assert f"at most {MAX_STOP_STRINGS}" in e.value.message


class _Detok:
    """Each token id decodes to a fixed piece of text; id 0 decodes to nothing (a partial
    character held back)."""

    def __init__(self, pieces: dict[int, str]):
        self.pieces = pieces

    def add(self, ids: list[int]) -> str:
        return "".join(self.pieces[t] for t in ids)


def _reference_absorb(pieces, stops, tokens, chunks, min_tokens, include):
    """The token-by-token matcher (the pre-issue implementation): after each token from
    min_tokens on, find every stop from `len(text before the token) - longest + 1`."""
    text, longest, seen = "", max(map(len, stops)), 0
    for chunk in chunks:
        for j, tok in enumerate(tokens[seen:seen + chunk]):
            before = len(text)
            text += pieces[tok]
            if seen + j + 1 < min_tokens:
                continue
            start = max(0, before - longest + 1)
            hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
            if hits:
                i, stop = min(hits)
                return text[:i + (len(stop) if include else 0)], stop, seen + j + 1
        seen += chunk
    return text, None, seen


def test_stop_strings_match_the_token_by_token_reference():
    rng = random.Random(0)
    pieces = {0: "", 1: "a", 2: "b", 3: "ab", 4: "ba", 5: "aab", 6: "c"}
    checked = hits = 0
    for _ in range(3000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 4))]
        tokens = [rng.randrange(len(pieces)) for _ in range(rng.randint(1, 14))]
        chunks, left = [], len(tokens)
        while left:  # steps that accept several tokens at once, as speculation does
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
        min_tokens, include = rng.randint(0, 6), rng.random() < 0.3
        want_text, want_stop, want_tokens = _reference_absorb(pieces, stops, tokens, chunks,
                                                              min_tokens, include)
        params = SamplingParams(stop=stops, min_tokens=min_tokens, max_tokens=None,
                                include_stop_str_in_output=include)
        req = Request("r", [1], params, set(), 1 << 20)
        req.status = RequestStatus.RUNNING
        sample = SampleState(req, None, StopStrings(params.stop))
        sample.detok = _Detok(pieces)
        stop, fed = None, 0
        for chunk in chunks:
            req.all_token_ids += tokens[fed:fed + chunk]
            fed += chunk
            stop = sample.absorb()
            if stop is not None:
                break
        assert (sample.text, stop, req.output_token_ids) == \
            (want_text, want_stop, tokens[:want_tokens]), (stops, tokens, chunks, min_tokens)
        checked, hits = checked + 1, hits + (stop is not None)
    assert hits > checked // 4  # the random cases do hit stops, at all kinds of places


def test_stop_strings_compile_once_per_request(tiny_llama, monkeypatch):
    compiled = []
    real = output_processor.re

    def compile(pattern, *a):
        compiled.append(pattern)
        return real.compile(pattern, *a)

    monkeypatch.setattr(output_processor, "re", types.SimpleNamespace(compile=compile,
                                                                      escape=real.escape))
    eng = LLMEngine(EngineArgs(model=tiny_llama, **engine_kwargs()))
    stops = [f"never{i}" for i in range(MAX_STOP_STRINGS)]
    eng.add_request("s", {"prompt_token_ids": [11, 12]},
                    SamplingParams(n=2, temperature=1.0, max_tokens=30, stop=stops, seed=1,
                                   ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [len(c.token_ids) for c in outs[-1].outputs] == [30, 30]
    assert len(compiled) == 1  # one regex for both samples and all 30 steps


# item 9: one owning event loop --------------------------------------------------------------------
async def test_engine_refuses_a_second_event_loop(tiny_llama):
    engine = _async_engine(tiny_llama)
    running = engine.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=8, **GREEDY),
                              "owner")
    await running.__anext__()

    async def from_another_loop():
        errors = []
        for call in (lambda: engine.generate({"prompt_token_ids": [7]}, SamplingParams(),
                                             "intruder").__anext__(),
                     lambda: engine.abort("owner")):
            try:
                await asyncio.wait_for(call(), 10)  # bounded: the old code reached the engine
            except RuntimeError as e:
                errors.append(str(e))
        return errors

    errors = await asyncio.get_running_loop().run_in_executor(
        None, lambda: asyncio.run(from_another_loop()))
    loop = asyncio.get_running_loop()
    assert len(errors) == 2 and all(repr(loop) in e and "belongs to event loop" in e
                                    for e in errors)
    outs = [o async for o in running]  # the owner's request is untouched
    assert outs[-1].outputs[0].finish_reason == "length"
    assert "intruder" not in engine.engine.states
    await engine.shutdown()


def test_engine_moves_to_a_new_loop_once_the_old_one_closed(tiny_llama):
    engine = _async_engine(tiny_llama)

    async def one():
        return [o async for o in engine.generate({"prompt_token_ids": [5, 6]},
                                                 SamplingParams(max_tokens=3, **GREEDY))]
    first, second = asyncio.run(one()), asyncio.run(one())
    assert first[-1].outputs[0].token_ids == second[-1].outputs[0].token_ids
    asyncio.run(engine.shutdown())


# item 10: a batch of prompts is admitted together ------------------------------------------------
def _run(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int = 4) -> Run:
    state = types.SimpleNamespace(engine=engine, inflight=set(), draining=False,
                                  metrics=ServerMetrics(engine))
    params = SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, **GREEDY)
    req = ParsedRequest(False, "cmpl-t", "m", [{"prompt": None, "prompt_token_ids": p}
                                               for p in prompts],
                        [""] * len(prompts), [params] * len(prompts), False, False)
    return Run(state, req)


def _spy_admissions(engine: AsyncEngine) -> dict:
    """Records, per request id, how many engine steps had run when the engine admitted it (a
    fact that stays true once the request finishes, however fast the steps are)."""
    admitted: dict = {}
    real = engine.engine.add_request

    def add_request(request_id, *args, **kwargs):
        admitted[request_id] = engine.engine.counters["steps"]
        return real(request_id, *args, **kwargs)
    engine.engine.add_request = add_request
    return admitted


async def test_batch_prompts_are_admitted_together(tiny_llama):
    engine = _async_engine(tiny_llama)
    admitted = _spy_admissions(engine)
    prompts = [[5 + i] * (3 + i) for i in range(6)]
    run = _run(engine, prompts)
    await run.start()
    assert set(admitted) == set(run.ids) and len(set(admitted.values())) == 1  # between two steps
    texts = {i: [] for i in range(len(prompts))}
    async for i, o in run.outputs():
        texts[i] += o.outputs[0].token_ids
    await run.close()
    assert all(len(t) == 4 for t in texts.values())
    assert not run.state.inflight and not engine.engine.states
    await engine.shutdown()


@pytest.mark.parametrize("refusal", ["too_long", "queue_full"])
async def test_batch_refusal_fails_the_call_and_aborts_the_others(tiny_llama, refusal):
    """A batch is admitted as a whole: one refused prompt fails it with that prompt's status."""
    engine = _async_engine(tiny_llama, max_queued_requests=2 if refusal == "queue_full" else 64)
    prompts = [[5] * 4, [6] * (600 if refusal == "too_long" else 4), [7] * 4]
    run = _run(engine, prompts)
    with pytest.raises(APIError) as e:
        await run.start()
    status, param = (400, "prompt") if refusal == "too_long" else (503, None)
    assert (e.value.status, e.value.param) == (status, param)
    assert not run.state.inflight and not run.live
    await _until(lambda: not engine.engine.has_unfinished_requests(), "the others aborted")
    pool = engine.engine.kv.pool
    assert not engine.engine.states and pool.num_free_blocks == pool.num_blocks
    await engine.shutdown()


# items 12 and 14: KV cache sizing and memory reporting -------------------------------------------
def _block_bytes(path: str, block_size: int = 16) -> int:
    """K and V of one block, every layer, fp32: from the checkpoint's config."""
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * block_size * c["num_key_value_heads"] * head_dim * 4


def _memory_args(path, **kw) -> EngineArgs:
    """The test engine's arguments, with the KV pool sized from memory."""
    kw = {**engine_kwargs(), **kw}
    del kw["num_kv_blocks"]
    return EngineArgs(model=path, **kw)


def test_context_fits_the_kv_budget_when_not_given(long_llama, caplog):
    caplog.set_level(logging.INFO, logger="luceio")
    block = _block_bytes(long_llama)
    eng = LLMEngine(_memory_args(long_llama, kv_cache_memory=20 * block))
    assert eng.max_model_len == 20 * 16 == eng.memory_stats().max_model_len
    assert f"context capped to 320 tokens to fit the KV cache (20 blocks, " \
           f"{20 * block / 2**20:.1f} MiB); pass --max-model-len / --kv-cache-memory to change" \
        in caplog.text
    eng.add_request("r", {"prompt_token_ids": [5] * 300}, SamplingParams(max_tokens=20, **GREEDY))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    done = outs[-1].outputs[0]
    assert done.finish_reason == "length" and len(done.token_ids) == 20
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request(None, {"prompt_token_ids": [5] * 300}, SamplingParams(max_tokens=21))
    with pytest.raises(ValueError, match="lower --max-model-len"):  # asked for: never shortened
        LLMEngine(_memory_args(long_llama, kv_cache_memory=20 * block, max_model_len=512))
    too_small = MIN_FITTED_CONTEXT // 16 - 1
    with pytest.raises(ValueError, match=f"shortest context served \\({MIN_FITTED_CONTEXT}"):
        LLMEngine(_memory_args(long_llama, kv_cache_memory=too_small * block))


def test_cpu_kv_default_is_sized_for_tokens_not_a_fixed_gib(long_llama, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="luceio")
    block = _block_bytes(long_llama)
    plenty = types.SimpleNamespace(available=1 << 40)
    monkeypatch.setattr(runner_module.psutil, "virtual_memory", lambda: plenty)
    eng = LLMEngine(_memory_args(long_llama))  # the README case: context > the default cache
    stats = eng.memory_stats()
    assert stats.num_kv_blocks == CPU_KV_TOKENS // 16 and stats.max_model_len == CPU_KV_TOKENS
    assert stats.kv_cache_bytes == CPU_KV_TOKENS // 16 * block
    assert f"context capped to {CPU_KV_TOKENS} tokens" in caplog.text
    asked = LLMEngine(_memory_args(long_llama, max_model_len=2 * CPU_KV_TOKENS)).memory_stats()
    assert asked.num_kv_blocks == 2 * CPU_KV_TOKENS // 16  # one full sequence of the asked context
    scarce = types.SimpleNamespace(available=100 * block)
    monkeypatch.setattr(runner_module.psutil, "virtual_memory", lambda: scarce)
    capped = LLMEngine(_memory_args(long_llama)).memory_stats()
    assert capped.num_kv_blocks == int(100 * CPU_KV_MAX_FRACTION)


def test_memory_stats_and_startup_line(tiny_llama, caplog):
    caplog.set_level(logging.INFO, logger="luceio")
    eng = LLMEngine(EngineArgs(model=tiny_llama, **engine_kwargs()))
    stats = eng.memory_stats()
    with safe_open(os.path.join(tiny_llama, "model.safetensors"), "pt") as f:
        weights = sum(f.get_tensor(k).nbytes for k in f.keys())  # fp32, as the engine holds them
    assert stats.weight_bytes == weights
    assert stats.kv_cache_bytes == sum(t.nbytes for t in eng.runner.kv_caches) == \
        256 * _block_bytes(tiny_llama)
    assert (stats.num_kv_blocks, stats.block_size, stats.max_model_len) == (256, 16, 512)
    line = (f"weights {weights / 2**20:.1f} MiB on cpu; KV cache "
            f"{stats.kv_cache_bytes / 2**20:.1f} MiB = 256 blocks x 16 tokens; longest context "
            f"512 tokens")
    assert [r.getMessage() for r in caplog.records if r.name == "luceio"].count(line) == 1
