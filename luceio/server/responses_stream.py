"""OpenAI Responses output (`POST /v1/responses`; the request side is `responses_api.py`): the
output's deltas (`deltas.py`) become a response object or its SSE events.

Output: items in the order the deltas come, a new one when the kind changes (a reasoning item
with reasoning_text content, a message with one output_text part, one function_call per call).
Thinking streams as `response.reasoning_text.*` (Codex shows it with `show_raw_agent_reasoning`).
Finish "stop"/"tool_calls" → completed; "length" → incomplete, `incomplete_details.reason`
"max_output_tokens", the open item incomplete too. `reasoning_tokens` is 0: not counted apart."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from .deltas import Delta, ReasoningDelta, TextDelta, ToolCall, ToolCallArgs, ToolCallStart

Event = tuple[str, dict]  # (SSE event name, its data)
_ID_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


# responses ---------------------------------------------------------------------------------------
@dataclass
class _Item:
    kind: str  # "reasoning" | "message" | "function_call"
    text: str = ""  # the reasoning, the message text, or the call's arguments
    call_id: str = ""  # function_call only
    name: str = ""
    call: int = -1  # the call's index in deltas.py
    status: str = "in_progress"
    id: str = ""  # set when the item opens

    def wire(self) -> dict:
        if self.kind == "function_call":
            return {"type": "function_call", "id": self.id, "call_id": self.call_id,
                    "name": self.name, "arguments": self.text, "status": self.status}
        done = self.status != "in_progress"
        if self.kind == "reasoning":
            return {"type": "reasoning", "id": self.id, "summary": [], "status": self.status,
                    "content": [self.part()] if done else []}
        return {"type": "message", "id": self.id, "role": "assistant", "status": self.status,
                "content": [self.part()] if done else []}

    def part(self) -> dict:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}


class ResponseStream:
    """Deltas → Responses SSE events, each with its `sequence_number`: `start()`
    (response.created, response.in_progress); `feed` each delta (output_item.added, the content
    part or argument events, output_item.done); `finish` (response.completed or
    response.incomplete). `response()` is the object the events add up to, so a non-streaming
    response is this stream with its events dropped.

    `request` is the validated request body (its settings are echoed in the response). A call's
    arguments must come while its item is open (the parsers stream calls one after another);
    arguments for any other call are a ValueError."""

    def __init__(self, request: dict, model: str, id: str | None = None):
        self.request, self.model = request, model
        self.id = id or f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.items: list[_Item] = []
        self.open = False  # whether the last item still takes deltas
        self.status = "in_progress"
        self.usage: dict | None = None
        self.error: dict | None = None
        self.seq = 0  # the next event's sequence_number

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, d: Delta) -> list[Event]:
        if isinstance(d, ToolCallStart):
            return self._open(_Item("function_call", call_id=d.id, name=d.name, call=d.index))
        if isinstance(d, ToolCallArgs):
            if not (self.open and self.items[-1].call == d.index):
                raise ValueError(f"arguments for tool call {d.index} while it is not open")
            return self._append(d.fragment)
        kind = "message" if isinstance(d, TextDelta) else "reasoning"
        if not d.text:
            return []
        opened = [] if self.open and self.items[-1].kind == kind else self._open(_Item(kind))
        return opened + self._append(d.text)

    def finish(self, reason: str, input_tokens: int, output_tokens: int,
               cached_tokens: int = 0) -> list[Event]:
        """`reason`: "stop", "tool_calls" or "length"."""
        if reason not in ("stop", "tool_calls", "length"):
            raise ValueError(f"no Responses status for finish reason {reason!r}")
        self.status = "incomplete" if reason == "length" else "completed"
        self.usage = {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "total_tokens": input_tokens + output_tokens,
                      "input_tokens_details": {"cached_tokens": cached_tokens,
                                               "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}
        events = self._close(self.status)
        return events + [self._event(f"response.{self.status}", response=self.response())]

    def fail(self, message: str) -> list[Event]:
        """The event that ends a stream whose generation failed."""
        self.status = "failed"
        self.error = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=self.response())]

    def response(self) -> dict:
        r = self.request
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": self.status, "model": self.model, "error": self.error,
                "incomplete_details": {"reason": "max_output_tokens"}
                if self.status == "incomplete" else None,
                "output": [it.wire() for it in self.items if it.status != "in_progress"],
                "usage": self.usage, "instructions": r.get("instructions"),
                "max_output_tokens": r.get("max_output_tokens"),
                "metadata": r.get("metadata") or {},
                "parallel_tool_calls": r.get("parallel_tool_calls", True) is not False,
                "temperature": r.get("temperature"), "top_p": r.get("top_p"),
                "tool_choice": r.get("tool_choice") or "auto",
                "tools": [t for t in r.get("tools") or [] if t.get("type") == "function"],
                "text": r.get("text") or {"format": {"type": "text"}}}

    def _event(self, name: str, /, **data) -> Event:
        self.seq += 1
        return (name, {"type": name, "sequence_number": self.seq - 1, **data})

    def _where(self) -> dict:
        return {"item_id": self.items[-1].id, "output_index": len(self.items) - 1}

    def _open(self, item: _Item) -> list[Event]:
        events = self._close("completed")
        item.id = f"{_ID_PREFIX[item.kind]}_{uuid.uuid4().hex}"
        self.items.append(item)
        self.open = True
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=item.wire()))
        if item.kind != "function_call":
            events.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part={**item.part(), "text": ""}))
        return events

    def _append(self, s: str) -> list[Event]:
        if not s:
            return []
        item = self.items[-1]
        item.text += s
        if item.kind == "function_call":
            return [self._event("response.function_call_arguments.delta", **self._where(),
                                delta=s)]
        extra = {"logprobs": []} if item.kind == "message" else {}
        name = "output_text" if item.kind == "message" else "reasoning_text"
        return [self._event(f"response.{name}.delta", **self._where(), content_index=0,
                            delta=s, **extra)]

    def _close(self, status: str) -> list[Event]:
        if not self.open:
            return []
        self.open = False
        item = self.items[-1]
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", **self._where(),
                                  arguments=item.text)]
        else:
            extra = {"logprobs": []} if item.kind == "message" else {}
            name = "output_text" if item.kind == "message" else "reasoning_text"
            events = [self._event(f"response.{name}.done", **self._where(), content_index=0,
                                  text=item.text, **extra),
                      self._event("response.content_part.done", **self._where(),
                                  content_index=0, part=item.part())]
        item.status = status
        return events + [self._event("response.output_item.done",
                                     output_index=len(self.items) - 1, item=item.wire())]


def response_object(request: dict, *, model: str, text: str, tool_calls: list[ToolCall],
                    finish_reason: str, input_tokens: int, output_tokens: int,
                    reasoning: str | None = None, cached_tokens: int = 0,
                    id: str | None = None) -> dict:
    """The non-streaming `/v1/responses` response: reasoning, message, then the calls."""
    stream = ResponseStream(request, model, id)
    for d in [ReasoningDelta(reasoning or ""), TextDelta(text)]:
        stream.feed(d)
    for i, c in enumerate(tool_calls):
        stream.feed(ToolCallStart(i, c.id, c.name))
        stream.feed(ToolCallArgs(i, c.arguments))
    stream.finish(finish_reason, input_tokens, output_tokens, cached_tokens)
    return stream.response()
