"""Expert offload for mixture-of-experts models (`--expert-memory`, `--expert-placement`).

Every expert of a sparse layer waits in host memory (pinned when the model runs on a CUDA
device); the device holds `num_slots` of them per layer, in slot stacks shaped like the resident
ones ([num_slots, 2 * inter, hidden], [num_slots, hidden, inter]), which the layer's
`w_gate_up` / `w_down` parameters become.

Rules:
- The budget buys the same number of slots in every sparse layer: budget // (sparse layers x
  one expert's bytes), capped at the experts per layer. At least top-k slots per layer (one
  token's experts), or the budget is refused; enough for every expert, and nothing is offloaded.
- `ExpertCache` (ids only) decides which expert sits in which slot. Slots [0, P) hold the
  layer's pinned experts for good: a placement file's first P experts of the layer, P at most
  num_slots - top_k, so a decoding token's misses fit the LRU slots that remain. The other slots
  are an LRU cache, empty at start.
- A step asks each sparse layer for the experts its tokens were routed to (one host read of
  their ids per layer). Hits (pinned or cached) are touched; misses are loaded in ascending
  expert id into free slots, else into the least recently used slot whose expert this round
  does not use. When the misses outnumber the slots they can take, the layer runs in rounds:
  the first computes the hits and the misses that fit, each next one reuses every LRU slot for
  the next misses. `kernels.fused_moe` takes the rounds (`kernels/moe.py`): the output equals
  the fully resident layer's, bit for bit.
- Counters per layer: hits and misses (one per expert a step needs; a miss is one load of one
  expert's three matrices, `expert_bytes` bytes, host to device).
- `ExpertStore` is the tensor half. On a CUDA device its copies run on a side stream: they wait
  for the layer's last use of its slots (an event) rather than for the whole compute stream,
  and the compute stream waits for them before the round's kernels. On the CPU they are plain
  copies. The host read of the routed ids syncs the device once per sparse layer, so an
  offloaded model runs eagerly (the runner captures no CUDA graphs for it, and a capture that
  reaches a layer is refused); the copies overlap only what is already queued, not the layers
  before (that needs the next layer's experts before its router runs).
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import ExpertOffloadConfig
from ..kernels.moe import route_topk_ref
from .moe import SparseMoeBlock

logger = logging.getLogger("luceio")

PLACEMENT_FORMAT = "luceio-expert-placement/1"


@dataclass(frozen=True)
class ExpertStats:
    num_slots: int         # device slots per sparse layer
    num_pinned: int        # of them, held for good by placed experts (summed over layers)
    hits: int
    misses: int
    bytes_loaded: int      # host to device, for the misses


class ExpertCache:
    """One sparse layer's slot assignment: ids and counts only (see the module docstring)."""

    def __init__(self, num_slots: int, pinned: list[int] = ()):
        if len(pinned) >= num_slots:
            raise ValueError(f"{len(pinned)} pinned experts leave no LRU slot of {num_slots}")
        self.slot_of: dict[int, int] = {e: s for s, e in enumerate(pinned)}  # expert -> slot
        self.pinned = frozenset(pinned)
        self.lru: OrderedDict[int, int] = OrderedDict()  # cached expert -> slot, oldest first
        self.free = list(range(len(pinned), num_slots))
        self.hits = self.misses = 0

    def plan(self, needed: list[int]) -> list[tuple[list[tuple[int, int]], dict[int, int]]]:
        """needed: the step's experts, ascending. Returns the rounds: (loads [(expert, slot)],
        the slot of every expert the round computes)."""
        held = {e: self.slot_of[e] for e in needed if e in self.slot_of}
        misses = [e for e in needed if e not in self.slot_of]
        self.hits += len(held)
        self.misses += len(misses)
        for e in held:
            if e in self.lru:
                self.lru.move_to_end(e)
        rounds = []
        while misses or not rounds:
            room = len(self.free) + sum(e not in held for e in self.lru)
            batch, misses = misses[:room], misses[room:]
            loads = []
            for e in batch:
                held[e] = self._take_slot(e, held)
                loads.append((e, held[e]))
            rounds.append((loads, held))
            held = {}
        return rounds

    def _take_slot(self, expert: int, busy: dict[int, int]) -> int:
        """A free slot, else the least recently used one no expert in `busy` sits in."""
        if self.free:
            slot = self.free.pop(0)
        else:
            victim = next(e for e in self.lru if e not in busy)
            slot = self.lru.pop(victim)
            del self.slot_of[victim]
        self.slot_of[expert] = self.lru[expert] = slot
        return slot


