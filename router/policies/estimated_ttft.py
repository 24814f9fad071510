"""`estimated_ttft`: placement by estimated time to first token, from the workers' measured step
costs; the design's own policy (the default).

Prefill pool: for each worker, this request's TTFT there is estimated as

    queued prompt work ahead of it + its own prompt pass + the expected KV transfer

the prompt pass of the part the worker does not cache (a + b·n + c·n², the worker's fitted step
cost, `engine.cost_model`), the queue from the router's exact count of prompts placed there and not
past their first token. With length-aware queues (LAPS) a short prompt waits only for the short
queue and at most one chunk of a long prompt. The least estimate wins; the router refuses the
request at once when even that misses the TTFT objective by too much.

Decode pool: the workers with room for the request's KV (free blocks as the router sees them), then
the smallest running batch, and among equals two picked at random, the one with more free blocks
(power of two choices: no herd on one worker when the router's view lags).
"""

from __future__ import annotations

import random
import threading
from collections import deque

import numpy as np

from pdserve.engine.cost_model import fit_nonnegative
from pdserve.router.policies.base import Choice, RouteRequest, Rotation
from pdserve.router.workers import QueuedPrefill, WorkerRef


class TransferCost:
    """Seconds from a prompt's first token to its KV committed on the decode worker, x0 + x1·tokens:
    seeded by a probe at start-up, refitted from the transfers the router sees finish: after each of
    the first `refit_every`, then every `refit_every` (a fit costs a few hundred microseconds of the
    router's event loop; one request moves a window of hundreds little)."""

    def __init__(self, window: int = 256, refit_every: int = 16) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._line: tuple[float, float] = (0.0, 0.0)
        self._refit_every = refit_every
        self._since_fit = 0

    def observe(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._samples.append((tokens, seconds))
            self._since_fit += 1
            if len(self._samples) > self._refit_every and self._since_fit < self._refit_every:
                return
            self._since_fit = 0
            data = np.array(self._samples, dtype=float)  # one sample fits a constant; two or more, a line
            self._line = tuple(fit_nonnegative(np.column_stack([np.ones(len(data)), data[:, 0]]), data[:, 1]).tolist())

    @property
    def x0(self) -> float:
        return self._line[0]

    @property
    def x1(self) -> float:
        return self._line[1]

    def predict(self, tokens: int) -> float:
        x0, x1 = self._line  # one read: a concurrent refit replaces the pair whole
        return x0 + x1 * tokens


def is_short(request: RouteRequest, worker: WorkerRef) -> bool:
    """Whether the prompt goes to `worker`'s short queue (its measured LAPS threshold; 0 = no LAPS)."""
    return request.new_tokens(worker) <= worker.short_prompt_tokens


class EstimatedTTFTPrefill:
    name = "estimated_ttft"

    def __init__(self, transfer: TransferCost) -> None:
        self.transfer = transfer
        self._turn = Rotation()

    def queue_s(self, request: RouteRequest, worker: WorkerRef) -> float:
        """The prompt work placed on `worker` that this request would wait for."""
        ahead = list(worker.queued.values())
        if is_short(request, worker):  # shorts pass longs: at most the long chunk in flight is ahead
            longs = sum(q.new_tokens for q in ahead if not q.short)
            ahead = [q for q in ahead if q.short] + ([QueuedPrefill(min(longs, worker.chunk_tokens), 0, False)]
                                                     if longs else [])
        budget = worker.status.step_budget
        return worker.step_cost.work_s(sum(q.new_tokens for q in ahead), sum(q.quad for q in ahead), budget)

    def estimate_s(self, request: RouteRequest, worker: WorkerRef) -> float:
        own = worker.step_cost.prefill_s(request.new_tokens(worker), request.cached_tokens(worker))
        return self.queue_s(request, worker) + own + self.transfer.predict(request.num_prompt_tokens)

    def choose(self, request: RouteRequest, workers: list[WorkerRef]) -> Choice:
        estimates = [(self.estimate_s(request, w), w) for w in self._turn.rotate(workers)]
        best_s, best = min(estimates, key=lambda e: e[0])
        return Choice(best, best_s)


class EstimatedTTFTDecode:
    name = "estimated_ttft"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, workers: list[WorkerRef]) -> Choice:
        need = request.num_blocks_with_output
        fits = [w for w in workers if w.free_blocks >= need] or workers  # none fits: the reservation waits
        lightest = min(w.outstanding for w in fits)
        tied = [w for w in fits if w.outstanding == lightest]
        pair = self._rng.sample(tied, 2) if len(tied) > 2 else tied
        return Choice(max(pair, key=lambda w: w.free_blocks))
