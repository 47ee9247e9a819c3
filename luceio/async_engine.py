"""AsyncEngine: the engine steps on its own thread; asyncio code streams each request's outputs.

Threads: the engine thread owns the LLMEngine. It runs `engine.step()` back to back while there is
work and sleeps on a condition while there is none. The event loop never touches engine state: it
sends commands (admit a request, abort one) to the engine thread's inbox, which the engine thread
drains between steps, and it gets each step's outputs back in one `call_soon_threadsafe` that
fans them out to the requests' streams (admissions and refusals in one more, before the step
runs: a caller learns its request was accepted without waiting for a long prefill). So a step
waits for no loop, and the loop waits for no step. Commands sent in one loop iteration reach
the inbox together: a batch of prompts is admitted before any of them steps. The engine thread
runs in `torch.inference_mode` throughout (entered once, not per forward).

Rules: the loop that first calls `generate` owns the engine until it closes; a call from another
loop or thread raises RuntimeError. A refused request (ValueError, QueueFullError) raises from its
stream's first `__anext__`, before any output. A request id names one request at a time: reusing
it while that request runs is refused; once it has finished the id is free again, and the old
consumer's cleanup touches only its own request. A step that raises fails every request in flight
with RuntimeError("engine step failed: ...") and is logged; the engine keeps serving. Except an
EngineDeadError (a pipeline stage died): that is terminal. The requests in flight fail with it,
`failure` holds its message from then on, every later request is refused with it, and the
engine never steps again; the server answers 503 and exits non-zero.

`AsyncLLM` (also `AsyncLLMEngine`) is this engine under vLLM v1's names, whose `shutdown()` is
synchronous; here `shutdown()` is a coroutine and `close()` its synchronous part."""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Callable

import torch

from .config import EngineArgs
from .engine import LLMEngine
from .errors import EngineDeadError
from .inputs import PromptType
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger("luceio")

STALL_WAIT_S = 0.001  # how long the engine thread waits when work exists but none can be scheduled


_ADMITTED = object()  # queued on a stream when the engine accepts its request


