"""Tool calls in a model's generated text: parsers per model family, whole and streaming.

A parser reads one message. `feed(text)` takes the next piece of decoded text and returns the
deltas it can already be sure of; `finish()` flushes the rest at the end of the generation;
`parse(text)` is both in one call. Whole parsing runs the same machine, so any cut of the text
into pieces gives the same content and calls.

Rules:
- A call is JSON with a non-empty string `name` and an object `arguments` (`parameters`, as
  Llama 3.1 writes it, is accepted too). One region may hold several, as a list or separated by
  whitespace or `;`: they are parallel calls. Arguments come out as canonical JSON text
  (`json.dumps(..., ensure_ascii=False)`), call ids as `call_<24 hex>`.
- Where calls may stand, per format: `<tool_call>...</tool_call>` anywhere (Hermes: Qwen2.5,
  Qwen3); also ```` ```json ```` fenced blocks anywhere and bare JSON at the start of the message
  (what Qwen2.5-Coder writes); bare JSON at the start, optionally after `<|python_tag|>` (Llama 3.1).
- A region that is not all valid calls comes back verbatim as text, markup included: malformed
  output is shown, never raised. A region left open at the end of the text is judged as if closed.
- Whitespace touching a valid call is dropped, so text never consists of the newlines between calls.
- Streaming holds back only what could still become markup: a partial opening marker, the
  whitespace before it, and an open region until it ends. A call's `ToolCallStart` and its
  arguments (one `ToolCallArgs`) are sent once the region closes, because a region that turns
  out malformed must come back as text, which cannot follow fragments already sent as a call.
- Each parser names the shape a forced call is written in (`call_format`: what the grammar of
  `tool_choice` "required" or a named function makes the model write), one this parser reads.
"""
from __future__ import annotations

import json
import math
import re
import abc
import secrets
from collections.abc import Callable, Iterable

from ..structured import ToolCallFormat
from .deltas import Delta, ReasoningDelta, TextDelta, ToolCall, ToolCallArgs, ToolCallStart

TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
JSON_FENCE = ("```json\n", "```")
PYTHON_TAG = "<|python_tag|>"

_LEADING = re.compile(r'\{\s*"|\[\s*\{')  # how bare JSON calls start: `{"` or `[{`
_MAYBE_LEADING = re.compile(r"[{\[]?\s*")  # ... and what may still become that
_SEPARATORS = re.compile(r"[\s;]*")
_IN_STRING = re.compile(r'["\\]')


