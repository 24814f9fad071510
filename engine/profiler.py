"""Start-up profiles of an engine: its prompt passes (the anchor samples of its step cost model) and,
where it decodes speculatively, its decode steps with drafts of several lengths (the anchors of the
decode step cost model that sizes speculation, `profile_decode`).

Prompts of a few lengths (powers of four up to the step budget and the context limit) are each
prefilled, twice; the first pass of each length is a warm-up and is not kept. Run it before the
engine serves, on an otherwise idle machine: the launcher profiles its workers one at a time, because
workers that profile side by side on shared cores measure each other.

The engine need not be idle, though: a worker that Ray restarted may already hold requests when it
profiles. Those go on being served: their outputs go to `on_outputs`, as the engine loop's would, and
the pool's listener keeps hearing of their blocks. A step that runs anything besides the profile's own
prompt is not kept as a sample (it would measure two prompts as one), so a busy engine yields fewer
samples, or none: a worker whose profile is not `complete` (a length without its sample) says it is
not profiled, and the supervisor has it profile again (with no new work placed on it meanwhile). The profile's
prompts are random tokens that share no prefix with anything; their cached blocks are nobody's news
(hidden from the listener) and are forgotten afterwards, so the profile neither warms the prefix
cache nor leaks KV.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.engine.block_pool import CacheListener, hash_prompt_blocks
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import RequestOutput, SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.draft import Draft, DraftRequest, DraftWorth, WorkerRecord
from pdserve.engine.speculative.sizing import DecodeStepShape

PROFILE_LENGTHS = (8, 32, 128, 512, 2048)
ROUNDS = 2  # per length; the first is a warm-up
MAX_WAIT_STEPS = 32  # steps a profile prompt may wait to be scheduled on a busy engine before it is given up


@dataclass(frozen=True)
class Profile:
    samples: list[tuple[int, int, float]]  # (tokens, quad, seconds) of the passes kept
    complete: bool  # every length has its sample (not so on a busy engine: profile again later)


class _HidingListener:
    """Passes the pool's events on, except those of the hashes in `hidden`."""

    def __init__(self, listener: CacheListener, hidden: set[bytes]) -> None:
        self.listener = listener
        self.hidden = hidden

    def stored(self, block_hash: bytes, parent_hash: bytes | None) -> None:
        if block_hash not in self.hidden:
            self.listener.stored(block_hash, parent_hash)

    def removed(self, block_hash: bytes) -> None:
        if block_hash not in self.hidden:
            self.listener.removed(block_hash)


def profile_prefill(engine: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None],
                    lengths: tuple[int, ...] = PROFILE_LENGTHS, seed: int = 0) -> Profile:
    """Measure prompt passes; feed them to `engine.step_costs` when every length has its sample.
    Outputs of the engine's other requests go to `on_outputs`. An engine given a stored profile's costs
    (`EngineConfig.stored_step_cost`) runs one warm-up pass only (a first pass pays one-off set-up that
    would otherwise land on the first request) and is fed passes computed from those costs."""
    limit = min(engine.config.chunk_limit, engine.max_model_len - 1)
    lengths = tuple(sorted({min(n, limit) for n in lengths}))
    stored = engine.config.stored_step_cost
    # (prompt length, kept as a sample): each length's first pass is a warm-up
    passes = [(lengths[0], False)] if stored is not None else [(n, r > 0) for n in lengths for r in range(ROUNDS)]
    rng = random.Random(seed)
    pool = engine.pool
    ours: set[bytes] = set()  # block hashes of the profile's prompts
    listener = pool.listener
    if listener is not None:
        pool.listener = _HidingListener(listener, ours)
    samples: list[tuple[int, int, float]] = []
    request_id: str | None = None
    try:
        for n, keep in passes:
            prompt = [rng.randrange(engine.vocab_size) for _ in range(n)]
            ours.update(hash_prompt_blocks(prompt, engine.config.block_size))
            request_id = engine.add_request(prompt, SamplingParams.greedy(max_tokens=1))  # ends at its first token
            samples += _prefill_alone(engine, request_id, n, on_outputs, keep=keep)
    finally:
        if request_id is not None:
            engine.abort_request(request_id)  # still there only when a step or `on_outputs` failed
        pool.forget_cached(ours)  # their blocks are free: every profile prompt has finished or failed
        pool.listener = listener
    if stored is not None:  # the stored fit's passes at these lengths are the anchors
        samples = [(n, n * n, stored.prefill_s(n)) for n in lengths]
    profile = Profile(samples, complete={n for n, _, _ in samples} == set(lengths))
    if profile.complete:  # a partial one would weigh the lengths a busy engine let through twice, when redone
        engine.step_costs.add_profile(samples)
    return profile


