"""One request's state inside an engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.multimodal.placement import PromptImages
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.speculative.draft import AcceptanceRecord

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pdserve.engine.detokenizer import StopStrings

REQUEST_RECORD_DECAY = 0.97  # per engine step: a request's record is mostly of its last 30 steps


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # holds no blocks; prefilled (or re-prefilled after preemption) when admitted
    RUNNING = "running"  # in the batch; its first `num_computed_tokens` tokens have KV in its blocks
    IMPORTING = "importing"  # blocks reserved for a KV import that is not committed yet
    HELD = "held"  # finished a prefill-only pass; keeps its blocks until released (for export)
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: two requests are never 'equal'
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False  # stop after the first sampled token and hold the KV for export

    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the leading full blocks
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_strings: StopStrings | None = None  # its output text searched for them, from its first check on
    num_preemptions: int = 0
    # False once its KV came through a lossy codec: its blocks (and those computed on top of them)
    # never enter the prefix cache, where another request would take them for exact KV.
    exact_kv: bool = True
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step to verify
    draft_probabilities: list[float] = field(default_factory=list)  # the proposer's, for each prefix of them
    num_draft_tokens: int = 0  # draft tokens verified so far
    num_accepted_tokens: int = 0  # of those, accepted
    num_verifications: int = 0  # steps that verified a draft for it
    num_rejected_drafts: int = 0  # of those, the ones that ended on a rejected draft token
    num_model_verifications: int = 0  # of those, the ones whose draft a draft model proposed
    # How its drafts fared lately: how far the next ones are believed (`engine.speculative.sizing`).
    acceptance: AcceptanceRecord = field(default_factory=lambda: AcceptanceRecord(REQUEST_RECORD_DECAY))
    images: PromptImages | None = None  # where the prompt's images are (a multimodal request's)
    # Their embeddings, kept while the prompt may be (re)computed here: a preempted request recomputes it.
    image_embeddings: list[torch.Tensor] = field(default_factory=list)
    mrope_positions: np.ndarray | None = None  # [3, prompt length], an M-RoPE model's prompt with images

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def recomputable(self) -> bool:
        """Whether its KV can be computed again here from what it holds (a preemption's recompute): not
        for a prompt with images whose embeddings stayed where they were made (an import)."""
        return self.images is None or bool(self.image_embeddings)

    def block_extra(self, start: int, end: int) -> bytes:
        """What the prefix-cache hash of the block of tokens [start, end) adds to their ids."""
        return b"" if self.images is None else self.images.block_extra(start, end)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.HELD)

    def append_token(self, token_id: int, logprob: float | None) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
