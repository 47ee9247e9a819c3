"""LLMEngine.step(): schedule → run → sample → update → outputs.

A step's phases: `schedule_step()` (scheduler + batch tensors), `execute(batch)` (forward +
sampling, launched on the device; tensors only) and `finish_step(batch, result)` (token appends,
stop checks, outputs). `pipeline.StepPipeline` orders them, overlapping the next step's
scheduling with the step in flight where it can.

Constrained requests (`SamplingParams.structured_outputs`): `add_request` compiles the grammar
and starts a matcher per sample; `execute` fills the step's grammar masks on the host after
launching the forward (so on a GPU they overlap it; its walk through speculative drafts ends
where it began) and the sampler applies them; `finish_step` feeds the appended tokens to the
matchers, the only place that advances them, and ends a request whose grammar has terminated."""
from __future__ import annotations

import itertools
import os
import logging
import time
from collections import Counter

import numpy as np
import torch

from .cache import KVCacheManager
from .config import EngineArgs
from .engine_runner import build_runner
from .engine_info import EngineStats, MemoryStats, ModelInfo, engine_stats, model_info
from .errors import QueueFullError
from .infill_sampling import token_piece
from .inputs import PromptType, split_prompt
from .kernels.qdot_cpu import set_activations as set_cpu_activations
from .loader import load_checkpoint
from .loader.resolve import model_path
from .output_processor import RequestState
from .outputs import RequestOutput
from .request import Request, RequestStatus
from .admission import check_request, check_token_ids
from .models import caches_prefixes, check_engine_support, runs_spec_prefill
from .pipeline import Batch, DeviceSamples, StepPipeline, StepResult, pending_tokens
from .sampler import Sampler, device_tensor
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .spec import build_draft_model, build_spec_decoder, build_spec_prefill, check_draft_vocab
from .spec.commit import commit_verified
from .stages import start_stages
from .structured import StructuredOutputs
from .tokenizer import Tokenizer
from .warmup import warm_runner

logger = logging.getLogger("luceio")


