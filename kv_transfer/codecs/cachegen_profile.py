"""Profile CacheGen's tables for one model, offline: `pdserve kv-profile MODEL` writes
`cachegen_tables.npz` into the model directory, where the codec finds them.

The model reads calibration text (the Python standard library's source, which every machine has)
in windows; the KV it caches gives each (layer, K/V, channel) its mean and spread, which set the
step sizes, and then, quantized exactly as the codec quantizes, the symbol histograms that become
the entropy coder's distributions (with a small pseudo-count, so that a symbol unseen in
calibration still codes, at a high cost).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from pdserve.engine.model_loader import cache_of, context_limit, load_tokenizer
from pdserve.engine.models.training import calibration_text
from pdserve.kv_transfer.codecs.cachegen import TABLES_FILE, CacheGenTables
from pdserve.kv_transfer.codecs.cachegen_quant import Steps, channels_first, coded_deltas, quantize

GROUP_SIZE = 10  # CacheGen's group: one anchor token, nine deltas
LEVEL_FACTORS = (0.5, 1.0, 2.0)  # step / channel spread at the shallow layer group; level 0 finest
RADIUS = 31  # symbols beyond +-31 steps from the channel mean escape (they travel as float32)
PSEUDO_COUNT = 0.05


def layer_factors(num_layers: int) -> np.ndarray:
    """Bit allocation by layer group: the first third of the layers at 1x, the middle third 1.5x, the
    rest 2x the step (CacheGen's finding: errors in shallow layers hurt the most)."""
    groups = np.minimum(np.arange(num_layers) * 3 // max(num_layers, 1), 2)
    return np.array([1.0, 1.5, 2.0], dtype=np.float32)[groups]


@torch.no_grad()
def collect_kv(model_dir: str | Path, num_tokens: int, window: int,
               progress: bool) -> tuple[list[np.ndarray], tuple[int, int]]:
    """Per layer: float32 [2, channels, tokens] of the KV the model caches for `num_tokens` tokens of
    calibration text (whole groups of them), window by window (each a whole number of groups, the last
    one perhaps shorter); and (KV heads, head size) as cached."""
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    context = context_limit(model.config, None)
    window = min(window, context) // GROUP_SIZE * GROUP_SIZE
    if window < GROUP_SIZE:
        raise ValueError(f"cannot profile cachegen with windows of {window} tokens (the model's context is "
                         f"{context}): each must hold a group of {GROUP_SIZE}")
    ids = tokenizer(calibration_text(num_tokens * 8), add_special_tokens=False)["input_ids"][:num_tokens]
    ids = ids[: len(ids) // GROUP_SIZE * GROUP_SIZE]
    if not ids:
        raise ValueError(f"cannot profile cachegen on {num_tokens} tokens: it takes a group of {GROUP_SIZE} at least")
    per_layer: list[list[np.ndarray]] = [[] for _ in range(model.config.num_hidden_layers)]
    heads = (0, 0)
    for start in tqdm(range(0, len(ids), window), desc="kv-profile", disable=not progress):
        cache = cache_of(model(torch.tensor([ids[start : start + window]]), use_cache=True))
        for layer, layer_cache in enumerate(cache.layers):
            kv = torch.stack([layer_cache.keys[0], layer_cache.values[0]]).transpose(1, 2)  # [2, T, H, D]
            heads = (kv.shape[2], kv.shape[3])
            # A sliding-window layer keeps only its last window - 1 tokens: its latest whole groups,
            # so no zero padding enters the statistics.
            whole = kv.shape[1] // GROUP_SIZE * GROUP_SIZE
            if whole:
                per_layer[layer].append(channels_first(kv[:, kv.shape[1] - whole :], GROUP_SIZE))
    if short := [layer for layer, chunks in enumerate(per_layer) if not chunks]:
        raise ValueError(f"layers {short} keep the KV of fewer than {GROUP_SIZE} tokens (their sliding window): "
                         "cachegen cannot profile them")
    return [np.concatenate(chunks, axis=2) for chunks in per_layer], heads


def build_tables(kv_per_layer: list[np.ndarray], head_layout: tuple[int, int]) -> CacheGenTables:
    num_layers, levels = len(kv_per_layer), len(LEVEL_FACTORS)
    two, channels, _ = kv_per_layer[0].shape
    alphabet = 2 * RADIUS + 2
    shape = (num_layers, levels, two, channels)
    mean = np.stack([x.mean(axis=2) for x in kv_per_layer]).astype(np.float32)
    spread = np.stack([x.std(axis=2) for x in kv_per_layer]).astype(np.float32)
    spread = np.maximum(spread, 1e-6)
    by_layer = layer_factors(num_layers)
    step = (np.asarray(LEVEL_FACTORS, np.float32)[None, :, None, None] * by_layer[:, None, None, None]
            * spread[:, None])
    radius = np.full(shape, RADIUS, dtype=np.int32)
    anchor_counts = np.zeros((*shape, alphabet))
    delta_counts = np.zeros((*shape, alphabet))
    for layer, x in enumerate(kv_per_layer):
        for level in range(levels):
            steps = Steps(step[layer, level][..., None], step[layer, level][..., None],
                          radius[layer, level][..., None], radius[layer, level][..., None])
            symbols = quantize(x, mean[layer][..., None], steps, x.shape[2], GROUP_SIZE)
            coded = coded_deltas(x.shape[2], GROUP_SIZE)
            _histogram(symbols.anchors, anchor_counts[layer, level])
            _histogram(symbols.deltas[:, :, :coded], delta_counts[layer, level])
    return CacheGenTables(
        group_size=GROUP_SIZE,
        layout=np.array([num_layers, *head_layout], dtype=np.int64),
        level_factors=np.asarray(LEVEL_FACTORS, np.float32),
        layer_factors=by_layer,
        mean=mean,
        anchor_step=step,
        delta_step=step.copy(),
        radius=radius,
        anchor_probs=_probabilities(anchor_counts),
        delta_probs=_probabilities(delta_counts),
    )


def _histogram(symbols: np.ndarray, out: np.ndarray) -> None:
    """Adds each (K/V, channel) row's symbol counts to out[K/V, channel, :]."""
    two, channels, _ = symbols.shape
    alphabet = out.shape[-1]
    rows = np.arange(two * channels).reshape(two, channels, 1) * alphabet
    out += np.bincount((rows + symbols).ravel(), minlength=two * channels * alphabet).reshape(out.shape)


def _probabilities(counts: np.ndarray) -> np.ndarray:
    probs = counts + PSEUDO_COUNT
    return (probs / probs.sum(axis=-1, keepdims=True)).astype(np.float32)


def profile_cachegen(model_dir: str | Path, num_tokens: int = 65536, window: int = 1000,
                     progress: bool = True) -> Path:
    """Profile the model in `model_dir` and write its tables there; returns the file."""
    kv, heads = collect_kv(model_dir, num_tokens, window, progress)
    tables = build_tables(kv, heads)
    path = Path(model_dir) / TABLES_FILE
    tables.save(path)
    return path
