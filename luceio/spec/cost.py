"""When speculation pays: the cost model `SpecDecoder` inherits. Per batch-size bucket it measures
the period of plain steps and of drafting steps (chains, trees), counts how drafts are accepted,
and drafts the way expected to emit the most tokens per plain step's cost, if any beats plain
decoding; a draft model's catch-up with new prompts is weighed against what it saves."""
from __future__ import annotations

from .length import expected_tokens

_PROBE_EVERY = 8
_COST_EMA = 0.2       # step-cost averages remember a few steps
_ACCEPT_DECAY = 0.98  # acceptance is a decayed count over roughly the last 50 verifies
_ACCEPT_PRIOR = 0.5   # acceptance assumed before any draft is verified (weight: 4 draft tokens)
_FEED_MEASURE = 64    # a proposal that fed this many tokens to catch up measures their cost
_PRIOR_GAIN = 0.5     # share of a plain step's cost a token saves, a way of drafting unmeasured
_BACK_OFF_MAX = 4     # a losing way is probed at least every 2^4 probe cycles (256 steps)
_DRAFT_COST_PRIOR = 0.1  # a draft token's cost in a request's share of a plain step, unmeasured
_DRAFT_COST_MIN, _DRAFT_COST_MAX = 0.01, 2.0
_FIT_DECAY = 0.9      # the draft-token cost fit remembers ~10 drafting steps
_SURE_WORTH = 1.25    # a way this far ahead of plain decoding probes plain decoding less often
_PLAIN_STALE = 4      # ... every this many probe cycles (64 steps) instead of every cycle


def _bucket(batch_size: int) -> int:
    return 1 << max(batch_size - 1, 0).bit_length()


def _way_probe(step: int) -> bool:
    """Whether plan step `step` is a probe cycle's drafting probe (`CostModel.mode`)."""
    return step % (2 * _PROBE_EVERY) == _PROBE_EVERY


