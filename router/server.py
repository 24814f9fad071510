"""Runs the router's gRPC server (API, health, reflection) on its own event loop thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.proto.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.client import GRPC_OPTIONS
from pdserve.router.service import RouterService

log = logging.getLogger(__name__)
SERVICE_NAME = pdserve_pb2.DESCRIPTOR.services_by_name["PDServe"].full_name


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("publishing health failed", exc_info=future.exception())


class TokenAuth(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer TOKEN` on every call except health checks."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        if details.method.startswith("/grpc.health.") or (
            dict(details.invocation_metadata or ()).get("authorization") == self._expected
        ):
            return await continuation(details)
        return self._deny_stream if details.method.endswith("/Generate") else self._deny_unary


class RouterServer:
    def __init__(self, service: RouterService, address: str, tls: tuple[bytes, bytes] | None = None,
                 auth_token: str | None = None) -> None:
        self.service = service
        self.requested_address = address
        self.tls = tls
        self.auth_token = auth_token
        self.address: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router-grpc", daemon=True)
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None

    def start(self, timeout: float = 30.0) -> str:
        self._thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout)
        return self.address

    def stop(self, grace: float = 2.0) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop).result(grace + 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _start(self) -> str:
        interceptors = [TokenAuth(self.auth_token)] if self.auth_token else []
        server = grpc.aio.server(interceptors=interceptors, options=GRPC_OPTIONS)
        pdserve_pb2_grpc.add_PDServeServicer_to_server(self.service, server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        host = self.requested_address.rpartition(":")[0]
        if self.tls:
            creds = grpc.ssl_server_credentials([(self.tls[1], self.tls[0])])
            port = server.add_secure_port(self.requested_address, creds)
        else:
            port = server.add_insecure_port(self.requested_address)
        await server.start()
        self._server = server
        self.service.hub.on_error = self.health_changed
        await self._publish_health()
        return f"{host}:{port}"

    def health_changed(self) -> None:
        """Workers' health changed (called by the cluster's supervisor, from any thread)."""
        future = asyncio.run_coroutine_threadsafe(self._publish_health(), self._loop)
        future.add_done_callback(_log_failure)

    async def _publish_health(self) -> None:
        pools = [self.service.prefill_pool, self.service.decode_pool]
        serving = self.service.hub.error is None and all(any(w.healthy for w in pool) for pool in pools if pool)
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def _stop(self, grace: float) -> None:
        await self._server.stop(grace)
