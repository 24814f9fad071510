"""`pdserve bench spec`: decoding with and without speculation, side by side in one run.

Three workloads on the shipped model (trained on Python's standard library):
  - code: greedy completion of held-out Python source (files the model never saw), each prompt its own
    stretch of a file;
  - conversation: greedy, random token prompts with the conversation trace's prompt lengths (nothing
    in the prompt to copy);
  - sampled: the conversation prompts sampled at temperature 1 (seeded per request): outputs with
    little to copy, where drafts mostly fail and speculation must turn itself off.
At each batch size every request of a run starts at once; a run's engine is built afresh (empty prefix
cache, empty index of recent outputs) and profiles its decode steps first, as a worker does when it
starts (`engine.profiler.profile_decode`: a warm-up for both systems, and the step costs that size
speculation); every run of a repeat gets prompts no other repeat used.
Systems alternate within a repeat on the same prompts, and their outputs must be identical.
TPOT is each request's time from its first to its last token over its tokens after the first (the
median over requests); output tokens/s is the run's tokens over its wall time.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pdserve.cluster.bench.report import provenance
from pdserve.cluster.bench.serve_metrics import (
    TARGET_ATTAINMENT, GoodputSearch, Objective, RequestRecord, attainment, percentile,
)
from pdserve.cluster.bench.workload import azure_trace_shapes, random_token_prompts
from pdserve.cluster.plan.sim_speculation import Drafting
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, resolve_model
from pdserve.engine.models.training import corpus_texts
from pdserve.engine.profiler import profile_decode
from pdserve.engine.speculative.config import SpeculativeConfig

MIN_TPOT_SPEEDUP = 2.0  # target: TPOT at batch 1 on code, off / speculative
MIN_THROUGHPUT_RATIO = 0.97  # target: speculative output tok/s and goodput against off, on every workload
IDLE_REQUESTS = 8  # one at a time, without speculation: the idle latency the objectives are set from


@dataclass
class SpecBenchConfig:
    model: str = "pystd-llama"
    draft_model: str | None = "pystd-llama-draft"  # a draft for `model`; None: the model-free proposer only
    batches: tuple[int, ...] = (1, 8, 32)
    repeats: int = 3
    prompt_len: int = 384  # code prompts; conversation prompts take the trace's lengths (clipped to it)
    output_len: int = 128
    threads: int = 1
    open_loop_requests: int = 24  # per rate of the goodput search (0: no open-loop part)
    max_runs: int = 8  # of each system's goodput search, per workload
    start_rate: float = 1.0  # requests/s where each goodput search starts
    out: Path = Path("bench-results/spec.json")


def systems(cfg: SpecBenchConfig) -> dict[str, SpeculativeConfig | None]:
    """What is compared: no speculation, then each proposer (the draft model's where there is one)."""
    compared: dict[str, SpeculativeConfig | None] = {"off": None, "suffix": SpeculativeConfig()}
    if cfg.draft_model is not None:
        compared["draft"] = SpeculativeConfig(method="draft_model", draft_model=cfg.draft_model)
        compared["both"] = SpeculativeConfig(method="both", draft_model=cfg.draft_model)
    return compared


@dataclass
class RunFigures:
    tpot_ms: float  # median over the run's requests
    output_tps: float
    drafted: int
    accepted: int
    decode_steps: int = 0  # steps that gave a request tokens after its first, summed over requests
    verifications: int | None = None  # steps that verified a draft, summed over requests (None: not recorded)
    rejected: int | None = None  # of those, the ones that ended on a rejected draft token
    model_verifications: int | None = None  # of those, the ones whose draft the draft model proposed

    @staticmethod
    def drafting(runs: list["RunFigures"]) -> Drafting | None:
        """What the simulator needs of the runs' drafts (None: none verified, or not recorded)."""
        if any(r.verifications is None or r.rejected is None or r.model_verifications is None for r in runs):
            return None

        def total(figure: str) -> int:
            return sum(getattr(r, figure) for r in runs)

        return Drafting.measured(total("accepted"), total("verifications"), total("rejected"), total("drafted"),
                                 total("decode_steps"), total("model_verifications"))


@dataclass
class OpenLoopFigures:
    """One workload under Poisson arrivals: its objectives (from the idle TTFT and TPOT without
    speculation) and each system's goodput for each, requests/s."""

    idle_ttft_s: float
    idle_tpot_s: float
    objectives: dict[str, tuple[float, float]]  # name -> (TTFT, TPOT) seconds
    goodput: dict[str, dict[str, float]]  # system -> objective -> highest rate meeting it
    converged: dict[str, dict[str, bool]]
    # The goodput target checked at one rate rather than between two searches' brackets (15% wide): every
    # system run at MIN_THROUGHPUT_RATIO x off's goodput (the highest rate off was measured to meet the
    # objective at), off too (a rate its search found by a lucky run, off misses there as well);
    # system -> objective -> share of requests meeting it.
    at_target: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class SpecBenchResult:
    provenance: dict
    model: str
    threads: int
    prompt_len: int
    output_len: int
    draft_model: str | None = None  # none: the model-free proposer alone
    reused: list[str] = field(default_factory=list)  # workloads whose prompts ran out and were handed out again
    # workload -> batch -> system -> one RunFigures per repeat
    runs: dict[str, dict[int, dict[str, list[RunFigures]]]] = field(default_factory=dict)
    open_loop: dict[str, OpenLoopFigures] = field(default_factory=dict)  # workload ->

    def median(self, workload: str, batch: int, system: str, figure: str) -> float:
        return statistics.median(getattr(r, figure) for r in self.runs[workload][batch][system])


def code_prompts(tokenize: Callable[[str], list[int]], n: int, length: int, rng: random.Random) -> list[list[int]]:
    """`n` stretches of `length` tokens of held-out Python source (all there are, when fewer), no two
    overlapping, drawn at random from every file's stretches."""
    stretches = [ids[start : start + length] for ids in (tokenize(text) for text in corpus_texts("heldout"))
                 for start in range(0, len(ids) - length + 1, length)]
    if not stretches:
        raise ValueError(f"the held-out source has no stretch of {length} tokens")
    return rng.sample(stretches, min(n, len(stretches)))


def workload_params(workload: str, output_len: int, seed: int) -> SamplingParams:
    """A request's parameters in `workload`: greedy, or for `sampled` temperature 1 with its own seed."""
    if workload == "sampled":
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=output_len, ignore_eos=True)
    return SamplingParams.greedy(max_tokens=output_len, ignore_eos=True)


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
              ) -> tuple[RunFigures, list[list[int]]]:
    """Every prompt at once, to its `max_tokens` (EOS ignored): the run's figures and outputs."""
    output_len = params[0].max_tokens
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    done = {}
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            steps += out.request_id in first
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            if out.finished:
                done[out.request_id] = out
    wall = time.perf_counter() - t0
    tpot = statistics.median((last[i] - first[i]) / (output_len - 1) for i in ids)
    figures = RunFigures(tpot_ms=tpot * 1e3, output_tps=len(ids) * output_len / wall,
                         drafted=sum(o.num_draft_tokens for o in done.values()),
                         accepted=sum(o.num_accepted_tokens for o in done.values()), decode_steps=steps,
                         verifications=sum(o.num_verifications for o in done.values()),
                         rejected=sum(o.num_rejected_drafts for o in done.values()),
                         model_verifications=sum(o.num_model_verifications for o in done.values()))
    return figures, [done[i].token_ids for i in ids]


