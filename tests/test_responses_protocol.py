"""OpenAI Responses translation (`luceio/server/responses_api.py`) checked against the official
`openai` SDK: a Codex-like request translates to the expected chat body with warnings for what
is not applied; responses and every stream event validate as the SDK's own models with no unknown
fields; the stream, replayed event by event and read by the SDK's stream state through a mock
transport, adds up to the non-streaming response."""
from __future__ import annotations

import copy
import json
import random

import httpx2  # the HTTP client the SDKs are built on
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.shared import ErrorObject

from luceio.server.deltas import ReasoningDelta, TextDelta, ToolCall, ToolCallArgs, ToolCallStart
from luceio.server.protocol import APIError
from luceio.server.responses_api import responses_to_chat
from luceio.server.responses_stream import ResponseStream, response_object
from sdk_oracle import fragmented, sse, strict

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
SHELL = {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
         "required": ["command"], "additionalProperties": False}
PLAN = {"type": "object", "properties": {"plan": {"type": "string"}}}


# a Codex turn: developer message, reasoning + call + output round trip, non-function tools -------
CODEX = {
    "model": "qwen", "instructions": "You are Codex.", "stream": True, "store": False,
    "parallel_tool_calls": False, "tool_choice": "auto", "prompt_cache_key": "conv-1",
    "reasoning": {"effort": "medium", "summary": "auto"},
    "include": ["reasoning.encrypted_content"],
    "tools": [
        {"type": "function", "name": "shell", "description": "Runs a command", "strict": False,
         "parameters": SHELL},
        {"type": "function", "name": "update_plan", "description": "Plan", "parameters": PLAN},
        {"type": "local_shell"},
        {"type": "web_search"},
        {"type": "custom", "name": "apply_patch", "description": "Patch files",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    ],
    "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions>ro</permissions>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context/>"},
                     {"type": "input_text", "text": "list files"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None,
         "content": [{"type": "reasoning_text", "text": "I should run ls."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
         "arguments": '{"command":["ls"]}'},
        {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "update_plan",
         "arguments": '{"plan":"look"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "ok"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Done."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Two files.", "annotations": []}]},
        {"role": "user", "content": "thanks"},
    ],
}

CODEX_CHAT = {
    "model": "qwen", "stream": True, "parallel_tool_calls": False, "tool_choice": "auto",
    "reasoning_effort": "medium",
    "messages": [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "<permissions>ro</permissions>"},
        {"role": "user", "content": "<environment_context/>\nlist files"},
        {"role": "assistant", "content": "", "reasoning_content": "I should run ls.",
         "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "shell", "arguments": '{"command":["ls"]}'}},
             {"id": "call_2", "type": "function",
              "function": {"name": "update_plan", "arguments": '{"plan":"look"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
        {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
        {"role": "assistant", "content": "Two files.", "reasoning_content": "Done."},
        {"role": "user", "content": "thanks"},
    ],
    "tools": [{"type": "function", "function": {"name": "shell", "description": "Runs a command",
                                                "parameters": SHELL, "strict": False}},
              {"type": "function", "function": {"name": "update_plan", "description": "Plan",
                                                "parameters": PLAN}}],
}


def test_codex_turn_translates():
    chat, warnings = responses_to_chat(CODEX)
    assert chat == CODEX_CHAT
    for needle in ("'reasoning.summary'", "'include'",
                   "tools[2] of type 'local_shell'", "tools[3] of type 'web_search'",
                   "tools[4] of type 'custom'"):
        assert sum(needle in w for w in warnings) == 1, (needle, warnings)
    assert len(warnings) == 5


def test_string_input_and_settings():
    chat, warnings = responses_to_chat({
        "model": "qwen", "input": "hi", "max_output_tokens": 64, "temperature": 0.2,
        "top_p": 0.5, "tool_choice": {"type": "function", "name": "shell"},
        "tools": CODEX["tools"][:1], "metadata": {"k": "v"}, "user": "u",
        "safety_identifier": "s", "service_tier": "auto", "truncation": "disabled",
        "background": False, "stream_options": {"include_obfuscation": False}})
    assert warnings == []
    assert chat == {"model": "qwen", "max_tokens": 64, "temperature": 0.2, "top_p": 0.5,
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": CODEX_CHAT["tools"][:1],
                    "tool_choice": {"type": "function", "function": {"name": "shell"}}}


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "answer", "schema": PLAN, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "answer", "schema": PLAN, "strict": True}}),
])
def test_text_format(fmt, expected):
    chat, warnings = responses_to_chat({"input": "x", "text": {"format": fmt}})
    assert chat.get("response_format") == expected and warnings == []


