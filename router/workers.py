"""What the router knows of each worker, and which workers a request may go to.

`WorkerRef` is the router's view of one worker: its handle, health (kept by the cluster's
supervisor), its last health report (`status`: free KV blocks, its fitted step cost, its LAPS
threshold), and the load the router itself put on it, which is exact at every moment because every
request passes through here: requests holding an admission slot, prompt work not yet past its
first token, and KV blocks its requests may hold. Policies (`router.policies`) choose among these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.cost_model import StepCost
from pdserve.wire import WorkerStatus


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
    status: WorkerStatus | None = None  # its last health report (`ping`); placement starts after the first
    fault: str | None = None  # why it is out, as its last health report said; kept by the supervisor, None while healthy
    reported_at: float = 0.0  # when `status` arrived (monotonic clock)
    outstanding: int = 0  # requests holding an admission slot here (`router.admission`)
    queued: dict[str, QueuedPrefill] = field(default_factory=dict)  # request id -> its prompt work here
    active_blocks: int = 0  # KV blocks the requests placed here may hold (prompt + max_tokens)
    draining: bool = False  # takes no new request; those it holds move away (`Frontend.drain`)
    least_fixed_step_s: float = math.inf  # the lowest fixed step cost its fits have shown (`fixed_step_s`)

    @property
    def step_cost(self) -> StepCost:
        return self.status.step_cost

    def fixed_step_s(self) -> float:
        """Its step's fixed cost: the least its fitted step costs have shown. A fit under load is
        inflated by what shares its cores and its batches, and a bound that grew with that (local
        prefills kept within it) would load the worker further: the bound ran away to whole prompts
        of a thousand tokens and decode steps of seconds in a loaded 2P+1D cluster."""
        if self.step_cost.measured and self.step_cost.a > 0:  # a fit with no intercept says nothing of it
            self.least_fixed_step_s = min(self.least_fixed_step_s, self.step_cost.a)
        return self.least_fixed_step_s if math.isfinite(self.least_fixed_step_s) else self.step_cost.a

    def restarted(self) -> None:
        """Its process was started afresh (by Ray, perhaps on another node): what its earlier fits
        showed no longer bounds its costs."""
        self.least_fixed_step_s = math.inf

    @property
    def total_blocks(self) -> int:
        return self.status.kv.total_blocks

    @property
    def free_blocks(self) -> int:
        """Free KV blocks as the router sees them: the last report, less what was placed since, which
        the router's own count (every request placed here holds at most its blocks) bounds."""
        return max(0, min(self.status.kv.free_blocks, self.total_blocks - self.active_blocks))

    @property
    def short_prompt_tokens(self) -> int:
        return self.status.short_prompt_tokens

    @property
    def chunk_tokens(self) -> int:
        return self.status.chunk_tokens


class NoHealthyWorker(RuntimeError):
    pass


def placeable_workers(workers: list[WorkerRef]) -> list[WorkerRef]:
    """The healthy ones not draining; raises NoHealthyWorker when there is none."""
    placeable = [w for w in workers if w.healthy and not w.draining]
    if not placeable:
        pool = workers[0].pool if workers else "unknown"
        draining = sum(w.healthy and w.draining for w in workers)
        raise NoHealthyWorker(f"no healthy worker in the {pool} pool" + (f" ({draining} draining)" if draining else ""))
    return placeable
