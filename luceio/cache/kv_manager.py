"""Per-request block tables over a `BlockPool`. Deals in ids and counts, never tensors.

Host memory holds KV through one mechanism, `HostCopies` (offload.py): bounded residency
offloads a request's cold blocks, swap preemption offloads every block (`swap_out`: the table
keeps its length, all entries `OFFLOADED`) and reloads the same blocks on resume (`swap_in`).
A request's host copies are released with its blocks, in `free`, whether or not it is swapped
out."""
from __future__ import annotations

from ..request import Request
from .block_pool import BlockPool, hash_block
from .offload import OFFLOADED, HostCopies, KVMoves
from .residency import Residency, ResidencyConfig


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 residency: ResidencyConfig | None = None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.host = HostCopies()
        # bounded residency: tables may hold OFFLOADED entries (see residency.py)
        self.residency = Residency(residency, self.host) if residency is not None else None
        self.swapped: dict[str, list[int]] = {}  # swapped-out id -> logical blocks to reload
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[int]] = {}  # chained hashes of the full blocks
        self.num_cached_blocks: dict[str, int] = {}  # how many of its blocks are registered

    def blocks_of(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def take_moves(self) -> KVMoves:
        """The host copies planned since the last call, for the runner to apply before the
        step's forward."""
        return self.host.take()

    def attention_table(self, request_id: str) -> tuple[list[int], int]:
        """(the device blocks attention reads, in order; tokens skipped before the tail)."""
        table = self.block_tables[request_id]
        if self.residency is None:
            return table, 0
        return self.residency.attention_table(request_id, table)

    def plan_residency(self, req: Request, num_new_tokens: int, reserve: int = 0) -> None:
        """Bounded residency: offload/reload this request's blocks for a step computing
        `num_new_tokens` more tokens. Call before `allocate_slots`, so offloads make room."""
        if self.residency is None:
            return
        table = self.block_tables.setdefault(req.request_id, [])
        after = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        self.residency.plan(req.request_id, table, req.num_computed_tokens, after, self.pool,
                            reserve)

    def _hashes(self, req: Request, num_tokens: int) -> list[int]:
        """Chained hashes of the full blocks among the first `num_tokens` tokens (memoised)."""
        hashes = self.block_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     tuple(req.all_token_ids[i * bs:(i + 1) * bs])))
        return hashes

    def forget_hashes(self, request_id: str) -> None:
        """Drops a request's memoised block hashes: its tokens were replaced before any of its
        blocks were cached (the draft model reading a long prompt through its window)."""
        self.block_hashes.pop(request_id, None)

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a new request: (block ids, tokens covered). At least one
        token is always left to compute, so the step produces logits for it."""
        if not self._caches(req):
            return [], 0
        bs = self.block_size
        hashes = self._hashes(req, req.num_tokens - 1)
        blocks: list[int] = []
        for i, h in enumerate(hashes):
            b = self.pool.lookup(h, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * bs

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Makes room for `num_new_tokens` beyond the request's computed tokens (plus the
        prefix-hit `computed_blocks` of a newly admitted request). False if the pool is short."""
        table = self.block_tables.get(req.request_id)
        if not computed_blocks and table is not None:  # a running request: often no new block
            needed = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
            if needed <= 0:
                return True
        computed_blocks = computed_blocks or []
        table = self.block_tables.setdefault(req.request_id, [])
        num_tokens = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        needed = -(-num_tokens // self.block_size) - len(table) - len(computed_blocks)
        if needed > self.pool.num_free_excluding(computed_blocks):
            if not table:
                del self.block_tables[req.request_id]
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            self.num_cached_blocks[req.request_id] = len(table)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return True

    def cache_blocks(self, req: Request) -> None:
        """Registers the request's newly full, verified blocks in the prefix cache."""
        bs = self.block_size
        num_full = min(req.num_computed_tokens, len(req.all_token_ids)) // bs
        start = self.num_cached_blocks.get(req.request_id, 0)
        if num_full <= start or not self._caches(req):  # the residency cap only lowers num_full
            return
        table = self.block_tables.get(req.request_id, [])
        if self.residency is not None:
            exact = self.residency.exact_blocks(req.request_id)
            num_full = num_full if exact is None else min(num_full, exact)
        if num_full <= start:
            return
        hashes = self._hashes(req, num_full * bs)
        for i in range(start, num_full):
            self.pool.cache(table[i], hashes[i], tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
        self.num_cached_blocks[req.request_id] = num_full

    def _caches(self, req) -> bool:
        """Prefix caching applies unless off, or the request's tokens sit at other positions
        than their cache index (speculative prefill): their KV would not match a plain prompt,
        or the request wants prompt logprobs."""
        if not self.enable_prefix_caching or getattr(req, "position_ids", None) is not None:
            return False
        # prompt logprobs need every prompt position computed, so such requests never hit
        return getattr(getattr(req, "params", None), "prompt_logprobs", None) is None

    def swap_out(self, req: Request) -> None:
        """Swap preemption: offloads every block holding the request's computed tokens (its
        KV goes to host memory bit-exact) and frees the rest. Its residency state stays, and
        on resume the same blocks come back: its resident set is the one it had."""
        rid = req.request_id
        self.trim(req, req.num_computed_tokens)
        table = self.block_tables[rid]
        resident = [i for i, b in enumerate(table) if b != OFFLOADED]
        self.swapped[rid] = resident
        # tail first, as `free` does, so shared prefixes outlive their tails
        self.host.offload(rid, table, resident[::-1], self.pool)
        if self.residency is not None:
            self.residency.forget_view(rid)

    def swap_in(self, req: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        """Resumes a swapped-out request: reloads the blocks `swap_out` offloaded and makes
        room for `num_new_tokens` more (residency plans the step first, as for a running
        request; `reserve` as in `Residency.plan`). False, changing nothing, if the pool is
        short."""
        rid = req.request_id
        table, back = self.block_tables[rid], self.swapped[rid]
        grow = max(-(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(table), 0)
        if len(back) + grow > self.pool.num_free_blocks:
            return False
        del self.swapped[rid]
        self.host.reload(rid, table, back, self.pool)
        if req.num_computed_tokens % self.block_size:
            # the partial last block fills up from here: its host copy goes stale
            self.host.stale(rid, req.num_computed_tokens // self.block_size)
        if self.residency is not None:
            self.residency.forget_view(rid)
        self.plan_residency(req, num_new_tokens, reserve)
        return self.allocate_slots(req, num_new_tokens)

    def free(self, req: Request, preempted: bool = False) -> None:
        """Releases the request's blocks, tail first so shared prefixes outlive their tails,
        and its host copies (a swapped-out request's included)."""
        table = self.block_tables.pop(req.request_id, [])
        self.pool.free([b for b in reversed(table) if b != OFFLOADED])
        self.host.release(req.request_id)
        self.swapped.pop(req.request_id, None)
        if self.residency is not None:
            self.residency.release(req.request_id, preempted)
        self.block_hashes.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Returns blocks past what `num_tokens` tokens need (after rejected drafts)."""
        table = self.block_tables.get(req.request_id)
        if not table:
            return
        keep = -(-num_tokens // self.block_size)
        if len(table) > keep:
            extra = table[keep:]
            del table[keep:]
            if self.residency is not None:
                self.residency.forget_view(req.request_id)
            self.pool.free([b for b in reversed(extra) if b != OFFLOADED])
