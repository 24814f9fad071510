"""The online planner's decisions: from the requests of the last minutes, the split of the workers between
the prefill and the decode pool that carries the traffic best, how many workers it takes, and whether to
move toward it now.

Its settings are the manifest's `planner` section. Every `interval_s` the cluster hands
`OnlinePlanner.decide` what it measured over the last `window_s` (each request's arrival, prompt and
output length, and its prompt's block ids, so that prefix reuse is simulated as it was served; the
requests still running count with the tokens they have so far: left out, a phase of long outputs would
look short until its requests end) and its current split. Each split of the same workers (P prefill + D
decode, P and D at least 1), and of one more and one fewer where the budget (`min_workers`,
`max_workers`) allows, is simulated on the window's shapes at fresh Poisson arrivals, and its goodput
found as `pdserve plan` finds it (DistServe's: the highest rate at which 90% of requests meet both
objectives), the search starting at the measured rate; a window whose mix (length percentiles, prefix
reuse) is within `MIX_TOLERANCE` of the last simulated one's, which kept the split, takes over its
goodputs instead, for a few decisions in a row (the simulations' CPU is the workers' idle time). The
number of workers grows when the current ones are predicted to carry less than `headroom` times the
measured rate (and one more helps by `margin`), and shrinks when one fewer would carry twice `margin`
more than that; of that number, the best split is the target. A change is made only when the target has
been the same in `confirmations` decisions in a row (or at once when the current split is predicted to
carry less than the measured rate: it loses requests while it waits), no change was made in the last
`cooldown_s`, and (a split of the same workers) it beats the current one by `margin`: hysteresis, so
that a stationary workload, whose goodputs differ by noise, never makes it flap. One worker is added,
removed (drained first: its requests move with their KV) or switched per decision, so a wrong step costs
one change.
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
from pdserve.cluster.plan.simulator import handoff_transport
from pdserve.router.frontend import ObservedRequest

MAX_SEARCH_RUNS = 6  # simulated runs per split and decision (the goodput search's budget)
MIN_SIM_DURATION_S = 20.0  # of simulated arrivals per run
# A window whose mix is this close to the last simulated one's (length quantiles relative, prefix reuse
# absolute) reuses its goodputs: the simulations' CPU comes out of the workers' idle time, and on a
# stationary mix they would only repeat themselves...
MIX_TOLERANCE = 0.1
RESIMULATE_AFTER = 5  # ... for at most this many decisions in a row


@dataclass(frozen=True)
class Split:
    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    def __str__(self) -> str:
        return f"{self.prefill}P+{self.decode}D"


@dataclass(frozen=True)
class Decision:
    """One decision, as it is logged, exported and shown."""

    at: float  # wall clock
    action: str  # "keep", "wait", "change", or "none" (too few requests)
    current: Split
    best: Split | None = None
    step: Split | None = None  # "change": the split to go to now (one worker added, removed or switched toward `best`)
    rate: float = 0.0  # measured arrivals per second over the window
    requests: int = 0
    goodputs: dict[str, float] = field(default_factory=dict)  # predicted, requests/s, by split
    reason: str = ""
    simulated: bool = False  # the goodputs were simulated for this decision (else those of an earlier one, same mix)


@dataclass(frozen=True)
class MixSignature:
    """What a window's goodputs depend on: its prompt and output lengths (10th, 50th and 90th
    percentiles) and its prefix reuse. The rate only sets where a split's goodput search starts."""

    prompt: tuple[float, float, float]
    output: tuple[float, float, float]
    reuse: float

    @classmethod
    def of(cls, shapes: Sequence[TraceRequest]) -> MixSignature:
        def deciles(values: list[int]) -> tuple[float, float, float]:
            cuts = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else list(values) * 9
            return cuts[0], cuts[4], cuts[8]
        return cls(deciles([r.prompt_len for r in shapes]), deciles([r.output_len for r in shapes]), _reuse(shapes))

    def near(self, other: MixSignature, tolerance: float) -> bool:
        lengths = zip((*self.prompt, *self.output), (*other.prompt, *other.output))
        return (all(abs(a - b) <= tolerance * max(a, b, 1.0) for a, b in lengths)
                and abs(self.reuse - other.reuse) <= tolerance)


