"""KV events: how a worker tells the router, exactly, which prefix blocks its cache holds.

  worker -> router   `KVEventBatch` (protobuf, `proto/pdserve/v1/internal.proto`) over pyzmq: a
                     worker's `KVEventPublisher` listens to its block pool (every hash stored, with
                     its parent, and every hash removed), numbers the events 1, 2, ... and PUSHes
                     them in batches to the router's `KVEventHub`; `parse_kv_event_batch` turns
                     bytes back into a batch or raises `MalformedMessage`.
  router -> worker   a snapshot request (a Ray call, made by the launcher) when the router lost
                     events: the worker answers with `KVEventPublisher.snapshot`, taken on its engine
                     loop thread so that the sequence number and the pool's state agree.

Each worker process has a random `epoch`, so the router recognises a restarted worker. A batch that
cannot be sent at once (the router is gone or far behind) is dropped, not queued without bound: the
router sees the gap in the sequence numbers and asks for a snapshot. An idle publisher sends an empty
batch (a heartbeat) now and then, so a lost last batch is noticed too.

Neutral (workers and router both import it) and torch-free, like `pdserve.wire`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq
from google.protobuf.message import DecodeError

from pdserve.proto.pdserve.v1.internal_pb2 import KVEvent, KVEventBatch
from pdserve.threads import start_guarded
from pdserve.wire import ClusterSecret, MalformedMessage

__all__ = ["KVEvent", "KVEventBatch", "KVEventPublisher", "KVSnapshot", "parse_kv_event_batch"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSnapshot:
    """A worker's whole prefix cache as of its event `seq`: what the router replaces its view with."""

    epoch: str
    seq: int
    blocks: list[tuple[bytes, bytes | None]]  # (block hash, parent hash or None for a first block)


def parse_kv_event_batch(data: bytes) -> KVEventBatch:
    batch = KVEventBatch()
    try:
        batch.ParseFromString(data)
    except DecodeError as e:
        raise MalformedMessage(f"not a KVEventBatch: {e}") from None
    if not batch.worker_id or not batch.epoch:
        raise MalformedMessage("KVEventBatch without worker_id or epoch")
    if batch.first_seq < 1:
        raise MalformedMessage("KVEventBatch with first_seq 0 (sequence numbers start at 1)")
    for event in batch.events:
        if not event.block_hash or event.parent_hash == event.block_hash:
            raise MalformedMessage("KVEvent without a block hash, or chained on itself")
    return batch


class KVEventPublisher:
    """A worker's sending end; a `pdserve.engine.block_pool.CacheListener` (set it as `pool.listener`
    before the pool caches its first block, so that event 1 starts from an empty cache).

    `stored` and `removed` run on the engine loop thread, inside the pool's own operations: they only
    number the event and append it under a lock. The flusher thread owns the socket and sends.
    """

    def __init__(self, address: str, worker_id: str, *, heartbeat_s: float = 1.0, max_batch_events: int = 4096,
                 on_crash: Callable[[BaseException], None] = lambda error: None,
                 secret: ClusterSecret | None = None) -> None:
        self.address = address
        self._secret = secret
        self.worker_id = worker_id
        self.epoch = uuid.uuid4().hex
        self.dropped_batches = 0  # batches the socket would not take at once (the router resyncs)
        self._heartbeat_s = heartbeat_s
        self._max_batch_events = max_batch_events
        self._lock = threading.Lock()
        self._seq = 0  # the last number given to an event
        self._pending: list[tuple[bytes, bytes | None, bool]] = []  # events after the last flush
        self._pending_first = 1  # the sequence number of _pending[0]
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = start_guarded(f"kv-events-{worker_id}", self._run, on_crash)

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._seq

    def stored(self, block_hash: bytes, parent_hash: bytes | None) -> None:
        self._append(block_hash, parent_hash, False)

    def removed(self, block_hash: bytes) -> None:
        self._append(block_hash, None, True)

    def _append(self, block_hash: bytes, parent_hash: bytes | None, removed: bool) -> None:
        with self._lock:
            self._seq += 1
            if not self._pending:
                self._pending_first = self._seq
                self._wake.set()  # later events of the same batch need no wake-up of their own
            self._pending.append((block_hash, parent_hash, removed))

    def snapshot(self, blocks: Iterable[tuple[bytes, bytes | None]]) -> KVSnapshot:
        """The snapshot of `blocks` (the pool's `cached_blocks()`), read on the thread that publishes
        the pool's events, so no event can fall between the pool's state and the sequence number."""
        return KVSnapshot(self.epoch, self.last_seq, list(blocks))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is pending, then stop the flusher."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        socket = zmq.Context.instance().socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 1000)
        if self._secret is not None:
            self._secret.client(socket)
        socket.connect(self.address)
        last_sent = time.monotonic()
        try:
            while True:
                self._wake.wait(self._heartbeat_s)
                self._wake.clear()
                stopping = self._stop.is_set()
                with self._lock:
                    events, first = self._pending, self._pending_first
                    self._pending = []
                    next_seq = self._seq + 1
                if events:
                    for start in range(0, len(events), self._max_batch_events):
                        self._send(socket, first + start, events[start : start + self._max_batch_events])
                    last_sent = time.monotonic()
                elif time.monotonic() - last_sent >= self._heartbeat_s:
                    self._send(socket, next_seq, [])
                    last_sent = time.monotonic()
                if stopping:
                    return
        finally:
            socket.close()

    def _send(self, socket: zmq.Socket, first_seq: int, events: list[tuple[bytes, bytes | None, bool]]) -> None:
        batch = KVEventBatch(worker_id=self.worker_id, epoch=self.epoch, first_seq=first_seq, events=[
            KVEvent(block_hash=h, parent_hash=parent or b"", removed=removed) for h, parent, removed in events])
        try:
            socket.send(batch.SerializeToString(), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped_batches += 1
            log.debug("KV event batch %d+%d of %s dropped: the router is not taking events", first_seq,
                      len(events), self.worker_id)
