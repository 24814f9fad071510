"""A sequence's output text as its tokens come: the router's stream of text deltas and the engine's
search for stop strings both read it.

Decoding every output token again at each new one costs a stream of n tokens n²/2 token decodes: about
1 s of CPU for 2,048 tokens and four minutes for 32k, on the router's event loop or the engine's step.
tokenizers' `DecodeStream` decodes each new token with the few before it instead (the ids since the last
complete character, and one before them for the spaces a decoder adds or strips between tokens).
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 character decodes to


class TextStream:
    """`tokenizer.decode(ids, skip_special_tokens=True)` of the ids added so far, without an incomplete
    character at its end (it waits for the token that completes it).

    A tokenizer whose text the stream cannot follow is decoded whole at every token instead: a
    pure-Python one (no tokenizers pipeline to step), or one that cleans up spaces after decoding
    (`clean_up_tokenization_spaces`: its text is not the pieces' text joined). Where the stream finds its
    last text is not the start of the next (a byte-fallback decoder that strips a leading space, over
    bytes that are not UTF-8), the text is decoded whole once and the stream starts again from there."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = None if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False) else backend
        self._stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.text = ""
        # Whether the last `add` changed the text before its old end (only a text decoded whole can): a
        # search of the text then starts again from its beginning (`StopStrings`).
        self.rewritten = False

    def add(self, tokens: list[int]) -> None:
        self.rewritten = False
        if not tokens:
            return
        self.ids += tokens
        if self._backend is None:
            self._decode_whole()
            return
        try:
            # One at a time: a run ending in an incomplete character would hold back the run's whole text.
            for token in tokens:
                chunk = self._stream.step(self._backend, token)
                if chunk is not None:
                    self.text += chunk
        except Exception:  # tokenizers raises a bare Exception for a text that is not its last one's continuation
            self._decode_whole()
            self._stream = DecodeStream(self.ids, skip_special_tokens=True)

    def _decode_whole(self) -> None:
        text = self._tokenizer.decode(self.ids, skip_special_tokens=True).rstrip(REPLACEMENT)
        self.rewritten = not text.startswith(self.text)
        self.text = text


class StopStrings:
    """Where a sequence's output text first holds one of its stop strings, searched as tokens come: the
    text the new tokens added, and before it as many characters as a stop string could start in."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.text = TextStream(tokenizer)
        self.stops = stops
        self._overlap = max(len(s) for s in stops) - 1
        self._searched = 0  # characters of the text searched before

    def find(self, output_token_ids: list[int]) -> int | None:
        """The first stop string's start in the text of `output_token_ids` (the sequence's output: the
        ids given before and those appended since), or None."""
        self.text.add(output_token_ids[len(self.text.ids):])
        text = self.text.text
        start = 0 if self.text.rewritten else max(0, self._searched - self._overlap)
        self._searched = len(text)
        cuts = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(cuts) if cuts else None
