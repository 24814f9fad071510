"""`pdserve profile`: what a model's steps and KV handoffs cost on this machine, for the simulator.

For each number of torch threads, in this process, on an engine with the manifest's limits:

- prompt passes: fresh prompts of powers of four up to the step budget, and prompts whose first half
  is in the prefix cache (their attention term reaches back over it); the fit a + b·N + c·Q
  (`engine.cost_model`), non-negative, as the workers fit theirs;
- decode steps over a grid of batch sizes and contexts: a batch of B prompts of L tokens prefilled,
  then the median of its decode steps (`costs.DecodeTable`);
- mixed steps, a decode batch with one prompt chunk beside it: the median ratio of their time to the
  sum of the two parts' is the profile's `mixed_scale`.

Where the manifest decodes speculatively, for each number of threads, what speculation adds
(`costs.SpeculationCosts`): an engine with its `speculative` settings runs the start-up profile its
workers run (`engine.profiler.profile_decode`: decode steps verifying drafts of several lengths, and a
draft model's passes), whose fits are kept as measured; with a draft model, the prompt passes again
with the draft's beside them (a prefill worker that sends the draft's KV). The decode table is
measured without speculation either way: the simulator scales it by the verify fit.

For a vision-language model, for each number of threads, its image pass (`costs.EncodeCost`) as an
encode worker runs it: PNGs decoded, the image processor, the vision tower and projector, over 1 to 3
fresh images of each size of the workloads' image mix; a line over images and their tokens.

Then, for each KV transport, a 1P+1D cluster of the manifest on this machine (local prefill off):
prompts of several lengths one at a time, and from each one's lifetime events the handoff (prefill
end to decode start, every cost of the transfer in it; a line over prompt length), the dispatch (the
router's accepting it to the prefill worker's queue), the prefill worker's set-up (taking it to its
pass's end, beyond the pass), the delivery (the pass's end to the first token leaving the router) and
a serving decode step's overhead; a burst of short prompts for that overhead per sequence; and this
process's (the router's and its client's) CPU per output token, less its idle share. The serving
costs are measured with the first transport only.

The first pass of each shape is a warm-up and is not kept; every prompt is random tokens, fresh.
Run it on an otherwise idle machine: what else runs is measured too.
"""

from __future__ import annotations

import io
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

import numpy as np

from pdserve.cluster.plan.costs import (DecodeTable, DraftPassCost, EncodeCost, HardwareProfile, SpeculationCosts,
                                        TransferCost, WorkerCosts)
from pdserve.engine.cost_model import StepCost, fit_nonnegative
from pdserve.wire import LifetimeEvent

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXTS = (16, 128, 512)
DECODE_STEPS = 16  # decode steps timed per cell (after one warm-up step): a shared machine is noisy
TRANSFER_PROMPTS = (16, 64, 128, 256, 512, 900)
PREFILL_PASSES = 5  # passes timed per prompt shape (after one warm-up pass)
ENCODE_IMAGES = (1, 2, 3)  # images per timed image pass
BURST = 8  # requests sent at once to measure what serving adds per decoding sequence


def _random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


