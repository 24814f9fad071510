"""What travels between the router and the workers: work requests, and token messages over pyzmq.

Workers PUSH token messages to the router's PULL socket (one message per request per engine step,
never one Ray call per token). A message is a dict:
  rid       request id
  tokens    new token ids;  logprobs: their logprobs or None
  finish    finish reason when the request ended on this worker, else None
  text      the final text (set with finish)
  error     set when the worker failed the request; the router ends it with that message
  events    lifetime events {name: wall-clock seconds}, e.g. prefill_start, kv_committed
  cached    prompt tokens served from the prefix cache (first message)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import zmq

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class WorkRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class TokenSink:
    """A worker's sending end. Thread-safe: the engine loop and transfer threads both send."""

    def __init__(self, address: str) -> None:
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(address)
        self._lock = threading.Lock()

    def send(self, rid: str, tokens: list[int] | None = None, *, logprobs: list[float] | None = None,
             finish: str | None = None, text: str | None = None, error: str | None = None,
             events: dict[str, float] | None = None, cached: int = 0) -> None:
        message: dict[str, Any] = {"rid": rid, "tokens": tokens or [], "logprobs": logprobs, "finish": finish,
                                   "text": text, "error": error, "events": events or {}, "cached": cached}
        with self._lock:
            self._socket.send_json(message)

    def close(self) -> None:
        self._socket.close()
