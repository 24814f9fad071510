"""The per-transfer state machine both sides drive, and through which every path, success or failure,
goes (SGLang's `KVPoll`):

    BOOTSTRAPPING --lease--> TRANSFERRING --commit asked--> COMMITTING --admitted--> DONE
          |                       |      <--layers resent--     |
          +-----------------------+---------> FAILED <----------+   (abort, lease expiry, error)

The sending side (`sender.KVSender`) moves its copy as it reserves, sends and commits; the receiving
side (`receiver.KVReceiver`) moves its own as it grants the lease and admits the request. A commit
that names incomplete layers takes the sender back to TRANSFERRING for their resend.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # the reservation is asked for (sender) or being made (receiver)
    TRANSFERRING = "transferring"  # the lease is granted: frames may go
    COMMITTING = "committing"  # the commit is asked for (sender) or admitting the request (receiver)
    DONE = "done"  # the decode worker holds the request
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


_ALLOWED = {
    TransferState.BOOTSTRAPPING: {TransferState.TRANSFERRING, TransferState.FAILED},
    TransferState.TRANSFERRING: {TransferState.COMMITTING, TransferState.FAILED},
    TransferState.COMMITTING: {TransferState.TRANSFERRING, TransferState.DONE, TransferState.FAILED},
    TransferState.DONE: set(),
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
    # When each state was first entered (wall clock: the events travel to the router with the request).
    events: dict[str, float] = field(default_factory=lambda: {TransferState.BOOTSTRAPPING.value: time.time()})
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
        self.events.setdefault(new.value, time.time())
        return True

    def advance_unless_finished(self, new: TransferState) -> bool:
        """`advance`, but a transfer that already ended (aborted meanwhile) stays as it is: False."""
        with self._lock:
            if self.state.is_terminal:
                return False
            return self._move(new, None)

    def fail(self, error: str) -> bool:
        """Fail unless already finished; True when this call did it (so cleanup runs once). One hold
        of the lock: a commit landing between the check and the move must not make it raise."""
        with self._lock:
            return not self.state.is_terminal and self._move(TransferState.FAILED, error)
