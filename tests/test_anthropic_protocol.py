"""Anthropic Messages translation (`luceio/server/anthropic.py`) checked against the official
`anthropic` SDK: requests the SDK sends translate to the expected OpenAI chat bodies; responses,
stream events and errors validate as the SDK's own models with no unknown fields; and the SDK's
stream accumulator, reading our SSE through a mock transport, rebuilds the non-streaming message."""
from __future__ import annotations

import json
import random

import anthropic
import httpx2  # the HTTP client the SDKs are built on
import pydantic
import pytest
from anthropic.types import ErrorResponse, Message, MessageTokensCount, RawMessageStreamEvent

from luceio.server.anthropic import (AnthropicError, count_tokens_request, count_tokens_response,
                                     messages_to_chat, to_anthropic)
from luceio.server.anthropic_stream import MessageStream, message_response
from luceio.server.deltas import ReasoningDelta, TextDelta, ToolCall, ToolCallArgs, ToolCallStart
from luceio.server.protocol import APIError
from sdk_oracle import fragmented, sse, strict

EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
BASH = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
READ = {"type": "object", "properties": {"path": {"type": "string"}}}


# a Claude Code turn: system blocks with cache_control, two tools, a call round trip -------------
CLAUDE_CODE = {
    "model": "qwen", "max_tokens": 32000, "stream": True, "temperature": 1,
    "metadata": {"user_id": "user_1"},
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "Be brief."}],
    "tools": [{"name": "Bash", "description": "Run a command", "input_schema": BASH},
              {"name": "Read", "description": "Read a file", "input_schema": READ,
               "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                     {"type": "text", "text": "list files"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should run ls.", "signature": ""},
            {"type": "text", "text": "Running ls."},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"path": "a.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py\nb.py"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no such file"}]},
            {"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral"}}]},
    ],
}

CLAUDE_CODE_CHAT = {
    "model": "qwen", "max_tokens": 32000, "stream": True, "temperature": 1,
    "messages": [
        {"role": "system", "content": "You are Claude Code.\nBe brief."},
        {"role": "user", "content": "<system-reminder>ctx</system-reminder>\nlist files"},
        {"role": "assistant", "content": "Running ls.", "reasoning_content": "I should run ls.",
         "tool_calls": [
             {"id": "toolu_1", "type": "function",
              "function": {"name": "Bash", "arguments": '{"command": "ls"}'}},
             {"id": "toolu_2", "type": "function",
              "function": {"name": "Read", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py\nb.py"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such file"},
        {"role": "user", "content": "thanks"},
    ],
    "tools": [{"type": "function", "function": {"name": "Bash", "parameters": BASH,
                                                "description": "Run a command"}},
              {"type": "function", "function": {"name": "Read", "parameters": READ,
                                                "description": "Read a file"}}],
}


def test_claude_code_turn_translates():
    assert messages_to_chat(CLAUDE_CODE) == (CLAUDE_CODE_CHAT, [])


def test_sdk_request_translates_without_warnings():
    """What the SDK itself sends (its serialisation of typed params) is read with no warning."""
    seen = {}

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen["chat"] = messages_to_chat(json.loads(request.content))
        return httpx2.Response(200, json=message_response(
            model="qwen", text="hi", tool_calls=[], finish_reason="stop", input_tokens=3,
            output_tokens=1))

    client = _client(handler)
    msg = client.messages.create(model="qwen", max_tokens=50, system="sys",
                                 stop_sequences=["END"], extra_body={"top_k": 5, "top_p": 0.9},
                                 messages=[{"role": "user", "content": "hello"}],
                                 tools=[{"name": "Bash", "input_schema": BASH}],
                                 tool_choice={"type": "tool", "name": "Bash"})
    assert msg.content[0].text == "hi"
    chat, warnings = seen["chat"]
    assert warnings == []
    assert chat == {"model": "qwen", "max_tokens": 50, "top_k": 5, "top_p": 0.9, "stop": ["END"],
                    "messages": [{"role": "system", "content": "sys"},
                                 {"role": "user", "content": "hello"}],
                    "tools": [{"type": "function",
                               "function": {"name": "Bash", "parameters": BASH}}],
                    "tool_choice": {"type": "function", "function": {"name": "Bash"}}}


@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "Bash"},
     {"tool_choice": {"type": "function", "function": {"name": "Bash"}}}),
    ({"type": "auto", "disable_parallel_tool_use": True},
     {"tool_choice": "auto", "parallel_tool_calls": False}),
])
def test_tool_choice(choice, expected):
    chat, _ = messages_to_chat({**_hello(), "tools": CLAUDE_CODE["tools"], "tool_choice": choice})
    assert {k: chat[k] for k in expected} == expected
    assert "parallel_tool_calls" in chat or "parallel_tool_calls" not in expected


