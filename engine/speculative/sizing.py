"""How many draft tokens each sequence verifies in a step: as many as raise the step's goodput
(SmartSpec, Liu et al. 2024: "Optimizing Speculative Decoding for Serving LLMs Using Goodput").

A step's goodput is the tokens it is expected to produce over the time it takes. A proposer says how
likely each prefix of its draft is to be accepted (the suffix proposer: the share of earlier
occurrences that continued that way); each request's record bounds that: α, the chance that its draft
tokens were accepted one after another lately (fading, starting from the worker's recent record),
caps the j-th token's chance at α^j. A request verifying k draft tokens is expected to produce
1 + g₁ + ... + g_k tokens, g_j = min(p_j, α^j). The step takes the worker's measured decode-step cost
(`DecodeCost`: a + b·tokens + c·attention + g·keys read + s·sequences, plus a premium when it
verifies anything) over every sequence's tokens. Draft tokens are taken best expected tokens per
second first while each raises the step's goodput, and a step verifies at all only when its drafts
pay for the premium: long drafts where the fixed cost of a step dominates (small batches), few or
none where a step is already bound by its tokens (large batches), none where drafts keep failing. As
old failures fade a request tries again.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.cost_model import OnlineFit

@dataclass(frozen=True)
class DecodeCost:
    """A decode step's seconds: a + b·tokens + c·quad + g·keys + s·sequences, plus `verify` when any
    sequence verifies a draft. quad (Σ queries × their context) is attention's arithmetic; keys (Σ each
    sequence's context) is the KV it reads, once per sequence however many queries it verifies: at a
    long context that read dominates, and a draft token adds only its arithmetic. On a CPU the
    premium is large: one token per sequence runs the weights as matrix-vector products, more than one
    as matrix products, which cost more for a few rows. A sequence costs more than a draft token of
    another (its own sampling)."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    verify: float = 0.0
    per_seq: float = 0.0
    gather: float = 0.0  # g: per key read (a batch reads each row up to its longest: contexts alike, about Σ)

    @property
    def measured(self) -> bool:
        return any((self.a, self.b, self.c, self.verify, self.per_seq, self.gather))

    def step_s(self, tokens: float, quad: float, verifies: bool, seqs: float = 0, keys: float = 0) -> float:
        return (self.a + self.b * tokens + self.c * quad + self.verify * verifies + self.per_seq * seqs
                + self.gather * keys)


class DecodeCostModel(OnlineFit):
    """The engine's decode steps (no prompt chunk in them) fitted to `DecodeCost` over (tokens, quad,
    verifies, sequences, keys), for relative error: drafts are sized by ratios, and a batch of one must be
    priced as well as a batch of 32. The start-up profile's steps (every batch size, draft length and
    two contexts) give the fit its shape; the steps served then only rescale it (a moving average of
    measured over predicted, kept by the engine loop's thread), because they come in few shapes (a run
    at one batch size, say), from which a refit would trade one coefficient for another and misprice
    every other shape. Without a profile the steps served are fitted themselves (the last `window`,
    refitted every `refit_every`)."""

    relative_error = True
    SCALE_WEIGHT = 0.02  # of each step served in the scale: about its last 50 steps

    def __init__(self, window: int = 512, refit_every: int = 32) -> None:
        super().__init__(5, window, refit_every, horizon_s=math.inf, clock=time.monotonic)
        self._scale = 1.0

    @property
    def cost(self) -> DecodeCost:
        return DecodeCost(*(self._fit * self._scale).tolist())

    def add_profile(self, samples: list[tuple[int, int, bool, int, int, float]]) -> None:
        self._add_profile(samples)
        self._scale = 1.0

    def observe(self, tokens: int, quad: int, verifies: bool, seqs: int, keys: int, seconds: float) -> None:
        if not self.profiled:
            self._observe((tokens, quad, verifies, seqs, keys), seconds)
            return
        predicted = float(self._fit @ (1.0, tokens, quad, verifies, seqs, keys))
        if predicted > 0:  # clipped: one step stalled by the machine (a page fault, a GC) moves it little
            ratio = min(max(seconds / predicted, self._scale / 4), self._scale * 4)
            self._scale += self.SCALE_WEIGHT * (ratio - self._scale)


