"""One API call, from a parsed request to its HTTP response, for every route and wire format.

Rules: the request is admitted to the engine (its first output awaited) before any response
starts, so refusals are real HTTP statuses, not mid-stream errors. A client that goes away aborts
its engine requests; so does a shutdown, after which a stream still gets its final events. A
`Wire` turns the outputs into one API's shape (OpenAI's is `responses.ResponseBuilder`); a
non-streaming response is the same wire with its events dropped."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Callable, Protocol

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ..outputs import RequestOutput
from .fields import APIError, bad
from .protocol import ParsedRequest
from .responses import ResponseBuilder
from .run import Run

if TYPE_CHECKING:
    from .app import ServerState

logger = logging.getLogger("luceio.server")

SHUTDOWN_GRACE_S = 5.0  # a stream's time to send its final (aborted) events

# an SSE event: a JSON `data:` payload, raw data text (OpenAI's "[DONE]"), or (event name, data)
Event = dict | str | tuple[str, dict]


class Wire(Protocol):
    """One API's shape of a run's outputs: `start()` once the run is admitted, `step()` per
    output, then `end()` (or `fail()` when the engine failed mid-stream); `response()` is the
    non-streaming body once `end()` was called. A wire whose own rule ends the output early
    (llama.cpp's n_indent on /infill) sets `stop_reason` in `step()`: the run is stopped there
    and its choices are counted as finished with that reason."""
    ping_event: tuple[str, dict] | None  # a keep-alive event; None: SSE comments
    stop_reason: str | None

    def start(self) -> list[Event]: ...
    def step(self, prompt_index: int, ro: RequestOutput) -> list[Event]: ...
    def end(self) -> list[Event]: ...
    def fail(self, message: str) -> list[Event]: ...
    def response(self) -> dict: ...


WireFactory = Callable[[ResponseBuilder, Run], Wire]


# Characters str.splitlines() breaks lines at that JSON leaves unescaped (it escapes the C0
# controls): an SSE client that splits its lines that way (httpx's iter_lines does) would cut a
# `data:` line in two. They can only occur inside JSON strings, so the escapes mean the same.
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def dumps(obj) -> str:
    """One SSE `data:` payload: compact JSON on one line for every line splitter."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


def _sse_event(ev: Event) -> str | dict:
    if isinstance(ev, tuple):
        return {"event": ev[0], "data": dumps(ev[1])}
    return ev if isinstance(ev, str) else dumps(ev)


async def off_loop(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a worker thread: rendering a chat template and encoding a long
    prompt take tens of milliseconds (the tokenizer lets go of the GIL meanwhile), which on the
    event loop would hold up every stream's events."""
    return await asyncio.to_thread(fn, *args, **kwargs)


async def read_json(request: Request, limit: int) -> dict:
    # a cross-origin page may POST text/plain or a form without asking (no CORS preflight):
    # demanding JSON keeps such requests from starting generations on a local server
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, "the request body must be JSON sent with `Content-Type: "
                       f"application/json`, got {repr(media) if media else 'none'}",
                       code="unsupported_media_type")
    cl = request.headers.get("content-length")
    if cl is not None:
        if not (cl.isascii() and cl.isdigit()):
            raise bad(None, f"invalid Content-Length {cl!r}")
        if int(cl) > limit:
            raise APIError(413, f"the request body is {int(cl)} bytes; the limit is {limit} "
                           "bytes", code="request_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(None, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    if not raw.isascii() or b"\\u" in raw:
        # JSON lets `\ud800` (and json.loads lets CESU-8 bytes) through as a lone surrogate, which
        # is not text: the tokenizer and every UTF-8 encoder downstream would fail on it
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad(None, "the request body contains invalid Unicode (a lone UTF-16 "
                      "surrogate)") from None
        except RecursionError:
            raise bad(None, "the request body is nested too deeply") from None
    return body


async def generate(request: Request, state: ServerState, req: ParsedRequest,
                   make_wire: WireFactory | None = None) -> Response:
    """Runs `req` and answers in the wire `make_wire` builds (OpenAI's by default)."""
    if state.draining:
        raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
    for warning in req.warnings:
        logger.warning("request %s: %s", req.id, warning)
    run = Run(state, req)
    builder = ResponseBuilder(req, state.ctx.tokenizer)
    # until the response streams (sse-starlette watches the connection from then on), a client
    # that goes away aborts its requests from here
    watcher = asyncio.ensure_future(_abort_on_disconnect(request, run))
    try:
        # a stream starts once its prompts are admitted (a refusal is still an HTTP status);
        # its first event waits for the first outputs, with keep-alives every 15 s meanwhile,
        # so a prefill longer than a client's idle timeout does not end the connection
        await run.start(first_outputs=not req.stream)
        if req.stream:
            shutdown = anyio.Event()
            made: list[Wire] = []

            def ping() -> ServerSentEvent:  # the wire's own event once it exists, else a comment
                event = made[0].ping_event if made else None
                if event is None:
                    return ServerSentEvent(comment="ping", sep="\n")
                return ServerSentEvent(dumps(event[1]), event=event[0], sep="\n")

            return EventSourceResponse(
                _sse(run, lambda: _make(make_wire, builder, run, made), state, shutdown),
                sep="\n", shutdown_event=shutdown, ping_message_factory=ping,
                shutdown_grace_period=min(SHUTDOWN_GRACE_S, state.args.timeout_graceful_shutdown),
                background=BackgroundTask(run.close))  # also if the stream never started
        wire = make_wire(builder, run) if make_wire is not None else builder
        outputs = run.outputs()
        try:
            async for i, o in outputs:
                wire.step(i, o)
                if wire.stop_reason is not None:
                    await run.stop(wire.stop_reason)
                    break
        finally:
            with contextlib.suppress(RuntimeError):
                await outputs.aclose()
            await run.close()
        wire.end()
        return JSONResponse(wire.response())
    finally:
        watcher.cancel()


async def _abort_on_disconnect(request: Request, run: Run) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            await run.abort()
            return


async def _abort_on_shutdown(event: anyio.Event, state: ServerState) -> None:
    await event.wait()
    await state.drain()


def _make(make_wire: WireFactory | None, builder: ResponseBuilder, run: Run,
          made: list) -> Wire:
    wire = make_wire(builder, run) if make_wire is not None else builder
    made.append(wire)
    return wire


async def _sse(run: Run, new_wire: Callable[[], Wire], state: ServerState,
               shutdown: anyio.Event):
    watcher = asyncio.ensure_future(_abort_on_shutdown(shutdown, state))
    outputs = None
    try:
        try:
            await run.first_outputs()
        except ClientDisconnect:
            return
        except Exception as e:  # noqa: BLE001  the stream has started: an error event ends it
            logger.exception("request %s failed before its first output", run.req.id)
            for ev in new_wire().fail(f"generation failed: {e}"):
                yield _sse_event(ev)
            return
        wire = new_wire()
        outputs = run.outputs()
        for ev in wire.start():
            yield _sse_event(ev)
        try:
            async for i, o in outputs:
                for ev in wire.step(i, o):
                    yield _sse_event(ev)
                if wire.stop_reason is not None:
                    await run.stop(wire.stop_reason)
                    break
        except Exception as e:  # noqa: BLE001  an engine failure ends the stream with an error
            logger.exception("request %s failed mid-stream", run.req.id)
            tail = wire.fail(f"generation failed: {e}")
        else:
            tail = wire.end()
        for ev in tail:
            yield _sse_event(ev)
    finally:  # runs when the client went away too (no awaits that could be cancelled)
        watcher.cancel()
        if outputs is not None:
            with contextlib.suppress(RuntimeError):
                await outputs.aclose()
        await run.close()
