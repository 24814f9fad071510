"""`pdserve bench serve --policies`: the router's placement policies side by side, on three traces.

Where a request is placed decides its TTFT: a worker that holds its prefix skips most of the prompt
pass, a short queue starts it sooner, a short prompt need not wait behind long ones. This benchmark runs
every policy on the same cluster shape and the same workloads, one configuration at a time, and
checks the design's own policy (estimated_ttft) against the simpler ones and against itself with one part
switched off:

  estimated_ttft                      the estimated_ttft policy for both pools (length-aware prefill queues,
                                      prefix- and load-aware placement, conditional disaggregation)
  round_robin, least_loaded,          the same for both pools
  cache_aware, kv_cost
  estimated_ttft-fcfs                 estimated_ttft with one FCFS prefill queue (router.length_aware false)
  estimated_ttft-always-disaggregate  estimated_ttft that never prefills on a decode worker
                                      (router.local_prefill_tokens 0)

Cluster: disaggregated, 4 prefill + 1 decode worker (deploy/local.yaml otherwise), 1 thread each,
fractional Ray CPUs so that all of them fit the machine's cores (they share them, as they would share
a node's accelerators). Each configuration is started once, warmed up, runs every trace, and is stopped.

Workloads (the shipped traces, first requests; greedy, EOS ignored, token-id prompts):
  mooncake    Mooncake synthetic trace, whole prefix groups (workload.prefix_group_sample), lengths /32
              so that one 512-token hash block is one 16-token KV block; prefix sharing only through
              the trace's hash_ids
  azure-conv  Azure conversation trace, prompts x 0.5: mixed short and long
  azure-code  Azure code trace, prompts x 0.25: long
Outputs are scaled to a few up to 32 tokens (TTFT is what the router decides). Every run draws fresh
token contents (a seed per trace and run), so no run finds another run's blocks in a prefix cache; the
same run of two configurations gets the same tokens.

Rate: one per trace, common to all configurations: --rate, or `load` x the throughput the first
configuration (estimated_ttft when selected) reaches when the whole run's requests arrive at once.
Measured there, the load is one that the estimated_ttft policy sustains; a policy that wastes work queues past it.
Each (trace, configuration) runs once at that rate (Poisson arrivals), and that run is the first of a
goodput search (serve_metrics.GoodputSearch, --max-runs runs, never below half the rate).

Objective (per trace, for goodput): the serve benchmark's loose pair (5 x idle p90 TTFT, 3 x idle TPOT, from
requests one at a time on the first configuration), or --objective. Not the tight pair: its attainment
wanders between runs on this machine, and five workers on two cores stretch TPOT under any load.

Per (trace, configuration), at the common rate: prefix-cache hit rate (cached prompt tokens the workers
reported to the client / prompt tokens), the oracle's hit rate over the same requests (`prefix_oracle`:
each request's longest prefix shared with any earlier request of the run, which no placement can beat),
the best prefix any worker held at placement time (the router's exact index), the router's predicted
hit rate, TTFT
p50/p90, TTFT p90 of short prompts (<= the LAPS threshold that the estimated_ttft configuration reports,
one cut for every configuration of a trace), TPOT p50, local prefills, early rejections, requests per
worker; and goodput. The targets are checked side by side (TARGETS).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import multiprocessing
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.cluster.bench import serve as bench_serve
from pdserve.cluster.bench.loadgen import GrpcClient, Request, poisson_arrivals, run_load, write_jsonl
from pdserve.cluster.bench.report import SMOKE_CAVEAT, plot_record, provenance
from pdserve.cluster.bench.serve_metrics import (
    Goodput,
    GoodputSearch,
    Objective,
    RequestRecord,
    percentile,
    rate_key,
    summarize,
    summarize_runs,
)
from pdserve.cluster.bench.workload import (
    TraceRequest,
    block_prompts,
    find_trace,
    load_azure_trace,
    load_mooncake_trace,
    prefix_group_sample,
    run_seed,
    scale_requests,
)
from pdserve.engine.block_pool import hash_prompt_blocks


# --- configurations -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyConfig:
    description: str
    router: dict[str, Any]  # manifest `router` fields


CONFIGS: dict[str, PolicyConfig] = {  # estimated_ttft first: it calibrates, and its LAPS threshold cuts "short"
    "estimated_ttft": PolicyConfig("estimated_ttft policy, both pools", {"policy": "estimated_ttft"}),
    "round_robin": PolicyConfig("round robin, both pools", {"policy": "round_robin"}),
    "least_loaded": PolicyConfig("least loaded, both pools", {"policy": "least_loaded"}),
    "cache_aware": PolicyConfig("longest cached prefix, both pools", {"policy": "cache_aware"}),
    "kv_cost": PolicyConfig("KV cost, both pools", {"policy": "kv_cost"}),
    "estimated_ttft-fcfs": PolicyConfig("estimated_ttft with one FCFS prefill queue",
                                        {"policy": "estimated_ttft", "length_aware": False}),
    "estimated_ttft-always-disaggregate": PolicyConfig("estimated_ttft, never prefilling on a decode worker",
                                                       {"policy": "estimated_ttft", "local_prefill_tokens": 0}),
    # On request: LAPS against one FCFS queue with no local prefill in either, so that every short
    # prompt goes through the prefill queues.
    "estimated_ttft-fcfs-always-disaggregate": PolicyConfig("estimated_ttft with one FCFS prefill queue, never "
                                                            "prefilling on a decode worker",
                                                            {"policy": "estimated_ttft", "length_aware": False,
                                                             "local_prefill_tokens": 0}),
}
DEFAULT_CONFIGS = tuple(CONFIGS)[:-1]
PREFILL_CPUS, DECODE_CPUS = 0.25, 0.5  # Ray CPUs per worker: 4 x 0.25 + 0.5 fit 2 cores


@dataclass(frozen=True)
class TraceSpec:
    file: str
    input_scale: float
    output_scale: float
    description: str
    prefix_groups: bool = False  # sample whole prefix groups (Mooncake); the prefix-cache targets apply
    mixed_lengths: bool = False  # short and long prompts: the length-aware queueing target applies
    max_output: int = 32


TRACES: dict[str, TraceSpec] = {
    "mooncake": TraceSpec("mooncake_synthetic_trace.jsonl", 1 / 32, 0.1, "Mooncake synthetic trace, whole prefix "
                          "groups, block-structured prompts (equal hash ids, equal tokens)", prefix_groups=True),
    "azure-conv": TraceSpec("azure2023_conv.csv", 0.5, 0.1, "Azure conversation trace, random prompts",
                            mixed_lengths=True),
    "azure-code": TraceSpec("azure2023_code.csv", 0.25, 1.0, "Azure code trace, random prompts", mixed_lengths=True),
}

# The targets (issue 8), checked by check_targets.
ROUND_ROBIN_SPEEDUP = 2.0  # TTFT p90 on the prefix-sharing trace: round_robin / estimated_ttft
SHORT_GAIN = 0.3  # short-request TTFT p90 on the mixed traces: 1 - estimated_ttft / estimated_ttft-fcfs
NOISE_ALLOWANCE = 0.05  # "never worse" than always-disaggregate: estimated_ttft / it <= 1 + this
HIT_VS_ORACLE = 0.9  # estimated_ttft's hit rate / the oracle's
MIN_RATE_FACTOR = 0.5  # the goodput search goes no lower than this x the common rate

ROUTER_COUNTERS = ("requests_routed", "prompt_tokens", "predicted_cached_tokens", "oracle_cached_tokens",
                   "local_prefills", "early_rejections")
ROUTER_SETTINGS = ("prefill_policy", "decode_policy", "short_prompt_tokens", "long_chunk_tokens",
                   "local_prefill_tokens")

# The run-time estimate: a cluster's start and stop, its warm-up, one idle request, the rate assumed
# before calibration. Each search run lasts about as long as the first (it goes up as often as down).
START_S, WARM_UP_S, IDLE_REQUEST_S, ASSUMED_RATE = 25.0, 8.0, 0.4, 4.0


@dataclass
class PolicyBenchConfig:
    model: str = "llama-20m"
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    traces: tuple[str, ...] = tuple(TRACES)
    requests: int = 64  # per run
    rates: dict[str, float] = field(default_factory=dict)  # per trace, req/s; absent: load x capacity
    load: float = 0.7
    max_runs: int = 3  # per (trace, configuration), the common-rate run included
    rel_tol: float = 0.1
    max_rate: float = 64.0
    objective: tuple[float, float] | None = None  # (ttft_s, tpot_s) for every trace; None: calibrated
    calibration_requests: int = 8
    prefill_replicas: int = 4
    decode_replicas: int = 1
    max_model_len: int = 1024
    max_output: int | None = None  # a cap below the traces' own (32)
    seed: int = 0
    timeout_s: float = 300.0
    out_dir: Path = Path("bench-results/policies")
    progress: bool = True
    smoke: bool = False  # a --quick run: its figures are marked as no measurement

    def quick(self) -> "PolicyBenchConfig":
        """A smoke run: the first two configurations on the first trace, a few short requests (a 256-token
        context cuts the prompts), one run each, two prefill workers."""
        return replace(self, configs=self.configs[:2], traces=self.traces[:1], requests=8, calibration_requests=2,
                       max_runs=1, prefill_replicas=min(self.prefill_replicas, 2), max_model_len=256, max_output=4,
                       smoke=True)

    def serve_config(self) -> bench_serve.ServeBenchConfig:
        """The fields the serve benchmark's manifest and calibration read."""
        return bench_serve.ServeBenchConfig(model=self.model, max_model_len=self.max_model_len,
                                            calibration_requests=self.calibration_requests)


