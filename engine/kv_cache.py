"""Paged KV storage: one tensor holding K and V of every layer, addressed by block id.

Layout: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]. A token's slot is
block_id * block_size + offset; one layer's K (or V) is a flat view [num_slots, heads, head_dim]
that the attention function writes with one indexed copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.block_size * self.bytes_per_token_layer


@dataclass
class KVBlocks:
    """KV of some blocks of one request, as exported by one engine and imported by another.

    `data` is [num_layers or 1, 2, len(block_indices), block_size, num_kv_heads, head_dim];
    `layer` is None when it holds every layer. `block_indices` are positions in the request's block
    table (0 = the block holding its first tokens), so they mean the same thing on both sides.
    """

    request_id: str
    block_indices: list[int]
    layer: int | None
    data: torch.Tensor
    num_tokens: int  # tokens of KV the request has in total (the last block may be partial)
    block_size: int


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.data = torch.zeros(
            layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim,
            dtype=layout.dtype, device=device,
        )

    def key_slots(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0].view(-1, self.layout.num_kv_heads, self.layout.head_dim)

    def value_slots(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1].view(-1, self.layout.num_kv_heads, self.layout.head_dim)

    def key_blocks(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def value_blocks(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def read(self, block_ids: list[int], layer: int | None = None) -> torch.Tensor:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        if layer is None:
            return self.data.index_select(2, index).clone()
        return self.data[layer : layer + 1].index_select(2, index).clone()

    def token_slots(self, block_ids: list[int], start: int, num_tokens: int) -> torch.Tensor:
        """Slot index of each token in [start, start + num_tokens) of a request with these blocks."""
        bs = self.layout.block_size
        pos = torch.arange(start, start + num_tokens)
        table = torch.tensor(block_ids, dtype=torch.long)
        return (table[pos // bs] * bs + pos % bs).to(self.data.device)

    def read_tokens(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """K and V of one layer at `slots`: a new tensor [2, len(slots), heads, head_dim]."""
        return self.data[layer].flatten(1, 2).index_select(1, slots)

    def write_tokens(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write [2, len(slots), heads, head_dim] of K and V into one layer at `slots` (one copy)."""
        expected = (2, len(slots), self.layout.num_kv_heads, self.layout.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV data has shape {tuple(kv.shape)}, expected {expected}")
        self.data[layer].flatten(1, 2).index_copy_(1, slots, kv.to(device=self.data.device, dtype=self.data.dtype))

    def write(self, block_ids: list[int], data: torch.Tensor, layer: int | None = None) -> None:
        expected = (
            1 if layer is not None else self.layout.num_layers, 2, len(block_ids),
            self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim,
        )
        if tuple(data.shape) != expected:
            raise ValueError(f"KV data has shape {tuple(data.shape)}, this pool expects {expected}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        target = self.data if layer is None else self.data[layer : layer + 1]
        target.index_copy_(2, index, data.to(device=self.data.device, dtype=self.data.dtype))