class ExpertStore:
    """One sparse layer's experts: all of them on the host, `num_slots` on the device."""

    def __init__(self, num_experts: int, inter: int, hidden: int, cache: ExpertCache,
                 num_slots: int, dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        self.host_gate_up = torch.empty(num_experts, 2 * inter, hidden, dtype=dtype,
                                        pin_memory=pin)
        self.host_down = torch.empty(num_experts, hidden, inter, dtype=dtype, pin_memory=pin)
        self.slot_gate_up = torch.empty(num_slots, 2 * inter, hidden, dtype=dtype, device=device)
        self.slot_down = torch.empty(num_slots, hidden, inter, dtype=dtype, device=device)
        self.cache, self.num_experts, self.device = cache, num_experts, device
        self.expert_bytes = 3 * inter * hidden * self.host_down.element_size()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last_use: torch.cuda.Event | None = None  # the slots' last reader, queued

    def place_pinned(self) -> None:
        """Copies the pinned experts into their slots (once their weights are loaded)."""
        self._copy([(e, self.cache.slot_of[e]) for e in sorted(self.cache.pinned)])

    def rounds(self, expert_ids: torch.Tensor) -> Iterator[torch.Tensor]:
        """`kernels.fused_moe`'s rounds for one layer's routing ([num_tokens, top_k]): per
        round, each expert's slot (-1: not this round), its misses copied in first."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("an offloaded mixture-of-experts layer cannot run in a CUDA "
                               "graph: it reads its routed experts on the host")
        for loads, slots in self.cache.plan(torch.unique(expert_ids).tolist()):
            self._copy(loads)
            rows = torch.full((self.num_experts,), -1, dtype=torch.int64)
            rows[list(slots)] = torch.tensor(list(slots.values()), dtype=torch.int64)
            yield rows.to(self.device, non_blocking=True)
            if self.stream is not None:  # the round's kernels are queued: the next copies wait
                self.last_use = torch.cuda.Event()
                self.last_use.record()

    def _copy(self, loads: list[tuple[int, int]]) -> None:
        if not loads:
            return
        if self.stream is None:
            for e, s in loads:
                self.slot_gate_up[s].copy_(self.host_gate_up[e])
                self.slot_down[s].copy_(self.host_down[e])
            return
        with torch.cuda.stream(self.stream):
            if self.last_use is not None:
                self.stream.wait_event(self.last_use)
            for e, s in loads:
                self.slot_gate_up[s].copy_(self.host_gate_up[e], non_blocking=True)
                self.slot_down[s].copy_(self.host_down[e], non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def stats(self) -> tuple[int, int, int]:
        """(hits, misses, bytes loaded)."""
        c = self.cache
        return c.hits, c.misses, c.misses * self.expert_bytes


def has_experts(model) -> bool:
    """Whether `model` has sparse layers of `SparseMoeBlock`s (Qwen3-MoE, Qwen3.5-MoE)."""
    moe = getattr(model, "moe_cfg", None)
    return moe is not None and all(isinstance(model.layers[i].mlp, SparseMoeBlock)
                                   for i in moe.sparse_layers)


class ExpertOffload:
    """The model's expert offload: one `ExpertStore` per sparse layer, attached to the model
    before its weights load (`models.build_model`), and their counters (`stats`)."""

    def __init__(self, config: ExpertOffloadConfig):
        self.config = config
        self.stores: dict[int, ExpertStore] = {}
        self.num_slots = 0

    def attach(self, model, dtype: torch.dtype, device: torch.device) -> None:
        """Gives each sparse layer of `model` (on the meta device, not loaded yet) its store;
        raises ValueError for a model without experts or a budget or placement that does not
        fit it. Every expert fitting the budget attaches nothing."""
        if not has_experts(model):
            raise ValueError(f"--expert-memory applies to mixture-of-experts models; "
                             f"{type(model).__name__} has no experts")
        moe, hidden = model.moe_cfg, model.cfg.hidden_size
        layers = moe.sparse_layers
        expert_bytes = 3 * moe.moe_intermediate_size * hidden * dtype.itemsize
        total = len(layers) * moe.num_experts * expert_bytes
        budget = self.config.memory if isinstance(self.config.memory, int) else \
            int(self.config.memory * total)
        num_slots = min(moe.num_experts, budget // (len(layers) * expert_bytes))
        if num_slots < moe.top_k:
            raise ValueError(
                f"--expert-memory {self.config.memory!r} ({budget} bytes) holds {num_slots} "
                f"experts per sparse layer; a step needs the top-{moe.top_k}: give at least "
                f"{moe.top_k * len(layers) * expert_bytes} bytes (of {total} for every expert)")
        pinned = load_placement(self.config.placement, layers, moe.num_experts) \
            if self.config.placement else {i: [] for i in layers}
        if num_slots == moe.num_experts:
            logger.info("--expert-memory: every expert fits (%.1f MiB); none offloaded",
                        total / 2**20)
            return
        self.num_slots = num_slots
        for i in layers:
            cache = ExpertCache(num_slots, pinned[i][:num_slots - moe.top_k])
            store = ExpertStore(moe.num_experts, moe.moe_intermediate_size, hidden, cache,
                                num_slots, dtype, device)
            model.layers[i].mlp.offload(store)
            self.stores[i] = store
        logger.info("expert offload: %d of %d experts per sparse layer on %s (%.1f of %.1f "
                    "MiB), %d pinned per layer", num_slots, moe.num_experts, device,
                    num_slots * len(layers) * expert_bytes / 2**20, total / 2**20,
                    len(cache.pinned))

    @property
    def active(self) -> bool:
        """Whether some expert waits in host memory (False when all fit the budget)."""
        return bool(self.stores)

    def stats(self) -> ExpertStats | None:
        """The counters summed over the sparse layers; None when nothing is offloaded."""
        if not self.active:
            return None
        hits = misses = moved = 0
        for store in list(self.stores.values()):
            h, m, b = store.stats()
            hits, misses, moved = hits + h, misses + m, moved + b
        return ExpertStats(self.num_slots, sum(len(s.cache.pinned) for s in self.stores.values()),
                           hits, misses, moved)


# calibration ------------------------------------------------------------------------------------
@contextmanager
def count_experts(model) -> Iterator[dict[int, torch.Tensor]]:
    """While open, counts each sparse layer's routed (token, expert) pairs: layer -> int64
    [num_experts] counts, on the host. Routes each router output again, as the layer does."""
    if not has_experts(model):
        raise ValueError(f"{type(model).__name__} has no experts to calibrate")
    counts = {i: torch.zeros(model.moe_cfg.num_experts, dtype=torch.int64)
              for i in model.moe_cfg.sparse_layers}

    def hook(block: SparseMoeBlock, layer: int):
        def count(_module, _inputs, logits):
            _, ids = route_topk_ref(logits, block.top_k, block.renormalize)
            counts[layer] += torch.bincount(ids.flatten(), minlength=len(counts[layer])).cpu()
        return count

    handles = [model.layers[i].mlp.gate.register_forward_hook(hook(model.layers[i].mlp, i))
               for i in counts]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def placement(counts: dict[int, torch.Tensor], model: str | None) -> dict:
    """The placement file's content: per layer the experts by count, most used first (ties:
    lower id first), and the counts by expert id."""
    layers = {}
    for i, c in counts.items():
        order = sorted(range(len(c)), key=lambda e: (-int(c[e]), e))
        layers[str(i)] = {"experts": order, "counts": c.tolist()}
    num_experts = len(next(iter(counts.values())))
    return {"format": PLACEMENT_FORMAT, "model": model, "num_experts": num_experts,
            "layers": layers}


def load_placement(path: str, layers: tuple[int, ...], num_experts: int) -> dict[int, list[int]]:
    """A placement file's experts by count, per sparse layer; ValueError when it does not fit
    the model."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != PLACEMENT_FORMAT:
        raise ValueError(f"--expert-placement {path}: not a `luceio calibrate-experts` file")
    if data["num_experts"] != num_experts or sorted(map(int, data["layers"])) != list(layers):
        raise ValueError(f"--expert-placement {path}: made for another model ({data['num_experts']}"
                         f" experts, sparse layers {sorted(map(int, data['layers']))}; this one "
                         f"has {num_experts}, sparse layers {list(layers)})")
    out = {}
    for i in layers:
        order = data["layers"][str(i)]["experts"]
        if sorted(order) != list(range(num_experts)):
            raise ValueError(f"--expert-placement {path}: layer {i} does not list each expert "
                             "once")
        out[i] = order
    return out
