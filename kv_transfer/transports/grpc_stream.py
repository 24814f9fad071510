"""grpc: gRPC client streaming on grpcio (`KVTransfer.PushKV` of kv_transfer.proto), for networks
that pass only HTTP/2 (service meshes, L7 proxies); mutual TLS when the manifest gives certificates.

A channel is one `PushKV` call fed from a queue: `send` cuts a frame into messages of at most
PIECE_BYTES and returns once grpcio has taken all but WINDOW_BYTES of what was queued (so the sender
keeps pace with the link and its lease is renewed as frames go); `finish` ends the stream and reads
the receiver's `KVAck`. A sender keeps one HTTP/2 channel per decode worker, so calls share its
connection. grpcio copies each message into its core and out again; the `tcp` transport moves the
same frames without those copies (docs/benchmarks.md has both side by side).

With the cluster's secret, each call carries a proof of membership made for it (`_proof`: an HMAC
of the call's time, a fresh nonce and its transfer id under the cluster's key), never the key: a
receiver that has the secret ends a call whose proof does not hold, is older than PROOF_WINDOW_S
or was seen before UNAUTHENTICATED before it reads a message, and the call may carry frames of its
own transfer only. The receiver admits each frame's header with the sink before it puts a frame's
pieces together (`FrameSink.admit_frame`), so no header makes it allocate more than a reservation
holds; grpcio bounds each message (MESSAGE_LIMIT), the calls at once (MAX_CALLS) and the time a
connection may take to set up.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from pdserve.kv_transfer.interface import (MAX_FRAME_BYTES, CorruptFrame, FrameHeader, FrameSink, Payload,
                                          TransferError, shown)
from pdserve.kv_transfer.transports.gate import RefusalLog
from pdserve.kv_transfer.transports.tcp import join_address
from pdserve.proto.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

if TYPE_CHECKING:
    from pdserve.wire import ClusterSecret

log = logging.getLogger(__name__)

_SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
PROOF_METADATA = "x-pdserve-proof"  # "<unix ms>.<nonce, hex>.<HMAC-SHA256, hex>" (`_proof`)
TRANSFER_METADATA = "x-pdserve-transfer"  # the one transfer whose frames the call carries
PROOF_WINDOW_S = 120.0  # a proof this much older or newer than the receiver's clock is refused
NONCES_KEPT = 1 << 16  # proofs remembered within the window (against replays); past that, calls wait their turn
# A frame's bytes per message: grpcio moved messages of 1-1.5 MiB faster than larger ones on loopback
# (docs/benchmarks.md); within the 4 MiB other gRPC implementations take by default.
PIECE_BYTES = 3 << 19
MESSAGE_LIMIT = (4 << 20) + (64 << 10)  # a piece of at most 4 MiB and its header fields
WINDOW_BYTES = 64 << 20  # queued on a call and not yet taken by grpcio, at most (a piece more)
SEND_TIMEOUT_S = 30.0  # a call that takes nothing for this long has stalled
# Each transfer's call holds a server thread from its lease to its commit: as many as the decode
# worker's actor takes calls at once, so its transfers are not what runs out; calls beyond wait.
MAX_CALLS = 64
OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    # Large windows: the default flow control stalls a single fast stream on loopback.
    ("grpc.http2.lookahead_bytes", 16 << 20),
    ("grpc.http2.write_buffer_size", 16 << 20),
    # A peer that vanished without closing (half-open) is noticed within ~40 s on both ends.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]
SERVER_OPTIONS = [
    *OPTIONS,
    ("grpc.server_handshake_timeout_ms", 5_000),  # a connection's TLS and HTTP/2 set-up, before any call
    ("grpc.max_connection_idle_ms", 60_000),  # a connection that carries no call for a minute is closed
    ("grpc.max_concurrent_streams", MAX_CALLS),
]


def _read_tls(tls: dict[str, str]) -> tuple[bytes, bytes, bytes]:
    missing = {"cert", "key", "ca"} - set(tls)
    if missing:
        raise ValueError(f"KV TLS needs cert, key and ca (mutual TLS); missing {sorted(missing)}")
    for name in ("cert", "key", "ca"):
        if not Path(tls[name]).is_file():
            raise ValueError(f"KV TLS {name} file {tls[name]!r} does not exist")
    return tuple(Path(tls[k]).read_bytes() for k in ("cert", "key", "ca"))  # type: ignore[return-value]


def _mac(key: bytes, millis: str, nonce: str, transfer_id: str) -> str:
    message = "\n".join(("pdserve-kv-grpc", millis, nonce, transfer_id)).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _proof(key: bytes, transfer_id: str) -> str:
    """A proof of membership for one call of `transfer_id`'s frames, made now."""
    millis, nonce = str(int(time.time() * 1000)), secrets.token_hex(16)
    return f"{millis}.{nonce}.{_mac(key, millis, nonce, transfer_id)}"


