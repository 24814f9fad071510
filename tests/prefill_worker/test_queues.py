"""LAPS's two queues on a prefill worker: what `take` releases, and when."""

from __future__ import annotations

import threading
import time

from pdserve.prefill_worker.queues import SHORTS_PER_KEY, PrefillQueues


def never() -> bool:
    return False


def none_inflight() -> int:
    return 0


def test_one_fcfs_queue_releases_in_arrival_order() -> None:
    queues: PrefillQueues[str] = PrefillQueues(False)
    for job, tokens in (("long", 500), ("short", 8), ("long2", 300)):
        queues.put(job, tokens)
    taken = [job for _ in range(3) for job in queues.take(0.1, lambda: True, none_inflight)]
    assert taken == ["long", "short", "long2"]  # a busy long holds nothing back in one FCFS queue
    assert not queues.is_short(8)


def test_shorts_pass_a_waiting_long_and_leave_as_one_batch() -> None:
    queues: PrefillQueues[str] = PrefillQueues(True, short_tokens=32, window_s=0.0, short_room=100)
    queues.put("long", 500)
    queues.put("s1", 8)
    queues.put("s2", 30)
    assert queues.take(0.1, lambda: True, none_inflight) == ["s1", "s2"]
    assert queues.take(0.05, lambda: True, none_inflight) == []  # a long still holds the engine: the next waits
    assert queues.take(0.1, never, none_inflight) == ["long"]


def test_a_short_batch_waits_for_its_window_unless_it_fills_the_room() -> None:
    queues: PrefillQueues[str] = PrefillQueues(True, short_tokens=32, window_s=0.2, short_room=40)
    queues.put("s1", 8)
    t0 = time.monotonic()
    assert queues.take(1.0, never, none_inflight) == ["s1"]
    assert time.monotonic() - t0 >= 0.19  # released by its window
    queues.put("s2", 30)
    queues.put("s3", 30)  # 60 tokens queued: more than the room, so the batch leaves at once
    t0 = time.monotonic()
    assert queues.take(1.0, never, none_inflight) == ["s2"]  # as many as fit the room (always at least one)
    assert time.monotonic() - t0 < 0.15


def test_shorts_in_flight_use_up_the_room() -> None:
    queues: PrefillQueues[str] = PrefillQueues(True, short_tokens=32, window_s=0.0, short_room=40)
    queues.put("s1", 8)
    assert queues.take(0.05, never, lambda: 40) == []  # the step's room for shorts is taken
    assert queues.take(0.1, never, lambda: 20) == ["s1"]


def test_jobs_queued_before_laps_is_set_up_are_still_taken_in_order() -> None:
    queues: PrefillQueues[str] = PrefillQueues(False)
    queues.put("first", 8)
    queues.configure(True, short_tokens=32, window_s=0.0, short_room=100)
    queues.put("short", 8)
    queues.put("long", 500)
    taken = [job for _ in range(3) for job in queues.take(0.1, never, none_inflight)]
    assert taken == ["short", "first", "long"]  # "first" was queued as a long: it keeps its place there


def test_shorts_queued_when_laps_is_turned_off_go_first_in_the_one_line() -> None:
    queues: PrefillQueues[str] = PrefillQueues(True, short_tokens=32, window_s=10.0, short_room=100)
    queues.put("long", 500)
    queues.put("short", 8)  # waits for its batch window
    queues.configure(False)
    taken = [job for _ in range(2) for job in queues.take(0.1, never, none_inflight)]
    assert taken == ["short", "long"]


def decode_worker_of(job: str) -> str:
    return job[0]  # "a1" is bound for decode worker "a"


