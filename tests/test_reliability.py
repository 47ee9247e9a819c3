"""Reliability of the real server: `python -m luceio.serve` subprocesses on 127.0.0.1 serving a tiny
random-weight llama, under concurrent streaming load, client disconnects, a KV pool ~10% of the
demand (preemption), aborts while queued / prefilling / decoding, SIGTERM under load, fuzzed JSON
(hypothesis, schemathesis when installed), malformed HTTP, and the security basics. Nothing may be
lost: every stream ends with [DONE], greedy and seeded outputs equal the same request run alone
in-process, no 5xx, every rejection an OpenAI error object, the KV pool and every per-request table
back to empty afterwards.

The harness (server process, load specs and checks, fuzz strategies, raw-HTTP cases) is
bench/soak.py; `python bench/soak.py` is the long version. Bounded here for CI (2 cores)."""
from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import subprocess
import sys

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import VOCAB, make_tiny_model
from luceio import LLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
import soak  # noqa: E402

API_KEY = "sk-reliability"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
AUTH_JSON = {**AUTH, "Content-Type": "application/json"}  # for raw bodies (content=)
NAME = "tiny"
MAX_BODY = 256 * 1024
CAP = 64  # --max-tokens-cap of the main server
SMALL_POOL = 20  # KV blocks of the preemption server (16 tokens each)
LEAK_WARMUP, LEAK_ROUNDS = 8, 12  # rounds of 64 requests before / while memory must stay flat
LEAK_HEAP_KIB = 2048  # malloc KiB in use 8 rounds may add (~4 KiB a request)
LEAK_BLOCKS = 16000  # Python blocks 8 rounds may add (~31 a request)
C, CH = "/v1/completions", "/v1/chat/completions"


# fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return soak.build_tiny_model(str(tmp_path_factory.mktemp("rel") / "llama"))


@pytest.fixture(scope="module")
def refs(model) -> soak.References:
    return soak.References(LLM(model, dtype="float32", device="cpu", seed=0, num_kv_blocks=4096))


def _server(model, tmp_path_factory, name, *extra, api_key=None):
    log = str(tmp_path_factory.mktemp(name) / "server.log")
    s = soak.ServerProc(model, log, *extra, api_key=api_key)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def main_server(model, tmp_path_factory):
    """API key, body cap, max_tokens cap, a served name; a pool far above the load."""
    yield from _server(model, tmp_path_factory, "main", "--served-model-name", NAME,
                       "--max-request-bytes", str(MAX_BODY), "--max-tokens-cap", str(CAP),
                       "--num-kv-blocks", "2048", api_key=API_KEY)


@pytest.fixture(scope="module", params=["recompute", "swap"])
def small_server(model, tmp_path_factory, request):
    """A KV pool of SMALL_POOL blocks: ~10% of the preemption test's demand (each mode)."""
    yield from _server(model, tmp_path_factory, "small", "--num-kv-blocks", str(SMALL_POOL),
                       "--preemption-mode", request.param)


@pytest.fixture(scope="module")
def abort_server(model, tmp_path_factory):
    """9 sequences at most, 9 tokens a step: 8 decoders leave one token a step for a prefill,
    and a 10th request waits."""
    yield from _server(model, tmp_path_factory, "abort", "--max-num-seqs", "9",
                       "--max-num-batched-tokens", "9", "--num-kv-blocks", "2048")


def _load(server, specs, model=None, timeout=120.0):
    return asyncio.run(soak.run_load(server.url, specs, server.headers, model, timeout))


def _assert_round(server, specs, refs, model=None, allow_abort=False) -> dict:
    refs.fill([s for s in specs if not s.disconnects])  # each exact request, alone, in-process
    results = _load(server, specs, model)
    counts, problems = soak.summarize(results, refs, model, allow_abort)
    assert not problems, "\n".join(problems[:20])
    return counts


def _assert_clean(server) -> dict:
    """Idle (pool all free, no request state anywhere), no 500 counted, nothing bad logged."""
    m = server.wait_idle(30)
    assert m["luceio_kv_blocks_free"] == m["luceio_kv_blocks_total"]
    assert m.get("luceio_http_errors_total{status=500}", 0) == 0
    assert not server.log_problems(), "\n".join(server.log_problems()[:20])
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    return m


