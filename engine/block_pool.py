"""Ref-counted KV block allocation with a prefix cache of full blocks.

A block is in exactly one of three states:
  free       refcount 0, no hash                 -> in `_free`
  cached     refcount 0, hash, contents valid    -> in `_evictable` (LRU order), reusable by hash
  in use     refcount > 0                        -> referenced by one or more block tables
A cached block is counted as free: allocation takes plain free blocks first, then evicts the least
recently used cached block. A block with refcount > 1 is shared read-only; only the request that
owns a block alone (refcount 1, not yet full) ever writes into it.

An optional `listener` hears of every hash that becomes cached and every hash that stops being
cached, in order, on the thread that changes the pool: a worker forwards these as KV events so that
the router knows exactly which prefixes it holds.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


# What a block's hash adds to its token ids, from the positions [start, end) it covers (the images
# a multimodal prompt has there: `PromptImages.block_extra`).
BlockExtra = Callable[[int, int], bytes]


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Chained hash of a full block: stable across processes, so workers can report it to a router."""
    return _hash_packed(parent_hash, _pack(token_ids), extra)


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, extra: BlockExtra | None = None) -> list[bytes]:
    """Hashes of every full block of `token_ids`, each chained on the one before: `hash_block`'s, with
    the prompt packed once (the router hashes every prompt it places)."""
    full = len(token_ids) // block_size * block_size
    packed = memoryview(_pack(token_ids[:full]))
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, full, block_size):
        end = start + block_size
        parent = _hash_packed(parent, packed[4 * start:4 * end], b"" if extra is None else extra(start, end))
        hashes.append(parent)
    return hashes


def _pack(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)  # each id as 4 little-endian bytes


def _hash_packed(parent_hash: bytes | None, packed: bytes | memoryview, extra: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\x00" * 16)
    h.update(packed)
    if extra:  # after the fixed-size token bytes, so no extra can pass for other tokens
        h.update(extra)
    return h.digest()


@dataclass
class PrefixCacheStats:
    queried_blocks: int = 0
    hit_blocks: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


@dataclass(frozen=True)
class KVPoolStatus:
    """The pool's state for a worker's health report."""

    free_blocks: int  # allocatable now: evictable cached blocks count as free
    total_blocks: int
    cached_blocks: int  # holding a prefix (in use or evictable)
    prefix_queried_blocks: int  # the prefix cache's cumulative lookups, in blocks
    prefix_hit_blocks: int

    @property
    def held_blocks(self) -> int:
        """Blocks requests hold (beyond the evictable prefix cache)."""
        return self.total_blocks - self.free_blocks


class CacheListener(Protocol):
    """Told of changes to the set of cached hashes (a worker's KV event publisher)."""

    def stored(self, block_hash: bytes, parent_hash: bytes | None) -> None: ...

    def removed(self, block_hash: bytes) -> None: ...


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (callers check first). `free`: the
    blocks free then (a caller waiting for room need not try again before there are more)."""

    def __init__(self, message: str, free: int) -> None:
        super().__init__(message)
        self.free = free


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_hash: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}
        self._parent: dict[bytes, bytes | None] = {}  # of each cached hash, for snapshots of the cache
        self.stats = PrefixCacheStats()
        self.listener: CacheListener | None = None

    # --- capacity -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def status(self) -> KVPoolStatus:
        return KVPoolStatus(self.num_free, self.num_blocks, self.num_cached, self.stats.queried_blocks,
                            self.stats.hit_blocks)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # --- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} KV blocks, {self.num_free} free", self.num_free)
        blocks = [self._take_one() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def _take_one(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)
        self._uncache(block)
        self.stats.evictions += 1
        return block

    def _uncache(self, block: int) -> None:
        block_hash = self._block_hash.pop(block)
        del self._cached[block_hash]
        del self._parent[block_hash]
        if self.listener is not None:
            self.listener.removed(block_hash)

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block. Freed in reverse so a request's tail is evicted first."""
        for b in reversed(list(blocks)):
            if self._refcount[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                if b in self._block_hash:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    # --- prefix cache ---------------------------------------------------------------------------
    def lookup_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Take a reference on the longest run of cached blocks matching `block_hashes`. Not counted
        in `stats` until `count_lookup`: an admission that then finds no room gives the blocks back
        and tries again on a later step."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in block_hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        for b in hits:
            if self._refcount[b] == 0:
                del self._evictable[b]
            self._refcount[b] += 1
        return hits

    def count_lookup(self, queried: int, hit: int) -> None:
        """Count a lookup whose request was admitted: `queried` prompt blocks, `hit` of them cached."""
        if self.enable_prefix_caching:
            self.stats.queried_blocks += queried
            self.stats.hit_blocks += hit

    def cache_block(self, block: int, block_hash: bytes, parent_hash: bytes | None) -> None:
        """Publish a full, in-use block under its hash, chained on `parent_hash` (None for a first
        block). A hash already cached keeps its first block."""
        if not self.enable_prefix_caching or block_hash in self._cached or block in self._block_hash:
            return
        self._cached[block_hash] = block
        self._block_hash[block] = block_hash
        self._parent[block_hash] = parent_hash
        if self.listener is not None:
            self.listener.stored(block_hash, parent_hash)

    def cached_hashes(self) -> list[bytes]:
        """Every block hash this pool can serve (what a worker reports to a prefix-aware router)."""
        return list(self._cached)

    def cached_blocks(self) -> list[tuple[bytes, bytes | None]]:
        """Every cached hash with its parent hash: the whole state a KV event stream describes."""
        return list(self._parent.items())

    def forget_cached(self, block_hashes: Iterable[bytes]) -> None:
        """Stop caching these hashes, where no request uses their block."""
        for block_hash in block_hashes:
            block = self._cached.get(block_hash)
            if block is not None and self._refcount[block] == 0:
                del self._evictable[block]
                self._uncache(block)
                self._free.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request uses."""
        self.forget_cached([self._block_hash[block] for block in self._evictable])
