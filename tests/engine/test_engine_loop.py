"""The engine loop thread: it fails loudly, never runs a withdrawn command, and sleeps when idle."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.engine_loop import EngineLoop, LoopStopped
from pdserve.worker_base import loop_health

ARCH = "tiny-llama"
GREEDY = SamplingParams.greedy(max_tokens=4, ignore_eos=True)


@pytest.fixture()
def engine(model_dirs):
    return LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=2 * 2**20, max_model_len=512))


def test_an_exception_in_the_output_callback_fails_loudly(engine):
    fatal: list[BaseException] = []
    done = threading.Event()

    def broken_callback(outputs):
        raise RuntimeError("callback bug")

    loop = EngineLoop(engine, broken_callback, on_fatal=lambda e: (fatal.append(e), done.set())).start()
    loop.call(lambda e: e.add_request([5, 6, 7], GREEDY, "r1"))
    assert done.wait(10), "the loop's failure was never reported"
    assert isinstance(fatal[0], RuntimeError) and "callback bug" in str(fatal[0])
    assert not loop.running and loop.fatal_error is fatal[0]
    with pytest.raises(RuntimeError, match="callback bug"):
        loop.call(lambda e: None)  # later commands fail at once, naming the cause
    loop.stop()


def test_a_failed_loop_is_the_workers_fault_before_its_requests_are_failed(engine):
    """Between the loop's failure and the worker's own report (`on_fatal`, which fails its requests), a
    health check sees the worker out with the loop's error as its fault, never out with no reason."""
    reporting, release = threading.Event(), threading.Event()

    def on_fatal(error: BaseException) -> None:
        reporting.set()
        release.wait(10)

    loop = EngineLoop(engine, lambda outputs: 1 / 0, on_fatal=on_fatal).start()
    assert loop_health("w0", None, loop) == (True, None)
    try:
        loop.submit(lambda e: e.add_request([5, 6, 7], GREEDY, "r1"))
        assert reporting.wait(10), "the loop's failure was never reported"
        assert loop_health("w0", None, loop) == (False, "w0: engine loop failed: ZeroDivisionError: division by zero")
        assert loop_health("w0", "w0: its own words", loop) == (False, "w0: its own words")  # the worker's, once set
    finally:
        release.set()
        loop.stop()


def test_an_output_callback_failing_inside_a_command_ends_the_loop_too(engine):
    """A command that steps the engine itself (the start-up profile) hands outputs over through
    `deliver`: a callback that raises there ends the loop and is reported, as in a step, instead of
    failing only that command while the requests whose outputs it dropped wait forever."""
    fatal: list[BaseException] = []

    def broken_callback(outputs):
        raise RuntimeError("callback bug")

    loop = EngineLoop(engine, broken_callback, on_fatal=fatal.append).start()
    queued_behind = threading.Event()

    def step_it_here(e: LLMEngine) -> None:
        assert queued_behind.wait(10)
        e.add_request([5, 6, 7], GREEDY, "r1")
        loop.deliver(e.step())

    failing = loop.submit(step_it_here)
    behind = loop.submit(lambda e: e.add_request([8, 9], GREEDY, "r2"))  # in the same batch of commands
    queued_behind.set()
    with pytest.raises(RuntimeError, match="callback bug"):
        failing.result(10)
    with pytest.raises(LoopStopped):  # not run: the engine is nobody's after the failure
        behind.result(10)
    assert len(fatal) == 1 and not loop.running and loop.fatal_error is fatal[0]
    assert list(engine.requests) == ["r1"]  # and no step ran after it
    assert engine.requests["r1"].num_computed_tokens == 3
    with pytest.raises(RuntimeError, match="callback bug"):
        loop.call(lambda e: None)
    loop.stop()


def test_a_timed_out_command_never_runs_later(engine):
    loop = EngineLoop(engine, lambda outputs: None).start()
    ran = []
    loop.submit(lambda e: time.sleep(0.5))  # keeps the loop busy
    with pytest.raises(TimeoutError):
        loop.call(lambda e: ran.append("late"), timeout=0.1)
    loop.call(lambda e: None)  # every command queued before this one has been dealt with
    assert ran == []
    loop.stop()


def test_the_loop_sleeps_when_waiting_work_cannot_be_scheduled(engine):
    loop = EngineLoop(engine, lambda outputs: None).start()
    # Imports in progress hold (nearly) every block, so the waiting request cannot be admitted.
    holders = []
    while loop.call(lambda e: e.num_free_blocks) >= 3:
        n = min(496, (loop.call(lambda e: e.num_free_blocks) - 1) * 16)
        holders.append(f"holder-{len(holders)}")
        loop.call(lambda e: e.begin_import(holders[-1], [5] * n, GREEDY, n))
    loop.call(lambda e: e.add_request([5] * 40, GREEDY, "waits"))
    steps_before = loop.busy.steps
    time.sleep(0.5)
    steps = loop.busy.steps - steps_before
    assert loop.call(lambda e: e.has_unfinished_requests())
    assert steps <= 20, f"{steps} empty steps in 0.5 s: the loop spins"  # ~10 at a 50 ms idle wait
    for holder in holders:  # blocks come back: the request runs at once
        loop.call(lambda e: e.abort_request(holder))
    deadline = time.time() + 10
    while loop.call(lambda e: e.has_unfinished_requests()) and time.time() < deadline:
        time.sleep(0.01)
    assert not loop.call(lambda e: e.has_unfinished_requests())
    busy = loop.busy
    assert busy.wall_s > 0.5 and busy.forward_s > 0 and busy.forward_s + busy.other_s < busy.wall_s
    loop.stop()


def test_a_posted_command_that_fails_is_logged(engine, caplog):
    loop = EngineLoop(engine, lambda outputs: None).start()
    try:
        loop.post(lambda e: e.pool.free([0]))  # a double free: the signal of a KV accounting bug
        loop.call(lambda e: None)  # the posted command ran before this one
    finally:
        loop.stop()
    assert any("engine command failed" in r.getMessage() and "free" in r.getMessage() for r in caplog.records)


def test_every_command_submitted_while_the_loop_stops_is_answered(engine):
    for _ in range(20):
        loop = EngineLoop(engine, lambda outputs: None).start()
        futures = []
        stopper = threading.Thread(target=loop.stop)
        stopper.start()
        for _ in range(200):
            futures.append(loop.submit(lambda e: None))
        stopper.join(10)
        _, unanswered = wait(futures, timeout=5)  # each one run, or refused
        assert not unanswered
