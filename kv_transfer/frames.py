"""Which tokens of which layer leave, cut into frames, at which level (`FrameCutter`).

The sending side (`sender.KVSender`) calls `send_through(layer, ...)` on its link to the decode
worker whenever a layer's KV up to some token is final: for each chunk of the prompt pass, as soon as
the forward pass has written that layer (layer-wise streaming), or, for a pass shorter than
`LAYERWISE_MIN_TOKENS`, for every layer once the pass is over; the first call also sends what its own
prefix cache served. Tokens the decode worker already holds (the lease's `cached_blocks`) are never sent. Frames are cut at chunk ends
and at multiples of `frame_tokens` (CacheGen's context chunks); the receiver tracks which tokens of
each layer arrived, so a layer sent again may be cut differently. The `LevelController` picks each
frame's quality level. On CUDA, frames are read out on a side stream (`off_the_compute_stream`), to
pinned host memory, or, for a channel whose payloads live on the GPU (NCCL) and the raw codec, not
copied out at all. A transfer that carries the draft model's prompt KV too (its lease's
`draft_layers`) sends its layers as layers `num_layers + i`, raw (CacheGen's tables are the target's),
from the prompt's first token (the decode worker's draft keeps no prefix cache).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from pdserve.engine.kv_cache import PagedKVCache
from pdserve.kv_transfer.codecs import Codec, frame_checksum, make_codec
from pdserve.kv_transfer.codecs.base import Unrepresentable, device_bytes, payload_nbytes
from pdserve.kv_transfer.interface import FrameHeader, LayerChannel, Payload
from pdserve.kv_transfer.side_streams import off_the_compute_stream

FRAME_TOKENS = 1536  # CacheGen's context chunk: large enough to code well, small enough to stream
# Prompt passes this long or longer (the tokens the prefill worker computes) stream their KV layer by
# layer beside the pass; a shorter one's is sent once the pass ends. Sending beside the pass slows it
# (the sending process's Python and copies share the cores and the GIL), which costs the first token
# more than a short prompt's transfer, sent after, costs the second (measured: docs/benchmarks.md,
# "The handoff in serving").
LAYERWISE_MIN_TOKENS = 1024


def streams_beside_pass(new_tokens: int, layerwise_min_tokens: int, adaptive: bool) -> bool:
    """Whether a prompt's KV goes layer by layer beside its pass (its reservation asked for as the pass
    starts), else all at once as the pass ends: a long prompt's, or any whose codec's levels adapt to a
    TTFT objective (the level controller paces its frames against the pass)."""
    return new_tokens >= layerwise_min_tokens or adaptive


@dataclass
class LevelSizes:
    """Measured encoded bytes per (token × layer) at each level of one codec, kept per worker.

    A frame's fixed bytes (header, scales, a group's anchor token) weigh more the shorter it is, so a
    level's figure is taken from the longest frames it was measured on (`measured_on`): a frame more
    than twice as long measures it anew, and a frame under half as long is not counted. Otherwise a
    level first met on a short frame would look too large for good, and never be chosen (so never
    measured) again. Shared by the worker's sending threads (one per decode worker): under a lock."""

    bytes_per_token: dict[int, float]
    measured_on: dict[int, float] = field(default_factory=dict)  # level -> frame tokens its figure is from
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def of(cls, codec: Codec) -> LevelSizes:
        """Nothing measured yet, or for a codec whose sizes are fixed, its size, which nothing measures
        again: the recompute decision has a transfer time from a worker's first transfer on."""
        if codec.fixed_bytes_per_token is None:
            return cls({})
        return cls(dict.fromkeys(range(codec.num_levels), float(codec.fixed_bytes_per_token)),
                   dict.fromkeys(range(codec.num_levels), math.inf))

    def observe(self, level: int, num_tokens: int, nbytes: int) -> None:
        seen = nbytes / max(1, num_tokens)
        with self._lock:
            if self._outdated(level, num_tokens):
                self.bytes_per_token[level], self.measured_on[level] = seen, num_tokens
            elif 2 * num_tokens >= self.measured_on[level]:
                self.bytes_per_token[level] = 0.8 * self.bytes_per_token[level] + 0.2 * seen

    def outdated(self, level: int, num_tokens: int) -> bool:
        """Whether a frame of `num_tokens` should measure `level`: unknown, or known from short frames only."""
        with self._lock:
            return self._outdated(level, num_tokens)

    def _outdated(self, level: int, num_tokens: int) -> bool:
        return level not in self.bytes_per_token or num_tokens > 2 * self.measured_on[level]

    def smallest(self) -> float | None:
        """The smallest figure of any level (the coarsest measured), or None before any."""
        with self._lock:
            return min(self.bytes_per_token.values(), default=None)


