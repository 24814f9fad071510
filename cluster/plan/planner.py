"""`pdserve plan`: the deployment to run, chosen by simulating every candidate on the user's workload.

Candidates, within a budget of CPUs (each worker takes its torch threads' worth): colocated with k
workers of t threads, at the manifest's step budget and at a chunked one; disaggregated with P
prefill and D decode workers of the thread counts the profile measured; for a workload with images
(a vision-language model's), each of them also with an encode pool of 1 or 2 workers, beside encoding
where the prompt pass runs. The deployments within a
quarter of the best goodput (of the target rate, with one) are then tuned, one setting at a time: a
colocated one's step budget, a disaggregated one's local-prefill threshold (off, or the trace's
median prompt) and LAPS's chunk for long prompts (a quarter of the step budget, or all of it). Each
candidate's goodput
(DistServe's: the highest rate at which 90% of requests meet both objectives) is searched with the
benchmark's own search (`serve_metrics.GoodputSearch`) over simulated runs, fresh Poisson arrivals of
the trace's lengths at each rate. Without a target rate the best goodput wins (goodputs within the
search's 5% of each other are a tie, won by fewer CPUs, then by the higher bracket: the first rate
missed); with one, the fewest CPUs at which 90% of requests meet the objective at that rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.cluster.bench.loadgen import poisson_arrivals
from pdserve.cluster.bench.serve_metrics import (TARGET_ATTAINMENT, Goodput, GoodputSearch, Objective, RequestRecord,
                                                attainment)
from pdserve.cluster.bench.workload import TraceRequest, run_seed
from pdserve.cluster.plan.costs import HardwareProfile
from pdserve.cluster.plan.sim_speculation import Drafting
from pdserve.cluster.plan.simulator import ClusterSimulator, MissBudget, trace_requests

CHUNKED_BUDGET = 256  # the colocated candidates' chunked step budget (Sarathi-Serve's small chunks)
TUNED_BUDGETS = (512, 1024)  # a colocated deployment's step budgets tried when it is tuned
TUNE_WITHIN = 0.25  # the deployments this close to the best goodput are tuned
MIN_DURATION_S = 30.0  # of arrivals in a simulated run
REL_TOL = 0.05  # the goodput search's resolution: goodputs closer than this are a tie
MAX_ENCODERS = 2  # encode pools tried, for a workload with images: 1 to this many workers


@dataclass(frozen=True)
class Candidate:
    mode: str
    prefill: tuple[int, int]  # (replicas, threads); colocated: (0, 0)
    decode: tuple[int, int]  # (replicas, threads): colocated workers in colocated mode
    step_budget: int
    router: tuple[tuple[str, int], ...] = ()  # router settings changed from the manifest's (name, value)
    encode: tuple[int, int] = (0, 0)  # (replicas, threads) of the encode pool; (0, 0): images encoded in prefill

    @property
    def cpus(self) -> int:
        return sum(replicas * threads for replicas, threads in (self.prefill, self.decode, self.encode))

    @property
    def name(self) -> str:
        def pool(p: tuple[int, int]) -> str:
            return f"{p[0]}x{p[1]}t"

        settings = "".join(f", {key} {value}" for key, value in self.router)
        encoders = f"+{pool(self.encode)}E" if self.encode[0] else ""
        if self.mode == "colocated":
            return f"colocated {pool(self.decode)}{encoders} budget {self.step_budget}{settings}"
        return f"disaggregated {pool(self.prefill)}P+{pool(self.decode)}D{encoders}{settings}"

    def manifest(self, base: Any) -> Any:
        data = base.model_dump(mode="json")
        data.update(mode=self.mode, max_num_batched_tokens=self.step_budget)
        data["router"].update(self.router)
        for pool, (replicas, threads) in (("prefill", self.prefill), ("decode", self.decode), ("encode", self.encode)):
            data["pools"][pool].update(replicas=replicas, threads=max(threads, 1), num_cpus=max(threads, 1))
        return type(base).model_validate(data)


def candidates(base: Any, profile: HardwareProfile, cpus: int,
               threads: Sequence[int] | None = None, images: bool = False) -> list[Candidate]:
    """The deployments within `cpus`, their workers at the thread counts given (None: all profiled);
    `images` (a workload with images): each also with an encode pool of 1 to `MAX_ENCODERS` workers
    of the fewest threads, where the CPUs allow."""
    threads = sorted(threads or profile.workers)
    if missing := [t for t in threads if t not in profile.workers]:
        raise ValueError(f"the profile has no worker with {missing} thread(s): measured {sorted(profile.workers)}")
    budgets = sorted({base.max_num_batched_tokens, min(CHUNKED_BUDGET, base.max_num_batched_tokens)})
    out = []
    for t in threads:
        for k in range(1, cpus // t + 1):
            out += [Candidate("colocated", (0, 0), (k, t), b) for b in budgets]
    for tp in threads:
        for td in threads:
            for p in range(1, cpus // tp + 1):
                for d in range(1, (cpus - p * tp) // td + 1):
                    out.append(Candidate("disaggregated", (p, tp), (d, td), base.max_num_batched_tokens))
    if images:
        te = threads[0]
        out += [replace(c, encode=(e, te)) for c in list(out) for e in range(1, MAX_ENCODERS + 1)
                if c.cpus + e * te <= cpus]
    return out


def tunings(candidate: Candidate, base: Any, shapes: Sequence[TraceRequest]) -> list[Candidate]:
    """`candidate` with one setting changed: a colocated one's step budget; a disaggregated one's
    local-prefill threshold (off, or the trace's median prompt: the shorter half prefills on its decode
    worker) and LAPS's chunk for long prompts (a quarter of the step budget: shorts wait less behind a
    long one; the whole budget: a long prompt takes fewer steps)."""
    if candidate.mode == "colocated":
        return [replace(candidate, step_budget=b) for b in TUNED_BUDGETS
                if CHUNKED_BUDGET < b < base.max_num_batched_tokens]
    r = base.router
    median = sorted(s.prompt_len for s in shapes)[len(shapes) // 2]
    # unset, the threshold is measured with the estimated_ttft prefill policy, else off (0 already)
    local_prefill = r.local_prefill_tokens if r.local_prefill_tokens is not None or \
        r.pool_policies[0] == "estimated_ttft" else 0
    settings = [("local_prefill_tokens", n) for n in (0, median) if n != local_prefill]
    if r.laps:  # (the chunk is LAPS's)
        budget = candidate.step_budget
        settings += [("long_prompt_chunk_tokens", n) for n in (max(1, budget // 4), budget)
                     if n != r.long_prompt_chunk_tokens]
    return [replace(candidate, router=(setting,)) for setting in settings]


class Infeasible(ValueError):
    """No candidate meets the objective at any rate; the message names the bottleneck."""


@dataclass
class Evaluated:
    candidate: Candidate
    goodput: Goodput
    runs: int
    carries: bool | None = None  # with a target rate: whether 90% of requests met the objective at it


@dataclass
class Plan:
    best: Evaluated
    tried: list[Evaluated]
    objective: Objective
    target_rate: float | None


def simulated_runs(manifest: Any, profile: HardwareProfile, shapes: Sequence[TraceRequest], seed: int,
                   name: str = "", min_duration_s: float = MIN_DURATION_S, drafting: Drafting | None = None,
                   budget: MissBudget | None = None) -> Callable[[float], list[RequestRecord]]:
    """`measure(rate)` for `GoodputSearch`: the shapes (over again, for runs of at least `min_duration_s`
    of arrivals: a short run at a high rate ends before its queues build up) at Poisson arrivals of
    `rate`, each run fresh (its own prompts and arrivals) on a fresh simulated cluster. `drafting`:
    the workload's (`ClusterSimulator`), where the manifest decodes speculatively; `budget`: each run
    stops once it cannot meet the search's target (`MissBudget`)."""
    def measure(rate: float) -> list[RequestRecord]:
        n = max(len(shapes), math.ceil(rate * min_duration_s))
        arrivals = poisson_arrivals(n, rate, run_seed(seed, "plan", rate))
        # every run starts a fresh simulated cluster, whose caches hold nothing of the runs before
        simulator = ClusterSimulator(manifest, profile, name, drafting=drafting, seed=run_seed(seed, "drafts", rate))
        return simulator.run(trace_requests(shapes, arrivals), rate, budget).records

    return measure