def manifest_for(config: str, cfg: PolicyBenchConfig) -> dict[str, Any]:
    """the serve benchmark's disaggregated manifest with this benchmark's pools and the configuration's router."""
    data = bench_serve.manifest_for("disaggregated", cfg.serve_config())
    data["pools"]["prefill"].update(replicas=cfg.prefill_replicas, num_cpus=PREFILL_CPUS, threads=1)
    data["pools"]["decode"].update(replicas=cfg.decode_replicas, num_cpus=DECODE_CPUS, threads=1)
    data["router"].update(CONFIGS[config].router)
    return data


def parse_rates(items: Iterable[str], traces: Iterable[str]) -> dict[str, float]:
    """`--rate` values: `R` (every trace) or `TRACE=R`, in req/s."""
    traces = tuple(traces)
    out: dict[str, float] = {}
    for item in items:
        name, _, value = item.rpartition("=")
        try:
            rate = float(value)
        except ValueError:
            raise ValueError(f"--rate takes R or TRACE=R (req/s), got {item!r}") from None
        if not rate > 0:
            raise ValueError(f"--rate must be > 0, got {item!r}")
        if name and name not in traces:
            raise ValueError(f"--rate names trace {name!r}; the traces are {', '.join(traces)}")
        out.update({name: rate} if name else dict.fromkeys(traces, rate))
    return out


