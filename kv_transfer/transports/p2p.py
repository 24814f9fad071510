"""torch.distributed point-to-point between a prefill and a decode worker (gloo or NCCL), with pyzmq control.

In the manner of vLLM's P2P-NCCL connector: a two-rank process group per worker pair, created lazily
on the pair's first transfer and torn down when the peer leaves or fails. The sending half drops a
decode worker's group when the cluster forgets its address (`forget`); the receiving half drops a
group within SWEEP_S of its sender's death (its connection to the group's store, which lives in the
sender as long as its side of the group, breaks; each check runs on the group's lane, as a frozen
sender's store never answers), so a prefill worker that died holds no group (for NCCL: no
communicator on the GPU) in the decode workers it sent to.

The sending half (rank 0) hosts the group's TCPStore and asks the receiving half (rank 1) to join
over the control channel; both construct the group at once and meet in the store. Each frame is then
a control message (header, group, tag) followed by a tagged `send` of its bytes; the receiving half
posts the matching `recv` into a buffer and hands it to the sink. It forms each group and receives
its frames on the group's own lane (a thread per sending peer: `control.Deferred`), so a sender that
stalls mid-frame (frozen) holds up its own frames only, not other prefill workers'. With NCCL each
group also has a CUDA stream of its own, which its receives, checksums and writes into the cache
queue on, synchronized before the frame is answered: on the device's default stream, one stuck
receive would hold up every other group's work there (not yet tested on two GPUs). A pair whose
sends and receives may have fallen out of step (a frame unanswered, or refused before its receive;
a send that failed; the peer gone) drops its group and forms a new one on its next transfer. A frame
received whole and then refused by the sink (its transfer aborted there: a cancel, a request done at
its first token) fails only its own transfer: the group stays, in step, for the pair's other
transfers. gloo matches each send to its receive by tag, not by order, so a gloo channel that ends
with frames unanswered (closed early, or its answers late) leaves the group to the others too: its
sends complete as the receiver takes the frames it was told of, and the sender waits for them on a
thread (`P2PSender.settle`), dropping the group only if one fails or is still pending after
GROUP_TIMEOUT_S.

A host channel's sends are asynchronous: it keeps at most WINDOW_BYTES of frames unanswered (`send`
waits for answers past that), so the sender keeps pace with the receiver, and it lets go of each
answered send's buffer as it goes rather than at its end.

Where the bytes live is the `device`: None (gloo's default) moves host bytes and hands the sink a
memoryview; a device (a CUDA device for NCCL) moves tensors there, so KV read out of a GPU cache goes
GPU to GPU without touching host memory, and the sink gets the received tensor. The sender checksums
what travels (`codecs.frame_checksum`: a device payload's checksum is computed on the device).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import zmq

from pdserve.diagnostics import shown
from pdserve.kv_transfer.interface import MAX_FRAME_BYTES, FrameHeader, FrameSink, Payload, TransferError
from pdserve.kv_transfer.side_streams import GROUP_PRIORITY
from pdserve.kv_transfer.transports.control import (ClientPool, ControlClient, ControlServer, Deferred, deliver,
                                                     frame_header, notify)
from pdserve.threads import start_guarded

if TYPE_CHECKING:
    from pdserve.wire import ClusterSecret

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 30.0  # joining a group, and any one send or receive
WINDOW_BYTES = 64 << 20  # a host channel's frames sent and not yet answered, at most (a frame more)
CONNECT_MARGIN_S = 5.0  # on top of it, for an NCCL group's first operation (`_connect`)
JOIN_REFUSAL_S = 0.2  # how long a JOIN's refusal is waited for before this side forms its half
REFUSAL_LOOK_S = 0.05  # after a group failed to form: a refusal already answered is read in this
SETTLE_STOP_S = 2.0  # how long closing a sender waits for its threads settling left-over sends
JOIN, FRAME, LEAVE = b"J", b"F", b"L"
_PARTS = {JOIN: 2, LEAVE: 1, FRAME: 3}  # each kind's parts after (kind, sequence number)
_TAG = struct.Struct("<I")


def _text(frame: zmq.Frame) -> str:
    try:
        return frame.bytes.decode("ascii")
    except UnicodeDecodeError:
        raise TransferError(f"p2p control message: {frame.bytes[:40]!r} is not ASCII") from None


def _on(stream: torch.cuda.Stream | None) -> AbstractContextManager:
    """Make `stream` current; None changes nothing (and, unlike `torch.cuda.stream(None)`, never
    touches CUDA: a gloo receiver in a process with a GPU must not make a CUDA context per frame)."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=GROUP_TIMEOUT_S)


