"""SamplingParams with vLLM's field names and defaults.

Rules: every field is honoured or refused at construction with a ValueError naming it, never
dropped. `logit_bias` (clamped to [-100, 100], as vLLM and OpenAI do) and `allowed_token_ids` are
applied by the sampler to the logits before any penalty; `detokenize=False` leaves output text
empty (so stop strings need it True); `bad_words` is refused for now. `structured_outputs` /
`guided_decoding` (vLLM's older name: give one) take vLLM's parameter classes below and are
enforced by grammar masks (`luceio.structured`); the grammar decides where the output ends, so
`min_tokens` cannot be combined with them."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# stop strings are matched on the event loop after every step: bound the work one request adds
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
LOGIT_BIAS_LIMIT = 100.0
# HF generation_config.json keys that set sampling defaults (vLLM's generation_config="auto")
_GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                           "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                           "max_new_tokens": "max_tokens"}


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # each output holds everything generated so far (vLLM's default)
    DELTA = 1  # each output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


INFILL_MAX_TOP_K = 1024


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    use_speculation: bool = True  # per-request opt-out of speculative decoding
    spec_prefill_keep: float | None = None  # per-request speculative-prefill keep ratio
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None
    # llama.cpp's `infill` sampler stage after top-k / top-p (luceio.infill_sampling), as
    # llama.vim's /infill requests ask for; needs top_k in 1..INFILL_MAX_TOP_K
    infill_sampler: bool = False
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: GuidedDecodingParams | None = None  # vLLM's older name of the same
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.guided_decoding is not None and self.structured_outputs is None:
            self.structured_outputs = self.guided_decoding
        self._verify()
        self._refuse_unsupported()

    def _verify(self) -> None:
        self._verify_stop_limits()
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0.0, "must be non-negative"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1 (disable), 0 (disable) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be positive"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must not exceed max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "must be in [0, 20]"),
            ("spec_prefill_keep", self.spec_prefill_keep is None or
             0.0 < self.spec_prefill_keep <= 1.0, "must be in (0, 1]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop),
             "must be non-empty strings"),
            ("allowed_token_ids", self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "must not be empty (None allows every token)"),
            ("stop", self.detokenize or not self.stop, "needs detokenize=True (stop strings are "
             "matched on the output text)"),
            ("guided_decoding", self.guided_decoding in (None, self.structured_outputs),
             "is vLLM's older name of structured_outputs: give one of them"),
            ("structured_outputs", self.structured_outputs is None or
             isinstance(self.structured_outputs, StructuredOutputsParams),
             "must be a StructuredOutputsParams"),
            ("top_k", not self.infill_sampler or 0 < self.top_k <= INFILL_MAX_TOP_K,
             f"must be in 1..{INFILL_MAX_TOP_K} with the infill sampler (it compares every pair "
             "of the candidates top-k leaves)"),
            ("min_tokens", self.structured_outputs is None or self.min_tokens == 0,
             "cannot be combined with structured_outputs (the grammar decides where the output "
             "ends)"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

    def _verify_stop_limits(self) -> None:
        """Before the other checks: their message quotes the whole list."""
        longest = max((len(s) for s in self.stop if isinstance(s, str)), default=0)
        if len(self.stop) > MAX_STOP_STRINGS or longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop allows at most {MAX_STOP_STRINGS} strings of at most "
                             f"{MAX_STOP_STRING_CHARS} characters each, got {len(self.stop)} "
                             f"strings, the longest {longest} characters")

    def _refuse_unsupported(self) -> None:
        if self.bad_words:
            raise ValueError("bad_words is not supported yet; allowed_token_ids or logit_bias "
                             "(-100) can ban single tokens")

    @classmethod
    def from_generation_config(cls, config: dict, **changes) -> "SamplingParams":
        """The defaults a model ships in its generation_config.json (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens as max_tokens), as vLLM's default
        generation_config="auto" reads them; fields it does not set keep SamplingParams'."""
        kw = {ours: config[key] for key, ours in _GENERATION_CONFIG_KEYS.items()
              if config.get(key) is not None}
        return cls(**{**kw, **changes})

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> "SamplingParams":
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d.update(changes)
        return SamplingParams(**d)


def _logit_bias(bias: dict | None) -> dict[int, float] | None:
    """Token ids as ints (JSON keys arrive as strings), values clamped to +-100 as vLLM does."""
    if not bias:
        return None
    out = {}
    for token, value in bias.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite numbers, got {value!r} for {token!r}")
        try:
            token_id = int(token)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {token!r}") from None
        out[token_id] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
    return out


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
GRAMMAR_BACKENDS = ("auto", "xgrammar")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint: exactly one of json (a JSON schema, dict or text),
    regex, choice (a list of strings), grammar (EBNF, as xgrammar reads it), json_object (any
    JSON object) or structural_tag (xgrammar's structural tag JSON), plus vLLM's options:
    disable_any_whitespace (no whitespace between JSON tokens), disable_additional_properties and
    disable_fallback (always so here: schemas are strict and there is no fallback backend).
    whitespace_pattern is refused (xgrammar has no such option)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        kinds = [k for k in _CONSTRAINTS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"give one kind of structured-output constraint (one of "
                             f"{', '.join(_CONSTRAINTS)}), got {kinds or 'none'}")
        checks = [
            ("json", self.json is None or isinstance(self.json, (str, dict)),
             "must be a JSON schema (a dict or its JSON text)"),
            ("choice", self.choice is None or (isinstance(self.choice, list) and self.choice and
                                               all(isinstance(c, str) for c in self.choice)),
             "must be a non-empty list of strings"),
            ("whitespace_pattern", self.whitespace_pattern is None,
             "is not supported (xgrammar has no such option); disable_any_whitespace=True "
             "allows no whitespace"),
        ] + [(k, getattr(self, k) is None or isinstance(getattr(self, k), str), "must be a string")
             for k in ("regex", "grammar", "structural_tag")]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's name for StructuredOutputsParams before 0.11, with its `backend` choice (luceio's
    is xgrammar: "auto" and "xgrammar" are accepted, others refused)."""
    backend: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.backend is not None and self.backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not available: luceio's structured "
                             f"outputs run on xgrammar (give one of {GRAMMAR_BACKENDS} or None)")
