"""KV codecs: one frame of one layer's KV to bytes and back (`interface.Codec`).

  raw       the engine dtype's own bytes; exact
  int8      per-token absmax scale, 8 bits per element
  fp8       float8 e4m3 with a per-token scale, where torch has the type
  cachegen  CacheGen: grouped anchors and deltas, per-layer bit allocation, entropy coded with
            per-(layer, channel) distributions profiled offline and stored with the model
            (`pdserve kv-profile`); several quality levels

A codec that cannot be used here (unknown name, no fp8 in this torch, no tables for this model)
raises `CodecUnavailable`; the receiver then negotiates down to raw. A codec is offered by name, with
the digest of what both sides must hold alike after an '@' (`offers`): "cachegen@1f0c...".
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

from pdserve.engine.kv_cache import KVLayout
from pdserve.kv_transfer.codecs.base import CodecUnavailable
from pdserve.kv_transfer.interface import Codec, FrameHeader, Payload

CODEC_NAMES = ("raw", "int8", "fp8", "cachegen")

log = logging.getLogger(__name__)

__all__ = ["CODEC_NAMES", "Codec", "CodecUnavailable", "checksum", "frame_checksum", "make_codec", "offers",
           "parse_offer", "usable_codec"]


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


def usable_codec(name: str, model_dir: str | Path | None, layout: KVLayout, refused: str) -> Codec | None:
    """`make_codec`, or None when the codec cannot be used here (unknown, unsupported, or its tables
    unreadable), logged with `refused` saying what follows from that."""
    try:
        return make_codec(name, model_dir, layout)
    except Exception as e:  # any failure to build it only leaves this codec out
        level = logging.WARNING if isinstance(e, CodecUnavailable) else logging.ERROR
        log.log(level, "KV codec %r %s: %s: %s", name, refused, type(e).__name__, e)
        return None


def offers(codecs: Mapping[str, Codec]) -> list[str]:
    """What a reservation offers, in order: each codec by its name (the key), with its digest after
    an '@' when it has one."""
    return [f"{name}@{codec.digest}" if codec.digest else name for name, codec in codecs.items()]


def parse_offer(offered: str) -> tuple[str, str]:
    """The codec's name and digest ("" for none) of an offer."""
    name, _, digest = offered.partition("@")
    return name, digest


def checksum(payload: Payload) -> int:
    """A payload's checksum: CRC32 of host bytes; for a tensor payload (on a GPU, for NCCL), an
    Adler-style pair of sums of its 32-bit words computed where it lives, so checking it never copies
    the payload to the host. A frame carries `frame_checksum`, which covers its header too."""
    if isinstance(payload, torch.Tensor):
        return _tensor_checksum(payload)
    return zlib.crc32(memoryview(payload).cast("B")) & 0xFFFFFFFF


def frame_checksum(header: FrameHeader, payload: Payload) -> int:
    """What a frame header's `crc32` holds: the checksum of the payload, seeded with (for a tensor,
    combined with) the CRC32 of the header's other fields, so a damaged layer, position or length is
    caught like damaged bytes, instead of writing good KV to the wrong place."""
    covered = zlib.crc32(header.covered())
    if isinstance(payload, torch.Tensor):
        return checksum(payload) ^ covered
    return zlib.crc32(memoryview(payload).cast("B"), covered) & 0xFFFFFFFF


_CHECKSUM_PASS_WORDS = 1 << 20  # bounds the int64 temporaries of one pass at 8 MiB each
_CHECKSUM_MODULUS = 65521  # the largest prime below 2**16 (Adler-32's): no bit flip is a multiple of it


def _tensor_checksum(payload: torch.Tensor) -> int:
    data = payload.reshape(-1).view(torch.uint8)
    pad = -data.numel() % 4
    if pad or data.storage_offset() % 4:  # whole, aligned 32-bit words
        data = torch.cat([data, data.new_zeros(pad)])
    words = data.view(torch.int32)
    plain = torch.zeros((), dtype=torch.int64, device=words.device)
    weighted = torch.zeros_like(plain)
    # Sums of the words and of the words weighted by position, modulo a prime: a word changed by any
    # amount short of a multiple of the prime (every single flipped bit) changes the plain sum, and
    # reordered words change the weighted one. Residues keep every product and pass sum far inside
    # int64, so every device (and any slicing into passes) gets the same answer.
    for start in range(0, words.numel(), _CHECKSUM_PASS_WORDS):
        residues = (words[start : start + _CHECKSUM_PASS_WORDS].to(torch.int64) & 0xFFFFFFFF) % _CHECKSUM_MODULUS
        positions = torch.arange(start + 1, start + residues.numel() + 1, dtype=torch.int64,
                                 device=words.device) % _CHECKSUM_MODULUS
        plain = (plain + residues.sum()) % _CHECKSUM_MODULUS
        weighted = (weighted + (residues * positions).sum()) % _CHECKSUM_MODULUS
    return int(weighted) << 16 | int(plain)  # one wait for the device, at the end
