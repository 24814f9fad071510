"""`pdserve bench replanning`: the online planner against every static split of the same workers, on a
trace whose mix shifts.

The trace has three phases of `phase_s` each, back to back: conversation (the Azure conversation
trace's lengths), long-prompt summarisation (prompts of 600 to 900 tokens, answers of 8 to 24) and code
completion (the Azure code trace's lengths), scaled to the model's context. Each phase's rate is `load`
times the goodput the best static split is predicted to carry on that phase (the simulator, with the
profile the planner uses), so every phase loads the cluster about as much whichever split suits it.
Arrivals are Poisson; every deployment serves the same lengths and arrivals, each with prompts of its
own (fresh: no run is served from an earlier run's prefix cache).

Deployments: every split of `workers` workers into P prefill + D decode (P, D >= 1), static; and the
online planner (`planner.online`, starting from 1 prefill worker), deciding every `interval_s` from
the last `window_s` of requests. Each runs on a fresh local cluster. Goodput here is the requests
that met both objectives per second of the phase (or of the whole trace): what a deployment actually
delivered within the objectives at the offered load.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.cluster.bench.loadgen import GrpcClient, Request, poisson_arrivals, run_load
from pdserve.cluster.bench.report import provenance
from pdserve.cluster.bench.serve_metrics import Objective, RequestRecord, meets
from pdserve.cluster.bench.workload import (TraceRequest, find_trace, load_azure_trace, run_seed, scale_requests)
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import load_manifest
from pdserve.cluster.plan.costs import HardwareProfile
from pdserve.cluster.plan.online import Split
from pdserve.cluster.plan.planner import Candidate, evaluate

PHASES = ("conversation", "summarisation", "code completion")
SHAPES_PER_PHASE = 400  # lengths drawn per phase (arrivals reuse them in turn)


@dataclass
class ReplanBenchConfig:
    profile: Path  # `pdserve profile` of the model on this machine (the planner's and the calibration's)
    model: str = "pystd-llama"
    workers: int = 3
    phase_s: float = 120.0
    load: float = 0.8  # of the best static split's predicted goodput, per phase
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    interval_s: float = 10.0  # the online planner's
    window_s: float = 30.0
    # Simulated runs of each split's goodput search, per phase. The search starts at 1 request/s and
    # doubles until the objectives fail, then bisects: fewer runs settle on a lower rate, sooner.
    calibration_runs: int = 8
    max_model_len: int = 1024
    seed: int = 0
    out: Path = Path("bench-results/replanning.json")


def _base(cfg: ReplanBenchConfig, split: Split, online: bool) -> Any:
    pool = {"num_cpus": 1, "threads": 1}
    return load_manifest({
        "model": cfg.model, "mode": "disaggregated", "max_model_len": cfg.max_model_len, "profile": str(cfg.profile),
        "server": {"address": "127.0.0.1:0", "http_address": None},
        "pools": {"prefill": {**pool, "replicas": split.prefill}, "decode": {**pool, "replicas": split.decode}},
        "planner": {"online": online, "ttft_slo_s": cfg.ttft_slo_s, "tpot_slo_s": cfg.tpot_slo_s,
                    "interval_s": cfg.interval_s, "window_s": cfg.window_s, "min_requests": 10,
                    "confirmations": 2, "cooldown_s": cfg.window_s},
    })


def phase_shapes(cfg: ReplanBenchConfig) -> dict[str, list[TraceRequest]]:
    """Each phase's request lengths, fitted to the model's context."""
    rng = random.Random(cfg.seed)
    fit = dict(max_model_len=cfg.max_model_len, max_output=256)
    conversation = load_azure_trace(find_trace("azure2023_conv.csv"), SHAPES_PER_PHASE)
    code = load_azure_trace(find_trace("azure2023_code.csv"), SHAPES_PER_PHASE)
    summaries = [TraceRequest(0.0, rng.randint(600, 900), rng.randint(8, 24)) for _ in range(SHAPES_PER_PHASE)]
    return {"conversation": scale_requests(conversation, 0.5, 1.0, **fit),
            "summarisation": scale_requests(summaries, 1.0, 1.0, **fit),
            "code completion": scale_requests(code, 0.35, 1.0, **fit)}


def calibrate(cfg: ReplanBenchConfig, shapes: dict[str, list[TraceRequest]], profile: HardwareProfile,
              log: Any) -> dict[str, dict[str, float]]:
    """Each phase's predicted goodput for every static split (req/s), simulated as the planner does."""
    base = _base(cfg, Split(1, cfg.workers - 1), online=False)
    objective = Objective("bench", cfg.ttft_slo_s, cfg.tpot_slo_s)
    predicted = {}
    for phase, phase_requests in shapes.items():
        predicted[phase] = {}
        for split in _splits(cfg.workers):
            candidate = Candidate("disaggregated", (split.prefill, 1), (split.decode, 1), base.max_num_batched_tokens)
            evaluated = evaluate(candidate, base, profile, phase_requests, objective, cfg.seed,
                                 max_runs=cfg.calibration_runs, min_duration_s=20.0)
            predicted[phase][str(split)] = evaluated.goodput.rate
        log(f"  {phase}: predicted goodput {predicted[phase]} req/s")
    return predicted


