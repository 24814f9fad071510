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


class PromiseRecord:
    """Draft tokens accepted against those promised (the sum of the verified tokens' estimated
    probabilities), both fading by `decay` at every engine step: recent drafts count and old failures
    fade, so a request (or a worker) that stopped drafting tries again in time."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.kept = self.promised = 0.0

    def observe(self, kept: int, promised: float) -> None:
        self.kept += kept
        self.promised += promised

    def tick(self) -> None:
        self.kept *= self.decay
        self.promised *= self.decay

    def ratio(self, prior: float, weight: float = 2.0) -> float:
        """Kept over promised, `prior` weighing as `weight` promised tokens: the prior without a record."""
        return (self.kept + weight * prior) / (self.promised + weight)