class _Proofs:
    """The receiving side's check of calls' proofs, with the nonces seen within the window."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it stops mattering (monotonic)
        self._lock = threading.Lock()

    def check(self, proof: str, transfer_id: str) -> str | None:
        """Why the proof does not hold, or None."""
        millis, _, rest = proof.partition(".")
        nonce, _, mac = rest.partition(".")
        if not millis.isascii() or not millis.isdigit() or len(nonce) != 32:
            return "a malformed proof"
        if not hmac.compare_digest(mac.encode(), _mac(self._key, millis, nonce, transfer_id).encode()):
            return "a proof that does not match this cluster's key"
        if abs(time.time() - int(millis) / 1000) > PROOF_WINDOW_S:
            return f"a proof made more than {PROOF_WINDOW_S:g} s from this receiver's clock"
        now = time.monotonic()
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "a proof used before"
            if len(self._seen) >= NONCES_KEPT:
                return "too many calls within the proofs' window"
            self._seen[nonce] = now + 2 * PROOF_WINDOW_S
        return None


class GrpcChannel:
    device = None  # payloads are host bytes

    def __init__(self, push: grpc.StreamUnaryMultiCallable, transfer_id: str,
                 metadata: tuple[tuple[str, str], ...]) -> None:
        self.transfer_id = transfer_id
        self.bytes_sent = 0
        self._queue: queue.SimpleQueue[kv_transfer_pb2.KVFrame | None] = queue.SimpleQueue()
        self._ended = False
        self._queued_bytes = 0  # put on the queue and not yet taken by grpcio's request thread
        self._taken = threading.Condition()
        self._call = push.future(self._messages(), metadata=metadata)
        self._call.add_done_callback(lambda _: self._wake())

    def _messages(self) -> Iterator[kv_transfer_pb2.KVFrame]:
        """The call's messages, as grpcio's request thread takes them."""
        for message in iter(self._queue.get, None):
            with self._taken:
                self._queued_bytes -= len(message.payload)
                self._taken.notify_all()
            yield message

    def _wake(self) -> None:
        with self._taken:
            self._taken.notify_all()

    def send(self, header: FrameHeader, payload: Payload) -> None:
        view = memoryview(payload).cast("B")
        for offset in range(0, max(view.nbytes, 1), PIECE_BYTES):
            piece = bytes(view[offset : offset + PIECE_BYTES])
            self._wait_for_room()
            with self._taken:
                self._queued_bytes += len(piece)
            self._queue.put(kv_transfer_pb2.KVFrame(
                transfer_id=header.transfer_id, layer=header.layer, start_token=header.start_token,
                num_tokens=header.num_tokens, codec=header.codec, level=header.level, crc32=header.crc32,
                payload_bytes=header.payload_bytes, offset=offset, payload=piece))
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
            raise TransferError(f"KV receiver refused a frame: {ack.error}")

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
        self._key = secret.key if secret is not None else None
        self._credentials = None
        if tls:
            cert, key, ca = _read_tls(tls)
            self._credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                                             certificate_chain=cert)
        self._channels: dict[str, tuple[grpc.Channel, kv_transfer_pb2_grpc.KVTransferStub]] = {}
        self._lock = threading.Lock()

    def open(self, address: str, transfer_id: str) -> GrpcChannel:
        with self._lock:
            if address not in self._channels:
                channel = (grpc.secure_channel(address, self._credentials, options=OPTIONS) if self._credentials
                           else grpc.insecure_channel(address, options=OPTIONS))
                self._channels[address] = (channel, kv_transfer_pb2_grpc.KVTransferStub(channel))
            stub = self._channels[address][1]
        metadata = [(TRANSFER_METADATA, transfer_id)]
        if self._key is not None:
            metadata.append((PROOF_METADATA, _proof(self._key, transfer_id)))
        return GrpcChannel(stub.PushKV, transfer_id, tuple(metadata))

    def forget(self, address: str) -> None:
        with self._lock:
            entry = self._channels.pop(address, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        for address in list(self._channels):
            self.forget(address)


class _Frames:
    """One call's frames, piece by piece. Each frame is admitted by the sink before its pieces are put
    together; the first frame the sink refuses (at admission or when whole) ends the call."""

    def __init__(self, sink: FrameSink, transfer_id: str) -> None:
        self.sink = sink
        self.transfer_id = transfer_id
        self.buffer = bytearray()  # kept across the call's frames: the sink's view is valid only during its call
        self.header: FrameHeader | None = None  # the frame whose pieces are coming
        self.filled = 0
        self.refusal: str | None = None
        self.taken = self.corrupt = 0  # frames the sink took, and those it found corrupt

    def take(self, message: kv_transfer_pb2.KVFrame) -> None:
        header = FrameHeader(message.transfer_id, message.layer, message.start_token, message.num_tokens,
                             message.codec, message.level, message.crc32, message.payload_bytes)
        if message.offset == 0:
            self._start(header)
            if self.refusal is not None:
                return
        elif header != self.header or message.offset != self.filled:
            raise TransferError(f"a frame's pieces arrived out of order (byte {message.offset}, "
                                f"{self.filled} expected)")
        start, end = self.filled, self.filled + len(message.payload)
        if end > header.payload_bytes:
            raise TransferError(f"message bytes [{start}, {end}) of a {header.payload_bytes}-byte frame")
        self.filled = end
        if start == 0 and end == header.payload_bytes:  # in one message: no copy into the buffer
            self._deliver(header, memoryview(message.payload))
            return
        self.buffer[start:end] = message.payload
        if end == header.payload_bytes:
            self._deliver(header, memoryview(self.buffer)[: header.payload_bytes])

    def _start(self, header: FrameHeader) -> None:
        if self.header is not None and self.filled < self.header.payload_bytes:
            raise TransferError("a frame began before the one before it was whole")
        if header.transfer_id != self.transfer_id:
            raise TransferError(f"a frame of transfer {shown(header.transfer_id)} in a call for "
                                f"{shown(self.transfer_id)}")
        if header.payload_bytes > MAX_FRAME_BYTES:
            raise TransferError(f"frame of {header.payload_bytes} bytes announced (at most {MAX_FRAME_BYTES})")
        self.header, self.filled = header, 0
        try:
            self.sink.admit_frame(header)
        except TransferError as e:
            self.refusal = f"{type(e).__name__}: {e}"
            return
        if len(self.buffer) < header.payload_bytes:
            self.buffer = bytearray(header.payload_bytes)

    def _deliver(self, header: FrameHeader, payload: memoryview) -> None:
        try:
            self.sink.receive_frame(header, payload)
            self.taken += 1
        except CorruptFrame:
            self.corrupt += 1  # its layer is named by `commit` for a resend
        except TransferError as e:
            self.refusal = f"{type(e).__name__}: {e}"


class _KVTransferService:
    """`KVTransfer`: its messages are parsed here (protobuf), so a malformed one ends its call
    INVALID_ARGUMENT, saying why, rather than in grpcio's own INTERNAL."""

    def __init__(self, sink: FrameSink, key: bytes | None, refusals: RefusalLog) -> None:
        self.sink = sink
        self._proofs = _Proofs(key) if key is not None else None
        self.refusals = refusals
        self.malformed = 0  # calls ended by a message no frame can be made of

    def handler(self) -> grpc.GenericRpcHandler:
        push = grpc.stream_unary_rpc_method_handler(self.push_kv, request_deserializer=None,
                                                    response_serializer=kv_transfer_pb2.KVAck.SerializeToString)
        return grpc.method_handlers_generic_handler(_SERVICE, {"PushKV": push})

    def push_kv(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> kv_transfer_pb2.KVAck:
        metadata = dict(context.invocation_metadata() or ())
        transfer_id = str(metadata.get(TRANSFER_METADATA, ""))
        why = self._refusal(transfer_id, str(metadata.get(PROOF_METADATA, "")))
        if why is not None:  # before any message is read: a stranger's bytes are never parsed
            self.refusals.refused_peer(context.peer().rpartition(":")[0], why)  # "ipv4:host:port" -> its host
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"KV call refused: {why}")
        frames = _Frames(self.sink, transfer_id)
        try:
            for data in request_iterator:
                try:
                    message = kv_transfer_pb2.KVFrame.FromString(data)
                except DecodeError as e:
                    raise TransferError(f"not a KVFrame message: {e}") from None
                frames.take(message)
                if frames.refusal is not None:  # its transfer cannot go on: the call ends, so its sender stops
                    break
        except TransferError as e:
            self.malformed += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed KV stream: {e}")
        return kv_transfer_pb2.KVAck(frames=frames.taken, corrupt_frames=frames.corrupt, error=frames.refusal or "")

    def _refusal(self, transfer_id: str, proof: str) -> str | None:
        if not transfer_id:
            return f"no {TRANSFER_METADATA} metadata"
        if self._proofs is None:
            return None
        return self._proofs.check(proof, transfer_id) if proof else f"no {PROOF_METADATA} metadata"


class GrpcReceiver:
    name = "grpc"

    def __init__(self, sink: FrameSink, host: str = "127.0.0.1", tls: dict[str, str] | None = None,
                 secret: ClusterSecret | None = None) -> None:
        # One thread per call, MAX_CALLS at most; grpcio answers RESOURCE_EXHAUSTED past twice that waiting.
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_CALLS, thread_name_prefix="kv-grpc"),
                                   options=SERVER_OPTIONS, maximum_concurrent_rpcs=2 * MAX_CALLS)
        self.service = _KVTransferService(sink, secret.key if secret is not None else None,
                                          RefusalLog(log, "KV grpc receiver"))
        self._server.add_generic_rpc_handlers([self.service.handler()])
        if tls:
            cert, key, ca = _read_tls(tls)
            credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
            port = self._server.add_secure_port(join_address(host, 0), credentials)
        else:
            port = self._server.add_insecure_port(join_address(host, 0))
        self._server.start()
        self.address = join_address(host, port)
        log.info("KV grpc receiver listening on %s%s%s", self.address, " (mutual TLS)" if tls else "",
                 " (cluster secret)" if secret is not None else "")

    def stop(self) -> None:
        self._server.stop(grace=None)