def _process_group(backend: str, store: dist.Store, rank: int, host: str) -> dist.Backend:
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = _timeout()
        return dist.ProcessGroupGloo(store, rank, 2, options)
    # A timed-out NCCL operation must end this pair's group, not the worker: the default (3) tears
    # the whole process down. Nor is it worth torch's debug dump (its flight recorder), whose
    # handling on timeout may also end the process: a pair's timeout is an ordinary peer failure
    # here. Both read when the group is made.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = _timeout()
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def _connect(pg: dist.Backend, device: torch.device, rank: int, stream: torch.cuda.Stream | None) -> None:
    """The pair's first operation (rank 0 sends a byte, rank 1 receives it), which sets NCCL's
    communicator up. In torch's default (blocking) mode that setup waits for the peer's half with no
    bound of its own: a peer that refused the JOIN late, or died while joining, would hold this thread
    (and, on the sending side, the peer's `forming` lock, so every later open to it) forever. So it
    runs on a thread of its own, waited for GROUP_TIMEOUT_S + CONNECT_MARGIN_S; past that the group
    is given up (TransferError) and the thread left behind, its outcome logged if it ever comes."""
    def first_operation() -> None:
        with _on(stream):
            byte = torch.zeros(1, dtype=torch.uint8, device=device)
            (pg.send([byte], 1, 0) if rank == 0 else pg.recv([byte], 0, 0)).wait(_timeout())

    connected: Future = Future()

    def run() -> None:
        try:
            first_operation()
        except BaseException as e:  # noqa: BLE001 (raised in the waiting thread, or logged below)
            connected.set_exception(e)
        else:
            connected.set_result(None)

    threading.Thread(target=run, name="kv-nccl-connect", daemon=True).start()
    try:
        connected.result(GROUP_TIMEOUT_S + CONNECT_MARGIN_S)
    except TimeoutError:
        connected.add_done_callback(lambda late: log.warning("a p2p group given up on connected after all: %s",
                                                             late.exception() or "no error"))
        raise TransferError(f"the p2p group's communicator did not connect within "
                            f"{GROUP_TIMEOUT_S + CONNECT_MARGIN_S:g} s: its peer never joined") from None


