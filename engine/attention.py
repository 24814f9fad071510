"""Paged attention plugged into Hugging Face models through transformers' attention interface.

The model runs on one packed row of tokens ([1, total_tokens], no padding) with explicit position
ids, so RoPE and every projection are Hugging Face's own code. Only the attention core is ours: each
layer writes this step's keys and values into the paged pool, then reads each sequence's whole
context back through its block table.

  - a prefill chunk with no earlier context attends to its own fresh K/V (causal);
  - a chunk that continues earlier context (chunked prefill, prefix-cache hit) gathers its blocks and
    uses a causal mask shifted by the context length;
  - all single-token (decode) rows run as one padded batch over their gathered blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from pdserve.engine.kv_cache import PagedKVCache

ATTENTION_NAME = "pdserve_paged"


@dataclass
class PrefillSpan:
    """A run of >1 query tokens of one sequence inside the packed row."""

    start: int  # first query token in the packed row
    length: int  # number of query tokens
    context_len: int  # tokens of KV after this step, including the query tokens
    block_ids: torch.Tensor | None  # blocks to gather, None when the span has no earlier context
    mask: torch.Tensor | None  # [length, context_len] bool, None for the plain causal case


@dataclass
class DecodeBatch:
    """Every single-token query row of the step, attended as one padded batch."""

    token_index: torch.Tensor  # [B] positions of the query tokens in the packed row
    block_ids: torch.Tensor  # [B, max_blocks] block tables, padded with block 0
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool, True where a key is valid


@dataclass
class PagedBatch:
    """What the attention function needs to know about the current step."""

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [total_tokens] pool slot of each new token
    prefills: list[PrefillSpan]
    decode: DecodeBatch | None
    on_layer_written: Callable[[int], None] | None = None  # KV-transfer hook (save_kv_layer)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    pdserve_batch: PagedBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if pdserve_batch is None:
        raise RuntimeError(
            f"attention '{ATTENTION_NAME}' needs the engine's batch metadata; run the model through "
            "engine.ModelRunner, or load it with attn_implementation='sdpa' for plain use"
        )
    batch = pdserve_batch
    layer = module.layer_idx
    cache = batch.kv_cache
    new_k = key[0].transpose(0, 1)  # [tokens, kv_heads, head_dim]
    new_v = value[0].transpose(0, 1)
    cache.key_slots(layer).index_copy_(0, batch.slot_mapping, new_k)
    cache.value_slots(layer).index_copy_(0, batch.slot_mapping, new_v)
    if batch.on_layer_written is not None:
        batch.on_layer_written(layer)

    q = query[0]  # [heads, tokens, head_dim]
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)
    for span in batch.prefills:
        stop = span.start + span.length
        if span.block_ids is None:
            k, v = key[:, :, span.start : stop], value[:, :, span.start : stop]
        else:
            k = _gather(cache.key_blocks(layer), span.block_ids, span.context_len)
            v = _gather(cache.value_blocks(layer), span.block_ids, span.context_len)
        o = F.scaled_dot_product_attention(
            q[None, :, span.start : stop], k, v,
            attn_mask=span.mask, is_causal=span.mask is None, scale=scaling, enable_gqa=True,
        )
        out[span.start : stop] = o[0].transpose(0, 1)

    if batch.decode is not None:
        d = batch.decode
        qd = q[:, d.token_index].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, head_dim]
        kd = _gather_padded(cache.key_blocks(layer), d.block_ids)
        vd = _gather_padded(cache.value_blocks(layer), d.block_ids)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=scaling, enable_gqa=True)
        out[d.token_index] = o[:, :, 0]
    return out.unsqueeze(0), None


def _gather(blocks: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, d] -> [1, kv_heads, length, d] for one sequence."""
    kv = blocks.index_select(0, block_ids).flatten(0, 1)[:length]
    return kv.transpose(0, 1).unsqueeze(0)


def _gather_padded(blocks: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, d] -> [B, kv_heads, max_blocks * block_size, d]."""
    kv = blocks[block_ids]  # [B, max_blocks, block_size, kv_heads, d]
    return kv.flatten(1, 2).transpose(1, 2)


def register_paged_attention() -> str:
    """Make `attn_implementation=ATTENTION_NAME` available to every transformers model."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
