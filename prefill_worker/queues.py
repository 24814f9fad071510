"""The prefill worker's waiting line: one FCFS queue, or LAPS's two (short and long prompts).

With one queue a short prompt waits behind every long prompt ahead of it. Length-aware (LAPS:
She et al., "A Length-Aware-Prefill LLM Serving System", 2026): prompts whose uncached part is at
most `short_tokens` go to a short queue that goes first; a short batch is released when its oldest
prompt has waited `window_s` (so shorts arriving together share one step) or when it fills the
step's room for shorts; a long prompt starts when no short batch is due and no other long prompt has
more than its last chunk to compute (the worker's `long_busy`: the next long reserves its decode
blocks while that chunk runs). The engine chunks long prompts and runs a running chunk and newly
admitted shorts in one step, so a short prompt waits behind at most one chunk.

Each job has a key (the prefill worker's: its decode worker's lane), and a job whose key is busy
(that decode worker has not yet granted the leases of the jobs before) waits in its place while jobs
behind it with other keys go ahead. A key's jobs are taken one at a time, except shorts in one batch:
they go together (up to `SHORTS_PER_KEY` of a key), or they would not share a step.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from pdserve.engine.cost_model import StepCost

J = TypeVar("J")
# Shorts of one key (decode worker) in one batch, at most. Each holds a reservation there, and a decode
# worker whose KV memory is full holds each reservation's call (one of the threads its actor keeps for
# reservations, RESERVE_THREADS) for up to `reserve_wait_s`: one batch must not take them all.
SHORTS_PER_KEY = 8


@dataclass(frozen=True)
class LapsSettings:
    """How a prefill worker queues and chunks its prompts (`PrefillQueues.configure`, the engine's chunk)."""

    length_aware: bool
    short_tokens: int = 0
    window_s: float = 0.0
    short_room: int = 0  # prompt tokens of shorts one step takes beside a long chunk
    chunk_tokens: int | None = None  # the engine's prefill chunk (None: the step budget)


def laps_settings(length_aware: bool, short_tokens: int | None, window_s: float | None, chunk_tokens: int | None,
                  cost: StepCost, step_budget: int, max_model_len: int) -> LapsSettings:
    """A prefill worker's LAPS settings, from the manifest's (None: derived) and its measured step cost:
    a prompt is short when its compute costs no more than a step's fixed cost (batching shorts then
    nearly divides their cost); shorts wait at most one fixed cost to be batched; long prompts are
    chunked at half the step budget, the other half being the shorts' room, so a short waits behind
    at most one step of long work (a chunk, and the last chunk of the long before it where the two
    share a step). Smaller chunks (where the fixed cost was 1/8 of a chunk's compute, ~250 tokens
    here) cost long prompts a third more TTFT p90 with four workers sharing two cores
    (docs/benchmarks.md). The simulator derives them here too."""
    if not length_aware or (cost.a <= 0 and short_tokens is None):  # no fixed cost measured: no shorts
        return LapsSettings(False)
    half = max(1, step_budget // 2)  # a step holds a chunk and a batch of shorts
    limit = min(half, max_model_len)
    short = min(short_tokens or max(1, cost.max_tokens_within(cost.a, limit)), half)
    chunk = min(max(chunk_tokens or half, short), step_budget - short)  # short <= half: room for one short
    window = cost.a if window_s is None else window_s
    return LapsSettings(True, short, window, step_budget - chunk, chunk)


class PrefillQueues(Generic[J]):
    """`clock`: seconds, monotonic (the simulator passes its own)."""

    def __init__(self, length_aware: bool, short_tokens: int = 0, window_s: float = 0.0, short_room: int = 0,
                 key: Callable[[J], Hashable] = id, clock: Callable[[], float] = time.monotonic) -> None:
        self._key = key
        self._clock = clock
        self._short: deque[tuple[J, int, float]] = deque()  # (job, new tokens, enqueued at)
        self._long: deque[J] = deque()
        self._cv = threading.Condition()
        self.configure(length_aware, short_tokens, window_s, short_room)

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._short) + len(self._long)

    def configure(self, length_aware: bool, short_tokens: int = 0, window_s: float = 0.0, short_room: int = 0) -> None:
        """Set how jobs are queued from now on (the worker sets LAPS up once its costs are measured).
        Jobs already queued stay, in order: a fresh queue would strand them."""
        with self._cv:
            self.length_aware = length_aware
            self.short_tokens = short_tokens if length_aware else 0
            self.window_s = window_s
            self.short_room = short_room  # prompt tokens of shorts one step takes beside a long chunk
            if not length_aware:  # no room for shorts any more: those queued go first in the one line
                self._long.extendleft(reversed([job for job, _, _ in self._short]))
                self._short.clear()
            self._cv.notify_all()

    def is_short(self, new_tokens: int) -> bool:
        return self.length_aware and new_tokens <= self.short_tokens

    def put(self, job: J, new_tokens: int, short: bool | None = None) -> None:
        """Queue a job; `short`: the caller's own `is_short` answer, so that the job's queue agrees with
        it even if `configure` ran in between (None: decided here)."""
        with self._cv:
            if short is None:
                short = self.is_short(new_tokens)
            if short:
                self._short.append((job, new_tokens, self._clock()))
            else:
                self._long.append(job)
            self._cv.notify()

    def take(self, timeout: float, long_busy: Callable[[], bool], short_inflight: Callable[[], int],
             busy_keys: Callable[[], Collection[Hashable]] = frozenset) -> list[J]:
        """The jobs to start now, in order, none of a busy key; [] when none is due within `timeout`.
        `long_busy`: whether a long prompt is still in its prompt pass; `short_inflight`: short prompt
        tokens started and not past their first token; `busy_keys`: keys whose jobs wait."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                due = self.due(long_busy, short_inflight, busy_keys)
                if due:
                    return due
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                # LAPS with work queued: poll every few ms, the window and the long-busy check change
                # without a notify. Otherwise sleep until a `put` or a `wake` (a key no longer busy).
                poll = self.length_aware and (self._short or self._long)
                self._cv.wait(min(remaining, max(self.window_s / 2, 0.002)) if poll else remaining)

    def remove(self, matches: Callable[[J], bool]) -> list[J]:
        """Take the queued jobs that `matches` out of the queues (in order, shorts first) and return them."""
        with self._cv:
            shorts = [job for job, _, _ in self._short if matches(job)]
            longs = [job for job in self._long if matches(job)]
            self._short = deque(entry for entry in self._short if not matches(entry[0]))
            self._long = deque(job for job in self._long if not matches(job))
            return shorts + longs

    def wake(self) -> None:
        """Have `take` look again at once: a key it found busy may be free now."""
        with self._cv:
            self._cv.notify_all()

    def due(self, long_busy: Callable[[], bool], short_inflight: Callable[[], int],
            busy_keys: Callable[[], Collection[Hashable]] = frozenset) -> list[J]:
        """The jobs to start now (as `take`, without waiting): [] when none is due."""
        with self._cv:
            return self._due(long_busy, short_inflight, set(busy_keys()))

    def _due(self, long_busy: Callable[[], bool], short_inflight: Callable[[], int], busy: set[Hashable]) -> list[J]:
        free = [entry for entry in self._short if self._key(entry[0]) not in busy]  # (the others wait)
        if free:
            queued = sum(n for _, n, _ in free)
            waited = self._clock() - free[0][2]
            room = self.short_room - short_inflight()
            if room > 0 and (waited >= self.window_s or queued >= room):
                batch, tokens, per_key = [], 0, Counter()
                for entry in free:
                    job, n, _ = entry
                    if per_key[self._key(job)] == SHORTS_PER_KEY:  # the rest of that key's wait for the next
                        continue
                    if batch and tokens + n > room:
                        break
                    self._short.remove(entry)
                    per_key[self._key(job)] += 1
                    batch.append(job)
                    tokens += n
                return batch
        # A long prompt may start while shorts gather: the engine runs its chunk and the shorts in one
        # step, so shorts still wait behind one chunk at most, and a steady stream of shorts cannot
        # starve the longs.
        if self._long and not (self.length_aware and long_busy()):
            for job in self._long:
                if self._key(job) not in busy:
                    self._long.remove(job)
                    return [job]
        return []
