"""The `raw` codec: the tensor's own bytes, in the engine's dtype, where the tensor is (a GPU's KV
stays on the GPU for NCCL). Exact; decoding is a view."""

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
    digest = ""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.fixed_bytes_per_token = layout.bytes_per_token_layer

    def encode(self, kv: torch.Tensor, layer: int, level: int = 0) -> np.ndarray | torch.Tensor:
        """A uint8 view of the tensor's bytes (no copy when it is contiguous): a numpy array for a
        CPU tensor, a tensor on the tensor's device otherwise."""
        check_encode_level(self.name, level, self.num_levels)
        if kv.device.type == "cpu":
            return tensor_bytes(kv)
        return kv.contiguous().view(torch.uint8).reshape(-1)

    def decode(self, payload: Payload, layer: int, level: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """A view of the payload's bytes when they are writable and aligned, else one copy."""
        check_decode_level(self.name, level, self.num_levels)
        shape = (2, num_tokens, self.layout.num_kv_heads, self.layout.head_dim)
        if isinstance(payload, torch.Tensor):  # received on a device: decoded there
            expect_size(self.name, payload.nbytes, int(np.prod(shape)) * element_size(dtype))
            data = payload.reshape(-1).view(torch.uint8)
            return (data if data.storage_offset() % element_size(dtype) == 0 else data.clone()).view(dtype).view(shape)
        data = payload_bytes(payload)
        expect_size(self.name, data.nbytes, int(np.prod(shape)) * element_size(dtype))
        return bytes_as_tensor(data, dtype).view(shape)