def _listening_store(host: str) -> dist.TCPStore:
    """The group's rendezvous store, listening on `host` only (the worker's configured address): a
    TCPStore binds every interface when it makes its own socket, so it is handed one bound here. Its
    keys live under the group's id, which only the JOIN (over the CURVE control channel) carries."""
    listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store owns the descriptor from here on
    try:
        return dist.TCPStore(host, port, world_size=2, is_master=True, wait_for_workers=False, timeout=_timeout(),
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _abort_quietly(pg: dist.Backend, what: str) -> None:
    try:
        pg.abort()
    except Exception as e:  # it had failed already, or this torch has no abort: the last reference going frees it
        log.warning("KV p2p: aborting %s failed: %s", what, e)


def check_backend(backend: str, device: torch.device | None) -> None:
    """Raise ValueError naming what is missing for `backend` with payloads on `device`."""
    if backend == "gloo":
        if device is not None and device.type != "cpu":
            raise ValueError(f"gloo moves host memory, not {device}")
    elif backend == "nccl":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ValueError("KV transport 'nccl' needs a CUDA GPU and a torch built with NCCL "
                             f"(cuda available: {torch.cuda.is_available()}, nccl: {dist.is_nccl_available()})")
        if device is None or device.type != "cuda":
            raise ValueError(f"NCCL moves CUDA memory, not {device or 'host bytes'}")
    else:
        raise ValueError(f"unknown torch.distributed backend {backend!r}")


class _Group:
    """The sending side of one pair's process group."""

    def __init__(self, backend: str, address: str, host: str, secret: ClusterSecret | None,
                 device: torch.device | None) -> None:
        self.id = uuid.uuid4().hex
        self.store = _listening_store(host)
        join = ControlClient(address, secret=secret)
        try:
            join.send(JOIN, [self.id.encode(), f"{host}:{self.store.port}".encode()])
            # A refusal (a store address the receiver will not dial, say) is answered at once; an
            # accepted JOIN only once the group has formed, which needs this half too. Without this
            # look, a refused JOIN cost GROUP_TIMEOUT_S.
            _raise_refusal(join, JOIN_REFUSAL_S)
            self.pg = _process_group(backend, dist.PrefixStore(self.id, self.store), 0, host)
            self.device = device
            if device is not None:  # NCCL sets its communicator up on the first send: here, not in a transfer
                # On a stream of the groups' pool: a peer dying before its receive leaves no wait on the
                # engine's stream, nor on a stream NCCL or a transfer thread is handed later.
                _connect(self.pg, device, 0,
                         torch.cuda.Stream(device, priority=GROUP_PRIORITY) if device.type == "cuda" else None)
            join.wait(lambda: not join.unanswered, GROUP_TIMEOUT_S)
        except BaseException as e:
            if device is not None and hasattr(self, "pg"):  # NCCL's communicator goes now, not with the object
                _abort_quietly(self.pg, f"the group being formed with {address}")
            refusal = None
            if not join.failures:  # the group did not form: a refusal that came late says why
                try:
                    _raise_refusal(join, REFUSAL_LOOK_S)
                except TransferError as refused:
                    refusal = refused
            # The peer may have formed its side: told on the JOIN's own socket, so after the JOIN.
            try:
                join.send(LEAVE, [self.id.encode()])
            except TransferError:
                pass  # closed or gone: nothing to tell
            if refusal is not None:
                raise refusal from e
            raise
        finally:
            join.close()
        self._next_tag = 0
        self._lock = threading.Lock()
        self.in_order = threading.Lock()  # held from a frame's control message until its answer (NCCL)

    def tag(self) -> int:
        with self._lock:
            self._next_tag = (self._next_tag + 1) % (1 << 31)
            return self._next_tag


def _raise_refusal(join: ControlClient, wait_s: float) -> None:
    """Raise the JOIN's refusal (TransferError) if it comes within `wait_s`; else nothing."""
    try:
        join.wait(lambda: not join.unanswered, wait_s)
    except TransferError:
        if join.failures:
            raise


class P2PChannel:
    def __init__(self, sender: P2PSender, group: _Group, address: str, transfer_id: str) -> None:
        self.sender = sender
        self.group = group
        self.address = address
        self.transfer_id = transfer_id
        self.device = sender.device  # where payloads must be (`LayerChannel.device`)
        self.bytes_sent = 0
        self.control = sender.clients.take(address, on_answer=lambda tag: None)
        self._pending: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # sends in flight, with their buffers
        self._pending_lock = threading.Lock()  # sends post from the sending thread; close comes from any
        self._lock = threading.Lock()  # the owner's send and finish
        self._closing = threading.Lock()  # two closes at once: one acts
        self._closed = False

    def send(self, header: FrameHeader, payload: Payload | torch.Tensor) -> None:
        tensor = self._as_tensor(payload)  # held until the send completes
        with self._lock:
            self._check_open()
            self._send(header, tensor)

    def _send(self, header: FrameHeader, tensor: torch.Tensor) -> None:
        if self.device is None:
            self._post(header, tensor)
            self._keep_within_window()
            return
        # NCCL matches sends to receives in the order they are issued, whatever their tags, and the
        # receiving half posts receives in the order control messages reach it, over one socket per
        # channel. So a device frame goes out only after the pair's previous frame was answered (its
        # receive done): frames of concurrent transfers to one peer cannot cross.
        # Once answered, its receive is done: the send is waited for here and nothing stays pending (no
        # second copy of the prompt's KV held on the GPU; a channel closed early leaves the group whole).
        with self.group.in_order:
            seq = self._post(header, tensor)
            self._settle(lambda: seq not in self.control.unanswered, GROUP_TIMEOUT_S)

    def _as_tensor(self, payload: Payload | torch.Tensor) -> torch.Tensor:
        """The payload as the group sends it. Tensors only on a device channel: a tensor's checksum
        is the tensor kind, which a host-bytes receiver would not match."""
        is_tensor = isinstance(payload, torch.Tensor)
        if self.device is not None:
            if is_tensor and payload.device == self.device and payload.dtype == torch.uint8:
                return payload
            got = f"{payload.dtype} on {payload.device}" if is_tensor else type(payload).__name__
            raise TransferError(f"p2p channel takes uint8 tensors on {self.device}, got {got}")
        if is_tensor:
            raise TransferError("p2p channel for host bytes got a tensor payload")
        data = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
        return torch.from_numpy(data if data.flags.writeable else data.copy())

    def _post(self, header: FrameHeader, tensor: torch.Tensor) -> int:
        tag = self.group.tag()
        seq = self.control.send(FRAME, [header.pack(), self.group.id.encode(), _TAG.pack(tag)], tag=tensor.numel())
        try:
            work = self.group.pg.send([tensor], 1, tag)
            with self._pending_lock:
                self._pending[seq] = (work, tensor)
        except RuntimeError as e:  # announced but not sent: the receiver waits for it, the group is done
            self.sender.drop_group(self.address, self.group)
            raise TransferError(f"p2p send to {self.address} failed: {e}") from e
        self.bytes_sent += tensor.numel()
        return seq

    def _keep_within_window(self) -> None:
        """Host sends go out asynchronously: past WINDOW_BYTES unanswered, wait for answers (the sender
        keeps pace with the receiver, so a slow link leaves `finish` a window, not the prompt), and let
        go of the sends answered, each received whole so complete (their buffers need not wait for the
        channel's end). Not after a frame was refused unreceived: `_settle` sorts those out."""
        def unanswered_bytes() -> int:
            return sum(self.control.unanswered.values())

        if unanswered_bytes() > WINDOW_BYTES:
            self.control.wait(lambda: unanswered_bytes() <= WINDOW_BYTES, GROUP_TIMEOUT_S)
        if not self.control.taken_whole:
            return
        with self._pending_lock:
            answered = [seq for seq in self._pending if seq not in self.control.unanswered]
            done = [self._pending.pop(seq) for seq in answered]
        try:
            for work, _ in done:
                work.wait(_timeout())
        except RuntimeError as e:
            self.sender.drop_group(self.address, self.group)
            raise TransferError(f"p2p transfer to {self.address} failed: {e}") from e

    def finish(self, timeout: float) -> None:
        if not self._lock.acquire(timeout=timeout):  # a send waits on its window: the receiver is slow or stuck
            raise TransferError(f"transfer {self.transfer_id}: frames still being sent after {timeout:g} s")
        try:
            self._check_open()
            self._settle(lambda: not self.control.unanswered, timeout)
        finally:
            self._lock.release()

    def _check_open(self) -> None:
        if self._closed:  # its control client may be another channel's by now
            raise TransferError(f"transfer {self.transfer_id}: the channel is closed")

    def _settle(self, answered: Callable[[], bool], timeout: float) -> None:
        """Take the receiver's answers until `answered()`, then wait for the pending sends. A frame
        refused before its receive was posted has a send that never completes: unless every answer
        came and every frame was taken whole (received, if refused then), the pending sends are let
        go (`_leave_pending`: gloo's waited for, NCCL's group dropped). A refusal is raised after the
        sends completed."""
        refusal = None
        try:
            self.control.wait(answered, timeout)
        except TransferError as e:
            if not (answered() and self.control.taken_whole):
                self._leave_pending()
                raise TransferError(f"p2p transfer to {self.address} failed: {e}") from e
            refusal = e  # every frame had its receive: the sends complete, the group stays in step
        with self._pending_lock:
            pending, self._pending = list(self._pending.values()), {}
        try:
            for work, _ in pending:
                work.wait(datetime.timedelta(seconds=timeout))  # with a timeout, NCCL's wait blocks too
        except RuntimeError as e:
            self.sender.drop_group(self.address, self.group)
            raise TransferError(f"p2p transfer to {self.address} failed: {e}") from e
        if refusal is not None:
            raise refusal

    def _leave_pending(self) -> None:
        """Let go of sends whose frames may never be received (unanswered, or refused before their
        receive). gloo matches sends by tag, so while every answer so far says the frame was taken
        whole, the group is in step for the pair's other transfers: the sender waits for these sends.
        Otherwise (NCCL matches in issue order; a frame refused unreceived) the group is dropped."""
        with self._pending_lock:
            pending, self._pending = list(self._pending.values()), {}
        if not pending:
            return
        if self.device is None and self.control.taken_whole:
            self.sender.settle(self.address, self.group, pending)
        else:
            self.sender.drop_group(self.address, self.group)

    def close(self) -> None:
        """A channel whose frames were all answered gives its control client back for the next; with
        a send or finish under way, the client closes, which ends that one's wait within one poll."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        owner_idle = self._lock.acquire(blocking=False)
        try:
            self._leave_pending()  # not finished: sends may be left without receives
            if owner_idle:
                self.sender.clients.give_back(self.address, self.control)
            else:
                self.control.close()
        finally:
            if owner_idle:
                self._lock.release()


class P2PSender:
    """The sending half. `backend`: gloo or nccl; `device`: where payloads travel from (None: host
    bytes; NCCL needs a CUDA device)."""

    def __init__(self, backend: str = "gloo", host: str = "127.0.0.1", secret: ClusterSecret | None = None,
                 device: torch.device | None = None) -> None:
        check_backend(backend, device)
        self.name = self.backend = backend
        self.host = host  # where this side's store listens and its gloo device binds
        self.secret = secret  # authenticates the control channel (the process group itself cannot be)
        self.clients = ClientPool(secret)
        self.device = device
        self._groups: dict[str, _Group] = {}
        self._forming: dict[str, threading.Lock] = {}  # per peer: one group formation at a time
        self._settling: list[threading.Thread] = []  # `settle`'s threads
        self._lock = threading.Lock()

    def open(self, address: str, transfer_id: str) -> P2PChannel:
        with self._lock:
            forming = self._forming.setdefault(address, threading.Lock())
        # Per peer, not under `_lock`: forming a group waits up to GROUP_TIMEOUT_S on a peer that does
        # not answer, and opens to other peers must not wait behind it.
        with forming:
            with self._lock:
                group = self._groups.get(address)
            if group is None:
                try:
                    group = _Group(self.backend, address, self.host, self.secret, self.device)
                except (RuntimeError, TransferError) as e:
                    raise TransferError(f"cannot form a {self.backend} group with {address}: {e}") from e
                with self._lock:
                    self._groups[address] = group
        return P2PChannel(self, group, address, transfer_id)

    def settle(self, address: str, group: _Group, pending: list[tuple[dist.Work, torch.Tensor]]) -> None:
        """Wait, on a thread of their own, for the sends of a gloo channel that ended with frames
        unanswered: they complete as the receiver takes the frames it was told of. One that fails,
        or is still pending after GROUP_TIMEOUT_S, drops the group. (A gloo send cannot be polled: its
        `is_completed` changes only in `wait`, and a wait that times out breaks the pair.)"""
        def wait_for_sends() -> None:
            try:
                for work, _ in pending:
                    work.wait(_timeout())
            except RuntimeError as e:
                log.warning("KV %s sender: a send to %s left by an ended transfer failed (%s); group torn down",
                            self.backend, address, (str(e).splitlines() or ["no reason given"])[0][:200])
                self.drop_group(address, group)

        thread = start_guarded(f"kv-{self.backend}-settle", wait_for_sends,
                               lambda error: self.drop_group(address, group))
        with self._lock:
            self._settling = [t for t in self._settling if t.is_alive()] + [thread]

    def drop_group(self, address: str, group: _Group) -> None:
        """Tear down a pair's group (if it is still the current one) and tell the peer."""
        with self._lock:
            if self._groups.get(address) is not group:
                return
            del self._groups[address]
        notify(address, LEAVE, [group.id.encode()], self.secret)
        if group.device is not None:  # NCCL's communicator, its GPU memory and proxy thread go now, as the receiver's
            _abort_quietly(group.pg, f"the group to {address}")

    def forget(self, address: str) -> None:
        with self._lock:
            group = self._groups.get(address)
            self._forming.pop(address, None)
        if group is not None:
            self.drop_group(address, group)
        self.clients.forget(address)

    def close(self) -> None:
        """Drop every group, after waiting up to SETTLE_STOP_S for the sends being settled (a process
        exiting under a gloo wait can abort in C++; one still waiting then ends with its group)."""
        deadline = time.monotonic() + SETTLE_STOP_S
        for thread in list(self._settling):
            thread.join(max(0.0, deadline - time.monotonic()))
        for address in list(self._groups):
            self.forget(address)
        self.clients.close()


class _Joined(NamedTuple):
    """The receiving side of one pair's process group."""

    pg: dist.Backend
    store: dist.TCPStore  # a client of the sender's store: it answers while the sender's side lives
    # NCCL: the group's own, so a stuck receive holds up no other group (from torch's pool of 32 per
    # device at GROUP_PRIORITY, handed out in turn: past 32 groups share one; NCCL's own streams never
    # do, nor receiving threads' side streams on GPUs with three stream priorities or more)
    stream: torch.cuda.Stream | None


class P2PReceiver:
    """The receiving half: hands the sink a memoryview of host bytes, or (with a `device`) the
    received tensor on it. `on_crash` is told if its control loop dies."""

    def __init__(self, sink: FrameSink, backend: str = "gloo", host: str = "127.0.0.1",
                 secret: ClusterSecret | None = None, device: torch.device | None = None,
                 on_crash: Callable[[BaseException], None] = lambda error: None) -> None:
        check_backend(backend, device)
        self.sink = sink
        self.name = self.backend = backend
        self.host = host
        self.device = device
        self._groups: dict[str, _Joined] = {}
        self._checking: set[str] = set()  # groups whose sender's liveness check is queued or running
        self._stopped = False
        self._lock = threading.Lock()  # the above: the control thread and the groups' lanes use them
        self._server = ControlServer(backend, host, self._handle, secret, sweep=self._drop_orphans,
                                     on_crash=on_crash)
        self.address = self._server.address

    def _handle(self, kind: bytes, parts: list[zmq.Frame]) -> Deferred:
        """Check a message on the control thread; what waits on the sender (forming its group, a
        frame's receive) runs on the group's lane, so a stalled sender holds up no other."""
        # The shape first: a malformed message is refused as such, not by an accident of parsing.
        if len(parts) != _PARTS.get(kind, -1) or (kind == FRAME and len(parts[2].bytes) != _TAG.size):
            raise TransferError(f"malformed p2p control message: kind {kind[:8]!r} with {len(parts)} parts")
        group_id = _text(parts[1] if kind == FRAME else parts[0])
        if kind == JOIN:
            store_host, _, port = _text(parts[1]).rpartition(":")
            peer = parts[0].get("Peer-Address")  # where the JOIN came from, as the socket saw it
            if store_host != peer:  # never dial an address a message names on someone else's behalf
                raise TransferError(f"p2p JOIN from {peer} names a store on {store_host[:80]!r}")
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise TransferError(f"p2p JOIN names no valid store port: {port[:20]!r}")
            return Deferred(group_id, lambda: self._join(group_id, store_host, int(port)))
        if kind == LEAVE:  # on the lane: after the group's JOIN, even one answered too late
            return Deferred(group_id, lambda: self._leave(group_id))
        header = frame_header(parts[0].buffer)
        (tag,) = _TAG.unpack(parts[2].bytes)
        with self._lock:
            joined = self._groups.get(group_id)
        if joined is None:
            raise TransferError(f"no p2p group {group_id[:40]!r} (never joined, or torn down)")
        try:  # before its receive allocates the payload's buffer
            if header.payload_bytes > MAX_FRAME_BYTES:
                raise TransferError(f"frame of {header.payload_bytes} bytes announced (at most {MAX_FRAME_BYTES})")
            self.sink.admit_frame(header)
        except TransferError:
            self._server.run_on_lane(group_id, lambda: self._leave(group_id))  # its sends cannot be matched any more
            raise
        return Deferred(group_id, lambda: self._receive(group_id, joined, header, tag))

    def _join(self, group_id: str, store_host: str, port: int) -> None:
        store = dist.TCPStore(store_host, port, world_size=2, is_master=False, timeout=_timeout())
        group = _process_group(self.backend, dist.PrefixStore(group_id, store), 1, self.host)
        stream = torch.cuda.Stream(self.device, priority=GROUP_PRIORITY) \
            if self.device is not None and self.device.type == "cuda" else None
        joined = _Joined(group, store, stream)
        if self.device is not None:  # the sender's first send, which sets NCCL's communicator up
            try:
                _connect(group, self.device, 1, stream)
            except RuntimeError as e:
                self._abort(group_id, joined)
                raise TransferError(f"p2p group {group_id[:40]!r} did not form: {e}") from e
        with self._lock:
            if not self._stopped:
                self._groups[group_id] = joined
                return
        self._abort(group_id, joined)  # formed as the receiver stopped: nothing would ever drop it

    def _receive(self, group_id: str, joined: _Joined, header: FrameHeader, tag: int) -> None:
        with self._lock:
            if self._groups.get(group_id) is not joined:  # torn down while the frame waited on the lane
                raise TransferError(f"p2p group {group_id[:40]!r} was torn down")
        with _on(joined.stream):
            buffer = torch.empty(header.payload_bytes, dtype=torch.uint8, device=self.device)
            try:
                joined.pg.recv([buffer], 0, tag).wait(_timeout())  # with a timeout, NCCL's wait blocks too
            except RuntimeError as e:  # the peer is gone or stalled: this group is done
                self._tear_down(group_id, joined)  # NCCL: its stuck receive ends with the communicator
                raise TransferError(f"p2p receive failed, group torn down: {e}") from e
            try:
                deliver(self.sink, header, memoryview(buffer.numpy()) if self.device is None else buffer)
            finally:
                if joined.stream is not None:  # the frame is in the cache before its answer (and the commit)
                    joined.stream.synchronize()

    def _leave(self, group_id: str) -> None:
        """End a group its sender left (or that can no longer be in step): NCCL's communicator, its GPU
        memory and proxy thread go now, not whenever the last reference does."""
        with self._lock:
            joined = self._groups.pop(group_id, None)
        if joined is not None:
            self._abort(group_id, joined)

    def _drop_orphans(self) -> None:
        """Look for groups whose sender died (it sent no LEAVE): each on its group's lane, since the
        store of a sender that is frozen, or on a host lost without a reset, never answers at all."""
        with self._lock:
            due = [(group_id, joined) for group_id, joined in self._groups.items() if group_id not in self._checking]
            self._checking.update(group_id for group_id, _ in due)
        for group_id, joined in due:
            self._server.run_on_lane(group_id, lambda group_id=group_id, joined=joined: self._check(group_id, joined))

    def _check(self, group_id: str, joined: _Joined) -> None:
        try:
            joined.store.check([group_id])
        except RuntimeError as e:  # DistNetworkError: its connection is closed
            log.info("KV %s receiver: the sender of group %s is gone (%s); group torn down",
                     self.backend, shown(group_id), (str(e).splitlines() or ["no reason given"])[0][:200])
            self._tear_down(group_id, joined)
        finally:
            with self._lock:
                self._checking.discard(group_id)

    def _tear_down(self, group_id: str, joined: _Joined) -> None:
        with self._lock:
            self._groups.pop(group_id, None)
        self._abort(group_id, joined)

    def _abort(self, group_id: str, joined: _Joined) -> None:
        """End a group this side dropped: NCCL's communicator goes now, not with the last reference."""
        _abort_quietly(joined.pg, f"{self.backend} group {group_id}")

    def stop(self) -> None:
        with self._lock:  # first: a JOIN finishing from here on aborts its group instead of keeping it
            self._stopped = True
        if not self._server.stop():  # a lane still waits in a group: aborting under it can end the process
            return  # in C++, so the groups go with the process, as shm's mappings do
        with self._lock:
            groups, self._groups = self._groups, {}
        for group_id, joined in groups.items():
            self._abort(group_id, joined)
