"""The OpenAI-compatible server end to end: `python -m luceio.serve` as a real uvicorn subprocess on
127.0.0.1 (random free port) serving a tiny random-weight llama; the official `openai` client and
raw httpx against it; every output compared with the in-process `LLM` on the same weights."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import engine_kwargs, make_tiny_model
from luceio import LLM, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT = 2048  # the tiny model's config is patched to this context so long requests exist
MAX_BODY = 64 * 1024


# fixtures ---------------------------------------------------------------------------------------
class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: str):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def log_text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, log: str, *extra: str) -> Server:
    port = _free_port()
    cmd = [sys.executable, "-m", "luceio.serve", "--model", model, "--port", str(port),
           "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "256", "--block-size",
           "16", "--seed", "0", "--no-access-log", *extra]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    server = Server(proc, port, log)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server did not come up:\n{server.log_text()}")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("server") / "llama")
    make_tiny_model(folder, "llama")
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = CONTEXT
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server-log") / "server.log")
    s = start_server(model, log, "--api-key", API_KEY, "--max-request-bytes", str(MAX_BODY),
                     "--served-model-name", "tiny")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model, **engine_kwargs())


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


def _ref(llm: LLM, prompt, params: SamplingParams, chat: bool = False):
    return (llm.chat(prompt, params) if chat else llm.generate(prompt, params))[0].outputs


def _metrics(server: Server) -> dict[str, float]:
    """Samples by name (labels folded in as name{k=v})."""
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                            if s.labels else "")
            out[key] = s.value
    return out


def _wait_for(pred, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello world! Write fibonacci."}]


# the official client ----------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = httpx.get(server.url + "/health")  # no key needed
    assert r.status_code == 200


def test_completion_greedy_logprobs(client, llm):
    ref = _ref(llm, "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=12, logprobs=2))
    r = client.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=12,
                                  temperature=0, logprobs=2)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    (c,) = r.choices
    assert c.text == ref[0].text and c.finish_reason == ref[0].finish_reason
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 12
    want = [d[t].logprob for t, d in zip(ref[0].token_ids, ref[0].logprobs)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)  # a dict: equal texts collapse
    assert lp.text_offset[0] == 0
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_default_max_tokens_and_batch_prompts(client, llm):
    prompts = ["Hello world!", "import torch"]
    refs = [_ref(llm, p, SamplingParams(temperature=0))[0] for p in prompts]  # max_tokens 16
    r = client.completions.create(model="tiny", prompt=prompts, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [x.text for x in refs]
    assert r.usage.completion_tokens == sum(len(x.token_ids) for x in refs) == 32


def test_completion_stream_n2_seed_stop_usage(client, llm):
    base = _ref(llm, "The quick brown", SamplingParams(temperature=0.8, seed=7, max_tokens=24))
    stop = base[0].text[8:11]
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=24, stop=[stop])
    ref = _ref(llm, "The quick brown", params)
    assert ref[0].finish_reason == "stop"
    stream = client.completions.create(model="tiny", prompt="The quick brown", n=2,
                                       temperature=0.8, seed=7, max_tokens=24, stop=[stop],
                                       stream=True, stream_options={"include_usage": True})
    texts, finish, chunks = {0: "", 1: ""}, {}, list(stream)
    for ch in chunks[:-1]:
        assert ch.usage is None and len(ch.choices) == 1
        c = ch.choices[0]
        texts[c.index] += c.text
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert texts == {0: ref[0].text, 1: ref[1].text}
    assert finish == {0: ref[0].finish_reason, 1: ref[1].finish_reason}
    assert last.usage.completion_tokens == sum(len(o.token_ids) for o in ref)
    assert len({ch.id for ch in chunks}) == 1


def test_chat_n2_seed_logprobs(client, llm):
    params = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=16, logprobs=3)
    ref = _ref(llm, MESSAGES, params, chat=True)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, temperature=0.9,
                                       seed=3, max_tokens=16, logprobs=True, top_logprobs=3)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    for c, o in zip(r.choices, ref):
        assert c.message.role == "assistant" and c.message.content == o.text
        assert c.finish_reason == o.finish_reason
        got = [e.logprob for e in c.logprobs.content]
        want = [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)]
        assert got == pytest.approx(want, abs=1e-4)
        assert all(len(e.top_logprobs) == 3 for e in c.logprobs.content)
        assert all(isinstance(e.bytes, list) for e in c.logprobs.content)
    assert r.usage.prompt_tokens == len(llm.chat(MESSAGES, SamplingParams(max_tokens=1))[0]
                                        .prompt_token_ids)


def test_chat_stream_greedy_stop_usage(client, llm):
    base = _ref(llm, MESSAGES, SamplingParams(temperature=0, max_tokens=20), chat=True)[0]
    stop = base.text[5:8]
    ref = _ref(llm, MESSAGES, SamplingParams(temperature=0, max_tokens=20, stop=stop), True)[0]
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                            max_completion_tokens=20, stop=stop, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.text and stop not in text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


async def test_async_client(server, llm):
    ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    ref_chat = _ref(llm, MESSAGES, SamplingParams(temperature=0.7, seed=11, max_tokens=14), True)
    ref_cmpl = _ref(llm, "Numbers: 0 1 2", SamplingParams(temperature=0, max_tokens=10))
    stream = await ac.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.7,
                                              seed=11, max_tokens=14, stream=True)
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream])
    r = await ac.completions.create(model="tiny", prompt="Numbers: 0 1 2", temperature=0,
                                    max_tokens=10)
    assert text == ref_chat[0].text and r.choices[0].text == ref_cmpl[0].text
    await ac.close()


# concurrency ------------------------------------------------------------------------------------
def _parse_sse(raw: str) -> list:
    events = [e for e in raw.replace("\r\n", "\n").split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


async def test_32_concurrent_streams(server, llm):
    prompts = [f"Hello world {i}! def f{i}(x):" for i in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=20) if i % 2 else
              SamplingParams(temperature=1.0, seed=100 + i, max_tokens=20) for i in range(32)]
    refs = [o.outputs[0] for o in llm.generate(prompts, params)]

    async def one(http: httpx.AsyncClient, i: int):
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 20, "stream": True,
                "temperature": params[i].temperature}
        if params[i].seed is not None:
            body["seed"] = params[i].seed
        async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = (await r.aread()).decode()
        data = _parse_sse(raw)
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        text = "".join(c["choices"][0]["text"] for c in chunks)
        return text, chunks[-1]["choices"][0]["finish_reason"]

    async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                 limits=httpx.Limits(max_connections=64)) as http:
        results = await asyncio.gather(*(one(http, i) for i in range(32)))
    for (text, finish), ref in zip(results, refs):
        assert text == ref.text and finish == ref.finish_reason


# bad input ----------------------------------------------------------------------------------------
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [  # (path, body, status, param or None, substring of the message)
    (C, b"{not json", 400, None, "JSON"),
    (C, b"[1, 2]", 400, None, "object"),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    (C, {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    (C, {"prompt": "hi", "n": 0}, 400, "n", "n"),
    (C, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    (C, {"prompt": "hi", "stop": [1, 2]}, 400, "stop", "stop"),
    (C, {"prompt": "hi", "logprobs": 50}, 400, "logprobs", "logprobs"),
    (C, {"prompt": "hi", "seed": "x"}, 400, "seed", "seed"),
    (C, {"prompt": "hi", "stream": "yes"}, 400, "stream", "boolean"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", ""),
    (C, {"max_tokens": 3}, 400, "prompt", "required"),
    (C, {"prompt": [1, 2, 100000]}, 400, "prompt", "token ids"),
    (C, {"prompt": {"a": 1}}, 400, "prompt", "prompt"),
    (C, {"prompt": "", "max_tokens": 3}, 400, "prompt", "empty"),
    (C, {"prompt": [5] * 3000, "max_tokens": 3}, 400, "prompt", "3000"),
    (C, {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens", f"{CONTEXT}"),
    (C, {"prompt": "hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
    (CH, {"messages": "hi"}, 400, "messages", "messages"),
    (CH, {"messages": []}, 400, "messages", "messages"),
    (CH, {"messages": [{"role": 1, "content": "x"}]}, 400, "messages[0].role", "role"),
    (CH, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "content"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]", "text"),
    (CH, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (CH, {"messages": MSG, "temperature": None, "top_k": 1.5}, 400, "top_k", "integer"),
    (CH, {"messages": MSG, "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    (CH, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0]", "function"),
    (CH, {"messages": MSG, "model": 3}, 400, "model", "model"),
    (CH, {"messages": MSG, "model": "nope"}, 404, "model", "nope"),
]


def _assert_error(r: httpx.Response, status: int, param=None, needle: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and needle.lower() in err["message"].lower(), err
    if param is not None:
        assert err["param"] == param, err
    return err


def test_bad_inputs(server, client, llm):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for path, body, status, param, needle in BAD:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=content, headers={"Content-Type": "application/json"})
            _assert_error(r, status, param, needle)
        # the prompt-too-long message carries the numbers
        r = http.post(C, json={"prompt": [5] * 3000, "max_tokens": 3})
        assert str(CONTEXT) in r.json()["error"]["message"]
        # body size: by Content-Length and by the streamed (chunked) body
        big = json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode()
        _assert_error(http.post(C, content=big, headers={"Content-Type": "application/json"}),
                      413)

        def chunks():
            for _ in range(10):
                yield b" " * (MAX_BODY // 4)
            yield b'{"prompt": "hi"}'
        _assert_error(http.post(C, content=chunks(), headers={"Content-Type": "application/json"}),
                      413)
        # routes and methods
        _assert_error(http.get("/v1/nothing"), 404)
        _assert_error(http.get(C), 405)
    # auth: every route but /health
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", C), ("GET", "/metrics")):
            r = httpx.request(method, server.url + path, headers=headers, json={"prompt": "x"})
            _assert_error(r, 401, None, "api key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MSG, temperature=-3)
    # still serving, correctly
    ref = _ref(llm, MSG, SamplingParams(temperature=0, max_tokens=8), chat=True)[0]
    r = client.chat.completions.create(model="tiny", messages=MSG, temperature=0, max_tokens=8)
    assert r.choices[0].message.content == ref.text


# disconnect, metrics -----------------------------------------------------------------------------
def test_client_disconnect_aborts(server):
    before = _metrics(server)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with http.stream("POST", C, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert got[0].startswith("data: ")
            m = _metrics(server)
            assert m["luceio_num_requests_running"] == 1 and m["luceio_kv_blocks_used"] > 0
        # leaving the block closes the connection mid-stream

    def drained():
        m = _metrics(server)
        return m if (m["luceio_num_requests_running"] == 0 and
                     m["luceio_num_requests_waiting"] == 0 and
                     m["luceio_kv_blocks_used"] == 0) else None
    m = _wait_for(drained, 10, "the aborted request's KV blocks to be freed")
    assert m["luceio_kv_blocks_free"] == m["luceio_kv_blocks_total"] == 256
    key = "luceio_requests_total{finish_reason=abort}"
    assert m.get(key, 0) == before.get(key, 0) + 1
    gen = m["luceio_generation_tokens_total"] - before["luceio_generation_tokens_total"]
    assert 0 < gen < 2000  # stopped before its last token (and counted as an abort above)
    assert "aborted" in server.log_text()


def test_metrics(server, client):
    before = _metrics(server)
    client.completions.create(model="tiny", prompt="Hello again", max_tokens=8, temperature=0)
    client.completions.create(model="tiny", prompt="Hello again", max_tokens=8, temperature=0)
    m = _metrics(server)
    for name in ("luceio_num_requests_running", "luceio_num_requests_waiting",
                 "luceio_kv_blocks_used", "luceio_kv_blocks_free", "luceio_prefix_cache_hit_rate",
                 "luceio_spec_decode_acceptance_rate", "luceio_engine_steps_total"):
        assert name in m
    assert m["luceio_requests_total{finish_reason=length}"] == \
        before.get("luceio_requests_total{finish_reason=length}", 0) + 2
    assert m["luceio_generation_tokens_total"] == before["luceio_generation_tokens_total"] + 16
    assert m["luceio_prompt_tokens_total"] > before["luceio_prompt_tokens_total"]
    # a count of observations (one first token per request), whatever the times observed
    assert m["luceio_time_to_first_token_seconds_count"] == \
        before["luceio_time_to_first_token_seconds_count"] + 2
    # one observation per output that brings new tokens after the first: 7 per request when each
    # token comes alone, fewer when a slow event loop gets several in one output
    itl = m["luceio_inter_token_latency_seconds_count"] - \
        before["luceio_inter_token_latency_seconds_count"]
    assert 2 <= itl <= 14
    assert m["luceio_engine_generation_tokens_total"] >= \
        before["luceio_engine_generation_tokens_total"] + 16
    # the second identical prompt is served from the prefix cache... if it spans a full block;
    # lookups move regardless
    assert m["luceio_prefix_cache_queries_total"] >= before["luceio_prefix_cache_queries_total"]
    assert 0 <= m["luceio_prefix_cache_hit_rate"] <= 1
    assert "request cmpl-" in server.log_text() and "tokens/s" in server.log_text()


# queue full, SIGTERM -----------------------------------------------------------------------------
def test_queue_full_then_sigterm(model, tmp_path):
    s = start_server(model, str(tmp_path / "small.log"), "--max-num-seqs", "1",
                     "--max-queued-requests", "1")
    try:
        long = {"prompt": "Hello", "max_tokens": 1800, "ignore_eos": True, "stream": True}
        results: dict[int, list[str]] = {}

        async def stream(i: int):
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
                async with http.stream("POST", C, json=long) as r:
                    assert r.status_code == 200
                    results[i] = _parse_sse((await r.aread()).decode())

        async def scenario():
            a = asyncio.ensure_future(stream(0))
            await asyncio.to_thread(_wait_for, lambda: _metrics(s)["luceio_num_requests_running"]
                                    == 1, 10, "request A running")
            b = asyncio.ensure_future(stream(1))
            await asyncio.to_thread(_wait_for, lambda: _metrics(s)["luceio_num_requests_waiting"]
                                    == 1, 10, "request B waiting")
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as http:
                r = await http.post(C, json={"prompt": "hi", "max_tokens": 2})
            err = _assert_error(r, 503, None, "retry")
            assert err["code"] == "queue_full" and r.headers["retry-after"] == "1"
            assert not a.done() and not b.done()
            s.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(a, b), 20)

        asyncio.run(scenario())
        assert s.proc.wait(30) == 0, s.log_text()
        for i in (0, 1):  # each stream ended properly: an aborted final chunk, then [DONE]
            data = results[i]
            assert data[-1] == "[DONE]"
            assert json.loads(data[-2])["choices"][0]["finish_reason"] == "abort"
        assert len(results[0]) > len(results[1])  # A was generating, B only waited
        assert "Application shutdown complete" in s.log_text()
    finally:
        s.stop()


# options, imports, request parsing (no server) ---------------------------------------------------
def test_cli_options_come_from_the_dataclasses(capsys):
    from luceio.cli import main
    from luceio.server.args import make_parser, parse_args
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--max-request-bytes", "--served-model-name",
                 "--model", "--max-model-len", "--max-num-seqs", "--max-queued-requests",
                 "--kv-cache-memory", "--gpu-memory-utilization", "--draft-model"):
        assert flag in out
    srv, eng = parse_args(make_parser().parse_args(["/m", "--port", "9", "--max-num-seqs", "3"]))
    assert (srv.port, srv.host, eng.model, eng.max_num_seqs) == (9, "127.0.0.1", "/m", 3)


def test_import_luceio_does_not_import_the_server_stack():
    code = ("import sys, luceio; bad = [m for m in ('starlette', 'uvicorn', 'sse_starlette', "
            "'prometheus_client') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_max_tokens_defaults_and_cap():
    from luceio.server.protocol import APIError, ModelContext, parse_chat, parse_completion

    class Tok:
        def encode(self, text, add_special_tokens=True):
            return [1] * len(text)

        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "".join(m["content"] for m in messages)

    def check_fits(n, mt):
        if n + (mt or 0) > 100:
            raise ValueError(f"the prompt is {n} tokens")

    ctx = ModelContext(["m"], Tok(), 50, max_model_len=100, kv_capacity_tokens=64,
                       check_fits=check_fits)
    assert parse_completion({"prompt": "abcd"}, ctx).params[0].max_tokens == 16
    assert parse_completion({"prompt": "abcd", "max_tokens": None}, ctx).params[0].max_tokens == 60
    chat = parse_chat({"messages": [{"role": "user", "content": "abcd"}]}, ctx)
    assert chat.params[0].max_tokens == 60  # no limit: what the KV pool can hold
    ctx.max_tokens_cap = 8
    assert parse_chat({"messages": MSG, "max_tokens": 30}, ctx).params[0].max_tokens == 8
    assert parse_chat({"messages": MSG}, ctx).params[0].max_tokens == 8
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": "x" * 101}, ctx)
    assert e.value.status == 400 and e.value.param == "prompt"
