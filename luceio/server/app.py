"""The Starlette app: OpenAI routes over one AsyncEngine on the server's event loop.

`build_app(engine, server_args)` is the factory (tests run it in-process too). Every failure is
answered as OpenAI's error object; a request is validated and admitted to the engine (its first
output awaited) before any response starts, so refusals are real HTTP statuses, not mid-stream
errors. A client that goes away aborts its engine requests."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

import anyio
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .args import ServerArgs
from .metrics import ServerMetrics
from .openapi import openapi_schema
from .protocol import (APIError, ModelContext, ParsedRequest, bad, error_body, parse_chat,
                       parse_completion)
from .responses import ResponseBuilder
from .run import Run

logger = logging.getLogger("luceio.server")

SHUTDOWN_GRACE_S = 5.0  # a stream's time to send its final (aborted) chunk and [DONE]


def _default_model_name() -> str:
    try:
        from ..loader.resolve import DEFAULT_MODEL
        return DEFAULT_MODEL
    except Exception:  # noqa: BLE001  the resolver is optional here
        return "default"


class ServerState:
    def __init__(self, engine, args: ServerArgs):
        self.engine = engine
        self.args = args
        le = engine.engine
        name = args.served_model_name or le.args.model or _default_model_name()
        names = [name] + ([le.args.model] if le.args.model and le.args.model != name else [])
        self.ctx = ModelContext(names, le.tokenizer, le.runner.cfg.vocab_size, le.max_model_len,
                                le.kv.pool.num_blocks * le.kv.block_size, le.scheduler.check_fits,
                                args.max_tokens_cap)
        self.inflight: set[str] = set()
        self.metrics = ServerMetrics(engine, inflight=lambda: len(self.inflight))
        self.draining = False
        self.created = int(time.time())

    async def drain(self) -> None:
        """Shutdown: refuse new requests, abort the in-flight ones (streams then send their final
        chunk and [DONE])."""
        self.draining = True
        for rid in list(self.inflight):
            await self.engine.abort(rid)

    def error(self, e: APIError) -> JSONResponse:
        self.metrics.http_errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# handlers ----------------------------------------------------------------------------------------
# Characters str.splitlines() breaks lines at that JSON leaves unescaped (it escapes the C0
# controls): an SSE client that splits its lines that way (httpx's iter_lines does) would cut a
# `data:` line in two. They can only occur inside JSON strings, so the escapes mean the same.
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def _dumps(obj) -> str:
    """One SSE `data:` payload: compact JSON on one line for every line splitter."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


async def _read_json(request: Request, limit: int) -> dict:
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


async def _generate(request: Request, state: ServerState, req: ParsedRequest) -> Response:
    if state.draining:
        raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
    run = Run(state, req)
    builder = ResponseBuilder(req, state.ctx.tokenizer)
    # until the response streams (sse-starlette watches the connection from then on), a client
    # that goes away aborts its requests from here
    watcher = asyncio.ensure_future(_abort_on_disconnect(request, run))
    try:
        await run.start()
        if req.stream:
            shutdown = anyio.Event()
            return EventSourceResponse(
                _sse(run, builder, state, shutdown), sep="\n", shutdown_event=shutdown,
                shutdown_grace_period=min(SHUTDOWN_GRACE_S, state.args.timeout_graceful_shutdown),
                background=BackgroundTask(run.close))  # also if the stream never started
        try:
            async for i, o in run.outputs():
                builder.absorb(i, o)
        finally:
            await run.close()
        return JSONResponse(builder.response())
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


async def _sse(run: Run, builder: ResponseBuilder, state: ServerState, shutdown: anyio.Event):
    watcher = asyncio.ensure_future(_abort_on_shutdown(shutdown, state))
    outputs = run.outputs()
    try:
        for chunk in builder.first_chunks():
            yield _dumps(chunk)
        try:
            async for i, o in outputs:
                for chunk in builder.chunks(i, o):
                    yield _dumps(chunk)
        except Exception as e:  # noqa: BLE001  an engine failure ends the stream with an error
            logger.exception("request %s failed mid-stream", builder.req.id)
            yield _dumps(error_body(f"generation failed: {e}", "server_error"))
        else:
            if builder.req.include_usage:
                yield _dumps(builder.usage_chunk())
        yield "[DONE]"
    finally:  # runs when the client went away too (no awaits that could be cancelled)
        watcher.cancel()
        with contextlib.suppress(RuntimeError):
            await outputs.aclose()
        await run.close()


def build_app(engine, server_args: ServerArgs | None = None) -> Starlette:
    """The ASGI app over a (not yet started) AsyncEngine; its lifespan shuts the engine down."""
    args = server_args or ServerArgs()
    state = ServerState(engine, args)

    def endpoint(fn):
        async def wrapped(request: Request) -> Response:
            try:
                return await fn(request)
            except APIError as e:
                return state.error(e)
            except ClientDisconnect:
                return Response(status_code=499)
            except Exception:  # noqa: BLE001  never crash the server on one request
                logger.exception("unhandled error on %s", request.url.path)
                return state.error(APIError(500, "internal server error", "server_error",
                                            code="internal_error"))
        return wrapped

    @endpoint
    async def health(request: Request) -> Response:
        if state.draining:
            raise APIError(503, "the server is shutting down", "server_error",
                           code="shutting_down")
        return JSONResponse({"status": "ok"})

    @endpoint
    async def models(request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "luceio",
                 "root": engine.engine.args.model, "max_model_len": state.ctx.max_model_len}
                for name in state.ctx.names[:1]]
        return JSONResponse({"object": "list", "data": data})

    @endpoint
    async def completions(request: Request) -> Response:
        body = await _read_json(request, args.max_request_bytes)
        return await _generate(request, state, parse_completion(body, state.ctx))

    @endpoint
    async def chat(request: Request) -> Response:
        body = await _read_json(request, args.max_request_bytes)
        return await _generate(request, state, parse_chat(body, state.ctx))

    @endpoint
    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    spec = openapi_schema(state.ctx.names, state.ctx.vocab_size, state.ctx.max_model_len,
                          bool(args.api_key))

    @endpoint
    async def openapi(request: Request) -> Response:
        return JSONResponse(spec)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = exc.detail if exc.status_code != 404 else f"no route {request.url.path}"
        return state.error(APIError(exc.status_code, msg, code=code, headers=exc.headers))

    async def server_error(request: Request, exc: Exception) -> Response:
        # Starlette's last resort (an error outside the endpoints): JSON, not its plain text
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return state.error(APIError(500, "internal server error", "server_error",
                                    code="internal_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        AppStatus.should_exit = False  # sse-starlette's process-wide flag, from an earlier server
        loop = type(asyncio.get_running_loop())
        logger.info("serving %s (context %d tokens, %d KV blocks) on %s.%s", state.ctx.names[0],
                    state.ctx.max_model_len, engine.engine.kv.pool.num_blocks, loop.__module__,
                    loop.__name__)
        yield
        await state.drain()
        await engine.shutdown()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    middleware = [Middleware(_BearerAuth, api_key=args.api_key, state=state)] \
        if args.api_key else []
    if args.origins:  # outermost: preflights carry no API key
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=args.origins,
                                        allow_methods=["GET", "POST"], allow_headers=["*"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.server = state
    return app


class _BearerAuth:
    """`Authorization: Bearer KEY` on every route but /health (constant-time comparison)."""

    def __init__(self, app, api_key: str, state: ServerState):
        self.app, self.key, self.state = app, api_key.encode(), state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = auth.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                resp = self.state.error(APIError(
                    401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)
