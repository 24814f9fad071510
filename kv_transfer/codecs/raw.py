"""The `raw` codec: the tensor's own bytes, in the engine's dtype. Exact; decoding is a view."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.kv_cache import KVLayout
from pdserve.kv_transfer.codecs.base import (
    bytes_as_tensor,
    check_decode_level,
    check_encode_level,
    element_size,
    expect_size,
    payload_bytes,
    tensor_bytes,
)
from pdserve.kv_transfer.interface import Payload


class RawCodec:
    name = "raw"
    num_levels = 1
    lossless = True

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def encode(self, kv: torch.Tensor, layer: int, level: int = 0) -> np.ndarray:
        """A uint8 view of the tensor's bytes (no copy for a contiguous CPU tensor)."""
        check_encode_level(self.name, level, self.num_levels)
        return tensor_bytes(kv)

    def decode(self, payload: Payload, layer: int, level: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """A view of the payload's bytes when they are writable and aligned, else one copy."""
        check_decode_level(self.name, level, self.num_levels)
        shape = (2, num_tokens, self.layout.num_kv_heads, self.layout.head_dim)
        data = payload_bytes(payload)
        expect_size(self.name, data.nbytes, int(np.prod(shape)) * element_size(dtype))
        return bytes_as_tensor(data, dtype).view(shape)
