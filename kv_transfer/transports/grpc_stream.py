"""gRPC client streaming (`KVTransfer.PushKV` of kv_transfer.proto): the cross-node default, over
mutual TLS when the manifest gives certificates.

Both halves speak gRPC over the package's own HTTP/2 (`http2`). A message goes from the KV buffer to
the socket in one `sendmsg` with its headers, and comes off the socket into its frame's buffer; the
sink gets a view of that buffer, so nothing is copied in between. grpcio's Python binding,
which this transport ran on before, copies each message into and out of its core, one message in
flight at a time, and moved about a third of a raw socket's bytes/s on loopback (docs/benchmarks.md
has both side by side). The wire is plain gRPC: grpcio clients push into the receiving half, and
the sending half pushes into grpcio servers (tests/kv_transfer/test_grpc_wire.py).

A sender keeps one connection per decode worker; each channel is one PushKV call (an HTTP/2 stream)
on it. `send` cuts a frame into messages of at most PIECE_BYTES and queues them, to be sent from the
payload's own memory (it stays unchanged until `finish`, as the channel interface asks). It returns
once no more than WINDOW_BYTES of the call wait to be written, so the sender keeps pace with the link
and its lease is renewed as frames go. `finish` ends the stream and reads the receiver's `KVAck`.

The messages are `KVFrame`s with the payload field last. The sender writes the small fields with
protobuf, then the payload field's tag and length itself, then the payload from its own buffer
(`_fields`). The receiver reads a message's first bytes, parses its fields, and reads its payload
straight into the frame's buffer at its offset, so a frame in several messages is put together
without a copy (`_PushKV`); a message from a sender that puts the payload elsewhere is read whole
and parsed (`_parse`).

With the cluster's secret, every call carries its token as call metadata (`CLUSTER_METADATA`, which
HPACK never indexes). A receiver that has the secret ends any call without it UNAUTHENTICATED before
it reads a message. Mutual TLS (the manifest's `kv_transfer.tls`) also keeps strangers from
connecting at all.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import grpc
import hpack
from google.protobuf.message import DecodeError

from pdserve.kv_transfer.interface import CorruptFrame, FrameHeader, FrameSink, Payload, TransferError
from pdserve.kv_transfer.transports import http2, pipes
from pdserve.proto.pdserve.v1 import kv_transfer_pb2
from pdserve.threads import start_guarded

if TYPE_CHECKING:
    from pdserve.wire import ClusterSecret

log = logging.getLogger(__name__)

CLUSTER_METADATA = "x-pdserve-cluster"  # the call metadata key that carries the cluster's token
_SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
PUSH_PATH = f"/{_SERVICE.full_name}/PushKV"

# A frame's bytes per message: whole messages within 4 MiB, the most other gRPC implementations take
# by default (grpcio's, grpc-go's, grpc-java's). Nothing is copied per message, so larger messages only
# cost the receiving call a larger buffer; a frame of up to this size reaches the sink without being
# put together.
PIECE_BYTES = (4 << 20) - (4 << 10)
MAX_PIECE_BYTES = 4 << 20  # the largest piece a receiver takes (>= PIECE_BYTES)
WINDOW_BYTES = 64 << 20  # a call's messages queued and not yet written, at most (a piece more)
SEND_TIMEOUT_S = 30.0  # a connection that writes nothing for this long while a call waits for room has stalled
ANSWER_WAIT_S = 1.0  # a call whose stream the receiver closed: how long its answer may take to follow
MAX_FRAME_BYTES = 1 << 30  # a header asking for more is not believed
_MESSAGE_LIMIT = MAX_PIECE_BYTES + (64 << 10)  # a piece and its header fields
_ANSWER_LIMIT = 64 << 10  # a KVAck
HEAD_BYTES = 512  # read of a KVFrame message before its payload (its other fields take about 60-120 bytes)
# A connection keeps one frame buffer of a call that ended for its next call (no fresh allocation,
# page faults included, per transfer), if it is no larger than this: the raw frames of a 7B-class
# layout without grouped KV heads (1,536 tokens x 16 KiB) still fit; a member's odd huge frame is not kept.
SPARE_MAX_BYTES = 32 << 20
MAX_CONNECTIONS = 256  # a receiving half's connections at once (each is two threads)
CALL_DEADLINE_S = 10.0  # a connection that made no call this receiver takes within this long is closed
ACCEPT_POLL_S = 0.5  # how often the accepting thread looks at its stop flag and the connections' deadlines
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
# gRPC's mapping of a response's HTTP status that is not 200 (doc/http-grpc-status-mapping.md)
_HTTP_STATUS = {"400": grpc.StatusCode.INTERNAL, "401": grpc.StatusCode.UNAUTHENTICATED,
                "403": grpc.StatusCode.PERMISSION_DENIED, "404": grpc.StatusCode.UNIMPLEMENTED,
                **dict.fromkeys(("429", "502", "503", "504"), grpc.StatusCode.UNAVAILABLE)}
_RESET_STATUS = {http2.ErrorCode.CANCEL: grpc.StatusCode.CANCELLED,
                 http2.ErrorCode.REFUSED_STREAM: grpc.StatusCode.UNAVAILABLE,
                 http2.ErrorCode.ENHANCE_YOUR_CALM: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 http2.ErrorCode.INADEQUATE_SECURITY: grpc.StatusCode.PERMISSION_DENIED}
# Status-Message's percent-encoding keeps space and visible ASCII but "%" (gRPC's PROTOCOL-HTTP2.md)
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"


def _tls_context(tls: dict[str, str], server_side: bool) -> ssl.SSLContext:
    missing = {"cert", "key", "ca"} - set(tls)
    if missing:
        raise ValueError(f"KV TLS needs cert, key and ca (mutual TLS); missing {sorted(missing)}")
    for key in ("cert", "key", "ca"):
        if not Path(tls[key]).is_file():
            raise ValueError(f"KV TLS {key} file {tls[key]!r} does not exist")
    return pipes.tls_context(tls["cert"], tls["key"], tls["ca"], server_side)


# --- messages ----------------------------------------------------------------------------------------
_PAYLOAD = kv_transfer_pb2.KVFrame.DESCRIPTOR.fields_by_name["payload"].number
_PAYLOAD_TAG = bytes([_PAYLOAD << 3 | 2])  # a length-delimited field


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes | memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _fields(header: FrameHeader, offset: int, piece_bytes: int) -> bytes:
    """A KVFrame message's gRPC prefix and every byte before its payload: the fields serialized by
    protobuf, then the payload field's tag and length (the payload itself follows from its buffer)."""
    fields = kv_transfer_pb2.KVFrame(
        transfer_id=header.transfer_id, layer=header.layer, start_token=header.start_token,
        num_tokens=header.num_tokens, codec=header.codec, level=header.level, crc32=header.crc32,
        payload_bytes=header.payload_bytes, offset=offset).SerializeToString()
    head = b"".join((fields, _PAYLOAD_TAG, _varint(piece_bytes)))
    return _prefix(len(head) + piece_bytes) + head


