"""What the router and the workers say to each other: the one neutral module both import.

  router -> worker   `WorkRequest`, an argument of a Ray actor call (validated on construction).
  worker -> router   `TokenMessage` (protobuf, `proto/pdserve/v1/internal.proto`) over pyzmq: a
                     worker's `TokenSink` PUSHes one message per request per engine step to the
                     router's PULL socket; `parse_token_message` turns bytes back into a message or
                     raises `MalformedMessage`.

No torch here: the router imports this module.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import zmq
from google.protobuf.message import DecodeError

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.pdserve.v1.internal_pb2 import TokenMessage

__all__ = ["WorkRequest", "TokenMessage", "TokenSink", "MalformedMessage", "parse_token_message", "Tombstones",
           "RESOURCE_EXHAUSTED", "INTERNAL", "UNAVAILABLE", "INVALID_ARGUMENT"]

# Error codes a worker puts on a failed request (gRPC status names; the router maps them).
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # a queue or KV memory is full: retry later
INTERNAL = "INTERNAL"  # the worker itself failed (its engine loop or a thread died)
UNAVAILABLE = "UNAVAILABLE"  # a peer or a transfer failed
INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the worker's engine refused the request


@dataclass(frozen=True)
class WorkRequest:
    """One request, tokenized and validated by the router, as a worker receives it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        ids = self.prompt_token_ids
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise ValueError("prompt_token_ids must be a non-empty list of non-negative integers")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(self.params).__name__}")


class Tombstones:
    """Ids of requests aborted recently (bounded). Ray may run a threaded actor's calls out of order,
    so an abort can overtake the call that starts the request; the start then finds the tombstone."""

    def __init__(self, capacity: int = 65536) -> None:
        self._order: deque[str] = deque()
        self._ids: set[str] = set()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._ids:
                return
            self._order.append(request_id)
            self._ids.add(request_id)
            if len(self._order) > self._capacity:
                self._ids.discard(self._order.popleft())

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._ids


class MalformedMessage(ValueError):
    pass


def parse_token_message(data: bytes) -> TokenMessage:
    message = TokenMessage()
    try:
        message.ParseFromString(data)
    except DecodeError as e:
        raise MalformedMessage(f"not a TokenMessage: {e}") from None
    if not message.request_id:
        raise MalformedMessage("TokenMessage without request_id")
    return message


class TokenSink:
    """A worker's sending end. Thread-safe: the engine loop and transfer threads both send."""

    def __init__(self, address: str) -> None:
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(address)
        self._lock = threading.Lock()

    def send(self, request_id: str, token_ids: list[int] | None = None, *, logprobs: list[float] | None = None,
             finish_reason: str | None = None, text: str | None = None, error: str | None = None,
             error_code: str = "", events: dict[str, float] | None = None, cached_tokens: int = 0) -> None:
        """One message; `error` (with `error_code`, a gRPC status name) fails the request."""
        message = TokenMessage(request_id=request_id, token_ids=token_ids or [], logprobs=logprobs or [],
                               finish_reason=finish_reason or "", text=text or "", error=error or "",
                               error_code=error_code, events=events or {}, cached_tokens=cached_tokens)
        data = message.SerializeToString()
        with self._lock:
            self._socket.send(data)

    def close(self) -> None:
        self._socket.close()