def evaluate(candidate: Candidate, base: Any, profile: HardwareProfile, shapes: Sequence[TraceRequest],
             objective: Objective, seed: int = 0, max_runs: int = 12, rel_tol: float = REL_TOL,
             min_duration_s: float = MIN_DURATION_S, target_rate: float | None = None,
             drafting: Drafting | None = None) -> Evaluated:
    manifest = candidate.manifest(base)
    # One objective over the search's runs: a run that already cannot meet it stops there.
    budget = MissBudget(objective, TARGET_ATTAINMENT)
    measure = simulated_runs(manifest, profile, shapes, seed, candidate.name, min_duration_s, drafting, budget)
    search = GoodputSearch(measure, start_rate=target_rate or 1.0, min_rate=0.01, max_rate=10_000, rel_tol=rel_tol,
                           max_runs=max_runs, target=budget.target)
    carries = None if target_rate is None else attainment(search.records(target_rate), objective) >= budget.target
    return Evaluated(candidate, search.goodput(objective), len(search.runs), carries)


def bottleneck(base: Any, profile: HardwareProfile, shapes: Sequence[TraceRequest], objective: Objective) -> str:
    """Why nothing meets `objective`: what one request alone costs on the fastest worker measured."""
    costs = min(profile.workers.values(), key=lambda c: c.prefill.prefill_s(512))
    prompts = sorted(s.prompt_len for s in shapes)
    p90 = prompts[min(len(prompts) - 1, math.ceil(0.9 * len(prompts)) - 1)]
    ttft = profile.dispatch_s + costs.prefill.prefill_s(p90) + profile.delivery_s
    tpot = costs.decode.step_s(1, p90) + profile.step_overhead_s
    reasons = []
    if ttft > objective.ttft_s:
        reasons.append(f"prefill: the trace's p90 prompt ({p90} tokens) alone takes {ttft * 1e3:.0f} ms to its first "
                       f"token at {costs.threads} thread(s), over the TTFT objective of "
                       f"{objective.ttft_s * 1e3:.0f} ms")
    if tpot > objective.tpot_s:
        reasons.append(f"decode: one decode step alone takes {tpot * 1e3:.1f} ms at {costs.threads} thread(s), over "
                       f"the TPOT objective of {objective.tpot_s * 1e3:.1f} ms")
    return "; ".join(reasons) or ("queueing: even at the lowest rate tried, fewer than 90% of requests meet both "
                                  "objectives (the trace's longest prompts and outputs miss them)")


