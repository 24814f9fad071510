"""What both worker actors share (`WorkerBase`): their model and engine, the engine loop, the token
sink to the router, the prefix-cache event publisher, injected faults, and the health report's
common part. Each role adds its own requests, KV side and report on top.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import ray
from ray.util.annotations import RayDeprecationWarning

from pdserve.diagnostics import LogLevel, configure_diagnostics
from pdserve.engine import EngineConfig, LLMEngine, RequestOutput
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import ImagePrompt, RequestHandoff
from pdserve.engine.multimodal.placement import PromptImages
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.model_store import ModelSource, materialize
from pdserve.faults import FaultInjector, FaultSettings
from pdserve.kv_events import KVEventPublisher, KVSnapshot
from pdserve.engine.multimodal.vision import EncodedImage
from pdserve.kv_transfer.embeddings import EMBEDDINGS_PREFIX, EmbeddingReceiver, SinkByKind
from pdserve.kv_transfer.interface import FrameSink, Lease, ReceivingTransport, TransferError
from pdserve.kv_transfer.transports import start_receiver
from pdserve.kv_transfer.settings import TransferSettings
from pdserve.wire import EncodedImages, TokenSink, WorkerStatus, WorkRequest

log = logging.getLogger(__name__)

EMBEDDINGS_POLL_S = 0.5  # how often a worker waiting for embeddings checks their transfer's lease


def _was_restarted() -> bool:
    """Whether Ray restarted this actor. Ray's `was_current_actor_reconstructed` reads its own deprecated
    `actor_id` property inside, which printed a deprecation warning in every worker's start-up log: the
    warning is Ray's, not a use of ours to change, so it is held back here and nowhere else."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RayDeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def fault_text(worker_id: str, reason: str) -> str:
    """A worker's fault as it reports it and fails its requests with."""
    return f"{worker_id}: {reason}"


def _loop_fault(error: BaseException) -> str:
    return f"engine loop failed: {type(error).__name__}: {error}"


def loop_health(worker_id: str, fault: str | None, loop: EngineLoop) -> tuple[bool, str | None]:
    """Whether the worker serves, and its fault if it has one. A failed loop is the fault from the moment
    it fails, not only once the worker's `_on_fault` has run: a ping between the two would show a dead
    worker that gives no reason. `running` is read first: the loop records its error before it stops."""
    running = loop.running
    error = loop.fatal_error
    fault = fault or (fault_text(worker_id, _loop_fault(error)) if error is not None else None)
    return running and fault is None, fault