def _prefix(length: int) -> bytes:
    """gRPC's Length-Prefixed-Message prefix: not compressed, then the length (big-endian)."""
    return b"\0" + length.to_bytes(4, "big")


def _parse(data: bytes | memoryview) -> tuple[kv_transfer_pb2.KVFrame, memoryview]:
    """A KVFrame message's payload as a view of `data`, and its other fields parsed by protobuf."""
    view, rest, payload, at = memoryview(data), [], memoryview(b""), 0
    while at < len(view):
        start = at
        tag, at = _read_varint(view, at)
        wire_type = tag & 7
        if wire_type == 0:
            _, at = _read_varint(view, at)
        elif wire_type == 2:
            length, at = _read_varint(view, at)
            if tag >> 3 == _PAYLOAD:
                payload = view[at : at + length]
            at += length
        elif wire_type in (1, 5):
            at += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"wire type {wire_type} at byte {start}")
        if at > len(view):
            raise ValueError("a field runs past the end of the message")
        if tag >> 3 != _PAYLOAD:
            rest.append(view[start:at])
    return kv_transfer_pb2.KVFrame.FromString(b"".join(rest)), payload


class MalformedMessage(TransferError):
    """A message that is no gRPC message of its kind (a KVFrame, a KVAck): it ends its call."""


def _message_length(prefix: bytearray, limit: int) -> int:
    """The length a Length-Prefixed-Message's 5-byte prefix gives, if this side takes such a message."""
    length = int.from_bytes(prefix[1:], "big")
    if prefix[0]:
        raise MalformedMessage("a compressed message, though no grpc-encoding was agreed")
    if length > limit:
        raise MalformedMessage(f"a message of {length} bytes, over the limit of {limit}")
    return length


