"""The error every request parser raises, and readers for one JSON field each.

Rules: a reader takes the body and the field's name and returns the field's value or, when the
field is absent or null, the default; a value of the wrong type is an `APIError` 400 whose
`param` names the field. Plain Python: no web framework here."""
from __future__ import annotations

import math
from typing import Any

_INT64 = 2 ** 63 - 1
MAX_N = 128
# the engine's seeds: sample i of a request draws from seed + i, kept below 2**63
_SEED_RANGE = 2 ** 63 - MAX_N


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


def show(v: Any) -> str:
    """A short repr of a client's value for an error message."""
    try:
        s = repr(v)
    except RecursionError:  # a deeply nested JSON value
        return f"a deeply nested {type(v).__name__}"
    return s if len(s) <= 60 else s[:57] + "..."


def number(body: dict, name: str, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"'{name}' must be a number, got {show(v)}")
    return float(v)


def integer(body: dict, name: str, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"'{name}' must be an integer, got {show(v)}")
    if not -_INT64 - 1 <= v <= _INT64:
        raise bad(name, f"'{name}' is out of range, got {show(v)}")
    return v


def seed(body: dict) -> int | None:
    """Any int64 (OpenAI's range): negative and very large seeds wrap onto the engine's range, so
    a given seed always draws the same samples; smaller non-negative ones are used as they are."""
    value = integer(body, "seed", None)
    return None if value is None else value % _SEED_RANGE


def boolean(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"'{name}' must be a boolean, got {show(v)}")
    return v


def stop_strings(body: dict) -> list[str]:
    """`stop`: a string or a list of strings."""
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", f"'stop' must be a string or a list of strings, got {show(v)}")
    return v


def int_list(body: dict, name: str) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in v):
        raise bad(name, f"'{name}' must be a list of integers, got {show(v)}")
    return v


def string_list(body: dict, name: str) -> list[str] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(name, f"'{name}' must be a list of strings, got {show(v)}")
    return v


def text(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad(name, f"'{name}' must be a string, got {show(v)}")
    return v
