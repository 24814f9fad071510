"""The router <-> worker messages: validated work requests; health reports; token messages through the real hub over
loopback pyzmq, where a malformed message is dropped and counted and the hub serves on."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import zmq
from helpers import worker_status

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.pdserve.v1.internal_pb2 import TokenBatch
from pdserve.router.token_hub import OutputOrder, TokenStreamHub
from pdserve.wire import (
    INTERNAL,
    LifetimeEvent,
    MalformedMessage,
    TokenMessage,
    TokenSink,
    WorkRequest,
    is_handoff_notice,
    parse_token_batch,
    token_message,
)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"request_id": ""}, "request_id must be a non-empty string"),
    ({"prompt_token_ids": []}, "prompt_token_ids must be a non-empty list"),
    ({"prompt_token_ids": [3, -1]}, "non-negative integers"),
    ({"prompt_token_ids": [3, True]}, "non-negative integers"),
    ({"prompt_token_ids": (3, 4)}, "non-empty list"),
    ({"params": {"temperature": 0}}, "params must be a SamplingParams"),
])
def test_work_request_validation(kwargs, message):
    fields = {"request_id": "r", "prompt_token_ids": [3, 4], "params": SamplingParams(), **kwargs}
    with pytest.raises(ValueError, match=message):
        WorkRequest(**fields)


def test_parse_rejects_garbage_and_batches_with_a_message_without_a_request():
    with pytest.raises(MalformedMessage, match="not a TokenBatch"):
        parse_token_batch(b"\x0a\xff")  # field 1, length 255, truncated
    unnamed = TokenBatch(messages=[TokenMessage(request_id="r1"), TokenMessage(token_ids=[1])])
    with pytest.raises(MalformedMessage, match="without request_id"):
        parse_token_batch(unnamed.SerializeToString())
    step = [TokenMessage(request_id="r1", token_ids=[4]), TokenMessage(request_id="r2", token_ids=[5])]
    assert parse_token_batch(TokenBatch(messages=step).SerializeToString()) == step


def test_one_step_s_messages_travel_together_and_reach_each_request():
    """A worker's engine step sends every request's new tokens in one pyzmq message."""
    async def scenario() -> list[list[int]]:
        hub = TokenStreamHub(asyncio.get_running_loop(), "127.0.0.1")
        sink = TokenSink(hub.address)
        try:
            queues = [hub.subscribe(f"r{i}") for i in range(3)]
            sink.send_step([token_message(f"r{i}", [10 + i], first_index=0) for i in range(3)])
            return [list((await asyncio.wait_for(q.get(), 5)).token_ids) for q in queues]
        finally:
            sink.close()
            hub.close()

    assert asyncio.run(scenario()) == [[10], [11], [12]]


def test_hub_delivers_token_messages_and_drops_malformed_ones():
    async def scenario() -> tuple[TokenMessage, TokenMessage, int]:
        hub = TokenStreamHub(asyncio.get_running_loop(), "127.0.0.1")
        raw = zmq.Context.instance().socket(zmq.PUSH)
        sink = TokenSink(hub.address)
        try:
            queue = hub.subscribe("r1")
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(hub.address)
            raw.send(b"\x0a\xff")
            raw.send(TokenBatch(messages=[TokenMessage(token_ids=[1])]).SerializeToString())
            sink.send("r1", [5, 6], logprobs=[-0.5, -1.0], events={"prefill_start": 1.5}, cached_tokens=3)
            sink.send("r1", [7], finish_reason="length", text="abc", first_index=2)
            first = await asyncio.wait_for(queue.get(), 5)
            last = await asyncio.wait_for(queue.get(), 5)
            deadline = time.monotonic() + 5  # the two sockets' messages may interleave either way
            while hub.malformed < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return first, last, hub.malformed
        finally:
            raw.close()
            sink.close()
            hub.close()

    first, last, malformed = asyncio.run(scenario())
    assert list(first.token_ids) == [5, 6] and list(first.logprobs) == [-0.5, -1.0]
    assert dict(first.events) == {"prefill_start": 1.5} and first.cached_tokens == 3 and not first.finish_reason
    assert list(last.token_ids) == [7] and last.finish_reason == "length" and last.text == "abc"
    assert malformed == 2


def test_the_hub_is_read_on_its_own_event_loop_only():
    """Every stream's queue lives on the router's loop, where the hub puts messages without locking."""
    async def make() -> TokenStreamHub:
        return TokenStreamHub(asyncio.get_running_loop(), "127.0.0.1")

    hub = asyncio.run(make())  # its loop is closed now, as is its socket (its task never ran a step)
    assert hub._socket.closed
    with pytest.raises(RuntimeError, match="on the router's event loop only"):
        hub.subscribe("r1")
    hub.close()  # and closing it again is harmless


def test_a_failed_hub_fails_every_waiting_stream_and_each_new_one():
    """The hub's receiving task fails: each stream waiting on it gets an INTERNAL error naming the
    cause at once (none waits forever), the router hears of it (`on_error`: NOT_SERVING), and a
    stream that subscribes afterwards gets the same error."""
    async def scenario() -> tuple[TokenMessage, TokenMessage, int, TokenStreamHub]:
        hub = TokenStreamHub(asyncio.get_running_loop(), "127.0.0.1")
        told: list[str] = []
        hub.on_error = lambda: told.append(hub.error)
        hub._on_message = lambda data: (_ for _ in ()).throw(ValueError("injected"))  # noqa: E731
        sink = TokenSink(hub.address)
        try:
            waiting = hub.subscribe("r1")
            sink.send("r1", [5], first_index=0)
            failed = await asyncio.wait_for(waiting.get(), 5)
            later = await asyncio.wait_for(hub.subscribe("r2").get(), 5)
            return failed, later, len(told), hub
        finally:
            sink.close()
            hub.close()

    failed, later, told, hub = asyncio.run(scenario())
    assert failed.error_code == INTERNAL and "token stream failed: ValueError: injected" in failed.error
    assert later.request_id == "r2" and later.error == failed.error
    assert told == 1 and hub.error == "ValueError: injected"


def test_a_request_s_messages_reach_it_in_output_order_across_workers():
    """The reported failure: the decode worker's tokens overtook the prefill worker's first token
    (two sockets) and the stream ended without it. Here the decode side's messages go out first."""
    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        hub = TokenStreamHub(asyncio.get_running_loop(), "127.0.0.1")
        prefill, decode = TokenSink(hub.address), TokenSink(hub.address)
        try:
            fresh = hub.subscribe("r1")
            resumed = hub.subscribe("r2", first_index=3)  # a retry: the client has 3 tokens already
            decode.send("r1", [11], first_index=1)
            decode.send("r1", [12, 13], first_index=2)
            decode.send("r1", [14], finish_reason="length", first_index=4)
            decode.send("r2", [21], finish_reason="length", first_index=4)
            decode.send("r2", [20], first_index=3)
            await asyncio.sleep(0.3)  # all four of r1's later messages are in, and held
            assert fresh.empty()
            prefill.send("r1", [10], cached_tokens=5, first_index=0)
            got = [await asyncio.wait_for(fresh.get(), 5) for _ in range(4)]
            got_resumed = [await asyncio.wait_for(resumed.get(), 5) for _ in range(2)]
            return [list(m.token_ids) for m in got], [list(m.token_ids) for m in got_resumed]
        finally:
            prefill.close()
            decode.close()
            hub.close()

    fresh, resumed = asyncio.run(scenario())
    assert fresh == [[10], [11], [12, 13], [14]]
    assert resumed == [[20], [21]]


