"""What a deployment's parts cost on one machine, for one model: the profile the simulator times its
steps with (`pdserve profile` measures it; `HardwareProfile.load` reads it back).

A worker's step is timed from two measured parts, because on a CPU they do not add up as one line:

- a prompt pass of N new tokens with attention term Q = Σ m·(p + m) (the router's cost model,
  `engine.cost_model.StepCost`: a + b·N + c·Q);
- a decode step of B sequences with mean context L, read off a measured table (B × L, interpolated):
  a batch of 4 costs twice a batch of 1 and a batch of 48 only three times (the per-layer fixed cost
  dominates), which no line through the origin of B fits.

A step that mixes both costs the decode table's time plus the prompt part's marginal cost (b·N + c·Q,
its fixed cost already paid), times the ratio of measured mixed steps to that sum (`mixed_scale`:
on 2 cores, mixed steps cost about a fifth more than their parts).

Where the manifest decodes speculatively, the profile also holds what speculation adds
(`SpeculationCosts`): the engine's own decode-step fit over verified drafts (the one that sizes its
drafts), a draft model's pass cost, and a prefill worker's prompt pass with the draft's beside it (the
draft's prompt KV sent). How many drafts are accepted is the workload's, not the machine's: the
simulator takes it apart (`sim_speculation`).

A profile is stored beside the model cache, keyed by the model's digest and the machine
(`default_profile_path`); a local cluster's workers take their prompt-pass costs from it instead of
measuring them at start-up (`find_stored_profile`; the manifest's `profile`).
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.engine.cost_model import StepCost
from pdserve.engine.speculative.sizing import DecodeCost

PROFILE_FORMAT = 2


def _interpolate(xs: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """Indices (i, j) of the grid points around `x` and the weight of j; beyond the grid, the last
    two points' line is extended (clamped at the first point below)."""
    if len(xs) == 1 or x <= xs[0]:
        return 0, 0, 0.0
    j = min(bisect.bisect_left(xs, x), len(xs) - 1)
    i = j - 1
    return i, j, (x - xs[i]) / (xs[j] - xs[i])


@dataclass(frozen=True)
class DecodeTable:
    """Seconds of a decode step over batch size and mean context (rows: batches, columns: contexts)."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if (not self.batches or not self.contexts or list(self.batches) != sorted(set(self.batches))
                or list(self.contexts) != sorted(set(self.contexts))):
            raise ValueError("a decode table needs increasing batch sizes and contexts")
        if len(self.seconds) != len(self.batches) or any(len(row) != len(self.contexts) for row in self.seconds):
            raise ValueError("a decode table needs one time per batch size and context")

    def step_s(self, batch: int, context: float) -> float:
        bi, bj, bw = _interpolate(self.batches, batch)
        ci, cj, cw = _interpolate(self.contexts, context)
        low, high = self.seconds[bi], self.seconds[bj]  # (no helper: the simulator asks at every step)
        at_low = low[ci] + (low[cj] - low[ci]) * cw
        at_high = high[ci] + (high[cj] - high[ci]) * cw
        return max(0.0, at_low + (at_high - at_low) * bw)


@dataclass(frozen=True)
class DraftPassCost:
    """Seconds of one draft-model pass: a + per_seq·sequences + per_token·tokens fed."""

    a: float
    per_seq: float
    per_token: float

    def seconds(self, sequences: int, tokens: int) -> float:
        return self.a + self.per_seq * sequences + self.per_token * tokens


@dataclass(frozen=True)
class SpeculationCosts:
    """What speculative decoding adds to a worker's steps: the same for every proposer, but for a draft
    model's passes (measured where the profiled manifest names one)."""

    verify: DecodeCost  # decode steps over verified drafts: the engine's fit, as its start-up profile makes it
    draft_model: str | None = None  # the manifest's `speculative.draft_model`, whose costs follow
    draft_pass: DraftPassCost | None = None  # its pass
    prompt_with_draft: StepCost | None = None  # a prefill worker's pass with the draft's beside it (draft_kv: send)

    def decode_scale(self, contexts: list[int], lengths: list[int]) -> float:
        """How many times longer a decode step of sequences with `contexts` tokens of KV takes verifying
        `lengths` draft tokens each than verifying none (the terms `sizing.draft_lengths` prices)."""
        plain_quad = sum(c + 1 for c in contexts)
        plain = self.verify.step_s(len(contexts), plain_quad, verifies=False, seqs=len(contexts), keys=plain_quad)
        if plain <= 0 or not any(lengths):
            return 1.0
        quad = sum((1 + k) * (c + 1 + k) for c, k in zip(contexts, lengths))
        drafted = self.verify.step_s(len(contexts) + sum(lengths), quad, verifies=True, seqs=len(contexts),
                                     keys=plain_quad + sum(lengths))
        return drafted / plain


