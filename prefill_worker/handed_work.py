"""What one job handed to its lane's sender thread (frames, lease renewals, a resend), for its commit
or its channel's drain to wait for: that job's work only, not the other jobs' queued on the lane.

Work that is done is let go at once: a long prompt sent layer by layer hands over a piece per layer
and frame (about 2K for 32K tokens), which a job used to keep until it ended. What a piece raised (or
its cancel, when the lane shut down) is kept, and `wait` raises it, as waiting on that piece would.
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future, wait


class HandedWork:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._error: BaseException | None = None  # the first a piece let go of raised

    def add(self, future: Future) -> None:
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)  # at once if it is done already

    def _done(self, future: Future) -> None:
        error = CancelledError() if future.cancelled() else future.exception()
        with self._lock:
            self._pending.discard(future)
            self._error = self._error or error

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def wait(self, timeout: float) -> None:
        """Until everything handed so far is done; raises what a piece raised (CancelledError for a
        cancelled one), or TimeoutError after `timeout` seconds."""
        with self._lock:
            pending = list(self._pending)
        _, not_done = wait(pending, timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} pieces of KV work still queued on the sender after {timeout:g} s")
        for future in pending:  # done, though perhaps not yet through `_done` (callbacks run after waiters wake)
            future.result()
        with self._lock:
            error = self._error
        if error is not None:
            raise error