def estimate_s(cfg: PolicyBenchConfig, rates: dict[str, float]) -> float:
    """About how long the benchmark takes, given the rates known so far (ASSUMED_RATE for the others)."""
    per_trace = 0.0
    for t in cfg.traces:
        rate = rates.get(t, ASSUMED_RATE)
        idle = 0 if cfg.objective else cfg.calibration_requests * IDLE_REQUEST_S
        calibration = idle + (0 if t in cfg.rates else cfg.requests * cfg.load / rate)
        per_trace += calibration + len(cfg.configs) * cfg.max_runs * cfg.requests / rate
    return len(cfg.configs) * (START_S + WARM_UP_S) + per_trace


# --- workloads ------------------------------------------------------------------------------------
@dataclass
class Workload:
    """One trace's request shapes and what calibration found for it."""

    name: str
    path: Path
    shapes: list[TraceRequest]
    vocab_size: int
    rate: float | None = None
    rate_source: str = ""
    capacity_rps: float | None = None
    calibration: dict[str, float] | None = None
    objective: Objective | None = None

    def requests(self, seed: int, tag: str) -> list[Request]:
        """The trace's requests with token contents of their own for run `tag`."""
        prompts = block_prompts(self.shapes, self.vocab_size, run_seed(seed, self.name, tag))
        return [Request(f"{self.name}-{tag}-{i}", ids, s.output_len)
                for i, (s, ids) in enumerate(zip(self.shapes, prompts))]


def load_workload(name: str, cfg: PolicyBenchConfig, vocab_size: int) -> Workload:
    spec = TRACES[name]
    path = find_trace(spec.file)
    if spec.prefix_groups:
        raw = prefix_group_sample(load_mooncake_trace(path), cfg.requests)
    else:
        raw = load_azure_trace(path, cfg.requests)
    max_output = min(spec.max_output, cfg.max_output or spec.max_output)
    shapes = scale_requests(raw, spec.input_scale, spec.output_scale, cfg.max_model_len, max_output)
    return Workload(name, path, shapes, vocab_size)


def describe(w: Workload) -> dict[str, Any]:
    spec = TRACES[w.name]
    prompts = [s.prompt_len for s in w.shapes]
    outputs = [s.output_len for s in w.shapes]
    return {
        "trace": str(w.path), "description": spec.description, "requests": len(w.shapes),
        "selection": "whole prefix groups in order of first appearance" if spec.prefix_groups else "first rows",
        "input_scale": spec.input_scale, "output_scale": spec.output_scale,
        "block_tokens": w.shapes[0].block_tokens if spec.prefix_groups else None,
        "prompt_len": {"mean": sum(prompts) / len(prompts), "p50": percentile(prompts, 50), "min": min(prompts),
                       "max": max(prompts)},
        "output_len": {"mean": sum(outputs) / len(outputs), "p50": percentile(outputs, 50), "max": max(outputs)},
        "arrivals": "poisson", "sampling": "greedy, EOS ignored (exactly max_tokens)",
        "tokens": "fresh per run (seed per trace and run); prefix sharing only within a run, from hash_ids",
    }


# --- measurement ----------------------------------------------------------------------------------
@dataclass
class PairResult:
    """One (trace, configuration): its runs by rate, the router's counters over each, its goodput."""

    trace: str
    config: str
    runs: dict[float, list[RequestRecord]] = field(default_factory=dict)
    router: dict[float, dict[str, Any]] = field(default_factory=dict)
    goodput: Goodput | None = None
    error: str | None = None


def router_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The router's counters over one run: differences of Cluster.router_stats() snapshots."""
    out: dict[str, Any] = {k: after[k] - before[k] for k in ROUTER_COUNTERS}
    out["per_worker"] = {w: n - before["per_worker"].get(w, 0) for w, n in after["per_worker"].items()}
    return out


def _share(part: int | float, whole: int | float) -> float | None:
    return part / whole if whole else None


