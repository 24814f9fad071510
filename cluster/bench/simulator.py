"""`pdserve bench simulator`: the cluster simulator against real runs of the same manifests.

For each trace and deployment (the serve benchmark's configurations: `serve.manifest_for`), a real
cluster on this machine is measured, and the simulator (`cluster.plan.simulator`, with this machine's
profile from `pdserve profile`) is given exactly what that run was given: the same prompts (their
blocks decide prefix sharing) and output lengths, sent at the run's own send times. First a burst of
every request at once measures the deployment's capacity (completed requests over the burst's span,
real and simulated); then Poisson runs at fractions of the measured capacity (30%, 60%, 90% by
default). Every run draws fresh prompts. TTFT and TPOT p50 and p90 are compared side by side, with the
simulator's error relative to the measurement, and where the time to the first token goes (phases
between lifetime events, which the gRPC API sends with a request's last message and the simulator
records alike). Last, the simulator's own speed on one core: the default trace's lengths over
disaggregated deployments of growing size (a quarter of the workers prefill), each worker on cores
of its own, at a request rate that keeps every worker busy.
"""

from __future__ import annotations

import concurrent.futures
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.cluster.bench.loadgen import Request, poisson_arrivals, run_load, write_jsonl
from pdserve.cluster.bench.report import provenance
from pdserve.cluster.bench.serve import ServeBenchConfig, manifest_for, serving, software, warm_up
from pdserve.cluster.bench.serve_metrics import RequestRecord, summarize
from pdserve.cluster.bench.workload import (DEFAULT_TRACE, TraceRequest, block_prompts, find_trace, load_azure_trace,
                                            load_mooncake_trace, random_token_prompts, run_seed, scale_requests)
from pdserve.wire import LifetimeEvent

DEFAULT_TRACES = ("azure2023_conv.csv", "azure2023_code.csv", "mooncake_synthetic_trace.jsonl")
DEFAULT_CONFIGS = ("colocated", "disaggregated", "disaggregated-1p2d")
PDSERVE_CONFIGS = ("colocated", "colocated-chunked", "disaggregated", "disaggregated-1p2d")  # `serve.manifest_for`
FIGURES = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"))
# Where a request's time goes, from its lifetime events: (name, from, to).
PHASES = (("to its pass", LifetimeEvent.ACCEPTED, LifetimeEvent.PREFILL_START),
          ("pass", LifetimeEvent.PREFILL_START, LifetimeEvent.PREFILL_END),
          ("handoff", LifetimeEvent.PREFILL_END, LifetimeEvent.DECODE_START),
          ("reserved", LifetimeEvent.PREFILL_START, LifetimeEvent.KV_RESERVED))
WITHIN = 0.10  # the target: each figure within 10% of the measured one
# (requests, workers) of the speed runs; a rate of RATE_PER_WORKER req/s per worker
SPEED_RUNS = ((20_000, 8), (20_000, 100), (5_000, 1000))
SPEED_QUICK = ((500, 4), (500, 40))
RATE_PER_WORKER = 1.0


@dataclass
class SimulatorBenchConfig:
    model: str = "llama-20m"
    profile: Path | None = None  # None: the model's profile on this machine (`pdserve profile`)
    traces: tuple[str, ...] = DEFAULT_TRACES
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    loads: tuple[float, ...] = (0.3, 0.6, 0.9)  # of the measured capacity
    requests: int = 64  # per run
    input_scale: float = 0.25
    output_scale: float = 0.25
    max_model_len: int = 1024
    seed: int = 0
    out_dir: Path = Path("bench-results/simulator")
    progress: bool = True
    smoke: bool = False

    def quick(self) -> "SimulatorBenchConfig":
        return replace(self, traces=(DEFAULT_TRACE,), configs=("colocated", "disaggregated"), loads=(0.5,),
                       requests=8, smoke=True)


@dataclass
class TraceWorkload:
    """A trace's request shapes; each run draws prompts of its own (`prompts(tag)`), keeping the
    trace's prefix sharing (Mooncake's hash ids) within the run."""

    name: str
    shapes: list[TraceRequest]
    vocab_size: int
    seed: int

    def prompts(self, tag: str) -> list[list[int]]:
        seed = run_seed(self.seed, "simulator", self.name, tag)
        if any(s.hash_ids for s in self.shapes):
            return block_prompts(self.shapes, self.vocab_size, seed)
        return random_token_prompts(self.shapes, self.vocab_size, seed)

    def requests(self, tag: str) -> list[Request]:
        return [Request(f"{tag}-{i}", ids, s.output_len)
                for i, (ids, s) in enumerate(zip(self.prompts(tag), self.shapes))]


