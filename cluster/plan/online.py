"""The online planner's decisions: from the requests of the last minutes, the split of a fixed number of
workers between the prefill and the decode pool that carries the most traffic, and whether to move
toward it now.

Its settings are the manifest's `planner` section. Every `interval_s` the cluster hands `OnlinePlanner.decide` what it measured over the last `window_s`
(each finished request's arrival, prompt and output length) and its current split. Each split of the
same workers (P prefill + D decode, P and D at least 1) is simulated on the window's shapes at fresh
Poisson arrivals, and its goodput found as `pdserve plan` finds it (DistServe's: the highest rate at
which 90% of requests meet both objectives), the search starting at the measured rate. The best split
is acted on only when it beats the current one's goodput by `margin`, has been the best in
`confirmations` decisions in a row, and no change was made in the last `cooldown_s`: hysteresis, so
that a stationary workload, whose goodputs differ by noise, never makes it flap. One worker changes
role per decision (the drain moves its requests with their KV), so a wrong step costs one role change.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.cluster.bench.serve_metrics import Objective
from pdserve.cluster.bench.workload import TraceRequest
from pdserve.cluster.plan.costs import HardwareProfile
from pdserve.cluster.plan.planner import Candidate, evaluate
from pdserve.router.frontend import CompletedRequest

MAX_SEARCH_RUNS = 6  # simulated runs per split and decision (the goodput search's budget)
MIN_SIM_DURATION_S = 20.0  # of simulated arrivals per run


@dataclass(frozen=True)
class Split:
    prefill: int
    decode: int

    def __str__(self) -> str:
        return f"{self.prefill}P+{self.decode}D"


@dataclass(frozen=True)
class Decision:
    """One decision, as it is logged, exported and shown."""

    at: float  # wall clock
    action: str  # "keep", "wait", "change", or "none" (too few requests)
    current: Split
    best: Split | None = None
    step: Split | None = None  # "change": the split to go to now (one role change toward `best`)
    rate: float = 0.0  # measured arrivals per second over the window
    requests: int = 0
    goodputs: dict[str, float] = field(default_factory=dict)  # predicted, requests/s, by split
    reason: str = ""


class OnlinePlanner:
    def __init__(self, base: Any, profile: HardwareProfile, seed: int = 0,
                 goodputs: Callable[[list[GoodputQuestion]], list[float]] | None = None) -> None:
        """`base`: the cluster's manifest (its settings, pool threads and step budget are kept, and its
        `planner` section is this planner's); `profile`: the model's measured costs on this hardware
        (`pdserve profile`); `goodputs`: answers the splits' goodput questions (by default here, one
        after another: the cluster has them answered in processes of their own)."""
        self.settings = settings = base.planner
        # Simulated as it serves: the faults it injects (which name workers a split may lack) left out.
        self.base = type(base).model_validate({**base.model_dump(mode="json"), "faults": {}, "planner": {}})
        self.profile = profile
        self.objective = Objective("planner", settings.ttft_slo_s, settings.tpot_slo_s)
        self.goodputs = goodputs or (lambda questions: [split_goodput(q) for q in questions])
        self.seed = seed
        self.last_change_at: float | None = None
        self._streak: tuple[Split | None, int] = (None, 0)  # the best split of the last decisions, how many in a row

    def decide(self, now: float, finished: Sequence[CompletedRequest], current: Split) -> Decision:
        s = self.settings
        window = [r for r in finished if now - s.window_s <= r.arrived <= now]
        if len(window) < s.min_requests:
            self._streak = (None, 0)
            return Decision(now, "none", current, requests=len(window),
                            reason=f"{len(window)} requests in the last {s.window_s:.0f} s, fewer than {s.min_requests}")
        span = max(now - min(r.arrived for r in window), 1.0)
        rate = len(window) / span
        shapes = [TraceRequest(0.0, r.prompt_len, max(1, r.output_len)) for r in window]
        splits = self._splits(current)
        questions = [GoodputQuestion(self.base, self.profile, split, shapes, self.objective, self.seed, rate)
                     for split in splits]
        goodputs = dict(zip(splits, self.goodputs(questions)))
        best = max(goodputs, key=lambda split: (goodputs[split], split == current))
        previous, streak = self._streak
        self._streak = (best, streak + 1 if best == previous else 1)
        shown = {str(split): round(g, 3) for split, g in goodputs.items()}
        decision = Decision(now, "keep", current, best, rate=rate, requests=len(window), goodputs=shown)
        ahead = goodputs[best] / goodputs[current] - 1 if goodputs[current] > 0 else float("inf")
        mix = (f"{rate:.2f} req/s, median prompt {statistics.median(r.prompt_len for r in window):.0f} and output "
               f"{statistics.median(r.output_len for r in window):.0f} tokens")
        if best == current or ahead < s.margin:
            return replace(decision, reason=f"{current} is best or within {s.margin:.0%} of the best ({mix})")
        if self._streak[1] < s.confirmations:
            return replace(decision, action="wait", reason=f"{best} predicted {ahead:.0%} better ({mix}); best "
                                                         f"{self._streak[1]} of {s.confirmations} times in a row")
        if self.last_change_at is not None and now - self.last_change_at < s.cooldown_s:
            return replace(decision, action="wait", reason=f"{best} predicted {ahead:.0%} better ({mix}); the last "
                                                         f"change was {now - self.last_change_at:.0f} s ago")
        step = Split(current.prefill + 1, current.decode - 1) if best.prefill > current.prefill else \
            Split(current.prefill - 1, current.decode + 1)
        self.last_change_at = now
        self._streak = (None, 0)
        return replace(decision, action="change", step=step,
                     reason=f"{best} predicted {ahead:.0%} better than {current} ({mix}); moving one worker")

    def _splits(self, current: Split) -> list[Split]:
        workers = current.prefill + current.decode
        return [Split(p, workers - p) for p in range(1, workers)]



@dataclass(frozen=True)
class GoodputQuestion:
    """What one split is predicted to carry on a window's requests (`split_goodput`)."""

    base: Any  # the cluster's manifest
    profile: HardwareProfile
    split: Split
    shapes: list[TraceRequest]
    objective: Objective
    seed: int
    rate: float  # measured: the goodput search starts here


def split_goodput(q: GoodputQuestion) -> float:
    """The split's goodput (requests/s) on the shapes, simulated as `pdserve plan` does."""
    pools = q.base.pools
    candidate = Candidate("disaggregated", (q.split.prefill, pools.prefill.threads),
                          (q.split.decode, pools.decode.threads), q.base.max_num_batched_tokens)
    evaluated = evaluate(candidate, q.base, q.profile, q.shapes, q.objective, q.seed, max_runs=MAX_SEARCH_RUNS,
                         min_duration_s=MIN_SIM_DURATION_S, target_rate=q.rate)
    return evaluated.goodput.rate