def plan(base: Any, profile: HardwareProfile, shapes: Sequence[TraceRequest], objective: Objective, cpus: int,
         target_rate: float | None = None, seed: int = 0, min_duration_s: float = MIN_DURATION_S,
         threads: Sequence[int] | None = None, log: Callable[[str], None] = print,
         drafting: Drafting | None = None) -> Plan:
    """Simulate every candidate within `cpus`; raises Infeasible when none meets `objective` (or, with
    `target_rate`, none carries it). `drafting`: the workload's, where `base` decodes speculatively
    (`ClusterSimulator`)."""
    if len(shapes) < 2:
        raise ValueError(f"a plan needs at least 2 requests of the trace, got {len(shapes)}")
    fewest = min(threads or profile.workers)
    if cpus < fewest:
        raise ValueError(f"{cpus} CPU(s) fit no worker of {fewest} thread(s)")
    tried: list[Evaluated] = []

    def run(batch: list[Candidate]) -> None:
        for candidate in batch:
            result = evaluate(candidate, base, profile, shapes, objective, seed, min_duration_s=min_duration_s,
                              target_rate=target_rate, drafting=drafting)
            tried.append(result)
            carries = "" if result.carries is None else \
                f" ({'carries' if result.carries else 'misses'} {target_rate:g})"
            log(f"  [{len(tried)}] {candidate.name:42s} {candidate.cpus} CPU(s): goodput {result.goodput.rate:.2f} "
                f"req/s{carries}")

    run(candidates(base, profile, cpus, threads, images=any(s.images for s in shapes)))
    bar = target_rate or max(e.goodput.rate for e in tried)
    near = [e.candidate for e in tried if e.goodput.rate > 0 and e.goodput.rate >= bar * (1 - TUNE_WITHIN)]
    variants = list(dict.fromkeys(t for c in near for t in tunings(c, base, shapes)))  # two may tune alike
    if variants:
        log(f"tuning the {len(near)} deployment(s) within {TUNE_WITHIN:.0%} of the "
            f"{'target rate' if target_rate else 'best'}:")
        run(variants)
    if all(e.goodput.rate <= 0 for e in tried):
        raise Infeasible(f"no deployment within {cpus} CPU(s) meets TTFT <= {objective.ttft_s * 1e3:.0f} ms and "
                         f"TPOT <= {objective.tpot_s * 1e3:.1f} ms for 90% of requests at any rate: "
                         f"{bottleneck(base, profile, shapes, objective)}")
    if target_rate is not None and not any(e.carries for e in tried):
        top = max(tried, key=lambda e: e.goodput.rate)
        raise Infeasible(f"no deployment within {cpus} CPU(s) carries {target_rate:g} req/s: the best, "
                         f"{top.candidate.name}, carries {top.goodput.rate:.2f} req/s")
    best = choose(tried, target_rate)
    return Plan(best, tried, objective, target_rate)


