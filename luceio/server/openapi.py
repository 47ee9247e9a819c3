"""The OpenAPI 3.0 description served at /openapi.json: hand-written, one dict.

It states what the server accepts, field by field, as `protocol` validates it: anything the schema
forbids is answered 400 (the schema-driven fuzz test holds the server to that). Cross-field rules
(prompt plus max_tokens within the context, min_tokens <= max_tokens, stream_options only when
streaming, best_of == n) are in the descriptions only. Built per server so the token-id range
and the auth requirement match the model and flags being served."""
from __future__ import annotations

from .protocol import MAX_N

_INT64_MIN, _INT64_MAX = -2 ** 63, 2 ** 63 - 1


def _null(schema: dict) -> dict:
    return dict(schema, nullable=True)


def _any_null(*branches: dict, **kw) -> dict:
    """anyOf the branches or null (3.0 has no null type: the first branch is made nullable)."""
    return {"anyOf": [dict(branches[0], nullable=True), *branches[1:]], **kw}


def _int(lo: int | None = None, hi: int | None = None, **kw) -> dict:
    s = {"type": "integer", **kw}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return _null(s)


def _num(lo: float | None = None, hi: float | None = None, exclusive_lo: bool = False,
         **kw) -> dict:
    s = {"type": "number", **kw}
    if lo is not None:
        s["minimum"] = lo
        if exclusive_lo:
            s["exclusiveMinimum"] = True
    if hi is not None:
        s["maximum"] = hi
    return _null(s)


_BOOL = _null({"type": "boolean"})
# one server-sent event: `data` is a JSON chunk, an error object, or `[DONE]` (the last event)
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def _sampling(vocab: int) -> dict:
    """Fields shared by both generation routes."""
    token = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    return {
        "model": _null({"type": "string", "description": "a served model name (GET /v1/models); "
                        "any other name is answered 404 and nothing is loaded"}),
        "n": _int(1, MAX_N, description="samples per prompt"),
        "temperature": _num(0.0, description="0 is greedy"),
        "top_p": _num(0.0, 1.0, exclusive_lo=True),
        "top_k": _int(-1, _INT64_MAX, description="0 or -1: no top-k"),
        "min_p": _num(0.0, 1.0),
        "presence_penalty": _num(-2.0, 2.0),
        "frequency_penalty": _num(-2.0, 2.0),
        "repetition_penalty": _num(0.0, exclusive_lo=True),
        "seed": _int(_INT64_MIN, _INT64_MAX, description="the same seed draws the same samples; "
                     "seeds outside [0, 2**63 - 128) are taken modulo 2**63 - 128"),
        "stop": _any_null({"type": "string", "minLength": 1},
                          {"type": "array", "items": {"type": "string", "minLength": 1}},
                          description="stop strings; the text ends before the first one"),
        "stop_token_ids": _null({"type": "array", "items": token}),
        "ignore_eos": _BOOL,
        "min_tokens": _int(0, _INT64_MAX, description="at most max_tokens"),
        "skip_special_tokens": _BOOL,
        "include_stop_str_in_output": _BOOL,
        "stream": _BOOL,
        "stream_options": _null({"type": "object", "properties": {"include_usage": _BOOL},
                                 "description": "only with stream: true"}),
        "logit_bias": _null({"type": "object", "maxProperties": 0,
                             "description": "not supported: only {} or null"}),
        "tools": _null({"type": "array", "maxItems": 0,
                        "description": "not supported: only [] or null"}),
        "response_format": _null({"type": "object", "required": ["type"],
                                  "properties": {"type": {"type": "string", "enum": ["text"]}}}),
        "user": _null({"type": "string"}),
    }


