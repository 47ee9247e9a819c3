"""The OpenAPI 3.0 description served at /openapi.json: hand-written, one dict.

It states what the server accepts, field by field, as `protocol` validates it: anything the schema
forbids is answered 400 (the schema-driven fuzz test holds the server to that). Cross-field rules
(prompt plus max_tokens within the context, min_tokens <= max_tokens, stream_options only when
streaming, best_of == n) are in the descriptions only. Built per server so the token-id range
and the auth requirement match the model and flags being served."""
from __future__ import annotations

from .fields import MAX_N
# the schema builders, under this module's short local names
from .schema_parts import (BOOL as _BOOL, STRING as _STRING, any_null as _any_null,
                           content_block as _block, integer as _int, nullable as _null,
                           number as _num, text_or as _text_or)

_INT64_MIN, _INT64_MAX = -2 ** 63, 2 ** 63 - 1

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
        "logit_bias": _null({"type": "object",
                             "additionalProperties": {"type": "number", "minimum": -100,
                                                      "maximum": 100},
                             "description": "token id (as a string key) -> added to its logit"}),
        "allowed_token_ids": _null({"type": "array", "minItems": 1, "items": token,
                                    "description": "sample only among these tokens"}),
        "response_format": _null({"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {
                "name": {"type": "string"}, "schema": {"type": "object"}, "strict": _BOOL}}},
            "description": "json_object and json_schema are enforced by a grammar (always "
                           "strict); json_schema needs json_schema"}),
        "user": _null({"type": "string"}),
    }


_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": _null({"type": "string"}),
        "parameters": _null({"type": "object"}), "strict": _BOOL}}}}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": _null({"type": "string"}), "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string"}}}}}
def _assist_requests(sampling: dict, tools: bool, fim: bool) -> dict:
    """The request bodies of the editor-assistant routes, field by field as far as they are
    validated; the translating modules' docstrings list every field read."""
    block = {"anyOf": [
        _block("text", text=_STRING),
        _block("tool_use", id=_STRING, name=_STRING, input={"type": "object"}),
        _block("tool_result", ("content",), tool_use_id=_STRING,
               content=_text_or("text", nullable=True)),
        _block("thinking", thinking=_STRING), _block("redacted_thinking")]}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["user", "assistant"]},
        "content": {"anyOf": [_STRING, {"type": "array", "items": block}]}}}
    prompt = {"model": _STRING,
              "messages": {"type": "array", "minItems": 1, "items": message,
                           "description": "the last message is the user's"},
              "system": _text_or("text", nullable=True)}
    if tools:
        prompt["tools"] = _null({"type": "array", "items": {
            "type": "object", "required": ["name", "input_schema"], "properties": {
                "type": _null({"type": "string", "enum": ["custom"]}),
                "name": {"type": "string", "minLength": 1}, "input_schema": {"type": "object"},
                "description": _null(_STRING), "strict": _BOOL}}})
        prompt["tool_choice"] = _null({
            "type": "object", "required": ["type"], "properties": {
                "type": {"type": "string", "enum": ["auto", "none", "any", "tool"]},
                "name": _STRING, "disable_parallel_tool_use": _BOOL},
            "description": "needs tools; \"any\" and \"tool\" (with name) force a call "
                           "through a grammar"})
    messages = {"type": "object", "required": ["model", "max_tokens", "messages"], "properties": {
        **prompt, **{k: sampling[k] for k in ("temperature", "top_p", "top_k", "stream")},
        "max_tokens": _int(1, _INT64_MAX, description="lowered to the room the prompt leaves "
                           "in the context"),
        "stop_sequences": _null({"type": "array", "items": {"type": "string", "minLength": 1}})}}
    count = {"type": "object", "required": ["model", "messages"], "properties": prompt}
    item = {"anyOf": [
        dict(_block("message", role={"type": "string",
                                     "enum": ["user", "assistant", "system", "developer"]},
                    content=_text_or("input_text", "output_text")), required=["role", "content"]),
        _block("function_call", call_id=_STRING, name=_STRING, arguments=_STRING),
        _block("function_call_output", call_id=_STRING,
               output=_text_or("input_text", "output_text"))]}
    responses = {"type": "object", "required": ["input"], "properties": {
        "model": sampling["model"],
        "input": {"anyOf": [_STRING, {"type": "array", "minItems": 1, "items": item}]},
        "instructions": _null(_STRING), "max_output_tokens": _int(1, _INT64_MAX),
        "parallel_tool_calls": _BOOL,
        **{k: sampling[k] for k in ("temperature", "top_p", "stream")}}}
    out = {"MessagesRequest": messages, "CountTokensRequest": count,
           "ResponsesRequest": responses}
    if fim:
        chunk = {"type": "object", "required": ["text"],
                 "properties": {"text": _STRING, "filename": _STRING}}
        out["InfillRequest"] = {"type": "object", "additionalProperties": False, "properties": {
            **{k: _null(_STRING) for k in ("input_prefix", "input_suffix", "prompt", "model")},
            "input_extra": _null({"type": "array", "items": chunk}),
            "n_predict": _int(-1, _INT64_MAX, description="-1: no limit; 0: one token, as "
                              "llama.cpp"),
            "top_k": _int(_INT64_MIN, _INT64_MAX, description="<= 0: no top-k"),
            "seed": _int(_INT64_MIN, _INT64_MAX, description="-1: a random seed"),
            "id_slot": _int(_INT64_MIN, _INT64_MAX), "cache_prompt": _BOOL,
            "n_cmpl": _int(1, MAX_N, description="completions of the prompt; more than one: "
                           "the response is an array of results"),
            "samplers": _any_null(
                {"type": "array", "uniqueItems": True, "items": {"type": "string", "enum": [
                    "temperature", "min_p", "top_k", "top_p"]}},
                {"type": "string", "pattern": "^[tmkp]*$"},
                description="the stages that run; pairs that do not commute in luceio's order "
                            "(temperature, min_p, top_k, top_p) must be listed in it"),
            "n_indent": _int(_INT64_MIN, _INT64_MAX, description="stop at a line after the "
                             "first with less indentation (llama.cpp's rule)"),
            "t_max_predict_ms": _int(_INT64_MIN, _INT64_MAX, description="after this long, "
                                     "stop at the next newline"),
            "t_max_prompt_ms": _int(_INT64_MIN, _INT64_MAX, description="accepted, not "
                                    "applied (as in llama.cpp)"),
            "response_fields": _null({"type": "array", "items": _STRING,
                                      "description": "paths of the final response's fields"}),
            **{k: sampling[k] for k in ("temperature", "top_p", "min_p", "stop", "stream",
                                        "ignore_eos")}}}
    return out


