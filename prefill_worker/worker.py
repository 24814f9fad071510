"""The prefill worker: computes prompts, samples the first token, streams KV to a decode worker.

Each request is a job that moves through

    queued -> reserving -> prefilling -> committing -> done
       \\__________\\_____________\\____________\\______> done (cancelled or failed)

`prefill` only queues the job (bounded: past `max_queued` the request fails at once with
RESOURCE_EXHAUSTED), in one FCFS line or in LAPS's short and long queues (`queues`). One feeder
thread takes jobs when they are due (FCFS: when the engine has less than one step's budget of work
ahead, so a reservation is made as the prompt pass starts, not while the job queues; LAPS: a long
prompt when the one before is on its last chunk; a batch of shorts together). It adds their
prompts to the engine with `prefill_only`, in one command so that a batch shares a step, and beside
the pass reserves blocks on each job's decode worker (the lease; the decode side waits a bounded time
for free blocks; the lease says which leading blocks it already holds and which codec it agreed to);
that decode worker's lane waits for the lease and opens a channel on the transport chosen for the
pair. The engine's layer hook records each layer of each chunk as soon as it is
written; once the lease is there, the decode worker's sender thread sends what the decode worker
lacks of it (`kv_transfer.sender`; the level controller picks each frame's quality level): layer by
layer beside the pass, or, for a pass of fewer than `kv_transfer.layerwise_min_tokens` tokens computed,
all at once when it ends (sending beside a short pass slows it more than its transfer is worth). Once
the pass is over and the lease taken, a commit thread commits the handoff (first token included);
layers the decode side reports incomplete (a corrupt frame) are sent once more, and if they still
fail the decode worker recomputes the request from its tokens. When the controller expects that
recomputation to be faster than the transfer, nothing is sent at all. `_finish` ends every job, on
every path: it closes the channel (a job ended early, failed or not, once its frames in flight are
answered, so the channel's resources are reused), aborts the transfer on both sides unless it
committed, frees the local blocks and, for a failure, tells the router why. A cancel (`abort`) is
honoured in every state.

Each decode worker has a lane of its own (`_Lane`): the thread that waits for its jobs' leases (one
job at a time, or one batch of shorts, while the lane's next jobs wait in the queues), the sender
thread that keeps its frames in order, and the threads that run its commits and drains. A decode worker that
stops answering (its reservations, its KV path cut, its commit stuck) or whose pool is full holds up
only its own lane: the feeder starts prompts bound for the others, and transfers already under way
to them go on, where on shared threads they waited behind it (a reservation for up to
`reserve_wait_s` + `RESERVE_MARGIN_S`, a commit until their own leases lapsed). A decode worker
that leaves a reservation unanswered past that bound gets no job until it answers it: the jobs
queued for it, and new ones, fail at once with UNAVAILABLE, and the router places them elsewhere.

Both sides of a transfer hold a lease. The decode side's lapses when no frame arrives for `lease_s`
(`KVReceiver`); this side's lapses when the job's transfer makes no progress (a frame taken by the
channel, which keeps at most a bounded window unanswered; a commit answered) for `lease_s` +
`PREFILL_LEASE_MARGIN_S`: a decode worker that hangs mid-commit frees this side's blocks within the
lease, not after every bounded wait in turn, and the router retries the request. So the lease, not a
fixed bound, ends a transfer: a long prompt over a slow link goes on as long as its frames do.

Before serving, the worker profiles its prompt passes (`profile`, called by the launcher, and by the
supervisor after a restart); its health report carries the fitted step cost, the LAPS threshold
derived from it, the LAPS chunk, and whether it has been profiled. It publishes every change of its
prefix cache to the router (`pdserve.kv_events`).
"""

from __future__ import annotations

import logging
import resource
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from pdserve.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.model_store import ModelSource, materialize
from pdserve.engine.profiler import profile_prefill
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.kv_transfer.codecs import offers, usable_codec
from pdserve.kv_transfer.interface import (PROBE_PREFIX, Codec, KVMemoryFull, Lease, LayerChannel,
                                          TransferError)
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.sender import LevelController, LevelSizes, OutgoingTransfer, make_frame
from pdserve.kv_transfer.settings import TransferSettings
from pdserve.kv_transfer.state import Transfer, TransferState
from pdserve.kv_transfer.transports import make_sender
from pdserve.faults import FaultInjector, FaultSettings
from pdserve.kv_events import KVEventPublisher, KVSnapshot
from pdserve.prefill_worker.handed_work import HandedWork
from pdserve.prefill_worker.queues import PrefillQueues
from pdserve.threads import start_guarded, submit_guarded
from pdserve.wire import (
    HANDOFF_COMMITTED,
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    Tombstones,
    TokenSink,
    WorkRequest,
)

log = logging.getLogger(__name__)
COMMIT_TIMEOUT_S = 30.0
# A job that ends early without error (a request finished at its first token, a cancel) has frames in
# flight; its channel closes once they are answered (waiting up to this for the sender's queue, then
# as long for the answers): a channel closed with nothing unanswered keeps its resources for the next
# transfer (shm: its mapped segment, whose making costs more than a short prompt's whole transfer).
DRAIN_S = 0.5
LEASE_CHECK_S = 0.5
PREFILL_LEASE_MARGIN_S = 2.0  # the decode side's lease lapses first; this one is the backstop
RESERVE_MARGIN_S = 10.0  # on top of the decode side's own bounded wait for blocks
_BEFORE_FIRST_TOKEN = ("queued", "reserving", "prefilling")
DEFAULT_BANDWIDTH = 200e6  # bytes/s assumed for a pair not yet probed (the launcher probes each)