class PromptPool:
    """A workload's prompts, each handed out once while they last (the held-out source holds a few
    hundred code prompts), then again from the first (`reused`): every run builds its engine afresh, so
    even a prompt handed out twice is never served from an earlier run's prefix cache or recent-output
    index. Open-loop runs at one rate share their prompts across systems."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self._prompts = prompts
        self._taken = 0
        self.reused = False
        self._by_rate: dict[float, list[list[int]]] = {}

    def take(self, n: int) -> list[list[int]]:
        count = len(self._prompts)
        self.reused |= self._taken + n > count
        taken = [self._prompts[(self._taken + i) % count] for i in range(n)]
        self._taken += n
        return taken

    def for_rate(self, rate: float, n: int) -> list[list[int]]:
        if rate not in self._by_rate:
            self._by_rate[rate] = self.take(n)
        return self._by_rate[rate]


BENCH_KV_MEMORY_MB = 512


def bench_engine(model_dir: Path, spec: SpeculativeConfig | None, batches: tuple[int, ...],
                 max_model_len: int) -> LLMEngine:
    """A fresh engine for one run, profiled as a worker starts: warm, and speculation knows its step costs."""
    engine = LLMEngine(model_dir, EngineConfig(speculative=spec, max_num_seqs=max(64, *batches),
                                               max_model_len=max_model_len,
                                               kv_memory_bytes=BENCH_KV_MEMORY_MB * 2**20))
    profile_decode(engine)
    return engine


def workload_pools(tokenize: Callable[[str], list[int]], vocab_size: int, needed: int, prompt_len: int,
                   output_len: int) -> dict[str, PromptPool]:
    """Each workload's prompts (`needed` of each)."""
    shapes = azure_trace_shapes(needed, 1.0, 1.0, prompt_len, output_len, seed=1)[0]
    return {
        "code": PromptPool(code_prompts(tokenize, needed, prompt_len, random.Random(0))),
        "conversation": PromptPool(random_token_prompts(shapes, vocab_size, seed=1)),
        "sampled": PromptPool(random_token_prompts(shapes, vocab_size, seed=2)),
    }


