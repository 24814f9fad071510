"""A proposer's guess: draft tokens, and how likely each prefix of them is to be accepted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # a Sequence holds an AcceptanceRecord: this module comes first
    from pdserve.engine.sequence import Sequence


@dataclass(frozen=True)
class Draft:
    tokens: list[int] = field(default_factory=list)
    # probabilities[j]: the estimated chance that tokens[: j + 1] are all accepted (non-increasing)
    probabilities: list[float] = field(default_factory=list)

    @property
    def expected(self) -> float:
        """Tokens a verification is expected to accept: the sum of the prefixes' probabilities."""
        return sum(self.probabilities)


@dataclass(frozen=True)
class DraftRequest:
    """A sequence asking for a draft: at most `max_tokens` tokens, and how its drafts fared lately."""

    seq: Sequence
    max_tokens: int
    acceptance: float  # the chance that a draft token is accepted after the one before it (its record)
    # How far `acceptance` may be off: its standard error, large while the record holds few verifications
    uncertainty: float = 0.0


@dataclass(frozen=True)
class DraftWorth:
    """What drafting is worth in a step, for a proposer whose drafts cost time (a draft model)."""

    token_s: float = math.inf  # an accepted draft token saves this: a decode step's seconds per sequence
    verify_s: float = 0.0  # a step that verifies anything costs this much more


WORKER_RECORD_DECAY = 0.995  # per engine step: a worker's record is mostly of its last 200 steps


class AcceptanceRecord:
    """Draft tokens accepted, and verifications that ended on a rejected one, both fading by `decay` at
    every engine step: recent drafts count and old failures fade, so a request (or a worker) that
    stopped drafting tries again in time."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.accepted = self.rejected = 0.0

    def observe(self, accepted: float, rejected: float) -> None:
        self.accepted += accepted
        self.rejected += rejected

    def tick(self) -> None:
        self.accepted *= self.decay
        self.rejected *= self.decay

    def rate(self, prior: float, weight: float = 2.0) -> float:
        """The chance that a draft token is accepted after the one before it (each taken as
        independent), `prior` weighing as `weight` tokens: the prior without a record."""
        return (self.accepted + weight * prior) / (self.accepted + self.rejected + weight)

    def uncertainty(self, prior: float, weight: float = 2.0) -> float:
        """The standard error of `rate` (a binomial proportion's, over the tokens it weighs)."""
        rate = self.rate(prior, weight)
        return math.sqrt(rate * (1.0 - rate) / (self.accepted + self.rejected + weight))


class WorkerRecord:
    """How drafts fared lately on a worker, greedy and sampled requests apart: a sampled request accepts
    a draft token only when the model's own draw lands on it, so the two kinds of request accept at very
    different rates, and each new request starts from its own kind's record."""

    def __init__(self, decay: float) -> None:
        self.greedy, self.sampled = AcceptanceRecord(decay), AcceptanceRecord(decay)

    def of(self, params: SamplingParams) -> AcceptanceRecord:
        return self.greedy if params.is_greedy else self.sampled

    def tick(self) -> None:
        self.greedy.tick()
        self.sampled.tick()
