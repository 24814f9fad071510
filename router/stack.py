"""The router of one cluster, built from its manifest (`RouterStack`): the channels the workers send
to (the token stream, the KV events that feed the prefix index), the placement core (`Router`), the
frontend that runs requests, and the gRPC and HTTP servers. The launcher opens it before it starts
the workers (they are given its channels' addresses), has it place on the workers once they are up,
then serve; it never wires the parts itself.

The manifest is read here by attribute only (the router imports nothing of the cluster package).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.registry import Collector

from pdserve.router.event_loop import EventLoopThread
from pdserve.router.frontend import Frontend, RetryBudget, ServedModel
from pdserve.router.health_report import PlannerHealth
from pdserve.router.kv_event_hub import KVEventHub
from pdserve.router.pool_admin import PoolControl
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.routing import Router, RoutingSettings
from pdserve.router.server import RouterServer
from pdserve.router.service import RouterService
from pdserve.router.token_hub import TokenStreamHub
from pdserve.router.workers import WorkerRef
from pdserve.wire import ClusterSecret

if TYPE_CHECKING:
    from pdserve.cluster.manifest import Manifest


class RouterStack:
    def __init__(self, manifest: Manifest, host: str, secret: ClusterSecret | None,
                 request_snapshot: Callable[[str], None]) -> None:
        """Open the channels the workers send to, on `host`. `request_snapshot(worker)`: the KV event
        hub lost a worker's events, fetch its cache's snapshot (`KVEventHub.apply_snapshot`)."""
        self.manifest = manifest
        with contextlib.ExitStack() as opened:  # closed again if a later part fails to open
            self.loop = EventLoopThread()  # every part of the router runs on it
            opened.callback(self.loop.stop)
            self.tokens = TokenStreamHub(self.loop.loop, host, secret)
            opened.callback(self.tokens.close)
            self.kv_events = KVEventHub(PrefixIndex(), request_snapshot, self.loop.loop, host, secret=secret)
            opened.pop_all()
        self.placement: Router | None = None  # once `place` has run
        self.server: RouterServer | None = None  # once `serve` has run
        self.frontend: Frontend | None = None  # once `serve` has run
        self._served: ServedModel | None = None

    def place(self, workers: list[WorkerRef], served: ServedModel) -> Router:
        """Build the placement core over the workers (each with its first health report)."""
        m = self.manifest
        settings = RoutingSettings.from_spec(m.router, served.info.max_model_len, served.info.image_token_id or None,
                                             served.image_tokens)
        prefill = [w for w in workers if w.pool == "prefill"]
        decode = [w for w in workers if w.pool != "prefill"]
        self.placement = Router(m.mode, prefill, decode, m.block_size, settings, self.kv_events.index)
        self._served = served
        return self.placement

    def serve(self, collectors: Iterable[Collector] = (), pool_control: PoolControl | None = None,
              planner_status: Callable[[], PlannerHealth | None] = lambda: None) -> str:
        """Start the servers (after `place`); `collectors` join the router's /metrics; `pool_control`
        (the cluster) backs the HTTP API's admin routes; `planner_status` is the online planner's part
        of the health report. Returns the gRPC API's HOST:PORT."""
        m = self.manifest
        self.frontend = frontend = Frontend(self._served, self.placement, self.tokens,
                                            RetryBudget(m.router.max_retries, m.router.retry_wait_s))
        for collector in collectors:
            frontend.metrics.registry.register(collector)
        s = m.server
        tls = (s.tls_cert, s.tls_key) if s.tls_cert is not None else None
        self.server = RouterServer(RouterService(frontend), self.loop, s.address, tls=tls, auth_token=s.token,
                                   http_address=s.http_address, client_ca=s.tls_client_ca,
                                   max_request_bytes=s.max_request_bytes, max_http_connections=s.max_http_connections,
                                   pool_control=pool_control, admin_token=s.admin, planner_status=planner_status)
        return self.server.start()

    @property
    def http_address(self) -> str | None:
        """HOST:PORT of the OpenAI-compatible HTTP API (and /metrics) once serving; None when off."""
        return self.server.http_address if self.server is not None else None

    def health_changed(self) -> None:
        """Workers' health changed (from the cluster's supervisor, on any thread): a worker that stopped
        answering leaves the prefix index at once (it rejoins through a snapshot when its events
        resume); then the health service hears of it, and the streams waiting on it retry."""
        for w in self.placement.prefill_pool + self.placement.decode_pool:
            if not w.healthy:
                self.kv_events.forget(w.name)
                if self.placement.approximate is not None:
                    self.placement.approximate.drop(w.name)
        if self.server is not None:
            self.server.health_changed()
        if self.frontend is not None:  # streams waiting on a lost worker retry now
            try:
                self.loop.loop.call_soon_threadsafe(self.frontend.workers_lost)
            except RuntimeError:  # the router's loop is closed (shutting down): no stream waits any more
                pass

    def stats(self) -> dict[str, Any]:
        """The cumulative placement counts and the settings in effect (`Router.snapshot_stats`), with
        the KV event hub's counters (`kv_events`)."""
        return {**self.placement.snapshot_stats(), "kv_events": self.kv_events.stats()}

    def stop_serving(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def close(self) -> None:
        """Stop serving and close the channels (once the workers are gone: they send on them to the end);
        every part is closed, whichever fails first."""
        with contextlib.ExitStack() as closing:  # run last to first
            closing.callback(self.loop.stop)
            closing.callback(self.kv_events.close)
            closing.callback(self.tokens.close)
            closing.callback(self.stop_serving)
