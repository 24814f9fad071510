"""Shared memory between processes on one node: frames in a mapped file, control over pyzmq.

The sending half owns segments: files in /dev/shm cut into slots, each mapped by both sides. A frame
is copied once into a free slot and announced on the control channel (`control`) with its slot; the
receiving half hands the sink a view of its own mapping of that slot (no copy), so the sink's write
into the reserved blocks is the only copy on the receiving side. A slot is free again once the
receiver answered its message. Slots are sized to the largest frame the sender expects (a whole
frame of raw KV: `make_sender`'s `frame_bytes`; up to half a segment of 64 MiB), so only a frame
larger than that (a lossy codec's worst case, or frames over 32 MiB) travels inline in the message
instead, as many at a time as a segment has slots.

Nothing leaks when either side dies: the sender unlinks a segment's file as soon as the receiver has
answered a message that used it (both have it mapped by then), so the memory goes away with the last
mapping. The sender holds a lock on the file for the segment's whole life, and the lock dies with
it. A sender killed leaves the receiver's mapping, which the receiver drops within SWEEP_S
(`control`), or sooner when it next maps a segment (a restarted sender's first frame does that),
removing the file too if the sender had not unlinked it yet. A file no receiver mapped (or one left
half made) is removed by the next sender started on the node (`sweep_orphan_segments`). A channel
takes a segment from its transport's pool for the peer and returns it when it closes with nothing
unanswered, so sequential transfers reuse one mapping.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import zmq

from pdserve.kv_transfer.interface import FrameHeader, FrameSink, Payload, TransferError
from pdserve.kv_transfer.transports.control import ClientPool, ControlServer, deliver, frame_header, notify

if TYPE_CHECKING:
    from pdserve.wire import ClusterSecret

SLOT_BYTES = 8 << 20  # when the sender is not told its frames' size
SLOTS = 8  # fewer when slots are large, down to 2: a segment is SEGMENT_BYTES at most
SEGMENT_BYTES = 64 << 20
_SLOT_ALIGN = 64 << 10
SEND_TIMEOUT_S = 30.0  # waiting for a free slot: the receiver is stuck or gone
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
_NAME = re.compile(r"pdserve-kv-[0-9a-f]{32}")
_MAKING = ".making-"  # a segment's name while it is made (locked, then renamed)
MAKING_STALE_S = 60.0  # a file under its making name this long was left by a sender killed making it
_SLOT = struct.Struct("<QQ")  # offset, length
FRAME, INLINE, RELEASE = b"F", b"I", b"R"
_PARTS = {FRAME: 3, INLINE: 2, RELEASE: 1}  # after [kind, seq]: header, segment name, slot / header, payload / name


log = logging.getLogger(__name__)


class _Segment:
    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        self.name = f"pdserve-kv-{uuid.uuid4().hex}"
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.path: Path | None = SHM_DIR / self.name
        self._lock = threading.Lock()  # the owner's answer handler and a close may both unlink
        # Open, and locked, until `close`: the lock dies with this process, which tells the sweep and
        # the receiver that nobody owns the segment any more. Made under a name the sweep ignores and
        # renamed once locked, so no sweep sees it unlocked.
        making = SHM_DIR / f"{_MAKING}{self.name}"
        self._fd = os.open(making, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            # Allocated now, not on first touch: a full /dev/shm is an error here, not a SIGBUS later.
            os.posix_fallocate(self._fd, 0, slots * slot_bytes)
            self.map = mmap.mmap(self._fd, slots * slot_bytes)
            # Frames are copied in through numpy, which lets go of the GIL while it copies (an mmap
            # slice assignment holds it, stalling the prompt pass's Python for the whole copy).
            self.bytes = np.frombuffer(self.map, dtype=np.uint8)
            os.rename(making, self.path)
        except OSError as e:
            making.unlink(missing_ok=True)
            self.path = None
            os.close(self._fd)
            raise TransferError(f"cannot make a {slots * slot_bytes >> 20} MiB shared memory segment in "
                                f"{SHM_DIR}: {e}") from e
        self.free = list(range(slots))

    def unlink(self) -> None:
        """Remove the name (mappings stay valid); once both sides mapped it, nothing can leak."""
        with self._lock:
            if self.path is None:
                return
            self.path.unlink(missing_ok=True)
            self.path = None

    def close(self) -> None:
        self.unlink()
        if not self.map.closed:
            del self.bytes  # the map cannot close while a view of it lives
            self.map.close()
            os.close(self._fd)  # and with it the lock


class ShmChannel:
    device = None  # payloads are host bytes

    def __init__(self, transport: ShmSender, address: str, transfer_id: str) -> None:
        self.transport = transport
        self.address = address
        self.transfer_id = transfer_id
        self.bytes_sent = 0
        self.control = transport.clients.take(address, on_answer=self._answered)
        try:
            self.segment = transport.take_segment(address)
        except BaseException:
            transport.clients.give_back(address, self.control)
            raise
        self._closed = False
        self._announced = False  # a frame named the segment to the receiver (which may have mapped it)
        self._closing = threading.Lock()  # two closes at once (a resend's and a lease expiry's): one acts
        self._lock = threading.Lock()  # the owner's send and finish; a close from another thread cuts in

    def send(self, header: FrameHeader, payload: Payload) -> None:
        view = memoryview(payload).cast("B")
        with self._lock:
            if self._closed:
                raise TransferError(f"transfer {self.transfer_id}: the channel is closed")
            segment = self.segment
            if view.nbytes > segment.slot_bytes:  # inline: no more in flight than the segment has slots
                self.control.wait(lambda: len(self.control.unanswered) < segment.slots, SEND_TIMEOUT_S)
                self.control.send(INLINE, [header.pack(), bytes(view)])
            else:
                self.control.wait(lambda: bool(segment.free), SEND_TIMEOUT_S)
                slot = segment.free.pop()
                offset = slot * segment.slot_bytes
                try:
                    np.copyto(segment.bytes[offset : offset + view.nbytes], np.frombuffer(view, dtype=np.uint8))
                    self.control.send(FRAME, [header.pack(), segment.name.encode(), _SLOT.pack(offset, view.nbytes)],
                                      tag=slot)
                    self._announced = True
                except BaseException:  # not sent (closed meanwhile): the slot is free again
                    segment.free.append(slot)
                    raise
            self.bytes_sent += view.nbytes

    def _answered(self, slot: int | None) -> None:
        if slot is not None:  # an inline frame had none
            self.segment.free.append(slot)
            self.segment.unlink()  # the receiver has mapped it

    def finish(self, timeout: float) -> None:
        if not self._lock.acquire(timeout=timeout):  # a send waits for a slot: the receiver is stuck
            raise TransferError(f"transfer {self.transfer_id}: frames still being sent after {timeout:g} s")
        try:
            if self._closed:  # its control client may be another channel's by now
                raise TransferError(f"transfer {self.transfer_id}: the channel is closed")
            self.control.wait(lambda: not self.control.unanswered, timeout)
        finally:
            self._lock.release()

    def close(self) -> None:
        """A channel whose messages were all answered gives its control client back for the next;
        a send or finish under way is cut short (its wait stops within one poll)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        if not self._lock.acquire(blocking=False):
            self.control.close()
            self._lock.acquire()
        try:
            # No frame named it: the segment is as it was taken (a fresh one, still named, is mapped by
            # the receiver of the next frame that uses it), so it goes back to the pool.
            if self._announced and (self.control.unanswered or self.segment.path is not None
                                    or not self.control.taken_whole):
                # Unanswered: the receiver may still read it. Never answered, or a frame refused before
                # it was taken (the receiver could not map the segment, whose name the answer unlinked):
                # it may not have mapped it. Either way: not reused, released on both sides.
                self.transport.release(self.address, self.segment)
            else:
                self.transport.return_segment(self.address, self.segment)
            self.transport.clients.give_back(self.address, self.control)
        finally:
            self._lock.release()