def _assert_fresh_exact(server, refs, model=None, seed=99) -> None:
    specs = soak.make_specs(random.Random(seed), 2, start=10 ** 8, exact_only=True)
    counts = _assert_round(server, specs, refs, model)
    assert counts.get("checked_exact") == 2


def _abort_count(m: dict) -> float:
    return m.get("luceio_requests_total{finish_reason=abort}", 0)


# 1. load ----------------------------------------------------------------------------------------
def test_load_64_streams_exact_and_back_to_baseline(main_server, refs):
    """64 concurrent clients (mixed prompt lengths, n, stop strings, seeds, greedy/sampled,
    chat/completions, a few non-streaming): every stream [DONE]-terminated and well formed, one
    id per request and none shared, greedy/seeded text and usage equal to a lone in-process run.
    After each round the pool and all request tables are empty.

    Then no leak. RSS is no measure of one: it keeps high-water marks, steps up by 4-60 MiB at
    rounds that differ from run to run (rounds 9, 18, 21 and 29 locally, after flat stretches) and
    a leak first fills the holes freed memory left. The server's own counts of memory in use fall
    back when memory is freed (/metrics: Python's allocated blocks; glibc malloc's bytes in use,
    where mallinfo2 exists), so from one idle moment to the next they are flat (a 30-round run
    here: +0.3 MiB of heap and +-0.3% blocks over rounds 10-29). After LEAK_WARMUP rounds (caches
    bounded by the pool fill up), the mean of the last 4 of LEAK_ROUNDS idle readings may exceed
    the mean of the first 4 (8 rounds, ~512 requests, earlier) by less than LEAK_HEAP_KIB and
    LEAK_BLOCKS. Tried: a server that kept 4 KiB per request failed it (heap +3.0 MiB), one that
    kept a list of 12 one-key dicts per request too (+16.6 K blocks).
    """
    s = main_server
    exact = 0
    for k in range(2):
        counts = _assert_round(s, soak.make_specs(random.Random(10 + k), 64, start=100 * (k + 1)),
                               refs, NAME)
        assert counts["completed"] == counts.get("status_200") == 64
        exact += counts["checked_exact"]
        _assert_clean(s)
    assert exact >= 64  # most of the 128 are greedy or seeded
    heap, blocks, rss = [], [], []
    for k in range(LEAK_WARMUP + LEAK_ROUNDS):
        results = _load(s, soak.make_specs(random.Random(k), 64, start=10 ** 4 * (k + 1)), NAME)
        counts, problems = soak.summarize(results, None, NAME)
        assert not problems, "\n".join(problems[:20])
        m = _assert_clean(s)
        rss.append(s.rss_kib() // 1024)
        if k >= LEAK_WARMUP:
            blocks.append(m["luceio_process_python_allocated_blocks"])
            heap.append(m.get("luceio_process_heap_in_use_bytes", 0) / 1024)
    print(f"idle after each round: RSS {rss} MiB; heap in use {[round(h) for h in heap]} KiB; "
          f"Python blocks {[int(b) for b in blocks]}")
    if platform.libc_ver()[0] == "glibc":
        assert heap[0] > 0  # the metric is there
    growth = sum(heap[-4:]) / 4 - sum(heap[:4]) / 4
    assert growth < LEAK_HEAP_KIB, f"heap in use grew {growth:.0f} KiB over {LEAK_ROUNDS} rounds"
    growth = sum(blocks[-4:]) / 4 - sum(blocks[:4]) / 4
    assert growth < LEAK_BLOCKS, f"Python blocks grew {growth:.0f} over {LEAK_ROUNDS} rounds"


# 2. faults ----------------------------------------------------------------------------------------
def test_half_the_clients_disconnect(main_server, refs):
    """64 clients, about half hang up at random points (some before the response starts): the rest
    are exact, every disconnect aborts its engine request, nothing leaks, a fresh request is right."""
    s = main_server
    m0 = s.metrics()
    specs = soak.make_specs(random.Random(3), 64, start=1000, max_tokens=(8, 40),
                            disconnect_frac=0.5)
    counts = _assert_round(s, specs, refs, NAME)
    assert counts.get("disconnected", 0) >= 20 and counts.get("completed", 0) >= 20, counts
    m1 = _assert_clean(s)
    assert _abort_count(m1) > _abort_count(m0)
    _assert_fresh_exact(s, refs, NAME)


def test_preemption_with_a_pool_a_tenth_of_the_demand(small_server, refs):
    """A pool of SMALL_POOL blocks for ~10x as many blocks of concurrent demand: requests are
    preempted (the counter moves), recomputed or swapped out and back, and still equal their
    lone runs."""
    s = small_server
    rng = random.Random(5)
    specs = soak.make_specs(rng, 32, start=2000, max_tokens=(24, 48), exact_only=True,
                            stream_frac=1.0)
    tok = refs.llm.get_tokenizer()
    for sp in specs:  # a prompt + max_tokens must fit the small pool on its own
        sp.prompt = " ".join(sp.prompt.split()[:12]) or "Hello"
        sp.extra_prompts = [" ".join(x.split()[:12]) or "Hi" for x in sp.extra_prompts]
    demand = sum(sp.n * -(-(len(tok.encode(x)) + 24 * sp.chat + sp.max_tokens) // 16)
                 for sp in specs for x in sp.prompts)
    assert SMALL_POOL <= 0.12 * demand, demand
    print(f"KV demand {demand} blocks, pool {SMALL_POOL}")
    m0 = s.metrics()
    counts = _assert_round(s, specs, refs)
    assert counts["checked_exact"] == 32
    m1 = _assert_clean(s)
    preempted = m1["luceio_num_preemptions_total"] - m0["luceio_num_preemptions_total"]
    print(f"{preempted:.0f} preemptions")
    assert preempted > 0
    _assert_fresh_exact(s, refs)


def test_abort_while_queued_prefilling_and_decoding(abort_server, refs):
    """8 greedy decoders hold 8 of 9 sequence slots and 8 of the 9 tokens a step. A long prompt P
    then prefills one token a step, and Q waits for a slot. Hanging up on Q (queued) and P (mid
    prefill, before any response byte) and on a decoder frees each at once; the rest go on."""
    s = abort_server
    tok = refs.llm.get_tokenizer()
    long_prompt = "Hello world! " * 400
    p_len = len(tok.encode(long_prompt))
    assert 1000 < p_len < 1900

    def spec(i, prompt, max_tokens):
        return soak.Spec(i, chat=False, prompt=prompt, max_tokens=max_tokens, ignore_eos=True)

    async def wait(pred, what, timeout=20.0):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            m = await asyncio.to_thread(s.metrics)
            if pred(m):
                return m
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}: {m}")

    async def scenario():
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=s.url, limits=limits, timeout=60) as http:
            m0 = await asyncio.to_thread(s.metrics)
            decoders = [asyncio.ensure_future(soak.run_request(
                http, spec(i, f"Hello {i}", 2000), timeout=60)) for i in range(8)]
            m = await wait(lambda m: m["luceio_num_requests_running"] == 8 and
                           m["luceio_engine_generation_tokens_total"] >
                           m0["luceio_engine_generation_tokens_total"] + 16, "8 decoders")
            pt0 = m["luceio_engine_prompt_tokens_total"]
            p = asyncio.ensure_future(soak.run_request(http, spec(8, long_prompt, 4)))
            m = await wait(lambda m: m["luceio_num_requests_running"] == 9 and
                           m["luceio_engine_prompt_tokens_total"] > pt0, "P prefilling")
            q = asyncio.ensure_future(soak.run_request(http, spec(9, "Queued", 4)))
            m = await wait(lambda m: m["luceio_num_requests_waiting"] == 1 and
                           m["luceio_server_inflight_requests"] == 10, "Q queued")
            assert m["luceio_engine_prompt_tokens_total"] - pt0 < p_len  # P still prefilling
            aborts = _abort_count(m)

            q.cancel()  # hang up while queued
            m = await wait(lambda m: m["luceio_num_requests_waiting"] == 0 and
                           m["luceio_server_inflight_requests"] == 9, "Q gone")
            assert _abort_count(m) == aborts + 1
            assert m["luceio_num_requests_running"] == 9
            assert m["luceio_engine_prompt_tokens_total"] - pt0 < p_len

            p.cancel()  # hang up while prefilling
            m = await wait(lambda m: m["luceio_num_requests_running"] == 8 and
                           m["luceio_server_inflight_requests"] == 8, "P gone")
            assert _abort_count(m) == aborts + 2
            pt_p = m["luceio_engine_prompt_tokens_total"] - pt0
            assert pt_p < p_len, "P finished its prefill before the abort"

            # a batch's prompts are admitted together: hanging up while two of them wait
            # aborts all three
            batch = spec(10, "Batch a", 1000)
            batch.extra_prompts, batch.stream = ["Batch b", "Batch c"], False
            b = asyncio.ensure_future(soak.run_request(http, batch))
            m = await wait(lambda m: m["luceio_num_requests_running"] == 9 and
                           m["luceio_num_requests_waiting"] == 2, "batch: a runs, b and c wait")
            b.cancel()
            m = await wait(lambda m: m["luceio_server_inflight_requests"] == 8, "batch gone")
            await asyncio.sleep(0.5)
            m = await asyncio.to_thread(s.metrics)
            assert m["luceio_num_requests_running"] == 8 and \
                m["luceio_server_inflight_requests"] == 8, "a prompt of the batch lived on"
            assert _abort_count(m) == aborts + 5

            decoders[0].cancel()  # hang up while decoding
            m = await wait(lambda m: m["luceio_num_requests_running"] == 7, "decoder 0 gone")
            assert _abort_count(m) == aborts + 6
            assert not any(d.done() for d in decoders[1:])
            for d in decoders[1:]:
                d.cancel()
            await asyncio.gather(*decoders, p, q, b, return_exceptions=True)
        m = await asyncio.to_thread(_assert_clean, s)
        assert _abort_count(m) == aborts + 13
        # P's prompt was never finished: nothing more was prefilled for it after its abort
        assert m["luceio_engine_prompt_tokens_total"] - pt0 < p_len

    asyncio.run(scenario())
    _assert_fresh_exact(s, refs)


