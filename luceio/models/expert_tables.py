"""Expert offload read in place: the offloaded model's CUDA-graph path (`expert_offload.py`).

The stores' rounds read each layer's routing on the host, which a CUDA graph cannot. On a GPU
the offload instead keeps, for all sparse layers, a device table `where` [layers, experts]:
an expert's slot in its layer's device stacks, or -1 when it sits in host memory only. The
MoE kernels (`kernels.moe.InPlace`) read each routed expert from its slot or, at -1, straight
from the pinned host stacks over the bus (as fast as a copy would move it), and count per
expert the launches that computed it and those that read it from the host (`counts`). Nothing
in a step reads back to the host, so the steps replay their graphs.

Rules:
- Between steps (`before_step`, on the host, never waiting for the device): the newest
  finished snapshot of `counts` is taken: its increments since the last one are the stores'
  hits and misses (one per expert a launch computed, as the rounds count), used experts are
  touched in their layer's LRU (`ExpertCache`), and experts read from the host are promoted:
  each takes a free LRU slot, or the least recently used one whose expert the snapshot did not
  see used. The victim's table entry becomes -1 first (the table is written in stream order,
  after the steps already queued); the copy into the slot runs on the store's side stream
  after everything queued so far, the compute stream never waiting for it; the expert's entry
  points at the slot once its copy is seen finished (an event polled at a later step). Until
  then the expert is read in place.
- After each step (`after_step`): `counts` is copied to one of a few pinned buffers with an
  event (skipped when all are still in flight: counts are cumulative, a later snapshot covers
  it), and the stores' `last_use` becomes the step's end, so a later eager step's rounds wait
  for it before rewriting slots.
- Rounds (eager steps of many tokens, `ExpertStore.rounds`) still work: they first take every
  pending promotion as landed (the compute stream waits for the side stream), and afterwards
  rebuild their layer's table entries from the cache, written before the next step.
- The counters lag by the steps in flight: `collect()` folds the finished snapshots in (the
  engine's thread only; `stats()` reads what is folded).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..kernels.moe import InPlace

if TYPE_CHECKING:
    from .expert_offload import ExpertStore

SNAPSHOTS = 4  # pinned count buffers in flight at most


class SlotTables:
    def __init__(self, stores: dict[int, "ExpertStore"], device: torch.device):
        self.stores = stores
        self.rows = {layer: i for i, layer in enumerate(sorted(stores))}
        num_experts = next(iter(stores.values())).num_experts
        self.cuda = device.type == "cuda"
        self.host = torch.full((len(stores), num_experts), -1, dtype=torch.int64)
        for layer, store in stores.items():
            for e, s in store.cache.slot_of.items():
                self.host[self.rows[layer], e] = s
        self.where = self.host.to(device)
        self.counts = torch.zeros((len(stores), 2, num_experts), dtype=torch.int32,
                                  device=device)
        self.seen = torch.zeros(self.counts.shape, dtype=torch.int64)
        self.pending: dict[int, dict[int, tuple[int, object]]] = {layer: {} for layer in stores}
        # [buffer, event (None: free), sequence number]
        self.snapshots = [[torch.zeros(self.counts.shape, dtype=torch.int32,
                                       pin_memory=self.cuda), None, 0]
                          for _ in range(SNAPSHOTS)]
        self.taken = 0
        self.dirty = False
        for layer, store in stores.items():
            r = self.rows[layer]
            store.tables = self
            store.in_place = InPlace(self.where[r], store.host_gate_up, store.host_down,
                                     self.counts[r])

    # between steps ---------------------------------------------------------------------------
    def before_step(self) -> None:
        self.collect()
        for layer, pending in self.pending.items():
            for e, (slot, done) in list(pending.items()):
                if done is None or done.query():
                    self.host[self.rows[layer], e] = slot
                    self.dirty = True
                    del pending[e]
        if self.dirty:
            self._flush()

    def after_step(self) -> None:
        if not self.cuda:
            buf = self.snapshots[0]
            buf[0].copy_(self.counts)
            self.taken += 1
            buf[1], buf[2] = True, self.taken
            return
        end = torch.cuda.Event()
        end.record()
        for store in self.stores.values():
            store.last_use = end
        free = next((s for s in self.snapshots if s[1] is None), None)
        if free is None:
            return
        free[0].copy_(self.counts, non_blocking=True)
        free[1] = torch.cuda.Event()
        free[1].record()
        self.taken += 1
        free[2] = self.taken

    def collect(self) -> None:
        """Folds the newest finished snapshot of the counters into the stores (see the module
        docstring) and starts the promotions it calls for."""
        newest = None
        for s in self.snapshots:
            if s[1] is not None and (s[1] is True or s[1].query()):
                if newest is None or s[2] > newest[2]:
                    newest = s
                s[1] = None  # free again
        if newest is None:
            return
        now = newest[0].to(torch.int64)
        delta = ((now - self.seen) % (1 << 32)).numpy()  # int32 counters wrap
        self.seen = now
        loads = {}
        for layer, r in self.rows.items():
            uses, host_reads = delta[r, 0], delta[r, 1]
            used = np.flatnonzero(uses).tolist()
            if not used:
                continue
            cache = self.stores[layer].cache
            misses = int(host_reads.sum())
            cache.hits += int(uses.sum()) - misses
            cache.misses += misses
            cache.touch(used)
            missed = [e for e in np.flatnonzero(host_reads).tolist() if e not in cache.slot_of]
            if missed:
                loads[layer] = cache.promote(missed, set(used))
                for e, _, victim in loads[layer]:
                    if victim is not None:
                        self.host[r, victim] = -1
                        self.pending[layer].pop(victim, None)
                        self.dirty = True
        if any(loads.values()):
            if self.dirty:  # victims leave the table before their slots are overwritten
                self._flush()
            for layer, layer_loads in loads.items():
                done = self.stores[layer].load_async([(e, s) for e, s, _ in layer_loads])
                for e, s, _ in layer_loads:
                    self.pending[layer][e] = (s, done)

    def settle(self, layer: int) -> None:
        """Rounds are about to run on `layer`: its pending promotions count as landed (the
        caller makes the compute stream wait for the copies)."""
        for e, (slot, _) in self.pending[layer].items():
            self.host[self.rows[layer], e] = slot
        self.pending[layer].clear()
        self.dirty = True

    def rebuild(self, layer: int) -> None:
        """After rounds rewrote `layer`'s slots: its entries from the cache."""
        row = self.host[self.rows[layer]]
        row.fill_(-1)
        for e, s in self.stores[layer].cache.slot_of.items():
            row[e] = s
        self.dirty = True

    def reset_counts(self) -> None:
        """Zeroes the counters (after graph capture, whose warm-up runs counted)."""
        self.counts.zero_()
        self.seen.zero_()
        for s in self.snapshots:
            s[1] = None

    def _flush(self) -> None:
        # a fresh pinned copy each time: the asynchronous copy keeps its own source alive
        src = self.host.pin_memory() if self.cuda else self.host
        self.where.copy_(src, non_blocking=self.cuda)
        self.dirty = False
