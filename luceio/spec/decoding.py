"""Speculative decoding inside the engine step: propose drafts for running requests (adaptive k),
verify them in the one target forward, and keep acceptance statistics. Which requests speculate:
decoding ones whose params allow it (`use_speculation`, no penalties — they depend on each
emitted token — and `min_tokens` already met). How many drafts: per request, an estimate of how
many would be accepted (an exponential moving average of the accepted length) plus one, capped
by `num_speculative_tokens`; a request whose drafts keep failing drops to k = 0 and probes again
now and then. Larger batches speculate less: the target forward stops being memory-bound, so
rejected drafts cost real compute."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..request import Request
from .proposer import ProposalInput
from .rejection import rejection_sample_batch
from .tree import accept as tree_accept

_EMA = 0.5
_PROBE_EVERY = 8
_COST_EMA = 0.2       # step-cost averages remember a few steps
_ACCEPT_DECAY = 0.98  # acceptance is a decayed count over roughly the last 50 verified drafts
_ACCEPT_PRIOR = 0.5   # acceptance assumed before any draft is verified (weight: 4 draft tokens)
_FEED_MEASURE = 64    # a proposal that fed this many tokens to catch up measures their cost
_PRIOR_GAIN = 0.5     # share of a plain step's cost a token saves, a way of drafting unmeasured


def _bucket(batch_size: int) -> int:
    return 1 << max(batch_size - 1, 0).bit_length()


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    draft_seconds: float = 0.0  # proposer time (draft-model forwards or n-gram search)
    verify_seconds: float = 0.0  # rejection-sampling time (the target forward is not included)
    # verify steps by accepted drafts: accepted_histogram[a] verifies accepted exactly a
    accepted_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the recovered/bonus token)."""
        return (self.num_accepted_tokens + self.num_verify_steps) / max(self.num_verify_steps, 1)


