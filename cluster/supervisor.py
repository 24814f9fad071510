"""Supervision of the worker actors: a thread that pings every worker and keeps `WorkerRef.healthy`.

Liveness is not load: pings run in the actors' own `health` concurrency group, so no amount of blocking
work on a worker's other threads delays them. A worker is unhealthy when its ping fails or goes
unanswered for `misses_to_fail` rounds (the actor hangs, or its node is gone), when it reports itself
dead (its engine loop or another of its threads failed: it has already failed its requests with an
explicit error), or at once when its process dies: each worker that answers a ping gets a `watch` call
held open on a thread of its own (the `watch` group), which Ray fails the moment the process dies, so a
killed worker is known within milliseconds instead of a few ping rounds (`worker_lost`, the one place a
worker is declared lost between rounds). A ping sent before a worker was lost says nothing of it after.
Such a worker is killed so that Ray restarts it (`max_restarts`); it is healthy again once a ping
answers alive (a restarted worker first profiles its prompt passes: placement needs its step costs). A
restarted worker rejoins after a back-off (`RestartBackoff`) that doubles with each restart in a short
while, so a worker in a crash loop (a bad node, a request that kills it) is kept out longer and longer
instead of failing requests at the pace Ray restarts it. Placement skips unhealthy workers, streams
waiting on them end with UNAVAILABLE, and `on_change` hears of every change (the router server
publishes it on the standard gRPC health service). A worker whose last ping is still unanswered gets no
new one, so a stalled actor does not pile pings up.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

import ray

from pdserve.deadlines import HealthDeadlines
from pdserve.router.workers import WorkerRef

log = logging.getLogger(__name__)
HEALTH_GROUP = "health"  # the actors' concurrency group for pings (see launcher)
WATCH_GROUP = "watch"  # ... and for the supervisor's watch call, open for the worker's life


class RestartBackoff:
    """When a restarted worker may rejoin: `first_s` after it is seen restarted, doubling with each
    restart of the same worker within `window_s`, at most `max_s`."""

    def __init__(self, first_s: float, max_s: float, window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first_s, self.max_s, self.window_s = first_s, max_s, window_s
        self._clock = clock
        self._restarts: dict[str, list[float]] = {}  # worker name -> when each recent restart was seen
        self._rejoin_at: dict[str, float] = {}  # workers restarted and not yet back

    @classmethod
    def of(cls, deadlines: HealthDeadlines) -> RestartBackoff:
        """A fresh back-off (no restart counted yet) with the manifest's timings."""
        return cls(deadlines.restart_backoff_s, deadlines.restart_backoff_max_s, deadlines.restart_window_s)

    def may_rejoin(self, name: str) -> bool:
        """Whether restarted worker `name` has waited out its back-off; the first call after a restart
        counts the restart and starts the wait."""
        now = self._clock()
        if name not in self._rejoin_at:
            recent = [t for t in self._restarts.get(name, []) if now - t < self.window_s] + [now]
            self._restarts[name] = recent
            self._rejoin_at[name] = now + min(self.first_s * 2 ** (len(recent) - 1), self.max_s)
        return now >= self._rejoin_at[name]

    def rejoined(self, name: str) -> None:
        self._rejoin_at.pop(name, None)


