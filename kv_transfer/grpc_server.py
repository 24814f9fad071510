"""The decode worker's KVTransfer gRPC service: reassembles layer payloads and hands them on."""

from __future__ import annotations

from concurrent import futures

import grpc

from pdserve.kv_transfer.interface import GRPC_OPTIONS, TransferError
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.proto.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc


class KVTransferService(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver

    def PushKV(self, request_iterator, context):  # noqa: N802 (gRPC's name)
        buffers: dict[int, bytearray] = {}
        layers = 0
        try:
            for chunk in request_iterator:
                buf = buffers.setdefault(chunk.layer, bytearray(chunk.layer_bytes))
                end = chunk.offset + len(chunk.payload)
                if end > len(buf):
                    raise TransferError(f"chunk past the end of layer {chunk.layer}")
                buf[chunk.offset : end] = chunk.payload
                if end == chunk.layer_bytes:
                    self.receiver.receive_layer(chunk.transfer_id, chunk.layer, buffers.pop(chunk.layer), chunk.crc32)
                    layers += 1
        except TransferError as e:
            return kv_transfer_pb2.KVAck(layers_received=layers, error=str(e))
        return kv_transfer_pb2.KVAck(layers_received=layers)


def start_kv_server(receiver: KVReceiver, host: str = "127.0.0.1", max_workers: int = 8) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferService(receiver), server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, f"{host}:{port}"
