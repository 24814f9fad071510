"""Model-free drafts from earlier tokens (SuffixDecoding, Oliaro et al. 2024).

A request's next tokens often repeat text seen before: its prompt (code being edited, a document
being summarised) or earlier requests' outputs (agents issuing similar calls). The proposer finds the
longest suffix of the request's tokens, up to `max_match` of them, that occurred before, both in the
request's own prompt and output and in a bounded window of recent outputs, and follows what came
after those occurrences: at each step the most frequent next token among them, the occurrences that
agree kept for the next step (the walk down a suffix tree's most frequent path). The path stops where
its estimated probability (the product of each token's share of the occurrences) falls under
`min_token_prob`, and is at most `max_spec_factor` times as long as the match it grew from: a long
match predicts further than a short one. Of the two sources, the draft with more expected accepted
tokens (the sum of its prefixes' probabilities) is proposed.

Occurrences are found from a per-token position list (one int per indexed token, not a tree), the
most recent `MAX_OCCURRENCES` of the suffix's last token examined: a proposal's time is bounded
whatever the text.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from weakref import WeakKeyDictionary

from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.draft import Draft, DraftRequest, DraftWorth

MAX_OCCURRENCES = 256
END = -1  # between two documents of the recent outputs: no match crosses it, and no draft goes past it


class TokenIndex:
    """Token ids in order, with the positions of each id."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.where.setdefault(token, []).append(len(self.tokens))
            self.tokens.append(token)

    def draft(self, context: Seq[int], limit: int, config: SpeculativeConfig) -> Draft:
        """The most likely continuation of `context` (its last tokens) by what followed it here."""
        tokens, end = self.tokens, len(self.tokens)
        # Occurrences of the context's last token that something follows (not the context's own end).
        found = [p for p in self.where.get(context[-1], ())[-MAX_OCCURRENCES:] if p + 1 < end]
        length = 1
        while found and length < min(config.max_match, len(context)):
            want = context[-1 - length]
            longer = [p for p in found if p >= length and tokens[p - length] == want]
            if not longer:
                break
            found, length = longer, length + 1
        limit = min(limit, math.ceil(config.max_spec_factor * length))
        draft: list[int] = []
        probabilities: list[float] = []
        probability = 1.0
        while found and len(draft) < limit:
            # The most recent occurrence wins a tie: text repeats its latest form first.
            counts = Counter(tokens[p + 1] for p in reversed(found) if p + 1 < end)
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            probability *= count / sum(counts.values())
            if token == END or probability < config.min_token_prob:
                break
            draft.append(token)
            probabilities.append(probability)
            found = [p + 1 for p in found if p + 1 < end and tokens[p + 1] == token]
        return Draft(draft, probabilities)


class RecentOutputs:
    """The outputs of the latest finished requests, about `capacity` tokens of them, indexed."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._outputs: deque[list[int]] = deque()
        self._size = 0
        self.index = TokenIndex()

    def add(self, output: list[int]) -> None:
        if not output or self.capacity <= 0:
            return
        self._outputs.append(output[-self.capacity:])
        self._size += len(self._outputs[-1]) + 1
        self.index.extend([*self._outputs[-1], END])
        if self._size > 2 * self.capacity:  # rebuilt now and then, not at every request
            while self._size > self.capacity:
                self._size -= len(self._outputs.popleft()) + 1
            self.index = TokenIndex()
            for kept in self._outputs:
                self.index.extend([*kept, END])


class SuffixProposer:
    """Drafts from the request's own tokens and from recent outputs, whichever promises more."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._own: WeakKeyDictionary[Sequence, TokenIndex] = WeakKeyDictionary()  # gone with the sequence
        self.recent = RecentOutputs(config.recent_output_tokens)

    def propose(self, requests: list[DraftRequest], worth: DraftWorth) -> list[Draft]:
        return [self.propose_one(r.seq, r.max_tokens) for r in requests]  # a lookup costs next to nothing

    def propose_one(self, seq: Sequence, max_tokens: int) -> Draft:
        own = self._own.get(seq)
        if own is None:
            own = self._own[seq] = TokenIndex()
        own.extend(seq.token_ids[len(own.tokens):])
        context = seq.token_ids[-self.config.max_match:]
        mine = own.draft(context, max_tokens, self.config)
        recent = self.recent.index.draft(context, max_tokens, self.config) if self.recent.index.tokens else Draft()
        return max(mine, recent, key=lambda d: d.expected)

    def verified(self, seq: Sequence, draft: list[int], accepted: int) -> None:
        pass  # its estimates are counts of what followed, not a calibrated guess

    def finished(self, seq: Sequence) -> None:
        self.recent.add(seq.output_token_ids)
        self._own.pop(seq, None)
