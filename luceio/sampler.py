"""Logits → tokens for one step, batched over requests.

Order (as vLLM): the grammar bitmask of constrained rows (`luceio.structured`: tokens the
grammar does not allow next to -inf), allowed_token_ids (every other token to -inf), logit_bias
(added) and min_tokens masking, repetition/frequency/presence penalties, then temperature,
min-p, top-k, top-p, then one draw. allowed_token_ids and logit_bias become index tensors for
one masked fill and one scatter-add over the whole batch. Greedy rows take the argmax of the
penalised logits. A draw is `argmax(probs / E)` with `E ~ Exp(1)` — an exact sample from `probs`
— where seeded requests draw E from their own generator, so their output does not depend on the
batch. Logprobs are of the raw model distribution (before any processing, the grammar's mask
included).

No host round trip: everything stays on the logits' device — the sampled ids and the logprob
tensors come back as device tensors, per-row parameters go up through pinned memory without
waiting for the device (`device_tensor`), and a row's token still in flight (overlapped
scheduling, `Pending`) joins the penalty counts on the device. The host reads the results only
at output processing (`LogprobTensors.to_dicts`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .request import Request
from .structured import apply_token_bitmask


@dataclass
class LogprobTensors:
    """Per row: the logprob and rank (1 = most likely) of one token, and the top-k tokens."""
    token_ids: torch.Tensor  # [rows] int64
    chosen: torch.Tensor  # [rows] fp32
    ranks: torch.Tensor  # [rows] int64
    top_values: torch.Tensor  # [rows, k] fp32
    top_ids: torch.Tensor  # [rows, k] int64

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def to_dicts(self, num: list[int | None]) -> list[dict[int, tuple[float, int]] | None]:
        """{token: (logprob, rank)} for each row that asked for `num[i]` alternatives (read these
        tensors on the host)."""
        tokens, chosen, ranks = self.token_ids.tolist(), self.chosen.tolist(), self.ranks.tolist()
        top_v, top_i = self.top_values.tolist(), self.top_ids.tolist()
        out = []
        for i, n in enumerate(num):
            if n is None:
                out.append(None)
                continue
            d = {tokens[i]: (chosen[i], ranks[i])}
            for j in range(n):
                d.setdefault(top_i[i][j], (top_v[i][j], j + 1))
            out.append(d)
        return out


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64, on the logits' device
    logprobs: LogprobTensors | None  # None when no row asked


@dataclass
class Pending:
    """Rows whose latest token is still on the device (overlapped scheduling): row `rows[i]`
    of the batch has token `token_ids[i]` [len(rows)], not yet in its request's token list."""
    rows: list[int]
    token_ids: torch.Tensor


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without waiting for the device: through pinned memory and
    a non-blocking copy (a pageable copy would first wait for all queued work)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


