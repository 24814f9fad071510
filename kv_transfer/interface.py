"""What the sending and receiving halves of every KV transport share (neither imports the other).

The receiving side (`receiver.KVReceiver`, and per transport its server, e.g. `grpc_server`) grants
a `Lease` and takes layer payloads; the sending side (`transports`) opens a `LayerChannel` per
transfer and pushes layers into it. Both raise `TransferError` for anything that ends a transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

# gRPC data plane: layers travel in messages of GRPC_CHUNK_BYTES (at most GRPC_MAX_CHUNK_BYTES); the
# message limit on both ends leaves room for the chunk's header fields.
GRPC_CHUNK_BYTES = 512 * 1024
GRPC_MIN_CHUNK_BYTES = 256 * 1024
GRPC_MAX_CHUNK_BYTES = 1024 * 1024
GRPC_MAX_MESSAGE_BYTES = 2 * GRPC_MAX_CHUNK_BYTES
GRPC_OPTIONS = [("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES)]


class TransferError(RuntimeError):
    pass


class KVMemoryFull(TransferError):
    """The receiver had no free blocks for the reservation within its bounded wait: retry later."""


@dataclass(frozen=True)
class Lease:
    transfer_id: str
    num_blocks: int
    expires_at: float  # wall clock; freed if no commit comes by then (each layer or renewal extends it)


class LayerChannel(Protocol):
    """The sending half of one transfer."""

    bytes_sent: int

    def push_layer(self, layer: int, tensor: torch.Tensor) -> None: ...

    def finish(self, timeout: float) -> None:
        """Wait until every pushed layer is delivered; raise TransferError if any was not."""

    def close(self) -> None:
        """Release the channel's resources (idempotent; ends an unfinished stream). Called on every path."""
