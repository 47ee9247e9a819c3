"""How many tokens one request drafts: k from the request's own chance of acceptance and the
measured cost of a draft token. A verify of k drafts emits E(k) = (1 - a^(k+1)) / (1 - a) tokens
on average, where `a` is a draft's chance of acceptance once the drafts before it were accepted,
and costs about 1 + d*k of the request's share of a plain step (d: a draft token's cost, drafting
and verifying, in those units); the request drafts the k that maximises E(k) / (1 + d*k).

`a` is counted per request: accepted drafts over tried ones (those accepted plus each verify's
first rejection), decayed over the last few verifies, so a verify that failed early cuts k only
as much as it moves the estimate. It replaced k = (the moving average of the accepted count,
rounded up) + 1, which knew nothing of what a draft costs. Replayed on real greedy outputs at
batch 1 (bench/spec_length.py) this rule projects between -2% and +6% of that one; in the CPU
engine the two measure the same (bench/spec_k_rule.py).
`spec/decoding.py` and the replay in `bench/spec_acceptance.py` use this same class."""
from __future__ import annotations

_DECAY = 0.75        # a verify's weight halves after ~2.4 verifies
_PRIOR_WEIGHT = 1.0  # the batch-wide acceptance, as this many tried drafts, for a new request
_IDLE_BELOW = 0.1    # a request whose drafts are accepted less often than this stops drafting
_A_MAX = 0.98        # the estimate never reads certain: one miss must be able to move it


class DraftLength:
    """One request's draft length. `prior`: the acceptance expected before its first verify
    (the batch's recent rate); `probe_every`: an idle request drafts one token this often."""

    __slots__ = ("accepted", "tried", "idle", "verified", "probe_every")

    def __init__(self, prior: float, probe_every: int):
        self.accepted = _PRIOR_WEIGHT * min(max(prior, 0.0), 1.0)
        self.tried = _PRIOR_WEIGHT
        self.idle = 0
        self.verified = False
        self.probe_every = probe_every

    @property
    def acceptance(self) -> float:
        return min(self.accepted / self.tried, _A_MAX)

    def k(self, cap: int, draft_cost: float) -> int:
        """Drafts for the next step (0: none), at most `cap`; `draft_cost`: d above."""
        if cap <= 0:
            return 0
        if not self.verified:
            return cap  # nothing measured for this request yet: the batch's cap
        a = self.acceptance
        if a < _IDLE_BELOW:  # drafting does not pay for this request: probe now and then
            self.idle += 1
            return 1 if self.idle % self.probe_every == 0 else 0
        self.idle = 0
        return best_k(a, cap, draft_cost)

    def record(self, num_drafts: int, num_accepted: int, rejected: bool | None = None) -> None:
        """A verify of `num_drafts` that accepted `num_accepted`; `rejected`: whether a draft
        was rejected (default: fewer accepted than drafted, as in a chain; a tree whose walk
        reached a leaf rejected nothing, whatever its other branches held)."""
        if rejected is None:
            rejected = num_accepted < num_drafts
        tried = num_accepted + bool(rejected)
        self.accepted = _DECAY * self.accepted + num_accepted
        self.tried = _DECAY * self.tried + tried
        self.verified = True


def expected_tokens(a: float, k: float) -> float:
    """Tokens a verify of k drafts emits on average, each accepted with chance `a` once the
    drafts before it were."""
    a = min(max(a, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


def best_k(a: float, cap: int, draft_cost: float) -> int:
    """The k in 1..cap that maximises expected tokens per cost, E(k) / (1 + draft_cost * k)."""
    best, best_rate = 1, 0.0
    for k in range(1, cap + 1):
        rate = expected_tokens(a, k) / (1 + draft_cost * k)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best