class LevelController:
    """Picks each frame's level: the finest at which everything still to send fits in the time left
    before the request's TTFT objective at the measured bandwidth (the finest, without an objective).
    A level's size is measured by encoding a real frame at it when it is needed and `LevelSizes` has
    no figure for frames this long."""

    def __init__(self, codec: Codec, sizes: LevelSizes, bandwidth_bps: float, deadline: float | None) -> None:
        if not bandwidth_bps > 0:
            raise ValueError(f"bandwidth must be positive, not {bandwidth_bps}")
        self.codec = codec
        self.sizes = sizes
        self.bandwidth_bps = bandwidth_bps
        self.deadline = deadline

    def encode(self, kv: torch.Tensor, layer: int, tokens_left: int) -> tuple[int, Payload]:
        """(level, payload) for this frame; `tokens_left`: token-layers still to send, this frame's included."""
        levels = self.codec.num_levels
        if self.deadline is None or levels == 1:
            return 0, self._encode(kv, layer, 0)
        time_left = self.deadline - time.time()
        payloads: dict[int, Payload] = {}
        for level in range(levels):
            if self.sizes.outdated(level, kv.shape[1]):
                payloads[level] = self._encode(kv, layer, level)
            size = self.sizes.bytes_per_token[level]
            if size * tokens_left / self.bandwidth_bps <= time_left or level == levels - 1:
                return level, payloads[level] if level in payloads else self._encode(kv, layer, level)
        raise AssertionError("the coarsest level is always chosen")

    def transfer_s(self, token_layers: int) -> float | None:
        """The estimated time to send this many token-layers at the coarsest measured level."""
        smallest = self.sizes.smallest()
        return None if smallest is None else smallest * token_layers / self.bandwidth_bps

    def _encode(self, kv: torch.Tensor, layer: int, level: int) -> Payload:
        payload = self.codec.encode(kv, layer, level)
        # A frame larger than raw travels raw (`FrameCutter._encode`): raw's size is what it costs.
        self.sizes.observe(level, kv.shape[1], min(payload_nbytes(payload), kv.numel() * kv.element_size()))
        return payload


def make_frame(transfer_id: str, layer: int, start: int, num_tokens: int, codec: str, level: int, payload: Payload,
               device: torch.device | None) -> tuple[FrameHeader, Payload]:
    """A frame's header and its payload as it travels: host bytes, or a uint8 tensor on `device` (the
    channel's); the checksum is taken of exactly that, and of the header's other fields."""
    travelling = memoryview(payload).cast("B") if device is None else device_bytes(payload, device)
    header = FrameHeader(transfer_id, layer, start, num_tokens, codec, level, 0, payload_nbytes(travelling))
    return replace(header, crc32=frame_checksum(header, travelling)), travelling


def read_kv(kv_cache: PagedKVCache, layer: int, block_ids: list[int], start: int, n: int,
            to_host: bool = True) -> torch.Tensor:
    """K and V of tokens [start, start + n) of one layer: in host memory (from a GPU, through pinned
    memory), or where the cache is (`to_host=False`). On CUDA, call it `off_the_compute_stream`."""
    kv = kv_cache.read_tokens(layer, kv_cache.token_slots(block_ids, start, n))
    if not to_host or kv.device.type == "cpu":
        return kv
    host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
    host.copy_(kv, non_blocking=True)
    torch.cuda.current_stream(kv.device).synchronize()
    return host


