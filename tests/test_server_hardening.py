"""Hardening of the server (issue 12): stalled connections are closed (slowloris headers, half
bodies, idle keep-alive), a connection cap, JSON-only request bodies, CORS only for allowed
origins, any int64 seed, and startup mistakes as one line and exit status 1 (busy port, unknown
model, unwritable cache, empty API key, unused draft model, Ctrl-C while loading).

Servers run in-process on a thread (uvicorn on 127.0.0.1, port 0, a tiny random-weight llama);
the CLI cases run `python -m luceio.serve` subprocesses. Every bound on time is a generous
multiple of a timeout the server itself enforces."""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import make_tiny_model, running, wait_for
from luceio.serve import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 2.0  # --timeout-headers / --timeout-body / --timeout-keep-alive of the `hard` server
SLACK_S = 15.0  # what a loaded CI machine may add before the server acts on a timeout
GOOD_ORIGIN = "http://good.example"
C = "/v1/completions"
JSON = {"Content-Type": "application/json"}


# servers ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("hardening") / "llama"), "llama")


@pytest.fixture(scope="module")
def hard(model):
    with running(model, timeout_headers=TIMEOUT_S, timeout_body=TIMEOUT_S,
                 timeout_keep_alive=TIMEOUT_S, allowed_origins=GOOD_ORIGIN) as port:
        yield port


@pytest.fixture(scope="module")
def capped(model):
    with running(model, limit_concurrency=4, timeout_headers=600) as port:
        yield port


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