def test_a_job_whose_decode_worker_is_busy_waits_in_place_while_others_go_ahead() -> None:
    queues: PrefillQueues[str] = PrefillQueues(False, key=decode_worker_of)
    for job in ("a1", "a2", "b1", "a3", "b2"):
        queues.put(job, 500)
    assert queues.take(0.1, never, none_inflight, lambda: {"a"}) == ["b1"]
    assert queues.take(0.05, never, none_inflight, lambda: {"a", "b"}) == []
    assert queues.take(0.1, never, none_inflight, lambda: {"b"}) == ["a1"]
    assert [job for _ in range(3) for job in queues.take(0.1, never, none_inflight)] == ["a2", "a3", "b2"]


def test_a_short_batch_takes_every_free_decode_workers_shorts_and_none_of_a_busy_one() -> None:
    """Shorts bound for one decode worker go in one batch (so they share a step); those of a decode
    worker still waiting for a lease stay, in place."""
    queues: PrefillQueues[str] = PrefillQueues(True, short_tokens=32, window_s=0.0, short_room=100, key=decode_worker_of)
    for job in ("a1", "a2", "b1", "c1", "b2"):
        queues.put(job, 8)
    assert queues.take(0.1, never, none_inflight, lambda: {"c"}) == ["a1", "a2", "b1", "b2"]
    assert queues.take(0.1, never, none_inflight) == ["c1"]


def test_a_short_batch_takes_a_bounded_share_of_one_decode_workers_shorts() -> None:
    """Each short of a batch holds a reservation on its decode worker: one batch takes at most
    SHORTS_PER_KEY of them, and the others of that decode worker wait for the next."""
    queues: PrefillQueues[str] = PrefillQueues(True, short_tokens=32, window_s=0.0, short_room=1000,
                                               key=decode_worker_of)
    jobs = [f"a{i}" for i in range(SHORTS_PER_KEY + 2)] + ["b1"]
    for job in jobs:
        queues.put(job, 8)
    assert queues.take(0.1, never, none_inflight) == jobs[:SHORTS_PER_KEY] + ["b1"]
    assert queues.take(0.1, never, none_inflight) == jobs[SHORTS_PER_KEY:-1]


def test_a_busy_decode_workers_shorts_neither_end_a_batch_nor_open_the_window() -> None:
    queues: PrefillQueues[str] = PrefillQueues(True, short_tokens=32, window_s=0.3, short_room=40, key=decode_worker_of)
    queues.put("a1", 30)  # bound for a busy decode worker: the batch is made of the others
    time.sleep(0.35)  # a1's window has passed; b1's will not have when it arrives
    queues.put("b1", 8)
    queues.put("c1", 8)
    assert queues.take(0.05, never, none_inflight, lambda: {"a"}) == []  # b1 has not waited its window
    assert queues.take(0.5, never, none_inflight, lambda: {"a"}) == ["b1", "c1"]  # a1's 30 tokens did not end it


def test_a_fcfs_take_waiting_on_a_busy_decode_worker_goes_on_when_woken() -> None:
    queues: PrefillQueues[str] = PrefillQueues(False, key=decode_worker_of)
    queues.put("a1", 500)
    busy = {"a"}
    taken: list[list[str]] = []
    taker = threading.Thread(target=lambda: taken.append(queues.take(10, never, none_inflight, lambda: set(busy))))
    taker.start()
    time.sleep(0.1)
    busy.clear()
    queues.wake()
    taker.join(5)
    assert taken == [["a1"]]


def test_removing_a_decode_workers_jobs_leaves_the_others_in_order() -> None:
    queues: PrefillQueues[str] = PrefillQueues(True, short_tokens=32, window_s=0.0, short_room=100, key=decode_worker_of)
    for job, tokens in (("a1", 500), ("b1", 500), ("a2", 8), ("b2", 8), ("a3", 300)):
        queues.put(job, tokens)
    assert queues.remove(lambda job: decode_worker_of(job) == "a") == ["a2", "a1", "a3"]
    assert queues.take(0.1, never, none_inflight) == ["b2"]
    assert queues.take(0.1, never, none_inflight) == ["b1"]
    assert queues.take(0.05, never, none_inflight) == []
