"""A vision-language model's image side: its image processor, its vision tower and projector, and
where the resulting embeddings go in the prompt.

Two families, each the reference of a way to place image tokens that many models share:
  - LLaVA (`llava`): a CLIP-style tower, a fixed number of tokens per image (the crop's patches),
    1-D positions like text: what LLaVA-1.5, BakLLaVA and most "tower + MLP projector" models do;
  - Qwen2-VL (`qwen2_vl`): a native-resolution tower whose token count follows the image's size,
    and M-RoPE, 3-D positions (time, row, column) for image tokens: Qwen2-VL's scheme, which
    Qwen2.5-VL and Qwen3-VL keep.
Everything model-specific is transformers' own code (`get_image_features`, `get_rope_index`, the
image processors); this file only says which to call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel

from pdserve.engine.multimodal.images import DecodedImage
from pdserve.engine.multimodal.placement import EmbeddingSpec, PlacedImage, PromptImages
from pdserve.engine.sampling_params import BadParameter


@dataclass(frozen=True)
class EncodedImage:
    """An image's embeddings, made by a vision tower here or on an encode worker."""

    content_hash: bytes
    num_tokens: int
    grid: tuple[int, int, int] | None
    embeddings: torch.Tensor  # [num_tokens, hidden], on the CPU

    def check_for(self, hidden_size: int) -> None:
        """ValueError unless these embeddings fit a language model of `hidden_size` (an encoder's answer
        is checked before it is spliced into a prompt)."""
        if tuple(self.embeddings.shape) != (self.num_tokens, hidden_size) or not self.embeddings.is_floating_point():
            raise ValueError(f"image embeddings of shape {tuple(self.embeddings.shape)} do not fit "
                             f"{self.num_tokens} tokens of a {hidden_size}-wide model")

    @property
    def spec(self) -> EmbeddingSpec:
        return EmbeddingSpec(self.content_hash, self.num_tokens, self.embeddings.shape[-1],
                             str(self.embeddings.dtype).removeprefix("torch."), self.grid)

    @classmethod
    def of(cls, spec: EmbeddingSpec, embeddings: torch.Tensor) -> EncodedImage:
        """The image `spec` describes, with the embeddings that arrived for it."""
        return cls(spec.content_hash, spec.num_tokens, spec.grid, embeddings)


@dataclass(frozen=True)
class PreparedImage:
    """An image as its vision tower takes it."""

    content_hash: bytes
    pixel_inputs: dict[str, torch.Tensor]  # the image processor's output for this image alone
    num_tokens: int  # embedding rows the tower makes of it: its placeholder tokens in the prompt
    grid: tuple[int, int, int] | None  # (temporal, height, width) patches, M-RoPE families only


class VisionModel:
    """The image side of a loaded vision-language model."""

    uses_mrope: ClassVar[bool] = False  # 3-D positions for image tokens (`prompt_positions`)

    def __init__(self, model: PreTrainedModel, model_dir: str | Path, config: PretrainedConfig) -> None:
        self.model = model
        self.config = config
        self.dtype = next(model.parameters()).dtype
        self.placeholder_id = int(config.image_token_id)
        # The Pillow processors: the others need torchvision, which the engine does without.
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")

    def prepare(self, image: DecodedImage) -> PreparedImage:
        inputs = dict(self.image_processor(images=[image.pixels], return_tensors="pt"))
        return PreparedImage(image.content_hash, inputs, self.count_tokens(self.config, inputs), self._grid(inputs))

    @torch.inference_mode()
    def encode(self, images: Sequence[PreparedImage]) -> list[torch.Tensor]:
        """The embeddings of each image ([num_tokens, hidden], the language model's dtype), from one
        pass of the vision tower and projector over them all."""
        if not images:
            return []
        device = next(self.model.parameters()).device
        batched = {key: torch.cat([image.pixel_inputs[key] for image in images]).to(device)
                   for key in images[0].pixel_inputs}
        features = self.model.model.get_image_features(**batched, return_dict=True).pooler_output
        out = [f.reshape(-1, f.shape[-1]).to(self.dtype) for f in features]
        for image, rows in zip(images, out):
            if rows.shape[0] != image.num_tokens:  # the token count the prompt was expanded with
                raise RuntimeError(f"the vision tower made {rows.shape[0]} embeddings of an image expected to "
                                   f"take {image.num_tokens} tokens")
        return out

    def encode_images(self, images: Sequence[PreparedImage]) -> list[EncodedImage]:
        """`encode`, each image's embeddings with what placing them needs (an encode worker's answer)."""
        return [EncodedImage(image.content_hash, image.num_tokens, image.grid, rows.cpu())
                for image, rows in zip(images, self.encode(images))]

    def place(self, token_ids: Sequence[int],
              images: Sequence[PreparedImage | EncodedImage]) -> tuple[list[int], PromptImages]:
        """Expand each image's single placeholder token in `token_ids` to its number of tokens."""
        found = [i for i, t in enumerate(token_ids) if t == self.placeholder_id]
        if len(found) != len(images):
            raise BadParameter("images", f"the prompt has {len(found)} image placeholders (token "
                                         f"{self.placeholder_id}) for {len(images)} images: one per image, in order")
        expanded: list[int] = []
        placed: list[PlacedImage] = []
        start = 0
        for at, image in zip(found, images):
            expanded.extend(token_ids[start:at])
            placed.append(PlacedImage(len(expanded), image.num_tokens, image.content_hash, image.grid))
            expanded.extend([self.placeholder_id] * image.num_tokens)
            start = at + 1
        expanded.extend(token_ids[start:])
        prompt_images = PromptImages(tuple(placed))
        if self.uses_mrope and any(a.end == b.offset for a, b in zip(placed, placed[1:])):
            # M-RoPE numbers each run of image tokens as one image (transformers' `get_rope_index`).
            raise BadParameter("images", "two image placeholders are adjacent: with this model each image must be "
                                         "set apart by text (its chat template wraps each in "
                                         "<|vision_start|>...<|vision_end|>)")
        if self.uses_mrope:
            _, delta = self.prompt_positions(expanded, prompt_images)
            prompt_images = PromptImages(tuple(placed), delta)
        return expanded, prompt_images

    def prompt_positions(self, token_ids: Sequence[int], images: PromptImages) -> tuple[np.ndarray, int]:
        """[3, len(token_ids)] M-RoPE positions of a prompt, and the delta of the text after it."""
        raise NotImplementedError(f"{type(self).__name__} has 1-D positions")

    @classmethod
    def _grid(cls, inputs: dict[str, torch.Tensor]) -> tuple[int, int, int] | None:
        return None

    @classmethod
    def count_tokens(cls, config: PretrainedConfig, inputs: dict[str, torch.Tensor]) -> int:
        """The embedding rows the tower makes of an image its processor turned into `inputs`."""
        raise NotImplementedError


