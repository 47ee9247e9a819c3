"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) over luceio's chat path:
a request becomes an OpenAI chat-completions body (then parsed by `protocol.parse_chat`), and the
output's deltas (`deltas.py`) become an Anthropic message or its SSE events. Plain Python.

Request fields
- translated: `model`, `max_tokens` (required, as Anthropic requires it), `messages`, `system` (a
  string or text blocks), `stop_sequences` → `stop`, `temperature`, `top_p`, `top_k`, `stream`,
  `tools` → function tools, `tool_choice` (auto/any/tool/none → auto/required/named/none;
  `disable_parallel_tool_use` → `parallel_tool_calls: false`), `output_config.format` (a JSON
  schema) → `response_format`.
- accepted, no effect on the output: `metadata`, `service_tier`, `cache_control` (anywhere),
  `inference_geo`, `speed`, `user_profile_id`, `workspace_id`, `diagnostics`, a tool's
  `eager_input_streaming` (tool input always streams).
- `thinking`: `disabled` → the chat template variable `enable_thinking` false (Qwen3's templates
  then write no thinking; a template that does not read it is warned about); `enabled` /
  `adaptive` keep the template's default; `budget_tokens` and `display` are warned about, not
  applied.
- accepted with a warning, returned for the server to log: `context_management` (no context
  editing), `output_config.effort`, and every field, block key or tool key not named here.
- refused, 400 naming the field: `container`, `mcp_servers`, server tools (a tool `type` other
  than custom), content blocks other than those below (images, documents, ...), and a final
  assistant message (a prefill: the chat template would close that turn, not continue it).

Content blocks (the text blocks of a message or of a tool result are joined with "\n")
- system (a message with role `system` inside `messages`: Claude Code sends one after the first
  user turn, beta `mid-conversation-system-2026-04-07`): a string or text blocks, kept in its
  place as a chat system message; a chat template that allows system only first answers 400.
- user: `text`; each `tool_result` becomes a `tool` message, placed before the user's text (OpenAI
  wants tool messages right after the calls), prefixed "Error: " when `is_error` is true.
