"""Named small models: random-weight presets built locally and cached on disk, and the shipped
trained model.

`make_model("llama-20m", dir)` writes a normal Hugging Face checkpoint directory (config.json,
model.safetensors, tokenizer files) that any transformers code can load. Same preset and seed, same
bytes. `resolve_model` turns a directory, a preset name, a shipped model's name or a Hugging Face Hub
id into such a directory. `pystd-llama`, the default, is trained (not random):
`engine/models/training.py` made it from the Python standard library's source and it ships in
`engine/models/checkpoints/` (`pdserve train-model` reproduces it).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.utils import logging as hf_logging

from pdserve.engine.models.hub import hub_snapshot, is_hub_id
from pdserve.engine.models.tokenizer import build_tokenizer, chat_template

BUILD_VERSION = 3  # bump when the build recipe changes, so cached models are rebuilt
MARKER = "pdserve_preset.json"


@dataclass(frozen=True)
class VisionPreset:
    """The image side of a vision-language preset: its family's composite config around the text model."""

    family: str  # the composite model type: "llava" or "qwen2_vl" (`engine.multimodal.vision.FAMILIES`)
    tower: dict[str, Any]  # vision_config
    image_processor: str  # a transformers image processor class (the Pillow ones: no torchvision needed)
    processor_settings: dict[str, Any]
    image_token: str  # the placeholder: `<image>`, `<|image_pad|>`
    # Special tokens the family's config names by id (config key -> token), the placeholder's included.
    token_ids: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)  # the composite config's own settings

    def hf_config(self, text_config: Any, tokenizer: Any) -> Any:
        ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in self.token_ids.items()}
        return AutoConfig.for_model(self.family, text_config=text_config.to_dict(), vision_config=self.tower,
                                    **ids, **self.extra)

    def save_image_processor(self, out: Path) -> None:
        getattr(transformers, self.image_processor)(**self.processor_settings).save_pretrained(out)


@dataclass(frozen=True)
class Preset:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    vision: VisionPreset | None = None  # a vision-language model's image side

    def hf_config(self, vocab_size: int) -> Any:
        return AutoConfig.for_model(
            self.model_type,
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            **self.extra,
        )


# The special tokens Qwen2-VL's config names by id.
QWEN2_VL_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                   "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}

PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset("llama", 1024, 64, 2, 4, 2, 192, 1024, description="~0.3M, Llama, GQA, for tests"),
    "tiny-qwen2": Preset(
        "qwen2", 1024, 64, 2, 4, 2, 192, 1024, tie_word_embeddings=True,
        description="~0.2M, Qwen2, GQA, QKV biases, tied embeddings, for tests",
    ),
    "tiny-mistral": Preset(
        "mistral", 1024, 64, 2, 4, 1, 192, 1024, extra={"sliding_window": 40},
        description="~0.3M, Mistral, multi-query attention, 40-token sliding window, for tests",
    ),
    # Windows are deliberately not multiples of the 16-token block, and shorter than test prompts.
    "tiny-qwen2-swa": Preset(
        "qwen2", 1024, 64, 2, 4, 2, 192, 1024, tie_word_embeddings=True,
        extra={"use_sliding_window": True, "sliding_window": 56, "max_window_layers": 1},
        description="~0.2M, Qwen2, full attention then a 56-token window, for tests",
    ),
    "tiny-qwen3": Preset(
        "qwen3", 1024, 64, 2, 4, 2, 192, 1024, extra={"head_dim": 16},
        description="~0.3M, Qwen3, QK-norm, for tests",
    ),
    "tiny-gemma2": Preset(
        "gemma2", 1024, 64, 2, 4, 2, 192, 1024, tie_word_embeddings=True,
        extra={"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 24},
        description="~0.2M, Gemma 2, local (24-token window) and global layers, logit soft-capping, for tests",
    ),
    "tiny-gemma3": Preset(
        "gemma3_text", 1024, 64, 2, 4, 1, 192, 1024, tie_word_embeddings=True,
        extra={"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 24,
               "layer_types": ["sliding_attention", "full_attention"]},
        description="~0.2M, Gemma 3, QK-norm, local (24-token window) and global layers, for tests",
    ),
    "tiny-phi3": Preset(
        "phi3", 1024, 64, 2, 4, 2, 192, 1024, description="~0.3M, Phi-3, fused QKV and MLP, for tests",
    ),
    "tiny-olmo2": Preset(
        "olmo2", 1024, 64, 2, 4, 4, 192, 1024, description="~0.3M, OLMo 2, QK-norm, post-norm, for tests",
    ),
    # Its decoder layers do not pass extra forward arguments on to their attention (Nemotron's neither).
    "tiny-stablelm": Preset(
        "stablelm", 1024, 64, 2, 4, 2, 192, 1024,
        extra={"partial_rotary_factor": 0.25, "use_parallel_residual": True, "qk_layernorm": True, "use_qkv_bias": True},
        description="~0.3M, StableLM, partial rotary, parallel residual, per-head QK-norm, for tests",
    ),
    # Vision-language models, one per way of placing image tokens (`engine/multimodal/vision.py`).
    "tiny-llava": Preset(
        "llama", 1024, 64, 2, 4, 2, 192, 1024,
        vision=VisionPreset(
            "llava", tower={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                            "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 7,
                            "projection_dim": 32},
            image_processor="CLIPImageProcessorPil",
            processor_settings={"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}},
            image_token="<image>", token_ids={"image_token_id": "<image>"},
            extra={"vision_feature_layer": -1, "vision_feature_select_strategy": "default"}),
        description="~0.3M, LLaVA: CLIP tower (16 tokens an image) and Llama, for tests",
    ),
    "tiny-qwen2-vl": Preset(
        "qwen2_vl_text", 1024, 64, 2, 4, 2, 192, 1024,
        extra={"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision=VisionPreset(
            "qwen2_vl", tower={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
                               "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
            image_processor="Qwen2VLImageProcessorPil",
            processor_settings={"min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28},
            image_token="<|image_pad|>", token_ids=QWEN2_VL_TOKENS),
        description="~0.3M, Qwen2-VL: native-resolution tower (4 to 64 tokens an image), M-RoPE, for tests",
    ),
    # Its vision tower costs several times its images' prompt pass (as in real VLMs): the encode pool's benchmark model.
    "qwen2-vl-20m": Preset(
        "qwen2_vl_text", 8192, 384, 8, 6, 2, 1024, 2048,
        extra={"rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}},
        vision=VisionPreset(
            "qwen2_vl", tower={"depth": 8, "embed_dim": 384, "hidden_size": 384, "num_heads": 6, "mlp_ratio": 4,
                               "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
            image_processor="Qwen2VLImageProcessorPil",
            processor_settings={"min_pixels": 16 * 28 * 28, "max_pixels": 256 * 28 * 28},
            image_token="<|image_pad|>", token_ids=QWEN2_VL_TOKENS),
        description="~30M, Qwen2-VL: an 8-layer tower (16 to 256 tokens an image), M-RoPE",
    ),
    "llama-20m": Preset("llama", 8192, 384, 8, 6, 2, 1024, 2048, description="~19M, Llama, GQA 6:2"),
    "qwen2-20m": Preset(
        "qwen2", 8192, 384, 8, 6, 2, 1024, 2048, tie_word_embeddings=True,
        description="~16M, Qwen2, QKV biases, tied embeddings",
    ),
    "llama-150m": Preset("llama", 8192, 1024, 12, 16, 4, 2816, 2048, description="~150M, Llama, GQA 16:4"),
}

CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"
SHIPPED = {
    "pystd-llama": "~5M, Llama, GQA 4:2, trained on the Python standard library (engine/models/training.py)",
    "pystd-llama-draft": "~3M, one layer, pystd-llama's draft model for speculative decoding "
                         "(engine/models/draft_training.py)",
}
SHIPPED_RECIPES = {"pystd-llama": "pdserve train-model", "pystd-llama-draft": "pdserve train-draft"}
DEFAULT_PRESET = "pystd-llama"


def default_cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "models"


def make_model(preset_name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build a preset's checkpoint into `out_dir` (replacing it). Deterministic in (preset, seed)."""
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; known presets: {', '.join(PRESETS)}")
    preset = PRESETS[preset_name]
    out = Path(out_dir)
    tokenizer = build_tokenizer(preset.vocab_size, seed)
    vision = preset.vision
    if vision is not None:
        tokenizer.add_special_tokens({"additional_special_tokens": sorted(set(vision.token_ids.values()))})
        tokenizer.chat_template = chat_template(vision.image_token)
    config = preset.hf_config(vocab_size=len(tokenizer))
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    if vision is None:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForImageTextToText.from_config(vision.hf_config(config, tokenizer), dtype=torch.float32)
    # Write into a temporary sibling, then rename: a crash never leaves a half-written model behind.
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if vision is not None:
        vision.save_image_processor(staging)
    info = {"preset": preset_name, "seed": seed, "build_version": BUILD_VERSION,
            "parameters": sum(p.numel() for p in model.parameters())}
    (staging / MARKER).write_text(json.dumps(info, indent=2))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out


def preset_info(model_dir: str | Path) -> dict[str, Any] | None:
    marker = Path(model_dir) / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def resolve_model(spec: str | Path, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """A model directory for `spec`: an existing directory, a shipped model, a Hugging Face Hub id (from
    the Hub's cache, downloaded there when missing: `hub.hub_snapshot`), or a preset name (built once,
    cached)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    name = str(spec)
    if name in SHIPPED:
        shipped = CHECKPOINTS / name
        if not (shipped / "config.json").is_file():
            raise FileNotFoundError(f"the shipped model {name!r} is missing from {shipped}; "
                                    f"`{SHIPPED_RECIPES[name]}` makes it again")
        return shipped
    if is_hub_id(name):
        return hub_snapshot(name)
    if "/" in name or name.startswith((".", "~")):
        raise FileNotFoundError(f"model directory {name!r} does not exist")
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: not a directory, a Hugging Face Hub id (organisation/name), "
                         f"a shipped model ({', '.join(SHIPPED)}) or a preset ({', '.join(PRESETS)})")
    target = (cache_dir or default_cache_dir()) / f"{name}-seed{seed}"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several workers may resolve the same preset at once: one builds, the others wait and reuse it.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        info = preset_info(target)
        if info is None or info.get("build_version") != BUILD_VERSION:
            make_model(name, target, seed)
    return target
