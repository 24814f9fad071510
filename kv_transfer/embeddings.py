"""Image embeddings over the KV-transfer layer: from the encode worker that made them to the worker
that runs the request's prompt pass, through the same transports, frames, checksums, leases and
state machine as KV.

    prompt-pass worker                             encode worker
    EmbeddingReceiver.reserve  -- lease -->        EmbeddingSender.send: frames into a channel
    (buffers for every row)    <-- frames --       (one image's rows per frame run; raw)
    EmbeddingReceiver.take     once every row of every image arrived intact

A frame carries rows [start, start + n) of one image's embeddings: the header's `layer` is the
image's index in the prompt, `start_token` and `num_tokens` its rows. Embeddings travel raw (their
own bytes, in the encoder's dtype): the KV codecs are for K and V, and a lossy one would change the
tokens sampled. The receiver sizes everything from the specs it reserved for (the router passed on
the encoder's answer), never from a frame: a frame whose payload is not exactly its rows' bytes is
refused before the transport reads it. The receiving worker waits a lease's time at most (the
manifest's `kv_transfer.lease_s`; it holds at most `MAX_IN_FLIGHT` reservations), and then encodes the
images itself.

Transfer ids of embeddings start with `EMBEDDINGS_PREFIX`: a decode worker's transports take both
kinds, and `SinkByKind` hands each frame to the receiver that holds its transfer.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.multimodal.placement import EmbeddingSpec
from pdserve.engine.multimodal.vision import EncodedImage
from pdserve.kv_transfer.codecs import frame_checksum
from pdserve.kv_transfer.codecs.base import payload_bytes, tensor_bytes
from pdserve.kv_transfer.frames import make_frame
from pdserve.kv_transfer.interface import (CorruptFrame, FrameHeader, FrameSink, Lease, SendingTransport,
                                           TransferError, shown)
from pdserve.kv_transfer.settings import TransferSettings
from pdserve.kv_transfer.state import Transfer, TransferState
from pdserve.kv_transfer.transports import forget_moved, make_sender

log = logging.getLogger(__name__)

EMBEDDINGS_PREFIX = "embed-"
FRAME_BYTES = 4 << 20  # rows of one image go in frames of at most this many bytes (one row at least)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_IN_FLIGHT = 16  # reservations held at once (past it, the worker encodes the images itself)
ENDED_KEPT = 1024  # transfers remembered after they end, for frames still on their way (`admit_frame`)


def rows_per_frame(row_bytes: int) -> int:
    return max(1, FRAME_BYTES // row_bytes)


@dataclass
class _IncomingImages:
    transfer: Transfer
    specs: tuple[EmbeddingSpec, ...]
    buffers: list[torch.Tensor]  # [rows, hidden] per image, filled as frames arrive
    written: list[np.ndarray]  # per image: whether each row arrived intact
    # Frames are written under `lock` while the transfer takes them; `take` and `abort` end that under it.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def row_bytes(self, image: int) -> int:
        return self.buffers[image].shape[1] * self.buffers[image].element_size()

    def missing_rows(self) -> int:
        return sum(int((~w).sum()) for w in self.written)


class EmbeddingReceiver:
    """The receiving side in a worker that runs prompt passes of a vision-language model: one
    reservation per request whose images an encode worker made."""

    def __init__(self, hidden_size: int, max_rows: int, lease_s: float) -> None:
        self.hidden_size = hidden_size
        self.max_rows = max_rows  # every image's rows together: no more than a prompt can hold
        self.lease_s = lease_s
        self._incoming: dict[str, _IncomingImages] = {}
        self._ended: OrderedDict[str, int] = OrderedDict()  # transfer -> the largest frame it could have had
        self._lock = threading.Lock()
        self.frames = self.bytes = self.corrupt_frames = self.refused_frames = 0  # under `_lock`

    def reserve(self, transfer_id: str, request_id: str, specs: tuple[EmbeddingSpec, ...]) -> Lease:
        """Buffers for every row of every image; ValueError for specs this model cannot take."""
        if not transfer_id.startswith(EMBEDDINGS_PREFIX):
            raise ValueError(f"an embeddings transfer's id starts with {EMBEDDINGS_PREFIX!r}")
        for spec in specs:
            if spec.hidden_size != self.hidden_size or spec.dtype not in DTYPES or spec.num_tokens < 1:
                raise ValueError(f"image embeddings of {spec.num_tokens} rows of {spec.hidden_size} {spec.dtype} "
                                 f"do not fit this {self.hidden_size}-wide model")
        rows = sum(spec.num_tokens for spec in specs)
        if rows > self.max_rows:
            raise ValueError(f"{rows} image tokens do not fit a prompt of at most {self.max_rows} tokens")
        with self._lock:
            if len(self._incoming) >= MAX_IN_FLIGHT:  # each holds up to a prompt's worth of rows
                raise TransferError(f"{MAX_IN_FLIGHT} embeddings transfers in flight already")
        incoming = _IncomingImages(
            Transfer(transfer_id, request_id), tuple(specs),
            [torch.empty(spec.num_tokens, spec.hidden_size, dtype=DTYPES[spec.dtype]) for spec in specs],
            [np.zeros(spec.num_tokens, dtype=bool) for spec in specs])
        incoming.transfer.advance(TransferState.TRANSFERRING)
        with self._lock:
            self._incoming[transfer_id] = incoming
        return Lease(transfer_id, num_blocks=0, lease_s=self.lease_s)

    # --- data plane: every transport's FrameSink ------------------------------------------------
    def admit_frame(self, header: FrameHeader) -> None:
        """TransferError unless the frame names rows of an image this transfer carries and its payload
        is exactly their bytes (or it belongs to a transfer that ended lately, and is no larger than
        that one's largest frame could be)."""
        with self._lock:
            incoming = self._incoming.get(header.transfer_id)
            ended_most = self._ended.get(header.transfer_id)
        if incoming is not None:
            self._check_frame(incoming, header)
        elif ended_most is None or header.payload_bytes > ended_most:
            raise TransferError(f"no open embeddings transfer {shown(header.transfer_id)} taking "
                                f"{header.payload_bytes} bytes (ended, or never reserved)")

    def _check_frame(self, incoming: _IncomingImages, header: FrameHeader) -> None:
        if not 0 <= header.layer < len(incoming.specs):
            raise TransferError(f"image {header.layer} outside [0, {len(incoming.specs)})")
        rows = incoming.specs[header.layer].num_tokens
        if header.num_tokens < 1 or header.start_token + header.num_tokens > rows:
            raise TransferError(f"rows [{header.start_token}, {header.start_token + header.num_tokens}) outside "
                                f"the image's {rows}")
        if header.codec != "raw" or header.level != 0:
            raise TransferError(f"embeddings travel raw, not in codec {shown(header.codec)} at level {header.level}")
        if header.num_tokens > rows_per_frame(incoming.row_bytes(header.layer)):
            raise TransferError(f"frame of {header.num_tokens} rows, more than a frame carries")
        if header.payload_bytes != header.num_tokens * incoming.row_bytes(header.layer):
            raise TransferError(f"frame of {header.payload_bytes} bytes for {header.num_tokens} rows "
                                f"of {incoming.row_bytes(header.layer)} bytes")

    def receive_frame(self, header: FrameHeader, payload: memoryview | torch.Tensor) -> None:
        with self._lock:
            incoming = self._incoming.get(header.transfer_id)
        if payload.nbytes != header.payload_bytes or frame_checksum(header, payload) != header.crc32:
            self._count(corrupt_frames=1)
            log.warning("embeddings transfer %s: frame of image %d at row %d dropped: checksum mismatch",
                        shown(header.transfer_id), header.layer, header.start_token)
            raise CorruptFrame(f"checksum mismatch on a frame of image {header.layer}")
        try:
            if incoming is None:
                raise TransferError(f"no open embeddings transfer {shown(header.transfer_id)}")
            self._check_frame(incoming, header)
        except TransferError:
            self._count(refused_frames=1)
            raise
        rows = slice(header.start_token, header.start_token + header.num_tokens)
        data = payload_bytes(payload)  # host bytes (a device's payload is copied here)
        with incoming.lock:
            if incoming.transfer.state is not TransferState.TRANSFERRING:
                self._count(refused_frames=1)
                raise TransferError(f"embeddings transfer {shown(header.transfer_id)} already ended")
            incoming.buffers[header.layer][rows].view(torch.uint8).reshape(-1).numpy()[:] = data
            incoming.written[header.layer][rows] = True
            incoming.transfer.bytes_moved += header.payload_bytes
        self._count(frames=1, bytes=header.payload_bytes)

    # --- control plane --------------------------------------------------------------------------
    def take(self, transfer_id: str) -> list[EncodedImage]:
        """The images once every row arrived intact (the transfer is done); TransferError otherwise
        (the transfer is failed: its buffers are let go)."""
        incoming = self._take_out(transfer_id)
        with incoming.lock:
            missing = incoming.missing_rows()
            if missing:
                incoming.transfer.fail(f"{missing} rows did not arrive intact")
                raise TransferError(f"embeddings transfer {transfer_id}: {missing} rows did not arrive intact")
            incoming.transfer.advance(TransferState.COMMITTING)
            incoming.transfer.advance(TransferState.DONE)
        return [EncodedImage.of(spec, rows) for spec, rows in zip(incoming.specs, incoming.buffers)]

    def abort(self, transfer_id: str, reason: str) -> None:
        """Let the transfer's buffers go (idempotent)."""
        try:
            incoming = self._take_out(transfer_id)
        except TransferError:  # taken or aborted already
            return
        with incoming.lock:  # no frame is being written as it ends
            incoming.transfer.fail(reason)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"embedding_frames": self.frames, "embedding_bytes": self.bytes,
                    "embedding_corrupt_frames": self.corrupt_frames, "embedding_refused_frames": self.refused_frames}

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._incoming)

    def _count(self, frames: int = 0, bytes: int = 0, corrupt_frames: int = 0, refused_frames: int = 0) -> None:
        with self._lock:
            self.frames += frames
            self.bytes += bytes
            self.corrupt_frames += corrupt_frames
            self.refused_frames += refused_frames

    def _take_out(self, transfer_id: str) -> _IncomingImages:
        with self._lock:
            incoming = self._incoming.pop(transfer_id, None)
            if incoming is None:
                raise TransferError(f"no open embeddings transfer {shown(transfer_id)}")
            self._ended[transfer_id] = max(rows_per_frame(incoming.row_bytes(i)) * incoming.row_bytes(i)
                                           for i in range(len(incoming.specs))) if incoming.specs else 0
            if len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
        return incoming



