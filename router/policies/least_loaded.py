"""`least_loaded`: the worker holding the fewest requests (a prefill worker's count ends at the
request's first token, a decode worker's at its last); ties go round-robin, so an idle pool shares."""

from __future__ import annotations

from pdserve.router.policies.base import Choice, RouteRequest, Rotation
from pdserve.router.workers import WorkerRef


class LeastLoaded:
    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = Rotation()

    def choose(self, request: RouteRequest, workers: list[WorkerRef]) -> Choice:
        return Choice(min(self._turn.rotate(workers), key=lambda w: w.outstanding))
