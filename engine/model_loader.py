"""Load a local Hugging Face causal-LM directory with transformers' own modeling code."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput
from transformers.utils import logging as hf_logging

from pdserve.engine.attention import ATTENTION_NAME, AttentionProbe, attending, register_paged_attention
from pdserve.engine.kv_cache import KVLayout
from pdserve.engine.multimodal.vision import FAMILIES, VisionModel

# Per-layer kinds whose layers attend with plain (optionally windowed) softmax attention.
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    kv_layout: KVLayout
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    vision: VisionModel | None = None  # a vision-language model's image side


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: str,
    block_size: int,
    max_model_len: int | None = None,
) -> LoadedModel:
    """Load a causal LM the engine can serve exactly, or raise ValueError saying what it lacks.

    Support is decided by what the model does, not by its name: its config must describe a decoder
    (with a vision tower of a family `multimodal.vision` knows, for a vision-language model), and one
    probing forward pass must show every layer attending through transformers' attention interface
    with one K/V shape and no argument the paged attention cannot honour.
    """
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json (make one with `pdserve make-model`)")
    full_config = AutoConfig.from_pretrained(path)
    vision_family = _check_config(full_config)
    config = full_config.get_text_config()
    max_len = context_limit(config, max_model_len)

    hf_logging.disable_progress_bar()  # a per-shard bar per worker start is noise in server logs
    paged = register_paged_attention()
    try:
        if vision_family is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=paged)
        else:  # the vision tower attends bidirectionally within each image, with transformers' own kernel
            model = AutoModelForImageTextToText.from_pretrained(
                path, dtype=dtype, attn_implementation={"text_config": paged, "vision_config": "sdpa"})
    except ValueError as e:  # no causal-LM class, or a class that refuses custom attention functions
        raise ValueError(f"model type {config.model_type!r} cannot be served: {e}") from None
    except KeyError as e:  # a class that looks its attention up in a table of its own (Falcon, GPT-Neo)
        if e.args != (ATTENTION_NAME,):
            raise
        raise ValueError(f"model type {config.model_type!r} cannot be served: it does not take attention "
                         f"functions through transformers' attention interface (it has no {e})") from None
    model.to(device).eval()
    _check_rope_within(model, config, max_len)
    tokenizer = load_tokenizer(path)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        kv_layout=_probe_kv_layout(model, config, block_size, dtype, mrope=vision_family is not None
                                   and FAMILIES[vision_family].uses_mrope),
        max_model_len=max_len,
        eos_token_ids=eos_ids(config, tokenizer) | eos_ids(full_config, tokenizer),
        vocab_size=config.vocab_size,
        vision=None if vision_family is None else FAMILIES[vision_family](model, path, full_config),
    )


def _check_config(config: PretrainedConfig) -> str | None:
    """Refuse, before any weight is read, what the config already says the engine cannot serve; the
    vision family of a vision-language model (None for a text-only one)."""
    name = repr(config.model_type)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model type {name} is an encoder-decoder model (config.is_encoder_decoder); "
                         "the engine serves decoder-only causal LMs")
    towers = [key for key in ("vision_config", "audio_config", "speech_config") if getattr(config, key, None)]
    family = config.model_type if towers == ["vision_config"] and config.model_type in FAMILIES else None
    if towers and family is None:
        raise ValueError(f"model type {name} is multimodal ({', '.join(towers)}) of a family the engine does not "
                         f"place images for (it knows {', '.join(sorted(FAMILIES))}); load the text model alone, "
                         "e.g. a *_text model type")
    config = config.get_text_config()
    if getattr(config, "kv_lora_rank", None):
        raise ValueError(f"model type {name} uses multi-head latent attention (kv_lora_rank), which the paged "
                         "pool does not store")
    other = sorted(set(getattr(config, "layer_types", None) or []) - ATTENTION_LAYER_TYPES)
    if other:
        raise ValueError(f"model type {name} has layers of type {', '.join(other)}; the engine serves models "
                         f"whose layers are all {' or '.join(sorted(ATTENTION_LAYER_TYPES))}")
    return family


def _rope_settings(config: PretrainedConfig) -> list[dict]:
    """Every RoPE parameter set of the config (transformers 5 may keep one per layer type)."""
    found = []
    for value in (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None)):
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            found += nested or [value]
    return found


def _probe_kv_layout(model: PreTrainedModel, config: PretrainedConfig, block_size: int,
                     dtype: torch.dtype, mrope: bool = False) -> KVLayout:
    """One forward over a few tokens with an AttentionProbe: the layout of the KV every layer writes."""
    probe = AttentionProbe()
    device = next(model.parameters()).device
    ids = torch.arange(1, 4, device=device)[None, :] % config.vocab_size
    positions = torch.arange(3, device=device)[None, :]
    name = repr(config.model_type)
    try:
        with torch.inference_mode(), attending(probe):
            model(input_ids=ids, position_ids=positions.expand(3, 1, 3) if mrope else positions, use_cache=False,
                  logits_to_keep=1)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # attention code of the model's own that cannot run on what the paged one passes (MPT)
        raise ValueError(f"model type {name} cannot be served: its forward pass fails under the engine's "
                         f"attention ({type(e).__name__}: {e})") from e
    num_layers = config.num_hidden_layers
    seen = sorted(c.layer for c in probe.calls if c.layer is not None)
    if seen != list(range(num_layers)) or len(probe.calls) != num_layers:
        missing = sorted(set(range(num_layers)) - set(seen))
        raise ValueError(f"model type {name}: layers {missing or '(some)'} of {num_layers} do not run their "
                         "attention once each through transformers' attention interface with a layer_idx "
                         "(state-space, linear-attention or custom attention layers)")
    problems = sorted({what for c in probe.calls for what in c.unsupported})
    if not all(c.causal for c in probe.calls):
        problems.append("bidirectional (non-causal) attention")
    shapes = {(c.kv_heads, c.key_dim, c.value_dim) for c in probe.calls}
    if len(shapes) > 1:
        problems.append(f"layers that differ in K/V shape (kv heads, key size, value size): {sorted(shapes)}")
    kv_heads, key_dim, value_dim = min(shapes)
    if key_dim != value_dim:
        problems.append(f"keys ({key_dim}) and values ({value_dim}) of different head sizes")
    if problems:
        raise ValueError(f"model type {name} cannot be served exactly: it uses {'; '.join(problems)}")
    return KVLayout(num_layers=num_layers, num_kv_heads=kv_heads, head_dim=key_dim, block_size=block_size,
                    dtype=dtype)


def context_limit(config: PretrainedConfig, requested: int | None) -> int:
    """The context limit served: the requested max_model_len, capped by the model's own and, for
    longrope, by the length its short factors cover.

    Two RoPE kinds take their frequencies from the largest position in the forward pass, so over a
    packed row of many sequences they would differ from each sequence run alone, past a length:
    longrope switches to its long factors past original_max_position_embeddings, dynamic NTK rescales
    past its rotary's cached length (`_check_rope_within`). Within that length they are fixed."""
    native = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
    longrope = [int(rope.get("original_max_position_embeddings")
                    or getattr(config, "original_max_position_embeddings", 0) or native)
                for rope in _rope_settings(config) if _rope_kind(rope) == "longrope"]
    return min(requested or native, native, *longrope)


