"""Placement policies: which worker of a pool takes the next request. Better ones come later."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(eq=False)
class WorkerRef:
    name: str
    pool: str
    handle: Any  # Ray actor handle
    kv_address: str | None = None
    healthy: bool = True
    outstanding: int = 0  # requests holding an admission slot here (`router.admission`)


class NoHealthyWorker(RuntimeError):
    pass


class PlacementPolicy(Protocol):
    def choose(self, workers: list[WorkerRef]) -> WorkerRef:
        """One of `workers` (non-empty: healthy ones with room)."""


class _Rotation:
    """A turn counter per pool: one request places on two pools, and a counter shared between them
    would hand each pool only every other turn (with two decode workers, always the same one)."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count] = {}

    def next(self, workers: list[WorkerRef]) -> int:
        return next(self._counters.setdefault(workers[0].pool, itertools.count())) % len(workers)


class RoundRobin:
    def __init__(self) -> None:
        self._turn = _Rotation()

    def choose(self, workers: list[WorkerRef]) -> WorkerRef:
        return workers[self._turn.next(workers)]


class LeastLoaded:
    """The worker holding the fewest requests; ties go round-robin, so an idle pool shares the work."""

    def __init__(self) -> None:
        self._turn = _Rotation()

    def choose(self, workers: list[WorkerRef]) -> WorkerRef:
        start = self._turn.next(workers)
        return min(workers[start:] + workers[:start], key=lambda w: w.outstanding)


def healthy_workers(workers: list[WorkerRef]) -> list[WorkerRef]:
    """The healthy ones; raises NoHealthyWorker when there is none."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        pool = workers[0].pool if workers else "unknown"
        raise NoHealthyWorker(f"no healthy worker in the {pool} pool")
    return healthy


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}
