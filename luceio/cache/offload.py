"""Host copies of KV blocks, the planning half (loop thread, ids and counts only): the one
mechanism that moves a request's blocks to host memory and back. Bounded residency offloads
some of a request's blocks (`residency.py`); swap preemption offloads every block and reloads
them on resume (`KVCacheManager.swap_out` / `swap_in`). The tensor half is the runner's
`HostKVStore`, which applies the `KVMoves` recorded here.

Rules:
- An offloaded block's table entry becomes `OFFLOADED` and its device block is freed at once;
  the table keeps one entry per logical block. The copy out is queued in the step's moves,
  which the runner applies before that step's forward: the first thing that may reuse the block.
- Moves apply in order: drops, repools, offloads, reloads (so a block freed by an offload may
  be the target of a reload in the same step).
- A host copy stays current after its reload until its block is written again: offloading the
  block again then only frees the device block. Offloading a block whose reload is still
  pending cancels the reload and copies nothing (its content is in host memory only).
  Blocks written again (the partial last block of a resumed request, a prompt chunk computed
  again) are marked `stale` when that is decided, so their next offload copies them.
- One release path: when a request's blocks are freed (finish, abort, recompute preemption)
  `release` cancels its pending moves and records a drop of its host copies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

OFFLOADED = -1


@dataclass
class KVMoves:
    """Copies the runner makes before a step's forward, in the order of the module docstring."""
    offload: list[tuple[str, list[int], list[int]]] = field(default_factory=list)  # id, logical, phys
    reload: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)  # requests whose host copies are released
    # (id, first block written again): its pooled keys from there on are stale (keys policy)
    repool: list[tuple[str, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offload or self.reload or self.drop or self.repool)


class HostCopies:
    def __init__(self):
        self.moves = KVMoves()
        self.current: dict[str, set[int]] = {}  # id -> logical blocks whose host copy is current

    def take(self) -> KVMoves:
        moves, self.moves = self.moves, KVMoves()
        return moves

    def take_drops(self) -> list[str]:
        """The drops recorded so far, out of the queue. Safe to apply ahead of the rest: drops
        go first anyway, and `release` left no earlier move of a dropped request."""
        drops, self.moves.drop = self.moves.drop, []
        return drops

    def offload(self, rid: str, table: list[int], logical: list[int], pool) -> None:
        """Moves the resident blocks `logical` of `table` to host memory, freeing their device
        blocks in the given order. Blocks with a current host copy are not copied again, nor
        are blocks whose reload is still pending: their content is in host memory only, and
        the reload is cancelled."""
        m, out, pending = self.moves, set(logical), set()
        for j, (r, back, phys) in enumerate(m.reload):
            if r == rid and out.intersection(back):
                pending.update(out.intersection(back))
                m.reload[j] = (r, [i for i in back if i not in out],
                               [p for i, p in zip(back, phys) if i not in out])
        m.reload = [x for x in m.reload if x[1]]
        current = self.current.setdefault(rid, set())
        copy = [i for i in logical if i not in current and i not in pending]
        if copy:
            m.offload.append((rid, copy, [table[i] for i in copy]))
        current.update(logical)
        phys = [table[i] for i in logical]
        for i in logical:
            table[i] = OFFLOADED
        pool.free(phys)

    def reload(self, rid: str, table: list[int], logical: list[int], pool) -> None:
        """Brings the offloaded blocks `logical` of `table` back into fresh device blocks."""
        phys = pool.allocate(len(logical))
        for i, b in zip(logical, phys):
            table[i] = b
        self.moves.reload.append((rid, list(logical), phys))

    def stale(self, rid: str, first: int) -> None:
        """Blocks `first` onward will be written again: their host copies are no longer
        current, nor their pooled keys."""
        current = self.current.get(rid)
        if current:
            current.difference_update([i for i in current if i >= first])
        self.moves.repool.append((rid, first))

    def release(self, rid: str) -> None:
        """The request's blocks were freed: its pending copies are moot and its host copies
        released (a recomputed request must not find them)."""
        m = self.moves
        m.offload = [x for x in m.offload if x[0] != rid]
        m.reload = [x for x in m.reload if x[0] != rid]
        m.repool = [x for x in m.repool if x[0] != rid]
        self.current.pop(rid, None)
        m.drop.append(rid)