def _rope_kind(rope: dict) -> str | None:
    return rope.get("rope_type", rope.get("type"))


def _check_rope_within(model: PreTrainedModel, config: PretrainedConfig, max_len: int) -> None:
    """Refuse a dynamic-NTK rotary whose cached length is below the context served: past it, its
    frequencies would follow the longest sequence of each batch."""
    if not any(_rope_kind(rope) == "dynamic" for rope in _rope_settings(config)):
        return
    name = repr(config.model_type)
    cached = [int(m.max_seq_len_cached) for m in model.modules() if hasattr(m, "max_seq_len_cached")]
    if not cached:
        raise ValueError(f"model type {name} uses RoPE scaling 'dynamic' in a rotary that does not say the length "
                         "past which its frequencies follow the longest sequence of a batch")
    if max_len > min(cached):
        raise ValueError(f"model type {name} uses RoPE scaling 'dynamic', whose frequencies follow the longest "
                         f"sequence of a batch past {min(cached)} tokens: serve it with max_model_len <= {min(cached)}")


def cache_of(output: ModelOutput) -> Cache:
    """The KV cache a transformers forward pass returned: `cache` in the transformers that renamed it,
    `past_key_values` (which warns there) in those before."""
    cache = output.get("cache")
    return output["past_key_values"] if cache is None else cache


