"""Codecs turn one layer's KV tensor into bytes and back. `raw` is exact; lossy ones come later."""

from __future__ import annotations

import zlib

import numpy as np
import torch


class RawCodec:
    name = "raw"

    @staticmethod
    def encode(tensor: torch.Tensor) -> np.ndarray:
        """A uint8 view of the tensor's bytes (bfloat16 has no numpy dtype, bytes always do)."""
        return tensor.detach().contiguous().cpu().view(torch.uint8).numpy().reshape(-1)

    @staticmethod
    def decode(payload: bytes | bytearray | memoryview | np.ndarray, dtype: torch.dtype,
               shape: tuple[int, ...]) -> torch.Tensor:
        raw = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) else payload
        expected = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if raw.nbytes != expected:
            raise ValueError(f"KV payload has {raw.nbytes} bytes, expected {expected} for shape {shape}")
        return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


def checksum(payload: bytes | bytearray | memoryview | np.ndarray) -> int:
    return zlib.crc32(memoryview(payload).cast("B")) & 0xFFFFFFFF

