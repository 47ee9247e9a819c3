"""llama.cpp's `POST /infill` (what llama.vim and llama.vscode call): its request bodies, the
end-of-generation rules llama.cpp's server applies itself, and its response shape. The FIM
prompt is built by `fim.py`; the route is in `routes_assist.py`.

Rules
- Each field of `HONOURED` is honoured with llama.cpp's meaning. `t_max_prompt_ms` is accepted
  and logged as not applied: llama.cpp's server reads it and does not apply it either. Any other
  field is refused with a 400 naming it.
- Sampling starts from llama.cpp's /completion defaults (`DEFAULTS`). luceio's sampler runs
  `CHAIN` (temperature, min_p, top_k, top_p) in that order. `samplers` (names, or a string of
  llama.cpp's letters) says which stages run, as in llama.cpp: a stage it leaves out is off.
  It is accepted when it names only `CHAIN`'s stages, each once, and lists every pair of stages
  that would not commute in `CHAIN`'s order. Two stages commute when either is a no-op at the
  request's values (top_k <= 0, top_p >= 1, min_p <= 0, temperature 1), when temperature is <= 0
  (greedy: every truncation keeps the most likely token), or when the pair is top_k with
  temperature or with min_p (each keeps a prefix of the same ranking). llama.cpp's other stages
  (`infill`, `dry`, `penalties`, ...) are refused: luceio's sampler has none of them.
  Without `samplers`, the stages run in luceio's order, not in llama.cpp's default order with
  temperature last: with temperature != 1, min_p and top_p keep a different set of tokens.
- `n_predict`: -1 no limit; 0 is one token, as in llama.cpp (its budget is checked only after a
  token; llama.vim's context-warming requests send 0); otherwise the limit.
- `n_indent` (llama.cpp's rule): each line after the first must start with at least n_indent
  spaces or tabs (a tab counts one). At the first line whose first other character (a newline
  too: an empty line) comes earlier, generation stops and the text is cut before that
  character. A line's leading whitespace is held back while it is undecided, so streamed text
  is cut the same way (llama.cpp streams the line's first token before it stops).
- `t_max_predict_ms`: once that long has passed since the first token, the next output holding a
  newline ends generation, its text kept whole (llama.cpp checks each token; an engine output is
  one token unless the event loop fell behind).
- Both stops report `stop_type` "limit", as llama.cpp does; the engine request is aborted.
- `response_fields`: the final response (the last chunk when streaming) carries only these
  fields, each keyed by its path as given ("timings/prompt_n"); paths not in the response are
  left out, as in llama.cpp.
- `n_cmpl` (llama.vscode sends 3 by default): that many completions of the one prompt, sampled
  independently (the prompt is prefilled once). As in llama.cpp, the response is then a JSON
  array of final results, one per completion, ordered by their `index`; each has its own
  n_indent and t_max_predict_ms stops and token counts. Streamed chunks carry their
  completion's `index`; the final chunks come after the last completion ends, in index order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..outputs import RequestOutput
from ..sampling_params import INFILL_MAX_TOP_K
from .fields import (MAX_N, bad, boolean, integer, number, seed, show, stop_strings,
                     string_list, text)
from .fim import FimFormat
from .responses import ResponseBuilder

# llama.cpp's /completion defaults, which its /infill shares
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
CHAIN = ("temperature", "min_p", "top_k", "top_p")
_OFF = {"temperature": 1.0, "min_p": 0.0, "top_k": 0, "top_p": 1.0}
_COMMUTING = {frozenset(("top_k", "temperature")), frozenset(("top_k", "min_p"))}
# llama.cpp's sampler letters (common_sampler_types_from_chars)
_LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p",
            "s": "top_n_sigma", "x": "xtc", "t": "temperature", "i": "infill", "e": "penalties"}
_CHUNK_FILENAME = "tmp"  # llama.cpp's name for a chunk that gives none

HONOURED = {
    "input_prefix": "text before the gap (default empty)",
    "input_suffix": "text after the gap (default empty)",
    "input_extra": "other files' chunks, [{filename (default 'tmp'), text}]; other chunk keys "
                   "(llama.vim's `time`) carry nothing for the prompt and are not read",
    "prompt": "the typed part of the current line, encoded after the prefix (text only)",
    "n_predict": "-1 (default): until a stop or the end of the context; 0: one token",
    "temperature": "default 0.8", "top_k": "default 40; <= 0 disables",
    "top_p": "default 0.95", "min_p": "default 0.05",
    "samplers": "the stages that run, in luceio's order (temperature, min_p, top_k, top_p)",
    "stop": "stop strings", "seed": "-1 (default) draws a random seed", "stream": "default false",
    "ignore_eos": "default false",
    "n_indent": "minimum indentation of the lines after the first (default 0: none)",
    "t_max_predict_ms": "stop at a newline after this long (default 0: no limit)",
    "response_fields": "the final response's fields, by path",
    "cache_prompt": "accepted: luceio always reuses cached prefixes",
    "id_slot": "accepted: luceio has no slots; its prefix cache serves every request",
    "n_cmpl": f"completions of the prompt, 1..{MAX_N} (default 1); more than one: a JSON array",
    "model": "the served model's name",
}
_NOT_APPLIED = {"t_max_prompt_ms": "llama.cpp's server does not apply it either"}
_REFUSED_WHY = {
    "repeat_penalty": "llama.cpp's penalty covers only the last repeat_last_n tokens",
    "presence_penalty": "llama.cpp's penalty covers only the last repeat_last_n tokens",
    "frequency_penalty": "llama.cpp's penalty covers only the last repeat_last_n tokens",
    "grammar": "send json_schema-constrained requests to /v1/completions",
    "json_schema": "send json_schema-constrained requests to /v1/completions",
}


@dataclass(frozen=True)
class InfillRequest:
    input_prefix: str
    input_suffix: str
    input_extra: list[dict]  # [{"filename": str, "text": str}]
    prompt: str
    max_tokens: int | None  # None: until a stop or the end of the context
    stream: bool
    model: str | None
    sampling: dict  # SamplingParams keyword arguments, max_tokens and stop_token_ids aside
    n_indent: int = 0
    t_max_predict_ms: int = 0
    response_fields: list[str] | None = None
    n_cmpl: int = 1
    warnings: list[str] = field(default_factory=list)

    def prompt_token_ids(self, fmt: FimFormat, tokenizer) -> list[int]:
        return fmt.build(tokenizer, self.input_prefix, self.input_suffix, self.input_extra,
                         prompt=self.prompt)

    def sampling_kwargs(self, fmt: FimFormat) -> dict:
        """SamplingParams keyword arguments (all but max_tokens), the format's stop tokens added."""
        return {**self.sampling, "n": self.n_cmpl, "stop_token_ids": list(fmt.stop_token_ids)}


