"""What `int8` and `fp8` share: each token's K (and V) scaled by its absolute maximum over
heads × head_dim, then stored in a one-byte type.

Payload: float32 scales [2, num_tokens] (K's then V's, scale = absmax / the type's largest value),
then one byte per element [2, num_tokens, heads, head_dim].
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from pdserve.engine.kv_cache import KVLayout
from pdserve.kv_transfer.codecs.base import (
    Unrepresentable,
    bytes_as_tensor,
    check_decode_level,
    check_encode_level,
    expect_size,
    payload_bytes,
)
from pdserve.kv_transfer.interface import Payload


class TokenScaledCodec(ABC):
    num_levels = 1
    lossless = False
    digest = ""
    name: str
    value_dtype: torch.dtype  # one byte per element
    qmax: float  # the largest value the type holds (as used)

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.channels = layout.num_kv_heads * layout.head_dim
        self.fixed_bytes_per_token = 2 * (4 + self.channels)  # K's and V's float32 scale and one byte per channel

    @abstractmethod
    def to_values(self, scaled: torch.Tensor) -> torch.Tensor:
        """`scaled` (in [-qmax, qmax] up to float32 rounding) as what the cast to value_dtype takes."""

    def encode(self, kv: torch.Tensor, layer: int, level: int = 0) -> np.ndarray:
        check_encode_level(self.name, level, self.num_levels)
        x = self.tokens(kv)
        scale = token_scales(x, self.qmax)
        if not bool(torch.isfinite(scale).all()):  # a token holding inf or NaN: its absmax is too
            raise Unrepresentable(f"{self.name} cannot carry non-finite KV")
        scale_bytes = scale.numel() * 4
        out = np.empty(scale_bytes + x.numel(), dtype=np.uint8)
        bytes_as_tensor(out[:scale_bytes], torch.float32).copy_(scale.reshape(-1))
        values = bytes_as_tensor(out[scale_bytes:], self.value_dtype).view(x.shape)
        values.copy_(self.to_values(x / scale[..., None]))
        return out

    def decode(self, payload: Payload, layer: int, level: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        check_decode_level(self.name, level, self.num_levels)
        data = payload_bytes(payload)
        scale_bytes = 2 * num_tokens * 4
        expect_size(self.name, data.nbytes, scale_bytes + 2 * num_tokens * self.channels)
        scale = bytes_as_tensor(data[:scale_bytes], torch.float32).view(2, num_tokens, 1)
        values = bytes_as_tensor(data[scale_bytes:], self.value_dtype).view(2, num_tokens, self.channels)
        out = values.to(torch.float32).mul_(scale)
        # A token near the largest float32 can round past it (inf); its true values are within dtype's range.
        limit = torch.finfo(dtype).max
        out = out.clamp_(-limit, limit).to(dtype)
        return out.view(2, num_tokens, self.layout.num_kv_heads, self.layout.head_dim)

    def tokens(self, kv: torch.Tensor) -> torch.Tensor:
        """[2, n, heads, head_dim] -> float32 [2, n, channels] on the CPU."""
        return kv.detach().to("cpu", torch.float32).reshape(2, -1, self.channels)


# float32's rounding of x / scale, relative to |x|, and of what is cast to the one-byte type after it:
# a quotient rounded onto a half (int8) or a midpoint (e4m3) may then round the wrong way.
QUOTIENT_ROUNDING = 2.0**-23


def token_scales(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """[2, n] float32: each token's absmax / qmax, or 1 where the token is all zeros (inf or NaN
    where it holds one). Rounded up where float32 rounded it down, so absmax / scale <= qmax: for
    subnormal scales (absmax under ~1e-36) that rounding is coarse, and the clamp to qmax would cost more
    than scale / 2."""
    absmax = x.abs().amax(dim=2)
    scale = absmax / qmax
    scale = torch.where(absmax / scale > qmax, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    return torch.where(scale == 0, torch.ones_like(scale), scale)
