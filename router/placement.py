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
    outstanding: int = 0  # requests placed here and not finished


class NoHealthyWorker(RuntimeError):
    pass


class PlacementPolicy(Protocol):
    def choose(self, workers: list[WorkerRef]) -> WorkerRef: ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: list[WorkerRef]) -> WorkerRef:
        healthy = _healthy(workers)
        return healthy[next(self._counter) % len(healthy)]


class LeastLoaded:
    def choose(self, workers: list[WorkerRef]) -> WorkerRef:
        return min(_healthy(workers), key=lambda w: w.outstanding)


def _healthy(workers: list[WorkerRef]) -> list[WorkerRef]:
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        pool = workers[0].pool if workers else "unknown"
        raise NoHealthyWorker(f"no healthy worker in the {pool} pool")
    return healthy


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}
