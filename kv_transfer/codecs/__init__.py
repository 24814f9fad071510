"""KV codecs: one frame of one layer's KV to bytes and back (`interface.Codec`).

  raw       the engine dtype's own bytes; exact
  int8      per-token absmax scale, 8 bits per element
  fp8       float8 e4m3 with a per-token scale, where torch has the type
  cachegen  CacheGen: grouped anchors and deltas, per-layer bit allocation, entropy coded with
            per-(layer, channel) distributions profiled offline and stored with the model
            (`pdserve kv-profile`); several quality levels

A codec that cannot be used here (unknown name, no fp8 in this torch, no tables for this model)
raises `CodecUnavailable`; the receiver then negotiates down to raw.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from pdserve.engine.kv_cache import KVLayout
from pdserve.kv_transfer.codecs.base import CodecUnavailable
from pdserve.kv_transfer.interface import Codec, Payload

CODEC_NAMES = ("raw", "int8", "fp8", "cachegen")

__all__ = ["CODEC_NAMES", "Codec", "CodecUnavailable", "checksum", "make_codec"]


def make_codec(name: str, model_dir: str | Path | None, layout: KVLayout) -> Codec:
    """A codec for KV of `layout` (of the model in `model_dir`, which cachegen's tables come with)."""
    if name == "raw":
        from pdserve.kv_transfer.codecs.raw import RawCodec

        return RawCodec(layout)
    if name == "int8":
        from pdserve.kv_transfer.codecs.int8 import Int8Codec

        return Int8Codec(layout)
    if name == "fp8":
        from pdserve.kv_transfer.codecs.fp8 import Fp8Codec

        return Fp8Codec(layout)
    if name == "cachegen":
        from pdserve.kv_transfer.codecs.cachegen import CacheGenCodec

        return CacheGenCodec.for_model(model_dir, layout)
    raise CodecUnavailable(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}")


def checksum(payload: Payload) -> int:
    """CRC32 of a payload's bytes (what every frame header carries)."""
    return zlib.crc32(memoryview(payload).cast("B")) & 0xFFFFFFFF