class WorkerBase:
    def __init__(self, worker_id: str, model: ModelSource, engine_config: dict, token_sink: str,
                 kv_settings: TransferSettings, kv_events: str | None, faults: FaultSettings | None,
                 log_level: LogLevel) -> None:
        configure_diagnostics(log_level)
        self.worker_id = worker_id
        restarted = ray.is_initialized() and _was_restarted()
        self.faults = FaultInjector(faults, first_incarnation=not restarted)  # a fault that ends it fires once
        model_dir, self.model_digest = materialize(model, ray.get)  # this node's copy, the launcher's bytes
        self.model_dir = str(model_dir)
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self.kv = kv_settings.on_node(self.node_ip)
        self.engine = LLMEngine(self.model_dir, EngineConfig(**engine_config))
        self.kv_events = KVEventPublisher(kv_events, worker_id, on_crash=self._on_publisher_crash,
                                          secret=self.kv.secret) if kv_events else None
        self.engine.pool.listener = self.kv_events
        self.sink = TokenSink(token_sink, self.kv.secret)
        # A vision-language model's: where image embeddings from the encode pool arrive
        engine = self.engine
        self.embeddings = EmbeddingReceiver(engine.embedding_width, engine.max_model_len, self.kv.deadlines.lease_s) \
            if engine.vision is not None else None
        self._receivers: list[ReceivingTransport] = []
        self.kv_addresses: dict[str, str] = {}  # transport -> where this worker's receiving half listens
        self.fault: str | None = None  # why the worker is dead (it has failed its requests); None: alive
        self._profiled = False
        self._closed = threading.Event()

    def start_loop(self) -> None:
        """Start the engine loop, once the role's own state (which its callbacks use) is set up."""
        self.loop = EngineLoop(self.engine, self._on_outputs, on_fatal=self._on_loop_fatal).start()

    def status(self, transfers: int, **role: Any) -> WorkerStatus:
        """The health report: the part every role has, `role` the role's own fields."""
        engine = self.engine
        draft = engine.draft_model
        alive, fault = loop_health(self.worker_id, self.fault, self.loop)
        return WorkerStatus(worker_id=self.worker_id, node_id=self.node_id, node_ip=self.node_ip,
                            model_digest=self.model_digest, alive=alive, fault=fault, profiled=self._profiled, kv=engine.pool.status(),
                            requests=len(engine.requests), transfers=transfers,
                            step_cost=engine.step_costs.coefficients,
                            step_budget=engine.config.max_num_batched_tokens,
                            draft_blocks=draft.pool.num_blocks - draft.pool.num_free if draft is not None else 0,
                            embedding_counts=self.embeddings.counts() if self.embeddings is not None else {},
                            **role)

    def image_prompt(self, work: WorkRequest) -> ImagePrompt:
        """A request's prompt with its images placed: with the embeddings an encode worker made, sent
        here over the KV-transfer layer, else decoded here (the engine runs the vision tower as the
        request is added). Embeddings that cannot be had (their encoder died, or let them go) are made
        here instead."""
        if work.encoded is not None and self.embeddings is not None:
            try:
                encoded = self._receive_embeddings(work.request_id, work.encoded)
            except Exception as e:
                log.warning("request %s: its images' embeddings did not arrive from %s (%s): encoding them here",
                            work.request_id, work.encoded.encoder_name, type(e).__name__)
            else:
                return self.engine.place_encoded(work.prompt_token_ids, encoded)
        return self.engine.prepare_images(work.prompt_token_ids, work.images)

    def _receive_embeddings(self, request_id: str, encoded: EncodedImages) -> list[EncodedImage]:
        """Reserve room for the images' embeddings and have their encoder send them; the transfer is
        given up if they have not all arrived within a lease's time."""
        transfer_id = f"{EMBEDDINGS_PREFIX}{request_id}-{uuid.uuid4().hex[:8]}"
        lease = dataclasses.replace(self.embeddings.reserve(transfer_id, request_id, encoded.images),
                                    addresses=self.kv_addresses, node_id=self.node_id, worker_id=self.worker_id)
        sent = None
        deadline = time.monotonic() + lease.lease_s
        try:
            sent = encoded.encoder.send_embeddings.remote(encoded.key, lease)
            while not ray.wait([sent], timeout=EMBEDDINGS_POLL_S)[0]:
                if time.monotonic() > deadline:  # the call that brought the request waits no longer
                    ray.cancel(sent)  # a send still queued does not start
                    raise TransferError(f"the embeddings did not arrive within {lease.lease_s:g} s")
            ray.get(sent)
            return self.embeddings.take(transfer_id)
        finally:
            self.embeddings.abort(transfer_id, "not taken")  # nothing, once taken

    def start_receivers(self, kv_sink: FrameSink | None) -> None:
        """The receiving halves of the transports the manifest allows: KV frames go to `kv_sink` (a
        decode worker's), embedding frames to this worker's `EmbeddingReceiver` (a vision-language
        model's). None when neither."""
        sink = kv_sink if self.embeddings is None else SinkByKind(kv_sink, self.embeddings)
        self._receivers = [] if sink is None else [
            start_receiver(name, sink, self.kv.host, tls=self.kv.tls, secret=self.kv.secret,
                           on_crash=self._receiver_crashed(name)) for name in self.kv.receivers]
        self.kv_addresses = {r.name: r.address for r in self._receivers}

    def stop_receivers(self) -> None:
        for receiver in self._receivers:
            receiver.stop()

    def _receiver_crashed(self, transport: str) -> Callable[[BaseException], None]:
        # Its senders would wait out every reservation: dead, so the supervisor starts it afresh.
        return lambda error: self._on_fault(f"KV {transport} receiver failed: {type(error).__name__}: {error}")

    def common_stats(self) -> dict[str, Any]:
        return {"loop": vars(self.loop.busy), "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def kv_snapshot(self) -> KVSnapshot:
        """Every cached block (hash, parent) and the sequence number of the last event they reflect."""
        return self.loop.call(lambda e: self.kv_events.snapshot(e.pool.cached_blocks()))

    def watch(self) -> None:
        """Returns when the worker closes. The supervisor keeps one such call open on each worker (on a
        thread of its own): when the process dies, Ray fails the call at once, which tells the
        supervisor long before a ping round would."""
        self._closed.wait()

    def close_common(self) -> None:
        self._closed.set()
        self.loop.stop()
        self.sink.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def _on_fault(self, reason: str) -> None:
        """Fail every request held here with an explicit error; `ping` then reports the worker dead."""
        raise NotImplementedError

    def _on_loop_fatal(self, error: BaseException) -> None:
        self._on_fault(_loop_fault(error))

    def _on_publisher_crash(self, error: BaseException) -> None:
        self._on_fault(f"KV event publisher failed: {type(error).__name__}: {error}")


class RayDecodePeer:
    """A decode worker's actor as the KV sender calls it (`kv_transfer.sender.DecodePeer`)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.key: Hashable = handle  # actor handles compare by actor id: a restarted worker is the same
        self.name = "its decode worker"  # until a lease names it

    def reserve(self, transfer_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                num_kv_tokens: int, codecs: list[str], draft_kv: str | None = None,
                output_token_ids: list[int] | None = None, images: PromptImages | None = None) -> Future[Lease]:
        return self.handle.reserve.remote(transfer_id, request_id, prompt_token_ids, params, num_kv_tokens,
                                          codecs, draft_kv, output_token_ids, images).future()

    def renew(self, transfer_id: str) -> Future[Lease]:
        return self.handle.renew_lease.remote(transfer_id).future()

    def commit(self, transfer_id: str, handoff: RequestHandoff, recompute: bool) -> Future[list[int]]:
        return self.handle.commit.remote(transfer_id, handoff, recompute).future()

    def abort(self, transfer_id: str, reason: str) -> None:
        self.handle.abort_transfer.remote(transfer_id, reason)
