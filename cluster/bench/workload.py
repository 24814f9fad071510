"""Benchmark workloads: prompt/output lengths from the shipped request traces, scaled to a small model.

Traces (shipped in `traces/` beside this module, with their sources and licences in its README):
Azure LLM inference CSVs (TIMESTAMP, ContextTokens,
GeneratedTokens; other CSVs whose columns name arrival, prompt and output tokens, BurstGPT's say) and
Mooncake's JSONL (timestamp in ms, input_length, output_length, hash_ids: one id per prompt block,
512 tokens in its trace, equal ids = equal blocks, so replaying it exercises prefix caching). Rows
out of order are sorted by arrival; a row that does not parse is an error naming its file and line.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import itertools
import json
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

# The traces the benchmarks ship with, and before them PDSERVE_TRACES, a folder of one's own.
TRACE_DIRS = tuple(Path(p) for p in [os.environ.get("PDSERVE_TRACES")] if p) + (Path(__file__).resolve().parent / "traces",)


@dataclass(frozen=True)
class RequestShape:
    prompt_len: int
    output_len: int


DEFAULT_TRACE = "azure2023_conv.csv"


def check_azure_trace(name: str) -> None:
    """Raise ValueError unless `name` is an Azure CSV trace, the kind these benchmarks read."""
    if not name.lower().endswith((".csv", ".csv.gz")):
        raise ValueError(f"the trace must be a CSV (.csv or .csv.gz) such as Azure's (TIMESTAMP, ContextTokens, "
                         f"GeneratedTokens); got {name!r}")


def azure_trace_shapes(n: int, input_scale: float, output_scale: float, max_prompt: int, max_output: int,
                       trace_dir: Path | None = None, seed: int = 0,
                       trace: str = DEFAULT_TRACE) -> tuple[list[RequestShape], str]:
    """`n` request shapes from an Azure trace (first rows; the conversation trace by default), scaled
    and clipped.

    Falls back to a seeded log-normal with the conversation trace's median lengths when the default
    trace is absent (another one that is absent is an error); the second value says which source was
    used: the trace file's name (where it was found depends on the machine), or what stood in for it.
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
        lengths = [(r.prompt_len, r.output_len) for r in load_azure_trace(path, n)]
        source = path.name
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
class TraceImage:
    """An image of a request, as the simulator sees it: which image (equal keys: the same picture, an
    encoder's cache hit) and its tokens in the prompt."""

    key: int
    tokens: int


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # since the trace's first request
    prompt_len: int  # text and image tokens
    output_len: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: one id per prompt block
    block_tokens: int = MOONCAKE_BLOCK  # the block length hash_ids stand for (scaled with the prompt)
    images: tuple[TraceImage, ...] = ()

    @property
    def image_tokens(self) -> int:
        return sum(image.tokens for image in self.images)


IMAGE_SIZES = ((224, 224), (448, 336), (640, 480), (336, 600))  # width, height: camera-like shapes


@dataclass(frozen=True)
class ImageMix:
    """Which requests of a workload carry images, how many and which: a share of requests with 1 to 3
    (one most often), each of a size from `IMAGE_SIZES`, some drawn from a small pool of popular images
    (the repeats an embedding cache serves), the rest never seen before."""

    share: float = 0.6  # of requests with images
    popular_share: float = 0.3  # of images drawn from the popular pool
    popular_images: int = 4

    def __post_init__(self) -> None:
        if not (0 <= self.share <= 1 and 0 <= self.popular_share <= 1) or self.popular_images < 1:
            raise ValueError("an image mix's shares are in [0, 1], with at least one popular image")

    def draw(self, rng: random.Random, count: int) -> list[tuple[tuple[int, tuple[int, int]], ...]]:
        """Each of `count` requests' images as (key, (width, height)): keys below `popular_images` are
        the popular pool's, each with one size; the others are unique."""
        popular = [rng.choice(IMAGE_SIZES) for _ in range(self.popular_images)]
        fresh = itertools.count(self.popular_images)
        out = []
        for _ in range(count):
            n = rng.choice((1, 1, 2, 3)) if rng.random() < self.share else 0
            images = []
            for _ in range(n):
                if rng.random() < self.popular_share:
                    key = rng.randrange(self.popular_images)
                    images.append((key, popular[key]))
                else:
                    images.append((next(fresh), rng.choice(IMAGE_SIZES)))
            out.append(tuple(images))
        return out


