"""What a generation's text means, as it streams: the pieces every API format is built from.

The tool-call and reasoning parsers (`tool_parsers.py`, `reasoning.py`) turn the model's raw
text into these deltas; the OpenAI chat, Anthropic Messages and OpenAI Responses formatters
turn deltas into their own wire events. Plain data, no web framework: every stage is testable
on its own.

Order rules a parser keeps: a call's `ToolCallStart` comes before its `ToolCallArgs`; the
`ToolCallArgs` fragments of one call, joined, are its complete arguments as a JSON object text;
indices count from 0 in the order calls start; text and reasoning never carry tool-call markup.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextDelta:
    """Visible answer text."""
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Text of the model's thinking (Qwen3 `<think>...</think>`), shown apart from the answer."""
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A function call begins: its index in this message, a call id, the function's name."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    """A fragment of the arguments (JSON text) of call `index`."""
    index: int
    fragment: str


Delta = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgs


@dataclass(frozen=True)
class ToolCall:
    """A whole parsed call (non-streaming responses)."""
    id: str
    name: str
    arguments: str  # a JSON object, as text


__all__ = ["TextDelta", "ReasoningDelta", "ToolCallStart", "ToolCallArgs", "Delta", "ToolCall"]