# 3. fuzzed input ----------------------------------------------------------------------------------
_STRATEGIES: dict = {}


@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck), print_blob=True)
@given(chat=st.booleans(), data=st.data())
def test_fuzzed_json_bodies(main_server, model, chat, data):
    """Hypothesis-built bodies for both generation routes: wrong types, huge/negative numbers,
    NaN/Infinity literals, lone surrogates (escaped and as CESU-8 bytes), invalid UTF-8, empty and
    enormous prompts, deep nesting, unknown fields, bad stop/logit_bias/n/model, truncated and
    non-object bodies; a third fully valid. Never a 5xx; every rejection an OpenAI error object;
    every 200 a well-formed response or a [DONE]-terminated stream."""
    if "raw" not in _STRATEGIES:
        _STRATEGIES["raw"] = soak.fuzz_strategies(NAME, VOCAB, (model, os.path.dirname(model)))[1]
    raw = data.draw(_STRATEGIES["raw"](chat), label="body")
    with httpx.Client(base_url=main_server.url, timeout=120) as http:
        problems = soak.send_fuzz(http, CH if chat else C, raw, AUTH)
    assert not problems, problems


REGRESSIONS = [  # (route, raw body): found answered 500 or let through, now 400
    (C, b'{"prompt": "\\ud800", "max_tokens": 2}'),  # lone surrogate: the tokenizer raised
    (C, '{"prompt": "x\ud800"}'.encode("utf-8", "surrogatepass")),  # the same as CESU-8 bytes
    (CH, b'{"messages": [{"role": "user", "content": "a\\udc00"}]}'),
    (C, b'{"prompt": "hi", "model": "\\ud83d"}'),  # would have failed encoding the 404
    (C, b'{"prompt": "hi", "temperature": ' + b"[" * 900 + b"]" * 900 + b"}"),  # (a guard)
    (C, b'{"prompt": "hi", "logit_bias": ""}'),  # falsy non-objects were accepted
    (C, b'{"prompt": "hi", "tools": 0}'),
    (CH, b'{"messages": [{"role": "user", "content": "hi", "name": 5}]}'),  # name was ignored
]