def prefix_oracle(requests: list[Request], block_size: int) -> dict[str, int]:
    """Per request (in arrival order), the prompt tokens an oracle serves from cache: the longest run of
    leading full blocks it shares with any earlier request of the run (counted as the engine counts:
    never the last prompt token). Every cached block comes from an earlier request's prompt pass, so
    no placement can hit more; a placement that always finds the worker holding the longest prefix,
    with caches that never evict, hits exactly this."""
    seen: set[bytes] = set()
    out = {}
    for r in requests:
        ids = r.token_ids
        hashes = hash_prompt_blocks(ids[: (len(ids) - 1) // block_size * block_size], block_size)
        hits = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        out[r.request_id] = hits * block_size
        seen.update(hashes)
    return out


def figures(records: list[RequestRecord], router: dict[str, Any], short_cut: int | None) -> dict[str, Any]:
    """One run's figures: latencies from the records, hit rates from the records, the oracle and the
    router's counters."""
    s = summarize(records)
    ok = [r for r in records if r.outcome == "ok"]
    seen = [r for r in records if r.cached_tokens is not None]
    hit = _share(sum(r.cached_tokens for r in seen), sum(r.prompt_len for r in seen))
    best = router.get("prefix_oracle")
    oracle = _share(sum(best.get(r.request_id, 0) for r in seen), sum(r.prompt_len for r in seen)) if best else None
    short = [r.ttft for r in ok if short_cut is not None and r.prompt_len <= short_cut]
    # TTFT of requests some cache served part of, and of cold ones: placement only speeds up the first.
    hit_ttft = [r.ttft for r in ok if r.cached_tokens]
    cold_ttft = [r.ttft for r in ok if not r.cached_tokens]
    return {
        "sent": s["sent"], "ok": s["ok"], "rejected": s["rejected"], "errors": s["errors"],
        "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"],
        "short_requests": len(short), "short_ttft_p90_s": percentile(short, 90),
        "hit_requests": len(hit_ttft), "hit_ttft_p50_s": percentile(hit_ttft, 50), "hit_ttft_p90_s": percentile(hit_ttft, 90),
        "cold_ttft_p50_s": percentile(cold_ttft, 50), "cold_ttft_p90_s": percentile(cold_ttft, 90),
        "tpot_p50_s": s["tpot_s"]["p50"],
        "hit_rate": hit, "oracle_hit_rate": oracle,
        "hit_vs_oracle": hit / oracle if hit is not None and oracle else None,
        "predicted_hit_rate": _share(router["predicted_cached_tokens"], router["prompt_tokens"]),
        "placement_oracle_hit_rate": _share(router["oracle_cached_tokens"], router["prompt_tokens"]),
        "local_prefills": router["local_prefills"], "early_rejections": router["early_rejections"],
        "per_worker": router["per_worker"], "output_tokens_per_s": s["output_tokens_per_s"],
    }


def short_cut(settings: dict[str, dict[str, Any]], prompt_lens: list[int]) -> tuple[int, str]:
    """The prompt length that counts as short for every configuration of a trace, and where it came from.

    The LAPS threshold the estimated_ttft configuration reported, else another configuration's, else the
    workload's median prompt.
    """
    for name in sorted(settings, key=lambda n: n != "estimated_ttft"):
        value = settings[name].get("short_prompt_tokens")
        if value:
            return int(value), f"short_prompt_tokens of {name}"
    return int(percentile(prompt_lens, 50)), "median prompt length (no configuration reported a LAPS threshold)"


def _calibrate(w: Workload, cfg: PolicyBenchConfig, pool: concurrent.futures.Executor, target: bench_serve.Target,
               log: Callable[[str], None]) -> None:
    """Idle latencies give the objective; a burst of the whole run at once gives the capacity and the rate."""
    log(f"  calibrating {w.name}:")
    if cfg.objective:
        w.objective = Objective("given", *cfg.objective)
    else:
        w.calibration = bench_serve.calibrate(cfg.serve_config(), pool, target, w.requests(cfg.seed, "calibration"),
                                              lambda s: log(f"    {s}"))
        w.objective = next(o for o in bench_serve.objectives_from(cfg.serve_config(), w.calibration)
                           if o.name == "loose")
    if w.name in cfg.rates:
        w.rate, w.rate_source = rate_key(cfg.rates[w.name]), "--rate"
    else:
        burst = w.requests(cfg.seed, "capacity")
        recs = pool.submit(run_load, target.client, burst, [0.0] * len(burst), config=f"{w.name}/capacity",
                           rate=0.0, progress=cfg.progress).result()
        w.capacity_rps = summarize(recs)["requests_per_s"]
        if not w.capacity_rps:
            raise RuntimeError(f"{w.name}: no request of the capacity burst completed: {recs[0].error}")
        w.rate = rate_key(cfg.load * w.capacity_rps)
        w.rate_source = f"{cfg.load:g} x capacity ({len(burst)} requests at once: {w.capacity_rps:.2f} req/s)"
    log(f"    rate {w.rate:g} req/s ({w.rate_source}); objective TTFT <= {w.objective.ttft_s * 1e3:.0f} ms, "
        f"TPOT <= {w.objective.tpot_s * 1e3:.1f} ms")


def _interleave(lists: list[list[Request]]) -> list[Request]:
    return [r for group in zip(*lists) for r in group]


def bench_config(config: str, cfg: PolicyBenchConfig, workloads: dict[str, Workload],
                 results: dict[tuple[str, str], PairResult], settings: dict[str, dict[str, Any]],
                 pool: concurrent.futures.Executor, log: Callable[[str], None]) -> None:
    """Start one configuration, calibrate the traces no configuration has, run every trace, stop.

    Fills `results` and `settings` as it goes, so what was measured before a failure is kept.
    """
    from pdserve.cluster.launcher import Cluster
    from pdserve.cluster.manifest import load_manifest

    def record_settings() -> None:  # at the start, and again at the end: measured values may settle late
        stats = cluster.router_stats()
        settings[config] = {k: stats.get(k) for k in ROUTER_SETTINGS}

    with Cluster(load_manifest(manifest_for(config, cfg)), log=lambda s: log(f"  {s}")) as cluster:
        record_settings()
        log(f"  router: {', '.join(f'{k} {v}' for k, v in settings[config].items())}")
        target = bench_serve.Target(GrpcClient(cluster.address, timeout=cfg.timeout_s))
        bench_serve.warm_up(pool, target, _interleave([w.requests(cfg.seed, "warmup") for w in workloads.values()]),
                             config)
        if any(w.rate is None for w in workloads.values()):
            for w in workloads.values():
                if w.rate is None:
                    _calibrate(w, cfg, pool, target, log)
            log(f"  estimated total now: ~{estimate_s(cfg, {w.name: w.rate for w in workloads.values()}) / 60:.0f} min")

        for w in workloads.values():
            _bench_trace(w, results[w.name, config], cluster, target, cfg, pool, log)
        record_settings()


def _bench_trace(w: Workload, result: PairResult, cluster: Any, target: bench_serve.Target, cfg: PolicyBenchConfig,
                 pool: concurrent.futures.Executor, log: Callable[[str], None]) -> None:
    """One trace on a running configuration: the common-rate run, then the rest of the goodput search."""
    name = f"{w.name}/{result.config}"

    def measure(rate: float) -> list[RequestRecord]:
        before = cluster.router_stats()
        reqs = w.requests(cfg.seed, f"{rate:g}")
        recs = pool.submit(run_load, target.client, reqs, poisson_arrivals(len(reqs), rate, cfg.seed), config=name,
                           rate=rate, progress=cfg.progress).result()
        result.router[rate] = router_delta(before, cluster.router_stats())
        result.router[rate]["prefix_oracle"] = prefix_oracle(reqs, cluster.manifest.block_size)
        write_jsonl(recs, cfg.out_dir / "requests.jsonl")
        f = figures(recs, result.router[rate], None)
        log(f"  {name} @ {rate:g} req/s: ok {f['ok']}/{f['sent']} (rejected {f['rejected']}, errors {f['errors']}), "
            f"TTFT p50 {bench_serve._ms(f['ttft_p50_s'])} p90 {bench_serve._ms(f['ttft_p90_s'])}, TPOT p50 "
            f"{bench_serve._ms(f['tpot_p50_s'])}, hit {_pct(f['hit_rate'])} (oracle {_pct(f['oracle_hit_rate'])}), "
            f"local {f['local_prefills']}")
        return recs

    search = GoodputSearch(measure, w.rate, min_rate=w.rate * MIN_RATE_FACTOR, max_rate=cfg.max_rate,
                           rel_tol=cfg.rel_tol, max_runs=cfg.max_runs)
    result.runs = search.runs  # the same dict, filled as runs are measured
    search.records(w.rate)  # the common rate, the search's first run
    result.goodput = g = search.goodput(w.objective)
    log(f"  {name}: goodput {g.rate:g} req/s{'' if g.failed_rate is None else f' (missed at {g.failed_rate:g})'}"
        f"{f' [{g.note}]' if g.note else ''}")


# --- report ---------------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def check_targets(table: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The issue's targets from the figures at the common rates (table[trace][config]); pass None: not
    measurable (a configuration missing, or no request in the group)."""
    out = []

    def add(key: str, target: str, trace: str, measured: float | None, threshold: float,
            passed: Callable[[float], bool]) -> None:
        out.append({"id": key, "target": target, "trace": trace, "measured": measured, "threshold": threshold,
                    "pass": None if measured is None else passed(measured)})

    for trace, row in table.items():
        def get(config: str, key: str) -> Any:
            return row.get(config, {}).get(key)

        spec = TRACES[trace]
        if spec.prefix_groups:
            add("vs_round_robin", "TTFT p90: round_robin / estimated_ttft", trace,
                _ratio(get("round_robin", "ttft_p90_s"), get("estimated_ttft", "ttft_p90_s")),
                ROUND_ROBIN_SPEEDUP, lambda m: m >= ROUND_ROBIN_SPEEDUP)
            add("hit_vs_oracle", "hit rate / oracle hit rate, estimated_ttft", trace,
                get("estimated_ttft", "hit_vs_oracle"), HIT_VS_ORACLE, lambda m: m >= HIT_VS_ORACLE)
        if spec.mixed_lengths:
            ratio = _ratio(get("estimated_ttft", "short_ttft_p90_s"),
                           get("estimated_ttft-fcfs", "short_ttft_p90_s"))
            add("short_vs_fcfs", "short-request TTFT p90: 1 - estimated_ttft / estimated_ttft-fcfs", trace,
                None if ratio is None else 1 - ratio, SHORT_GAIN, lambda m: m >= SHORT_GAIN)
        add("vs_always_disaggregate", "TTFT p90: estimated_ttft / estimated_ttft-always-disaggregate", trace,
            _ratio(get("estimated_ttft", "ttft_p90_s"), get("estimated_ttft-always-disaggregate", "ttft_p90_s")),
            1 + NOISE_ALLOWANCE, lambda m: m <= 1 + NOISE_ALLOWANCE)
    return out


def _goodput(g: Goodput | None) -> dict[str, Any] | None:
    return None if g is None else {"rate": g.rate, "failed_rate": g.failed_rate, "attainment": g.attainment,
                                   "converged": g.converged, "note": g.note}


def tables(workloads: dict[str, Workload], results: dict[tuple[str, str], PairResult],
           settings: dict[str, dict[str, Any]]) -> tuple[dict[str, tuple[int, str]], dict[str, dict[str, dict]]]:
    """Each trace's short cut, and the figures at its common rate per configuration that ran it."""
    cuts = {t: short_cut(settings, [s.prompt_len for s in w.shapes]) for t, w in workloads.items()}
    table = {t: {c: figures(r.runs[w.rate], r.router[w.rate], cuts[t][0]) for (trace, c), r in results.items()
                 if trace == t and w.rate in r.runs and w.rate in r.router}
             for t, w in workloads.items()}
    return cuts, table


def assemble(cfg: PolicyBenchConfig, model_dir: Path, workloads: dict[str, Workload],
             results: dict[tuple[str, str], PairResult], settings: dict[str, dict[str, Any]], errors: dict[str, str],
             cuts: dict[str, tuple[int, str]], table: dict[str, dict[str, dict]]) -> dict[str, Any]:
    traces = {}
    for t, w in workloads.items():
        per_config = {}
        for c in cfg.configs:
            r = results[t, c]
            runs = summarize_runs(r.runs.items(), [w.objective] if w.objective else [])
            per_config[c] = {"error": r.error, "at_rate": table[t].get(c), "goodput": _goodput(r.goodput),
                             "runs": [{**run, "router": r.router.get(run["rate"])} for run in runs]}
        traces[t] = {"workload": describe(w), "rate": w.rate, "rate_source": w.rate_source,
                     "capacity_rps": w.capacity_rps, "calibration": w.calibration,
                     "objective": asdict(w.objective) if w.objective else None,
                     "short_prompt_tokens": {"cut": cuts[t][0], "source": cuts[t][1]}, "configs": per_config}
    return {
        "benchmark": "policies",
        "provenance": provenance(cfg.smoke),
        "software": bench_serve.software(),
        "model": {"name": cfg.model, "dir": str(model_dir), "max_model_len": cfg.max_model_len},
        "cluster": {"mode": "disaggregated", "prefill_replicas": cfg.prefill_replicas,
                    "decode_replicas": cfg.decode_replicas, "threads": 1,
                    "ray_cpus": {"prefill": PREFILL_CPUS, "decode": DECODE_CPUS}},
        "method": {"requests_per_run": cfg.requests, "load": cfg.load, "max_runs": cfg.max_runs,
                   "min_rate_factor": MIN_RATE_FACTOR, "rel_tol": cfg.rel_tol, "seed": cfg.seed,
                   "rate": "per trace, common to all configurations: --rate, or load x the throughput of the first "
                           "configuration with the whole run arriving at once",
                   "objective": "--objective" if cfg.objective else "the serve benchmark's loose pair: 5 x idle p90 "
                                                                    "TTFT, 3 x idle TPOT",
                   "hit_rate": "sum of cached_tokens reported to the client / sum of their prompt tokens",
                   "oracle_hit_rate": "prefix_oracle: each request's longest block prefix shared with an earlier "
                                      "request of the run / prompt tokens, over the requests that reported cached tokens",
                   "placement_oracle_hit_rate": "router_stats: oracle_cached_tokens / prompt_tokens (the best "
                                                "match any worker held when the request was placed)",
                   "requests_jsonl": "one RequestRecord a line; config = TRACE/CONFIG"},
        "configs": {c: {"description": CONFIGS[c].description, "router": CONFIGS[c].router,
                        "router_in_effect": settings.get(c), "error": errors.get(c)} for c in cfg.configs},
        "traces": traces,
        "targets": check_targets(table),
    }


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _or_nan(x: float | None) -> float:
    return math.nan if x is None else x  # a missing figure draws no bar


def plot(cfg: PolicyBenchConfig, workloads: dict[str, Workload], results: dict[tuple[str, str], PairResult],
         table: dict[str, dict[str, dict]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import ScalarFormatter

    traces, configs = list(workloads), list(cfg.configs)
    width = 0.8 / len(configs)
    paths = []

    fig, ax = plt.subplots(figsize=(max(6.0, 2.5 * len(traces)), 4))
    for i, c in enumerate(configs):
        ys = [_or_nan(table[t].get(c, {}).get("ttft_p90_s")) * 1e3 for t in traces]
        ax.bar(np.arange(len(traces)) + (i - (len(configs) - 1) / 2) * width, ys, width, label=c)
    ax.set_xticks(range(len(traces)), [f"{t}\n@ {workloads[t].rate:g} req/s" for t in traces])
    ax.set(ylabel="TTFT p90 (ms)", yscale="log", title="TTFT p90 per policy at each trace's common rate")
    ax.yaxis.set_major_formatter(ScalarFormatter())  # log: policies can differ by orders of magnitude
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "ttft_p90.png"))

    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    for ax, t in zip(axes[0], traces):
        x = np.arange(len(configs))
        for offset, key, label in ((-0.2, "hit_rate", "hit rate (workers)"), (0.2, "oracle_hit_rate", "oracle")):
            ax.bar(x + offset, [_or_nan(table[t].get(c, {}).get(key)) for c in configs], 0.4, label=label)
        ax.set_xticks(x, configs, rotation=30, ha="right", fontsize=7)
        ax.set(ylabel="prefix-cache hit rate", ylim=(0, 1), title=t)
        ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "hit_rate.png"))

    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    for ax, t in zip(axes[0], traces):
        for c in configs:
            xs = sorted(r.ttft * 1e3 for r in results[t, c].runs.get(workloads[t].rate, []) if r.outcome == "ok")
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=c)
        ax.set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of completed requests",
               title=f"{t} @ {workloads[t].rate:g} req/s")
        ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "ttft_cdf.png"))
    return paths


