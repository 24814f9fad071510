"""KV transports: each has a sending half (`SendingTransport`, in the prefill worker) and a receiving
half (`ReceivingTransport`, in the decode worker), which hands every frame to the receiver's sink.

  shm   shared memory between processes on one node (the default there): one copy into a slot,
        a view of it on the other side; pyzmq control
  grpc  gRPC client streaming (the default across nodes), mutual TLS when certificates are given
  gloo  torch.distributed point-to-point, a two-rank group per worker pair; pyzmq control

Transports move bytes: they know nothing of codecs, blocks or the engine.
"""

from __future__ import annotations

from pdserve.kv_transfer.interface import FrameSink, ReceivingTransport, SendingTransport

TRANSPORT_NAMES = ("shm", "grpc", "gloo")


def make_sender(name: str, host: str = "127.0.0.1", tls: dict[str, str] | None = None) -> SendingTransport:
    """The sending half of transport `name`; `host`: this node's address (gloo's store binds there)."""
    if name == "shm":
        from pdserve.kv_transfer.transports.shm import ShmSender

        return ShmSender()
    if name == "grpc":
        from pdserve.kv_transfer.transports.grpc_stream import GrpcSender

        return GrpcSender(tls)
    if name == "gloo":
        from pdserve.kv_transfer.transports.gloo import GlooSender

        return GlooSender(host)
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORT_NAMES)}")


def start_receiver(name: str, sink: FrameSink, host: str = "127.0.0.1",
                   tls: dict[str, str] | None = None) -> ReceivingTransport:
    """Start the receiving half of transport `name`, listening on `host`."""
    if name == "shm":
        from pdserve.kv_transfer.transports.shm import ShmReceiver

        return ShmReceiver(sink, host)
    if name == "grpc":
        from pdserve.kv_transfer.transports.grpc_stream import GrpcReceiver

        return GrpcReceiver(sink, host, tls)
    if name == "gloo":
        from pdserve.kv_transfer.transports.gloo import GlooReceiver

        return GlooReceiver(sink, host)
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORT_NAMES)}")
