"""OpenAI request bodies → engine prompts and SamplingParams (every bad field a 400 naming it).
The response side lives in `responses.py`.

Plain Python: no web framework here, so it is testable without a server."""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import jinja2

from ..sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from ..structured import tool_call_constraint
from .reasoning import ChatTextParser, ReasoningParserFactory
from .tool_parsers import ToolParserFactory

if TYPE_CHECKING:
    from .fim import FimFormat

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
    tool_parser: ToolParserFactory | None = None  # None: tool calls cannot be parsed
    reasoning_parser: ReasoningParserFactory | None = None  # None: no reasoning split
    fim: FimFormat | None = None  # None: the vocabulary has no fill-in-the-middle tokens


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
    text_parser: Callable[[], ChatTextParser] | None = None  # one per choice; None: text as is
    parallel_tool_calls: bool = True  # False: calls after a choice's first are dropped
    constraint_param: str | None = None  # the field that asked for an output grammar
    warnings: list[str] = field(default_factory=list)  # fields ignored, for the server to log

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


# refused on both routes: accepting them would return something other than what was asked for
_REFUSED = {
    "functions": "legacy function calling is not supported: send 'tools'",
    "function_call": "legacy function calling is not supported: send 'tool_choice'",
    "guided_whitespace_pattern": "not supported (xgrammar has no such option); "
                                 "'structured_outputs': {\"disable_any_whitespace\": true} "
                                 "allows no whitespace",
    "bad_words": "not supported yet; logit_bias -100 bans single tokens",
}
# vLLM's extra fields that each give one kind of StructuredOutputsParams
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_SAMPLING_FIELDS = {
    "model", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "logit_bias",
    "allowed_token_ids", "stream", "stream_options", "response_format", "max_tokens", "logprobs",
    "user", "structured_outputs", *_GUIDED, *_REFUSED}
_COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "suffix", "echo", "tools"}
_CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs",
                                   "add_generation_prompt", "tools", "tool_choice",
                                   "parallel_tool_calls"}


def _refuse(body: dict) -> None:
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise bad(name, f"'{name}': {why}")