- assistant: `text`; `tool_use` → `tool_calls` (input as JSON text); `thinking` → the message's
  `reasoning_content` (Qwen3's template shows the thinking of the current tool loop);
  `redacted_thinking` is dropped (it carries no text).

Output: blocks in the order the deltas come, a new one when the kind changes (thinking, text, one
per tool call); thinking blocks carry an empty `signature`. Finish "stop" → `end_turn` (or
`stop_sequence` with the string that matched), "length" → `max_tokens`, "tool_calls" →
`tool_use`. `input_tokens` counts the prompt tokens not read from the prefix cache and
`cache_read_input_tokens` those that were (Anthropic's split: they add up to the prompt).
Errors are `{"type": "error", "error": {"type", "message"}}`, the type from the HTTP status;
`to_anthropic` reshapes any `APIError` (those of `parse_chat` too). The output side is
`anthropic_stream.py`."""
from __future__ import annotations

import json
import re

from .fields import APIError

_TRANSLATED = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature",
               "top_p", "top_k", "stream", "tools", "tool_choice", "output_config"}
_NO_EFFECT = {"metadata", "service_tier", "cache_control", "inference_geo", "speed",
              "user_profile_id", "workspace_id", "diagnostics"}
_WARNED = {"context_management": "'context_management' is not applied: no context editing"}
_REFUSED = ("container", "mcp_servers")
_BLOCK_KEYS = {"text": {"text", "citations"}, "tool_use": {"id", "name", "input", "caller"},
               "tool_result": {"tool_use_id", "content", "is_error"},
               "thinking": {"thinking", "signature"}, "redacted_thinking": {"data"}}
_TOOL_KEYS = {"type", "name", "description", "input_schema", "strict", "cache_control",
              "eager_input_streaming"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


# errors ------------------------------------------------------------------------------------------
class AnthropicError(APIError):
    """An `APIError` answered in Anthropic's shape; its error type follows the status."""

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status,
                                "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


_TOO_LONG = re.compile(r"^the prompt is (\d+) tokens, but the model's context is (\d+) tokens")


def to_anthropic(e: APIError) -> AnthropicError:
    """Anthropic's shape of an error; a prompt past the context in Anthropic's words, which
    Claude Code reads to offer /compact."""
    m = _TOO_LONG.match(e.message)
    message = f"prompt is too long: {m[1]} tokens > {m[2]} maximum" if m else e.message
    return AnthropicError(e.status, message, param=e.param, code=e.code, headers=e.headers)


def _bad(where: str, message: str) -> AnthropicError:
    return AnthropicError(400, f"{where}: {message}", param=where)


def _need(obj: dict, key: str, kind: type, where: str):
    v = obj.get(key)
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise _bad(f"{where}.{key}" if where else key,
                   f"must be a {kind.__name__}, got {type(v).__name__}")
    return v


def _warn_unknown(obj: dict, where: str, known: set[str], warnings: list[str]) -> None:
    warnings += [f"unknown field '{where}{k}' ignored" for k in obj if k not in known]


# requests ----------------------------------------------------------------------------------------
def messages_to_chat(body: dict) -> tuple[dict, list[str]]:
    """A `/v1/messages` body → (an OpenAI chat-completions body, warnings to log)."""
    if body.get("max_tokens") is None:
        raise _bad("max_tokens", "field required")
    chat, warnings = _to_chat(body)
    chat["max_tokens"] = body["max_tokens"]
    return chat, warnings


def count_tokens_request(body: dict) -> tuple[dict, list[str]]:
    """A `/v1/messages/count_tokens` body → (the chat body whose prompt to count, warnings)."""
    return _to_chat(body)


def count_tokens_response(num_tokens: int) -> dict:
    return {"input_tokens": num_tokens}


def _thinking(thinking, warnings: list[str]) -> dict:
    """`thinking` as chat template variables: {"type": "disabled"} → `enable_thinking` false
    (Qwen3's templates read it: no thinking block); "enabled" / "adaptive" leave the template's
    default (its thinking, if it has any); the budget and `display` are not applied (warned)."""
    if thinking is None:
        return {}
    kinds = ("enabled", "disabled", "adaptive")
    if not isinstance(thinking, dict) or thinking.get("type") not in kinds:
        raise _bad("thinking", "must be an object with type 'enabled', 'disabled' or 'adaptive'")
    if thinking.get("type") == "disabled":
        return {"enable_thinking": False}
    if set(thinking) - {"type"}:
        warnings.append("'thinking': " + ", ".join(sorted(set(thinking) - {"type"}))
                        + " not applied (the model thinks as its chat template directs)")
    return {}


def _to_chat(body: dict) -> tuple[dict, list[str]]:
    warnings: list[str] = []
    _warn_unknown(body, "", _TRANSLATED | _NO_EFFECT | set(_WARNED) | set(_REFUSED) | {"thinking"},
                  warnings)
    warnings += [msg for k, msg in _WARNED.items() if body.get(k) is not None]
    kwargs = _thinking(body.get("thinking"), warnings)
    for k in _REFUSED:
        if body.get(k) is not None:
            raise _bad(k, "is not supported by this server")
    chat = {k: body[k] for k in ("model", "temperature", "top_p", "top_k", "stream")
            if body.get(k) is not None}
    system = [] if body.get("system") is None else \
        [{"role": "system", "content": _joined(body["system"], "system")}]
    chat["messages"] = system + _messages(body.get("messages"), warnings)
    if body.get("stop_sequences") is not None:
        stop = _need(body, "stop_sequences", list, "")
        if not all(isinstance(s, str) for s in stop):
            raise _bad("stop_sequences", "must be a list of strings")
        chat["stop"] = stop
    if body.get("tools") is not None:
        chat["tools"] = [_tool(t, f"tools.{i}", warnings)
                         for i, t in enumerate(_need(body, "tools", list, ""))]
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(_need(body, "tool_choice", dict, ""), warnings))
    if body.get("output_config") is not None:
        chat.update(_output_config(_need(body, "output_config", dict, ""), warnings))
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    return chat, warnings


def _joined(content, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of text blocks")
    for k, b in enumerate(content):
        if not (isinstance(b, dict) and b.get("type") == "text"):
            raise _bad(f"{where}.{k}", "only text blocks are supported here")
    return "\n".join(_need(b, "text", str, f"{where}.{k}") for k, b in enumerate(content))


def _messages(msgs, warnings: list[str]) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of {role, content} objects")
    out: list[dict] = []
    for i, m in enumerate(msgs):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise _bad(where, "must be an object with 'role' and 'content'")
        _warn_unknown(m, f"{where}.", {"role", "content"}, warnings)
        if m.get("role") == "system":
            out.append({"role": "system", "content": _joined(m.get("content"), f"{where}.content")})
        elif m.get("role") == "user":
            out += _user(_blocks(m.get("content"), where, warnings))
        elif m.get("role") == "assistant":
            out.append(_assistant(_blocks(m.get("content"), where, warnings)))
        else:
            raise _bad(f"{where}.role", "must be 'user', 'assistant' or 'system'")
    if msgs[-1]["role"] == "assistant":
        raise _bad(f"messages.{len(msgs) - 1}", "a final assistant message (prefill) is unsupported")
    return out


def _blocks(content, where: str, warnings: list[str]) -> list[tuple[str, dict]]:
    """The content as (path, block) pairs, each block of a type this server reads."""
    if isinstance(content, str):
        return [(f"{where}.content", {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise _bad(f"{where}.content", "must be a string or a list of content blocks")
    out = []
    for j, b in enumerate(content):
        w = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else type(b).__name__
        if not isinstance(kind, str) or kind not in _BLOCK_KEYS:
            raise _bad(f"{w}.type", f"content blocks of type {kind!r} are not supported here")
        _warn_unknown(b, f"{w}.", _BLOCK_KEYS[b["type"]] | {"type", "cache_control"}, warnings)
        out.append((w, b))
    return out


def _user(blocks: list[tuple[str, dict]]) -> list[dict]:
    tool_msgs, texts = [], []
    for w, b in blocks:
        if b["type"] == "text":
            texts.append(_need(b, "text", str, w))
        elif b["type"] == "tool_result":
            content = "" if b.get("content") is None else _joined(b["content"], f"{w}.content")
            tool_msgs.append({"role": "tool", "tool_call_id": _need(b, "tool_use_id", str, w),
                              "content": ("Error: " if b.get("is_error") else "") + content})
        else:
            raise _bad(f"{w}.type", f"a user message cannot hold a {b['type']!r} block")
    user = [{"role": "user", "content": "\n".join(texts)}] if texts or not tool_msgs else []
    return tool_msgs + user


def _assistant(blocks: list[tuple[str, dict]]) -> dict:
    texts, thinking, calls = [], [], []
    for w, b in blocks:
        if b["type"] == "text":
            texts.append(_need(b, "text", str, w))
        elif b["type"] == "thinking":
            thinking.append(_need(b, "thinking", str, w))
        elif b["type"] == "tool_use":
            calls.append({"id": _need(b, "id", str, w), "type": "function", "function": {
                "name": _need(b, "name", str, w),
                "arguments": json.dumps(_need(b, "input", dict, w), ensure_ascii=False)}})
        elif b["type"] != "redacted_thinking":
            raise _bad(f"{w}.type", f"an assistant message cannot hold a {b['type']!r} block")
    msg = {"role": "assistant", "content": "\n".join(texts)}
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tool(t, where: str, warnings: list[str]) -> dict:
    if not isinstance(t, dict):
        raise _bad(where, "must be a tool object")
    if t.get("type", "custom") not in ("custom", None):
        raise _bad(f"{where}.type", f"server tools ({t['type']!r}) are not supported by this "
                   "server; only custom tools with an input_schema")
    _warn_unknown(t, f"{where}.", _TOOL_KEYS, warnings)
    fn = {"name": _need(t, "name", str, where),
          "parameters": _need(t, "input_schema", dict, where)}
    for key, kind in (("description", str), ("strict", bool)):
        if t.get(key) is not None:
            fn[key] = _need(t, key, kind, where)
    return {"type": "function", "function": fn}


def _tool_choice(tc: dict, warnings: list[str]) -> dict:
    _warn_unknown(tc, "tool_choice.", {"type", "name", "disable_parallel_tool_use"}, warnings)
    kind = tc.get("type")
    if kind == "tool":
        choice = {"type": "function", "function": {"name": _need(tc, "name", str, "tool_choice")}}
    elif isinstance(kind, str) and kind in _TOOL_CHOICES:
        choice = _TOOL_CHOICES[kind]
    else:
        raise _bad("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
    out = {"tool_choice": choice}
    if tc.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _output_config(oc: dict, warnings: list[str]) -> dict:
    _warn_unknown(oc, "output_config.", {"format", "effort"}, warnings)
    if oc.get("effort") is not None:
        warnings.append("'output_config.effort' is not applied")
    fmt = oc.get("format")
    if fmt is None:
        return {}
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"):
        raise _bad("output_config.format", "must be {\"type\": \"json_schema\", \"schema\": ...}")
    schema = {"name": "output", "schema": _need(fmt, "schema", dict, "output_config.format"),
              "strict": True}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}