def openapi_schema(model_names: list[str], vocab_size: int, max_model_len: int,
                   api_key: bool) -> dict:
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    max_tokens = _int(1, _INT64_MAX, description=f"prompt + max_tokens must fit the "
                      f"{max_model_len}-token context (the server may cap it lower)")
    completion_req = {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **_sampling(vocab_size),
            "prompt": {"anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                {"type": "array", "minItems": 1, "items": token},
                {"type": "array", "minItems": 1,
                 "items": {"type": "array", "minItems": 1, "items": token}}],
                "description": "text, texts, token ids or lists of token ids; each prompt must "
                               f"be shorter than the {max_model_len}-token context"},
            "max_tokens": dict(max_tokens, default=16),
            "echo": _BOOL,
            "logprobs": _int(0, 20, description="top-n logprobs per token; not with echo"),
        },
    }
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"type": "string", "enum": ["text"]},
                                "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "minLength": 1},
        "content": _any_null({"type": "string"}, {"type": "array", "items": text_part}),
        "name": _null({"type": "string"})}}
    chat_req = {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **_sampling(vocab_size),
            "messages": {"type": "array", "minItems": 1, "items": message},
            "max_tokens": max_tokens,
            "max_completion_tokens": max_tokens,
            "logprobs": _BOOL,
            "top_logprobs": _int(0, 20, description="needs logprobs: true"),
            "add_generation_prompt": _BOOL,
        },
    }
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    finish = _null({"type": "string", "enum": ["stop", "length", "abort"]})
    stop_reason = _any_null({"type": "string"}, {"type": "integer"})
    head = {"id": {"type": "string"}, "created": {"type": "integer"},
            "model": {"type": "string"}}
    completion = {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {**head, "object": {"type": "string", "enum": ["text_completion"]},
                       "choices": {"type": "array", "items": {
                           "type": "object", "required": ["index", "text", "finish_reason"],
                           "properties": {"index": {"type": "integer"},
                                          "text": {"type": "string"},
                                          "logprobs": _null({"type": "object"}),
                                          "finish_reason": finish,
                                          "stop_reason": stop_reason}}},
                       "usage": usage}}
    chat = {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {**head, "object": {"type": "string", "enum": ["chat.completion"]},
                       "choices": {"type": "array", "items": {
                           "type": "object", "required": ["index", "message", "finish_reason"],
                           "properties": {"index": {"type": "integer"},
                                          "message": {"type": "object",
                                                      "required": ["role", "content"],
                                                      "properties": {
                                                          "role": {"type": "string"},
                                                          "content": {"type": "string"}}},
                                          "logprobs": _null({"type": "object"}),
                                          "finish_reason": finish,
                                          "stop_reason": stop_reason}}},
                       "usage": usage}}
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": _null({"type": "string"}), "code": _null({"type": "string"})}}}}
    ref = {"$ref": "#/components/schemas/Error"}

    def err(what: str) -> dict:
        return {"description": what, "content": {"application/json": {"schema": ref}}}

    auth = {"401": err("missing or wrong API key")} if api_key else {}
    generation_errors = {
        "400": err("invalid request (the error's `param` names the field)"),
        **auth,
        "404": err("unknown model"),
        "413": err("request body over --max-request-bytes"),
        "415": err("Content-Type is not application/json"),
        "503": err("queue full (Retry-After) or shutting down"),
    }

    def generation(summary: str, req: str, resp: str) -> dict:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{req}"}}}},
            "responses": {
                "200": {"description": "the response, or with stream: true server-sent events "
                                       "(one JSON chunk per event, then `data: [DONE]`)",
                        "content": {"application/json": {
                            "schema": {"$ref": f"#/components/schemas/{resp}"}},
                            "text/event-stream": {"schema": _SSE_EVENT}}},
                **generation_errors}}}

    def get(summary: str, content: dict, errors: dict) -> dict:
        return {"get": {"summary": summary, "responses": {
            "200": {"description": "OK", "content": content}, **errors}}}

    models = {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"type": "string", "enum": ["list"]},
        "data": {"type": "array", "items": {"type": "object", "required": ["id", "object"],
                                            "properties": {"id": {"type": "string"},
                                                           "object": {"type": "string"}}}}}}
    health = get("liveness; no API key needed",
                 {"application/json": {"schema": {"type": "object", "properties": {
                     "status": {"type": "string"}}}}},
                 {"503": err("shutting down")})
    health["get"]["security"] = []
    doc = {
        "openapi": "3.0.3",
        "info": {"title": "luceio OpenAI-compatible server", "version": "1",
                 "description": f"serving {', '.join(model_names)}"},
        "paths": {
            "/health": health,
            "/v1/models": get("the served model", {"application/json": {"schema": models}}, auth),
            "/v1/completions": generation("text completion", "CompletionRequest",
                                          "Completion"),
            "/v1/chat/completions": generation("chat completion", "ChatCompletionRequest",
                                               "ChatCompletion"),
            "/metrics": get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}},
                            auth),
            "/openapi.json": get("this document",
                                 {"application/json": {"schema": {"type": "object"}}}, auth),
        },
        "components": {"schemas": {"CompletionRequest": completion_req,
                                   "ChatCompletionRequest": chat_req, "Completion": completion,
                                   "ChatCompletion": chat, "Error": error}},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
