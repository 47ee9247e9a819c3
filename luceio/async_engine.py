"""AsyncEngine: one asyncio loop owns the engine. A background task drives steps while there is
work; the forward runs on one worker thread so the loop keeps serving; only the loop thread
touches engine state. Each request gets a stream fed by the step task.

Rules: the loop that first calls `generate` owns the engine until it closes; a call from another
loop or thread raises RuntimeError. A request id names one request at a time: reusing it while
that request runs raises ValueError; once it has finished the id is free again, and the old
consumer's cleanup touches only its own stream.

`AsyncLLM` (also `AsyncLLMEngine`) is this engine under vLLM v1's names, whose `shutdown()` is
synchronous; here `shutdown()` is a coroutine and `close()` its synchronous part."""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from .config import EngineArgs
from .engine import LLMEngine, PromptType
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger("luceio")


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="luceio-forward")
        self._streams: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that owns the engine
        self._loop_thread = ""
        self._closed = False

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kw) -> "AsyncEngine":
        return cls(LLMEngine(args, **kw))

    @classmethod
    def from_pretrained(cls, model: str | None = None, **engine_args) -> "AsyncEngine":
        return cls(LLMEngine(EngineArgs(model=model, **engine_args)))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def closed(self) -> bool:
        """Shut down: new requests are refused."""
        return self._closed

    # requests ----------------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutputs (cumulative by default; see SamplingParams.output_kind).
        Leaving the iteration early aborts the request and frees its blocks."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        self._check_loop()
        self._ensure_running()
        params = sampling_params or SamplingParams()
        text, ids = self.engine.tokenize(prompt)
        kept = None
        keep = self.engine.spec_prefill_keep(len(ids), params)
        if keep is not None:  # the draft's scoring pass runs on the worker, like a step
            self.engine.check_request(ids, params)
            kept = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.engine.spec_prefill.select, ids, keep)
        scores = None
        if self.engine.wants_block_scores(len(ids) if kept is None else len(kept)):
            self.engine.check_request(ids, params)
            kept_ids = ids if kept is None else [ids[p] for p in kept]
            scores = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.engine.prompt_block_scores, kept_ids)
        request_id = self.engine.add_request(request_id, {"prompt": text, "prompt_token_ids": ids},
                                             params, kept_positions=kept, block_scores=scores)
        queue: asyncio.Queue = asyncio.Queue()
        # may replace the stream of a finished request whose consumer lags: that consumer reads
        # its own queue, and its cleanup leaves this one alone
        self._streams[request_id] = queue
        self._wakeup.set()
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is queue:  # else a newer request holds the id
                del self._streams[request_id]
                if not finished:
                    self.engine.abort_request(request_id)
                    self.engine.finish_step(None, None)  # drop the abort's own output

    async def abort(self, request_id: str) -> None:
        self._check_loop()
        self.engine.abort_request(request_id)
        self._dispatch(self.engine.finish_step(None, None))

    # the step task -----------------------------------------------------------------------------
    def _check_loop(self) -> None:
        """Binds the engine to the running loop, or raises if another (still open) loop owns it:
        its queues and step task would never wake a consumer on this one."""
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop.is_closed():
            self._loop, self._loop_thread = loop, threading.current_thread().name
        elif loop is not self._loop:
            raise RuntimeError(f"this AsyncEngine belongs to event loop {self._loop!r} in thread "
                               f"{self._loop_thread!r}; call it from that loop (from another "
                               f"thread: asyncio.run_coroutine_threadsafe)")

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done() or self._task.get_loop().is_closed():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="luceio-steps")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                plan = self.engine.plan_drafts()
                if plan is not None:
                    drafts = await loop.run_in_executor(self._executor, self.engine.run_drafts, plan)
                    self.engine.apply_drafts(plan, drafts)
                batch = self.engine.schedule_step()
                result = None
                if batch is not None:
                    result = await loop.run_in_executor(self._executor, self.engine.execute, batch)
                self._dispatch(self.engine.finish_step(batch, result))
                if batch is None:
                    await asyncio.sleep(0.001)
                else:
                    await asyncio.sleep(0)  # let the consumers run between steps
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a broken step fails its requests, not the server
                logger.exception("engine step failed; aborting in-flight requests")
                self._fail_all(e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_all(self, error: Exception) -> None:
        ids = list(self.engine.states)
        self.engine.abort_request(ids)
        self.engine.finish_step(None, None)
        for rid in ids:
            queue = self._streams.get(rid)
            if queue is not None:
                queue.put_nowait(RuntimeError(f"engine step failed: {error}"))

    # lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Refuses new requests, aborts those in flight (their streams end with finish_reason
        "abort"), cancels the step task and waits for a forward in progress. Call it on the
        owning loop's thread, or once no loop runs the engine."""
        loop = self._loop
        if loop is not None and loop.is_running() and _running_loop() is not loop:
            raise RuntimeError(f"close this AsyncEngine on its event loop {loop!r} (thread "
                               f"{self._loop_thread!r})")
        self._closed = True
        ids = list(self.engine.states)
        if ids:
            self.engine.abort_request(ids)
            self._dispatch(self.engine.finish_step(None, None))
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=True)

    async def shutdown(self) -> None:
        """close(), then waits for the step task to end."""
        self._check_loop()
        self.close()
        if self._task is not None:
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass


class AsyncLLM(AsyncEngine):
    """vLLM v1's AsyncLLM: `AsyncLLM.from_engine_args(AsyncEngineArgs(...))`, `generate(prompt,
    sampling_params, request_id)`, `abort(request_id)`, and a synchronous `shutdown()`."""

    def shutdown(self) -> None:  # vLLM's is synchronous, called from sync and async code alike
        self.close()


AsyncLLMEngine = AsyncLLM  # vLLM v1: `vllm.engine.async_llm_engine.AsyncLLMEngine = AsyncLLM`


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
