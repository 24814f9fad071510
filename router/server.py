"""Runs the router's servers on the router's event loop: gRPC (API, health, reflection) and, when the
manifest gives `server.http_address`, the OpenAI-compatible HTTP API with /metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.client import MAX_MESSAGE_BYTES
from pdserve.proto.pdserve.v1 import pdserve_pb2
from pdserve.router.event_loop import EventLoopThread
from pdserve.router.health_report import (HealthReport, ModelHealth, PlannerHealth, PoolHealth, encoder_health,
                                           worker_health)
from pdserve.router.http_api import create_app
from pdserve.router.http_connections import MAX_CONNECTIONS, bounded_h11
from pdserve.router.pool_admin import PoolAdmin, PoolControl
from pdserve.router.service import RouterService, add_to_server

# Clients may ping every 10 s, with no call open too (gRPC core's default allows one ping in 5 minutes
# while the server sends nothing, then answers GOAWAY "too_many_pings": clients keeping a stream alive
# through a failover's silence would lose it). As pdserve.proto states.
KEEPALIVE_POLICY = [("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                    ("grpc.keepalive_permit_without_calls", 1)]

log = logging.getLogger(__name__)
SERVICE_NAME = pdserve_pb2.DESCRIPTOR.services_by_name["PDServe"].full_name


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("publishing health failed", exc_info=future.exception())


class TokenAuth(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer TOKEN` on every call except health checks (compared in
    constant time); `on_deny` hears of each refusal.

    A refused call is answered by a handler that streams its requests and reads none: gRPC reads a
    unary call's whole message before its handler runs (up to `max_request_bytes` for each call a
    stranger opens), a streaming handler's only as it asks for them."""

    def __init__(self, token: str, on_deny: Callable[[], None]) -> None:
        self._expected = token.encode()
        self._on_deny = on_deny

        async def deny(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")

        self._deny = grpc.stream_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        scheme, _, token = (given.decode() if isinstance(given, bytes) else given).partition(" ")
        if details.method.startswith("/grpc.health.") or (
                scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected)):
            return await continuation(details)
        self._on_deny()
        return self._deny


