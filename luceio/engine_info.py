"""What an engine says about itself: `MemoryStats` and `ModelInfo` (fixed once the engine is
built) and `EngineStats` (a snapshot of its queues, KV pool and counters). `LLMEngine.model_info()` /
`stats()` (and `AsyncEngine`'s) return them; the server's startup log, limits and /metrics read
these, never the engine's internals.

`engine_stats` may run on another thread while the engine thread steps (the server's /metrics
does): every field is one read of an int or a length, and the containers it walks are copied in
one C call first (`list(...)`, `dict.copy`), which the GIL makes atomic against the engine
thread. A snapshot is consistent field by field, not across fields (a step may land between two
reads)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .models.expert_offload import ExpertStats


@dataclass(frozen=True)
class MemoryStats:
    device: str
    weight_bytes: int  # the target's weights, and a draft model's
    kv_cache_bytes: int  # the KV pool, and a draft model's cache of as many blocks
    num_kv_blocks: int
    block_size: int  # tokens per block
    max_model_len: int  # the longest prompt + output served

    def __str__(self) -> str:
        return (f"weights {self.weight_bytes / 2**20:.1f} MiB on {self.device}; KV cache "
                f"{self.kv_cache_bytes / 2**20:.1f} MiB = {self.num_kv_blocks} blocks x "
                f"{self.block_size} tokens; longest context {self.max_model_len} tokens")


@dataclass(frozen=True)
class ModelInfo:
    name: str | None          # EngineArgs.model (None: a model object was given directly)
    vocab_size: int
    max_model_len: int        # the longest prompt + output served
    block_size: int           # tokens per KV block
    num_kv_blocks: int
    device: str
    dtype: str                # activations and dense weights
    weight_bytes: int         # the target's weights, and a draft model's
    kv_cache_bytes: int
    weight_types: tuple[str, ...]  # how the weights are stored ("q4_k x 168", "bf16 x 2", ...)
    speculative_method: str | None

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds at once, over all requests."""
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True)
class EngineStats:
    num_running: int          # sequences the scheduler runs
    num_waiting: int          # queued or preempted
    num_request_states: int   # requests the engine holds output state for
    kv_blocks_total: int
    kv_blocks_used: int       # held by requests
    kv_blocks_free: int       # cached-free included
    prefix_cache_lookups: int
    prefix_cache_hits: int
    offloaded_blocks: int | None  # blocks whose KV waits in host memory; None: residency off
    kv_offloads: int          # blocks moved to host memory (bounded residency)
    kv_reloads: int
    prompt_tokens: int        # computed by prefill
    generation_tokens: int    # sampled
    steps: int                # launched
    overlapped_steps: int     # left in flight while the next step was scheduled
    sync_steps: dict = field(default_factory=dict)  # reason -> steps processed before the next
    discarded_tokens: int = 0  # computed for requests that had already finished
    preemptions: int = 0
    spec_draft_tokens: int = 0     # drafts verified (all requests, finished or not)
    spec_accepted_tokens: int = 0
    # --expert-memory: slots and hit/miss/byte counters (`expert_offload.ExpertStats`); None
    # when no expert is offloaded
    experts: ExpertStats | None = None

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_lookups \
            if self.prefix_cache_lookups else 0.0


def model_info(engine) -> ModelInfo:
    mem = engine.memory_stats()
    return ModelInfo(engine.args.model, engine.runner.cfg.vocab_size, mem.max_model_len,
                     mem.block_size, mem.num_kv_blocks, mem.device,
                     str(engine.runner.dtype).removeprefix("torch."), mem.weight_bytes,
                     mem.kv_cache_bytes, tuple(engine.runner.model.weight_types()),
                     engine.args.speculative_method)


def engine_stats(engine) -> EngineStats:
    kv, sched, c = engine.kv, engine.scheduler, engine.counters
    pool, res = kv.pool, kv.residency
    offloaded = None
    if res is not None:
        offloaded = sum(t.count(-1) for t in list(kv.block_tables.values()))
    spec = engine.spec.stats if engine.spec is not None else None
    offload = engine.runner.expert_offload
    return EngineStats(
        num_running=len(sched.running), num_waiting=len(sched.waiting),
        num_request_states=len(engine.states), kv_blocks_total=pool.num_blocks,
        kv_blocks_used=pool.num_used_blocks, kv_blocks_free=pool.num_free_blocks,
        prefix_cache_lookups=pool.num_lookups, prefix_cache_hits=pool.num_hits,
        offloaded_blocks=offloaded,
        kv_offloads=res.num_offloaded if res is not None else 0,
        kv_reloads=res.num_reloaded if res is not None else 0,
        prompt_tokens=c["prompt_tokens"], generation_tokens=c["generation_tokens"],
        steps=c["steps"], overlapped_steps=c["overlapped_steps"],
        sync_steps=dict.copy(c["sync_steps"]), discarded_tokens=c["discarded_tokens"],
        preemptions=sched.num_preemptions,
        spec_draft_tokens=spec.num_draft_tokens if spec is not None else 0,
        spec_accepted_tokens=spec.num_accepted_tokens if spec is not None else 0,
        experts=offload.stats() if offload is not None else None)
