"""A proposer's guess: draft tokens, and how likely each prefix of them is to be accepted."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Draft:
    tokens: list[int] = field(default_factory=list)
    # probabilities[j]: the estimated chance that tokens[: j + 1] are all accepted (non-increasing)
    probabilities: list[float] = field(default_factory=list)

    @property
    def expected(self) -> float:
        """Tokens a verification is expected to accept: the sum of the prefixes' probabilities."""
        return sum(self.probabilities)


class AcceptanceRecord:
    """Draft tokens accepted, and verifications that ended on a rejected one, both fading by `decay` at
    every engine step: recent drafts count and old failures fade, so a request (or a worker) that
    stopped drafting tries again in time."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.accepted = self.rejected = 0.0

    def observe(self, accepted: int, rejected: bool) -> None:
        self.accepted += accepted
        self.rejected += rejected

    def tick(self) -> None:
        self.accepted *= self.decay
        self.rejected *= self.decay

    def rate(self, prior: float, weight: float = 2.0) -> float:
        """The chance that a draft token is accepted after the one before it (each taken as
        independent), `prior` weighing as `weight` tokens: the prior without a record."""
        return (self.accepted + weight * prior) / (self.accepted + self.rejected + weight)
