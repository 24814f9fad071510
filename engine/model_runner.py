"""Turns a scheduled step into one packed forward pass over the paged pool and returns logits."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from pdserve.engine.attention import DecodeBatch, PagedBatch, PrefillSpan, attending
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.multimodal.placement import text_positions
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.sequence import Sequence

# Called with (layer index, the step's chunks) right after that layer's new KV is in the pool.
LayerHook = Callable[[int, list[ScheduledChunk]], None]


class ModelRunner:
    def __init__(self, model: PreTrainedModel, kv_cache: PagedKVCache, device: torch.device | str,
                 mrope: bool = False) -> None:
        self.model = model
        self.mrope = mrope  # M-RoPE positions ([3, tokens]: Qwen2-VL), for every run
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.device = torch.device(device)
        self.last_forward_s = 0.0  # wall time of the model call alone, for the step-time split
        self.layer_hook: LayerHook | None = None

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Compute KV for every chunk; return logits [num sampling chunks' positions, vocab], in chunk order:
        a sampling chunk's newest token's logits, then each of its draft tokens'."""
        runs = [TokenRun(c.input_ids, c.seq.num_computed_tokens, c.seq.block_table,
                         # the newest token (and drafts after it) attend as decode queries over the context
                         as_decode=c.num_tokens == 1 or bool(c.draft),
                         num_logits=1 + len(c.draft) if c.samples else 0,
                         image_rows=_image_rows(c.seq, c.seq.num_computed_tokens, len(c.input_ids)),
                         mrope_positions=_mrope_positions(c.seq, c.seq.num_computed_tokens, len(c.input_ids))
                         if self.mrope else None) for c in chunks]
        hook = self.layer_hook
        return self.forward(runs, None if hook is None else lambda layer: hook(layer, chunks))

    @torch.inference_mode()
    def forward(self, runs: list[TokenRun], on_layer_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """One packed pass over every run's tokens, writing their KV; the logits each run keeps, in order."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_rows: list[_DecodeRow] = []
        keep: list[int] = []
        bs = self.block_size
        for run in runs:
            n, first, table = len(run.input_ids), run.first_position, run.block_table
            start = len(input_ids)
            input_ids.extend(run.input_ids)
            positions.extend(range(first, first + n))
            if n == 1:
                slots.append(table[first // bs] * bs + first % bs)
            else:
                pos = np.arange(first, first + n)
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            if run.as_decode:
                decode_rows.append(_DecodeRow(start, n, table, first + n))
            else:
                prefills.append(self._prefill_span(start, n, first, table))
            keep.extend(range(start + n - run.num_logits, start + n))

        dev = self.device
        batch = PagedBatch(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            prefills=prefills,
            # Rows verifying drafts apart from those decoding one token: one padded batch would pad
            # every row to the longest draft, each costing its whole context once per padded query.
            decodes=[self._decode_batch(group) for group in (
                [row for row in decode_rows if row.num_queries == 1],
                [row for row in decode_rows if row.num_queries > 1]) if group],
            on_layer_written=on_layer_written,
        )
        ids = torch.tensor([input_ids], dtype=torch.long, device=dev)
        if self.mrope:  # [3, 1, tokens]
            pos = torch.from_numpy(np.concatenate([run.mrope_positions for run in runs], axis=1)).to(dev)[:, None, :]
        else:
            pos = torch.tensor([positions], dtype=torch.long, device=dev)
        keep_index = torch.tensor(keep, dtype=torch.long, device=dev)
        t0 = time.perf_counter()
        tokens = self._token_inputs(ids, runs)
        with attending(batch):
            logits = self.model(**tokens, position_ids=pos, use_cache=False, logits_to_keep=keep_index).logits[0]
        if dev.type == "cuda":  # this stream only: KV read-outs and NCCL sends on other streams go on
            torch.cuda.current_stream(dev).synchronize()
        self.last_forward_s = time.perf_counter() - t0
        return logits

    def _token_inputs(self, ids: torch.Tensor, runs: list[TokenRun]) -> dict[str, torch.Tensor]:
        """The model's token input: the ids, or where image embeddings replace some of their rows, the
        embeddings (the models' own splicing, `masked_scatter` at placeholder ids, is this by position)."""
        if not any(run.image_rows for run in runs):
            return {"input_ids": ids}
        embeds = self.model.get_input_embeddings()(ids)
        start = 0
        for run in runs:
            for offset, rows in run.image_rows:
                embeds[0, start + offset : start + offset + len(rows)] = rows.to(embeds.device, embeds.dtype)
            start += len(run.input_ids)
        return {"inputs_embeds": embeds}

    def _prefill_span(self, start: int, n: int, first: int, table: list[int]) -> PrefillSpan:
        context_len = first + n
        if first == 0:
            return PrefillSpan(start, n, context_len, block_ids=None)
        num_blocks = -(-context_len // self.block_size)
        block_ids = torch.tensor(table[:num_blocks], dtype=torch.long, device=self.device)
        return PrefillSpan(start, n, context_len, block_ids=block_ids)

    def _decode_batch(self, rows: list[_DecodeRow]) -> DecodeBatch:
        max_blocks = max(-(-row.context_len // self.block_size) for row in rows)
        max_queries = max(row.num_queries for row in rows)
        tables = np.zeros((len(rows), max_blocks), dtype=np.int64)
        lengths = np.empty(len(rows), dtype=np.int64)
        token_index = np.empty((len(rows), max_queries), dtype=np.int64)
        for i, row in enumerate(rows):
            used = -(-row.context_len // self.block_size)
            tables[i, :used] = row.block_table[:used]
            lengths[i] = row.context_len
            token_index[i] = np.minimum(np.arange(max_queries), row.num_queries - 1) + row.start
        dev = self.device
        query_lens = None
        if max_queries > 1:
            query_lens = torch.tensor([row.num_queries for row in rows], dtype=torch.long, device=dev)
        return DecodeBatch(
            token_index=torch.from_numpy(token_index).to(dev),
            block_ids=torch.from_numpy(tables).to(dev),
            context_lens=torch.from_numpy(lengths).to(dev),
            block_size=self.block_size,
            query_lens=query_lens,
        )


@dataclass(frozen=True)
class TokenRun:
    """One sequence's tokens in a forward pass."""

    input_ids: list[int]
    first_position: int  # of the first token; the sequence's KV before it is in its blocks
    block_table: list[int]  # covering every position the run writes
    as_decode: bool  # attended as decode queries (a padded batch) rather than a prefill span
    num_logits: int  # logits kept: the last num_logits tokens'
    image_rows: tuple[tuple[int, torch.Tensor], ...] = ()  # (first token in the run, embeddings) replacing ids
    mrope_positions: np.ndarray | None = None  # [3, tokens], on a model with M-RoPE


def _image_rows(seq: Sequence, first: int, n: int) -> tuple[tuple[int, torch.Tensor], ...]:
    """The embedding rows of the images placed in the tokens [first, first + n) of `seq`, each with the
    token (counted from `first`) its first row replaces."""
    if seq.images is None or first >= seq.images.placed[-1].end:
        return ()
    if not seq.image_embeddings:
        raise RuntimeError(f"request {seq.request_id!r} computes image tokens without their embeddings")
    rows = []
    for index, image in seq.images.overlapping(first, first + n):
        lo, hi = max(first, image.offset), min(first + n, image.end)
        rows.append((lo - first, seq.image_embeddings[index][lo - image.offset : hi - image.offset]))
    return tuple(rows)


def _mrope_positions(seq: Sequence, first: int, n: int) -> np.ndarray:
    """[3, n] M-RoPE positions of the tokens [first, first + n): the prompt's own where it has images,
    then each token's index plus the request's delta."""
    delta = 0 if seq.images is None else seq.images.rope_delta
    known = 0 if seq.mrope_positions is None else seq.mrope_positions.shape[1]
    if first >= known:
        if seq.images is not None and first < seq.images.placed[-1].end:
            raise RuntimeError(f"request {seq.request_id!r} computes image tokens without their positions")
        return text_positions(first, n, delta)
    head = seq.mrope_positions[:, first : first + n]
    if head.shape[1] == n:
        return head
    return np.concatenate([head, text_positions(known, n - head.shape[1], delta)], axis=1)


@dataclass(frozen=True)
class _DecodeRow:
    """A sequence's decode queries in the packed row: its newest token and any drafts after it."""

    start: int  # first query token in the packed row
    num_queries: int
    block_table: list[int]
    context_len: int  # keys after this step, the queries included
