"""Helpers shared by the Anthropic Messages and OpenAI Responses protocol tests: strict validation
against the official SDKs' models, deltas cut at random places, and SSE for a mock transport."""
from __future__ import annotations

import json
import random

import pydantic

from luceio.server.deltas import ReasoningDelta, TextDelta, ToolCall, ToolCallArgs, ToolCallStart


def strict(validate, data: dict):
    """The SDK's model of `data`; fails on a field the SDK does not know (a typo, a wrong shape)
    and on any value the SDK had to coerce."""
    obj = validate(data)

    def walk(o):
        if isinstance(o, pydantic.BaseModel):
            assert not o.model_extra, f"{type(o).__name__} has unknown fields {o.model_extra}"
            for v in o.__dict__.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
    walk(obj)
    assert obj.to_dict(mode="json", exclude_unset=True) == data
    return obj


def split(text: str, rng: random.Random) -> list[str]:
    """`text` cut at up to 6 random places."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def fragmented(reasoning: str, text: str, calls: list[ToolCall], rng: random.Random) -> list:
    """The deltas a streaming parser could emit for this output (an empty text delta included)."""
    deltas = [ReasoningDelta(s) for s in split(reasoning, rng)]
    deltas += [TextDelta(s) for s in split(text, rng)] + [TextDelta("")]
    for i, c in enumerate(calls):
        deltas.append(ToolCallStart(i, c.id, c.name))
        deltas += [ToolCallArgs(i, s) for s in split(c.arguments, rng)]
    return deltas


def sse(events: list[tuple[str, dict]]) -> bytes:
    return "".join(f"event: {n}\ndata: {json.dumps(d)}\n\n" for n, d in events).encode()