class _MessageReader:
    """Length-prefixed gRPC messages out of a stream's DATA, each read straight into one buffer
    (kept for the next: `on_message`'s view is valid only during the call)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._prefix = bytearray(5)
        self._buffer = bytearray()
        self._length: int | None = None  # the message being read, once its prefix is in
        self._filled = 0  # of the prefix, then of the message

    @property
    def inside_a_message(self) -> bool:
        return self._length is not None or self._filled > 0

    def read(self, data: http2.DataReader, on_message: Callable[[memoryview], None]) -> None:
        while True:
            if self._length is None:
                if not data.remaining:
                    return
                n = min(5 - self._filled, data.remaining)
                data.read_into(memoryview(self._prefix)[self._filled : self._filled + n])
                self._filled += n
                if self._filled < 5:
                    continue
                length = _message_length(self._prefix, self.limit)
                if len(self._buffer) < length:
                    self._buffer = bytearray(length)
                self._length, self._filled = length, 0
            n = min(self._length - self._filled, data.remaining)
            if n:
                data.read_into(memoryview(self._buffer)[self._filled : self._filled + n])
                self._filled += n
            if self._filled < self._length:
                return
            length, self._length, self._filled = self._length, None, 0
            on_message(memoryview(self._buffer)[:length])


# --- the sending half ------------------------------------------------------------------------------
class _Answer:
    """The receiver's answer to one call: status, details and its KVAck's bytes. Filled on the
    connection's reader thread; `done` once the status is known."""

    def __init__(self) -> None:
        self.status: grpc.StatusCode | None = None
        self.details = ""
        self.ack = b""
        self.done = threading.Event()
        self._headers_seen = False
        self._messages = _MessageReader(_ANSWER_LIMIT)

    def headers(self, headers: list[tuple[str, str]]) -> None:
        fields = dict(headers)
        if not self._headers_seen:
            self._headers_seen = True
            if fields.get(":status") != "200":
                http_status = fields.get(":status", "missing")
                self.end(_HTTP_STATUS.get(http_status, grpc.StatusCode.UNKNOWN), f"HTTP status {http_status}")
                return
        if "grpc-status" in fields:  # trailers (or trailers only)
            value = fields["grpc-status"]
            code = int(value) if value.isascii() and value.isdigit() else -1
            self.end(_STATUS.get(code, grpc.StatusCode.UNKNOWN),
                     urllib.parse.unquote(fields.get("grpc-message", ""), errors="replace"))

    def data(self, data: http2.DataReader) -> None:
        self._messages.read(data, self._take)

    def _take(self, message: memoryview) -> None:
        self.ack = bytes(message)

    def end(self, status: grpc.StatusCode, details: str) -> None:
        if self.status is None:
            self.status, self.details = status, details
        self.done.set()