@pytest.mark.parametrize("path,raw", REGRESSIONS)
def test_rejected_as_400(main_server, path, raw):
    r = httpx.post(main_server.url + path, content=raw, headers=AUTH_JSON, timeout=30)
    assert r.status_code == 400, r.text
    assert soak.check_error_object(r.json()) == []


def test_sse_data_lines_survive_splitlines(main_server):
    """U+2028, U+2029 and U+0085 are line breaks to str.splitlines (and httpx's iter_lines) but
    not to JSON: streamed chunks escape them, so no client cuts a `data:` line in two."""
    prompt = "a\u2028b\u2029c\x85d"
    r = httpx.post(main_server.url + C, headers=AUTH, timeout=30, json={
        "prompt": prompt, "echo": True, "stream": True, "max_tokens": 2})
    data = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["text"] == prompt
    assert not any(c in r.text for c in "\u2028\u2029\x85")


def test_fuzz_left_the_server_clean(main_server, refs):
    _assert_clean(main_server)
    _assert_fresh_exact(main_server, refs, NAME, seed=7)


def test_malformed_http(main_server, refs):
    """Raw socket: garbage request lines, bad/duplicate/huge Content-Length, truncated bodies
    (hung up and held), broken chunked encoding, oversized headers, TLS/HTTP2 prefaces, resets.
    Every answer below 500 and, if a rejection, an OpenAI error object in JSON."""
    n, problems = soak.run_raw_http(main_server.port, b"Authorization: Bearer " +
                                    API_KEY.encode() + b"\r\n")
    assert n >= 30 and not problems, "\n".join(problems)
    # the common answer: a JSON error object, not uvicorn's plain text
    (status, headers, body), = soak.parse_http_responses(
        soak.send_raw(main_server.port, b"GARBAGE\r\n\r\n", "shut"))
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "bad_http_request"
    _assert_clean(main_server)
    _assert_fresh_exact(main_server, refs, NAME, seed=8)


