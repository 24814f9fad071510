"""The pyzmq control channel of the shared-memory and torch.distributed transports.

Each sending channel has a DEALER socket connected to the receiving half's ROUTER. A message is
`[kind, seq, *parts]`; the receiving half answers every one with `[seq, status, text]`: in order,
unless its handler gives a message to a lane (`Deferred`: the torch.distributed transport's group
per sender), whose answers come in order per lane.
Status OK: handled; CORRUPT: the frame was damaged (the receiver counted and dropped it; its layer is
sent again after `commit` names it); REFUSED: taken whole, and refused (its transfer cannot go on: it
was aborted there), the handler raising `Refused`; FAILED: the message could not be taken (the text
says why). Only plain bytes cross the socket: no pickle. With the cluster's secret
(`pdserve.wire.ClusterSecret`), the channel is CURVE: the server takes messages only from the
cluster's members.

The loop also runs its owner's `sweep` every SWEEP_S, busy or not: a receiving half releases there
what senders that died left behind (they sent no goodbye).

Every wait is bounded: a send that the peer does not take within SEND_TIMEOUT_S (its queue full, or
gone) fails the channel, and so does an answer that does not come in time. A client may be closed
from another thread (a cancel) while its owner waits or sends: the owner's wait ends within one poll,
a send waiting for room in the peer's queue within SEND_RETRY_S.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from pdserve.diagnostics import shown
from pdserve.kv_transfer.interface import MAX_FRAME_BYTES, CorruptFrame, FrameHeader, FrameSink, TransferError
from pdserve.kv_transfer.transports.idle import IdlePool
from pdserve.threads import start_guarded

if TYPE_CHECKING:  # only its methods are used: pdserve.wire's own imports stay out of the transports
    from pdserve.wire import ClusterSecret

log = logging.getLogger(__name__)

OK, CORRUPT, FAILED, REFUSED = 0, 1, 2, 3
_SEQ = struct.Struct("<Q")
POLL_MS = 100  # how often a loop looks at its stop or closed flag
SEND_TIMEOUT_S = 30.0
SEND_RETRY_S = 0.01  # how long a send waits for room with the lock held, at most
SWEEP_S = 5.0  # how often the loop runs its owner's sweep
LANE_IDLE_S = 10.0  # a lane's thread ends after this long without a message
LANE_STOP_S = 2.0  # how long `stop` waits for the lanes' work under way
LINGER_MS = 1000  # a last message (release, leave) still goes out after close
MAX_MESSAGE_BYTES = MAX_FRAME_BYTES + (64 << 10)  # a frame's payload and its header


class Refused(TransferError):
    """A handler took the whole message (a frame's payload off its wire too) and refuses it: whatever
    else the message's sender shares with this side (a process group) stays in step."""


# Takes a message's parts after [kind, seq]; returns None (answered OK) or the answer to come (`Deferred`);
# raises CorruptFrame, Refused or TransferError to answer so.
Handler = Callable[[bytes, list[zmq.Frame]], "Deferred | None"]


def frame_header(data: memoryview) -> FrameHeader:
    """A control message's frame header. One that does not parse is a malformed message (FAILED), not
    a damaged frame (CORRUPT, which the sender sends again): the channel cannot damage a message (TCP,
    and CURVE's authentication with the cluster secret), so only a faulty sender sends one, and its
    payload was not taken (a process group's send is left without a receive)."""
    try:
        return FrameHeader.unpack(data)
    except CorruptFrame as e:
        raise TransferError(f"malformed frame header: {e}") from None


def deliver(sink: FrameSink, header: FrameHeader, payload: Any) -> None:
    """Hand a frame taken whole to the sink; the sink's refusal is answered REFUSED."""
    try:
        sink.receive_frame(header, payload)
    except CorruptFrame:
        raise
    except TransferError as e:
        raise Refused(str(e)) from e


@dataclass(frozen=True)
class Deferred:
    """A handler's answer to come: `work` runs on a thread of `lane`'s own (a lane takes its messages
    one at a time, in arrival order; lanes run side by side), and its outcome answers the message. So
    a message that waits on its peer (a process-group receive from a stalled sender) holds up only
    its own lane, not the other peers'."""

    lane: str
    work: Callable[[], None]


@dataclass
class _Lane:
    ready: threading.Condition  # on the server's lock: notified when a message joins `waiting`
    # (identity, seq, kind, work) of each message; identity None for a chore, which answers nobody
    waiting: deque[tuple[zmq.Frame | None, zmq.Frame | None, bytes, Callable[[], None]]] = field(default_factory=deque)
    thread: threading.Thread | None = None


class ControlServer:
    """The receiving half's ROUTER: one thread takes messages in arrival order and answers each (or
    hands it to its lane: `Deferred`), and runs `sweep` every SWEEP_S. If that thread or a lane's
    dies, `failure` says why and `on_crash` is told."""

    def __init__(self, name: str, host: str, handle: Handler, secret: ClusterSecret | None = None,
                 sweep: Callable[[], None] = lambda: None,
                 on_crash: Callable[[BaseException], None] = lambda error: None) -> None:
        self.name = name
        self._handle = handle
        self._sweep = sweep
        self._on_crash = on_crash
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A peer's message is allocated as its header declares: bounded, CURVE or not (shm's inline
        # frames are the largest).
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if secret is not None:
            secret.server(self._socket)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        # Lanes' answers reach the loop over inproc: only the loop's thread uses the ROUTER.
        # No high-water mark: a lane must never block on a send while it holds the lock the loop needs.
        inproc = f"inproc://kv-{name}-answers-{uuid.uuid4().hex}"
        self._lane_answers = self._context.socket(zmq.PULL)
        self._answer_out = self._context.socket(zmq.PUSH)
        for socket, option in ((self._lane_answers, zmq.RCVHWM), (self._answer_out, zmq.SNDHWM)):
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(option, 0)
        self._lane_answers.bind(inproc)
        self._answer_out.connect(inproc)
        self._lock = threading.Lock()  # the lanes, the counters and `_answer_out`
        self._lanes: dict[str, _Lane] = {}  # those with a thread
        self.failure: BaseException | None = None  # set if the loop or a lane died (its peers then time out)
        self.dropped = 0  # messages without kind and sequence number: not answered
        self.refused = 0  # messages answered CORRUPT, REFUSED or FAILED
        self._stopped = threading.Event()
        self._thread = start_guarded(f"kv-{name}-receiver", self._serve, self._crashed)
        log.info("KV %s receiver listening on %s", name, self.address)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._lane_answers, zmq.POLLIN)
        next_sweep = time.monotonic() + SWEEP_S
        try:
            while not self._stopped.is_set():
                if time.monotonic() >= next_sweep:
                    self._sweep()
                    next_sweep = time.monotonic() + SWEEP_S
                ready = dict(poller.poll(POLL_MS))
                if self._lane_answers in ready:
                    self._forward_lane_answers()
                if self._socket in ready:
                    self._take(*self._socket.recv_multipart(copy=False))
        finally:
            with self._lock:
                self._answer_out.close()
            self._lane_answers.close()
            self._socket.close()

    def _take(self, identity: zmq.Frame, *message: zmq.Frame) -> None:
        if len(message) < 2 or len(message[1].bytes) != _SEQ.size:
            self.dropped += 1
            log.warning("KV %s receiver: dropped a message of %d parts without kind and sequence number",
                        self.name, len(message))
            return
        kind, seq, *parts = message
        try:
            deferred = self._handle(kind.bytes, parts)
        except Exception as e:  # one peer's bad message must not stop the loop for the others
            self._socket.send_multipart([identity, seq, *self._status(e, kind.bytes)])
            return
        if deferred is None:
            self._socket.send_multipart([identity, seq, bytes([OK]), b""])
            return
        self._queue(deferred.lane, (identity, seq, kind.bytes, deferred.work))

    def _queue(self, name: str, item: tuple[zmq.Frame | None, zmq.Frame | None, bytes, Callable[[], None]]) -> None:
        with self._lock:
            lane = self._lanes.get(name)
            if lane is None:
                lane = self._lanes[name] = _Lane(threading.Condition(self._lock))
                lane.thread = start_guarded(f"kv-{self.name}-lane", lambda: self._run_lane(name, lane), self._crashed)
            lane.waiting.append(item)
            lane.ready.notify()

    def run_on_lane(self, name: str, work: Callable[[], None]) -> None:
        """Run `work` on lane `name`, in order with its messages, answering nobody (the owner's own
        chores: what may wait on a peer stays off the loop's thread)."""
        self._queue(name, (None, None, b"", work))

    def _run_lane(self, name: str, lane: _Lane) -> None:
        """Run the lane's messages in order; end once none came for LANE_IDLE_S (a lane's thread
        lives while its sender sends, not once per frame)."""
        while True:
            with self._lock:
                lane.ready.wait_for(lambda: lane.waiting or self._stopped.is_set(), LANE_IDLE_S)
                if not lane.waiting:
                    del self._lanes[name]
                    return
                identity, seq, kind, work = lane.waiting.popleft()
            if identity is None:  # a chore (`run_on_lane`): nobody to answer, so its failure is logged
                try:
                    work()
                except Exception:
                    log.exception("KV %s receiver: a chore on lane %s failed", self.name, name)
                continue
            try:
                work()
                answer = [bytes([OK]), b""]
            except Exception as e:
                answer = self._status(e, kind)
            with self._lock:
                if not self._answer_out.closed:  # else the loop has stopped: nobody is answered any more
                    self._answer_out.send_multipart([identity, seq, *answer])

    def _forward_lane_answers(self) -> None:
        while True:
            try:
                answer = self._lane_answers.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._socket.send_multipart(answer)

    def _status(self, error: Exception, kind: bytes) -> list[bytes]:
        """The answer's [status, text] for a message whose handling raised `error`."""
        with self._lock:
            self.refused += 1
        if isinstance(error, CorruptFrame):
            status, text = CORRUPT, str(error)
        elif isinstance(error, Refused):
            status, text = REFUSED, f"{type(error.__cause__ or error).__name__}: {error}"
        else:
            if not isinstance(error, TransferError):
                log.error("KV %s receiver: message %s failed", self.name, shown(kind), exc_info=error)
            status, text = FAILED, f"{type(error).__name__}: {error}"
        return [bytes([status]), text.encode()]

    def _crashed(self, error: BaseException) -> None:
        self.failure = error
        self._on_crash(error)

    def stop(self) -> bool:
        """Stop the loop, and let the lanes finish what they hold, waiting up to LANE_STOP_S for them
        (a process exiting under a lane's work, a gloo group being torn down, can abort in C++):
        whether all have ended. A lane still running then (a receive waiting on a stalled peer,
        which gloo cannot abort, for up to its group timeout) ends on its own; its answer goes
        nowhere."""
        self._stopped.set()
        me = threading.current_thread()  # a crash handler or a chore may stop its own server
        if self._thread is not me:
            self._thread.join(timeout=5 * POLL_MS / 1000)
        with self._lock:  # once the loop has stopped, it makes no more lanes
            threads = [lane.thread for lane in self._lanes.values() if lane.thread not in (None, me)]
            for lane in self._lanes.values():
                lane.ready.notify()
        deadline = time.monotonic() + LANE_STOP_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive() and not any(thread.is_alive() for thread in threads)


