"""The `cachegen` codec: CacheGen's KV encoding with distributions profiled offline for the model.

Each frame of one layer is quantized by `cachegen_quant` (tokens in groups: an anchor token, then
deltas against the reconstructed anchor), after the channel's mean is taken off. Step sizes are per
(layer, level, K/V, channel): the channel's spread times the level's factor times its layer group's
(shallow layers get finer steps: their errors travel through every later layer). Symbols are entropy
coded by constriction's ANS coder (`cachegen_coding`: those near zero two at a time), each channel
with its own categorical distribution for anchors and one for deltas, profiled offline on calibration
text (`cachegen_profile`) and stored next to the model (`cachegen_tables.npz`): nothing about the
distributions travels with a frame. Both sides must hold the same tables and code alike: a prefill
worker offers the codec with a digest of both, and a decode worker whose digest differs refuses it.

Payload: u32 number of escapes, the escaped values (float32), then the ANS words (u32). Error bound:
|x - decoded| <= step / 2 for every element, plus float32's rounding on the way and the rounding to
the engine's dtype (`error_bound` counts both); escaped values, non-finite ones included, exact.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

import constriction
import numpy as np
import torch

from pdserve.engine.kv_cache import KVLayout
from pdserve.kv_transfer.codecs.base import (
    CodecUnavailable,
    check_decode_level,
    check_encode_level,
    payload_bytes,
    rounded_like,
)
from pdserve.kv_transfer.codecs.cachegen_coding import FORMAT, DecodedRows, RowModels, check_probabilities
from pdserve.kv_transfer.codecs.cachegen_quant import (
    Steps,
    channels_first,
    coded_deltas,
    dequantize,
    escape_count,
    num_groups,
    quantize,
)
from pdserve.kv_transfer.interface import CorruptFrame, Payload

TABLES_FILE = "cachegen_tables.npz"
# float32's rounding on the way to a decoded value, relative to the magnitudes involved (`error_bound`):
# a dozen roundings of 2^-24 each at most, with room.
ROUNDING = 2.0**-20
_COUNT = struct.Struct("<I")


@dataclass(frozen=True)
class CacheGenTables:
    """Everything both sides need, profiled for one model. Arrays are indexed [layer, level, K/V, channel]."""

    group_size: int
    layout: np.ndarray  # int64 [num_layers, num_kv_heads, head_dim]: the model these tables fit
    level_factors: np.ndarray  # float32 [levels]: step = factor x layer factor x channel spread
    layer_factors: np.ndarray  # float32 [num_layers]
    mean: np.ndarray  # float32 [layer, K/V, channel]
    anchor_step: np.ndarray  # float32 [layer, level, K/V, channel]
    delta_step: np.ndarray
    radius: np.ndarray  # int32 [layer, level, K/V, channel]: symbols 0..2R+1 (2R+1: escape)
    anchor_probs: np.ndarray  # float32 [layer, level, K/V, channel, 2 R_max + 2]
    delta_probs: np.ndarray

    @property
    def num_levels(self) -> int:
        return len(self.level_factors)

    @cached_property
    def digest(self) -> str:
        """Of every field, so tables profiled anew (other text, another seed) differ: a decode worker
        with other tables than the prefill worker's would decode every frame wrong without an error."""
        h = hashlib.sha256()
        for f in fields(self):
            value = np.ascontiguousarray(getattr(self, f.name))
            h.update(f"{f.name}:{value.dtype.str}:{value.shape};".encode())
            h.update(value.tobytes())
        return h.hexdigest()[:16]

    def save(self, path: str | Path) -> None:
        np.savez_compressed(path, group_size=np.int64(self.group_size),
                            **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "group_size"})

    @classmethod
    def load(cls, path: str | Path) -> CacheGenTables:
        with np.load(path) as data:
            values = {f.name: data[f.name] for f in fields(cls)}
        values["group_size"] = int(values["group_size"])
        return cls(**values)

    def steps(self, layer: int, level: int) -> Steps:
        radius = self.radius[layer, level][..., None]
        return Steps(self.anchor_step[layer, level][..., None], self.delta_step[layer, level][..., None],
                     radius, radius)


