"""Drafts from a small model run beside the target (speculative decoding's original proposer:
Leviathan et al. 2023, Chen et al. 2023).

The draft model has the target's tokenizer and runs in the same engine, on the same device, through
the same paged attention, with a KV pool of its own holding as many tokens as the target's. Each
sequence keeps its draft KV between steps: a step first feeds the tokens the draft has not seen (the
whole prompt the first time, unless it arrived with the target's; then the tokens accepted since),
then extends every drafting sequence by one greedy token per pass, all sequences batched in each pass.
A sequence stops drafting when the estimated chance that the target accepts its whole path falls under
`min_token_prob` (`_token_chance`: for a sampled request the product of the guesses' probabilities
under the draft; for a greedy one, how often guesses that likely under the draft were accepted).

Passes cost time whether their tokens are accepted or not, so each pass must be worth it: the tokens
it is expected to add (each sequence's chance so far, times its record's chance of one more token)
times what an accepted token saves (`DraftWorth`, from the engine's measured decode cost) must
exceed the pass's own measured cost (the first pass's: and the verification's premium). Where drafts
are accepted rarely, or where a decode step is cheap per sequence (large batches), the draft model
stops running at all; as a request's old failures fade it is tried again.
Draft tokens the target rejects leave stale KV behind the sequence's verified length: it is
overwritten when those positions are fed again, and never attended before.

In a disaggregated deployment the draft's prompt KV can travel with the target's
(`SpeculativeConfig.draft_kv`; `pdserve bench draft-kv` measures both ways): the prefill worker runs
each prompt chunk through the draft too (`prompt_pass`, from the prompt's first token: the draft keeps
no prefix cache), the KV transfer sends its layers after the target's, and the decode worker reserves
blocks for them with the target's (`reserve_import`) and takes them as the sequence's draft KV when
they all arrived (`import_committed`); else the draft's prompt pass runs there, as without a transfer.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.cost_model import OnlineFit
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.model_loader import load_model
from pdserve.engine.model_store import model_digest
from pdserve.engine.model_runner import ModelRunner, TokenRun
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.sequence import REQUEST_RECORD_DECAY, Sequence
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.draft import (
    WORKER_RECORD_DECAY, AcceptanceRecord, Draft, DraftRequest, DraftWorth,
)


class DraftPassCost(OnlineFit):
    """Seconds of one draft pass: a + b·sequences + c·tokens (a first pass feeds each sequence the
    tokens accepted since its last draft), from the start-up profile's passes (`profile`, kept as
    anchors) and the passes run; none measured: free, so the first passes run and measure. Passes run
    while serving mostly feed one token per sequence, so alone they cannot tell the cost of a token
    from a sequence's: a fit of them priced a first pass's nine tokens at 7 ms where it took 2 ms, and
    the draft model stopped for good (its KV then lagged further each step, so each first pass looked
    dearer). The profile measures passes that feed several tokens per sequence as well."""

    relative_error = True

    def __init__(self) -> None:
        super().__init__(2, window=256, refit_every=16, horizon_s=math.inf, clock=time.monotonic)

    def seconds(self, sequences: int, tokens: int) -> float:
        return float(self._fit @ (1.0, sequences, tokens))

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c) of the current fit."""
        return tuple(self._fit.tolist())

    def observe(self, sequences: int, tokens: int, seconds: float) -> None:
        self._observe((sequences, tokens), seconds)

    def add_profile(self, samples: list[tuple[int, int, float]]) -> None:
        """(sequences, tokens, seconds) of the start-up profile's passes; fits at once."""
        self._add_profile(samples)


class GuessCalibration:
    """How often a greedy target took the draft's guess, by the guess's probability under the draft
    (binned): a distilled draft spreads its probability as the target does, so its probability of a
    guess understates how often the guess is also the target's likeliest token, by an amount only
    verification tells. Learned from every verified guess; fading with the worker's record."""

    EDGES = (0.05, 0.1, 0.2, 0.4, 0.7)

    def __init__(self) -> None:
        self._bins = [AcceptanceRecord(WORKER_RECORD_DECAY) for _ in range(len(self.EDGES) + 1)]

    def chance(self, p: float, prior: float) -> float:
        return self._bins[bisect.bisect_right(self.EDGES, p)].rate(prior)

    def observe(self, p: float, accepted: bool) -> None:
        self._bins[bisect.bisect_right(self.EDGES, p)].observe(accepted, not accepted)

    def tick(self) -> None:
        for record in self._bins:
            record.tick()


