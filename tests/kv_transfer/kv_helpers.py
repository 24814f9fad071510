"""Synthetic KV for the codec and sender tests, CacheGen tables profiled on it, and frames and a
recording sink for the transport tests."""

from __future__ import annotations

import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.engine.kv_cache import KVLayout
from pdserve.kv_transfer.interface import FrameHeader, TransferError
from pdserve.kv_transfer.codecs.cachegen import TABLES_FILE
from pdserve.kv_transfer.codecs.cachegen_profile import build_tables
from pdserve.kv_transfer.codecs.cachegen_quant import channels_first

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)


def synthetic_kv(num_tokens: int, seed: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """[2, n, heads, dim]: a random walk per channel (neighbouring tokens alike), channel means and
    scales that differ, two outlier channels."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_tokens, layout.num_kv_heads, layout.head_dim)
    walk = torch.cumsum(0.3 * torch.randn(shape, generator=g), dim=1) / (1 + 0.02 * num_tokens) ** 0.5
    scale = torch.exp(torch.randn((2, 1, layout.num_kv_heads, layout.head_dim), generator=g))
    kv = (walk + torch.randn(shape, generator=g) * 0.2) * scale + 3 * torch.randn((2, 1, *shape[2:]), generator=g)
    kv[:, :, 0, 0] *= 20
    return kv


def synthetic_tables(out: Path, layout: KVLayout = LAYOUT, seed: int = 100) -> Path:
    """`out`, with CacheGen tables profiled on synthetic KV of `layout` (token-to-token correlation,
    the property CacheGen's deltas exploit, and outlier channels)."""
    calibration = [np.concatenate([channels_first(synthetic_kv(1000, seed + i, layout), 10) for i in range(4)],
                                  axis=2) for _ in range(layout.num_layers)]
    out.mkdir(parents=True, exist_ok=True)
    build_tables(calibration, (layout.num_kv_heads, layout.head_dim)).save(out / TABLES_FILE)
    return out


class RecordingSink:
    """A `FrameSink` that keeps every frame; `verdict`: raised after keeping each; `most_bytes`: the
    largest payload it admits (as a reservation bounds it)."""

    def __init__(self, verdict: type[Exception] | None = None, most_bytes: int | None = None) -> None:
        self.frames: list[tuple[FrameHeader, bytes]] = []
        self.verdict = verdict
        self.most_bytes = most_bytes
        self.admitted = 0
        self.lock = threading.Lock()

    def admit_frame(self, header: FrameHeader) -> None:
        if self.most_bytes is not None and header.payload_bytes > self.most_bytes:
            raise TransferError(f"frame of {header.payload_bytes} bytes, at most {self.most_bytes} held")
        with self.lock:
            self.admitted += 1

    def receive_frame(self, header: FrameHeader, payload: memoryview | torch.Tensor) -> None:
        data = bytes(payload) if isinstance(payload, memoryview) else payload.cpu().numpy().tobytes()
        with self.lock:
            self.frames.append((header, data))
        if self.verdict is not None:
            raise self.verdict("the sink says no")


class FunctionSink(RecordingSink):
    """A `FrameSink` whose frames go to `take` (a test's own verdicts), admitting every one."""

    def __init__(self, take) -> None:
        super().__init__()
        self.take = take

    def receive_frame(self, header: FrameHeader, payload: memoryview | torch.Tensor) -> None:
        self.take(header, payload)


def frame(layer: int, nbytes: int, seed: int, device: torch.device | None = None,
          transfer_id: str = "t1") -> tuple[FrameHeader, Any]:
    """A frame of random bytes: host bytes, or a uint8 tensor on `device` (the channel's)."""
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    header = FrameHeader(transfer_id, layer, 16 * layer, 16, "raw", 0, zlib.crc32(data), nbytes)
    return header, data if device is None else torch.from_numpy(data).to(device)