class _Link:
    """A sender's connection to one receiving half, and the calls open on it (its stream handler)."""

    def __init__(self, address: str, tls: ssl.SSLContext | None) -> None:
        self.address = address
        self._scheme = "https" if tls is not None else "http"
        self._answers: dict[int, _Answer] = {}
        self._lock = threading.Lock()
        self._retired = False  # replaced (its peer is going away): closed once its last call ends
        self.connection = http2.Connection(lambda: pipes.connect(address, tls), self, client=True,
                                           name=f"kv-grpc-to-{address}")
        self.connection.start()  # once `connection` is set: the callbacks use it

    def call(self, metadata: tuple[tuple[str, str], ...]) -> tuple[int, _Answer]:
        """A new PushKV call: its stream, and its answer to come (failed already if the link is)."""
        headers = [(":method", "POST"), (":scheme", self._scheme), (":path", PUSH_PATH), (":authority", self.address),
                   ("te", "trailers"), ("content-type", "application/grpc"), ("user-agent", "pdserve-kv"),
                   *(hpack.NeverIndexedHeaderTuple(name, value) for name, value in metadata)]
        answer = _Answer()
        with self._lock:  # registered before its answer can arrive
            try:
                stream_id = self.connection.open_stream(headers)
            except http2.ConnectionClosed as e:
                answer.end(grpc.StatusCode.UNAVAILABLE, str(e))
                return 0, answer
            self._answers[stream_id] = answer
        return stream_id, answer

    def drop(self, stream_id: int) -> None:
        self._answer(stream_id, done=True)

    def retire(self) -> None:
        with self._lock:
            self._retired = True
        self._close_if_retired()

    def _close_if_retired(self) -> None:
        with self._lock:
            done = self._retired and not self._answers
        if done:
            self.connection.close("replaced: the receiver went away")

    def _answer(self, stream_id: int, done: bool = False) -> _Answer | None:
        with self._lock:
            answer = self._answers.pop(stream_id, None) if done else self._answers.get(stream_id)
        if done:
            self._close_if_retired()
        return answer

    # http2.StreamHandler
    def on_headers(self, stream_id: int, headers: list[tuple[str, str]]) -> None:
        if (answer := self._answer(stream_id)) is not None:
            answer.headers(headers)

    def on_data(self, stream_id: int, data: http2.DataReader) -> None:
        if (answer := self._answer(stream_id)) is not None:
            try:
                answer.data(data)
            except MalformedMessage as e:
                self.drop(stream_id)
                answer.end(grpc.StatusCode.INTERNAL, f"the receiver's answer: {e}")
                self.connection.reset(stream_id, http2.ErrorCode.PROTOCOL_ERROR)

    def on_end(self, stream_id: int) -> None:
        if (answer := self._answer(stream_id, done=True)) is not None:
            answer.end(grpc.StatusCode.INTERNAL, "the receiver ended the call without a gRPC status")

    def on_reset(self, stream_id: int, code: int) -> None:
        if (answer := self._answer(stream_id, done=True)) is not None:
            answer.end(_RESET_STATUS.get(code, grpc.StatusCode.INTERNAL),
                       f"the receiver reset the stream ({http2.ErrorCode.name_of(code)})")

    def on_closed(self, reason: str) -> None:
        with self._lock:
            answers, self._answers = list(self._answers.values()), {}
        for answer in answers:
            answer.end(grpc.StatusCode.UNAVAILABLE, f"connection to {self.address}: {reason}")


