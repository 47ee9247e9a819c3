"""AsyncEngine's engine thread (issue 14 item 4): aborts mid-stream, a failing step, close() while
generating, many concurrent streams with one hand-over per step, an idle thread that sleeps.
Outputs are checked against the synchronous engine; no assertion depends on machine speed (waits
are bounded only so a bug fails instead of hanging)."""
import asyncio
import logging
import threading
import time

import psutil
import pytest

from conftest import engine_kwargs
from luceio import LLM, AsyncEngine, EngineArgs, SamplingParams
from luceio.sampling_params import RequestOutputKind

GREEDY = dict(temperature=0.0, ignore_eos=True)
DELTA = RequestOutputKind.DELTA
BOUND_S = 60  # a stream that has not ended by then hangs


def _engine(path, **kw) -> AsyncEngine:
    return AsyncEngine.from_engine_args(EngineArgs(model=path, **engine_kwargs(**kw)))


def _reference(path, prompts, params) -> list[list[int]]:
    outs = LLM(path, **engine_kwargs()).generate([{"prompt_token_ids": p} for p in prompts],
                                                 params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


async def _drain(agen) -> list:
    return await asyncio.wait_for(_collect(agen), BOUND_S)


async def _collect(agen) -> list:
    return [o async for o in agen]


def _tokens(outs, kind) -> list[int]:
    if kind == DELTA:
        return [t for o in outs for t in o.outputs[0].token_ids]
    return outs[-1].outputs[0].token_ids


def _assert_clean(engine: AsyncEngine) -> None:
    pool = engine.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not engine.engine.states and not engine.engine.has_unfinished_requests()


async def _until(condition, what: str) -> None:
    for _ in range(BOUND_S * 100):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def _engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "luceio-engine"}


async def test_abort_mid_stream_ends_that_stream_only(tiny_llama):
    engine = _engine(tiny_llama)
    kept = SamplingParams(max_tokens=24, **GREEDY)
    ref = _reference(tiny_llama, [[9, 10, 11]], kept)[0]
    aborted = engine.generate({"prompt_token_ids": [5, 6, 7]},
                              SamplingParams(max_tokens=400, output_kind=DELTA, **GREEDY), "a")
    other = asyncio.ensure_future(_drain(engine.generate({"prompt_token_ids": [9, 10, 11]}, kept,
                                                         "b")))
    head = [await aborted.__anext__() for _ in range(3)]
    await engine.abort("a")
    rest = await _drain(aborted)
    outs = head + rest
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert outs[-1].outputs[0].finish_reason == "abort"
    assert 3 <= len(_tokens(outs, DELTA)) < 400
    assert (await other)[-1].outputs[0].token_ids == ref  # the other request is untouched
    await _until(lambda: not engine.engine.has_unfinished_requests(), "the abort is applied")
    _assert_clean(engine)
    await engine.shutdown()


