"""The router's one event loop, on a thread of its own: the gRPC and HTTP servers, every request's
stream, and the pyzmq sockets the workers send tokens and KV events to all run on it, so a token
message reaches its request's queue without changing threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class EventLoopThread:
    def __init__(self, name: str = "router-loop") -> None:
        self.loop = asyncio.new_event_loop()
        # Why a thread: the launcher (and a test) drives the cluster from its own thread, blocking on Ray.
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def on_loop(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self._thread

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coroutine` on the loop and wait for its result (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and close it once its thread has returned."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
