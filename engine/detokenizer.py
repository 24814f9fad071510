"""A sequence's output text as its tokens come: the router's stream of text deltas and the engine's
search for stop strings both read it.

Decoding every output token again at each new one costs a stream of n tokens n²/2 token decodes: about
1 s of CPU for 2,048 tokens and four minutes for 32k, on the router's event loop or the engine's step.
tokenizers' `DecodeStream` decodes each new token with the few before it instead (the ids since the last
complete character, and one before them for the spaces a decoder adds or strips between tokens).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 character decodes to
# Text that transformers' clean-up after decoding changes (" ." to ".", " n't" to "n't", ...).
CLEAN_UP_PROBE = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're k"


class GrowingText:
    """A string built by appending: an append, and a look at its end, cost what they add and read, not
    the whole string (`text += piece` on an attribute copies the whole string each time)."""

    FOLD = 256  # pieces kept apart before they are joined to the rest

    def __init__(self) -> None:
        self._head = ""
        self._recent: list[str] = []
        self.length = 0

    def append(self, piece: str) -> None:
        self._recent.append(piece)
        self.length += len(piece)
        if len(self._recent) >= self.FOLD:
            self._head += "".join(self._recent)
            self._recent = []

    def tail(self, start: int) -> str:
        """The text from character `start` on."""
        if start >= len(self._head):
            return "".join(self._recent)[start - len(self._head) :]
        return self._head[start:] + "".join(self._recent)

    def __str__(self) -> str:
        return self.tail(0)


@dataclass(frozen=True)
class _StreamPlan:
    backend: Tokenizer  # the tokenizers pipeline the stream steps
    special_ids: frozenset[int]  # skipped when decoding (`skip_special_tokens`): never stepped
    # A byte-fallback vocabulary's <0xNN> tokens: its decoder shows a run of them as one � per byte when
    # the run is not all UTF-8, complete characters in it too, so a run's text is final when it ends.
    byte_ids: frozenset[int]


@functools.lru_cache(maxsize=16)  # per tokenizer: a process serves one model or a few
def _stream_plan(tokenizer: Any) -> _StreamPlan | None:
    """How to stream a tokenizer's text, or None when it must be decoded whole: it has no tokenizers
    pipeline (a pure-Python tokenizer), or its `decode` is not its pipeline's (transformers' clean-up of
    spaces, for the tokenizers it still applies it to, changes text across the pieces' joins)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        probe = tokenizer.encode(CLEAN_UP_PROBE, add_special_tokens=False)
        if tokenizer.decode(probe, skip_special_tokens=True) != backend.decode(probe, skip_special_tokens=True):
            return None
    except Exception:  # a tokenizer that cannot take the probe: decoded whole, as it decodes itself
        return None
    special = frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
    vocab = backend.get_vocab(with_added_tokens=False)
    byte_ids = frozenset(i for i in (vocab.get(f"<0x{b:02X}>") for b in range(256)) if i is not None)
    return _StreamPlan(backend, special, byte_ids)


class TextStream:
    """`tokenizer.decode(ids, skip_special_tokens=True)` of the ids added so far, without an incomplete
    character at its end (it waits for the token that completes it).

    A tokenizer whose text the stream cannot follow (`_stream_plan`) is decoded whole at every token, as
    is a request's text once tokenizers finds its last text is not the start of the next (a
    byte-fallback decoder that strips a leading space, over bytes that are not UTF-8): such output is
    rare, and decoding it whole keeps it exact. So is a run of byte tokens that never completes a
    character: tokenizers decodes the run again at each of its tokens."""

    WHOLE_UNSETTLED = 4  # characters at the end of a text decoded whole that a clean-up may still change (" n't")

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._plan = _stream_plan(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self._text = GrowingText()
        self._run_start: int | None = None  # the text's length when the byte-token run at its end began
        # Whether the last `add` changed the text before its old end (only a text decoded whole can): a
        # reader of its end starts again from its beginning.
        self.rewritten = False

    @property
    def length(self) -> int:
        return self._text.length

    @property
    def text(self) -> str:
        return str(self._text)

    @property
    def settled_length(self) -> int:
        """The characters at the start of the text that later tokens leave as they are (for valid UTF-8):
        all but an open byte-token run's, or, decoded whole, all but the last few."""
        if self._plan is None:
            return max(0, self.length - self.WHOLE_UNSETTLED)
        return self.length if self._run_start is None else self._run_start

    def tail(self, start: int) -> str:
        return self._text.tail(start)

    def add(self, tokens: list[int]) -> None:
        self.rewritten = False
        if not tokens:
            return
        self.ids += tokens
        plan = self._plan
        if plan is not None:
            try:
                # One at a time: a run ending in an incomplete character would hold back the run's whole text.
                for token in tokens:
                    if token in plan.special_ids:
                        continue  # (skipped: bytes on either side of it still make one run)
                    if token not in plan.byte_ids:
                        self._run_start = None
                    elif self._run_start is None:
                        self._run_start = self.length
                    chunk = self._stream.step(plan.backend, token)
                    if chunk:
                        self._text.append(chunk)
                return
            except Exception:  # tokenizers raises a bare Exception for a text that is not its last one's start
                self._plan = None
        text = self._tokenizer.decode(self.ids, skip_special_tokens=True).rstrip(REPLACEMENT)
        self.rewritten = not text.startswith(self.text)
        self._text = GrowingText()
        self._text.append(text)


def cut_at_stop(text: str, stops: tuple[str, ...] | list[str]) -> str:
    """`text` up to the first of `stops` in it (all of it when none is)."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


class StopStrings:
    """Whether a sequence's output text holds one of its stop strings yet, searched as tokens come: the
    text the new tokens added, and before it as many characters as a stop string could start in."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] | list[str]) -> None:
        self.text = TextStream(tokenizer)
        self.stops = stops
        self._overlap = max(len(s) for s in stops) - 1
        self._searched = 0  # characters of the text searched before

    def found(self, output_token_ids: list[int]) -> bool:
        """Whether the text of `output_token_ids` (the sequence's output: the ids given before and those
        appended since) holds a stop string."""
        if len(output_token_ids) < len(self.text.ids):
            raise ValueError("a sequence's output only grows")
        self.text.add(output_token_ids[len(self.text.ids) :])
        start = 0 if self.text.rewritten else max(0, self._searched - self._overlap)
        self._searched = self.text.length
        window = self.text.tail(start)
        return any(s in window for s in self.stops)