class SinkByKind:
    """The sink of a worker's receiving transports when it takes both KV and embeddings: each frame
    goes to the receiver its transfer id names."""

    def __init__(self, kv: FrameSink | None, embeddings: FrameSink | None) -> None:
        self.kv = kv
        self.embeddings = embeddings

    def _sink(self, transfer_id: str) -> FrameSink:
        sink = self.embeddings if transfer_id.startswith(EMBEDDINGS_PREFIX) else self.kv
        if sink is None:
            raise TransferError(f"no open transfer {shown(transfer_id)}: this worker takes no frames of its kind")
        return sink

    def admit_frame(self, header: FrameHeader) -> None:
        self._sink(header.transfer_id).admit_frame(header)

    def receive_frame(self, header: FrameHeader, payload: memoryview | torch.Tensor) -> None:
        self._sink(header.transfer_id).receive_frame(header, payload)


class EmbeddingSender:
    """The sending side in an encode worker: one sending half per transport, made on first use."""

    def __init__(self, settings: TransferSettings, node_id: str) -> None:
        self.settings = settings
        self.node_id = node_id
        self._transports: dict[str, SendingTransport] = {}
        self._peer_addresses: dict[str, dict[str, str]] = {}  # receiving worker -> where it listened last
        self._lock = threading.Lock()

    def send(self, lease: Lease, images: list[EncodedImage], timeout_s: float) -> int:
        """Send every row of `images` under `lease` and wait until they are delivered; returns the
        bytes sent. TransferError when the channel fails."""
        name = self.settings.pick(lease.addresses, same_node=lease.node_id == self.node_id)
        transport = self._transport(name)
        with self._lock:
            old, self._peer_addresses[lease.worker_id] = self._peer_addresses.get(lease.worker_id), lease.addresses
            transports = dict(self._transports)
        forget_moved(transports, old, lease.addresses)  # a worker that restarted: what was kept for it goes
        channel = transport.open(lease.addresses[name], lease.transfer_id)
        try:  # the receiver's state machine decides the transfer: it takes the images whole, or none
            for index, image in enumerate(images):
                rows = image.embeddings.contiguous()
                step = rows_per_frame(rows.shape[1] * rows.element_size())
                for start in range(0, rows.shape[0], step):
                    chunk = rows[start : start + step]
                    header, payload = make_frame(lease.transfer_id, index, start, chunk.shape[0], "raw", 0,
                                                 tensor_bytes(chunk), channel.device)
                    channel.send(header, payload)
            channel.finish(timeout_s)
        finally:
            channel.close()
        return channel.bytes_sent

    def _transport(self, name: str) -> SendingTransport:
        with self._lock:
            if name not in self._transports:
                self._transports[name] = make_sender(name, host=self.settings.host, tls=self.settings.tls,
                                                     secret=self.settings.secret, frame_bytes=FRAME_BYTES)
            return self._transports[name]

    def close(self) -> None:
        with self._lock:
            transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()