def test_openapi_document(main_server):
    r = httpx.get(main_server.url + "/openapi.json", headers=AUTH, timeout=10)
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) == {"/health", "/v1/models", C, CH, "/metrics", "/openapi.json",
                                 "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"}
    # (/infill is documented only for a model with fill-in-the-middle tokens)
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["prompt"]["anyOf"][2]["items"]["maximum"] == VOCAB - 1
    assert doc["paths"]["/health"]["get"]["security"] == [] and doc["security"]


def test_schemathesis(main_server, tmp_path):
    """Schemathesis against /openapi.json (when installed): no 5xx, statuses, content types and
    bodies as documented, schema-invalid data rejected, auth enforced. (Schema-valid data is not
    required to pass: cross-field rules like prompt + max_tokens <= context are not in the
    schema.)"""
    pytest.importorskip("schemathesis")
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", main_server.url + "/openapi.json",
           "-H", f"Authorization: Bearer {API_KEY}", "--max-examples", "12", "--seed", "1",
           "--exclude-checks", "positive_data_acceptance", "--max-failures", "5",
           "--request-timeout", "60", "--no-color"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, SCHEMATHESIS_HOOKS=""))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "No issues found" in r.stdout, r.stdout[-3000:]
    _assert_clean(main_server)


# 4. security basics -------------------------------------------------------------------------------
def test_security_basics(main_server, tmp_path):
    s = main_server
    # binds 127.0.0.1 by default (no --host was given)
    assert s.listen_addresses() == ["127.0.0.1"]
    # the API key on every route but /health, every method, unknown paths too
    doc = httpx.get(s.url + "/openapi.json", headers=AUTH, timeout=10).json()
    paths = list(doc["paths"]) + ["/", "/v1/nothing", "/docs", "/health/", "//health"]
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
             {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"},
             {"Authorization": "Bearer"}, {"X-API-Key": f"{API_KEY}x"}, {"X-API-Key": ""},
             {"Authorization": API_KEY, "X-API-Key": "wrong"}]
    with httpx.Client(base_url=s.url, timeout=30) as http:
        for path in paths:
            for method in ("GET", "POST", "PUT", "DELETE", "OPTIONS"):
                for headers in wrong:
                    r = http.request(method, path, headers=headers, json={"prompt": "x"})
                    if path == "/health":
                        assert r.status_code in (200, 405), (method, r.status_code)
                        continue
                    assert r.status_code == 401, (path, method, headers, r.status_code)
                    if path.startswith("/v1/messages"):  # Anthropic's error shape there
                        assert r.json()["error"]["type"] == "authentication_error"
                        continue
                    assert soak.check_error_object(r.json()) == []
                    assert r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models", headers=AUTH).status_code == 200
        assert http.get("/v1/models", headers={"X-API-Key": API_KEY}).status_code == 200
        # body cap, by Content-Length and by a chunked body without one
        r = http.post(C, headers=AUTH_JSON, content=json.dumps({"prompt": "x" * MAX_BODY}).encode())
        assert r.status_code == 413 and soak.check_error_object(r.json()) == []
        r = http.post(C, headers=AUTH_JSON, content=iter([b" " * (MAX_BODY // 2)] * 3 + [b"{}"]))
        assert r.status_code == 413 and soak.check_error_object(r.json()) == []
        # max_tokens cap: asking for more (or for no limit) gets CAP tokens
        r = http.post(C, headers=AUTH, json={"prompt": "Hi", "max_tokens": 1500,
                                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == CAP
        r = http.post(CH, headers=AUTH, json={"messages": [{"role": "user", "content": "Hi"}],
                                              "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == CAP
        # no route loads a client-chosen path or model: a valid checkpoint elsewhere on disk, a
        # short name the resolver would download, paths; all 404, nothing loaded
        other = make_tiny_model(str(tmp_path / "other"), "llama", seed=1)
        rss0 = s.rss_kib()
        log0 = len(s.log_text())
        for name in (other, "smollm2-135m", "qwen2.5-coder-0.5b", "/", "../llama", "/etc/passwd",
                     "file:///etc/passwd", "hf://HuggingFaceTB/SmolLM2-135M", other + "/"):
            for path, body in ((C, {"prompt": "hi", "model": name}),
                               (CH, {"messages": [{"role": "user", "content": "hi"}],
                                     "model": name})):
                r = http.post(path, headers=AUTH, json=body)
                assert r.status_code == 404, (name, r.status_code, r.text)
                assert r.json()["error"]["code"] == "model_not_found"
        assert [m["id"] for m in http.get("/v1/models", headers=AUTH).json()["data"]] == [NAME]
        assert s.rss_kib() - rss0 < 16 * 1024  # not even a tiny model was loaded
        assert "load" not in s.log_text()[log0:].lower()
    _assert_clean(s)


# SIGTERM last: it ends the abort server ------------------------------------------------------------
def test_sigterm_during_load(abort_server):
    """24 long requests (9 generating, 15 queued; most streaming), then SIGTERM: every stream
    ends with its final chunk and [DONE], every plain request gets its JSON, all with finish
    "abort"; requests after the signal get 503 or a refused connection; the process exits 0
    without a traceback."""
    s = abort_server
    report = asyncio.run(soak.sigterm_under_load(s, None, 24, random.Random(11), max_tokens=1500))
    assert report["exit_status"] == 0, s.log_text()[-3000:]
    assert not report["problems"], report["problems"]
    assert report["ended_properly"] == 24 and report["streaming"] >= 12
    assert report["finished_abort"] == 24  # all were cut short (1500 tokens at 9 a step)
    assert sum(report["late_requests"].values()) == 4 and "200" not in report["late_requests"]
    assert not s.log_problems(), s.log_problems()
    assert "Application shutdown complete" in s.log_text()