class DecodeStepShape:
    """What speculation adds to a worker's decode steps, averaged over the recent ones: the tokens a step
    computes per sequence (its newest and the drafts it verifies) and the seconds spent drafting. The
    router prices a worker's running batch with it (`StepCost` counts tokens, not sequences)."""

    WEIGHT = 0.02  # of each decode step: about its last 50

    def __init__(self) -> None:
        self.tokens_per_seq = 1.0
        self.propose_s = 0.0

    def observe(self, tokens: int, seqs: int, propose_s: float) -> None:
        self.tokens_per_seq += self.WEIGHT * (tokens / seqs - self.tokens_per_seq)
        self.propose_s += self.WEIGHT * (propose_s - self.propose_s)


ACCEPTANCE_PRIOR = 0.8  # a worker with no record believes a draft token is accepted 4 times in 5


@dataclass(frozen=True)
class DraftCandidate:
    context_len: int  # tokens with KV before the step (the attention each query token pays for)
    probabilities: Sequence[float]  # each prefix of its draft: the proposer's chance it is accepted whole
    acceptance: float = 1.0  # the request's record: the chance a draft token is accepted after the one before

    def gain(self, position: int) -> float:
        """Expected tokens the draft's `position`-th token (from 1) adds: the proposer's estimate, but
        no more than the request's record allows."""
        return min(self.probabilities[position - 1], self.acceptance ** position)


def draft_lengths(candidates: list[DraftCandidate], cost: DecodeCost, other_tokens: int = 0,
                  other_quad: int = 0, other_seqs: int = 0) -> list[int]:
    """Each candidate's number of draft tokens to verify this step. The step also decodes one token for
    each candidate and computes `other_tokens` more (attention term `other_quad`) for `other_seqs` more
    sequences. Without a measured cost every draft is verified whole."""
    if not cost.measured or not candidates:
        return [len(c.probabilities) for c in candidates]
    expected = float(len(candidates))
    # One query per sequence: its quad term and the keys it reads are both its context.
    quad = other_quad + sum(c.context_len + 1 for c in candidates)
    seconds = cost.step_s(other_tokens + len(candidates), quad, verifies=False, seqs=other_seqs + len(candidates),
                          keys=quad)
    # The best drafts for a step that verifies (its premium paid), against a step that does not.
    lengths, verified_expected, verified_seconds = _best_drafts(candidates, cost, expected, seconds + cost.verify)
    if verified_expected / verified_seconds <= expected / seconds:
        return [0] * len(candidates)
    return lengths


def _best_drafts(candidates: list[DraftCandidate], cost: DecodeCost, expected: float,
                 seconds: float) -> tuple[list[int], float, float]:
    """Draft tokens taken best expected tokens per second first, while each raises the step's goodput;
    the lengths, and the step's expected tokens and seconds with them."""
    lengths = [0] * len(candidates)
    offers: list[tuple[float, int, float, float]] = []

    def offer(i: int) -> None:
        c, verified = candidates[i], lengths[i]
        if verified < len(c.probabilities):
            gain = c.gain(verified + 1)
            # its token, the attention term of a chunk of 1 + verified tokens growing by one, its key
            extra = cost.b + cost.c * (c.context_len + 2 * (1 + verified) + 1) + cost.gather
            heapq.heappush(offers, (-gain / extra if extra > 0 else -float("inf"), i, gain, extra))

    for i in range(len(candidates)):
        offer(i)
    while offers:
        _, i, gain, extra = heapq.heappop(offers)
        if (expected + gain) / (seconds + extra) <= expected / seconds:
            break  # the best offer left lowers goodput, and every later one is worse
        lengths[i] += 1
        expected, seconds = expected + gain, seconds + extra
        offer(i)
    return lengths, expected, seconds