class GrpcChannel:
    device = None  # payloads are host bytes

    def __init__(self, link: _Link, transfer_id: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.transfer_id = transfer_id
        self.bytes_sent = 0
        self._link = link
        self._ended = False  # the stream's end is queued (finish) or it was cancelled (close)
        self._stream_id, self._answer = link.call(metadata)

    def send(self, header: FrameHeader, payload: Payload) -> None:
        if self._ended:
            raise TransferError(f"transfer {self.transfer_id}: the stream is closed")
        view = memoryview(payload).cast("B")
        for offset in range(0, max(view.nbytes, 1), PIECE_BYTES):
            piece = view[offset : offset + PIECE_BYTES]
            self._wait_for_room()
            try:
                self._link.connection.send_data(self._stream_id, [_fields(header, offset, piece.nbytes), piece])
            except http2.ConnectionClosed:
                self._stream_ended()
        self.bytes_sent += view.nbytes

    def _wait_for_room(self) -> None:
        connection = self._link.connection
        if not connection.wait_for_room(self._stream_id, WINDOW_BYTES, SEND_TIMEOUT_S):
            # The connection wrote nothing for that long: every call on it is stuck behind the same
            # socket. Closed, so they all fail now, and the next transfer connects anew.
            connection.close(f"stalled: wrote nothing for {SEND_TIMEOUT_S:g} s")
            raise TransferError(f"transfer {self.transfer_id}: the KV stream took nothing for {SEND_TIMEOUT_S:g} s")
        if self._ended:
            raise TransferError(f"transfer {self.transfer_id}: the stream is closed")
        if self._answer.done.is_set():
            self._stream_ended()

    def _stream_ended(self) -> NoReturn:
        """The receiver answered (a refusal), or the stream or connection went, before the last frame."""
        self._answer.done.wait(ANSWER_WAIT_S)  # an answer that closed the stream is reported just after
        if (closed := self._link.connection.closed) is not None:  # reported once its threads are out: say it now
            self._answer.end(grpc.StatusCode.UNAVAILABLE, f"connection to {self._link.address}: {closed}")
        self.finish(0)  # raises the answer's error, if it is one
        raise TransferError(f"transfer {self.transfer_id}: the KV stream ended before its last frame")

    def finish(self, timeout: float) -> None:
        self._end_stream()
        if not self._answer.done.wait(timeout):
            connection = self._link.connection
            # A wait as long as a stall whose whole length brought nothing back: the link is dead (a
            # busy receiver is silent for a while, so a shorter wait, a drain's, says nothing of it).
            if timeout >= SEND_TIMEOUT_S and connection.silent_for() >= timeout:
                connection.close(f"the receiver sent nothing for {connection.silent_for():.0f} s")
            raise TransferError(f"KV stream did not finish within {timeout:g} s")
        answer = self._answer
        if answer.status is not grpc.StatusCode.OK:
            raise TransferError(f"KV stream failed: {answer.status.name}: {answer.details}")
        try:
            ack = kv_transfer_pb2.KVAck.FromString(answer.ack)
        except DecodeError as e:
            raise TransferError(f"KV receiver's answer does not parse: {e}") from None
        if ack.error:
            raise TransferError(f"KV receiver ended the stream: {ack.error}")

    def close(self) -> None:
        self._ended = True
        self._answer.end(grpc.StatusCode.CANCELLED, "closed by the sender")  # unless it was answered
        # Both are no-ops once the call ended; a stream a peer left half-done is cancelled (the receiver drops it).
        self._link.drop(self._stream_id)
        self._link.connection.reset(self._stream_id, http2.ErrorCode.CANCEL)

    def _end_stream(self) -> None:
        if not self._ended:
            self._ended = True
            try:
                self._link.connection.send_data(self._stream_id, [], end_stream=True)
            except http2.ConnectionClosed:
                pass  # the answer says what ended it


class GrpcSender:
    name = "grpc"

    def __init__(self, tls: dict[str, str] | None = None, secret: ClusterSecret | None = None) -> None:
        self._metadata = ((CLUSTER_METADATA, secret.token),) if secret is not None else ()
        self._tls = _tls_context(tls, server_side=False) if tls else None
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()

    def open(self, address: str, transfer_id: str) -> GrpcChannel:
        with self._lock:
            link = self._links.get(address)
            if link is None or not link.connection.accepts_streams:  # made on first use, and anew once gone
                if link is not None:
                    link.retire()  # its calls under way go on (a GOAWAY lets them finish)
                link = self._links[address] = _Link(address, self._tls)
        return GrpcChannel(link, transfer_id, self._metadata)

    def forget(self, address: str) -> None:
        with self._lock:
            link = self._links.pop(address, None)
        if link is not None:
            link.connection.close(f"{address} left")

    def close(self) -> None:
        for address in list(self._links):
            self.forget(address)


# --- the receiving half ----------------------------------------------------------------------------
class _KVTransferService:
    """What every PushKV call on a receiving half shares: the sink, the token, and the counts of calls refused."""

    def __init__(self, sink: FrameSink, token: str | None = None) -> None:
        self.sink = sink
        self._token = token.encode() if token is not None else None
        self.refused = 0  # calls ended for want of the cluster's token
        self.malformed = 0  # calls ended by a message that is no KVFrame, or by a frame's inconsistent pieces
        self._counting = threading.Lock()  # connections count on their own reader threads

    def count(self, what: str) -> int:
        with self._counting:
            setattr(self, what, getattr(self, what) + 1)
            return getattr(self, what)

    def refusal(self, headers: dict[str, str]) -> tuple[str, grpc.StatusCode, str] | None:
        """Why a call with these request headers is not taken: (HTTP status, gRPC status, message)."""
        if headers.get(":method") != "POST" or not headers.get("content-type", "").startswith("application/grpc"):
            return "415", grpc.StatusCode.UNKNOWN, "a gRPC call is a POST of application/grpc"
        if headers.get(":path") != PUSH_PATH:
            return "200", grpc.StatusCode.UNIMPLEMENTED, f"no method {headers.get(':path')!r} here; {PUSH_PATH} is"
        if self._token is not None and not hmac.compare_digest(headers.get(CLUSTER_METADATA, "").encode(),
                                                               self._token):
            return "200", grpc.StatusCode.UNAUTHENTICATED, "KV stream without this cluster's secret: refused"
        return None


def _payload_last(head: memoryview, length: int) -> tuple[int, int] | None:
    """Where a KVFrame message of `length` bytes has its payload, if the payload field is its last
    and starts within `head` (its first bytes): (where the field's tag is, where its bytes start)."""
    at = 0
    try:
        while at < len(head):
            tag, after = _read_varint(head, at)
            wire_type = tag & 7
            if wire_type == 2:
                size, start = _read_varint(head, after)
                if tag >> 3 == _PAYLOAD:
                    return (at, start) if start + size == length else None
                at = start + size
            elif wire_type == 0:
                at = _read_varint(head, after)[1]
            elif wire_type in (1, 5):
                at = after + (8 if wire_type == 1 else 4)
            else:
                return None  # not a field: the whole message's parse says so
    except (IndexError, ValueError):  # a varint cut by the head's end, or too long
        return None
    return None


class _PushKV:
    """One PushKV call on the receiving side: its messages read off the wire, the frames they make,
    and what it took. A message whose payload field comes last (as pdserve's senders write them) has
    its first HEAD_BYTES read, its fields parsed, and its payload read from the socket straight into
    its frame's buffer, at its offset: a frame in several pieces (in order, each right after the last)
    is put together without a copy. Any other message is read whole, parsed (`_parse`) and its payload
    copied there. A call starts with the connection's spare buffer and leaves its own (`release`)."""

    def __init__(self, service: _KVTransferService, spares: list[bytearray]) -> None:
        self._service = service
        self._spares = spares
        self.frames = self.corrupt = 0
        self._prefix = bytearray(5)
        self._head = bytearray(HEAD_BYTES)
        self._whole = bytearray()  # a message whose payload is not last
        self._frame = bytearray()  # the frame being put together: the sink's view is valid only during its call
        self._assembling: FrameHeader | None = None
        self._piece: tuple[FrameHeader, int] | None = None  # the frame and the end of the piece being read
        self._next_offset = 0  # where the frame being put together takes its next piece
        self._stage, self._length, self._filled = "prefix", 0, 0
        self._target = memoryview(self._prefix)  # where the stage's bytes go

    def read(self, data: http2.DataReader) -> None:
        """Take a DATA frame's bytes; TransferError ends the call (answered with it)."""
        try:
            while data.remaining:
                n = min(len(self._target) - self._filled, data.remaining)
                data.read_into(self._target[self._filled : self._filled + n])
                self._filled += n
                if self._filled == len(self._target):
                    self._stage_done()
        except MalformedMessage:
            self._service.count("malformed")
            raise

    def end(self) -> None:
        if self._stage != "prefix" or self._filled:
            self._service.count("malformed")
            raise MalformedMessage("the stream ended inside a message")

    def release(self) -> None:
        """The call is over: its frame buffer may serve the connection's next call."""
        if len(self._spares[0] if self._spares else b"") < len(self._frame) <= SPARE_MAX_BYTES:
            self._spares[:] = [self._frame]
        self._frame = bytearray()

    def _next(self, stage: str, target: memoryview, filled: int = 0) -> None:
        self._stage, self._target, self._filled = stage, target, filled
        if filled == len(target):  # nothing left to read for it (an empty payload, a head that held it all)
            self._stage_done()

    def _stage_done(self) -> None:
        if self._stage == "prefix":
            self._length = _message_length(self._prefix, _MESSAGE_LIMIT)
            self._next("head", memoryview(self._head)[: min(self._length, HEAD_BYTES)])
        elif self._stage == "head":
            self._take_head()
        elif self._stage == "payload":
            self._piece_done()
        else:  # "whole"
            self._take_whole(memoryview(self._whole)[: self._length])

    def _take_head(self) -> None:
        head = self._target
        found = _payload_last(head, self._length)
        if found is None:  # read it whole, then parse it
            if len(self._whole) < self._length:
                self._whole = bytearray(self._length)
            self._whole[: len(head)] = head
            if len(head) == self._length:
                self._take_whole(memoryview(self._whole)[: self._length])
            else:
                self._next("whole", memoryview(self._whole)[: self._length], len(head))
            return
        fields_end, start = found
        try:
            message = kv_transfer_pb2.KVFrame.FromString(head[:fields_end])
        except DecodeError as e:
            raise MalformedMessage(f"malformed KVFrame message: {e}") from None
        target = self._place(message, self._length - start)
        target[: len(head) - start] = head[start:]  # the payload's first bytes came with the head
        self._next("payload", target, len(head) - start)

    def _take_whole(self, data: memoryview) -> None:
        try:
            message, payload = _parse(data)
        except (ValueError, IndexError, DecodeError) as e:
            raise MalformedMessage(f"malformed KVFrame message: {e}") from None
        self._place(message, payload.nbytes)[:] = payload
        self._piece_done()

    def _place(self, message: kv_transfer_pb2.KVFrame, size: int) -> memoryview:
        """Where a message's payload of `size` bytes goes in its frame's buffer."""
        header = FrameHeader(message.transfer_id, message.layer, message.start_token, message.num_tokens,
                             message.codec, message.level, message.crc32, message.payload_bytes)
        end = message.offset + size
        if header.payload_bytes > MAX_FRAME_BYTES or end > header.payload_bytes:
            raise MalformedMessage(f"message bytes [{message.offset}, {end}) of a {header.payload_bytes}-byte frame")
        if message.offset == 0:
            self._assembling = header
            if not self._frame and self._spares:
                self._frame = self._spares.pop()
            if len(self._frame) < header.payload_bytes:
                self._frame = bytearray(header.payload_bytes)
        elif self._assembling != header or message.offset != self._next_offset:
            raise MalformedMessage("a frame's messages arrived out of order")
        self._piece, self._next_offset = (header, end), end
        return memoryview(self._frame)[message.offset : end]

    def _piece_done(self) -> None:
        header, end = self._piece
        self._next("prefix", memoryview(self._prefix))
        if end < header.payload_bytes:
            return  # more pieces of the frame to come
        self._assembling = None
        try:
            self._service.sink(header, memoryview(self._frame)[: header.payload_bytes])
            self.frames += 1
        except CorruptFrame:
            self.corrupt += 1

    def ack(self, error: str = "") -> bytes:
        return kv_transfer_pb2.KVAck(frames=self.frames, corrupt_frames=self.corrupt, error=error).SerializeToString()


class _Accepted:
    """A connection a receiving half accepted, and the calls open on it (its stream handler)."""

    def __init__(self, sock: socket.socket, tls: ssl.SSLContext | None, service: _KVTransferService,
                 on_closed: Callable[[_Accepted], None]) -> None:
        self._service = service
        self._calls: dict[int, _PushKV] = {}  # these two only on the connection's reader thread
        self._spares: list[bytearray] = []
        self._on_closed = on_closed
        self.peer = pipes.peer_name(sock)
        self.deadline: float | None = time.monotonic() + CALL_DEADLINE_S  # for its first call taken (None: made)
        self._refusals = 0
        self.connection = http2.Connection(lambda: pipes.accepted(sock, tls), self, client=False,
                                           name=f"kv-grpc-from-{self.peer}")
        self.connection.start()  # once `connection` is set: the callbacks use it

    def _end_call(self, stream_id: int) -> _PushKV | None:
        call = self._calls.pop(stream_id, None)
        if call is not None:
            call.release()
        return call

    def _answer(self, stream_id: int, call: _PushKV, error: str = "") -> None:
        """Headers, the call's KVAck (with `error` when this side ended it), and trailers with OK."""
        connection = self.connection
        connection.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
        ack = call.ack(error)
        try:
            connection.send_data(stream_id, [_prefix(len(ack)), ack])
        except http2.ConnectionClosed:  # the client reset the stream, or the connection went: nobody to tell
            return
        connection.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)

    def _refuse(self, stream_id: int, http_status: str, status: grpc.StatusCode, message: str) -> None:
        """A trailers-only answer."""
        headers = [(":status", http_status), ("content-type", "application/grpc")]
        if http_status == "200":
            headers += [("grpc-status", str(status.value[0])),
                        ("grpc-message", urllib.parse.quote(message, safe=_MESSAGE_SAFE))]
        self.connection.send_headers(stream_id, headers, end_stream=True)

    # http2.StreamHandler
    def on_headers(self, stream_id: int, headers: list[tuple[str, str]]) -> None:
        if stream_id in self._calls:
            return  # a client's trailers: gRPC clients send none, and they would say nothing here
        refusal = self._service.refusal(dict(headers))
        if refusal is None:
            self.deadline = None
            self._calls[stream_id] = _PushKV(self._service, self._spares)
            return
        if refusal[1] is grpc.StatusCode.UNAUTHENTICATED:
            refused = self._service.count("refused")
            self._refusals += 1
            if self._refusals == 1:  # once per connection: a stranger's flood of calls writes one line
                log.warning("KV grpc receiver: refused a stream from %s without this cluster's secret (%d so far)",
                            self.peer, refused)
        self._refuse(stream_id, *refusal)

    def on_data(self, stream_id: int, data: http2.DataReader) -> None:
        if (call := self._calls.get(stream_id)) is None:
            return  # refused or answered: dropped
        try:
            call.read(data)
        except TransferError as e:  # the call ends here, answered with why
            self._end_call(stream_id)
            self._answer(stream_id, call, str(e))
        except (OSError, EOFError):  # the connection's failure, not the call's: it ends them all
            raise
        except Exception as e:  # a fault of this side's: logged, the call answered UNKNOWN, the connection kept
            log.exception("KV grpc receiver: a call from %s failed", self.peer)
            self._end_call(stream_id)
            self._refuse(stream_id, "200", grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}")

    def on_end(self, stream_id: int) -> None:
        if (call := self._end_call(stream_id)) is None:
            return
        try:
            call.end()
        except TransferError as e:
            self._answer(stream_id, call, str(e))
            return
        self._answer(stream_id, call)

    def on_reset(self, stream_id: int, code: int) -> None:
        self._end_call(stream_id)  # cancelled: what it brought is in, its lease expires if no commit comes

    def on_closed(self, reason: str) -> None:
        self._calls.clear()
        self._spares.clear()
        self._on_closed(self)