COLUMNS = ("TTFT p50", "TTFT p90", "short p90", "TPOT p50", "hit", "oracle", "hit/oracle", "local", "early",
           "refused", "goodput")


def _cells(figures: dict[str, Any], goodput: dict[str, Any] | None) -> list[str]:
    """One configuration's figures at a trace's common rate, as COLUMNS."""
    ms = bench_serve._ms
    f = figures
    return [ms(f["ttft_p50_s"]), ms(f["ttft_p90_s"]), ms(f["short_ttft_p90_s"]), ms(f["tpot_p50_s"]),
            _pct(f["hit_rate"]), _pct(f["oracle_hit_rate"]),
            "n/a" if f["hit_vs_oracle"] is None else f"{f['hit_vs_oracle']:.2f}",
            str(f["local_prefills"]), str(f["early_rejections"]), str(f["rejected"]),
            "n/a" if goodput is None else format(goodput["rate"], "g")]


def _verdict(target: dict[str, Any]) -> tuple[str, str]:
    measured = "n/a" if target["measured"] is None else f"{target['measured']:.2f}"
    return {True: "pass", False: "MISS", None: "n/a"}[target["pass"]], measured


def _summary(cfg: PolicyBenchConfig, out: dict[str, Any], log: Callable[[str], None]) -> None:
    widths = (10, 10, 10, 9, 5, 6, 10, 5, 5, 7, 8)
    for t, tr in out["traces"].items():
        log(f"\n{t} @ {tr['rate']} req/s (short: prompt <= {tr['short_prompt_tokens']['cut']} tokens)")
        log(f"  {'config':28} " + " ".join(f"{name:>{w}}" for name, w in zip(COLUMNS, widths)))
        for c in cfg.configs:
            f, g = tr["configs"][c]["at_rate"], tr["configs"][c]["goodput"]
            if f is None:
                log(f"  {c:28} {tr['configs'][c]['error'] or 'not measured'}")
                continue
            log(f"  {c:28} " + " ".join(f"{cell:>{w}}" for cell, w in zip(_cells(f, g), widths)))
    log("\ntargets:")
    if cfg.smoke:
        log(f"  a smoke run (--quick): {SMOKE_CAVEAT}")
    for x in out["targets"]:
        verdict, measured = _verdict(x)
        log(f"  {verdict:4}  {x['trace']:10} {x['target']}: {measured} (target {x['threshold']:g})")


