"""What the router knows of each worker, and which workers a request may go to.

`WorkerRef` is the router's view of one worker: its handle, health (kept by the cluster's
supervisor), its last health report (`status`: free KV blocks, its fitted step cost, its LAPS
threshold), and the load the router itself put on it, which is exact at every moment because every
request passes through here: requests holding an admission slot, prompt work not yet past its
first token, and KV blocks its requests may hold. Policies (`router.policies`) choose among these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.cost_model import StepCost


@dataclass(frozen=True)
class QueuedPrefill:
    """A prompt placed on a worker and not yet past its first token."""

    new_tokens: int  # the uncached part, which the worker computes
    cached_tokens: int
    short: bool  # in the worker's short queue (LAPS)

    @property
    def quad(self) -> int:
        return self.new_tokens * (self.cached_tokens + self.new_tokens)


@dataclass(eq=False)
class WorkerRef:
    name: str
    pool: str
    handle: Any  # Ray actor handle
    healthy: bool = True
    status: dict = field(default_factory=dict)  # the worker's last health report (`ping`)
    outstanding: int = 0  # requests holding an admission slot here (`router.admission`)
    queued: dict[str, QueuedPrefill] = field(default_factory=dict)  # request id -> its prompt work here
    active_blocks: int = 0  # KV blocks the requests placed here may hold (prompt + max_tokens)

    @property
    def step_cost(self) -> StepCost:
        return StepCost(*self.status.get("step_cost", (0.0, 0.0, 0.0)))

    @property
    def total_blocks(self) -> int:
        return int(self.status.get("total_blocks", 0))

    @property
    def free_blocks(self) -> int:
        """Free KV blocks as the router sees them: the last report, less what was placed since, which
        the router's own count (every request placed here holds at most its blocks) bounds."""
        reported = int(self.status.get("free_blocks", 0))
        return max(0, min(reported, self.total_blocks - self.active_blocks))

    @property
    def short_prompt_tokens(self) -> int:
        return int(self.status.get("short_prompt_tokens", 0))

    @property
    def chunk_tokens(self) -> int:
        """The longest prompt chunk one step computes (LAPS's chunk, else the step budget)."""
        return int(self.status.get("chunk_tokens", 0))


class NoHealthyWorker(RuntimeError):
    pass


def healthy_workers(workers: list[WorkerRef]) -> list[WorkerRef]:
    """The healthy ones; raises NoHealthyWorker when there is none."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        pool = workers[0].pool if workers else "unknown"
        raise NoHealthyWorker(f"no healthy worker in the {pool} pool")
    return healthy
