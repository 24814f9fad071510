"""Admission control: bounded work per worker, and RESOURCE_EXHAUSTED with a retry-after hint past it.

Each worker takes at most `limit` requests from the router at a time: a prefill worker counts the
requests dispatched to it that have not had their first token yet, a decode (or colocated) worker
the requests placed on it that have not finished. A request that finds every healthy worker of a
pool at its limit is refused at once (the DistServe way: queues stay bounded, so memory does, and a
client hears "busy, retry in N ms" instead of waiting past its deadline). The hint is how long the
pool, at the rate it has been finishing requests over the last `window_s`, needs to make room.
"""

from __future__ import annotations

import time
from collections import deque

from pdserve.router.workers import WorkerRef

MIN_RETRY_S, MAX_RETRY_S = 0.1, 30.0


class Overloaded(RuntimeError):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PoolAdmission:
    def __init__(self, pool: str, limit: int, window_s: float = 10.0) -> None:
        self.pool = pool
        self.limit = limit
        self.window_s = window_s
        self._done: deque[float] = deque()  # when requests left this pool, within the window

    def open_workers(self, workers: list[WorkerRef]) -> list[WorkerRef]:
        """The workers with room; raises Overloaded when there is none."""
        room = [w for w in workers if w.outstanding < self.limit]
        if not room:
            held = sum(w.outstanding for w in workers)
            raise Overloaded(f"the {self.pool} pool is full ({held} requests on {len(workers)} healthy "
                             f"worker(s), at most {self.limit} each); retry later", self.retry_after_s())
        return room

    def left(self, now: float | None = None) -> None:
        """A request left the pool (finished its stage, failed or was cancelled)."""
        now = time.monotonic() if now is None else now
        self._done.append(now)
        self._trim(now)

    def retry_after_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._done:
            return 1.0  # nothing finished lately: no rate to go by
        rate = len(self._done) / self.window_s
        return min(MAX_RETRY_S, max(MIN_RETRY_S, 1.0 / rate))

    def _trim(self, now: float) -> None:
        while self._done and self._done[0] < now - self.window_s:
            self._done.popleft()
