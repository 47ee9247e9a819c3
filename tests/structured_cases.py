"""The structured-output test cases shared by tests/test_structured.py and the GPU tests: JSON
schemas the tiny random model can finish, and the validity check (`jsonschema`, independent of
the grammar library)."""
from __future__ import annotations

import json

import jsonschema

from luceio import SamplingParams
from luceio.sampling_params import StructuredOutputsParams

S = StructuredOutputsParams
TIGHT = dict(disable_any_whitespace=True)  # the tiny model would fill any room with blanks


def _obj(props: dict, required: list | None = None, **kw) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required, **kw}


_NAME = {"type": "string", "maxLength": 6}
_SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
SCHEMAS = [  # bounded, so the tiny random model finishes them too
    _obj({"name": _NAME, "age": _SMALL}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"level": {"enum": ["debug", "info", "warning", "error"]}}),
    _obj({"version": {"const": "1.0"}, "n": _SMALL}),
    _obj({"ids": {"type": "array", "items": _SMALL, "minItems": 1, "maxItems": 3}}),
    _obj({"pair": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2,
                   "maxItems": 2}}),
    _obj({"user": _obj({"name": _NAME, "admin": {"type": "boolean"}})}),
    _obj({"a": _obj({"b": _obj({"c": _SMALL})})}),
    _obj({"name": _NAME, "nick": _NAME, "age": _SMALL}, required=["name"]),
    _obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    _obj({"t": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    _obj({"email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}}),
    _obj({"word": {"type": "string", "minLength": 2, "maxLength": 4}}),
    _obj({"v": {"anyOf": [_NAME, _SMALL]}}),
    _obj({"shape": {"oneOf": [_obj({"kind": {"const": "circle"}, "r": _SMALL}),
                              _obj({"kind": {"const": "square"}, "side": _SMALL})]}}),
    _obj({"maybe": {"type": ["string", "null"], "maxLength": 4}}),
    _obj({"points": {"type": "array", "maxItems": 2, "items": _obj({"x": _SMALL, "y": _SMALL})}}),
    _obj({"xy": {"type": "array", "prefixItems": [_SMALL, {"type": "boolean"}], "items": False}}),
    {"$defs": {"pt": _obj({"x": _SMALL})}, **_obj({"p": {"$ref": "#/$defs/pt"},
                                                   "q": {"$ref": "#/$defs/pt"}})},
    _obj({"id": _SMALL, "tag": _NAME}, additionalProperties=False),
    {"type": "array", "items": _NAME, "maxItems": 3},
    {"enum": ["red", "green", "blue"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "boolean"},
    {"type": "null"},
    _obj({"grid": {"type": "array", "maxItems": 2,
                   "items": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": 2}}}),
    _obj({"prio": {"enum": [1, 2, 3]}}),
    _obj({"id": {"type": "string", "format": "uuid"}}),
    _obj({"score": {"const": 42}, "label": {"title": "Label", "description": "shown", **_NAME}}),
    _obj({"cfg": _obj({"on": {"type": "boolean"}, "mode": {"enum": ["fast", "safe"]},
                       "retries": {"type": "integer", "minimum": 0, "maximum": 3}},
                      required=["on"])}),
    _obj({"files": {"type": "array", "minItems": 1, "maxItems": 2, "items": _obj(
        {"path": {"type": "string", "pattern": "^[a-z]{1,4}\\.py$"}, "lines": _SMALL})}}),
    _obj({"temp": {"type": "number", "minimum": -10.5, "maximum": 10.5},
          "unit": {"enum": ["C", "F"]}}),
]
REGEX = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
CHOICES = ["Positive", "Negative", "Neutral \"quoted\"", "naïve"]


def _valid(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _assert_all_valid(outs, schemas) -> None:
    for o, schema in zip(outs, schemas):
        c = o.outputs[0]
        assert c.finish_reason == "stop" and _valid(schema, c.text), (schema, c.text)


def _json_params(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=200, structured_outputs=S(json=schema, **TIGHT), **kw)