def test_the_handoff_notice_is_delivered_at_once_and_holds_no_position():
    order = OutputOrder()
    assert order.add(TokenMessage(request_id="r", token_ids=[1], first_index=0)) != []
    assert order.add(TokenMessage(request_id="r", token_ids=[3], first_index=2)) == []  # waits for position 1
    notice = TokenMessage(request_id="r", events={LifetimeEvent.HANDOFF_COMMITTED: 1.0})
    assert is_handoff_notice(notice) and order.add(notice) == [notice]
    later = TokenMessage(request_id="r", token_ids=[2], first_index=1)
    assert [list(m.token_ids) for m in order.add(later)] == [[2], [3]] and order.next_index == 3
    assert not is_handoff_notice(later) and not is_handoff_notice(TokenMessage(request_id="r", events={"x": 1.0}))


def test_an_error_is_delivered_at_once_and_a_repeated_position_is_dropped():
    order = OutputOrder()
    assert order.add(TokenMessage(request_id="r", token_ids=[2], first_index=1)) == []
    failure = TokenMessage(request_id="r", error="peer lost", error_code="UNAVAILABLE", first_index=7)
    assert order.add(failure) == [failure]  # the request is retried now, not after a gap that may never fill
    first = TokenMessage(request_id="r", token_ids=[1], first_index=0)
    assert [list(m.token_ids) for m in order.add(first)] == [[1], [2]] and order.next_index == 2
    assert order.add(TokenMessage(request_id="r", token_ids=[9], first_index=1)) == []  # a second position 1
    assert order.next_index == 2 and order.held_since is None
    # A repeat held before the gap filled is dropped once it is behind, and holds nothing up.
    assert order.add(TokenMessage(request_id="r", token_ids=[4], first_index=3)) == []
    assert order.add(TokenMessage(request_id="r", token_ids=[9], first_index=3)) == []
    assert order.held_since is not None
    assert [list(m.token_ids) for m in order.add(TokenMessage(request_id="r", token_ids=[3], first_index=2))] \
        == [[3], [4]]
    assert order.next_index == 4 and order.held_since is None


