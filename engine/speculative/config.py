"""Speculative decoding's settings (plain Python: a manifest builds them without loading torch)."""

from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_METHODS = frozenset({"suffix", "draft_model", "both"})
DRAFT_KV_WAYS = frozenset({"send", "recompute"})


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding in an engine (`engine.speculative`): what proposes draft tokens, and how many."""

    # The proposer: "suffix" (model-free, `engine.speculative.suffix`), "draft_model" (a small model with
    # the target's tokenizer, `engine.speculative.draft_model`), or "both" (the suffix draft where the
    # text repeats itself, the draft model's elsewhere).
    method: str = "suffix"
    draft_model: str | None = None  # for draft_model and both: a model directory, shipped model or preset
    max_draft_tokens: int = 8  # per sequence per step
    # suffix: the longest context suffix matched; a draft is at most max_spec_factor x its match's
    # length; the recent outputs indexed for every request (SuffixDecoding's global tree), in tokens.
    # Every proposer ends a draft where its estimated chance of being accepted whole falls under
    # min_token_prob.
    max_match: int = 16
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    recent_output_tokens: int = 65536
    # Each step's draft lengths chosen to raise its goodput from the measured decode-step cost, the
    # proposer's estimates and each request's record (`engine.speculative.sizing`); False: drafts whole.
    goodput_sizing: bool = True
    # Disaggregated deployments with a draft model: the draft's prompt KV computed by the prefill worker
    # beside the target's and sent with it ("send"), or computed by the decode worker on the request's
    # first drafting step ("recompute").
    draft_kv: str = "send"

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {sorted(SPECULATIVE_METHODS)}, got {self.method!r}")
        if (self.method != "suffix") != (self.draft_model is not None):
            raise ValueError(f"speculative method {self.method!r} " + (
                "needs draft_model: a model with the target's tokenizer (pystd-llama-draft for pystd-llama)"
                if self.draft_model is None else "takes no draft_model (draft_model and both do)"))
        if self.draft_kv not in DRAFT_KV_WAYS:
            raise ValueError(f"draft_kv must be one of {sorted(DRAFT_KV_WAYS)}, got {self.draft_kv!r}")
        for name in ("max_draft_tokens", "max_match"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.recent_output_tokens, int) or self.recent_output_tokens < 0:
            raise ValueError(f"recent_output_tokens must be an integer >= 0, got {self.recent_output_tokens!r}")
        if not self.max_spec_factor > 0:
            raise ValueError(f"max_spec_factor must be > 0, got {self.max_spec_factor!r}")
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob!r}")

