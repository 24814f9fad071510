"""What proposes draft tokens, behind one interface."""

from __future__ import annotations

from typing import Protocol

from pdserve.engine.config import EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.draft import Draft, DraftRequest, DraftWorth
from pdserve.engine.speculative.draft_model import DraftModelProposer
from pdserve.engine.speculative.suffix import SuffixProposer


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest], worth: DraftWorth) -> list[Draft]:
        """For each request: up to its `max_tokens` tokens the sequence is likely to generate next, each
        prefix with its estimated chance of being accepted (no tokens: no good guess). A proposer whose
        drafts cost time spends no more on them than they are `worth`."""

    def verified(self, seq: Sequence, draft: list[int], accepted: int) -> None:
        """A step verified `draft` for `seq` (its proposal, or the first tokens of it): the first
        `accepted` were accepted."""

    def finished(self, seq: Sequence) -> None:
        """`seq` left the engine (finished, aborted or handed off): what it generated may help other
        requests' drafts, and what the proposer held for it is freed."""


class SuffixThenModel:
    """The suffix proposer's draft where the text repeats itself (a draft expected to gain at least a
    token), the draft model's for the other sequences: a suffix match costs nothing to find and is
    often long, the model guesses where nothing repeats. A request that names one proposer
    (`SamplingParams.proposer`) gets that one's draft alone."""

    def __init__(self, suffix: SuffixProposer, model: DraftModelProposer) -> None:
        self.suffix, self.model = suffix, model

    def propose(self, requests: list[DraftRequest], worth: DraftWorth) -> list[Draft]:
        drafts = [Draft()] * len(requests)
        by_suffix = [i for i, r in enumerate(requests) if r.seq.params.proposer != "draft_model"]
        for i, draft in zip(by_suffix, self.suffix.propose([requests[i] for i in by_suffix], worth)):
            drafts[i] = draft
        by_model = [i for i, r in enumerate(requests) if r.seq.params.proposer == "draft_model"
                    or (r.seq.params.proposer is None and drafts[i].expected < 1.0)]
        for i, draft in zip(by_model, self.model.propose([requests[i] for i in by_model], worth)):
            drafts[i] = max(drafts[i], draft, key=lambda d: d.expected)
        return drafts

    def verified(self, seq: Sequence, draft: list[int], accepted: int) -> None:
        self.model.verified(seq, draft, accepted)  # it knows whether the draft was its own

    def finished(self, seq: Sequence) -> None:
        self.suffix.finished(seq)
        self.model.finished(seq)


def make_proposer(config: SpeculativeConfig, engine: EngineConfig, num_blocks: int, target_vocab: dict[str, int],
                  target_vocab_size: int, max_model_len: int) -> tuple[Proposer, DraftModelProposer | None]:
    """The proposer a deployment's speculative settings name, and its draft model if it has one (which
    gets a KV pool of `num_blocks` blocks, as many tokens as the target's)."""
    if config.method == "suffix":
        return SuffixProposer(config), None
    from pdserve.engine.models.presets import resolve_model  # only a draft model needs the model registry

    assert config.draft_model is not None  # SpeculativeConfig's check: a method with a model names one
    model = DraftModelProposer(config, resolve_model(config.draft_model), engine.torch_dtype, engine.device,
                               engine.block_size, num_blocks, target_vocab, target_vocab_size, max_model_len,
                               catch_up_tokens=engine.chunk_limit)
    return (model if config.method == "draft_model" else SuffixThenModel(SuffixProposer(config), model)), model
