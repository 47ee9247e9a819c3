"""OpenAI request bodies → engine prompts and SamplingParams (every bad field a 400 naming it).
The response side lives in `responses.py`; chat prompts are built in `chat.py`, output grammars
read in `constraints.py`, fill-in-the-middle prompts in `fim.py`, and single fields in
`fields.py`.

Plain Python: no web framework here, so it is testable without a server."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..sampling_params import RequestOutputKind, SamplingParams
from ..structured import tool_call_constraint
from . import constraints
from .chat import FIELDS as CHAT_PROMPT_FIELDS
from .chat import chat_prompt
from .fields import (MAX_N, APIError, bad, boolean, int_list, integer, number, seed, show,
                     stop_strings)
from .fim import FimFormat, fim_prompts
from .reasoning import ChatTextParser, ReasoningParserFactory
from .tool_parsers import ToolParserFactory


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
    fitted_max_tokens: bool = False  # max_tokens was lowered to the room the prompt leaves

    @property
    def n(self) -> int:
        return self.params[0].n


def resolve_model(body: dict, ctx: ModelContext) -> str:
    """The served model a body names (the default when it names none); 404 for another."""
    m = body.get("model")
    if m is None:
        return ctx.names[0]
    if not isinstance(m, str):
        raise bad("model", f"'model' must be a string, got {show(m)}")
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
_SAMPLING_FIELDS = {
    "model", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "logit_bias",
    "allowed_token_ids", "stream", "stream_options", "max_tokens", "logprobs", "user",
    *constraints.FIELDS, *_REFUSED}
_COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "suffix", "echo", "tools"}
_CHAT_FIELDS = _SAMPLING_FIELDS | CHAT_PROMPT_FIELDS | {"max_completion_tokens", "top_logprobs",
                                                        "parallel_tool_calls"}


def _refuse(body: dict) -> None:
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise bad(name, f"'{name}': {why}")


def _unknown(body: dict, known: set[str]) -> list[str]:
    """A warning naming the fields this server does not read (vLLM logs them too)."""
    names = [k for k in body if k not in known]
    if not names:
        return []
    shown = ", ".join(show(k) for k in names[:10]) + (" ..." if len(names) > 10 else "")
    return [f"unknown fields ignored: {shown}"]


def _stream_options(body: dict, stream: bool) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise bad("stream_options", f"'stream_options' must be an object, got {show(so)}")
    if not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    v = so.get("include_usage")
    if v is not None and not isinstance(v, bool):
        raise bad("stream_options", f"'stream_options.include_usage' must be a boolean, "
                  f"got {show(v)}")
    return bool(v)


def _sampling_kwargs(body: dict) -> dict:
    n = integer(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise bad("n", f"'n' must be in [1, {MAX_N}], got {n}")
    best_of = integer(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise bad("best_of", "'best_of' other than n is not supported")
    return dict(
        n=n,
        temperature=number(body, "temperature", 1.0),
        top_p=number(body, "top_p", 1.0),
        top_k=integer(body, "top_k", 0),
        min_p=number(body, "min_p", 0.0),
        presence_penalty=number(body, "presence_penalty", 0.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0),
        repetition_penalty=number(body, "repetition_penalty", 1.0),
        seed=seed(body),
        stop=stop_strings(body),
        stop_token_ids=int_list(body, "stop_token_ids"),
        ignore_eos=boolean(body, "ignore_eos", False),
        min_tokens=integer(body, "min_tokens", 0),
        skip_special_tokens=boolean(body, "skip_special_tokens", True),
        include_stop_str_in_output=boolean(body, "include_stop_str_in_output", False),
        logit_bias=_logit_bias(body),
        allowed_token_ids=None if body.get("allowed_token_ids") is None
        else int_list(body, "allowed_token_ids"),
    )


def _logit_bias(body: dict) -> dict[int, float] | None:
    """Keys as token ids (JSON keys are strings); SamplingParams checks and clamps the values."""
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if not isinstance(lb, dict):
        raise bad("logit_bias", f"'logit_bias' must be an object, got {show(lb)}")
    out = {}
    for key, value in lb.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad("logit_bias", f"'logit_bias' keys must be token ids, got {show(key)}") \
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


def build_params(kw: dict, ctx: ModelContext, ids: list[int], requested: int | None,
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
    model = resolve_model(body, ctx)
    _refuse(body)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", f"'tools' must be a list, got {show(tools)}")
    if tools:
        raise bad("tools", "'tools' (tool calling) is served on /v1/chat/completions only")
    stream = boolean(body, "stream", False)
    include_usage = _stream_options(body, stream)
    echo = boolean(body, "echo", False)
    kw = _sampling_kwargs(body)
    kw["structured_outputs"], constraint_param = constraints.output_constraint(body)
    requested = integer(body, "max_tokens", None) if "max_tokens" in body else 16
    logprobs = integer(body, "logprobs", None)
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
        pairs = fim_prompts(body.get("prompt"), body["suffix"], ctx)
        kw["stop_token_ids"] = kw["stop_token_ids"] + list(ctx.fim.stop_token_ids)
    prompts, texts, params = [], [], []
    for text, ids in pairs:
        params.append(build_params(kw, ctx, ids, requested, "prompt"))
        prompts.append({"prompt": text, "prompt_token_ids": ids})
        texts.append(text if text is not None else
                     (ctx.tokenizer.decode(ids) if echo and ctx.tokenizer is not None else ""))
    return ParsedRequest(False, f"cmpl-{uuid.uuid4().hex}", model, prompts, texts, params,
                         stream, include_usage, echo, logprobs, constraint_param=constraint_param,
                         warnings=_unknown(body, _COMPLETION_FIELDS))


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
    model = resolve_model(body, ctx)
    _refuse(body)
    stream = boolean(body, "stream", False)
    include_usage = _stream_options(body, stream)
    kw = _sampling_kwargs(body)
    max_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    requested = integer(body, max_param, None)
    want_lp = boolean(body, "logprobs", False)
    top = integer(body, "top_logprobs", None)
    if top is not None and not want_lp:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
    if top is not None and not 0 <= top <= 20:
        raise bad("top_logprobs", f"'top_logprobs' must be in [0, 20], got {top}")
    num_lp = (top or 0) if want_lp else None
    kw["logprobs"] = num_lp
    parallel = boolean(body, "parallel_tool_calls", True)

    prompt = chat_prompt(body, ctx)
    kw["structured_outputs"], constraint_param = constraints.output_constraint(body)
    if prompt.forced_functions is not None:
        if constraint_param is not None:
            raise bad("tool_choice", f"a 'tool_choice' that forces a call cannot be combined "
                      f"with '{constraint_param}'")
        kw["structured_outputs"], constraint_param = tool_call_constraint(
            prompt.forced_functions, ctx.tool_parser.call_format, parallel), "tool_choice"
    fitted = False
    if fit_max_tokens and requested is not None:
        room = min(ctx.max_model_len, ctx.kv_capacity_tokens) - len(prompt.ids)
        fitted = 1 <= room < requested
        requested = room if fitted else requested
    params = build_params(kw, ctx, prompt.ids, requested, "messages", max_param)
    return ParsedRequest(True, f"chatcmpl-{uuid.uuid4().hex}", model,
                         [{"prompt": prompt.text, "prompt_token_ids": prompt.ids}], [prompt.text],
                         [params], stream, include_usage, False, num_lp,
                         text_parser=prompt.text_parser if kw["structured_outputs"] is None
                         else prompt.constrained_text_parser, parallel_tool_calls=parallel,
                         constraint_param=constraint_param,
                         warnings=_unknown(body, _CHAT_FIELDS) + prompt.warnings,
                         fitted_max_tokens=fitted)