class LlavaVision(VisionModel):
    @classmethod
    def count_tokens(cls, config: PretrainedConfig, inputs: dict[str, torch.Tensor]) -> int:
        height, width = inputs["pixel_values"].shape[-2:]
        patch = config.vision_config.patch_size
        class_token = 1 if config.vision_feature_select_strategy == "full" else 0
        return (height // patch) * (width // patch) + class_token


class Qwen2VLVision(VisionModel):
    uses_mrope = True

    @classmethod
    def _grid(cls, inputs: dict[str, torch.Tensor]) -> tuple[int, int, int]:
        t, h, w = (int(v) for v in inputs["image_grid_thw"][0])
        return t, h, w

    @classmethod
    def count_tokens(cls, config: PretrainedConfig, inputs: dict[str, torch.Tensor]) -> int:
        t, h, w = cls._grid(inputs)
        return t * h * w // config.vision_config.spatial_merge_size ** 2

    def prompt_positions(self, token_ids: Sequence[int], images: PromptImages) -> tuple[np.ndarray, int]:
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        grids = torch.tensor([image.grid for image in images.placed], dtype=torch.long) if images.placed else None
        positions, delta = self.model.model.get_rope_index(
            ids, mm_token_type_ids=(ids == self.placeholder_id).int(), image_grid_thw=grids)
        return positions[:, 0, :].numpy(), int(delta.reshape(-1)[0])


FAMILIES: dict[str, type[VisionModel]] = {"llava": LlavaVision, "qwen2_vl": Qwen2VLVision}


def image_token_counter(model_dir: str | Path, config: PretrainedConfig) -> Callable[[int, int], int]:
    """tokens(width, height): the tokens an image of that size takes in this model's prompts (its image
    processor's resize, the family's count)."""
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    family = FAMILIES[config.model_type]

    @functools.cache
    def tokens(width: int, height: int) -> int:
        inputs = dict(processor(images=[Image.new("RGB", (width, height))], return_tensors="pt"))
        return family.count_tokens(config, inputs)

    return tokens


def tokens_per_image(model_dir: str | Path, config: PretrainedConfig, side: int = 1024) -> int:
    """The tokens a side x side image takes: the router's estimate of an image's share of a prompt,
    which it places before any worker has decoded the image."""
    return image_token_counter(model_dir, config)(side, side)


def load_encoder(model_dir: str | Path, dtype: torch.dtype, device: str) -> VisionModel:
    """A vision-language model's image side alone (an encode worker's): the model is loaded whole by
    transformers (which knows its checkpoint's layout), then its language model and head are dropped,
    so only the vision tower and projector stay in memory."""
    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in FAMILIES:
        raise ValueError(f"model type {config.model_type!r} is not a vision-language model of a family the "
                         f"encoder knows ({', '.join(sorted(FAMILIES))})")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype,
                                                        attn_implementation={"vision_config": "sdpa"})
    model.model.language_model = None
    model.lm_head = None
    model.to(device).eval()
    return FAMILIES[config.model_type](model, model_dir, config)