def parse_infill(body: dict) -> InfillRequest:
    """A llama.cpp `/infill` body; raises `fields.APIError` (400, `param` = the field) for a
    field it does not honour or a value of the wrong type (see the module's rules)."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    for name in body:
        if name not in HONOURED and name not in _NOT_APPLIED:
            why = _REFUSED_WHY.get(name, "luceio's /infill does not honour it")
            raise bad(name, f"'{name}' is not supported: {why}")
    n_predict = integer(body, "n_predict", -1)
    if n_predict < -1:
        raise bad("n_predict", f"'n_predict' must be -1 (no limit) or at least 0, got {n_predict}")
    boolean(body, "cache_prompt", True)
    integer(body, "id_slot", -1)
    warnings = [f"'{name}' is accepted and not applied: {why}"
                for name, why in _NOT_APPLIED.items() if integer(body, name, None) is not None]
    n_cmpl = integer(body, "n_cmpl", 1)
    if not 1 <= n_cmpl <= MAX_N:
        raise bad("n_cmpl", f"'n_cmpl' must be in [1, {MAX_N}], got {n_cmpl}")
    sampling = dict(
        temperature=number(body, "temperature", DEFAULTS["temperature"]),
        top_k=max(integer(body, "top_k", DEFAULTS["top_k"]), 0),
        top_p=number(body, "top_p", DEFAULTS["top_p"]),
        min_p=number(body, "min_p", DEFAULTS["min_p"]),
        seed=None if body.get("seed") in (None, -1) else seed(body),
        stop=stop_strings(body),
        ignore_eos=boolean(body, "ignore_eos", False),
    )
    return InfillRequest(text(body, "input_prefix") or "", text(body, "input_suffix") or "",
                         _chunks(body.get("input_extra")), text(body, "prompt") or "",
                         None if n_predict == -1 else max(n_predict, 1),
                         boolean(body, "stream", False), text(body, "model"),
                         _samplers(body.get("samplers"), sampling),
                         n_indent=max(integer(body, "n_indent", 0), 0),
                         t_max_predict_ms=max(integer(body, "t_max_predict_ms", 0), 0),
                         response_fields=string_list(body, "response_fields"),
                         n_cmpl=n_cmpl, warnings=warnings)


def _chunks(extra) -> list[dict]:
    if extra is None:
        return []
    if not isinstance(extra, list):
        raise bad("input_extra", f"'input_extra' must be a list of {{filename, text}} objects, "
                  f"got {show(extra)}")
    chunks = []
    for i, chunk in enumerate(extra):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise bad(where, f"'{where}' must be an object with a string 'text'")
        filename = chunk.get("filename", _CHUNK_FILENAME)
        if not isinstance(filename, str):
            raise bad(where, f"'{where}.filename' must be a string, got {show(filename)}")
        chunks.append({"filename": filename, "text": chunk["text"]})
    return chunks


def _samplers(value, sampling: dict) -> dict:
    """`sampling` with the stages `samplers` leaves out switched off (see the module's rules)."""
    if value is None:
        return sampling
    if isinstance(value, str):
        names = [_LETTERS.get(c, c) for c in value]
    elif isinstance(value, list) and all(isinstance(n, str) for n in value):
        names = value
    else:
        raise bad("samplers", f"'samplers' must be a list of sampler names or a string of "
                  f"their letters, got {show(value)}")
    infill = "infill" in names
    if infill:  # llama.cpp's infill stage runs here after the whole chain: it must come last
        if names[-1] != "infill":
            raise bad("samplers", "'samplers': luceio runs the infill stage after temperature, "
                      "min_p, top_k and top_p; list it last")
        if not 0 < sampling["top_k"] <= INFILL_MAX_TOP_K or "top_k" not in names:
            raise bad("samplers", f"'samplers': the infill stage needs top_k in "
                      f"1..{INFILL_MAX_TOP_K} before it (it compares every pair of candidates)")
        names = names[:-1]
    for name in names:
        if name not in CHAIN:
            raise bad("samplers", f"'samplers': luceio has no {show(name)} sampler; it runs "
                      f"{', '.join(CHAIN)} in that order (then infill), and samplers may name "
                      "only those")
    if len(set(names)) < len(names):
        raise bad("samplers", f"'samplers' names a sampler twice: {show(value)}")
    sampling = {**sampling, **{k: v for k, v in _OFF.items() if k not in names},
                "infill_sampler": infill}
    if sampling["temperature"] <= 0:  # greedy
        return sampling
    active = [n for n in names if sampling[n] != _OFF[n]]
    for i, a in enumerate(active):
        for b in active[i + 1:]:
            if CHAIN.index(a) > CHAIN.index(b) and frozenset((a, b)) not in _COMMUTING:
                raise bad("samplers", f"'samplers' runs {a} before {b}; luceio's sampler runs "
                          f"{b} first, which keeps a different set of tokens")
    return sampling


class _Stops:
    """llama.cpp's n_indent and t_max_predict_ms rules over the generated text (see the
    module's rules). `feed` takes each output's text and returns the text that may be sent;
    `stopped` is True once a rule ended the generation."""

    def __init__(self, n_indent: int, t_max_predict_ms: int):
        self.n_indent, self.t_max_s = n_indent, t_max_predict_ms / 1e3
        self.text = ""
        self.sent = 0  # characters of `text` released
        self.scan = 0  # where to look for the next newline (the first line is never checked)
        self.line: int | None = None  # start of the undecided line after a newline, if any
        self.stopped = False

    def feed(self, piece: str, elapsed_s: float) -> str:
        self.text += piece
        end = self._check_indent() if self.n_indent > 0 else len(self.text)
        if self.t_max_s > 0 and "\n" in piece and elapsed_s > self.t_max_s:
            self.stopped = True
        return self.release(len(self.text) if self.stopped else end)

    def release(self, end: int | None = None) -> str:
        """The text up to `end` (all of it by default) not sent yet."""
        end = len(self.text) if end is None else end
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def _check_indent(self) -> int:
        """Decides the lines that can be; returns where the releasable text ends."""
        while True:
            if self.line is None:
                newline = self.text.find("\n", self.scan)
                if newline < 0:
                    self.scan = len(self.text)
                    return len(self.text)
                self.line = newline + 1
            first = self.line
            while first < len(self.text) and self.text[first] in " \t":
                first += 1
            if first == len(self.text):
                return self.line  # only indentation so far: held back
            if first - self.line < self.n_indent:
                self.stopped = True
                self.text = self.text[:first]
                return first
            self.line, self.scan = None, first


class InfillWire:
    """llama.cpp's /infill response (`driver.Wire`): `{"index", "content", "stop": false}`
    chunks, then one with `stop: true`, the token counts, `stop_type` (eos, limit or word) with
    the `stopping_word`, and `timings`, per completion (`n_cmpl`; more than one: the response
    is their array). `tokens_cached` and `timings.cache_n` count the prompt tokens read from the
    prefix cache."""
    ping_event = None

    def __init__(self, builder: ResponseBuilder, fill: InfillRequest, model: str, cached: int):
        self.builder, self.fill, self.model, self.cached = builder, fill, model, cached
        n = fill.n_cmpl
        self.stops = [_Stops(fill.n_indent, fill.t_max_predict_ms) for _ in range(n)]
        self.text: list[list[str]] = [[] for _ in range(n)]
        self.predicted: list[int | None] = [None] * n  # tokens when a stop rule ended a choice
        self.first: float | None = None  # when the first token was sampled (monotonic)
        self.arrival: float | None = None
        self.stop_reason: str | None = None

    def start(self) -> list:
        return []

    def step(self, prompt_index: int, ro: RequestOutput) -> list:
        now = time.monotonic()
        if self.first is None:
            m = ro.metrics
            self.arrival = m.arrival_time if m is not None else now
            self.first = m.first_token_time if m is not None and m.first_token_time else now
        out = []
        for index, deltas in self.builder.absorb_each(prompt_index, ro):
            stops = self.stops[index]
            for delta in deltas:
                if stops.stopped:
                    break
                piece = stops.feed(delta.text, now - self.first)
                if piece:
                    self.text[index].append(piece)
                    out.append({"index": index, "content": piece, "stop": False})
            if stops.stopped and self.predicted[index] is None:
                self.predicted[index] = self.builder.choice_tokens(index)
        # a choice a rule stopped runs on in the engine: the run stops once every choice is done
        if any(s.stopped for s in self.stops) and all(
                s.stopped or self.builder.finish(i)[0] is not None
                for i, s in enumerate(self.stops)):
            self.stop_reason = "length"  # llama.cpp's STOP_TYPE_LIMIT
        return out

    def end(self) -> list:
        out = []
        for index, stops in enumerate(self.stops):
            if not stops.stopped:
                out += self._held(index)
            out.append(self._final(index, ""))
        return out

    def _held(self, index: int) -> list:
        piece = self.stops[index].release()
        if piece:
            self.text[index].append(piece)
        return [{"index": index, "content": piece, "stop": False}] if piece else []

    @staticmethod
    def fail(message: str) -> list:
        return [{"error": {"code": 500, "message": message, "type": "server_error"}}]

    def response(self) -> dict | list:
        finals = [self._final(i, "".join(text)) for i, text in enumerate(self.text)]
        return finals[0] if len(finals) == 1 else finals

    def _final(self, index: int, content: str) -> dict:
        reason, word = self.builder.finish(index)
        stops = self.stops[index]
        prompt_tokens = self.builder.usage()["prompt_tokens"]
        predicted = self.predicted[index]
        if predicted is None:
            predicted = self.builder.choice_tokens(index)
        stopped = stops.stopped or reason == "length"
        stop_type = "limit" if stopped else "word" if word is not None else "eos"
        body = {"index": index, "content": content, "stop": True, "model": self.model,
                "tokens_predicted": predicted,
                "tokens_evaluated": prompt_tokens, "tokens_cached": self.cached,
                "truncated": False, "stop_type": stop_type,
                "stopping_word": word if word is not None and not stops.stopped else "",
                "timings": self._timings(prompt_tokens - self.cached, predicted)}
        return body if self.fill.response_fields is None else \
            pick_fields(body, self.fill.response_fields)

    def _timings(self, prompt_n: int, predicted_n: int) -> dict:
        prompt_ms = (self.first - self.arrival) * 1e3 if self.first is not None else 0.0
        predicted_ms = (time.monotonic() - self.first) * 1e3 if self.first is not None else 0.0
        return {"cache_n": self.cached,
                "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": prompt_n * 1e3 / prompt_ms if prompt_ms > 0 else 0.0,
                "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
                "predicted_per_second": predicted_n * 1e3 / predicted_ms
                if predicted_ms > 0 else 0.0}


def pick_fields(body: dict, paths: list[str]) -> dict:
    """llama.cpp's response_fields: each path ("timings/prompt_n") that leads to a value in
    `body`, keyed by the path itself."""
    out = {}
    for path in paths:
        value, found = body, True
        for key in path.split("/"):
            if not (isinstance(value, dict) and key in value):
                found = False
                break
            value = value[key]
        if found:
            out[path] = value
    return out
