"""Reasoning text (Qwen3 / DeepSeek-R1 `<think>...</think>`) apart from the answer, and the
combinator that runs it before the tool-call parser.

A parser reads one message: `feed(text)` returns the deltas already certain, `finish()` flushes
the rest, `parse(text)` does both; whole parsing runs the same machine as streaming, so any cut
of the text gives the same result.

Rules:
- Reasoning opens with `<think>` at the very start of the generation (whitespace before it is
  dropped) and ends at the first `</think>`; everything after is answer text, where tags are not
  looked for again. Text that does not start with `<think>` is all answer.
- When the chat template already put `<think>` into the prompt (DeepSeek-R1's template, Qwen3's
  forced thinking), generation starts inside the reasoning: construct with `in_reasoning=True`,
  which `opens_reasoning(prompt)` tells from the prompt's end.
- Newlines right after `<think>`, right before `</think>` and right after `</think>` are neither
  reasoning nor answer (Qwen3's template strips the same when it renders history).
- Streaming holds back only a partial tag and newlines that may still be such.
- A generation that stops inside the reasoning leaves it all reasoning.
"""
from __future__ import annotations

from collections.abc import Callable

from .deltas import Delta, ReasoningDelta, TextDelta, ToolCall
from .tool_parsers import StreamParser, ToolParser, collect_deltas, partial_marker_len

_START, _REASONING, _ANSWER = "start", "reasoning", "answer"


class ThinkParser(StreamParser):
    """Splits `<think>...</think>` from the answer; Qwen3 and DeepSeek-R1 share the tags."""
    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, in_reasoning: bool = False) -> None:
        super().__init__()
        self._state = _REASONING if in_reasoning else _START
        self._strip_newlines = in_reasoning  # at the start of reasoning or of the answer

    @classmethod
    def opens_reasoning(cls, prompt: str) -> bool:
        """Whether the generation prompt opens a reasoning block: `prompt` ends with the start tag
        (DeepSeek-R1 style templates). Only its end counts: a `<think>` in a message (a file a
        tool read, a user's question) opens nothing."""
        return prompt.rstrip().endswith(cls.start_tag)

    def parse(self, text: str) -> tuple[str | None, str]:
        reasoning, content, _ = collect_deltas(self.feed(text) + self.finish())
        return reasoning, content

    def _step(self, final: bool) -> bool:
        if self._strip_newlines:
            self._buf = self._buf.lstrip("\n")
            if not self._buf:
                return False
            self._strip_newlines = False
        if self._state == _START:
            head = self._buf.lstrip()
            if head.startswith(self.start_tag):
                self._enter(_REASONING, len(self._buf) - len(head) + len(self.start_tag))
            elif not final and self.start_tag.startswith(head):
                return False
            else:
                self._state = _ANSWER
            return True
        if self._state == _ANSWER:
            self._send(TextDelta, len(self._buf))
            return False
        at = self._buf.find(self.end_tag)
        if at >= 0:
            kept = len(self._buf[:at].rstrip("\n"))
            self._send(ReasoningDelta, kept)
            self._enter(_ANSWER, at - kept + len(self.end_tag))
            return True
        end = len(self._buf)
        if not final:
            end = len(self._buf[:end - partial_marker_len(self._buf, [self.end_tag])].rstrip("\n"))
        self._send(ReasoningDelta, end)
        return False

    def _enter(self, state: str, drop: int) -> None:
        self._state, self._strip_newlines = state, True
        self._buf = self._buf[drop:]


ReasoningParserFactory = Callable[..., ThinkParser]  # called with in_reasoning=...
REASONING_PARSERS: dict[str, ReasoningParserFactory] = {"qwen3": ThinkParser,
                                                         "deepseek_r1": ThinkParser}
REASONING_PARSER_CHOICES = ("auto", *REASONING_PARSERS, "none")


def get_reasoning_parser(name: str, chat_template: str | None) -> ReasoningParserFactory | None:
    """The parser factory for `--reasoning-parser NAME`; None means no reasoning split.
    "auto" picks the `<think>` parser when the chat template mentions `<think>`."""
    if name not in REASONING_PARSER_CHOICES:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(REASONING_PARSER_CHOICES)}")
    if name == "auto":
        return ThinkParser if ThinkParser.start_tag in (chat_template or "") else None
    return REASONING_PARSERS.get(name)


class ChatTextParser:
    """A message's text through the reasoning parser first, its answer text through the
    tool-call parser; either may be None (that stage passes text through)."""

    def __init__(self, reasoning: ThinkParser | None, tools: ToolParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    def feed(self, text: str) -> list[Delta]:
        if self.reasoning is not None:
            return self._to_tools(self.reasoning.feed(text))
        return self._to_tools([TextDelta(text)] if text else [])

    def finish(self) -> list[Delta]:
        deltas = self._to_tools(self.reasoning.finish()) if self.reasoning is not None else []
        return deltas + (self.tools.finish() if self.tools is not None else [])

    def parse(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        """(reasoning or None, answer text, calls) of a whole message."""
        return collect_deltas(self.feed(text) + self.finish())

    def _to_tools(self, deltas: list[Delta]) -> list[Delta]:
        if self.tools is None:
            return deltas
        out = []
        for delta in deltas:
            out.extend(self.tools.feed(delta.text) if isinstance(delta, TextDelta) else [delta])
        return out


__all__ = ["ThinkParser", "ReasoningParserFactory", "REASONING_PARSERS",
           "REASONING_PARSER_CHOICES", "get_reasoning_parser", "ChatTextParser"]