class SpecDecoder:
    def __init__(self, method: str, num_speculative_tokens: int, proposer, sampler,
                 tree_budget: int = 0):
        self.method = method
        self.tree_budget = tree_budget  # > 0: the proposer may draft trees (`spec.tree`)
        self.k_max = num_speculative_tokens
        self.proposer = proposer
        self.sampler = sampler
        self.stats = SpecStats()
        self._ema: dict[str, float] = {}
        self._idle: dict[str, int] = {}
        self._released: list[str] = []  # proposer state is freed on the loop thread, between steps
        # (batch bucket, "plain" | "chain" | "tree") -> step seconds
        self._cost: dict[tuple[int, str], float] = {}
        # (batch bucket, "chain" | "tree") -> share of a drafting step's requests that drafted
        self._share: dict[tuple[int, str], float] = {}
        self._feed_cost: float | None = None  # seconds a token the proposer feeds to catch up
        self._fed_last = 0  # tokens the last proposal fed to catch up (`observe_step`)
        # chains: decayed counts of accepted drafts and of drafts tried (those accepted plus
        # each verify's first rejection: the drafts after it were never compared)
        self._accepted, self._tried = 4 * _ACCEPT_PRIOR, 4.0
        # (batch bucket, "chain") -> drafts a drafting request verified, on average
        self._k: dict[tuple[int, str], float] = {}
        self._tree_emitted, self._tree_verifies = 0.0, 0.0  # trees: decayed, per request
        self._step = 0
        self.last_draft_seconds = 0.0
        # plain steps at the start of each probe cycle (the engine sets 2 with overlapped
        # scheduling: only the second is overlapped, the cost plain decoding really has)
        self.plain_probe_steps = 1

    # proposing ---------------------------------------------------------------------------------
    def batch_cap(self, batch_size: int) -> int:
        if batch_size <= 4:
            return self.k_max
        if batch_size <= 16:
            return max(self.k_max // 2, 1)
        return 1 if batch_size <= 32 else 0

    def eligible(self, r: Request) -> bool:
        return r.num_computed_tokens == r.num_tokens - 1 and self._allowed(r)

    @staticmethod
    def _allowed(r: Request) -> bool:
        """Params and progress that allow drafting once the request's tokens are all known."""
        p = r.params
        return (p.use_speculation and r.num_output_tokens + r.num_pending_tokens >= p.min_tokens
                and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
                and p.presence_penalty == 0.0)

    def may_draft(self, running: list[Request]) -> bool:
        """Whether the next `plan` may draft for `running` once their tokens still on the device
        have landed (no side effects). Drafts start from a request's latest token, so overlapped
        scheduling waits for the step in flight before such a step."""
        n = len(running)
        return bool(self.batch_cap(n)) and self.pays(n, self._step + 1) and any(
            self._allowed(r) and (r.num_pending_tokens or r.num_computed_tokens == r.num_tokens - 1)
            for r in running)

    def k_for(self, r: Request, cap: int) -> int:
        room = min(r.max_tokens - r.num_output_tokens, r.max_model_len - r.num_tokens) - 1
        ema = self._ema.get(r.request_id)
        if ema is None:
            k = cap
        elif ema < 0.25:
            idle = self._idle.get(r.request_id, 0) + 1
            self._idle[r.request_id] = idle
            k = 1 if idle % _PROBE_EVERY == 0 else 0
        else:
            k = math.ceil(ema) + 1
        return max(0, min(k, cap, room))

    def plan(self, running: list[Request]) -> tuple[list[Request], list[int], bool]:
        """Loop thread: which requests draft this step, how many tokens each, and whether as
        trees (with a tree budget: `mode`)."""
        for rid in self._released:
            self.proposer.release(rid)
        self._released.clear()
        self._step += 1
        mode = self.mode(len(running))
        cap = self.batch_cap(len(running)) if mode is not None else 0
        reqs = [r for r in running if self.eligible(r)] if cap else []
        ks = [self.k_for(r, cap) for r in reqs]
        picked = self._catch_up([(r, k) for r, k in zip(reqs, ks) if k], len(running), mode, cap)
        return [r for r, _ in picked], [k for _, k in picked], mode == "tree"

    def _catch_up(self, picked: list, batch_size: int, mode: str | None, cap: int) -> list:
        """The (request, k) pairs that draft, less cold ones (a draft model that has not read
        the prompt) where catching up would not pay: tokens to feed x the measured seconds a
        fed token, against what drafting saves over the tokens the request has left (each a
        plain step's share per request x (1 - 1 / worth), `_PRIOR_GAIN` while unmeasured).
        Until the feed cost is measured, cold requests catch up only until `_FEED_MEASURE`
        tokens are due in a step (one at least). At batch 16 on the CPU a draft model's
        catch-up of 16 prompts took 10.5 s against 0.27 s a plain step."""
        uncached = getattr(self.proposer, "uncached", None)
        if uncached is None or not picked:
            return picked
        out, due = [], 0
        plain = self._cost.get((_bucket(batch_size), "plain"))
        if self._feed_cost is not None and plain is not None:
            worth = self._worth(_bucket(batch_size), mode, cap)
            gain = _PRIOR_GAIN if worth is None else max(0.0, 1 - 1 / worth)
            saved = plain / batch_size * gain  # seconds drafting saves a token of a request
        for r, k in picked:
            cold = uncached(r.request_id, r.num_tokens)
            if cold > self.k_max + 2:
                if self._feed_cost is None:
                    if due >= _FEED_MEASURE:
                        continue
                    due += cold
                elif plain is not None:
                    left = min(r.max_tokens - r.num_output_tokens, r.max_model_len - r.num_tokens)
                    if cold * self._feed_cost > left * saved:
                        continue
            out.append((r, k))
        return out

    # cost model: does speculation pay at this batch size on this machine? -------------------
    def pays(self, batch_size: int, step: int | None = None) -> bool:
        """Whether a step of `batch_size` requests drafts (`mode` is not None)."""
        return self.mode(batch_size, step) is not None

    def mode(self, batch_size: int, step: int | None = None) -> str | None:
        """How a step of `batch_size` requests drafts: "chain", "tree" (with a tree budget) or
        None (plain decoding). A way of drafting is worth the tokens a drafting step is expected
        to emit per request over its measured cost in plain steps of the same batch-size bucket;
        the best runs while worth >= 1. Chains expect (1 - a^(k+1)) / (1 - a) tokens for k the
        mean drafts a request verified in the bucket's recent steps and `a` a draft's chance of
        acceptance once those before it were accepted, over the last ~50 tried drafts (one
        unlucky step does not switch drafting off); trees expect what recent verifies emitted.
        Plain decoding's cost is measured first; then a way not measured yet is tried. Every
        `_PROBE_EVERY * 2` steps `plain_probe_steps` plain steps refresh the baseline and one
        drafting step re-measures a way (the ways in turn, so acceptance and cost stay current
        while a way is off). `step`: the plan step asked about (default: the current one)."""
        b = _bucket(batch_size)
        step = self._step if step is None else step
        phase = step % (2 * _PROBE_EVERY)
        if phase < self.plain_probe_steps:
            return None  # measure plain decoding
        modes = ("tree", "chain") if self.tree_budget else ("chain",)
        if phase == _PROBE_EVERY:  # measure a way of drafting
            return modes[step // (2 * _PROBE_EVERY) % len(modes)]
        if (b, "plain") not in self._cost:  # the baseline first (unknown, every way looked
            return None  # unmeasured: a 16-request batch drafted with a draft model throughout)
        worth = {m: self._worth(b, m, self.batch_cap(batch_size)) for m in modes}
        unknown = [m for m in modes if worth[m] is None]
        if unknown:
            return unknown[0]
        best = max(modes, key=lambda m: worth[m])
        return best if worth[best] >= 1.0 else None

    def _worth(self, bucket: int, mode: str, k: int) -> float | None:
        """Tokens per request a `mode` drafting step is expected to emit over its cost in plain
        steps; None while a part of that is unmeasured."""
        cost, plain = self._cost.get((bucket, mode)), self._cost.get((bucket, "plain"))
        if cost is None or plain is None:
            return None
        if mode == "chain":
            tokens = self.expected_tokens(self._k.get((bucket, mode), k))
        elif self._tree_verifies:
            tokens = self._tree_emitted / self._tree_verifies
        else:
            return None
        # requests that did not draft in those steps (cold, idle, no guess) emit one token
        tokens = 1 + self._share.get((bucket, mode), 1.0) * (tokens - 1)
        return tokens / (cost / plain)

    def acceptance_rate(self) -> float:
        """A draft's recent chance of acceptance where the drafts before it were accepted
        (decayed counts, with a weak prior). Not accepted / drafted: a verify of k drafts
        rejected at its first compares only one, so that ratio reads 0.36 where each draft is
        accepted with probability 0.5 (k = 2..4) and undercounts what a verify emits."""
        return self._accepted / self._tried

    def expected_tokens(self, k: float) -> float:
        """Tokens one verify of k drafts emits on average at the recent acceptance rate."""
        a = min(self.acceptance_rate(), 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def observe_step(self, batch, result, overlap: bool) -> None:
        """Feeds a processed step (`pipeline.Batch` and its `StepResult`) to the cost model when
        it is a decode-only step; `overlap`: whether the pipeline overlaps steps."""
        sched = batch.sched.scheduled
        fed, self._fed_last = self._fed_last, 0
        if not batch.decode_only:
            return  # a prefill chunk rode along: not comparable
        drafted = any(s.spec_token_ids for s in sched)
        if drafted and fed >= _FEED_MEASURE:
            return  # the proposer caught up with prompts first: a one-off, not drafting's cost
        if not drafted and overlap and not result.overlapped:
            # a plain step launched with nothing in flight (after a drafting step) paid host
            # work that plain decoding hides: it is not what drafting is weighed against
            return
        # result.seconds is the step's period, its drafting included (pipeline._process)
        self.observe(len(sched), drafted, sum(len(t) for t in result.sampled.values()),
                     result.seconds, tree=any(s.spec_tree is not None for s in sched),
                     drafting=sum(1 for s in sched if s.spec_token_ids),
                     drafts=sum(len(s.spec_token_ids) for s in sched))

    def observe(self, batch_size: int, drafted: bool, num_tokens: int, seconds: float,
                tree: bool = False, drafting: int | None = None, drafts: int | None = None
                ) -> None:
        """Records one decode step's time (drafting included); `tree`: it verified trees;
        `drafting`: how many of its requests drafted (default: all, where it drafted);
        `drafts`: the draft tokens they verified (chains: their mean is the k `_worth` uses)."""
        if seconds <= 0 or num_tokens <= 0:
            return
        key = (_bucket(batch_size), "tree" if tree else "chain" if drafted else "plain")
        if drafted:
            share = (batch_size if drafting is None else drafting) / batch_size
            old = self._share.get(key)
            self._share[key] = share if old is None else _COST_EMA * share + (1 - _COST_EMA) * old
            n = batch_size if drafting is None else drafting
            if not tree and drafts and n:
                old = self._k.get(key)
                self._k[key] = drafts / n if old is None else \
                    _COST_EMA * drafts / n + (1 - _COST_EMA) * old
        prev = self._cost.get(key)
        # a step under half the average: the average holds a one-off (a draft model's catch-up
        # with 16 prompts, 10.5 s against 0.85 s a step after it on the CPU); start over
        self._cost[key] = seconds if prev is None or 2 * seconds < prev else \
            _COST_EMA * seconds + (1 - _COST_EMA) * prev

    def draft(self, reqs: list[Request], ks: list[int], tree: bool = True):
        """Worker thread: runs the proposer (reads request tokens, writes only its own state);
        `tree`: a proposer with a tree budget may draft trees (`plan`'s choice)."""
        t0 = time.perf_counter()
        self.last_draft_seconds = 0.0
        proposal = self.proposer.propose([ProposalInput(r.all_token_ids, k, r, tree)
                                          for r, k in zip(reqs, ks)])
        self.last_draft_seconds = time.perf_counter() - t0
        self.stats.draft_seconds += self.last_draft_seconds
        fed = self._fed_last = getattr(proposal, "fed", 0)
        if fed >= _FEED_MEASURE:  # its cost a token fed or drafted (a draft step ~ a token)
            per = self.last_draft_seconds / (fed + sum(ks))
            self._feed_cost = per if self._feed_cost is None else \
                _COST_EMA * per + (1 - _COST_EMA) * self._feed_cost
        return proposal.drafts, proposal.probs, proposal.trees

    def apply(self, reqs: list[Request], drafts, probs, trees=None) -> None:
        """Loop thread: attaches the drafts (and their trees) to requests still running. A
        constrained request takes its tree's first path: grammar masks walk drafts in a line."""
        offset = 0
        for i, (r, d) in enumerate(zip(reqs, drafts)):
            if not r.is_finished and r.num_computed_tokens == r.num_tokens - 1:
                tree = trees[i] if trees is not None else None
                if tree is not None and r.params.structured_outputs is not None:
                    tree = tree.first_path()
                r.spec_tree = tree if tree is not None and tree.num_nodes else None
                r.spec_token_ids = list(tree.tokens) if tree is not None else list(d)
                r.draft_probs = probs[offset:offset + len(d)] if probs is not None else None
            offset += len(d)

    # verifying ---------------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, rows: dict[str, slice], scheduled,
               bitmask: torch.Tensor | None = None) -> tuple[dict, dict, dict]:
        """Rejection-samples every request that had drafts verified this step. Returns
        (tokens per request id, per-token logprob dicts per request id, the accepted rows per
        request id that verified a tree: see `spec.tree`). `bitmask`: the grammar masks of the
        logits' rows (`luceio.structured`), or None; a draft its grammar refuses has
        probability zero, so it is rejected."""
        t0 = time.perf_counter()
        trees = [s for s in scheduled if s.spec_tree is not None and s.req.request_id in rows]
        tokens, logprobs, paths = self._verify_trees(logits, rows, trees)
        items = [s for s in scheduled if s.spec_token_ids and s.spec_tree is None
                 and s.req.request_id in rows]
        if not items:
            self.stats.verify_seconds += time.perf_counter() - t0
            return tokens, logprobs, paths
        reqs = [s.req for s in items]
        raw = torch.cat([logits[rows[r.request_id]] for r in reqs])
        per_row = [r for r in reqs for _ in range(rows[r.request_id].stop - rows[r.request_id].start)]
        masks = torch.cat([bitmask[rows[r.request_id]] for r in reqs]) \
            if bitmask is not None else None
        processed = self.sampler.process(raw, per_row, masks)
        greedy = [r.params.greedy for r in reqs]
        target = processed if all(greedy) else processed.softmax(-1)
        draft_probs = None
        if self.method != "ngram" and not all(greedy):
            # one row per verified draft; greedy requests' rows are ignored, so zeros do
            draft_probs = torch.cat([
                r.draft_probs[:len(s.spec_token_ids)].to(raw.device) if r.draft_probs is not None
                else raw.new_zeros(len(s.spec_token_ids), raw.shape[-1]) for r, s in zip(reqs, items)])
        gens = [None if r.params.greedy or r.params.seed is None
                else self.sampler.request_generator(r, logits.device) for r in reqs]
        out = rejection_sample_batch(target, [s.spec_token_ids for s in items], draft_probs,
                                     greedy, gens)
        start = 0
        for r, s, toks in zip(reqs, items, out):
            n_rows = len(s.spec_token_ids) + 1
            tokens[r.request_id] = toks
            if r.params.logprobs is not None:
                sl = raw[start:start + len(toks)]
                logprobs[r.request_id] = self.sampler.logprobs(
                    sl, torch.tensor(toks, device=sl.device), [r.params.logprobs] * len(toks))
            start += n_rows
            self._record(r, len(s.spec_token_ids), len(toks) - 1)
        self.stats.verify_seconds += time.perf_counter() - t0
        return tokens, logprobs, paths

    def _verify_trees(self, logits: torch.Tensor, rows: dict[str, slice], items
                      ) -> tuple[dict, dict, dict]:
        """`spec.tree.accept` per request that verified a draft tree (no grammar: constrained
        requests draft chains). Returns tokens, logprobs and the accepted rows, by request id."""
        tokens, logprobs, paths = {}, {}, {}
        for s in items:
            r, sl = s.req, rows[s.req.request_id]
            raw = logits[sl]
            processed = self.sampler.process(raw, [r] * (sl.stop - sl.start))
            greedy = r.params.greedy
            gen = None if greedy or r.params.seed is None \
                else self.sampler.request_generator(r, logits.device)
            path, toks = tree_accept(s.spec_tree, processed if greedy else processed.softmax(-1),
                                     greedy, gen)
            tokens[r.request_id], paths[r.request_id] = toks, path
            if r.params.logprobs is not None:
                seq = torch.tensor([0] + path, device=raw.device)
                logprobs[r.request_id] = self.sampler.logprobs(
                    raw[seq], torch.tensor(toks, device=raw.device),
                    [r.params.logprobs] * len(toks))
            self._record(r, s.spec_tree.num_nodes, len(toks) - 1, tree=True)
        return tokens, logprobs, paths

    def _record(self, r: Request, num_drafts: int, num_accepted: int, tree: bool = False) -> None:
        st = self.stats
        if r.is_finished:  # aborted during the step: its state is already released
            return
        st.num_drafts += 1
        st.num_verify_steps += 1
        st.num_draft_tokens += num_drafts
        st.num_accepted_tokens += num_accepted
        st.accepted_histogram[num_accepted] = st.accepted_histogram.get(num_accepted, 0) + 1
        if tree:  # a tree's nodes are mostly siblings: count what a verify emits
            self._tree_emitted = _ACCEPT_DECAY * self._tree_emitted + num_accepted + 1
            self._tree_verifies = _ACCEPT_DECAY * self._tree_verifies + 1
        else:
            self._accepted = _ACCEPT_DECAY * self._accepted + num_accepted
            self._tried = _ACCEPT_DECAY * self._tried + num_accepted + (num_accepted < num_drafts)
        prev = self._ema.get(r.request_id)
        self._ema[r.request_id] = num_accepted if prev is None else \
            _EMA * num_accepted + (1 - _EMA) * prev

    def release(self, request_id: str) -> None:
        self._ema.pop(request_id, None)
        self._idle.pop(request_id, None)
        self._released.append(request_id)
