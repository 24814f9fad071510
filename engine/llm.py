"""Offline batch generation: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.presets import resolve_model
from pdserve.engine.sampling_params import RequestOutput, SamplingParams


class LLM:
    """Runs prompts to completion on one engine with continuous batching.

    `model` is a model directory or a preset name (built and cached on first use); keyword arguments
    are EngineConfig fields.
    """

    def __init__(self, model: str | Path, **config: object) -> None:
        self.engine = LLMEngine(resolve_model(model), EngineConfig(**config))  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt if isinstance(prompt, str) else list(prompt), sp))
        except ValueError:
            for request_id in ids:  # one bad prompt fails the call and leaves the engine as it was
                self.engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]
