"""The `int8` codec: each token's K (and V) scaled by its absolute maximum over heads × head_dim.

Payload: float32 scales [2, num_tokens] (K's then V's, scale = absmax / 127), then int8 values
[2, num_tokens, heads, head_dim]. Error bound: |x - decoded| <= scale / 2 = absmax / 254 for every
element of the token (plus float32 arithmetic and the rounding to the output dtype). Inputs must be
finite.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.kv_cache import KVLayout
from pdserve.kv_transfer.codecs.base import (
    bytes_as_tensor,
    check_decode_level,
    check_encode_level,
    expect_size,
    payload_bytes,
)
from pdserve.kv_transfer.interface import Payload

QMAX = 127


class Int8Codec:
    name = "int8"
    num_levels = 1
    lossless = False

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.channels = layout.num_kv_heads * layout.head_dim

    def encode(self, kv: torch.Tensor, layer: int, level: int = 0) -> np.ndarray:
        check_encode_level(self.name, level, self.num_levels)
        x = kv.detach().to("cpu", torch.float32).reshape(2, -1, self.channels)
        scale = token_scales(x, QMAX)
        scale_bytes = scale.numel() * 4
        out = np.empty(scale_bytes + x.numel(), dtype=np.uint8)
        bytes_as_tensor(out[:scale_bytes], torch.float32).copy_(scale.reshape(-1))
        q = bytes_as_tensor(out[scale_bytes:], torch.int8).view(x.shape)
        q.copy_(torch.round(x / scale[..., None]).clamp_(-QMAX, QMAX))  # integral already: the cast is exact
        return out

    def decode(self, payload: Payload, layer: int, level: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        check_decode_level(self.name, level, self.num_levels)
        data = payload_bytes(payload)
        scale_bytes = 2 * num_tokens * 4
        expect_size(self.name, data.nbytes, scale_bytes + 2 * num_tokens * self.channels)
        scale = bytes_as_tensor(data[:scale_bytes], torch.float32).view(2, num_tokens, 1)
        q = bytes_as_tensor(data[scale_bytes:], torch.int8).view(2, num_tokens, self.channels)
        out = torch.mul(q, scale).to(dtype)
        return out.view(2, num_tokens, self.layout.num_kv_heads, self.layout.head_dim)

    def error_bound(self, kv: torch.Tensor, layer: int, level: int = 0) -> torch.Tensor:
        """The largest |x - decoded| each element may have, broadcastable to kv: [2, n, 1, 1]."""
        x = kv.detach().to("cpu", torch.float32).reshape(2, -1, self.channels)
        return (token_scales(x, QMAX) / 2)[..., None, None]


def token_scales(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """[2, n] float32: each token's absmax / qmax, or 1 where the token is all zeros."""
    scale = x.abs().amax(dim=2) / qmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))
