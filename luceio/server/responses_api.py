"""OpenAI Responses (`POST /v1/responses`) over luceio's chat path: a request becomes an OpenAI
chat-completions body (then parsed by `protocol.parse_chat`), and the output's deltas (`deltas.py`)
become a response object or its SSE events (`responses_stream.py`). Plain Python. Errors are
OpenAI's (`APIError`).

Request fields
- translated: `model`, `input` (below), `instructions` → a leading system message, `tools`
  (function tools), `tool_choice` (auto/none/required or `{"type": "function", "name"}`),
  `parallel_tool_calls`, `max_output_tokens` → `max_tokens`, `temperature`, `top_p`, `stream`,
  `text.format` (json_schema/json_object → `response_format`; text is the default).
- `reasoning.effort` → the chat body's `reasoning_effort` (`chat.py`: a template that reads it
  gets it; else "none" sets `enable_thinking` false, as Anthropic's `thinking: disabled`, and
  other efforts are warned about); another value is a 400. `reasoning.summary` is warned
  about (no summaries are written).
- accepted, no effect on the output: `metadata` (echoed), `user`, `safety_identifier`,
  `prompt_cache_key`, `prompt_cache_retention`, `prompt_cache_options`, `service_tier`,
  `stream_options`, `store: false`, `background: false`, `truncation: "disabled"`,
  `max_tool_calls` (it bounds calls of built-in tools, and none run here).
- accepted with a warning, returned for the server to log: tools of other types (web_search,
  local_shell, custom, ...: Codex sends them; they are not offered to the model), `store: true`
  (nothing is stored, so no later request can refer to this one), `include` (nothing extra is
  returned), `truncation: "auto"` (a prompt that does not fit is refused, not cut),
  `text.verbosity`, `context_management`, and every field or item key not named here.
- refused, 400 naming the field: `previous_response_id` and `conversation` (no stored state: send
  the whole conversation in `input`), `background: true`, `prompt` (stored templates),
  `top_logprobs`, content other than text (images, files), items of other types
  (local_shell_call, custom_tool_call, item_reference, ...).

`input` is a string (one user message) or a list of items: messages (`type` "message" or absent;
roles user/assistant/system/developer, developer → system; content a string or
input_text/output_text parts joined with "\n"); `function_call_output` → a `tool` message; and
assistant-side items (assistant messages, `function_call`s, `reasoning`) of which each run forms
one assistant message with its text, `tool_calls` and `reasoning_content` (a reasoning item's
reasoning_text, else its summary; encrypted content is dropped).

Output: `responses_stream.py`."""
from __future__ import annotations

from .chat import EFFORTS
from .fields import bad

_TRANSLATED = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
               "max_output_tokens", "temperature", "top_p", "stream", "text", "reasoning"}
_NO_EFFECT = {"metadata", "user", "safety_identifier", "prompt_cache_key",
              "prompt_cache_retention", "prompt_cache_options", "service_tier", "stream_options",
              "store", "background", "truncation", "max_tool_calls"}
_WARNED = {"include": "'include' is not applied: nothing extra is returned",
           "context_management": "'context_management' is not applied"}
_REFUSED = {"previous_response_id": "stored responses are not supported (store is not): send "
                                    "the whole conversation in 'input'",
            "conversation": "stored conversations are not supported: send the whole "
                            "conversation in 'input'",
            "prompt": "stored prompt templates are not supported",
            "top_logprobs": "logprobs are not supported on /v1/responses"}
_ITEM_KEYS = {"message": {"role", "content", "id", "status", "phase"},
              "function_call": {"call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"call_id", "output", "id", "status"},
              "reasoning": {"summary", "content", "encrypted_content", "id", "status"}}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _need(obj: dict, key: str, kind: type, where: str):
    v = obj.get(key)
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        name = f"{where}.{key}" if where else key
        raise bad(name, f"'{name}' must be a {kind.__name__}, got {type(v).__name__}")
    return v


def _warn_unknown(obj: dict, where: str, known: set[str], warnings: list[str]) -> None:
    warnings += [f"unknown field '{where}{k}' ignored" for k in obj if k not in known]


# requests ----------------------------------------------------------------------------------------
def responses_to_chat(body: dict) -> tuple[dict, list[str]]:
    """A `/v1/responses` body → (an OpenAI chat-completions body, warnings to log)."""
    warnings: list[str] = []
    _warn_unknown(body, "", _TRANSLATED | _NO_EFFECT | set(_WARNED) | set(_REFUSED), warnings)
    warnings += [msg for k, msg in _WARNED.items() if body.get(k) is not None]
    for k, msg in _REFUSED.items():
        if body.get(k) is not None:
            raise bad(k, f"'{k}': {msg}")
    if body.get("background"):
        raise bad("background", "'background': background responses are not supported")
    if body.get("store"):
        warnings.append("'store' is not applied: responses are not stored")
    if body.get("truncation") == "auto":
        warnings.append("'truncation: auto' is not applied: a prompt that does not fit is "
                        "refused")
    chat = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "parallel_tool_calls")
            if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        n = _need(body, "max_output_tokens", int, "")
        if n < 1:
            raise bad("max_output_tokens", f"'max_output_tokens' must be at least 1, got {n}")
        chat["max_tokens"] = n
    system = [] if body.get("instructions") is None else \
        [{"role": "system", "content": _need(body, "instructions", str, "")}]
    chat["messages"] = system + _input(body.get("input"), warnings)
    if body.get("tools") is not None:
        chat["tools"] = _tools(_need(body, "tools", list, ""), warnings)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if not chat.get("tools"):  # none, or only tools of other types (not offered to the model)
        chat.pop("tools", None)
        if chat.get("tool_choice") in ("auto", "none"):
            del chat["tool_choice"]
        elif "tool_choice" in chat:
            raise bad("tool_choice", "'tool_choice' forces a call, but no function tool is "
                      "offered (only tools of type 'function' reach the model)")
    if body.get("text") is not None:
        chat.update(_text_format(_need(body, "text", dict, ""), warnings))
    if body.get("reasoning") is not None:
        chat.update(_reasoning(_need(body, "reasoning", dict, ""), warnings))
    return chat, warnings


