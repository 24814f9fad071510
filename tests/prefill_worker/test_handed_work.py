"""A job's work on its lane's sender thread (`HandedWork`): what is done is let go, what failed is
still raised, and waiting is bounded."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor

import pytest

from pdserve.prefill_worker.handed_work import HandedWork


def test_work_done_is_let_go_and_waiting_for_it_returns() -> None:
    handed = HandedWork()
    with ThreadPoolExecutor(max_workers=1) as sender:
        for _ in range(2000):  # a 32K-token prompt's frames, layer by layer
            handed.add(sender.submit(lambda: None))
        handed.wait(10.0)
    assert handed.pending == 0


def test_a_piece_that_failed_is_raised_after_it_was_let_go() -> None:
    handed = HandedWork()
    with ThreadPoolExecutor(max_workers=1) as sender:
        failed = sender.submit(lambda: (_ for _ in ()).throw(ValueError("resend failed")))
        failed.exception()  # done before it is handed over: let go at once
        handed.add(failed)
        handed.add(sender.submit(lambda: None))
        with pytest.raises(ValueError, match="resend failed"):
            handed.wait(10.0)
    assert handed.pending == 0


def test_waiting_is_bounded_and_a_cancelled_piece_is_raised() -> None:
    handed = HandedWork()
    release = threading.Event()
    sender = ThreadPoolExecutor(max_workers=1)
    try:
        handed.add(sender.submit(release.wait, 10.0))  # holds the sender thread
        queued = sender.submit(lambda: None)
        handed.add(queued)
        with pytest.raises(TimeoutError):
            handed.wait(0.05)
        assert handed.pending == 2
        assert queued.cancel()  # as the lane's shutdown cancels what it has not started
        release.set()
        with pytest.raises(CancelledError):
            handed.wait(10.0)
        assert handed.pending == 0
    finally:
        release.set()
        sender.shutdown()
