"""The `fp8` codec: float8 e4m3 (torch.float8_e4m3fn) with a scale per token, where torch has it.

Payload: float32 scales [2, num_tokens] (K's then V's, scale = absmax / 448, e4m3's largest value),
then one byte per element [2, num_tokens, heads, head_dim]. Error bound, from e4m3's 3 mantissa bits
and its subnormal spacing of 2^-9: |x - decoded| <= max(|x| / 16, scale / 1024) (plus float32
arithmetic and the rounding to the output dtype). Inputs must be finite.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.kv_cache import KVLayout
from pdserve.kv_transfer.codecs.base import (
    CodecUnavailable,
    bytes_as_tensor,
    check_decode_level,
    check_encode_level,
    expect_size,
    payload_bytes,
)
from pdserve.kv_transfer.codecs.int8 import token_scales
from pdserve.kv_transfer.interface import Payload

E4M3_MAX = 448.0


def fp8_dtype() -> torch.dtype:
    """torch's e4m3 type, if this torch has it and can convert to and from it here."""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        raise CodecUnavailable(f"codec 'fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")
    try:
        torch.ones(1).to(dtype).to(torch.float32)
    except (RuntimeError, TypeError) as e:
        raise CodecUnavailable(f"codec 'fp8': torch cannot convert to float8_e4m3fn here: {e}") from None
    return dtype


class Fp8Codec:
    name = "fp8"
    num_levels = 1
    lossless = False

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.channels = layout.num_kv_heads * layout.head_dim
        self.dtype = fp8_dtype()

    def encode(self, kv: torch.Tensor, layer: int, level: int = 0) -> np.ndarray:
        check_encode_level(self.name, level, self.num_levels)
        x = kv.detach().to("cpu", torch.float32).reshape(2, -1, self.channels)
        scale = token_scales(x, E4M3_MAX)
        scale_bytes = scale.numel() * 4
        out = np.empty(scale_bytes + x.numel(), dtype=np.uint8)
        bytes_as_tensor(out[:scale_bytes], torch.float32).copy_(scale.reshape(-1))
        # Clamped: float32 rounding of x / scale may land just past 448, which e4m3fn cannot hold.
        values = bytes_as_tensor(out[scale_bytes:], self.dtype).view(x.shape)
        values.copy_((x / scale[..., None]).clamp_(-E4M3_MAX, E4M3_MAX))
        return out

    def decode(self, payload: Payload, layer: int, level: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        check_decode_level(self.name, level, self.num_levels)
        data = payload_bytes(payload)
        scale_bytes = 2 * num_tokens * 4
        expect_size(self.name, data.nbytes, scale_bytes + 2 * num_tokens * self.channels)
        scale = bytes_as_tensor(data[:scale_bytes], torch.float32).view(2, num_tokens, 1)
        values = bytes_as_tensor(data[scale_bytes:], self.dtype).view(2, num_tokens, self.channels)
        out = (values.to(torch.float32) * scale).to(dtype)
        return out.view(2, num_tokens, self.layout.num_kv_heads, self.layout.head_dim)

    def error_bound(self, kv: torch.Tensor, layer: int, level: int = 0) -> torch.Tensor:
        """The largest |x - decoded| of each element: a tensor shaped like kv."""
        x = kv.detach().to("cpu", torch.float32).reshape(2, -1, self.channels)
        scale = token_scales(x, E4M3_MAX)[..., None]
        return torch.maximum(x.abs() / 16, scale / 1024).view(kv.shape)