class Supervisor:
    def __init__(self, workers: list[WorkerRef], on_change: Callable[[], None],
                 deadlines: HealthDeadlines = HealthDeadlines(), after_round: Callable[[], object] = lambda: None,
                 backoff: RestartBackoff | None = None) -> None:
        self.workers = workers
        self.on_change = on_change
        self.after_round = after_round  # the idle audit reads the reports of each round
        self.deadlines = deadlines
        self.restarts: dict[str, int] = {}  # worker name -> restarts the supervisor asked Ray for
        self.backoff = backoff or RestartBackoff.of(deadlines)
        self._pending: dict[str, ray.ObjectRef] = {}  # worker name -> its unanswered ping
        self._missed: dict[str, int] = {}  # worker name -> rounds in a row its ping went unanswered
        self._restarting: set[str] = set()
        self._profiling: dict[str, ray.ObjectRef] = {}  # restarted workers measuring their step costs
        self._watches: dict[str, ray.ObjectRef] = {}  # worker name -> its open watch call
        self._losses: dict[str, int] = {}  # worker name -> times it was lost between rounds
        self._pinged_after: dict[str, int] = {}  # worker name -> its losses when its pending ping was sent
        self._reported = [w.healthy for w in workers]  # the health `on_change` last reported
        # Health changes and their reports: the supervisor's thread and Ray's callback threads (watches).
        # Re-entrant: a watch that has already failed runs its callback at once, inside `_watch`.
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.deadlines.ping_timeout_s + 5)

    def add(self, worker: WorkerRef) -> None:
        """Supervise a worker started after this (it is healthy: it answered, and was profiled)."""
        with self._lock:
            self.workers.append(worker)
            self._watch(worker)
            self._report()

    def remove(self, worker: WorkerRef) -> None:
        """Stop supervising a worker about to be shut down: its watch call ending is no loss."""
        with self._lock:
            self.workers[:] = [w for w in self.workers if w is not worker]
            for table in (self._pending, self._missed, self._watches, self._losses, self._pinged_after,
                          self._profiling):
                table.pop(worker.name, None)
            self._restarting.discard(worker.name)
            self._report()

    def check_once(self) -> None:
        """Ping every worker (concurrently), wait up to the timeout, update health, report a change."""
        with self._lock:  # those of this round: a worker may be added or removed meanwhile
            workers = list(self.workers)
            for w in workers:
                if w.name not in self._pending:
                    self._pending[w.name] = w.handle.ping.options(concurrency_group=HEALTH_GROUP).remote()
                    self._pinged_after[w.name] = self._losses.get(w.name, 0)
            pending = list(self._pending.values())
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=self.deadlines.ping_timeout_s)
        answered = set(ready)
        with self._lock:
            for w in workers:
                ref = self._pending.get(w.name)
                if ref is None:  # removed meanwhile
                    continue
                if ref in answered:
                    del self._pending[w.name]
                    self._missed[w.name] = 0
                    stale = self._pinged_after[w.name] != self._losses.get(w.name, 0)  # sent before it was lost
                    w.healthy = not stale and self._alive(ref, w)
                    if w.healthy:
                        self._watch(w)
                else:  # one slow answer (a starved core) is not death; `misses_to_fail` in a row are
                    self._missed[w.name] = self._missed.get(w.name, 0) + 1
                    w.healthy = w.healthy and self._missed[w.name] < self.deadlines.misses_to_fail
            self._report()
        self.after_round()

    def watched(self) -> set[str]:
        """The workers with a watch call open."""
        with self._lock:
            return set(self._watches)

    def worker_lost(self, worker: WorkerRef, cause: str) -> None:
        """`worker` is gone (its process died): unhealthy at once, reported at once. Any thread."""
        with self._lock:
            if self._stop.is_set() or not worker.healthy:
                return
            log.warning("worker %s lost: %s", worker.name, cause)
            worker.healthy = False
            self._losses[worker.name] = self._losses.get(worker.name, 0) + 1
            self._report()

    def _report(self) -> None:
        """Tell `on_change` of health that changed since it was last told (under the lock)."""
        health = [w.healthy for w in self.workers]
        if health != self._reported:  # against what was reported: a round that failed before telling
            self.on_change()          # (or whose `on_change` raised) is told by the next one
            self._reported = health

    def _watch(self, worker: WorkerRef) -> None:
        """Hold a watch call open on `worker` unless one is (under the lock): it fails when the process dies."""
        if worker.name in self._watches:
            return
        ref = worker.handle.watch.options(concurrency_group=WATCH_GROUP).remote()
        self._watches[worker.name] = ref

        def ended(future: concurrent.futures.Future) -> None:  # on a Ray thread
            with self._lock:
                if self._watches.get(worker.name) != ref:  # removed from supervision: no loss
                    return
                del self._watches[worker.name]
            error = None if future.cancelled() else future.exception()
            if error is not None:  # (a watch that returned: the worker closed, as the cluster stops)
                self.worker_lost(worker, f"its process died ({type(error).__name__})")

        ref.future().add_done_callback(ended)

    def _alive(self, ref: ray.ObjectRef, worker: WorkerRef) -> bool:
        try:
            status = ray.get(ref)
        except Exception as e:  # the actor died (or is restarting), or its ping raised
            if worker.healthy:
                log.warning("worker %s failed its health check: %s", worker.name, e)
            return False
        worker.fault = status.fault
        if status.alive:
            self._restarting.discard(worker.name)
            if not status.profiled:  # restarted by Ray: it measures itself before taking work
                worker.healthy = False  # first: placement reads no old fit into the bound forgotten next
                worker.restarted()
                self._profile(worker)
                return False
            worker.status, worker.reported_at = status, time.monotonic()  # free blocks, step cost: what placement reads
            self.backoff.rejoined(worker.name)
            return True
        if worker.name not in self._restarting:  # it failed and said so: have Ray start it afresh
            log.error("worker %s reports a fault, restarting it: %s", worker.name, status.fault)
            worker.healthy = False  # before the count: whoever sees the restart counted sees it out too
            self._restarting.add(worker.name)
            self.restarts[worker.name] = self.restarts.get(worker.name, 0) + 1
            ray.kill(worker.handle, no_restart=False)
        return False

    def _profile(self, worker: WorkerRef) -> None:
        """Start the worker's profile unless one runs; a finished one (failed, or done and about to show
        in the next ping) is forgotten, so a failed one is started again next round."""
        ref = self._profiling.get(worker.name)
        if ref is None:
            if self.backoff.may_rejoin(worker.name):
                self._profiling[worker.name] = worker.handle.profile.remote()
        elif ray.wait([ref], timeout=0)[0]:
            del self._profiling[worker.name]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_once()
            except Exception:  # keep supervising; a broken round must not end supervision silently
                log.exception("health check round failed")
            self._stop.wait(self.deadlines.ping_interval_s)