@dataclass(frozen=True)
class EncodeCost:
    """Seconds of one vision-tower pass (and projector) over a request's images: a + per_image·images +
    per_token·their embedding rows. The same pass runs on an encode worker and, without an encode pool,
    on the engine loop of the worker that runs the prompt pass."""

    a: float
    per_image: float
    per_token: float

    def pass_s(self, images: int, tokens: int) -> float:
        return self.a + self.per_image * images + self.per_token * tokens if images else 0.0


@dataclass(frozen=True)
class WorkerCosts:
    """One worker's step costs at a number of torch threads."""

    threads: int
    prefill: StepCost
    decode: DecodeTable
    mixed_scale: float = 1.0  # measured mixed steps over the sum of their parts
    speculation: SpeculationCosts | None = None  # measured where the manifest decodes speculatively
    encode: EncodeCost | None = None  # a vision-language model's image pass (None: a text model)

    def step_s(self, decode_seqs: int, decode_context: int, prompt_tokens: int, prompt_quad: int,
               decode_scale: float = 1.0) -> float:
        """A step of `decode_seqs` decoding sequences (their contexts summing to `decode_context`; their
        part `decode_scale` times longer when they verify drafts) and `prompt_tokens` prompt tokens
        (attention term `prompt_quad`)."""
        if not decode_seqs:
            return self.prefill.step_s(prompt_tokens, prompt_quad) if prompt_tokens else 0.0
        decode = self.decode.step_s(decode_seqs, decode_context / decode_seqs) * decode_scale
        if not prompt_tokens:
            return decode
        return max(decode, (decode + self.prefill.b * prompt_tokens + self.prefill.c * prompt_quad) * self.mixed_scale)


@dataclass(frozen=True)
class TransferCost:
    """Seconds from a prompt's last pass to its KV committed on the decode worker: x0 + x1·tokens."""

    x0_s: float
    x1_s_per_token: float

    def handoff_s(self, tokens: int) -> float:
        return self.x0_s + self.x1_s_per_token * tokens


