"""Per user request: detokenize each sample incrementally, apply stop strings with hold-back
(a stop string never leaks into streamed text), and build vLLM-shaped RequestOutputs in
cumulative, delta or final-only mode."""
from __future__ import annotations

import time

from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .request import Request, RequestStatus
from .sampling_params import RequestOutputKind, SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer


class SampleState:
    """One sample's text and what has been emitted of it."""

    def __init__(self, req: Request, tokenizer: Tokenizer | None):
        self.req = req
        self.detok = (IncrementalDetokenizer(tokenizer, req.prompt_token_ids,
                                             req.params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.text = ""
        self.num_tokens_seen = 0
        self.emitted_tokens = 0
        self.emitted_chars = 0
        self.finished_sent = False

    def absorb(self) -> str | None:
        """Detokenizes new tokens; returns the stop string hit, if any. A stop string ends the
        output where it completes: tokens accepted after it in the same step (speculation) are
        dropped, so the tokens match decoding one at a time. Stop strings count only once
        `min_tokens` tokens exist."""
        req = self.req
        seen = self.num_tokens_seen
        new = req.output_token_ids[seen:]
        self.num_tokens_seen += len(new)
        if self.detok is None or not new:
            return None
        text_tokens = new
        if req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None \
                and new[-1] in req.eos_token_ids:
            text_tokens = new[:-1]  # eos is in token_ids, not in text
        stops = req.params.stop if req.status != RequestStatus.FINISHED_ABORTED else []
        if not stops:
            self.text += self.detok.add(text_tokens) if text_tokens else ""
            return None
        longest = max(len(s) for s in stops)
        for j, tok in enumerate(text_tokens):
            before = len(self.text)
            self.text += self.detok.add([tok])
            if seen + j + 1 < req.params.min_tokens:
                continue
            start = max(0, before - longest + 1)
            hits = [(i, s) for s in stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                i, stop = min(hits)
                keep = len(stop) if req.params.include_stop_str_in_output else 0
                self.text = self.text[:i + keep]
                drop = len(new) - (j + 1)
                if drop:
                    req.drop_last_tokens(drop)
                    self.num_tokens_seen -= drop
                return stop
        return None

    def visible_text(self) -> str:
        """Text safe to show: while running, hold back what could be the start of a stop string."""
        p = self.req.params
        if self.req.is_finished or not p.stop or p.include_stop_str_in_output:
            return self.text
        hold = max(len(s) for s in p.stop) - 1
        return self.text[:max(len(self.text) - hold, 0)]


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, samples: list[Request], tokenizer: Tokenizer | None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.samples = [SampleState(r, tokenizer) for r in samples]
        self.tokenizer = tokenizer
        self.arrival_time = samples[0].arrival_time
        self.prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        return all(s.req.is_finished for s in self.samples)

    def make_output(self) -> RequestOutput | None:
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        outs = [o for s in self.samples if (o := self._completion(s, kind)) is not None]
        if not outs and not self.finished:
            return None
        lead = self.samples[0].req
        send_prompt_lps = kind != RequestOutputKind.DELTA or not self.prompt_logprobs_sent
        prompt_lps = (self._prompt_logprobs(lead) if send_prompt_lps and
                      self.params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = self.prompt_logprobs_sent or prompt_lps is not None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_lps,
                             outs, self.finished, self._metrics(),
                             num_cached_tokens=lead.num_cached_tokens)

    def _completion(self, s: SampleState, kind: RequestOutputKind) -> CompletionOutput | None:
        r = s.req
        text = s.visible_text()
        tokens = r.output_token_ids[:s.num_tokens_seen]
        lps = self._logprobs(r) if r.params.logprobs is not None else None
        done = r.is_finished
        if kind == RequestOutputKind.DELTA:
            if len(tokens) == s.emitted_tokens and len(text) == s.emitted_chars and \
                    (not done or s.finished_sent):
                return None
            text, tokens_out = text[s.emitted_chars:], tokens[s.emitted_tokens:]
            lps = lps[s.emitted_tokens:] if lps is not None else None
        else:
            tokens_out = tokens
        s.emitted_chars = len(s.visible_text())
        s.emitted_tokens = len(tokens)
        s.finished_sent = done
        return CompletionOutput(r.index, text, list(tokens_out),
                                r.cumulative_logprob if r.params.logprobs is not None else None,
                                lps, r.status.finish_reason, r.stop_reason)

    def _logprobs(self, r: Request) -> list[dict[int, Logprob]]:
        return [{t: Logprob(lp, rank, self._tok_text(t)) for t, (lp, rank) in d.items()}
                for d in r.output_logprobs]

    def _prompt_logprobs(self, r: Request):
        return [None if d is None else
                {t: Logprob(lp, rank, self._tok_text(t)) for t, (lp, rank) in d.items()}
                for d in r.prompt_logprobs]

    def _tok_text(self, t: int) -> str | None:
        return self.tokenizer.id_to_token_text(t) if self.tokenizer is not None else None

    def _metrics(self) -> RequestMetrics:
        reqs = [s.req for s in self.samples]
        firsts = [r.first_token_time for r in reqs if r.first_token_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time, first_token_time=min(firsts) if firsts else None,
            finished_time=time.monotonic() if self.finished else None,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=reqs[0].num_cached_tokens,
            num_generated_tokens=sum(r.num_output_tokens for r in reqs),
            num_draft_tokens=sum(r.num_draft_tokens for r in reqs),
            num_accepted_tokens=sum(r.num_accepted_tokens for r in reqs))
