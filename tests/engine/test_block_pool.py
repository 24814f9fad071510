"""Block pool: ref-counted allocation, prefix cache lookups, LRU eviction, no double free."""

from __future__ import annotations

import random

import pytest
from helpers import random_prompts
from helpers import assert_pool_idle, drain, run_all

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
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


def test_a_prompts_block_hashes_are_each_blocks_chained_hash_with_its_extra():
    rng = random.Random(0)
    for _ in range(50):
        block_size = rng.choice([1, 4, 16])
        prompt = [rng.randrange(2**32) for _ in range(rng.randrange(70))]
        extra = (lambda start, end: b"img%d" % start if start % 3 == 0 else b"") if rng.random() < 0.5 else None
        want, parent = [], None
        for start in range(0, len(prompt) // block_size * block_size, block_size):
            end = start + block_size
            parent = hash_block(parent, prompt[start:end], extra(start, end) if extra else b"")
            want.append(parent)
        assert hash_prompt_blocks(prompt, block_size, extra) == want


def test_prefix_lookup_refcounts_and_lru_eviction():
    pool = BlockPool(3)
    hashes = hash_prompt_blocks(list(range(48)), 16)
    blocks = pool.allocate(3)
    for i, (b, h) in enumerate(zip(blocks, hashes)):
        pool.cache_block(b, h, hashes[i - 1] if i else None)
    pool.free(blocks)
    assert pool.num_free == 3 and pool.num_cached == 3  # cached blocks count as free

    hits = pool.lookup_prefix(hashes[:2])
    assert hits == blocks[:2] and pool.refcount(blocks[0]) == 1
    assert pool.stats.hit_blocks == 0  # counted once its request is admitted
    pool.count_lookup(2, len(hits))
    assert (pool.stats.queried_blocks, pool.stats.hit_blocks) == (2, 2)
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
    pool.cache_block(b, h, None)
    assert pool.lookup_prefix([h]) == [b] and pool.refcount(b) == 2
    pool.free([b])
    assert pool.refcount(b) == 1 and pool.num_free == 1
    pool.free([b])
    assert pool.num_free == 2


def test_prefix_caching_disabled():
    pool = BlockPool(2, enable_prefix_caching=False)
    (b,) = pool.allocate(1)
    h = hash_block(None, range(16))
    pool.cache_block(b, h, None)
    pool.free([b])
    assert pool.lookup_prefix([h]) == [] and pool.num_cached == 0


class Recorder:
    """A CacheListener that keeps what it is told, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bytes, bytes | None]] = []

    def stored(self, block_hash: bytes, parent_hash: bytes | None) -> None:
        self.events.append(("stored", block_hash, parent_hash))

    def removed(self, block_hash: bytes) -> None:
        self.events.append(("removed", block_hash, None))


def test_listener_hears_of_every_hash_cached_and_uncached():
    pool = BlockPool(3)
    pool.listener = recorder = Recorder()
    h0, h1, h2 = hash_prompt_blocks(list(range(48)), 16)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[0], h0, None)
    pool.cache_block(blocks[1], h1, h0)
    pool.cache_block(blocks[1], h2, h1)  # the block is cached already: nothing happens
    pool.cache_block(blocks[2], h1, h0)  # the hash is cached already: nothing happens
    assert recorder.events == [("stored", h0, None), ("stored", h1, h0)]
    assert sorted(pool.cached_blocks()) == sorted([(h0, None), (h1, h0)])

    pool.free(blocks)  # the tail first: blocks[1] is the least recently used cached block
    pool.allocate(2)  # the free block, then an eviction
    assert recorder.events[2:] == [("removed", h1, None)]
    assert pool.cached_blocks() == [(h0, None)]
    pool.reset_prefix_cache()  # blocks[0] is evictable: forgotten
    assert recorder.events[3:] == [("removed", h0, None)] and pool.cached_blocks() == []


def test_listener_replays_to_the_pool_state():
    """Replaying the events gives exactly the cached set, through hits, evictions and a reset."""
    pool = BlockPool(6)
    pool.listener = recorder = Recorder()
    prompts = [list(range(s, s + 64)) for s in (0, 0, 100, 200, 0, 300)]
    for i, prompt in enumerate(prompts):
        hashes = hash_prompt_blocks(prompt, 16)
        hits = pool.lookup_prefix(hashes)
        new = pool.allocate(len(hashes) - len(hits))
        for j, block in enumerate(new, start=len(hits)):
            pool.cache_block(block, hashes[j], hashes[j - 1] if j else None)
        pool.free(hits + new)
        if i == 3:
            pool.reset_prefix_cache()
    replayed: dict[bytes, bytes | None] = {}
    for kind, block_hash, parent in recorder.events:
        if kind == "stored":
            assert block_hash not in replayed
            replayed[block_hash] = parent
        else:
            del replayed[block_hash]
    assert replayed == dict(pool.cached_blocks()) and pool.stats.evictions > 0


def test_no_listener_calls_without_prefix_caching():
    pool = BlockPool(2, enable_prefix_caching=False)
    pool.listener = recorder = Recorder()
    (b,) = pool.allocate(1)
    pool.cache_block(b, hash_block(None, range(16)), None)
    pool.free([b])
    pool.reset_prefix_cache()
    assert recorder.events == [] and pool.cached_blocks() == []


def test_a_request_waiting_for_room_counts_its_prefix_lookup_once(model_dirs, hf_reference):
    """The scheduler tries a waiting request again every step; its lookup counts when it is admitted,
    not at each try (the prefix hit rate in the metrics would otherwise grow with the wait)."""
    arch = "tiny-llama"
    probe = LLMEngine(model_dirs[arch], EngineConfig(kv_memory_bytes=16 * 2**20))
    block_size = probe.config.block_size
    engine = LLMEngine(model_dirs[arch], EngineConfig(kv_memory_bytes=10 * probe.kv_layout.bytes_per_block,
                                                      max_model_len=10 * block_size))
    warm, held_prompt, tail = random_prompts(3, hf_reference[arch].vocab_size, 3 * block_size, 5 * block_size, seed=14)
    run_all(engine, [warm[: 3 * block_size]], SamplingParams.greedy(max_tokens=1))  # caches 2 blocks
    held = engine.add_request(held_prompt[: 5 * block_size], SamplingParams.greedy(max_tokens=16), prefill_only=True)
    drain(engine, [held])
    stats = engine.pool.stats
    before = (stats.queried_blocks, stats.hit_blocks)
    prompt = warm[: 2 * block_size] + tail[: 4 * block_size - 4]  # 2 cached blocks, 4 more to allocate
    waiting = engine.add_request(prompt, SamplingParams.greedy(max_tokens=2))
    for _ in range(3):
        engine.step()
        assert engine.last_step.num_seqs == 0  # no room beside the held request
    assert (stats.queried_blocks, stats.hit_blocks) == before
    engine.release(held)
    drain(engine, [waiting])
    assert (stats.queried_blocks - before[0], stats.hit_blocks - before[1]) == (5, 2)
    assert_pool_idle(engine)
