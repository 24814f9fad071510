"""Speculative decoding in the simulated engine: how many draft tokens each decoding sequence verifies
in a step, what that step then costs, and how many of them are accepted.

What the simulator knows of a workload's drafts is what `pdserve bench spec` measures of them
(`Drafting`): how often a request's decode step verifies a draft (a proposer offers none where it has
no guess), how long those drafts are, which share of them a draft model proposed (`both`: the rest
were the suffix proposer's), and their acceptance α: the chance that a draft token is accepted when
the one before it was (what the engine keeps per request as its record). In each step, each decoding
sequence is offered a draft with that chance, of about that length (drawn to it on average, at most
`max_draft_tokens`), from the draft model with that share; the drafts are sized as the engine sizes
them (`sizing.draft_lengths` over the profile's fit of verifying steps, the j-th token's chance α^j);
the step takes the profile's decode time scaled by that fit's ratio of the step with its drafts to the
step without, plus the draft model's passes (one per draft token of its longest draft; a sequence
whose draft KV is not there yet first catches up over its whole context); and how many of each draft
are accepted is drawn one after another, each with chance α, from a seeded generator. The draft model
drafts in a step only where its passes pay for themselves: the step's expected tokens per second with
its drafts above those without them (the engine's `_worth_a_pass`, for the batch at once).

Measure the drafting at the batch size the workers will run at: the suffix proposer's index of recent
outputs lets requests decoding together draft from each other, so a batch of one drafts less (at larger
batches the engine's sizing has shortened the drafts a little, and the simulator sizes them again).
Left out: how one request's drafting differs from the workload's mean (and the two proposers' drafts
of `both` from each other), a draft model's passes beyond what is verified (in `both`, passes whose
draft lost to the suffix proposer's), and drafts counted against the step's token budget.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.plan.costs import SpeculationCosts
from pdserve.engine.speculative.sizing import DecodeCost, DraftCandidate, draft_lengths


@dataclass(frozen=True)
class Drafting:
    """A workload's drafts, as a run measures them."""

    acceptance: float  # the chance a draft token is accepted when the one before it was
    share: float = 1.0  # of a request's decode steps, those that verify a draft
    length: float | None = None  # draft tokens such a step verifies for it, on average (None: as many as allowed)
    model_share: float = 1.0  # of those drafts, the draft model's (where the method has one)

    def __post_init__(self) -> None:
        for name in ("acceptance", "share", "model_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"a draft's {name} is a chance in [0, 1], got {getattr(self, name)!r}")
        if self.length is not None and not self.length >= 1.0:
            raise ValueError(f"a draft's mean length is at least one token, got {self.length!r}")

    @classmethod
    def measured(cls, accepted: int, verifications: int, rejected: int, drafted: int, decode_steps: int,
                 model_verifications: int) -> "Drafting | None":
        """From a run's counts (over its requests); None where nothing was verified."""
        if not verifications:
            return None
        return cls(accepted / (accepted + rejected) if accepted + rejected else 0.0,
                   min(1.0, verifications / decode_steps) if decode_steps else 1.0, drafted / verifications,
                   model_verifications / verifications)


@dataclass(frozen=True)
class SpecStep:
    lengths: list[int]  # draft tokens each decoding sequence verifies
    by_model: list[bool]  # whether the draft model drafted them (its KV has then caught up)
    decode_scale: float  # the decode part of the step takes this many times its time without drafts
    draft_s: float  # a draft model's passes before it


class SimSpeculation:
    """One worker's drafts, for a manifest's `speculative` settings (`method`, `max_draft_tokens`,
    `goodput_sizing`)."""

    def __init__(self, costs: SpeculationCosts, spec: Any, drafting: Drafting, draft_kv_sent: bool,
                 seed: str) -> None:
        self.costs = costs
        self.max_draft_tokens = spec.max_draft_tokens
        # sized by goodput, or every draft whole (the engine's sizing without a measured cost)
        self.verify_cost = costs.verify if spec.goodput_sizing else DecodeCost()
        self.draft_pass = costs.draft_pass if spec.method != "suffix" else None
        # `both` takes the suffix proposer's draft where it has one; `draft_model` has only the model's
        self.model_share = drafting.model_share if spec.method == "both" else 1.0
        self.drafting = drafting
        self.draft_kv_sent = draft_kv_sent  # an imported sequence's draft KV came with the target's
        self._rng = random.Random(seed)

    def size(self, contexts: list[int], remaining: list[int], behind: list[int], plain_s: float,
             other_tokens: int, other_quad: int) -> SpecStep:
        """The drafts of decoding sequences with `contexts` tokens of KV and `remaining` output tokens
        each to go (a draft longer than that is never verified), `behind` tokens of context their draft
        model's KV lacks; `plain_s`: the step's decode part without drafts. The step also computes
        `other_tokens` prompt tokens (attention term `other_quad`)."""
        a, c = self.drafting.acceptance, self.costs
        offers = [self._offered() for _ in contexts]
        candidates = [DraftCandidate(ctx, [a ** j for j in range(1, min(offered, left - 1) + 1)], a)
                      for ctx, left, (offered, _) in zip(contexts, remaining, offers)]
        lengths = draft_lengths(candidates, self.verify_cost, other_tokens, other_quad)
        draft = self.draft_pass
        by_model = [k if from_model else 0 for k, (_, from_model) in zip(lengths, offers)]
        if draft is None or not any(by_model):
            return SpecStep(lengths, [False] * len(lengths), c.decode_scale(contexts, lengths), 0.0)
        # As the engine feeds them: a sequence whose draft KV lags by more than a draft's worth (a new
        # prompt) catches up in a pass of its own first; the first drafting pass feeds each its newest
        # token and any shorter lag, each later one a guess.
        lags = [n for n, k in zip(behind, by_model) if k]
        lagging = [n for n in lags if n > self.max_draft_tokens + 1]
        passes = draft.seconds(len(lags), sum(1 + (n if n <= self.max_draft_tokens + 1 else 0) for n in lags))
        for j in range(2, max(by_model) + 1):
            drafting = sum(k >= j for k in by_model)
            passes += draft.seconds(drafting, drafting)
        without = [k - m for k, m in zip(lengths, by_model)]  # the suffix proposer's drafts alone
        scale, scale_without = c.decode_scale(contexts, lengths), c.decode_scale(contexts, without)
        if self._expected(lengths) / (plain_s * scale + passes) <= self._expected(without) / (plain_s * scale_without):
            return SpecStep(without, [False] * len(lengths), scale_without, 0.0)
        catch_up = draft.seconds(len(lagging), sum(lagging)) if lagging else 0.0
        return SpecStep(lengths, [k > 0 for k in by_model], scale, passes + catch_up)

    def _expected(self, lengths: list[int]) -> float:
        """The tokens a step verifying drafts of `lengths` is expected to give."""
        return sum(1 + sum(self.drafting.acceptance ** j for j in range(1, k + 1)) for k in lengths)

    def _offered(self) -> tuple[int, bool]:
        """The length of the draft a sequence is offered this step (0: none), and whether the draft
        model proposed it."""
        d = self.drafting
        if self._rng.random() >= d.share:
            return 0, False
        pick = self._rng.random()  # drawn whatever the method: methods compare on the same draws
        from_model = self.draft_pass is not None and pick < self.model_share
        if d.length is None:
            return self.max_draft_tokens, from_model
        whole = int(d.length)
        return min(self.max_draft_tokens, whole + (self._rng.random() < d.length - whole)), from_model

    def accepted(self, drafted: int) -> int:
        """How many of `drafted` draft tokens are accepted: up to the first rejected one."""
        n = 0
        while n < drafted and self._rng.random() < self.drafting.acceptance:
            n += 1
        return n
