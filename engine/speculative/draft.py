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