def _splits(workers: int) -> list[Split]:
    return [Split(p, workers - p) for p in range(1, workers)]


def trace(cfg: ReplanBenchConfig, shapes: dict[str, list[TraceRequest]],
          rates: dict[str, float]) -> list[tuple[str, float, TraceRequest]]:
    """(phase, arrival offset, lengths) of every request, the phases back to back."""
    out = []
    for i, phase in enumerate(PHASES):
        rate, phase_requests = rates[phase], shapes[phase]
        n = max(1, round(rate * cfg.phase_s))
        offsets = [t for t in poisson_arrivals(n * 2, rate, run_seed(cfg.seed, "arrivals", phase)) if t < cfg.phase_s]
        out += [(phase, i * cfg.phase_s + t, phase_requests[k % len(phase_requests)]) for k, t in enumerate(offsets)]
    return out


def serve(cfg: ReplanBenchConfig, name: str, split: Split, online: bool,
          requests: list[tuple[str, float, TraceRequest]], log: Any) -> dict[str, Any]:
    """One deployment through the whole trace on a fresh cluster: its records and role changes."""
    said: list[str] = []
    with Cluster(_base(cfg, split, online), log=said.append) as cluster:
        vocab = cluster.router_stack.frontend.model.info.vocab_size
        rng = random.Random(run_seed(cfg.seed, "prompts", name))  # fresh prompts for each deployment
        sent = [Request(f"{name}-{i}", [rng.randrange(3, vocab) for _ in range(r.prompt_len)], r.output_len)
                for i, (_, _, r) in enumerate(requests)]
        records = run_load(GrpcClient(cluster.address), sent, [t for _, t, _ in requests], config=name,
                           rate=len(requests) / (len(PHASES) * cfg.phase_s))
        changes = [line for line in said if line.startswith("planner: ") and "; split " in line]
        final = f"{sum(w.pool == 'prefill' for w in cluster.workers)}P+{sum(w.pool == 'decode' for w in cluster.workers)}D"
    log(f"  {name}: {sum(r.outcome == 'ok' for r in records)}/{len(records)} completed, {len(changes)} role changes, "
        f"ending {final}")
    kept = [{k: v for k, v in r.to_dict().items() if k != "token_times"} for r in records]  # the file stays small
    return {"name": name, "online": online, "start": str(split), "final": final, "role_changes": changes,
            "records": kept}


def goodputs(cfg: ReplanBenchConfig, requests: list[tuple[str, float, TraceRequest]], run: dict) -> dict[str, float]:
    """Requests meeting both objectives per second, per phase and over the whole trace."""
    objective = Objective("bench", cfg.ttft_slo_s, cfg.tpot_slo_s)
    met = [meets(RequestRecord.from_dict(r), objective) for r in run["records"]]  # (TPOT needs no token times)
    out = {phase: sum(m for (p, _, _), m in zip(requests, met) if p == phase) / cfg.phase_s for phase in PHASES}
    out["whole trace"] = sum(met) / (len(PHASES) * cfg.phase_s)
    return out