class CacheGenCodec:
    name = "cachegen"
    lossless = False
    fixed_bytes_per_token = None  # entropy coded: measured

    def __init__(self, tables: CacheGenTables, layout: KVLayout) -> None:
        expected = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
        if tuple(int(v) for v in tables.layout) != expected:
            raise CodecUnavailable(f"cachegen tables are for KV layout {tuple(tables.layout)}, this model has "
                                   f"{expected} (layers, KV heads, head dim)")
        for probs in (tables.anchor_probs, tables.delta_probs):
            try:
                check_probabilities(probs, tables.radius)
            except ValueError as e:
                raise CodecUnavailable(str(e)) from None
        self.tables = tables
        # What both sides must hold alike: the tables, and the coding their payloads use.
        self.digest = hashlib.sha256(f"{tables.digest}:{FORMAT}".encode()).hexdigest()[:16]
        self.layout = layout
        self.num_levels = tables.num_levels
        self.group_size = tables.group_size
        self._models: dict[tuple[int, int], tuple[RowModels, RowModels]] = {}

    @classmethod
    def for_model(cls, model_dir: str | Path | None, layout: KVLayout) -> CacheGenCodec:
        path = Path(model_dir) / TABLES_FILE if model_dir is not None else None
        if path is None or not path.is_file():
            raise CodecUnavailable(f"codec 'cachegen' needs tables profiled for the model ({TABLES_FILE} in "
                                   f"{model_dir}); make them with `pdserve kv-profile MODEL`")
        return cls(CacheGenTables.load(path), layout)

    def encode(self, kv: torch.Tensor, layer: int, level: int = 0) -> np.ndarray:
        check_encode_level(self.name, level, self.num_levels)
        n = kv.shape[1]
        x = channels_first(kv, self.group_size)
        symbols = quantize(x, self.tables.mean[layer][..., None], self.tables.steps(layer, level), n, self.group_size)
        coded = coded_deltas(n, self.group_size)
        anchor_models, delta_models = self._row_models(layer, level)
        coder = constriction.stream.stack.AnsCoder()
        # A stack: pushed in the reverse of the order `_decode_rows` reads (anchors, then deltas).
        if coded:
            delta_models.encode(coder, symbols.deltas[:, :, :coded].reshape(-1, coded))
        anchor_models.encode(coder, symbols.anchors.reshape(-1, symbols.anchors.shape[2]))
        words = coder.get_compressed()
        return np.concatenate([np.frombuffer(_COUNT.pack(len(symbols.escapes)), np.uint8),
                               symbols.escapes.view(np.uint8), words.view(np.uint8)])

    def decode(self, payload: Payload, layer: int, level: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        check_decode_level(self.name, level, self.num_levels)
        data = payload_bytes(payload)
        if data.nbytes < _COUNT.size or (data.nbytes - _COUNT.size) % 4:
            raise CorruptFrame(f"cachegen payload of {data.nbytes} bytes is not a count and 32-bit words")
        (num_escapes,) = _COUNT.unpack_from(data)
        words_at = _COUNT.size + 4 * num_escapes
        if words_at > data.nbytes:
            raise CorruptFrame(f"cachegen payload names {num_escapes} escapes, it has room for fewer")
        escapes = data[_COUNT.size : words_at].copy().view(np.float32)
        words = data[words_at:].copy().view(np.uint32)
        steps = self.tables.steps(layer, level)
        anchors, deltas = self._decode_rows(words, layer, level, num_tokens)
        if (decoded_escapes := escape_count(anchors, deltas, steps)) != num_escapes:
            raise CorruptFrame(f"cachegen payload decodes to {decoded_escapes} escapes, its header says {num_escapes}")
        x = dequantize(anchors, deltas, escapes, self.tables.mean[layer][..., None], steps, self.group_size,
                       num_tokens, float(torch.finfo(dtype).max))
        # Tokens first, as the engine holds them: a view for float32 (whoever stores it copies it anyway).
        out = torch.from_numpy(x).transpose(1, 2).to(dtype)
        return out.view(2, num_tokens, self.layout.num_kv_heads, self.layout.head_dim)

    def _decode_rows(self, words: np.ndarray, layer: int, level: int, num_tokens: int) -> tuple[DecodedRows, DecodedRows]:
        """(anchors, deltas), each value its quantized value times its step."""
        anchor_models, delta_models = self._row_models(layer, level)
        try:
            coder = constriction.stream.stack.AnsCoder(words)
            anchors = anchor_models.decode(coder, num_groups(num_tokens, self.group_size))
            deltas = delta_models.decode(coder, coded_deltas(num_tokens, self.group_size))
        except Exception as e:  # constriction raises on words that cannot have come from its encoder
            raise CorruptFrame(f"cachegen payload does not decode: {e}") from None
        return anchors, deltas

    def error_bound(self, kv: torch.Tensor, layer: int, level: int = 0) -> torch.Tensor:
        """The largest |x - decoded| of each element, decoded in kv's dtype: shaped like kv. Half a step,
        plus float32's rounding on the way (taking the mean off, the quotient, which may land on a half
        and round the wrong way, the products and sums that rebuild the value: each within 2^-24 of
        what it rounds, which the channel's largest distance from its mean in the frame bounds)."""
        shape = (2, 1, self.layout.num_kv_heads, self.layout.head_dim)
        step = torch.from_numpy(np.maximum(self.tables.anchor_step[layer, level],
                                           self.tables.delta_step[layer, level])).view(shape).double()
        mean = torch.from_numpy(self.tables.mean[layer]).view(shape).double()
        x = kv.detach().to("cpu", torch.float64)
        spread = torch.where(torch.isfinite(x), (x - mean).abs(), 0.0).amax(dim=1, keepdim=True)
        rounding = ROUNDING * (x.abs().nan_to_num(0.0, 0.0, 0.0) + mean.abs() + spread + step)
        return rounded_like(step / 2 + rounding, kv)

    def _row_models(self, layer: int, level: int) -> tuple[RowModels, RowModels]:
        """(anchor models, delta models), built once per (layer, level)."""
        key = (layer, level)
        if key not in self._models:
            t = self.tables
            radius = t.radius[layer, level].reshape(-1)
            self._models[key] = tuple(
                RowModels.from_probs(probs[layer, level].reshape(len(radius), -1), radius, step[layer, level])
                for probs, step in ((t.anchor_probs, t.anchor_step), (t.delta_probs, t.delta_step)))
        return self._models[key]
