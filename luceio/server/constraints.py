"""The output grammar a request body asks for: OpenAI's `response_format` (json_object,
json_schema), vLLM's `structured_outputs` object or one of its `guided_*` fields. At most one
may be given; `luceio.structured` compiles it. Plain Python: no web framework here."""
from __future__ import annotations

from ..sampling_params import StructuredOutputsParams
from .fields import bad, show

# vLLM's extra fields that each give one kind of StructuredOutputsParams
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
FIELDS = {"response_format", "structured_outputs", *GUIDED}


def output_constraint(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint and the field that asked for it; (None, None) when there is none."""
    found = []
    if body.get("response_format") is not None:
        found.append(("response_format", _response_format(body["response_format"])))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs",
                      _constraint_params("structured_outputs", body["structured_outputs"])))
    found += [(name, _constraint_params(name, {kind: body[name]}))
              for name, kind in GUIDED.items() if body.get(name) is not None]
    found = [(name, p) for name, p in found if p is not None]
    if len(found) > 1:
        raise bad(found[1][0], f"'{found[1][0]}' cannot be combined with '{found[0][0]}': give "
                  "one output constraint")
    return (found[0][1], found[0][0]) if found else (None, None)


def _response_format(rf) -> StructuredOutputsParams | None:
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    js = rf.get("json_schema") if kind == "json_schema" else None
    if not (isinstance(js, dict) and isinstance(js.get("schema", {}), dict)):
        raise bad("response_format", "'response_format' must be {\"type\": \"text\"}, "
                  "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                  f"{{\"name\": ..., \"schema\": {{...}}}}}}, got {show(rf)}")
    return StructuredOutputsParams(json=js.get("schema", {}))  # always strict


def _constraint_params(name: str, value) -> StructuredOutputsParams:
    fields = set(StructuredOutputsParams.__dataclass_fields__)
    if not isinstance(value, dict) or not set(value) <= fields:
        raise bad(name, f"'{name}' must be an object with one of json, regex, choice, grammar, "
                  f"json_object, structural_tag (and vLLM's options), got {show(value)}")
    try:
        return StructuredOutputsParams(**value)
    except ValueError as e:
        raise bad(name, f"'{name}': {e}") from None
