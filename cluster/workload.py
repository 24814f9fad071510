"""Benchmark workloads: prompt/output lengths from the shared request traces, scaled to a small model."""

from __future__ import annotations

import csv
import os
import random
from dataclasses import dataclass
from pathlib import Path

# The traces live beside the checkout (../shared/traces); PDSERVE_TRACES names another folder.
TRACE_DIRS = tuple(Path(p) for p in [os.environ.get("PDSERVE_TRACES")] if p) + (
    Path(__file__).resolve().parents[2] / "shared" / "traces",)


@dataclass(frozen=True)
class RequestShape:
    prompt_len: int
    output_len: int


def azure_conv_shapes(n: int, input_scale: float, output_scale: float, max_prompt: int, max_output: int,
                      trace_dir: Path | None = None, seed: int = 0) -> tuple[list[RequestShape], str]:
    """`n` request shapes from the Azure conversation trace (first rows), scaled and clipped.

    Falls back to a seeded log-normal with the trace's median lengths when the trace is absent;
    the second value says which source was used.
    """
    for d in ([trace_dir] if trace_dir else []) + list(TRACE_DIRS):
        path = Path(d) / "azure2023_conv.csv"
        if path.is_file():
            with path.open() as f:
                rows = list(csv.DictReader(f))[:n]
            shapes = [
                RequestShape(
                    max(4, min(max_prompt, round(int(r["ContextTokens"]) * input_scale))),
                    max(2, min(max_output, round(int(r["GeneratedTokens"]) * output_scale))),
                )
                for r in rows
            ]
            return shapes, str(path)
    rng = random.Random(seed)
    shapes = [
        RequestShape(
            max(4, min(max_prompt, round(rng.lognormvariate(6.9, 0.9) * input_scale))),
            max(2, min(max_output, round(rng.lognormvariate(4.9, 0.9) * output_scale))),
        )
        for _ in range(n)
    ]
    return shapes, "synthetic log-normal (trace not found)"


def random_token_prompts(shapes: list[RequestShape], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, made of ordinary (non-special) token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(s.prompt_len)] for s in shapes]