class Sampler:
    def __init__(self, seed: int = 0, piece=None):
        self.seed = seed
        self._global: dict[torch.device, torch.Generator] = {}
        self.piece = piece  # token id -> its text as bytes (the infill stage's prefix test)

    def __call__(self, logits: torch.Tensor, reqs: list[Request],
                 bitmask: torch.Tensor | None = None,
                 pending: Pending | None = None) -> SamplerOutput:
        raw = logits
        logits = self.process(logits, reqs, bitmask, pending)
        tokens = self.draw(logits, reqs)
        return SamplerOutput(tokens, self.logprob_tensors(raw, tokens,
                                                          [r.params.logprobs for r in reqs]))

    # processing --------------------------------------------------------------------------------
    def process(self, logits: torch.Tensor, reqs: list[Request],
                bitmask: torch.Tensor | None = None,
                pending: Pending | None = None) -> torch.Tensor:
        """Grammar masks, penalties, min_tokens, temperature and truncation; returns processed
        logits (greedy rows keep temperature 1 and no truncation). `bitmask`: [rows, words]
        int32 on the host, one bit per token id (1: allowed), or None. `pending`: tokens of
        these rows still on the device, which count as output tokens."""
        if bitmask is None and all(_untouched_greedy(r) for r in reqs):
            return logits  # nothing to apply: the batch's common case, without the copy
        logits = logits.clone()
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask)
        self._restrict_and_bias(logits, reqs)
        self._mask_min_tokens(logits, reqs)
        if any(has_penalty(r) for r in reqs):
            self._apply_penalties(logits, reqs, pending)
        p = [r.params for r in reqs]
        if all(x.greedy for x in p):
            return logits
        dev = logits.device
        temp = device_tensor([1.0 if x.greedy else x.temperature for x in p], torch.float32, dev)
        logits.div_(temp[:, None])
        if any(x.min_p > 0 for x in p):
            min_p = device_tensor([0.0 if x.greedy else x.min_p for x in p], torch.float32, dev)
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
            banned[device_tensor([i for i, _ in limited], torch.int64, dev)] = True
            rows = device_tensor([i for i, ids in limited for _ in ids], torch.int64, dev)
            cols = device_tensor([t for _, ids in limited for t in ids], torch.int64, dev)
            banned[rows, cols] = False
            logits.masked_fill_(banned, float("-inf"))
        biased = [(i, r.params.logit_bias) for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased:
            rows = device_tensor([i for i, bias in biased for _ in bias], torch.int64, dev)
            cols = device_tensor([t for _, bias in biased for t in bias], torch.int64, dev)
            values = device_tensor([v for _, bias in biased for v in bias.values()],
                                   logits.dtype, dev)
            logits.index_put_((rows, cols), values, accumulate=True)

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, reqs: list[Request]) -> None:
        rows, cols = [], []
        for i, r in enumerate(reqs):
            if r.num_output_tokens + r.num_pending_tokens < r.params.min_tokens:
                banned = r.eos_token_ids | set(r.params.stop_token_ids)
                rows += [i] * len(banned)
                cols += banned
        if rows:
            dev = logits.device
            logits[device_tensor(rows, torch.int64, dev),
                   device_tensor(cols, torch.int64, dev)] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request],
                         pending: Pending | None) -> None:
        n, vocab = logits.shape
        dev = logits.device
        counts = torch.zeros(n, vocab, device=dev)
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
        out_rows = device_tensor([i for i, r in enumerate(reqs) for _ in range(r.num_output_tokens)],
                                 torch.int64, dev)
        out_ids = device_tensor([t for r in reqs for t in r.output_token_ids], torch.int64, dev)
        counts.index_put_((out_rows, out_ids), torch.ones(len(out_ids), device=dev),
                          accumulate=True)
        seen[device_tensor([i for i, r in enumerate(reqs) for _ in range(r.num_tokens)],
                           torch.int64, dev),
             device_tensor([t for r in reqs for t in r.all_token_ids], torch.int64, dev)] = True
        if pending is not None:
            rows = device_tensor(pending.rows, torch.int64, dev)
            counts.index_put_((rows, pending.token_ids), torch.ones(len(pending.rows), device=dev),
                              accumulate=True)
            seen[rows, pending.token_ids] = True
        rep = device_tensor([r.params.repetition_penalty for r in reqs], torch.float32, dev)[:, None]
        freq = device_tensor([r.params.frequency_penalty for r in reqs], torch.float32, dev)[:, None]
        pres = device_tensor([r.params.presence_penalty for r in reqs], torch.float32, dev)[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))
        logits.sub_(freq * counts + pres * (counts > 0))

    # drawing -----------------------------------------------------------------------------------
    def draw(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        tokens = logits.argmax(-1)
        flags = [r.params.greedy for r in reqs]
        if not all(flags):
            greedy = device_tensor(flags, torch.bool, logits.device)
            probs = logits.softmax(-1)
            noise = self.exponential(probs, reqs)
            tokens = torch.where(greedy, tokens, (probs / noise).argmax(-1))
        # greedy rows too (their pick is the stage's likeliest), whatever else is in the batch
        if any(r.params.infill_sampler for r in reqs):
            tokens = self._infill(logits, reqs, tokens)
        return tokens

    def _infill(self, logits: torch.Tensor, reqs: list[Request], tokens: torch.Tensor):
        """Rows with llama.cpp's infill stage (`luceio.infill_sampling`) draw again from the
        distribution it leaves over their top-k / top-p candidates: on the host, since the
        stage compares the candidates' text (a host round trip only for these rows)."""
        from .infill_sampling import infill_filter
        tokens = tokens.clone()
        for i, r in enumerate(reqs):
            if not r.params.infill_sampler:
                continue
            row = logits[i].float()
            top = row.topk(min(r.params.top_k, row.numel()))  # greedy rows skipped truncation
            cand = top.indices[torch.isfinite(top.values)]
            eog = r.eos_token_ids | set(r.params.stop_token_ids)
            eot = min(r.eos_token_ids) if r.eos_token_ids else int(row.argmax())
            ids, probs = infill_filter(cand.tolist(), row[cand].tolist(), eog.__contains__,
                                       self.piece, eot)
            if r.params.greedy or len(ids) == 1:
                pick = ids[max(range(len(ids)), key=probs.__getitem__)]
            else:
                gen = (self.request_generator(r, row.device) if r.params.seed is not None
                       else self._global_gen(row.device))
                e = torch.empty(len(ids), device=row.device).exponential_(generator=gen)
                pick = ids[int((torch.tensor(probs, device=row.device) / e).argmax())]
            tokens[i] = pick
        return tokens

    def exponential(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Exp(1) noise shaped like `probs`; seeded rows from their request's generator."""
        noise = torch.empty_like(probs).exponential_(generator=self._global_gen(probs.device))
        for i, r in enumerate(reqs):
            if r.params.seed is not None and not r.params.greedy:
                noise[i].exponential_(generator=self.request_generator(r, probs.device))
        return noise

    def request_generator(self, req: Request, device: torch.device) -> torch.Generator:
        """A seeded request's generator on `device`: one stream per device it draws on (a draft
        model on another device than the target's draws on its own), seeded apart so that the
        streams are not the same numbers."""
        device = torch.device(device)
        gen = req.generators.get(device)
        if gen is None:
            seed = req.params.seed + req.index + 1_000_003 * len(req.generators)
            gen = req.generators[device] = torch.Generator(device=device).manual_seed(seed)
        return gen

    def _global_gen(self, device: torch.device) -> torch.Generator:
        if device not in self._global:
            self._global[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._global[device]

    # logprobs ----------------------------------------------------------------------------------
    @staticmethod
    def logprob_tensors(raw: torch.Tensor, tokens: torch.Tensor,
                        num: list[int | None]) -> LogprobTensors | None:
        """On the device: each row's `tokens[i]` logprob and rank and the top-max(num) tokens;
        None when no row asked (`num[i]` None)."""
        if all(k is None for k in num):
            return None
        k = max(x or 0 for x in num)
        rows, vocab = raw.shape
        step = max(1, LOGPROB_CPU_SLICE_ELEMS // max(1, vocab))
        if rows <= step or raw.device.type != "cpu":
            return LogprobTensors(tokens, *_logprob_rows(raw, tokens, k))
        # many rows on the CPU (prompt logprobs): a slice of rows at a time, so the fp32
        # log-softmax and the comparison mask stay in cache ([2100, 151936] took 1.4 s this way
        # against 5-11 s at once) instead of two more copies of the whole [rows, vocab] block
        chosen = torch.empty(rows, dtype=torch.float32, device=raw.device)
        ranks = torch.empty(rows, dtype=torch.int64, device=raw.device)
        top_v = torch.empty(rows, k, dtype=torch.float32, device=raw.device)
        top_i = torch.empty(rows, k, dtype=torch.int64, device=raw.device)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            chosen[a:b], ranks[a:b], top_v[a:b], top_i[a:b] = _logprob_rows(raw[a:b], tokens[a:b], k)
        return LogprobTensors(tokens, chosen, ranks, top_v, top_i)

    @classmethod
    def logprobs(cls, raw: torch.Tensor, tokens: torch.Tensor, num: list[int | None]):
        """For rows that asked: the chosen token's logprob and rank (1 = most likely) and the
        top-n alternatives, read on the host at once (speculative verify steps)."""
        lps = cls.logprob_tensors(raw, tokens, num)
        return [None] * len(num) if lps is None else lps.to_dicts(num)


LOGPROB_CPU_SLICE_ELEMS = 1 << 22
"""Logits elements per slice of `Sampler.logprob_tensors` on the CPU: ~27 rows of a 152K
vocabulary (16 MiB of fp32). GPUs take the whole block in one go."""


def _logprob_rows(raw: torch.Tensor, tokens: torch.Tensor, k: int):
    """(chosen logprob, rank, top-k values, top-k ids) of each row of `raw` [rows, vocab]."""
    lp = raw.float().log_softmax(-1)
    chosen = lp.gather(1, tokens[:, None])
    ranks = (lp > chosen).sum(-1) + 1
    top_v, top_i = lp.topk(k, dim=-1)
    return chosen[:, 0], ranks, top_v, top_i


def _untouched_greedy(r: Request) -> bool:
    """A greedy row that no processing step changes (so its logits need no copy)."""
    p = r.params
    return p.greedy and not p.allowed_token_ids and not p.logit_bias and not has_penalty(r) and \
        (not p.min_tokens or r.num_output_tokens + r.num_pending_tokens >= p.min_tokens)


def has_penalty(r: Request) -> bool:
    p = r.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(-1, descending=True)
    vocab = logits.shape[-1]
    k = device_tensor([x if x > 0 else vocab for x in top_k], torch.int64, logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits.masked_fill_(ranks >= k[:, None], float("-inf"))
    p = device_tensor(top_p, torch.float32, logits.device)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    sorted_logits.masked_fill_(mass_before > p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