def sweep_orphan_segments(directory: Path = SHM_DIR) -> int:
    """Remove the segment files no living sender holds locked: left by one killed between making a
    segment and its receiver mapping it, or while making it. Returns how many."""
    removed = 0
    for path in [*directory.glob("pdserve-kv-*"), *directory.glob(f"{_MAKING}pdserve-kv-*")]:
        being_made = path.name.startswith(_MAKING)
        if not _NAME.fullmatch(path.name.removeprefix(_MAKING)):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, or not ours to open
            continue
        try:
            # One being made is unlocked for a moment after it is created: judged by its age too.
            if being_made and time.time() - os.fstat(fd).st_mtime < MAKING_STALE_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_nlink:  # not unlinked by its sender meanwhile
                path.unlink()
                removed += 1
        except (BlockingIOError, FileNotFoundError):
            pass  # its sender is alive, or was until it unlinked the file just now
        finally:
            os.close(fd)
    return removed


class ShmSender:
    name = "shm"

    def __init__(self, secret: ClusterSecret | None = None, frame_bytes: int | None = None) -> None:
        """`frame_bytes`: the largest frame expected (its raw KV), which the slots are sized to."""
        if removed := sweep_orphan_segments():
            log.warning("removed %d shared memory segment(s) left in %s by a KV sender that died", removed, SHM_DIR)
        self.secret = secret  # proves this side's membership on the control channel
        self.clients = ClientPool(secret)
        if frame_bytes is not None and frame_bytes <= 0:
            raise ValueError(f"frame_bytes must be positive, got {frame_bytes}")
        fitted = SLOT_BYTES if frame_bytes is None else -(-frame_bytes // _SLOT_ALIGN) * _SLOT_ALIGN
        self.slot_bytes = min(fitted, SEGMENT_BYTES // 2)  # larger frames go inline
        self.slots = min(SLOTS, SEGMENT_BYTES // self.slot_bytes)
        self._pools: dict[str, list[_Segment]] = {}  # receiver address -> idle segments it has mapped
        self._lock = threading.Lock()
        # Each costs its whole size in zeroed pages; once the pools hold the peak concurrency, none.
        self.segments_made = 0

    def open(self, address: str, transfer_id: str) -> ShmChannel:
        return ShmChannel(self, address, transfer_id)

    def take_segment(self, address: str) -> _Segment:
        with self._lock:
            pool = self._pools.setdefault(address, [])
            if pool:
                return pool.pop()
            self.segments_made += 1
        return _Segment(self.slots, self.slot_bytes)

    def return_segment(self, address: str, segment: _Segment) -> None:
        with self._lock:
            pool = self._pools.get(address)
            if pool is not None:
                pool.append(segment)
                return
        self.release(address, segment)  # the address was forgotten while the channel was open

    def release(self, address: str, segment: _Segment) -> None:
        """Unmap a segment here and tell its receiver to unmap it too."""
        notify(address, RELEASE, [segment.name.encode()], self.secret)
        segment.close()

    def forget(self, address: str) -> None:
        with self._lock:
            segments = self._pools.pop(address, [])
        for segment in segments:
            self.release(address, segment)
        self.clients.forget(address)

    def close(self) -> None:
        for address in list(self._pools):
            self.forget(address)
        self.clients.close()


class ShmReceiver:
    name = "shm"

    def __init__(self, sink: FrameSink, host: str = "127.0.0.1", secret: ClusterSecret | None = None,
                 on_crash: Callable[[BaseException], None] = lambda error: None) -> None:
        self.sink = sink
        # name -> (mapping, an open file of it: its lock tells whether the sender lives); only the
        # control thread touches it
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}
        self._server = ControlServer("shm", host, self._handle, secret, sweep=self._unmap_orphans, on_crash=on_crash)
        self.address = self._server.address

    def _handle(self, kind: bytes, parts: list[zmq.Frame]) -> None:
        # The shape first: a malformed message is refused as such (not an IndexError, nor a "corrupt
        # frame" that the sender would send again).
        if len(parts) != _PARTS.get(kind, -1) or (kind == FRAME and len(parts[2].bytes) != _SLOT.size):
            raise TransferError(f"malformed control message: kind {kind[:8]!r} with {len(parts)} parts")
        if kind == RELEASE:
            self._unmap(_segment_name(parts[0].bytes))
            return
        if kind == INLINE:
            deliver(self.sink, frame_header(parts[0].buffer), parts[1].buffer)
        else:  # FRAME
            offset, length = _SLOT.unpack(parts[2].bytes)
            # Mapped first, whatever the rest says: the sender unlinks a segment on its first answer.
            mapping = self._mapping(_segment_name(parts[1].bytes))
            header = frame_header(parts[0].buffer)
            if offset + length > len(mapping):
                raise TransferError(f"slot [{offset}, {offset + length}) outside a segment of {len(mapping)} bytes")
            deliver(self.sink, header, memoryview(mapping)[offset : offset + length])

    def _mapping(self, name: str) -> mmap.mmap:
        if name in self._maps:
            return self._maps[name][0]
        self._unmap_orphans()  # a new segment: perhaps from a sender restarted after one that died
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise TransferError(f"shared memory segment {name} is gone (its sender closed it)") from None
        try:
            mapping = mmap.mmap(fd, 0)
        except BaseException:
            os.close(fd)
            raise
        self._maps[name] = (mapping, fd)
        return mapping

    def _unmap_orphans(self) -> None:
        """Drop the mappings whose sender died without releasing them (its lock on the file is gone)."""
        for name, (_, fd) in list(self._maps.items()):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its sender holds it
            log.info("shared memory segment %s: no sender holds it any more (released, or its sender died); "
                     "unmapped", name)
            self._unmap(name)
            # A sender killed before it took this side's answer left the name linked: nobody else will
            # open it (a living sender holds its segments locked; a released one is unlinked already).
            (SHM_DIR / name).unlink(missing_ok=True)

    def _unmap(self, name: str) -> None:
        entry = self._maps.pop(name, None)
        if entry is not None:
            _close_quietly(entry[0])
            os.close(entry[1])

    def stop(self) -> None:
        if self._server.stop():  # else a handler still runs on them: they go with the process
            for name in list(self._maps):
                self._unmap(name)


def _segment_name(raw: bytes) -> str:
    """A segment name from the wire, checked: nothing but our own files is ever opened."""
    name = raw.decode(errors="replace")
    if not _NAME.fullmatch(name):
        raise TransferError(f"not a pdserve shared memory segment: {name[:80]!r}")
    return name


def _close_quietly(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a view of it is still alive somewhere: the mapping goes when that does
        pass
