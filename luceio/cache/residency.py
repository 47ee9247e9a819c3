"""Bounded KV residency, the planning half (loop thread, ids and counts only).

A request's KV lives in at most `budget_blocks` device blocks. Its block table keeps one entry
per logical block; an entry of `OFFLOADED` means the block's KV sits in pinned host memory
(moved there through `offload.HostCopies`, the mechanism swap preemption uses too; the runner's
`HostKVStore` holds the copies) and attention skips it: the runner hands the attention
kernels the table with those entries removed and the sequence length shortened to match, so
the kernels attend over the resident blocks only, while rotary positions stay the original
ones (they are baked into the cached keys).

Which blocks stay: the first `SINK_BLOCKS` (attention sinks) and the most recent
`recent_blocks` (always), then the best-scored of the rest up to the budget. Scores come from
the policy:
- `keys`: the target's own pooled keys — every `rescore_interval` decode steps (and after every
  prefill chunk) the runner scores each block by the attention the request's latest query pays
  to the block's mean key (softmax over blocks per layer and head, max over heads and layers);
- `spec`: the speculative-prefill scorer — the draft model's attention-based importance of each
  prompt token, averaged per block, computed once at admission;
- `recency`: no scores; the most recent blocks stay (a sliding window plus the sinks).

Blocks computed while everything was resident are exact and may enter the prefix cache; blocks
computed after the first eviction attended to a subset and never do."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .offload import OFFLOADED, HostCopies

SINK_BLOCKS = 1
POLICIES = ("keys", "spec", "recency")


@dataclass(frozen=True)
class ResidencyConfig:
    budget_tokens: int
    block_size: int
    policy: str = "keys"
    rescore_interval: int = 16

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"residency policy must be one of {POLICIES}, got {self.policy!r}")
        if self.budget_tokens < 4 * self.block_size:
            raise ValueError(f"--kv-resident-tokens must be at least 4 blocks "
                             f"({4 * self.block_size} tokens), got {self.budget_tokens}")
        if self.rescore_interval < 1:
            raise ValueError("--kv-rescore-interval must be at least 1")

    @property
    def budget_blocks(self) -> int:
        return self.budget_tokens // self.block_size

    @property
    def recent_blocks(self) -> int:
        return max(2, self.budget_blocks // 4)

    @property
    def max_reloads(self) -> int:
        """Most blocks one plan brings back from host memory."""
        return max(2, self.budget_blocks // 8)

    @property
    def chunk_tokens(self) -> int:
        """Longest prefill chunk: half the budget, so a chunk attends to at least as many
        earlier tokens as it holds."""
        return self.budget_tokens // 2

    def max_blocks(self, num_tokens: int) -> int:
        """Most device blocks one request of `num_tokens` tokens holds at once."""
        full = -(-num_tokens // self.block_size)
        return min(full, self.budget_blocks + 2)


HYSTERESIS = 1.25  # a block comes back only to replace one scored this much lower


def _better(candidate: float, victim: float) -> bool:
    return candidate > (victim * HYSTERESIS if victim > 0 else victim)


class _State:
    def __init__(self):
        self.scores: np.ndarray | None = None  # per logical block; higher stays
        self.version = 0  # bumped when scores change
        self.planned: tuple | None = None  # (num blocks, tail start, version) of the last plan
        self.steps_since_score = 0
        self.exact_blocks: int | None = None  # blocks computed before the first eviction
        self.view: tuple[int, list[int], int] | None = None  # attention_table cache
        self.final_chunk: int | None = None  # keys policy: where the prompt's last chunk began
        self.rewound = False  # ... and whether it was computed again after scoring


class Residency:
    def __init__(self, cfg: ResidencyConfig, host: HostCopies):
        self.cfg = cfg
        self.host = host  # where the offloads and reloads planned here are recorded
        self.states: dict[str, _State] = {}
        self.num_offloaded = 0  # blocks moved to host memory (a re-offload without a copy counts)
        self.num_reloaded = 0

    def exact_blocks(self, rid: str) -> int | None:
        """Blocks whose KV equals a plain prefill's (None: all so far): those computed before
        the first offload, and before a last chunk that may be computed again."""
        st = self.states.get(rid)
        if st is None:
            return None
        limits = [x for x in (st.exact_blocks, None if st.final_chunk is None else
                              st.final_chunk // self.cfg.block_size) if x is not None]
        return min(limits) if limits else None

    def set_scores(self, rid: str, scores: np.ndarray) -> None:
        st = self.states.setdefault(rid, _State())
        st.scores = np.asarray(scores, dtype=np.float64)
        st.version += 1
        st.steps_since_score = 0

    def wants_scores(self, rid: str, table: list[int], prefill_chunk: bool) -> bool:
        """Whether this step should score the request's blocks (keys policy): after a prefill
        chunk, or every `rescore_interval` decode steps, once the request outgrew its budget."""
        if self.cfg.policy != "keys" or len(table) <= self.cfg.budget_blocks:
            return False
        st = self.states.setdefault(rid, _State())
        st.steps_since_score += 1
        return prefill_chunk or st.steps_since_score >= self.cfg.rescore_interval or \
            st.scores is None

    def attention_table(self, rid: str, table: list[int]) -> tuple[list[int], int]:
        """(resident blocks in order, tokens skipped). Cached between plans: between them the
        table only grows or shrinks at its (resident) tail."""
        st = self.states.get(rid)
        if st is None or st.exact_blocks is None:
            return table, 0  # nothing was ever offloaded
        if st.view is None or st.view[0] > len(table):
            resident = [b for b in table if b != OFFLOADED]
            st.view = (len(table), resident, len(table) - len(resident))
        n, resident, skipped = st.view
        return resident + table[n:] if len(table) > n else resident, skipped * self.cfg.block_size

    def forget_view(self, rid: str) -> None:
        st = self.states.get(rid)
        if st is not None:
            st.view = None

    def prefill_step(self, rid: str, num_computed: int, num_tokens: int, num_new: int,
                     can_rewind: bool) -> tuple[int, int]:
        """`keys` policy, for a prompt past the budget: (first token, tokens) this step computes.
        The prefill's last chunk stops one token short and is scored there (with the query of
        the prompt's next-to-last token: the end of the question); then, once, that chunk is
        computed again over the blocks the score chose, so the end of the prompt (and the
        first output token) sees what it asks about. `can_rewind` False (prompt logprobs)
        keeps the first pass."""
        if self.cfg.policy != "keys" or num_tokens <= self.cfg.budget_tokens:
            return num_computed, num_new
        st = self.states.setdefault(rid, _State())
        if num_computed + num_new == num_tokens and num_new > 1 and st.final_chunk is None:
            st.final_chunk = num_computed
            return num_computed, num_new - 1
        if can_rewind and st.final_chunk is not None and not st.rewound and \
                num_computed == num_tokens - 1:
            st.rewound = True
            # the recomputed blocks' host copies and pooled keys are stale; they are not exact
            # either
            self.host.stale(rid, st.final_chunk // self.cfg.block_size)
            return st.final_chunk, min(num_tokens - st.final_chunk, self.cfg.chunk_tokens)
        return num_computed, num_new

    def release(self, rid: str, preempted: bool = False) -> None:
        """The request's blocks were freed (its host copies go through `HostCopies.release`):
        its plan state goes. A request preempted for recompute keeps the `spec` policy's prompt
        scores, which are computed only at admission."""
        st = self.states.pop(rid, None)
        if st is not None and preempted and self.cfg.policy == "spec" and st.scores is not None:
            self.set_scores(rid, st.scores)

    def plan(self, rid: str, table: list[int], num_computed: int, num_blocks_after: int,
             pool, reserve: int = 0) -> None:
        """Offloads/reloads so that, with the step's tail blocks (from the block holding
        the first new token up to `num_blocks_after`), the request fits its budget. Offloads
        free their device blocks at once; reloads take free blocks only, never preempting,
        and at most `max_reloads` per plan: the resident set moves toward the chosen one a
        few blocks at a time, which bounds the host-to-device traffic of one step."""
        cfg = self.cfg
        st = self.states.setdefault(rid, _State())
        tail_start = num_computed // cfg.block_size
        key = (num_blocks_after, tail_start, st.version)
        if st.planned == key:
            return
        room = max(cfg.budget_blocks - (num_blocks_after - tail_start), 0)
        old = min(tail_start, len(table))
        keep, score = self._choose(st, old, room)
        best_first = np.lexsort((np.arange(old), score))[::-1]  # high score, then newest
        away = np.asarray(table[:old]) == OFFLOADED
        want = best_first[(away & keep)[best_first]].tolist()
        # a block shared with another request (prefix cache, n > 1) frees no device memory
        # when offloaded: it stays, counted in the budget
        worst_first = [i for i in best_first[::-1][(~away & ~keep)[best_first[::-1]]].tolist()
                       if pool.ref_cnt[table[i]] == 1]
        free_slots = room - int(old - away.sum())
        off = worst_first[:max(-free_slots, 0)]  # over budget (the tail grew): must go
        victims = worst_first[len(off):]
        free_slots = max(free_slots, 0)
        # reloads into free blocks leave the step's own new blocks and `reserve` (the other
        # running requests' growth) free, so a reload never causes a preemption
        spare = pool.num_free_blocks - max(num_blocks_after - len(table), 0) - reserve
        back, done = [], True
        for i in want:
            if len(back) == cfg.max_reloads:
                done = False  # more to bring back: plan again next step
                break
            if free_slots > 0 and spare > 0:  # room in the budget and a free block
                free_slots, spare = free_slots - 1, spare - 1
            elif victims and _better(score[i], score[victims[0]]):
                off.append(victims.pop(0))  # a swap, only for a clear gain (no churn on ties)
            else:
                done = free_slots <= 0  # short of free blocks: try again next step
                break
            back.append(i)
        st.planned = key if done else None
        off.sort()
        if off or back:
            st.view = None
        if off:
            if st.exact_blocks is None:
                st.exact_blocks = tail_start
            self.host.offload(rid, table, off, pool)
            self.num_offloaded += len(off)
        if back:
            self.host.reload(rid, table, back, pool)
            self.num_reloaded += len(back)

    def _choose(self, st: _State, old: int, room: int) -> tuple[np.ndarray, np.ndarray]:
        """(mask over the `old` blocks before the tail that should be on the device, their
        scores). The sinks and the most recent blocks score +inf; unscored blocks -inf, so
        ties and unscored blocks go by recency."""
        score = np.full(old, -np.inf)
        if st.scores is not None and self.cfg.policy != "recency":
            n = min(old, len(st.scores))
            score[:n] = st.scores[:n]
        score[:SINK_BLOCKS] = np.inf
        score[max(old - self.cfg.recent_blocks, 0):] = np.inf
        keep = np.zeros(old, dtype=bool)
        order = np.lexsort((np.arange(old), score))[::-1]
        keep[order[:max(room, int(np.isposinf(score).sum()))]] = True
        return keep, score
