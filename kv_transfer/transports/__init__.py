"""KV transports: each has a sending half (`SendingTransport`, in the prefill worker) and a receiving
half (`ReceivingTransport`, in the decode worker), which hands every frame to the receiver's sink.

  shm   shared memory between processes on one node (the default there): one copy into a slot,
        a view of it on the other side; pyzmq control
  tcp   frames straight over TCP (the default across nodes): one `sendmsg` out of the KV buffer, one
        `recv_into` on the other side; mutual TLS when certificates are given
  grpc  gRPC client streaming on grpcio, for networks that pass only HTTP/2 (service meshes, L7
        proxies); mutual TLS when certificates are given
  gloo  torch.distributed point-to-point of host bytes, a two-rank group per worker pair; pyzmq control
  nccl  the same over NCCL, GPU to GPU: KV read out of a CUDA cache never touches host memory

With the cluster's secret (`pdserve.wire.ClusterSecret`), the pyzmq control channels are CURVE, a
tcp connection starts with both sides proving they hold the cluster's key, and every gRPC call
carries a proof made with it: receivers take nothing from strangers, and the key itself never
crosses the wire. gloo's and NCCL's own sockets cannot be authenticated (docs/security.md).

Transports move bytes: they know nothing of codecs, blocks or the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.kv_transfer.interface import FrameSink, ReceivingTransport, SendingTransport

if TYPE_CHECKING:
    from pdserve.wire import ClusterSecret

TRANSPORT_NAMES = ("shm", "tcp", "grpc", "gloo", "nccl")


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
    if name == "tcp":
        from pdserve.kv_transfer.transports.tcp import TcpSender

        return TcpSender(tls, secret)
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
    gloo's and NCCL's; tcp's accepting thread: each connection's failure ends only that connection)."""
    if name == "shm":
        from pdserve.kv_transfer.transports.shm import ShmReceiver

        return ShmReceiver(sink, host, secret, on_crash)
    if name == "tcp":
        from pdserve.kv_transfer.transports.tcp import TcpReceiver

        return TcpReceiver(sink, host, tls, secret, on_crash)
    if name == "grpc":
        from pdserve.kv_transfer.transports.grpc_stream import GrpcReceiver

        return GrpcReceiver(sink, host, tls, secret)  # grpcio's threads: a call's failure ends only that call
    if name in ("gloo", "nccl"):
        from pdserve.kv_transfer.transports.p2p import P2PReceiver

        return P2PReceiver(sink, name, host, secret, _payload_device(name), on_crash)
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORT_NAMES)}")


def forget_moved(transports: dict[str, SendingTransport], old: dict[str, str] | None, new: dict[str, str]) -> None:
    """A receiving worker that restarted listens on new addresses (`new`): what the sending halves hold
    for its old ones (idle shm segments, tcp connections, a process group) is let go."""
    for name, address in (old or {}).items():
        if address != new.get(name) and name in transports:
            transports[name].forget(address)
