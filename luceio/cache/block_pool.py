"""The block pool: fixed-size KV blocks with ref counts, an LRU free queue, and a prefix
cache keyed by chained block hashes.

Rules:
- Every block is either free (ref count 0, in the free queue) or referenced (ref count > 0).
- A full block may carry a hash; the hash stays when the block is released, so a later request
  with the same prefix can take it back from the free queue ("cached-free"). The hash is dropped
  only when the block is handed out again for new content (LRU: least recently freed first).
- Hash lookups compare the stored token ids too, so a hash collision never serves wrong KV.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

try:
    import xxhash

    def _digest(data: bytes) -> int:
        return xxhash.xxh3_64_intdigest(data)
except ImportError:  # the GPU image has no xxhash
    import hashlib

    def _digest(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash: a block's hash covers its tokens and, through the parent, every token before."""
    parent = (parent_hash or 0).to_bytes(8, "little")
    return _digest(parent + np.asarray(token_ids, dtype=np.int64).tobytes())


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_lookups = 0
        self.num_hits = 0
        self.num_registered = 0  # blocks `cache` has registered so far (a version to compare)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref count 1), evicting the least recently freed cached blocks."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._drop_hash(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Takes one more reference on each block (a prefix-cache hit)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference on each; blocks reaching zero join the free queue's tail in the
        given order (callers pass tail blocks first, so they are evicted first)."""
        for b in block_ids:
            assert self.ref_cnt[b] > 0, f"block {b} freed twice"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def cache(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Registers a full block under its hash (first writer wins on duplicates)."""
        if block_hash in self.hash_to_block or self.block_hash[block_id] is not None:
            return
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = token_ids
        self.hash_to_block[block_hash] = block_id
        self.num_registered += 1

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        self.num_lookups += 1
        b = self.hash_to_block.get(block_hash)
        if b is None or self.block_tokens[b] != token_ids:
            return None
        self.num_hits += 1
        return b

    def num_free_excluding(self, block_ids: list[int]) -> int:
        """Free blocks left after taking `block_ids` (cached-free ones leave the free queue)."""
        return len(self.free_queue) - sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    def _drop_hash(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            if self.hash_to_block.get(h) == block_id:
                del self.hash_to_block[h]
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None

    def reset_prefix_cache(self) -> None:
        for b in range(self.num_blocks):
            if self.ref_cnt[b] == 0:
                self._drop_hash(b)