def test_the_hub_reports_how_long_a_gap_has_held_a_request_s_messages():
    """What the router's stream reads to retry an attempt whose earlier message was lost."""
    async def scenario() -> tuple[float, float, float]:
        hub = TokenStreamHub(asyncio.get_running_loop(), "127.0.0.1")
        sink = TokenSink(hub.address)
        try:
            queue = hub.subscribe("r1")
            sink.send("r1", [11], first_index=1)  # position 0 never comes
            deadline = time.monotonic() + 5
            while hub.gap_s("r1") == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            held = hub.gap_s("r1")
            sink.send("r1", [10], first_index=0)
            await asyncio.wait_for(queue.get(), 5)
            return held, hub.gap_s("r1"), hub.gap_s("nobody")
        finally:
            sink.close()
            hub.close()

    held, after, unknown = asyncio.run(scenario())
    assert held >= 0.2 and after == 0 and unknown == 0


def test_a_worker_status_holds_what_is_not_free_and_refuses_unknown_fields():
    assert worker_status().holdings == {}
    busy = worker_status(free_blocks=990, requests=2, jobs=1)
    assert busy.holdings == {"blocks": 10, "requests": 2, "jobs": 1}
    with pytest.raises(TypeError, match="free_block"):  # a field renamed on one side fails, never reads as 0
        worker_status(free_block=3)
    with pytest.raises(AttributeError):
        busy.free_blocks  # noqa: B018  the blocks are under `kv`



def test_lifetime_event_names_are_their_members_and_numbered_retries_are_retry():
    assert LifetimeEvent.of("prefill_end") is LifetimeEvent.PREFILL_END
    assert LifetimeEvent.retry(2) == "retry_2" and LifetimeEvent.of("retry_2") is LifetimeEvent.RETRY
    assert json.dumps({LifetimeEvent.ACCEPTED: 1.0}) == '{"accepted": 1.0}'  # the log line keeps its names
    for name in ("retry", "retry_0", "retry_x", "prefil_end", "transfer"):
        with pytest.raises(ValueError):
            LifetimeEvent.of(name)
