"""The router's receiving end of KV events: one PULL socket feeding the exact `PrefixIndex`.

Workers' `pdserve.kv_events.KVEventPublisher`s number their events 1, 2, ... per process (`epoch`).
Per worker the hub keeps the epoch and the last sequence number applied, and applies each event
exactly once, in order:
  - a batch whose events were all applied already (a duplicate, or one overtaken) is dropped; one
    that overlaps what was applied applies only its new events;
  - a gap (events lost), or a worker's first batch that does not start at 1 (the hub missed its start,
    or forgot it), puts the worker into resync: its entries stay as they are, later batches are kept
    (bounded: an overflow only means another gap), and `request_snapshot(worker)` is called, with
    never more than one request outstanding per worker. `apply_snapshot` (any thread) then replaces
    the worker's entries and applies the kept events that come after the snapshot, in order;
  - a new epoch is a restarted worker: its old entries go at once (a new process starts with an
    empty cache), and its events apply from event 1 on; when event 1 was missed, it resyncs like a gap.
`forget(worker)` takes a worker out at once (it became unhealthy); if it comes back, it resyncs. The
hub still knows its epochs then, so a straggler of a dead process does not pass for a new one.

A message that does not parse is dropped and counted (`malformed`), never fatal. If the hub's
receiving task itself fails, the index is cleared and `error` set: placement loses its prefix hints,
nothing else. The hub receives on the router's event loop; `apply_snapshot` and `forget` come from
other threads, hence its lock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdserve.diagnostics import shown
from pdserve.kv_events import KVEventBatch, parse_kv_event_batch
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.zmq_pull import PullHub
from pdserve.wire import ClusterSecret, MalformedMessage

log = logging.getLogger(__name__)


@dataclass
class _Worker:
    epoch: str
    last_seq: int = 0  # the last event reflected in the index
    resyncing: bool = False
    requested_at: float | None = None  # when the outstanding snapshot request was made
    kept: list[KVEventBatch] = field(default_factory=list)  # batches received while resyncing
    num_kept: int = 0  # events (heartbeats count one) in `kept`
    old_epochs: set[str] = field(default_factory=set)  # earlier processes under this name
    forgotten: bool = False  # out of the index until it sends again (then it resyncs)


class KVEventHub(PullHub):
    def __init__(self, index: PrefixIndex, request_snapshot: Callable[[str], None], loop: asyncio.AbstractEventLoop,
                 host: str = "127.0.0.1", *, max_kept_events: int = 65536, snapshot_timeout_s: float = 30.0,
                 secret: ClusterSecret | None = None) -> None:
        self.index = index
        self._request_snapshot = request_snapshot
        self._max_kept_events = max_kept_events
        self._snapshot_timeout_s = snapshot_timeout_s  # then a lost request is made again
        self.applied = 0  # events applied to the index
        self.duplicates = 0  # events received again and skipped
        self.resyncs = 0  # gaps, missed starts and overflows that needed a snapshot
        self.snapshots = 0  # snapshots applied
        self.malformed = 0
        self.error: str | None = None
        self._workers: dict[str, _Worker] = {}
        self._lock = threading.Lock()
        super().__init__("KV event stream", host, secret, loop)

    # --- state, for the launcher, stats and tests -----------------------------------------------
    def last_seq(self, worker: str) -> int | None:
        """The last event of the worker reflected in the index (None: not tracked)."""
        with self._lock:
            state = self._workers.get(worker)
            return None if state is None or state.forgotten else state.last_seq

    def is_resyncing(self, worker: str) -> bool:
        with self._lock:
            state = self._workers.get(worker)
            return state is not None and state.resyncing

    def stats(self) -> dict[str, int]:
        return {"applied": self.applied, "duplicates": self.duplicates, "resyncs": self.resyncs,
                "snapshots": self.snapshots, "malformed": self.malformed}

    # --- from other threads ---------------------------------------------------------------------
    def apply_snapshot(self, worker: str, epoch: str, seq: int, blocks: Iterable[tuple[bytes, bytes | None]]) -> None:
        """A worker's answer to `request_snapshot`: its whole cache as of its event `seq`."""
        requests: list[str] = []
        with self._lock:
            state = self._workers.get(worker)
            if state is None or not state.resyncing or epoch in state.old_epochs:
                # Not asked for (forgotten, or a late second answer), or from a process that has
                # since restarted: ask the current one if the worker still waits.
                if state is not None and state.resyncing:
                    state.requested_at = None
                    self._want_snapshot(worker, state, requests)
            else:
                if epoch != state.epoch:  # a newer process answered before its first batch arrived
                    state.old_epochs.add(state.epoch)
                    state.epoch, state.kept, state.num_kept = epoch, [], 0
                self.index.replace(worker, blocks)
                self.snapshots += 1
                kept = state.kept
                state.last_seq, state.resyncing, state.requested_at = seq, False, None
                state.kept, state.num_kept = [], 0
                for batch in sorted(kept, key=lambda b: b.first_seq):  # reordered ones need no new resync
                    self._receive(batch, requests)
        self._send_requests(requests)

    def forget(self, worker: str) -> None:
        """Take a worker out of the index at once (unhealthy or gone)."""
        with self._lock:
            state = self._workers.get(worker)
            if state is not None:  # its epochs stay known (a dead one's stragglers are ignored)
                self._workers[worker] = _Worker(state.epoch, old_epochs=state.old_epochs, forgotten=True)
            self.index.drop(worker)

    # --- on the router's event loop ------------------------------------------------------------
    def _crashed(self, error: BaseException) -> None:
        with self._lock:
            self.error = f"{type(error).__name__}: {error}"
            for worker in self.index.workers():  # stale from now on: better no hints than wrong ones
                self.index.drop(worker)
            self._workers.clear()

    def _on_message(self, data: bytes) -> None:
        try:
            batch = parse_kv_event_batch(data)
        except MalformedMessage as e:
            self.malformed += 1
            log.warning("dropped a malformed KV event batch (%d so far): %s", self.malformed, e)
            return
        requests: list[str] = []
        with self._lock:
            self._receive(batch, requests)
        self._send_requests(requests)

    # --- under the lock -------------------------------------------------------------------------
    def _receive(self, batch: KVEventBatch, requests: list[str]) -> None:
        worker, first = batch.worker_id, batch.first_seq
        state = self._workers.get(worker)
        if state is not None and batch.epoch in state.old_epochs:
            return  # a straggler from before a restart
        if state is None or batch.epoch != state.epoch:
            previous = state
            state = self._workers[worker] = _Worker(batch.epoch)
            if previous is not None:
                state.old_epochs = previous.old_epochs | {previous.epoch}
            self.index.drop(worker)  # a new process starts with an empty cache: old entries are stale
            if first != 1:  # the process's history from event 1 was missed
                if previous is not None:  # a request still out counts: its answer is taken if of this epoch
                    state.requested_at = previous.requested_at
                self._start_resync(worker, state, requests)
        if state.forgotten:  # back: its entries were dropped, so it resyncs
            state.forgotten = False
            self._start_resync(worker, state, requests)
        if state.resyncing:
            self._keep(worker, state, batch, requests)
            return
        if first > state.last_seq + 1:
            self._start_resync(worker, state, requests)
            self._keep(worker, state, batch, requests)
            return
        skip = min(state.last_seq + 1 - first, len(batch.events))
        self.duplicates += skip
        if skip < len(batch.events):
            new = batch.events[skip:]
            self.index.apply(worker, new)
            self.applied += len(new)
            state.last_seq = first + len(batch.events) - 1

    def _start_resync(self, worker: str, state: _Worker, requests: list[str]) -> None:
        log.info("KV events of %s lost (last applied %d): resyncing from a snapshot", shown(worker), state.last_seq)
        self.resyncs += 1
        state.resyncing = True
        self._want_snapshot(worker, state, requests)

    def _keep(self, worker: str, state: _Worker, batch: KVEventBatch, requests: list[str]) -> None:
        state.num_kept += max(1, len(batch.events))
        if state.num_kept > self._max_kept_events:
            # Dropping what was kept is safe: whatever the snapshot does not cover shows as a gap.
            state.kept, state.num_kept = [], max(1, len(batch.events))
        state.kept.append(batch)
        self._want_snapshot(worker, state, requests)

    def _want_snapshot(self, worker: str, state: _Worker, requests: list[str]) -> None:
        """Ask once; ask again only when the request looks lost (it failed, or timed out)."""
        now = time.monotonic()
        if state.requested_at is None or now - state.requested_at > self._snapshot_timeout_s:
            state.requested_at = now
            requests.append(worker)

    def _send_requests(self, requests: list[str]) -> None:
        # Outside the lock: the callback may answer at once, through apply_snapshot.
        for worker in requests:
            try:
                self._request_snapshot(worker)
            except Exception:
                log.exception("requesting a KV snapshot of %s failed; asking again on its next batch", shown(worker))
                with self._lock:
                    state = self._workers.get(worker)
                    if state is not None:
                        state.requested_at = None
