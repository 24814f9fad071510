"""A simulated engine: the scheduler of `engine.scheduler` at the level of token and block counts, its
steps timed by a measured profile (`costs.WorkerCosts`) instead of run.

It keeps what decides latency: continuous batching under a per-step token budget and `max_num_seqs`,
chunked prompts (`chunk_limit`), running sequences first, then committed imports, then waiting
prompts; imports whose blocks are reserved before their KV arrives (`reserve_import`, as
`LLMEngine.begin_import`, prefix hits included) and queued when committed; a worker's calls run
between steps, as its engine loop runs them (`call`); KV blocks, with the most recently admitted
sequence preempted (and recomputed) when a running one needs a block and none is free; and a prefix
cache of chained block hashes (blocks in use shared, freed ones evictable, least recently freed first)
whose stores and removals are reported to a listener, as a worker's KV events feed the router's index.
Speculative decoding, where the manifest has it, is `sim_speculation`'s: a decoding sequence may gain
several tokens in a step. It leaves out what does not decide latency: token values, sampling, stop
strings (every request generates its trace's output length).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from pdserve.cluster.plan.costs import WorkerCosts
from pdserve.cluster.plan.sim_speculation import SimSpeculation
from pdserve.engine.speculative.sizing import DecodeStepShape


class IndexEvent(NamedTuple):
    """A block stored in or removed from a worker's prefix cache: the fields `PrefixIndex.apply` reads of
    a worker's `KVEvent`."""

    block_hash: bytes
    parent_hash: bytes | None
    removed: bool


@dataclass(eq=False, slots=True)  # (slots: read and written at every simulated step)
class SimSequence:
    """One request in one engine. `num_tokens`: prompt + tokens generated so far (the newest has no KV
    yet while decoding)."""

    request_id: str
    prompt_len: int
    output_len: int
    block_hashes: list[bytes]  # the prompt's cacheable full blocks, chained
    prefill_only: bool = False  # a prefill worker's: ends at its first token, its blocks held until handed off
    short: bool = False  # in LAPS's short queue
    num_tokens: int = 0
    computed: int = 0
    generated: int = 0
    cached_tokens: int = 0  # found in the prefix cache when first admitted
    preemptions: int = 0
    plain_blocks: int = 0  # blocks it holds that no hash names
    draft_computed: int = 0  # tokens of its context a draft model holds KV of (speculative decoding)
    refs: list[bytes] = field(default_factory=list)  # cached blocks it holds, in order (its leading blocks)
    tower_s: float = 0.0  # its images' pass, run on the engine loop as it is added (none encoded elsewhere)

    def __post_init__(self) -> None:
        self.num_tokens = self.num_tokens or self.prompt_len

    @property
    def uncomputed(self) -> int:
        return self.num_tokens - self.computed

    @property
    def num_blocks(self) -> int:
        return self.plain_blocks + len(self.refs)


class EngineListener(Protocol):
    def step_started(self, engine: "SimEngine") -> float:
        """A step starts: how many times longer than alone it takes (cores shared with other workers)."""

    def sampled(self, engine: "SimEngine", seq: SimSequence, tokens: int, now: float) -> None:
        """A step ending at `now` gave `seq` its next `tokens` tokens (its `generated` already counts them)."""

    def step_ended(self, engine: "SimEngine", now: float) -> None:
        """A step ended; blocks may have come free."""


@dataclass(frozen=True)
class EngineLimits:
    total_blocks: int
    block_size: int
    step_budget: int  # max_num_batched_tokens
    chunk_limit: int  # the longest prompt chunk of one sequence in one step
    max_num_seqs: int


