"""`cache_aware`: SGLang router's policy. When the pool's load is out of balance (the busiest worker
holds more than `balance_abs` requests above the idlest and more than `balance_rel` times it), the
least loaded worker; otherwise the worker with the longest cached prefix, if that covers more than
`match_threshold` of the prompt; otherwise the least loaded. (SGLang's router guesses each worker's
cache from its own decisions; here the prefix index knows it.)"""

from __future__ import annotations

from pdserve.router.policies.base import Choice, RouteRequest, Rotation
from pdserve.router.workers import WorkerRef


class CacheAware:
    name = "cache_aware"

    def __init__(self, balance_abs: int = 32, balance_rel: float = 1.0001, match_threshold: float = 0.5) -> None:
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.match_threshold = match_threshold
        self._turn = Rotation()

    def choose(self, request: RouteRequest, workers: list[WorkerRef]) -> Choice:
        workers = self._turn.rotate(workers)
        least = min(workers, key=lambda w: w.outstanding)
        busiest = max(w.outstanding for w in workers)
        if busiest - least.outstanding > self.balance_abs and busiest > self.balance_rel * least.outstanding:
            return Choice(least)
        best = max(workers, key=lambda w: (request.cached_tokens(w), -w.outstanding))
        if request.cached_tokens(best) > self.match_threshold * request.num_prompt_tokens:
            return Choice(best)
        return Choice(least)
