"""Routes for editor coding assistants: Anthropic Messages (Claude Code), OpenAI Responses (Codex)
and llama.cpp's `/infill` (llama.vim, llama.vscode). Each turns its body into the request
`protocol.py` parses (`anthropic.py`, `responses_api.py` and `infill.py` translate), runs it through
`driver.generate`, and shapes the output with its own wire below.

Rules
- `/v1/messages` and `/v1/messages/count_tokens` (`?beta=true` accepted, as Claude Code sends it)
  answer every error in Anthropic's shape, 401 and 404 included (`app.py` asks `is_anthropic`).
  A model name the server does not serve (Claude Code sends claude-...) is served by the
  server's model, logged once per name, and echoed in the response. `max_tokens` is lowered to
  the room the prompt leaves in the context instead of refused (Claude Code asks for 32000).
- `/v1/responses` keeps OpenAI's rules: an unknown model is a 404.
- Streams: Anthropic's named events, with a `ping` after message_start and as the keep-alive;
  the Responses events; `/infill` sends `{"content": ..., "stop": false}` chunks, then one with
  `stop: true` and the totals, as llama.cpp's server does (no [DONE]).
- A generation aborted by a shutdown ends an Anthropic or Responses stream with its error event,
  and is a 503 when not streaming.
- Warnings of the translations (fields accepted but not applied) are logged with the request.
"""
from __future__ import annotations

import abc
import logging
import uuid
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..outputs import RequestOutput
from .anthropic import count_tokens_request, count_tokens_response, messages_to_chat
from .anthropic_stream import MessageStream
from .chat import chat_prompt
from .driver import generate, off_loop, read_json
from .fields import APIError, bad
from .fim import missing_fim_tokens
from .infill import InfillWire, parse_infill
from .protocol import ParsedRequest, build_params, parse_chat, resolve_model
from .responses import ResponseBuilder
from .responses_api import responses_to_chat
from .responses_stream import ResponseStream
from .run import Run

if TYPE_CHECKING:
    from .app import ServerState

logger = logging.getLogger("luceio.server")

ANTHROPIC_PATH = "/v1/messages"
_MAX_LOGGED_NAMES = 64  # model names logged as mapped, at most (a client may send any)
_ABORTED = "the request was aborted: the server is shutting down"


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def _cached_tokens(run: Run) -> int:
    return sum(o.num_cached_tokens for o in run.firsts)


# wires --------------------------------------------------------------------------------------------
class _DeltaWire(abc.ABC):
    """The builder's deltas fed to an API's event stream (`MessageStream`, `ResponseStream`);
    subclasses say how the stream finishes and what the whole response is."""
    ping_event = None
    stop_reason = None  # runs until the engine finishes

    def __init__(self, builder: ResponseBuilder, cached: int, stream):
        self.builder, self.cached, self.stream, self.aborted = builder, cached, stream, False

    def start(self) -> list:
        return self.stream.start()

    def step(self, prompt_index: int, ro: RequestOutput) -> list:
        return [ev for d in self.builder.absorb(prompt_index, ro) for ev in self.stream.feed(d)]

    def end(self) -> list:
        reason, stop_string = self.builder.finish()
        if reason == "abort":
            self.aborted = True
            return self.fail(_ABORTED)
        return self._finish(reason, stop_string, self.builder.usage())

    def fail(self, message: str) -> list:
        return self.stream.fail(message)

    def response(self) -> dict:
        if self.aborted:
            raise APIError(503, _ABORTED, "server_error", code="shutting_down")
        return self._whole()

    @abc.abstractmethod
    def _finish(self, reason: str, stop_string: str | None, usage: dict) -> list:
        """The API's closing events for a finish reason, stop string and usage."""

    @abc.abstractmethod
    def _whole(self) -> dict:
        """The non-streaming response body."""


class _AnthropicWire(_DeltaWire):
    ping_event = MessageStream.ping()

    def __init__(self, builder: ResponseBuilder, run: Run, model: str, fitted: bool = False):
        cached = _cached_tokens(run)
        super().__init__(builder, cached,
                         MessageStream(model, builder.usage()["prompt_tokens"], cached))
        self.fitted = fitted  # max_tokens was lowered to the context's room: "length" is the window

    def start(self) -> list:
        return super().start() + [self.ping_event]

    def _finish(self, reason: str, stop_string: str | None, usage: dict) -> list:
        if reason == "length" and self.fitted:
            reason = "context"
        return self.stream.finish(reason, usage["completion_tokens"], stop_string)

    def _whole(self) -> dict:
        return self.stream.message()