def run(cfg: SpecBenchConfig, log: Callable[[str], None] = print) -> SpecBenchResult:
    if cfg.output_len < 2:
        raise ValueError("output_len must be at least 2 (TPOT is measured between tokens)")
    torch.set_num_threads(cfg.threads)
    model_dir = resolve_model(cfg.model)
    probe = LLMEngine(model_dir, EngineConfig(max_num_seqs=1))
    result = SpecBenchResult(provenance(), cfg.model, cfg.threads, cfg.prompt_len, cfg.output_len, cfg.draft_model)
    compared = systems(cfg)
    # Every prompt a batch or open-loop run could take: each system's search measures at most `max_runs`
    # rates, the direct checks at the target (two objectives) a few more, and the idle runs a few more.
    needed = cfg.repeats * sum(cfg.batches) + (len(compared) * (cfg.max_runs + 2) * cfg.open_loop_requests
                                               + IDLE_REQUESTS if cfg.open_loop_requests else 0)
    pools = workload_pools(probe.tokenize, probe.vocab_size, needed, cfg.prompt_len, cfg.output_len)

    def engine_for(spec: SpeculativeConfig | None) -> LLMEngine:
        return bench_engine(model_dir, spec, cfg.batches, cfg.prompt_len + cfg.output_len)

    for workload, pool in pools.items():
        for batch in cfg.batches:
            for repeat in range(cfg.repeats):
                prompts = pool.take(batch)  # fresh for every repeat
                params = [workload_params(workload, cfg.output_len, seed=i) for i in range(batch)]
                outputs = {}
                for system, spec in compared.items():
                    figures, outputs[system] = run_batch(engine_for(spec), prompts, params)
                    result.runs.setdefault(workload, {}).setdefault(batch, {}).setdefault(system, []).append(figures)
                    log(f"  {workload:>12} batch {batch:>3} repeat {repeat + 1}/{cfg.repeats} {system:>7}: TPOT "
                        f"{figures.tpot_ms:6.2f} ms, {figures.output_tps:7.1f} output tok/s, accepted "
                        f"{figures.accepted}/{figures.drafted} drafted")
                if len({tuple(map(tuple, o)) for o in outputs.values()}) != 1:
                    raise AssertionError(f"{workload} batch {batch}: speculation changed the output")
        if cfg.open_loop_requests:
            result.open_loop[workload] = open_loop_goodput(workload, pool, engine_for, compared, cfg, log)
    result.reused = [workload for workload, pool in pools.items() if pool.reused]
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps({"benchmark": "spec", **asdict(result)}, indent=2))
    log(summary_table(result))
    log(f"results written to {cfg.out}")
    return result