class _Stream:
    """One `generate` call's outputs: a queue read on `loop`. `request_id` is set by the engine
    thread when it admits the request, and read only there."""
    __slots__ = ("loop", "queue", "request_id")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_id: str | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that owns the engine
        self._loop_thread = ""
        self._closed = False
        self._failure: str | None = None  # why the engine died (written by the engine thread)
        self._streams: set[_Stream] = set()  # open streams (loop thread)
        self._staged: list[tuple] = []  # commands sent in this loop iteration (loop thread)
        self._wakeup = threading.Condition()  # guards _inbox and _stopping
        self._inbox: list[tuple] = []
        self._stopping = False
        self._sinks: dict[str, _Stream] = {}  # request id -> its stream (engine thread)
        self._thread: threading.Thread | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kw) -> "AsyncEngine":
        return cls(LLMEngine(args, **kw))

    @classmethod
    def from_pretrained(cls, model: str | None = None, **engine_args) -> "AsyncEngine":
        return cls(LLMEngine(EngineArgs(model=model, **engine_args)))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def model_info(self):
        """`LLMEngine.model_info()`: fixed once built, so read here on the loop thread."""
        return self.engine.model_info()

    def stats(self):
        """`LLMEngine.stats()`, taken on the calling thread while the engine thread steps (see
        `engine_info`: consistent field by field)."""
        return self.engine.stats()

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        self.engine.check_fits(num_prompt_tokens, max_tokens)

    def num_open_streams(self) -> int:
        """Output streams a consumer still holds (the server's metrics read this)."""
        return len(self._streams)

    @property
    def failure(self) -> str | None:
        """Why the engine died (an EngineDeadError's message), or None while it can step."""
        return self._failure

    @property
    def closed(self) -> bool:
        """Shut down: new requests are refused."""
        return self._closed

    # requests (event loop) -----------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *,
                       on_admitted: Callable[[], None] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutputs (cumulative by default; see SamplingParams.output_kind).
        Leaving the iteration early aborts the request and frees its blocks. `on_admitted` is
        called on the loop once the engine has accepted the request (a refusal raises instead),
        which can be long before the first output: a long prompt's prefill lies between."""
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        if self._closed:
            raise RuntimeError("the engine is shut down")
        self._check_loop()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="luceio-engine", daemon=True)
            self._thread.start()
        params = sampling_params or SamplingParams()
        text, ids = self.engine.tokenize(prompt)  # here, so a long prompt costs no step time
        stream = _Stream(self._loop)
        self._streams.add(stream)
        self._send((self._admit, stream, request_id,
                    {"prompt": text, "prompt_token_ids": ids}, params), now=False)
        finished = False
        try:
            while True:
                out = await stream.queue.get()
                if out is _ADMITTED:
                    if on_admitted is not None:
                        on_admitted()
                    continue
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.discard(stream)
            if not finished:
                self._send((self._drop, stream))

    async def abort(self, request_id: str) -> None:
        """Aborts the request between steps: its stream ends with finish_reason "abort"."""
        self._check_loop()
        self._send((self._abort, request_id))

    def _send(self, command: tuple, now: bool = True) -> None:
        """Hands a command to the engine thread: at once, or (`now=False`, admissions) with the
        rest of this loop iteration's commands. Order is kept either way."""
        if self._closed:
            return  # close() has aborted everything
        self._staged.append(command)
        if now:
            self._flush()
        elif len(self._staged) == 1:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        commands, self._staged = self._staged, []
        if commands:
            with self._wakeup:
                self._inbox += commands
                self._wakeup.notify()

    def _check_loop(self) -> None:
        """Binds the engine to the running loop, or raises if another (still open) loop owns it:
        its streams would never wake a consumer on this one."""
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop.is_closed():
            self._flush()  # commands whose flush died with the old loop
            self._loop, self._loop_thread = loop, threading.current_thread().name
        elif loop is not self._loop:
            raise RuntimeError(f"this AsyncEngine belongs to event loop {self._loop!r} in thread "
                               f"{self._loop_thread!r}; call it from that loop (from another "
                               f"thread: asyncio.run_coroutine_threadsafe)")

    # the engine thread ---------------------------------------------------------------------------
    def _serve(self) -> None:
        with torch.inference_mode():  # once for the thread, not per forward
            self._serve_loop()

    def _serve_loop(self) -> None:
        stalled = False
        while True:
            with self._wakeup:
                while not (self._inbox or self._stopping or self._can_step()):
                    self._wakeup.wait()
                if stalled and not (self._inbox or self._stopping):
                    self._wakeup.wait(STALL_WAIT_S)
                if self._stopping:
                    return  # close() takes the engine over from here
                commands, self._inbox = self._inbox, []
            items, stalled = self._step(commands)
            self._deliver(items)

    def _step(self, commands: list[tuple]) -> tuple[list, bool]:
        """Runs the commands, then one engine step. Returns the (stream, output or error) pairs
        to deliver, and whether the step found nothing it could schedule."""
        items: list = []
        try:
            self._run_commands(commands, items)
            if items:  # admissions and refusals reach their callers now, not after the step
                self._deliver(items)
                items = []
            if not self._can_step():
                return items, False
            steps = self.engine.counters["steps"]
            items += self._route(self.engine.step())
            return items, self.engine.counters["steps"] == steps
        except EngineDeadError as e:
            logger.error("the engine is dead, failing %d in-flight requests: %s",
                         len(self._sinks), e)
            self._failure = str(e)
            return items + self._fail_all(EngineDeadError(self._failure)), False
        except Exception as e:  # a broken step fails its requests, not the server
            logger.exception("engine step failed; aborting in-flight requests")
            return items + self._fail_all(RuntimeError(f"engine step failed: {e}")), False

    def _can_step(self) -> bool:
        # a dead engine's pipeline may still look busy (its failed step): it must not spin
        return self._failure is None and self.engine.has_unfinished_requests()

    @staticmethod
    def _run_commands(commands: list[tuple], items: list) -> None:
        """Each command is (method, *args); it appends what its streams get to `items`."""
        for fn, *args in commands:
            fn(items, *args)

    def _admit(self, items: list, stream: _Stream, request_id: str | None, prompt: dict,
               params: SamplingParams) -> None:
        if self._failure is not None:  # sent before the loop learnt of the failure
            items.append((stream, EngineDeadError(self._failure)))
            return
        try:
            stream.request_id = self.engine.add_request(request_id, prompt, params)
        except Exception as e:  # refused: the caller gets it instead of a first output
            items.append((stream, e))
            return
        self._sinks[stream.request_id] = stream
        items.append((stream, _ADMITTED))

    def _abort(self, items: list, request_id: str) -> None:
        self.engine.abort_request(request_id)  # its final output comes with the next step's

    def _drop(self, items: list, stream: _Stream) -> None:
        """The consumer left early: abort its request, unless the id now names a newer one."""
        if stream.request_id is not None and self._sinks.get(stream.request_id) is stream:
            del self._sinks[stream.request_id]
            self.engine.abort_request(stream.request_id)

    def _route(self, outputs: list[RequestOutput]) -> list:
        items = []
        for out in outputs:
            stream = self._sinks.get(out.request_id)
            if stream is not None:
                items.append((stream, out))
                if out.finished:
                    del self._sinks[out.request_id]
        return items

    def _fail_all(self, failure: Exception) -> list:
        streams, self._sinks = list(self._sinks.values()), {}
        self.engine.abort_request(list(self.engine.states))
        self.engine.finish_step(None, None)  # drop the aborts' own outputs
        return [(stream, failure) for stream in streams]

    def _deliver(self, items: list) -> None:
        """One hand-over per loop (there is one but while the engine moves to a new loop)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_fan_out, batch)
            except RuntimeError:  # that loop closed: nobody reads its streams any more
                orphans = [rid for rid, s in self._sinks.items() if s.loop is loop]
                for rid in orphans:
                    del self._sinks[rid]
                self.engine.abort_request(orphans)

    # lifecycle -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Refuses new requests, stops the engine thread (after the step in progress), and aborts
        what is in flight: every stream ends with finish_reason "abort", or with its refusal.
        Call it on the owning loop's thread, or once no loop runs the engine."""
        loop = self._loop
        if loop is not None and loop.is_running() and _running_loop() is not loop:
            raise RuntimeError(f"close this AsyncEngine on its event loop {loop!r} (thread "
                               f"{self._loop_thread!r})")
        self._closed = True
        self._request_stop()
        if self._thread is not None:
            self._thread.join()
        # the engine thread has ended: this thread owns the engine now (in inference mode, as
        # the engine thread ran it: the tensors it made are inference tensors)
        commands, self._inbox, self._staged = self._inbox + self._staged, [], []
        items: list = []
        with torch.inference_mode():
            self._run_commands(commands, items)
            self.engine.abort_request(list(self.engine.states))
            items += self._route(self.engine.finish_step(None, None))
        self.engine.close()
        _fan_out([(s, item) for s, item in items if not s.loop.is_closed()])

    async def shutdown(self) -> None:
        """close(), waiting for the step in progress off the loop."""
        self._check_loop()
        self._closed = True
        self._request_stop()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.close()

    def _request_stop(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()


def _fan_out(batch: list) -> None:
    """On the loop: each (stream, output or error) into its stream."""
    for stream, item in batch:
        stream.queue.put_nowait(item)


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