class FrameCutter:
    """One transfer's frames: cut, encoded and sent into its channel (replaced by a fresh one for a resend)."""

    def __init__(self, transfer_id: str, channel: LayerChannel, controller: LevelController,
                 kv_cache: PagedKVCache, first_token: int, num_tokens: int,
                 frame_tokens: int = FRAME_TOKENS, before_frame: Callable[[], None] = lambda: None,
                 draft_cache: PagedKVCache | None = None) -> None:
        self.transfer_id = transfer_id
        # Called before each frame is read: may raise to stop the transfer (its blocks may be another's
        # by now); that the channel took the frame before is progress.
        self.before_frame = before_frame
        self.channel = channel
        self.controller = controller
        self.kv_cache = kv_cache
        self.first_token = first_token  # the decode worker holds every token before it
        self.num_tokens = num_tokens
        self.frame_tokens = frame_tokens
        self.target_layers = kv_cache.layout.num_layers
        self.draft_cache = draft_cache  # the draft model's KV, sent too (None: not this transfer's)
        self._draft_raw = make_codec("raw", None, draft_cache.layout) if draft_cache is not None else None
        self.num_layers = self.target_layers + (draft_cache.layout.num_layers if draft_cache is not None else 0)
        self.frames_sent = 0
        self.bytes_sent = 0  # payload bytes, over every channel the transfer used (a resend opens another)
        self.levels_used: dict[int, int] = {}  # level -> frames
        # the target's token-layers the level controller must fit in the time left
        self._token_layers_left = (num_tokens - first_token) * self.target_layers
        # tokens before it are sent, per layer (the draft's layers start at the prompt's first)
        self._sent_until = [first_token] * self.target_layers + [0] * (self.num_layers - self.target_layers)

    def send_through(self, layer: int, block_ids: list[int], end: int) -> None:
        """Send what is not sent yet of `layer`'s tokens before `end` (their KV is final); nothing of a
        draft layer this transfer does not carry."""
        if layer >= self.num_layers:
            return
        start = self._sent_until[layer]
        if end > start:
            self._send_range(layer, block_ids, start, end, resend=False)
            self._sent_until[layer] = end

    def resend_layers(self, layers: dict[int, list[int]]) -> None:
        """Send these layers (each with the blocks holding it) once more, as far as they were sent."""
        for layer, block_ids in layers.items():
            first = self.first_token if layer < self.target_layers else 0
            self._send_range(layer, block_ids, first, self._sent_until[layer], resend=True)

    def _send_range(self, layer: int, block_ids: list[int], start: int, end: int, resend: bool) -> None:
        while start < end:
            stop = min(end, (start // self.frame_tokens + 1) * self.frame_tokens)
            self._send_frame(layer, block_ids, start, stop - start, resend)
            start = stop

    def _send_frame(self, layer: int, block_ids: list[int], start: int, n: int, resend: bool) -> None:
        self.before_frame()
        device = self.channel.device
        target = layer < self.target_layers
        with off_the_compute_stream(self.kv_cache.data.device):
            # Raw KV bound for a device (NCCL) goes there as it is; every other codec encodes on the host.
            if target:
                kv = read_kv(self.kv_cache, layer, block_ids, start, n,
                             to_host=device is None or self.controller.codec.name != "raw")
                codec, level, payload = self._encode(kv, layer, max(n, self._token_layers_left))
            else:
                kv = read_kv(self.draft_cache, layer - self.target_layers, block_ids, start, n, to_host=device is None)
                codec, level, payload = self._draft_raw, 0, self._draft_raw.encode(kv, layer)
            header, payload = make_frame(self.transfer_id, layer, start, n, codec.name, level, payload, device)
            self.channel.send(header, payload)
        self.frames_sent += 1
        self.bytes_sent += header.payload_bytes
        self.levels_used[level] = self.levels_used.get(level, 0) + 1
        if target and not resend:
            self._token_layers_left -= n

    def _encode(self, kv: torch.Tensor, layer: int, tokens_left: int) -> tuple[Codec, int, Payload]:
        """The frame's codec, level and payload: the agreed codec's, or raw (which the receiver takes
        in any transfer) where that codec cannot represent the KV, or would make it larger (CacheGen
        pays an escape per value far outside the range its tables were profiled on)."""
        try:
            level, payload = self.controller.encode(kv, layer, tokens_left)
            if payload_nbytes(payload) <= kv.numel() * kv.element_size():
                return self.controller.codec, level, payload
        except Unrepresentable:
            pass
        raw = make_codec("raw", None, self.kv_cache.layout)
        return raw, 0, raw.encode(kv, layer)
