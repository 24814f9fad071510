"""How long an engine step takes, as a function of the work in it: fitted from measured steps.

A step that computes N tokens, chunk i being m_i new tokens after p_i already in the cache, costs

    t ≈ a + b·N + c·Q,    Q = Σ m_i·(p_i + m_i)

a: the fixed cost of a step (launch, scheduling, sampling), b: the per-token cost (the matmuls),
c: attention over the context (for one fresh prompt of n tokens Q = n², the a + b·n + c·n² of the
design). The fit starts from a profile taken when the worker starts (`engine.profiler`) and is
refined online from every step the engine runs: the profile's samples stay as anchors, the steps of
the last `horizon_s` seconds (at most `window` of them) are added, and the three coefficients are
refitted, non-negative, every `refit_every` steps, and on reading when no step has refitted them
for a horizon. The horizon is in time, not steps, because conditions change: steps measured under
an abort storm's contention made prompts look three times dearer, and a window of 512 steps kept
them for seconds of serving after the storm (or for good, when no step followed). The router reads
the coefficients (`coefficients`) from the worker's health report and predicts with `StepCost`; no
torch here, so the router can import it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepCost:
    """Fitted coefficients (seconds, seconds per token, seconds per unit of Q)."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0

    @property
    def measured(self) -> bool:
        """Whether a fit stands behind these (before a worker's first profile all are 0: free work)."""
        return self.a > 0 or self.b > 0 or self.c > 0

    def step_s(self, tokens: float, quad: float) -> float:
        return self.a + self.b * tokens + self.c * quad

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One prompt's pass alone: `new_tokens` computed after `cached_tokens` from the prefix cache."""
        return self.step_s(new_tokens, new_tokens * (cached_tokens + new_tokens))

    def work_s(self, tokens: int, quad: float, step_budget: int) -> float:
        """Prompt work of `tokens` tokens (attention term `quad`) packed into steps of `step_budget`."""
        if tokens <= 0:
            return 0.0
        steps = -(-tokens // max(1, step_budget))
        return self.a * steps + self.b * tokens + self.c * quad

    def compute_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """The marginal cost of adding a prompt to a step that runs anyway (no fixed cost)."""
        return self.prefill_s(new_tokens, cached_tokens) - self.a

    def max_tokens_within(self, budget_s: float | Callable[[int], float], limit: int) -> int:
        """The longest fresh prompt (≤ `limit`) whose marginal compute fits in `budget_s` seconds, or in
        `budget_s(n)` for a budget that grows with the prompt (a transfer's time). The prompts that fit
        must form one interval from 0: true for any concave budget ≥ 0 (a constant, a line, the least
        of these), as compute minus it is then convex and ≤ 0 at n = 0."""
        budget = budget_s if callable(budget_s) else (lambda n: budget_s)
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.compute_s(mid) <= budget(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.a, self.b, self.c)


def fit_nonnegative(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ≥ 0: the best fit over subsets of the columns (there
    are at most six, so trying every subset is exact and cheap)."""
    n = features.shape[1]
    best, best_err = np.zeros(n), float(np.sum(seconds**2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = features[:, cols]
            coef, *_ = np.linalg.lstsq(sub, seconds, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - seconds) ** 2))
            if err < best_err:
                best, best_err = np.zeros(n), err
                best[list(cols)] = coef
    return best


class OnlineFit:
    """Step times fitted, every coefficient >= 0, to a constant and `num_features` features of the step:
    the start-up profile's samples kept for good as anchors, the steps of the last `horizon_s` seconds
    (at most `window` of them) added, refitted every `refit_every` steps. Thread-safe: the engine loop
    observes, any thread reads."""

    relative_error = False  # fit each step's error over its time rather than in seconds

    def __init__(self, num_features: int, window: int, refit_every: int, horizon_s: float,
                 clock: Callable[[], float]) -> None:
        self._anchors: list[tuple[float, ...]] = []  # (features..., seconds)
        self._recent: deque[tuple[float, ...]] = deque(maxlen=window)  # (time, features..., seconds)
        self._refit_every = refit_every
        self._since_fit = 0
        self.horizon_s = horizon_s
        self._clock = clock
        self._lock = threading.Lock()
        self._fit = np.zeros(num_features + 1)
        self._fitted_at = clock()

    @property
    def profiled(self) -> bool:
        """Whether a start-up profile anchors the fit (and gave one)."""
        return bool(self._anchors) and bool(self._fit.any())

    def _add_profile(self, samples: Iterable[Sequence[float]]) -> None:
        """(features..., seconds) of the start-up profile; fits at once. The steps observed so far (the
        profile's own passes, warm-ups included) are dropped: the online window starts now."""
        rows = [tuple(map(float, sample)) for sample in samples]
        if any(len(row) != len(self._fit) for row in rows):
            raise ValueError(f"a profile sample holds {len(self._fit) - 1} features and the seconds")
        with self._lock:
            self._anchors.extend(rows)
            self._recent.clear()
        self._refit()

    def _observe(self, features: Sequence[float], seconds: float) -> None:
        with self._lock:
            self._recent.append((self._clock(), *map(float, features), float(seconds)))
            self._since_fit += 1
            due = self._since_fit >= self._refit_every
        if due:
            self._refit()

    def _refit(self) -> np.ndarray:
        with self._lock:  # the fit too (about a millisecond): concurrent refits land in order
            self._fitted_at = now = self._clock()
            while self._recent and self._recent[0][0] < now - self.horizon_s:
                self._recent.popleft()
            samples = self._anchors + [step[1:] for step in self._recent]
            self._since_fit = 0
            if len(samples) >= len(self._fit):
                data = np.array(samples)
                features = np.column_stack([np.ones(len(data)), data[:, :-1]])
                seconds = data[:, -1]
                if self.relative_error:  # each step's error over its own time
                    weight = 1.0 / np.maximum(seconds, 1e-9)
                    features, seconds = features * weight[:, None], seconds * weight
                self._fit = fit_nonnegative(features, seconds)
            return self._fit


class StepCostModel(OnlineFit):
    """The step cost `StepCost` over (tokens, quad), as the header says."""

    def __init__(self, window: int = 512, refit_every: int = 32, horizon_s: float = 3.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(2, window, refit_every, horizon_s, clock)

    @property
    def coefficients(self) -> StepCost:
        """The current fit; refitted first when no step has refitted it for a horizon (an idle engine
        still holding the steps of a busy spell)."""
        with self._lock:
            stale = bool(self._recent) and self._fitted_at < self._clock() - self.horizon_s
        return self.refit() if stale else StepCost(*self._fit.tolist())

    def add_profile(self, samples: list[tuple[int, int, float]]) -> None:
        """(tokens, quad, seconds) of the start-up profile; fits at once."""
        self._add_profile(samples)

    def observe(self, tokens: int, quad: int, seconds: float) -> None:
        if tokens > 0:
            self._observe((tokens, quad), seconds)

    def refit(self) -> StepCost:
        return StepCost(*self._refit().tolist())
