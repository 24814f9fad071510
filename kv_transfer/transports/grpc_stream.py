"""gRPC client streaming: the cross-node default, over TLS (mutual) when the manifest gives certificates.

A channel is one `PushKV` stream fed from a queue: `send` cuts a frame into messages of at most
`PIECE_BYTES` (1.5 MiB: grpcio moves a stream of such messages faster than one of larger ones;
measured in docs/benchmarks.md) and returns once grpcio has taken all but `WINDOW_BYTES` of what was
queued (so the sender keeps pace with the link, its lease renewed as frames go, and what is left
when `finish` ends the stream is at most a window, not the whole prompt's KV held in memory behind a
slow link); `finish` ends the stream and reads the receiver's `KVAck`. Each piece becomes a message
only when grpcio's request thread takes it to the wire (the payload stays unchanged until `finish`,
as the channel interface allows); building every message up front in the sending thread moved a
16K-token prompt at about half the rate, measured side by side (docs/benchmarks.md). The receiving
half hands a frame that came in one message to the sink as a view of the message's bytes; a larger
one is assembled first, in a buffer the stream keeps for its next frames. A sender keeps one HTTP/2
channel per decode worker, so streams share its connection.

The messages are `KVFrame`s of kv_transfer.proto on the wire, but the payload field skips protobuf's
copies: the sender writes the small fields with protobuf and appends the payload field itself (field
order is free in protobuf), in one copy from the KV buffer; the receiver cuts the payload field out
as a view and lets protobuf parse the rest (`_encode`, `_parse`). Any protobuf client interoperates.

With the cluster's secret, every stream carries its token as call metadata (`CLUSTER_METADATA`); a
receiver that has the secret ends any stream without it UNAUTHENTICATED before reading a message.
Mutual TLS (the manifest's `kv_transfer.tls`) additionally keeps strangers from connecting at all.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from pdserve.kv_transfer.interface import CorruptFrame, FrameHeader, FrameSink, Payload, TransferError
from pdserve.proto.pdserve.v1 import kv_transfer_pb2

if TYPE_CHECKING:
    from pdserve.wire import ClusterSecret

log = logging.getLogger(__name__)

CLUSTER_METADATA = "x-pdserve-cluster"  # the call metadata key that carries the cluster's token

# A frame's bytes per message. Measured on loopback (docs/benchmarks.md, seventh session): grpcio
# alone moved messages of 1-1.5 MiB faster than larger ones (3 MiB: 20-33% slower, 6 MiB: 32-42%), and
# frames of 6 and 24 MiB (8B- and 7B-class layouts) went 1.17-1.30x faster in pieces of 1.5 MiB than
# of 4 MiB. A 1.5 MiB frame (1,536 tokens of 1 KiB) is one message, which reaches the sink unassembled.
PIECE_BYTES = 3 << 19
MAX_PIECE_BYTES = 4 << 20  # the largest piece a receiver takes (>= PIECE_BYTES): what senders sent before
WINDOW_BYTES = 64 << 20  # queued on a stream and not yet taken by grpcio, at most (a piece more)
SEND_TIMEOUT_S = 30.0  # a stream that takes nothing for this long has stalled
MAX_FRAME_BYTES = 1 << 30  # a header asking for more is not believed
_MESSAGE_LIMIT = MAX_PIECE_BYTES + (64 << 10)  # a piece and its header fields
OPTIONS = [
    ("grpc.max_receive_message_length", _MESSAGE_LIMIT),
    ("grpc.max_send_message_length", _MESSAGE_LIMIT),
    # Large windows: the default flow control stalls a single fast stream on loopback.
    ("grpc.http2.lookahead_bytes", 16 << 20),
    ("grpc.http2.write_buffer_size", 16 << 20),
    # A peer that vanished without closing (half-open connection) is noticed within ~40 s on both
    # ends, so no stream pins a server thread for good.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"


def _read_tls(tls: dict[str, str]) -> tuple[bytes, bytes, bytes]:
    missing = {"cert", "key", "ca"} - set(tls)
    if missing:
        raise ValueError(f"KV TLS needs cert, key and ca (mutual TLS); missing {sorted(missing)}")
    return tuple(Path(tls[k]).read_bytes() for k in ("cert", "key", "ca"))  # type: ignore[return-value]


_SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
_PAYLOAD = kv_transfer_pb2.KVFrame.DESCRIPTOR.fields_by_name["payload"].number
_PAYLOAD_TAG = bytes([_PAYLOAD << 3 | 2])  # a length-delimited field


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
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


def _encode(fields: kv_transfer_pb2.KVFrame, piece: memoryview) -> bytes:
    """A KVFrame message: `fields` (no payload) serialized by protobuf, then the payload field."""
    return b"".join((fields.SerializeToString(), _PAYLOAD_TAG, _varint(piece.nbytes), piece))


def _parse(data: bytes) -> tuple[kv_transfer_pb2.KVFrame, memoryview]:
    """A KVFrame message's payload as a view of `data`, and its other fields parsed by protobuf."""
    view, rest, payload, at = memoryview(data), [], memoryview(b""), 0
    while at < len(data):
        start = at
        tag, at = _read_varint(data, at)
        wire_type = tag & 7
        if wire_type == 0:
            _, at = _read_varint(data, at)
        elif wire_type == 2:
            length, at = _read_varint(data, at)
            if tag >> 3 == _PAYLOAD:
                payload = view[at : at + length]
            at += length
        elif wire_type in (1, 5):
            at += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"wire type {wire_type} at byte {start}")
        if at > len(data):
            raise ValueError("a field runs past the end of the message")
        if tag >> 3 != _PAYLOAD:
            rest.append(view[start:at])
    return kv_transfer_pb2.KVFrame.FromString(b"".join(rest)), payload