def test_store_and_unknown_fields_are_warned():
    _, warnings = responses_to_chat({"store": True, "truncation": "auto",
                                     "max_tool_calls": 3, "text": {"verbosity": "low"},
                                     "frobnicate": 1,
                                     "input": [{"role": "user", "content": "x", "zz": 1}]})
    for needle in ("'store'", "'truncation: auto'", "'text.verbosity'",
                   "'frobnicate'", "'input[0].zz'"):
        assert sum(needle in w for w in warnings) == 1, (needle, warnings)
    assert len(warnings) == 5  # max_tool_calls bounds built-in tools: none run, nothing to say


@pytest.mark.parametrize("reasoning, effort, warned", [
    ({"effort": "none"}, "none", []),
    ({"effort": "high"}, "high", []),
    ({"summary": "auto"}, None, ["'reasoning.summary'"]),
    ({"effort": "none", "summary": "concise", "zz": 1}, "none",
     ["'reasoning.summary'", "'reasoning.zz'"]),
    ({}, None, []),
])
def test_reasoning_effort(reasoning, effort, warned):
    """`reasoning.effort` becomes the chat body's `reasoning_effort` (what it does there:
    tests/test_server_template_kwargs.py); summaries are warned about, not applied."""
    chat, warnings = responses_to_chat({"input": "x", "reasoning": reasoning})
    assert chat.get("reasoning_effort") == effort
    assert len(warnings) == len(warned) and all(
        sum(n in w for w in warnings) == 1 for n in warned), warnings