def open_loop_goodput(workload: str, pool: PromptPool, engine_for: Callable[[SpeculativeConfig | None], LLMEngine],
                      compared: dict[str, SpeculativeConfig | None], cfg: SpecBenchConfig,
                      log: Callable[[str], None]) -> OpenLoopFigures:
    """Each system's goodput under Poisson arrivals, for objectives set from the idle latency without
    speculation (`pdserve bench serve`'s: tight 2x idle p90 TTFT and 1.5x idle p90 TPOT, loose 5x, 3x)."""
    engine = engine_for(None)
    idle = [r for p in pool.take(IDLE_REQUESTS)  # one at a time
            for r in open_loop_run(engine, [p], [workload_params(workload, cfg.output_len, 0)], 1.0, 0)]
    ttft = percentile([r.ttft for r in idle], 90)
    tpot = percentile([r.tpot for r in idle], 90)
    objectives = [Objective("tight", 2 * ttft, 1.5 * tpot), Objective("loose", 5 * ttft, 3 * tpot)]
    figures = OpenLoopFigures(ttft, tpot, {o.name: (o.ttft_s, o.tpot_s) for o in objectives}, {}, {})
    for system, spec in compared.items():
        def measure(rate: float, spec: SpeculativeConfig | None = spec, system: str = system) -> list[RequestRecord]:
            prompts = pool.for_rate(rate, cfg.open_loop_requests)
            params = [workload_params(workload, cfg.output_len, seed=i) for i in range(len(prompts))]
            records = open_loop_run(engine_for(spec), prompts, params, rate, seed=int(rate * 1000))
            log(f"  {workload:>12} open loop {system:>7} at {rate:6.2f} req/s: "
                + ", ".join(f"{o.name} {attainment(records, o):.0%}" for o in objectives))
            return records

        # Not below half the start: a run there takes minutes, and a system that misses there has no goodput
        # worth the name (the table says so).
        search = GoodputSearch(measure, start_rate=cfg.start_rate, min_rate=cfg.start_rate / 2, max_runs=cfg.max_runs,
                               rel_tol=0.15)
        found = {o.name: search.goodput(o) for o in objectives}
        figures.goodput[system] = {name: g.rate for name, g in found.items()}
        figures.converged[system] = {name: g.converged for name, g in found.items()}
        # runs the search made are reused where the rate is one of them
        figures.at_target[system] = {
            o.name: attainment(search.records(MIN_THROUGHPUT_RATIO * figures.goodput["off"][o.name]), o)
            for o in objectives if figures.goodput["off"][o.name]}
    return figures


def open_loop_run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], rate: float,
                  seed: int) -> list[RequestRecord]:
    """The prompts sent at Poisson arrivals of `rate` per second (the first at once); each request's
    times (seconds from the start) as the engine produced its tokens."""
    rng = random.Random(seed)
    arrivals = [0.0]
    while len(arrivals) < len(prompts):
        arrivals.append(arrivals[-1] + rng.expovariate(rate))
    records = [RequestRecord(f"r{i}", "", rate, send_time=t, prompt_len=len(p), max_tokens=sp.max_tokens)
               for i, (t, p, sp) in enumerate(zip(arrivals, prompts, params))]
    by_id: dict[str, RequestRecord] = {}
    sent = 0
    t0 = time.perf_counter()
    while sent < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while sent < len(prompts) and arrivals[sent] <= now:
            by_id[engine.add_request(prompts[sent], params[sent])] = records[sent]
            sent += 1
        if not engine.has_unfinished_requests():
            time.sleep(arrivals[sent] - now)  # the load generator's own clock: nothing to do until then
            continue
        outputs = engine.step()
        now = time.perf_counter() - t0
        for out in outputs:
            record = by_id[out.request_id]
            if record.first_token_time is None:
                record.first_token_time = now
            record.token_times += [now] * len(out.new_token_ids)
            if out.finished:
                record.end_time, record.output_tokens = now, len(out.token_ids)
    return records


def _from_json(results: dict) -> SpecBenchResult:
    result = SpecBenchResult(**{k: v for k, v in results.items() if k not in ("benchmark", "runs", "open_loop")})
    result.runs = {w: {int(b): {s: [RunFigures(**r) for r in rs] for s, rs in systems.items()}
                       for b, systems in batches.items()} for w, batches in results["runs"].items()}
    result.open_loop = {w: OpenLoopFigures(**f) for w, f in results.get("open_loop", {}).items()}
    return result


def _speculative(result: SpecBenchResult) -> list[str]:
    """The speculative systems the run compared, in order."""
    return [s for s in next(iter(next(iter(result.runs.values())).values())) if s != "off"]


