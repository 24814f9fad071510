"""The KV-transfer settings both halves share (from the manifest's `kv_transfer` section), and the
choice of transport for a pair of workers."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pdserve.deadlines import KVDeadlines
from pdserve.kv_transfer.frames import FRAME_TOKENS, LAYERWISE_MIN_TOKENS

if TYPE_CHECKING:
    from pdserve.wire import ClusterSecret

TRANSPORT_CHOICES = ("auto", "shm", "tcp", "grpc", "gloo", "nccl")


@dataclass(frozen=True)
class TransferSettings:
    transport: str = "auto"  # auto: shared memory within a node, tcp across nodes
    codecs: tuple[str, ...] = ("raw",)  # offered in this order; the decode side takes the first it can use
    host: str | None = None  # where receiving halves listen; None: the worker's own node address (`on_node`)
    tls: dict[str, str] = field(default_factory=dict)  # cert, key and ca, all three (mutual TLS)
    frame_tokens: int = FRAME_TOKENS
    layerwise_min_tokens: int = LAYERWISE_MIN_TOKENS  # shorter prompts' KV is sent once their pass ends
    deadlines: KVDeadlines = field(default_factory=KVDeadlines)  # leases, waits and timeouts (from the manifest)
    ttft_slo_s: float | None = None  # the level controller fits each transfer into it
    recompute: bool = True  # the decode worker may recompute the KV instead when that is faster
    # The cluster's secret (the manifest's `security.cluster_secret`): authenticates the KV channels,
    # and the workers' token and KV event streams too (they get it with these settings). None: off.
    secret: ClusterSecret | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {TRANSPORT_CHOICES}, got {self.transport!r}")

    def on_node(self, node_ip: str) -> "TransferSettings":
        """The settings of a worker on the node at `node_ip`: it listens there unless the manifest set a host."""
        return self if self.host else replace(self, host=node_ip)

    @property
    def receivers(self) -> list[str]:
        """The receiving halves a decode worker starts."""
        return ["shm", "tcp"] if self.transport == "auto" else [self.transport]

    def pick(self, addresses: dict[str, str], same_node: bool) -> str:
        """The transport for one transfer, from those the decode worker listens on."""
        wanted = self.transport
        if wanted == "auto":
            wanted = "shm" if same_node and "shm" in addresses else "tcp"
        elif wanted == "shm" and not same_node:  # its segments would name files on another machine
            raise ValueError("transport 'shm' moves KV between workers on one node, and this pair is on two; "
                             "use 'auto' (shared memory within a node, tcp across) or 'tcp'")
        if wanted not in addresses:
            raise ValueError(f"the decode worker does not listen on {wanted!r} (it has {sorted(addresses)})")
        return wanted
