"""The prefill worker: computes prompts, samples the first token, hands the KV to a decode worker.

A thin Ray surface over three parts: the engine loop (`engine.engine_loop`), the waiting line
(`queues`: FCFS, or LAPS's short and long queues) and the KV sending side (`kv_transfer.sender.
KVSender`, which holds each transfer's state machine and its threads). Each request is a job:

    queued -> started -> done
       \\_________\\______> done (cancelled or failed)

`prefill` only queues the job (bounded: past `max_queued` the request fails at once with
RESOURCE_EXHAUSTED); a request with images has them placed first, on that call's thread (their
embeddings taken from the encode worker that made them, or the images decoded for the engine to
encode), so that the feeder never waits on them. The feeder thread takes jobs when they are due (FCFS: when the engine has less
than one step's budget of work ahead, so a reservation is made for the prompt pass, not while
the job queues; LAPS: a long prompt when the one before is on its last chunk; a batch of shorts
together) and starts them: each job's transfer, then their prompts in one engine command, so a
batch shares a step. A transfer's reservation on its decode worker is asked for beside the pass where
its KV streams beside it (long prompts), else as the pass ends (`KVSender.pass_started`): never before
the pass, which never waits for it. A decode worker with a
reservation still unanswered holds back only the prompts bound for it: the feeder starts the others'
meanwhile. The engine's layer hook hands each layer of each chunk to the job's transfer as soon as it
is written; the pass's end (its first token) goes to the router and to the transfer, which commits
once every frame is delivered. `_finish` ends every job, on every path, once: it ends the transfer
(aborted on the decode worker unless committed), frees the local blocks and, for a failure, tells the
router why. A cancel (`abort`) is honoured in every state.

Before serving, the worker profiles its prompt passes (`profile`, called by the launcher, and by the
supervisor after a restart); its health report carries the fitted step cost, the LAPS threshold
derived from it, the LAPS chunk, and whether it has been profiled. It publishes every change of its
prefix cache to the router (`pdserve.kv_events`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine import LLMEngine, RequestOutput
from pdserve.engine.llm_engine import ImagePrompt
from pdserve.engine.profiler import profile_prefill
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.kv_transfer.codecs import usable_codec
from pdserve.kv_transfer.sender import DraftKV, KVSender, OutgoingKV, TransferOutcome
from pdserve.kv_transfer.settings import TransferSettings
from pdserve.kv_transfer.state import TransferState
from pdserve.prefill_worker.queues import PrefillQueues, laps_settings
from pdserve.threads import start_guarded
from pdserve.wire import (INTERNAL, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, LifetimeEvent, Tombstones,
                          WorkerStatus, WorkRequest, token_message)
from pdserve.diagnostics import LogLevel
from pdserve.worker_base import RayDecodePeer, WorkerBase, fault_text

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    work: WorkRequest
    peer: RayDecodePeer
    new_tokens: int  # the prompt tokens the router expects this worker to compute (its cache has the rest)
    short: bool = False  # in LAPS's short queue
    state: str = "queued"
    kv: OutgoingKV | None = None  # its transfer, once started
    arrived: float = field(default_factory=time.time)
    prefill_started: float = 0.0
    prompt: ImagePrompt | None = None  # its images placed, as it was queued (a vision-language model's request)

    @property
    def request_id(self) -> str:
        return self.work.request_id


class PrefillWorker(WorkerBase):
    def __init__(self, worker_id: str, model: Any, engine_config: dict, token_sink: str,
                 kv_settings: TransferSettings, max_queued: int = 64, kv_events: str | None = None,
                 length_aware: bool = False, short_prompt_tokens: int | None = None,
                 short_batch_window_s: float | None = None, long_chunk_tokens: int | None = None,
                 faults: Any = None, log_level: LogLevel = "warning") -> None:
        super().__init__(worker_id, model, engine_config, token_sink, kv_settings, kv_events, faults, log_level)
        self._laps = (length_aware, short_prompt_tokens, short_batch_window_s, long_chunk_tokens)
        # `profile` sets LAPS up from the measured costs
        self.queues: PrefillQueues[_Job] = PrefillQueues(False, key=lambda job: job.peer.key)
        self.engine.set_layer_hook(self._push_layer)
        self.engine.set_preempt_hook(self._on_preempted)
        self.max_queued = max_queued
        codecs = self._usable_codecs(self.kv.codecs)  # by name, in the order they are offered
        draft = self.engine.draft_model if self.engine.config.draft_prompt_kv else None
        self.sender = KVSender(self.kv, self.engine.kv_cache, codecs, self._transfer_ended,
                               lambda e: self._on_fault(f"KV sender failed: {type(e).__name__}: {e}"),
                               node_id=self.node_id, wrap_channel=self.faults.channel,
                               draft=DraftKV(draft.kv_identity, draft.runner.kv_cache) if draft is not None else None)
        self._jobs: dict[str, _Job] = {}
        self.aborted = Tombstones()
        self._peers: dict[Any, RayDecodePeer] = {}  # decode worker's actor handle -> its peer
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.start_loop()
        self.start_receivers(None)  # image embeddings from the encode pool, for a vision-language model
        # Takes jobs from the queues when they are due and starts them: waits on the queues and the
        # engine's room, apart from the engine loop and the KV sender.
        start_guarded("prefill-feeder", self._feed, lambda e: self._on_fault(f"feeder failed: {type(e).__name__}: {e}"))

    def profile(self) -> WorkerStatus:
        """Measure prompt passes (before serving; the launcher runs one worker at a time), then set up
        the queues from the measured costs. Returns the health report."""
        profile = self.loop.call(lambda engine: profile_prefill(engine, self.loop.deliver), timeout=300)
        self.queues.configure(*self._laps_settings(*self._laps))
        self._profiled = profile.complete  # else (a busy engine) the supervisor has it profile again
        return self.ping()

    def _laps_settings(self, length_aware: bool, short_tokens: int | None, window_s: float | None,
                       chunk_tokens: int | None) -> tuple[bool, int, float, int]:
        """The queues' settings (`PrefillQueues.configure`), derived where the manifest leaves them
        (`queues.laps_settings`); sets the engine's prefill chunk."""
        config = self.engine.config
        laps = laps_settings(length_aware, short_tokens, window_s, chunk_tokens, self.engine.step_costs.coefficients,
                             config.max_num_batched_tokens, self.engine.max_model_len)
        if laps.chunk_tokens is not None:
            config.prefill_chunk_size = laps.chunk_tokens
        return laps.length_aware, laps.short_tokens, laps.window_s, laps.short_room

    def ping(self) -> WorkerStatus:
        with self._lock:
            jobs = len(self._jobs)
        return self.status(self.sender.num_transfers(), jobs=jobs, chunk_tokens=self.engine.config.chunk_limit,
                           short_prompt_tokens=self.queues.short_tokens, metrics=self.sender.metrics.exposition())

    def stats(self) -> dict:
        return {**self.common_stats(), "transfers": list(self.sender.transfer_log)}

    @property
    def counters(self) -> dict[str, int]:
        """The KV sender's counts (frames resent, recomputed, leases expired, ...)."""
        return self.sender.counters

    def probe_transfer(self, decode: Any, num_tokens: int) -> dict:
        """Send every layer of `num_tokens` tokens of (random) raw KV to `decode`, then abort it: the
        transport's bandwidth and a whole handoff's time (`KVSender.probe`)."""
        layout = self.engine.kv_layout
        return self.sender.probe(self._peer(decode), num_tokens, lambda n: torch.randn(
            2, n, layout.num_kv_heads, layout.head_dim).to(layout.dtype))

    # --- requests -------------------------------------------------------------------------------
    def prefill(self, work: WorkRequest, decode: Any, new_tokens: int | None = None) -> None:
        """Queue one request's prefill and handoff; the outcome reaches the router as token messages.
        `new_tokens`: the part of the prompt the router expects this worker not to cache (its queue)."""
        new_tokens = len(work.prompt_token_ids) if new_tokens is None else new_tokens
        prompt = None
        if work.images:  # before it queues, on this call's thread: the feeder never waits on another's images
            try:  # (their embeddings taken from the encoder that made them, or decoded for the engine to encode)
                prompt = self.image_prompt(work)
            except Exception as e:  # this request's images (even one that failed their processor)
                self.sink.send(work.request_id, error=f"prefill could not start: {e}", error_code=_code(e))
                return
        peer = self._peer(decode)
        not_answering = self.sender.refusal(peer)
        with self._lock:  # the lock `abort` takes too: a cancel lands before or after, never between
            refusal = None
            waiting = sum(1 for j in self._jobs.values() if j.kv is None or j.kv.handoff is None)
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
                job = self._jobs[work.request_id] = _Job(work, peer, new_tokens, self.queues.is_short(new_tokens),
                                                          prompt=prompt)
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
        with self._lock:
            self._stop.set()
        self.sender.close()
        self.stop_receivers()
        self.close_common()

    def _peer(self, decode: Any) -> RayDecodePeer:
        """The peer of a decode worker, made on its first request. A restarted decode worker keeps its
        actor, so its peer."""
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError(f"prefill worker {self.worker_id} is shutting down")
            peer = self._peers.get(decode)
            if peer is None:
                peer = self._peers[decode] = RayDecodePeer(decode)
            return peer

    # --- the feeder thread ----------------------------------------------------------------------
    def _feed(self) -> None:
        while not self._stop.is_set() and self.fault is None:
            jobs = []
            for job in self.queues.take(0.1, self._long_busy, self._short_inflight, self.sender.reserving):
                if (refusal := self.sender.refusal(job.peer)) is not None:  # queued as its decode worker stopped answering
                    self._finish(job, error=refusal, code=UNAVAILABLE)
                else:
                    jobs.append(job)
            if jobs and not self.queues.length_aware:
                self._wait_for_room()
            self._start(jobs)

    def _start(self, jobs: list[_Job]) -> None:
        """Start the transfers of jobs released together, then their prompts, in one engine command so
        that they share a step (their reservations go beside the pass or after it, never before).
        Returns once the prompts are in the engine, so the next room check counts them."""
        with self._lock:  # all marked at once: a ping or the queues' checks see the batch whole
            jobs = [job for job in jobs if self._owns(job) and not self._stop.is_set()]  # not cancelled since
            now = time.time()
            for job in jobs:
                job.state, job.prefill_started = "started", now
        started = []
        for job in jobs:
            work = job.work
            # with images, their placeholders expanded: the prompt the decode worker reserves for
            token_ids = work.prompt_token_ids if job.prompt is None else job.prompt.token_ids
            try:
                kv = self.sender.start(work.request_id, token_ids, work.params, job.new_tokens, job.peer, job.arrived,
                                       images=None if job.prompt is None else job.prompt.images, ask_now=False)
            except Exception as e:
                self._finish(job, error=f"prefill could not start: {e}", code=UNAVAILABLE)
                continue
            with self._lock:
                owned = self._owns(job)
                if owned:
                    job.kv = kv
            if not owned:  # cancelled meanwhile: `_finish` found no transfer to end
                self.sender.end(kv, "request ended while reserving")
                continue
            kv.reservation.add_done_callback(lambda _: self.queues.wake())  # its decode worker's next jobs may start
            started.append(job)
        if not started:
            return
        try:
            errors = self.loop.call(lambda engine: [_add_prompt(engine, job) for job in started])
        except Exception as e:  # the loop stopped, or a long command held it past the call's bound
            errors = [e] * len(started)
        for job, error in zip(started, errors):
            if error is not None:
                self._finish(job, error=f"prefill could not start: {error}", code=_code(error))
                continue
            self.sender.pass_started(job.kv)  # (nothing when the job ended meanwhile)
            with self._lock:
                owned = self._owns(job)
            if not owned:  # ended meanwhile: its engine command may have preceded the add
                self.loop.post(lambda e, request_id=job.request_id: e.abort_request(request_id))

    def _in_pass(self, short: bool) -> list[_Job]:
        with self._lock:
            return [j for j in self._jobs.values() if j.short == short and j.kv is not None and j.kv.handoff is None]

    def _long_busy(self) -> bool:
        """Whether a long prompt holds the engine beyond its last chunk. The next long starts (reserves,
        joins the engine) while that last chunk runs: waiting for the whole pass left the engine idle
        for every long prompt's reservation, a quarter of a worker's throughput in a burst. It joins the
        step after, so a short still waits behind one chunk at most."""
        chunk = self.engine.config.chunk_limit
        for job in self._in_pass(short=False):
            seq = self.engine.requests.get(job.request_id)  # None before its prompt joins the engine
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

    def _usable_codecs(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The manifest's codecs this worker can encode with (fp8 needs a torch with it, cachegen the
        model's tables), and raw, which every decode worker falls back to: only these are offered, so
        a decode worker never agrees to a codec this side would fail every transfer on."""
        made = {name: usable_codec(name, self.model_dir, self.engine.kv_layout, "is not offered")
                for name in dict.fromkeys([*names, "raw"])}
        return {name: codec for name, codec in made.items() if codec is not None}

    # --- on the engine loop thread --------------------------------------------------------------
    def _push_layer(self, layer: int, chunks: list[ScheduledChunk]) -> None:
        """A layer of these chunks is written (the target's, or past them the draft model's): the KV of
        every token before its end is final, and its blocks stay held until the job ends (the sender
        may read them later)."""
        for chunk in chunks:
            job = self._jobs.get(chunk.seq.request_id)
            if job is not None and job.kv is not None:
                self.sender.layer_written(job.kv, layer, chunk.seq.num_computed_tokens + chunk.num_tokens,
                                          self.engine.layer_blocks(chunk.seq, layer))

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
        first_tokens, prefilled = [], []
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None or job.kv is None:  # cancelled or failed meanwhile; `_finish` frees its blocks
                continue
            # `transfer_start` comes from the decode worker: the first token may leave before the lease.
            events = {LifetimeEvent.PREFILL_QUEUED: job.arrived, LifetimeEvent.PREFILL_START: job.prefill_started,
                      LifetimeEvent.PREFILL_END: now}
            if out.finish_reason == "prefilled":
                first_tokens.append(token_message(out.request_id, out.new_token_ids, logprobs=out.logprobs,
                                                  events=events, cached_tokens=out.num_cached_tokens,
                                                  first_index=out.first_new_index,
                                                  prompt_tokens=len(out.prompt_token_ids)))
                prefilled.append((job, self.engine.export_handoff(out.request_id)))
            else:  # finished on its first token (stop, length): nothing to hand over
                self._finish(job, reason="request finished at prefill", last_message=lambda out=out, events=events:
                             self.sink.send(out.request_id, out.new_token_ids, logprobs=out.logprobs,
                                            finish_reason=out.finish_reason, text=out.text, events=events,
                                            cached_tokens=out.num_cached_tokens, first_index=out.first_new_index,
                                            prompt_tokens=len(out.prompt_token_ids)))
        self.sink.send_step(first_tokens)  # the step's first tokens in one message, before their handoffs go on
        for job, handoff in prefilled:
            self.sender.prompt_done(job.kv, handoff)

    # --- every job ends here --------------------------------------------------------------------
    def _transfer_ended(self, kv: OutgoingKV, outcome: TransferOutcome) -> None:
        """The KV sender ended a transfer (committed, or failed)."""
        with self._lock:
            job = self._jobs.get(kv.request_id)
        if job is None or job.kv is not kv:
            return
        if kv.transfer.state is TransferState.DONE:  # committed (a failure landing just after changes nothing)
            self.sink.send(job.request_id, events={LifetimeEvent.HANDOFF_COMMITTED: time.time()})  # this worker may go now
            self._finish(job)
            return
        self._finish(job, error=outcome.error, code=outcome.code)
        if outcome.peer_not_answering:  # the jobs queued for it fail now: the router places them elsewhere
            for queued in self.queues.remove(lambda j: j.peer is job.peer):
                self._finish(queued, error=outcome.error, code=UNAVAILABLE)

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
        if queued:  # a cancelled job left in the queues would count toward a batch's room and its peer's
            self.queues.remove(lambda j: j is job)
        if job.kv is not None and self.sender.end(job.kv, error or reason) and error is not None:
            # Committed (a lease expiry or a fault landing just after): the request is the decode
            # worker's now, and nothing failed; an error would have the router redo it.
            log.info("request %s: %s, after its commit: ignored", job.request_id, error)
            error = None
        if error is not None:
            log.warning("request %s: %s", job.request_id, error)
        request_id = job.request_id
        self.loop.post(lambda e: e.abort_request(request_id))  # frees the held blocks (no-op if none)
        if error is not None:
            self.sink.send(request_id, error=error, error_code=code)
        return error is not None

    def _on_fault(self, reason: str) -> None:
        """Fail every job with an explicit error; `ping` now reports the worker dead (it gets restarted)."""
        self.fault = self.fault or fault_text(self.worker_id, reason)
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            self._finish(job, error=self.fault, code=INTERNAL)


def _add_prompt(engine: LLMEngine, job: _Job) -> Exception | None:
    """Add a prompt to compute (on the engine loop: its images' vision-tower pass too); the error that
    refused it, if one did."""
    work = job.work
    try:
        engine.add_request(job.prompt or work.prompt_token_ids, work.params, work.request_id, prefill_only=True)
    except Exception as e:  # the request's own fault (a prompt the engine cannot take): the others go on
        return e
    return None


def _code(error: BaseException) -> str:
    """A prompt the engine refused is the request's own fault; anything else is this worker's."""
    return INVALID_ARGUMENT if isinstance(error, ValueError) else UNAVAILABLE
