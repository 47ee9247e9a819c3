"""Logits → tokens for one step, batched over requests.

Order (as vLLM): the grammar bitmask of constrained rows (`luceio.structured`: tokens the
grammar does not allow next to -inf), allowed_token_ids (every other token to -inf), logit_bias
(added) and min_tokens masking, repetition/frequency/presence penalties, then temperature,
min-p, top-k, top-p, then one draw. allowed_token_ids and logit_bias become index tensors for
one masked fill and one scatter-add over the whole batch. Greedy rows take the argmax of the
penalised logits. A draw is `argmax(probs / E)` with `E ~ Exp(1)` — an exact sample from `probs`
— where seeded requests draw E from their own generator, so their output does not depend on the
batch. Logprobs are of the raw model distribution (before any processing, the grammar's mask
included)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request
from .structured import apply_token_bitmask


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, tuple[float, int]] | None]  # per row: {token: (logprob, rank)}


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._global: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, reqs: list[Request],
                 bitmask: torch.Tensor | None = None) -> SamplerOutput:
        raw = logits
        logits = self.process(logits, reqs, bitmask)
        tokens = self.draw(logits, reqs)
        logprobs = self.logprobs(raw, tokens, [r.params.logprobs for r in reqs])
        return SamplerOutput(tokens.tolist(), logprobs)

    # processing --------------------------------------------------------------------------------
    def process(self, logits: torch.Tensor, reqs: list[Request],
                bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """Grammar masks, penalties, min_tokens, temperature and truncation; returns processed
        logits (greedy rows keep temperature 1 and no truncation). `bitmask`: [rows, words]
        int32 on the host, one bit per token id (1: allowed), or None."""
        logits = logits.clone()
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask)
        self._restrict_and_bias(logits, reqs)
        self._mask_min_tokens(logits, reqs)
        if any(_has_penalty(r) for r in reqs):
            self._apply_penalties(logits, reqs)
        p = [r.params for r in reqs]
        if all(x.greedy for x in p):
            return logits
        dev = logits.device
        temp = torch.tensor([1.0 if x.greedy else x.temperature for x in p], device=dev)
        logits.div_(temp[:, None])
        if any(x.min_p > 0 for x in p):
            min_p = torch.tensor([0.0 if x.greedy else x.min_p for x in p], device=dev)
            probs = logits.softmax(-1)
            logits.masked_fill_(probs < min_p[:, None] * probs.max(-1, keepdim=True).values,
                                float("-inf"))
        if any(x.top_k > 0 or x.top_p < 1.0 for x in p):
            top_k = [0 if x.greedy else x.top_k for x in p]
            top_p = [1.0 if x.greedy else x.top_p for x in p]
            logits = _top_k_top_p(logits, top_k, top_p)
        return logits

    @staticmethod
    def _restrict_and_bias(logits: torch.Tensor, reqs: list[Request]) -> None:
        dev = logits.device
        limited = [(i, r.params.allowed_token_ids) for i, r in enumerate(reqs)
                   if r.params.allowed_token_ids]
        if limited:
            banned = torch.zeros_like(logits, dtype=torch.bool)
            banned[torch.tensor([i for i, _ in limited], device=dev)] = True
            rows = torch.tensor([i for i, ids in limited for _ in ids], device=dev)
            cols = torch.tensor([t for _, ids in limited for t in ids], device=dev)
            banned[rows, cols] = False
            logits.masked_fill_(banned, float("-inf"))
        biased = [(i, r.params.logit_bias) for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased:
            rows = torch.tensor([i for i, bias in biased for _ in bias], device=dev)
            cols = torch.tensor([t for _, bias in biased for t in bias], device=dev)
            values = torch.tensor([v for _, bias in biased for v in bias.values()],
                                  dtype=logits.dtype, device=dev)
            logits.index_put_((rows, cols), values, accumulate=True)

    def _mask_min_tokens(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.params.min_tokens:
                banned = list(r.eos_token_ids | set(r.params.stop_token_ids))
                if banned:
                    logits[i, banned] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        n, vocab = logits.shape
        dev = logits.device
        counts = torch.zeros(n, vocab, device=dev)
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
        for i, r in enumerate(reqs):
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=dev)
            counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
            seen[i, torch.tensor(r.all_token_ids, dtype=torch.long, device=dev)] = True
        rep = torch.tensor([r.params.repetition_penalty for r in reqs], device=dev)[:, None]
        freq = torch.tensor([r.params.frequency_penalty for r in reqs], device=dev)[:, None]
        pres = torch.tensor([r.params.presence_penalty for r in reqs], device=dev)[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))
        logits.sub_(freq * counts + pres * (counts > 0))

    # drawing -----------------------------------------------------------------------------------
    def draw(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        argmax = logits.argmax(-1)
        flags = [r.params.greedy for r in reqs]
        if all(flags):
            return argmax
        greedy = torch.tensor(flags, device=logits.device)
        probs = logits.softmax(-1)
        noise = self.exponential(probs, reqs)
        sampled = (probs / noise).argmax(-1)
        return torch.where(greedy, argmax, sampled)

    def exponential(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Exp(1) noise shaped like `probs`; seeded rows from their request's generator."""
        noise = torch.empty_like(probs).exponential_(generator=self._global_gen(probs.device))
        for i, r in enumerate(reqs):
            if r.params.seed is not None and not r.params.greedy:
                noise[i].exponential_(generator=self.request_generator(r, probs.device))
        return noise

    def request_generator(self, req: Request, device: torch.device) -> torch.Generator:
        if req.generator is None:
            req.generator = torch.Generator(device=device).manual_seed(req.params.seed + req.index)
        return req.generator

    def _global_gen(self, device: torch.device) -> torch.Generator:
        if device not in self._global:
            self._global[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._global[device]

    # logprobs ----------------------------------------------------------------------------------
    @staticmethod
    def logprobs(raw: torch.Tensor, tokens: torch.Tensor, num: list[int | None]):
        """For rows that asked: the chosen token's logprob and rank (1 = most likely) and the
        top-n alternatives."""
        if all(k is None for k in num):
            return [None] * len(num)
        lp = raw.float().log_softmax(-1)
        chosen = lp.gather(1, tokens[:, None])[:, 0]
        ranks = (lp > chosen[:, None]).sum(-1) + 1
        k = max(x or 0 for x in num)
        top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
        out = []
        for i, n in enumerate(num):
            if n is None:
                out.append(None)
                continue
            d = {int(tokens[i]): (float(chosen[i]), int(ranks[i]))}
            for j in range(n):
                d.setdefault(int(top_i[i, j]), (float(top_v[i, j]), j + 1))
            out.append(d)
        return out


def _has_penalty(r: Request) -> bool:
    p = r.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.tensor([x if x > 0 else vocab for x in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits.masked_fill_(ranks >= k[:, None], float("-inf"))
    p = torch.tensor(top_p, device=logits.device)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    sorted_logits.masked_fill_(mass_before > p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
