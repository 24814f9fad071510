"""The router's receiving end of token streaming: one PULL socket, fanned out to per-request queues.

Messages are `pdserve.wire.TokenMessage`s, each engine step's in one `TokenBatch`. Each request's
reach its queue in output order (`OutputOrder`): its first token comes from the prefill worker and
the rest from the decode worker, over two sockets that the PULL socket reads fairly, not in the
order they were sent. One that does not parse (a batch) is dropped and counted (`malformed`), never
fatal: the hub serves every other request on. If the hub's receiving task itself fails, every
waiting request gets an INTERNAL error naming the cause and `error` is set (the router then refuses
new requests and reports NOT_SERVING) instead of leaving streams waiting forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.router.zmq_pull import PullHub, on_loop
from pdserve.wire import (
    INTERNAL,
    ClusterSecret,
    MalformedMessage,
    TokenMessage,
    is_handoff_notice,
    parse_token_batch,
)

log = logging.getLogger(__name__)


class OutputOrder:
    """One request's token messages put back in output order by their `first_index`. An error acts at
    once, whatever its position: the request ends, or is tried again under another id; so does the
    notice that the KV handoff committed, which has no position."""

    def __init__(self, next_index: int = 0) -> None:
        self.next_index = next_index  # the output position of the next token to deliver
        self._early: list[tuple[float, TokenMessage]] = []  # (arrived, message): held for one before them

    @property
    def held_since(self) -> float | None:
        """Monotonic time the oldest held message arrived; None when none is held."""
        return min((arrived for arrived, _ in self._early), default=None)

    def add(self, message: TokenMessage) -> list[TokenMessage]:
        """The messages that can be delivered now, in order (none while one before them is missing)."""
        if message.error or is_handoff_notice(message):
            return [message]
        self._early.append((time.monotonic(), message))
        ready = []
        while (nxt := next((e for e in self._early if e[1].first_index == self.next_index), None)) is not None:
            self._early.remove(nxt)
            ready.append(nxt[1])
            self.next_index += len(nxt[1].token_ids)
        for _, stale in [e for e in self._early if e[1].first_index < self.next_index]:
            # No worker sends a position twice: a bug, not a race.
            log.warning("dropped a token message of %s at output position %d, already delivered up to %d",
                        stale.request_id, stale.first_index, self.next_index)
        self._early = [e for e in self._early if e[1].first_index >= self.next_index]
        return ready


@dataclass
class _Subscriber:
    queue: asyncio.Queue[TokenMessage]
    order: OutputOrder


class TokenStreamHub(PullHub):
    """Runs on the router's event loop (`loop`): `subscribe`, `unsubscribe` and `gap_s` are called
    there, and messages reach their queues there without a thread hand-off; `deliver` may be called
    from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str = "127.0.0.1",
                 secret: ClusterSecret | None = None) -> None:
        self.malformed = 0
        self.error: str | None = None
        self.on_error: Callable[[], None] = lambda: None  # the router server publishes NOT_SERVING
        self._subscribers: dict[str, _Subscriber] = {}
        super().__init__("token stream", host, secret, loop)

    def subscribe(self, request_id: str, first_index: int = 0) -> asyncio.Queue[TokenMessage]:
        """Messages for `request_id` arrive on the returned queue in output order, starting at output
        position `first_index` (the tokens a resumed request's client already has come before it)."""
        self._check_on_loop()
        queue: asyncio.Queue[TokenMessage] = asyncio.Queue()
        if self.error is not None:
            queue.put_nowait(self._failure(request_id))
        self._subscribers[request_id] = _Subscriber(queue, OutputOrder(first_index))
        return queue

    def gap_s(self, request_id: str) -> float:
        """How long messages of `request_id` have been held for one before them that has not come
        (0 when none is held). A gap that lasts means a message was lost: its worker died with it
        unsent."""
        self._check_on_loop()
        subscriber = self._subscribers.get(request_id)
        since = subscriber.order.held_since if subscriber is not None else None
        return 0.0 if since is None else time.monotonic() - since

    def unsubscribe(self, request_id: str) -> None:
        self._check_on_loop()
        self._subscribers.pop(request_id, None)

    def deliver(self, message: TokenMessage) -> None:
        """Hand one of the router's own messages (such as a failed dispatch) to its request's stream,
        from any thread."""
        try:
            self._loop.call_soon_threadsafe(self._hand, message)
        except RuntimeError:  # the router's loop is closed (shutting down): no stream waits any more
            log.debug("dropped a message for %s: the router's event loop is closed", message.request_id)

    def _check_on_loop(self) -> None:
        if not on_loop(self._loop):
            raise RuntimeError("the token stream is read on the router's event loop only")

    def _crashed(self, error: BaseException) -> None:
        self.error = f"{type(error).__name__}: {error}"
        for request_id, subscriber in self._subscribers.items():
            subscriber.queue.put_nowait(self._failure(request_id))
        self.on_error()

    def _failure(self, request_id: str) -> TokenMessage:
        return TokenMessage(request_id=request_id, error=f"the router's token stream failed: {self.error}",
                            error_code=INTERNAL)

    def _on_message(self, data: bytes) -> None:
        try:
            messages = parse_token_batch(data)
        except MalformedMessage as e:
            self.malformed += 1
            log.warning("dropped a malformed token batch (%d so far): %s", self.malformed, e)
            return
        for message in messages:
            self._hand(message)

    def _hand(self, message: TokenMessage) -> None:
        subscriber = self._subscribers.get(message.request_id)
        if subscriber is None:  # messages of requests nobody waits for (cancelled) are dropped
            return
        for ready in subscriber.order.add(message):
            subscriber.queue.put_nowait(ready)