class GrpcReceiver:
    name = "grpc"

    def __init__(self, sink: FrameSink, host: str = "127.0.0.1", tls: dict[str, str] | None = None,
                 secret: ClusterSecret | None = None,
                 on_crash: Callable[[BaseException], None] = lambda error: None) -> None:
        self.service = _KVTransferService(sink, secret.token if secret is not None else None)
        self._tls = _tls_context(tls, server_side=True) if tls else None
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=128)
        self._listener.settimeout(ACCEPT_POLL_S)
        self.address = pipes.join_address(host, self._listener.getsockname()[1])
        self._connections: set[_Accepted] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._accepting = start_guarded("kv-grpc-accept", self._accept_loop, on_crash)
        log.info("KV grpc receiver listening on %s%s%s", self.address, " (mutual TLS)" if tls else "",
                 " (cluster secret)" if secret is not None else "")
        if not tls and not _is_loopback(host):
            log.warning("KV grpc receiver on %s without kv_transfer.tls: the KV%s crosses the network in clear "
                        "text, so whoever can read this network can read it%s", self.address,
                        " and the cluster's token" if secret is not None else "",
                        ", and send KV of its own with the token" if secret is not None else "")

    def _accept_loop(self) -> None:
        while not self._stopping:
            self._close_late_connections()
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stopping:
                    return
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED):
                    raise
                log.warning("KV grpc receiver on %s cannot accept a connection now: %s", self.address, e)
                time.sleep(ACCEPT_POLL_S)
                continue
            with self._lock:
                if self._stopping or len(self._connections) >= MAX_CONNECTIONS:
                    if not self._stopping:
                        log.warning("KV grpc receiver on %s: %d connections open, refusing another",
                                    self.address, MAX_CONNECTIONS)
                    sock.close()
                    continue
                self._connections.add(_Accepted(sock, self._tls, self.service, self._closed))

    def _close_late_connections(self) -> None:
        """A connection that made no call this receiver takes within CALL_DEADLINE_S (a stranger, or a
        peer that connects and says nothing) gives its place up: the connections' cap is not theirs."""
        now = time.monotonic()
        with self._lock:
            late = [c for c in self._connections if c.deadline is not None and c.deadline < now]
        for accepted in late:
            accepted.connection.close(f"no call taken within {CALL_DEADLINE_S:g} s of connecting")

    def _closed(self, accepted: _Accepted) -> None:
        with self._lock:
            self._connections.discard(accepted)

    def stop(self) -> None:
        self._stopping = True
        self._accepting.join(ACCEPT_POLL_S * 4)
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for accepted in connections:
            accepted.connection.close("the receiving half stopped")
        for accepted in connections:
            accepted.connection.reader.join(ACCEPT_POLL_S * 4)
