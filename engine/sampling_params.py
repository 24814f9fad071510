"""Per-request parameters (sampling, prompt) and their validation: the one place these rules live.

Plain Python on purpose (no torch): the router validates requests with the same rules before they
reach a worker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.diagnostics import shown

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
# What one request may ask of every engine step it runs in: each step looks the sequence's newest token
# up in its stop_token_ids and searches its output text for each stop string, so a request with a
# million of them slows every request batched with it. Far above what clients send: OpenAI's API
# allows 4 stop strings, and so do SGLang's router (sgl-router/src/protocols/validation.rs) and TGI
# (--max-stop-sequences, default 4); vLLM's and SGLang's engines set no limits. No stop string or stop
# token list a client writes comes near 1,024 entries or characters.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
PROPOSERS = ("suffix", "draft_model")  # what a request may pick where its deployment runs both


class BadParameter(ValueError):
    """A request's value that breaks a rule; `param` names the request field it came from (OpenAI's
    error `param`), so every API can say which one, in the same words."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[BadParameter], tuple[str, str]]:
        # Exceptions unpickle as cls(*args), args being (message,) alone: without this, one raised in a
        # Ray actor (an encode worker's bad image) would reach its caller as an error of unpickling.
        return type(self), (self.param, str(self))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 means greedy, and so does any temperature below `GREEDY_BELOW` (dividing the
    logits by it would overflow into NaN probabilities; vLLM draws the same line). A request with a
    `seed` samples the same tokens whatever else runs in its batch: its randomness comes from (seed,
    output position) alone.
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    speculative: bool = True  # False: never speculative decoding for this request (where the deployment has it)
    # Where the deployment runs both proposers: "suffix" or "draft_model" drafts with that one alone;
    # None: the deployment's choice. A deployment running one proposer uses it whatever this says.
    proposer: str | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the object hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        self.validate()

    @classmethod
    def greedy(cls, max_tokens: int = 16, **kwargs: object) -> "SamplingParams":
        return cls(temperature=0.0, max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        """Raise BadParameter naming the parameter and its allowed range."""
        if not _is_real(self.temperature) or self.temperature < 0:
            raise BadParameter("temperature", f"temperature must be a finite number >= 0 (0 means greedy), got "
                                              f"{self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise BadParameter("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        # Bounded above: the sampler puts top_k in an int64 tensor, and a larger value (the HTTP API
        # takes any JSON integer) would fail the engine step of every request in the batch.
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**63:
            raise BadParameter("top_k", f"top_k must be an integer >= 0 and < 2**63 (0 disables it), got "
                                        f"{shown(self.top_k)}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise BadParameter("max_tokens", f"max_tokens must be an integer >= 1, got {shown(self.max_tokens)}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise BadParameter("seed", f"seed must be an integer in [0, 2**63), got {shown(self.seed)}")
        for name in ("ignore_eos", "logprobs", "speculative"):  # flags: a count (OpenAI's logprobs=5 alternatives) is refused
            if not isinstance(getattr(self, name), bool):
                raise BadParameter(name, f"{name} must be true or false, got {shown(getattr(self, name))}")
        if self.proposer is not None and self.proposer not in PROPOSERS:
            raise BadParameter("proposer", f"proposer must be one of {', '.join(PROPOSERS)} (or unset: the "
                                           f"deployment's), got {shown(self.proposer)}")
        # Errors name the first bad entry, not the whole list: a client's list may be huge.
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise BadParameter("stop_token_ids", f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most "
                                                 f"{MAX_STOP_TOKEN_IDS} are allowed")
        for i, t in enumerate(self.stop_token_ids):
            if not isinstance(t, int) or t < 0:
                raise BadParameter("stop_token_ids", f"stop_token_ids must be non-negative integers, got {shown(t)} "
                                                     f"at index {i}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise BadParameter("stop", f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise BadParameter("stop", f"stop must be a list of non-empty strings, got {shown(s)} at index {i}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise BadParameter("stop", f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters; the "
                                           f"one at index {i} has {len(s)}")


def _is_real(x: object) -> bool:
    """A finite int or float (bool, NaN and infinity are not, nor an int too large for a float)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float's range: the engine could not use it either
        return False


def check_prompt(token_ids: Sequence[int], vocab_size: int, max_model_len: int, num_output_tokens: int = 0) -> None:
    """Raise ValueError unless `token_ids` is a prompt the model can continue by at least one token."""
    if not token_ids:
        raise BadParameter("prompt", "prompt is empty: it must have at least one token")
    total = len(token_ids) + num_output_tokens  # before the ids are read: a client's list may hold millions
    if total >= max_model_len:
        raise BadParameter("prompt", f"prompt has {total} tokens but the context limit is {max_model_len} "
                                 "(max_model_len, which must leave room for at least one generated token)")
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise BadParameter("prompt", f"prompt token ids must be integers in [0, {vocab_size}); got "
                                 f"{', '.join(shown(t) for t in bad[:5])}")


def check_prompt_text(text: str, max_token_chars: int | None, max_model_len: int, param: str = "prompt") -> None:
    """Raise ValueError when `text` cannot fit max_model_len whatever it tokenizes to, without tokenizing
    it (seconds for a long text): no token stands for more than `max_token_chars` characters, so text
    longer than (max_model_len - 1) x max_token_chars holds too many tokens for check_prompt to pass.
    `max_token_chars` None: the tokenizer gives no such bound (see model_loader.max_token_chars)."""
    if max_token_chars is None:
        return
    limit = (max_model_len - 1) * max_token_chars
    if len(text) > limit:
        raise BadParameter(param, f"{param} has {len(text)} characters, more than the {limit} that can fit the "
                                     f"context limit of {max_model_len} tokens (max_model_len, which must leave room "
                                     f"for one generated token; no token of this model stands for more than "
                                     f"{max_token_chars} characters)")


def check_output_room(prompt_tokens: int, max_tokens: int, max_model_len: int, param: str = "max_tokens") -> None:
    """Raise BadParameter (naming `param`, the request's field) when a prompt of `prompt_tokens` tokens
    plus `max_tokens` generated ones do not fit the context: refused, as vLLM refuses it, rather than
    cut short unasked."""
    room = max_model_len - prompt_tokens
    if max_tokens > room:
        raise BadParameter(param, f"{param} is {max_tokens} but the prompt has {prompt_tokens} tokens and the "
                                  f"context limit is {max_model_len} (max_model_len): at most {room} tokens can be "
                                  f"generated; ask for {room} or fewer, or shorten the prompt")


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step (incremental) or at the end (complete)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "prefilled"
    logprobs: list[float] | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified for it so far
    num_accepted_tokens: int = 0  # of those, accepted
    num_verifications: int = 0  # steps that verified a draft for it
    # of those, the ones that ended on a rejected draft token: accepted / (accepted + these) is the chance
    # a draft token is accepted when the one before it was (the simulator's `acceptance`)
    num_rejected_drafts: int = 0
    num_model_verifications: int = 0  # of the verifications, those whose draft a draft model proposed

    @property
    def first_new_index(self) -> int:
        """The output position of `new_token_ids[0]`."""
        return len(self.token_ids) - len(self.new_token_ids)
