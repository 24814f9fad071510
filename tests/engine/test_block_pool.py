"""Block pool: ref-counted allocation, prefix cache lookups, LRU eviction, no double free."""

from __future__ import annotations

import pytest

from pdserve.engine.block_pool import BlockPool, OutOfBlocks, hash_block, hash_prompt_blocks


def test_allocate_and_free_round_trip():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free == 1
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks[:1])


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_prompt_blocks(list(range(32)), 16)
    b = hash_prompt_blocks([99] + list(range(1, 32)), 16)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert hash_block(None, range(16)) == a[0]
    assert hash_prompt_blocks(list(range(31)), 16) == a[:1]  # partial blocks are never hashed


def test_prefix_lookup_refcounts_and_lru_eviction():
    pool = BlockPool(3)
    hashes = hash_prompt_blocks(list(range(48)), 16)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hashes):
        pool.cache_block(b, h)
    pool.free(blocks)
    assert pool.num_free == 3 and pool.num_cached == 3  # cached blocks count as free

    hits = pool.lookup_prefix(hashes[:2])
    assert hits == blocks[:2] and pool.refcount(blocks[0]) == 1
    assert pool.stats.hit_blocks == 2
    assert pool.lookup_prefix(hash_prompt_blocks([7] * 16, 16)) == []

    # Only the unreferenced cached block can be evicted; it is reused for a new allocation.
    (new,) = pool.allocate(1)
    assert new == blocks[2] and pool.stats.evictions == 1 and pool.num_cached == 2
    again = pool.lookup_prefix(hashes)
    assert again == blocks[:2]  # the third block was evicted, so the hit stops after two
    pool.free(hits + again + [new])
    assert pool.num_free == 3


def test_shared_blocks_stay_in_use_until_every_reader_frees():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    h = hash_block(None, range(16))
    pool.cache_block(b, h)
    assert pool.lookup_prefix([h]) == [b] and pool.refcount(b) == 2
    pool.free([b])
    assert pool.refcount(b) == 1 and pool.num_free == 1
    pool.free([b])
    assert pool.num_free == 2


def test_prefix_caching_disabled():
    pool = BlockPool(2, enable_prefix_caching=False)
    (b,) = pool.allocate(1)
    h = hash_block(None, range(16))
    pool.cache_block(b, h)
    pool.free([b])
    assert pool.lookup_prefix([h]) == [] and pool.num_cached == 0