class _ResponsesWire(_DeltaWire):
    def __init__(self, builder: ResponseBuilder, run: Run, request: dict, model: str):
        super().__init__(builder, _cached_tokens(run), ResponseStream(request, model))

    def _finish(self, reason: str, stop_string: str | None, usage: dict) -> list:
        return self.stream.finish(reason, usage["prompt_tokens"], usage["completion_tokens"],
                                  self.cached)

    def _whole(self) -> dict:
        return self.stream.response()


# routes -------------------------------------------------------------------------------------------
def assist_routes(state: ServerState, endpoint) -> list[Route]:
    """The routes, each wrapped by `endpoint` (app.py's error handling)."""
    ctx, limit = state.ctx, state.args.max_request_bytes
    logged_names: set[str] = set()

    def served_model(chat: dict) -> str:
        """The name the client asked for; the chat body gets the served model's."""
        asked = chat.get("model")
        if not isinstance(asked, str):
            raise bad("model", "'model' must be a string")
        if asked not in ctx.names:
            if asked not in logged_names and len(logged_names) < _MAX_LOGGED_NAMES:
                logged_names.add(asked)
                logger.info("Anthropic requests for model %r are served by %s", asked,
                            ctx.names[0])
            chat["model"] = ctx.names[0]
        return asked

    @endpoint
    async def messages(request: Request) -> Response:
        chat, warnings = messages_to_chat(await read_json(request, limit))
        asked = served_model(chat)
        req = await off_loop(parse_chat, chat, ctx, fit_max_tokens=True)
        req.warnings[:0] = warnings
        return await generate(request, state, req,
                              lambda builder, run: _AnthropicWire(builder, run, asked,
                                                                  req.fitted_max_tokens))

    @endpoint
    async def count_tokens(request: Request) -> Response:
        chat, warnings = count_tokens_request(await read_json(request, limit))
        served_model(chat)
        prompt = await off_loop(chat_prompt, chat, ctx)
        for warning in warnings + prompt.warnings:
            logger.warning("count_tokens: %s", warning)
        return JSONResponse(count_tokens_response(len(prompt.ids)))

    @endpoint
    async def responses(request: Request) -> Response:
        body = await read_json(request, limit)
        chat, warnings = responses_to_chat(body)
        try:
            req = await off_loop(parse_chat, chat, ctx)
        except APIError as e:
            if e.param == "max_tokens":  # the Responses API calls it max_output_tokens
                e.param, e.message = "max_output_tokens", e.message.replace("max_tokens",
                                                                            "max_output_tokens")
            raise
        req.warnings[:0] = warnings
        return await generate(request, state, req,
                              lambda builder, run: _ResponsesWire(builder, run, body, req.model))

    @endpoint
    async def infill(request: Request) -> Response:
        body = await read_json(request, limit)
        fill = parse_infill(body)
        model = resolve_model(body, ctx)
        if ctx.fim is None:
            raise bad(None, missing_fim_tokens(ctx.tokenizer) if ctx.tokenizer is not None
                      else "this model has no tokenizer, so it cannot fill in the middle")
        ids = await off_loop(fill.prompt_token_ids, ctx.fim, ctx.tokenizer)
        params = build_params(fill.sampling_kwargs(ctx.fim), ctx, ids, fill.max_tokens,
                              "input_prefix", "n_predict")
        req = ParsedRequest(False, f"infill-{uuid.uuid4().hex}", model,
                            [{"prompt": None, "prompt_token_ids": ids}], [""], [params],
                            fill.stream, False, warnings=fill.warnings)
        return await generate(request, state, req, lambda builder, run: InfillWire(
            builder, fill, model, _cached_tokens(run)))

    return [Route(ANTHROPIC_PATH, messages, methods=["POST"]),
            Route(ANTHROPIC_PATH + "/count_tokens", count_tokens, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/infill", infill, methods=["POST"])]