def _prefill_alone(engine: LLMEngine, request_id: str, prompt_len: int,
                   on_outputs: Callable[[list[RequestOutput]], None], keep: bool) -> Iterable[tuple[int, int, float]]:
    """Step until `request_id` has its token; yield the steps that ran its whole prompt alone. Gives
    the prompt up when a step runs nothing (the blocks it needs are held by requests that only the
    engine loop's commands release, and none runs until the profile ends), or when it waits
    `MAX_WAIT_STEPS` steps behind a full batch (commands wait meanwhile)."""
    waited = 0
    while request_id in engine.requests:
        computed = engine.requests[request_id].num_computed_tokens
        outputs = [out for out in engine.step() if out.request_id != request_id]
        if outputs:
            on_outputs(outputs)
        stats = engine.last_step
        ran_ours = request_id not in engine.requests or engine.requests[request_id].num_computed_tokens > computed
        waited = 0 if ran_ours else waited + 1
        if stats.num_seqs == 0 or waited > MAX_WAIT_STEPS:
            engine.abort_request(request_id)
            return
        if keep and stats.num_seqs == 1 and ran_ours and stats.num_tokens == prompt_len:  # whole, and alone
            yield stats.num_tokens, stats.quad_tokens, stats.total_s



DECODE_BATCHES = (1, 8, 32)
DRAFT_LENGTHS = (0, 1, 4, 8)
DECODE_CONTEXTS = (64, 512)  # prompt tokens of the profiled requests: a short context and a long one
DECODE_STEPS = 4  # measured steps per batch and draft length, after one warm-up step


class _FixedDraft:
    """Proposes `length` copies of a token for every sequence: what the decode profile verifies."""

    def __init__(self) -> None:
        self.length = 0

    def propose(self, requests: list[DraftRequest], worth: DraftWorth) -> list[Draft]:
        return [Draft([0] * min(self.length, r.max_tokens), [1.0] * min(self.length, r.max_tokens)) for r in requests]

    def verified(self, seq: Sequence, draft: list[int], accepted: int) -> None:
        pass

    def finished(self, seq: Sequence) -> None:
        pass


def profile_decode(engine: LLMEngine, contexts: tuple[int, ...] = DECODE_CONTEXTS,
                   seed: int = 0) -> list[tuple[int, int, bool, int, int, float]]:
    """Measure decode steps of `DECODE_BATCHES` requests with prompts of each of `contexts` tokens,
    verifying drafts of each of `DRAFT_LENGTHS` tokens where the engine speculates (rejected drafts: they
    cost what accepted ones do); feed them to `engine.decode_step_costs` as anchors. Two contexts tell
    attention's cost from a sequence's. Where the engine is not idle (a restarted worker already
    serving) or its context is too short, nothing is measured: the decode cost is then learned from
    serving alone. A draft model's passes are profiled too (`DraftModelProposer.profile`). Returns the
    samples kept: (tokens, attention term, verified drafts, sequences, keys read, seconds)."""
    lengths = DRAFT_LENGTHS if engine.config.speculative is not None else (0,)
    steps_each = (1 + DECODE_STEPS) * (1 + max(lengths))
    room = engine.max_model_len - 1 - MAX_WAIT_STEPS - steps_each * len(lengths)
    contexts = tuple(sorted({min(c, room) for c in contexts if min(c, room) >= 1}))
    if engine.requests or not contexts:
        return []
    rng = random.Random(seed)
    config, proposer, acceptance, shape = engine.config, engine.proposer, engine.acceptance, engine.decode_step_shape
    drafts = _FixedDraft()
    engine.acceptance, engine.decode_step_shape = WorkerRecord(acceptance.greedy.decay), DecodeStepShape()
    if config.speculative is not None:
        engine.config = dataclasses.replace(config, speculative=dataclasses.replace(config.speculative,
                                                                                   goodput_sizing=False))
        engine.proposer = drafts
    ours: set[bytes] = set()
    samples: list[tuple[int, int, bool, int, int, float]] = []
    try:
        for prompt_len, batch in itertools.product(contexts, DECODE_BATCHES):
            prompts = [[rng.randrange(engine.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
            # Long enough to outlast the wait: the first prompts decode while the last are prefilled.
            params = SamplingParams.greedy(max_tokens=MAX_WAIT_STEPS + steps_each * len(lengths), ignore_eos=True)
            ids = [engine.add_request(p, params) for p in prompts]
            try:
                drafts.length = 0
                for _ in range(MAX_WAIT_STEPS):  # their prompt passes (bounded: a small pool may not hold them)
                    if all(engine.requests[i].num_uncomputed_tokens == 1 for i in ids):
                        break
                    engine.step()
                else:
                    continue
                for length in lengths:
                    drafts.length = length
                    for step in range(1 + DECODE_STEPS):
                        engine.step()
                        stats = engine.last_step
                        if step and stats.num_seqs == stats.num_decode_seqs == batch:
                            samples.append((stats.num_tokens, stats.quad_tokens, length > 0, batch,
                                            stats.keys_read, stats.total_s - stats.propose_s))
            finally:
                for request_id in ids:
                    if request_id in engine.requests:  # the blocks its output filled are cached too
                        ours.update(engine.requests[request_id].block_hashes)
                    engine.abort_request(request_id)
    finally:  # its rejected drafts are no news of what requests accept, nor its steps of what they verify
        engine.config, engine.proposer, engine.acceptance = config, proposer, acceptance
        engine.decode_step_shape = shape
        engine.pool.forget_cached(ours)
    engine.decode_step_costs.add_profile(samples)
    if engine.draft_model is not None:  # what its passes cost, one token per sequence and a first pass's
        engine.draft_model.profile(DECODE_BATCHES, max(contexts))
    return samples
