"""Expert offload for mixture-of-experts models (`--expert-memory`, `--expert-placement`).

Every expert of a sparse layer waits in host memory (pinned when the model runs on a CUDA
device); the device holds `num_slots` of them per layer, in slot stacks shaped like the resident
ones ([num_slots, 2 * inter, hidden], [num_slots, hidden, inter]), which the layer's
`w_gate_up` / `w_down` parameters become.

Rules:
- The budget (bytes, or a fraction of the experts' bytes) is split evenly over the sparse
  layers; each buys slots of its own experts' bytes, capped at the experts per layer: dense
  ones counted at attach, quantized ones (a GGUF's, `ExpertStore.hold_quantized`) once the
  layer's experts loaded (host and slot stacks are then stacked quantized weights,
  `kernels/moe_quant_triton.py`, read in place only). At least top-k slots per layer (one
  token's experts), or the budget is refused; enough for every expert, and nothing is offloaded.
- `ExpertCache` (ids only) decides which expert sits in which slot. Slots [0, P) hold the
  layer's pinned experts for good: a placement file's first P experts of the layer, P at most
  half the slots (PINNED_SHARE) and num_slots - top_k, so a decoding token's misses fit the LRU
  slots that remain, and the LRU keeps room for the experts recent tokens reuse (on the H200
  bench, pinning all but top-k slots decoded at 0.71x the resident speed where the LRU alone
  gave 0.88x). The other slots are an LRU cache, empty at start.
- Two ways to run a step's experts:
  - In place (GPUs, `expert_tables.py`): the kernels read each expert from its slot, or from
    its pinned host row over the bus, as a device table says; nothing comes back to the host,
    so decode steps replay CUDA graphs. Between steps, experts that were read from the host
    are promoted into LRU slots by copies on a side stream, landing in the table when done.
    Every step inside a graph, and eager steps of up to IN_PLACE_MAX_TOKENS tokens (quantized
    experts: `moe.DECODE_MAX_TOKENS`, as their resident stacks run), run so.
  - Rounds (the CPU; eager steps of more tokens, where reading a weight in place once per
    tile of its tokens would cross the bus several times): the layer reads its routed experts
    on the host (one sync per sparse layer). Hits (pinned or cached) are touched; misses are
    loaded in ascending expert id into free slots, else into the least recently used slot
    whose expert this round does not use. When the misses outnumber the slots they can take,
    the layer runs in rounds: the first computes the hits and the misses that fit, each next
    one reuses every LRU slot for the next misses. A capture that reaches rounds is refused.
  Both give the fully resident layer's output, bit for bit (`kernels/moe.py`).
- Counters per layer: hits and misses, one per expert a step's launch needs (a miss is an
  expert read from host memory, in place or copied in first), and the experts copied into
  slots (`expert_bytes` bytes each, host to device: a round's misses, the promotions).
- `ExpertStore` is the tensor half. On a CUDA device its copies run on a side stream: a
  round's copies wait for the layer's last use of its slots (an event: the layer's last round,
  or the end of the last step read in place) rather than for the whole compute stream, and
  the compute stream waits for them before the round's kernels; promotions wait for
  everything queued and nothing waits for them. On the CPU they are plain copies.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import ExpertOffloadConfig
from ..kernels.moe import InPlace
from .expert_calibration import has_experts, load_placement
from .expert_tables import SlotTables

logger = logging.getLogger("luceio")

# eager steps of more tokens run in rounds (copies), fewer read their experts in place
IN_PLACE_MAX_TOKENS = 64
PINNED_SHARE = 0.5  # of a layer's slots, at most, for a placement's experts


@dataclass(frozen=True)
class ExpertStats:
    num_slots: int         # device slots per sparse layer (the fewest: quantized experts of
    #                        types that differ by layer take different numbers of slots)
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

    def touch(self, used: list[int]) -> None:
        """Marks `used` (ascending) as the most recently used, in that order."""
        for e in used:
            if e in self.lru:
                self.lru.move_to_end(e)

    def promote(self, missed: list[int], busy: set[int]) -> list[tuple[int, int, int | None]]:
        """Slots for experts read in place (`expert_tables.py`): each of `missed` (ascending)
        takes a free slot or the least recently used one whose expert is not in `busy`, while
        one is left. Returns (expert, slot, the evicted expert or None)."""
        loads = []
        for e in missed:
            if self.free:
                slot, victim = self.free.pop(0), None
            else:
                victim = next((v for v in self.lru if v not in busy), None)
                if victim is None:
                    break
                slot = self.lru.pop(victim)
                del self.slot_of[victim]
            self.slot_of[e] = self.lru[e] = slot
            busy.add(e)
            loads.append((e, slot, victim))
        return loads

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
    """One sparse layer's experts: all of them on the host, `num_slots` on the device; dense
    stacks from `allocate_dense`, quantized ones from `hold_quantized`."""

    def __init__(self, num_experts: int, inter: int, hidden: int, cache: ExpertCache,
                 num_slots: int, dtype: torch.dtype | None, device: torch.device):
        self.cache, self.num_experts, self.device = cache, num_experts, device
        self.inter, self.hidden, self.num_slots = inter, hidden, num_slots
        self.host_gate_up = self.host_down = self.slot_gate_up = self.slot_down = None
        self.quantized = False
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (host, slots, rows)
        self.layer = -1  # the model's layer; then sizing: this layer's bytes, placement, ...
        self.budget, self.top_k, self.placement, self.num_layers = 0, 1, [], 1  # (`attach`)
        self.fraction: float | None = None  # --expert-memory as a fraction of the experts
        self.expert_bytes = 0
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last_use: torch.cuda.Event | None = None  # the slots' last reader, queued
        self.loaded = 0  # experts copied into slots
        self.tables: SlotTables | None = None  # read in place (`expert_tables.py`)
        self.in_place: InPlace | None = None
        if dtype is not None:
            self.allocate_dense(dtype)

    def allocate_dense(self, dtype: torch.dtype) -> None:
        """The dense host stacks (pinned on a CUDA device) and slot stacks, once (at the
        layer's first dense expert)."""
        if self.host_gate_up is not None:
            return
        if self.num_slots < self.top_k:
            raise ValueError(
                f"--expert-memory holds {self.num_slots} experts per sparse layer; a step needs "
                f"the top-{self.top_k}: give at least "
                f"{self.top_k * self.num_layers * 3 * self.inter * self.hidden * dtype.itemsize}"
                " bytes")
        pin = self.device.type == "cuda"
        e, i, h, s = self.num_experts, self.inter, self.hidden, self.num_slots
        self.host_gate_up = torch.empty(e, 2 * i, h, dtype=dtype, pin_memory=pin)
        self.host_down = torch.empty(e, h, i, dtype=dtype, pin_memory=pin)
        self.slot_gate_up = torch.empty(s, 2 * i, h, dtype=dtype, device=self.device)
        self.slot_down = torch.empty(s, h, i, dtype=dtype, device=self.device)
        self.expert_bytes = 3 * i * h * dtype.itemsize
        self._pairs = [(self.host_gate_up, self.slot_gate_up, 1),
                       (self.host_down, self.slot_down, 1)]

    def hold_quantized(self, gate_up, down) -> bool:
        """The layer's quantized experts stacked row-wise (`QuantWeight`s on the host,
        gate_up [E * 2 * inter, hidden], down [E * hidden, inter], one qtype each): the slots are
        sized by their bytes from the layer's budget, the stacks laid out as the GPU kernels
        read them (`quant.pair_scales`) in pinned host memory, the slots likewise on the
        device. Returns False when every expert fits the budget (nothing to offload)."""
        from ..kernels import weight_nbytes
        from ..kernels.quant_args import laid_out
        e = self.num_experts
        expert_bytes = (weight_nbytes(gate_up) + weight_nbytes(down)) // e
        budget = self.budget if self.fraction is None else int(self.fraction * e * expert_bytes)
        slots = min(e, budget // expert_bytes)
        if slots == e:
            return False
        if slots < self.top_k:
            raise ValueError(
                f"--expert-memory holds {slots} quantized experts ({expert_bytes} bytes each) per "
                f"sparse layer; a step needs the top-{self.top_k}: give at least "
                f"{self.top_k * self.num_layers * expert_bytes} bytes")
        self.num_slots, self.expert_bytes, self.quantized = slots, expert_bytes, True
        self.cache = ExpertCache(slots, self.placement[:min(slots - self.top_k,
                                                            int(slots * PINNED_SHARE))])
        pin = self.device.type == "cuda"
        self._pairs = []
        for w, n, name in ((gate_up, 2 * self.inter, "gate_up"), (down, self.hidden, "down")):
            host, host_arrays = laid_out(w, w.shape[0], lambda shape, dt: torch.empty(
                shape, dtype=dt, pin_memory=pin), copy=True)
            slot, slot_arrays = laid_out(w, slots * n, lambda shape, dt: torch.empty(
                shape, dtype=dt, device=self.device), copy=False)
            setattr(self, f"host_{name}", host)
            setattr(self, f"slot_{name}", slot)
            self._pairs += [(h, s, n) for h, s in zip(host_arrays, slot_arrays)]
        return True

    def place_pinned(self) -> None:
        """Copies the pinned experts into their slots (once their weights are loaded)."""
        self._copy([(e, self.cache.slot_of[e]) for e in sorted(self.cache.pinned)])
        self.loaded = 0  # placing is not loading a miss

    def in_place_for(self, x: torch.Tensor) -> InPlace | None:
        """The tables to read this step's experts in place: always inside a CUDA graph, in
        eager steps up to IN_PLACE_MAX_TOKENS tokens; None: run `rounds`."""
        if self.in_place is None:
            return None
        if x.shape[0] <= IN_PLACE_MAX_TOKENS or (x.is_cuda and
                                                 torch.cuda.is_current_stream_capturing()):
            return self.in_place
        return None

    def rounds(self, expert_ids: torch.Tensor) -> Iterator[torch.Tensor]:
        """`kernels.fused_moe`'s rounds for one layer's routing ([num_tokens, top_k]): per
        round, each expert's slot (-1: not this round), its misses copied in first."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("an offloaded mixture-of-experts layer cannot run in a CUDA "
                               "graph: it reads its routed experts on the host")
        if self.tables is not None:  # promotions still copying land first
            self.tables.settle(self.layer)
            if self.stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
        yield from self._rounds(expert_ids)
        if self.tables is not None:
            self.tables.rebuild(self.layer)

    def _rounds(self, expert_ids: torch.Tensor) -> Iterator[torch.Tensor]:
        for loads, slots in self.cache.plan(torch.unique(expert_ids).tolist()):
            self._copy(loads)
            rows = torch.full((self.num_experts,), -1, dtype=torch.int64)
            rows[list(slots)] = torch.tensor(list(slots.values()), dtype=torch.int64)
            yield rows.to(self.device, non_blocking=True)
            if self.stream is not None:  # the round's kernels are queued: the next copies wait
                self.last_use = torch.cuda.Event()
                self.last_use.record()

    def load_async(self, loads: list[tuple[int, int]]) -> torch.cuda.Event | None:
        """Promotions (`expert_tables.py`): copies (expert, slot) pairs after everything queued
        so far, on the side stream, the compute stream not waiting; returns the copies' event
        (None on the CPU, where they are done)."""
        if self.stream is None:
            self._copy_rows(loads)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._copy_rows(loads)
            done = torch.cuda.Event()
            done.record()
        return done

    def _copy(self, loads: list[tuple[int, int]]) -> None:
        if not loads:
            return
        if self.stream is None:
            self._copy_rows(loads)
            return
        with torch.cuda.stream(self.stream):
            if self.last_use is not None:
                self.stream.wait_event(self.last_use)
            self._copy_rows(loads)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _copy_rows(self, loads: list[tuple[int, int]]) -> None:
        """(expert, slot) pairs from the host stacks into the slots, on the current stream."""
        self.loaded += len(loads)
        for e, s in loads:
            for host, slots, n in self._pairs:
                slots[s * n:(s + 1) * n].copy_(host[e * n:(e + 1) * n], non_blocking=True)

    def stats(self) -> tuple[int, int, int]:
        """(hits, misses, bytes loaded)."""
        c = self.cache
        return c.hits, c.misses, self.loaded * self.expert_bytes


class ExpertOffload:
    """The model's expert offload: one `ExpertStore` per sparse layer, attached to the model
    before its weights load (`models.build_model`), and their counters (`stats`)."""

    def __init__(self, config: ExpertOffloadConfig):
        self.config = config
        self.stores: dict[int, ExpertStore] = {}
        self.num_slots = 0
        self.tables: SlotTables | None = None

    def attach(self, model, dtype: torch.dtype, device: torch.device,
               quantized_file: bool = False) -> None:
        """Gives each sparse layer of `model` (on the meta device, not loaded yet) its store;
        raises ValueError for a model without experts or a budget or placement that does not
        fit its `dtype` experts (`quantized_file`: a GGUF's experts may load quantized, judged
        then, `ExpertStore.hold_quantized`). Every expert fitting the budget attaches nothing."""
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
        if num_slots < moe.top_k and not quantized_file:
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
            cache = ExpertCache(max(num_slots, 1), pinned[i][:max(0, min(
                num_slots - moe.top_k, int(num_slots * PINNED_SHARE)))])
            store = ExpertStore(moe.num_experts, moe.moe_intermediate_size, hidden, cache,
                                num_slots, None, device)
            store.layer = i
            store.budget, store.top_k, store.num_layers, store.placement, store.fraction = (
                budget // len(layers), moe.top_k, len(layers), pinned[i],
                self.config.memory if isinstance(self.config.memory, float) else None)
            model.layers[i].mlp.offload(store)
            self.stores[i] = store
        logger.info("expert offload: %d of %d experts per sparse layer on %s (%.1f of %.1f "
                    "MiB), %d pinned per layer (dense experts; quantized ones are counted "
                    "when they load)", num_slots, moe.num_experts, device,
                    num_slots * len(layers) * expert_bytes / 2**20, total / 2**20,
                    len(cache.pinned))

    @property
    def active(self) -> bool:
        """Whether some expert waits in host memory (False when all fit the budget)."""
        return bool(self.stores)

    def start(self, device: torch.device, in_place: bool | None = None) -> bool:
        """After the weights loaded: on a GPU running the Triton kernels (or when `in_place`
        says so), sets up the slot tables that let steps read experts in place, so CUDA graphs
        can capture them (`expert_tables.py`). Layers whose quantized experts all fit the
        budget keep them resident (no store). Returns whether it set up tables."""
        from .. import kernels
        self.stores = {i: s for i, s in self.stores.items() if s.host_gate_up is not None}
        if self.stores:
            self.num_slots = min(s.num_slots for s in self.stores.values())
        if in_place is None:
            in_place = device.type == "cuda" and kernels.use_triton(device)
        if any(s.quantized for s in self.stores.values()):
            in_place = True  # quantized experts decode in place only (`SparseMoeBlock`)
        if self.active and in_place:
            self.tables = SlotTables(self.stores, device)
        return self.tables is not None

    def before_step(self) -> None:
        if self.tables is not None:
            self.tables.before_step()

    def after_step(self) -> None:
        if self.tables is not None:
            self.tables.after_step()

    def collect(self) -> None:
        """Folds the counters of finished steps in (the engine's thread; see `stats`)."""
        if self.tables is not None:
            self.tables.collect()

    def stats(self) -> ExpertStats | None:
        """The counters summed over the sparse layers; None when nothing is offloaded. Read
        in place, they cover the steps `collect` (or the next step) has folded in."""
        if not self.active:
            return None
        hits, misses, moved = (sum(v) for v in zip(*(s.stats() for s in self.stores.values())))
        return ExpertStats(self.num_slots, sum(len(s.cache.pinned) for s in self.stores.values()),
                           hits, misses, moved)
