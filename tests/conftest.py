"""Shared fixtures: small random-weight models built once per test session, and HF references."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.engine.models.presets import PRESETS, make_model

# Every family the engine is tested on: Llama, Qwen2 (with and without a window), Qwen3, Mistral
# (window shorter than the prompts), Gemma 2 and 3 (local/global layers; soft-capping), Phi-3, OLMo 2.
TEST_PRESETS = tuple(name for name in PRESETS if name.startswith("tiny-"))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_model(name, root / name, seed=0) for name in TEST_PRESETS}


class HFReference:
    """Greedy continuations from transformers' own `generate` (the ground truth), memoised."""

    def __init__(self, model_dir: Path) -> None:
        # eager: transformers' literal attention, the one every family supports (Gemma 2 has no SDPA path).
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        self.model.eval()
        self.vocab_size = self.model.config.vocab_size
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._memo:
            out = self.model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )
            self._memo[key] = out[0, len(prompt):].tolist()
        return self._memo[key]


@pytest.fixture(scope="session")
def hf_reference(model_dirs: dict[str, Path]) -> dict[str, HFReference]:
    return {name: HFReference(path) for name, path in model_dirs.items()}


def random_prompts(n: int, vocab_size: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts avoiding the special ids 0-2 (pad, bos, eos)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]