class LLMEngine:
    def __init__(self, args: EngineArgs, model=None, tokenizer: Tokenizer | None = None):
        self.args = args
        device = args.resolved_device()
        dtype = args.resolved_dtype(device)
        if device.type == "cpu":
            torch.set_num_threads(args.cpu_threads or max(1, (os.cpu_count() or 2) - 1))
            set_cpu_activations(args.cpu_activations)
        ckpt = load_checkpoint(model_path(args.model)) if model is None else None
        self.model_config = ckpt.config if ckpt else {}
        self.generation_config = ckpt.generation_config if ckpt else {}
        if tokenizer is None and ckpt is not None and ckpt.tokenizer is not None:
            tokenizer = Tokenizer(ckpt.tokenizer, ckpt.tokenizer_config, ckpt.generation_config,
                                  ckpt.config)
        self.tokenizer = tokenizer
        check_engine_support(args, ckpt, model)
        self.stages = start_stages(args, ckpt, model)
        try:
            if self.stages is not None:  # stage 0's KV pool is sized around its own layers
                model = self.stages.build_model(ckpt, dtype, device, args.quantization)
            # the draft model loads first, so the target's KV cache is sized around its weights
            draft = build_draft_model(args, dtype, device)
            self.runner = build_runner(args, ckpt, model, dtype, device, draft, self.stages)
            if draft is not None:
                check_draft_vocab(args, draft.cfg.vocab_size, self.runner.cfg.vocab_size)
        except BaseException:
            if self.stages is not None:
                self.stages.close()
            raise
        self.max_model_len = self.runner.max_model_len
        self._weight_bytes = self.runner.model.weight_bytes() + \
            (draft.weight_bytes() if draft is not None else 0)
        prefix_caching = args.enable_prefix_caching and caches_prefixes(self.runner.model)
        if args.enable_prefix_caching and not prefix_caching:
            logger.info("prefix caching is off for %s models", self.runner.model.family)
        self.kv = KVCacheManager(self.runner.num_blocks, args.block_size, prefix_caching,
                                 args.residency_config())
        if args.kv_resident_policy == "spec" and args.kv_resident_tokens and draft is None:
            raise ValueError("--kv-resident-policy spec scores blocks with the draft model: "
                             "give --draft-model")
        self.scheduler = Scheduler(args.scheduler_config(self.max_model_len), self.kv)
        # compile the eager steps' kernel variants now, not in a request's first steps
        warm_runner(self.runner, args.max_num_seqs, self.scheduler.config.max_num_batched_tokens)
        self.sampler = Sampler(args.seed, piece=token_piece(tokenizer))
        self.spec = build_spec_decoder(args, self.runner, self.sampler, self.max_model_len, draft)
        self.spec_prefill = build_spec_prefill(args, self.runner, draft, self.max_model_len) \
            if runs_spec_prefill(self.runner.model) and runs_spec_prefill(draft) else None
        self.structured = StructuredOutputs(tokenizer, self.runner.cfg.vocab_size)
        self.states: dict[str, RequestState] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._ids = itertools.count()
        self.pipeline = StepPipeline(self, args.resolved_async_scheduling(device))
        if self.spec is not None and self.pipeline.overlap:
            # a plain step costs what an overlapped one costs: the first plain step after a
            # drafting step ran synchronously, so the cost model's plain probe is two steps
            self.spec.plain_probe_steps = 2
        # steps: launched; sync_steps: per reason, steps processed before the next was
        # scheduled (pipeline.py); discarded_tokens: computed for requests already finished.
        # Read them through `stats()`
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                      "overlapped_steps": 0, "sync_steps": Counter(), "discarded_tokens": 0}
        logger.info("%s", self.memory_stats())
        logger.info("weights stored as %s", ", ".join(self.runner.model.weight_types()))

    def memory_stats(self) -> MemoryStats:
        """What the weights and the KV pool take, and the context the pool serves."""
        return MemoryStats(str(self.runner.device), self._weight_bytes,
                           self.runner.kv_cache_bytes, self.runner.num_blocks,
                           self.args.block_size, self.max_model_len)

    def model_info(self) -> ModelInfo:
        """The served model and the engine's fixed limits (`engine_info.ModelInfo`)."""
        return model_info(self)

    def stats(self) -> EngineStats:
        """A snapshot of the queues, the KV pool and the counters (`engine_info.EngineStats`);
        safe to take from another thread while this engine steps."""
        return engine_stats(self)

    def close(self) -> None:
        """Ends the pipeline stages' processes, if any; the engine cannot step after it."""
        if self.stages is not None:
            self.stages.close()

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raises ValueError for a request this engine could never run."""
        self.scheduler.check_fits(num_prompt_tokens, max_tokens)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kw) -> "LLMEngine":
        return cls(args, **kw)

    @property
    def eos_token_ids(self) -> set[int]:
        return self.tokenizer.eos_token_ids if self.tokenizer is not None else set()

    # requests ----------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text, prompt = split_prompt(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        check_token_ids("prompt token ids", ids, self.runner.cfg.vocab_size)
        return text, ids

    def spec_prefill_keep(self, num_prompt_tokens: int, params: SamplingParams) -> float | None:
        """The keep ratio speculative prefill applies to this prompt, or None."""
        if self.spec_prefill is None:
            return None
        if params.spec_prefill_keep is not None:
            return params.spec_prefill_keep
        if self.args.spec_prefill_keep is not None and \
                num_prompt_tokens >= self.args.spec_prefill_min_tokens:
            return self.args.spec_prefill_keep
        return None

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    kept_positions: list[int] | None = None,
                    block_scores=None) -> str:
        """Validates and queues a request; raises ValueError for one that can never run.
        `kept_positions`: the prompt positions speculative prefill kept (computed here when
        the request asks for it and none are given). `block_scores`: the residency `spec`
        policy's per-block prompt scores (likewise computed here when needed)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        check_request(self, ids, params)
        sample_ids = [request_id if params.n == 1 else f"{request_id}#{i}" for i in range(params.n)]
        if any(i in self.scheduler.requests for i in sample_ids):
            raise ValueError(f"request id {request_id!r} collides with a running request's samples")
        if len(self.scheduler.waiting) >= self.args.max_queued_requests:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are already waiting")
        keep = self.spec_prefill_keep(len(ids), params)
        if kept_positions is None and keep is not None:
            kept_positions = self.spec_prefill.select(ids, keep)
        kept_ids = ids if kept_positions is None else [ids[p] for p in kept_positions]
        if params.structured_outputs is not None:  # last: a refusal must leave nothing behind
            self.structured.add(sample_ids, params.structured_outputs)
        arrival = arrival_time or time.monotonic()
        samples = [Request(sample_ids[i], kept_ids, params,
                           self.eos_token_ids, self.max_model_len, parent_id=request_id, index=i,
                           arrival_time=arrival, position_ids=kept_positions,
                           num_original_prompt_tokens=len(ids)) for i in range(params.n)]
        for r in samples[1:]:
            r.prefill_leader = samples[0]
        self.states[request_id] = RequestState(request_id, text, ids, params, samples,
                                               self.tokenizer)
        if block_scores is None and self.wants_block_scores(len(kept_ids)):
            block_scores = self.prompt_block_scores(kept_ids)
        for r in samples:
            if block_scores is not None:
                self.kv.residency.set_scores(r.request_id, block_scores)
            self.scheduler.add_request(r)
        return request_id

    def wants_block_scores(self, num_prompt_tokens: int) -> bool:
        """Residency `spec` policy: whether this prompt outgrows the budget (so it needs the
        draft's scores of its blocks)."""
        return self.kv.residency is not None and self.args.kv_resident_policy == "spec" and \
            num_prompt_tokens > self.args.kv_resident_tokens

    def prompt_block_scores(self, ids: list[int]):
        """The draft model's importance of each prompt token (speculative prefill's scorer),
        averaged per KV block. Runs a draft forward: call it where a step would run."""
        tok = self.spec_prefill.scores(ids).float().cpu().numpy()
        bs = self.args.block_size
        return np.array([tok[i:i + bs].mean() for i in range(0, len(tok), bs)])

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.states.get(rid)
            if state is None:
                continue
            for s in state.samples:
                self.scheduler.finish(s.req.request_id, RequestStatus.FINISHED_ABORTED)
            self._emit(state)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending_outputs) or \
            self.pipeline.busy

    # one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        return self.pipeline.step()

    # speculation: plan and apply on the loop thread, draft on the worker thread
    def plan_drafts(self):
        if self.spec is None:
            return None
        self._release_finished()
        plan = self.spec.plan(self.scheduler.running)
        return plan if plan[0] else None

    def run_drafts(self, plan):
        return self.spec.draft(*plan)

    def apply_drafts(self, plan, drafts) -> None:
        self.spec.apply(plan[0], *drafts)

    def _release_finished(self) -> None:
        ids, self.scheduler.released_ids = self.scheduler.released_ids, []
        for rid in ids:
            self.structured.release(rid)
            if self.spec is not None:
                self.spec.release(rid)
        # their host copies (a swapped-out request's included): the moves' one release path,
        # applied now rather than with the next step's moves so nothing lingers when idle
        for rid in self.kv.host.take_drops():
            self.runner.host_store.drop(rid)

    def schedule_step(self, previous: DeviceSamples | None = None) -> Batch | None:
        """`previous`: the sampled rows of the step in flight, which hold the input ids of this
        step's tokens still on the device."""
        sched = self.scheduler.schedule()
        if not sched:
            if sched.kv_moves:  # blocks were offloaded but nothing runs: copy them now
                self.runner.host_store.apply(sched.kv_moves)
            return None
        inputs = self.runner.prepare(sched, self.kv)
        if inputs.device_ids:
            inputs.ids_from = previous.ids_for(inputs.device_ids)
        return Batch.of(sched, inputs, self.structured.plan(sched.scheduled, inputs.row_slices,
                                                            len(inputs.host.logits_indices)))

    def execute(self, batch: Batch, before_masks=None) -> StepResult:
        """Forward and sampling, launched on the device: plain rows' tokens and logprobs stay
        there (their host copy starts, unwaited); speculative verify rows come back at once.
        `before_masks`: called once the forward is queued and before the grammar masks are
        built (the pipeline processes the step in flight there, whose tokens the masks start
        from). Reads request state, writes only tensors: safe off-loop."""
        res = StepResult(started=time.perf_counter())
        # host copies first: an offload's device block may be reused by this very forward
        self.runner.host_store.apply(batch.sched.kv_moves)
        logits = self.runner.execute(batch.inputs)
        # host work while the device runs the forward
        bitmask = None
        if batch.grammar is not None:
            if before_masks is not None:
                before_masks()
            bitmask = batch.grammar.fill()
        rows = batch.inputs.row_slices
        by_id = {s.req.request_id: s for s in batch.sched.scheduled}
        if self.spec is not None and any(s.spec_token_ids for s in batch.sched.scheduled):
            tokens, lps, paths = self.spec.verify(logits, rows, batch.sched.scheduled, bitmask)
            commit_verified(self.runner, batch.inputs, tokens, paths)
            res.sampled.update(tokens)
            res.logprobs.update(lps)
        plain = [by_id[rid].req for rid in rows if rid not in res.sampled]
        if plain:
            starts = [rows[r.request_id].start for r in plain]
            picked = logits if starts == list(range(len(logits))) else \
                logits[device_tensor(starts, torch.int64, logits.device)]
            out = self.sampler(picked, plain, bitmask[starts] if bitmask is not None else None,
                               pending_tokens(batch.inputs, plain))
            res.samples = DeviceSamples([r.request_id for r in plain], out.token_ids,
                                        out.logprobs, [r.params.logprobs for r in plain])
        for rid, (sl, first) in batch.inputs.prompt_row_slices.items():
            req = by_id[rid].req
            nxt = device_tensor(req.all_token_ids[first + 1:first + 1 + sl.stop - sl.start],
                                torch.int64, logits.device)
            n = req.params.prompt_logprobs
            res.device_prompt_logprobs[rid] = (
                self.sampler.logprob_tensors(logits[sl], nxt, [n] * len(nxt)), n)
        res.kv_scores = batch.inputs.kv_scores or {}
        res.start_copy()
        self.counters["steps"] += 1
        self.counters["prompt_tokens"] += batch.num_prompt_tokens
        return res

    def finish_step(self, batch: Batch | None, result: StepResult | None) -> list[RequestOutput]:
        """Processes a step (when given; waits for its tokens); returns every output ready."""
        if batch is not None:
            result.resolve()
            self._record_prompt_logprobs(batch, result)
            if self.spec is not None:
                self.spec.observe_step(batch, result, self.pipeline.overlap)
            for rid, scores in result.kv_scores.items():
                if rid in self.scheduler.requests:
                    self.kv.residency.set_scores(rid, scores)
            changed = self.scheduler.update(batch.sched, result.sampled)
            self.structured.advance(changed, self.scheduler.finish)
            now = time.monotonic()
            for req in changed:
                self._record_sample(req, result, now)
            for state in {self.states[r.parent_id] for r in changed if r.parent_id in self.states}:
                self._emit(state)
        self._release_finished()
        outs, self._pending_outputs = self._pending_outputs, []
        return outs

    def _record_prompt_logprobs(self, batch: Batch, result: StepResult) -> None:
        for rid, lps in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)
            room = req.num_prompt_tokens - len(req.prompt_logprobs)
            req.prompt_logprobs.extend(lps[:room])

    def _record_sample(self, req: Request, result: StepResult, now: float) -> None:
        self.counters["generation_tokens"] += len(result.sampled.get(req.request_id, []))
        if req.first_token_time is None:
            req.first_token_time = now
        if req.params.logprobs is None:
            return
        lps = iter(result.logprobs.get(req.request_id) or [])
        while len(req.output_logprobs) < req.num_output_tokens:
            lp = next(lps)
            tok = req.all_token_ids[req.num_prompt_tokens + len(req.output_logprobs)]
            req.output_logprobs.append(lp)
            req.cumulative_logprob += lp[tok][0]

    def _emit(self, state: RequestState) -> None:
        for s in state.samples:
            stop = s.absorb()
            if stop is not None and not s.req.is_finished:
                s.req.stop_reason = stop
                self.scheduler.finish(s.req.request_id, RequestStatus.FINISHED_STOPPED)
            elif stop is not None:
                s.req.status, s.req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        out = state.make_output()
        if out is not None:
            self._pending_outputs.append(out)
        if state.finished:
            self.states.pop(state.request_id, None)
