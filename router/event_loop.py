"""The router's one event loop, on a thread of its own: the gRPC and HTTP servers, every request's
stream, and the pyzmq sockets the workers send tokens and KV events to all run on it, so a token
message reaches its request's queue without changing threads."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class EventLoopThread:
    def __init__(self, name: str = "router-loop") -> None:
        self.loop = asyncio.new_event_loop()
        # Why a thread: the launcher (and a test) drives the cluster from its own thread, blocking on Ray.
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coroutine` on the loop and wait for its result (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what still runs on the loop (as `asyncio.run` does at its end), stop it, and close it
        once its thread has returned."""
        if self.loop.is_closed():
            return
        try:
            self.run(_cancel_tasks(), timeout)
        except Exception:  # noqa: BLE001 (the loop stops all the same)
            log.exception("cancelling the tasks left on the event loop failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_tasks() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()
