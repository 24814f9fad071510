"""Engine configuration: memory budget, batching limits, device and precision."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.cost_model import StepCost
from pdserve.engine.multimodal.images import ImageLimits
from pdserve.engine.speculative.config import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """Knobs of one engine instance. Defaults suit a small model on a CPU."""

    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_memory_bytes: int = 256 * 2**20
    max_model_len: int | None = None  # None: the model's own context limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (decode tokens + prefill chunks)
    prefill_chunk_size: int | None = None  # None: a prompt may take the whole step budget
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # The prompt-pass costs a stored profile measured for this model, threads and machine: the start-up
    # profile takes them instead of measuring (`engine.profiler.profile_prefill`); None: measure.
    stored_step_cost: StepCost | None = None
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # A prefill worker that sends the draft model's prompt KV (`SpeculativeConfig.draft_kv`): each prompt
    # chunk is also run through the speculative settings' draft model, into its own KV pool.
    draft_prompt_kv: bool = False
    image_limits: ImageLimits = field(default_factory=ImageLimits)  # a vision-language model's requests

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device.startswith("cpu") and self.dtype == "float16":
            raise ValueError("dtype float16 is not supported on CPU; use float32 or bfloat16")
        for name in ("block_size", "kv_memory_bytes", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1 or None, got {self.prefill_chunk_size!r}")
        if self.draft_prompt_kv and (self.speculative is None or self.speculative.draft_model is None):
            raise ValueError("draft_prompt_kv needs speculative settings that name a draft model")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None, got {self.max_model_len!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def chunk_limit(self) -> int:
        """Most prompt tokens one request may prefill in one step."""
        return min(self.prefill_chunk_size or self.max_num_batched_tokens, self.max_num_batched_tokens)
