"""A prefill job's transfer goes on as long as it makes progress: its commit waits for its frames
while they go (each one renews the job's lease, and the lease thread ends a transfer that stops), not
a fixed bound that a long prompt over a slow link outlasts; and a job whose frames wait behind another
job's on their lane is renewed while the lane sends."""

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


def test_a_job_waiting_behind_a_busy_lane_is_renewed_and_one_behind_a_stuck_lane_is_not():
    """The lane sends one job's frames after another's: the second job's lease must not lapse while
    the first one's go (a long transfer over a slow link), but must once the lane stops sending."""
    kv = SimpleNamespace(lease_s=30.0)
    full = kv.lease_s + worker_module.PREFILL_LEASE_MARGIN_S
    now = 1000.0
    with ThreadPoolExecutor(max_workers=1) as sender:
        waiting = job_sending_for(0.3, sender)  # its frames, not yet sent

        def job(lane_sent_s_ago: float, lease_left_s: float, handed=waiting.handed) -> SimpleNamespace:
            return SimpleNamespace(handed=handed, lane=SimpleNamespace(progressed_at=now - lane_sent_s_ago),
                                   lease_until=now + lease_left_s)

        busy = PrefillWorker._waits_behind_a_busy_lane
        worker = SimpleNamespace(kv=kv)
        assert busy(worker, job(lane_sent_s_ago=1.0, lease_left_s=full / 2), now)
        assert not busy(worker, job(lane_sent_s_ago=kv.lease_s / 2, lease_left_s=full / 2), now)  # lane stuck
        assert not busy(worker, job(lane_sent_s_ago=1.0, lease_left_s=full - 1), now)  # renewed just now
        assert not busy(worker, job(lane_sent_s_ago=1.0, lease_left_s=full / 2, handed=HandedWork()), now)
