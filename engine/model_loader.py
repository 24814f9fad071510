"""Load a local Hugging Face causal-LM directory with transformers' own modeling code."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from pdserve.engine.attention import register_paged_attention
from pdserve.engine.kv_cache import KVLayout

# Model types whose attention is plain (GQA, RoPE, optional QKV bias) and therefore runs unchanged
# over the paged pool. Others may work but are refused until a test covers them.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    kv_layout: KVLayout
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: str,
    block_size: int,
    max_model_len: int | None = None,
) -> LoadedModel:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json (make one with `pdserve make-model`)")
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    max_len = context_limit(config, max_model_len)
    window = getattr(config, "sliding_window", None)
    if window is not None and (getattr(config, "use_sliding_window", True)) and window < max_len:
        raise ValueError(
            f"model uses sliding-window attention (window {window}) below the context limit {max_len}; "
            f"set max_model_len <= {window}"
        )

    hf_logging.disable_progress_bar()  # a per-shard bar per worker start is noise in server logs
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=register_paged_attention()
    ).to(device)
    model.eval()
    tokenizer = load_tokenizer(path)

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layout = KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        kv_layout=layout,
        max_model_len=max_len,
        eos_token_ids=_eos_ids(config, tokenizer),
        vocab_size=config.vocab_size,
    )


def context_limit(config: PretrainedConfig, requested: int | None) -> int:
    """The context limit served: the requested max_model_len, capped by the model's own."""
    native = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
    return min(requested or native, native)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer the directory declares.

    AutoTokenizer would replace a generic tokenizer.json tokenizer with the model type's own class
    (Qwen2Tokenizer adds special tokens of its own), so a directory that declares the generic backend
    is loaded as exactly that.
    """
    config_file = Path(model_dir) / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if declared in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)


def _eos_ids(config: object, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return frozenset(ids)
