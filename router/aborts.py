"""Aborts batched per worker: a storm of cancels costs one Ray call per worker, not one per request.

`ActiveRequest` ends many requests within the same few milliseconds when clients cancel in bulk.
Each abort is queued here and sent, with every other abort for the same worker, after `BATCH_S`
(one call carrying many ids; the worker applies them in one engine command). Outside an event loop
(tests, shutdown) an abort is sent at once.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from pdserve.router.workers import WorkerRef

BATCH_S = 0.01  # how long an abort waits for others to the same worker: nothing next to freeing KV


class AbortBatcher:
    def __init__(self) -> None:
        self._pending: dict[str, tuple[Any, list[str]]] = {}  # worker name -> (handle, request ids)
        self._lock = threading.Lock()
        self._scheduled = False
        self.calls = 0  # Ray calls sent, for tests and the storm's figures

    def add(self, worker: WorkerRef, request_id: str) -> None:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._pending.setdefault(worker.name, (worker.handle, []))[1].append(request_id)
            schedule = loop is not None and not self._scheduled
            self._scheduled = self._scheduled or schedule
        if loop is None:
            self.flush()
        elif schedule:
            loop.call_later(BATCH_S, self.flush)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, {}, False
        for handle, request_ids in pending.values():
            handle.abort.remote(request_ids)
            self.calls += 1
