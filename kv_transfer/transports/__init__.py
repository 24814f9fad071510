"""KV transports: each has a sending half (`SendingTransport`, in the prefill worker) and a receiving
half (`ReceivingTransport`, in the decode worker), which hands every frame to the receiver's sink.

  shm   shared memory between processes on one node (the default there): one copy into a slot,
        a view of it on the other side; pyzmq control
  grpc  gRPC client streaming (the default across nodes), mutual TLS when certificates are given

With the cluster's secret (`pdserve.wire.ClusterSecret`), the pyzmq control channels are CURVE and
every gRPC stream carries the cluster's token: receivers take nothing from strangers. gloo's own
sockets cannot be authenticated (see the README's security section).
  gloo  torch.distributed point-to-point, a two-rank group per worker pair; pyzmq control

Transports move bytes: they know nothing of codecs, blocks or the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.kv_transfer.interface import FrameSink, ReceivingTransport, SendingTransport

if TYPE_CHECKING:
    from pdserve.wire import ClusterSecret

TRANSPORT_NAMES = ("shm", "grpc", "gloo")


def make_sender(name: str, host: str = "127.0.0.1", tls: dict[str, str] | None = None,
                secret: ClusterSecret | None = None) -> SendingTransport:
    """The sending half of transport `name`; `host`: this node's address (gloo's store binds there)."""
    if name == "shm":
        from pdserve.kv_transfer.transports.shm import ShmSender

        return ShmSender(secret)
    if name == "grpc":
        from pdserve.kv_transfer.transports.grpc_stream import GrpcSender

        return GrpcSender(tls, secret)
    if name == "gloo":
        from pdserve.kv_transfer.transports.gloo import GlooSender

        return GlooSender(host, secret)
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORT_NAMES)}")


def start_receiver(name: str, sink: FrameSink, host: str = "127.0.0.1", tls: dict[str, str] | None = None,
                   secret: ClusterSecret | None = None) -> ReceivingTransport:
    """Start the receiving half of transport `name`, listening on `host`; with `secret`, it takes
    frames only from the cluster's members."""
    if name == "shm":
        from pdserve.kv_transfer.transports.shm import ShmReceiver

        return ShmReceiver(sink, host, secret)
    if name == "grpc":
        from pdserve.kv_transfer.transports.grpc_stream import GrpcReceiver

        return GrpcReceiver(sink, host, tls, secret=secret)
    if name == "gloo":
        from pdserve.kv_transfer.transports.gloo import GlooReceiver

        return GlooReceiver(sink, host, secret)
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORT_NAMES)}")