class _EngineProfiler:
    def __init__(self, engine: Any, seed: int, log: Callable[[str], None]) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.log = log

    def prompt(self, n: int) -> list[int]:
        return _random_prompt(self.rng, self.engine.vocab_size, n)

    def _run(self, prompts: list[list[int]], max_tokens: int, keep: Callable[[Any], bool]) -> list[Any]:
        from pdserve.engine.sampling_params import SamplingParams

        for p in prompts:
            self.engine.add_request(p, SamplingParams.greedy(max_tokens=max_tokens, ignore_eos=True))
        kept = []
        while self.engine.has_unfinished_requests():
            self.engine.step()
            step = self.engine.last_step
            if keep(step):
                kept.append(replace(step))
        return kept

    def prefill_samples(self, step_budget: int, max_model_len: int,
                        behind_cache: bool = True) -> list[tuple[int, int, float]]:
        """(tokens, quad, seconds) of single prompt passes, fresh and (`behind_cache`) behind a cached half:
        per shape, the median of `PREFILL_PASSES` passes after a warm-up one (a shared machine's passes
        vary by half)."""
        limit = min(step_budget, max_model_len - 1)
        lengths = sorted({min(n, limit) for n in (8, 32, 128, 512, 2048, limit)})
        samples = []

        def median_pass(make_prompt: Callable[[], list[int]], alone: Callable[[Any], bool]) -> None:
            passes = []
            for round_ in range(PREFILL_PASSES + 1):
                steps = self._run([make_prompt()], 1, alone)
                if round_:
                    passes += [(s.num_tokens, s.quad_tokens, s.total_s) for s in steps]
            if passes:
                samples.append((passes[0][0], passes[0][1], statistics.median(p[2] for p in passes)))

        def behind_cached_half(n: int) -> list[int]:
            first = self.prompt(n)
            self._run([first], 1, lambda s: False)  # its blocks are now in the prefix cache
            return first[:n // 2] + self.prompt(n - n // 2)

        for n in lengths:
            median_pass(lambda: self.prompt(n), lambda s: s.num_seqs == 1 and s.num_tokens == n)
            if behind_cache and n // 2 >= 16:
                median_pass(lambda: behind_cached_half(n),
                            lambda s: s.num_seqs == 1 and s.quad_tokens > s.num_tokens ** 2)
        return samples

    def decode_cell(self, batch: int, context: int) -> tuple[float, float] | None:
        """Median seconds and mean context of the decode steps of `batch` prompts of `context` tokens;
        None when they do not fit the engine's KV memory or batch."""
        e = self.engine
        # the batch's prompts take several steps when they exceed the step budget: the first ones decode
        # meanwhile, and must still be decoding when the last one joins
        tokens = DECODE_STEPS + 2 + -(-batch * context // e.config.max_num_batched_tokens)
        blocks = -(-(context + tokens) // e.config.block_size) * batch
        if batch > e.config.max_num_seqs or blocks > e.num_free_blocks or context + tokens > e.max_model_len:
            return None
        steps = self._run([self.prompt(context) for _ in range(batch)], tokens,
                          lambda s: s.num_seqs == batch and s.num_decode_seqs == batch)
        timed = steps[1:]  # the first decode step of a batch is its warm-up
        if not timed:
            return None
        return statistics.median(s.total_s for s in timed), statistics.mean(s.quad_tokens / batch for s in timed)

    def mixed_ratios(self, costs: WorkerCosts, step_budget: int) -> list[float]:
        """Measured over predicted seconds of mixed steps (a decode batch with one prompt chunk beside it),
        predicted from the parts alone (`costs.mixed_scale` 1)."""
        from pdserve.engine.sampling_params import SamplingParams

        e, ratios = self.engine, []
        context = min(128, e.max_model_len // 4)
        for batch, chunk in ((4, 64), (16, 256), (8, 512)):
            chunk = min(chunk, step_budget - batch, e.max_model_len - 2)
            if batch > e.config.max_num_seqs or chunk < 1:
                continue
            for p in [self.prompt(context) for _ in range(batch)]:
                e.add_request(p, SamplingParams.greedy(max_tokens=12, ignore_eos=True))
            for _ in range(batch + 4):  # until the batch is decoding (each prompt's pass is one step at most)
                e.step()
                if e.last_step.num_decode_seqs == batch:
                    break
            e.add_request(self.prompt(chunk), SamplingParams.greedy(max_tokens=1, ignore_eos=True))
            while e.has_unfinished_requests():
                e.step()
                s = e.last_step
                prompt_tokens = s.num_tokens - s.num_decode_seqs
                if s.num_decode_seqs == batch and prompt_tokens == chunk:
                    decode_quad = s.quad_tokens - chunk * chunk
                    predicted = costs.step_s(batch, decode_quad, chunk, chunk * chunk)
                    ratios.append(s.total_s / predicted)
        return ratios


def profile_threads(model_dir: Any, threads: int, engine_config: dict[str, Any], seed: int,
                    log: Callable[[str], None]) -> tuple[WorkerCosts, dict[str, Any]]:
    """One thread count's costs, and how well they predict what was measured."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(**{**engine_config, "num_threads": threads, "enable_prefix_caching": True})
    return profile_engine(LLMEngine(model_dir, config), threads, seed, log)


def profile_engine(engine: Any, threads: int, seed: int,
                   log: Callable[[str], None]) -> tuple[WorkerCosts, dict[str, Any]]:
    """Measure `engine` (an `LLMEngine`, or anything that steps and times its steps alike)."""
    config = engine.config
    p = _EngineProfiler(engine, seed, log)
    started = time.monotonic()
    prefill, prefill_errors = _prompt_pass_fit(p, f"  {threads} thread(s): prompt passes")
    contexts = tuple(c for c in DECODE_CONTEXTS if c <= engine.max_model_len // 2) or (engine.max_model_len // 4,)
    rows, batches, measured_contexts, extrapolated = [], [], None, 0
    for batch in DECODE_BATCHES:
        cells = [p.decode_cell(batch, c) for c in contexts]
        if cells[0] is None or (not rows and None in cells):
            break  # larger batches fit no better
        measured_contexts = measured_contexts or tuple(round(ctx) for _, ctx in cells)
        row = []
        for i, cell in enumerate(cells):
            if cell is None:  # a long context that does not fit this batch: the row before's growth with context
                row.append(row[i - 1] * rows[-1][i] / rows[-1][i - 1])
                extrapolated += 1
            else:
                row.append(cell[0])
        batches.append(batch)
        rows.append(tuple(row))
        log(f"  {threads} thread(s): decode batch {batch:3d}: " +
            ", ".join(f"{ctx} tokens {seconds * 1e3:.1f} ms{'' if cell else ' (extrapolated)'}"
                      for ctx, seconds, cell in zip(measured_contexts, row, cells)))
    if not batches:
        raise RuntimeError("no decode batch fits the engine's KV memory: raise kv_memory_mb")
    costs = WorkerCosts(threads, prefill, DecodeTable(tuple(batches), measured_contexts, tuple(rows)))
    mixed = p.mixed_ratios(costs, config.max_num_batched_tokens)
    if mixed:
        costs = replace(costs, mixed_scale=statistics.median(mixed))
    log(f"  {threads} thread(s): mixed steps measured at " + ", ".join(f"{r:.2f}" for r in mixed) +
        f" x the sum of their parts (scale {costs.mixed_scale:.2f}; {time.monotonic() - started:.0f} s)")
    checks = {"max_model_len": engine.max_model_len, "decode_cells_extrapolated": extrapolated,
              "prefill_error_median": float(np.median(np.abs(prefill_errors))),
              "prefill_error_max": float(np.max(np.abs(prefill_errors))),
              "mixed_ratios": [float(r) for r in mixed]}
    return costs, checks


def _prompt_pass_fit(p: _EngineProfiler, label: str, fresh_only: bool = False) -> tuple[StepCost, np.ndarray]:
    """The prompt passes' fit a + b·N + c·Q, and its relative error on each shape measured; `fresh_only`:
    of prompts with nothing cached (where a draft model runs beside the target: it keeps no prefix
    cache, so its share of a pass behind a cached prefix is not the target's N and Q)."""
    samples = p.prefill_samples(p.engine.config.max_num_batched_tokens, p.engine.max_model_len,
                                behind_cache=not fresh_only)
    data = np.array(samples, dtype=float)
    features = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    fit = StepCost(*fit_nonnegative(features, data[:, 2]).tolist())
    errors = (features @ np.array(fit.as_tuple())) / data[:, 2] - 1
    p.log(f"{label} a={fit.a * 1e3:.2f} ms, b={fit.b * 1e6:.2f} us/token, c={fit.c * 1e9:.3f} ns/token^2 from "
          f"{len(samples)} prompt shapes ({PREFILL_PASSES} passes each) (median error "
          f"{np.median(np.abs(errors)):.1%}, max {np.max(np.abs(errors)):.1%})")
    return fit, errors


def profile_encoder(model_dir: Any, threads: int, dtype: str, device: str, seed: int,
                    log: Callable[[str], None]) -> tuple[EncodeCost, int] | None:
    """A vision-language model's image pass at `threads` as an encode worker runs it (decoding the PNGs,
    the image processor, the vision tower and projector of `load_encoder`) over 1 to 3 images of each
    size of the workloads' mix, and the bytes of an embedding row; None for a text model."""
    import torch
    from PIL import Image
    from transformers import AutoConfig

    from pdserve.cluster.bench.workload import IMAGE_SIZES
    from pdserve.engine.multimodal.images import ImageLimits, decode_image
    from pdserve.engine.multimodal.vision import FAMILIES, load_encoder

    if AutoConfig.from_pretrained(model_dir).model_type not in FAMILIES:
        return None
    torch.set_num_threads(threads)
    vision = load_encoder(model_dir, getattr(torch, dtype), device)
    rng = np.random.default_rng(seed)

    def png(width: int, height: int) -> bytes:
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
        return out.getvalue()

    samples = []
    for count in ENCODE_IMAGES:
        for size in IMAGE_SIZES:
            images = [png(*size) for _ in range(count)]
            seconds = []
            for _ in range(PREFILL_PASSES + 1):  # the first is a warm-up
                started = time.perf_counter()  # what an encode worker does: decode, process, encode
                encoded = vision.encode_images([vision.prepare(decode_image(data, ImageLimits())) for data in images])
                seconds.append(time.perf_counter() - started)
            samples.append((count, sum(e.num_tokens for e in encoded), statistics.median(seconds[1:])))
    data = np.array(samples, dtype=float)
    features = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    fit = EncodeCost(*fit_nonnegative(features, data[:, 2]).tolist())
    errors = (features @ np.array([fit.a, fit.per_image, fit.per_token])) / data[:, 2] - 1
    log(f"  {threads} thread(s): image passes a={fit.a * 1e3:.2f} ms, {fit.per_image * 1e3:.2f} ms/image, "
        f"{fit.per_token * 1e6:.1f} us/token from {len(samples)} shapes (median error {np.median(np.abs(errors)):.1%})")
    return fit, encoded[0].embeddings.shape[-1] * encoded[0].embeddings.element_size()


def profile_speculation(model_dir: Any, threads: int, engine_config: dict[str, Any], seed: int,
                        log: Callable[[str], None]) -> SpeculationCosts:
    """What the manifest's speculative decoding (`engine_config["speculative"]`) adds at `threads`."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.profiler import profile_decode

    config = EngineConfig(**{**engine_config, "num_threads": threads, "enable_prefix_caching": True})
    engine = LLMEngine(model_dir, config)
    samples = profile_decode(engine, seed=seed)
    if not samples:
        raise RuntimeError("no decode step verifying drafts fits the engine: raise kv_memory_mb or max_model_len")
    verify = engine.decode_step_costs.cost
    log(f"  {threads} thread(s): decode steps verifying drafts: {verify.a * 1e3:.2f} ms + "
        f"{verify.b * 1e6:.1f} us/token + {verify.verify * 1e3:.2f} ms when verifying + {verify.per_seq * 1e6:.1f} "
        f"us/sequence ({len(samples)} steps)")
    draft_pass = prompt_with_draft = None
    if engine.draft_model is not None:
        draft_pass = DraftPassCost(*engine.draft_model.pass_cost.coefficients)
        log(f"  {threads} thread(s): a draft pass {draft_pass.a * 1e3:.2f} ms + {draft_pass.per_seq * 1e6:.1f} "
            f"us/sequence + {draft_pass.per_token * 1e6:.1f} us/token")
        with_draft = LLMEngine(model_dir, replace(config, draft_prompt_kv=True))
        prompt_with_draft, _ = _prompt_pass_fit(_EngineProfiler(with_draft, seed, log),
                                                f"  {threads} thread(s): prompt passes with the draft's",
                                                fresh_only=True)
    return SpeculationCosts(verify, config.speculative.draft_model, draft_pass, prompt_with_draft)


@dataclass(frozen=True)
class ServingCosts:
    """What serving adds to the engine's steps, measured in a running 1P+1D cluster."""

    handoff: TransferCost
    dispatch_s: float  # the router's accepting a request to its worker's queue (placement, the Ray call)
    prefill_setup_s: float  # a prefill worker's taking a prompt to its pass, beyond the pass (its transfer's set-up)
    delivery_s: float  # a prompt pass's end to its first token leaving the router (the token stream)
    step_overhead_s: float  # a serving decode step beyond the engine's own (token sending, the loop's other work) ...
    step_overhead_per_seq_s: float  # ... and per sequence in it
    router_cpu_s_per_token: float  # CPU the router (and its client) spend per output token


def profile_serving(manifest: Any, transport: str, costs: WorkerCosts, seed: int,
                    log: Callable[[str], None]) -> ServingCosts:
    """A 1P+1D cluster of `manifest` with `transport`, its workers at `costs.threads` threads; prompts
    of several lengths one at a time, then bursts of short ones: the handoff's line over prompt length
    (from each request's lifetime events), and what serving adds to the engine's steps (`ServingCosts`)."""
    from pdserve.client import Client
    from pdserve.cluster.launcher import Cluster

    data = manifest.model_dump(mode="json")
    data.update(mode="disaggregated")
    for pool in ("prefill", "decode"):
        data["pools"][pool].update(replicas=1, threads=costs.threads)
    data["kv_transfer"]["transport"] = transport
    data["router"]["local_prefill_tokens"] = 0  # every prompt hands its KV off: that is what is measured
    data["server"].update(address="127.0.0.1:0", http_address=None)
    data["profile"] = "measure"  # a profile stored earlier must not stand in for what is measured again here
    data["speculative"] = None  # what serving adds to a step of one token per sequence, as the decode table's
    m = type(manifest).model_validate(data)
    rng = random.Random(seed)
    dispatch, setup, delivery, overhead, handoffs = [], [], [], [], []
    output_tokens = DECODE_STEPS + 2
    with Cluster(m, log=lambda s: None) as cluster, Client(cluster.address, timeout=60) as client:
        vocab = client.model_info().vocab_size
        idle_cpu = _cpu_share_idle()  # what this process spends with nothing to serve (pings, Ray's threads)
        cpu_from, wall_from, tokens = time.process_time(), time.monotonic(), 0

        def decode_step_s(events: dict[str, float], tokens: int) -> float:
            return (events[LifetimeEvent.DECODE_END] - events[LifetimeEvent.DECODE_START]) / (tokens - 1)

        for round_, n in enumerate(TRANSFER_PROMPTS * 3):
            n = min(n, m.max_model_len - output_tokens - 1)
            events = client.generate(_random_prompt(rng, vocab, n), max_tokens=output_tokens, ignore_eos=True).events
            if round_ < len(TRANSFER_PROMPTS):
                cpu_from, wall_from = time.process_time(), time.monotonic()
                continue  # the first round warms every length up
            tokens += output_tokens
            handoffs.append((n, events[LifetimeEvent.DECODE_START] - events[LifetimeEvent.PREFILL_END]))
            # to the prefill worker's queue (the simulator runs the queue itself, LAPS's window included)
            dispatch.append(events[LifetimeEvent.PREFILL_QUEUED] - events[LifetimeEvent.ACCEPTED])
            setup.append(events[LifetimeEvent.PREFILL_END] - events[LifetimeEvent.PREFILL_START]
                         - costs.prefill.work_s(n, n * n, max(1, m.max_num_batched_tokens // 2)))
            delivery.append(events[LifetimeEvent.FIRST_TOKEN] - events[LifetimeEvent.PREFILL_END])
            overhead.append(decode_step_s(events, output_tokens) - costs.decode.step_s(1, n + output_tokens / 2))
        # This process is the router (and the client): its CPU per output token, which it takes from the
        # workers where they share a machine.
        busy = time.process_time() - cpu_from - idle_cpu * (time.monotonic() - wall_from)
        router_cpu = max(0.0, busy) / tokens
        # A batch of short prompts sent at once decodes together: what serving adds per sequence.
        burst_prompt, burst_output = 16, min(64, m.max_model_len - 17)
        with ThreadPoolExecutor(BURST) as pool:
            for _ in range(3):  # the last burst is measured; the others warm the batch shapes up
                completions = list(pool.map(
                    lambda _: client.generate(_random_prompt(rng, vocab, burst_prompt), max_tokens=burst_output,
                                              ignore_eos=True), range(BURST)))
        burst_step = statistics.median(decode_step_s(c.events, burst_output) for c in completions)
    data = np.array(handoffs, dtype=float)
    line = TransferCost(*fit_nonnegative(np.column_stack([np.ones(len(data)), data[:, 0]]), data[:, 1]).tolist())
    alone = max(0.0, statistics.median(overhead))
    in_burst = burst_step - costs.decode.step_s(BURST, burst_prompt + burst_output / 2)
    per_seq = max(0.0, (in_burst - alone) / (BURST - 1))
    serving = ServingCosts(line, statistics.median(dispatch), max(0.0, statistics.median(setup)),
                           statistics.median(delivery), alone, per_seq, router_cpu)
    log(f"  {transport}: handoff {line.x0_s * 1e3:.2f} ms + {line.x1_s_per_token * 1e6:.2f} us/token; dispatch "
        f"{serving.dispatch_s * 1e3:.2f} ms, prefill set-up {serving.prefill_setup_s * 1e3:.2f} ms, delivery "
        f"{serving.delivery_s * 1e3:.2f} ms, decode step overhead "
        f"{serving.step_overhead_s * 1e3:.2f} ms + {serving.step_overhead_per_seq_s * 1e3:.2f} ms per sequence; the "
        f"router's CPU {serving.router_cpu_s_per_token * 1e3:.2f} ms per output token")
    return serving


def _cpu_share_idle(seconds: float = 1.0) -> float:
    """This process's CPU per wall second over `seconds` of doing nothing itself."""
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(seconds)
    return (time.process_time() - cpu) / (time.monotonic() - wall)


def profile(manifest: Any, threads: tuple[int, ...], transports: tuple[str, ...], seed: int = 0,
            log: Callable[[str], None] = print) -> HardwareProfile:
    from pdserve.cluster.plan.costs import machine
    from pdserve.cluster.bench.serve import kv_bytes_per_token
    from pdserve.engine.model_store import model_digest
    from pdserve.engine.models.presets import resolve_model

    model_dir = resolve_model(manifest.model)
    pool = manifest.pools.decode
    engine_config = manifest.engine_config(pool)
    engine_config.pop("num_threads")
    # The decode table and prompt passes are measured without speculation (drafts would speed decode
    # cells up on whatever the profile's random prompts repeat); what speculation adds, apart.
    speculative = engine_config.pop("speculative")
    workers, checks = {}, {}
    embedding_bytes = 0  # a text model's
    log(f"profiling {manifest.model} on {machine()}")
    for t in threads:
        workers[t], checks[f"threads_{t}"] = profile_threads(model_dir, t, {**engine_config, "speculative": None},
                                                             seed, log)
        image_pass = profile_encoder(model_dir, t, manifest.dtype, engine_config["device"], seed, log)
        if image_pass is not None:
            workers[t] = replace(workers[t], encode=image_pass[0])
            embedding_bytes = image_pass[1]
        if speculative is not None:
            measured = profile_speculation(model_dir, t, {**engine_config, "speculative": speculative}, seed, log)
            workers[t] = replace(workers[t], speculation=measured)
    transfers, serving = {}, None
    for transport in transports:  # at the fewest threads measured: the default manifest's workers
        measured = profile_serving(manifest, transport, workers[min(threads)], seed, log)
        transfers[transport] = measured.handoff
        serving = serving or measured
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[manifest.dtype]
    return HardwareProfile(
        model=manifest.model, model_digest=model_digest(model_dir), hardware=machine(), dtype=manifest.dtype,
        block_size=manifest.block_size, kv_bytes_per_token=kv_bytes_per_token(model_dir, dtype_bytes),
        max_model_len=checks[f"threads_{threads[0]}"]["max_model_len"], workers=workers, transfers=transfers,
        dispatch_s=serving.dispatch_s if serving else 0.0, prefill_setup_s=serving.prefill_setup_s if serving else 0.0,
        delivery_s=serving.delivery_s if serving else 0.0,
        step_overhead_s=serving.step_overhead_s if serving else 0.0,
        step_overhead_per_seq_s=serving.step_overhead_per_seq_s if serving else 0.0,
        router_cpu_s_per_token=serving.router_cpu_s_per_token if serving else 0.0, cores=os.cpu_count() or 0,
        embedding_bytes_per_token=embedding_bytes, device=engine_config["device"], checks=checks,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
