"""The per-transfer state machine that every path, success or failure, goes through.

    BOOTSTRAPPING --reserve ok--> RESERVED --first layer--> TRANSFERRING --commit--> SUCCESS
          |                          |                          |
          +--------------------------+----------> FAILED <------+   (abort, lease expiry, error)
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    RESERVED = "reserved"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.SUCCESS, TransferState.FAILED)


_ALLOWED = {
    TransferState.BOOTSTRAPPING: {TransferState.RESERVED, TransferState.FAILED},
    TransferState.RESERVED: {TransferState.TRANSFERRING, TransferState.SUCCESS, TransferState.FAILED},
    TransferState.TRANSFERRING: {TransferState.SUCCESS, TransferState.FAILED},
    TransferState.SUCCESS: set(),
    TransferState.FAILED: set(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Transfer:
    transfer_id: str
    request_id: str
    state: TransferState = TransferState.BOOTSTRAPPING
    error: str | None = None
    events: dict[str, float] = field(default_factory=lambda: {"bootstrapping": time.time()})
    bytes_moved: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def advance(self, new: TransferState, error: str | None = None) -> bool:
        """Move to `new`; False (and no change) when already there. Raises on an illegal move."""
        with self._lock:
            return self._move(new, error)

    def _move(self, new: TransferState, error: str | None) -> bool:  # under `_lock`
        if new == self.state:
            return False
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"transfer {self.transfer_id}: {self.state.value} -> {new.value}")
        self.state = new
        self.error = error if new == TransferState.FAILED else self.error
        self.events[new.value] = time.time()
        return True

    def advance_unless_finished(self, new: TransferState) -> bool:
        """`advance`, but a transfer that already ended (aborted meanwhile) stays as it is: False."""
        try:
            return self.advance(new)
        except IllegalTransition:  # it ended between the check and the move
            return False

    def fail(self, error: str) -> bool:
        """Fail unless already finished; True when this call did it (so cleanup runs once). One hold
        of the lock: a commit landing between the check and the move must not make it raise."""
        with self._lock:
            return not self.state.is_terminal and self._move(TransferState.FAILED, error)