class SimEngine:
    def __init__(self, name: str, costs: WorkerCosts, limits: EngineLimits, listener: EngineListener,
                 schedule_at: Callable[[float, Callable[[float], None]], None],
                 on_cache_events: Callable[[str, list[IndexEvent]], None] | None = None,
                 step_overhead: Callable[[int], float] = lambda decode_seqs: 0.0,
                 speculation: SimSpeculation | None = None) -> None:
        self.name = name
        self.speculation = speculation
        self.decode_shape = DecodeStepShape()  # what drafts add to its decode steps, as a worker reports it
        self.step_overhead = step_overhead  # what a serving worker adds to a step streaming tokens of this many
        self.costs = costs
        self.limits = limits
        self.listener = listener
        self._schedule_at = schedule_at  # the simulator's clock: run a callback at a time
        self._on_cache_events = on_cache_events
        self.free_plain = limits.total_blocks  # blocks neither held nor cached
        self.evictable: OrderedDict[bytes, bytes | None] = OrderedDict()  # cached, held by none (hash -> parent)
        self.in_use: dict[bytes, int] = {}  # cached blocks held, by how many sequences
        self.waiting: deque[SimSequence] = deque()
        self.ready: deque[SimSequence] = deque()
        self.running: list[SimSequence] = []
        self.importing: set[SimSequence] = set()  # blocks reserved, KV not yet committed
        self._calls: deque[Callable[[float], None]] = deque()  # run when the step ends
        self.busy = False  # a step is running
        self.holding = False  # a call holds the engine loop (a vision-tower pass): no step, no other call
        self.busy_s = 0.0
        self.steps = 0
        self.preemptions = 0
        self._events: list[IndexEvent] = []

    # --- what the simulator asks ----------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return self.free_plain + len(self.evictable)

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.ready) + len(self.running) + len(self.importing)

    def check_drained(self) -> None:
        """After a run: every block back, nothing held (a leak in the simulation is a bug)."""
        if self.num_requests or self._calls or self.holding or self.in_use or self.free_blocks != self.limits.total_blocks:
            raise RuntimeError(f"{self.name}: the run ended holding {self.num_requests} requests, "
                               f"{self.limits.total_blocks - self.free_blocks} blocks and {len(self._calls)} calls")

    @property
    def pending_tokens(self) -> int:
        return sum(s.uncomputed for queue in (self.waiting, self.ready, self.running) for s in queue)

    def add(self, seq: SimSequence, now: float) -> None:
        self.add_many([seq], now)

    def add_many(self, seqs: list[SimSequence], now: float,
                 added: Callable[[float], None] = lambda now: None) -> None:
        """Queue `seqs` at once: an idle engine's next step can take them all; `added` runs once they are
        queued (the call that adds them has returned). Their images not encoded elsewhere are encoded
        first, on the engine loop, between steps (`hold`)."""
        tower_s = sum(seq.tower_s for seq in seqs)
        if not tower_s:
            self.waiting.extend(seqs)
            added(now)
            self.kick(now)
            return

        def queued(t: float) -> None:
            self.waiting.extend(seqs)
            added(t)

        self.call(lambda t: self.hold(tower_s, queued, t), now)

    def call(self, command: Callable[[float], None], now: float) -> None:
        """Run `command` as the engine loop runs a worker's call: between steps (now, when idle)."""
        if self.busy or self.holding:
            self._calls.append(command)
        else:
            command(now)

    def hold(self, seconds: float, then: Callable[[float], None], now: float) -> None:
        """From a call: the engine loop is held for `seconds` (a request's images encoded as it is added,
        on the loop); then `then` runs (it must not step the engine), then the calls queued meanwhile,
        then the next step, as the loop runs them. Its cores count as a step's do."""
        self.holding = True
        seconds *= self.listener.step_started(self)
        self.busy_s += seconds

        def end(t: float) -> None:
            self.holding = False
            then(t)
            self.listener.step_ended(self, t)
            self._run_calls(t)
            self.kick(t)

        self._schedule_at(now + seconds, end)

    def _run_calls(self, now: float) -> None:
        """The calls queued meanwhile, in order, until one holds the loop (the rest wait for it)."""
        while self._calls and not self.holding:
            self._calls.popleft()(now)

    def reserve_import(self, seq: SimSequence) -> bool:
        """Take the blocks of an incoming sequence's prompt KV, its cached leading blocks shared; False
        (nothing taken) when they do not fit (the caller tries again once blocks come free)."""
        hits = self._lookup(seq)
        need = -(-seq.prompt_len // self.limits.block_size) - hits
        if need > self.free_blocks - sum(h in self.evictable for h in seq.block_hashes[:hits]):
            return False
        for h in seq.block_hashes[:hits]:
            self._hold(h)
        self._allocate(need)
        seq.refs, seq.plain_blocks = list(seq.block_hashes[:hits]), need
        self.importing.add(seq)
        return True

    def commit_import(self, seq: SimSequence, now: float) -> None:
        """Its KV arrived with its first token: it joins the batch (its full blocks now cached)."""
        self.importing.remove(seq)
        seq.num_tokens, seq.computed, seq.generated = seq.prompt_len + 1, seq.prompt_len, 1
        if self.speculation is not None and self.speculation.draft_kv_sent:
            seq.draft_computed = seq.prompt_len
        self._publish(seq)
        self._flush_events()
        self.ready.append(seq)
        self.kick(now)

    def cancel_import(self, seq: SimSequence, now: float) -> None:
        """The request ended before its KV came (done at its first token): its reservation is freed."""
        self.importing.remove(seq)
        self.release(seq, now)

    def release(self, seq: SimSequence, now: float) -> None:
        """Free what `seq` holds (a prefill-only sequence once its KV is handed off)."""
        self._free(seq)
        self._flush_events()
        self.kick(now)

    def kick(self, now: float) -> None:
        """Start a step if idle with work to do."""
        if self.busy or self.holding or not (self.waiting or self.ready or self.running):
            return
        chunks, preempted = self._schedule()
        while not chunks and preempted:  # what it preempted freed blocks: the engine loop steps again
            chunks, preempted = self._schedule()
        self._flush_events()
        if not chunks:
            return  # waiting for blocks a handoff releases (it kicks again)
        # a sequence computing its newest token (not a recomputed chunk of one token after a preemption)
        decoding: list[SimSequence] = []
        prompt_tokens = prompt_quad = decode_context = 0
        for seq, n in chunks:
            if n == 1 and seq.generated and seq.num_tokens - seq.computed == 1:
                decoding.append(seq)
                decode_context += seq.computed + 1
            else:
                prompt_tokens += n
                prompt_quad += n * (seq.computed + n)
        drafts: dict[SimSequence, tuple[int, bool]] = {}  # draft tokens verified, by the draft model
        decode_scale, draft_s = 1.0, 0.0
        if self.speculation is not None and decoding:
            plain_s = self.costs.decode.step_s(len(decoding), decode_context / len(decoding))
            spec = self.speculation.size([s.computed for s in decoding], [s.output_len - s.generated for s in decoding],
                                         [max(0, s.computed - s.draft_computed) for s in decoding], plain_s,
                                         prompt_tokens, prompt_quad)
            drafts = {seq: (k, m) for seq, k, m in zip(decoding, spec.lengths, spec.by_model) if k}
            decode_scale, draft_s = spec.decode_scale, spec.draft_s
            self.decode_shape.observe(len(decoding) + sum(spec.lengths), len(decoding), draft_s)
        seconds = self.costs.step_s(len(decoding), decode_context, prompt_tokens, prompt_quad, decode_scale)
        if decoding:
            seconds += draft_s + self.step_overhead(len(decoding))
        seconds *= self.listener.step_started(self)
        self.busy = True
        self.busy_s += seconds
        self.steps += 1
        self._schedule_at(now + seconds, lambda end: self._end_step(chunks, drafts, end))

    # --- one step -------------------------------------------------------------------------------
    def _schedule(self) -> tuple[list[tuple[SimSequence, int]], bool]:
        """This step's chunks, and whether it preempted anything (as `Scheduler.schedule`)."""
        lim = self.limits
        chunks: list[tuple[SimSequence, int]] = []
        budget, preempted, index = lim.step_budget, False, 0
        block_size, running = lim.block_size, self.running
        while index < len(running) and budget > 0:
            seq = running[index]
            n = min(seq.num_tokens - seq.computed, budget, lim.chunk_limit)
            # (`_blocks_needed`, inline: this loop runs for every sequence at every step)
            need = max(0, -(-(seq.computed + n) // block_size) - seq.plain_blocks - len(seq.refs))
            while need and not self._allocate(need):  # (most decode steps need no block)
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                seq.plain_blocks += need
                chunks.append((seq, n))
                budget -= n
                index += 1
                continue
            break
        while self.ready and budget > 0 and not preempted and len(running) < lim.max_num_seqs:
            seq = self.ready[0]
            n = min(seq.uncomputed, budget, lim.chunk_limit)
            need = self._blocks_needed(seq, n)
            # Imports queued behind it give their blocks back (recomputed later); with nothing running
            # to finish, at last the head itself does.
            while need > self.free_blocks and (len(self.ready) > 1 or not running):
                self._preempt(self.ready.pop())
                preempted = True
            if not self.ready or not self._allocate(need):
                break
            self.ready.popleft()
            seq.plain_blocks += need
            running.append(seq)
            chunks.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and not preempted and len(running) < lim.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if not n:
                break
            self.waiting.popleft()
            running.append(seq)
            chunks.append((seq, n))
            budget -= n
        return chunks, preempted

    def _lookup(self, seq: SimSequence) -> int:
        """How many of `seq`'s leading blocks the prefix cache holds (only the cacheable blocks: at least
        one token is left to compute)."""
        hits = 0
        for h in seq.block_hashes:
            if h not in self.in_use and h not in self.evictable:
                break
            hits += 1
        return hits

    def _admit(self, seq: SimSequence, budget: int) -> int:
        """Take `seq`'s cached leading blocks and the blocks of its first chunk; the chunk's tokens, or 0
        (nothing taken) when its blocks do not fit."""
        hits = self._lookup(seq)
        for h in seq.block_hashes[:hits]:
            self._hold(h)
        seq.refs = list(seq.block_hashes[:hits])
        seq.computed = hits * self.limits.block_size
        n = min(seq.uncomputed, budget, self.limits.chunk_limit)
        need = self._blocks_needed(seq, n)
        if not self._allocate(need):
            self._free(seq)
            seq.computed = 0
            return 0
        seq.plain_blocks = need
        if not seq.preemptions:
            seq.cached_tokens = seq.computed
        return n

    def _end_step(self, chunks: list[tuple[SimSequence, int]], drafts: dict[SimSequence, tuple[int, bool]],
                  now: float) -> None:
        """The step's outputs (each sequence's accepted draft tokens, then the token sampled after them),
        then the calls queued meanwhile (still busy: what they add waits for the next step, as every
        command the engine loop holds runs before it steps again), then the next step."""
        sampled = self.listener.sampled
        for seq, n in chunks:
            seq.computed += n
            if len(seq.refs) < len(seq.block_hashes):  # (a decoding sequence has published its prompt)
                self._publish(seq)
            if seq.computed < seq.num_tokens:
                continue
            drafted, by_model = drafts.get(seq, (0, False)) if drafts else (0, False)
            accepted = self._keep_accepted(seq, self.speculation.accepted(drafted)) if drafted else 0
            seq.computed += accepted
            if by_model:  # its draft KV holds all but the token sampled after the draft (fed with the next one)
                seq.draft_computed = seq.computed
            seq.generated += 1 + accepted
            if seq.prefill_only or seq.generated >= seq.output_len:
                self.running.remove(seq)
                if not seq.prefill_only:
                    self._free(seq)
            else:
                seq.num_tokens += 1 + accepted
            sampled(self, seq, 1 + accepted, now)
        self._flush_events()
        self._run_calls(now)
        self.busy = False
        self.listener.step_ended(self, now)
        self.kick(now)

    def _keep_accepted(self, seq: SimSequence, accepted: int) -> int:
        """Of `accepted` draft tokens, those whose KV fits the blocks `seq` holds or can take (blocks
        for them are taken at the step's end; where none is left the draft is cut short, where the
        engine, which takes them for the whole draft before it verifies, would have verified less)."""
        need = self._blocks_needed(seq, accepted)
        while need and not self._allocate(need):
            accepted -= 1
            need = self._blocks_needed(seq, accepted)
        seq.plain_blocks += need
        return accepted

    # --- blocks ---------------------------------------------------------------------------------
    def _blocks_needed(self, seq: SimSequence, n: int) -> int:
        return max(0, -(-(seq.computed + n) // self.limits.block_size) - seq.num_blocks)

    def _allocate(self, n: int) -> bool:
        if n > self.free_blocks:
            return False
        take = min(n, self.free_plain)
        self.free_plain -= take
        for _ in range(n - take):  # evict the least recently freed cached blocks
            h, _parent = self.evictable.popitem(last=False)
            self._events.append(IndexEvent(h, None, True))
        return True

    def _hold(self, h: bytes) -> None:
        if h in self.in_use:
            self.in_use[h] += 1
        else:
            self.evictable.pop(h)
            self.in_use[h] = 1

    def _publish(self, seq: SimSequence) -> None:
        """The full prompt blocks `seq` computed become cached blocks (shared from now on)."""
        full = min(seq.computed // self.limits.block_size, len(seq.block_hashes))
        for i in range(len(seq.refs), full):
            h = seq.block_hashes[i]
            seq.plain_blocks -= 1
            seq.refs.append(h)
            if h in self.in_use or h in self.evictable:  # computed twice at once: one copy is kept
                self.free_plain += 1
                self._hold(h)
            else:
                self.in_use[h] = 1
                self._events.append(IndexEvent(h, seq.block_hashes[i - 1] if i else None, False))

    def _free(self, seq: SimSequence) -> None:
        """Give back `seq`'s blocks; its cached ones become evictable last block first, so a prefix is
        evicted from its end (as `BlockPool.free`)."""
        self.free_plain += seq.plain_blocks
        for h, parent in reversed(list(zip(seq.refs, [None, *seq.refs]))):
            left = self.in_use[h] - 1
            if left:
                self.in_use[h] = left
            else:
                del self.in_use[h]
                self.evictable[h] = parent
        seq.plain_blocks, seq.refs = 0, []

    def _preempt(self, seq: SimSequence) -> None:
        self._free(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _flush_events(self) -> None:
        if self._events and self._on_cache_events is not None:
            self._on_cache_events(self.name, self._events)
        self._events = []
