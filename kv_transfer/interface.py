"""What the sending and receiving halves of every KV transport, and every codec, share.

A transfer moves the KV of the tokens the decode worker does not already hold, layer by layer, as
frames: one frame carries tokens [start, start + num_tokens) of one layer's K and V (positions in
the request's prompt), encoded by one codec at one quality level, with a checksum of the header's
other fields and the encoded bytes (CRC32; for a payload on a GPU, one computed there:
`codecs.frame_checksum`).

The receiving side (`receiver.KVReceiver`) grants a `Lease` and takes frames through a `FrameSink`,
whichever transport brought them; the sending side opens a `LayerChannel` per transfer and sends
frames into it. Both raise `TransferError` for anything that ends a transfer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

# Host bytes, or a flat uint8 tensor on a channel's device (NCCL: the KV never leaves the GPU).
Payload = bytes | bytearray | memoryview | np.ndarray | torch.Tensor


PROBE_PREFIX = "probe-"  # request ids of the launcher's transfer probes, which carry no client request
MAX_FRAME_BYTES = 1 << 30  # a frame header announcing a larger payload is believed by no transport


def shown(text: str | bytes, limit: int = 80) -> str:
    """Text a peer chose, fit for a log line or an error message: its repr (no newline or control
    character gets through raw), cut to about `limit` characters."""
    if isinstance(text, bytes | bytearray | memoryview):
        text = bytes(text[: limit * 4]).decode("utf-8", errors="replace")
    cut = text[:limit]
    return repr(cut) + (f"... ({len(text)} characters)" if len(text) > limit else "")


class TransferError(RuntimeError):
    pass


class KVMemoryFull(TransferError):
    """The receiver had no free blocks for the reservation within its bounded wait: retry later."""


class CorruptFrame(TransferError):
    """A frame's bytes do not match its checksum (or cannot be decoded): the sender may send it again."""


@dataclass(frozen=True)
class FrameHeader:
    transfer_id: str
    layer: int
    start_token: int  # position in the request (tokens the decode worker holds already are not sent)
    num_tokens: int
    codec: str
    level: int
    crc32: int  # `codecs.frame_checksum`: of the other fields (`covered`) and the payload
    payload_bytes: int

    # layer, start, num_tokens, level, crc32, payload_bytes: every field as wide as the gRPC message's,
    # so whatever a KVFrame carries packs (and is checksummed)
    _FIXED = struct.Struct("<IIIIIQ")

    def pack(self) -> bytes:
        """A compact binary form for transports whose control messages are plain bytes."""
        names = f"{self.transfer_id}\0{self.codec}".encode()
        return self._FIXED.pack(self.layer, self.start_token, self.num_tokens, self.level, self.crc32,
                                self.payload_bytes) + names

    def covered(self) -> bytes:
        """The fields the checksum covers besides the payload: all but the checksum itself."""
        return replace(self, crc32=0).pack()

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> FrameHeader:
        size = cls._FIXED.size
        if len(data) < size:
            raise CorruptFrame(f"frame header of {len(data)} bytes, at least {size} expected")
        layer, start, n, level, crc, nbytes = cls._FIXED.unpack_from(data)
        try:
            transfer_id, codec = bytes(data[size:]).decode().split("\0")
        except ValueError as e:
            raise CorruptFrame(f"malformed frame header: {e}") from None
        return cls(transfer_id, layer, start, n, codec, level, crc, nbytes)


@dataclass(frozen=True)
class Lease:
    transfer_id: str
    num_blocks: int  # blocks the request has on the decode side (cached prefix included)
    lease_s: float  # freed if no frame, renewal or commit comes for this long
    cached_blocks: int = 0  # leading blocks the decode worker already holds: not sent
    codec: str = "raw"  # what the decode side accepted of the codecs offered
    addresses: dict[str, str] = field(default_factory=dict)  # transport -> where its receiving half listens
    node_id: str = ""  # the decode worker's node (same node: shared memory)
    worker_id: str = ""  # the decode worker's name: a restarted one keeps it and listens on new addresses
    recompute_s: float | None = None  # the decode worker's estimate of recomputing the KV from the tokens
    # The draft model's layers to send after the target's (layer num_layers + i, raw, from token 0); 0: none
    draft_layers: int = 0


class FrameSink(Protocol):
    """Where a receiving half hands the frames it takes (the decode worker's `KVReceiver`)."""

    def admit_frame(self, header: FrameHeader) -> None:
        """Raise TransferError unless a frame with this header may be taken: its transfer is held
        here, and its payload is no larger than the tokens it names can take. A transport asks before
        it allocates anything for a payload or reads it, so a frame for a transfer not held here, or
        one announcing more bytes than its reservation holds, costs it nothing."""

    def receive_frame(self, header: FrameHeader, payload: memoryview | torch.Tensor) -> None:
        """Take one frame: a view of host bytes, or the received tensor from a transport whose
        payloads live on a device; valid only during the call. Raises CorruptFrame for a frame that
        may be sent again, TransferError for one that ends the transfer."""


class LayerChannel(Protocol):
    """The sending half of one transfer."""

    bytes_sent: int
    device: torch.device | None  # where payloads must be (a uint8 tensor there); None: host bytes

    def send(self, header: FrameHeader, payload: Payload) -> None:
        """Queue one frame (returns before it is delivered). The payload must stay unchanged until
        `finish` returns: a transport may send from it until then (gloo and gRPC do; shm copies it).
        Raises TransferError when the channel cannot take it (closed, or the receiver stuck or gone)."""

    def finish(self, timeout: float) -> None:
        """Wait until every frame sent so far is delivered; raise TransferError if any was not. A
        frame the receiver found corrupt is not an error here: the receiver lists it (`missing`)."""

    def close(self) -> None:
        """Release the channel's resources (idempotent; ends an unfinished stream). Called on every
        path, possibly from another thread than the one sending: a send or finish under way then
        ends with TransferError promptly."""


class SendingTransport(Protocol):
    """One per prefill worker and transport kind: opens channels to decode workers' receiving halves."""

    name: str

    def open(self, address: str, transfer_id: str) -> LayerChannel: ...

    def forget(self, address: str) -> None:
        """Drop what is kept for a peer that left (connections, process groups)."""

    def close(self) -> None: ...


class ReceivingTransport(Protocol):
    """One per decode worker and transport kind: hands every frame that arrives to the `FrameSink`."""

    name: str
    address: str  # what a sending half passes to `open`

    def stop(self) -> None: ...


class Codec(Protocol):
    """Encodes one frame's KV: a tensor [2 (K, V), num_tokens, num_kv_heads, head_dim] of one layer."""

    name: str
    num_levels: int  # quality levels, 0 = finest; lossless codecs have one
    lossless: bool
    digest: str  # of what both sides must hold alike (cachegen's tables and payload coding); "" if nothing
    # Encoded bytes per token of one layer where every frame's size follows from its length; None where
    # it depends on the values (then the sender measures it).
    fixed_bytes_per_token: int | None

    def encode(self, kv: torch.Tensor, layer: int, level: int = 0) -> Payload: ...

    def decode(self, payload: Payload, layer: int, level: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """The tensor [2, num_tokens, heads, head_dim] in `dtype`; raises CorruptFrame if malformed."""
