"""OpenAI request bodies → engine prompts and SamplingParams (every bad field a 400 naming it).
The response side lives in `responses.py`.

Plain Python: no web framework here, so it is testable without a server."""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import jinja2

from ..sampling_params import RequestOutputKind, SamplingParams

MAX_N = 128
_INT64 = 2 ** 63 - 1
# the engine's seeds: sample i of a request draws from seed + i, kept below 2**63
_SEED_RANGE = 2 ** 63 - MAX_N


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


# model-side facts the parser needs -------------------------------------------------------------
@dataclass
class ModelContext:
    names: list[str]  # served names; the first is the default
    tokenizer: Any  # luceio Tokenizer or None
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int  # the whole KV pool, in tokens
    check_fits: Callable[[int, int | None], None]  # raises ValueError for a request that can't fit
    max_tokens_cap: int | None = None


@dataclass
class ParsedRequest:
    chat: bool
    id: str
    model: str
    prompts: list[dict]  # engine prompts: {"prompt": text | None, "prompt_token_ids": [...]}
    prompt_texts: list[str]  # for echo
    params: list[SamplingParams]  # one per prompt (max_tokens may depend on the prompt length)
    stream: bool
    include_usage: bool
    echo: bool = False
    num_logprobs: int | None = None  # top-n logprobs to report; None: no logprobs
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.params[0].n


# field readers: null means "not given" -----------------------------------------------------------
def _show(v: Any) -> str:
    try:
        s = repr(v)
    except RecursionError:  # a deeply nested JSON value
        return f"a deeply nested {type(v).__name__}"
    return s if len(s) <= 60 else s[:57] + "..."


def _number(body: dict, name: str, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"'{name}' must be a number, got {_show(v)}")
    return float(v)


def _integer(body: dict, name: str, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"'{name}' must be an integer, got {_show(v)}")
    if not -_INT64 - 1 <= v <= _INT64:
        raise bad(name, f"'{name}' is out of range, got {_show(v)}")
    return v


def _seed(body: dict) -> int | None:
    """Any int64 (OpenAI's range): negative and very large seeds wrap onto the engine's range, so
    a given seed always draws the same samples; smaller non-negative ones are used as they are."""
    seed = _integer(body, "seed", None)
    return None if seed is None else seed % _SEED_RANGE


def _boolean(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"'{name}' must be a boolean, got {_show(v)}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", f"'stop' must be a string or a list of strings, got {_show(v)}")
    return v


def _int_list(body: dict, name: str) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in v):
        raise bad(name, f"'{name}' must be a list of integers, got {_show(v)}")
    return v


def _model(body: dict, ctx: ModelContext) -> str:
    m = body.get("model")
    if m is None:
        return ctx.names[0]
    if not isinstance(m, str):
        raise bad("model", f"'model' must be a string, got {_show(m)}")
    if m not in ctx.names:
        raise APIError(404, f"The model `{m}` does not exist.", param="model",
                       code="model_not_found")
    return m


def _unsupported(body: dict) -> None:
    lb = body.get("logit_bias")
    if lb is not None and not isinstance(lb, dict):
        raise bad("logit_bias", f"'logit_bias' must be an object, got {_show(lb)}")
    if lb:
        raise bad("logit_bias", "'logit_bias' is not supported")
    if body.get("suffix") is not None:
        raise bad("suffix", "'suffix' is not supported")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", f"'tools' must be a list, got {_show(tools)}")
    if tools:
        raise bad("tools", "'tools' (tool calling) is not supported")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("response_format", "only response_format {\"type\": \"text\"} is supported")


def _stream_options(body: dict, stream: bool) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise bad("stream_options", f"'stream_options' must be an object, got {_show(so)}")
    if not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    v = so.get("include_usage")
    if v is not None and not isinstance(v, bool):
        raise bad("stream_options", f"'stream_options.include_usage' must be a boolean, "
                  f"got {_show(v)}")
    return bool(v)


