"""Sending halves of the data plane: one channel per transfer carries layer payloads to the receiver.

  ray   same node: payloads go through the Ray object store as numpy buffers (zero-copy reads on the
        receiving side) in `receive_layer` actor calls.
  grpc  any node: one client stream per transfer to the decode worker's KVTransfer server, layers
        cut into messages of `chunk_bytes` (limits in `interface`), message limits raised on both ends.
Both deliver into the same KVReceiver, which checks each layer's checksum.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import grpc
import torch

from pdserve.kv_transfer.codec import RawCodec, checksum
from pdserve.kv_transfer.interface import (
    GRPC_CHUNK_BYTES,
    GRPC_MAX_CHUNK_BYTES,
    GRPC_MIN_CHUNK_BYTES,
    GRPC_OPTIONS,
    TransferError,
)
from pdserve.proto.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc


class RayChannel:
    def __init__(self, receiver_actor: Any, transfer_id: str) -> None:
        self.actor = receiver_actor
        self.transfer_id = transfer_id
        self.bytes_sent = 0
        self._refs: list[Any] = []

    def push_layer(self, layer: int, tensor: torch.Tensor) -> None:
        payload = RawCodec.encode(tensor)
        self.bytes_sent += payload.nbytes
        self._refs.append(self.actor.receive_layer.remote(self.transfer_id, layer, payload, checksum(payload)))

    def finish(self, timeout: float) -> None:
        import ray

        try:
            ray.get(self._refs, timeout=timeout)
        except Exception as e:  # RayTaskError wraps the receiver's TransferError
            raise TransferError(f"KV delivery over ray failed: {e}") from e

    def close(self) -> None:
        self._refs.clear()  # nothing is held open: each layer was its own actor call


class GrpcChannel:
    def __init__(self, stub: kv_transfer_pb2_grpc.KVTransferStub, transfer_id: str, chunk_bytes: int) -> None:
        self.transfer_id = transfer_id
        self.chunk_bytes = chunk_bytes
        self.bytes_sent = 0
        self._queue: queue.Queue[kv_transfer_pb2.KVChunk | None] = queue.Queue()
        self._layers = 0
        self._closed = False
        self._call = stub.PushKV.future(iter(self._queue.get, None))

    def push_layer(self, layer: int, tensor: torch.Tensor) -> None:
        if self._closed:
            raise TransferError(f"transfer {self.transfer_id}: the stream is closed")
        payload = RawCodec.encode(tensor)
        crc, total = checksum(payload), payload.nbytes
        for offset in range(0, total, self.chunk_bytes):
            piece = payload[offset : offset + self.chunk_bytes]
            last = offset + piece.nbytes >= total
            self._queue.put(kv_transfer_pb2.KVChunk(
                transfer_id=self.transfer_id, layer=layer, offset=offset, layer_bytes=total,
                payload=piece.tobytes(), crc32=crc if last else 0,
            ))
        self.bytes_sent += total
        self._layers += 1

    def finish(self, timeout: float) -> None:
        self._end_stream()
        try:
            ack = self._call.result(timeout=timeout)
        except grpc.RpcError as e:
            raise TransferError(f"KV stream failed: {e.code().name}: {e.details()}") from e
        except grpc.FutureCancelledError as e:
            raise TransferError("KV stream was closed before it finished") from e
        if ack.error or ack.layers_received != self._layers:
            raise TransferError(f"KV stream: receiver took {ack.layers_received}/{self._layers} layers: {ack.error}")

    def close(self) -> None:
        self._end_stream()
        self._call.cancel()  # no-op once the call has finished

    def _end_stream(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)


class GrpcTransport:
    """Keeps one gRPC channel per decode worker address."""

    def __init__(self, chunk_bytes: int = GRPC_CHUNK_BYTES) -> None:
        if not GRPC_MIN_CHUNK_BYTES <= chunk_bytes <= GRPC_MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [{GRPC_MIN_CHUNK_BYTES}, {GRPC_MAX_CHUNK_BYTES}], "
                             f"got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._stubs: dict[str, kv_transfer_pb2_grpc.KVTransferStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def open(self, address: str, transfer_id: str) -> GrpcChannel:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
                self._channels.append(channel)
                stub = self._stubs[address] = kv_transfer_pb2_grpc.KVTransferStub(channel)
        return GrpcChannel(stub, transfer_id, self.chunk_bytes)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