def cache_argument(model: PreTrainedModel) -> str:
    """The name under which this transformers' forward takes a KV cache to continue from."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


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


# Parts of a tokenizers pipeline that never shorten the text: what goes in comes out whole in the
# strings of the tokens, so no token stands for more characters than its string has.
_TEXT_KEEPING_NORMALIZERS = {"Prepend", "Lowercase", "NFD", "Replace"}  # Replace: only by a string as long
_TEXT_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most characters of text one token can stand for, or None when the tokenizer gives no bound.

    With it, a text of N characters holds at least N / max_token_chars tokens, so the router refuses a
    prompt too long for the context before tokenizing it. It holds for BPE tokenizers that keep every
    character of the text in some token: byte-level ones (GPT-2, Llama 3, Qwen, OLMo, pdserve's own: one
    string character per byte, every byte in the vocabulary) and SentencePiece-style ones with byte
    fallback (Llama 2, Mistral, Gemma). A tokenizer that can drop text gives None: one that splits on
    whitespace and drops it, strips, composes characters (NFC, NFKC), skips characters it lacks, has an
    unknown token that stands for a run of characters (WordPiece, Unigram, a fused BPE one), or has
    added tokens that take in the spaces beside them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a pure-Python tokenizer: nothing to read its pipeline from
        return None
    spec = json.loads(backend.to_str())
    model, vocab = spec["model"], backend.get_vocab(with_added_tokens=True)
    if (model["type"] != "BPE"
            or not _keeps_text(spec.get("normalizer"), "normalizers", _TEXT_KEEPING_NORMALIZERS)
            or not _keeps_text(spec.get("pre_tokenizer"), "pretokenizers", _TEXT_KEEPING_PRE_TOKENIZERS)
            or any(t["lstrip"] or t["rstrip"] for t in spec.get("added_tokens") or ())):
        return None
    # A character the vocabulary lacks is skipped, or becomes the unknown token (fused: one for a run).
    whole_words = not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix")
    every_byte = whole_words and (
        (_has_part(spec.get("pre_tokenizer"), "ByteLevel") and set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys())
        or (model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256))))
    if not every_byte and (model.get("unk_token") is None or model.get("fuse_unk")):
        return None
    return max(len(token) for token in vocab)


def _keeps_text(part: dict | None, members: str, keeping: set[str]) -> bool:
    """Whether a normalizer or pre-tokenizer (in tokenizer.json's form) never shortens the text."""
    if part is None:
        return True
    if part["type"] == "Sequence":
        return all(_keeps_text(p, members, keeping) for p in part[members])
    if part["type"] == "Replace":
        pattern = part["pattern"].get("String")
        return pattern is not None and len(part["content"]) >= len(pattern)
    return part["type"] in keeping and part.get("behavior") != "Removed"


def _has_part(part: dict | None, kind: str) -> bool:
    return part is not None and (part["type"] == kind or any(_has_part(p, kind) for p in part.get("pretokenizers", ())))


def eos_ids(config: object, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every token id that ends generation: the config's (one or a list) and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return frozenset(ids)
