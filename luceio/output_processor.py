"""Per user request: detokenize each sample incrementally, apply stop strings with hold-back
(a stop string never leaks into streamed text), and build vLLM-shaped RequestOutputs in
cumulative, delta or final-only mode.

This runs on the event loop after every step, so a step's work here is proportional to what
the step added: stop strings are found in one scan of the new text, and Logprob objects are
built once per position (cumulative outputs copy the list, not its entries)."""
from __future__ import annotations

import bisect
import re
import time

from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .request import Request, RequestStatus
from .sampling_params import RequestOutputKind, SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer


class StopStrings:
    """A request's stop strings as one regex, compiled once per request."""

    def __init__(self, stops: list[str]):
        self.longest = max(len(s) for s in stops)
        # the lookahead reports every start position; the alternatives go shortest first, so
        # each start reports the stop that completes first there
        alternatives = "|".join(re.escape(s) for s in sorted(stops, key=len))
        self._pattern = re.compile(f"(?=({alternatives}))")

    def first_hit(self, text: str, start: int, token_ends: list[int],
                  first_token: int) -> tuple[int, int, str] | None:
        """The stop a token-by-token check finds first, as (token index, position, stop).
        `token_ends[j]`: len(text) once new token j is decoded; the check looks at `text[start:]`
        from token `first_token` on (min_tokens). The earliest completing token wins, then the
        leftmost position."""
        best = None
        for m in self._pattern.finditer(text, start):
            stop = m.group(1)
            j = max(bisect.bisect_left(token_ends, m.start() + len(stop)), first_token)
            if best is None or (j, m.start()) < best[:2]:
                best = (j, m.start(), stop)
        return best


