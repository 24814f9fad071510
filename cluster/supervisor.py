"""Supervision of the worker actors: a thread that pings every worker and keeps `WorkerRef.healthy`.

A worker whose ping fails or misses its deadline is marked unhealthy, so placement skips it and
streams waiting on it end with UNAVAILABLE; `on_change` hears of every change (the router server
publishes it on the standard gRPC health service).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import ray

from pdserve.router.placement import WorkerRef

log = logging.getLogger(__name__)
PING_INTERVAL_S = 0.5
PING_TIMEOUT_S = 1.0


class Supervisor:
    def __init__(self, workers: list[WorkerRef], on_change: Callable[[], None],
                 interval_s: float = PING_INTERVAL_S, timeout_s: float = PING_TIMEOUT_S) -> None:
        self.workers = workers
        self.on_change = on_change
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 5)

    def check_once(self) -> None:
        """Ping every worker once, concurrently; update their health; report a change."""
        pings = {w.handle.ping.remote(): w for w in self.workers}
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=self.timeout_s)
        before = [w.healthy for w in self.workers]
        for ref, worker in pings.items():
            worker.healthy = ref in ready and self._alive(ref, worker)
        if before != [w.healthy for w in self.workers]:
            self.on_change()

    def _alive(self, ref: ray.ObjectRef, worker: WorkerRef) -> bool:
        try:
            return bool(ray.get(ref).get("alive", False))
        except Exception as e:  # the actor died, or its ping raised
            if worker.healthy:
                log.warning("worker %s failed its health check: %s", worker.name, e)
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # keep supervising; a broken round must not end supervision silently
                log.exception("health check round failed")