@dataclass(frozen=True)
class _Simulated:
    """The last goodputs simulated, for the mix and splits they were simulated for."""

    signature: MixSignature
    goodputs: dict[Split, float]
    reused: int = 0  # decisions since, that took them over


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
        self.budget = base.planner_budget()  # the fewest and the most workers
        transport = handoff_transport(self.base)
        if transport not in profile.transfers:  # said at start, not at the first decision
            raise ValueError(f"the online planner simulates KV handoffs over {transport!r}, and the profile measured "
                             f"{sorted(profile.transfers)} only: run `pdserve profile --transports {transport}` (with "
                             "the others it should keep)")
        self.last_change_at: float | None = None
        self._simulated: _Simulated | None = None
        self._streak: tuple[Split | None, int] = (None, 0)  # the best split of the last decisions, how many in a row

    def decide(self, now: float, observed: Sequence[ObservedRequest], current: Split) -> Decision:
        s = self.settings
        window = [r for r in observed if now - s.window_s <= r.arrived <= now]
        if len(window) < s.min_requests:
            self._streak = (None, 0)
            return Decision(now, "none", current, requests=len(window),
                            reason=f"{len(window)} requests in the last {s.window_s:.0f} s, fewer than {s.min_requests}")
        if current.prefill < 1 or current.decode < 1:  # made by hand: the planner simulates no empty pool
            self._streak = (None, 0)
            return Decision(now, "none", current, requests=len(window), reason=f"{current} has an empty pool")
        span = max(now - min(r.arrived for r in window), 1.0)
        rate = len(window) / span
        shapes = [_shape(r) for r in window]
        splits = self._splits(current)
        signature = MixSignature.of(shapes)
        goodputs, simulated = self._goodputs(splits, shapes, signature, rate)
        best = self._target(goodputs, current, rate)
        if not simulated and self._why(goodputs, current, best, rate) is not None:
            # a change wanted is decided on simulations of its own, never on a copy
            goodputs, simulated = self._goodputs(splits, shapes, signature, rate, fresh=True)
            best = self._target(goodputs, current, rate)
        previous, streak = self._streak
        self._streak = (best, streak + 1 if best == previous else 1)
        shown = {str(split): round(g, 3) for split, g in goodputs.items()}
        decision = Decision(now, "keep", current, best, rate=rate, requests=len(window), goodputs=shown,
                            simulated=simulated)
        mix = (f"{rate:.2f} req/s, median prompt {signature.prompt[1]:.0f} and output {signature.output[1]:.0f} "
               f"tokens, {signature.reuse:.0%} of prompt blocks seen before"
               f"{'' if simulated else '; goodputs of an earlier decision, the mix unchanged'}")
        why = self._why(goodputs, current, best, rate)
        if why is None:
            self._streak = (None, 0)  # a change must be wanted in consecutive decisions
            return replace(decision, reason=f"{current} is predicted to carry {goodputs[current]:.2f} req/s "
                                            f"({rate * s.headroom:.2f} wanted) and is best or within {s.margin:.0%} "
                                            f"of the best ({mix})")
        self._simulated = None  # the next decision simulates too: confirmations are fresh evidence
        # Confirmations guard a split that carries the traffic against noise; one predicted to carry less
        # than the measured rate loses requests every second it is kept.
        overloaded = goodputs[current] < rate
        if self._streak[1] < s.confirmations and not overloaded:
            return replace(decision, action="wait", reason=f"{why} ({mix}); best {self._streak[1]} of "
                                                         f"{s.confirmations} times in a row")
        if self.last_change_at is not None and now - self.last_change_at < s.cooldown_s:
            return replace(decision, action="wait", reason=f"{why} ({mix}); the last change was "
                                                         f"{now - self.last_change_at:.0f} s ago")
        unconfirmed = self._streak[1] < s.confirmations
        at_once = f", at once: {current} is predicted to carry less than the measured rate" if unconfirmed else ""
        step = _step_toward(current, best)
        self.last_change_at = now
        self._streak = (None, 0)
        return replace(decision, action="change", step=step, reason=f"{why} ({mix}); {_said(current, step)}{at_once}")

    def _goodputs(self, splits: list[Split], shapes: list[TraceRequest], signature: MixSignature, rate: float,
                  fresh: bool = False) -> tuple[dict[Split, float], bool]:
        """Each split's predicted goodput, and whether it was simulated now: the last simulated goodputs
        when the mix and the splits are theirs (and they were not taken over too often), unless `fresh`."""
        last = self._simulated
        if (not fresh and last is not None and set(last.goodputs) == set(splits) and last.reused < RESIMULATE_AFTER
                and last.signature.near(signature, MIX_TOLERANCE)):
            self._simulated = replace(last, reused=last.reused + 1)
            return last.goodputs, False
        questions = [GoodputQuestion(self.base, self.profile, split, shapes, self.objective, self.seed, rate)
                     for split in splits]
        goodputs = dict(zip(splits, self.goodputs(questions)))
        self._simulated = _Simulated(signature, goodputs)
        return goodputs, True

    def _splits(self, current: Split) -> list[Split]:
        """Every split of the current number of workers, and of one more and one fewer where the budget
        allows (one worker changes per decision); one more or one fewer when the current number is below
        or above the budget (after workers were added or removed by hand, or a start failed)."""
        lo, hi = self._bounds()
        n = current.total
        sizes = [n, *(m for m in (n - 1, n + 1) if lo <= m <= hi or (m == n + 1 and n < lo) or (m == n - 1 and n > hi))]
        return [Split(p, m - p) for m in sizes for p in range(1, m)]

    def _bounds(self) -> tuple[int, int]:
        fewest, most = self.budget
        return max(fewest, 2), most

    def _target(self, goodputs: dict[Split, float], current: Split, rate: float) -> Split:
        """The split to move toward, the best of its number of workers: one more when the current
        workers' best split carries less than `headroom` times the measured rate and one more helps by
        `margin`; one fewer when that would carry it by twice `margin` more (a band between the two, so
        that noise does not add and remove a worker in turn); toward the budget when outside it."""
        s = self.settings
        best_of: dict[int, Split] = {}
        for split, goodput in goodputs.items():
            held = best_of.get(split.total)
            if held is None or (goodput, split == current) > (goodputs[held], held == current):
                best_of[split.total] = split
        needed = rate * s.headroom
        size = current.total
        lo, hi = self._bounds()
        if size < lo or size > hi:
            size += 1 if size < lo else -1
        elif goodputs[best_of[size]] < needed and size + 1 in best_of and \
                goodputs[best_of[size + 1]] >= goodputs[best_of[size]] * (1 + s.margin):  # and one more helps
            size += 1
        elif size - 1 in best_of and goodputs[best_of[size - 1]] >= needed * (1 + 2 * s.margin):
            size -= 1
        return best_of[size]

    def _why(self, goodputs: dict[Split, float], current: Split, best: Split, rate: float) -> str | None:
        """Why moving toward `best` pays, or None when it does not."""
        needed = rate * self.settings.headroom
        lo, hi = self._bounds()
        if not lo <= current.total <= hi:
            return f"{current.total} workers, outside the budget of {lo} to {hi}"
        if best.total > current.total:
            return (f"{current} is predicted to carry {goodputs[current]:.2f} req/s, short of "
                    f"{self.settings.headroom:g}x the measured rate ({needed:.2f}); {best} {goodputs[best]:.2f}")
        if best.total < current.total:
            return f"{best} is predicted to carry {goodputs[best]:.2f} req/s, enough for {needed:.2f}"
        ahead = goodputs[best] / goodputs[current] - 1 if goodputs[current] > 0 else float("inf")
        if best == current or ahead < self.settings.margin:
            return None
        return f"{best} predicted {ahead:.0%} better than {current}"


