"""The one interface every placement policy implements, and what a policy sees of a request.

A policy picks one worker of a pool for a request: `choose(request, workers) -> Choice`. `workers`
are the pool's healthy workers with an admission slot free (never empty); `request` carries what the
router learnt before placing it: the prompt's chained block hashes and, from the global prefix
index, how many leading blocks each worker already caches. A policy only decides; the router
(`router.routing`) does the bookkeeping, so a simulator can drive the same policies.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.router.workers import WorkerRef


@dataclass
class RouteRequest:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    block_size: int
    block_hashes: list[bytes] = field(default_factory=list)  # the prompt's cacheable full blocks
    matches: dict[str, int] = field(default_factory=dict)  # worker name -> leading blocks it caches
    oracle_cached_tokens: int = 0  # the longest prefix any worker caches (the exact index)
    max_model_len: int | None = None  # a sequence never holds more tokens than this

    def cached_tokens(self, worker: WorkerRef) -> int:
        return self.matches.get(worker.name, 0) * self.block_size

    def new_tokens(self, worker: WorkerRef) -> int:
        """The prompt tokens `worker` would compute (its cache serves the rest)."""
        return self.num_prompt_tokens - self.cached_tokens(worker)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_prompt_tokens // self.block_size)

    @property
    def num_blocks_with_output(self) -> int:
        tokens = self.num_prompt_tokens + self.max_tokens
        return -(-min(tokens, self.max_model_len or tokens) // self.block_size)


@dataclass(frozen=True)
class Choice:
    worker: WorkerRef
    estimate_s: float | None = None  # the policy's TTFT estimate there, when it has a cost model


class PlacementPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, workers: list[WorkerRef]) -> Choice:
        """One of `workers` (non-empty: healthy ones with room)."""


class Rotation:
    """A turn counter per pool: one request places on two pools, and a counter shared between them
    would hand each pool only every other turn (with two decode workers, always the same one)."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count] = {}

    def rotate(self, workers: list[WorkerRef]) -> list[WorkerRef]:
        """`workers` starting at this pool's next turn: ties then go round-robin."""
        start = next(self._counters.setdefault(workers[0].pool, itertools.count())) % len(workers)
        return workers[start:] + workers[:start]