def choose(tried: Sequence[Evaluated], target_rate: float | None = None) -> Evaluated:
    """The pick. Without a target rate, the best goodput: goodputs within the search's tolerance of it
    are a tie, won by the fewest CPUs, then the higher goodput, then the bracket reaching higher (the
    first rate missed) and the margin at the goodput. With one, the fewest CPUs among the deployments
    that carry it (at least one does), then the higher goodput."""
    if target_rate is not None:
        return min((e for e in tried if e.carries), key=lambda e: (e.candidate.cpus, -e.goodput.rate))
    top = max(e.goodput.rate for e in tried)
    return min((e for e in tried if e.goodput.rate >= top / (1 + REL_TOL)),
               key=lambda e: (e.candidate.cpus, -e.goodput.rate, -(e.goodput.failed_rate or math.inf),
                              -(e.goodput.attainment or 0.0)))


def write_manifest(result: Plan, base: Any, path: Path, profile: HardwareProfile) -> None:
    import yaml

    best = result.best
    o = result.objective
    header = (f"# Planned by `pdserve plan` for TTFT <= {o.ttft_s * 1e3:.0f} ms, TPOT <= {o.tpot_s * 1e3:.1f} ms"
              f" (90% of requests), on {profile.hardware}:\n"
              f"# {best.candidate.name}, predicted goodput {best.goodput.rate:.2f} req/s"
              f" (simulated; {len(result.tried)} deployments tried).\n")
    data = best.candidate.manifest(base).model_dump(mode="json", exclude_defaults=True)
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))


def plot_frontier(result: Plan, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in (("colocated", "o"), ("disaggregated", "s")):
        points = [(e.candidate.cpus, e.goodput.rate) for e in result.tried if e.candidate.mode == mode]
        if points:
            ax.scatter(*zip(*points), marker=marker, label=mode, alpha=0.7)
    frontier: dict[int, float] = {}
    for e in result.tried:
        frontier[e.candidate.cpus] = max(frontier.get(e.candidate.cpus, 0.0), e.goodput.rate)
    xs = sorted(frontier)
    best_so_far, ys = 0.0, []
    for x in xs:
        best_so_far = max(best_so_far, frontier[x])
        ys.append(best_so_far)
    ax.step(xs, ys, where="post", color="grey", linewidth=1, label="frontier")
    ax.annotate(result.best.candidate.name, (result.best.candidate.cpus, result.best.goodput.rate),
                textcoords="offset points", xytext=(5, 5), fontsize=8)
    o = result.objective
    ax.set_xlabel("CPUs (torch threads over all workers)")
    ax.set_ylabel("predicted goodput (req/s)")
    ax.set_title(f"TTFT <= {o.ttft_s * 1e3:.0f} ms, TPOT <= {o.tpot_s * 1e3:.1f} ms (90% of requests)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