def _shape(r: ObservedRequest) -> TraceRequest:
    """A request as the simulator replays it: its lengths, and its prompt's blocks (so that the
    window's prefix reuse is simulated as it was served)."""
    if not r.block_ids:
        return TraceRequest(0.0, r.prompt_len, max(1, r.output_len))
    return TraceRequest(0.0, r.prompt_len, max(1, r.output_len), r.block_id_list(), r.block_size)


def _reuse(shapes: Sequence[TraceRequest]) -> float:
    """The share of the window's prompt blocks that an earlier request of the window had too."""
    seen: set[int] = set()
    repeated = total = 0
    for shape in shapes:
        repeated += sum(h in seen for h in shape.hash_ids)
        total += len(shape.hash_ids)
        seen.update(shape.hash_ids)
    return repeated / total if total else 0.0


def _step_toward(current: Split, target: Split) -> Split:
    """One worker's change from `current` toward `target`: added, removed or switched to the pool the
    target has more of (relative to what is there)."""
    if target.total > current.total:
        return Split(current.prefill + 1, current.decode) if target.prefill > current.prefill else \
            Split(current.prefill, current.decode + 1)
    if target.total < current.total:
        return Split(current.prefill - 1, current.decode) if target.prefill < current.prefill else \
            Split(current.prefill, current.decode - 1)
    return Split(current.prefill + 1, current.decode - 1) if target.prefill > current.prefill else \
        Split(current.prefill - 1, current.decode + 1)


def _said(current: Split, step: Split) -> str:
    if step.total > current.total:
        return f"adding a {'prefill' if step.prefill > current.prefill else 'decode'} worker"
    if step.total < current.total:
        return f"removing a {'prefill' if step.prefill < current.prefill else 'decode'} worker"
    return "moving one worker"


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
                          (q.split.decode, pools.decode.threads), q.base.max_num_batched_tokens,
                          encode=(pools.encode.replicas, pools.encode.threads))
    evaluated = evaluate(candidate, q.base, q.profile, q.shapes, q.objective, q.seed, max_runs=MAX_SEARCH_RUNS,
                         min_duration_s=MIN_SIM_DURATION_S, target_rate=q.rate)
    return evaluated.goodput.rate