def load_workload(trace: str, cfg: SimulatorBenchConfig, vocab_size: int) -> TraceWorkload:
    path = find_trace(trace)
    jsonl = path.name.endswith((".jsonl", ".jsonl.gz"))
    raw = load_mooncake_trace(path, cfg.requests) if jsonl else load_azure_trace(path, cfg.requests)
    shapes = scale_requests(raw, cfg.input_scale, cfg.output_scale, cfg.max_model_len)
    return TraceWorkload(path.name, shapes, vocab_size, cfg.seed)


def figures(records: Sequence[RequestRecord]) -> dict[str, Any]:
    s = summarize(records)
    return {"ok": s["ok"], "sent": s["sent"], "requests_per_s": s["requests_per_s"],
            **{f"{metric}_{p}": s[metric][p] for metric, p in FIGURES}}


def capacity(records: Sequence[RequestRecord]) -> float:
    """Completed requests per second over a burst's span."""
    return summarize(records)["requests_per_s"]


def _error(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else sim / real - 1


def phase_medians(records: Sequence[RequestRecord]) -> dict[str, float | None]:
    """Each phase's median over the requests whose events hold both its ends."""
    out = {}
    for name, start, end in PHASES:
        spans = [r.events[end] - r.events[start] for r in records if start in r.events and end in r.events]
        out[name] = statistics.median(spans) if spans else None
    return out


def compare(real: Sequence[RequestRecord], sim: Sequence[RequestRecord]) -> dict[str, Any]:
    r, s = figures(real), figures(sim)
    return {"real": r, "sim": s, "error": {f"{m}_{p}": _error(s[f"{m}_{p}"], r[f"{m}_{p}"]) for m, p in FIGURES},
            "phases": {"real": phase_medians(real), "sim": phase_medians(sim)}}


def bench_deployment(name: str, workload: TraceWorkload, cfg: SimulatorBenchConfig, profile: Any, model_dir: Path,
                     pool: concurrent.futures.Executor, log: Callable[[str], None]) -> dict[str, Any]:
    from pdserve.cluster.manifest import load_manifest
    from pdserve.cluster.plan.simulator import ClusterSimulator, SimRequest

    serve_cfg = ServeBenchConfig(model=cfg.model, max_model_len=cfg.max_model_len, out_dir=cfg.out_dir)
    manifest = load_manifest(manifest_for(name, serve_cfg))
    jsonl = cfg.out_dir / "requests.jsonl"

    def simulate(requests: list[Request], real: list[RequestRecord], rate: float) -> list[RequestRecord]:
        runs = [SimRequest(rec.send_time, req.token_ids, req.max_tokens) for req, rec in zip(requests, real)]
        return ClusterSimulator(manifest, profile, name=name).run(runs, rate).records

    def measure(target: Any, tag: str, arrivals: list[float], rate: float) -> tuple[list[Request], list[RequestRecord]]:
        requests = [replace(r, request_id=f"{workload.name}-{name}-{r.request_id}") for r in workload.requests(tag)]
        real = pool.submit(run_load, target.client, requests, arrivals, config=name, rate=rate,
                           progress=cfg.progress).result()
        write_jsonl(real, jsonl)
        return requests, real

    out: dict[str, Any] = {"trace": workload.name, "config": name, "runs": []}
    ClusterSimulator(manifest, profile, name=name)  # a manifest the profile cannot simulate fails here, first
    with serving(name, serve_cfg, model_dir, log) as target:
        warm_up(pool, target, workload.requests(f"warmup-{name}"), name)
        requests, real = measure(target, "burst", [0.0] * len(workload.shapes), 0.0)
        sim = simulate(requests, real, 0.0)
        out["capacity"] = {"real": capacity(real), "sim": capacity(sim)}
        log(f"  {workload.name} {name}: capacity {out['capacity']['real']:.2f} req/s measured, "
            f"{out['capacity']['sim']:.2f} simulated")
        if not out["capacity"]["real"]:
            raise RuntimeError(f"no request of the burst completed: {next(r.error for r in real if r.outcome != 'ok')}")
        for load in cfg.loads:
            rate = load * out["capacity"]["real"]
            arrivals = poisson_arrivals(len(workload.shapes), rate, run_seed(cfg.seed, workload.name, name, load))
            requests, real = measure(target, f"load-{load:g}", arrivals, rate)
            row = {"load": load, "rate": rate, **compare(real, simulate(requests, real, rate))}
            out["runs"].append(row)
            log(f"  {workload.name} {name} @ {load:.0%} ({rate:.2f} req/s): " + ", ".join(
                f"{m[:-2].upper()} {p} {_ms(row['real'][f'{m}_{p}'])} real / {_ms(row['sim'][f'{m}_{p}'])} sim"
                for m, p in FIGURES))
    return out


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def run(cfg: SimulatorBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    from transformers import AutoConfig

    from pdserve.cluster.manifest import load_manifest
    from pdserve.cluster.plan.costs import HardwareProfile, check_profile, default_profile_path, machine
    from pdserve.engine.model_store import model_digest
    from pdserve.engine.models.presets import resolve_model

    if unknown := [c for c in cfg.configs if c not in PDSERVE_CONFIGS]:
        raise ValueError(f"not a pdserve deployment the simulator can run: {', '.join(unknown)} (one of "
                         f"{', '.join(PDSERVE_CONFIGS)})")
    model_dir = resolve_model(cfg.model)
    digest = model_digest(model_dir)
    profile_path = cfg.profile or default_profile_path(cfg.model, digest, machine())
    if not Path(profile_path).is_file():
        raise FileNotFoundError(f"no profile of {cfg.model} on this machine at {profile_path}: measure it first with "
                                f"`pdserve profile --model {cfg.model}`")
    profile = HardwareProfile.load(profile_path)
    check_profile(profile, load_manifest(manifest_for(cfg.configs[0], ServeBenchConfig(model=cfg.model))),
                  Path(profile_path), digest)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "requests.jsonl").unlink(missing_ok=True)
    results: dict[str, Any] = {
        "benchmark": "simulator", "provenance": provenance(cfg.smoke), "software": software(),
        "model": cfg.model, "config": {k: str(v) for k, v in asdict(cfg).items()},
        "profile": {"path": str(profile_path), "hardware": profile.hardware, "created": profile.created,
                    "checks": profile.checks},
        "deployments": [],
    }
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for trace in cfg.traces:
            workload = load_workload(trace, cfg, vocab)
            for name in cfg.configs:
                try:
                    deployment = bench_deployment(name, workload, cfg, profile, model_dir, pool, log)
                except Exception as e:  # noqa: BLE001 (the other deployments still run; the table says which failed)
                    log(f"  {workload.name} {name} failed: {type(e).__name__}: {e}")
                    deployment = {"trace": workload.name, "config": name, "error": f"{type(e).__name__}: {e}"}
                results["deployments"].append(deployment)
                (cfg.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    results["speed"] = [simulator_speed(profile, cfg, n, w, log) for n, w in (SPEED_QUICK if cfg.smoke else SPEED_RUNS)]
    (cfg.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    log(f"wrote {cfg.out_dir / 'results.json'}")
    return results


def simulator_speed(profile: Any, cfg: SimulatorBenchConfig, requests: int, workers: int,
                    log: Callable[[str], None]) -> dict[str, Any]:
    """Simulate `requests` of the default trace's lengths over `workers` (a quarter prefill) on workers
    of their own machines (no core sharing): the simulator's wall time, one core."""
    from pdserve.cluster.manifest import load_manifest
    from pdserve.cluster.plan.simulator import ClusterSimulator, trace_requests

    prefill = max(1, workers // 4)
    data = manifest_for("disaggregated", ServeBenchConfig(model=cfg.model, max_model_len=cfg.max_model_len))
    data["ray"] = {"address": "auto"}  # each worker on cores of its own
    data["kv_transfer"]["transport"] = next(iter(profile.transfers))  # one the profile measured
    manifest = load_manifest(data)
    # Past a manifest's 64 replicas per pool: sizes a real cluster would spread over several manifests.
    pools = manifest.pools.model_copy(update={
        "prefill": manifest.pools.prefill.model_copy(update={"replicas": prefill}),
        "decode": manifest.pools.decode.model_copy(update={"replicas": workers - prefill})})
    manifest = manifest.model_copy(update={"pools": pools})
    shapes = scale_requests(load_azure_trace(find_trace(DEFAULT_TRACE), 1000), cfg.input_scale, cfg.output_scale,
                            cfg.max_model_len)
    rate = RATE_PER_WORKER * workers
    arrivals = poisson_arrivals(requests, rate, run_seed(cfg.seed, "speed", workers))
    result = ClusterSimulator(manifest, profile).run(trace_requests(shapes, arrivals), rate)
    ok = sum(r.outcome == "ok" for r in result.records)
    out = {"requests": requests, "workers": len(result.workers), "rate": rate, "ok": ok, "events": result.events,
           "wall_s": result.wall_s, "us_per_request": result.wall_s / requests * 1e6}
    log(f"  simulator speed: {requests:,} requests over {workers} workers in {result.wall_s:.1f} s "
        f"({out['us_per_request']:.0f} us per request, {ok:,} completed)")
    return out


# --- report ---------------------------------------------------------------------------------------
def _cell(row: dict[str, Any], key: str) -> str:
    real, sim, err = row["real"][key], row["sim"][key], row["error"][key]
    if real is None or sim is None or err is None:
        return "n/a" if real is None or sim is None else f"{real * 1e3:.0f} / {sim * 1e3:.0f}"
    mark = "" if abs(err) <= WITHIN else " ✗"
    return f"{real * 1e3:.0f} / {sim * 1e3:.0f} ({err:+.0%}){mark}"


def markdown(results: dict[str, Any]) -> str:
    failed = [d for d in results["deployments"] if "error" in d]
    deployments = [d for d in results["deployments"] if "error" not in d]
    errors = [e for d in deployments for row in d["runs"] for e in row["error"].values() if e is not None]
    within = sum(abs(e) <= WITHIN for e in errors)
    lines = [
        f"The simulator (`pdserve plan`'s) against real runs of the same manifests on this machine, "
        f"{results['model']}, "
        f"profile made {results['profile']['created']}: each run's prompts, output lengths and send times given to "
        f"both; loads are fractions of the capacity a burst of every request at once measured. Cells: measured / "
        f"simulated, in ms, and the simulator's error (✗: off by more than {WITHIN:.0%}).",
        "",
        f"**{within} of {len(errors)} figures within {WITHIN:.0%}**"
        + (f"; the largest error {max(errors, key=abs):+.0%}." if errors else "."),
        "",
        "| trace | deployment | capacity measured / simulated (req/s) | load | TTFT p50 | TTFT p90 | TPOT p50 "
        "| TPOT p90 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in deployments:
        head = [d["trace"], d["config"], f"{d['capacity']['real']:.2f} / {d['capacity']['sim']:.2f}"]
        for i, row in enumerate(d["runs"]):
            cells = (head if i == 0 else ["", "", ""]) + [f"{row['load']:.0%} ({row['rate']:.2f} req/s)"]
            lines.append("| " + " | ".join(cells + [_cell(row, f"{m}_{p}") for m, p in FIGURES]) + " |")
    lines += [f"| {d['trace']} | {d['config']} | failed: {' '.join(str(d['error']).split())[:200]} | | | | | |"
              for d in failed]
    phased = [(d, row) for d in deployments for row in d["runs"] if "phases" in row]
    if phased:
        lines += ["", "Where the time to the first token goes (medians from each request's lifetime events, "
                      "measured / simulated, ms): placed to its prompt pass's start (queues included), the pass "
                      "(its transfer's set-up included), the KV handoff after it, and the decode worker's answer to "
                      "the KV reservation, from the pass's start (reserved: asked for beside the pass, or as it ends "
                      "for a prompt whose KV goes after it).", "",
                  "| trace | deployment | load | " + " | ".join(name for name, _, _ in PHASES) + " |",
                  "|---|---|---|" + "---|" * len(PHASES)]
        for d, row in phased:
            cells = [_phase(row["phases"], name) for name, _, _ in PHASES]
            lines.append(f"| {d['trace']} | {d['config']} | {row['load']:.0%} | " + " | ".join(cells) + " |")
    if results.get("speed"):
        lines += ["", "The simulator's own speed, one core: the default trace's lengths over disaggregated "
                      f"deployments (a quarter of the workers prefill), {RATE_PER_WORKER:g} req/s per worker.", "",
                  "| requests | workers | completed | simulator wall time | per request | 1M requests at that pace |",
                  "|---|---|---|---|---|---|"]
        for run in results["speed"]:
            lines.append(f"| {run['requests']:,} | {run['workers']} | {run['ok']:,} | {run['wall_s']:.1f} s | "
                         f"{run['us_per_request']:.0f} µs | {run['us_per_request']:.0f} s |")
    return "\n".join(lines) + "\n"


def _phase(phases: dict[str, dict[str, float | None]], name: str) -> str:
    real, sim = phases["real"][name], phases["sim"][name]
    if real is None and sim is None:
        return "–"
    return f"{'n/a' if real is None else f'{real * 1e3:.0f}'} / {'n/a' if sim is None else f'{sim * 1e3:.0f}'}"