class ControlClient:
    """One sending channel's DEALER: sends messages, counts what is unanswered, collects answers.
    Thread-safe: its owner sends and waits, any thread may close it."""

    def __init__(self, address: str, on_answer: Callable[[Any], None] = lambda tag: None,
                 secret: ClusterSecret | None = None) -> None:
        self.on_answer = on_answer  # called with each answered message's tag (a channel frees its buffer)
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, LINGER_MS)
        if secret is not None:
            secret.client(self._socket)
        self._socket.connect(address)
        self._lock = threading.Lock()
        self.closed = False
        self._next_seq = 0
        self.unanswered: dict[int, Any] = {}  # seq -> the tag it was sent with
        self.failures: list[str] = []  # the texts of REFUSED and FAILED answers
        self.taken_whole = True  # no message answered FAILED (a message refused before it was taken)
        self.corrupt = 0

    def send(self, kind: bytes, parts: list[bytes | memoryview], tag: Any = None) -> int:
        """Send one message; its `tag` comes back to `on_answer` with the answer (recorded under the
        lock that taking answers needs, so whichever thread takes the answer finds it). While the
        peer's queue is full, it waits for room SEND_RETRY_S at a time, up to SEND_TIMEOUT_S, letting
        go of the lock in between: a close from another thread is not held up behind a stalled peer."""
        deadline = time.monotonic() + SEND_TIMEOUT_S
        while True:
            with self._lock:
                self._check_open()
                if self._socket.poll(int(SEND_RETRY_S * 1000), zmq.POLLOUT):
                    seq = self._next_seq
                    try:  # room for the message's first part is room for all of it (zmq's messages are whole)
                        self._socket.send_multipart([kind, _SEQ.pack(seq), *parts], flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        pass
                    else:
                        self._next_seq += 1
                        self.unanswered[seq] = tag
                        return seq
            if time.monotonic() >= deadline:
                raise TransferError(f"KV receiver took no message for {SEND_TIMEOUT_S:g} s")

    def wait(self, until: Callable[[], bool], timeout: float) -> None:
        """Take answers until `until()` holds; TransferError on a failure answer, after `timeout`, or
        once the client is closed."""
        deadline = time.monotonic() + timeout
        while not until():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(f"KV receiver did not answer {len(self.unanswered)} messages within {timeout:g} s")
            with self._lock:
                self._check_open()
                if not self._socket.poll(min(POLL_MS, int(remaining * 1000) + 1)):
                    continue
                seq, status, text = self._socket.recv_multipart()
            (number,) = _SEQ.unpack(seq)
            tag = self.unanswered.pop(number, None)
            if status[0] == CORRUPT:
                self.corrupt += 1
            elif status[0] in (FAILED, REFUSED):
                self.failures.append(text.decode())
                self.taken_whole = self.taken_whole and status[0] == REFUSED
            self.on_answer(tag)
        if self.failures:
            raise TransferError(f"KV receiver refused a message: {self.failures[0]}")

    def _check_open(self) -> None:
        if self.closed:
            raise TransferError("the KV channel was closed")

    @property
    def in_step(self) -> bool:
        """Open, every message answered, none refused: another channel may take it over."""
        return not self.closed and not self.unanswered and not self.failures

    def close(self) -> None:
        self.closed = True  # an owner's wait stops at its next poll and lets go of the lock
        with self._lock:
            self._socket.close()


class ClientPool:
    """A sending half's control clients, each given back to the next channel to its receiver (`IdlePool`)
    when it is in step: a new one's CURVE handshake comes before its first answer, 1.3 to 1.9 ms on a
    2-vCPU host, on every transfer's path to its first token."""

    def __init__(self, secret: ClusterSecret | None) -> None:
        self.secret = secret
        self._idle: IdlePool[ControlClient] = IdlePool()
        self.made = 0

    def take(self, address: str, on_answer: Callable[[Any], None]) -> ControlClient:
        client = self._idle.take(address)
        if client is None:
            self.made += 1
            return ControlClient(address, on_answer, self.secret)
        client.on_answer, client.corrupt = on_answer, 0  # in step: nothing else of its last channel's is left
        return client

    def give_back(self, address: str, client: ControlClient) -> None:
        """Keep `client` for the next channel to `address` if it is in step; else close it."""
        if not client.in_step:
            client.close()
            return
        client.on_answer = _ignore  # its channel is done with: not kept alive by an idle socket
        self._idle.give_back(address, client)

    def forget(self, address: str) -> None:
        self._idle.forget(address)

    def close(self) -> None:
        self._idle.close()


def _ignore(tag: Any) -> None:
    pass


def notify(address: str, kind: bytes, parts: list[bytes], secret: ClusterSecret | None = None) -> None:
    """A last message to a receiving half (release, leave) on a socket of its own; best effort: it is
    not answered, and it goes nowhere if the peer is gone (the socket lingers LINGER_MS, no longer) or
    no socket can be made (out of descriptors: logged), so what its caller lets go of here goes all
    the same (the receiver's own sweep, or its peer's leaving, covers its side)."""
    try:
        client = ControlClient(address, secret=secret)
    except zmq.ZMQError as e:
        log.warning("KV control: no socket for a %r notice to %s: %s", kind, address, e)
        return
    try:
        client.send(kind, parts)
    except TransferError:
        pass
    finally:
        client.close()