def _output_constraint(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The output grammar a body asks for, and the field that asked: `response_format`
    (json_object, json_schema), vLLM's `structured_outputs` object or one of its `guided_*`
    fields. At most one may be given."""
    found = []
    if body.get("response_format") is not None:
        found.append(("response_format", _response_format(body["response_format"])))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs",
                      _constraint_params("structured_outputs", body["structured_outputs"])))
    found += [(name, _constraint_params(name, {kind: body[name]}))
              for name, kind in _GUIDED.items() if body.get(name) is not None]
    found = [(name, p) for name, p in found if p is not None]
    if len(found) > 1:
        raise bad(found[1][0], f"'{found[1][0]}' cannot be combined with '{found[0][0]}': give "
                  "one output constraint")
    return (found[0][1], found[0][0]) if found else (None, None)


def _response_format(rf) -> StructuredOutputsParams | None:
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    js = rf.get("json_schema") if kind == "json_schema" else None
    if not (isinstance(js, dict) and isinstance(js.get("schema", {}), dict)):
        raise bad("response_format", "'response_format' must be {\"type\": \"text\"}, "
                  "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                  f"{{\"name\": ..., \"schema\": {{...}}}}}}, got {_show(rf)}")
    return StructuredOutputsParams(json=js.get("schema", {}))  # always strict


def _constraint_params(name: str, value) -> StructuredOutputsParams:
    fields = set(StructuredOutputsParams.__dataclass_fields__)
    if not isinstance(value, dict) or not set(value) <= fields:
        raise bad(name, f"'{name}' must be an object with one of json, regex, choice, grammar, "
                  f"json_object, structural_tag (and vLLM's options), got {_show(value)}")
    try:
        return StructuredOutputsParams(**value)
    except ValueError as e:
        raise bad(name, f"'{name}': {e}") from None


def _unknown(body: dict, known: set[str]) -> list[str]:
    """A warning naming the fields this server does not read (vLLM logs them too)."""
    names = [k for k in body if k not in known]
    if not names:
        return []
    shown = ", ".join(_show(k) for k in names[:10]) + (" ..." if len(names) > 10 else "")
    return [f"unknown fields ignored: {shown}"]


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
        logit_bias=_logit_bias(body),
        allowed_token_ids=None if body.get("allowed_token_ids") is None
        else _int_list(body, "allowed_token_ids"),
    )


def _logit_bias(body: dict) -> dict[int, float] | None:
    """Keys as token ids (JSON keys are strings); SamplingParams checks and clamps the values."""
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if not isinstance(lb, dict):
        raise bad("logit_bias", f"'logit_bias' must be an object, got {_show(lb)}")
    out = {}
    for key, value in lb.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad("logit_bias", f"'logit_bias' keys must be token ids, got {_show(key)}") \
                from None
    return out


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
    for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
        if any(not 0 <= t < ctx.vocab_size for t in kw.get(name) or ()):
            raise bad(name, f"'{name}' token ids must be in [0, {ctx.vocab_size})")
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
    _refuse(body)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", f"'tools' must be a list, got {_show(tools)}")
    if tools:
        raise bad("tools", "'tools' (tool calling) is served on /v1/chat/completions only")
    stream = _boolean(body, "stream", False)
    include_usage = _stream_options(body, stream)
    echo = _boolean(body, "echo", False)
    kw = _sampling_kwargs(body)
    kw["structured_outputs"], constraint_param = _output_constraint(body)
    requested = _integer(body, "max_tokens", None) if "max_tokens" in body else 16
    logprobs = _integer(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise bad("logprobs", f"'logprobs' must be in [0, 20], got {logprobs}")
    if echo and logprobs is not None:
        raise bad("echo", "'echo' together with 'logprobs' is not supported")
    kw["logprobs"] = logprobs

    if body.get("suffix") is None:
        pairs = _completion_prompts(body.get("prompt"), ctx)
    else:
        if echo:
            raise bad("echo", "'echo' together with 'suffix' is not supported")
        pairs = _fim_prompts(body.get("prompt"), body["suffix"], ctx)
        kw["stop_token_ids"] = kw["stop_token_ids"] + list(ctx.fim.stop_token_ids)
    prompts, texts, params = [], [], []
    for text, ids in pairs:
        params.append(_build_params(kw, ctx, ids, requested, "prompt"))
        prompts.append({"prompt": text, "prompt_token_ids": ids})
        texts.append(text if text is not None else
                     (ctx.tokenizer.decode(ids) if echo and ctx.tokenizer is not None else ""))
    return ParsedRequest(False, f"cmpl-{uuid.uuid4().hex}", model, prompts, texts, params,
                         stream, include_usage, echo, logprobs, constraint_param=constraint_param,
                         warnings=_unknown(body, _COMPLETION_FIELDS))


def _fim_prompts(prompt, suffix, ctx: ModelContext) -> list[tuple[None, list[int]]]:
    """Text prompt(s) and a suffix → the model's fill-in-the-middle prompt ids (`fim.py`)."""
    if not isinstance(suffix, str):
        raise bad("suffix", f"'suffix' must be a string, got {_show(suffix)}")
    if ctx.fim is None:
        from .fim import missing_fim_tokens  # fim.py builds on this module
        raise bad("suffix", missing_fim_tokens(ctx.tokenizer) if ctx.tokenizer is not None
                  else "this model has no tokenizer, so it cannot fill in the middle")
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not (isinstance(texts, list) and texts and all(isinstance(p, str) for p in texts)):
        raise bad("prompt", "with 'suffix', 'prompt' must be text (a string or a list of "
                  "strings): the fill-in-the-middle prompt is built from the text")
    return [(None, ctx.fim.build(ctx.tokenizer, p, suffix)) for p in texts]


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
def parse_chat(body: dict, ctx: ModelContext, fit_max_tokens: bool = False) -> ParsedRequest:
    """`fit_max_tokens`: a max_tokens beyond the room the prompt leaves in the context is lowered
    to that room instead of refused (the Anthropic route: Claude Code asks for 32000 tokens
    whatever the model)."""
    model = _model(body, ctx)
    _refuse(body)
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
    parallel = _boolean(body, "parallel_tool_calls", True)

    prompt = chat_prompt(body, ctx)
    kw["structured_outputs"], constraint_param = _output_constraint(body)
    if prompt.forced_functions is not None:
        if constraint_param is not None:
            raise bad("tool_choice", f"a 'tool_choice' that forces a call cannot be combined "
                      f"with '{constraint_param}'")
        kw["structured_outputs"], constraint_param = tool_call_constraint(
            prompt.forced_functions, ctx.tool_parser.call_format, parallel), "tool_choice"
    if fit_max_tokens and requested is not None:
        room = min(ctx.max_model_len, ctx.kv_capacity_tokens) - len(prompt.ids)
        requested = min(requested, room) if room >= 1 else requested
    params = _build_params(kw, ctx, prompt.ids, requested, "messages", max_param)
    return ParsedRequest(True, f"chatcmpl-{uuid.uuid4().hex}", model,
                         [{"prompt": prompt.text, "prompt_token_ids": prompt.ids}], [prompt.text],
                         [params], stream, include_usage, False, num_lp,
                         text_parser=prompt.text_parser, parallel_tool_calls=parallel,
                         constraint_param=constraint_param,
                         warnings=_unknown(body, _CHAT_FIELDS) + prompt.warnings)


@dataclass
class ChatPrompt:
    text: str
    ids: list[int]
    text_parser: Callable[[], ChatTextParser] | None  # how to read what the model writes back
    warnings: list[str]
    forced_functions: list[dict] | None = None  # tool_choice required/named: a call to one of these


def chat_prompt(body: dict, ctx: ModelContext) -> ChatPrompt:
    """A chat body's prompt: `messages` (tool calls and tool results included) and the `tools`
    that `tool_choice` offers, rendered through the model's chat template. What
    /v1/messages/count_tokens counts."""
    messages = _messages(body.get("messages"))
    tools, forced, warnings = _offered_tools(body)
    add_gen = _boolean(body, "add_generation_prompt", True)
    tok = ctx.tokenizer
    if tok is None:
        raise bad("messages", "this model has no tokenizer; use /v1/completions with token ids")
    if tools and ctx.tool_parser is None:
        raise bad("tools", "this model's chat template has no tool-call format luceio knows, so "
                  "its calls could not be read; start the server with --tool-parser NAME if the "
                  "model writes one of them")
    extra = {"tools": tools} if tools else {}
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_gen, **extra)
    except (ValueError, jinja2.TemplateError) as e:
        raise bad("messages", f"the chat template failed on these messages: {e}") from None
    ids = tok.encode(text, add_special_tokens=False)
    return ChatPrompt(text, ids, _text_parser(ctx, text, bool(tools)), warnings, forced)