def _reasoning(reasoning: dict, warnings: list[str]) -> dict:
    """`reasoning.effort` as the chat body's `reasoning_effort`; `summary` is warned about."""
    _warn_unknown(reasoning, "reasoning.", {"effort", "summary", "generate_summary"}, warnings)
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad("reasoning.effort", f"'reasoning.effort' must be one of {', '.join(EFFORTS)}, "
                  f"got {effort!r}")
    if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
        warnings.append("'reasoning.summary' is not applied: no summaries are written")
    return {"reasoning_effort": effort} if effort is not None else {}


def _input(items, warnings: list[str]) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input", "'input' must be a string or a non-empty list of items")
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"'{where}' must be an item object")
        kind = item.get("type", "message")
        if not isinstance(kind, str) or kind not in _ITEM_KEYS:
            raise bad(f"{where}.type", f"'{where}.type': items of type {kind!r} are not supported")
        _warn_unknown(item, f"{where}.", _ITEM_KEYS[kind] | {"type"}, warnings)
        if kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _need(item, "call_id", str, where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "message" and item.get("role") != "assistant":
            if not isinstance(item.get("role"), str) or item["role"] not in _ROLES:
                raise bad(f"{where}.role", f"'{where}.role' must be one of {sorted(_ROLES)}")
            out.append({"role": _ROLES[item["role"]],
                        "content": _text(item.get("content"), f"{where}.content")})
        else:
            _add_assistant_item(_assistant_turn(out), kind, item, where)
    return out


def _assistant_turn(out: list[dict]) -> dict:
    """The assistant message the next assistant-side item joins: the last one, or a new one."""
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": ""})
    return out[-1]


def _add_assistant_item(msg: dict, kind: str, item: dict, where: str) -> None:
    def join(key: str, text: str) -> None:
        msg[key] = f"{msg[key]}\n{text}" if msg.get(key) else text

    if kind == "message":
        join("content", _text(item.get("content"), f"{where}.content"))
    elif kind == "function_call":
        msg.setdefault("tool_calls", []).append({
            "id": _need(item, "call_id", str, where), "type": "function",
            "function": {"name": _need(item, "name", str, where),
                         "arguments": _need(item, "arguments", str, where)}})
    else:
        parts = item.get("content") or item.get("summary") or []
        text = _text(parts, f"{where}.content", kinds=("reasoning_text", "summary_text"))
        if text:
            join("reasoning_content", text)


def _text(content, where: str, kinds=("input_text", "output_text")) -> str:
    """A string, or the text of a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"'{where}' must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in kinds):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(f"{where}[{j}]", f"'{where}[{j}]': parts of type {kind!r} are not "
                      f"supported (only {', '.join(kinds)})")
        texts.append(_need(part, "text", str, f"{where}[{j}]"))
    return "\n".join(texts)


def _tools(tools: list, warnings: list[str]) -> list[dict]:
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(where, f"'{where}' must be a tool object")
        if t.get("type") != "function":
            warnings.append(f"{where} of type {t.get('type')!r} ignored: only function tools "
                            "are offered to the model")
            continue
        _warn_unknown(t, f"{where}.", {"type", "name", "description", "parameters", "strict"},
                      warnings)
        fn = {"name": _need(t, "name", str, where)}
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if t.get(key) is not None:
                fn[key] = _need(t, key, kind, where)
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc) -> str | dict:
    if tc in ("auto", "none", "required"):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function":
        return {"type": "function", "function": {"name": _need(tc, "name", str, "tool_choice")}}
    raise bad("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or "
              "{\"type\": \"function\", \"name\": ...}")


def _text_format(text: dict, warnings: list[str]) -> dict:
    _warn_unknown(text, "text.", {"format", "verbosity"}, warnings)
    if text.get("verbosity") is not None:
        warnings.append("'text.verbosity' is not applied")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return {}
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"):
        raise bad("text.format", "'text.format.type' must be 'text', 'json_schema' or "
                  "'json_object'")
    schema = {"name": _need(fmt, "name", str, "text.format"),
              "schema": _need(fmt, "schema", dict, "text.format")}
    schema.update({k: fmt[k] for k in ("strict", "description") if fmt.get(k) is not None})
    return {"response_format": {"type": "json_schema", "json_schema": schema}}
