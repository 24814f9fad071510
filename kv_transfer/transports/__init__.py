"""KV transports: each has a sending half (`SendingTransport`, in the prefill worker) and a receiving
half (`ReceivingTransport`, in the decode worker), which hands every frame to the receiver's sink.

  shm   shared memory between processes on one node (the default there): one copy into a slot,
        a view of it on the other side; pyzmq control
  grpc  gRPC client streaming (the default across nodes), mutual TLS when certificates are given; on
        the package's own HTTP/2 (`http2`), which moves a message with no copy in user space
  gloo  torch.distributed point-to-point of host bytes, a two-rank group per worker pair; pyzmq control
  nccl  the same over NCCL, GPU to GPU: KV read out of a CUDA cache never touches host memory

With the cluster's secret (`pdserve.wire.ClusterSecret`), the pyzmq control channels are CURVE and
every gRPC stream carries the cluster's token: receivers take nothing from strangers. gloo's and
NCCL's own sockets cannot be authenticated (see the README's security section).

Transports move bytes: they know nothing of codecs, blocks or the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.kv_transfer.interface import FrameSink, ReceivingTransport, SendingTransport

if TYPE_CHECKING:
    from pdserve.wire import ClusterSecret

TRANSPORT_NAMES = ("shm", "grpc", "gloo", "nccl")


def _payload_device(name: str) -> torch.device | None:
    """Where a transport's payloads live: NCCL's on this process's current GPU (Ray gives a GPU
    actor its own as device 0), the others' in host memory."""
    if name == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def make_sender(name: str, host: str = "127.0.0.1", tls: dict[str, str] | None = None,
                secret: ClusterSecret | None = None, frame_bytes: int | None = None) -> SendingTransport:
    """The sending half of transport `name`; `host`: this node's address (gloo's and NCCL's store
    binds there); `frame_bytes`: the largest frame expected (shm sizes its slots to it)."""
    if name == "shm":
        from pdserve.kv_transfer.transports.shm import ShmSender

        return ShmSender(secret, frame_bytes)
    if name == "grpc":
        from pdserve.kv_transfer.transports.grpc_stream import GrpcSender

        return GrpcSender(tls, secret)
    if name in ("gloo", "nccl"):
        from pdserve.kv_transfer.transports.p2p import P2PSender

        return P2PSender(name, host, secret, _payload_device(name))
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORT_NAMES)}")


def start_receiver(name: str, sink: FrameSink, host: str = "127.0.0.1", tls: dict[str, str] | None = None,
                   secret: ClusterSecret | None = None,
                   on_crash: Callable[[BaseException], None] = lambda error: None) -> ReceivingTransport:
    """Start the receiving half of transport `name`, listening on `host`; with `secret`, it takes
    frames only from the cluster's members. `on_crash` is told if its control loop dies (shm's,
    gloo's and NCCL's; gRPC's accepting thread: each connection's failure ends only its own calls)."""
    if name == "shm":
        from pdserve.kv_transfer.transports.shm import ShmReceiver

        return ShmReceiver(sink, host, secret, on_crash)
    if name == "grpc":
        from pdserve.kv_transfer.transports.grpc_stream import GrpcReceiver

        return GrpcReceiver(sink, host, tls, secret, on_crash)
    if name in ("gloo", "nccl"):
        from pdserve.kv_transfer.transports.p2p import P2PReceiver

        return P2PReceiver(sink, name, host, secret, _payload_device(name), on_crash)
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORT_NAMES)}")