def _assist_paths(openai_errors: dict, auth: dict, fim: bool) -> dict:
    """The editor-assistant routes (`routes_assist.py`); /infill only where the model has FIM
    tokens."""
    anthropic_error = {"description": "Anthropic's error object", "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}}
    anthropic_errors = {s: anthropic_error for s in ("400", "413", "415", "503")}
    if auth:
        anthropic_errors["401"] = anthropic_error

    def post(summary: str, req: str, errors: dict, stream: bool = True) -> dict:
        content = {"application/json": {"schema": {"type": "object"}}}
        if stream:
            content["text/event-stream"] = {"schema": _SSE_EVENT}
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{req}"}}}},
            "responses": {"200": {"description": "the response" + (
                ", or with stream: true server-sent events" if stream else ""),
                "content": content}, **errors}}}

    paths = {
        "/v1/messages": post("Anthropic Messages (any model name is served by this model)",
                             "MessagesRequest", anthropic_errors),
        "/v1/messages/count_tokens": post("Anthropic token count of a Messages prompt",
                                          "CountTokensRequest", anthropic_errors, stream=False),
        "/v1/responses": post("OpenAI Responses", "ResponsesRequest", openai_errors),
    }
    if fim:
        paths["/infill"] = post("llama.cpp fill-in-the-middle", "InfillRequest", openai_errors)
    return paths


def openapi_schema(model_names: list[str], vocab_size: int, max_model_len: int,
                   api_key: bool, tools: bool = False, fim: bool = False) -> dict:
    """`tools`: the model's tool calls can be parsed; `fim`: it has fill-in-the-middle tokens
    (each documents the fields and routes that need it)."""
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    max_tokens = _int(1, _INT64_MAX, description=f"prompt + max_tokens must fit the "
                      f"{max_model_len}-token context (the server may cap it lower)")
    completion_req = {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **_sampling(vocab_size),
            "tools": _null({"type": "array", "maxItems": 0,
                            "description": "tool calling is on /v1/chat/completions"}),
            **({"suffix": _null({"type": "string", "description": "fill in the middle between "
                                 "prompt and suffix (text prompts only; not with echo)"})}
               if fim else {}),
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
        "name": _null({"type": "string"}),
        "tool_calls": _null({"type": "array", "items": _TOOL_CALL}),
        "tool_call_id": _null({"type": "string", "description": "required in a tool message"}),
        "reasoning_content": _null({"type": "string"})}}
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
            "parallel_tool_calls": _BOOL,
            "chat_template_kwargs": _null({"type": "object", "description": "extra variables "
                                           "for the chat template, e.g. enable_thinking"}),
            **({"tools": _null({"type": "array", "items": _TOOL}),
                "tool_choice": _null({"anyOf": [
                    {"type": "string", "enum": ["none", "auto", "required"]},
                    {"type": "object", "required": ["type", "function"], "properties": {
                        "type": {"type": "string", "enum": ["function"]},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": _STRING}}}}],
                    "description": "needs tools; \"required\" and a named function force a "
                                   "call through a grammar"})}
               if tools else {"tools": _null({"type": "array", "maxItems": 0, "description":
                                              "this model's tool calls cannot be parsed"})}),
        },
    }
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {**{k: {"type": "integer", "minimum": 0}
                               for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                            "prompt_tokens_details": {"type": "object", "properties": {
                                "cached_tokens": {"type": "integer", "minimum": 0,
                                                  "description": "read from the prefix cache"}}}}}
    finish = _null({"type": "string", "enum": ["stop", "length", "abort", "tool_calls"]})
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
                                                          "content": _null({"type": "string"}),
                                                          "reasoning_content": _null(
                                                              {"type": "string"}),
                                                          "tool_calls": {"type": "array",
                                                                         "items": _TOOL_CALL}}},
                                          "logprobs": _null({"type": "object"}),
                                          "finish_reason": finish,
                                          "stop_reason": stop_reason}}},
                       "usage": usage}}
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": _null({"type": "string"}), "code": _null({"type": "string"})}}}}
    anthropic_error = {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"type": "string", "enum": ["error"]},
        "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}}}
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
            **_assist_paths(generation_errors, auth, fim),
        },
        "components": {"schemas": {"CompletionRequest": completion_req,
                                   "ChatCompletionRequest": chat_req, "Completion": completion,
                                   "ChatCompletion": chat, "Error": error,
                                   "AnthropicError": anthropic_error,
                                   **_assist_requests(_sampling(vocab_size), tools, fim)}},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        doc["security"] = [{"bearer": []}, {"x-api-key": []}]
    return doc
