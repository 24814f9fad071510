"""Long-lived threads, and work handed to pools, whose failure somebody sees.

`start_guarded` runs `target` on a daemon thread (`submit_guarded`: on a pool's thread); if it
raises, the exception is logged with its traceback and handed to `on_crash` (which fails the
requests the thread served and marks its owner unhealthy). A thread that ends normally is not a
crash. Torch-free: the router uses it too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

log = logging.getLogger(__name__)


def start_guarded(name: str, target: Callable[[], None], on_crash: Callable[[BaseException], None]) -> threading.Thread:
    thread = threading.Thread(target=_guarded(name, target, on_crash), name=name, daemon=True)
    thread.start()
    return thread


def submit_guarded(pool: Executor, name: str, target: Callable[[], None],
                   on_crash: Callable[[BaseException], None]) -> Future:
    """Run `target` on a pool's thread, guarded as `start_guarded`'s threads are: for work nobody
    waits on, whose exception would otherwise stay in its future."""
    return pool.submit(_guarded(name, target, on_crash))


def _guarded(name: str, target: Callable[[], None], on_crash: Callable[[BaseException], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001 (reported, never swallowed)
            log.exception("thread %s failed", name)
            try:
                on_crash(e)
            except Exception:
                log.exception("handling the failure of thread %s failed too", name)

    return run
