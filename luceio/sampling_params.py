"""SamplingParams with vLLM's field names and defaults."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# stop strings are matched on the event loop after every step: bound the work one request adds
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # each output holds everything generated so far (vLLM's default)
    DELTA = 1  # each output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


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
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

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

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> "SamplingParams":
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d.update(changes)
        return SamplingParams(**d)
