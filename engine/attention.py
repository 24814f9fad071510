"""Paged attention plugged into Hugging Face models through transformers' attention interface.

The model runs on one packed row of tokens ([1, total_tokens], no padding) with explicit position
ids, so RoPE and every projection are Hugging Face's own code. Only the attention core is ours: each
layer writes this step's keys and values into the paged pool, then reads each sequence's whole
context back through its block table.

  - a prefill chunk with no earlier context attends to its own fresh K/V (causal);
  - a chunk that continues earlier context (chunked prefill, prefix-cache hit) gathers its blocks and
    uses a causal mask shifted by the context length;
  - decode rows run as a padded batch over their gathered blocks: one query token each, and the
    rows verifying draft tokens as a second batch (each query sees the context up to itself), so a
    long draft pads only the rows that verify.

Each layer's own attention arguments are honoured: `sliding_window` (a query at position i sees keys
j with i - window < j <= i, transformers' definition; Mistral, Qwen2, Gemma's local layers) narrows
the mask, built once per step for each window size; `softcap` (Gemma 2) caps the logits. Before a
model is served, an `AttentionProbe` runs one tiny forward through this same function to check that
every layer comes here and asks for nothing this function cannot do (an attention bias of its own in
`attention_mask`, say: this function builds its masks itself).

The step's batch reaches this function through a context variable (`attending`), not a forward
argument: some models' decoder layers (StableLM's, Nemotron's) do not pass extra arguments on to
their attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from pdserve.engine.kv_cache import PagedKVCache

ATTENTION_NAME = "pdserve_paged"
# Arguments some models pass that this attention cannot honour, with what they are.
UNSUPPORTED_ARGUMENTS = {"s_aux": "attention sinks (s_aux)"}


@dataclass
class PrefillSpan:
    """A run of >1 query tokens of one sequence inside the packed row."""

    start: int  # first query token in the packed row
    length: int  # number of query tokens
    context_len: int  # tokens of KV after this step, including the query tokens
    block_ids: torch.Tensor | None  # blocks to gather, None when the span has no earlier context
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[length, context_len] bool, True where a query sees a key; None for plain causal."""
        if window is not None and window >= self.context_len:
            window = None  # the window reaches past the first token: plain causal
        if window is None and self.block_ids is None:
            return None
        if window not in self._masks:
            keys = torch.arange(self.context_len, device=device)[None, :]
            queries = self.context_len - self.length + torch.arange(self.length, device=device)[:, None]
            visible = keys <= queries
            if window is not None:
                visible &= keys > queries - window
            self._masks[window] = visible
        return self._masks[window]


@dataclass
class DecodeBatch:
    """Decode rows of the step attended as one padded batch (the rows of one query token, or those
    verifying drafts): row b's `query_lens[b]` query tokens are the last of its `context_lens[b]` keys."""

    token_index: torch.Tensor  # [B, Q] positions of the query tokens in the packed row (padding repeats)
    block_ids: torch.Tensor  # [B, max_blocks] block tables, padded with block 0
    context_lens: torch.Tensor  # [B] keys of each row, its own query tokens included
    block_size: int
    query_lens: torch.Tensor | None = None  # [B]; None: one query per row
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)
    _queries: tuple[torch.Tensor, torch.Tensor | None] | None = field(default=None, repr=False)

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, Q, max_blocks * block_size] bool, True where a key is visible to a query."""
        if window not in self._masks:
            keys = torch.arange(self.block_ids.shape[1] * self.block_size, device=self.block_ids.device)[None, None, :]
            queries = self.token_index.shape[1]
            lengths = self.context_lens[:, None]
            if self.query_lens is not None:  # query i of a row sits at position length - query_len + i
                lengths = lengths - self.query_lens[:, None] + 1 + torch.arange(queries, device=keys.device)[None, :]
            lengths = lengths[:, :, None]  # [B, Q, 1]: keys below it are visible
            visible = keys < lengths
            if window is not None:
                visible &= keys >= lengths - window  # the query sits at position length - 1
            self._masks[window] = visible[:, None, :, :]
        return self._masks[window]

    def queries(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where the real queries' outputs go in the packed row, and which of the [B * Q] padded outputs
        they are (None: all of them, in order); computed once per step, used by every layer."""
        if self._queries is None:
            if self.query_lens is None:
                self._queries = (self.token_index.flatten(), None)
            else:
                queries = torch.arange(self.token_index.shape[1], device=self.token_index.device)[None, :]
                real = (queries < self.query_lens[:, None]).flatten().nonzero().squeeze(1)
                self._queries = (self.token_index.flatten()[real], real)
        return self._queries