# raw sockets --------------------------------------------------------------------------------------
def _connect(port: int, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        s.sendall(data)
    return s


def _read_until_closed(socks: list[socket.socket], limit_s: float,
                       drip: list[socket.socket] = ()) -> dict[socket.socket, bytes]:
    """What each socket received until the server closed it; fails when one is still open after
    `limit_s`. The `drip` sockets send one more header byte every 0.2 s meanwhile (slowloris)."""
    got = {s: b"" for s in socks}
    alive = set(socks)
    deadline = time.monotonic() + limit_s
    next_drip = 0.0
    while alive:
        assert time.monotonic() < deadline, \
            f"{len(alive)} of {len(socks)} stalled connections still open after {limit_s} s"
        if time.monotonic() >= next_drip:
            for s in alive.intersection(drip):
                with contextlib.suppress(OSError):
                    s.send(b"a")
            next_drip = time.monotonic() + 0.2
        for s in select.select(list(alive), [], [], 0.1)[0]:
            try:
                chunk = s.recv(65536)
            except OSError:  # reset: a drip byte met the closed socket
                chunk = b""
            got[s] += chunk
            if not chunk:
                alive.discard(s)
    return got


def _error(raw: bytes, status: int, code: str) -> None:
    """`raw` is one HTTP response: `status` with an OpenAI error object of `code`."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == str(status).encode(), raw[:300]
    assert b"content-type: application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err


def _complete(port: int, **body) -> httpx.Response:
    return httpx.post(_url(port) + C, json={"prompt": "Hello", "max_tokens": 2, **body},
                      timeout=60)


# stalled connections ------------------------------------------------------------------------------
PARTIAL_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applic"
HALF_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 40\r\n\r\n{\"prompt\": \"Hel")


def test_slowloris_headers_are_closed(hard):
    """Sockets that never finish their headers (silent, partial, or a byte every 0.2 s) are
    answered 408 and closed once --timeout-headers has passed since they connected; a normal
    request is served meanwhile."""
    silent = [_connect(hard) for _ in range(10)]
    partial = [_connect(hard, PARTIAL_HEADERS) for _ in range(20)]
    drip = [_connect(hard, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ") for _ in range(10)]
    try:
        assert _complete(hard).status_code == 200
        got = _read_until_closed(silent + partial + drip, TIMEOUT_S + SLACK_S, drip)
        for s in silent + partial:
            _error(got[s], 408, "request_timeout")
    finally:
        for s in silent + partial + drip:
            s.close()
    assert _complete(hard).status_code == 200


def test_stalled_body_gets_408(hard):
    """Headers with a Content-Length, then half the body and silence: 408 and closed."""
    socks = [_connect(hard, HALF_BODY) for _ in range(10)]
    try:
        got = _read_until_closed(socks, TIMEOUT_S + SLACK_S)
        for s in socks:
            _error(got[s], 408, "request_timeout")
    finally:
        for s in socks:
            s.close()
    assert _complete(hard).status_code == 200


def test_idle_keep_alive_connection_is_closed(hard):
    s = _connect(hard, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        got = _read_until_closed([s], TIMEOUT_S + SLACK_S)[s]
        assert got.startswith(b"HTTP/1.1 200"), got
    finally:
        s.close()


def test_connection_cap(capped):
    """With --limit-concurrency 4, a fifth open connection is answered 503 and closed at once;
    once one of the four goes, requests are served again."""
    held = [_connect(capped) for _ in range(4)]
    try:
        extra = _connect(capped)
        try:
            got = _read_until_closed([extra], SLACK_S)[extra]  # the cap acts on accept
            _error(got, 503, "too_many_connections")
        finally:
            extra.close()
        held.pop().close()

        def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(_url(capped) + "/health", timeout=10).status_code == 200
            return False
        wait_for(healthy, SLACK_S, "a connection slot to free up")
    finally:
        for s in held:
            s.close()


# request bodies, CORS -----------------------------------------------------------------------------
def test_post_bodies_must_be_json(hard):
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    for headers in ({"Content-Type": "text/plain"}, {},
                    {"Content-Type": "application/x-www-form-urlencoded"}):
        r = httpx.post(_url(hard) + C, content=body, headers=headers, timeout=60)
        assert r.status_code == 415, r.text
        err = r.json()["error"]
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    for ctype in ("application/json; charset=utf-8", "Application/JSON"):
        r = httpx.post(_url(hard) + C, content=body, headers={"Content-Type": ctype}, timeout=60)
        assert r.status_code == 200, r.text


def _preflight(port: int, origin: str) -> httpx.Response:
    return httpx.options(_url(port) + "/v1/chat/completions", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_only_for_allowed_origins(hard, capped):
    r = _preflight(hard, GOOD_ORIGIN)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.post(_url(hard) + C, json={"prompt": "Hello", "max_tokens": 2}, timeout=60,
                   headers={"Origin": GOOD_ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD_ORIGIN
    for port, origin in ((hard, "http://evil.example"), (capped, GOOD_ORIGIN),
                         (capped, "http://evil.example")):  # capped: default, no origins
        r = _preflight(port, origin)
        assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers, r.headers


# seeds --------------------------------------------------------------------------------------------
def test_any_int64_seed_is_accepted_and_deterministic(hard):
    def text(seed: int) -> str:
        r = _complete(hard, seed=seed, temperature=1.0, max_tokens=8, ignore_eos=True)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    # negative seeds wrap modulo 2**63 - 128 (the engine's range, room for n samples)
    assert text(-1) == text(-1) == text(2 ** 63 - 129)
    assert text(2 ** 63 - 1) == text(2 ** 63 - 1)
    r = _complete(hard, seed=-1, n=3, temperature=1.0, max_tokens=4)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    for bad in (2 ** 63, -2 ** 63 - 1, "x"):
        r = _complete(hard, seed=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


# startup ------------------------------------------------------------------------------------------
def _env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **extra)
    env.pop("LUCEIO_API_KEY", None)
    return env


def _serve(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "luceio.serve", "--port", "0", *args],
                            cwd=REPO, env=_env(**(env or {})), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _one_line_failure(proc: subprocess.Popen, *needles: str) -> str:
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1, err
    assert "Traceback" not in err and len(err.splitlines()) <= 3, err
    last = err.splitlines()[-1]
    assert last.startswith("luceio: error: "), err
    for needle in needles:
        assert needle in last, err
    return err


def test_unknown_model_is_one_line():
    procs = [(_serve("--model", "/nonexistent/model"), "/nonexistent/model"),
             (_serve("--model", "nobody/no-such-model", env={"HF_HUB_OFFLINE": "1"}),
              "nobody/no-such-model")]
    for proc, name in procs:
        _one_line_failure(proc, name)


def test_busy_port_fails_before_loading_the_model():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _serve("--port", str(port))  # the default model: it is never loaded
        err = _one_line_failure(proc, f"127.0.0.1:{port}", "in use")
    assert "loading the model" not in err and "luceio.loader" not in err


def test_startup_mistakes_refused(monkeypatch, capsys, tmp_path):
    def refused(*argv: str) -> str:
        assert main(list(argv)) == 1
        err = capsys.readouterr().err
        assert err.startswith("luceio: error: ") and len(err.splitlines()) == 1, err
        return err

    monkeypatch.delenv("LUCEIO_API_KEY", raising=False)
    assert "--api-key" in refused("--api-key", "")
    assert "--api-key" in refused("--api-key", " sk-x ")
    monkeypatch.setenv("LUCEIO_API_KEY", "")
    assert "LUCEIO_API_KEY" in refused()
    monkeypatch.delenv("LUCEIO_API_KEY")
    assert "--speculative-method draft" in refused("--draft-model", "/some/draft")
    for flag in ("--timeout-headers", "--limit-concurrency"):
        assert flag in refused(flag, "0")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LUCEIO_CACHE", str(tmp_path / "file" / "cache"))
    assert "LUCEIO_CACHE" in refused("--model", "qwen2.5-coder-1.5b", "--port", "0")


SLOW_LOAD = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job of a shell script inherits
from luceio import engine
def slow(self, *args, **kwargs):
    print("LOADING", file=sys.stderr, flush=True)
    time.sleep(600)
engine.LLMEngine.__init__ = slow
from luceio.serve import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_stops_the_model_load(model):
    """SIGINT while the engine is being built ends the process at once with one line, even
    when SIGINT was ignored before (a background job of a shell script)."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD, "--model", model, "--port", "0"],
                            cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("LOADING"):
                break
        assert lines and lines[-1].startswith("LOADING"), "".join(lines)
        proc.send_signal(signal.SIGINT)
        err = "".join(lines) + proc.communicate(timeout=60)[1]  # the load would take 600 s
        assert proc.returncode == 128 + signal.SIGINT, err
        assert "Traceback" not in err and err.splitlines()[-1] == \
            "luceio: interrupted (SIGINT) while loading the model", err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_stream_starts_once_admitted_before_the_first_output(model, monkeypatch):
    """A streaming request gets its 200 and headers once the engine has accepted it, while its
    prefill still runs (held here), so a prefill longer than a client's idle timeout keeps a
    live connection (keep-alives every 15 s); the events, once they come, are those of an
    unhindered run. A refused prompt is still an HTTP error, streamed or not."""
    import threading

    from luceio.engine import LLMEngine
    gate, held, gave_up = threading.Event(), threading.Event(), threading.Event()
    step = LLMEngine.step

    def held_step(self, *a, **kw):
        if not gate.is_set():
            held.set()
            if not gate.wait(20):  # the headers never came while the step was held
                gave_up.set()
        return step(self, *a, **kw)

    body = {"prompt": [5, 9, 33, 70, 12], "max_tokens": 6, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with running(model) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                              timeout=60) as http:
        want = http.post("/v1/completions", json=body).read()
        monkeypatch.setattr(LLMEngine, "step", held_step)
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and held.is_set() and not gave_up.is_set()
            gate.set()
            got = r.read()
        too_long = http.post("/v1/completions", json={**body, "prompt": [5] * 100_000})
        assert too_long.status_code == 400, too_long.text

    def texts(raw: bytes) -> list[str]:
        return [json.loads(line[6:])["choices"][0]["text"] for line in raw.decode().splitlines()
                if line.startswith("data: {")]
    assert texts(got) == texts(want) and len(texts(want)) >= 6


def test_prompts_are_rendered_and_encoded_off_the_event_loop(tiny_llama, monkeypatch):
    """Chat and completion prompts (template, tokenizer: tens of ms for a long prompt) are
    parsed on a worker thread, not on the event loop that runs every stream."""
    import threading

    import luceio.server.app as app
    seen = {"parse": [], "loop": []}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen[name].append(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapped

    async def on_loop(*args, **kwargs):
        seen["loop"].append(threading.get_ident())
        return await generate(*args, **kwargs)
    generate = app.generate
    monkeypatch.setattr(app, "parse_chat", spy("parse", app.parse_chat))
    monkeypatch.setattr(app, "parse_completion", spy("parse", app.parse_completion))
    monkeypatch.setattr(app, "generate", on_loop)
    with running(tiny_llama) as port:
        base = f"http://127.0.0.1:{port}/v1"
        for path, body in (("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/completions", {"prompt": "hello"})):
            r = httpx.post(base + path, json={**body, "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
    assert len(seen["parse"]) == 2 and len(seen["loop"]) == 2
    assert not set(seen["parse"]) & set(seen["loop"])
