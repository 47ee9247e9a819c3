"""Continuous batching. There are no prefill and decode phases: each step moves every chosen
request's `num_computed_tokens` toward its token count (plus drafts to verify), under a token
budget. Running requests go first (decodes before unfinished prefills), then waiting ones FCFS.
When the pool runs dry the newest running request is preempted (recompute: its blocks are
freed and it is re-prefilled later, its tokens kept so its output does not change; or swap:
every block is offloaded to host memory through the same host copies bounded residency uses,
and reloaded when it is admitted again — `KVCacheManager.swap_out` / `swap_in`).
With bounded KV residency, each running request's blocks are planned before its slots are
allocated (cold blocks offloaded, selected ones reloaded) and prefill chunks are capped at half
the residency budget.

Overlapped scheduling (`launched`): a step still running on the device counts as done — its
tokens computed, each sampling request one token pending — so the next step is scheduled before
its tokens are known; `update` appends them once they reach the host. A request whose pending
tokens reach its length limit is not scheduled again. The engine schedules such a step only when
`fits_without_preemption()` holds: preemption decisions are made with every token known."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache import KVCacheManager
from ..cache.offload import KVMoves
from ..config import SchedulerConfig
from ..request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    req: Request
    num_new_tokens: int  # tokens computed this step, drafts included
    spec_token_ids: list[int] = field(default_factory=list)
    spec_tree: object = None  # tree speculation: the drafts' `spec.tree.DraftTree`

    @property
    def samples(self) -> bool:
        """Whether this step ends at the request's last token (so it samples)."""
        return self.req.num_computed_tokens + self.num_new_tokens >= self.req.num_tokens_with_spec


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    # host copies of KV (bounded residency, swap preemption) to make before the forward, and
    # (residency) requests whose blocks to score
    kv_moves: KVMoves = field(default_factory=KVMoves)
    kv_score_ids: list[str] = field(default_factory=list)
    launched: bool = False  # overlapped scheduling: counted as computed when launched

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.released_ids: list[str] = []  # finished since the engine last looked
        self.swap_mode = config.preemption_mode == "swap"

    # admission -----------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raises ValueError for a request that could never run."""
        limit = self.config.max_model_len
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_prompt_tokens >= limit:
            raise ValueError(f"the prompt is {num_prompt_tokens} tokens, but the model's context "
                             f"is {limit} tokens (prompt plus at least one output token)")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise ValueError(f"this model's maximum context length is {limit} tokens, but "
                             f"{num_prompt_tokens + max_tokens} were requested "
                             f"({num_prompt_tokens} prompt + {max_tokens} max_tokens)")
        total = num_prompt_tokens + (max_tokens if max_tokens is not None else limit - num_prompt_tokens)
        need = -(-total // self.kv.block_size)
        if self.kv.residency is not None:
            need = self.kv.residency.cfg.max_blocks(total)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"the request needs up to {need} KV blocks ({total} tokens), but the "
                             f"whole KV cache holds {self.kv.pool.num_blocks} blocks")

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        done: set[str] = set()
        score_ids: list[str] = []
        res = self.kv.residency

        for req in self._running_in_order():
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_wanted(req, budget)
            if num_new <= 0:
                continue
            if res is not None:  # keys policy: the last prompt chunk is scored, then redone
                req.num_computed_tokens, num_new = res.prefill_step(
                    req.request_id, req.num_computed_tokens, req.num_tokens, num_new,
                    req.params.prompt_logprobs is None)
                num_new = min(num_new, budget)
            self.kv.plan_residency(req, num_new, reserve=len(self.running))
            if not self._allocate_or_preempt(req, num_new, done, preempted):
                continue
            spec = self._fit_spec(req, num_new)
            scheduled.append(ScheduledRequest(req, num_new, spec, req.spec_tree))
            done.add(req.request_id)
            budget -= num_new
            if res is not None and res.wants_scores(
                    req.request_id, self.kv.blocks_of(req.request_id),
                    req.num_computed_tokens + num_new < req.num_tokens):
                score_ids.append(req.request_id)

        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        return SchedulerOutput(scheduled, preempted, self.kv.take_moves(), score_ids)

    def _running_in_order(self) -> list[Request]:
        """Decodes first, then unfinished prefills, each in arrival order."""
        decodes = [r for r in self.running if r.num_computed_tokens >= len(r.prompt_token_ids)]
        if len(decodes) == len(self.running):
            return list(self.running)
        return decodes + [r for r in self.running
                          if r.num_computed_tokens < len(r.prompt_token_ids)]

    def _num_wanted(self, req: Request, budget: int) -> int:
        """Tokens a running request would compute this step (before residency's adjustments)."""
        pending, n = req.num_pending_tokens, len(req.all_token_ids)
        if pending and n - len(req.prompt_token_ids) + pending >= req.max_tokens:
            return 0  # it finishes when its pending tokens land
        return min(n + pending + len(req.spec_token_ids) - req.num_computed_tokens, budget,
                   self._chunk_cap)

    def fits_without_preemption(self) -> bool:
        """Whether `schedule()` would find blocks for every running request it schedules (so
        it preempts none): the blocks the running requests' next chunks need, within the token
        budget, against the free pool. Admissions never preempt."""
        budget, need = self.config.max_num_batched_tokens, 0
        bs, free = self.kv.block_size, self.kv.pool.num_free_blocks
        # a bound first: each scheduled request holds the blocks of its computed tokens, so its
        # chunk of n tokens needs at most ceil(n / bs) more; the chunks sum to at most the budget
        if self.kv.residency is None and free * bs >= budget + len(self.running) * (bs - 1):
            return True
        for req in self._running_in_order():
            if budget <= 0:
                break
            num_new = self._num_wanted(req, budget)
            if num_new <= 0:
                continue
            num_blocks = -(-(req.num_computed_tokens + num_new) // self.kv.block_size)
            need += max(num_blocks - len(self.kv.blocks_of(req.request_id)), 0)
            budget -= num_new
        return need <= self.kv.pool.num_free_blocks

    @property
    def _chunk_cap(self) -> int:
        res = self.kv.residency
        return res.cfg.chunk_tokens if res is not None else self.config.max_num_batched_tokens

    def _fit_spec(self, req: Request, num_new: int) -> list[int]:
        """Drops the drafts that did not fit in the budget (a tree's last nodes: a subtree)."""
        if not req.spec_token_ids and req.spec_tree is None:
            return []
        room = max(req.num_computed_tokens + num_new - req.num_tokens, 0)
        req.spec_token_ids = req.spec_token_ids[:room]
        if req.spec_tree is not None:
            req.spec_tree = req.spec_tree.truncated(room) if room else None
        return list(req.spec_token_ids)

    def _allocate_or_preempt(self, req: Request, num_new: int, done: set[str],
                             preempted: list[Request]) -> bool:
        while not self.kv.allocate_slots(req, num_new):
            victims = [r for r in self.running if r.request_id not in done]
            victim = max(victims, key=lambda r: r.arrival_time)
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            leader = req.prefill_leader
            if leader is not None and not leader.is_finished and \
                    (leader.num_computed_tokens < leader.num_prompt_tokens or
                     leader.num_output_tokens == 0 and leader.num_pending_tokens):
                continue  # n > 1: wait for the first sample's prompt to be cached, then share it
            if req.request_id in self.kv.swapped:
                num_new = min(req.num_tokens - req.num_computed_tokens, budget, self._chunk_cap)
                if not self.kv.swap_in(req, num_new, reserve=len(self.running)):
                    break
            else:
                computed_blocks, num_hit = self.kv.get_computed_blocks(req)
                num_new = min(req.num_tokens - num_hit, budget, self._chunk_cap)
                if not self.kv.allocate_slots(req, num_new, computed_blocks):
                    break
                if req.status == RequestStatus.WAITING:
                    req.num_cached_tokens = num_hit
                req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return budget

    def _preempt(self, req: Request) -> None:
        if self.swap_mode and req.num_computed_tokens > 0:
            # offloads every block; the runner copies them before this step's forward, the
            # first thing that could overwrite them
            self.kv.swap_out(req)
        else:
            req.num_computed_tokens = 0
            req.prompt_logprobs = []  # recomputed with the prompt
            self.kv.free(req, preempted=True)
        req.status = RequestStatus.PREEMPTED
        req.spec_token_ids, req.spec_tree = [], None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    # after the model ran -----------------------------------------------------------------------
    def launched(self, out: SchedulerOutput) -> None:
        """Overlapped scheduling: the step runs on the device; count its tokens as computed and
        each sampling request's next token as pending, so the next step can be scheduled now."""
        for s in out.scheduled:
            samples = s.samples  # before the counts below move
            s.req.num_computed_tokens += s.num_new_tokens
            s.req.num_pending_tokens += samples
        out.launched = True

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advances computed counts (unless `launched` did), appends sampled/accepted tokens,
        finishes requests. `sampled[request_id]` holds the tokens to append (accepted drafts +
        one more). Returns the requests whose token lists changed."""
        changed = []
        for s in out.scheduled:
            req = s.req
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran (a launched step's token is dropped)
            if not out.launched:
                req.num_computed_tokens += s.num_new_tokens
            if req.request_id in sampled:
                req.num_pending_tokens -= out.launched
                tokens = sampled[req.request_id]
                rejected = len(s.spec_token_ids) - (len(tokens) - 1)
                req.num_computed_tokens -= rejected
                req.num_draft_tokens += len(s.spec_token_ids)
                req.num_accepted_tokens += len(tokens) - 1
                req.spec_token_ids, req.spec_tree = [], None
                for t in tokens:
                    req.append_token(t)
                    if req.check_stop():
                        break
                changed.append(req)
            self.kv.cache_blocks(req)
            if req.is_finished:
                self._release(req)
            elif s.spec_token_ids:
                self.kv.trim(req, req.num_tokens)
        return changed

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (abort, stop string): out of the queues, blocks freed."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        req.status = status
        self._release(req)
        return req

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self.released_ids.append(req.request_id)
