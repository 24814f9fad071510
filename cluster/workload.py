"""Benchmark workloads: prompt/output lengths from the shared request traces, scaled to a small model.

Traces (../shared/traces/README.md): Azure LLM inference CSVs (TIMESTAMP, ContextTokens,
GeneratedTokens) and Mooncake's JSONL (timestamp in ms, input_length, output_length, hash_ids: one id
per 512-token prompt block, equal ids = equal blocks, so replaying it exercises prefix caching).
"""

from __future__ import annotations

import csv
import json
import os
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

# The traces live beside the checkout (../shared/traces); PDSERVE_TRACES names another folder.
TRACE_DIRS = tuple(Path(p) for p in [os.environ.get("PDSERVE_TRACES")] if p) + (
    Path(__file__).resolve().parents[2] / "shared" / "traces",)


@dataclass(frozen=True)
class RequestShape:
    prompt_len: int
    output_len: int


DEFAULT_TRACE = "azure2023_conv.csv"


def check_azure_trace(name: str) -> None:
    """Raise ValueError unless `name` is an Azure CSV trace, the kind these benchmarks read."""
    if not name.endswith(".csv"):
        raise ValueError(f"the trace must be an Azure CSV (TIMESTAMP, ContextTokens, GeneratedTokens); got {name!r}")


def azure_trace_shapes(n: int, input_scale: float, output_scale: float, max_prompt: int, max_output: int,
                       trace_dir: Path | None = None, seed: int = 0,
                       trace: str = DEFAULT_TRACE) -> tuple[list[RequestShape], str]:
    """`n` request shapes from an Azure trace (first rows; the conversation trace by default), scaled
    and clipped.

    Falls back to a seeded log-normal with the conversation trace's median lengths when the default
    trace is absent (another one that is absent is an error); the second value says which source was
    used.
    """
    check_azure_trace(trace)
    try:
        path = find_trace(trace, trace_dir)
    except FileNotFoundError:
        if trace != DEFAULT_TRACE:
            raise
        rng = random.Random(seed)
        lengths = [(rng.lognormvariate(6.9, 0.9), rng.lognormvariate(4.9, 0.9)) for _ in range(n)]
        source = "synthetic log-normal (trace not found)"
    else:
        with path.open() as f:
            lengths = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in list(csv.DictReader(f))[:n]]
        source = str(path)
    shapes = [RequestShape(max(4, min(max_prompt, round(prompt * input_scale))),
                           max(2, min(max_output, round(output * output_scale))))
              for prompt, output in lengths]
    return shapes, source


def random_token_prompts(shapes: list[RequestShape], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, made of ordinary (non-special) token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(s.prompt_len)] for s in shapes]


# --- traces with arrival times --------------------------------------------------------------------
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake trace


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # since the trace's first request
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: one id per prompt block
    block_tokens: int = MOONCAKE_BLOCK  # the block length hash_ids stand for (scaled with the prompt)


def find_trace(name: str, trace_dir: Path | None = None) -> Path:
    """The trace file `name` in `trace_dir` or the default trace folders."""
    for d in ([trace_dir] if trace_dir else []) + list(TRACE_DIRS):
        path = Path(d) / name
        if path.is_file():
            return path
    searched = ", ".join(str(d) for d in ([trace_dir] if trace_dir else []) + list(TRACE_DIRS))
    raise FileNotFoundError(f"trace {name!r} not found in {searched} (PDSERVE_TRACES names another folder)")


def _azure_time(stamp: str) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, one more than datetime parses.
    whole, _, frac = stamp.partition(".")
    return datetime.fromisoformat(whole).timestamp() + (float(f"0.{frac}") if frac else 0.0)


def load_azure_trace(path: Path, n: int | None = None) -> list[TraceRequest]:
    """The first `n` rows (all if None) of an Azure LLM inference trace."""
    with Path(path).open() as f:
        rows = list(csv.DictReader(f))[:n]
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    t0 = _azure_time(rows[0]["TIMESTAMP"])
    return [TraceRequest(_azure_time(r["TIMESTAMP"]) - t0, int(r["ContextTokens"]), int(r["GeneratedTokens"]))
            for r in rows]


def load_mooncake_trace(path: Path, n: int | None = None) -> list[TraceRequest]:
    """The first `n` requests (all if None) of a Mooncake JSONL trace."""
    out: list[TraceRequest] = []
    with Path(path).open() as f:
        for line in f:
            if n is not None and len(out) >= n:
                break
            if line.strip():
                d = json.loads(line)
                out.append(TraceRequest(d["timestamp"] / 1000, int(d["input_length"]), int(d["output_length"]),
                                        tuple(d["hash_ids"])))
    if not out:
        raise ValueError(f"trace {path} has no requests")
    t0 = out[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0) for r in out]


def scale_requests(requests: list[TraceRequest], input_scale: float, output_scale: float, max_model_len: int,
                   max_output: int | None = None, min_prompt: int = 4, min_output: int = 2) -> list[TraceRequest]:
    """Scale lengths (and Mooncake's block length) to a small model; clip so prompt + output fits.

    The output is capped at `max_output` first, then the prompt is cut to what the context has left
    (cutting keeps a prefix, so shared Mooncake prefixes stay shared).
    """
    if min_prompt + min_output > max_model_len:
        raise ValueError(f"max_model_len {max_model_len} cannot hold {min_prompt} + {min_output} tokens")
    out = []
    for r in requests:
        output = max(min_output, round(r.output_len * output_scale))
        output = min(output, max_output or output, max_model_len - min_prompt)
        prompt = min(max(min_prompt, round(r.prompt_len * input_scale)), max_model_len - output)
        out.append(replace(r, prompt_len=prompt, output_len=output,
                           block_tokens=max(1, round(r.block_tokens * input_scale))))
    return out


def block_prompts(requests: list[TraceRequest], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts in which the same hash id is always the same block of token ids (deterministic by seed).

    A request whose hash ids do not cover its length (or that has none) is filled with tokens of its
    own, which no other request shares.
    """
    blocks: dict[tuple[int, int], list[int]] = {}
    rng = random.Random(seed)

    def block(hash_id: int, size: int) -> list[int]:
        if (hash_id, size) not in blocks:
            # Seeded per id, so a block does not depend on which request met it first.
            r = random.Random(f"{seed}:{hash_id}:{size}")
            blocks[hash_id, size] = [r.randrange(3, vocab_size) for _ in range(size)]
        return blocks[hash_id, size]

    prompts = []
    for req in requests:
        ids = [t for h in req.hash_ids for t in block(h, req.block_tokens)][:req.prompt_len]
        ids += [rng.randrange(3, vocab_size) for _ in range(req.prompt_len - len(ids))]
        prompts.append(ids)
    return prompts


def prefix_group_sample(requests: list[TraceRequest], n: int) -> list[TraceRequest]:
    """`n` requests taken as whole prefix groups, in trace order.

    A group is the requests whose first hash id is the same (they share at least one leading block);
    groups are taken in order of first appearance until `n` requests are in (the last may be cut).
    A window of consecutive Mooncake requests shares almost no prefix, as repeats lie minutes apart
    (about 4% of the first 100 requests' blocks repeat, against 62% over the whole trace); whole groups
    keep the trace's own degree of sharing in a short run. Requests without hash ids are groups of one.
    """
    groups: dict[object, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.hash_ids[0] if r.hash_ids else ("own", i), []).append(i)
    picked: list[int] = []
    for members in groups.values():  # insertion order: first appearance
        if len(picked) >= n:
            break
        picked += members[:n - len(picked)]
    return [requests[i] for i in sorted(picked)]
