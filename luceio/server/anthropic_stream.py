"""Anthropic Messages output: a finished output as one message (`message_response`), or its
deltas (`deltas.py`) as SSE events (`MessageStream`); the request side and the format's notes
are `anthropic.py`'s. Plain Python."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from .anthropic import AnthropicError
from .deltas import Delta, ReasoningDelta, TextDelta, ToolCall, ToolCallArgs, ToolCallStart

Event = tuple[str, dict]  # (SSE event name, its data)
_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
           "tool_use": ("input_json_delta", "partial_json")}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "context": "model_context_window_exceeded"}  # a max_tokens lowered to fit ran out


@dataclass
class _Block:
    kind: str  # "thinking" | "text" | "tool_use"
    text: str = ""  # the thinking, the text, or the tool input as JSON text
    id: str = ""  # tool_use only
    name: str = ""
    call: int = -1  # the call's index in deltas.py

    def wire(self, final: bool) -> dict:
        """The block at content_block_start (empty) or in the finished message."""
        text = self.text if final else ""
        if self.kind == "tool_use":
            return {"type": "tool_use", "id": self.id, "name": self.name,
                    "input": json.loads(text or "{}")}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": text, "signature": ""}
        return {"type": "text", "text": text}

    def delta(self, s: str) -> dict:
        kind, key = _DELTAS[self.kind]
        return {"type": kind, key: s}


class MessageStream:
    """Deltas → Anthropic SSE events, in the documented order: `start()` (message_start); `feed`
    each delta (content_block_start / _delta / _stop, indices from 0); `finish` (the last
    content_block_stop, message_delta, message_stop). `message()` is the whole message the events
    add up to, so a non-streaming response is this stream with its events dropped.

    A call's arguments must come while its block is open (the parsers stream calls one after
    another); arguments for any other call are a ValueError."""

    def __init__(self, model: str, input_tokens: int, cached_tokens: int = 0,
                 id: str | None = None):
        self.id = id or f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.usage = {"input_tokens": input_tokens - cached_tokens, "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}
        self.blocks: list[_Block] = []
        self.open = False  # whether the last block still takes deltas
        self.stop_reason = self.stop_sequence = None  # set by finish(): str | None

    def start(self) -> list[Event]:
        return [("message_start", {"type": "message_start", "message": self._message([])})]

    def feed(self, d: Delta) -> list[Event]:
        if isinstance(d, ToolCallStart):
            return self._open(_Block("tool_use", id=d.id, name=d.name, call=d.index))
        if isinstance(d, ToolCallArgs):
            if not (self.open and self.blocks[-1].call == d.index):
                raise ValueError(f"arguments for tool call {d.index} while it is not open")
            return self._append(d.fragment)
        kind = "text" if isinstance(d, TextDelta) else "thinking"
        if not d.text:
            return []
        opened = [] if self.open and self.blocks[-1].kind == kind else self._open(_Block(kind))
        return opened + self._append(d.text)

    def finish(self, reason: str, output_tokens: int,
               stop_sequence: str | None = None) -> list[Event]:
        """`reason`: "stop" (with the stop string that matched, if one did), "length",
        "tool_calls" or "context" (the context window ended the output)."""
        if reason not in _STOP_REASONS:
            raise ValueError(f"no Anthropic stop_reason for finish reason {reason!r}")
        self.stop_reason = _STOP_REASONS[reason] if stop_sequence is None else "stop_sequence"
        self.stop_sequence = stop_sequence
        self.usage["output_tokens"] = output_tokens
        delta = {"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                    "stop_sequence": self.stop_sequence},
                 "usage": {"output_tokens": output_tokens}}
        return self._close() + [("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def message(self) -> dict:
        return self._message([b.wire(final=True) for b in self.blocks])

    @staticmethod
    def ping() -> Event:
        return ("ping", {"type": "ping"})

    @staticmethod
    def fail(message: str) -> list[Event]:
        """The event that ends a stream whose generation failed."""
        return [("error", AnthropicError(500, message).body())]

    def _message(self, content: list[dict]) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence, "usage": dict(self.usage)}

    def _open(self, block: _Block) -> list[Event]:
        events = self._close()
        self.blocks.append(block)
        self.open = True
        return events + [("content_block_start", {"type": "content_block_start",
                                                  "index": len(self.blocks) - 1,
                                                  "content_block": block.wire(final=False)})]

    def _append(self, s: str) -> list[Event]:
        if not s:
            return []
        block = self.blocks[-1]
        block.text += s
        return [("content_block_delta", {"type": "content_block_delta",
                                         "index": len(self.blocks) - 1, "delta": block.delta(s)})]

    def _close(self) -> list[Event]:
        if not self.open:
            return []
        self.open = False
        return [("content_block_stop", {"type": "content_block_stop",
                                        "index": len(self.blocks) - 1})]


def message_response(*, model: str, text: str, tool_calls: list[ToolCall], finish_reason: str,
                     input_tokens: int, output_tokens: int, reasoning: str | None = None,
                     stop_sequence: str | None = None, cached_tokens: int = 0,
                     id: str | None = None) -> dict:
    """The non-streaming `/v1/messages` response: thinking, text, then one tool_use per call."""
    stream = MessageStream(model, input_tokens, cached_tokens, id)
    for d in [ReasoningDelta(reasoning or ""), TextDelta(text)]:
        stream.feed(d)
    for i, c in enumerate(tool_calls):
        stream.feed(ToolCallStart(i, c.id, c.name))
        stream.feed(ToolCallArgs(i, c.arguments))
    stream.finish(finish_reason, output_tokens, stop_sequence)
    return stream.message()
