"""What a running cluster is, for an operator: its model, addresses, pools and each worker's role, node,
health, load and KV use, as the router sees them at this moment.

`GET /health` answers it in JSON (200 while the cluster serves, 503 when it cannot: no healthy worker
in a pool it needs); `pdserve status` prints it as a table. `worker_health` is the one place that
reads a worker's health report, so that its shape can change without touching the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdserve.router.encoders import EncoderRef
from pdserve.router.workers import WorkerRef


@dataclass(frozen=True)
class WorkerHealth:
    name: str
    role: str  # prefill, decode, colocated or encode
    node: str  # the node's IP address
    healthy: bool
    requests: int  # requests the worker holds now (its last report)
    queued_prompts: int  # prompts the router placed on it that are not yet past their first token
    kv_blocks_total: int
    kv_blocks_free: int
    draining: bool = False  # taken out of placement; what it holds moves away (`Frontend.drain`)

    @property
    def kv_used(self) -> float:
        """The share of its KV blocks in use, 0 to 1."""
        return 1 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class PoolHealth:
    name: str  # prefill, decode or encode
    needed: bool  # the cluster cannot serve without a healthy worker here
    workers: list[WorkerHealth]

    @property
    def healthy(self) -> int:
        return sum(w.healthy for w in self.workers)


@dataclass(frozen=True)
class ModelHealth:
    name: str  # the served name, what requests say in `model`
    model_type: str
    max_model_len: int
    dtype: str


@dataclass(frozen=True)
class PlannerHealth:
    """The online planner's last decision, as `pdserve status` shows it."""

    decided_at: float | None  # wall clock; None before its first decision
    action: str  # keep, wait, change, none
    reason: str
    role_changes: int
    workers_added: int
    workers_removed: int
    failure: str | None = None  # it stopped on this error (the cluster serves on, unplanned)


@dataclass(frozen=True)
class HealthReport:
    serving: bool
    mode: str  # disaggregated or colocated
    model: ModelHealth
    grpc_address: str
    http_address: str | None
    pools: list[PoolHealth]
    planner: PlannerHealth | None = None  # None: the online planner is off

    def to_json(self) -> dict[str, Any]:
        """The report as `/health` answers it (each worker with its `kv_used` share)."""
        out = asdict(self)
        out["status"] = "serving" if self.serving else "not_serving"
        for pool, pool_json in zip(self.pools, out["pools"]):
            pool_json["healthy"] = pool.healthy
            for worker, worker_json in zip(pool.workers, pool_json["workers"]):
                worker_json["kv_used"] = round(worker.kv_used, 4)
        return out


def worker_health(worker: WorkerRef, mode: str) -> WorkerHealth:
    """One worker as the report shows it: the router's view with its last health report."""
    status = worker.status  # None until its first health report
    return WorkerHealth(
        name=worker.name, role="colocated" if mode == "colocated" else worker.pool,
        node=status.node_ip if status else "", healthy=worker.healthy, requests=status.requests if status else 0,
        queued_prompts=len(worker.queued), kv_blocks_total=worker.total_blocks if status else 0,
        kv_blocks_free=worker.free_blocks if status else 0, draining=worker.draining)


def encoder_health(encoder: EncoderRef) -> WorkerHealth:
    """An encode worker as the report shows it: healthy unless its last call failed (the router's view;
    Ray restarts it), the requests it has in hand, and no KV."""
    return WorkerHealth(name=encoder.name, role="encode", node="", healthy=encoder.failed_at is None,
                        requests=encoder.outstanding, queued_prompts=0, kv_blocks_total=0, kv_blocks_free=0)
