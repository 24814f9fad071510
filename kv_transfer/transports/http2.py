"""A small HTTP/2 connection (RFC 9113) for gRPC calls, built for bulk data.

A DATA frame goes out as its 9-byte header and views of the caller's buffers, in one `sendmsg`: no
copy in user space. A DATA frame's payload comes off the socket into whatever buffer the stream's
handler names (`DataReader`): no copy either. grpcio's Python binding copies each message into and
out of its core, one message in flight at a time; that is why the KV transport speaks gRPC through
this (docs/benchmarks.md has the two side by side), and any gRPC peer, grpcio included, speaks to it.

What gRPC needs is here: streams that clients open, HEADERS (with CONTINUATION), DATA, RST_STREAM,
SETTINGS, PING, GOAWAY and WINDOW_UPDATE, padding read and dropped; PRIORITY and unknown frames are
read and ignored, server push is refused. Header blocks are HPACK-coded by `hpack` (python-hyper).

Threads: a reader and a writer per connection. Only the writer writes: the reader queues its
answers (SETTINGS and PING acknowledgements, WINDOW_UPDATEs) for it, so the reader never waits on a
peer that is not reading, and it always drains what the peer writes (a peer that makes it queue
more than MAX_PENDING_CONTROL answers without reading them is cut off). Answers and resets go
before queued DATA; a stream's HEADERS and DATA go in the order they were queued, and header blocks
are HPACK-encoded as they are written, so the peer's decoder sees them in the encoder's order. The
handler's callbacks run on the reader thread, in the order frames arrive; `on_closed` comes last,
once.

Flow control: this side grants RECV_WINDOW bytes (per stream and for the connection) and gives
bytes back as they are read; the writer keeps to the peer's windows and frame size. A stream whose
one side ended while the other still sends is reset with NO_ERROR, as gRPC asks of both sides.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import hpack

from pdserve.kv_transfer.transports.pipes import Buffer, Pipe
from pdserve.threads import start_guarded

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADER = struct.Struct(">IBI")  # length << 8 | type, flags, stream id
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")


class FrameType(IntEnum):
    DATA = 0
    HEADERS = 1
    PRIORITY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PUSH_PROMISE = 5
    PING = 6
    GOAWAY = 7
    WINDOW_UPDATE = 8
    CONTINUATION = 9


END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY = 0x20


class Setting(IntEnum):
    HEADER_TABLE_SIZE = 1
    ENABLE_PUSH = 2
    MAX_CONCURRENT_STREAMS = 3
    INITIAL_WINDOW_SIZE = 4
    MAX_FRAME_SIZE = 5
    MAX_HEADER_LIST_SIZE = 6


class ErrorCode(IntEnum):
    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    SETTINGS_TIMEOUT = 4
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9
    CONNECT_ERROR = 10
    ENHANCE_YOUR_CALM = 11
    INADEQUATE_SECURITY = 12
    HTTP_1_1_REQUIRED = 13

    @classmethod
    def name_of(cls, code: int) -> str:
        return cls(code).name if code in cls._value2member_map_ else f"error {code}"


DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
MAX_WINDOW = 2**31 - 1
RECV_WINDOW = 64 << 20  # granted per stream and for the connection: far more than loopback or a LAN holds in flight
MAX_FRAME_SIZE = (1 << 24) - 1  # the largest the protocol allows: a message of a few MiB is one frame
MAX_HEADER_LIST = 16 << 10  # decoded header bytes per block (gRPC suggests 8 KiB)
MAX_HEADER_BLOCK = 64 << 10  # encoded bytes per block, CONTINUATIONs included
MAX_STREAMS = 128  # open at once per connection (the peer's): each may hold a message buffer of a few MiB
MAX_PENDING_CONTROL = 10_000  # answers queued for a peer that does not read them: past this, it is cut off
_BATCH_FRAMES = 512  # control frames per write (sendmsg takes at most 1,024 buffers)
_SCRATCH = 64 << 10  # bytes skipped at a time
_WRITER_EXIT_S = 5.0  # a shut-down pipe ends the writer's write at once; this bounds the wait anyway
_GOAWAY_FLUSH_S = 1.0  # how long a connection closing for a protocol error waits for its GOAWAY to go out


class ConnectionClosed(Exception):
    """The connection is closed (the reason says why): nothing more goes out on it."""


class ProtocolViolation(Exception):
    """The peer broke the protocol: the connection ends with GOAWAY(code)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class DataReader:
    """One DATA frame's payload, read off the wire into the buffers the handler names."""

    def __init__(self, read_exact: Callable[[memoryview], None], size: int) -> None:
        self._read_exact = read_exact
        self.remaining = size

    def read_into(self, view: memoryview) -> None:
        """Fill `view` (at most `remaining` bytes) with the payload's next bytes."""
        if len(view) > self.remaining:
            raise ValueError(f"{len(view)} bytes asked of a payload with {self.remaining} left")
        self._read_exact(view)
        self.remaining -= len(view)


