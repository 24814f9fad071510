"""gRPC client streaming: the cross-node default, over TLS (mutual) when the manifest gives certificates.

A channel is one `PushKV` stream fed from a queue: `send` cuts a frame into messages of at most
`PIECE_BYTES` and returns; `finish` ends the stream and reads the receiver's `KVAck`. The receiving
half hands a frame that came in one message to the sink as a view of the message's bytes (no copy
beyond protobuf's parse); a larger one is assembled into one buffer first. A sender keeps one HTTP/2
channel per decode worker, so streams share its connection.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent import futures
from pathlib import Path

import grpc

from pdserve.kv_transfer.interface import CorruptFrame, FrameHeader, FrameSink, Payload, TransferError
from pdserve.proto.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

log = logging.getLogger(__name__)

PIECE_BYTES = 4 << 20
MAX_FRAME_BYTES = 1 << 30  # a header asking for more is not believed
_MESSAGE_LIMIT = PIECE_BYTES + (64 << 10)  # a piece and its header fields
OPTIONS = [
    ("grpc.max_receive_message_length", _MESSAGE_LIMIT),
    ("grpc.max_send_message_length", _MESSAGE_LIMIT),
    # Large windows: the default flow control stalls a single fast stream on loopback.
    ("grpc.http2.lookahead_bytes", 16 << 20),
    ("grpc.http2.write_buffer_size", 16 << 20),
]


def _read_tls(tls: dict[str, str]) -> tuple[bytes, bytes, bytes]:
    missing = {"cert", "key", "ca"} - set(tls)
    if missing:
        raise ValueError(f"KV TLS needs cert, key and ca (mutual TLS); missing {sorted(missing)}")
    return tuple(Path(tls[k]).read_bytes() for k in ("cert", "key", "ca"))  # type: ignore[return-value]


class GrpcChannel:
    def __init__(self, stub: kv_transfer_pb2_grpc.KVTransferStub, transfer_id: str) -> None:
        self.transfer_id = transfer_id
        self.bytes_sent = 0
        self._queue: queue.SimpleQueue[kv_transfer_pb2.KVFrame | None] = queue.SimpleQueue()
        self._ended = False
        self._call = stub.PushKV.future(iter(self._queue.get, None))

    def send(self, header: FrameHeader, payload: Payload) -> None:
        if self._ended:
            raise TransferError(f"transfer {self.transfer_id}: the stream is closed")
        view = memoryview(payload).cast("B")
        for offset in range(0, max(view.nbytes, 1), PIECE_BYTES):
            self._queue.put(kv_transfer_pb2.KVFrame(
                transfer_id=header.transfer_id, layer=header.layer, start_token=header.start_token,
                num_tokens=header.num_tokens, codec=header.codec, level=header.level, crc32=header.crc32,
                payload_bytes=header.payload_bytes, offset=offset, payload=bytes(view[offset : offset + PIECE_BYTES]),
            ))
        self.bytes_sent += view.nbytes

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


class GrpcSender:
    name = "grpc"

    def __init__(self, tls: dict[str, str] | None = None) -> None:
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
            return GrpcChannel(self._channels[address][1], transfer_id)

    def forget(self, address: str) -> None:
        with self._lock:
            entry = self._channels.pop(address, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        for address in list(self._channels):
            self.forget(address)


class _KVTransferService(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, sink: FrameSink) -> None:
        self.sink = sink

    def PushKV(self, request_iterator, context):  # noqa: N802 (gRPC's name)
        frames = corrupt = 0
        assembling: tuple[FrameHeader, bytearray] | None = None
        try:
            for message in request_iterator:
                header = FrameHeader(message.transfer_id, message.layer, message.start_token, message.num_tokens,
                                     message.codec, message.level, message.crc32, message.payload_bytes)
                end = message.offset + len(message.payload)
                if header.payload_bytes > MAX_FRAME_BYTES or end > header.payload_bytes:
                    raise TransferError(f"message bytes [{message.offset}, {end}) of a "
                                        f"{header.payload_bytes}-byte frame")
                if message.offset == 0 and end == header.payload_bytes:
                    complete = memoryview(message.payload)
                else:
                    if message.offset == 0:
                        assembling = (header, bytearray(header.payload_bytes))
                    if assembling is None or assembling[0] != header:
                        raise TransferError("a frame's messages arrived out of order")
                    assembling[1][message.offset : end] = message.payload
                    if end < header.payload_bytes:
                        continue
                    complete, assembling = memoryview(assembling[1]), None
                try:
                    self.sink(header, complete)
                    frames += 1
                except CorruptFrame:
                    corrupt += 1
        except TransferError as e:
            return kv_transfer_pb2.KVAck(frames=frames, corrupt_frames=corrupt, error=str(e))
        return kv_transfer_pb2.KVAck(frames=frames, corrupt_frames=corrupt)


class GrpcReceiver:
    name = "grpc"

    def __init__(self, sink: FrameSink, host: str = "127.0.0.1", tls: dict[str, str] | None = None,
                 max_workers: int = 16) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=OPTIONS)
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(_KVTransferService(sink), self._server)
        if tls:
            cert, key, ca = _read_tls(tls)
            credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
            port = self._server.add_secure_port(f"{host}:0", credentials)
        else:
            port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()
        self.address = f"{host}:{port}"
        log.info("KV grpc receiver listening on %s%s", self.address, " (mutual TLS)" if tls else "")

    def stop(self) -> None:
        self._server.stop(grace=None)
