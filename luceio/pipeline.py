"""The step pipeline: the one step sequence both drivers run (`LLM` through `LLMEngine.step`,
`AsyncEngine` on its engine thread), with overlapped scheduling.

A step: wait for the step in flight if the next one needs its tokens → plan and draft
(speculation) → schedule → launch (forward and sampling; nothing is read back) → process the
step before it → process this one too, unless it may stay in flight.

Overlapped scheduling (`EngineArgs.async_scheduling`): a launched step stays in flight while the
host schedules and launches the next one. Its sampled ids stay on the device, where the next
step's input ids of the same requests are gathered from them (`runner.DeviceTokenIds`); they
reach the host through non-blocking copies into pinned memory and an event (`HostCopy`) that
only output processing waits on, once the next step is queued behind it. The scheduler counts
the step in flight as done (`Scheduler.launched`), each sampling request with one token pending.

Rules:
- A request that finishes at step N (stop token, stop string, abort; a length limit is known in
  advance and not scheduled past) may have computed one more token at N+1. Nothing appends or
  streams it: `Scheduler.update` skips finished requests. Its blocks were freed when it
  finished; later steps reuse them only after N+1 on the same device stream.
- A step is processed before the next is scheduled (a synchronous step) when the next one needs
  its tokens on the host; `counters["sync_steps"]` counts why: "speculation" (the step verified
  drafts, or the next plan may draft: drafts start from the latest token), "preemption"
  (the next schedule may preempt: that is decided with every token known), "residency"
  (bounded residency plans and scores with exact token counts), "idle" (nothing else to
  schedule) and "off" (overlap is off). `counters["overlapped_steps"]` counts the others.
- Structured output stays overlapped: a constrained row's grammar mask depends on the token
  the step in flight sampled, but the forward does not. So a step with constrained rows is
  launched first, then the step in flight is processed (its tokens advance the grammars), and
  only then are the masks built and the sampling queued (`LLMEngine.execute`'s
  `before_masks`): the host's wait, output processing and mask building run while the GPU
  computes the forward. A grammar that terminated at the step in flight leaves its row here
  unmasked (the request finished; the token is dropped).
- A step in flight whose requests have all finished is dropped without waiting for it; its
  tokens count in `counters["discarded_tokens"]`, as do extra tokens of finished requests.
- Host copies of KV (`SchedulerOutput.kv_moves`: bounded residency, swap preemption) are made
  when a step launches, before its forward, in stream order: an offload reads what the steps
  before wrote, ahead of this forward reusing its block. Offloads happen only with no step in
  flight (preemption waits for it; residency steps are synchronous), so their blocking copy to
  the host waits on nothing else; a resumed request's reloads may queue behind a step in flight.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .memory import current_stream
from .outputs import RequestOutput
from .request import Request
from .step_inputs import DeviceTokenIds, StepInputs
from .sampler import LogprobTensors, Pending, device_tensor, has_penalty
from .scheduler import SchedulerOutput
from .structured import GrammarBatch


class HostCopy:
    """Device tensors (and `LogprobTensors`) on their way to host memory: non-blocking copies
    into pinned buffers and an event that nothing waits on until `wait()`. On the CPU the
    tensors are there already."""

    def __init__(self, items: list):
        tensors = [t for item in items for t in _tensors(item)]
        self._event = None
        if not tensors or tensors[0].device.type == "cpu":
            self._host = items
            return
        self._host = [_map(item, _to_pinned) for item in items]
        self._event = torch.cuda.Event()
        self._event.record(current_stream(tensors[0].device))

    def wait(self) -> list:
        """The items on the host, once their copies are done."""
        if self._event is not None:
            self._event.synchronize()
        return self._host


def _tensors(item) -> list[torch.Tensor]:
    return item.tensors() if isinstance(item, LogprobTensors) else [item]


def _map(item, fn):
    return LogprobTensors(*map(fn, item.tensors())) if isinstance(item, LogprobTensors) else fn(item)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


@dataclass
class Batch:
    sched: SchedulerOutput
    inputs: StepInputs
    grammar: GrammarBatch | None = None  # the constrained rows, with their matchers
    num_prompt_tokens: int = 0  # prompt tokens this step computes
    decode_only: bool = False  # no prefill chunk rides along (the speculation cost model)

    @classmethod
    def of(cls, sched: SchedulerOutput, inputs: StepInputs, grammar: GrammarBatch | None):
        """A scheduled step, with the facts its processing needs counted before it runs."""
        items = sched.scheduled
        return cls(sched, inputs, grammar, sum(
            min(s.num_new_tokens, max(s.req.num_prompt_tokens - s.req.num_computed_tokens, 0))
            for s in items),
            all(s.req.num_computed_tokens >= s.req.num_tokens - 1 for s in items))


def pending_tokens(inputs: StepInputs, reqs: list[Request]) -> Pending | None:
    """For the sampler: the tokens of `reqs` (the sampled rows, in order) still on the device,
    when a penalty needs them (it counts them with the request's output)."""
    ids = inputs.ids_from
    if ids is None or not any(has_penalty(r) for r in reqs):
        return None
    src = dict(zip(inputs.device_ids, ids.src.tolist()))
    rows = [i for i, r in enumerate(reqs) if r.request_id in src]
    index = device_tensor([src[reqs[i].request_id] for i in rows], torch.int64,
                          ids.token_ids.device)
    return Pending(rows, ids.token_ids[index])


@dataclass
class DeviceSamples:
    """A step's plainly sampled rows, still on the device."""
    request_ids: list[str]  # of each row
    token_ids: torch.Tensor  # [rows] int64
    logprobs: LogprobTensors | None
    num_logprobs: list[int | None]  # alternatives each row asked for

    def ids_for(self, device_ids: dict[str, int]) -> DeviceTokenIds:
        """Where the next step's tokens still on the device (request id -> flat token index)
        come from: these rows."""
        row = {rid: i for i, rid in enumerate(self.request_ids)}
        return DeviceTokenIds(self.token_ids,
                              np.array([row[rid] for rid in device_ids], dtype=np.int64),
                              np.array(list(device_ids.values()), dtype=np.int64))


@dataclass
class StepResult:
    """One step's outcome. Speculative verify rows are on the host when `execute` returns; plain
    rows and all logprobs reach the host through `copy` and land in the dicts at `resolve()`."""
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict | None]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict]] = field(default_factory=dict)
    kv_scores: dict = field(default_factory=dict)  # residency keys policy: id -> block scores
    started: float = 0.0  # perf_counter() when `execute` began
    overlapped: bool = False  # launched while the step before it was still in flight
    seconds: float = 0.0  # the step's period: from the step before it being ready (or its own
    # launch, if none came just before) to its tokens being ready (set by the pipeline)
    samples: DeviceSamples | None = None
    device_prompt_logprobs: dict[str, tuple[LogprobTensors, int]] = field(default_factory=dict)
    copy: HostCopy | None = None

    def start_copy(self) -> None:
        """Starts the device→host copies of everything `resolve` needs."""
        items = []
        if self.samples is not None:
            items.append(self.samples.token_ids)
            if self.samples.logprobs is not None:
                items.append(self.samples.logprobs)
        items += [lps for lps, _ in self.device_prompt_logprobs.values()]
        self.copy = HostCopy(items)

    def resolve(self) -> None:
        """Waits for the copies and fills `sampled`, `logprobs` and `prompt_logprobs` (once)."""
        if self.copy is None:
            return
        host, self.copy = iter(self.copy.wait()), None
        if self.samples is not None:
            s = self.samples
            ids = next(host).tolist()
            lps = next(host).to_dicts(s.num_logprobs) if s.logprobs is not None else \
                [None] * len(ids)
            for rid, tok, lp in zip(s.request_ids, ids, lps):
                self.sampled[rid] = [tok]
                self.logprobs[rid] = [lp]
        for rid, (_, n) in self.device_prompt_logprobs.items():
            lps = next(host)
            self.prompt_logprobs[rid] = lps.to_dicts([n] * len(lps.chosen))


