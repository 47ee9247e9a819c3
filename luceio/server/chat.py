"""A chat body's prompt: `messages` (tool calls and tool results included), the `tools` that
`tool_choice` offers and the `chat_template_kwargs`, rendered through the model's chat template;
and how the model's reply will be read (reasoning split, tool-call parser).

Rules
- Every message field the template sees is checked here; a bad one is a 400 naming it
  (`messages[i].field`).
- `chat_template_kwargs` (vLLM's and SGLang's name) must be a JSON object; its entries reach the
  template as extra variables (`{"enable_thinking": false}` for Qwen3). Names the renderer sets
  itself (`tokenizer.TEMPLATE_VARIABLES`: messages, tools, add_generation_prompt, the special
  tokens, the template's globals) are refused: each has its own field or is not the client's.
- `reasoning_effort` (OpenAI's field: none, minimal, low, medium, high, xhigh) reaches a template
  that reads a `reasoning_effort` variable (gpt-oss); for one that does not, "none" sets
  `enable_thinking` false where the template reads that (Qwen3: no thinking), and any other
  effort, or "none" where neither is read, is warned about as not applied. Variables set in
  `chat_template_kwargs` win.
Plain Python: no web framework here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import jinja2

from ..tokenizer import TEMPLATE_VARIABLES
from .fields import bad, boolean, show
from .reasoning import ChatTextParser

if TYPE_CHECKING:
    from .protocol import ModelContext

FIELDS = {"messages", "add_generation_prompt", "tools", "tool_choice", "chat_template_kwargs",
          "reasoning_effort"}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass
class ChatPrompt:
    text: str
    ids: list[int]
    text_parser: Callable[[], ChatTextParser] | None  # how to read what the model writes back
    warnings: list[str]
    forced_functions: list[dict] | None = None  # tool_choice required/named: a call to one of these
    constrained_text_parser: Callable[[], ChatTextParser] | None = None  # text_parser, for output
    # that a grammar constrains from its first token (never inside a reasoning block)


def chat_prompt(body: dict, ctx: ModelContext) -> ChatPrompt:
    """A chat body's prompt: `messages` (tool calls and tool results included), the `tools`
    that `tool_choice` offers and the `chat_template_kwargs`, rendered through the model's chat
    template. What /v1/messages/count_tokens counts."""
    messages = _messages(body.get("messages"))
    tools, forced, warnings = _offered_tools(body)
    add_gen = boolean(body, "add_generation_prompt", True)
    template_kwargs = chat_template_kwargs(body)
    tok = ctx.tokenizer
    if tok is None:
        raise bad("messages", "this model has no tokenizer; use /v1/completions with token ids")
    if tools and ctx.tool_parser is None:
        raise bad("tools", "this model's chat template has no tool-call format luceio knows, so "
                  "its calls could not be read; start the server with --tool-parser NAME if the "
                  "model writes one of them")
    template_kwargs = {**_reasoning_effort(body, tok, warnings), **template_kwargs}
    unread = sorted(set(template_kwargs) - tok.chat_template_variables()) \
        if template_kwargs else []
    if unread:
        warnings.append("chat_template_kwargs: the chat template does not read "
                        + ", ".join(map(repr, unread)))
    extra = {"tools": tools} if tools else {}
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_gen, **extra,
                                       **template_kwargs)
    except (ValueError, jinja2.TemplateError) as e:
        raise bad("messages", f"the chat template failed on these messages: {e}") from None
    ids = tok.encode(text, add_special_tokens=False)
    return ChatPrompt(text, ids, _text_parser(ctx, text, bool(tools)), warnings, forced,
                      _text_parser(ctx, text, bool(tools), constrained=True))


def chat_template_kwargs(body: dict) -> dict:
    """The extra template variables of `chat_template_kwargs` (see the module's rules)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "'chat_template_kwargs' must be an object of template "
                  f"variables, got {show(kwargs)}")
    for name in kwargs:
        if name in TEMPLATE_VARIABLES:
            field = f" (send the '{name}' field)" if name in FIELDS else ""
            raise bad("chat_template_kwargs", f"'chat_template_kwargs' cannot set '{name}': the "
                      f"server sets it{field}")
        if not name.isidentifier():
            raise bad("chat_template_kwargs", f"'chat_template_kwargs' names must be template "
                      f"variable names, got {show(name)}")
    return kwargs


def _reasoning_effort(body: dict, tok, warnings: list[str]) -> dict:
    """`reasoning_effort` as template variables (see the module's rules)."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise bad("reasoning_effort", f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, "
                  f"got {show(effort)}")
    reads = tok.chat_template_variables()
    if "reasoning_effort" in reads:
        return {"reasoning_effort": effort}
    if effort == "none" and "enable_thinking" in reads:
        return {"enable_thinking": False}
    warnings.append(f"'reasoning_effort' {effort!r} is not applied: the chat template reads no "
                    "reasoning_effort" + (" or enable_thinking" if effort == "none" else ""))
    return {}


def _text_parser(ctx: ModelContext, prompt: str, tools_offered: bool,
                 constrained: bool = False) -> Callable[[], ChatTextParser] | None:
    """A factory of one message's parser: the reasoning split when the server has one, the
    tool-call parser when tools are offered; None when neither applies. `constrained`: a grammar
    makes the output start at once (a forced tool call, a JSON schema), so it is answer text even
    where the prompt opened a reasoning block."""
    reasoning = ctx.reasoning_parser
    tools = ctx.tool_parser if tools_offered else None
    if reasoning is None and tools is None:
        return None
    thinking = reasoning is not None and not constrained and reasoning.opens_reasoning(prompt)
    return lambda: ChatTextParser(reasoning(in_reasoning=thinking) if reasoning else None,
                                  tools() if tools else None)


def _offered_tools(body: dict) -> tuple[list[dict] | None, list[dict] | None, list[str]]:
    """The function tools the model is offered (None: none, or `tool_choice` "none"), the
    functions `tool_choice` forces a call to (all for "required", one when named; None
    otherwise), and warnings."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", f"'tools' must be a list, got {show(tools)}")
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
                  f"got {show(choice)}")
    named = [f for f in functions if f["name"] == fn["name"]]
    if not named:
        raise bad("tool_choice", f"'tool_choice' names the function {show(fn['name'])}, which "
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
                      f"{kind.__name__}, got {show(fn[key])}")
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
            raise bad(f"{where}.{key}", f"'{where}.{key}' must be a string, got {show(v)}")
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
                  f"parts, got {show(content)}")
    for j, p in enumerate(content):
        if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
            raise bad(f"{where}.content[{j}]", f"'{where}.content[{j}]': only "
                      "{\"type\": \"text\", \"text\": ...} parts are supported")
    return "\n".join(p["text"] for p in content)


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(where, f"'{where}' must be a list, got {show(calls)}")
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


