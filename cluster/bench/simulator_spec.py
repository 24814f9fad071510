"""`pdserve bench simulator-spec`: the cluster simulator's speculative decoding against the engine's.

For each workload of `pdserve bench spec` (code completion, random conversation prompts, sampled) and
batch size, the engine decodes a batch of fresh prompts (three times, medians), all at once, without
speculation and with each proposer (`spec.run_batch`, every engine fresh and profiled as a worker
starts). The simulator (`cluster.plan.simulator`: one colocated worker with the same limits, on this
machine's profile measured with speculation, `pdserve profile --manifest deploy/speculative.yaml`) then
runs the same prompt and output lengths at once, given each system's drafting (how often a step
verified a draft, how long, from which proposer, and the acceptance) twice: as measured at the first
batch size (one figure per workload, as `pdserve plan` takes it), and as measured at that batch.
Measured and predicted TPOT (median over requests) side by side, and the speedup over no speculation
measured and predicted: the simulator's error on the speedup is what its model of speculation adds to
its error without it. The run is in-process, so the profile's serving costs (dispatch, delivery, a
serving step's overhead, the router's CPU) are left out of the prediction.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.cluster.bench.report import provenance
from pdserve.cluster.bench.spec import (BENCH_KV_MEMORY_MB, RunFigures, bench_engine, run_batch, systems,
                                        workload_params, workload_pools, SpecBenchConfig)
from pdserve.cluster.plan.costs import HardwareProfile, default_profile_path, machine
from pdserve.cluster.plan.sim_speculation import Drafting
from pdserve.cluster.plan.simulator import ClusterSimulator, SimRequest

WITHIN = 0.10  # the simulator's target (as `pdserve bench simulator`'s)


@dataclass
class SimSpecBenchConfig:
    model: str = "pystd-llama"
    draft_model: str | None = "pystd-llama-draft"
    profile: Path | None = None  # None: the model's stored profile on this machine
    workloads: tuple[str, ...] = ("code", "conversation", "sampled")
    batches: tuple[int, ...] = (1, 8, 32)  # the first is where each workload's drafting is measured
    repeats: int = 3  # runs of each batch, each on fresh prompts: medians
    prompt_len: int = 384
    output_len: int = 128
    threads: int = 1
    out: Path = Path("bench-results/simulator-spec.json")


@dataclass
class Compared:
    """Medians over the repeats. Speculative systems are predicted twice: given the drafting measured at
    the first batch size (as `pdserve plan` is given one workload's), and given this batch's own."""

    measured_tpot_ms: float
    predicted_tpot_ms: float  # from the first batch size's drafting
    tokens_per_step: float  # measured (mean)
    drafting: Drafting | None = None  # the first batch size's runs' (None: nothing verified there)
    own_drafting: Drafting | None = None  # this batch's runs'
    predicted_own_tpot_ms: float | None = None  # from `own_drafting`


@dataclass
class SimSpecBenchResult:
    provenance: dict
    model: str
    profile: str
    # workload -> batch -> system -> figures
    runs: dict[str, dict[int, dict[str, Compared]]] = field(default_factory=dict)


def simulation_manifest(cfg: SimSpecBenchConfig, speculative: Any) -> Any:
    """One colocated worker with the benchmark engine's limits."""
    from pdserve.cluster.manifest import load_manifest
    from pdserve.engine.config import EngineConfig

    spec = None if speculative is None else {"method": speculative.method, "draft_model": speculative.draft_model,
                                             "max_draft_tokens": speculative.max_draft_tokens}
    return load_manifest({
        "model": cfg.model, "mode": "colocated", "max_model_len": cfg.prompt_len + cfg.output_len,
        "kv_memory_mb": BENCH_KV_MEMORY_MB, "max_num_seqs": max(64, *cfg.batches),
        "max_num_batched_tokens": EngineConfig.max_num_batched_tokens, "speculative": spec,
        "pools": {"prefill": {"replicas": 0}, "decode": {"replicas": 1, "threads": cfg.threads}}})


def load_profile(cfg: SimSpecBenchConfig) -> tuple[HardwareProfile, Path]:
    from pdserve.engine.model_store import model_digest
    from pdserve.engine.models.presets import resolve_model

    path = cfg.profile or default_profile_path(cfg.model, model_digest(resolve_model(cfg.model)), machine())
    if not Path(path).is_file():
        raise FileNotFoundError(f"no profile of {cfg.model} at {path}: measure it with speculation first, "
                                f"`pdserve profile --manifest deploy/speculative.yaml` (a few minutes)")
    profile = HardwareProfile.load(path)
    measured = profile.costs(cfg.threads).speculation
    if measured is None:
        raise ValueError(f"the profile {path} was measured without speculation: `pdserve profile --manifest "
                         f"deploy/speculative.yaml`")
    if cfg.draft_model is not None and measured.draft_model != cfg.draft_model:
        raise ValueError(f"the profile {path} was measured with the draft model {measured.draft_model}, not "
                         f"{cfg.draft_model}: measure it with a manifest that names {cfg.draft_model}")
    # in-process runs: nothing of serving around the engine
    return replace(profile, dispatch_s=0.0, prefill_setup_s=0.0, delivery_s=0.0, step_overhead_s=0.0,
                   step_overhead_per_seq_s=0.0, router_cpu_s_per_token=0.0), Path(path)


def predicted_tpot(cfg: SimSpecBenchConfig, profile: HardwareProfile, speculative: Any, prompts: list[list[int]],
                   drafting: Drafting | None) -> float:
    if speculative is not None and drafting is None:  # nothing verified: a plain decode
        drafting = Drafting(0.0, share=0.0)
    simulator = ClusterSimulator(simulation_manifest(cfg, speculative), profile, drafting=drafting)
    records = simulator.run([SimRequest(0.0, p, cfg.output_len) for p in prompts]).records
    return statistics.median(r.tpot for r in records)


def run(cfg: SimSpecBenchConfig, log: Callable[[str], None] = print) -> SimSpecBenchResult:
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, resolve_model

    if cfg.output_len < 2 or cfg.repeats < 1 or not cfg.batches:
        raise ValueError("output_len must be at least 2 (TPOT is measured between tokens), repeats at least 1, "
                         "and one batch size given")
    torch.set_num_threads(cfg.threads)
    profile, path = load_profile(cfg)
    model_dir = resolve_model(cfg.model)
    probe = LLMEngine(model_dir, EngineConfig(max_num_seqs=1))
    compared = systems(SpecBenchConfig(model=cfg.model, draft_model=cfg.draft_model))
    pools = workload_pools(probe.tokenize, probe.vocab_size, cfg.repeats * sum(cfg.batches), cfg.prompt_len,
                           cfg.output_len)
    result = SimSpecBenchResult(provenance(), cfg.model, str(path))
    for workload in cfg.workloads:
        measured: dict[tuple[int, str], list[tuple[RunFigures, list[list[int]]]]] = {}
        for repeat in range(cfg.repeats):
            for batch in cfg.batches:
                prompts = pools[workload].take(batch)  # fresh for every run; the systems share them
                params = [workload_params(workload, cfg.output_len, seed=i) for i in range(batch)]
                for system, speculative in compared.items():
                    engine = bench_engine(model_dir, speculative, cfg.batches, cfg.prompt_len + cfg.output_len)
                    figures, _ = run_batch(engine, prompts, params)
                    measured.setdefault((batch, system), []).append((figures, prompts))
                    log(f"  {workload:>12} batch {batch:>3} repeat {repeat + 1}/{cfg.repeats} {system:>7}: TPOT "
                        f"{figures.tpot_ms:6.2f} ms")
        first = cfg.batches[0]  # where each system's drafting is measured
        drafting = {system: RunFigures.drafting([f for f, _ in measured[first, system]])
                    for system, speculative in compared.items() if speculative is not None}
        for (batch, system), runs in measured.items():
            speculative, given = compared[system], drafting.get(system)
            own = RunFigures.drafting([f for f, _ in runs]) if speculative is not None else None

            def predicted(drafting: Drafting | None) -> float:
                return statistics.median(predicted_tpot(cfg, profile, speculative, prompts, drafting) * 1e3
                                         for _, prompts in runs)

            row = Compared(statistics.median(f.tpot_ms for f, _ in runs), predicted(given),
                           statistics.fmean(batch * (cfg.output_len - 1) / f.decode_steps for f, _ in runs), given,
                           own, predicted(own) if speculative is not None else None)
            result.runs.setdefault(workload, {}).setdefault(batch, {})[system] = row
            log(f"  {workload:>12} batch {batch:>3} {system:>7}: TPOT measured {row.measured_tpot_ms:6.2f} ms, "
                f"predicted {row.predicted_tpot_ms:6.2f} ms ({row.predicted_tpot_ms / row.measured_tpot_ms - 1:+.0%})"
                + ("" if given is None else f"; drafting {given.acceptance:.2f} / {given.share:.0%} / "
                                            f"{given.length:.1f} / {given.model_share:.0%}"))
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps({"benchmark": "simulator-spec", **asdict(result)}, indent=2))
    log(markdown(json.loads(cfg.out.read_text())))
    log(f"results written to {cfg.out}")
    return result