@dataclass
class _DraftState:
    """A sequence's KV in the draft model's pool."""

    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # the sequence's first tokens whose draft KV is in the blocks
    fed: list[int] = field(default_factory=list)  # draft tokens whose KV was written after them, in order
    proposed: list[int] = field(default_factory=list)  # the last draft's tokens
    guess_probabilities: list[float] = field(default_factory=list)  # of its tokens, under the draft model
    proposed_at: int = -1  # the sequence's output length when it was proposed
    used_at: int = 0  # the proposer's call that last reserved blocks for it (the least recent lose them first)
    importing: bool = False  # its blocks await its prompt's draft KV from a transfer: never dropped meanwhile
    # What the draft's guesses for this sequence were worth lately (each pass's `_token_chance`): a
    # sequence it cannot guess for is not worth passes, whatever its record of verified drafts says.
    confidence: AcceptanceRecord = field(default_factory=lambda: AcceptanceRecord(REQUEST_RECORD_DECAY))


class DraftModelProposer:
    """Drafts for decoding sequences with a draft model on this engine (the module's header says how)."""

    def __init__(self, config: SpeculativeConfig, draft_dir: str | Path, dtype: torch.dtype, device: str,
                 block_size: int, num_blocks: int, target_vocab: dict[str, int], target_vocab_size: int,
                 max_model_len: int, catch_up_tokens: int) -> None:
        loaded = load_model(draft_dir, dtype, device, block_size, max_model_len)
        if loaded.tokenizer.get_vocab() != target_vocab or loaded.vocab_size != target_vocab_size:
            raise ValueError(f"draft model {str(draft_dir)!r} does not have the target's tokenizer and vocabulary: "
                             "its drafts would be other tokens; give a draft trained for this model")
        if loaded.max_model_len < max_model_len:
            raise ValueError(f"draft model {str(draft_dir)!r} reaches {loaded.max_model_len} tokens, fewer "
                             f"than the target's max_model_len={max_model_len}")
        self.config = config
        # Its weights' digest: a transfer's draft KV is taken only from the same weights (a draft of the
        # same name retrained elsewhere would be KV of another model)
        self.weights_digest = model_digest(draft_dir)
        self.block_size = block_size
        self.catch_up_tokens = catch_up_tokens  # prompt tokens fed to the draft per step at most, over all sequences
        self._calls = 0
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        self.runner = ModelRunner(loaded.model, PagedKVCache(loaded.kv_layout, num_blocks, device), device)
        self.pass_cost = DraftPassCost()
        # What the draft's guesses were worth lately, over every sequence: a sequence's starting belief.
        self.confidence = AcceptanceRecord(WORKER_RECORD_DECAY)
        self.calibration = GuessCalibration()
        self._states: dict[str, _DraftState] = {}

    def propose(self, requests: list[DraftRequest], worth: DraftWorth) -> list[Draft]:
        self._calls += 1
        self.confidence.tick()
        self.calibration.tick()
        for request in requests:
            self._states.setdefault(request.seq.request_id, _DraftState()).confidence.tick()
        tokens: dict[str, list[int]] = {r.seq.request_id: [] for r in requests}
        chances: dict[str, list[float]] = {r.seq.request_id: [] for r in requests}
        guessed: dict[str, list[float]] = {r.seq.request_id: [] for r in requests}
        if requests and self._worth_a_pass(requests, chances, worth):
            active = [r for r in requests if self._reserve(r, requests)]
            # Those far behind are fed their prompt first (within a budget); the rest of it, next step.
            self._catch_up_prompts([r.seq for r in active if self._behind(r.seq) > self.config.max_draft_tokens + 1])
            active = [r for r in active if self._behind(r.seq) <= self.config.max_draft_tokens + 1]
        else:
            active = []
        while active and self._worth_a_pass(active, chances, worth):
            # The first pass feeds what each sequence's draft KV lacks; each later one its newest guess.
            runs = [self._guess_run(r.seq, tokens[r.seq.request_id]) for r in active]
            t0 = time.perf_counter()
            probs = torch.softmax(self.runner.forward(runs).float(), dim=-1).max(dim=-1)
            self.pass_cost.observe(len(active), sum(len(run.input_ids) for run in runs), time.perf_counter() - t0)
            still: list[DraftRequest] = []
            for request, p, token in zip(active, probs.values.tolist(), probs.indices.tolist()):
                rid = request.seq.request_id
                self._written(request.seq, tokens[rid])
                accepted = self._token_chance(request, p)
                guessed[rid].append(p)
                self._states[rid].confidence.observe(accepted, 1.0 - accepted)
                self.confidence.observe(accepted, 1.0 - accepted)
                chance = (chances[rid][-1] if chances[rid] else 1.0) * accepted
                if chance < self.config.min_token_prob:
                    continue
                tokens[rid].append(token)
                chances[rid].append(chance)
                if len(tokens[rid]) < request.max_tokens:
                    still.append(request)
            active = still
        drafts = [Draft(tokens[r.seq.request_id], chances[r.seq.request_id]) for r in requests]
        for request, draft in zip(requests, drafts):
            state = self._states[request.seq.request_id]
            state.proposed, state.guess_probabilities = draft.tokens, guessed[request.seq.request_id]
            state.proposed_at = len(request.seq.output_token_ids)
        return drafts

    def verified(self, seq: Sequence, draft: list[int], accepted: int) -> None:
        state = self._states.get(seq.request_id)
        if state is None or state.proposed_at != len(seq.output_token_ids) or draft != state.proposed[: len(draft)]:
            return  # another proposer's draft tells nothing
        seq.num_model_verifications += 1
        if not seq.params.is_greedy:
            return  # sampled requests' guesses need no calibration
        for j in range(min(accepted + 1, len(draft))):
            self.calibration.observe(state.guess_probabilities[j], j < accepted)

    def _token_chance(self, request: DraftRequest, p: float) -> float:
        """The chance that the target accepts the draft's guess, whose probability under the draft is
        `p`. A sampled request accepts it when its own draw lands there: about `p` (the draft was
        distilled to the target's distribution). A greedy one accepts it when it is also the target's
        likeliest token, which `p` understates (a distilled draft spreads its probability as the target
        does): as often as such guesses were (`GuessCalibration`), no more than its record allows."""
        if not request.seq.params.is_greedy:
            return p
        return min(request.acceptance, self.calibration.chance(p, prior=request.acceptance))

    def _worth_a_pass(self, active: list[DraftRequest], chances: dict[str, list[float]], worth: DraftWorth) -> bool:
        """Whether the tokens the next pass is expected to add save more than the pass costs (the first
        pass: and the verification it leads to): each sequence's chance that its draft so far is
        accepted (capped by its record) times the chance of one more token (its record, capped by what
        the draft's guesses for it were worth lately). A step's first pass takes each record at one
        standard error above its rate: a record of a verification or two is mostly luck, and without
        passes it learns nothing (one unlucky draft used to shut the draft model out of a request for
        good); a long record of failures still stops it."""
        expected = 0.0
        tokens = 0
        for request in active:
            so_far = chances[request.seq.request_id]
            # a first pass feeds what was accepted since (a prompt's catch-up is priced apart: its tokens
            # are fed once, and only to a sequence worth drafting for)
            tokens += 1 if so_far else min(self._behind(request.seq), self.config.max_draft_tokens + 1)
            reached = min(so_far[-1], request.acceptance ** len(so_far)) if so_far else 1.0
            own = request.acceptance if so_far else min(1.0, request.acceptance + request.uncertainty)
            usual = self.confidence.rate(prior=own)
            sure = self._states[request.seq.request_id].confidence.rate(prior=usual)
            expected += reached * min(own, sure)
        first = not any(chances[r.seq.request_id] for r in active)
        return expected * worth.token_s > self.pass_cost.seconds(len(active), tokens) + first * worth.verify_s

    def profile(self, batches: tuple[int, ...], context: int, rounds: int = 3) -> list[tuple[int, int, float]]:
        """Time passes over `context` tokens of draft KV for each of `batches` sequences, each feeding
        one token and feeding a whole first pass's (`max_draft_tokens + 1`) per sequence; feed them to
        `pass_cost` as its anchors. Returns the samples: (sequences, tokens, seconds). The KV read is
        whatever the pool's blocks hold: only the time counts, and nothing is kept. Needs the pool free
        enough for the largest batch (else it measures the batches that fit)."""
        samples: list[tuple[int, int, float]] = []
        blocks_each = -(-(context + self.config.max_draft_tokens + 1) // self.block_size)
        for batch in batches:
            if not self.pool.can_allocate(batch * blocks_each):
                continue
            tables = [self.pool.allocate(blocks_each) for _ in range(batch)]
            try:
                for fed in (1, self.config.max_draft_tokens + 1):
                    runs = [TokenRun([3] * fed, context, table, as_decode=True, num_logits=1) for table in tables]
                    for repeat in range(1 + rounds):  # the first warms up
                        t0 = time.perf_counter()
                        self.runner.forward(runs)
                        if repeat:
                            samples.append((batch, batch * fed, time.perf_counter() - t0))
            finally:
                for table in tables:
                    self.pool.free(table)
        self.pass_cost.add_profile(samples)
        return samples

    def finished(self, seq: Sequence) -> None:
        state = self._states.pop(seq.request_id, None)
        if state is not None:
            self.pool.free(state.blocks)

    def _reserve(self, request: DraftRequest, batch: list[DraftRequest]) -> bool:
        """Blocks for the sequence's tokens and a whole draft; False (no draft this step) when the pool
        cannot hold them even after dropping the draft KV of the sequences drafted for longest ago
        (outside this step), as few as needed."""
        seq = request.seq
        state = self._states[seq.request_id]
        state.used_at = self._calls
        need = -(-(seq.num_tokens + request.max_tokens) // self.block_size) - len(state.blocks)
        if need <= 0:
            return True
        if not self._make_room(need, keep={r.seq.request_id for r in batch}):
            return False
        state.blocks.extend(self.pool.allocate(need))
        return True

    def _make_room(self, need: int, keep: set[str]) -> bool:
        """Whether `need` blocks are free, after dropping the draft KV of the sequences drafted for
        longest ago (as few as needed; not those in `keep`, nor one awaiting its draft KV); nothing is
        dropped when even all of them would not make the room."""
        idle = sorted((s.used_at, rid) for rid, s in self._states.items()
                      if rid not in keep and s.blocks and not s.importing)
        if self.pool.num_free + sum(len(self._states[rid].blocks) for _, rid in idle) < need:
            return False
        for _, rid in idle:
            if self.pool.can_allocate(need):
                break
            dropped = self._states[rid]
            self.pool.free(dropped.blocks)
            dropped.blocks, dropped.computed, dropped.fed = [], 0, []
        return self.pool.can_allocate(need)

    def _behind(self, seq: Sequence) -> int:
        state = self._states.get(seq.request_id)
        return seq.num_tokens - (state.computed if state is not None else 0)

    def _catch_up_prompts(self, seqs: list[Sequence]) -> None:
        """Feed sequences far behind (a new prompt, or draft KV dropped) their missing tokens but the
        newest as prompt chunks, no more than the engine's own chunk budget in all this step: those fed
        whole draft in this step's passes, the others when they have caught up."""
        budget = self.catch_up_tokens
        runs: list[tuple[Sequence, TokenRun]] = []
        for seq in seqs:
            state = self._states[seq.request_id]
            take = min(budget, self._behind(seq) - 1)  # the newest token is fed with the first guess
            if take <= 0:
                break
            first = state.computed
            runs.append((seq, TokenRun(seq.token_ids[first : first + take], first, state.blocks,
                                       as_decode=False, num_logits=0)))
            budget -= take
        if runs:
            self.runner.forward([run for _, run in runs])
            for seq, run in runs:
                state = self._states[seq.request_id]
                state.computed, state.fed = run.first_position + len(run.input_ids), []

    def _guess_run(self, seq: Sequence, drafted: list[int]) -> TokenRun:
        """What a pass feeds the sequence for its next guess: its newest draft token; before the first,
        its tokens that its draft KV lacks (after the longest prefix of the drafts fed last time that it
        did generate). Nothing changes until the pass has run (`_written`)."""
        state = self._states[seq.request_id]
        if drafted:
            return TokenRun([drafted[-1]], state.computed + len(state.fed), state.blocks, as_decode=True,
                            num_logits=1)
        tokens = seq.token_ids
        agreed = 0
        while (agreed < len(state.fed) and state.computed + agreed < len(tokens) - 1
               and tokens[state.computed + agreed] == state.fed[agreed]):
            agreed += 1
        first = min(state.computed + agreed, len(tokens) - 1)  # the newest token is always fed
        return TokenRun(tokens[first:], first, state.blocks, as_decode=first > 0, num_logits=1)

    def _written(self, seq: Sequence, drafted: list[int]) -> None:
        """A pass wrote the sequence's `_guess_run`: its tokens up to its length, or one more draft token."""
        state = self._states[seq.request_id]
        if drafted:
            state.fed.append(drafted[-1])
        else:
            state.computed, state.fed = len(seq.token_ids), []

    # --- the draft's prompt KV handed over (disaggregated deployments) ----------------------------
    @property
    def kv_identity(self) -> str:
        """What the two sides of a transfer must hold alike for one's draft KV to serve the other: the
        draft model named, its weights (by digest), and the shape of its KV."""
        layout = self.runner.kv_cache.layout
        return (f"{self.config.draft_model}|{self.weights_digest[:16]}|{layout.num_layers}x{layout.num_kv_heads}x"
                f"{layout.head_dim}|{layout.dtype}|{self.block_size}")

    def drafts_for(self, params: SamplingParams) -> bool:
        """Whether this draft model may draft for a request with `params` (its prompt KV is worth computing)."""
        return params.speculative and (self.config.method == "draft_model" or params.proposer != "suffix")

    def blocks_of(self, request_id: str) -> list[int]:
        state = self._states.get(request_id)
        return list(state.blocks) if state is not None else []

    def prompt_pass(self, chunks: list[ScheduledChunk], on_layer_written: Callable[[int, list[ScheduledChunk]], None]
                    | None = None) -> None:
        """On a prefill worker, after the target's pass over these prompt chunks: the draft's KV of each
        sequence's tokens up to its chunk's end, from the first its draft KV lacks (the draft keeps no
        prefix cache: a prompt the target found cached is fed from its start, within the step's
        catch-up budget). A sequence whose draft KV the pool cannot hold, or whose cached prefix is
        longer than the budget, is left out (its decode worker computes the draft's KV: the first token
        must not wait on a long pass of the draft). `on_layer_written(layer, chunks fed)` as each of the
        draft's layers is written."""
        fed: list[ScheduledChunk] = []
        runs: list[TokenRun] = []
        for chunk in chunks:
            seq = chunk.seq
            state = self._states.setdefault(seq.request_id, _DraftState())
            end = seq.num_computed_tokens + chunk.num_tokens
            need = -(-end // self.block_size) - len(state.blocks)
            behind = seq.num_computed_tokens - state.computed  # a cached prefix, or a chunk left out before
            if behind > self.catch_up_tokens or (need > 0 and not self.pool.can_allocate(need)):
                continue
            if need > 0:
                state.blocks.extend(self.pool.allocate(need))
            runs.append(TokenRun(seq.token_ids[state.computed : end], state.computed, state.blocks, as_decode=False,
                                 num_logits=0))
            fed.append(chunk)
        if not runs:
            return
        self.runner.forward(runs, None if on_layer_written is None else lambda layer: on_layer_written(layer, fed))
        for chunk, run in zip(fed, runs):
            state = self._states[chunk.seq.request_id]
            state.computed, state.fed = run.first_position + len(run.input_ids), []

    def reserve_import(self, request_id: str, num_tokens: int) -> list[int]:
        """On a decode worker: blocks for an incoming request's draft KV of `num_tokens` tokens, kept
        until `import_committed`; none when the pool has not that many free (the draft's prompt pass
        then runs here: a transfer's draft KV is not worth the draft KV of requests decoding now)."""
        need = -(-num_tokens // self.block_size)
        if not self.pool.can_allocate(need):
            return []
        state = self._states[request_id] = _DraftState(self.pool.allocate(need), used_at=self._calls, importing=True)
        return list(state.blocks)

    def import_committed(self, request_id: str, num_tokens: int) -> None:
        """The request's draft KV of its first `num_tokens` tokens arrived in its reserved blocks (0: none did)."""
        state = self._states.get(request_id)
        if state is not None:
            state.importing, state.computed, state.fed = False, num_tokens, []