class _Lane:
    """One decode worker's threads on this side (see the module's docstring)."""

    def __init__(self, name: str) -> None:
        # Waits for the leases of the jobs the feeder started (one batch of them at most); meanwhile
        # (`starting`: batches waiting, under the worker's lock) the lane's next jobs wait in the queues, where
        # the feeder starts other lanes' jobs: a decode worker whose pool is full (or that does not
        # answer) holds back the prompts bound for it, and only those.
        self.starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-start-{name}")
        self.starting = 0
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-send-{name}")
        self.committers = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"kv-commit-{name}")
        # Apart from the commits (each may wait 30 s on a decode worker that stopped answering): a
        # channel closed early holds its resources (shm: a segment, up to 64 MiB) until its drain, at most 1 s.
        self.drains = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"kv-drain-{name}")
        self.send_busy_s = 0.0  # the sender thread's time reading and pushing KV
        self.progressed_at = 0.0  # the sender thread last handed a frame to a channel (time.monotonic())
        self.decode_name = "its decode worker"  # until a lease names it
        # A reservation the decode worker left unanswered past its bound, and since when: until it
        # answers that one, the lane's prompts fail at once (UNAVAILABLE: the router places them on
        # another decode worker) instead of each waiting out the bound in turn while they fill
        # `max_queued` for every decode worker.
        self._unanswered: tuple[ray.ObjectRef, float] | None = None
        self._unanswered_lock = threading.Lock()

    def not_answering(self, reservation: ray.ObjectRef, since: float) -> None:
        with self._unanswered_lock:
            self._unanswered = (reservation, since)

    def refusal(self) -> str | None:
        """Why the lane takes no job now (its decode worker has not answered a reservation past the
        bound yet), or None; the lane reopens once that reservation is answered, whatever the answer."""
        with self._unanswered_lock:
            if self._unanswered is None:
                return None
            reservation, since = self._unanswered
            if ray.wait([reservation], timeout=0, fetch_local=False)[0]:
                self._unanswered = None
                return None
        return f"{self.decode_name} has not answered a KV reservation made {time.time() - since:.0f} s ago"

    def shutdown(self) -> None:
        for pool in (self.starter, self.sender, self.committers, self.drains):
            pool.shutdown(wait=False, cancel_futures=True)


@dataclass(eq=False)
class _Job:
    work: WorkRequest
    decode: Any  # the decode worker's actor handle
    lane: _Lane  # that decode worker's
    new_tokens: int  # the prompt tokens the router expects this worker to compute (its cache has the rest)
    short: bool = False  # in LAPS's short queue
    state: str = "queued"
    transfer: Transfer | None = None
    outgoing: OutgoingTransfer | None = None  # None: the decode worker recomputes the KV (nothing is sent)
    lease: Lease | None = None
    transport: str = "none"  # the transport its KV goes over, once chosen
    arrived: float = field(default_factory=time.time)
    prefill_started: float = 0.0
    last_layer_at: float = 0.0  # the sender handed the last frame to the channel
    # The prompt pass ended: its step sampled the first token. Not when the last layer's KV was
    # written: that layer's attention and MLP still run then, a layer's compute of hiding left.
    prompt_done_at: float = 0.0
    delivered_at: float = 0.0  # the receiver answered every frame
    lease_until: float = 0.0  # this side's lease on the transfer (time.monotonic()); 0 until reserved
    # layer -> (tokens before it whose KV is final, the blocks holding them), as the pass writes them
    written: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    # Streams its KV layer by layer beside the pass (else it is sent once the pass ends); set with the lease.
    layerwise: bool = False
    handed: HandedWork = field(default_factory=HandedWork)  # to its lane's sender thread, not yet done
    handoff: Any = None  # the prompt pass's handoff (the first token included), once the pass is over
    lease_settled: bool = False  # `_take_lease` is done with it (taken or refused)
    commit_started: bool = False  # both of the above: `_commit_when_ready` handed it to a commit thread

    @property
    def request_id(self) -> str:
        return self.work.request_id