class GrpcChannel:
    device = None  # payloads are host bytes

    def __init__(self, push: grpc.StreamUnaryMultiCallable, transfer_id: str,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.transfer_id = transfer_id
        self.bytes_sent = 0
        self._queue: queue.SimpleQueue[tuple[kv_transfer_pb2.KVFrame, memoryview] | None] = queue.SimpleQueue()
        self._ended = False
        self._queued_bytes = 0  # put on the queue and not yet taken by grpcio's request thread
        self._taken = threading.Condition()
        self._call = push.future(self._messages(), metadata=metadata)
        self._call.add_done_callback(lambda _: self._wake())

    def _messages(self) -> Iterator[bytes]:
        for fields, piece in iter(self._queue.get, None):
            with self._taken:
                self._queued_bytes -= piece.nbytes
                self._taken.notify_all()
            yield _encode(fields, piece)

    def _wake(self) -> None:
        with self._taken:
            self._taken.notify_all()

    def send(self, header: FrameHeader, payload: Payload) -> None:
        if self._ended:
            raise TransferError(f"transfer {self.transfer_id}: the stream is closed")
        if self._call.done():  # the receiver ended it (a refused frame) or it broke: `finish` says why
            self.finish(0)
            raise TransferError(f"transfer {self.transfer_id}: the KV stream ended before its last frame")
        view = memoryview(payload).cast("B")
        for offset in range(0, max(view.nbytes, 1), PIECE_BYTES):
            fields = kv_transfer_pb2.KVFrame(
                transfer_id=header.transfer_id, layer=header.layer, start_token=header.start_token,
                num_tokens=header.num_tokens, codec=header.codec, level=header.level, crc32=header.crc32,
                payload_bytes=header.payload_bytes, offset=offset)
            piece = view[offset : offset + PIECE_BYTES]
            self._wait_for_room()
            with self._taken:
                self._queued_bytes += piece.nbytes
            self._queue.put((fields, piece))
        self.bytes_sent += view.nbytes

    def _wait_for_room(self) -> None:
        with self._taken:
            room = self._taken.wait_for(lambda: self._queued_bytes < WINDOW_BYTES or self._ended or self._call.done(),
                                        SEND_TIMEOUT_S)
        if not room:
            raise TransferError(f"transfer {self.transfer_id}: the KV stream took nothing for {SEND_TIMEOUT_S:g} s")
        if self._call.done() and not self._ended:  # the receiver ended it (a refused frame): `finish` says why
            self.finish(0)
        if self._ended or self._call.done():
            raise TransferError(f"transfer {self.transfer_id}: the KV stream ended before its last frame")

    def finish(self, timeout: float) -> None:
        self._end_stream()
        try:
            ack = self._call.result(timeout=timeout)
        except grpc.RpcError as e:
            raise TransferError(f"KV stream failed: {e.code().name}: {e.details()}") from e
        except (grpc.FutureCancelledError, grpc.FutureTimeoutError) as e:
            raise TransferError(f"KV stream did not finish: {type(e).__name__}") from e
        if ack.error:
            raise TransferError(f"KV receiver ended the stream: {ack.error}")

    def close(self) -> None:
        self._end_stream()
        self._call.cancel()  # no-op once the call has finished

    def _end_stream(self) -> None:
        if not self._ended:
            self._ended = True
            self._queue.put(None)
            self._wake()  # a send waiting for room stops


class GrpcSender:
    name = "grpc"

    def __init__(self, tls: dict[str, str] | None = None, secret: ClusterSecret | None = None) -> None:
        self._metadata = ((CLUSTER_METADATA, secret.token),) if secret is not None else ()
        self._credentials = None
        if tls:
            cert, key, ca = _read_tls(tls)
            self._credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                                             certificate_chain=cert)
        self._channels: dict[str, tuple[grpc.Channel, grpc.StreamUnaryMultiCallable]] = {}
        self._lock = threading.Lock()

    def open(self, address: str, transfer_id: str) -> GrpcChannel:
        with self._lock:
            if address not in self._channels:
                channel = (grpc.secure_channel(address, self._credentials, options=OPTIONS) if self._credentials
                           else grpc.insecure_channel(address, options=OPTIONS))
                push = channel.stream_unary(f"/{_SERVICE.full_name}/PushKV", request_serializer=None,
                                            response_deserializer=kv_transfer_pb2.KVAck.FromString)
                self._channels[address] = (channel, push)
            return GrpcChannel(self._channels[address][1], transfer_id, self._metadata)

    def forget(self, address: str) -> None:
        with self._lock:
            entry = self._channels.pop(address, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        for address in list(self._channels):
            self.forget(address)


class _KVTransferService:
    def __init__(self, sink: FrameSink, token: str | None = None) -> None:
        self.sink = sink
        self._token = token.encode() if token is not None else None
        self.refused = 0  # streams ended for want of the cluster's token
        self.malformed = 0  # streams ended by a message that is no KVFrame, or by a frame's inconsistent pieces

    def _is_member(self, context: grpc.ServicerContext) -> bool:
        if self._token is None:
            return True
        given = dict(context.invocation_metadata() or ()).get(CLUSTER_METADATA, "")
        return hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._token)

    def handler(self) -> grpc.GenericRpcHandler:
        push = grpc.stream_unary_rpc_method_handler(self.push_kv, request_deserializer=None,
                                                    response_serializer=kv_transfer_pb2.KVAck.SerializeToString)
        return grpc.method_handlers_generic_handler(_SERVICE.full_name, {"PushKV": push})

    def push_kv(self, request_iterator, context) -> kv_transfer_pb2.KVAck:
        if not self._is_member(context):  # before any message is read: a stranger's bytes are never parsed
            self.refused += 1
            log.warning("KV grpc receiver: refused a stream from %s without this cluster's secret (%d so far)",
                        context.peer(), self.refused)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "KV stream without this cluster's secret: refused")
        frames = corrupt = 0
        assembling: FrameHeader | None = None  # the frame whose pieces are being put together in `buffer`
        buffer = bytearray()  # kept across the stream's frames: the sink's view is valid only during its call
        try:
            for data in request_iterator:
                try:
                    message, piece = _parse(data)
                except (ValueError, IndexError, DecodeError) as e:
                    self.malformed += 1
                    raise TransferError(f"malformed KVFrame message: {e}") from None
                header = FrameHeader(message.transfer_id, message.layer, message.start_token, message.num_tokens,
                                     message.codec, message.level, message.crc32, message.payload_bytes)
                end = message.offset + piece.nbytes
                if header.payload_bytes > MAX_FRAME_BYTES or end > header.payload_bytes:
                    self.malformed += 1
                    raise TransferError(f"message bytes [{message.offset}, {end}) of a "
                                        f"{header.payload_bytes}-byte frame")
                if message.offset == 0 and end == header.payload_bytes:
                    complete = piece
                else:
                    if message.offset == 0:
                        assembling = header
                        if len(buffer) < header.payload_bytes:
                            buffer = bytearray(header.payload_bytes)
                    if assembling != header:
                        self.malformed += 1
                        raise TransferError("a frame's messages arrived out of order")
                    buffer[message.offset : end] = piece
                    if end < header.payload_bytes:
                        continue
                    complete, assembling = memoryview(buffer)[: header.payload_bytes], None
                try:
                    self.sink(header, complete)
                    frames += 1
                except CorruptFrame:
                    corrupt += 1
        except TransferError as e:
            return kv_transfer_pb2.KVAck(frames=frames, corrupt_frames=corrupt, error=str(e))
        return kv_transfer_pb2.KVAck(frames=frames, corrupt_frames=corrupt)


