"""`round_robin`: each pool's workers in turn, blind to prompt, cache and load."""

from __future__ import annotations

from pdserve.router.policies.base import Choice, RouteRequest, Rotation
from pdserve.router.workers import WorkerRef


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = Rotation()

    def choose(self, request: RouteRequest, workers: list[WorkerRef]) -> Choice:
        return Choice(self._turn.rotate(workers)[0])