class SampleState:
    """One sample's text and what has been emitted of it."""

    def __init__(self, req: Request, tokenizer: Tokenizer | None, stops: StopStrings | None):
        self.req = req
        self.stops = stops
        self.detok = (IncrementalDetokenizer(tokenizer, req.prompt_token_ids,
                                             req.params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.text = ""
        self.num_tokens_seen = 0
        self.emitted_tokens = 0
        self.emitted_chars = 0
        self.finished_sent = False
        self.logprobs: list[dict[int, Logprob]] = []  # built so far, one dict per output token

    def absorb(self) -> str | None:
        """Detokenizes new tokens; returns the stop string hit, if any. A stop string ends the
        output where it completes: tokens accepted after it in the same step (speculation) are
        dropped, so the tokens match decoding one at a time. Stop strings count only once
        `min_tokens` tokens exist."""
        req = self.req
        seen = self.num_tokens_seen
        new = req.all_token_ids[req.num_prompt_tokens + seen:]  # not the whole output, copied
        self.num_tokens_seen += len(new)
        if self.detok is None or not new:
            return None
        text_tokens = new
        if req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None \
                and new[-1] in req.eos_token_ids:
            text_tokens = new[:-1]  # eos is in token_ids, not in text
        first = max(req.params.min_tokens - seen - 1, 0)  # stops count from this new token on
        if self.stops is None or req.status == RequestStatus.FINISHED_ABORTED or \
                first >= len(text_tokens):
            self.text += self.detok.add(text_tokens) if text_tokens else ""
            return None
        ends = [len(self.text)]  # one token at a time: a stop drops the tokens after its own
        for tok in text_tokens:
            self.text += self.detok.add([tok])
            ends.append(len(self.text))
        hit = self.stops.first_hit(self.text, max(ends[first] - self.stops.longest + 1, 0),
                                   ends[1:], first)
        if hit is None:
            return None
        j, i, stop = hit
        keep = len(stop) if req.params.include_stop_str_in_output else 0
        self.text = self.text[:i + keep]
        drop = len(new) - (j + 1)
        if drop:
            req.drop_last_tokens(drop)
            self.num_tokens_seen -= drop
        return stop

    def visible_text(self) -> str:
        """Text safe to show: while running, hold back what could be the start of a stop string."""
        p = self.req.params
        if self.req.is_finished or self.stops is None or p.include_stop_str_in_output:
            return self.text
        hold = self.stops.longest - 1
        return self.text[:max(len(self.text) - hold, 0)]


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, samples: list[Request], tokenizer: Tokenizer | None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        tokenizer = tokenizer if params.detokenize else None  # ids only: no text, no token strings
        stops = StopStrings(params.stop) if params.stop else None
        self.samples = [SampleState(r, tokenizer, stops) for r in samples]
        self.tokenizer = tokenizer
        self.arrival_time = samples[0].arrival_time
        self.prompt_logprobs: list[dict[int, Logprob] | None] = []  # built so far
        self.prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        for s in self.samples:
            if not s.req.is_finished:
                return False
        return True

    def make_output(self) -> RequestOutput | None:
        kind = self.params.output_kind
        finished = self.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        outs = [o for s in self.samples if (o := self._completion(s, kind)) is not None]
        if not outs and not finished:
            return None
        lead = self.samples[0].req
        send_prompt_lps = kind != RequestOutputKind.DELTA or not self.prompt_logprobs_sent
        prompt_lps = (self._prompt_logprobs(lead) if send_prompt_lps and
                      self.params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = self.prompt_logprobs_sent or prompt_lps is not None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_lps,
                             outs, finished, self._metrics(finished),
                             num_cached_tokens=lead.num_cached_tokens)

    def _completion(self, s: SampleState, kind: RequestOutputKind) -> CompletionOutput | None:
        r = s.req
        text = s.visible_text()
        first, seen = r.num_prompt_tokens, s.num_tokens_seen
        lps = self._logprobs(s) if r.params.logprobs is not None else None
        done = r.is_finished
        if kind == RequestOutputKind.DELTA:
            if seen == s.emitted_tokens and len(text) == s.emitted_chars and \
                    (not done or s.finished_sent):
                return None
            # only the new tokens are copied: a long output costs nothing more per step
            tokens_out = r.all_token_ids[first + s.emitted_tokens:first + seen]
            text_out = text[s.emitted_chars:]
            lps = lps[s.emitted_tokens:] if lps is not None else None
        else:
            tokens_out, text_out = r.all_token_ids[first:first + seen], text
            lps = list(lps) if lps is not None else None  # later steps extend the built list
        s.emitted_chars = len(text)
        s.emitted_tokens = seen
        s.finished_sent = done
        return CompletionOutput(r.index, text_out, tokens_out,
                                r.cumulative_logprob if r.params.logprobs is not None else None,
                                lps, r.status.finish_reason, r.stop_reason)

    def _logprobs(self, s: SampleState) -> list[dict[int, Logprob]]:
        """The sample's Logprobs: built for the positions added since the last output only."""
        s.logprobs.extend(self._entries(d) for d in s.req.output_logprobs[len(s.logprobs):])
        return s.logprobs

    def _prompt_logprobs(self, r: Request) -> list[dict[int, Logprob] | None]:
        built = self.prompt_logprobs
        built.extend(None if d is None else self._entries(d)
                     for d in r.prompt_logprobs[len(built):])
        return list(built)

    def _entries(self, d: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        return {t: Logprob(lp, rank, self._tok_text(t)) for t, (lp, rank) in d.items()}

    def _tok_text(self, t: int) -> str | None:
        return self.tokenizer.id_to_token_text(t) if self.tokenizer is not None else None

    def _metrics(self, finished: bool) -> RequestMetrics:
        if len(self.samples) == 1:  # the common case, without the sums
            r = self.samples[0].req
            return RequestMetrics(self.arrival_time, r.first_token_time,
                                  time.monotonic() if finished else None,
                                  len(self.prompt_token_ids), r.num_cached_tokens,
                                  len(r.all_token_ids) - len(r.prompt_token_ids),
                                  r.num_draft_tokens, r.num_accepted_tokens)
        reqs = [s.req for s in self.samples]
        firsts = [r.first_token_time for r in reqs if r.first_token_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time, first_token_time=min(firsts) if firsts else None,
            finished_time=time.monotonic() if finished else None,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=reqs[0].num_cached_tokens,
            num_generated_tokens=sum(r.num_output_tokens for r in reqs),
            num_draft_tokens=sum(r.num_draft_tokens for r in reqs),
            num_accepted_tokens=sum(r.num_accepted_tokens for r in reqs))