# Each transfer's stream holds a server thread from its lease to its commit (the whole prompt pass):
# a stream beyond them is not read until one ends, and its lease lapses meanwhile. As many as the
# decode worker's actor takes calls at once (ACTOR_CONCURRENCY), so its transfers are not what runs out.
STREAM_THREADS = 64


class GrpcReceiver:
    name = "grpc"

    def __init__(self, sink: FrameSink, host: str = "127.0.0.1", tls: dict[str, str] | None = None,
                 max_workers: int = STREAM_THREADS, secret: ClusterSecret | None = None) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=OPTIONS)
        self.service = _KVTransferService(sink, secret.token if secret is not None else None)
        self._server.add_generic_rpc_handlers([self.service.handler()])
        if tls:
            cert, key, ca = _read_tls(tls)
            credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
            port = self._server.add_secure_port(f"{host}:0", credentials)
        else:
            port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()
        self.address = f"{host}:{port}"
        log.info("KV grpc receiver listening on %s%s%s", self.address, " (mutual TLS)" if tls else "",
                 " (cluster secret)" if secret is not None else "")
        if not tls and not _is_loopback(host):
            log.warning("KV grpc receiver on %s without kv_transfer.tls: the KV%s crosses the network in clear "
                        "text, so whoever can read this network can read it%s", self.address,
                        " and the cluster's token" if secret is not None else "",
                        ", and send KV of its own with the token" if secret is not None else "")

    def stop(self) -> None:
        self._server.stop(grace=None)
