"""Reliability soak: `python -m luceio.serve` as a real subprocess under many concurrent streaming
clients, random disconnects, a KV pool far smaller than the demand (preemption), fuzzed JSON and
malformed HTTP, then SIGTERM under load. Nothing may be lost: every stream ends with [DONE] and
well-formed chunks, greedy and seeded outputs equal the same request run alone in-process, no 5xx,
no leaked KV blocks or request state, the process exits 0.

    python bench/soak.py --clients 256 --duration 150          # tiny random-weight llama
    python bench/soak.py --model /path/to/checkpoint ...        # any checkpoint

Prints a table and writes JSON (default bench/results/cpu/soak.json). This module is also the
harness of tests/test_reliability.py (the bounded CI version): server process, load specs and
checks, fuzz strategies, raw-HTTP cases."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT = 2048  # the tiny model's context (patched) so long prompts exist
IDLE_GAUGES = ("luceio_num_requests_running", "luceio_num_requests_waiting",
               "luceio_kv_blocks_used", "luceio_server_inflight_requests",
               "luceio_engine_request_states", "luceio_engine_output_streams")


# the model --------------------------------------------------------------------------------------
def build_tiny_model(folder: str, context: int = CONTEXT) -> str:
    """tests/conftest.py's tiny random-weight llama (BPE tokenizer, ChatML), context patched."""
    tests = os.path.join(REPO, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from conftest import make_tiny_model
    make_tiny_model(folder, "llama")
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = context
    with open(path, "w") as f:
        json.dump(cfg, f)
    return folder


# the server process -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """`python -m luceio.serve` on a free port of 127.0.0.1 (no --host: the default bind)."""

    def __init__(self, model: str, log: str, *extra: str, api_key: str | None = None,
                 startup_timeout: float = 120.0, threads: int | None = 1):
        self.port, self.log, self.api_key = free_port(), log, api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        cmd = [sys.executable, "-m", "luceio.serve", "--model", model, "--port", str(self.port),
               "--dtype", "float32", "--device", "cpu", "--seed", "0", "--no-access-log",
               *(["--api-key", api_key] if api_key else []), *extra]
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("LUCEIO_API_KEY", None)
        if threads:  # torch's intra-op threads: one is plenty for a tiny model, and spinning
            env["OMP_NUM_THREADS"] = str(threads)  # workers on 2 shared cores slow every op
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                         env=env)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not come up:\n{self.log_text()[-4000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def log_problems(self) -> list[str]:
        """Log lines that must never appear: tracebacks, unhandled errors, failed steps."""
        bad = ("Traceback", "unhandled error", "engine step failed", "failed mid-stream",
               "Exception in ASGI application", "ASGI callable returned without")
        return [line for line in self.log_text().splitlines() if any(b in line for b in bad)]

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def listen_addresses(self) -> list[str]:
        """Local addresses of the LISTEN sockets on this server's port (from /proc/net)."""
        out = []
        for name in ("tcp", "tcp6"):
            try:
                with open(f"/proc/net/{name}") as f:
                    rows = f.read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                parts = row.split()
                local, state = parts[1], parts[3]
                addr, port = local.split(":")
                if state != "0A" or int(port, 16) != self.port:
                    continue
                if name == "tcp":
                    out.append(socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr)[::-1]))
                else:
                    raw = bytes.fromhex(addr)
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    out.append(socket.inet_ntop(socket.AF_INET6, raw))
        return out

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                                + "}" if s.labels else "")
                out[key] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing is running, waiting, held or open; raises on timeout."""
        deadline = time.monotonic() + timeout
        m = {}
        while time.monotonic() < deadline:
            m = self.metrics()
            if all(m.get(g, 0) == 0 for g in IDLE_GAUGES):
                return m
            time.sleep(0.05)
        raise AssertionError("server not idle: " + ", ".join(f"{g}={m.get(g)}"
                                                             for g in IDLE_GAUGES))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# load: request specs, streaming clients, checks --------------------------------------------------
WORDS = ["Hello", "world!", "def", "fibonacci(n):", "import", "torch", "The", "quick", "brown",
         "fox", "jumps", "ünïcödé", "日本語も少し。", "return", "x", "*", "2", "100", "Numbers:",
         "class", "Model(torch.nn.Module):", "—", "ok?", "\n", "    "]
STOPS = ["e", "in", " f", "\n", "ll", "0", "or", "ab"]


def make_prompt(rng: random.Random) -> str:
    kind = rng.random()
    n = rng.randint(1, 3) if kind < 0.35 else rng.randint(5, 25) if kind < 0.8 \
        else rng.randint(40, 120)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Spec:
    """One API request of the load, and what its client does."""
    idx: int
    chat: bool
    prompt: str
    n: int = 1
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    logprobs: int | None = None
    include_usage: bool = False
    stream: bool = True
    ignore_eos: bool = False
    extra_prompts: list[str] = field(default_factory=list)  # completions: a batch of prompts
    disconnect_events: int | None = None  # hang up after this many data events
    disconnect_s: float | None = None  # or after this long (maybe before the headers)

    @property
    def exact(self) -> bool:
        """Whether the output is determined (greedy or seeded): compared with a lone run."""
        return self.temperature == 0 or self.seed is not None

    @property
    def prompts(self) -> list[str]:
        return [self.prompt, *self.extra_prompts]

    @property
    def num_choices(self) -> int:
        return self.n * len(self.prompts)

    @property
    def disconnects(self) -> bool:
        return self.disconnect_events is not None or self.disconnect_s is not None

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": self.prompt}]

    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, model: str | None = None) -> dict:
        b: dict = {"n": self.n, "temperature": self.temperature, "stream": self.stream}
        if model is not None:
            b["model"] = model
        if self.chat:
            b["messages"] = self.messages()
            b["max_completion_tokens"] = self.max_tokens
            if self.logprobs is not None:
                b["logprobs"], b["top_logprobs"] = True, self.logprobs
        else:
            b["prompt"] = self.prompts if self.extra_prompts else self.prompt
            b["max_tokens"] = self.max_tokens
            if self.logprobs is not None:
                b["logprobs"] = self.logprobs
        if self.seed is not None:
            b["seed"] = self.seed
        if self.top_p != 1.0:
            b["top_p"] = self.top_p
        if self.top_k:
            b["top_k"] = self.top_k
        if self.stop:
            b["stop"] = self.stop if len(self.stop) > 1 else self.stop[0]
            b["include_stop_str_in_output"] = self.include_stop
        if self.ignore_eos:
            b["ignore_eos"] = True
        if self.stream and self.include_usage:
            b["stream_options"] = {"include_usage": True}
        return b

    def sampling_params(self):
        from luceio import SamplingParams
        return SamplingParams(n=self.n, temperature=self.temperature, seed=self.seed,
                              top_p=self.top_p, top_k=self.top_k, stop=list(self.stop),
                              include_stop_str_in_output=self.include_stop,
                              max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)

    def ref_key(self) -> tuple:
        return (self.chat, self.prompt, tuple(self.extra_prompts), self.n, self.max_tokens,
                self.temperature, self.seed, self.top_p, self.top_k, tuple(self.stop),
                self.include_stop, self.ignore_eos)


def make_specs(rng: random.Random, count: int, start: int = 0, max_tokens: tuple = (4, 40),
               disconnect_frac: float = 0.0, chat_frac: float = 0.3, stream_frac: float = 0.9,
               exact_only: bool = False) -> list[Spec]:
    specs = []
    for i in range(start, start + count):
        s = Spec(i, chat=rng.random() < chat_frac, prompt=make_prompt(rng),
                 n=rng.choice([1, 1, 1, 2, 3]), max_tokens=rng.randint(*max_tokens),
                 stream=rng.random() < stream_frac, include_usage=rng.random() < 0.5)
        mode = rng.random()
        if mode < 0.45 or exact_only and mode < 0.7:  # greedy
            s.temperature = 0.0
        else:  # sampled: seeded (exact) or not
            s.temperature = rng.choice([0.6, 0.8, 1.0, 1.3])
            s.top_p = rng.choice([1.0, 1.0, 0.9])
            s.top_k = rng.choice([0, 0, 20])
            if mode < 0.75 or exact_only:
                s.seed = rng.randint(0, 2 ** 31)
        if rng.random() < 0.3:
            s.stop = rng.sample(STOPS, rng.randint(1, 2))
            s.include_stop = rng.random() < 0.3
        if rng.random() < 0.2:
            s.logprobs = rng.randint(0, 3)
        if not s.chat and rng.random() < 0.15:
            s.extra_prompts = [make_prompt(rng) for _ in range(rng.randint(1, 3))]
        if disconnect_frac and rng.random() < disconnect_frac:
            if rng.random() < 0.2:  # by time: maybe before the response starts, maybe not
                s.disconnect_s = rng.uniform(0.0, 0.3)  # (non-streaming requests too)
            else:
                s.stream = True
                s.disconnect_events = rng.randint(1, max(1, s.max_tokens // 2))
        specs.append(s)
    return specs


class References:
    """Each exact spec run alone through the in-process LLM (cached by request content)."""

    def __init__(self, llm):
        self.llm = llm
        self.cache: dict[tuple, list[tuple[str, str, int]]] = {}

    def get(self, spec: Spec) -> list[tuple[str, str, int]]:
        """[(text, finish_reason, num tokens)] per choice (prompt-major, as the API numbers
        them), and ("", "", total prompt tokens) last. Each prompt of a batch runs alone."""
        key = spec.ref_key()
        if key not in self.cache:
            import torch
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # tiny model; 2 threads next to a busy server crawl
            try:
                self.cache[key] = self._run(spec)
            finally:
                torch.set_num_threads(threads)
        return self.cache[key]

    def _run(self, spec: Spec) -> list[tuple[str, str, int]]:
        p = spec.sampling_params()
        rows, prompt_tokens = [], 0
        for prompt in spec.prompts:
            out = (self.llm.chat(spec.messages(), p) if spec.chat
                   else self.llm.generate(prompt, p))[0]
            rows += [(o.text, o.finish_reason, len(o.token_ids)) for o in out.outputs]
            prompt_tokens += len(out.prompt_token_ids)
        return rows + [("", "", prompt_tokens)]

    def fill(self, specs: list[Spec]) -> None:
        for s in specs:
            if s.exact:
                self.get(s)


@dataclass
class Result:
    spec: Spec
    status: int | None = None
    outcome: str = "error"  # completed | disconnected | error
    error: str | None = None
    events: list[str] = field(default_factory=list)
    body: dict | None = None
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


_SPLITLINES_ONLY = "\x85\u2028\u2029"  # line breaks to str.splitlines, not to SSE
_SSE_EOL = re.compile(r"\r\n|\r|\n")


async def sse_lines(r: httpx.Response):
    """The response's lines as SSE defines them (CRLF, CR or LF; not str.splitlines)."""
    buf = ""
    async for text in r.aiter_text():
        buf += text
        held = buf.endswith("\r")  # maybe the first half of a CRLF: decide with the next text
        parts = _SSE_EOL.split(buf[:-1] if held else buf)
        buf = parts.pop() + ("\r" if held else "")
        for line in parts:
            yield line
    if buf:
        yield buf[:-1] if buf.endswith("\r") else buf


