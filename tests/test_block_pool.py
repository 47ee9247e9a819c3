"""Block pool and KV manager: ref counts, LRU reuse of cached-free blocks, collision guard."""
import pytest

from luceio.cache import BlockPool, KVCacheManager, hash_block
from luceio.request import Request
from luceio.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(), set(), max_model_len=10_000)


def test_allocate_free_and_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free_blocks == 1 and all(pool.ref_cnt[b] == 1 for b in a)
    pool.touch([a[0]])
    pool.free(a)
    assert pool.ref_cnt[a[0]] == 1 and pool.num_free_blocks == 3
    pool.free([a[0]])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_freed_block_keeps_hash_until_reused_lru():
    pool = BlockPool(2)
    b0, b1 = pool.allocate(2)
    h0, h1 = hash_block(None, (1, 2)), hash_block(None, (3, 4))
    pool.cache(b0, h0, (1, 2))
    pool.cache(b1, h1, (3, 4))
    pool.free([b1, b0])  # b1 freed first → evicted first
    assert pool.lookup(h0, (1, 2)) == b0 and pool.lookup(h1, (3, 4)) == b1
    (new,) = pool.allocate(1)
    assert new == b1 and pool.lookup(h1, (3, 4)) is None  # reused: hash dropped
    assert pool.lookup(h0, (1, 2)) == b0  # still cached


def test_collision_guard_compares_tokens():
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    pool.cache(b, 1234, (1, 2))
    assert pool.lookup(1234, (9, 9)) is None
    assert pool.lookup(1234, (1, 2)) == b


def test_chained_hash_depends_on_prefix():
    assert hash_block(None, (1, 2)) != hash_block(hash_block(None, (0, 0)), (1, 2))


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.cache_blocks(a)
    b = req("b", list(range(12)))  # identical prompt: at most 11 tokens may hit → 2 blocks
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and blocks == kv.blocks_of("a")[:2]
    assert kv.allocate_slots(b, 4, blocks)
    assert kv.pool.ref_cnt[blocks[0]] == 2
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 10


def test_allocation_fails_cleanly_when_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = req("a", list(range(20)))
    assert not kv.allocate_slots(a, 20)
    assert kv.pool.num_free_blocks == 2 and kv.blocks_of("a") == []