class StepPipeline:
    """Orders the engine's phases (see the module docstring). `overlap`: whether a step may stay
    in flight while the next is scheduled."""

    def __init__(self, engine, overlap: bool):
        self.engine = engine
        self.overlap = overlap
        self.in_flight: tuple[Batch, StepResult] | None = None
        self._last_ready = 0.0

    @property
    def busy(self) -> bool:
        """A step is in flight (the drivers step on until it is processed)."""
        return self.in_flight is not None

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        outputs: list[RequestOutput] = []
        if self.in_flight is not None:
            reason = self._wait_reason()
            if reason is not None:
                outputs += self._retire(reason)
        plan = eng.plan_drafts()
        if plan is not None:
            eng.apply_drafts(plan, eng.run_drafts(plan))
        previous = self.in_flight
        batch = eng.schedule_step(previous[1].samples if previous is not None else None)
        if batch is None:
            if previous is not None:
                outputs += self._retire("idle")
            self._last_ready = 0.0  # the next step's period starts at its own launch
            return outputs + eng.finish_step(None, None)
        settled = []

        def settle() -> None:  # the step in flight, processed while this forward runs
            if previous is not None and not settled:
                settled.append(True)
                eng.counters["overlapped_steps"] += 1
                outputs.extend(self._process(*previous))
        result = eng.execute(batch, settle)
        result.overlapped = previous is not None
        self.in_flight = None
        reason = self._sync_reason(batch)
        if reason is None:
            eng.scheduler.launched(batch.sched)
            self.in_flight = (batch, result)
        settle()
        if reason is not None:
            eng.counters["sync_steps"][reason] += 1
            outputs += self._process(batch, result)
        return outputs + eng.finish_step(None, None)

    def _wait_reason(self) -> str | None:
        """Why the step in flight must be processed before the next is scheduled, if it must."""
        eng = self.engine
        if eng.spec is not None and eng.spec.may_draft(eng.scheduler.running):
            return "speculation"
        if not eng.scheduler.fits_without_preemption():
            return "preemption"
        return None

    def _sync_reason(self, batch: Batch) -> str | None:
        """Why a step just launched cannot stay in flight, if it cannot."""
        if not self.overlap:
            return "off"
        if any(s.spec_token_ids for s in batch.sched.scheduled):
            return "speculation"
        if self.engine.kv.residency is not None:
            return "residency"
        return None

    def _retire(self, reason: str) -> list[RequestOutput]:
        batch, result = self.in_flight
        self.in_flight = None
        self.engine.counters["sync_steps"][reason] += 1
        return self._process(batch, result)

    def _process(self, batch: Batch, result: StepResult) -> list[RequestOutput]:
        """Output processing of one launched step; drops the tokens of finished requests, and
        does not wait for a step whose requests have all finished."""
        finished = {s.req.request_id for s in batch.sched.scheduled if s.req.is_finished}
        if result.samples is not None:
            self.engine.counters["discarded_tokens"] += sum(
                rid in finished for rid in result.samples.request_ids)
        if len(finished) == len(batch.sched.scheduled):
            return []
        result.resolve()
        # the step's time: the period since the step before it was ready, so the host work a
        # synchronous step cannot hide (drafting, scheduling, preparing its inputs) counts
        # against it, as it costs throughput; from its launch when no step came just before
        now = time.perf_counter()
        since = self._last_ready if self._last_ready else result.started
        result.seconds, self._last_ready = now - since, now
        return self.engine.finish_step(batch, result)