def test_output_config_format_is_a_json_schema_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat, warnings = messages_to_chat({**_hello(), "output_config": {
        "format": {"type": "json_schema", "schema": schema}, "effort": "low"}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "output", "schema": schema, "strict": True}}
    assert warnings == ["'output_config.effort' is not applied"]


def test_no_effect_fields_are_silent_and_the_rest_warned():
    quiet = {"metadata": {"user_id": "u"}, "service_tier": "auto",
             "cache_control": {"type": "ephemeral"}, "inference_geo": "us", "speed": "fast",
             "user_profile_id": "p", "workspace_id": "w", "diagnostics": {}}
    assert messages_to_chat({**_hello(), **quiet})[1] == []
    body = {**_hello(), "thinking": {"type": "enabled", "budget_tokens": 2048},
            "context_management": {"edits": []}, "frobnicate": 1,
            "tools": [{"name": "T", "input_schema": READ, "defer_loading": True}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "zz": 1}]}]}
    warnings = messages_to_chat(body)[1]
    for needle in ("'thinking'", "'context_management'", "'frobnicate'", "'tools.0.defer_loading'",
                   "'messages.0.content.0.zz'"):
        assert sum(needle in w for w in warnings) == 1, (needle, warnings)
    assert len(warnings) == 5


@pytest.mark.parametrize("thinking, kwargs, warned", [
    ({"type": "disabled"}, {"enable_thinking": False}, False),
    ({"type": "enabled", "budget_tokens": 1024}, None, True),
    ({"type": "adaptive"}, None, False)])
def test_thinking_reaches_the_chat_template(thinking, kwargs, warned):
    """`thinking` sets the template's `enable_thinking` (Qwen3: disabled writes no thinking
    block); the budget is warned about, not applied."""
    chat, warnings = messages_to_chat(_hello(thinking=thinking))
    assert chat.get("chat_template_kwargs") == kwargs
    assert bool(warnings) == warned
    with pytest.raises(AnthropicError):
        messages_to_chat(_hello(thinking={"type": "sometimes"}))


def _hello(**extra) -> dict:
    return {"model": "qwen", "max_tokens": 16,
            "messages": [{"role": "user", "content": "hello"}], **extra}


# refusals ----------------------------------------------------------------------------------------
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
DOC = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}


def _user(*blocks) -> dict:
    return {"model": "qwen", "max_tokens": 16, "messages": [{"role": "user", "content": list(blocks)}]}