def run(cfg: ReplanBenchConfig, log: Any = print) -> dict[str, Any]:
    profile = HardwareProfile.load(cfg.profile)
    shapes = phase_shapes(cfg)
    log("calibrating each phase's rate on the simulator ...")
    predicted = calibrate(cfg, shapes, profile, log)
    rates = {phase: cfg.load * max(predicted[phase].values()) for phase in PHASES}
    if not all(rates.values()):
        missed = ", ".join(p for p, rate in rates.items() if not rate)
        raise ValueError(f"no split met the objectives on {missed} at any rate the calibration tried (simulated "
                         f"runs per split and phase: {cfg.calibration_runs}): loosen the objectives or give it more "
                         "runs (--calibration-runs)")
    requests = trace(cfg, shapes, rates)
    log(f"trace: {len(requests)} requests over {len(PHASES) * cfg.phase_s:.0f} s; rates "
        + ", ".join(f"{p} {r:.2f} req/s" for p, r in rates.items()))
    runs = [serve(cfg, f"static {split}", split, False, requests, log) for split in _splits(cfg.workers)]
    runs.append(serve(cfg, "online planner", Split(1, cfg.workers - 1), True, requests, log))
    for r in runs:
        r["goodput"] = goodputs(cfg, requests, r)
    result = {"benchmark": "replanning", "provenance": provenance(),
              "config": {k: str(v) for k, v in asdict(cfg).items()},
              "phases": {p: {"rate": rates[p], "requests": sum(q[0] == p for q in requests),
                             "median_prompt": statistics.median(s.prompt_len for s in shapes[p]),
                             "median_output": statistics.median(s.output_len for s in shapes[p]),
                             "predicted": predicted[p]} for p in PHASES},
              "runs": runs}
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(result))
    log(markdown(result))
    log(f"wrote {cfg.out}")
    return result


def markdown(result: dict) -> str:
    cfg, phases, runs = result["config"], result["phases"], result["runs"]
    columns = [*PHASES, "whole trace"]
    lines = [
        f"{cfg['model']}, {cfg['workers']} workers of one torch thread on a local cluster; objectives TTFT <= "
        f"{float(cfg['ttft_slo_s']) * 1e3:.0f} ms and TPOT <= {float(cfg['tpot_slo_s']) * 1e3:.0f} ms. Three phases of "
        f"{float(cfg['phase_s']):.0f} s back to back, Poisson arrivals at {float(cfg['load']):.0%} of the goodput the "
        "best static split is predicted to carry on each (the simulator, with the profile the planner uses); every "
        "deployment serves the same lengths and arrivals with prompts of its own. Goodput: requests that met both "
        f"objectives per second. The online planner starts at 1 prefill worker and decides every "
        f"{float(cfg['interval_s']):.0f} s from the last {float(cfg['window_s']):.0f} s of requests.",
        "",
        "| phase | median prompt / output | rate (req/s) |",
        "|---|---|---|",
        *[f"| {p} | {v['median_prompt']:.0f} / {v['median_output']:.0f} | {v['rate']:.2f} |" for p, v in phases.items()],
        "",
        "| deployment | " + " | ".join(f"{c} goodput (req/s)" for c in columns) + " | role changes |",
        "|---" * (len(columns) + 2) + "|",
    ]
    for r in runs:
        cells = " | ".join(f"{r['goodput'][c]:.2f}" for c in columns)
        lines.append(f"| {r['name']} | {cells} | {len(r['role_changes'])} (ends {r['final']}) |")
    static = [r for r in runs if not r["online"]]
    online = next(r for r in runs if r["online"])
    best = {c: max(r["goodput"][c] for r in static) for c in columns}
    ratio = {c: online["goodput"][c] / best[c] if best[c] else float("nan") for c in columns}
    lines += ["", "Online planner against the best static split: " + ", ".join(
        f"{c} {ratio[c]:.2f}×" for c in columns) + " (target: at least 1.3× over the whole trace, and within 10% "
        "of the best static split in each phase)."]
    # The phases are equally long: the whole trace's goodput is their mean.
    ceiling = statistics.mean(best[p] for p in PHASES)
    lines += [f"The best static split of each phase in turn (switched at once and for free) would carry "
              f"{ceiling:.2f} req/s over the whole trace, {ceiling / best['whole trace']:.2f}× the best static "
              "split: the most a planner choosing among these splits could reach here."]
    lines += [f"- {change}" for change in online["role_changes"]]
    lines += ["", "Median TTFT (s) of the requests sent in each 30 s of the trace, completed ones:", "",
              "| deployment | " + " | ".join(f"{t}–{t + 30} s" for t in range(0, _span(runs), 30)) + " |",
              "|---" * (1 + len(range(0, _span(runs), 30))) + "|"]
    for r in runs:
        lines.append(f"| {r['name']} | " + " | ".join(_ttft_by_30s(r, _span(runs))) + " |")
    return "\n".join(lines)


def _span(runs: list[dict]) -> int:
    return int(max(rec["send_time"] for r in runs for rec in r["records"])) + 1


def _ttft_by_30s(run: dict, span: int) -> list[str]:
    cells = []
    for start in range(0, span, 30):
        ttfts = [rec["first_token_time"] - rec["send_time"] for rec in run["records"]
                 if start <= rec["send_time"] < start + 30 and rec["outcome"] == "ok" and rec["first_token_time"]]
        cells.append(f"{statistics.median(ttfts):.2f}" if ttfts else "–")
    return cells