def summary_table(result: SpecBenchResult) -> str:
    spec = _speculative(result)
    lines = ["| workload | batch | TPOT off (ms) | " + " | ".join(f"TPOT {s} (ms, off / {s})" for s in spec)
             + " | " + " | ".join(f"tok/s {s} / off" for s in spec)
             + " | " + " | ".join(f"{s}: drafts accepted, tokens per step, drafting" for s in spec) + " |",
             "|---" * (3 + 3 * len(spec)) + "|"]
    for workload, batches in result.runs.items():
        for batch, runs in batches.items():
            tpot = {s: result.median(workload, batch, s, "tpot_ms") for s in runs}
            tps = {s: result.median(workload, batch, s, "output_tps") for s in runs}
            cells = [f"{tpot[s]:.2f} ({tpot['off'] / tpot[s]:.2f}×)" for s in spec]
            cells += [f"{tps[s] / tps['off']:.2f}×" for s in spec]
            for s in spec:
                drafted, accepted = sum(r.drafted for r in runs[s]), sum(r.accepted for r in runs[s])
                steps = sum(r.decode_steps for r in runs[s])
                per_step = f"{len(runs[s]) * batch * (result.output_len - 1) / steps:.2f}" if steps else "—"
                drafting = RunFigures.drafting(runs[s])
                per_step += "" if drafting is None else (f", {drafting.acceptance:.2f} / {drafting.share:.0%} / "
                                                         f"{drafting.length:.1f} / {drafting.model_share:.0%}")
                cells.append(f"{accepted / drafted:.0%}, {per_step}" if drafted else f"none drafted, {per_step}")
            lines.append(f"| {workload} | {batch} | {tpot['off']:.2f} | " + " | ".join(cells) + " |")
    if result.open_loop:
        lines += ["", "| workload | objective (TTFT, TPOT) | goodput off (req/s) | "
                  + " | ".join(f"goodput {s} (req/s, {s} / off)" for s in spec) + " |", "|---" * (3 + len(spec)) + "|"]
        for workload, f in result.open_loop.items():
            for name, (ttft, tpot) in f.objectives.items():
                off = f.goodput["off"][name]
                checked = f.at_target.get("off", {}).get(name)
                off_cell = f"{off:.2f}" + ("" if checked is None else f" ({checked:.0%} met at {MIN_THROUGHPUT_RATIO:g}×)")
                cells = [f"{f.goodput[s][name]:.2f} ({f.goodput[s][name] / off:.2f}×"
                         + (f"; {f.at_target[s][name]:.0%} met at {MIN_THROUGHPUT_RATIO:g}× off's)" if s in f.at_target
                            and name in f.at_target[s] else ")") if off
                         else f"{f.goodput[s][name]:.2f} (—)" for s in spec]
                bounds = "" if all(f.converged[s][name] for s in f.goodput) else " (a search's run budget ran out)"
                lines.append(f"| {workload} | {name}: {ttft * 1e3:.0f} ms, {tpot * 1e3:.1f} ms | {off_cell} | "
                             + " | ".join(cells) + f"{bounds} |")
    return "\n".join(lines)


def _lowest(ratios: dict[str, list[float]]) -> str:
    # three digits: a ratio just under the threshold must not read as the threshold itself
    return "; ".join(f"{s} {min(r):.3f}× ({'met' if min(r) >= MIN_THROUGHPUT_RATIO else 'MISSED'})"
                     for s, r in ratios.items() if r)


def _goodput_verdict(at_target: dict[str, list[tuple[float, float | None]]], ratios: dict[str, list[float]]) -> str:
    """The goodput target's sentence: checked at 0.97x off's goodput where the run did (each system's
    share of requests meeting the objectives there, against 90% or off's own share there when off ran
    there too, the lowest margin shown), else from the searched goodputs' ratios."""
    def margin(share: float, off: float | None) -> float:
        return share - (TARGET_ATTAINMENT if off is None else min(TARGET_ATTAINMENT, off))

    def worst(pairs: list[tuple[float, float | None]]) -> str:
        share, off = min(pairs, key=lambda pair: margin(*pair))
        there = "" if off is None else f", off {off:.0%} there"
        return f"{share:.0%}{there} ({'met' if margin(share, off) >= 0 else 'MISSED'})"

    if any(at_target.values()):
        return (f". Goodput with speculation ≥ {MIN_THROUGHPUT_RATIO:g}× without on every workload and objective "
                f"(every system run at {MIN_THROUGHPUT_RATIO:g}× off's goodput, the highest rate off was measured to "
                f"meet the objectives at, off too; at least {TARGET_ATTAINMENT:.0%} of a system's requests must meet "
                "them there, or as many as off's did there), closest: "
                + "; ".join(f"{s} {worst(pairs)}" for s, pairs in at_target.items() if pairs))
    if any(ratios.values()):
        return (f". Goodput with speculation ≥ {MIN_THROUGHPUT_RATIO:g}× without on every workload and objective, "
                "lowest: " + _lowest(ratios))
    return ""


