"""Why a request's attempt ends when a worker it waits on is out: in the worker's own words when it
reported a fault (the same text as the error it sends), else that it stopped responding."""

from __future__ import annotations

from pdserve.router.frontend import lost_workers
from pdserve.router.workers import WorkerRef


def test_a_lost_worker_is_named_with_the_fault_it_reported_else_as_silent():
    prefill, decode = WorkerRef("prefill-0", "prefill", None), WorkerRef("decode-1", "decode", None)
    assert lost_workers([prefill, decode]) is None
    prefill.healthy, prefill.fault = False, "prefill-0: engine loop failed: RuntimeError: boom"
    assert lost_workers([prefill, decode]) == "prefill-0: engine loop failed: RuntimeError: boom"
    decode.healthy = False
    assert lost_workers([prefill, decode]) == ("prefill-0: engine loop failed: RuntimeError: boom; "
                                               "worker decode-1 stopped responding while serving the request")