async def run_request(http: httpx.AsyncClient, spec: Spec, headers: dict | None = None,
                      model: str | None = None, timeout: float = 120.0) -> Result:
    res = Result(spec)
    t0 = time.monotonic()

    async def go() -> None:
        if not spec.stream:
            r = await http.post(spec.path(), json=spec.body(model), headers=headers,
                                timeout=timeout)
            res.status = r.status_code
            res.body = r.json()
            res.outcome = "completed"
            return
        async with http.stream("POST", spec.path(), json=spec.body(model), headers=headers,
                               timeout=timeout) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.body = json.loads(await r.aread())
                res.outcome = "completed"
                return
            if not r.headers.get("content-type", "").startswith("text/event-stream"):
                res.problems.append(f"content-type {r.headers.get('content-type')}")
            async for line in sse_lines(r):
                if line.startswith("data: "):
                    if any(c in line for c in _SPLITLINES_ONLY):
                        res.problems.append(f"raw U+2028/U+2029/U+0085 in a data line (breaks "
                                            f"str.splitlines clients): {line[:80]!r}")
                    res.events.append(line[6:])
                    if spec.disconnect_events is not None and \
                            len(res.events) >= spec.disconnect_events:
                        res.outcome = "disconnected"
                        return  # leaving the block closes the connection mid-stream
                elif line and not line.startswith(":"):
                    res.problems.append(f"unexpected SSE line {line[:80]!r}")
            res.outcome = "completed"

    try:
        if spec.disconnect_s is not None:
            try:
                await asyncio.wait_for(go(), spec.disconnect_s)
            except asyncio.TimeoutError:
                res.outcome = "disconnected"
        else:
            await go()
    except (httpx.HTTPError, ValueError, OSError) as e:
        res.outcome, res.error = "error", f"{type(e).__name__}: {e}"
    res.seconds = time.monotonic() - t0
    return res