class CostModel:
    """The host class provides `proposer`, `k_max`, `tree_budget`, `batch_cap(n)`, `_step` (the
    plan step) and `plain_probe_steps`, and calls `_init_cost_model` from its constructor."""

    def _init_cost_model(self) -> None:
        # (batch bucket, "plain" | "chain" | "tree") -> step seconds
        self._cost: dict[tuple[int, str], float] = {}
        # (batch bucket, "chain" | "tree") -> share of a drafting step's requests that drafted
        self._share: dict[tuple[int, str], float] = {}
        # (batch bucket, "chain") -> drafts a drafting request verified, on average
        self._k: dict[tuple[int, str], float] = {}
        # (batch bucket, way) -> losing measurements in a row, and the step its probes resume
        self._losses: dict[tuple[int, str], int] = {}
        self._resume: dict[tuple[int, str], int] = {}
        self._feed_cost: float | None = None  # seconds a token the proposer feeds to catch up
        self._fed_last = 0  # tokens the last proposal fed to catch up (`observe_step`)
        # chains: decayed counts of accepted drafts and of drafts tried (those accepted plus
        # each verify's first rejection: the drafts after it were never compared)
        self._accepted, self._tried = 4 * _ACCEPT_PRIOR, 4.0
        self._tree_emitted, self._tree_verifies = 0.0, 0.0  # trees: decayed, per request
        # batch bucket -> decayed sums [n, x, y, xx, xy] of chain steps: x the drafts a drafting
        # request verified, y the step's extra cost over plain per drafting request (in that
        # request's share of a plain step); the slope of y on x is a draft token's cost
        self._fit: dict[int, list[float]] = {}
        self._plain_at: dict[int, int] = {}  # batch bucket -> the plan step plain was last measured

    def _catch_up(self, picked: list, batch_size: int, mode: str | None, cap: int) -> list:
        """The (request, k) pairs that draft, less cold ones (a draft model that has not read
        the prompt) where catching up would not pay: tokens to feed x the measured seconds a
        fed token, against what drafting saves over the tokens the request has left (each a
        plain step's share per request x (1 - 1 / worth), `_PRIOR_GAIN` while unmeasured).
        A probe step counts at least `_PRIOR_GAIN`: plain steps leave the draft's cache behind,
        so a probe judged by the measurement it is there to renew would find every request
        cold, draft nothing, and leave a losing way off for good. Until the feed cost is
        measured, cold requests catch up only until `_FEED_MEASURE` tokens are due in a step
        (one at least). At batch 16 on the CPU a draft model's catch-up of 16 prompts took
        10.5 s against 0.27 s a plain step."""
        uncached = getattr(self.proposer, "uncached", None)
        if uncached is None or not picked:
            return picked
        out, due = [], 0
        plain = self._cost.get((_bucket(batch_size), "plain"))
        if self._feed_cost is not None and plain is not None:
            worth = self._worth(_bucket(batch_size), mode, cap)
            gain = _PRIOR_GAIN if worth is None else max(0.0, 1 - 1 / worth)
            if _way_probe(self._step):
                gain = max(gain, _PRIOR_GAIN)
            saved = plain / batch_size * gain  # seconds drafting saves a token of a request
        for r, k in picked:
            cold = uncached(r.request_id, r.num_tokens, r.all_token_ids)
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
        `_PROBE_EVERY * 2` steps `plain_probe_steps` plain steps refresh the baseline (every
        `_PLAIN_STALE` cycles only while a way is worth `_SURE_WORTH` or more) and one
        drafting step re-measures a way (the ways in turn, so acceptance and cost stay current
        while a way is off), unless its last probes lost (`_back_off`). `step`: the plan step
        asked about (default: the current one)."""
        b = _bucket(batch_size)
        step = self._step if step is None else step
        phase = step % (2 * _PROBE_EVERY)
        modes = ("tree", "chain") if self.tree_budget else ("chain",)
        if phase < self.plain_probe_steps and not self._plain_fresh(
                b, step, modes, self.batch_cap(batch_size)):
            return None  # measure plain decoding
        if _way_probe(step):  # measure a way of drafting, unless it lost lately
            way = modes[step // (2 * _PROBE_EVERY) % len(modes)]
            if step >= self._resume.get((b, way), 0):
                return way
        if (b, "plain") not in self._cost:  # the baseline first (unknown, every way looked
            return None  # unmeasured: a 16-request batch drafted with a draft model throughout)
        worth = {m: self._worth(b, m, self.batch_cap(batch_size)) for m in modes}
        unknown = [m for m in modes if worth[m] is None]
        if unknown:
            return unknown[0]
        best = max(modes, key=lambda m: worth[m])
        return best if worth[best] >= 1.0 else None

    def _plain_fresh(self, bucket: int, step: int, modes: tuple, k: int) -> bool:
        """Whether a plain probe can be skipped: a way of drafting is measured worth at least
        `_SURE_WORTH` and plain decoding was measured within `_PLAIN_STALE` probe cycles. At
        batch 1 on code edits a plain probe every 16 steps cost ~7% of the steps against
        drafting every step (n-gram, 86-88 steps against 80 for 288 tokens, bench/spec_k_rule.py)."""
        at = self._plain_at.get(bucket)
        # by cycle, not by step: every plain step of a cycle's probe decides alike (with
        # overlapped scheduling only the second is measured, and a step count would let the
        # first draft and the second run unmeasured after a drafting step)
        if at is None or step // (2 * _PROBE_EVERY) - at // (2 * _PROBE_EVERY) >= _PLAIN_STALE:
            return False
        return any((self._worth(bucket, m, k) or 0.0) >= _SURE_WORTH for m in modes)

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

    def draft_token_cost(self, batch_size: int) -> float:
        """What one more draft token costs a drafting request, drafting and verifying it, in
        that request's share of a plain step (`spec.length` picks k from it): the slope of the
        extra cost of recent chain steps over their drafts a request, where those drafts varied
        enough to fit it, else the extra cost over the drafts (a step's fixed cost included: an
        upper bound); `_DRAFT_COST_PRIOR` until a chain step of the bucket is measured."""
        fit = self._fit.get(_bucket(batch_size))
        if fit is None or fit[0] < 1e-6:
            return _DRAFT_COST_PRIOR
        n, sx, sy, sxx, sxy = fit
        mx, my = sx / n, sy / n
        ratio = max(my, 0.0) / max(mx, 1e-6)
        var = sxx / n - mx * mx
        cost = ratio
        if var >= 0.25:  # k spread by a draft at least: the slope is measurable
            cost = min(max((sxy / n - mx * my) / var, 0.0), ratio)
        return min(max(cost, _DRAFT_COST_MIN), _DRAFT_COST_MAX)

    def _fit_draft_cost(self, bucket: int, batch_size: int, drafting: int, drafts: int,
                        seconds: float) -> None:
        plain = self._cost.get((bucket, "plain"))
        if plain is None or not drafting or not drafts:
            return
        x = drafts / drafting
        y = (seconds - plain) / plain * batch_size / drafting
        fit = self._fit.setdefault(bucket, [0.0] * 5)
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            fit[i] = _FIT_DECAY * fit[i] + v

    def acceptance_rate(self) -> float:
        """A draft's recent chance of acceptance where the drafts before it were accepted
        (decayed counts, with a weak prior). Not accepted / drafted: a verify of k drafts
        rejected at its first compares only one, so that ratio reads 0.36 where each draft is
        accepted with probability 0.5 (k = 2..4) and undercounts what a verify emits."""
        return self._accepted / self._tried

    def expected_tokens(self, k: float) -> float:
        """Tokens one verify of k drafts emits on average at the recent acceptance rate."""
        return expected_tokens(self.acceptance_rate(), k)

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
                self._fit_draft_cost(key[0], batch_size, n, drafts, seconds)
        if not drafted:
            self._plain_at[key[0]] = self._step
        prev = self._cost.get(key)
        # a step under half the average: the average holds a one-off (a draft model's catch-up
        # with 16 prompts, 10.5 s against 0.85 s a step after it on the CPU); start over
        self._cost[key] = seconds if prev is None or 2 * seconds < prev else \
            _COST_EMA * seconds + (1 - _COST_EMA) * prev
        if drafted:
            self._back_off(key, batch_size)

    def _back_off(self, key: tuple[int, str], batch_size: int) -> None:
        """A way of drafting measured not to pay skips its next probes: 2, 4, 8, then 16 probe
        cycles after each losing measurement in a row (on the CPU at batch 16 a drafting step
        where one request drafted cost over 2 plain steps); one measured to pay is probed on
        the usual cycle again."""
        worth = self._worth(key[0], key[1], self.batch_cap(batch_size))
        if worth is None or worth >= 1.0:
            self._losses.pop(key, None)
            self._resume.pop(key, None)
            return
        n = min(self._losses.get(key, 0) + 1, _BACK_OFF_MAX)
        self._losses[key] = n
        self._resume[key] = self._step + 2 ** n * 2 * _PROBE_EVERY

    def _note_feed(self, fed: int, seconds: float, num_drafts: int) -> None:
        """A proposal that fed `fed` tokens to catch up and drafted `num_drafts` in `seconds`."""
        self._fed_last = fed
        if fed >= _FEED_MEASURE:  # its cost a token fed or drafted (a draft step ~ a token)
            per = seconds / (fed + num_drafts)
            self._feed_cost = per if self._feed_cost is None else \
                _COST_EMA * per + (1 - _COST_EMA) * self._feed_cost

    def _count_acceptance(self, num_drafts: int, num_accepted: int, tree: bool) -> None:
        if tree:  # a tree's nodes are mostly siblings: count what a verify emits
            self._tree_emitted = _ACCEPT_DECAY * self._tree_emitted + num_accepted + 1
            self._tree_verifies = _ACCEPT_DECAY * self._tree_verifies + 1
        else:
            self._accepted = _ACCEPT_DECAY * self._accepted + num_accepted
            self._tried = _ACCEPT_DECAY * self._tried + num_accepted + (num_accepted < num_drafts)