def _reject(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: json.dumps would write Infinity
        raise ValueError(f"{text} does not fit a double")
    return value


# NaN and Infinity are not JSON; nor is a number too large for a double once written back
_DECODER = json.JSONDecoder(parse_constant=_reject, parse_float=_finite)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def partial_marker_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def collect_deltas(deltas: Iterable[Delta]) -> tuple[str | None, str, list[ToolCall]]:
    """A delta stream joined back into (reasoning or None when there was none, text, calls)."""
    reasoning, text, starts, args = [], [], {}, {}
    for delta in deltas:
        if isinstance(delta, ReasoningDelta):
            reasoning.append(delta.text)
        elif isinstance(delta, TextDelta):
            text.append(delta.text)
        elif isinstance(delta, ToolCallStart):
            starts[delta.index] = delta
            args[delta.index] = []
        else:
            args[delta.index].append(delta.fragment)
    calls = [ToolCall(s.id, s.name, "".join(args[i])) for i, s in sorted(starts.items())]
    return ("".join(reasoning) if reasoning else None), "".join(text), calls


def _call(item) -> tuple[str, dict] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments = item.get("arguments", item.get("parameters"))
    return (item["name"], arguments) if isinstance(arguments, dict) else None


def _parse_calls(body: str) -> list[tuple[str, dict]] | None:
    """The calls in a region's body, or None unless the body is nothing but calls."""
    calls, pos = [], _SEPARATORS.match(body).end()
    while pos < len(body):
        try:
            value, pos = _DECODER.raw_decode(body, pos)
        except ValueError:
            return None
        for item in value if isinstance(value, list) else [value]:
            call = _call(item)
            if call is None:
                return None
            calls.append(call)
        pos = _SEPARATORS.match(body, pos).end()
    return calls or None


class _Region:
    """A stretch of text that may hold calls: its body runs from `body_start` to the closing
    marker found outside JSON strings (`close`), or, with `close` None, to the end of the last
    of a run of bare JSON values. Scanning resumes where it stopped as the buffer grows."""

    def __init__(self, close: str | None, body_start: int):
        self.close, self.body_start = close, body_start
        self.pos, self.depth, self.in_string = body_start, 0, False
        self.value_end: int | None = None
        self._outside = re.compile(r'["{}\[\]]' + (f"|{re.escape(close)}" if close else ""))

    def scan(self, buf: str) -> int | None:
        """The start of the closing marker, or the end of a JSON value when `close` is None;
        None until the buffer holds it."""
        while True:
            if self.in_string:
                m = _IN_STRING.search(buf, self.pos)
                if m is None:
                    self.pos = len(buf)
                    return None
                if m.group() == "\\":
                    if m.end() == len(buf):  # the escaped character has not come yet
                        self.pos = m.start()
                        return None
                    self.pos = m.end() + 1
                    continue
                self.in_string, self.pos = False, m.end()
                continue
            m = self._outside.search(buf, self.pos)
            if m is None:  # keep a possible partial closing marker for the next scan
                keep = len(self.close) - 1 if self.close else 0
                self.pos = max(self.pos, len(buf) - keep)
                return None
            self.pos, c = m.end(), m.group()
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.close is None and self.depth == 0:
                    return self.pos
            else:
                return m.start()


class StreamParser(abc.ABC):
    """One message's text in, deltas out. `feed` appends to the buffer and lets `_step` decide
    what it can; `finish` lets it decide the rest. Subclasses write only `_step`."""

    def __init__(self) -> None:
        self._buf = ""  # received text not yet sent or dropped
        self._out: list[Delta] = []

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> list[Delta]:
        while self._step(final=True):
            pass
        return self._take()

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    @abc.abstractmethod
    def _step(self, final: bool) -> bool:
        """Sends or drops what it can decide at the front of `_buf`; True to be called again."""

    def _send(self, kind: type[TextDelta] | type[ReasoningDelta], end: int) -> None:
        if end > 0:
            self._out.append(kind(self._buf[:end]))
            self._buf = self._buf[end:]


class ToolParser(StreamParser):
    """Base machine; a format is its tagged regions and whether bare JSON may open the message."""
    tags: tuple[tuple[str, str], ...] = ()
    leading_json = False
    leading_tag = ""  # a marker that may stand before the leading JSON
    call_format: ToolCallFormat  # how a forced call is written

    def __init__(self) -> None:
        super().__init__()
        self._at_start = self.leading_json
        self._region: _Region | None = None
        self._after_call = False
        self._num_calls = 0

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        _, content, calls = collect_deltas(self.feed(text) + self.finish())
        return content, calls

    def _step(self, final: bool) -> bool:
        if self._region is not None:
            return self._region_step(final)
        if self._at_start:
            return self._start_step(final)
        return self._text_step(final)

    def _start_step(self, final: bool) -> bool:
        head = self._buf.lstrip()
        if self.leading_tag and head.startswith(self.leading_tag):
            head = head[len(self.leading_tag):].lstrip()
        elif not final and self.leading_tag.startswith(head):
            return False
        if _LEADING.match(head):
            self._region = _Region(None, len(self._buf) - len(head))
        elif not final and _MAYBE_LEADING.fullmatch(head):
            return False
        self._at_start = False
        return True

    def _text_step(self, final: bool) -> bool:
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_call = False
        found = [(self._buf.find(open_), open_, close) for open_, close in self.tags
                 if open_ in self._buf]
        if not found:
            end = len(self._buf)
            if not final and self.tags:
                end -= partial_marker_len(self._buf, (open_ for open_, _ in self.tags))
                end = len(self._buf[:end].rstrip())
            self._send(TextDelta, end)
            return False
        at, open_, close = min(found)
        text_end = len(self._buf[:at].rstrip())
        self._send(TextDelta, text_end)
        self._region = _Region(close, at - text_end + len(open_))
        return True

    def _region_step(self, final: bool) -> bool:
        region, buf = self._region, self._buf
        if region.close is not None:
            end = region.scan(buf)
            if end is not None:
                self._resolve(buf[region.body_start:end], end + len(region.close))
            elif final:
                self._resolve(buf[region.body_start:], len(buf))
            return end is not None or final
        if region.value_end is None:
            region.value_end = region.scan(buf)
            if region.value_end is None:
                if final:
                    self._resolve(buf[region.body_start:], len(buf))
                return final
        after = _SEPARATORS.match(buf, region.value_end).end()
        if _LEADING.match(buf, after):  # another value follows: a parallel call
            region.pos, region.value_end = after, None
            return True
        if not final and _MAYBE_LEADING.fullmatch(buf, after):
            return False
        self._resolve(buf[region.body_start:region.value_end], region.value_end)
        return True

    def _resolve(self, body: str, raw_end: int) -> None:
        """Ends the region at `raw_end`: its calls, or its raw text (and the whitespace before)."""
        calls = _parse_calls(body)
        if calls is None:
            self._send(TextDelta, raw_end)
        else:
            for name, arguments in calls:
                self._out.append(ToolCallStart(self._num_calls, new_call_id(), name))
                self._out.append(ToolCallArgs(self._num_calls,
                                              json.dumps(arguments, ensure_ascii=False)))
                self._num_calls += 1
            self._buf = self._buf[raw_end:]
            self._after_call = True
        self._region = None


_HERMES_CALL = ToolCallFormat(TOOL_CALL_TAGS[0] + "\n", "\n" + TOOL_CALL_TAGS[1], "\n")


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number in a row."""
    tags = (TOOL_CALL_TAGS,)
    call_format = _HERMES_CALL


class Qwen25CoderToolParser(ToolParser):
    """Hermes tags, plus ```` ```json ```` fenced calls and bare JSON calls opening the message:
    Qwen2.5-Coder is prompted for the tags but often answers in the other two shapes."""
    tags = (TOOL_CALL_TAGS, JSON_FENCE)
    leading_json = True
    call_format = _HERMES_CALL  # the tags its template asks for


class Llama3JsonToolParser(ToolParser):
    """`{"name": ..., "parameters": {...}}` opening the message, optionally after `<|python_tag|>`."""
    leading_json = True
    leading_tag = PYTHON_TAG
    call_format = ToolCallFormat("", "", "; ", arguments_key="parameters")


ToolParserFactory = Callable[[], ToolParser]
TOOL_PARSERS: dict[str, ToolParserFactory] = {
    "hermes": HermesToolParser,
    "qwen25_coder": Qwen25CoderToolParser,
    "llama3_json": Llama3JsonToolParser,
}
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS, "none")
# The default system prompt of the Qwen2.5 templates (Instruct and Coder share one template).
_QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud."


def get_tool_parser(name: str, chat_template: str | None,
                    vocab: set[str] | dict[str, int] | None) -> ToolParserFactory | None:
    """The parser factory for `--tool-parser NAME`; None means no tool-call parsing.

    "auto" reads the chat template, then the vocabulary: `<|python_tag|>` -> llama3_json; a
    template that writes `<tool_call>` -> qwen25_coder for the Qwen2.5 template (a superset of
    hermes, so Qwen2.5-Instruct loses nothing), else hermes; `<tool_call>` as a token -> hermes;
    nothing known -> None."""
    if name not in TOOL_PARSER_CHOICES:
        raise ValueError(f"unknown tool parser {name!r}; choose one of "
                         f"{', '.join(TOOL_PARSER_CHOICES)}")
    if name != "auto":
        return TOOL_PARSERS.get(name)
    template, vocab = chat_template or "", vocab or ()
    if PYTHON_TAG in template or PYTHON_TAG in vocab:
        return Llama3JsonToolParser
    if TOOL_CALL_TAGS[0] in template:
        return Qwen25CoderToolParser if _QWEN25_SYSTEM in template else HermesToolParser
    if TOOL_CALL_TAGS[0] in vocab:
        return HermesToolParser
    return None


__all__ = ["StreamParser", "ToolParser", "HermesToolParser", "Qwen25CoderToolParser", "Llama3JsonToolParser",
           "ToolParserFactory", "TOOL_PARSERS", "TOOL_PARSER_CHOICES", "get_tool_parser",
           "collect_deltas", "partial_marker_len", "new_call_id"]