class StreamHandler(Protocol):
    """What a connection tells its owner, on the reader thread. Whatever of a DATA payload `on_data`
    leaves unread is skipped."""

    def on_headers(self, stream_id: int, headers: list[tuple[str, str]]) -> None: ...

    def on_data(self, stream_id: int, data: DataReader) -> None: ...

    def on_end(self, stream_id: int) -> None:
        """The peer ended the stream (END_STREAM): it sends nothing more on it."""

    def on_reset(self, stream_id: int, code: int) -> None:
        """The stream is gone (RST_STREAM, or GOAWAY refused it): nothing more comes or goes on it."""

    def on_closed(self, reason: str) -> None:
        """The connection ended; every stream still open is gone with it."""


@dataclass
class _Stream:
    send_window: int
    on_wire: bool  # its HEADERS were written (a peer's stream: always); a stream never on the wire is reset silently
    recv_window: int = RECV_WINDOW  # what the peer may still send
    unacked: int = 0  # read and not yet given back
    queued: int = 0  # DATA bytes queued and not yet written
    end_queued: bool = False  # END_STREAM queued: nothing may follow it
    local_ended: bool = False  # END_STREAM written
    remote_ended: bool = False


@dataclass(eq=False)  # found in the queue by identity: comparing payloads would read them
class _Outgoing:
    """One queued item of a stream: DATA (flow-controlled, cut into frames as windows allow) or a
    header list (`headers`), encoded when it is written, in its place in the stream's order."""

    stream_id: int
    parts: deque[memoryview] = field(default_factory=deque)
    size: int = 0
    end_stream: bool = False
    headers: Sequence[tuple[str, str]] | None = None