# refusals ----------------------------------------------------------------------------------------
def _items(*items) -> dict:
    return {"model": "qwen", "input": list(items)}


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens"),
    ({"input": "x", "instructions": ["a"]}, "instructions"),
    ({"input": "x", "tools": {"type": "function"}}, "tools"),
    ({"input": "x", "tools": [{"type": "function", "parameters": PLAN}]}, "tools[0].name"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": "x", "reasoning": {"effort": "maximal"}}, "reasoning.effort"),
    ({"input": "x", "reasoning": "high"}, "reasoning"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
     "text.format.schema"),
    ({"input": []}, "input"),
    ({"input": 7}, "input"),
    (_items({"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}),
     "input[0].content[0]"),
    (_items({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}),
     "input[0].content[0]"),
    (_items({"role": "tool", "content": "x"}), "input[0].role"),
    (_items({"type": "local_shell_call", "call_id": "c", "action": {}}), "input[0].type"),
    (_items({"type": "custom_tool_call", "call_id": "c", "name": "n", "input": "x"}),
     "input[0].type"),
    (_items({"type": "item_reference", "id": "msg_1"}), "input[0].type"),
    (_items({"type": "function_call", "name": "shell", "arguments": "{}"}), "input[0].call_id"),
    (_items({"type": "function_call_output", "call_id": "c", "output": 3}), "input[0].output"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        responses_to_chat(body)
    assert (e.value.status, e.value.param) == (400, param)
    assert param in e.value.message
    strict(ErrorObject.model_validate, e.value.body()["error"])


@pytest.mark.parametrize("tools", [[{"type": "web_search"}], []])
@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_no_function_tools_left_is_a_plain_chat(tools, choice):
    """Tools of other types are dropped with a warning; with none left, `tool_choice` auto or
    none (the SDKs' default) is a plain chat request, not a 400 for a choice without tools."""
    body = {"input": "x", "tools": tools, **({"tool_choice": choice} if choice else {})}
    chat, warnings = responses_to_chat(body)
    assert "tools" not in chat and "tool_choice" not in chat
    assert bool(warnings) == bool(tools)


# responses ---------------------------------------------------------------------------------------
CALLS = [ToolCall("call_a", "shell", '{"command": ["ls", "-la"]}'),
         ToolCall("call_b", "update_plan", '{"plan": "caf\u00e9"}')]
REQUEST = {"model": "qwen", "input": "list files", "instructions": "Be brief.",
           "tools": CODEX["tools"], "max_output_tokens": 100, "metadata": {"k": "v"}}


@pytest.mark.parametrize("finish, status", [("stop", "completed"), ("tool_calls", "completed"),
                                            ("length", "incomplete")])
def test_response_object_validates(finish, status):
    body = response_object(REQUEST, model="qwen", reasoning="think", text="Hello",
                           tool_calls=CALLS, finish_reason=finish, input_tokens=40,
                           cached_tokens=32, output_tokens=9)
    r = strict(Response.model_validate, body)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == status
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call", "function_call"]
    assert r.output[0].content[0].text == "think" and r.output_text == "Hello"
    assert [(o.call_id, o.name, o.arguments) for o in r.output[2:]] == \
        [(c.id, c.name, c.arguments) for c in CALLS]
    assert [o.status for o in r.output] == ["completed"] * 3 + [status]
    assert body["incomplete_details"] == (None if status == "completed" else
                                          {"reason": "max_output_tokens"})
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens,
            r.usage.input_tokens_details.cached_tokens) == (40, 9, 49, 32)
    assert [t.name for t in r.tools] == ["shell", "update_plan"]  # only what the model saw
    assert (r.instructions, r.max_output_tokens, r.metadata) == ("Be brief.", 100, {"k": "v"})


def test_unknown_finish_reason_is_an_error():
    with pytest.raises(ValueError, match="abort"):
        ResponseStream(REQUEST, "qwen").finish("abort", 1, 1)


# streaming ---------------------------------------------------------------------------------------
def replay(events: list[tuple[str, dict]]) -> list[dict]:
    """Checks the documented order and rebuilds the output from the deltas alone: sequence
    numbers count from 0; response.created, response.in_progress first; each item added, its
    content part added, its deltas, its .done events agreeing with what the deltas built, the
    item done, before the next item; response.completed/incomplete last, whose output is the
    rebuilt one. Every event validates in the SDK."""
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert [n for n, _ in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1][0] in ("response.completed", "response.incomplete")
    out: list[dict] = []
    open_item = None
    for name, data in events:
        assert data["type"] == name
        strict(EVENT.validate_python, data)
        if name == "response.output_item.added":
            assert open_item is None and data["output_index"] == len(out)
            open_item = copy.deepcopy(data["item"])
            out.append(open_item)
            continue
        if name.startswith("response.") and name.split(".")[1] in ("created", "in_progress",
                                                                   "completed", "incomplete"):
            assert open_item is None
            continue
        assert open_item is not None and data["output_index"] == len(out) - 1
        assert data.get("item_id", open_item["id"]) == open_item["id"]
        if name == "response.content_part.added":
            assert not open_item["content"]
            open_item["content"].append(copy.deepcopy(data["part"]))
        elif name in ("response.output_text.delta", "response.reasoning_text.delta"):
            open_item["content"][data["content_index"]]["text"] += data["delta"]
        elif name == "response.function_call_arguments.delta":
            open_item["arguments"] += data["delta"]
        elif name in ("response.output_text.done", "response.reasoning_text.done"):
            assert open_item["content"][data["content_index"]]["text"] == data["text"]
        elif name == "response.function_call_arguments.done":
            assert open_item["arguments"] == data["arguments"]
        elif name == "response.content_part.done":
            assert open_item["content"][data["content_index"]] == data["part"]
        else:
            assert name == "response.output_item.done"
            assert {**open_item, "status": data["item"]["status"]} == data["item"]
            out[-1] = data["item"]
            open_item = None
    assert events[-1][1]["response"]["output"] == out
    return out


def stream_events(deltas, finish="tool_calls", id="resp_1") -> list[tuple[str, dict]]:
    s = ResponseStream(REQUEST, "qwen", id=id)
    events = s.start()
    for d in deltas:
        events += s.feed(d)
    return events + s.finish(finish, 40, 9, cached_tokens=32)


def _client(handler) -> openai.OpenAI:
    return openai.OpenAI(api_key="k", base_url="http://luceio.test/v1", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def _without_ids(r: dict) -> dict:
    """Item ids are fresh per response, and created_at is the clock's."""
    return {**r, "created_at": 0, "output": [{**o, "id": i} for i, o in enumerate(r["output"])]}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("finish", ["tool_calls", "length"])
def test_stream_adds_up_to_the_non_streaming_response(seed, finish):
    rng = random.Random(seed)
    reasoning, text = "Let me look at the files first.", "I'll list them:\n"
    events = stream_events(fragmented(reasoning, text, CALLS, rng), finish)
    rebuilt = replay(events)
    whole = response_object(REQUEST, model="qwen", reasoning=reasoning, text=text,
                            tool_calls=CALLS, finish_reason=finish, input_tokens=40,
                            cached_tokens=32, output_tokens=9, id="resp_1")
    assert _without_ids({"output": rebuilt})["output"] == _without_ids(whole)["output"]
    client = _client(lambda request: httpx2.Response(
        200, headers={"content-type": "text/event-stream"}, content=sse(events)))
    with client.responses.stream(model="qwen", input="list files") as stream:
        last = list(stream)[-1]  # the SDK's stream state checks each event against the last
    assert last.type == f"response.{whole['status']}"
    # (the SDK adds None-valued `parsed` fields to a completed response's items)
    assert _without_ids(last.response.to_dict(mode="json", exclude_none=True)) == \
        _without_ids(Response.model_validate(whole).to_dict(mode="json", exclude_none=True))


def test_new_item_when_the_kind_changes():
    deltas = [TextDelta("a"), ReasoningDelta("r"), TextDelta("b"), TextDelta("c"),
              ToolCallStart(0, "c0", "shell"), ToolCallArgs(0, "{}"),
              ToolCallStart(1, "c1", "update_plan"), TextDelta("done")]
    out = replay(stream_events(deltas))
    assert [o["type"] for o in out] == ["message", "reasoning", "message", "function_call",
                                        "function_call", "message"]
    assert out[2]["content"][0]["text"] == "bc" and out[4]["arguments"] == ""


def test_sdk_reads_the_non_streaming_response():
    seen = {}

    def handler(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        seen["chat"] = responses_to_chat(body)
        return httpx2.Response(200, json=response_object(
            body, model="qwen", text="Two files.", tool_calls=CALLS[:1],
            finish_reason="tool_calls", input_tokens=5, output_tokens=3))

    r = _client(handler).responses.create(model="qwen", input="list files",
                                          tools=CODEX["tools"][:2], max_output_tokens=50)
    assert r.output_text == "Two files." and r.output[1].call_id == "call_a"
    chat, warnings = seen["chat"]
    assert warnings == [] and chat["max_tokens"] == 50 and chat["tools"] == CODEX_CHAT["tools"]


def test_arguments_for_a_call_that_is_not_open_are_refused():
    s = ResponseStream(REQUEST, "qwen")
    s.start()
    s.feed(ToolCallStart(0, "c0", "shell"))
    s.feed(ToolCallStart(1, "c1", "update_plan"))
    with pytest.raises(ValueError, match="tool call 0"):
        s.feed(ToolCallArgs(0, "{}"))


def test_failure_ends_the_stream_with_response_failed():
    s = ResponseStream(REQUEST, "qwen")
    events = s.start() + s.feed(TextDelta("x")) + s.fail("engine died")
    name, data = events[-1]
    assert name == "response.failed"
    r = strict(EVENT.validate_python, data).response
    assert r.status == "failed" and r.error.message == "engine died" and r.output == []
