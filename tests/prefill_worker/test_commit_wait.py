"""How long a prefill job's commit waits for its frames to be handed to the channel: as long as they
go (each one renews the job's lease, and the lease thread ends a transfer that stops), not a fixed
bound that a long prompt over a slow link outlasts."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from pdserve.kv_transfer.state import Transfer, TransferState
from pdserve.prefill_worker import worker as worker_module
from pdserve.prefill_worker.handed_work import HandedWork
from pdserve.prefill_worker.worker import PrefillWorker


def job_sending_for(seconds: float, sender: ThreadPoolExecutor) -> SimpleNamespace:
    transfer = Transfer("t", "r")
    transfer.advance(TransferState.RESERVED)
    handed = HandedWork()
    handed.add(sender.submit(time.sleep, seconds))  # frames going out, slowly
    return SimpleNamespace(handed=handed, transfer=transfer)


def test_the_commit_waits_for_frames_still_going_past_any_fixed_bound(monkeypatch):
    monkeypatch.setattr(worker_module, "LEASE_CHECK_S", 0.05)
    monkeypatch.setattr(worker_module, "COMMIT_TIMEOUT_S", 0.1)  # the old fixed bound, outlasted 5 times
    with ThreadPoolExecutor(max_workers=1) as sender:
        job = job_sending_for(0.5, sender)
        started = time.monotonic()
        assert PrefillWorker._sent_while_progressing(None, job)
        assert time.monotonic() - started >= 0.45


def test_the_commit_stops_waiting_once_the_job_ended(monkeypatch):
    """A transfer that stopped making progress lost its lease: the lease thread failed it."""
    monkeypatch.setattr(worker_module, "LEASE_CHECK_S", 0.05)
    with ThreadPoolExecutor(max_workers=1) as sender:
        job = job_sending_for(1.5, sender)
        threading.Timer(0.2, job.transfer.fail, args=("lease expired",)).start()
        started = time.monotonic()
        assert not PrefillWorker._sent_while_progressing(None, job)
        assert time.monotonic() - started < 1.0  # not when the frames are done