def with_images(requests: list[TraceRequest], mix: ImageMix, tokens_of: Callable[[int, int], int], max_model_len: int,
                seed: int = 0) -> list[TraceRequest]:
    """`requests` with the images `mix` draws (seeded), their tokens (`tokens_of(width, height)`: the
    model's count) added to the prompt; an image that would leave no room for the output is left out."""
    out = []
    for request, drawn in zip(requests, mix.draw(random.Random(seed), len(requests))):
        images: list[TraceImage] = []
        room = max_model_len - request.prompt_len - request.output_len
        for key, (width, height) in drawn:
            tokens = tokens_of(width, height)
            if tokens <= room:
                images.append(TraceImage(key, tokens))
                room -= tokens
        added = sum(image.tokens for image in images)
        out.append(replace(request, prompt_len=request.prompt_len + added, images=tuple(images)))
    return out


def find_trace(name: str, trace_dir: Path | None = None) -> Path:
    """The trace file `name` in `trace_dir` or the default trace folders."""
    for d in ([trace_dir] if trace_dir else []) + list(TRACE_DIRS):
        path = Path(d) / name
        if path.is_file():
            return path
    searched = ", ".join(str(d) for d in ([trace_dir] if trace_dir else []) + list(TRACE_DIRS))
    raise FileNotFoundError(f"trace {name!r} not found in {searched} (PDSERVE_TRACES names another folder)")


# Columns by meaning, as spelled (case and spaces aside) by Azure's 2023 and 2024 traces, BurstGPT,
# Mooncake and common tools.
_COLUMNS = {
    "arrival": ("timestamp", "arrival_time", "arrival_s", "time"),
    "prompt": ("contexttokens", "request tokens", "input_length", "input_tokens", "prompt_tokens", "prompt_len"),
    "output": ("generatedtokens", "response tokens", "output_length", "output_tokens", "completion_tokens",
               "generated_tokens", "output_len"),
}