class PrefillWorker:
    def __init__(self, worker_id: str, model: ModelSource, engine_config: dict, token_sink: str,
                 kv_settings: TransferSettings, max_queued: int = 64, kv_events: str | None = None,
                 length_aware: bool = False, short_prompt_tokens: int | None = None,
                 short_batch_window_s: float | None = None, long_chunk_tokens: int | None = None,
                 faults: FaultSettings | None = None) -> None:
        self.worker_id = worker_id
        restarted = ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
        self.faults = FaultInjector(faults, first_incarnation=not restarted)  # a fault that ends it fires once
        model_dir, self.model_digest = materialize(model, ray.get)  # this node's copy, the launcher's bytes
        self.model_dir = str(model_dir)
        self.node_ip = ray.util.get_node_ip_address()
        kv_settings = kv_settings.on_node(self.node_ip)
        self.engine = LLMEngine(self.model_dir, EngineConfig(**engine_config))
        self._laps = (length_aware, short_prompt_tokens, short_batch_window_s, long_chunk_tokens)
        # `profile` sets LAPS up from the measured costs
        self.queues: PrefillQueues[_Job] = PrefillQueues(False, key=lambda job: job.lane)
        self._profiled = False
        self.engine.set_layer_hook(self._push_layer)
        self.engine.set_preempt_hook(self._on_preempted)
        self.kv_events = KVEventPublisher(kv_events, worker_id, on_crash=self._on_publisher_crash,
                                          secret=kv_settings.secret) if kv_events else None
        self.engine.pool.listener = self.kv_events
        self.sink = TokenSink(token_sink, kv_settings.secret)
        self.max_queued = max_queued
        self.kv = kv_settings
        self.reserve_wait_s = kv_settings.reserve_wait_s
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self._transports: dict[str, Any] = {}  # name -> sending half, made on first use
        self._making = threading.Lock()  # for the transports made on first use
        self._peer_addresses: dict[str, dict[str, str]] = {}  # decode worker -> where its last lease said it listens
        self._bandwidth: dict[str, float] = {}  # decode worker (node id + addresses) -> bytes/s, from probes
        self._level_sizes: dict[str, LevelSizes] = {}  # per codec
        self._codecs = self._usable_codecs(kv_settings.codecs)  # by name, in the order they are offered
        self.counters: dict[str, int] = {"frames_resent": 0, "recomputed": 0, "recompute_chosen": 0,
                                         "leases_expired": 0, "reservations_unanswered": 0}
        self.metrics = TransferMetrics()
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self.aborted = Tombstones()
        self.fault: str | None = None
        self.transfer_log: deque[dict] = deque(maxlen=1024)  # completed transfers, for benchmarks
        self._lanes: dict[Any, _Lane] = {}  # decode worker's actor handle (equal by actor id) -> its lane
        self._stop = threading.Event()
        self.loop = EngineLoop(self.engine, self._on_outputs, on_fatal=self._on_loop_fatal).start()
        start_guarded("prefill-feeder", self._feed, lambda e: self._on_fault(f"feeder failed: {type(e).__name__}: {e}"))
        start_guarded("prefill-lease-expiry", self._expire_leases,
                      lambda e: self._on_fault(f"lease thread failed: {type(e).__name__}: {e}"))

    def profile(self) -> dict:
        """Measure prompt passes (before serving; the launcher runs one worker at a time), then set up
        the queues from the measured costs. Returns the health report."""
        profile = self.loop.call(lambda engine: profile_prefill(engine, self.loop.deliver), timeout=300)
        self.queues.configure(*self._laps_settings(*self._laps))
        self._profiled = profile.complete  # else (a busy engine) the supervisor has it profile again
        return self.ping()

    def _laps_settings(self, length_aware: bool, short_tokens: int | None, window_s: float | None,
                       chunk_tokens: int | None) -> tuple[bool, int, float, int]:
        """The queues' settings (`PrefillQueues.configure`). LAPS settings not given are derived: a
        prompt is short when its compute costs no more than a step's fixed cost (measured; batching
        shorts then nearly divides their cost); shorts wait at most one fixed cost to be batched; long
        prompts are chunked at half the step budget, the other half being the shorts' room, so a short
        waits behind at most one step of long work (a chunk, and the last chunk of the long before it
        where the two share a step). Smaller chunks (where
        the fixed cost was 1/8 of a chunk's compute, ~250 tokens here) cost long prompts a third more
        TTFT p90 with four workers sharing two cores (docs/benchmarks.md, issue 8)."""
        config, cost = self.engine.config, self.engine.step_costs.coefficients
        if not length_aware or (cost.a <= 0 and short_tokens is None):  # no fixed cost measured: no shorts
            return False, 0, 0.0, 0
        budget = config.max_num_batched_tokens
        half = max(1, budget // 2)  # a step holds a chunk and a batch of shorts
        limit = min(half, self.engine.max_model_len)
        short = min(short_tokens or max(1, cost.max_tokens_within(cost.a, limit)), half)
        chunk = min(max(chunk_tokens or half, short), budget - short)  # short <= half: room for one short
        config.prefill_chunk_size = chunk
        window = cost.a if window_s is None else window_s
        return True, short, window, config.max_num_batched_tokens - chunk

    def ping(self) -> dict:
        engine = self.engine
        with self._lock:
            jobs = len(self._jobs)
            transfers = sum(1 for j in self._jobs.values() if j.transfer is not None)
        return {"worker_id": self.worker_id, "node_id": self.node_id, "node_ip": self.node_ip,
                "model_digest": self.model_digest, **engine.kv_status(), "requests": len(engine.requests), "jobs": jobs,
                "transfers": transfers, "alive": self.fault is None and self.loop.running, "fault": self.fault,
                "step_cost": engine.step_costs.coefficients.as_tuple(),
                "step_budget": engine.config.max_num_batched_tokens, "chunk_tokens": engine.config.chunk_limit,
                "short_prompt_tokens": self.queues.short_tokens, "profiled": self._profiled,
                "metrics": self.metrics.exposition()}

    def kv_snapshot(self) -> KVSnapshot:
        """Every cached block (hash, parent) and the sequence number of the last event they reflect."""
        return self.loop.call(lambda e: self.kv_events.snapshot(e.pool.cached_blocks()))

    def stats(self) -> dict:
        with self._lock:
            send_busy_s = sum(lane.send_busy_s for lane in self._lanes.values())
        return {"transfers": list(self.transfer_log), "loop": vars(self.loop.busy), "kv_send_s": send_busy_s,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def probe_transfer(self, decode: Any, num_tokens: int) -> dict:
        """Send every layer of `num_tokens` tokens of (random) raw KV to `decode`, then abort it: the
        transport's bandwidth (`seconds`: the frames) and a whole handoff's time (`handoff_s`: reserve
        to abort). The bandwidth is kept for the level controller of transfers to that worker."""
        transfer_id = uuid.uuid4().hex
        t_reserve = time.perf_counter()
        try:
            lease = ray.get(decode.reserve.remote(transfer_id, f"{PROBE_PREFIX}{transfer_id}", [3] * num_tokens,
                                                  SamplingParams.greedy(max_tokens=1), num_tokens),
                            timeout=self.reserve_wait_s + RESERVE_MARGIN_S)
            layout = self.engine.kv_layout
            raw = self._codecs["raw"]
            first = lease.cached_blocks * layout.block_size
            data = torch.randn(2, num_tokens - first, layout.num_kv_heads, layout.head_dim).to(layout.dtype)
            channel = self._open_channel(lease, transfer_id)
        except BaseException:  # the reservation may stand (granted late, or the channel failed): let it go
            decode.abort_transfer.remote(transfer_id, "probe failed")
            raise
        try:
            t0 = time.perf_counter()
            for layer in range(layout.num_layers):
                for start in range(first, num_tokens, self.kv.frame_tokens):
                    n = min(self.kv.frame_tokens, num_tokens - start)
                    channel.send(*make_frame(transfer_id, layer, start, n, raw.name, 0,
                                             raw.encode(data[:, start - first : start - first + n], layer),
                                             channel.device))
            channel.finish(COMMIT_TIMEOUT_S)
            seconds = time.perf_counter() - t0
        finally:
            channel.close()
            ray.get(decode.abort_transfer.remote(transfer_id, "probe finished"), timeout=COMMIT_TIMEOUT_S)
        if channel.bytes_sent:  # none when the decode worker held every probe block already
            self._bandwidth[_peer(lease)] = channel.bytes_sent / max(seconds, 1e-9)
        return {"bytes": channel.bytes_sent, "seconds": seconds, "handoff_s": time.perf_counter() - t_reserve}

    def _transport_name(self, lease: Lease) -> str:
        return self.kv.pick(lease.addresses, same_node=lease.node_id == self.node_id)

    def _open_channel(self, lease: Lease, transfer_id: str) -> LayerChannel:
        name = self._transport_name(lease)
        with self._making:  # lanes open channels side by side: one sending half per transport
            transport = self._transports.get(name)
            if transport is None:
                frame_bytes = self.kv.frame_tokens * self.engine.kv_layout.bytes_per_token_layer
                transport = self._transports[name] = make_sender(name, host=self.kv.host, tls=self.kv.tls,
                                                                 secret=self.kv.secret, frame_bytes=frame_bytes)
        return self.faults.channel(transport.open(lease.addresses[name], transfer_id))

    def _forget_old_addresses(self, lease: Lease) -> None:
        """A decode worker that restarted listens on new addresses: what the transports hold for its
        old ones (idle shm segments, a gRPC connection, a gloo group) is let go. Called as a transfer's
        lease opens its first channel: a resend reopening one on an older lease must not take the
        addresses back."""
        with self._lock:
            old = self._peer_addresses.get(lease.worker_id)
            self._peer_addresses[lease.worker_id] = lease.addresses
        for name, address in (old or {}).items():
            if address != lease.addresses.get(name) and name in self._transports:
                log.info("decode worker %s moved from %s: letting go of that address", lease.worker_id, address)
                self._transports[name].forget(address)

    # --- requests -------------------------------------------------------------------------------
    def prefill(self, work: WorkRequest, decode: Any, new_tokens: int | None = None) -> None:
        """Queue one request's prefill and handoff; the outcome reaches the router as token messages.
        `new_tokens`: the part of the prompt the router expects this worker not to cache (its queue)."""
        new_tokens = len(work.prompt_token_ids) if new_tokens is None else new_tokens
        lane = self._lane(decode)
        not_answering = lane.refusal()
        with self._lock:  # the lock `abort` takes too: a cancel lands before or after, never between
            refusal = None
            waiting = sum(1 for j in self._jobs.values() if j.state in _BEFORE_FIRST_TOKEN)
            if work.request_id in self.aborted:  # cancelled before this call ran
                return
            if self.fault is not None:
                refusal = (self.fault, INTERNAL)
            elif not_answering is not None:
                refusal = (not_answering, UNAVAILABLE)
            elif waiting >= self.max_queued:  # counted as the router counts: until the first token
                refusal = (f"prefill worker {self.worker_id} has {waiting} requests waiting for their prompt "
                           f"pass (max_queued {self.max_queued})", RESOURCE_EXHAUSTED)
            else:
                job = self._jobs[work.request_id] = _Job(work, decode, lane, new_tokens,
                                                         self.queues.is_short(new_tokens))
        if refusal is not None:
            self.sink.send(work.request_id, error=refusal[0], error_code=refusal[1])
            return
        self.queues.put(job, new_tokens, job.short)
        with self._lock:
            cancelled = not self._owns(job)
        if cancelled:  # between the two: `_finish` found nothing to take out of the queues
            self.queues.remove(lambda j: j is job)
        self.faults.took_request()

    def abort(self, request_ids: list[str]) -> list[str]:
        """Cancel requests, each in whatever state it is; frees what they hold here and on their decode
        workers. Returns the ids of those this worker held."""
        with self._lock:
            jobs = []
            for request_id in request_ids:
                self.aborted.add(request_id)
                if (job := self._jobs.get(request_id)) is not None:
                    jobs.append(job)
        for job in jobs:
            self._finish(job, reason="aborted by the router")
        return [job.request_id for job in jobs]

    def shutdown(self) -> None:
        with self._lock:  # `_lane` makes no lane after this
            self._stop.set()
            lanes = list(self._lanes.values())
        self.loop.stop()
        for lane in lanes:
            lane.shutdown()
        self.sink.close()
        if self.kv_events is not None:
            self.kv_events.close()
        for transport in self._transports.values():
            transport.close()

    def _lane(self, decode: Any) -> _Lane:
        """The lane of a decode worker, made on its first request. A restarted decode worker keeps its
        actor, so its lane."""
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError(f"prefill worker {self.worker_id} is shutting down")
            lane = self._lanes.get(decode)
            if lane is None:
                lane = self._lanes[decode] = _Lane(str(len(self._lanes)))
            return lane

    # --- the feeder thread ----------------------------------------------------------------------
    def _feed(self) -> None:
        while not self._stop.is_set() and self.fault is None:
            jobs = []
            for job in self.queues.take(0.1, self._long_busy, self._short_inflight, self._starting_lanes):
                if (refusal := job.lane.refusal()) is not None:  # queued as its decode worker stopped answering
                    self._finish(job, error=refusal, code=UNAVAILABLE)
                else:
                    jobs.append(job)
            if jobs and not self.queues.length_aware:
                self._wait_for_room()
            self._start(jobs)

    def _starting_lanes(self) -> list[_Lane]:
        with self._lock:
            return [lane for lane in self._lanes.values() if lane.starting]

    def _start(self, jobs: list[_Job]) -> None:
        """Start the prompt passes of jobs released together and, beside them, reserve on their decode
        workers: the reservation (a Ray round trip, and a bounded wait when a decode pool is full) runs
        beside the pass instead of before it. The prompts join the engine in one command, so they
        share a step (added one by one, each could miss the step the one before started); each decode
        worker's lane then takes its jobs' leases (`_await_leases`). Returns once the prompts are in
        the engine, so the next room check counts them."""
        with self._lock:  # all marked at once: a ping or the queues' checks see the batch whole
            jobs = [job for job in jobs if self._owns(job) and not self._stop.is_set()]  # not cancelled since
            now = time.time()
            for job in jobs:
                job.state, job.prefill_started = "reserving", now
                job.transfer = Transfer(uuid.uuid4().hex, job.request_id)
        reserving: list[tuple[_Job, ray.ObjectRef]] = []
        for job in jobs:
            work = job.work
            try:
                reservation = job.decode.reserve.remote(job.transfer.transfer_id, work.request_id,
                                                        work.prompt_token_ids, work.params,
                                                        len(work.prompt_token_ids), offers(self._codecs))
            except Exception as e:
                self._failed_to_start(job, e)
                continue
            reserving.append((job, reservation))
        if not reserving:
            return
        try:
            errors = self.loop.call(lambda engine: [_add_prompt(engine, job.work) for job, _ in reserving])
        except Exception as e:  # the loop stopped, or a long command held it past the call's bound
            errors = [e] * len(reserving)
        by_lane: dict[_Lane, list[tuple[_Job, ray.ObjectRef]]] = {}
        for (job, reservation), error in zip(reserving, errors):
            if error is not None:
                self._failed_to_start(job, error)
            else:
                by_lane.setdefault(job.lane, []).append((job, reservation))
        for lane, started in by_lane.items():
            with self._lock:  # `shutdown` stops the lanes' pools only after `_stop`
                if self._stop.is_set():
                    return
                lane.starting += 1
                self._on_lane(lane.starter, "start", self._await_leases, lane, started)
            for job, _ in started:
                with self._lock:
                    owned = self._owns(job)
                if not owned:  # ended meanwhile: its `abort_transfer` ends the reservation on the decode
                    # side, and its engine command may have preceded the add
                    self.loop.post(lambda e, request_id=job.request_id: e.abort_request(request_id))

    def _await_leases(self, lane: _Lane, started: list[tuple[_Job, ray.ObjectRef]]) -> None:
        """On a lane: take the leases of the jobs just started for its decode worker, in the order they
        come (a granted lease waiting behind another job's wait for blocks would let its decode-side
        lease lapse), within the reservation's bound. Meanwhile the lane's next jobs wait in the
        queues, so a full decode pool holds back the prompts bound for it (and only those)."""
        pending = {reservation: job for job, reservation in started}
        deadline = time.monotonic() + self.reserve_wait_s + RESERVE_MARGIN_S
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()),
                                    fetch_local=False)
                if not ready:
                    break
                self._take_lease(pending.pop(ready[0]), ready[0])
            if pending:
                reservation, job = next(iter(pending.items()))
                self._stop_lane(job, reservation)
                unanswered = TransferError(f"{lane.decode_name} did not answer the KV reservation within "
                                           f"{self.reserve_wait_s + RESERVE_MARGIN_S:.0f} s")
                for job in pending.values():
                    self._failed_to_start(job, unanswered)
        except Exception as e:  # Ray itself failed the wait (shutting down): the jobs cannot start
            for job in pending.values():
                self._failed_to_start(job, e)
        finally:
            with self._lock:
                lane.starting -= 1
            self.queues.wake()  # the lane's next jobs may start

    def _take_lease(self, job: _Job, reservation: ray.ObjectRef) -> None:
        """Take a granted reservation's lease (or its refusal), open the job's channel and send the
        layers written before the lease came."""
        transfer = job.transfer
        try:
            with self._lock:
                owned = self._owns(job)
            if not owned:  # ended while reserving: its `abort_transfer` may have come before the reservation
                job.decode.abort_transfer.remote(transfer.transfer_id, "request ended while reserving")
                return
            lease = ray.get(reservation)
            job.lane.decode_name = f"decode worker {lease.worker_id}"
            # Outside the lock: opening a channel may take a while (a gloo pair forms its group), and
            # pings and cancels take the lock.
            try:
                outgoing = self._outgoing(job, lease)
            except ValueError as e:  # the pools' settings disagree (a transport one lacks): not the request's
                raise TransferError(f"cannot send to {job.lane.decode_name}: {e}") from e
            with self._lock:  # what is taken here, `_finish` releases; a job it already ended takes nothing
                owned = self._owns(job)
                if owned:
                    transfer.advance(TransferState.RESERVED)
                    job.layerwise = self._streams_layerwise(job, outgoing)  # before the lease: `_push_layer` reads it
                    job.lease, job.outgoing = lease, outgoing
                    job.state = "prefilling" if job.state == "reserving" else job.state  # not if already done
                    self._renew(job)
            if not owned:
                if outgoing is not None:
                    _close_logged(outgoing.channel)
                job.decode.abort_transfer.remote(transfer.transfer_id, "request ended while reserving")
                return
            if job.layerwise:  # else all its layers go once the pass is over (`_commit_when_ready`)
                for layer in list(job.written):  # written before the lease came: send them now
                    self._forward_layer(job, layer)
        except Exception as e:
            self._failed_to_start(job, e)
        finally:
            self._commit_when_ready(job, lease_settled=True)

    def _failed_to_start(self, job: _Job, error: BaseException) -> None:
        self._finish(job, error=f"prefill could not start: {_reason(error)}", code=_code(error))

    def _on_lane(self, pool: ThreadPoolExecutor, what: str, fn: Callable[..., None], *args: Any) -> Future:
        """Run `fn(*args)` on one of a lane's pools; an exception it lets out (a bug: each handles its
        own job's failures) fails the worker's requests, as one in a long-lived thread does."""
        return submit_guarded(pool, f"kv-{what}", lambda: fn(*args),
                              lambda e: self._on_fault(f"KV {what} thread failed: {type(e).__name__}: {e}"))

    def _in_pass(self, short: bool) -> list[_Job]:
        with self._lock:
            return [j for j in self._jobs.values() if j.short == short and j.state in ("reserving", "prefilling")]

    def _long_busy(self) -> bool:
        """Whether a long prompt holds the engine beyond its last chunk. The next long starts (reserves,
        joins the engine) while that last chunk runs: waiting for the whole pass left the engine idle
        for every long prompt's reservation, a quarter of a worker's throughput in a burst. It joins the
        step after, so a short still waits behind one chunk at most."""
        chunk = self.engine.config.chunk_limit
        for job in self._in_pass(short=False):
            seq = self.engine.requests.get(job.request_id)  # None while reserving
            if seq is None or seq.num_uncomputed_tokens > chunk:
                return True
        return False

    def _short_inflight(self) -> int:
        return sum(j.new_tokens for j in self._in_pass(short=True))

    def _wait_for_room(self) -> None:
        """Until the engine has less than one step's budget of tokens ahead (or the worker stops)."""
        budget = self.engine.config.max_num_batched_tokens
        while not self._stop.is_set() and self.loop.running:
            try:
                if self.loop.call(lambda e: e.scheduler.num_pending_tokens) < budget:
                    return
            except TimeoutError:  # a long command holds the loop (a profile on a busy engine): ask again
                continue
            self.loop.wait_progress(0.1)

    def _owns(self, job: _Job) -> bool:
        """Whether `job` is still running here (not finished by a cancel or a fault). Call under the lock."""
        return self._jobs.get(job.request_id) is job

    def _stop_lane(self, job: _Job, reservation: ray.ObjectRef) -> None:
        """The job's decode worker left its reservation unanswered past the bound: its lane takes no
        job until it answers, and the jobs queued for it fail now (those waiting for leases, as this
        returns)."""
        lane = job.lane
        self.counters["reservations_unanswered"] += 1
        lane.not_answering(reservation, job.prefill_started)
        log.warning("%s did not answer a KV reservation within %.0f s: its prompts go to other decode workers "
                    "until it does", lane.decode_name, self.reserve_wait_s + RESERVE_MARGIN_S)
        refusal = lane.refusal() or f"{lane.decode_name} answered a KV reservation late"
        for queued in self.queues.remove(lambda j: j.lane is lane):
            self._finish(queued, error=refusal, code=UNAVAILABLE)

    def _usable_codecs(self, names: tuple[str, ...]) -> dict[str, Codec]:
        """The manifest's codecs this worker can encode with (fp8 needs a torch with it, cachegen the
        model's tables), and raw, which every decode worker falls back to: only these are offered, so
        a decode worker never agrees to a codec this side would fail every transfer on."""
        made = {name: usable_codec(name, self.model_dir, self.engine.kv_layout, "is not offered")
                for name in dict.fromkeys([*names, "raw"])}
        return {name: codec for name, codec in made.items() if codec is not None}

    def _outgoing(self, job: _Job, lease: Lease) -> OutgoingTransfer | None:
        """The transfer's sending side; None when the decode worker should recompute the KV instead
        (the controller expects that to be faster than sending it even at the coarsest level)."""
        layout = self.engine.kv_layout
        codec = self._codecs[lease.codec]  # one of those offered: the decode worker answers with one, or raw
        sizes = self._level_sizes.setdefault(codec.name, LevelSizes.of(codec))
        deadline = job.arrived + self.kv.ttft_slo_s if self.kv.ttft_slo_s is not None else None
        controller = LevelController(codec, sizes, self._bandwidth.get(_peer(lease), DEFAULT_BANDWIDTH), deadline)
        num_tokens = len(job.work.prompt_token_ids)
        first = lease.cached_blocks * layout.block_size
        transfer_s = controller.transfer_s((num_tokens - first) * layout.num_layers)
        if self.kv.recompute and lease.recompute_s is not None and transfer_s is not None \
                and transfer_s > lease.recompute_s:
            self.counters["recompute_chosen"] += 1
            return None
        job.transport = self._transport_name(lease)
        self._forget_old_addresses(lease)
        channel = self._open_channel(lease, job.transfer.transfer_id)
        return OutgoingTransfer(job.transfer.transfer_id, channel, controller, self.engine.kv_cache, first,
                                num_tokens, self.kv.frame_tokens, before_frame=lambda: self._frame_due(job))

    def _frame_due(self, job: _Job) -> None:
        """Before each of the job's frames is read: a job that ended reads no more of its blocks (the
        engine may have handed them to another request); in one still running, the channel took the
        frame before (the transports hold a bounded window unanswered): progress, so its lease is renewed."""
        if job.transfer.state.is_terminal:
            raise TransferError(f"transfer {job.transfer.transfer_id} ended: no more frames")
        self._renew(job)
        job.lane.progressed_at = time.monotonic()

    # --- on the engine loop thread --------------------------------------------------------------
    def _push_layer(self, layer: int, chunks: list[ScheduledChunk]) -> None:
        """A layer of these chunks is written: queue what the decode worker lacks of it for sending
        (once the job has its lease; `_take_lease` forwards what was written before)."""
        for chunk in chunks:
            job = self._jobs.get(chunk.seq.request_id)
            if job is None or job.transfer is None:
                continue
            # The KV of every token before `end` is final. The blocks stay held until the job ends, so
            # reading them later on the sender is safe.
            job.written[layer] = (chunk.seq.num_computed_tokens + chunk.num_tokens, list(chunk.seq.block_table))
            if job.lease is not None:
                self._forward_layer(job, layer)

    def _forward_layer(self, job: _Job, layer: int) -> None:
        """Hand what is written of `layer` to the sender thread: during the pass for a job that
        streams layer by layer (`_streams_layerwise`), else once the pass is over. Meanwhile (or when
        the decode worker recomputes the KV) keep its lease alive while the pass runs. Forwarding
        twice sends nothing twice."""
        held = job.outgoing is not None and not (job.layerwise or job.prompt_done_at)
        if layer == 0 and not held:
            job.transfer.advance_unless_finished(TransferState.TRANSFERRING)
        if job.outgoing is not None and not held:
            job.handed.add(self._on_lane(job.lane.sender, "send", self._send_layer, job, layer))
        elif layer == 0:  # at once, not on the sender thread behind the lane's other jobs' frames
            self._renew_lease(job)

    def _streams_layerwise(self, job: _Job, outgoing: OutgoingTransfer | None) -> bool:
        """Whether the job's KV goes layer by layer beside its pass: a pass of at least
        `kv_transfer.layerwise_min_tokens` tokens computed (as the router expects: this worker's
        prefix cache holds the rest; a short pass is what sending beside it slows most, whatever the
        bytes), or frames whose level is chosen to arrive by the TTFT objective, which the time after
        the pass is past."""
        if outgoing is None:
            return False
        by_objective = outgoing.controller.deadline is not None and outgoing.controller.codec.num_levels > 1
        return job.new_tokens >= self.kv.layerwise_min_tokens or by_objective

    def _on_preempted(self, request_id: str) -> None:
        """The engine gave up the request's blocks (its KV memory is full), and another request may write
        into them in this very step, while the sender may still read them for frames recorded before:
        the job fails, which stops its sending, and the router places the request afresh. (A frame
        read from a reused block belongs to a failed transfer, which the decode side never admits.)"""
        job = self._jobs.get(request_id)
        if job is not None:
            self._finish(job, error=f"preempted: prefill worker {self.worker_id}'s KV memory is full", code=UNAVAILABLE)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self.faults.after_step()
        now = time.time()
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:  # cancelled or failed meanwhile; `_finish` frees its blocks
                continue
            # `transfer_start` comes from the decode worker: the first token may leave before the lease.
            events = {"prefill_queued": job.arrived, "prefill_start": job.prefill_started, "prefill_end": now}
            if out.finish_reason == "prefilled":
                job.prompt_done_at = now
                self.sink.send(out.request_id, out.new_token_ids, logprobs=out.logprobs, events=events,
                               cached_tokens=out.num_cached_tokens, first_index=out.first_new_index)
                handoff = self.engine.export_handoff(out.request_id)
                with self._lock:  # `_take_lease` reads and writes the state under it
                    job.state = "committing"
                self._commit_when_ready(job, handoff=handoff)
            else:  # finished on its first token (stop, length): nothing to hand over
                self._finish(job, reason="request finished at prefill", last_message=lambda out=out, events=events:
                             self.sink.send(out.request_id, out.new_token_ids, logprobs=out.logprobs,
                                            finish_reason=out.finish_reason, text=out.text, events=events,
                                            cached_tokens=out.num_cached_tokens, first_index=out.first_new_index))

    def _on_loop_fatal(self, error: BaseException) -> None:
        self._on_fault(f"engine loop failed: {type(error).__name__}: {error}")

    def _on_publisher_crash(self, error: BaseException) -> None:
        self._on_fault(f"KV event publisher failed: {type(error).__name__}: {error}")

    # --- on the sender and commit threads -------------------------------------------------------
    def _send_layer(self, job: _Job, layer: int) -> None:
        if job.transfer.state.is_terminal:
            return
        t0 = time.perf_counter()
        try:
            end, block_ids = job.written[layer]
            job.outgoing.send_through(layer, block_ids, end)
            job.last_layer_at = time.time()
            if layer == 0 and end <= job.outgoing.first_token:
                # Tokens the decode worker holds: no frame leaves, so none extends its lease there.
                self._renew_lease(job)
            else:
                self._renew(job)
        except Exception as e:
            self._finish(job, error=f"KV transfer failed: {_reason(e)}", code=UNAVAILABLE)
        finally:
            job.lane.send_busy_s += time.perf_counter() - t0  # only this lane's sender thread adds

    def _renew_lease(self, job: _Job) -> None:
        if not job.transfer.state.is_terminal:  # a lost renewal only matters if the lease then expires:
            job.decode.renew_lease.remote(job.transfer.transfer_id)  # the commit reports that
            self._renew(job)

    def _renew(self, job: _Job) -> None:
        job.lease_until = time.monotonic() + self.kv.lease_s + PREFILL_LEASE_MARGIN_S

    def _expire_leases(self) -> None:
        while not self._stop.wait(LEASE_CHECK_S):
            now = time.monotonic()
            with self._lock:
                leased = [j for j in self._jobs.values() if j.lease_until > 0]
            for job in leased:
                if self._waits_behind_a_busy_lane(job, now):
                    self._renew_lease(job)
                elif job.lease_until < now:
                    self._expire(job)

    def _waits_behind_a_busy_lane(self, job: _Job, now: float) -> bool:
        """Whether the job's frames wait on its lane's sender thread while that sends other jobs' (one
        job's frames after another's, at the link's pace), and its leases are due for renewal (a third
        of them gone): it makes progress as the lane does, and must not lapse behind a long transfer."""
        full = self.kv.lease_s + PREFILL_LEASE_MARGIN_S
        return (job.handed.pending > 0 and now - job.lane.progressed_at < self.kv.lease_s / 3
                and job.lease_until - now < full * 2 / 3)

    def _expire(self, job: _Job) -> None:
        if not 0 < job.lease_until < time.monotonic():  # renewed since the lease thread listed it
            return
        if self._finish(job, error=f"lease expired: the transfer to its decode worker made no progress for "
                                   f"{self.kv.lease_s + PREFILL_LEASE_MARGIN_S:.0f} s", code=UNAVAILABLE):
            self.counters["leases_expired"] += 1  # not when the job had ended, or committed, meanwhile

    def _commit_when_ready(self, job: _Job, handoff: Any = None, lease_settled: bool = False) -> None:
        """Record that the job's prompt pass is over (its handoff) or its lease settled, and start its
        commit once both are, whichever comes second: first handing every layer of a job that does not
        stream layer by layer to the sender thread. A commit thread does not wait for a lease: a
        batch may hold more of a lane's reservations than the lane has commit threads, and one whose
        lease was granted would wait behind those still waiting for blocks, its lease lapsing."""
        with self._lock:
            job.handoff = job.handoff if handoff is None else handoff
            job.lease_settled = job.lease_settled or lease_settled
            ready = job.handoff is not None and job.lease_settled and not job.commit_started
            job.commit_started = job.commit_started or ready
        if not ready:
            return
        if job.lease is not None and not job.layerwise:  # held for the pass's end (no lease: failed to start)
            for layer in list(job.written):
                self._forward_layer(job, layer)
        self._on_lane(job.lane.committers, "commit", self._commit, job)

    def _commit(self, job: _Job) -> None:
        """Commit once every frame is delivered. Layers the decode side reports incomplete (a frame
        that arrived corrupt) are sent once more; if they still are, it recomputes the request."""
        with self._lock:
            if not self._owns(job):  # the reservation failed, or a cancel came: already finished
                return
        transfer, outgoing, lane, handoff = job.transfer, job.outgoing, job.lane, job.handoff
        try:
            recompute = outgoing is None
            for attempt in range(2):
                if not self._sent_while_progressing(job):
                    return  # ended meanwhile (a cancel, a fault, its lease): `_finish` did the rest
                if outgoing is not None:
                    outgoing.channel.finish(COMMIT_TIMEOUT_S)  # what is left: the transport's window at most
                    job.delivered_at = job.delivered_at or time.time()
                self._renew(job)  # the commit has its own bound (a recompute job sent nothing to renew it)
                if transfer.state.is_terminal:  # not committed once ended: its blocks here may be another's
                    return
                incomplete = ray.get(job.decode.commit.remote(transfer.transfer_id, handoff, recompute),
                                     timeout=COMMIT_TIMEOUT_S)
                self._renew(job)
                if not incomplete:
                    break
                if attempt == 0:
                    log.warning("request %s: layers %s arrived incomplete, sending them again", job.request_id,
                                incomplete)
                    self.counters["frames_resent"] += 1
                    block_ids = list(self.loop.call(lambda e: e.requests[job.request_id].block_table))
                    if not self._reopen_channel(job):
                        return  # cancelled meanwhile: `_finish` did the rest
                    job.handed.add(lane.sender.submit(self._resend, job, incomplete, block_ids))
                else:
                    log.warning("request %s: layers %s still incomplete, the decode worker recomputes it",
                                job.request_id, incomplete)
                    self.counters["recomputed"] += 1
                    recompute = True
                    ray.get(job.decode.commit.remote(transfer.transfer_id, handoff, True), timeout=COMMIT_TIMEOUT_S)
            if not transfer.advance_unless_finished(TransferState.SUCCESS):
                return  # cancelled during the commit: the router aborts the request on the decode worker
            self.sink.send(job.request_id, events={HANDOFF_COMMITTED: time.time()})  # this worker may go now
            sent = outgoing.bytes_sent if outgoing is not None else 0
            transfer.bytes_moved = sent
            ev = transfer.events
            self.metrics.ended(job.transport, job.lease.codec, "recomputed" if recompute else "success", sent,
                               ev["success"] - ev["reserved"])
            self.transfer_log.append({
                "bytes": sent, "first_layer": ev["transferring"], "last_layer": job.last_layer_at,
                "prompt_done": job.prompt_done_at, "delivered": job.delivered_at, "committed": ev["success"],
                "tokens": len(handoff.prompt_token_ids), "recomputed": recompute, "layerwise": job.layerwise,
                "cached_tokens": job.lease.cached_blocks * self.engine.kv_layout.block_size,
                "codec": job.lease.codec, "levels": dict(outgoing.levels_used) if outgoing else {}})
            self._finish(job)
        except Exception as e:
            self._finish(job, error=f"KV transfer failed: {_reason(e)}", code=UNAVAILABLE)

    def _sent_while_progressing(self, job: _Job) -> bool:
        """Wait until the job's work on the sender thread is done (its frames handed to the channel);
        False if the job ended meanwhile. No bound of its own: a long prompt over a slow link may take
        longer than any fixed one, and each frame renews the lease, so the lease ends a transfer that
        stops making progress (the lease thread finishes the job, which this then sees)."""
        while True:
            try:
                job.handed.wait(LEASE_CHECK_S)
                return not job.transfer.state.is_terminal
            except TimeoutError:
                if job.transfer.state.is_terminal:
                    return False

    def _resend(self, job: _Job, layers: list[int], block_ids: list[int]) -> None:
        if not job.transfer.state.is_terminal:  # a commit that gave up waiting ended it: its blocks are freed
            self._renew(job)  # frames flowing again are progress, as the first time
            job.outgoing.resend_layers(layers, block_ids)
            self._renew(job)

    def _reopen_channel(self, job: _Job) -> bool:
        """Replace the job's finished channel (a finished stream takes no more frames) with a fresh one;
        False, the fresh one closed, when the job ended meanwhile: `_finish` closed only the old one."""
        job.outgoing.channel.close()
        fresh = self._open_channel(job.lease, job.transfer.transfer_id)
        with self._lock:  # `_finish` takes the job out under it, then closes whichever channel it finds
            owned = self._owns(job)
            if owned:
                job.outgoing.channel = fresh
        if not owned:
            fresh.close()
        return owned

    # --- every job ends here --------------------------------------------------------------------
    def _finish(self, job: _Job, error: str | None = None, code: str = UNAVAILABLE, reason: str = "",
                last_message: Callable[[], None] | None = None) -> bool:
        """End a job once (later calls do nothing): release everything, report a failure. Whether this
        call reported `error` (not when the job had ended already, or its transfer committed).
        `last_message` (a request done at its first token: that token, final) is sent only if this call
        ends the job, so a fault or lease expiry that ends it just after cannot report it failed too."""
        with self._lock:
            if self._jobs.get(job.request_id) is not job:
                return False
            del self._jobs[job.request_id]
            queued, job.state = job.state == "queued", "done"
        if last_message is not None:
            try:
                last_message()
            except Exception:  # the rest must run: the blocks here and the reservation there are freed
                log.exception("request %s: sending its last message failed", job.request_id)
        if queued:  # a cancelled job left in the queues would count toward a batch's room and its lanes
            self.queues.remove(lambda j: j is job)
        failed = job.transfer is not None and job.transfer.fail(error or reason)  # from here on no frame is sent
        if error is not None and job.transfer is not None and job.transfer.state is TransferState.SUCCESS:
            # Committed (a lease expiry or a fault landing just after): the request is the decode
            # worker's now, and nothing failed; an error would have the router redo it.
            log.info("request %s: %s, after its commit: ignored", job.request_id, error)
            error = None
        if error is not None:
            log.warning("request %s: %s", job.request_id, error)
        if failed:
            job.decode.abort_transfer.remote(job.transfer.transfer_id, error or reason)
            if error is not None:  # a cancel is no failure of the transfer
                self.metrics.ended(job.transport, job.lease.codec if job.lease else "none", "failed")
        if job.outgoing is not None:  # a committed transfer's channel is finished: nothing to drain
            # Failed or ended early, its frames in flight are answered first (refused: the decode side
            # aborted it), so its shm segment is reused and a gloo/NCCL pair's group stays for the others.
            self._close_channel(job, drain=job.transfer.state is not TransferState.SUCCESS)
        request_id = job.request_id
        self.loop.post(lambda e: e.abort_request(request_id))  # frees the held blocks (no-op if none)
        if error is not None:
            self.sink.send(request_id, error=error, error_code=code)
        return error is not None

    def _close_channel(self, job: _Job, drain: bool) -> None:
        """Close the job's channel; to `drain` it, on a thread of its lane once its frames in flight are
        answered (bounded by `DRAIN_S`; a frame the decode side refused, its transfer aborted, is
        answered too)."""
        channel = job.outgoing.channel

        def drain_and_close() -> None:
            try:
                job.handed.wait(DRAIN_S)  # the job's queued frames are skipped or sent
                channel.finish(DRAIN_S)
            except (TransferError, TimeoutError, CancelledError, RuntimeError):  # the last two: shutting down
                pass  # not drained: `close` releases what it cannot reuse
            except Exception:  # the transport's own failure: the job is over, so it costs only the reuse
                log.exception("draining a KV channel failed; closing it")
            finally:
                _close_logged(channel)

        if drain:
            try:
                self._on_lane(job.lane.drains, "drain", drain_and_close)
                return
            except RuntimeError:  # shutting down: no drain thread takes it
                pass
        _close_logged(channel)

    def _on_fault(self, reason: str) -> None:
        """Fail every job with an explicit error; `ping` now reports the worker dead (it gets restarted)."""
        self.fault = self.fault or f"{self.worker_id}: {reason}"
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            self._finish(job, error=self.fault, code=INTERNAL)


