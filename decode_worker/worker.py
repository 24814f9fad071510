"""The decode worker: takes KV handoffs into its pool and decodes in one continuous batch.

The receiving half of the KV-transfer protocol: its control plane (`reserve`, `renew_lease`,
`commit`, `abort_transfer`) as actor methods, its data plane as the receiving halves of the
transports the manifest allows (shared memory, gRPC, gloo or NCCL), all delivering frames into one
`KVReceiver`. A lease tells the sender where those listen and on which node this worker runs. Tokens go to the router over pyzmq, one message
per request per step. `generate` runs a whole request here: the colocated mode, and the declared
fallback for prompts that are not worth a transfer.

`migrate` moves a running request to another decode worker with its KV (live migration), through
the sending side of the same protocol (`KVSender`, raw KV only: a lossy codec would change the
tokens the request goes on to sample): the request leaves this batch between two steps, keeping its
blocks; the other worker reserves with the tokens sampled so far and takes the KV; on its commit the
blocks here are freed and the stream goes on from there with the next token. A move that fails (the
other worker refused, died, or let the lease lapse) puts the request back into this batch: nothing
is lost and nothing repeats.

A fault in the engine loop or the lease thread fails every request the worker holds with an
explicit INTERNAL error and makes `ping` report the worker dead, so the supervisor restarts it.

Like a prefill worker it profiles its prompt passes before serving and reports the fitted step cost
(the router weighs a local prefill against a transfer with it), and publishes every change of its
prefix cache to the router (`pdserve.kv_events`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import ray

from pdserve.engine import LLMEngine, RequestOutput
from pdserve.engine.engine_loop import LoopStopped
from pdserve.engine.llm_engine import ImagePrompt, RequestHandoff
from pdserve.engine.multimodal.placement import PromptImages
from pdserve.engine.model_store import ModelSource
from pdserve.engine.profiler import profile_decode, profile_prefill
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import SequenceStatus
from pdserve.kv_transfer.codecs import make_codec
from pdserve.kv_transfer.interface import PROBE_PREFIX, Lease, TransferError
from pdserve.faults import FaultSettings
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.sender import KVSender, OutgoingKV, TransferOutcome
from pdserve.kv_transfer.state import TransferState
from pdserve.kv_transfer.settings import TransferSettings
from pdserve.threads import start_guarded
from pdserve.wire import (INTERNAL, INVALID_ARGUMENT, UNAVAILABLE, LifetimeEvent, MoveOutcome, WorkerStatus,
                          WorkRequest, token_message)
from pdserve.diagnostics import LogLevel
from pdserve.worker_base import RayDecodePeer, WorkerBase, fault_text

# Reservations get their own threads: one waits up to `reserve_wait_s` for free blocks, and with a full
# pool enough of them would hold every ordinary thread, so that the commits, lease renewals and aborts
# that free blocks could not run. As many as there are ordinary threads: one queued for a thread starts
# its own `reserve_wait_s` late, and the prefill side gives up on it `reserve_answer_margin_s` later.
RESERVE_GROUP = "reserve"
RESERVE_THREADS = 64
# Moves out get their own threads too: each `migrate` call waits for its move to end, and a drain
# moving a whole batch must not hold the threads its commits and aborts need. More moves wait for one.
MIGRATE_GROUP = "migrate"
MIGRATE_THREADS = 16


@dataclass(eq=False)
class _Move:
    """A running request being moved out (`DecodeWorker.migrate`)."""

    request_id: str
    kv: OutgoingKV | None = None  # its transfer, once started
    aborted: bool = False  # the router cancelled it meanwhile: the move is not started, or ended
    outcome: TransferOutcome | None = None
    ended: threading.Event = field(default_factory=threading.Event)


class DecodeWorker(WorkerBase):
    def __init__(self, worker_id: str, model: ModelSource, engine_config: dict, token_sink: str,
                 kv_settings: TransferSettings, kv_events: str | None = None,
                 faults: FaultSettings | None = None, log_level: LogLevel = "warning") -> None:
        super().__init__(worker_id, model, engine_config, token_sink, kv_settings, kv_events, faults, log_level)
        # Lifetime events of the requests here (request -> name -> wall-clock time), sent with the last token.
        # One with prefill_queued and no prefill_end is prefilling here, before its first token.
        self._events: dict[str, dict[LifetimeEvent, float]] = {}
        self._stop = threading.Event()
        self.step_log: deque[tuple[int, float]] = deque(maxlen=4096)  # (batch size, step seconds)
        self.engine.set_preempt_hook(self._on_preempted)
        self.start_loop()
        self.receiver = KVReceiver(self.loop, self.model_dir, lease_s=self.kv.deadlines.lease_s,
                                   reserve_wait_s=self.kv.deadlines.reserve_wait_s)
        self.start_receivers(self.receiver)
        self.mover = KVSender(self.kv, self.engine.kv_cache, {"raw": make_codec("raw", None, self.engine.kv_layout)},
                              self._move_ended, lambda e: self._on_fault(f"KV mover failed: {type(e).__name__}: {e}"),
                              node_id=self.node_id, wrap_channel=self.faults.channel)
        self._moves: dict[str, _Move] = {}
        self._moves_lock = threading.Lock()
        # Ends the leases of transfers that stopped making progress: the one periodic chore here.
        start_guarded("lease-expiry", self._expire_leases,
                      lambda e: self._on_fault(f"lease thread failed: {type(e).__name__}: {e}"))

    def ping(self) -> WorkerStatus:
        shape = self.engine.decode_step_shape
        return self.status(self.receiver.num_in_flight, kv_addresses=self.kv_addresses,
                           receiver_counts=self.receiver.counts(), step_tokens_per_seq=shape.tokens_per_seq,
                           step_propose_s=shape.propose_s)

    def profile(self) -> WorkerStatus:
        """Measure prompt passes and decode steps (before serving; the launcher runs one worker at a
        time); returns the health report, with the fitted step cost."""
        profile = self.loop.call(lambda engine: profile_prefill(engine, self.loop.deliver), timeout=300)
        if self.engine.config.speculative is not None:  # the decode cost that sizes its drafts
            self.loop.call(profile_decode, timeout=300)
        self._profiled = profile.complete  # else (a busy engine) the supervisor has it profile again
        return self.ping()

    def stats(self) -> dict:
        return {**self.common_stats(), "steps": list(self.step_log)}

    # --- KV transfer, receiving side ------------------------------------------------------------
    @ray.method(concurrency_group=RESERVE_GROUP)
    def reserve(self, transfer_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                num_kv_tokens: int, codecs: list[str] | None = None, draft_kv: str | None = None,
                output_token_ids: list[int] | None = None, images: PromptImages | None = None) -> Lease:
        """Reserve blocks for an incoming request; the lease says which leading blocks are cached here,
        the codec agreed (the first of `codecs` this worker can decode, else raw), whether the draft
        model's KV is to come too (`draft_kv`: the sender's draft), where the transports listen, and
        what recomputing the KV here would cost instead. `output_token_ids`: a request moved here
        from another decode worker, the tokens it sampled there (but the last). `images`: where a
        multimodal prompt's images are."""
        if self.fault is not None:
            raise TransferError(self.fault)
        if not request_id.startswith(PROBE_PREFIX):  # the launcher's transfer probes are no requests
            self.faults.took_request()
        lease = self.receiver.reserve(transfer_id, request_id, prompt_token_ids, params, num_kv_tokens,
                                      codecs or ["raw"], draft_kv, output_token_ids, images)
        missing = num_kv_tokens - lease.cached_blocks * self.engine.config.block_size
        recompute_s = self.engine.step_costs.coefficients.prefill_s(missing, num_kv_tokens - missing)
        # A prompt with images is never recomputed here: the embeddings stay where the images were encoded.
        return dataclasses.replace(lease, addresses=self.kv_addresses, node_id=self.node_id, worker_id=self.worker_id,
                                   recompute_s=recompute_s if self._profiled and images is None else None)

    def renew_lease(self, transfer_id: str) -> Lease:
        return self.receiver.renew(transfer_id)

    def commit(self, transfer_id: str, handoff: RequestHandoff, recompute: bool = False) -> list[int]:
        """Queue the request for the batch (`decode_start`, or `migrated` for a request moved here
        running: from here on it is this worker's to decode); returns the layers still incomplete
        instead (see `KVReceiver.commit`)."""
        request_id = handoff.request_id
        now = time.time()  # every frame has been delivered
        try:
            moved = self.receiver.is_move(transfer_id)
            # A moved request's earlier events are the worker's it came from (`MoveOutcome.events`).
            events = self._events[request_id] = {} if moved else {
                LifetimeEvent.TRANSFER_END: now, LifetimeEvent.KV_RESERVED: self.receiver.reserved_at(transfer_id),
                LifetimeEvent.TRANSFER_START: self.receiver.started_at(transfer_id)}
            incomplete = self.receiver.commit(transfer_id, handoff, recompute)
            if not incomplete:  # admitted (its first step may already have ended it: then it is the step's end)
                events.setdefault(LifetimeEvent.MIGRATED if moved else LifetimeEvent.DECODE_START, time.time())
            return incomplete
        finally:
            if request_id in self.receiver.aborted or request_id not in self.engine.requests:
                self._events.pop(request_id, None)  # failed, or cancelled meanwhile

    def abort_transfer(self, transfer_id: str, reason: str) -> bool:
        return self.receiver.abort(transfer_id, reason)

    # --- whole requests -------------------------------------------------------------------------
    def generate(self, work: WorkRequest) -> None:
        """Prefill and decode here (colocated mode); a refusal reaches the router as an error message."""
        self._run_here(work, lambda e, prompt: e.add_request(prompt, work.params, work.request_id))

    def resume(self, work: WorkRequest, generated: list[int], logprobs: list[float]) -> None:
        """Continue a request that lost its worker, from its prompt and the tokens the client already has
        (the router sends exactly those, so none repeats and none is missing): both are prefilled here,
        and sampling goes on at the same output position (a seeded request draws what it would have)."""
        handoff = RequestHandoff(work.request_id, work.prompt_token_ids, list(generated), work.params,
                                 num_computed_tokens=0, logprobs=list(logprobs))
        self._run_here(work, lambda e, prompt: e.resume_request(handoff, prompt if work.images else None))

    def _run_here(self, work: WorkRequest, add: Callable[[LLMEngine, list[int] | ImagePrompt], object]) -> None:
        """`add(engine, prompt)` on the engine loop: the prompt's images decoded (or their embeddings
        fetched) before, on this thread, so that the batch never waits on them."""
        if work.request_id in self.receiver.aborted:  # cancelled before this call ran
            return
        if self.fault is not None:
            self.sink.send(work.request_id, error=self.fault, error_code=INTERNAL)
            return
        self.faults.took_request()
        # A local prefill's start is when it enters the engine's queue: the engine schedules it on its next steps.
        now = time.time()
        self._events[work.request_id] = {LifetimeEvent.PREFILL_QUEUED: now, LifetimeEvent.PREFILL_START: now}
        try:
            prompt = self.image_prompt(work) if work.images else work.prompt_token_ids
            self.loop.call(lambda engine: add(engine, prompt))
        except Exception as e:
            self._events.pop(work.request_id, None)
            code = INVALID_ARGUMENT if isinstance(e, ValueError) else UNAVAILABLE
            self.sink.send(work.request_id, error=f"{self.worker_id} cannot take the request: {e}", error_code=code)
            return
        if work.request_id in self.receiver.aborted:  # the abort ran while the request was being added
            self._events.pop(work.request_id, None)
            self.loop.post(lambda e: e.abort_request(work.request_id))

    # --- moving running requests out (live migration) -----------------------------------------------
    @ray.method(concurrency_group=MIGRATE_GROUP)
    def migrate(self, request_id: str, target: Any) -> MoveOutcome:
        """Move a running request to decode worker `target` (its actor handle) with its KV; returns
        when the move has ended. Moved: `target` holds it and sends its next token, this worker holds
        nothing of it. Not moved: it decodes here still (`tried`: False when it was not decoding here,
        as a request still queued or prefilling: it can move later, or by recompute)."""
        move = _Move(request_id)
        with self._moves_lock:
            if self.fault is not None or request_id in self._moves or request_id in self.receiver.aborted:
                return MoveOutcome(False, self.fault or "it is already moving, or was cancelled", tried=False)
            self._moves[request_id] = move
        try:
            return self._move(move, target)
        finally:
            with self._moves_lock:
                if self._moves.get(request_id) is move:
                    del self._moves[request_id]

    def _move(self, move: _Move, target: Any) -> MoveOutcome:
        request_id = move.request_id

        def hold(engine: LLMEngine) -> tuple[RequestHandoff | None, list[int]]:
            handoff = engine.hold_decoding(request_id)
            return handoff, list(engine.requests[request_id].block_table) if handoff is not None else []

        handoff, blocks = self.loop.call(hold, kind="kv")
        if handoff is None:
            return MoveOutcome(False, f"it is not decoding on {self.worker_id}", tried=False)
        held_at = time.perf_counter()
        try:
            kv = self.mover.start(request_id, handoff.prompt_token_ids, handoff.params, 0, RayDecodePeer(target),
                                  None, output_token_ids=handoff.output_token_ids, images=handoff.images)
        except Exception as e:  # the sender is closing (a call that cannot be sent fails the transfer later)
            self.loop.post(lambda engine: _resume_if_held(engine, request_id))
            return MoveOutcome(False, f"the move could not start: {type(e).__name__}: {e}")
        with self._moves_lock:
            move.kv, aborted = kv, move.aborted
        if aborted:  # cancelled while it was being held: `abort` found no transfer to end
            self.mover.end(kv, "aborted by the router")
            return MoveOutcome(False, "aborted by the router")
        try:
            for layer in range(self.engine.kv_layout.num_layers):  # all written: they go at once
                self.mover.layer_written(kv, layer, kv.num_kv_tokens, blocks)
            self.mover.prompt_done(kv, handoff)
        except Exception as e:  # ended here, so nothing reads the blocks once the request goes on here
            self.mover.end(kv, f"the move failed: {e}")
            self.loop.post(lambda engine: _resume_if_held(engine, request_id))
            return MoveOutcome(False, f"the move failed: {type(e).__name__}: {e}")
        # The sender ends every transfer (its own lease bounds one that stops progressing).
        while not move.ended.wait(1.0) and not self._stop.is_set():
            pass
        outcome = move.outcome
        if outcome is None or outcome.error is not None:
            in_doubt = TransferState.COMMITTING.value in kv.transfer.events
            return MoveOutcome(False, outcome.error if outcome is not None else "the worker is shutting down",
                               in_doubt=in_doubt)
        pause_s = time.perf_counter() - held_at  # the target decodes it from here on
        # Its blocks go before the router hears it moved: a drain that has moved everything leaves
        # nothing of its requests on this worker. Moved it is either way: a stopped loop's engine
        # went with the blocks, and a slow loop frees them when it runs the command.
        def drop(engine: LLMEngine) -> None:
            engine.abort_request(request_id)

        try:
            self.loop.call(drop, kind="kv")
        except (LoopStopped, TimeoutError):
            self.loop.post(drop, kind="kv")
        return MoveOutcome(True, recomputed=kv.recompute, kv_tokens=kv.num_kv_tokens, kv_bytes=kv.transfer.bytes_moved,
                           pause_s=pause_s, events=self._events.pop(request_id, {}))

    def _move_ended(self, kv: OutgoingKV, outcome: TransferOutcome) -> None:
        """The mover ended a move's transfer (on its thread): failed, the request goes back into this
        batch (committed, `_move` frees it here)."""
        request_id = kv.request_id
        with self._moves_lock:
            move = self._moves.get(request_id)
        # (`move.kv` is still None when the transfer failed before `start` returned)
        if move is None or move.kv not in (None, kv):
            return
        if kv.transfer.state is not TransferState.DONE:  # moved, `_move` frees its blocks here
            self.loop.post(lambda engine: _resume_if_held(engine, request_id))
        move.outcome = outcome
        move.ended.set()

    def _end_move(self, request_id: str, reason: str) -> None:
        """Stop moving a request out (cancelled, or the worker failed): its transfer ends before the
        engine frees the blocks it reads."""
        with self._moves_lock:
            move = self._moves.get(request_id)
            if move is None:
                return
            move.aborted, kv = True, move.kv
        if kv is not None:
            self.mover.end(kv, reason)
            move.outcome = TransferOutcome(error=reason)
            move.ended.set()

    def abort(self, request_ids: list[str]) -> list[str]:
        """Clients went away: free whatever the requests hold here (queued, running, mid-transfer or
        moving out), in one engine command. Returns the ids of those this worker held."""
        held = set()
        for request_id in request_ids:
            self._events.pop(request_id, None)
            self._end_move(request_id, "aborted by the router")
            if self.receiver.abort_request(request_id, "aborted by the router"):
                held.add(request_id)
        if self.loop.running:
            held.update(self.loop.call(lambda e: [r for r in request_ids if e.abort_request(r)]))
        return [r for r in request_ids if r in held]

    def shutdown(self) -> None:
        self._stop.set()
        self.mover.close()
        self.stop_receivers()
        self.close_common()

    # --- on the engine loop thread --------------------------------------------------------------
    def _on_preempted(self, request_id: str) -> None:
        """On the engine loop, as a step gives a request's blocks up: it is recomputed here later from
        its tokens, unless its images were encoded elsewhere (an import has no embeddings): that one
        goes back to the router, which resumes it where its images are encoded again."""
        seq = self.engine.requests.get(request_id)
        if seq is None or seq.recomputable:
            return
        self.engine.abort_request(request_id)
        self._events.pop(request_id, None)
        self.sink.send(request_id, error=f"preempted: decode worker {self.worker_id}'s KV memory is full and the "
                                         "request's images were encoded elsewhere", error_code=UNAVAILABLE)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self.faults.after_step()
        now = time.time()
        self.step_log.append((self.engine.last_step.num_seqs, self.engine.last_step.total_s))
        messages = []
        for out in outputs:
            events = {}
            local = self._events.get(out.request_id)  # gone when an abort came in between: nothing to add
            if local is not None and LifetimeEvent.PREFILL_QUEUED in local and LifetimeEvent.PREFILL_END not in local:
                # prefilled here: this step made the first token
                local.update({LifetimeEvent.PREFILL_END: now, LifetimeEvent.DECODE_START: now})
            if out.finished:
                events = self._events.pop(out.request_id, {}) | {LifetimeEvent.DECODE_END: now}
                if LifetimeEvent.MIGRATED not in events:  # a moved request started decoding elsewhere
                    events.setdefault(LifetimeEvent.DECODE_START, now)
            messages.append(token_message(
                out.request_id, out.new_token_ids, logprobs=out.logprobs[out.first_new_index:] if out.logprobs else None,
                finish_reason=out.finish_reason if out.finished else None, text=out.text if out.finished else None,
                events=events, cached_tokens=out.num_cached_tokens, first_index=out.first_new_index,
                prompt_tokens=len(out.prompt_token_ids), draft_tokens=out.num_draft_tokens if out.finished else 0,
                accepted_draft_tokens=out.num_accepted_tokens if out.finished else 0))
        self.sink.send_step(messages)

    # --- faults ---------------------------------------------------------------------------------
    def _on_fault(self, reason: str) -> None:
        """Fail every request held here with an explicit error; `ping` now reports the worker dead."""
        self.fault = self.fault or fault_text(self.worker_id, reason)
        with self._moves_lock:
            moving = list(self._moves)
        for request_id in moving:  # no move reads blocks freed below
            self._end_move(request_id, self.fault)
        held = set(self.receiver.close(reason))  # no transfer takes frames into blocks freed below
        if self.loop.running:  # the lease thread died, the loop did not: free what the requests hold
            held |= set(self.loop.call(lambda e: [r for r in list(e.requests) if e.abort_request(r)]))
        else:  # on the dead loop's own thread (or after it): nothing else touches the engine now
            held |= set(self.engine.requests)
        for request_id in held:
            self.sink.send(request_id, error=self.fault, error_code=INTERNAL)

    def _expire_leases(self) -> None:
        while not self._stop.wait(self.kv.deadlines.lease_check_s):
            self.receiver.expire_leases()


def _resume_if_held(engine: LLMEngine, request_id: str) -> None:
    """Put a request whose move failed back into the batch, unless it ended meanwhile (cancelled)."""
    seq = engine.requests.get(request_id)
    if seq is not None and seq.status is SequenceStatus.HELD:
        engine.resume_held(request_id)