def _text_parser(ctx: ModelContext, prompt: str,
                 tools_offered: bool) -> Callable[[], ChatTextParser] | None:
    """A factory of one message's parser: the reasoning split when the server has one, the
    tool-call parser when tools are offered; None when neither applies."""
    reasoning = ctx.reasoning_parser
    tools = ctx.tool_parser if tools_offered else None
    if reasoning is None and tools is None:
        return None
    thinking = reasoning is not None and reasoning.opens_reasoning(prompt)
    return lambda: ChatTextParser(reasoning(in_reasoning=thinking) if reasoning else None,
                                  tools() if tools else None)


def _offered_tools(body: dict) -> tuple[list[dict] | None, list[dict] | None, list[str]]:
    """The function tools the model is offered (None: none, or `tool_choice` "none"), the
    functions `tool_choice` forces a call to (all for "required", one when named; None
    otherwise), and warnings."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", f"'tools' must be a list, got {_show(tools)}")
    warnings = [w for i, t in enumerate(tools or []) for w in _check_tool(t, f"tools[{i}]")]
    choice = body.get("tool_choice")
    if choice is None or (choice == "auto" and tools):
        return tools or None, None, warnings
    if not tools:
        raise bad("tool_choice", "'tool_choice' needs 'tools'")
    if choice == "none":
        return None, None, warnings
    functions = [t["function"] for t in tools]
    if choice == "required":
        return tools, functions, warnings
    fn = choice.get("function") if isinstance(choice, dict) and \
        choice.get("type") == "function" else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise bad("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                  "{\"type\": \"function\", \"function\": {\"name\": ...}}, "
                  f"got {_show(choice)}")
    named = [f for f in functions if f["name"] == fn["name"]]
    if not named:
        raise bad("tool_choice", f"'tool_choice' names the function {_show(fn['name'])}, which "
                  "is not in 'tools'")
    return tools, named[:1], warnings


def _check_tool(tool, where: str) -> list[str]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)):
        raise bad(where, f"'{where}' must be {{\"type\": \"function\", \"function\": "
                  "{\"name\": ..., \"parameters\": ...}}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad(f"{where}.function.name", f"'{where}.function.name' must be a non-empty string")
    for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise bad(f"{where}.function.{key}", f"'{where}.function.{key}' must be a "
                      f"{kind.__name__}, got {_show(fn[key])}")
    if fn.get("strict"):
        return [f"'{where}.function.strict' is enforced only when 'tool_choice' forces a call "
                "(\"required\" or this function by name)"]
    return []


def _messages(msgs) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(msgs)]


def _message(m, where: str) -> dict:
    """One message as the chat template gets it: role, text content, and where given `name`,
    an assistant's `tool_calls` and `reasoning_content`, a tool result's `tool_call_id`."""
    if not isinstance(m, dict):
        raise bad(where, f"'{where}' must be an object with 'role' and 'content'")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise bad(f"{where}.role", f"'{where}.role' must be a non-empty string")
    if m.get("function_call") is not None:
        raise bad(f"{where}.function_call", f"'{where}.function_call': legacy function calling "
                  "is not supported: send 'tool_calls'")
    msg = {"role": role, "content": _content(m.get("content"), where)}
    for key in ("name", "reasoning_content", "tool_call_id"):
        v = m.get(key)
        if v is not None and not isinstance(v, str):
            raise bad(f"{where}.{key}", f"'{where}.{key}' must be a string, got {_show(v)}")
        if v is not None:
            msg[key] = v
    if role == "tool" and "tool_call_id" not in msg:
        raise bad(f"{where}.tool_call_id", f"'{where}.tool_call_id' is required in a tool message")
    if m.get("tool_calls") is not None:
        msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    return msg


def _content(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content", f"'{where}.content' must be a string or a list of text "
                  f"parts, got {_show(content)}")
    for j, p in enumerate(content):
        if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
            raise bad(f"{where}.content[{j}]", f"'{where}.content[{j}]': only "
                      "{\"type\": \"text\", \"text\": ...} parts are supported")
    return "\n".join(p["text"] for p in content)


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(where, f"'{where}' must be a list, got {_show(calls)}")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), str)
                and isinstance(call.get("id") or "", str)):
            raise bad(f"{where}[{k}]", f"'{where}[{k}]' must be {{\"id\": ..., \"type\": "
                      "\"function\", \"function\": {\"name\": ..., \"arguments\": JSON text}}")
        ident = {"id": call["id"]} if call.get("id") is not None else {}
        out.append({**ident, "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


# responses ----------------------------------------------------------------------------------------
