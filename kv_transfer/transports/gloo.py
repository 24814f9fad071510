"""torch.distributed point-to-point between a prefill and a decode worker, with pyzmq control.

In the manner of vLLM's P2P-NCCL connector: a two-rank process group per worker pair, created lazily
on the pair's first transfer and torn down when the peer leaves (`forget`) or fails. The sending half
(rank 0) hosts the group's TCPStore and asks the receiving half (rank 1) to join over the control
channel; both construct the group at once and meet in the store. Each frame is then a control message
(header, group, tag) followed by a tagged `send` of its bytes; the receiving half posts the matching
`recv` into a buffer and hands it to the sink. A pair whose transfer fails (peer gone, a refused
frame) drops its group and forms a new one on its next transfer. The group is gloo, on CPU tensors;
NCCL for GPU-resident KV is not built yet (it needs a GPU session: issue 14).
"""

from __future__ import annotations

import datetime
import logging
import struct
import threading
import uuid
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
import zmq

from pdserve.kv_transfer.interface import FrameHeader, FrameSink, Payload, TransferError
from pdserve.kv_transfer.transports.control import ControlClient, ControlServer, notify

if TYPE_CHECKING:
    from pdserve.wire import ClusterSecret

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 30  # a header asking for more is not believed
GROUP_TIMEOUT_S = 30.0  # joining a group, and any one send or receive
JOIN, FRAME, LEAVE = b"J", b"F", b"L"
_PARTS = {JOIN: 2, LEAVE: 1, FRAME: 3}  # each kind's parts after (kind, sequence number)
_TAG = struct.Struct("<I")


def _text(frame: zmq.Frame) -> str:
    try:
        return frame.bytes.decode("ascii")
    except UnicodeDecodeError:
        raise TransferError(f"gloo control message: {frame.bytes[:40]!r} is not ASCII") from None


def _gloo_group(store: dist.Store, rank: int, host: str) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    return dist.ProcessGroupGloo(store, rank, 2, options)