@dataclass
class HardwareProfile:
    """A model's costs on one kind of machine. `workers` by torch threads; `transfers` by transport."""

    model: str
    model_digest: str
    hardware: str  # `machine()`
    dtype: str
    block_size: int
    kv_bytes_per_token: int
    max_model_len: int
    workers: dict[int, WorkerCosts]
    transfers: dict[str, TransferCost]
    # What serving adds, measured in a running cluster (`profiler.ServingCosts`):
    dispatch_s: float = 0.0  # the router's accepting a request to its worker's queue
    prefill_setup_s: float = 0.0  # a prefill worker's taking a prompt to its pass (its transfer's set-up)
    delivery_s: float = 0.0  # a prompt pass's end to its first token leaving the router
    step_overhead_s: float = 0.0  # a serving decode step beyond the engine's own: this ...
    step_overhead_per_seq_s: float = 0.0  # ... and this per sequence decoding in it
    router_cpu_s_per_token: float = 0.0  # CPU the router and its clients spend per output token
    cores: int = 0  # the machine's (0: not known)
    embedding_bytes_per_token: int = 0  # an image token's embedding row (0: a text model)
    device: str = ""  # where its engines ran, "cpu" or "cuda" ("": a profile made before this was recorded)
    checks: dict[str, Any] = field(default_factory=dict)  # how well the fitted parts predict what was measured
    created: str = ""

    def costs(self, threads: int) -> WorkerCosts:
        if threads not in self.workers:
            raise ValueError(f"the profile has no worker with {threads} thread(s): measured "
                             f"{sorted(self.workers)} (`pdserve profile --threads`)")
        return self.workers[threads]

    def transfer(self, transport: str) -> TransferCost:
        if transport not in self.transfers:
            raise ValueError(f"the profile has no KV transfer cost for {transport!r}: measured "
                             f"{sorted(self.transfers)} (`pdserve profile --transports`)")
        return self.transfers[transport]

    def encode_cost(self, threads: int) -> EncodeCost:
        encode = self.costs(threads).encode
        if encode is None:
            raise ValueError(f"the profile of {self.model} has no image-encoding cost at {threads} thread(s): "
                             "profile a vision-language model (`pdserve profile`) to plan for images")
        return encode

    def embeddings_handoff_s(self, transport: str, tokens: int) -> float:
        """An image's embeddings from an encode worker to a prompt-pass worker: the KV handoff's line
        at the tokens whose KV weighs as much (the same transports and frames carry both)."""
        cost = self.transfer(transport)
        return cost.x0_s + cost.x1_s_per_token * tokens * self.embedding_bytes_per_token / self.kv_bytes_per_token

    def step_overhead(self, decode_seqs: int) -> float:
        return self.step_overhead_s + self.step_overhead_per_seq_s * decode_seqs

    def kv_blocks(self, kv_memory_mb: int, block_size: int) -> int:
        """A worker's KV blocks of `block_size` tokens with `kv_memory_mb` of KV memory (as the engine sizes
        its pool)."""
        return kv_memory_mb * 2**20 // (self.kv_bytes_per_token * block_size)

    def to_json(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, **asdict(self)}

    def save(self, path: Path) -> None:
        """Whole or not at all: a cluster starting meanwhile may read it (`find_stored_profile`)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(partial, path)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "HardwareProfile":
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a pdserve profile of format {PROFILE_FORMAT} (found {data.get('format')!r}): "
                             f"measure it again with `pdserve profile`")
        data = {k: v for k, v in data.items() if k != "format"}
        workers = {int(t): WorkerCosts(w["threads"], StepCost(**w["prefill"]),
                                       DecodeTable(tuple(w["decode"]["batches"]), tuple(w["decode"]["contexts"]),
                                                   tuple(tuple(row) for row in w["decode"]["seconds"])),
                                       w["mixed_scale"], _speculation(w.get("speculation")),
                                       EncodeCost(**w["encode"]) if w.get("encode") else None)
                   for t, w in data.pop("workers").items()}
        transfers = {name: TransferCost(**t) for name, t in data.pop("transfers").items()}
        return cls(workers=workers, transfers=transfers, **data)

    @classmethod
    def load(cls, path: Path) -> "HardwareProfile":
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict):
                raise TypeError(f"a JSON {type(data).__name__}, not an object")
            return cls.from_json(data)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
            raise ValueError(f"cannot read the profile {path}: {e}") from None


def _speculation(data: dict[str, Any] | None) -> SpeculationCosts | None:
    """A profile's `SpeculationCosts` (None: measured without speculation)."""
    if data is None:
        return None
    draft, with_draft = data["draft_pass"], data["prompt_with_draft"]
    return SpeculationCosts(DecodeCost(**data["verify"]), data["draft_model"],
                            DraftPassCost(**draft) if draft is not None else None,
                            StepCost(**with_draft) if with_draft is not None else None)


def machine() -> str:
    """"2 cores (Intel Xeon ...), 23 GiB, no GPU": what costs depend on (a profile's key, and every
    benchmark figure's provenance)."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB, {gpu}"


def default_profile_path(model: str, model_digest: str, hardware: str) -> Path:
    """Where a model's profile on this kind of machine is kept: beside the model cache, keyed by the
    model's digest and the machine's description."""
    from pdserve.engine.models.presets import default_cache_dir

    name = f"{_profile_stem(model)}-{model_digest[:12]}-{_machine_key(hardware)}.json"
    return default_cache_dir().parent / "profiles" / name


def find_stored_profile(model: str, model_dir: Path, hardware: str) -> tuple[Path, str] | None:
    """Where `pdserve profile` stored a profile of this model (these files' bytes) on `hardware`, and the
    model's digest; None when there is none. The model is hashed only when a profile of its name is there."""
    from pdserve.engine.model_store import model_digest

    folder = default_profile_path(model, "", hardware).parent
    if not any(folder.glob(f"{glob.escape(_profile_stem(model))}-*-{_machine_key(hardware)}.json")):
        return None
    digest = model_digest(model_dir)
    path = default_profile_path(model, digest, hardware)
    return (path, digest) if path.is_file() else None


def check_profile(profile: Any, manifest: Any, path: Path, digest: str) -> None:
    """A profile of another model (`digest`: the manifest's model's), or of another dtype, predicts
    nothing about this one; ValueError."""
    if profile.model_digest != digest:
        raise ValueError(f"the profile {path} is of another model ({profile.model}, digest "
                         f"{profile.model_digest[:12]}) "
                         f"than {manifest.model} (digest {digest[:12]}): profile this one (`pdserve profile`)")
    if profile.dtype != manifest.dtype:
        raise ValueError(f"the profile {path} measured {profile.dtype}, the manifest serves {manifest.dtype}")


def _profile_stem(model: str) -> str:
    return Path(model).name or "model"


def _machine_key(hardware: str) -> str:
    return hashlib.sha256(hardware.encode()).hexdigest()[:12]
