"""Long-lived threads whose failure somebody sees.

`start_guarded` runs `target` on a daemon thread; if it raises, the exception is logged with its
traceback and handed to `on_crash` (which fails the requests the thread served and marks its owner
unhealthy). A thread that ends normally is not a crash. Torch-free: the router uses it too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def start_guarded(name: str, target: Callable[[], None], on_crash: Callable[[BaseException], None]) -> threading.Thread:
    def run() -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001 (reported, never swallowed)
            log.exception("thread %s failed", name)
            try:
                on_crash(e)
            except Exception:
                log.exception("handling the failure of thread %s failed too", name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
