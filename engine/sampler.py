"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, optional logprobs.

Sampling uses the exponential race: argmax(p / q) with q ~ Exp(1) per vocabulary entry draws from p.
A seeded request draws q from a generator seeded by (seed, output position) alone, so its tokens do
not depend on the batch it runs in, on preemption, or on which worker samples which position.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from pdserve.engine.sequence import Sequence

_GOLDEN = 0x9E3779B97F4A7C15


def position_seed(seed: int, position: int) -> int:
    return (seed * _GOLDEN + position) % 2**63


class Sampler:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._unseeded = torch.Generator(device=self.device)
        self._unseeded.seed()

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence],
                 positions: Seq[int] | None = None) -> tuple[list[int], list[float | None]]:
        """Pick one token for each row of `logits` ([len(seqs), vocab]): row i is `seqs[i]`'s token at
        output position `positions[i]` (default: its next one). A sequence may have several rows, one per
        position a speculative step verifies."""
        logits = logits.float()
        if positions is None:
            positions = [len(s.output_token_ids) for s in seqs]
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows] = self._sample(logits[rows], [seqs[i] for i in random_rows],
                                        [positions[i] for i in random_rows])
        token_list = tokens.tolist()
        logprobs: list[float | None] = [None] * len(seqs)
        want = [i for i, s in enumerate(seqs) if s.params.logprobs]
        if want:
            # Log-probabilities under the model's raw distribution (before temperature/top-k/top-p).
            rows = torch.tensor(want, device=logits.device)
            chosen = tokens[rows].unsqueeze(1)
            values = torch.log_softmax(logits[rows], dim=-1).gather(1, chosen).squeeze(1).tolist()
            for i, v in zip(want, values):
                logprobs[i] = v
        return token_list, logprobs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int]) -> torch.Tensor:
        temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        scaled = logits / temps.unsqueeze(1)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        top_k = torch.tensor([s.params.top_k or vocab for s in seqs], device=logits.device).unsqueeze(1)
        drop = ranks >= top_k
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        top_p = torch.tensor([s.params.top_p for s in seqs], device=logits.device).unsqueeze(1)
        # Drop a token when the tokens ranked above it already cover top_p; the first always stays.
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.empty_like(sorted_logits).scatter_(1, order, torch.softmax(sorted_logits, dim=-1))
        noise = torch.stack([self._exponential(s, p, vocab) for s, p in zip(seqs, positions)])
        return (probs / noise).argmax(dim=-1)

    def _exponential(self, seq: Sequence, position: int, vocab: int) -> torch.Tensor:
        generator = self._unseeded
        if seq.params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(position_seed(seq.params.seed, position))
        return torch.empty(vocab, device=self.device).exponential_(generator=generator)
