"""One API call's engine requests (one per prompt): admission, merged outputs, metrics, the
per-request log line, and abort when the call ends early."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import ClientDisconnect

from ..errors import EngineDeadError, QueueFullError
from ..structured import GrammarError
from .fields import APIError, bad
from .protocol import ParsedRequest

if TYPE_CHECKING:
    from .app import ServerState

logger = logging.getLogger("luceio.server")


def engine_dead(reason: str) -> APIError:
    """The answer while the engine is dead (`AsyncEngine.failure`): the server is exiting for
    its supervisor to restart it, so there is no Retry-After."""
    return APIError(503, reason, "server_error", code="engine_dead")


# one API request's engine requests -------------------------------------------------------------
@dataclass
class _Track:
    arrival: float
    first: float | None = None
    last: float | None = None
    admitted: bool = False
    reasons: dict[int, str] = field(default_factory=dict)
    output: object = None  # the last RequestOutput seen


class Run:
    """The engine requests of one API call (one per prompt): admission, merged outputs, metrics,
    the per-request log line, and abort on close."""

    def __init__(self, state: ServerState, req: ParsedRequest):
        self.state, self.req = state, req
        self.ids = [req.id] if len(req.prompts) == 1 else \
            [f"{req.id}-{i}" for i in range(len(req.prompts))]
        self.gens: dict[str, object] = {}
        self.firsts: list = []
        self.live: dict[str, _Track] = {}
        self.tasks: list[asyncio.Task] = []
        self.client_gone = False
        self._pending: list[asyncio.Task] = []  # first outputs still to come (see `start`)

    async def start(self, first_outputs: bool = True) -> None:
        """Admits every prompt at once (each generator adds its request to the engine when it
        starts), then waits for all first outputs, or with `first_outputs=False` only until
        the engine has accepted every prompt (a stream can then start before a long prefill
        ends; `first_outputs()` waits for the rest). A refused prompt fails the call with its
        status; the others are aborted."""
        st = self.state
        if self.client_gone:
            raise ClientDisconnect()
        if st.draining:
            raise APIError(503, "the server is shutting down", "server_error",
                           code="shutting_down")
        admitted = {rid: asyncio.Event() for rid in self.ids}
        for rid, prompt, params in zip(self.ids, self.req.prompts, self.req.params):
            self.gens[rid] = st.engine.generate(prompt, params, rid,
                                                on_admitted=admitted[rid].set)
            self.live[rid] = _Track(time.monotonic())
            st.inflight.add(rid)
        self._pending = [asyncio.ensure_future(self._first(rid)) for rid in self.ids]
        if first_outputs:
            await self.first_outputs()
            return
        try:
            for rid, task in zip(self.ids, self._pending):
                gate = asyncio.ensure_future(admitted[rid].wait())
                try:
                    await asyncio.wait({task, gate}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    gate.cancel()
                if task.done():
                    task.result()  # a refusal raises here
            if self.client_gone:  # hung up while the prompts were being admitted
                raise ClientDisconnect()
        except BaseException:
            await self._abandon()
            raise

    async def first_outputs(self) -> None:
        """Waits for the first output of every prompt `start` admitted (into `firsts`)."""
        try:
            outs = await asyncio.gather(*self._pending)
            if self.client_gone:  # hung up while the prompts were being admitted
                raise ClientDisconnect()
        except BaseException:
            await self._abandon()
            raise
        self._pending = []
        self.firsts = [self._seen(rid, first) for rid, first in zip(self.ids, outs)]

    async def _abandon(self) -> None:
        for task in self._pending:
            task.cancel()  # its generator's cleanup aborts the request
        await asyncio.gather(*self._pending, return_exceptions=True)
        self._pending = []
        await self.close()

    async def _first(self, rid: str):
        """The first output of one prompt; a refusal (never admitted) leaves the call's books."""
        try:
            return await self.gens[rid].__anext__()
        except Exception as e:
            self.live.pop(rid, None)
            self.state.inflight.discard(rid)
            refusal = self._refusal(e)
            if refusal is None:
                raise
            raise refusal from None

    def _refusal(self, e: Exception) -> APIError | None:
        st = self.state
        if isinstance(e, EngineDeadError):
            return engine_dead(str(e))
        if isinstance(e, QueueFullError):
            return APIError(503, f"the server is overloaded ({e}); retry later", "server_error",
                            code="queue_full", headers={"Retry-After": "1"})
        if isinstance(e, GrammarError) and self.req.constraint_param is not None:
            return bad(self.req.constraint_param, str(e))
        if isinstance(e, ValueError):
            return bad("messages" if self.req.chat else "prompt", str(e))
        if isinstance(e, RuntimeError) and (st.draining or st.engine.closed):
            return APIError(503, "the server is shutting down", "server_error",
                            code="shutting_down")
        return None

    async def outputs(self):
        """(prompt index, RequestOutput) until every engine request finished."""
        if len(self.ids) == 1:
            rid, first = self.ids[0], self.firsts[0]
            yield 0, first
            if not first.finished:
                async for o in self.gens[rid]:
                    yield 0, self._seen(rid, o)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, rid: str, first) -> None:
            queue.put_nowait((i, first))
            try:
                if not first.finished:
                    async for o in self.gens[rid]:
                        queue.put_nowait((i, self._seen(rid, o)))
            except Exception as e:  # noqa: BLE001  handed to the consumer
                queue.put_nowait((i, e))

        self.tasks = [asyncio.ensure_future(pump(i, rid, f))
                      for i, (rid, f) in enumerate(zip(self.ids, self.firsts))]
        remaining = len(self.ids)
        while remaining:
            i, o = await queue.get()
            if isinstance(o, Exception):
                raise o
            remaining -= o.finished
            yield i, o

    def _seen(self, rid: str, o):
        t = self.live.get(rid)
        if t is None:
            return o
        now = time.monotonic()
        m = self.state.metrics
        new_tokens = sum(len(c.token_ids) for c in o.outputs)
        if o.metrics is not None:
            t.arrival = o.metrics.arrival_time
        if not t.admitted:  # the first output
            t.admitted = True
            m.prompt_tokens.inc(len(o.prompt_token_ids))
        m.generation_tokens.inc(new_tokens)
        if t.first is None and o.metrics is not None and o.metrics.first_token_time is not None:
            t.first = o.metrics.first_token_time
            m.ttft.observe(max(t.first - t.arrival, 0.0))
        elif new_tokens and t.last is not None:
            m.itl.observe(now - t.last)
        if new_tokens:
            t.last = now
        t.output = o
        for c in o.outputs:
            if c.finish_reason is not None:
                t.reasons[c.index] = c.finish_reason
        if o.finished:
            self._finished(rid, o, now)
        return o

    def _finished(self, rid: str, o, now: float) -> None:
        t = self.live.pop(rid)
        self.state.inflight.discard(rid)
        m, rm = self.state.metrics, o.metrics
        m.e2e.observe(now - t.arrival)
        reasons = [t.reasons.get(i, "abort") for i in range(self.req.n)]
        for r in reasons:
            m.requests.labels(r).inc()
        n_prompt = rm.num_prompt_tokens if rm is not None else len(o.prompt_token_ids)
        n_out = rm.num_generated_tokens if rm is not None else 0
        if rm is not None:
            m.record_speculation(rm.num_draft_tokens, rm.num_accepted_tokens)
        ttft = f"{t.first - t.arrival:.3f}s" if t.first is not None else "-"
        elapsed = now - t.arrival
        logger.info("request %s finished: prompt %d tokens, output %d tokens, ttft %s, "
                    "%.1f tokens/s, finish %s", rid, n_prompt, n_out, ttft,
                    n_out / elapsed if elapsed > 0 else 0.0, ",".join(reasons))

    async def stop(self, reason: str) -> None:
        """The wire has all it wants (its own stop rule fired): the unfinished engine requests
        are aborted and their choices counted as finished with `reason`."""
        for rid in list(self.live):
            t = self.live[rid]
            for i in range(self.req.n):
                t.reasons.setdefault(i, reason)
            await self.state.engine.abort(rid)
            self._finished(rid, t.output, time.monotonic())

    async def abort(self) -> None:
        """The client went away: abort what runs, admit nothing more."""
        self.client_gone = True
        for rid in list(self.live):
            await self.state.engine.abort(rid)

    async def close(self) -> None:
        """Aborts what is unfinished. Runs in cancelled contexts too, so nothing here waits."""
        for task in self.tasks + self._pending:
            task.cancel()
        for rid, agen in self.gens.items():
            with contextlib.suppress(RuntimeError):  # still driven by a cancelled pump task
                await agen.aclose()
            if rid in self.live:
                await self.state.engine.abort(rid)
                t = self.live.pop(rid)
                self.state.inflight.discard(rid)
                for _ in range(self.req.n - len(t.reasons)):
                    self.state.metrics.requests.labels("abort").inc()
                logger.info("request %s aborted (client gone or server shutting down) after "
                            "%.3fs", rid, time.monotonic() - t.arrival)
