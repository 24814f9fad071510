"""Supervision of the worker actors: a thread that pings every worker and keeps `WorkerRef.healthy`.

A worker whose ping fails or misses its deadline is marked unhealthy, so placement skips it and
streams waiting on it end with UNAVAILABLE; `on_change` hears of every change (the router server
publishes it on the standard gRPC health service). A worker whose last ping is still unanswered gets
no new one, so a stalled actor does not pile pings up in its threads.
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
        self._pending: dict[str, ray.ObjectRef] = {}  # worker name -> its unanswered ping
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 5)

    def check_once(self) -> None:
        """Ping every worker (concurrently), wait up to the timeout, update health, report a change."""
        for w in self.workers:
            if w.name not in self._pending:
                self._pending[w.name] = w.handle.ping.remote()
        ready, _ = ray.wait(list(self._pending.values()), num_returns=len(self._pending), timeout=self.timeout_s)
        answered = set(ready)
        before = [w.healthy for w in self.workers]
        for w in self.workers:
            ref = self._pending[w.name]
            if ref in answered:
                del self._pending[w.name]
                w.healthy = self._alive(ref, w)
            else:
                w.healthy = False
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
        while not self._stop.is_set():
            try:
                self.check_once()
            except Exception:  # keep supervising; a broken round must not end supervision silently
                log.exception("health check round failed")
            self._stop.wait(self.interval_s)
