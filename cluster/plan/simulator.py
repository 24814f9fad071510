"""A discrete-event simulator of a whole pdserve cluster, for a manifest, a profile and a workload.

Requests are placed by the router's own placement (`router.routing.Router`, its policies, admission
control and prefix index: the objects a cluster's router uses, over `WorkerRef`s whose health reports
the simulator writes every `ping_interval_s`, as the supervisor does); prefill workers queue their
prompts in the worker's own queues (`prefill_worker.queues`, LAPS included, on the simulated clock)
and run them in simulated engines (`sim_engine`). The KV protocol's timing is the sender's: a job
whose KV streams beside its pass (`layerwise_min_tokens`) asks its decode worker to reserve the
prompt's blocks as it is taken from the queues, any other as its pass ends; that worker's
engine loop answers between its steps (waiting for room when its pool is full), and no other job for
that decode worker starts while the reservation is unanswered (the sender's `reserving`); the KV
reaches the decode worker the profiled handoff time after both the last pass and the reservation,
and joins its batch when the commit runs there, again between steps. Every request's first token and
end become a `RequestRecord`, so the figures are `pdserve bench serve`'s own (`serve_metrics`): TTFT
and TPOT percentiles, attainment, goodput.

Images (a vision-language model's requests): with an encode pool (`pools.encode`), a request's images
go first to the encoder the router's own choice picks (`router.encoders.EncodePool`: the one holding
most of them, else the least busy), which runs one image pass at a time, in arrival order, over the
images its cache (least recently used, `server.images.embedding_cache_mb`) lacks; the request reaches
its prefill worker a dispatch later, and is queued there an embeddings handoff after that (the KV
handoff's line at the tokens whose KV weighs as much: the worker takes them as the call that brings
the request runs). Without one, the worker that runs the prompt pass runs the image pass on its
engine loop as the request joins the engine, holding its steps and its feeder (`SimEngine.hold`).

Left out, as they do not shape latency at a steady state: worker faults and retries, a reservation
that waits past `reserve_wait_s` (it waits here as long as it must; pools too small to pass work on
make the run raise), codecs, and token values. The router here places a request with images by its
prompt's exact length (the real one counts each image as a 1024x1024 one's tokens, as it places a
request before any image is decoded).

Speculative decoding (the manifest's `speculative`) needs the workload's drafting (`drafting`: how
often its decode steps verify drafts, how long, and how many are accepted) and a profile measured with it
(`costs.SpeculationCosts`); decode steps then verify drafts as `sim_speculation` sizes them, and
prefill workers that send a draft model's prompt KV take the profile's prompt pass with the draft's.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.cluster.bench.serve_metrics import Objective, RequestRecord, meets
from pdserve.cluster.bench.workload import TraceRequest
from pdserve.cluster.plan.costs import EncodeCost, HardwareProfile, WorkerCosts
from pdserve.cluster.plan.sim_engine import EngineLimits, IndexEvent, SimEngine, SimSequence
from pdserve.cluster.plan.sim_speculation import Drafting, SimSpeculation
from pdserve.engine.block_pool import KVPoolStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.frames import streams_beside_pass
from pdserve.prefill_worker.queues import PrefillQueues, laps_settings
from pdserve.router.admission import Overloaded
from pdserve.router.encoders import EncodePool, EncoderRef
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.routing import Placement, Router, RoutingSettings
from pdserve.router.workers import NoHealthyWorker, WorkerRef
from pdserve.wire import LifetimeEvent, WorkRequest, WorkerStatus


STALL_S = 10.0  # simulated seconds with requests in flight and no step, arrival or end: the run raises


@dataclass(frozen=True)
class SimImage:
    key: bytes  # equal keys: the same picture (an encoder's cache hit)
    tokens: int


@dataclass(frozen=True)
class SimRequest:
    """One request of a workload: when it arrives (seconds from the start), its prompt's token ids
    (their blocks decide prefix sharing; image tokens included), how many tokens it generates, and its
    images."""

    arrival_s: float
    prompt: list[int]
    output_len: int
    images: tuple[SimImage, ...] = ()


def unique_prompt(index: int, length: int) -> list[int]:
    """A prompt of `length` tokens that shares no block with any other index's (hashes are chained,
    so a different first token makes every block different)."""
    return [index] + [0] * (length - 1)


SHARED_BLOCK_TOKEN = 2**31  # shared blocks' first tokens count up from here, past any prompt's index


def trace_requests(shapes: Sequence[TraceRequest], arrivals: Sequence[float]) -> list[SimRequest]:
    """A request at each of `arrivals`, with the lengths of `shapes` in turn (over again when there are
    more arrivals). Prompts share the blocks their shapes' `hash_ids` name (a block of `block_tokens`
    tokens each); each pass over the shapes has blocks of its own, so that no pass is served from the
    cache of the one before. Every other token is the request's own."""
    shared: dict[tuple[int, int], int] = {}  # (pass, hash id): the block's first token

    def prompt(index: int, shape: TraceRequest, lap: int) -> list[int]:
        ids: list[int] = []
        for h in shape.hash_ids:
            ids += [shared.setdefault((lap, h), SHARED_BLOCK_TOKEN + len(shared))] + [0] * (shape.block_tokens - 1)
        ids = ids[:shape.prompt_len]
        return ids + (unique_prompt(index, shape.prompt_len - len(ids)) if len(ids) < shape.prompt_len else [])

    def images(shape: TraceRequest, lap: int) -> tuple[SimImage, ...]:
        return tuple(SimImage(f"{lap}:{image.key}".encode(), image.tokens) for image in shape.images)

    return [SimRequest(t, prompt(i + 1, shape, lap), shape.output_len, images(shape, lap))
            for i, t in enumerate(arrivals) for shape, lap in [(shapes[i % len(shapes)], i // len(shapes))]]


class _SimEncoder:
    """An encode worker: one image pass at a time, in arrival order, over the images its cache lacks."""

    def __init__(self, name: str, cost: EncodeCost, threads: int, cache_tokens: int, sim: ClusterSimulator) -> None:
        self.ref = EncoderRef(name, handle=None)  # what the router's choice reads (its requests in hand)
        self.cost = cost
        self.threads = threads
        self.cache_tokens = cache_tokens
        self.cached: OrderedDict[bytes, int] = OrderedDict()  # image -> its tokens, least recently used first
        self.cached_tokens = 0
        self.sim = sim
        self.queue: deque[_Flight] = deque()
        self.busy = False
        self.busy_s = 0.0
        self.passes = 0
        self.hits = self.misses = 0

    def put(self, flight: _Flight, now: float) -> None:
        self.queue.append(flight)
        if not self.busy:
            self._next(now)

    def _next(self, now: float) -> None:
        if not self.queue:
            return
        flight = self.queue.popleft()
        images = flight.spec.images
        missing = list({image.key: image for image in images if image.key not in self.cached}.values())
        self.hits += len(images) - len(missing)
        self.misses += len(missing)
        seconds = self.cost.pass_s(len(missing), sum(image.tokens for image in missing))
        seconds *= self.sim.cores_taken(self.threads)
        self.busy = True
        self.busy_s += seconds
        self.passes += bool(missing)
        self.sim.clock.at(now + seconds, lambda t: self._done(flight, t))

    def _done(self, flight: _Flight, now: float) -> None:
        self.sim.cores_given_back(self.threads)
        for image in flight.spec.images:  # as `EmbeddingCache.put`: one larger than the cache is not kept
            if image.key in self.cached:
                self.cached.move_to_end(image.key)
            elif image.tokens <= self.cache_tokens:
                self.cached[image.key] = image.tokens
                self.cached_tokens += image.tokens
                while self.cached_tokens > self.cache_tokens:
                    self.cached_tokens -= self.cached.popitem(last=False)[1]
        self.busy = False
        self.sim.encoded(self, flight, now)
        self._next(now)


@dataclass
class WorkerLoad:
    """What one simulated worker did over a run."""

    role: str
    busy_s: float
    steps: int
    preemptions: int


@dataclass
class SimResult:
    records: list[RequestRecord]
    workers: dict[str, WorkerLoad]
    routing: dict[str, Any]  # the router's counts (`Router.snapshot_stats`)
    events: int  # the simulator's events, over
    wall_s: float  # the simulation's own time
    # Stopped past its `MissBudget`: the requests it did not end are recorded as not simulated, and the
    # workers' loads and the router's counts are as they stood (a step may have been under way).
    stopped: bool = False


@dataclass(frozen=True)
class MissBudget:
    """A run stops as soon as so many requests have missed `objective` that fewer than `target` of them
    all can meet it: a goodput search needs only that such a run failed, and an overloaded run, its
    queues growing to the end, is the costliest to simulate."""

    objective: Objective
    target: float


NOT_SIMULATED = "not simulated: the run had already missed its objective"


class _RunFailed(Exception):
    """The run's `MissBudget` is spent (raised out of the event loop)."""


@dataclass(eq=False, slots=True)
class _Flight:
    """A request between arrival and end."""

    request_id: str
    spec: SimRequest
    record: RequestRecord  # its `events` are the request's lifetime events, in simulated seconds
    placement: Placement
    reservation: _Reservation | None = None  # its KV's on its decode worker, from when its pass starts
    prefilled: SimSequence | None = None  # its prefill worker's sequence, past its pass (its KV to send)
    missed: bool = False  # counted against the run's `MissBudget` (its first token came late)

    @property
    def events(self) -> dict[str, float]:
        return self.record.events


@dataclass(eq=False, slots=True)
class _Reservation:
    """A prompt's KV blocks asked of its decode worker (the sender's BOOTSTRAPPING until answered)."""

    side: _PrefillSide  # the prefill worker that asked: its next jobs for that decode worker wait for the answer
    decode: str
    blocks: SimSequence  # the decode engine's sequence for the import
    asked: bool = False  # beside the pass where its KV streams beside it, else as the pass ends
    answered: bool = False
    dropped: bool = False  # the request ended before the answer (the sender ended the transfer)


class _Clock:
    """The event queue: callbacks at simulated times, in order (ties in the order they were set)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[float], None]]] = []
        self._order = itertools.count()
        self.events = 0

    def at(self, when: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(self._queue, (max(when, self.now), next(self._order), callback))

    @property
    def pending(self) -> int:
        return len(self._queue)

    def run(self) -> None:
        while self._queue:
            self.now, _, callback = heapq.heappop(self._queue)
            self.events += 1
            callback(self.now)


class _PrefillSide:
    """A prefill worker's queues in front of its engine, fed as the worker's feeder thread does: LAPS's
    jobs as soon as they are due, FCFS jobs while the engine has less than a step's budget ahead; the
    jobs taken together are set up (their transfers) for `setup_s`, then join the engine in one
    command, run between two of its steps, so that they share a step; the feeder takes nothing more
    until that command has run."""

    def __init__(self, engine: SimEngine, clock: _Clock, laps_on: bool, short_tokens: int, window_s: float,
                 short_room: int, setup_s: float, on_start: Callable[[SimSequence, float], None]) -> None:
        self.engine = engine
        self.unanswered: Counter[str] = Counter()  # this worker's reservations not yet answered, by decode worker
        self.clock = clock
        self.on_start = on_start  # a job taken from the queues (its PREFILL_START)
        self.setup_s = setup_s  # from taking a job to its prompt in the engine (the transfer's set-up)
        self.new_tokens: dict[str, int] = {}  # the router's count of each queued or started prompt's uncached part
        self.decode_of: dict[str, str] = {}  # each queued or started prompt's decode worker: its queue key
        self.queues: PrefillQueues[SimSequence] = PrefillQueues(laps_on, short_tokens, window_s, short_room,
                                                                key=lambda seq: self.decode_of[seq.request_id],
                                                                clock=lambda: clock.now)
        self.started: dict[str, SimSequence] = {}  # taken from the queues, not past their first token
        self._setting_up = False  # the feeder is starting a batch
        self._poll_at: float | None = None

    def put(self, seq: SimSequence, new_tokens: int, decode: str, now: float) -> None:
        seq.short = self.queues.is_short(new_tokens)
        self.new_tokens[seq.request_id] = new_tokens
        self.decode_of[seq.request_id] = decode
        self.queues.put(seq, new_tokens, seq.short)
        self.feed(now)

    def asked(self, decode: str) -> None:
        self.unanswered[decode] += 1

    def answered(self, decode: str, now: float) -> None:
        """A reservation was answered (or ended): once `decode` has none left, its jobs may start."""
        self.unanswered[decode] -= 1
        if not self.unanswered[decode]:
            del self.unanswered[decode]
            if self.queues.queued:
                self.feed(now)

    def first_token(self, seq: SimSequence) -> None:
        self.started.pop(seq.request_id, None)
        self.new_tokens.pop(seq.request_id, None)
        self.decode_of.pop(seq.request_id, None)

    def feed(self, now: float) -> None:
        if not self.queues.queued:  # (called after each of its engine's steps: most often nothing waits)
            return
        budget = self.engine.limits.step_budget
        while not self._setting_up:
            if not self.queues.length_aware and self.engine.pending_tokens >= budget:
                return
            jobs = self.queues.due(self._long_busy, self._short_inflight, self.unanswered.keys)
            if not jobs:
                break
            for seq in jobs:
                self.started[seq.request_id] = seq
                self.on_start(seq, now)
            # The feeder sets their transfers up, then waits while the engine loop takes the prompts
            # in between two steps: it takes nothing more meanwhile.
            self._setting_up = True
            self.clock.at(now + self.setup_s,
                          lambda t, jobs=jobs: self.engine.call(lambda t2: self._joined(jobs, t2), t))
            return
        if self.queues.length_aware and self.queues.queued and self._poll_at is None:
            # shorts gather for a window that no event ends: look again, as the worker's feeder polls
            self._poll_at = now + max(self.queues.window_s / 2, 0.002)
            self.clock.at(self._poll_at, self._poll)

    def _joined(self, jobs: list[SimSequence], now: float) -> None:
        self.engine.add_many(jobs, now, self._fed)  # (after their image passes, where the loop runs them)

    def _fed(self, now: float) -> None:
        self._setting_up = False
        self.feed(now)

    def _poll(self, now: float) -> None:
        self._poll_at = None
        self.feed(now)

    def _long_busy(self) -> bool:
        """A long prompt holds the engine beyond its last chunk (as the worker's `_long_busy`)."""
        chunk = self.engine.limits.chunk_limit
        return any(not s.short and s.uncomputed > chunk for s in self.started.values())

    def _short_inflight(self) -> int:
        return sum(self.new_tokens[s.request_id] for s in self.started.values() if s.short)


def handoff_transport(manifest: Any) -> str:
    """The KV transport a manifest's handoffs are simulated with: `auto` is shared memory on a local
    cluster (one machine) and tcp on one it joins (across nodes)."""
    transport = manifest.kv_transfer.transport
    if transport != "auto":
        return transport
    return "shm" if manifest.ray.address == "local" else "tcp"


class ClusterSimulator:
    """One run of a workload on a manifest's deployment; its handoffs take the manifest's KV transport
    (`auto`: shm on one machine, tcp across machines), as profiled. `shared_cores`: the cores every
    worker shares, where the whole deployment runs on one machine (None: a manifest that starts its own
    local Ray cluster runs on the profiled machine's cores; one that joins a cluster, on workers' own):
    a step that starts while workers with more threads than that are stepping, with the router's CPU
    for the tokens of the last second, takes as many times longer (processor sharing). `drafting`:
    the workload's, where the manifest decodes speculatively (see the module's text)."""

    def __init__(self, manifest: Any, profile: HardwareProfile, name: str = "",
                 shared_cores: int | None = None, drafting: Drafting | None = None, seed: int = 0) -> None:
        self.manifest = m = manifest
        self.profile = profile
        if shared_cores is None and m.ray.address == "local":  # on one machine
            shared_cores = profile.cores or None
        self.shared_cores = shared_cores
        self._stepping_threads = 0
        self._recent_tokens: deque[float] = deque()  # when tokens were streamed, over the last second
        self.max_model_len = min(m.max_model_len or profile.max_model_len, profile.max_model_len)
        total_blocks = profile.kv_blocks(m.kv_memory_mb, m.block_size)
        if total_blocks * m.block_size < self.max_model_len:  # as the engine refuses to start
            raise ValueError(f"kv_memory_mb {m.kv_memory_mb} holds {total_blocks * m.block_size} tokens of "
                             f"{profile.model}'s KV, less than one sequence of max_model_len {self.max_model_len}")
        self.name = name or m.mode
        self.clock = _Clock()
        self.index = PrefixIndex()
        self.handoff = profile.transfer(handoff_transport(m)) if m.mode == "disaggregated" else None
        self.engines: dict[str, SimEngine] = {}
        self.prefill_sides: dict[str, _PrefillSide] = {}
        self.refs: dict[str, WorkerRef] = {}
        self.waiting_for_room: dict[str, deque[_Flight]] = {}  # reservations a full KV pool holds, by decode worker
        self.flights: dict[str, _Flight] = {}
        self.records: list[RequestRecord] = []
        self._laps: dict[str, tuple[int, int]] = {}  # prefill worker -> (short tokens, chunk)
        encode = m.pools.encode
        self.encoders = {f"encode-{i}": _SimEncoder(
            f"encode-{i}", profile.encode_cost(encode.threads), encode.threads,
            m.server.images.embedding_cache_mb * 2**20 // max(1, profile.embedding_bytes_per_token), self)
            for i in range(encode.replicas)}
        # the router's own choice of encoder (its timeout and retries are for faults, which are left out)
        self.encode_pool = EncodePool([e.ref for e in self.encoders.values()])
        max_model_len = self.max_model_len
        for role, worker, spec in m.workers():
            costs = profile.costs(spec.threads)
            speculation = None
            if m.speculative is not None:
                costs, speculation = self._speculating(costs, role, drafting, f"{seed}:{worker}")
            chunk = m.max_num_batched_tokens
            laps = None
            if role == "prefill":
                laps = laps_settings(m.router.laps, m.router.short_prompt_tokens,
                                     None if m.router.short_batch_window_ms is None
                                     else m.router.short_batch_window_ms / 1e3,
                                     m.router.long_prompt_chunk_tokens, costs.prefill, m.max_num_batched_tokens,
                                     max_model_len)
                chunk = laps.chunk_tokens or chunk
            limits = EngineLimits(total_blocks, m.block_size, m.max_num_batched_tokens, chunk, m.max_num_seqs)
            engine = SimEngine(worker, costs, limits, self, self.clock.at, self._cache_events, profile.step_overhead,
                               speculation)
            self.engines[worker] = engine
            self.waiting_for_room[worker] = deque()
            if laps is not None:
                self.prefill_sides[worker] = _PrefillSide(engine, self.clock, laps.length_aware, laps.short_tokens,
                                                          laps.window_s, laps.short_room, profile.prefill_setup_s,
                                                          self._prefill_started)
            pool = "prefill" if role == "prefill" else "decode"
            self.refs[worker] = WorkerRef(worker, pool, handle=None)
            self._laps[worker] = (laps.short_tokens if laps else 0, chunk)
        self._report(0.0)
        refs = list(self.refs.values())
        self.router = Router(m.mode, [w for w in refs if w.pool == "prefill"], [w for w in refs if w.pool == "decode"],
                             m.block_size, RoutingSettings.from_spec(m.router, max_model_len), self.index)
        if self.handoff is not None:  # the cluster's start-up probe: two transfer sizes
            for tokens in (16, max_model_len):
                self.router.transfer.observe(tokens, self.handoff.handoff_s(tokens))
        self._outstanding = 0
        self._budget: MissBudget | None = None
        self._requests = self._misses = 0  # with a budget: the run's requests, and those that missed
        self._rate = 0.0
        self._last_progress = 0.0  # the last request's arrival or end, or engine step's end

    def _speculating(self, costs: WorkerCosts, role: str, drafting: Drafting | None,
                     seed: str) -> tuple[WorkerCosts, SimSpeculation | None]:
        """A worker's costs where the manifest decodes speculatively, and its drafts (decoding roles)."""
        spec, measured = self.manifest.speculative, costs.speculation
        uses_draft_model = spec.method != "suffix"
        if measured is None or (uses_draft_model and measured.draft_model != spec.draft_model):
            raise ValueError(f"the manifest decodes speculatively ({spec.method}"
                             + (f" with the draft model {spec.draft_model}" if uses_draft_model else "")
                             + f"), and the profile of {costs.threads} thread(s) was measured "
                             + ("without speculation" if measured is None else
                                f"with the draft model {measured.draft_model}" if measured.draft_model else
                                "without a draft model")
                             + ": measure it with this manifest's `speculative` (`pdserve profile --manifest`)")
        sends_draft = self.manifest.mode == "disaggregated" and uses_draft_model and spec.draft_kv == "send"
        if role == "prefill":
            return (replace(costs, prefill=measured.prompt_with_draft) if sends_draft else costs), None
        if drafting is None:
            raise ValueError("the manifest decodes speculatively: the simulator needs the workload's drafting (at "
                             "least its acceptance, the chance a draft token is accepted when the one before it "
                             "was; `--acceptance`)")
        return costs, SimSpeculation(measured, spec, drafting, sends_draft, seed)

    # --- a run ----------------------------------------------------------------------------------
    def run(self, requests: Sequence[SimRequest], rate: float = 0.0, budget: MissBudget | None = None) -> SimResult:
        """Simulate `requests` to their ends, or with `budget` until it is spent; `rate` labels the records
        (as a benchmark's run)."""
        started = time.perf_counter()
        self._rate = rate
        self._outstanding = len(requests)
        self._budget, self._requests, self._misses = budget, len(requests), 0
        for i, spec in enumerate(requests):
            self.clock.at(spec.arrival_s, lambda now, i=i, spec=spec: self._arrive(i, spec, now))
        self.clock.at(self.manifest.supervision.ping_interval_s, self._report_tick)
        stopped = False
        try:
            self.clock.run()
        except _RunFailed:
            stopped = True
            self._record_not_simulated(requests)
        else:
            for engine in self.engines.values():
                engine.check_drained()
        workers = {n: WorkerLoad(self.refs[n].pool if self.manifest.mode == "disaggregated" else "colocated",
                                 e.busy_s, e.steps, e.preemptions) for n, e in self.engines.items()}
        workers.update({n: WorkerLoad("encode", e.busy_s, e.passes, 0) for n, e in self.encoders.items()})
        records = sorted(self.records, key=lambda r: r.send_time)
        return SimResult(records, workers, self.router.snapshot_stats(), self.clock.events,
                         time.perf_counter() - started, stopped)

    def _missed(self) -> None:
        """A request missed the budget's objective, for certain: stop once the run cannot meet its target."""
        if self._budget is None:
            return
        self._misses += 1
        if (self._requests - self._misses) / self._requests < self._budget.target:
            raise _RunFailed

    def _request_id(self, i: int) -> str:
        return f"{self.name}-{i}"

    def _record_not_simulated(self, requests: Sequence[SimRequest]) -> None:
        """The requests a stopped run did not end, recorded as misses that say why."""
        for flight in self.flights.values():
            flight.record.outcome, flight.record.error = "error", NOT_SIMULATED
        arrived = {r.request_id for r in self.records}
        for i, spec in enumerate(requests):
            request_id = self._request_id(i)
            if request_id not in arrived:
                self.records.append(RequestRecord(request_id, self.name, self._rate, spec.arrival_s, len(spec.prompt),
                                                  spec.output_len, outcome="error", error=NOT_SIMULATED))

    def _arrive(self, i: int, spec: SimRequest, now: float) -> None:
        self._last_progress = now
        request_id = self._request_id(i)
        record = RequestRecord(request_id, self.name, self._rate, now, len(spec.prompt), spec.output_len)
        self.records.append(record)
        if len(spec.prompt) + spec.output_len > self.max_model_len:  # the router refuses it, as the API does
            record.outcome, record.error = "error", f"longer than max_model_len {self.max_model_len}"
            self._outstanding -= 1
            self._missed()
            return
        work = WorkRequest(request_id, spec.prompt, SamplingParams.greedy(max_tokens=spec.output_len, ignore_eos=True))
        try:
            placement = self.router.place(work)
        except (Overloaded, NoHealthyWorker) as e:
            record.outcome = "rejected" if isinstance(e, Overloaded) else "error"
            record.error = str(e)
            self._outstanding -= 1
            self._missed()
            return
        flight = _Flight(request_id, spec, record, placement)
        flight.events[LifetimeEvent.ACCEPTED] = now
        self.flights[request_id] = flight
        if spec.images and self.encoders:  # its images to an encoder first, a dispatch away
            ref = self.encode_pool.choose([image.key for image in spec.images])
            ref.outstanding += 1
            self.clock.at(now + self.profile.dispatch_s, lambda t: self.encoders[ref.name].put(flight, t))
            return
        # the worker hears of it a dispatch later (the router's own work, the Ray call)
        self.clock.at(now + self.profile.dispatch_s, lambda t: self._dispatch(flight, t))

    def encoded(self, encoder: _SimEncoder, flight: _Flight, now: float) -> None:
        """An encoder made a request's embeddings: it goes to its worker, which takes them over the
        KV-transfer layer before its prompt pass."""
        self._last_progress = now
        encoder.ref.outstanding -= 1
        self.encode_pool.remember([image.key for image in flight.spec.images], encoder.ref)
        flight.events[LifetimeEvent.ENCODED] = now
        self.clock.at(now + self.profile.dispatch_s, lambda t: self._dispatch(flight, t, encoded=True))

    def _dispatch(self, flight: _Flight, now: float, encoded: bool = False) -> None:
        placement, spec, request_id = flight.placement, flight.spec, flight.request_id
        hashes = placement.request.block_hashes
        flight.events[LifetimeEvent.PREFILL_QUEUED] = now
        worker = self.engines[(placement.prefill or placement.decode).name]
        # images an encoder made: the worker takes their embeddings as the call that brings the request
        # runs, before the request queues; the others are encoded where the prompt pass runs, on its loop
        image_tokens = sum(image.tokens for image in spec.images)
        fetch_s = self.profile.embeddings_handoff_s(handoff_transport(self.manifest), image_tokens) if encoded else 0.0
        tower_s = 0.0 if encoded or not spec.images else \
            self.profile.encode_cost(worker.costs.threads).pass_s(len(spec.images), image_tokens)
        seq = SimSequence(request_id, len(spec.prompt), spec.output_len, hashes, prefill_only=placement.prefill is not None,
                          tower_s=tower_s)
        if placement.prefill is None:
            flight.events[LifetimeEvent.PREFILL_START] = now  # as a decode worker records a local prefill
            self.clock.at(now + fetch_s, lambda t: worker.add(seq, t))
        else:
            side, new_tokens = self.prefill_sides[placement.prefill.name], placement.request.new_tokens(placement.prefill)
            self.clock.at(now + fetch_s, lambda t: side.put(seq, new_tokens, placement.decode.name, t))

    def _prefill_started(self, seq: SimSequence, now: float) -> None:
        """A job taken from the queues: its transfer asks the decode worker for a reservation now if
        its KV streams beside the pass, else as the pass ends (`KVSender.pass_started`)."""
        flight = self.flights[seq.request_id]
        flight.events[LifetimeEvent.PREFILL_START] = now
        placement = flight.placement
        flight.reservation = _Reservation(self.prefill_sides[placement.prefill.name], placement.decode.name,
                                          SimSequence(seq.request_id, seq.prompt_len, seq.output_len, seq.block_hashes))
        kv = self.manifest.kv_transfer
        adaptive = self.manifest.router.ttft_slo_s is not None and "cachegen" in kv.codecs  # (its levels adapt)
        if streams_beside_pass(placement.request.new_tokens(placement.prefill), kv.layerwise_min_tokens, adaptive):
            self._ask(flight, now)

    def _ask(self, flight: _Flight, now: float) -> None:
        r = flight.reservation
        if r.asked:
            return
        r.asked = True
        r.side.asked(r.decode)
        self._on_engine_loop(self.engines[r.decode], lambda t: self._reserve(flight, t), now)

    def _on_engine_loop(self, engine: SimEngine, command: Callable[[float], None], now: float) -> None:
        """A call that reaches `engine`'s worker after the current event (a step it starts now goes
        first), run between its steps."""
        self.clock.at(now, lambda t: engine.call(command, t))

    def _reserve(self, flight: _Flight, now: float) -> None:
        r = flight.reservation
        if r.dropped:  # the request ended meanwhile: the decode worker's wait ends on its tombstone
            return
        if not self.engines[r.decode].reserve_import(r.blocks):
            self.waiting_for_room[r.decode].append(flight)
            return
        r.answered = True
        flight.events[LifetimeEvent.KV_RESERVED] = now
        r.side.answered(r.decode, now)
        if flight.prefilled is not None:
            self._send_kv(flight, now)

    def _retry_reservations(self, decode: str, now: float) -> None:
        """Blocks may have come free on `decode`: each reservation waiting for room tries again."""
        waiting = self.waiting_for_room[decode]
        for _ in range(len(waiting)):
            self._reserve(waiting.popleft(), now)

    def _drop_reservation(self, flight: _Flight, now: float) -> None:
        """The request ended at its first token: the sender ends its transfer, freeing the reservation
        (an abort the decode worker runs between steps) or ending its wait."""
        r = flight.reservation
        if not r.asked:  # the sender never asks for a transfer that ended first
            r.dropped = True
            return
        if r.answered:
            decode = self.engines[r.decode]

            def cancel(t: float) -> None:
                decode.cancel_import(r.blocks, t)
                self._retry_reservations(r.decode, t)

            self._on_engine_loop(decode, cancel, now)
            return
        r.dropped = True
        if flight in self.waiting_for_room[r.decode]:
            self.waiting_for_room[r.decode].remove(flight)
        r.side.answered(r.decode, now)

    # --- what the engines report ----------------------------------------------------------------
    def step_started(self, engine: SimEngine) -> float:
        return self.cores_taken(engine.costs.threads)

    def cores_taken(self, threads: int) -> float:
        """A step or image pass of `threads` starts: how many times longer than alone it takes."""
        self._stepping_threads += threads
        if not self.shared_cores:
            return 1.0
        # the router's own CPU: the tokens it streamed over the last second
        while self._recent_tokens and self._recent_tokens[0] < self.clock.now - 1.0:
            self._recent_tokens.popleft()
        router = min(1.0, len(self._recent_tokens) * self.profile.router_cpu_s_per_token)  # one event loop: a core
        return max(1.0, (self._stepping_threads + router) / self.shared_cores)

    def sampled(self, engine: SimEngine, seq: SimSequence, tokens: int, now: float) -> None:
        flight = self.flights[seq.request_id]
        seen = now + self.profile.delivery_s
        if self.shared_cores:
            self._recent_tokens.extend([now] * tokens)
        if seq.generated == 1:
            flight.record.first_token_time = seen
            flight.record.cached_tokens = seq.cached_tokens
            flight.events.update({LifetimeEvent.PREFILL_END: now, LifetimeEvent.FIRST_TOKEN: seen})
            self.router.first_token(flight.placement)
            if self._budget is not None and seen - flight.record.send_time > self._budget.objective.ttft_s:
                flight.missed = True
                self._missed()
        if seq.prefill_only:
            self.prefill_sides[engine.name].first_token(seq)
            if seq.output_len <= 1:  # released once the step that sampled it has ended
                self.clock.at(now, lambda t: engine.release(seq, t))
                self._drop_reservation(flight, now)
                self._finish(flight, seen, 1)
            else:
                flight.prefilled = seq
                self._ask(flight, now)  # (where the pass's start did not)
                if flight.reservation.answered:  # else the KV goes once the decode worker answers
                    self._send_kv(flight, now)
        elif seq.generated >= seq.output_len:
            self._finish(flight, seen, seq.generated)

    def cores_given_back(self, threads: int) -> None:
        self._stepping_threads -= threads

    def step_ended(self, engine: SimEngine, now: float) -> None:
        self.cores_given_back(engine.costs.threads)
        self._last_progress = now
        self._after_step(engine, now)

    def _after_step(self, engine: SimEngine, now: float) -> None:
        self._retry_reservations(engine.name, now)
        side = self.prefill_sides.get(engine.name)
        if side is not None:
            side.feed(now)

    def _send_kv(self, flight: _Flight, now: float) -> None:
        """The prompt's KV leaves for its reserved blocks; the decode worker commits it between steps."""
        seq, source = flight.prefilled, self.engines[flight.placement.prefill.name]
        decode = self.engines[flight.placement.decode.name]

        def commit(t: float) -> None:
            flight.events[LifetimeEvent.DECODE_START] = t
            decode.commit_import(flight.reservation.blocks, t)

        def delivered(t: float) -> None:
            source.release(seq, t)
            self._after_step(source, t)  # its blocks are free: a prompt may now fit
            decode.call(commit, t)

        self.clock.at(now + self.handoff.handoff_s(seq.prompt_len), delivered)

    def _finish(self, flight: _Flight, seen: float, tokens: int) -> None:
        self._last_progress = seen
        flight.record.end_time = seen
        flight.record.output_tokens = tokens
        flight.events[LifetimeEvent.FINISHED] = seen
        self.router.finished(flight.placement, flight.events)  # it learns each handoff's time, as live
        del self.flights[flight.request_id]
        self._outstanding -= 1
        if self._budget is not None and not flight.missed and not meets(flight.record, self._budget.objective):
            self._missed()

    def _cache_events(self, worker: str, events: list[IndexEvent]) -> None:
        self.index.apply(worker, events)

    # --- health reports -------------------------------------------------------------------------
    def _report_tick(self, now: float) -> None:
        self._report(now)
        if self._outstanding <= 0:
            return
        idle = not any(e.busy or e.holding for e in self.engines.values()) and \
            not any(e.busy for e in self.encoders.values())
        if self.flights and idle and (not self.clock.pending or now - self._last_progress > STALL_S):
            # requests in flight and nothing for long (a feeder's poll may still tick): a bug, or KV
            # memory too small for the two pools to pass work on (reservations wait here past
            # `reserve_wait_s`); not a result, and a run must not spin
            raise RuntimeError(f"the simulation stalled at {now:.3f} s with {len(self.flights)} requests in flight "
                               f"and no engine step, arrival or end for {now - self._last_progress:.1f} s")
        self.clock.at(now + self.manifest.supervision.ping_interval_s, self._report_tick)

    def _report(self, now: float) -> None:
        for name, engine in self.engines.items():
            ref = self.refs[name]
            short_tokens, chunk = self._laps[name]
            lim = engine.limits
            ref.status = WorkerStatus(
                worker_id=name, node_id="sim", node_ip="", model_digest=self.profile.model_digest, alive=True,
                fault=None, profiled=True,
                kv=KVPoolStatus(engine.free_blocks, lim.total_blocks, len(engine.evictable) + len(engine.in_use), 0, 0),
                requests=engine.num_requests, transfers=0, step_cost=engine.costs.prefill, step_budget=lim.step_budget,
                jobs=self.prefill_sides[name].queues.queued if name in self.prefill_sides else 0,
                chunk_tokens=chunk, short_prompt_tokens=short_tokens,
                step_tokens_per_seq=engine.decode_shape.tokens_per_seq, step_propose_s=engine.decode_shape.propose_s)
            ref.reported_at = now