async def test_a_failing_step_fails_every_request_and_the_engine_serves_on(tiny_llama, caplog):
    engine = _engine(tiny_llama)
    execute, calls = engine.engine.execute, []

    def failing_execute(batch, *rest):
        calls.append(len(batch.sched.scheduled))
        if len(calls) == 4:
            raise RuntimeError("boom")
        return execute(batch, *rest)

    engine.engine.execute = failing_execute
    params = SamplingParams(max_tokens=50, **GREEDY)
    streams = [engine.generate({"prompt_token_ids": [5 + i] * (3 + i)}, params, f"r{i}")
               for i in range(3)]
    firsts = await asyncio.gather(*(s.__anext__() for s in streams))  # admitted together
    assert not any(o.finished for o in firsts)
    for s in streams:
        with pytest.raises(RuntimeError, match="engine step failed: boom"):
            await _drain(s)
    assert calls[3] == 3  # the failed step held all three
    failures = [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert failures and failures[0].levelno == logging.ERROR and failures[0].exc_info
    _assert_clean(engine)
    engine.engine.execute = execute
    prompt = [7, 8, 9]
    outs = await _drain(engine.generate({"prompt_token_ids": prompt},
                                        SamplingParams(max_tokens=12, **GREEDY), "after"))
    assert outs[-1].outputs[0].token_ids == \
        _reference(tiny_llama, [prompt], SamplingParams(max_tokens=12, **GREEDY))[0]
    await engine.shutdown()


async def test_close_while_generating_ends_every_stream(tiny_llama):
    before = _engine_threads()
    engine = _engine(tiny_llama)
    params = SamplingParams(max_tokens=400, output_kind=DELTA, **GREEDY)
    running = [engine.generate({"prompt_token_ids": [5 + i] * 4}, params, f"r{i}")
               for i in range(4)]
    heads = [[await s.__anext__()] for s in running]
    ours = _engine_threads() - before
    assert len(ours) == 1
    # admitted in this loop iteration, not yet handed to the engine thread when close() runs
    late = engine.generate({"prompt_token_ids": [3] * 4}, params, "late")
    late_first = asyncio.ensure_future(late.__anext__())
    await asyncio.sleep(0)  # late_first has run up to its wait for a first output
    engine.close()  # synchronous, on the loop: waits for the step in progress
    assert not any(t.is_alive() for t in ours)
    for head, s in zip(heads, running):
        outs = head + await _drain(s)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert len(_tokens(outs, DELTA)) < 400
    late_outs = [await asyncio.wait_for(late_first, BOUND_S)] + await _drain(late)
    assert late_outs[-1].finished and late_outs[-1].outputs[0].finish_reason == "abort"
    _assert_clean(engine)
    with pytest.raises(RuntimeError, match="shut down"):
        await engine.generate({"prompt_token_ids": [5]}, params).__anext__()
    await engine.shutdown()  # a second close is harmless


async def test_many_concurrent_streams_one_hand_over_per_step(tiny_llama):
    num_streams = 64
    prompts = [[3 + (i * 7) % 300] * (1 + i % 23) + [5 + i % 11] for i in range(num_streams)]
    lengths = [4 + (i * 5) % 37 for i in range(num_streams)]
    kinds = [DELTA if i % 2 else RequestOutputKind.CUMULATIVE for i in range(num_streams)]
    refs = _reference(tiny_llama, prompts, [SamplingParams(max_tokens=n, **GREEDY)
                                            for n in lengths])
    engine = _engine(tiny_llama, max_num_seqs=num_streams)
    loop = asyncio.get_running_loop()
    loop_thread, real, handoffs = threading.get_ident(), loop.call_soon_threadsafe, [0]

    def counting(*a, **kw):
        handoffs[0] += threading.get_ident() != loop_thread
        return real(*a, **kw)

    loop.call_soon_threadsafe = counting
    try:
        streams = [_drain(engine.generate({"prompt_token_ids": p},
                                          SamplingParams(max_tokens=n, output_kind=k, **GREEDY),
                                          f"s{i}"))
                   for i, (p, n, k) in enumerate(zip(prompts, lengths, kinds))]
        results = await asyncio.gather(*streams)
    finally:
        del loop.call_soon_threadsafe
    for outs, kind, ref in zip(results, kinds, refs):
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        assert _tokens(outs, kind) == ref
    num_outputs = sum(len(outs) for outs in results)
    steps = engine.engine.counters["steps"]
    # per step at most two hand-overs (the admissions it took, then its outputs), not one per
    # output
    assert handoffs[0] <= 2 * steps and steps < num_outputs and handoffs[0] < num_outputs
    _assert_clean(engine)
    await engine.shutdown()


async def test_idle_engine_thread_sleeps(tiny_llama):
    """Between requests the engine thread waits on a condition: it burns no CPU."""
    engine = _engine(tiny_llama)
    execute, native = engine.engine.execute, []

    def spy(batch, *rest):
        native.append(threading.get_native_id())
        return execute(batch, *rest)

    engine.engine.execute = spy
    await _drain(engine.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=4)))
    assert len(set(native)) == 1  # every step ran on the one engine thread

    def cpu_seconds() -> float:
        t = next(t for t in psutil.Process().threads() if t.id == native[0])
        return t.user_time + t.system_time

    # let the thread finish the last step's bookkeeping, however slow the machine: wait until
    # its CPU time stops moving (a busy-waiting thread never settles, and fails below)
    settle_by, before = time.monotonic() + 10, cpu_seconds()
    while time.monotonic() < settle_by:
        await asyncio.sleep(0.1)
        now = cpu_seconds()
        if now - before < 0.01:
            break
        before = now
    # CPU time the waiting thread used, not how fast anything ran: a thread blocked on its
    # condition uses next to none however slow the machine; a busy-waiting one burns most of
    # every window. The least of three windows: late bookkeeping on a slow box lands in one
    shares = []
    for _ in range(3):
        start, t0 = cpu_seconds(), time.monotonic()
        await asyncio.sleep(0.5)
        shares.append((cpu_seconds() - start) / (time.monotonic() - t0))
    assert min(shares) < 0.25
    await engine.shutdown()
