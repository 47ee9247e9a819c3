"""Small OpenAPI 3.0 schema builders for `openapi.py`: nullable scalars with bounds (3.0 has no
null type, so "or null" is `nullable`), and the content blocks the Anthropic and Responses
request schemas share."""
from __future__ import annotations


def nullable(schema: dict) -> dict:
    return dict(schema, nullable=True)


def any_null(*branches: dict, **kw) -> dict:
    """anyOf the branches or null (3.0 has no null type: the first branch is made nullable)."""
    return {"anyOf": [dict(branches[0], nullable=True), *branches[1:]], **kw}


def integer(lo: int | None = None, hi: int | None = None, **kw) -> dict:
    s = {"type": "integer", **kw}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return nullable(s)


def number(lo: float | None = None, hi: float | None = None, exclusive_lo: bool = False,
           **kw) -> dict:
    s = {"type": "number", **kw}
    if lo is not None:
        s["minimum"] = lo
        if exclusive_lo:
            s["exclusiveMinimum"] = True
    if hi is not None:
        s["maximum"] = hi
    return nullable(s)


BOOL = nullable({"type": "boolean"})
STRING = {"type": "string"}


def content_block(kind: str, optional: tuple[str, ...] = (), **fields: dict) -> dict:
    """An Anthropic content block / Responses item of type `kind`; `fields` are required but
    for the `optional` ones."""
    required = ["type"] + [k for k in fields if k not in optional]
    return {"type": "object", "required": required,
            "properties": {"type": {"type": "string", "enum": [kind]}, **fields}}


def text_or(*parts: str, nullable: bool = False) -> dict:
    """A string, or a list of text parts of the given types."""
    part = {"anyOf": [content_block(p, text=STRING) for p in parts]}
    return {"anyOf": [dict(STRING, nullable=nullable), {"type": "array", "items": part}]}