def markdown(results: dict[str, Any]) -> str:
    """The benchmark's section of docs/benchmarks.md: the cluster and the method, each trace's
    configurations side by side at its common rate, and the targets."""
    m, c, method = results["model"], results["cluster"], results["method"]
    lines = [
        f"Model {m['name']} (max_model_len {m['max_model_len']}); disaggregated, {c['prefill_replicas']} prefill + "
        f"{c['decode_replicas']} decode worker(s), {c['threads']} torch thread each, sharing the machine's cores "
        f"(Ray CPUs {c['ray_cpus']['prefill']:g} per prefill and {c['ray_cpus']['decode']:g} per decode worker). "
        f"One cluster per configuration runs every trace. {method['requests_per_run']} requests per run with "
        f"Poisson arrivals at a rate common to every configuration of a trace: {method['load']:g} × the "
        f"throughput of the first configuration with the run's requests arriving at once (or `--rate`); every "
        f"run draws fresh token contents, so no run is served from another's prefix cache. Goodput: the highest "
        f"rate meeting the objective ({method['objective']}) for 90% of requests, searched from the common rate "
        f"in at most {method['max_runs']} runs. Hit: prompt tokens the workers served from cache / prompt tokens; "
        f"oracle: each request's longest block prefix shared with an earlier request of the run (no placement "
        f"beats it); local: prompts prefilled on their decode worker; early: requests refused before placement; "
        f"short: prompts up to the trace's LAPS threshold.",
    ]
    for t, tr in results["traces"].items():
        objective = tr["objective"]
        goal = (f"; objective TTFT ≤ {objective['ttft_s'] * 1e3:.0f} ms, "
                f"TPOT ≤ {objective['tpot_s'] * 1e3:.0f} ms" if objective else "")
        lines += ["", f"**{t}** ({tr['workload']['requests']} requests; mean prompt "
                      f"{tr['workload']['prompt_len']['mean']:.0f} tokens, mean output "
                      f"{tr['workload']['output_len']['mean']:.0f}) at {tr['rate']:g} req/s ({tr['rate_source']}); "
                      f"short = prompt ≤ {tr['short_prompt_tokens']['cut']} tokens{goal}.",
                  "", "| configuration | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
        for name, config in tr["configs"].items():
            if config["at_rate"] is None:
                lines.append(f"| {name} | {config['error'] or 'not measured'} |" + " |" * (len(COLUMNS) - 1))
            else:
                lines.append(f"| {name} | " + " | ".join(_cells(config["at_rate"], config["goodput"])) + " |")
    lines += ["", "| trace | target | measured | threshold | verdict |", "|---|---|---|---|---|"]
    for x in results["targets"]:
        verdict, measured = _verdict(x)
        lines.append(f"| {x['trace']} | {x['target']} | {measured} | {x['threshold']:g} | {verdict} |")
    return "\n".join(lines)


# --- entry point ----------------------------------------------------------------------------------
def run(cfg: PolicyBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; write results.json, requests.jsonl and plots to cfg.out_dir; return the results."""
    from transformers import AutoConfig

    from pdserve.engine.models.presets import resolve_model

    for kind, chosen, known in (("configurations", cfg.configs, CONFIGS), ("traces", cfg.traces, TRACES)):
        unknown = [x for x in chosen if x not in known]
        if unknown or not chosen:
            raise ValueError(f"{kind} must be among {', '.join(known)}; got {', '.join(chosen) or 'none'}")
    if cfg.requests < 1 or not cfg.load > 0:
        raise ValueError(f"--requests must be >= 1 and --load > 0; got {cfg.requests}, {cfg.load}")
    # estimated_ttft first when chosen: the first configuration calibrates the rates and objectives.
    cfg = replace(cfg, configs=tuple(c for c in CONFIGS if c in cfg.configs), traces=tuple(dict.fromkeys(cfg.traces)))
    model_dir = resolve_model(cfg.model)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    workloads = {t: load_workload(t, cfg, vocab_size) for t in cfg.traces}
    for t, w in workloads.items():
        d = describe(w)
        log(f"{t}: {d['requests']} requests from {w.path}; prompts mean {d['prompt_len']['mean']:.0f} tokens, "
            f"outputs mean {d['output_len']['mean']:.0f}")
    log(f"{len(cfg.configs)} configurations x {len(cfg.traces)} traces, {cfg.prefill_replicas} prefill + "
        f"{cfg.decode_replicas} decode workers; estimated ~{estimate_s(cfg, cfg.rates) / 60:.0f} min "
        f"(refined once the rates are known)")
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "requests.jsonl").write_text("")

    results = {(t, c): PairResult(t, c) for t in cfg.traces for c in cfg.configs}
    settings: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    t_start = time.monotonic()
    # spawn: a clean interpreter for the load generator (no Ray, no router threads inherited).
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        for config in cfg.configs:
            log(f"\n== {config}: {CONFIGS[config].description}")
            t0 = time.monotonic()
            try:
                bench_config(config, cfg, workloads, results, settings, pool, log)
            except Exception as e:  # noqa: BLE001 (reported in the results; the other configurations go on)
                errors[config] = f"{type(e).__name__}: {e}"
                log(f"  {config} failed: {errors[config]}")
                for t in cfg.traces:
                    if results[t, config].goodput is None:
                        results[t, config].error = errors[config]
            log(f"  ({config}: {time.monotonic() - t0:.0f} s including start and stop; "
                f"{(time.monotonic() - t_start) / 60:.1f} min so far)")

    measured = {t: w for t, w in workloads.items() if w.rate is not None}
    if not measured:
        raise RuntimeError(f"no trace was calibrated: {'; '.join(f'{c}: {e}' for c, e in errors.items())}")
    cuts, table = tables(measured, results, settings)
    out = assemble(cfg, model_dir, measured, results, settings, errors, cuts, table)
    plots = plot(cfg, measured, results, table, cfg.out_dir)
    out["plots"] = [plot_record(p) for p in plots]
    (cfg.out_dir / "results.json").write_text(json.dumps(out, indent=2))
    _summary(cfg, out, log)
    log(f"wrote {cfg.out_dir / 'results.json'}, {cfg.out_dir / 'requests.jsonl'}, " + ", ".join(str(p) for p in plots))
    return out
