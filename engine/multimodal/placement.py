"""Where a prompt's images sit: what every engine holding the request needs, without the embeddings.

The placeholder tokens of an image are all one token id, so two prompts that differ only in their
images have the same token ids. The prefix cache tells them apart by the images' content hashes,
folded into the hash of every block an image overlaps (`PromptImages.block_extra`). M-RoPE models
(Qwen2-VL) give image tokens 2-D positions; text after the images continues from a position that is
not its index, so the request carries that difference (`rope_delta`) for every token it decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PlacedImage:
    offset: int  # first placeholder token in the prompt
    length: int  # placeholder tokens: one per embedding row
    content_hash: bytes
    grid: tuple[int, int, int] | None = None  # (temporal, height, width) patches, for M-RoPE positions

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class EmbeddingSpec:
    """An image's embeddings as everything but their values: what a receiver allocates for them
    before they travel (an encode worker's answer to the router, passed on to the prompt-pass worker)."""

    content_hash: bytes
    num_tokens: int  # embedding rows
    hidden_size: int  # values per row
    dtype: str  # a torch dtype's name: float32, bfloat16 or float16
    grid: tuple[int, int, int] | None = None  # (temporal, height, width) patches, M-RoPE families only


@dataclass(frozen=True)
class PromptImages:
    placed: tuple[PlacedImage, ...]
    # M-RoPE: a token at index i >= the prompt's last image takes position i + rope_delta on every axis.
    rope_delta: int = 0

    def block_extra(self, start: int, end: int) -> bytes:
        """What the hash of the block of tokens [start, end) adds to its token ids: the content and
        placement of every image it overlaps (empty when it overlaps none)."""
        return b"".join(image.content_hash + (image.offset - start).to_bytes(8, "little", signed=True)
                        for image in self.placed if image.offset < end and image.end > start)

    def overlapping(self, start: int, end: int) -> list[tuple[int, PlacedImage]]:
        """(index, image) of the images with placeholder tokens in [start, end)."""
        return [(i, image) for i, image in enumerate(self.placed) if image.offset < end and image.end > start]


def text_positions(first: int, n: int, rope_delta: int) -> np.ndarray:
    """[3, n] M-RoPE positions of n tokens after the images: their index plus the delta, on every axis."""
    return np.broadcast_to(np.arange(first + rope_delta, first + rope_delta + n), (3, n))
