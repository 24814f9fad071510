"""Bring a manifest up on Ray (workers as actors with their resources, the router built from the
manifest by `RouterStack`) and take it down again with nothing left running."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import ray
from ray.exceptions import RayError
from transformers import AutoConfig

from pdserve.cluster.audit import AuditCollector, IdleAudit
from pdserve.cluster.manifest import Manifest, PoolSpec
from pdserve.cluster.plan.costs import HardwareProfile, check_profile, find_stored_profile, machine
from pdserve.cluster.plan.online import OnlinePlanner
from pdserve.cluster.replanning import PlannerCollector, ReplanLoop, answered_by_ray
from pdserve.cluster.supervisor import HEALTH_GROUP, WATCH_GROUP, Supervisor
from pdserve.encode_worker.worker import ENCODER_CONCURRENCY, SEND_GROUP, SEND_THREADS, EncodeWorker
from pdserve.decode_worker.worker import MIGRATE_GROUP, MIGRATE_THREADS, RESERVE_GROUP, RESERVE_THREADS, DecodeWorker
from pdserve.engine.cost_model import StepCost
from pdserve.engine.model_loader import context_limit, eos_ids, load_tokenizer, max_token_chars
from pdserve.engine.multimodal.vision import FAMILIES, tokens_per_image
from pdserve.engine.model_store import ModelSource, files_digest, model_digest, read_model_files
from pdserve.engine.models.presets import resolve_model
from pdserve.kv_transfer.interface import shown
from pdserve.kv_transfer.settings import TransferSettings
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.proto.pdserve.v1 import pdserve_pb2
from pdserve.router.frontend import ObservedRequest, DrainReport, ServedModel
from pdserve.router.health_report import PlannerHealth
from pdserve.router.encoders import EncodePool, EncoderRef
from pdserve.router.stack import RouterStack
from pdserve.router.workers import WorkerRef
from pdserve.wire import ClusterSecret, WorkerStatus

if TYPE_CHECKING:
    from pdserve.router.kv_event_hub import KVEventHub
    from pdserve.router.routing import Router

log = logging.getLogger(__name__)
ACTOR_CONCURRENCY = 64  # threaded actors: transfer calls and aborts run beside the engine loop
# Pings get their own threads, so blocking calls on the other threads cannot delay them; so do a decode
# worker's reservations, which wait for free blocks (see decode_worker.worker).
# The supervisor's watch call on each worker holds a thread of its own, open for the worker's life.
CONCURRENCY_GROUPS = {PrefillWorker: {HEALTH_GROUP: 2, WATCH_GROUP: 1},
                      DecodeWorker: {HEALTH_GROUP: 2, WATCH_GROUP: 1, RESERVE_GROUP: RESERVE_THREADS,
                                     MIGRATE_GROUP: MIGRATE_THREADS}}
T = TypeVar("T")
MAX_POOL_WORKERS = 64  # a pool's workers at most, as a manifest's `replicas`
PROBE_TOKENS = (16, 256)  # prompt lengths of the start-up KV transfer probe (seeds the transfer cost)
PROBE_TIMEOUT_S = 120.0  # one start-up transfer probe, the worker's own timeouts inside it
READY_PROGRESS_S = 15.0  # while workers start, who is still pending is logged this often
SNAPSHOT_TIMEOUT_S = 10.0
RAY_DEATH_INFO_WAIT = "RAY_timeout_ms_task_wait_for_death_info"  # Ray's setting (ms), see `_init_ray`


def _one_change_at_a_time(method: Callable[..., T]) -> Callable[..., T]:
    """A `Cluster` method that changes the pools, run under its reshaping lock."""

    @functools.wraps(method)
    def locked(self: Cluster, *args: Any, **kwargs: Any) -> T:
        with self._reshaping:
            return method(self, *args, **kwargs)

    return locked


class Cluster:
    def __init__(self, manifest: Manifest, log: Callable[[str], None] = print) -> None:
        self.manifest = manifest
        self.log = log
        self.address: str | None = None
        self.workers: list[WorkerRef] = []
        self.encoders: list[EncoderRef] = []  # the encode pool (`pools.encode`)
        self._next_index = 0  # the number in the next worker's name (names are never reused)
        # One change to the pools at a time (the admin API's and the online planner's threads both make them).
        self._reshaping = threading.RLock()
        self._stored_profile: HardwareProfile | None = None  # the model's `pdserve profile` here, if one was found
        self._replanning: ReplanLoop | None = None
        self._started_ray = False
        self._model: ModelSource | None = None
        self.router_stack: RouterStack | None = None  # the router, from its channels up to its servers
        self._snapshots = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-snapshot")
        self._supervisor: Supervisor | None = None
        self._stored_costs: dict[tuple[int, str], StepCost] = {}  # a stored profile's, by (threads, device)
        # Made here, handed to the workers in their actor arguments (so a restarted worker has it too).
        self._secret = ClusterSecret.generate() if manifest.security.cluster_secret else None
        self.audit: IdleAudit | None = None  # proof that the pools are fully free whenever the cluster idles

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
        if m.speculative is not None and m.speculative.draft_model is not None:
            resolve_model(m.speculative.draft_model)  # here first: a missing draft fails before any worker starts
        self._init_ray()
        local = m.ray.address == "local"
        # Kept for the cluster's life: a shipped model's object must outlive every worker restart.
        source = self._model = self._model_source(model_dir, local)
        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        stack = self.router_stack = RouterStack(m, host, self._secret, self._request_snapshot)
        self.log(f"router: token stream on {stack.tokens.address}, KV events on {stack.kv_events.address}")
        self._stored_costs = self._stored_step_costs(Path(model_dir))

        for role, name, spec in m.workers():  # each kept as made: a failed spawn leaves none behind (`stop`)
            self.workers.append(self._spawn(role, name, spec, source))
        self._next_index = len(self.workers)
        self.log(f"starting {len(self.workers)} workers ({m.mode}) ...")
        self._wait_ready(self.workers, ready_timeout_s)
        if any(self._stored_cost(spec) is None for _, _, spec in m.workers()):
            self.log("profiling prompt passes, one worker at a time ...")
        for w in self.workers:
            w.status = ray.get(w.handle.profile.remote(), timeout=ready_timeout_s)

        placement = stack.place(self.workers, self._served_model(model_dir))
        encoders = self._start_encoders(source, ready_timeout_s) if m.pools.encode.replicas else []
        if m.mode == "disaggregated":
            self._probe_transfers(placement.prefill_pool[0], placement.decode_pool[0])
        self.audit = IdleAudit(self.workers, lambda: placement.stats.requests_routed,
                               leak_after_s=m.deadlines.leak_after_s)
        collectors: list[Any] = [AuditCollector(self.audit)]
        if m.planner.online:
            if self._stored_profile is None:
                raise ValueError("planner.online simulates with the model's stored profile, and none was found: run "
                                 "`pdserve profile --manifest MANIFEST` on this machine first, or set `profile:` to "
                                 "the file it wrote")
            self._replanning = ReplanLoop(self, OnlinePlanner(m, self._stored_profile, goodputs=answered_by_ray),
                                          self.log)
            collectors.append(PlannerCollector(self._replanning))
        self.address = stack.serve(collectors, pool_control=self, planner_status=self._planner_health)
        if encoders:
            stack.frontend.encoders = EncodePool(encoders, m.server.images.encode_timeout_s)
        self._supervisor = Supervisor(self.workers, on_change=stack.health_changed, deadlines=m.deadlines.health,
                                      after_round=self.audit.observe).start()
        if self._replanning is not None:
            self._replanning.start()
            self.log(f"online planner on: a decision every {m.planner.interval_s:g} s from the last "
                     f"{m.planner.window_s:g} s of requests")
        scheme = "https" if m.server.tls_cert is not None else "http"
        http = f"; OpenAI API and /metrics on {scheme}://{self.http_address}" if self.http_address else ""
        named = f" as {m.served_name!r}" if m.served_name != m.model else ""
        self.log(f"serving {m.model!r}{named} over gRPC on {self.address}{http} ({m.mode}, transport "
                 f"{m.kv_transfer.transport}) after {time.time() - t0:.1f} s")
        return self.address

    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        # A call to a worker whose process died fails at once (ActorUnavailableError) instead of after
        # Ray waits up to a second for its death to be confirmed (more for a worker it restarts): the
        # supervisor's watch call on each worker is how a dead one is found. Set before `ray.init`, as
        # Ray reads its settings then; the environment's own value stands.
        os.environ.setdefault(RAY_DEATH_INFO_WAIT, "0")
        m = self.manifest
        if m.ray.address == "local":
            specs = [m.pools.prefill, m.pools.decode, m.pools.encode]
            # Room for the most workers each pool may have: the replicas, or the online planner's budget
            # less the one worker the other pool keeps.
            most = m.planner_budget()[1] - 1 if m.planner.online else 0
            cpus = sum(s.num_cpus * max(s.replicas, most) for s in specs)
            custom: dict[str, float] = {}
            for s in specs:
                for name, amount in s.resources.items():
                    custom[name] = custom.get(name, 0) + amount * max(s.replicas, most)
            # address="local": a Ray instance of its own, never one that RAY_ADDRESS or the last
            # `ray start` on this machine (recorded under /tmp/ray) points to.
            with _quiet_token_auth_notice():
                ray.init(address="local", num_cpus=max(int(cpus + 0.999), os.cpu_count() or 1),
                         resources=custom or None, include_dashboard=False, logging_level=logging.WARNING,
                         configure_logging=True)
        else:
            ray.init(address=m.ray.address, logging_level=logging.WARNING)
        self._started_ray = True

    def _model_source(self, model_dir: str, local: bool) -> ModelSource:
        """How workers get the model: by name (shipped models and presets are made on each node), or a
        directory by its absolute path, its files shipped through the object store unless the manifest
        declares the path shared. On a single machine there is one copy: nothing is hashed or shipped."""
        m = self.manifest
        # With model_path_shared always a directory: the manifest wants a path, `resolve_model` an existing one.
        is_dir = Path(m.model).expanduser().is_dir()
        spec = str(Path(model_dir).resolve()) if is_dir else m.model
        if local:
            return ModelSource(spec, "")
        self.log("hashing the model (every worker checks it holds the same bytes) ...")
        if not is_dir or m.model_path_shared:
            return ModelSource(spec, model_digest(model_dir), shared_path=m.model_path_shared)
        files = read_model_files(model_dir)  # one read of the model: shipped, and hashed from memory
        return ModelSource(spec, files_digest(files), files=ray.put(files))

    def _spawn(self, role: str, name: str, spec: PoolSpec, model: ModelSource) -> WorkerRef:
        m = self.manifest
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS[cls])(cls).options(
            num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=spec.resources or None,
            max_concurrency=ACTOR_CONCURRENCY, max_restarts=spec.max_restarts,
        )
        stack = self.router_stack
        engine_config = {**m.engine_config(spec), "stored_step_cost": self._stored_cost(spec)}
        if role == "prefill":  # it never decodes: no draft model loaded, unless it computes the draft's prompt KV
            spec = m.speculative
            sends = spec is not None and spec.draft_model is not None and spec.draft_kv == "send"
            engine_config.update(speculative=engine_config["speculative"] if sends else None, draft_prompt_kv=sends)
            if sends:  # a stored profile timed prompt passes without the draft's beside them
                engine_config["stored_step_cost"] = None
        args: list[Any] = [name, model, engine_config, stack.tokens.address, self._transfer_settings()]
        kwargs: dict[str, Any] = {"kv_events": stack.kv_events.address, "faults": m.faults.for_worker(name),
                                  "log_level": m.log_level}
        if cls is PrefillWorker:
            r = m.router
            window = None if r.short_batch_window_ms is None else r.short_batch_window_ms / 1000
            kwargs.update(max_queued=r.max_queued_prefills, length_aware=r.laps,
                          short_prompt_tokens=r.short_prompt_tokens, short_batch_window_s=window,
                          long_chunk_tokens=r.long_prompt_chunk_tokens)
        return WorkerRef(name=name, pool="prefill" if role == "prefill" else "decode",
                         handle=actor.remote(*args, **kwargs))

    def _start_encoders(self, model: ModelSource, timeout_s: float) -> list[EncoderRef]:
        """The encode pool's workers, once each answers. Ray restarts one that dies (`max_restarts`);
        the router skips it meanwhile (`router.encoders`)."""
        m, spec = self.manifest, self.manifest.pools.encode
        actor = ray.remote(concurrency_groups={SEND_GROUP: SEND_THREADS})(EncodeWorker).options(
            num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=spec.resources or None,
            max_restarts=spec.max_restarts, max_concurrency=ENCODER_CONCURRENCY)
        images = m.server.images
        self.encoders = [EncoderRef(f"encode-{i}", actor.remote(
            f"encode-{i}", model, m.dtype, "cuda" if spec.num_gpus > 0 else "cpu", images.limits(),
            images.embedding_cache_mb * 2**20, self._transfer_settings(), spec.threads, m.log_level))
            for i in range(spec.replicas)]
        self.log(f"starting {spec.replicas} encode workers ...")
        ray.get([e.handle.ping.remote() for e in self.encoders], timeout=timeout_s)  # raises a start-up error
        return self.encoders

    def _stored_step_costs(self, model_dir: Path) -> dict[tuple[int, str], StepCost]:
        """The prompt-pass costs a stored profile holds, by (threads, device), as the manifest's `profile`
        says: `auto` finds this model's on this machine (a local cluster's workers run here) and passes
        over one it cannot use, a path names one that must be of this model; {} (`measure`, or nothing
        found): the workers measure theirs."""
        m = self.manifest
        if m.profile == "measure" or (m.profile == "auto" and m.ray.address != "local"):
            return {}
        if m.profile == "auto":
            found = find_stored_profile(m.model, model_dir, machine())
            if found is None:
                return {}
            path, digest = found
        else:
            path, digest = Path(m.profile).expanduser(), model_digest(model_dir)
        try:
            stored = HardwareProfile.load(path)
            check_profile(stored, m, path, digest)
        except ValueError as e:
            if m.profile != "auto":
                raise
            self.log(f"passing over the stored profile: {e}; the workers measure their prompt passes")
            return {}
        self._stored_profile = stored
        costs = {(threads, stored.device): c.prefill for threads, c in stored.workers.items()}
        used = sorted({s.threads for _, _, s in m.workers() if (s.threads, m.engine_config(s)["device"]) in costs})
        measured = f"measured {stored.created or 'at an unknown time'} on {stored.hardware}"
        if used:
            self.log(f"prompt-pass costs for workers of {used} thread(s) from the profile {path} ({measured}); "
                     "`profile: measure` measures them instead")
        else:
            self.log(f"the profile {path} ({measured}) has no costs for these workers' thread counts and device "
                     f"({stored.device or 'not recorded'}): they measure their prompt passes")
        return costs

    def _stored_cost(self, spec: PoolSpec) -> StepCost | None:
        return self._stored_costs.get((spec.threads, self.manifest.engine_config(spec)["device"]))

    def _transfer_settings(self) -> TransferSettings:
        m = self.manifest
        kv = m.kv_transfer
        host = kv.host or ("127.0.0.1" if m.ray.address == "local" else None)  # None: each worker's node address
        tls = {k: str(v) for k, v in kv.tls.model_dump().items() if v is not None} if kv.tls else {}
        return TransferSettings(transport=kv.transport, codecs=kv.codecs, host=host, tls=tls,
                                frame_tokens=kv.frame_tokens, layerwise_min_tokens=kv.layerwise_min_tokens,
                                deadlines=m.deadlines.kv,
                                ttft_slo_s=m.router.ttft_slo_s, recompute=kv.recompute, secret=self._secret)

    @property
    def http_address(self) -> str | None:
        """HOST:PORT of the OpenAI-compatible HTTP API (and /metrics), once started; None when off."""
        return self.router_stack.http_address if self.router_stack else None

    @property
    def router(self) -> Router | None:
        """The router's placement core (its settings, stats and prefix index), once started."""
        return self.router_stack.placement if self.router_stack else None

    @property
    def kv_event_hub(self) -> KVEventHub | None:
        return self.router_stack.kv_events if self.router_stack else None

    @property
    def restarts(self) -> dict[str, int]:
        """How often the supervisor had Ray restart each worker (after a fault it reported)."""
        return dict(self._supervisor.restarts) if self._supervisor else {}

    def router_stats(self) -> dict[str, Any]:
        """The router's cumulative placement counts and the settings in effect (`Router.snapshot_stats`),
        with the KV event hub's counters (`kv_events`)."""
        return self.router_stack.stats()

    # --- reshaping the pools while serving ---------------------------------------------------------
    @_one_change_at_a_time
    def add_worker(self, role: str, timeout_s: float = 300.0) -> WorkerRef:
        """Start one more worker of `role` (prefill or decode, with its pool's resources) and, once it has
        measured itself, let the router place on it. Returns it."""
        return self._admit(self._start_worker(role), timeout_s)

    def _start_worker(self, role: str) -> WorkerRef:
        """A new worker of `role` asked for (its actor starting); not yet known to the router."""
        m = self.manifest
        if m.mode == "colocated" or role not in ("prefill", "decode"):
            raise ValueError(f"a worker's role is prefill or decode, in a disaggregated deployment (got {role!r} "
                             f"in a {m.mode} one)")
        spec = m.pools.prefill if role == "prefill" else m.pools.decode
        if sum(w.pool == role for w in self.workers) >= MAX_POOL_WORKERS:
            raise ValueError(f"the {role} pool has {MAX_POOL_WORKERS} workers, the most it takes")
        worker = self._spawn(role, f"{role}-{self._next_index}", spec, self._model)
        self._next_index += 1
        return worker

    def _admit(self, worker: WorkerRef, timeout_s: float) -> WorkerRef:
        """Wait for a started worker to be ready and measured, then let the router place on it (it is
        stopped if it fails to)."""
        try:
            self._wait_ready([worker], timeout_s)
            worker.status = ray.get(worker.handle.profile.remote(), timeout=timeout_s)
        except BaseException:
            ray.kill(worker.handle)
            raise
        if self._supervisor is not None:
            self._supervisor.add(worker)  # the list it supervises is `self.workers`
        else:
            self.workers.append(worker)
        self.router.add_worker(worker)
        self.log(f"{worker.name} joined the {worker.pool} pool")
        return worker

    @_one_change_at_a_time
    def remove_worker(self, worker_name: str, timeout_s: float = 300.0) -> DrainReport:
        """Drain a worker (`drain`: what it decodes moves to the other decode workers with its KV, its
        prompts finish), then stop it and let its resources go. The last decode worker stays."""
        worker = self._worker(worker_name)
        self._check_removable(worker)
        report = self.drain(worker_name, timeout_s)
        self.router.remove_worker(worker)
        if self._supervisor is not None:
            self._supervisor.remove(worker)
        else:
            self.workers.remove(worker)
        self.kv_event_hub.forget(worker.name)
        ray.wait([worker.handle.shutdown.remote()], timeout=10)
        ray.kill(worker.handle)
        self.log(f"{worker_name} drained ({report.moved} requests moved) and stopped")
        return report

    @_one_change_at_a_time
    def switch_role(self, worker_name: str, role: str, timeout_s: float = 300.0) -> WorkerRef:
        """Turn a worker into one of `role`: drained (nothing dropped, nothing repeated), stopped, and a
        worker of the new role started in its place with its resources. Returns the new worker.

        The new worker is asked for first: its start (a process, the model, a warm-up: seconds) runs
        while the old one drains where the cluster has room for both (with an autoscaler, that may be a
        node it starts for it), else as soon as the old one's resources are let go."""
        worker = self._worker(worker_name)
        if worker.pool == role:
            return worker
        self._check_removable(worker)  # before a worker is started for nothing
        started = self._start_worker(role)
        try:
            self.remove_worker(worker_name, timeout_s)
        except BaseException:
            with contextlib.suppress(RayError):  # the removal's error is the one to raise
                ray.kill(started.handle)
            raise
        return self._admit(started, timeout_s)

    def _check_removable(self, worker: WorkerRef) -> None:
        """Raises ValueError when the cluster could not serve without `worker` (the last decode worker)."""
        if worker.pool == "decode" and not any(w.pool == "decode" and w is not worker and w.healthy and not w.draining
                                               for w in self.workers):
            raise ValueError(f"{worker.name} is the last decode worker taking requests: the cluster could not serve "
                             "without it")

    def _worker(self, name: str) -> WorkerRef:
        for worker in self.workers:
            if worker.name == name:
                return worker
        raise ValueError(f"no worker named {shown(name)}; the cluster has {', '.join(w.name for w in self.workers)}")

    def drain(self, worker_name: str, timeout_s: float = 300.0) -> DrainReport:
        """Take a worker out of placement and move the requests it decodes to the other decode workers
        with their KV (`Frontend.drain`); returns once none depends on it. It takes no request until
        `reopen`."""
        stack = self.router_stack
        return stack.loop.run(stack.frontend.drain(self._worker(worker_name), timeout_s), timeout_s + 10)

    def reopen(self, worker_name: str) -> None:
        """Let a drained worker take requests again."""
        self.router_stack.frontend.reopen(self._worker(worker_name))

    def _probe_transfers(self, prefill: WorkerRef, decode: WorkerRef) -> None:
        """Seed the router's transfer cost with a few handoffs of raw KV (reserve to abort)."""
        for tokens in PROBE_TOKENS:
            tokens = min(tokens, self.router.settings.max_model_len - 1)
            probe = ray.get(prefill.handle.probe_transfer.remote(decode.handle, tokens), timeout=PROBE_TIMEOUT_S)
            self.router.transfer.observe(tokens, probe["handoff_s"])

    def _request_snapshot(self, worker_name: str) -> None:
        """The KV event hub lost events of a worker: fetch its snapshot off the router's event loop."""
        worker = next((w for w in self.workers if w.name == worker_name), None)
        if worker is None:  # the hub then asks again on the worker's next batch
            raise KeyError(f"no worker named {worker_name!r} in this cluster")
        self._snapshots.submit(self._fetch_snapshot, worker)

    def _fetch_snapshot(self, worker: WorkerRef) -> None:
        try:
            snap = ray.get(worker.handle.kv_snapshot.remote(), timeout=SNAPSHOT_TIMEOUT_S)
        except Exception as e:  # the worker is dead or busy: the hub asks again after its snapshot timeout
            log.warning("KV snapshot of %s failed: %s", worker.name, e)
            return
        self.kv_event_hub.apply_snapshot(worker.name, snap.epoch, snap.seq, snap.blocks)

    def worker_stats(self) -> dict[str, dict]:
        """Each worker's cumulative figures: engine-loop busy time (`loop`: wall_s, forward_s, kv_s,
        other_s, steps), peak resident memory (`peak_rss_bytes`), and its role's own records."""
        stats = ray.get([w.handle.stats.remote() for w in self.workers])
        return {w.name: s for w, s in zip(self.workers, stats)}

    def wait_idle(self, timeout_s: float = 10.0) -> tuple[bool, list[WorkerStatus]]:
        """Poll the workers until every pool is fully free (no blocks held beyond the prefix cache, no
        request, transfer or queued job), at most `timeout_s`; whether it was, and the last status."""
        deadline = time.time() + timeout_s
        while True:
            status = ray.get([w.handle.ping.remote() for w in self.workers])
            idle = not any(s.holdings for s in status)
            if idle or time.time() > deadline:
                return idle, status
            time.sleep(0.1)

    def _wait_ready(self, workers: list[WorkerRef], timeout_s: float) -> None:
        pending = {w.handle.ping.remote(): w for w in workers}
        deadline = time.time() + timeout_s
        while pending:
            left = deadline - time.time()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, min(left, READY_PROGRESS_S)))
            if not ready:
                names = ", ".join(w.name for w in pending.values())
                if left <= READY_PROGRESS_S:
                    raise TimeoutError(f"workers not ready after {timeout_s:.0f} s: {names} (not enough resources? "
                                       f"the cluster has {ray.available_resources()} free)")
                self.log(f"  waiting for {names} ({left:.0f} s left; the cluster has {ray.available_resources()} free)")
                continue
            worker = pending.pop(ready[0])
            worker.status = ray.get(ready[0])  # raises the worker's own start-up error
            s = worker.status
            kv = f", KV receivers {', '.join(f'{k} {v}' for k, v in s.kv_addresses.items())}" if s.kv_addresses else ""
            model = f", model {s.model_digest[:12]}" if s.model_digest else ""
            self.log(f"  {worker.name} ready on node {s.node_ip} (id …{s.node_id[-12:]}){model}{kv}")

    def _served_model(self, model_dir: str) -> ServedModel:
        m = self.manifest
        full_config = AutoConfig.from_pretrained(model_dir)
        config = full_config.get_text_config()  # a vision-language model's language model
        tokenizer = load_tokenizer(model_dir)
        eos = sorted(eos_ids(config, tokenizer) | eos_ids(full_config, tokenizer))
        declared = config.eos_token_id if isinstance(config.eos_token_id, int) else (config.eos_token_id or [None])[0]
        first = declared if declared is not None else tokenizer.eos_token_id
        info = pdserve_pb2.ModelInfo(
            name=m.served_name, model_type=full_config.model_type, vocab_size=config.vocab_size,
            max_model_len=context_limit(config, m.max_model_len), mode=m.mode, dtype=m.dtype,
            block_size=m.block_size, eos_token_id=first if first is not None else 0, eos_token_ids=eos,
        )
        limits, image_tokens = None, 1
        if getattr(full_config, "vision_config", None) is not None and full_config.model_type in FAMILIES:
            image_tokens = tokens_per_image(model_dir, full_config)
            limits = m.server.images.limits()
            info.image_token_id = full_config.image_token_id
            info.image_token = tokenizer.convert_ids_to_tokens(full_config.image_token_id)
            info.max_images, info.max_image_bytes, info.max_image_pixels = (
                limits.max_images, limits.max_bytes, limits.max_pixels)
        return ServedModel(m.served_name, tokenizer, info, max_token_chars(tokenizer), limits, m.server.images.fetch(),
                           image_tokens)

    # --- down -----------------------------------------------------------------------------------
    @property
    def replanning(self) -> ReplanLoop | None:
        """The online planner at work (`planner.online`), or None."""
        return self._replanning

    def _planner_health(self) -> PlannerHealth | None:
        return self._replanning.health() if self._replanning is not None else None

    def observed_requests(self) -> list[ObservedRequest]:
        """The requests the router finished lately and those it serves now (the online planner's window)."""
        stack = self.router_stack
        return stack.loop.run(stack.frontend.observed(), SNAPSHOT_TIMEOUT_S)

    def stop(self) -> None:
        if self._replanning is not None:  # first: it would change roles on a cluster going down
            self._replanning.stop()
            self._replanning = None
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
        if self.router_stack is not None:
            self.router_stack.stop_serving()  # first: no request reaches a worker being stopped
        actors = [w.handle for w in [*self.workers, *self.encoders]]
        if actors and ray.is_initialized():
            shutdowns = [actor.shutdown.remote() for actor in actors]
            ray.wait(shutdowns, num_returns=len(shutdowns), timeout=10)
            for actor in actors:
                ray.kill(actor)
        self.workers, self.encoders = [], []
        self._model = None
        if self.router_stack is not None:
            self.router_stack.close()
            self.router_stack = None
        self._snapshots.shutdown(wait=False, cancel_futures=True)
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _NotTheTokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


@contextlib.contextmanager
def _quiet_token_auth_notice() -> Iterator[None]:
    """Ray turns token authentication on for every new local instance and WARNs that it did, in every
    start-up log, as if something were wrong. pdserve's local Ray has it unless `RAY_AUTH_MODE` says
    otherwise (docs/observability.md, Logs), so that one notice is dropped while pdserve starts its Ray;
    Ray's other warnings pass."""
    source = logging.getLogger("ray._private.authentication.authentication_token_setup")
    notice = _NotTheTokenAuthNotice()
    source.addFilter(notice)
    try:
        yield
    finally:
        source.removeFilter(notice)