def markdown(results: dict) -> str:
    result = _from_json(results)
    spec = _speculative(result)
    code_tpot = {}
    if 1 in result.runs.get("code", {}):
        code_tpot = {s: result.median("code", 1, "off", "tpot_ms") / result.median("code", 1, s, "tpot_ms")
                     for s in spec}
    throughput = {s: [result.median(w, b, s, "output_tps") / result.median(w, b, "off", "output_tps")
                      for w, batches in result.runs.items() for b in batches] for s in spec}
    at_target = {s: [(share, f.at_target.get("off", {}).get(name)) for f in result.open_loop.values()
                     for name, share in f.at_target.get(s, {}).items()] for s in spec}
    goodput = {s: [f.goodput[s][name] / f.goodput["off"][name] for f in result.open_loop.values()
                   for name in f.objectives if f.goodput["off"][name]] for s in spec}
    repeats = len(next(iter(next(iter(result.runs.values())).values()))["off"])
    described = {
        "suffix": "suffix: the model-free proposer",
        "draft": f"draft: the draft model {result.draft_model} (one layer, distilled from the target; its "
                 f"prompt KV computed on the decoding side)",
        "both": "both: the suffix draft where the text repeats itself, the draft model's elsewhere",
    }
    lines = [
        f"{result.model}, float32, {result.threads} torch thread, {result.output_len} output tokens per request. "
        f"code: greedy, {result.prompt_len}-token stretches of held-out Python source (files the model never saw; no "
        f"two prompts overlap); conversation: greedy, random token ids with the conversation trace's prompt lengths "
        f"(up to {result.prompt_len}); sampled: other such prompts sampled at temperature 1, each request with its "
        f"own seed. Every run builds its engine afresh (empty prefix cache and recent-output index), which profiles "
        f"its decode steps first as a worker does when it starts, and takes prompts no other run used"
        + (f" (but for {', '.join(result.reused)}, whose prompts ran out and were handed out again: never "
           "served from an earlier run's caches, which every run starts without)" if result.reused else "")
        + "; the systems run the same prompts in turn. " + "; ".join(described[s] for s in spec)
        + ". Each proposes up to 8 draft tokens per sequence per step, each step's draft lengths sized by goodput.",
        "",
        f"First table: at each batch size every request starts at once; medians of {repeats} repeats; the outputs "
        f"of off and {', '.join(spec)} were identical, token for token; tokens per step is a request's output tokens "
        f"after its first over the steps that gave them (1 without speculation); drafting is what `pdserve plan` takes "
        f"of a workload's drafts: acceptance (the chance a draft token is accepted when the one before it was: "
        f"`--acceptance`) / the share of a request's decode steps that verified a draft (`--draft-share`) / the "
        f"draft tokens such a step verified (`--draft-length`) / the share of those drafts the draft model proposed "
        f"(`--draft-model-share`); plan with the row of the batch size the workers will run at. "
        f"Second table: requests arrive at "
        f"Poisson times, goodput is the highest rate at which 90% of them meet both objectives, searched per system "
        f"from 1 req/s and no lower than 0.5 req/s (0: missed even there) to within 15%; the "
        f"objectives are `pdserve bench serve`'s, from the latency of requests sent one at a time without "
        f"speculation (tight: 2× idle p90 TTFT and 1.5× idle p90 TPOT; loose: 5× and 3×).",
        "", summary_table(result), "",
        "Read these figures with the model in mind: the shipped model is small, and its greedy outputs repeat "
        "themselves (on random prompts too: 20–50% of their 8-token windows are distinct), which the suffix "
        "proposer copies. A larger model's outputs repeat less, and its acceptance will be lower.", "",
        f"Targets: TPOT at batch 1 on code ≥ {MIN_TPOT_SPEEDUP:g}× better: "
        + ("; ".join(f"{s} {r:.2f}× ({'met' if r >= MIN_TPOT_SPEEDUP else 'MISSED'})" for s, r in code_tpot.items())
           if code_tpot else "not run")
        + f". Output tok/s with speculation ≥ {MIN_THROUGHPUT_RATIO:g}× without at every workload and batch, "
        "lowest: "
        + _lowest(throughput)
        + _goodput_verdict(at_target, goodput) + ".",
    ]
    return "\n".join(lines)
