"""The `fp8` codec: per-token absmax scaling (`scaled`) into float8 e4m3 (torch.float8_e4m3fn),
where torch has it.

Error bound, from e4m3's 3 mantissa bits and its subnormal spacing of 2^-9 (scale = absmax / 448):
|x - decoded| <= max(|x| / 16, scale / 1024), plus the rounding to the engine's dtype
and float32 arithmetic (`error_bound` counts both). A token holding inf or NaN raises `Unrepresentable`
(the sender sends that frame raw).
"""

from __future__ import annotations

import torch

from pdserve.engine.kv_cache import KVLayout
from pdserve.kv_transfer.codecs.base import CodecUnavailable, rounded_like
from pdserve.kv_transfer.codecs.scaled import QUOTIENT_ROUNDING, TokenScaledCodec, token_scales


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


class Fp8Codec(TokenScaledCodec):
    name = "fp8"
    qmax = 448.0  # e4m3's largest value

    def __init__(self, layout: KVLayout) -> None:
        super().__init__(layout)
        self.value_dtype = fp8_dtype()

    def to_values(self, scaled: torch.Tensor) -> torch.Tensor:
        # Clamped: float32 rounding of x / scale may land just past 448, which e4m3fn cannot hold.
        return scaled.clamp_(-self.qmax, self.qmax)

    def error_bound(self, kv: torch.Tensor, layer: int, level: int = 0) -> torch.Tensor:
        """The largest |x - decoded| of each element, decoded in kv's dtype: shaped like kv."""
        x = self.tokens(kv)
        scale = token_scales(x, self.qmax)[..., None]
        bound = torch.maximum(x.abs() / 16, scale / 1024) + x.abs() * QUOTIENT_ROUNDING
        return rounded_like(bound.view(kv.shape), kv)
