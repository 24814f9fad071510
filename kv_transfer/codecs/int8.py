"""The `int8` codec: per-token absmax scaling (`scaled`) into int8.

Error bound: |x - decoded| <= scale / 2 = absmax / 254 for every element of the token, plus the
rounding to the engine's dtype and float32 arithmetic (`error_bound` counts both). A token holding inf or
NaN raises `Unrepresentable` (the sender sends that frame raw).
"""

from __future__ import annotations

import torch

from pdserve.kv_transfer.codecs.base import rounded_like
from pdserve.kv_transfer.codecs.scaled import QUOTIENT_ROUNDING, TokenScaledCodec, token_scales


class Int8Codec(TokenScaledCodec):
    name = "int8"
    value_dtype = torch.int8
    qmax = 127

    def to_values(self, scaled: torch.Tensor) -> torch.Tensor:
        return torch.round(scaled).clamp_(-self.qmax, self.qmax)  # integral already: the cast is exact

    def error_bound(self, kv: torch.Tensor, layer: int, level: int = 0) -> torch.Tensor:
        """The largest |x - decoded| each element may have, decoded in kv's dtype: shaped like kv."""
        x = self.tokens(kv)
        half_step = (token_scales(x, self.qmax) / 2)[..., None]
        return rounded_like((half_step + x.abs() * QUOTIENT_ROUNDING).view(kv.shape), kv)