def _drafting(d: dict | None) -> str:
    return "none verified" if d is None else \
        f"{d['acceptance']:.2f} / {d['share']:.0%} / {d['length']:.1f} / {d['model_share']:.0%}"


def _within(errors: list[float]) -> str:
    return (f"{sum(e <= WITHIN for e in errors)} of {len(errors)} within {WITHIN:.0%} (median error "
            f"{statistics.median(errors):.0%}, largest {max(errors):.0%})")


def markdown(results: dict) -> str:
    runs = results["runs"]
    spec = [s for s in next(iter(next(iter(runs.values())).values())) if s != "off"]
    tpot = ["| workload | batch | off | " + " | ".join(spec) + " |", "|---" * (3 + len(spec)) + "|"]
    speedup = ["| workload | batch | " + " | ".join(spec) + " |", "|---" * (2 + len(spec)) + "|"]
    drafting = ["| workload | batch | " + " | ".join(spec) + " |", "|---" * (2 + len(spec)) + "|"]
    errors: dict[str, list[float]] = {"tpot": [], "tpot_own": [], "speedup": [], "speedup_own": []}
    for workload, batches in runs.items():
        for batch, row in batches.items():
            off = row["off"]
            errors["tpot"].append(abs(off["predicted_tpot_ms"] / off["measured_tpot_ms"] - 1))
            tpot_cells = [f"{off['measured_tpot_ms']:.2f} / {off['predicted_tpot_ms']:.2f}"]
            speedup_cells, drafting_cells = [], []
            for s in spec:
                c = row[s]
                measured = off["measured_tpot_ms"] / c["measured_tpot_ms"]
                first = off["predicted_tpot_ms"] / c["predicted_tpot_ms"]
                own = off["predicted_tpot_ms"] / c["predicted_own_tpot_ms"]
                errors["tpot"].append(abs(c["predicted_tpot_ms"] / c["measured_tpot_ms"] - 1))
                errors["tpot_own"].append(abs(c["predicted_own_tpot_ms"] / c["measured_tpot_ms"] - 1))
                errors["speedup"].append(abs(first / measured - 1))
                errors["speedup_own"].append(abs(own / measured - 1))
                tpot_cells.append(f"{c['measured_tpot_ms']:.2f} / {c['predicted_tpot_ms']:.2f} / "
                                  f"{c['predicted_own_tpot_ms']:.2f}")
                speedup_cells.append(f"{measured:.2f}× / {first:.2f}× / {own:.2f}×")
                drafting_cells.append(_drafting(c["own_drafting"]))
            tpot.append(f"| {workload} | {batch} | " + " | ".join(tpot_cells) + " |")
            speedup.append(f"| {workload} | {batch} | " + " | ".join(speedup_cells) + " |")
            drafting.append(f"| {workload} | {batch} | " + " | ".join(drafting_cells) + " |")
    first_batch = next(iter(next(iter(runs.values()))))
    return "\n".join([
        "Each batch's requests start at once on one engine (in-process), every system on the same fresh prompts, "
        "medians of the repeats; the simulator runs one colocated worker with the same limits on this machine's "
        f"profile (`{Path(results['profile']).name}`, measured with speculation). Each speculative system is "
        f"predicted twice: given its workload's drafting measured at batch {first_batch} (what `pdserve plan "
        "--acceptance --draft-share --draft-length --draft-model-share` takes), and given the batch's own. "
        "Serving costs are left out of the prediction (nothing serves around the engine here).", "",
        "TPOT (ms): off measured / predicted; each speculative system measured / predicted from the "
        f"batch-{first_batch} drafting / predicted from the batch's own.", "", *tpot, "",
        "Speedup (TPOT without speculation over TPOT with it, each measured or each predicted: its error is what "
        "the simulator's model of speculation adds to its error without it): measured / predicted from the "
        f"batch-{first_batch} drafting / predicted from the batch's own.", "", *speedup, "",
        "Drafting measured (acceptance / share of a request's decode steps that verified a draft / draft tokens "
        "such a step verified / the share of those drafts the draft model proposed):", "", *drafting, "",
        f"Predicted TPOT: from the batch-{first_batch} drafting {_within(errors['tpot'])} (off included); from "
        f"the batch's own {_within(errors['tpot_own'])}. Predicted speedup: from the batch-{first_batch} drafting "
        f"{_within(errors['speedup'])}; from the batch's own {_within(errors['speedup_own'])}."])