class _Group:
    """The sending side of one pair's process group."""

    def __init__(self, address: str, host: str, secret: ClusterSecret | None) -> None:
        self.id = uuid.uuid4().hex
        self.store = dist.TCPStore(host, 0, world_size=2, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        join = ControlClient(address, secret=secret)
        try:
            join.send(JOIN, [self.id.encode(), f"{host}:{self.store.port}".encode()])
            self.pg = _gloo_group(dist.PrefixStore(self.id, self.store), 0, host)
            join.wait(lambda: not join.unanswered, GROUP_TIMEOUT_S)
        finally:
            join.close()
        self._next_tag = 0
        self._lock = threading.Lock()

    def tag(self) -> int:
        with self._lock:
            self._next_tag = (self._next_tag + 1) % (1 << 31)
            return self._next_tag


class GlooChannel:
    def __init__(self, sender: GlooSender, group: _Group, address: str, transfer_id: str) -> None:
        self.sender = sender
        self.group = group
        self.address = address
        self.transfer_id = transfer_id
        self.bytes_sent = 0
        self.control = ControlClient(address, secret=sender.secret)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []  # sends in flight, with their buffers

    def send(self, header: FrameHeader, payload: Payload) -> None:
        data = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
        tensor = torch.from_numpy(data if data.flags.writeable else data.copy())  # held until the send completes
        tag = self.group.tag()
        self.control.send(FRAME, [header.pack(), self.group.id.encode(), _TAG.pack(tag)])
        self._pending.append((self.group.pg.send([tensor], 1, tag), tensor))
        self.bytes_sent += tensor.numel()

    def finish(self, timeout: float) -> None:
        """The receiver's answers first: a frame it refused has no matching receive, so its send
        would never complete; then the sends, which every accepted frame has completed."""
        try:
            self.control.wait(lambda: not self.control.unanswered, timeout)
            for work, _ in self._pending:
                work.wait(datetime.timedelta(seconds=timeout))
        except (RuntimeError, TransferError) as e:
            # Sends without receives (or a broken pair) leave the group unusable: the next transfer
            # to this peer forms a new one.
            self.sender.drop_group(self.address, self.group)
            raise TransferError(f"gloo transfer to {self.address} failed: {e}") from e
        finally:
            self._pending.clear()

    def close(self) -> None:
        if self._pending:  # not finished: sends may be left without receives
            self.sender.drop_group(self.address, self.group)
        self._pending.clear()
        self.control.close()


class GlooSender:
    name = "gloo"

    def __init__(self, host: str = "127.0.0.1", secret: ClusterSecret | None = None) -> None:
        self.host = host  # where this side's store listens and its gloo device binds
        self.secret = secret  # authenticates the control channel (the gloo group itself cannot be)
        self._groups: dict[str, _Group] = {}
        self._lock = threading.Lock()

    def open(self, address: str, transfer_id: str) -> GlooChannel:
        with self._lock:
            group = self._groups.get(address)
            if group is None:
                try:
                    group = self._groups[address] = _Group(address, self.host, self.secret)
                except (RuntimeError, TransferError) as e:
                    raise TransferError(f"cannot form a gloo group with {address}: {e}") from e
        return GlooChannel(self, group, address, transfer_id)

    def drop_group(self, address: str, group: _Group) -> None:
        """Tear down a pair's group (if it is still the current one) and tell the peer."""
        with self._lock:
            if self._groups.get(address) is not group:
                return
            del self._groups[address]
        notify(address, LEAVE, [group.id.encode()], self.secret)

    def forget(self, address: str) -> None:
        group = self._groups.get(address)
        if group is not None:
            self.drop_group(address, group)

    def close(self) -> None:
        for address in list(self._groups):
            self.forget(address)


class GlooReceiver:
    name = "gloo"

    def __init__(self, sink: FrameSink, host: str = "127.0.0.1", secret: ClusterSecret | None = None) -> None:
        self.sink = sink
        self.host = host
        self._groups: dict[str, dist.ProcessGroupGloo] = {}  # only the control thread touches it
        self._server = ControlServer("gloo", host, self._handle, secret)
        self.address = self._server.address

    def _handle(self, kind: bytes, parts: list[zmq.Frame]) -> None:
        # The shape first: a malformed message is refused as such, not by an accident of parsing.
        if len(parts) != _PARTS.get(kind, -1) or (kind == FRAME and len(parts[2].bytes) != _TAG.size):
            raise TransferError(f"malformed gloo control message: kind {kind[:8]!r} with {len(parts)} parts")
        if kind == JOIN:
            group_id, store_address = _text(parts[0]), _text(parts[1])
            store_host, _, port = store_address.rpartition(":")
            peer = parts[0].get("Peer-Address")  # where the JOIN came from, as the socket saw it
            if store_host != peer:  # never dial an address a message names on someone else's behalf
                raise TransferError(f"gloo JOIN from {peer} names a store on {store_host[:80]!r}")
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise TransferError(f"gloo JOIN names no valid store port: {port[:20]!r}")
            store = dist.TCPStore(store_host, int(port), world_size=2, is_master=False,
                                  timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
            self._groups[group_id] = _gloo_group(dist.PrefixStore(group_id, store), 1, self.host)
        elif kind == LEAVE:
            self._groups.pop(_text(parts[0]), None)
        else:  # FRAME
            header = FrameHeader.unpack(parts[0].buffer)
            group_id = _text(parts[1])
            group = self._groups.get(group_id)
            if group is None:
                raise TransferError(f"no gloo group {group_id[:40]!r} (never joined, or torn down)")
            (tag,) = _TAG.unpack(parts[2].bytes)
            if header.payload_bytes > MAX_FRAME_BYTES:
                self._groups.pop(group_id, None)  # the stream cannot be resynchronised
                raise TransferError(f"frame of {header.payload_bytes} bytes announced (at most {MAX_FRAME_BYTES})")
            buffer = torch.empty(header.payload_bytes, dtype=torch.uint8)
            try:
                group.recv([buffer], 0, tag).wait()
            except RuntimeError as e:  # the peer is gone or stalled: this group is done
                self._groups.pop(group_id, None)
                raise TransferError(f"gloo receive failed, group torn down: {e}") from e
            self.sink(header, memoryview(buffer.numpy()))

    def stop(self) -> None:
        self._server.stop()
        self._groups.clear()
