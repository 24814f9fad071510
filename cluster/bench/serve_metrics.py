"""Serving metrics from per-request records: latencies, throughput, SLO attainment and goodput.

Every request the load generator sends becomes one `RequestRecord`; everything else is computed from
the records, so a results file can always be recomputed from its JSONL. Goodput follows DistServe:
the highest request rate at which at least 90% of all sent requests meet both the TTFT and the TPOT
objective (rejected and failed requests are misses).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

Outcome = Literal["ok", "rejected", "error"]
TARGET_ATTAINMENT = 0.9  # DistServe's goodput definition


@dataclass
class RequestRecord:
    """One sent request. Times are seconds since the start of its run (one monotonic clock)."""

    request_id: str
    config: str
    rate: float  # the run's offered rate, requests/s
    send_time: float
    prompt_len: int
    max_tokens: int = 0  # what was asked for: a complete answer has output_tokens == max_tokens
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of every output token
    end_time: float | None = None
    output_tokens: int = 0  # the server's count when it reports one, else the tokens seen
    outcome: Outcome = "ok"
    error: str = ""
    cached_tokens: int | None = None  # None: the client could not see it
    # The server's lifetime events (`LifetimeEvent` names; seconds on the server's clock, so only their
    # differences mean anything), where its API sends them.
    events: dict[str, float] = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    @property
    def e2e(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (n_out - 1)."""
        if self.outcome != "ok" or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        """Every gap between consecutive token arrivals (0 for tokens that came in one message)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        return cls(**d)


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0-100), linear interpolation between closest ranks; None when empty."""
    return float(np.percentile(values, p)) if len(values) else None


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (None when there are no values)."""
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
    }


@dataclass(frozen=True)
class Objective:
    """An SLO pair: a request meets it when TTFT <= ttft_s and TPOT <= tpot_s."""

    name: str
    ttft_s: float
    tpot_s: float


def meets(record: RequestRecord, objective: Objective) -> bool:
    if record.outcome != "ok" or record.ttft is None:
        return False
    tpot = record.tpot  # a one-token answer has no TPOT to miss
    return record.ttft <= objective.ttft_s and (tpot is None or tpot <= objective.tpot_s)


def attainment(records: Sequence[RequestRecord], objective: Objective) -> float:
    """Fraction of ALL sent requests that met both objectives (rejections and errors are misses)."""
    return sum(meets(r, objective) for r in records) / len(records) if records else 0.0


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Counts, latency distributions (completed requests) and throughput over the run's span."""
    ok = [r for r in records if r.outcome == "ok"]
    # The span runs from the first send to the last end: what the server was offered and delivered.
    span = (max(r.end_time for r in records if r.end_time is not None) - min(r.send_time for r in records)
            if any(r.end_time is not None for r in records) else 0.0)
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "sent": len(records), "ok": len(ok),
        "rejected": sum(r.outcome == "rejected" for r in records),
        "errors": sum(r.outcome == "error" for r in records),
        "duration_s": span,
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": distribution([g for r in ok for g in r.itl]),
        "e2e_s": distribution([r.e2e for r in ok if r.e2e is not None]),
        "output_tokens_per_s": out_tokens / span if span > 0 else 0.0,
        "requests_per_s": len(ok) / span if span > 0 else 0.0,
    }


# --- goodput search -------------------------------------------------------------------------------
@dataclass
class Goodput:
    """The search's answer for one objective pair.

    `rate` is the highest measured rate that met the target (0 if none did); the true goodput lies in
    [rate, failed_rate). `converged` is False when the run budget ran out first; `note` says why a
    search stopped at a bound.
    """

    objective: Objective
    rate: float
    failed_rate: float | None
    attainment: float | None
    converged: bool
    note: str = ""


class GoodputSearch:
    """Find the highest rate with attainment >= 0.9, for several objective pairs over one set of runs.

    `measure(rate)` runs the workload at a rate and returns its records; each rate is measured once
    and cached, so a second objective pair reuses the first one's runs (its bracket is read off the
    cache before anything new is measured). Bracketing starts at `start_rate` and doubles until a run
    fails (halves until one passes), then bisects until (fail - pass) <= rel_tol * pass. `max_runs`
    caps the number of runs over all objectives.
    """

    def __init__(self, measure: Callable[[float], list[RequestRecord]], start_rate: float, *,
                 min_rate: float = 0.0, max_rate: float = math.inf, rel_tol: float = 0.1, max_runs: int = 12,
                 target: float = TARGET_ATTAINMENT) -> None:
        if start_rate <= 0 or rel_tol <= 0 or max_runs < 1:
            raise ValueError("start_rate and rel_tol must be > 0 and max_runs >= 1")
        self._measure = measure
        self.start_rate = min(max(start_rate, min_rate), max_rate)
        self.min_rate, self.max_rate = min_rate, max_rate
        self.rel_tol, self.max_runs, self.target = rel_tol, max_runs, target
        self.runs: dict[float, list[RequestRecord]] = {}

    def records(self, rate: float) -> list[RequestRecord]:
        """The records at `rate`, measured now unless cached (does not check the budget)."""
        key = rate_key(rate)
        if key not in self.runs:
            self.runs[key] = self._measure(key)
        return self.runs[key]

    @property
    def budget_left(self) -> int:
        return self.max_runs - len(self.runs)

    def goodput(self, objective: Objective) -> Goodput:
        while True:
            passed = {r: a for r, a in self._attainments(objective).items() if a >= self.target}
            failed = [r for r in self.runs if r not in passed]
            hi = min(failed, default=None)
            lo = max((r for r in passed if hi is None or r < hi), default=None)
            result = Goodput(objective, 0.0 if lo is None else lo, hi, passed.get(lo), converged=True)
            if hi is None and lo is None:
                nxt = self.start_rate
            elif hi is None:  # everything passed so far: go up
                if lo >= self.max_rate:
                    result.note = f"met the target at the maximum rate {self.max_rate:g} req/s"
                    return result
                nxt = min(lo * 2, self.max_rate)
            elif lo is None:  # everything failed so far: go down
                if hi <= self.min_rate:
                    result.note = f"missed the target even at {hi:g} req/s"
                    return result
                nxt = max(hi / 2, self.min_rate)
            elif hi - lo <= self.rel_tol * lo:
                return result
            else:
                nxt = (lo + hi) / 2
            if rate_key(nxt) in self.runs:  # rounding collapsed the bracket: as close as the key allows
                return result
            if self.budget_left <= 0:
                result.converged = False
                result.note = f"run budget ({self.max_runs}) spent"
                return result
            self.records(nxt)

    def _attainments(self, objective: Objective) -> dict[float, float]:
        return {rate: attainment(recs, objective) for rate, recs in self.runs.items()}


def rate_key(rate: float) -> float:
    """Rates are cache keys: four significant digits, so 0.1 + 0.2 and 0.3 are the same run."""
    return float(f"{rate:.4g}")


def summarize_runs(runs: Iterable[tuple[float, list[RequestRecord]]],
                   objectives: Sequence[Objective]) -> list[dict[str, Any]]:
    """Per-rate summaries with each objective's attainment, by increasing rate."""
    return [
        {"rate": rate, **summarize(recs), "attainment": {o.name: attainment(recs, o) for o in objectives}}
        for rate, recs in sorted(runs)
    ]
