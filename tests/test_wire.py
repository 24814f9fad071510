"""The router <-> worker messages: validated work requests; token messages through the real hub over
loopback pyzmq, where a malformed message is dropped and counted and the hub serves on."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.token_hub import TokenStreamHub
from pdserve.wire import MalformedMessage, TokenMessage, TokenSink, WorkRequest, parse_token_message


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


def test_parse_rejects_garbage_and_messages_without_a_request():
    with pytest.raises(MalformedMessage, match="not a TokenMessage"):
        parse_token_message(b"\x0a\xff")  # field 1, length 255, truncated
    with pytest.raises(MalformedMessage, match="without request_id"):
        parse_token_message(TokenMessage(token_ids=[1]).SerializeToString())


def test_hub_delivers_token_messages_and_drops_malformed_ones():
    async def scenario() -> tuple[TokenMessage, TokenMessage, int]:
        hub = TokenStreamHub("127.0.0.1")
        raw = zmq.Context.instance().socket(zmq.PUSH)
        sink = TokenSink(hub.address)
        try:
            queue = hub.subscribe("r1")
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(hub.address)
            raw.send(b"\x0a\xff")
            raw.send(TokenMessage(token_ids=[1]).SerializeToString())
            sink.send("r1", [5, 6], logprobs=[-0.5, -1.0], events={"prefill_start": 1.5}, cached_tokens=3)
            sink.send("r1", [7], finish_reason="length", text="abc")
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