def _seconds(stamp: object, unit_s: float = 1.0) -> float:
    """A timestamp as seconds: a number (in units of `unit_s`), or a date and time in ISO form (a
    space or T between them, any fraction digits, an optional zone; none: UTC, not this machine's)."""
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float, str)):
        raise ValueError(f"timestamp {stamp!r} is neither a number nor a date and time")
    try:
        seconds = float(stamp) * unit_s
    except ValueError:
        try:
            moment = datetime.fromisoformat(stamp.strip())
        except ValueError:
            raise ValueError(f"timestamp {stamp!r} is neither a number nor an ISO date and time") from None
        seconds = (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()
    if not math.isfinite(seconds):
        raise ValueError(f"timestamp {stamp!r} is not finite")
    return seconds


def _tokens(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise ValueError(f"{what} {value!r} is not a whole number of tokens >= 0")
    return int(value)


def _fields(row: dict) -> dict[str, object]:
    """The row's arrival, prompt and output values, found under any of their columns' names."""
    named = {str(k).strip().lower(): v for k, v in row.items() if k is not None}
    found = {}
    for meaning, names in _COLUMNS.items():
        value = next((named[n] for n in names if named.get(n) not in (None, "")), None)
        if value is None:
            raise ValueError(f"no {meaning} value (a column named one of {', '.join(names)}; "
                             f"this row has {', '.join(named) or 'none'})")
        found[meaning] = value
    return found


def _trace_request(row: dict, unit_s: float = 1.0, hash_ids: tuple[int, ...] = ()) -> TraceRequest:
    """One row's request; its arrival as a number in units of `unit_s`, or a date and time."""
    fields = _fields(row)
    return TraceRequest(_seconds(fields["arrival"], unit_s), _tokens(fields["prompt"], "prompt length"),
                        _tokens(fields["output"], "output length"), hash_ids)


def _from_trace_start(requests: list[TraceRequest], path: Path) -> list[TraceRequest]:
    """Requests in order of arrival, timed from the first (rows out of order are sorted, not replayed
    hours late or all at once)."""
    if not requests:
        raise ValueError(f"trace {path} has no requests")
    requests = sorted(requests, key=lambda r: r.arrival_s)
    t0 = requests[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0) for r in requests]


def _open_text(path: Path) -> TextIO:
    """utf-8 (a byte-order mark skipped), gzip-compressed when the name ends in .gz."""
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return path.open(encoding="utf-8-sig", newline="")


def load_azure_trace(path: Path, n: int | None = None) -> list[TraceRequest]:
    """The first `n` rows (all if None) of a CSV trace: Azure's (TIMESTAMP, ContextTokens,
    GeneratedTokens), or another naming arrival, prompt and output tokens (BurstGPT's Timestamp,
    Request tokens, Response tokens; see `_COLUMNS`). Timestamps are dates and times, or seconds."""
    path = Path(path)
    requests = []
    with _open_text(path) as f:
        reader = csv.DictReader(f)
        for row in itertools.islice(reader, n):
            try:
                requests.append(_trace_request(row))
            except ValueError as e:
                raise ValueError(f"{path}:{reader.line_num}: {e}") from None
    return _from_trace_start(requests, path)


def load_mooncake_trace(path: Path, n: int | None = None, block_tokens: int | None = None) -> list[TraceRequest]:
    """The first `n` requests (all if None) of a JSONL trace in Mooncake's form: timestamp in ms,
    input_length, output_length, and hash_ids (one id per prompt block; optional); an arrival column
    named otherwise (`_COLUMNS`) is in seconds. `block_tokens`: the tokens each hash id stands for; by
    default Mooncake's 512 where every request's ids fit it, else the most any request's ids cover each."""
    path = Path(path)
    requests = []
    with _open_text(path) as f:
        lines = ((i, line) for i, line in enumerate(f, 1) if line.strip())
        for number, line in itertools.islice(lines, n):
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
                hash_ids = row.get("hash_ids") or []
                if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
                    raise ValueError(f"hash_ids {hash_ids!r} is not a list of integers")
                # Mooncake's `timestamp` is in ms; another arrival column in seconds, as its name says
                unit_s = 1e-3 if row.get("timestamp") not in (None, "") else 1.0
                requests.append(_trace_request(row, unit_s, tuple(hash_ids)))
            except ValueError as e:  # JSONDecodeError included
                raise ValueError(f"{path}:{number}: {e}") from None
    hashed = [r for r in requests if r.hash_ids]
    if block_tokens is None and all(-(-r.prompt_len // MOONCAKE_BLOCK) == len(r.hash_ids) for r in hashed):
        block_tokens = MOONCAKE_BLOCK  # Mooncake's, as every request's ids say
    if block_tokens is None:  # the most tokens any request's ids cover each
        block_tokens = max(-(-r.prompt_len // len(r.hash_ids)) for r in hashed)
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    return _from_trace_start([replace(r, block_tokens=block_tokens) for r in requests], path)


def scale_requests(requests: list[TraceRequest], input_scale: float, output_scale: float, max_model_len: int,
                   max_output: int | None = None, min_prompt: int = 4, min_output: int = 2) -> list[TraceRequest]:
    """Scale lengths (and Mooncake's block length) to a small model; clip so prompt + output fits.

    The prompt is kept whole where the context allows (cut, it keeps its prefix, so shared Mooncake
    prefixes stay shared), then the output is capped at `max_output` and at what the context has
    left: a long answer does not shrink its prompt to nothing.
    """
    if min_prompt + min_output > max_model_len:
        raise ValueError(f"max_model_len {max_model_len} cannot hold {min_prompt} + {min_output} tokens")
    if max_output is not None and max_output < min_output:
        raise ValueError(f"max_output {max_output} is below the {min_output} tokens a request generates at least")
    out = []
    for r in requests:
        prompt = min(max(min_prompt, round(r.prompt_len * input_scale)), max_model_len - min_output)
        output = max(min_output, round(r.output_len * output_scale))
        output = min(output, max_model_len - prompt, *([max_output] if max_output is not None else []))
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


def run_seed(seed: int, *parts: object) -> int:
    """The seed of one run's token contents: stable across processes (unlike hash()), distinct per part."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()[:8], "big")
