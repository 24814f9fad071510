"""`kv_cost`: NVIDIA Dynamo's KV router cost. For each worker,

    cost = overlap_weight x (prompt blocks it would have to prefill) + (KV blocks its requests hold)

the first term from the prefix index (blocks it caches need no prefill), the second from the
router's own count of the blocks placed there; the cheapest worker wins, ties round-robin."""

from __future__ import annotations

from pdserve.router.policies.base import Choice, RouteRequest, Rotation
from pdserve.router.workers import WorkerRef


class KVCost:
    name = "kv_cost"

    def __init__(self, overlap_weight: float = 1.0) -> None:
        self.overlap_weight = overlap_weight
        self._turn = Rotation()

    def cost(self, request: RouteRequest, worker: WorkerRef) -> float:
        prefill_blocks = request.num_blocks - request.matches.get(worker.name, 0)
        return self.overlap_weight * prefill_blocks + worker.active_blocks

    def choose(self, request: RouteRequest, workers: list[WorkerRef]) -> Choice:
        return Choice(min(self._turn.rotate(workers), key=lambda w: self.cost(request, w)))
