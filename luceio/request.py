"""One sequence's state. A user request with n > 1 becomes n sequences (`Request`s) that
share the prompt's KV blocks through the prefix cache."""
from __future__ import annotations

import enum
import time

import torch  # noqa: F401  (generator type)

from .sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# plain ints: these are read per request per step, where an enum's properties cost
_FIRST_FINISHED = int(RequestStatus.FINISHED_STOPPED)
_FINISH_REASONS = {3: "stop", 4: "length", 5: "abort"}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], max_model_len: int, parent_id: str | None = None,
                 index: int = 0, arrival_time: float | None = None,
                 position_ids: list[int] | None = None, num_original_prompt_tokens: int | None = None):
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index  # sample index within the parent (n > 1)
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.max_model_len = max_model_len
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission
        self.spec_token_ids: list[int] = []  # drafts scheduled for verification
        self.spec_tree = None  # their `spec.tree.DraftTree` (tree speculation): tokens == them
        # overlapped scheduling: tokens a step in flight samples, counted as computed work
        # before their ids reach the host (then `Scheduler.update` appends them)
        self.num_pending_tokens = 0
        self.draft_probs = None  # [len(spec_token_ids), vocab] when a draft model sampled them
        self.arrival_time = arrival_time or time.monotonic()
        self.first_token_time: float | None = None
        self.prefill_leader: Request | None = None  # n > 1: wait until its prompt is cached
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict] = []  # per output token: {token_id: (logprob, rank)}
        self.prompt_logprobs: list[dict | None] = []
        # seeded sampling: one generator per device, made by the sampler (request_generator)
        self.generators: dict[torch.device, torch.Generator] = {}
        # speculative prefill: the prompt holds only the kept tokens, at these original positions;
        # tokens after the prompt continue from the original prompt's length
        self.position_ids = position_ids
        self.num_original_prompt_tokens = num_original_prompt_tokens or len(prompt_token_ids)
        room = max_model_len - self.num_original_prompt_tokens
        self._max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)

    # derived counts, never stored twice
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_tokens_with_spec(self) -> int:
        """The count `num_computed_tokens` catches up with: known tokens, those still on the
        device (overlapped scheduling) and drafts to verify."""
        return len(self.all_token_ids) + self.num_pending_tokens + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED

    def positions(self, start: int, end: int) -> list[int] | range:
        """Rotary positions of the tokens at cache indices start..end-1."""
        if self.position_ids is None:
            return range(start, end)
        shift = self.num_original_prompt_tokens - self.num_prompt_tokens
        return [self.position_ids[i] if i < self.num_prompt_tokens else i + shift
                for i in range(start, end)]

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: the params' cap, bounded by the model's context."""
        return self._max_tokens

    def drop_last_tokens(self, n: int) -> None:
        """Removes the last n output tokens (a stop string completed before them)."""
        for _ in range(n):
            tok = self.all_token_ids.pop()
            if len(self.output_logprobs) > self.num_output_tokens:
                self.cumulative_logprob -= self.output_logprobs.pop()[tok][0]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Token-level stop rules after an append; sets status. Stop strings are checked by
        the output processor, which sees text."""
        n_out = len(self.all_token_ids) - len(self.prompt_token_ids)
        last = self.all_token_ids[-1]
        params = self.params
        if n_out >= params.min_tokens:
            if last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and last in params.stop_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
                return True
        if n_out >= self._max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