def check_error_object(body) -> list[str]:
    """An OpenAI error object: {"error": {message: str, type: str, param, code: str|null}}."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return [f"not an error object: {str(body)[:200]}"]
    e = body["error"]
    p = []
    if set(e) != {"message", "type", "param", "code"}:
        p.append(f"error keys {sorted(e)}")
    if not isinstance(e.get("message"), str) or not e.get("message"):
        p.append("error.message not a non-empty string")
    if not isinstance(e.get("type"), str):
        p.append("error.type not a string")
    if e.get("param") is not None and not isinstance(e["param"], str):
        p.append("error.param not a string or null")
    if e.get("code") is not None and not isinstance(e["code"], str):
        p.append("error.code not a string or null")
    return p


def check_result(res: Result, refs: References | None, model: str | None = None,
                 allow_abort: bool = False) -> list[str]:
    """Problems with one result (empty: all good). Disconnected streams: what arrived must be
    well-formed. Completed ones: [DONE] last, one id, every choice finished once, usage right,
    and exact specs equal to the lone reference."""
    spec, p = res.spec, list(res.problems)
    if res.outcome == "error":
        return p + [f"request failed: {res.error}"]
    if res.outcome == "disconnected" and res.status is None:
        return p  # hung up before the response started
    if res.status != 200:
        return p + [f"status {res.status}: {str(res.body)[:300]}"]
    chat, n = spec.chat, spec.num_choices
    obj = "chat.completion.chunk" if chat else "text_completion"
    texts = {i: "" for i in range(n)}
    finish: dict[int, str] = {}
    usage = None
    if not spec.stream:
        b = res.body or {}
        if b.get("object") != ("chat.completion" if chat else "text_completion"):
            p.append(f"object {b.get('object')}")
        for c in b.get("choices", []):
            texts[c["index"]] = c["message"]["content"] if chat else c["text"]
            finish[c["index"]] = c["finish_reason"]
        if sorted(c["index"] for c in b.get("choices", [])) != list(range(n)):
            p.append("choice indexes")
        usage = b.get("usage")
        ids = {b.get("id")}
    else:
        ev = res.events
        done = ev and ev[-1] == "[DONE]"
        if res.outcome == "completed" and not done:
            p.append(f"stream did not end with [DONE] ({len(ev)} events)")
        if ev.count("[DONE]") > (1 if done else 0):
            p.append("[DONE] not last or repeated")
        chunks = []
        for e in ev[:-1] if done else ev:
            try:
                chunks.append(json.loads(e))
            except ValueError:
                p.append(f"event not JSON: {e[:100]!r}")
        ids = {c.get("id") for c in chunks}
        role_seen: set[int] = set()
        for k, c in enumerate(chunks):
            if "error" in c:
                p.append(f"error event {c}")
                continue
            if c.get("object") != obj:
                p.append(f"chunk object {c.get('object')}")
            if model is not None and c.get("model") != model:
                p.append(f"chunk model {c.get('model')}")
            if not isinstance(c.get("created"), int):
                p.append("chunk created")
            if spec.include_usage and "usage" not in c:
                p.append("usage key missing")
            if c.get("usage") is not None:
                if c.get("choices") != [] or (done and k != len(chunks) - 1):
                    p.append("usage chunk not last or has choices")
                usage = c["usage"]
                continue
            choices = c.get("choices")
            if not isinstance(choices, list) or len(choices) != 1:
                p.append(f"chunk choices {choices}")
                continue
            ch = choices[0]
            i = ch.get("index")
            if i not in texts:
                p.append(f"choice index {i}")
                continue
            if i in finish:
                p.append(f"chunk for choice {i} after its finish")
            if chat:
                d = ch.get("delta", {})
                if "role" in d:
                    if i in role_seen or d != {"role": "assistant", "content": ""}:
                        p.append(f"bad role delta {d}")
                    role_seen.add(i)
                elif i not in role_seen:
                    p.append(f"choice {i} content before its role chunk")
                texts[i] += d.get("content") or ""
            else:
                texts[i] += ch.get("text", "")
            if ch.get("finish_reason") is not None:
                finish[i] = ch["finish_reason"]
        if res.outcome == "disconnected":
            if len(ids) > 1:
                p.append(f"{len(ids)} ids in one stream")
            return p
        if spec.include_usage and usage is None:
            p.append("no usage chunk")
    prefix = "chatcmpl-" if chat else "cmpl-"
    if len(ids) != 1 or not str(next(iter(ids))).startswith(prefix):
        p.append(f"ids {ids}")
    if sorted(finish) != list(range(n)):
        p.append(f"finished choices {sorted(finish)} of {n}")
    ok = {"stop", "length"} | ({"abort"} if allow_abort else set())
    if any(f not in ok for f in finish.values()):
        p.append(f"finish reasons {finish}")
    if usage is not None:
        if usage.get("total_tokens") != usage.get("prompt_tokens", 0) + \
                usage.get("completion_tokens", 0):
            p.append(f"usage {usage}")
        if usage.get("completion_tokens", 0) > n * spec.max_tokens:
            p.append(f"usage over max_tokens: {usage}")
        if all(f == "length" for f in finish.values()) and \
                usage.get("completion_tokens") != n * spec.max_tokens:
            p.append(f"finish length but usage {usage}")
    if spec.exact and refs is not None and not (allow_abort and "abort" in finish.values()):
        ref = refs.get(spec)
        want_texts = {i: t for i, (t, _, _) in enumerate(ref[:-1])}
        want_finish = {i: f for i, (_, f, _) in enumerate(ref[:-1])}
        if texts != want_texts:
            p.append(f"text differs from the lone run: {texts} != {want_texts}")
        if finish != want_finish:
            p.append(f"finish differs from the lone run: {finish} != {want_finish}")
        if usage is not None:
            want = {"prompt_tokens": ref[-1][2],
                    "completion_tokens": sum(k for _, _, k in ref[:-1])}
            if {k: usage.get(k) for k in want} != want:
                p.append(f"usage {usage} != lone run {want}")
    return p


async def run_load(url: str, specs: list[Spec], headers: dict | None = None,
                   model: str | None = None, timeout: float = 120.0) -> list[Result]:
    """All specs at once, one connection each."""
    limits = httpx.Limits(max_connections=len(specs) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        return await asyncio.gather(*(run_request(http, s, headers, model, timeout)
                                      for s in specs))


def summarize(results: list[Result], refs: References | None, model: str | None = None,
              allow_abort: bool = False) -> tuple[dict, list[str]]:
    """(counts, problems) over a load round; ids must be unique across requests."""
    problems, seen_ids = [], {}
    counts = Counter()
    for r in results:
        counts[r.outcome] += 1
        if r.status is not None:
            counts[f"status_{r.status}"] += 1
        for msg in check_result(r, refs, model, allow_abort):
            problems.append(f"#{r.spec.idx}: {msg}")
        if r.outcome == "completed" and r.status == 200:
            counts["checked_exact" if r.spec.exact else "checked_sampled"] += 1
        ids = set()
        if r.spec.stream:
            for e in r.events:
                if e != "[DONE]":
                    try:
                        ids.add(json.loads(e).get("id"))
                    except ValueError:
                        pass
        elif isinstance(r.body, dict) and "id" in r.body:
            ids.add(r.body["id"])
        for i in ids:
            if i in seen_ids:
                problems.append(f"#{r.spec.idx}: id {i} also used by #{seen_ids[i]}")
            seen_ids[i] = r.spec.idx
    return dict(counts), problems


# fuzzed input ------------------------------------------------------------------------------------
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                     "n", "best_of", "seed", "stop", "stop_token_ids", "stream", "stream_options",
                     "echo", "logprobs", "logit_bias", "suffix", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
                     "skip_special_tokens", "include_stop_str_in_output", "response_format",
                     "tools", "user"]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in ("prompt", "echo", "suffix")] + [
    "messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt"]
ODD_STRINGS = ["", " ", "\x00", "\ud800", "\udfff", "a\ud83dz", "😀" * 50, "\u202e\u200b\ufeff",
               "日本語", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "{{ 7*7 }}", "{% raw %}",
               "\\", "\"", "\n" * 100, "x" * 5000, "💥" * 2000, "/etc/passwd", "../../llama",
               "NaN", "-1", "1e309", "null"]


def fuzz_strategies(model_name: str, vocab: int, model_paths: tuple[str, ...] = ()):
    """Hypothesis strategies: `bodies(chat)` (dicts, mostly near-valid with fields broken) and
    `raw_bodies(chat)` (bytes: NaN/Infinity literals, invalid UTF-8, CESU-8 surrogates,
    truncation, deep nesting, non-objects)."""
    from hypothesis import strategies as st

    text = st.one_of(st.text(max_size=30), st.sampled_from(ODD_STRINGS),
                     st.text(st.characters(codec="utf-8"), max_size=10))
    ints = st.one_of(st.integers(-3, 300), st.sampled_from(
        [-2 ** 63 - 1, -2 ** 63, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 10 ** 30, -10 ** 30]))
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e308, -1e308, 1e-5, 1e-6]))
    scalars = st.one_of(st.none(), st.booleans(), ints, floats, text)
    anything = st.recursive(scalars, lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(text, c, max_size=4)), max_leaves=12)
    token = st.integers(0, vocab - 1)
    stop = st.one_of(st.sampled_from(STOPS), st.lists(st.sampled_from(STOPS + ODD_STRINGS[:6]),
                                                      max_size=4))
    msg = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "", "x" * 50]),
         "content": st.one_of(text, st.just(None), st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=3))},
        optional={"name": st.one_of(text, ints)})
    good = {
        "model": st.sampled_from([model_name, None, "gpt-4", "", *model_paths,
                                  "smollm2-135m", "/", "../../etc/passwd"]),
        "prompt": st.one_of(st.sampled_from(["Hello", "def f(x):", "日本語", " "]), text,
                            st.lists(token, min_size=1, max_size=20),
                            st.lists(st.lists(token, max_size=8), max_size=3),
                            st.lists(st.sampled_from(["a", "Hello", ""]), max_size=3),
                            st.just([5] * 3000), st.just("Hello " * 3000)),
        "messages": st.one_of(st.lists(msg, min_size=1, max_size=3), st.just([])),
        "max_tokens": st.one_of(st.integers(1, 8), st.just(None)),
        "max_completion_tokens": st.integers(1, 8),
        "temperature": st.sampled_from([0, 0.0, 0.5, 1.0, 2.0, 1e-6, 100.0]),
        "top_p": st.sampled_from([1.0, 0.5, 0.01, 1e-300]),
        "top_k": st.sampled_from([-1, 0, 1, 50, 10 ** 9]),
        "min_p": st.sampled_from([0.0, 0.1, 1.0]),
        "n": st.sampled_from([1, 2, 3, 16, 128]),
        "best_of": st.sampled_from([1, 2]),
        "seed": st.sampled_from([0, 1, -1, 2 ** 63 - 1, -2 ** 63]),
        "stop": stop,
        "stop_token_ids": st.lists(token, max_size=3),
        "stream": st.booleans(),
        "stream_options": st.one_of(st.just({"include_usage": True}),
                                    st.dictionaries(text, scalars, max_size=2)),
        "echo": st.booleans(),
        "logprobs": st.one_of(st.integers(0, 5), st.booleans()),
        "top_logprobs": st.integers(0, 5),
        "logit_bias": st.one_of(st.just({}), st.dictionaries(st.sampled_from(["1", "5", "x"]),
                                                             ints, max_size=2)),
        "suffix": text,
        "presence_penalty": st.sampled_from([0.0, 2.0, -2.0, 1.5]),
        "frequency_penalty": st.sampled_from([0.0, 2.0, -2.0]),
        "repetition_penalty": st.sampled_from([1.0, 1e-300, 1e300, 0.5, 2.0]),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 10),
        "skip_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {}]),
        "tools": st.sampled_from([[], [{"type": "function"}]]),
        "add_generation_prompt": st.booleans(),
        "user": text,
    }

    # values the server accepts: a body of these alone goes all the way through generation
    valid = {
        "model": st.sampled_from([model_name, None]),
        "prompt": st.one_of(st.sampled_from(["Hello", "def f(x):", "日本語", " ", "a" * 300]),
                            st.text(st.characters(codec="utf-8"), min_size=1, max_size=40),
                            st.lists(token, min_size=1, max_size=20),
                            st.lists(st.lists(token, min_size=1, max_size=8), min_size=1,
                                     max_size=3),
                            st.lists(st.sampled_from(["a", "Hello", "日本"]), min_size=1,
                                     max_size=3)),
        "messages": st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
             "content": st.one_of(st.text(st.characters(codec="utf-8"), max_size=30),
                                  st.just(None), st.lists(st.fixed_dictionaries(
                                      {"type": st.just("text"), "text": st.text(max_size=10)}),
                                      max_size=2))},
            optional={"name": st.text(max_size=5)}), min_size=1, max_size=3),
        "max_tokens": st.integers(1, 12),
        "max_completion_tokens": st.integers(1, 12),
        "temperature": st.one_of(st.sampled_from([0, 1e-6, 1e-5, 100.0, 1e308]),
                                 st.floats(0, 5)),
        "top_p": st.one_of(st.sampled_from([1.0, 5e-324]), st.floats(0, 1, exclude_min=True)),
        "top_k": st.sampled_from([-1, 0, 1, 2, 50, 10 ** 9, 2 ** 63 - 1]),
        "min_p": st.floats(0, 1),
        "n": st.sampled_from([1, 2, 3, 16, 128]),
        "seed": st.sampled_from([None, 0, 1, -1, 2 ** 63 - 1, -2 ** 63]),
        "stop": st.one_of(st.sampled_from(STOPS), st.lists(st.sampled_from(
            STOPS + ["😀", "\n", "x" * 500]), max_size=4)),
        "stop_token_ids": st.lists(token, max_size=3),
        "stream": st.booleans(),
        "echo": st.booleans(),
        "logprobs": st.one_of(st.integers(0, 20), st.booleans()),
        "top_logprobs": st.integers(0, 20),
        "logit_bias": st.just({}),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.one_of(st.sampled_from([5e-324, 1e-300, 1e300]),
                                        st.floats(0, 10, exclude_min=True)),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 4),
        "skip_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "response_format": st.just({"type": "text"}),
        "tools": st.just([]),
        "add_generation_prompt": st.booleans(),
        "user": st.text(max_size=10),
    }

    def value(name: str):
        if name in valid:
            return st.one_of(valid[name], valid[name], valid[name], good[name], anything)
        return st.one_of(good[name], anything)

    @st.composite
    def bodies(draw, chat: bool):
        names = CHAT_FIELDS if chat else COMPLETION_FIELDS
        clean = draw(st.integers(0, 2)) == 0  # a third: only valid values, no unknown fields
        pick = (lambda n: valid[n]) if clean else value
        pool = [n for n in names if n in valid] if clean else names
        body = {}
        req = "messages" if chat else "prompt"
        if clean or draw(st.integers(0, 9)):  # the required field, usually
            body[req] = draw(pick(req))
        for name in draw(st.lists(st.sampled_from(pool), max_size=7, unique=True)):
            body[name] = draw(pick(name))
        if clean and body.get("stream") is not True:
            body.pop("stream_options", None)
        if not clean:
            body.update(draw(st.dictionaries(text, anything, max_size=2)))  # unknown fields
        return body

    @st.composite
    def raw_bodies(draw, chat: bool):
        body = draw(bodies(chat))
        how = draw(st.sampled_from(["json"] * 10 + ["nan", "cesu", "badutf8", "truncate",
                                                    "nest", "toplevel", "bytes", "bom",
                                                    "dupkeys"]))
        data = json.dumps(body).encode()  # NaN/Infinity as bare literals; surrogates escaped
        if how == "nan":
            key = draw(st.sampled_from(["temperature", "max_tokens", "n", "top_p", "seed"]))
            lit = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0"]))
            data = data[:-1] + (b", " if len(data) > 2 else b"") + \
                f'"{key}": {lit}}}'.encode()
        elif how == "cesu":  # lone surrogates as raw (CESU-8) bytes, which json.loads admits
            data = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
            data = data.replace(b'"', b'"\xed\xa0\x80', 1)
        elif how == "badutf8":
            cut = draw(st.integers(0, len(data)))
            junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xe2\x82", b"\x80\x80", b"\xf8"]))
            data = data[:cut] + junk + data[cut:]
        elif how == "truncate":
            data = data[:draw(st.integers(0, max(len(data) - 1, 0)))]
        elif how == "nest":
            depth = draw(st.sampled_from([50, 500, 990, 5000, 100000]))
            key = draw(st.sampled_from(["prompt", "messages", "stop", "temperature", "extra"]))
            data = data[:-1] + (b", " if len(data) > 2 else b"") + \
                f'"{key}": '.encode() + b"[" * depth + b"]" * depth + b"}"
        elif how == "toplevel":
            data = draw(st.sampled_from([b"[]", b"null", b"1", b'"x"', b"", b" ", b"[{}]",
                                         b"true", b"{}", b"{", b"}"]))
        elif how == "bytes":
            data = draw(st.binary(max_size=64))
        elif how == "bom":
            data = b"\xef\xbb\xbf" + data
        elif how == "dupkeys":
            data = data[:-1] + (b", " if len(data) > 2 else b"") + b'"n": "x", "n": 1}'
        return data

    return bodies, raw_bodies


def check_fuzz_response(r: httpx.Response, stream_body: bytes | None = None) -> list[str]:
    """No 5xx; a 4xx is an error object; a 200 is a well-formed response or SSE stream."""
    p = []
    if r.status_code >= 500:
        return [f"5xx: {r.status_code} {r.text[:300]}"]
    body = stream_body if stream_body is not None else r.content
    if r.status_code != 200:
        if not r.headers.get("content-type", "").startswith("application/json"):
            p.append(f"{r.status_code} content-type {r.headers.get('content-type')}")
        try:
            p += check_error_object(json.loads(body))
        except ValueError:
            p.append(f"{r.status_code} body not JSON: {body[:200]!r}")
        return p
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in body.decode("utf-8").replace("\r\n", "\n").split("\n")
                  if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            p.append(f"stream without [DONE]: {body[-200:]!r}")
        if any(c in e for e in events for c in _SPLITLINES_ONLY):
            p.append("raw U+2028/U+2029/U+0085 in a data line")
        for e in events[:-1]:
            try:
                c = json.loads(e)
            except ValueError:
                p.append(f"event not JSON: {e[:100]!r}")
                continue
            if "error" in c:
                p.append(f"error event in a stream: {c}")
            elif c.get("choices") and c["choices"][0].get("finish_reason") not in \
                    (None, "stop", "length"):
                p.append(f"finish reason {c['choices'][0].get('finish_reason')}")
        return p
    try:
        b = json.loads(body)
    except ValueError:
        return [f"200 body not JSON: {body[:200]!r}"]
    if not isinstance(b, dict) or not isinstance(b.get("choices"), list) or "usage" not in b:
        p.append(f"200 body shape: {str(b)[:200]}")
    elif any(c.get("finish_reason") not in ("stop", "length") for c in b["choices"]):
        p.append(f"finish reasons {[c.get('finish_reason') for c in b['choices']]}")
    return p


def send_fuzz(http: httpx.Client, path: str, data: bytes, headers: dict) -> list[str]:
    with http.stream("POST", path, content=data,
                     headers={**headers, "Content-Type": "application/json"}) as r:
        body = r.read()
    return check_fuzz_response(r, body)


def run_fuzz(url: str, headers: dict, model_name: str, vocab: int, max_examples: int,
             seed: int | None = 0, model_paths: tuple[str, ...] = (),
             stop: threading.Event | None = None) -> tuple[int, list[str]]:
    """Hypothesis-driven bodies on both generation routes: (cases sent, problems)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st
    _, raw_bodies = fuzz_strategies(model_name, vocab, model_paths)
    problems: list[str] = []
    count = 0
    with httpx.Client(base_url=url, timeout=120) as http:
        @settings(max_examples=max_examples, deadline=None, derandomize=seed is None,
                  database=None, suppress_health_check=list(HealthCheck), print_blob=False)
        @given(chat=st.booleans(), data=st.data())
        def case(chat, data):
            nonlocal count
            raw = data.draw(raw_bodies(chat))  # drawn even when stopping: draws must not vary
            if stop is not None and stop.is_set():
                return
            path = "/v1/chat/completions" if chat else "/v1/completions"
            count += 1
            for msg in send_fuzz(http, path, raw, headers):
                problems.append(f"{path} {raw[:300]!r}: {msg}")

        (hseed(seed)(case) if seed is not None else case)()
    return count, problems