def _sampling_kwargs(body: dict) -> dict:
    n = _integer(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise bad("n", f"'n' must be in [1, {MAX_N}], got {n}")
    best_of = _integer(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise bad("best_of", "'best_of' other than n is not supported")
    return dict(
        n=n,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=_integer(body, "top_k", 0),
        min_p=_number(body, "min_p", 0.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        seed=_seed(body),
        stop=_stop(body),
        stop_token_ids=_int_list(body, "stop_token_ids"),
        ignore_eos=_boolean(body, "ignore_eos", False),
        min_tokens=_integer(body, "min_tokens", 0),
        skip_special_tokens=_boolean(body, "skip_special_tokens", True),
        include_stop_str_in_output=_boolean(body, "include_stop_str_in_output", False),
    )


def _max_tokens(requested: int | None, prompt_len: int, ctx: ModelContext) -> int | None:
    """The request's max_tokens after the server cap; "no limit" becomes what the KV pool can
    hold when the pool is smaller than the context."""
    mt = requested
    if ctx.max_tokens_cap is not None:
        mt = ctx.max_tokens_cap if mt is None else min(mt, ctx.max_tokens_cap)
    if mt is None and ctx.kv_capacity_tokens < ctx.max_model_len:
        room = ctx.kv_capacity_tokens - prompt_len
        mt = room if room >= 1 else None
    return mt


def _build_params(kw: dict, ctx: ModelContext, ids: list[int], requested: int | None,
                  prompt_param: str, max_param: str = "max_tokens") -> SamplingParams:
    if requested is not None and requested < 1:
        raise bad(max_param, f"'{max_param}' must be at least 1, got {requested}")
    if any(not 0 <= t < ctx.vocab_size for t in kw["stop_token_ids"]):
        raise bad("stop_token_ids", f"'stop_token_ids' must be in [0, {ctx.vocab_size})")
    mt = _max_tokens(requested, len(ids), ctx)
    try:
        ctx.check_fits(len(ids), mt)
    except ValueError as e:
        msg = str(e)
        raise bad(max_param if requested is not None and "max_tokens" in msg
                  else prompt_param, msg) from None
    try:
        return SamplingParams(max_tokens=mt, output_kind=RequestOutputKind.DELTA, **kw)
    except ValueError as e:  # SamplingParams' messages start with the field's name
        msg = str(e)
        raise bad(msg.split(" ", 1)[0], msg) from None


# /v1/completions ---------------------------------------------------------------------------------
def parse_completion(body: dict, ctx: ModelContext) -> ParsedRequest:
    model = _model(body, ctx)
    _unsupported(body)
    stream = _boolean(body, "stream", False)
    include_usage = _stream_options(body, stream)
    echo = _boolean(body, "echo", False)
    kw = _sampling_kwargs(body)
    requested = _integer(body, "max_tokens", None) if "max_tokens" in body else 16
    logprobs = _integer(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise bad("logprobs", f"'logprobs' must be in [0, 20], got {logprobs}")
    if echo and logprobs is not None:
        raise bad("echo", "'echo' together with 'logprobs' is not supported")
    kw["logprobs"] = logprobs

    prompts, texts, params = [], [], []
    for text, ids in _completion_prompts(body.get("prompt"), ctx):
        params.append(_build_params(kw, ctx, ids, requested, "prompt"))
        prompts.append({"prompt": text, "prompt_token_ids": ids})
        texts.append(text if text is not None else
                     (ctx.tokenizer.decode(ids) if echo and ctx.tokenizer is not None else ""))
    return ParsedRequest(False, f"cmpl-{uuid.uuid4().hex}", model, prompts, texts, params,
                         stream, include_usage, echo, logprobs)


def _completion_prompts(prompt, ctx: ModelContext) -> list[tuple[str | None, list[int]]]:
    """str | [str] | [int] | [[int]] → (text, token ids) per prompt."""
    def tok_ids(ids: list) -> list[int]:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < ctx.vocab_size
                   for t in ids):
            raise bad("prompt", f"prompt token ids must be integers in [0, {ctx.vocab_size})")
        return ids

    def encode(text: str) -> list[int]:
        if ctx.tokenizer is None:
            raise bad("prompt", "this model has no tokenizer; send token ids")
        return ctx.tokenizer.encode(text)

    if prompt is None:
        raise bad("prompt", "'prompt' is required")
    if isinstance(prompt, str):
        return [(prompt, encode(prompt))]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [(p, encode(p)) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [(None, tok_ids(prompt))]
        if all(isinstance(p, list) for p in prompt):
            return [(None, tok_ids(p)) for p in prompt]
    raise bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids "
              "or a list of token-id lists (non-empty)")


# /v1/chat/completions ----------------------------------------------------------------------------
def parse_chat(body: dict, ctx: ModelContext) -> ParsedRequest:
    model = _model(body, ctx)
    _unsupported(body)
    stream = _boolean(body, "stream", False)
    include_usage = _stream_options(body, stream)
    kw = _sampling_kwargs(body)
    max_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    requested = _integer(body, max_param, None)
    want_lp = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None)
    if top is not None and not want_lp:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
    if top is not None and not 0 <= top <= 20:
        raise bad("top_logprobs", f"'top_logprobs' must be in [0, 20], got {top}")
    num_lp = (top or 0) if want_lp else None
    kw["logprobs"] = num_lp
    add_gen = _boolean(body, "add_generation_prompt", True)

    messages = _messages(body.get("messages"))
    tok = ctx.tokenizer
    if tok is None:
        raise bad("messages", "this model has no tokenizer; use /v1/completions with token ids")
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_gen)
    except (ValueError, jinja2.TemplateError) as e:
        raise bad("messages", f"the chat template failed on these messages: {e}") from None
    ids = tok.encode(text, add_special_tokens=False)
    params = _build_params(kw, ctx, ids, requested, "messages", max_param)
    return ParsedRequest(True, f"chatcmpl-{uuid.uuid4().hex}", model,
                         [{"prompt": text, "prompt_token_ids": ids}], [text], [params],
                         stream, include_usage, False, num_lp)


def _messages(msgs) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"'{where}' must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"{where}.role", f"'{where}.role' must be a non-empty string")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not (isinstance(p, dict) and p.get("type") == "text"
                        and isinstance(p.get("text"), str)):
                    raise bad(f"{where}.content[{j}]", f"'{where}.content[{j}]': only "
                              "{\"type\": \"text\", \"text\": ...} parts are supported")
                parts.append(p["text"])
            content = "\n".join(parts)
        elif not isinstance(content, str):
            raise bad(f"{where}.content", f"'{where}.content' must be a string or a list of "
                      f"text parts, got {_show(content)}")
        msg = {"role": role, "content": content}
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"{where}.name", f"'{where}.name' must be a string, got {_show(name)}")
        if name is not None:
            msg["name"] = name
        out.append(msg)
    return out


# responses ----------------------------------------------------------------------------------------