def frame(kind: FrameType, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(len(payload) << 8 | kind, flags, stream_id) + payload


class Connection:
    """One HTTP/2 connection over `open_pipe`'s pipe (connected, or accepted, and handshaken on the
    reader thread, once `start`ed: nothing here blocks its caller). Streams are opened by
    `open_stream` (a client) or by the peer (a server: its HEADERS reach `handler.on_headers` first);
    what is queued before the pipe is up goes out once it is."""

    def __init__(self, open_pipe: Callable[[], Pipe], handler: StreamHandler, *, client: bool, name: str) -> None:
        self.name = name
        self._handler = handler
        self._client = client
        self._pipe: Pipe | None = None
        self.closed: str | None = None  # why, once closed
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # work for the writer; room for senders
        self._control: deque[bytes] = deque()  # frames that go before any stream's items
        self._items: deque[_Outgoing] = deque()
        self._streams: dict[int, _Stream] = {}
        self._next_stream_id = 1  # a client's
        self._last_peer_stream = 0  # the highest stream id the peer opened (a server's)
        self._goaway_from_peer: int | None = None  # the last stream id the peer will process
        self._encoder = hpack.Encoder()
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_frame_size = DEFAULT_FRAME_SIZE
        self._send_window = DEFAULT_WINDOW  # the connection's, granted by the peer
        self._recv_window = RECV_WINDOW  # the connection's, granted to the peer
        self._unacked = 0
        self._last_write = self._last_read = time.monotonic()  # progress, for stall and silence checks
        self._header_block: tuple[int, int, bytearray] | None = None  # (stream id, flags, block) awaiting CONTINUATION
        self._head = bytearray(_HEADER.size)
        self._scratch = bytearray(_SCRATCH)
        settings = {Setting.INITIAL_WINDOW_SIZE: RECV_WINDOW, Setting.MAX_FRAME_SIZE: MAX_FRAME_SIZE,
                    Setting.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
                    **({Setting.ENABLE_PUSH: 0} if client else {Setting.MAX_CONCURRENT_STREAMS: MAX_STREAMS})}
        announced = b"".join(_SETTING.pack(key, value) for key, value in settings.items())
        self._control.extend([*([PREFACE] if client else []), frame(FrameType.SETTINGS, 0, 0, announced),
                              frame(FrameType.WINDOW_UPDATE, 0, 0, _U32.pack(RECV_WINDOW - DEFAULT_WINDOW))])
        self._open_pipe = open_pipe
        self._writer: threading.Thread | None = None
        self.reader: threading.Thread | None = None

    def start(self) -> None:
        """Connect (or take the accepted socket) and serve, on the connection's own threads; once the
        owner holds the connection, as the handler's callbacks may start at once."""
        self.reader = start_guarded(f"{self.name}-read", self._read_loop, self._crashed)

    # --- what the owner calls, from any thread -------------------------------------------------
    def open_stream(self, headers: Sequence[tuple[str, str]]) -> int:
        """A new stream with these request headers queued on it (a client's)."""
        with self._lock:
            self._check_open()
            if self._goaway_from_peer is not None:
                raise ConnectionClosed("the peer is going away (GOAWAY): no new stream")
            stream_id, self._next_stream_id = self._next_stream_id, self._next_stream_id + 2
            self._streams[stream_id] = _Stream(self._peer_initial_window, on_wire=False)
            self._queue_headers(stream_id, headers, end_stream=False)
        return stream_id

    def send_headers(self, stream_id: int, headers: Sequence[tuple[str, str]], end_stream: bool = False) -> None:
        """Queue HEADERS (a response's, or trailers with `end_stream`); a stream gone takes nothing."""
        with self._lock:
            stream = self._streams.get(stream_id)
            if self.closed is None and stream is not None and not stream.end_queued:
                self._queue_headers(stream_id, headers, end_stream)

    def send_data(self, stream_id: int, parts: Sequence[Buffer], end_stream: bool = False) -> None:
        """Queue `parts` as the stream's next DATA (sent from these buffers: they must stay unchanged
        until written); raises ConnectionClosed if the connection or the stream is gone."""
        views = deque(memoryview(part).cast("B") for part in parts if len(part))
        size = sum(len(view) for view in views)
        with self._lock:
            self._check_open()
            stream = self._streams.get(stream_id)
            if stream is None or stream.end_queued:
                raise ConnectionClosed(f"stream {stream_id} is closed")
            stream.queued += size
            stream.end_queued = end_stream
            self._items.append(_Outgoing(stream_id, views, size, end_stream))
            self._changed.notify_all()

    def reset(self, stream_id: int, code: ErrorCode) -> None:
        """End the stream at once (RST_STREAM), dropping what is still queued on it; idempotent."""
        with self._lock:
            if (stream := self._streams.pop(stream_id, None)) is not None:
                self._reset_locked(stream_id, stream, code)

    @property
    def accepts_streams(self) -> bool:
        """Open, and the peer is not going away (GOAWAY): a new stream may start here."""
        return self.closed is None and self._goaway_from_peer is None

    def silent_for(self) -> float:
        """Seconds since the last frame came from the peer."""
        return time.monotonic() - self._last_read

    def wait_for_room(self, stream_id: int, limit: int, stall_s: float) -> bool:
        """Wait until fewer than `limit` DATA bytes of the stream are queued and not yet written, or
        the stream or the connection is gone; False if the connection wrote nothing for `stall_s`
        meanwhile (stalled: the peer takes nothing)."""
        since = time.monotonic()
        with self._changed:
            while True:
                stream = self._streams.get(stream_id)
                if self.closed is not None or stream is None or stream.queued < limit:
                    return True
                left = max(self._last_write, since) + stall_s - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)

    def close(self, reason: str) -> None:
        """Close at once (idempotent); the reader thread then tells the handler (`on_closed(reason)`)."""
        with self._lock:
            if self.closed is None:
                self.closed = reason
            self._changed.notify_all()
            pipe = self._pipe
        if pipe is not None:
            pipe.shutdown()  # the reader's and the writer's calls return; the reader then reports

    # --- under the lock ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed is not None:
            raise ConnectionClosed(self.closed)

    def _queue_headers(self, stream_id: int, headers: Sequence[tuple[str, str]], end_stream: bool) -> None:
        self._streams[stream_id].end_queued = end_stream
        self._items.append(_Outgoing(stream_id, end_stream=end_stream, headers=headers))
        self._changed.notify_all()

    def _header_frames(self, stream_id: int, stream: _Stream, item: _Outgoing) -> list[bytes]:
        """The item's header block, encoded now (the writer's order is the order the peer decodes in),
        in HEADERS and CONTINUATION frames the peer's frame size allows."""
        block = self._encoder.encode(item.headers)
        limit = self._peer_frame_size
        chunks = [block[at : at + limit] for at in range(0, max(len(block), 1), limit)]
        stream.on_wire = True
        return [frame(FrameType.HEADERS if i == 0 else FrameType.CONTINUATION,
                      (END_STREAM if item.end_stream and i == 0 else 0) | (END_HEADERS if i == len(chunks) - 1 else 0),
                      stream_id, chunk) for i, chunk in enumerate(chunks)]

    def _reset_locked(self, stream_id: int, stream: _Stream, code: ErrorCode) -> None:
        """Drop what is queued on a stream taken out of `_streams`, and reset it if the peer knows of it."""
        self._items = deque(item for item in self._items if item.stream_id != stream_id)
        if stream.on_wire:
            self._control.append(frame(FrameType.RST_STREAM, 0, stream_id, _U32.pack(code)))
        self._changed.notify_all()

    def _answer_peer(self, frames: bytes) -> None:
        """Queue the reader's answer (an acknowledgement, a window update) for the writer."""
        self._control.append(frames)
        self._changed.notify_all()

    def _forget_if_done(self, stream_id: int, stream: _Stream) -> None:
        if stream.local_ended and stream.remote_ended:
            self._streams.pop(stream_id, None)

    # --- the writer ---------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._changed:
                while self.closed is None and not (out := self._next_write()):
                    self._changed.wait()
                if self.closed is not None:
                    return
            parts, stream_id, size = out
            try:
                self._pipe.send(parts)
            except OSError as e:
                self.close(f"connection lost while writing: {e}")
                return
            with self._changed:  # room for the stream's sender; a GOAWAY waited on is out
                self._last_write = time.monotonic()
                if size and (stream := self._streams.get(stream_id)) is not None:
                    stream.queued -= size
                self._changed.notify_all()

    def _next_write(self) -> tuple[list[Buffer], int, int] | None:
        """What the writer sends next: (parts, stream id, DATA bytes among them), or None for now."""
        if self._control:
            batch = min(len(self._control), _BATCH_FRAMES)
            return [self._control.popleft() for _ in range(batch)], 0, 0
        seen: set[int] = set()
        for item in self._items:
            if item.stream_id in seen:
                continue  # a stream's items go in order: only its first may go
            seen.add(item.stream_id)
            stream = self._streams[item.stream_id]
            if item.headers is not None:
                self._items.remove(item)
                frames = self._header_frames(item.stream_id, stream, item)
                return (self._ended(item.stream_id, stream, frames) if item.end_stream else frames), 0, 0
            # (a window may be below zero: the peer lowered the initial window under a stream in flight)
            size = max(0, min(item.size, stream.send_window, self._send_window, self._peer_frame_size))
            if size == 0 and item.size:
                continue  # waits for the peer's WINDOW_UPDATE
            parts: list[Buffer] = []
            taken = 0
            while taken < size:
                part = item.parts[0]
                if taken + len(part) <= size:
                    parts.append(item.parts.popleft())
                    taken += len(part)
                else:
                    parts.append(part[: size - taken])
                    item.parts[0] = part[size - taken :]
                    taken = size
            item.size -= size
            stream.send_window -= size
            self._send_window -= size
            last = item.size == 0
            if last:
                self._items.remove(item)
            flags = END_STREAM if last and item.end_stream else 0
            header = _HEADER.pack(size << 8 | FrameType.DATA, flags, item.stream_id)
            frames: list[Buffer] = [header, *parts]
            return (self._ended(item.stream_id, stream, frames) if flags else frames), item.stream_id, size
        return None

    def _ended(self, stream_id: int, stream: _Stream, frames: list) -> list:
        """`frames` end the stream on this side: if the peer still sends, a server resets the stream
        after them (NO_ERROR: its answer is complete, gRPC's early closure)."""
        stream.local_ended = True
        if not stream.remote_ended and not self._client:
            self._streams.pop(stream_id, None)
            self._items = deque(item for item in self._items if item.stream_id != stream_id)
            return [*frames, frame(FrameType.RST_STREAM, 0, stream_id, _U32.pack(ErrorCode.NO_ERROR))]
        self._forget_if_done(stream_id, stream)
        return frames

    # --- the reader ---------------------------------------------------------------------------
    def _read_loop(self) -> None:
        stage = "cannot connect"  # what a failure is called, by how far the connection got
        reason = "the peer closed the connection"
        try:
            pipe = self._open_pipe()
            with self._lock:
                self._pipe = pipe
                if self.closed is not None:
                    return
            stage = "the handshake failed"
            pipe.handshake()
            stage = "connection lost"
            self._writer = start_guarded(f"{self.name}-write", self._write_loop, self._crashed)
            if not self._client:
                self._expect_preface()
            pipe.settle()
            while True:
                self._read_frame()
        except ProtocolViolation as e:
            reason = f"HTTP/2 protocol error from the peer: {e}"
            log.warning("%s: %s; closing the connection", self.name, reason)
            self._go_away(e.code, str(e))
        except (OSError, EOFError) as e:
            reason = f"{stage}: {e}" if str(e) else reason
        except Exception as e:  # a fault of this side's (the handler's): logged, and the connection ends
            log.exception("%s: reading failed", self.name)
            reason = f"{type(e).__name__}: {e}"
        finally:
            self.close(reason)
            if self._writer is not None:  # out of the pipe before it closes: its descriptor may be reused
                self._writer.join(_WRITER_EXIT_S)
            if self._pipe is not None:
                self._pipe.close()
            self._report_closed()

    def _report_closed(self) -> None:
        with self._lock:
            self._streams.clear()
            self._items.clear()
        self._handler.on_closed(self.closed or "closed")

    def _crashed(self, error: BaseException) -> None:
        self.close(f"{type(error).__name__}: {error}")

    def _go_away(self, code: ErrorCode, message: str) -> None:
        """Tell the peer why (GOAWAY) before the connection closes, if the writer gets it out in time."""
        with self._changed:
            self._control.append(frame(FrameType.GOAWAY, 0, 0, _U32.pack(self._last_peer_stream) + _U32.pack(code)
                                       + message.encode()[:256]))
            self._changed.notify_all()
            self._changed.wait_for(lambda: not self._control or self.closed is not None, _GOAWAY_FLUSH_S)

    def _read_exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self._pipe.recv_into(view[got:])
            if n == 0:
                raise EOFError("the peer closed the connection")
            got += n

    def _read(self, size: int) -> bytearray:
        data = bytearray(size)
        self._read_exact(memoryview(data))
        return data

    def _skip(self, size: int) -> None:
        scratch = memoryview(self._scratch)
        while size:
            n = min(size, len(scratch))
            self._read_exact(scratch[:n])
            size -= n

    def _expect_preface(self) -> None:
        if bytes(self._read(len(PREFACE))) != PREFACE:
            raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, "no HTTP/2 connection preface")

    def _read_frame(self) -> None:
        if len(self._control) >= MAX_PENDING_CONTROL:  # each frame read queues two answers at most
            raise ProtocolViolation(ErrorCode.ENHANCE_YOUR_CALM,
                                    f"{MAX_PENDING_CONTROL} answers queued: the peer reads none of them")
        self._read_exact(memoryview(self._head))
        self._last_read = time.monotonic()
        length_kind, flags, stream_id = _HEADER.unpack(self._head)
        length, kind, stream_id = length_kind >> 8, length_kind & 0xFF, stream_id & 0x7FFFFFFF
        if length > MAX_FRAME_SIZE:
            raise ProtocolViolation(ErrorCode.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
        if self._header_block is not None and kind != FrameType.CONTINUATION:
            raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, "a header block cut by another frame")
        if kind == FrameType.DATA:
            self._on_data(length, flags, stream_id)
        elif kind in (FrameType.HEADERS, FrameType.CONTINUATION):
            self._on_header_block(kind, length, flags, stream_id)
        elif kind in _CONTROL_SIZES:
            expected = _CONTROL_SIZES[kind]
            if stream_id == 0 and kind in (FrameType.RST_STREAM, FrameType.PRIORITY) or \
                    stream_id != 0 and kind in (FrameType.SETTINGS, FrameType.PING, FrameType.GOAWAY):
                raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, f"{FrameType(kind).name} on stream {stream_id}")
            if expected is not None and length != expected:
                raise ProtocolViolation(ErrorCode.FRAME_SIZE_ERROR, f"{FrameType(kind).name} of {length} bytes")
            if length > MAX_HEADER_BLOCK:
                raise ProtocolViolation(ErrorCode.FRAME_SIZE_ERROR, f"{FrameType(kind).name} of {length} bytes")
            payload = self._read(length)
            getattr(self, f"_on_{FrameType(kind).name.lower()}")(payload, flags, stream_id)
        elif kind == FrameType.PUSH_PROMISE:
            raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE, though push is disabled")
        else:  # an extension's frame: ignored, as the protocol asks
            self._skip(length)

    def _strip_padding(self, payload: bytearray, flags: int) -> bytearray:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, "padding longer than its frame")
        return payload[1 : len(payload) - payload[0]]

    def _on_data(self, length: int, flags: int, stream_id: int) -> None:
        if stream_id == 0:
            raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        padding = 0
        if flags & PADDED:
            if length == 0:
                raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, "padded DATA without its pad length")
            padding = self._read(1)[0]
            if padding >= length:
                raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, "padding longer than its frame")
        body = length - padding - (1 if flags & PADDED else 0)
        with self._lock:
            self._recv_window -= length
            if self._recv_window < 0:
                raise ProtocolViolation(ErrorCode.FLOW_CONTROL_ERROR, "DATA past the connection's window")
            stream = self._streams.get(stream_id)
            if stream is None and self._is_idle(stream_id):
                raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, f"DATA on stream {stream_id}, never opened")
            refused = None  # why a stream open here is reset for this frame
            if stream is not None and stream.remote_ended:
                refused = ErrorCode.STREAM_CLOSED  # the peer ended it, then went on
            elif stream is not None and stream.recv_window < length:
                refused = ErrorCode.FLOW_CONTROL_ERROR
            if refused is not None:
                self._streams.pop(stream_id)
                self._reset_locked(stream_id, stream, refused)
            takes = stream is not None and refused is None
            if takes:
                stream.recv_window -= length
        if refused is not None:
            self._handler.on_reset(stream_id, refused)
        if takes:
            data = DataReader(self._read_exact, body)
            self._handler.on_data(stream_id, data)
            body = data.remaining
        self._skip(body + padding)  # what the handler left, or a closed stream's: read and dropped
        self._give_back(stream_id, length)
        if takes and flags & END_STREAM:
            self._remote_end(stream_id)

    def _give_back(self, stream_id: int, length: int) -> None:
        """Grant again what was read (one WINDOW_UPDATE per half window, not per frame)."""
        with self._lock:
            self._unacked += length
            if self._unacked >= RECV_WINDOW // 2:
                self._answer_peer(frame(FrameType.WINDOW_UPDATE, 0, 0, _U32.pack(self._unacked)))
                self._recv_window += self._unacked
                self._unacked = 0
            stream = self._streams.get(stream_id)
            if stream is not None and not stream.remote_ended:
                stream.unacked += length
                if stream.unacked >= RECV_WINDOW // 2:
                    self._answer_peer(frame(FrameType.WINDOW_UPDATE, 0, stream_id, _U32.pack(stream.unacked)))
                    stream.recv_window += stream.unacked
                    stream.unacked = 0

    def _is_idle(self, stream_id: int) -> bool:
        """Never opened: the peer may not send on it (a server's own streams are never opened here)."""
        if self._client:
            return stream_id % 2 == 0 or stream_id >= self._next_stream_id
        return stream_id % 2 == 0 or stream_id > self._last_peer_stream

    def _remote_end(self, stream_id: int) -> None:
        with self._lock:
            stream = self._streams.get(stream_id)
            if stream is None:
                return
            stream.remote_ended = True
            early = self._client and not stream.local_ended  # the answer came while the request still goes
            if early:
                self._streams.pop(stream_id)
                self._reset_locked(stream_id, stream, ErrorCode.NO_ERROR)
            else:
                self._forget_if_done(stream_id, stream)
        self._handler.on_end(stream_id)

    def _on_header_block(self, kind: int, length: int, flags: int, stream_id: int) -> None:
        if stream_id == 0:
            raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, "a header block on stream 0")
        so_far = len(self._header_block[2]) if self._header_block is not None else 0
        if so_far + length > MAX_HEADER_BLOCK:
            raise ProtocolViolation(ErrorCode.ENHANCE_YOUR_CALM, f"a header block over {MAX_HEADER_BLOCK} bytes")
        payload = self._read(length)
        if kind == FrameType.CONTINUATION:
            if self._header_block is None or self._header_block[0] != stream_id:
                raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            self._header_block[2].extend(payload)
            stream_id, first_flags, block = self._header_block
        else:
            payload = self._strip_padding(payload, flags)
            if flags & PRIORITY:
                if len(payload) < 5:
                    raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, "HEADERS too short for its priority")
                payload = payload[5:]
            first_flags, block = flags, payload
            self._header_block = (stream_id, flags, block)
        if flags & END_HEADERS:
            self._header_block = None
            self._on_headers(stream_id, first_flags, bytes(block))

    def _on_headers(self, stream_id: int, flags: int, block: bytes) -> None:
        try:  # decoded whatever becomes of the stream: the table must follow every block
            headers = [(bytes(n).decode("latin-1"), bytes(v).decode("latin-1"))
                       for n, v in self._decoder.decode(block, raw=True)]
        except hpack.HPACKError as e:
            raise ProtocolViolation(ErrorCode.COMPRESSION_ERROR, f"header block: {e}") from None
        with self._lock:
            stream = self._streams.get(stream_id)
            if stream is None:
                if self._client or not self._is_idle(stream_id):
                    return  # a stream closed here (reset, or ended): what still comes on it is dropped
                if stream_id % 2 == 0:
                    raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, f"a client opened stream {stream_id}")
                self._last_peer_stream = stream_id
                stream = _Stream(self._peer_initial_window, on_wire=True)
                if len(self._streams) >= MAX_STREAMS:
                    self._reset_locked(stream_id, stream, ErrorCode.REFUSED_STREAM)
                    return
                self._streams[stream_id] = stream
            elif stream.remote_ended:  # the peer ended the stream, then went on
                self._streams.pop(stream_id)
                self._reset_locked(stream_id, stream, ErrorCode.STREAM_CLOSED)
                stream = None
        if stream is None:
            self._handler.on_reset(stream_id, ErrorCode.STREAM_CLOSED)
            return
        self._handler.on_headers(stream_id, headers)
        if flags & END_STREAM:
            self._remote_end(stream_id)

    def _on_priority(self, payload: bytearray, flags: int, stream_id: int) -> None:
        pass  # advice on ordering: this side sends in queued order

    def _on_rst_stream(self, payload: bytearray, flags: int, stream_id: int) -> None:
        with self._lock:
            if self._is_idle(stream_id):
                raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, f"RST_STREAM on stream {stream_id}, never opened")
            known = self._streams.pop(stream_id, None) is not None
            self._items = deque(item for item in self._items if item.stream_id != stream_id)
            self._changed.notify_all()
        if known:
            self._handler.on_reset(stream_id, _U32.unpack(payload)[0])

    def _on_settings(self, payload: bytearray, flags: int, stream_id: int) -> None:
        if flags & ACK:
            if payload:
                raise ProtocolViolation(ErrorCode.FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % _SETTING.size:
            raise ProtocolViolation(ErrorCode.FRAME_SIZE_ERROR, f"SETTINGS of {len(payload)} bytes")
        with self._lock:
            for at in range(0, len(payload), _SETTING.size):
                self._apply_setting(*_SETTING.unpack_from(payload, at))
            self._answer_peer(frame(FrameType.SETTINGS, ACK, 0))

    def _apply_setting(self, key: int, value: int) -> None:
        if key == Setting.INITIAL_WINDOW_SIZE:
            change = value - self._peer_initial_window
            if value > MAX_WINDOW or any(s.send_window + change > MAX_WINDOW for s in self._streams.values()):
                raise ProtocolViolation(ErrorCode.FLOW_CONTROL_ERROR, f"initial window of {value}")
            for stream in self._streams.values():  # open streams' windows move by the change
                stream.send_window += change
            self._peer_initial_window = value
        elif key == Setting.MAX_FRAME_SIZE:
            if not DEFAULT_FRAME_SIZE <= value <= MAX_FRAME_SIZE:
                raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, f"max frame size {value}")
            self._peer_frame_size = value
        elif key == Setting.HEADER_TABLE_SIZE:
            self._encoder.header_table_size = value
        elif key == Setting.ENABLE_PUSH and value > 1:
            raise ProtocolViolation(ErrorCode.PROTOCOL_ERROR, f"enable push {value}")
        # MAX_CONCURRENT_STREAMS: a sender opens a stream per transfer, far fewer than any peer allows

    def _on_ping(self, payload: bytearray, flags: int, stream_id: int) -> None:
        if not flags & ACK:
            with self._lock:
                self._answer_peer(frame(FrameType.PING, ACK, 0, bytes(payload)))

    def _on_goaway(self, payload: bytearray, flags: int, stream_id: int) -> None:
        if len(payload) < 8:
            raise ProtocolViolation(ErrorCode.FRAME_SIZE_ERROR, f"GOAWAY of {len(payload)} bytes")
        last, code = _U32.unpack_from(payload)[0] & 0x7FFFFFFF, _U32.unpack_from(payload, 4)[0]
        log.log(logging.INFO if code == ErrorCode.NO_ERROR else logging.WARNING, "%s: the peer is going away (%s): %s",
                self.name, ErrorCode.name_of(code), bytes(payload[8:]).decode("utf-8", "replace"))
        with self._lock:
            self._goaway_from_peer = last
            refused = [s for s in self._streams if s > last and self._client]
            for stream_id_refused in refused:
                self._streams.pop(stream_id_refused)
            self._items = deque(item for item in self._items if item.stream_id not in refused)
            self._changed.notify_all()  # senders waiting on a refused stream see it gone
        for stream_id_refused in refused:
            self._handler.on_reset(stream_id_refused, ErrorCode.REFUSED_STREAM)

    def _on_window_update(self, payload: bytearray, flags: int, stream_id: int) -> None:
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        overflow = False
        with self._lock:
            if stream_id == 0:
                if increment == 0 or self._send_window + increment > MAX_WINDOW:
                    raise ProtocolViolation(ErrorCode.FLOW_CONTROL_ERROR, f"connection window update of {increment}")
                self._send_window += increment
            elif (stream := self._streams.get(stream_id)) is not None:
                overflow = increment == 0 or stream.send_window + increment > MAX_WINDOW
                if overflow:
                    self._streams.pop(stream_id)
                    self._reset_locked(stream_id, stream, ErrorCode.FLOW_CONTROL_ERROR)
                else:
                    stream.send_window += increment
            self._changed.notify_all()
        if overflow:
            self._handler.on_reset(stream_id, ErrorCode.FLOW_CONTROL_ERROR)


# Frames read whole into memory, and their fixed sizes (None: any, up to MAX_HEADER_BLOCK).
_CONTROL_SIZES: dict[int, int | None] = {FrameType.PRIORITY: 5, FrameType.RST_STREAM: 4, FrameType.SETTINGS: None,
                                         FrameType.PING: 8, FrameType.GOAWAY: None, FrameType.WINDOW_UPDATE: 4}
