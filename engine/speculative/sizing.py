"""How many draft tokens each sequence verifies in a step: as many as raise the step's goodput
(SmartSpec, Liu et al. 2024: "Optimizing Speculative Decoding for Serving LLMs Using Goodput").

A step's goodput is the tokens it is expected to produce over the time it takes. A sequence verifying
k draft tokens is expected to produce 1 + α + α² + ... + α^k tokens, where α is its running chance
that a draft token is accepted (each one independently, the first rejection ending the run); the
step takes the engine's measured step cost (`StepCost`: a + b·tokens + c·attention) over every
sequence's tokens. The j-th draft token of a sequence adds α^j expected tokens and its share of the
cost, so draft tokens are taken best ratio first while each raises the step's goodput: they all pay
where the fixed cost of a step dominates (small batches, where verifying 8 tokens costs about what 1
does), few or none where a step is already bound by its tokens (large batches). A sequence whose
drafts keep being rejected gets short drafts, then none; a new one starts from the acceptance the
engine has seen lately, so where drafts fail for everyone (random text) new requests do not try.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from pdserve.engine.cost_model import StepCost

PRIOR_WEIGHT = 2.0  # a request's own history outweighs the engine's after two verified draft tokens


class Acceptance:
    """The engine's recent acceptance of draft tokens, over every request (a decaying count of about
    the last `1 / (1 - decay)` verifications): what a request with little history of its own is
    expected to accept. Starts at one half."""

    def __init__(self, decay: float = 0.99) -> None:
        self.decay = decay
        self.accepted, self.trials = 1.0, 2.0

    def observe(self, accepted: int, rejected: bool) -> None:
        """One verification: `accepted` draft tokens, then a rejected one or the draft's end."""
        self.accepted = self.accepted * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + rejected

    @property
    def rate(self) -> float:
        return self.accepted / self.trials


@dataclass(frozen=True)
class DraftCandidate:
    context_len: int  # tokens with KV before the step (the attention each query token pays for)
    max_tokens: int  # the proposer's draft length: the most it may verify
    accepted: int  # its draft tokens accepted so far
    rejected: int  # its verifications that ended on a rejected draft token
    prior: float = 0.5  # the acceptance expected before its own history (the engine's, `Acceptance.rate`)

    @property
    def acceptance(self) -> float:
        """The chance that its next draft token is accepted (each taken as independent)."""
        return (self.accepted + PRIOR_WEIGHT * self.prior) / (self.accepted + self.rejected + PRIOR_WEIGHT)


def draft_lengths(candidates: list[DraftCandidate], cost: StepCost, other_tokens: int = 0,
                  other_quad: int = 0) -> list[int]:
    """Each candidate's number of draft tokens to verify this step. The step also decodes one token for
    each candidate and computes `other_tokens` more (attention term `other_quad`). Without a measured
    cost every draft is verified whole."""
    if not cost.measured or not candidates:
        return [c.max_tokens for c in candidates]
    lengths = [0] * len(candidates)
    expected = float(len(candidates))
    seconds = cost.step_s(other_tokens + len(candidates),
                          other_quad + sum(c.context_len + 1 for c in candidates))
    # Every candidate's next draft token, best expected tokens per second first.
    offers: list[tuple[float, int, float, float]] = []

    def offer(i: int) -> None:
        c, verified = candidates[i], lengths[i]
        if verified < c.max_tokens:
            gain = c.acceptance ** (verified + 1)
            # its token, and the attention term of a chunk of 1 + verified tokens growing by one
            extra = cost.b + cost.c * (c.context_len + 2 * (1 + verified) + 1)
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
    return lengths