@dataclass
class PagedBatch:
    """What the attention function needs to know about the current step."""

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [total_tokens] pool slot of each new token
    prefills: list[PrefillSpan]
    decodes: list[DecodeBatch]  # rows of one query token, and rows verifying drafts (padded apart)
    on_layer_written: Callable[[int], None] | None = None  # KV-transfer hook (save_kv_layer)


@dataclass
class LayerAttention:
    """What one layer's attention call looked like during a probe."""

    layer: int | None  # the module's layer_idx (None: it has none)
    kv_heads: int
    key_dim: int
    value_dim: int
    causal: bool
    unsupported: list[str]


@dataclass
class AttentionProbe:
    """Passed instead of a PagedBatch: records each layer's call and returns a dummy output."""

    calls: list[LayerAttention] = field(default_factory=list)

    def record(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, kwargs: dict[str, object]) -> tuple[torch.Tensor, None]:
        unsupported = [what for name, what in UNSUPPORTED_ARGUMENTS.items() if kwargs.get(name) is not None]
        if attention_mask is not None and not _only_causal(attention_mask, query.shape[2], key.shape[2]):
            unsupported.append("an attention mask or bias of its own (attention_mask)")
        self.calls.append(LayerAttention(
            layer=getattr(module, "layer_idx", None), kv_heads=key.shape[1], key_dim=key.shape[-1],
            value_dim=value.shape[-1], causal=bool(getattr(module, "is_causal", True)), unsupported=unsupported,
        ))
        batch, heads, tokens = query.shape[:3]
        return query.new_zeros(batch, tokens, heads, value.shape[-1]), None


def _only_causal(mask: torch.Tensor, queries: int, keys: int) -> bool:
    """Whether a model's mask says no more than causal visibility (boolean, or 0 / a large negative
    additive), which this function applies itself."""
    causal = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril(keys - queries)
    if mask.dtype == torch.bool:
        return bool((mask == causal).all())
    visible = mask > torch.finfo(mask.dtype).min / 2
    return bool((visible == causal).all()) and bool((mask[visible] == 0).all())


_BATCH: ContextVar[PagedBatch | AttentionProbe | None] = ContextVar("pdserve_batch", default=None)


@contextmanager
def attending(batch: PagedBatch | AttentionProbe) -> Iterator[None]:
    """Run the model's forward passes inside this: its attention layers serve `batch`."""
    token = _BATCH.set(batch)
    try:
        yield
    finally:
        _BATCH.reset(token)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    batch = _BATCH.get()
    if isinstance(batch, AttentionProbe):
        return batch.record(module, query, key, value, attention_mask, kwargs)
    if batch is None:
        raise RuntimeError(
            f"attention '{ATTENTION_NAME}' needs the engine's batch metadata; run the model through "
            "engine.ModelRunner, or load it with attn_implementation='sdpa' for plain use"
        )
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
        o = _attend(q[None, :, span.start : stop], k, v, span.mask(sliding_window, q.device), scaling, softcap)
        out[span.start : stop] = o[0].transpose(0, 1)

    for d in batch.decodes:
        qd = q[:, d.token_index].transpose(0, 1)  # [B, heads, Q, head_dim]
        kd = _gather_padded(cache.key_blocks(layer), d.block_ids)
        vd = _gather_padded(cache.value_blocks(layer), d.block_ids)
        o = _attend(qd, kd, vd, d.mask(sliding_window), scaling, softcap).transpose(1, 2).flatten(0, 1)
        index, real = d.queries()
        out[index] = o if real is None else o.index_select(0, real)
    return out.unsqueeze(0), None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
            softcap: float | None) -> torch.Tensor:
    """Attention of q [B, H, Lq, D] over k, v [B, Hkv, Lk, D]; mask None means causal with Lq == Lk."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    # Capped logits (tanh(s / cap) * cap) are not something SDPA can do: the explicit computation.
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


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
