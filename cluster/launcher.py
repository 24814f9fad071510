"""Bring a manifest up on Ray (workers as actors with their resources, the router's gRPC server)
and take it down again with nothing left running."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from transformers import AutoConfig

from pdserve.cluster.manifest import Manifest, PoolSpec
from pdserve.cluster.supervisor import HEALTH_GROUP, Supervisor
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.model_loader import context_limit, load_tokenizer
from pdserve.engine.presets import resolve_model
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.proto.pdserve.v1 import pdserve_pb2
from pdserve.router.placement import POLICIES, WorkerRef
from pdserve.router.server import RouterServer
from pdserve.router.service import RouterService, ServedModel
from pdserve.router.token_hub import TokenStreamHub

ACTOR_CONCURRENCY = 64  # threaded actors: transfer calls and aborts run beside the engine loop
# Pings get their own thread, so blocking calls on the other threads cannot delay them.
CONCURRENCY_GROUPS = {HEALTH_GROUP: 2}


class Cluster:
    def __init__(self, manifest: Manifest, log: Callable[[str], None] = print) -> None:
        self.manifest = manifest
        self.log = log
        self.address: str | None = None
        self.workers: list[WorkerRef] = []
        self._started_ray = False
        self._hub: TokenStreamHub | None = None
        self._server: RouterServer | None = None
        self._supervisor: Supervisor | None = None

    # --- up -------------------------------------------------------------------------------------
    def start(self, ready_timeout_s: float = 300.0) -> str:
        try:
            return self._start(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, ready_timeout_s: float) -> str:
        m = self.manifest
        t0 = time.time()
        self.log(f"preparing model {m.model!r} ...")
        model_dir = str(resolve_model(m.model))
        self._init_ray()
        local = m.ray.address == "local"
        self._hub = TokenStreamHub("127.0.0.1" if local else ray.util.get_node_ip_address())

        pools = {"prefill": m.pools.prefill, "decode": m.pools.decode}
        prefill_refs, decode_refs = [], []
        for pool_name, spec in pools.items():
            for i in range(spec.replicas):
                role = "colocated" if m.mode == "colocated" else pool_name
                ref = self._spawn(role, f"{role}-{len(prefill_refs) + len(decode_refs)}", spec, model_dir)
                (prefill_refs if role == "prefill" else decode_refs).append(ref)
        self.workers = prefill_refs + decode_refs
        self.log(f"starting {len(self.workers)} workers ({m.mode}) ...")
        self._wait_ready(ready_timeout_s)
        if m.kv_transfer.transport == "grpc":
            for w in decode_refs:
                w.kv_address = ray.get(w.handle.get_kv_address.remote())

        service = RouterService(self._served_model(model_dir), m.mode, prefill_refs, decode_refs,
                                POLICIES[m.router.policy](), self._hub,
                                max_queued_prefills=m.router.max_queued_prefills,
                                max_active_decodes=m.router.max_active_decodes)
        tls = None
        if m.server.tls_cert is not None:
            tls = (Path(m.server.tls_cert).read_bytes(), Path(m.server.tls_key).read_bytes())
        self._server = RouterServer(service, m.server.address, tls=tls, auth_token=m.server.auth_token)
        self.address = self._server.start()
        self._supervisor = Supervisor(self.workers, on_change=self._server.health_changed).start()
        self.log(f"serving {m.model!r} on {self.address} ({m.mode}, transport {m.kv_transfer.transport}) "
                 f"after {time.time() - t0:.1f} s")
        return self.address

    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        m = self.manifest
        if m.ray.address == "local":
            specs = [m.pools.prefill, m.pools.decode]
            cpus = sum(s.num_cpus * s.replicas for s in specs)
            custom: dict[str, float] = {}
            for s in specs:
                for name, amount in s.resources.items():
                    custom[name] = custom.get(name, 0) + amount * s.replicas
            ray.init(num_cpus=max(int(cpus + 0.999), os.cpu_count() or 1), resources=custom or None,
                     include_dashboard=False, logging_level=logging.WARNING, configure_logging=True)
        else:
            ray.init(address=m.ray.address, logging_level=logging.WARNING)
        self._started_ray = True

    def _spawn(self, role: str, name: str, spec: PoolSpec, model_dir: str) -> WorkerRef:
        m = self.manifest
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(cls).options(
            num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=spec.resources or None,
            max_concurrency=ACTOR_CONCURRENCY, max_restarts=spec.max_restarts,
        )
        args: list[Any] = [name, model_dir, m.engine_config(spec), self._hub.address, m.kv_transfer.transport]
        if cls is DecodeWorker:
            kwargs = {"lease_s": m.kv_transfer.lease_s, "reserve_wait_s": m.kv_transfer.reserve_wait_s}
        else:
            kwargs = {"max_queued": m.router.max_queued_prefills, "reserve_wait_s": m.kv_transfer.reserve_wait_s}
        return WorkerRef(name=name, pool="prefill" if role == "prefill" else "decode",
                         handle=actor.remote(*args, **kwargs))

    @property
    def restarts(self) -> dict[str, int]:
        """How often the supervisor had Ray restart each worker (after a fault it reported)."""
        return dict(self._supervisor.restarts) if self._supervisor else {}

    def worker_stats(self) -> dict[str, dict]:
        """Each worker's cumulative figures: engine-loop busy time (`loop`: wall_s, forward_s, kv_s,
        other_s, steps), peak resident memory (`peak_rss_bytes`), and its role's own records."""
        stats = ray.get([w.handle.stats.remote() for w in self.workers])
        return {w.name: s for w, s in zip(self.workers, stats)}

    def wait_idle(self, timeout_s: float = 10.0) -> tuple[bool, list[dict]]:
        """Poll the workers until every pool is fully free (no blocks held beyond the prefix cache, no
        request, transfer or queued job), at most `timeout_s`; whether it was, and the last status."""
        deadline = time.time() + timeout_s
        while True:
            status = ray.get([w.handle.ping.remote() for w in self.workers])
            idle = all(s["free_blocks"] == s["total_blocks"] and s["requests"] == 0 and s["transfers"] == 0
                       and s.get("jobs", 0) == 0 for s in status)
            if idle or time.time() > deadline:
                return idle, status
            time.sleep(0.1)

    def _wait_ready(self, timeout_s: float) -> None:
        pending = {w.handle.ping.remote(): w for w in self.workers}
        deadline = time.time() + timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.time()))
            if not ready:
                names = ", ".join(w.name for w in pending.values())
                raise TimeoutError(f"workers not ready after {timeout_s:.0f} s: {names} (not enough resources?)")
            worker = pending.pop(ready[0])
            ray.get(ready[0])  # raises the worker's own start-up error
            self.log(f"  {worker.name} ready")

    def _served_model(self, model_dir: str) -> ServedModel:
        m = self.manifest
        config = AutoConfig.from_pretrained(model_dir)
        tokenizer = load_tokenizer(model_dir)
        eos = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
        info = pdserve_pb2.ModelInfo(
            name=m.model, model_type=config.model_type, vocab_size=config.vocab_size,
            max_model_len=context_limit(config, m.max_model_len), mode=m.mode, dtype=m.dtype,
            block_size=m.block_size, eos_token_id=eos,
        )
        return ServedModel(m.model, tokenizer, info)

    # --- down -----------------------------------------------------------------------------------
    def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self.workers and ray.is_initialized():
            shutdowns = [w.handle.shutdown.remote() for w in self.workers]
            ray.wait(shutdowns, num_returns=len(shutdowns), timeout=10)
            for w in self.workers:
                ray.kill(w.handle)
        self.workers = []
        if self._hub is not None:
            self._hub.close()
            self._hub = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