@pytest.mark.parametrize("body, param", [
    ({"model": "qwen", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    (_user(IMAGE), "messages.0.content.0.type"),
    (_user(DOC), "messages.0.content.0.type"),
    (_user({"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}),
     "messages.0.content.0.content.0"),
    (_user({"type": "tool_use", "id": "t", "name": "Bash", "input": {}}),
     "messages.0.content.0.type"),
    (_hello(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools.0.type"),
    (_hello(tools=[{"name": "Bash"}]), "tools.0.input_schema"),
    (_hello(container="c_1"), "container"),
    (_hello(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]), "mcp_servers"),
    ({**_hello(), "messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "The answer is ("}]}, "messages.1"),
    ({**_hello(), "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]},
        {"role": "user", "content": "x"}]}, "messages.0.content.0.type"),
    ({**_hello(), "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "Bash", "input": "ls"}]},
        {"role": "user", "content": "x"}]}, "messages.0.content.0.input"),
    ({**_hello(), "messages": [{"role": "developer", "content": "x"}]}, "messages.0.role"),
    ({**_hello(), "messages": []}, "messages"),
    (_hello(system=7), "system"),
    (_hello(system=[{"type": "image"}]), "system.0"),
    (_hello(stop_sequences=["a", 1]), "stop_sequences"),
    (_hello(tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (_hello(output_config={"format": {"type": "regex", "pattern": "a+"}}), "output_config.format"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(AnthropicError) as e:
        messages_to_chat(body)
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.message.startswith(param + ":")
    err = strict(ErrorResponse.model_validate, e.value.body())
    assert err.error.type == "invalid_request_error"


@pytest.mark.parametrize("status, kind, sdk_error", [
    (400, "invalid_request_error", anthropic.BadRequestError),
    (401, "authentication_error", anthropic.AuthenticationError),
    (403, "permission_error", anthropic.PermissionDeniedError),
    (404, "not_found_error", anthropic.NotFoundError),
    (415, "invalid_request_error", anthropic.APIStatusError),
    (429, "rate_limit_error", anthropic.RateLimitError),
    (500, "api_error", anthropic.InternalServerError),
    (503, "overloaded_error", anthropic.InternalServerError),
])
def test_api_errors_map_by_status(status, kind, sdk_error):
    body = to_anthropic(APIError(status, "nope", param="model")).body()
    assert strict(ErrorResponse.model_validate, body).error.type == kind
    client = _client(lambda request: httpx2.Response(status, json=body))
    with pytest.raises(sdk_error) as e:
        client.messages.create(**_hello())
    assert e.value.body == body


def test_request_too_large_uses_the_documented_type():
    # the SDK's error union lacks it; Anthropic's error docs list 413 as request_too_large
    assert to_anthropic(APIError(413, "big")).body() == {
        "type": "error", "error": {"type": "request_too_large", "message": "big"}}


# count_tokens ------------------------------------------------------------------------------------
def test_count_tokens_translates_like_messages_without_max_tokens():
    body = {k: v for k, v in CLAUDE_CODE.items() if k not in ("max_tokens", "stream", "temperature")}
    chat, warnings = count_tokens_request(body)
    assert warnings == []
    assert chat["messages"] == CLAUDE_CODE_CHAT["messages"]
    assert chat["tools"] == CLAUDE_CODE_CHAT["tools"]
    assert strict(MessageTokensCount.model_validate, count_tokens_response(123)).input_tokens == 123


# responses ---------------------------------------------------------------------------------------
CALLS = [ToolCall("toolu_a", "Bash", '{"command": "ls -la"}'),
         ToolCall("toolu_b", "Read", '{"path": "caf\\u00e9/\u00fc.py"}')]


@pytest.mark.parametrize("finish, stop, reason", [
    ("stop", None, "end_turn"), ("stop", "\n\nHuman:", "stop_sequence"),
    ("length", None, "max_tokens"), ("tool_calls", None, "tool_use")])
def test_message_response_validates(finish, stop, reason):
    calls = CALLS if finish == "tool_calls" else []
    body = message_response(model="qwen", reasoning="think", text="Hello", tool_calls=calls,
                            finish_reason=finish, stop_sequence=stop, input_tokens=40,
                            cached_tokens=32, output_tokens=9)
    msg = strict(Message.model_validate, body)
    assert msg.id.startswith("msg_") and (msg.stop_reason, msg.stop_sequence) == (reason, stop)
    assert [b.type for b in msg.content] == ["thinking", "text"] + ["tool_use"] * len(calls)
    assert msg.content[0].thinking == "think" and msg.content[0].signature == ""
    assert [b.input for b in msg.content[2:]] == [json.loads(c.arguments) for c in calls]
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens,
            msg.usage.output_tokens) == (8, 32, 9)


def test_message_response_omits_empty_pieces():
    body = message_response(model="qwen", text="", tool_calls=CALLS[:1], finish_reason="tool_calls",
                            input_tokens=1, output_tokens=1)
    assert [b["type"] for b in body["content"]] == ["tool_use"]


def test_unknown_finish_reason_is_an_error():
    with pytest.raises(ValueError, match="abort"):
        MessageStream("qwen", 1).finish("abort", 0)


# streaming ---------------------------------------------------------------------------------------
DELTA_FOR = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}


def check_order(events: list[tuple[str, dict]]) -> None:
    """Anthropic's documented order: message_start; per block start, deltas of its kind, stop,
    indices counting from 0; message_delta; message_stop. Every event validates in the SDK."""
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    index, open_kind = -1, None
    for name, data in events:
        assert data["type"] == name
        strict(EVENT.validate_python, data)
        if name == "content_block_start":
            assert open_kind is None and data["index"] == index + 1
            index, open_kind = index + 1, data["content_block"]["type"]
        elif name == "content_block_delta":
            assert data["index"] == index and data["delta"]["type"] == DELTA_FOR[open_kind]
        elif name == "content_block_stop":
            assert data["index"] == index and open_kind is not None
            open_kind = None
        else:
            assert name in ("message_start", "message_delta", "message_stop")
    assert open_kind is None


def stream_events(deltas, finish="tool_calls", stop=None, id="msg_1") -> list[tuple[str, dict]]:
    s = MessageStream("qwen", 40, cached_tokens=32, id=id)
    events = s.start()
    for i, d in enumerate(deltas):
        events += s.feed(d)
        if i == 1:
            events.append(s.ping())
    return events + s.finish(finish, 9, stop)


def _client(handler) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="k", base_url="http://luceio.test", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def _stream_through_sdk(events) -> Message:
    client = _client(lambda request: httpx2.Response(
        200, headers={"content-type": "text/event-stream"}, content=sse(events)))
    with client.messages.stream(**_hello()) as stream:
        return stream.get_final_message()


@pytest.mark.parametrize("seed", range(5))
def test_stream_adds_up_to_the_non_streaming_message(seed):
    rng = random.Random(seed)
    reasoning, text = "Let me look at the files first.", "I'll list them:\n"
    events = stream_events(fragmented(reasoning, text, CALLS, rng))
    check_order([e for e in events if e[0] != "ping"])
    assert ("ping", {"type": "ping"}) in events
    whole = message_response(model="qwen", reasoning=reasoning, text=text, tool_calls=CALLS,
                             finish_reason="tool_calls", input_tokens=40, cached_tokens=32,
                             output_tokens=9, id="msg_1")
    assert _stream_through_sdk(events).model_dump(mode="json") == \
        strict(Message.model_validate, whole).model_dump(mode="json")


def test_new_block_when_the_kind_changes():
    deltas = [TextDelta("a"), ReasoningDelta("r"), TextDelta("b"), TextDelta("c"),
              ToolCallStart(0, "t0", "Bash"), ToolCallArgs(0, "{}"),
              ToolCallStart(1, "t1", "Read"), TextDelta("done")]
    events = stream_events(deltas)
    check_order([e for e in events if e[0] != "ping"])
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["text", "thinking", "text", "tool_use", "tool_use", "text"]
    final = _stream_through_sdk(events)
    assert [b.type for b in final.content] == starts
    assert final.content[2].text == "bc" and final.content[4].input == {}


def test_stop_sequence_in_message_delta():
    events = stream_events([TextDelta("x")], finish="stop", stop="END")
    delta = dict(events)["message_delta"]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert delta["usage"] == {"output_tokens": 9}
    start = dict(events)["message_start"]["message"]
    assert start["stop_reason"] is None and start["usage"]["input_tokens"] == 8
    assert _stream_through_sdk(events).stop_sequence == "END"


def test_arguments_for_a_call_that_is_not_open_are_refused():
    s = MessageStream("qwen", 1)
    s.start()
    s.feed(ToolCallStart(0, "t0", "Bash"))
    s.feed(ToolCallStart(1, "t1", "Read"))
    with pytest.raises(ValueError, match="tool call 0"):
        s.feed(ToolCallArgs(0, "{}"))


def test_failure_event_reaches_the_sdk_as_an_error():
    s = MessageStream("qwen", 1)
    [(name, body)] = s.fail("engine died")
    assert name == "error"
    assert strict(ErrorResponse.model_validate, body).error.type == "api_error"
    with pytest.raises(anthropic.APIStatusError, match="engine died"):
        _stream_through_sdk(s.start() + s.feed(TextDelta("x")) + s.fail("engine died"))