def _add_prompt(engine: LLMEngine, work: WorkRequest) -> Exception | None:
    """Add a prompt to compute (on the engine loop); the error that refused it, if one did."""
    try:
        engine.add_request(work.prompt_token_ids, work.params, work.request_id, prefill_only=True)
    except Exception as e:  # the request's own fault (a prompt the engine cannot take): the others go on
        return e
    return None


def _close_logged(channel: LayerChannel) -> None:
    """Close a channel; a failure (its release message not sent) is logged, never raised: the job's
    blocks must still be freed and its router told, whatever the channel does."""
    try:
        channel.close()
    except Exception:
        log.exception("closing a KV channel failed")


def _peer(lease: Lease) -> str:
    """A decode worker as its leases name it (its node and where it listens)."""
    return f"{lease.node_id}|{sorted(lease.addresses.items())}"


def _code(e: BaseException) -> str:
    """The status a failed start gets: busy (decode memory full) is not broken. A reservation left
    unanswered is UNAVAILABLE: the router tries another decode worker."""
    if _is(e, KVMemoryFull):
        return RESOURCE_EXHAUSTED
    return INVALID_ARGUMENT if _is(e, ValueError) else UNAVAILABLE


def _is(e: BaseException, cls: type) -> bool:
    """Whether `e`, or the error a Ray call wrapped in it, is a `cls`."""
    return isinstance(e, cls) or isinstance(getattr(e, "cause", None), cls)


def _reason(e: BaseException) -> str:
    """The innermost message of an exception, without Ray's wrapping."""
    cause = getattr(e, "cause", None) or e.__cause__
    if isinstance(e, TransferError) or cause is None:
        return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return _reason(cause)
