"""What a sending half keeps per receiving address between channels (tcp's proven connections, the
control channel's CURVE sockets): the next channel to that peer reuses one instead of paying its
handshake again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from pdserve.kv_transfer.interface import TransferError

IDLE_REUSE_S = 60.0  # an idle one is reused only this long (a tcp receiver keeps a member's MEMBER_IDLE_S)


class Closable(Protocol):
    def close(self) -> None: ...


T = TypeVar("T", bound=Closable)


class IdlePool(Generic[T]):
    """Idle ones per address, each reused within IDLE_REUSE_S of going idle: a peer gone for good, or a
    connection a middlebox dropped while idle, costs one that long, not for the sender's life. An
    address is known from its first `take` until `forget`: one given back to a forgotten address (its
    receiver moved while a channel to it was open) is closed. Holds at most as many per address as
    channels ran there at once."""

    def __init__(self) -> None:
        self._idle: dict[str, list[tuple[T, float]]] = {}  # address -> (idle one, since when), last used last
        self._lock = threading.Lock()
        self._closed = False

    def take(self, address: str, usable: Callable[[T], bool] = lambda idle: True) -> T | None:
        """An idle one for `address` that is still `usable` (those that are not are closed), or None:
        the caller makes one. TransferError once the pool is closed."""
        while True:
            now = time.monotonic()
            with self._lock:
                if self._closed:
                    raise TransferError("the KV sender is closed")
                stale = [item for idle in self._idle.values() for item, since in idle if now - since > IDLE_REUSE_S]
                for idle in self._idle.values():
                    idle[:] = [(item, since) for item, since in idle if now - since <= IDLE_REUSE_S]
                idle = self._idle.setdefault(address, [])
                item = idle.pop()[0] if idle else None
            for old in stale:
                old.close()
            if item is None or usable(item):
                return item
            item.close()

    def give_back(self, address: str, item: T) -> None:
        with self._lock:
            idle = None if self._closed else self._idle.get(address)
            if idle is not None:
                idle.append((item, time.monotonic()))
                return
        item.close()

    def forget(self, address: str) -> None:
        with self._lock:
            idle = self._idle.pop(address, [])
        for item, _ in idle:
            item.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            addresses = list(self._idle)
        for address in addresses:
            self.forget(address)
