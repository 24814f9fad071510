"""What proposes draft tokens, behind one interface."""

from __future__ import annotations

from typing import Protocol

from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.draft import Draft
from pdserve.engine.speculative.suffix import SuffixProposer


class Proposer(Protocol):
    def propose(self, seq: Sequence, max_tokens: int) -> Draft:
        """Up to `max_tokens` tokens `seq` is likely to generate next, each prefix with its estimated
        chance of being accepted (no tokens when it has no good guess)."""

    def finished(self, seq: Sequence) -> None:
        """`seq` generated its last token: what it generated may help other requests' drafts."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer a deployment's speculative settings name."""
    if config.method == "suffix":
        return SuffixProposer(config)
    raise ValueError(f"no proposer named {config.method!r}")