# malformed HTTP over a raw socket ----------------------------------------------------------------
def raw_http_cases(body: bytes = b'{"prompt": "hi", "max_tokens": 2}',
                   auth: bytes = b"") -> list[tuple[str, bytes, str]]:
    """(name, bytes to send, how to end: "close" | "shut" | "hold")."""
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth
    return [
        ("garbage request line", b"GARBAGE\r\n\r\n", "shut"),
        ("binary junk", bytes(range(256)) + b"\r\n\r\n", "shut"),
        ("bad method", b"G@T /health HTTP/1.1\r\nHost: x\r\n\r\n", "shut"),
        ("bad version", b"GET /health HTTP/7\r\nHost: x\r\n\r\n", "shut"),
        ("no version", b"GET /health\r\n\r\n", "shut"),
        ("bad content-length", post + b"Content-Length: abc\r\n\r\n" + body, "shut"),
        ("negative content-length", post + b"Content-Length: -5\r\n\r\n" + body, "shut"),
        ("two content-lengths", post + b"Content-Length: 5\r\nContent-Length: 9\r\n\r\n" + body,
         "shut"),
        ("huge content-length", post + b"Content-Length: 99999999999999999999\r\n\r\n" + body,
         "shut"),
        ("content-length over the body (truncated, hang up)",
         post + b"Content-Length: %d\r\n\r\n" % (len(body) + 50) + body, "shut"),
        ("content-length over the body (truncated, held)",
         post + b"Content-Length: %d\r\n\r\n" % (len(body) + 50) + body, "hold"),
        ("content-length under the body", post + b"Content-Length: 5\r\n\r\n" + body, "shut"),
        ("bad chunk size", post + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + body, "shut"),
        ("truncated chunked", post + b"Transfer-Encoding: chunked\r\n\r\n40\r\n{\"pro", "shut"),
        ("chunked and content-length",
         post + b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n", "shut"),
        ("unknown transfer-encoding", post + b"Transfer-Encoding: gzip\r\n\r\n" + body, "shut"),
        ("header without colon", b"GET /health HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n", "shut"),
        ("header with NUL", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", "shut"),
        ("obs-fold header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n", "shut"),
        ("oversized header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 200_000 +
         b"\r\n\r\n", "shut"),
        ("10k headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 10_000 +
         b"\r\n", "shut"),
        ("long url", b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", "shut"),
        ("non-ascii path", b"GET /\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n", "shut"),
        ("bad percent-escape", b"GET /v1/%ff%zz HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n",
         "shut"),
        ("headers only, hang up", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", "shut"),
        ("half a request line", b"POST /v1/compl", "shut"),
        ("nothing, held", b"", "hold"),
        ("pipelined garbage", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGARBAGE\r\n\r\n", "shut"),
        ("CONNECT", b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: x\r\n\r\n", "shut"),
        ("upgrade h2c", b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings"
         b"\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n", "shut"),
        ("websocket upgrade", b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
         b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: "
         b"dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n", "shut"),
        ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "shut"),
        ("TLS client hello", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40,
         "shut"),
        ("valid, then reset", post + b"Content-Length: %d\r\n\r\n" % len(body) + body, "close"),
    ]


def parse_http_responses(data: bytes) -> list[tuple[int, dict, bytes]]:
    """Responses in a raw byte stream (Content-Length or chunked bodies)."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            break
        headers = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(b":")
            headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
        if "content-length" in headers:
            n = int(headers["content-length"])
            body, data = rest[:n], rest[n:]
        elif headers.get("transfer-encoding") == "chunked":
            body, data = b"", rest
            while True:
                size_line, _, data = data.partition(b"\r\n")
                try:
                    size = int(size_line.split(b";")[0], 16)
                except ValueError:
                    break
                body, data = body + data[:size], data[size + 2:]
                if size == 0:
                    break
        else:
            body, data = rest, b""
        out.append((status, headers, body))
    return out


def send_raw(port: int, data: bytes, end: str, hold_s: float = 0.5,
             timeout: float = 10.0) -> bytes:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        if end == "close":  # RST right after sending: the server must cope
            s.sendall(data)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return b""
        if data:
            s.sendall(data)
        if end == "shut":
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:  # the server already answered and hung up (oversized headers)
                pass
        else:
            s.settimeout(hold_s)
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return out
    except (BrokenPipeError, ConnectionResetError):
        return b""
    finally:
        s.close()


def check_raw_responses(name: str, data: bytes) -> list[str]:
    p = []
    for status, headers, body in parse_http_responses(data):
        if status >= 500:
            p.append(f"{name}: 5xx: {status} {body[:200]!r}")
        elif status >= 400:
            if not headers.get("content-type", "").startswith("application/json"):
                p.append(f"{name}: {status} with content-type {headers.get('content-type')}")
                continue
            try:
                p += [f"{name}: {m}" for m in check_error_object(json.loads(body))]
            except ValueError:
                p.append(f"{name}: {status} body not JSON {body[:100]!r}")
    return p


def run_raw_http(port: int, auth: bytes = b"") -> tuple[int, list[str]]:
    cases = raw_http_cases(auth=auth)
    problems = []
    for name, data, end in cases:
        problems += check_raw_responses(name, send_raw(port, data, end))
    return len(cases), problems


# the soak ----------------------------------------------------------------------------------------
async def sigterm_under_load(server: ServerProc, model_name: str | None, clients: int,
                             rng: random.Random, max_tokens: int = 1500) -> dict:
    """Long requests in flight (most streaming, some not), then SIGTERM: each ends properly (a
    stream with its final chunk and [DONE], a plain request with its JSON, finish "abort" when
    cut short); requests arriving after the signal get 503 or a refused connection, never a
    hang; the process exits 0."""
    specs = make_specs(rng, clients, start=10 ** 6, max_tokens=(max_tokens, max_tokens),
                       chat_frac=0.3, stream_frac=0.8)
    for s in specs:
        s.ignore_eos, s.stop, s.n, s.include_usage, s.extra_prompts = True, [], 1, False, []
    task = asyncio.ensure_future(run_load(server.url, specs, server.headers, model_name, 60))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = await asyncio.to_thread(server.metrics)
        if m["luceio_server_inflight_requests"] >= clients and \
                m["luceio_engine_generation_tokens_total"] > 0:
            break
        await asyncio.sleep(0.1)
    server.proc.send_signal(signal.SIGTERM)
    late = make_specs(rng, 4, start=2 * 10 ** 6, max_tokens=(4, 4))

    def draining() -> bool:  # /health says 503 (or the socket is closed already)
        try:
            return httpx.get(server.url + "/health", timeout=5).status_code == 503
        except httpx.HTTPError:
            return True

    deadline = time.monotonic() + 20
    while not await asyncio.to_thread(draining) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    late_results = await asyncio.wait_for(run_load(server.url, late, server.headers,
                                                   model_name, 30), 40)
    results = await asyncio.wait_for(task, 60)
    code = await asyncio.to_thread(server.proc.wait, 60)
    counts, problems = summarize(results, None, model_name, allow_abort=True)
    aborted = 0
    for r in results:
        if r.status != 200:
            continue
        if r.spec.stream and len(r.events) > 1 and r.events[-1] == "[DONE]":
            last = json.loads(r.events[-2])
            if last.get("choices") and last["choices"][0].get("finish_reason") == "abort":
                aborted += 1
        elif not r.spec.stream and isinstance(r.body, dict) and \
                r.body["choices"][0]["finish_reason"] == "abort":
            aborted += 1
    late_outcomes = Counter()
    for r in late_results:
        if r.outcome == "error" and any(k in (r.error or "") for k in
                                        ("Connect", "Disconnected", "ReadError", "RemoteProtocol")):
            late_outcomes["refused"] += 1  # the socket closed before any response: shutting down
        elif r.status == 503 and not check_error_object(r.body):
            late_outcomes["503"] += 1
        elif r.status == 200 and not check_result(r, None, model_name, allow_abort=True):
            late_outcomes["200"] += 1
        else:
            problems.append(f"late request: {r.outcome} {r.status} {r.error} "
                            f"{str(r.body)[:200]}")
    if code != 0:
        problems.append(f"exit status {code}")
    return {"requests": clients, "streaming": sum(s.stream for s in specs),
            "ended_properly": counts.get("completed", 0), "finished_abort": aborted,
            "late_requests": dict(late_outcomes), "exit_status": code,
            "problems": problems[:20]}


def soak(args) -> dict:
    from luceio import LLM
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="luceio-soak-")
    model = args.model or build_tiny_model(os.path.join(tmp, "llama"))
    api_key = "soak-key"
    name = "soak-model"
    extra = ["--served-model-name", name, "--max-tokens-cap", str(args.max_tokens_cap)]
    if args.kv_blocks:
        extra += ["--num-kv-blocks", str(args.kv_blocks)]
    extra += ["--preemption-mode", args.preemption_mode]
    log = os.path.join(tmp, "server.log")
    server = ServerProc(model, log, *extra, api_key=api_key)
    print(f"server pid {server.pid} on {server.url}; log {log}", flush=True)
    report: dict = {"params": vars(args).copy(), "model": "tiny-llama" if not args.model
                    else args.model}
    try:
        llm = LLM(model, dtype="float32", device="cpu", seed=0, num_kv_blocks=4096)
        vocab = llm.engine.runner.cfg.vocab_size
        refs = References(llm)
        # a fixed pool of exact (greedy / seeded) requests, repeated through the run (also
        # exercises the prefix cache); sampled unseeded ones are fresh each time
        pool = make_specs(rng, args.exact_pool, exact_only=True, max_tokens=(4, 48))
        t0 = time.monotonic()
        refs.fill(pool)
        print(f"{len(pool)} references in {time.monotonic() - t0:.1f}s", flush=True)

        # warm-up round, then the RSS baseline
        warm = make_specs(rng, min(args.clients, 64), start=10 ** 7)
        asyncio.run(run_load(server.url, warm, server.headers, name))
        server.wait_idle(60)
        rss0 = server.rss_kib()
        m0 = server.metrics()

        counts: Counter = Counter()
        problems: list[str] = []
        latencies: list[float] = []
        stop = threading.Event()
        lock = threading.Lock()
        fuzz = {"cases": 0, "raw_http_cases": 0, "problems": []}

        def fuzz_loop(worker: int):
            try:
                fuzz_rounds(worker)
            except Exception as e:  # noqa: BLE001  reported, not lost with the thread
                with lock:
                    fuzz["problems"].append(f"fuzz thread failed: {type(e).__name__}: {e}")

        def fuzz_rounds(worker: int):
            k = 0
            while not stop.is_set():
                n, p = run_fuzz(server.url, server.headers, name, vocab, 50,
                                seed=args.seed + 1000 * worker + k, model_paths=(model, tmp),
                                stop=stop)
                n_raw, p_raw = run_raw_http(server.port, b"Authorization: Bearer " +
                                            api_key.encode() + b"\r\n")
                with lock:
                    fuzz["cases"] += n
                    fuzz["raw_http_cases"] += n_raw
                    fuzz["problems"] += p + p_raw
                k += 1

        async def client(cid: int, http: httpx.AsyncClient, end: float):
            crng = random.Random(args.seed * 1000 + cid)
            i = 0
            while time.monotonic() < end:
                if crng.random() < 0.5:
                    spec = Spec(**{**pool[crng.randrange(len(pool))].__dict__})
                    spec.idx = cid * 10 ** 5 + i
                else:  # fresh and sampled (references are computed up front only)
                    spec = make_specs(crng, 1, start=cid * 10 ** 5 + i, max_tokens=(4, 48))[0]
                    spec.temperature, spec.seed = max(spec.temperature, 0.8), None
                if crng.random() < args.disconnect_frac:
                    if crng.random() < 0.2:
                        spec.disconnect_s = crng.uniform(0.0, 0.5)
                    else:
                        spec.stream = True
                        spec.disconnect_events = crng.randint(1, max(1, spec.max_tokens // 2))
                i += 1
                counts["sent"] += 1
                r = await run_request(http, spec, server.headers, name, args.request_timeout)
                counts[r.outcome] += 1
                if r.status is not None:
                    counts[f"status_{r.status}"] += 1
                if r.outcome == "completed":
                    latencies.append(r.seconds)
                for msg in check_result(r, refs, name):
                    problems.append(f"#{spec.idx}: {msg}")
                if r.outcome == "completed" and r.status == 200:
                    counts["checked_exact" if spec.exact else "checked_sampled"] += 1

        async def load():
            end = time.monotonic() + args.duration
            limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=server.url, limits=limits,
                                         timeout=args.request_timeout) as http:
                await asyncio.gather(*(client(c, http, end) for c in range(args.clients)))

        threads = [threading.Thread(target=fuzz_loop, args=(w,), daemon=True)
                   for w in range(args.fuzz_threads)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        asyncio.run(load())
        stop.set()
        for t in threads:
            t.join(120)
        elapsed = time.monotonic() - t0
        fuzz["cases_under_load"] = fuzz["cases"]
        server.wait_idle(120)
        if args.fuzz_cases:  # then on the idle server, where every case is answered at once
            n, p = run_fuzz(server.url, server.headers, name, vocab, args.fuzz_cases,
                            seed=args.seed + 99, model_paths=(model, tmp))
            fuzz["cases"] += n
            fuzz["problems"] += p
        m1 = server.wait_idle(120)
        rss1 = server.rss_kib()
        leaked = int(m1["luceio_kv_blocks_used"])
        # a fresh request still gives the right output
        fresh = make_specs(random.Random(7), 1, start=10 ** 8, exact_only=True)
        fr = asyncio.run(run_load(server.url, fresh, server.headers, name))
        _, fresh_problems = summarize(fr, refs, name)
        sigterm = asyncio.run(sigterm_under_load(server, name, min(args.clients, 64), rng,
                                                 args.max_tokens_cap))
        status_5xx = sum(v for k, v in counts.items() if k.startswith("status_5"))
        fuzz_5xx = sum(1 for p in fuzz["problems"] if "5xx" in p)
        errors_by_status = {k[7:]: v for k, v in sorted(counts.items())
                            if k.startswith("status_") and k != "status_200"}
        lat = sorted(latencies)
        report.update({
            "clients": args.clients, "duration_s": round(elapsed, 1),
            "requests_sent": counts["sent"], "completed": counts["completed"],
            "aborted_by_client": counts["disconnected"], "client_errors": counts["error"],
            "errors_by_status": errors_by_status, "http_5xx": status_5xx + fuzz_5xx,
            "streams_checked_exact": counts["checked_exact"],
            "streams_checked_sampled": counts["checked_sampled"],
            "problems": len(problems), "problem_samples": problems[:20],
            "latency_s": {"p50": round(lat[len(lat) // 2], 3) if lat else None,
                          "p99": round(lat[int(len(lat) * 0.99)], 3) if lat else None},
            "tokens_generated": int(m1["luceio_generation_tokens_total"]
                                    - m0["luceio_generation_tokens_total"]),
            "preemptions": int(m1["luceio_num_preemptions_total"]
                               - m0["luceio_num_preemptions_total"]),
            "server_aborts": int(m1.get("luceio_requests_total{finish_reason=abort}", 0)
                                 - m0.get("luceio_requests_total{finish_reason=abort}", 0)),
            "kv_blocks_total": int(m1["luceio_kv_blocks_total"]),
            "leaked_blocks": leaked,
            "idle_after": {g: m1[g] for g in IDLE_GAUGES},
            "server_500_counter": m1.get("luceio_http_errors_total{status=500}", 0),
            "rss_mib": {"after_warmup": round(rss0 / 1024, 1), "after_soak": round(rss1 / 1024, 1),
                        "growth": round((rss1 - rss0) / 1024, 1)},
            "fuzz_cases": fuzz["cases"], "fuzz_cases_under_load": fuzz["cases_under_load"],
            "raw_http_cases": fuzz["raw_http_cases"],
            "fuzz_problems": len(fuzz["problems"]), "fuzz_problem_samples": fuzz["problems"][:20],
            "fresh_request_exact": not fresh_problems,
            "sigterm": sigterm,
            "server_log_problems": server.log_problems()[:20],
        })
        report["ok"] = (report["http_5xx"] == 0 and leaked == 0 and not problems
                        and not fuzz["problems"] and not fresh_problems
                        and not sigterm["problems"] and sigterm["exit_status"] == 0
                        and not report["server_log_problems"] and counts["error"] == 0)
        return report
    finally:
        server.stop()


def print_table(r: dict) -> None:
    rows = [("clients", r["clients"]), ("duration (s)", r["duration_s"]),
            ("requests sent", r["requests_sent"]), ("completed", r["completed"]),
            ("aborted by client (disconnect)", r["aborted_by_client"]),
            ("client-side errors", r["client_errors"]),
            ("errors by status", r["errors_by_status"] or "none"),
            ("5xx (must be 0)", r["http_5xx"]),
            ("streams checked exact (greedy/seeded)", r["streams_checked_exact"]),
            ("streams checked (sampled)", r["streams_checked_sampled"]),
            ("check problems", r["problems"]), ("tokens generated", r["tokens_generated"]),
            ("preemptions", r["preemptions"]), ("server-side aborts", r["server_aborts"]),
            ("leaked KV blocks (must be 0)", r["leaked_blocks"]),
            ("RSS after warm-up / soak (MiB)",
             f"{r['rss_mib']['after_warmup']} / {r['rss_mib']['after_soak']}"),
            ("fuzz cases (JSON / raw HTTP)", f"{r['fuzz_cases']} / {r['raw_http_cases']}"),
            ("fuzz problems", r["fuzz_problems"]),
            ("latency p50 / p99 (s)", f"{r['latency_s']['p50']} / {r['latency_s']['p99']}"),
            ("SIGTERM: requests ended properly / exit",
             f"{r['sigterm']['ended_properly']}/{r['sigterm']['requests']} / "
             f"{r['sigterm']['exit_status']}"),
            ("OK", r["ok"])]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: a tiny random llama)")
    ap.add_argument("--clients", type=int, default=256, help="concurrent streaming clients")
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of load")
    ap.add_argument("--disconnect-frac", type=float, default=0.3,
                    help="fraction of requests whose client hangs up mid-stream")
    ap.add_argument("--kv-blocks", type=int, default=160,
                    help="KV pool size (default ~10%% of 256 clients' demand: preemption); "
                         "0 = the server's default sizing")
    ap.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    ap.add_argument("--max-tokens-cap", type=int, default=64)
    ap.add_argument("--exact-pool", type=int, default=96,
                    help="distinct greedy/seeded requests, references computed up front")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--fuzz-threads", type=int, default=4,
                    help="fuzzing threads (hypothesis JSON bodies + raw HTTP) during the load")
    ap.add_argument("--fuzz-cases", type=int, default=1000,
                    help="hypothesis JSON cases on the idle server after the load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "cpu", "soak.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import env_info, write_json
    report = soak(args)
    report["env"] = env_info()
    print_table(report)
    write_json(args.out, report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
