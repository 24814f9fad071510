"""What both worker actors share (`WorkerBase`): their model and engine, the engine loop, the token
sink to the router, the prefix-cache event publisher, injected faults, and the health report's
common part. Each role adds its own requests, KV side and report on top.
"""

from __future__ import annotations

import logging
import resource
import threading
import warnings
from collections.abc import Hashable
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
from pdserve.kv_transfer.interface import Lease
from pdserve.kv_transfer.settings import TransferSettings
from pdserve.wire import TokenSink, WorkerStatus, WorkRequest

log = logging.getLogger(__name__)

ENCODED_FETCH_S = 30.0  # an encode worker's embeddings, resolved before the request came: a fetch


def _was_restarted() -> bool:
    """Whether Ray restarted this actor. Ray's `was_current_actor_reconstructed` reads its own deprecated
    `actor_id` property inside, which printed a deprecation warning in every worker's start-up log: the
    warning is Ray's, not a use of ours to change, so it is held back here and nowhere else."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RayDeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


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
        return WorkerStatus(worker_id=self.worker_id, node_id=self.node_id, node_ip=self.node_ip,
                            model_digest=self.model_digest, alive=self.fault is None and self.loop.running,
                            fault=self.fault, profiled=self._profiled, kv=engine.pool.status(),
                            requests=len(engine.requests), transfers=transfers,
                            step_cost=engine.step_costs.coefficients,
                            step_budget=engine.config.max_num_batched_tokens,
                            draft_blocks=draft.pool.num_blocks - draft.pool.num_free if draft is not None else 0,
                            **role)

    def image_prompt(self, work: WorkRequest) -> ImagePrompt:
        """A request's prompt with its images placed: from an encode worker's embeddings when it has
        them, else decoded here (the engine runs the vision tower as the request is added). Embeddings
        that cannot be fetched (lost with their encoder's node) are made here instead."""
        if work.encoded is not None:
            try:
                encoded = ray.get(work.encoded, timeout=ENCODED_FETCH_S)
            except Exception as e:
                log.warning("request %s: its images' embeddings could not be fetched (%s): encoding them here",
                            work.request_id, type(e).__name__)
            else:
                return self.engine.place_encoded(work.prompt_token_ids, encoded)
        return self.engine.prepare_images(work.prompt_token_ids, work.images)

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
        self._on_fault(f"engine loop failed: {type(error).__name__}: {error}")

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
