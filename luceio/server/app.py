"""The Starlette app: OpenAI routes, and the editor-assistant routes of `routes_assist.py`
(Anthropic Messages, OpenAI Responses, llama.cpp /infill), over one AsyncEngine on the server's
event loop.

`build_app(engine, server_args)` is the factory (tests run it in-process too). Every failure is
answered as OpenAI's error object, on the Anthropic routes as Anthropic's; `driver.py` runs each
request (admission before any response starts, abort when the client goes away). The tool-call
and reasoning parsers and the fill-in-the-middle format are chosen once, at startup, from the
flags and the model's chat template and vocabulary."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .anthropic import to_anthropic
from .args import ServerArgs
from ..errors import EngineDeadError
from .driver import generate, off_loop, read_json
from .fim import FimFormat
from .metrics import ServerMetrics
from .openapi import openapi_schema
from .fields import APIError
from .protocol import ModelContext, parse_chat, parse_completion
from .reasoning import get_reasoning_parser
from .routes_assist import assist_routes, is_anthropic
from .run import engine_dead
from .tool_parsers import get_tool_parser

logger = logging.getLogger("luceio.server")


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
        self.info = info = engine.model_info()
        name = args.served_model_name or info.name or _default_model_name()
        names = [name] + ([info.name] if info.name and info.name != name else [])
        tok = engine.tokenizer
        template = tok.chat_template if tok is not None else None
        self.ctx = ModelContext(names, tok, info.vocab_size, info.max_model_len,
                                info.kv_capacity_tokens, engine.check_fits,
                                args.max_tokens_cap,
                                get_tool_parser(args.tool_parser, template,
                                                tok.vocab() if tok is not None else None),
                                get_reasoning_parser(args.reasoning_parser, template),
                                FimFormat.detect(tok) if tok is not None else None)
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

    def error(self, e: APIError, path: str = "") -> JSONResponse:
        """`e` as a response; in Anthropic's shape on the Anthropic routes."""
        if is_anthropic(path):
            e = to_anthropic(e)
        self.metrics.http_errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def describe(self) -> str:
        """The startup log line on how model output is read."""
        ctx = self.ctx
        fim = f"{ctx.fim.name} fill-in-the-middle" if ctx.fim is not None else \
            "no fill-in-the-middle tokens (suffix and /infill answer 400)"
        tools = ctx.tool_parser.__name__ if ctx.tool_parser is not None else \
            "no tool-call parser (tools answer 400)"
        reasoning = ctx.reasoning_parser.__name__ if ctx.reasoning_parser is not None else \
            "no reasoning parser"
        return f"{tools}; {reasoning}; {fim}"


def build_app(engine, server_args: ServerArgs | None = None) -> Starlette:
    """The ASGI app over a (not yet started) AsyncEngine; its lifespan shuts the engine down."""
    args = server_args or ServerArgs()
    state = ServerState(engine, args)

    def endpoint(fn):
        async def wrapped(request: Request) -> Response:
            path = request.url.path
            try:
                return await fn(request)
            except APIError as e:
                return state.error(e, path)
            except EngineDeadError as e:  # after the first outputs (`Run` maps it before)
                return state.error(engine_dead(str(e)), path)
            except ClientDisconnect:
                return Response(status_code=499)
            except Exception:  # noqa: BLE001  never crash the server on one request
                logger.exception("unhandled error on %s", path)
                return state.error(APIError(500, "internal server error", "server_error",
                                            code="internal_error"), path)
        return wrapped

    @endpoint
    async def health(request: Request) -> Response:
        if engine.failure is not None:
            raise engine_dead(engine.failure)
        if state.draining:
            raise APIError(503, "the server is shutting down", "server_error",
                           code="shutting_down")
        return JSONResponse({"status": "ok"})

    @endpoint
    async def models(request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "luceio",
                 "root": state.info.name, "max_model_len": state.ctx.max_model_len}
                for name in state.ctx.names[:1]]
        return JSONResponse({"object": "list", "data": data})

    @endpoint
    async def completions(request: Request) -> Response:
        body = await read_json(request, args.max_request_bytes)
        return await generate(request, state, await off_loop(parse_completion, body, state.ctx))

    @endpoint
    async def chat(request: Request) -> Response:
        body = await read_json(request, args.max_request_bytes)
        return await generate(request, state, await off_loop(parse_chat, body, state.ctx))

    @endpoint
    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    ctx = state.ctx
    spec = openapi_schema(ctx.names, ctx.vocab_size, ctx.max_model_len, bool(args.api_key),
                          ctx.tool_parser is not None, ctx.fim is not None)

    @endpoint
    async def openapi(request: Request) -> Response:
        return JSONResponse(spec)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = exc.detail if exc.status_code != 404 else f"no route {request.url.path}"
        return state.error(APIError(exc.status_code, msg, code=code, headers=exc.headers),
                           request.url.path)

    async def server_error(request: Request, exc: Exception) -> Response:
        # Starlette's last resort (an error outside the endpoints): JSON, not its plain text
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return state.error(APIError(500, "internal server error", "server_error",
                                    code="internal_error"), request.url.path)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        AppStatus.should_exit = False  # sse-starlette's process-wide flag, from an earlier server
        loop = type(asyncio.get_running_loop())
        logger.info("serving %s (context %d tokens, %d KV blocks) on %s.%s", state.ctx.names[0],
                    state.ctx.max_model_len, state.info.num_kv_blocks, loop.__module__,
                    loop.__name__)
        logger.info("%s", state.describe())
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
        *assist_routes(state, endpoint),
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
    """`Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's header) on every route but
    /health (constant-time comparison)."""

    def __init__(self, app, api_key: str, state: ServerState):
        self.app, self.key, self.state = app, api_key.encode(), state

    def _allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        for name, value in headers:
            if name == b"authorization":
                scheme, _, value = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    continue
            elif name != b"x-api-key":
                continue
            if hmac.compare_digest(value.strip(), self.key):
                return True
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and \
                not self._allowed(scope["headers"]):
            resp = self.state.error(APIError(
                401, "Incorrect or missing API key: send `Authorization: Bearer <key>` or "
                "`x-api-key: <key>`.", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"}), scope["path"])
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)