class RouterServer:
    def __init__(self, service: RouterService, loop: EventLoopThread, address: str, tls: tuple[Path, Path] | None = None,
                 auth_token: str | None = None, http_address: str | None = None,
                 client_ca: Path | None = None, max_request_bytes: int = MAX_MESSAGE_BYTES,
                 max_http_connections: int = MAX_CONNECTIONS,
                 pool_control: PoolControl | None = None, admin_token: str | None = None,
                 planner_status: Callable[[], PlannerHealth | None] = lambda: None) -> None:
        """`pool_control`: the cluster, which the HTTP API's admin routes reshape (`pool_admin`) for callers
        holding `admin_token`; `planner_status`: the online planner's last decision, for the health report."""
        if client_ca is not None and tls is None:
            raise ValueError("client_ca (mutual TLS) needs tls: client certificates are checked over TLS")
        self.service = service
        self.admin = PoolAdmin(pool_control, admin_token) if pool_control is not None else None
        self.planner_status = planner_status
        self.requested_address = address
        self.requested_http_address = http_address
        self.tls = tls
        self.client_ca = client_ca  # PEM of the CA whose certificates clients must present (gRPC and HTTPS)
        self.auth_token = auth_token
        self.max_request_bytes = max_request_bytes  # the largest HTTP body and gRPC message taken
        self.max_http_connections = max_http_connections
        self.address: str | None = None
        self.http_address: str | None = None  # HOST:PORT once started; None without an HTTP API
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task | None = None
        self._loop = loop
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None

    def start(self, timeout: float = 30.0) -> str:
        self.address = self._loop.run(self._start(), timeout)
        return self.address

    def stop(self, grace: float = 2.0) -> None:
        if self._server is not None:
            self._loop.run(self._stop(grace), grace + 10)
        self.service.frontend.close()
        if self.admin is not None:
            self.admin.close()

    async def _start(self) -> str:
        frontend = self.service.frontend
        deny = lambda: frontend.metrics.ended("grpc", "UNAUTHENTICATED")  # noqa: E731
        interceptors = [TokenAuth(self.auth_token, deny)] if self.auth_token else []
        sizes = [("grpc.max_receive_message_length", self.max_request_bytes),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        server = grpc.aio.server(interceptors=interceptors, options=sizes + KEEPALIVE_POLICY)
        add_to_server(self.service, server)  # undecodable requests: INVALID_ARGUMENT, not UNKNOWN
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        host = self.requested_address.rpartition(":")[0]
        if self.tls:  # (certificate chain, private key) files, PEM
            cert, key = (Path(f).read_bytes() for f in self.tls)
            ca = Path(self.client_ca).read_bytes() if self.client_ca is not None else None
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
            port = server.add_secure_port(self.requested_address, creds)
        else:
            port = server.add_insecure_port(self.requested_address)
        await server.start()
        self._server = server
        frontend.hub.on_error = self.health_changed
        await self._publish_health()
        if self.requested_http_address is not None:
            self.http_address = await self._start_http()
        return f"{host}:{port}"

    async def _start_http(self, timeout_s: float = 20.0) -> str:
        host, _, port = self.requested_http_address.rpartition(":")
        # Bound here, not by uvicorn: a port that is taken is then an OSError naming the address
        # (uvicorn would sys.exit, which ends this thread without a word).
        sock = _listen(host.strip("[]"), int(port), self.requested_http_address)
        app = create_app(self.service.frontend, self.health_report, self.auth_token, self.max_request_bytes,
                         self.admin)
        tls = {"ssl_certfile": str(self.tls[0]), "ssl_keyfile": str(self.tls[1])} if self.tls else {}
        if self.client_ca is not None:  # mutual TLS: the handshake fails without a certificate the CA signed
            tls.update(ssl_ca_certs=str(self.client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(app, http=bounded_h11(self.max_http_connections), log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=2, **tls)
        self._http = uvicorn.Server(config)
        self._http_task = asyncio.ensure_future(_serve(self._http, sock))
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._http.started:  # bounded: uvicorn says nothing else when it is up
            if self._http_task.done():
                self._http_task.result()  # raises why it could not start (a bad certificate, ...)
                raise RuntimeError(f"the HTTP server on {self.requested_http_address} stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the HTTP server on {self.requested_http_address} did not start in {timeout_s} s")
            await asyncio.sleep(0.01)
        return f"{host}:{sock.getsockname()[1]}"

    def serving(self) -> bool:
        """Whether the cluster takes requests: the token stream is up and a decode (or colocated) worker
        lives and is not draining; without a prefill worker, decode workers prefill prompts themselves."""
        frontend = self.service.frontend
        return frontend.hub.error is None and any(w.healthy and not w.draining for w in frontend.router.decode_pool)

    def health_report(self) -> HealthReport:
        """The cluster as the router sees it now (`GET /health`, `pdserve status`)."""
        frontend = self.service.frontend
        router, info = frontend.router, frontend.model.info
        pools = [PoolHealth("decode", True, [worker_health(w, router.mode) for w in router.decode_pool])]
        if router.prefill_pool:  # not needed: without one, decode workers prefill prompts themselves
            pools.insert(0, PoolHealth("prefill", False, [worker_health(w, router.mode) for w in router.prefill_pool]))
        if frontend.encoders is not None:  # not needed: without one, the prompt pass encodes
            pools.insert(0, PoolHealth("encode", False, [encoder_health(e) for e in frontend.encoders.encoders]))
        model = ModelHealth(info.name, info.model_type, info.max_model_len, info.dtype)
        return HealthReport(self.serving(), router.mode, model, self.address, self.http_address, pools,
                            self.planner_status())

    def health_changed(self) -> None:
        """Workers' health changed (called by the cluster's supervisor, from any thread)."""
        future = asyncio.run_coroutine_threadsafe(self._publish_health(), self._loop.loop)
        future.add_done_callback(_log_failure)

    async def _publish_health(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self.serving() else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def _stop(self, grace: float) -> None:
        if self._http is not None:
            self._http.should_exit = True
            try:
                await asyncio.wait_for(self._http_task, grace + 5)
            except Exception:  # noqa: BLE001 (gRPC must stop all the same)
                log.exception("the HTTP server did not stop cleanly")
        await self._server.stop(grace)


def _listen(host: str, port: int, address: str) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6); OSError naming `address` when it cannot be."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on http_address {address}: {e.strerror or e}") from None
    # Inherited by every accepted connection (asyncio sets it only on sockets made with protocol
    # IPPROTO_TCP; this one has 0): without it, Nagle holds a stream's next small event until the
    # client's (delayed, ~40 ms) ACK of the previous one.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as e:  # uvicorn's way of failing; in a task it would end the whole loop thread
        raise RuntimeError(f"the HTTP server stopped (uvicorn exit code {e.code})") from None
    finally:
        sock.close()
