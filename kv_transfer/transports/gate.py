"""What a receiving half does before it trusts a peer: bounded connections, a deadline, and log
lines a flood cannot multiply.

A listener holds two budgets apart: connections still proving membership (at most MAX_PENDING in
all and MAX_PENDING_PER_HOST from one address, each cut off AUTH_DEADLINE_S after it was accepted)
and members' connections (MAX_MEMBERS). Strangers that open idle sockets fill only the first, and
not for long: a new connection evicts the oldest pending one of its address, or of all, when their
places are taken, so a member's connection still gets its turn to prove itself; after the proof it
counts against the second. Refusals are logged once per peer per
REFUSAL_LOG_S, with how many came since, and peer text only as `shown` cuts it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.kv_transfer.interface import shown

AUTH_DEADLINE_S = 5.0  # from accept to a proven membership (TLS handshake included)
MAX_PENDING = 32
MAX_PENDING_PER_HOST = 8
MAX_MEMBERS = 256
REFUSAL_LOG_S = 60.0
_REFUSERS_KEPT = 1024  # peers whose last refusal line is remembered (the oldest are forgotten first)


class RefusalLog:
    """Logs a refused peer at most once per REFUSAL_LOG_S, saying how many were refused since."""

    def __init__(self, logger: logging.Logger, listener: str, interval_s: float = REFUSAL_LOG_S) -> None:
        self._log = logger
        self._listener = listener
        self._interval_s = interval_s
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()  # host -> (logged at, refused since)
        self._lock = threading.Lock()
        self.refused = 0

    def refused_peer(self, host: str, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.refused += 1
            logged_at, since = self._last.pop(host, (-self._interval_s, 0))
            due = now - logged_at >= self._interval_s
            self._last[host] = (now, 0) if due else (logged_at, since + 1)
            while len(self._last) > _REFUSERS_KEPT:
                self._last.popitem(last=False)
        if due:
            self._log.warning("%s refused %s: %s%s", self._listener, shown(host, 64), why,
                              f" ({since} more refused since the last line)" if since else "")


@dataclass(eq=False)
class Slot:
    """One accepted connection's place in a `ConnectionBudget`."""

    host: str
    close: Callable[[], None]  # ends the connection from another thread (its reads and writes fail at once)
    accepted_at: float = field(default_factory=time.monotonic)
    member: bool = False


class ConnectionBudget:
    """The pending and member connections of one listener (see the module's docstring)."""

    def __init__(self, max_pending: int = MAX_PENDING, max_pending_per_host: int = MAX_PENDING_PER_HOST,
                 max_members: int = MAX_MEMBERS, auth_deadline_s: float = AUTH_DEADLINE_S) -> None:
        self.max_pending = max_pending
        self.max_pending_per_host = max_pending_per_host
        self.max_members = max_members
        self.auth_deadline_s = auth_deadline_s
        self._pending: OrderedDict[int, Slot] = OrderedDict()  # id -> slot, oldest first
        self._members: dict[int, Slot] = {}
        self._lock = threading.Lock()

    def open(self, host: str, close: Callable[[], None]) -> Slot:
        """A place for a connection just accepted from `host`. When its host has its share of pending
        places, that host's oldest pending connection is evicted, and when all are taken, the oldest
        of all: a newcomer always gets its turn to prove itself, so idle sockets cannot lock out a
        member (even one behind the same address), and what they cost stays bounded."""
        with self._lock:
            same_host = [s for s in self._pending.values() if s.host == host]
            if len(same_host) >= self.max_pending_per_host:
                evicted: Slot | None = same_host[0]
            elif len(self._pending) >= self.max_pending:
                evicted = next(iter(self._pending.values()))
            else:
                evicted = None
            if evicted is not None:
                del self._pending[id(evicted)]
            slot = Slot(host, close)
            self._pending[id(slot)] = slot
        if evicted is not None:
            evicted.close()
        return slot

    def prove(self, slot: Slot) -> bool:
        """Move a connection that proved membership to the members' budget; False when that is full
        (or the slot was evicted or timed out meanwhile): the connection is to be closed."""
        with self._lock:
            if self._pending.pop(id(slot), None) is None or len(self._members) >= self.max_members:
                return False
            slot.member = True
            self._members[id(slot)] = slot
            return True

    def release(self, slot: Slot) -> None:
        with self._lock:
            self._pending.pop(id(slot), None)
            self._members.pop(id(slot), None)

    def cut_late(self, now: float | None = None) -> int:
        """Close the pending connections past their deadline (a peer that trickles its handshake);
        returns how many. Called by the listener's accepting thread as it polls."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [s for s in self._pending.values() if now - s.accepted_at > self.auth_deadline_s]
            for slot in late:
                del self._pending[id(slot)]
        for slot in late:
            slot.close()
        return len(late)

    def close_all(self) -> None:
        with self._lock:
            slots = [*self._pending.values(), *self._members.values()]
            self._pending.clear()
            self._members.clear()
        for slot in slots:
            slot.close()

    @property
    def counts(self) -> tuple[int, int]:
        """(pending, members) now."""
        with self._lock:
            return len(self._pending), len(self._members)
