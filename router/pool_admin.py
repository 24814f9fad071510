"""The HTTP API's admin routes: reshape the pools of a running cluster.

    POST   /admin/workers                  {"role": "prefill"|"decode"}   start one more worker
    POST   /admin/workers/{name}/role      {"role": "prefill"|"decode"}   drain it, start one of that role instead
    POST   /admin/workers/{name}/drain                                    move what it decodes away; it takes no request
    POST   /admin/workers/{name}/reopen                                   it takes requests again
    DELETE /admin/workers/{name}                                          drain it, then stop it

Only with the manifest's `server.admin_token` set, and only with it (not the clients' `auth_token`:
who may generate may not stop workers); without one every admin call is refused. One change at a time: a call made
while another runs is answered 409. The cluster does the work (`PoolControl`, which the launcher's
`Cluster` is); its calls block (they wait for workers to start or drain), so they run on a thread of
their own, off the event loop that serves every stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
from collections.abc import Callable
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pdserve.router.frontend import DrainReport
from pdserve.router.workers import NoHealthyWorker, WorkerRef

MAX_BODY_BYTES = 1024  # {"role": "..."} is all an admin call carries


class PoolControl(Protocol):
    """What the admin routes ask of the cluster. Each call blocks until its change is done."""

    def add_worker(self, role: str) -> WorkerRef: ...

    def remove_worker(self, worker_name: str) -> DrainReport: ...

    def switch_role(self, worker_name: str, role: str) -> WorkerRef: ...

    def drain(self, worker_name: str) -> DrainReport: ...

    def reopen(self, worker_name: str) -> None: ...


class PoolAdmin:
    def __init__(self, control: PoolControl, admin_token: str | None) -> None:
        self.control = control
        self.expected_auth = admin_token.encode() if admin_token else None
        # One change at a time, each on this thread: a change waits for workers for seconds or minutes.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "pool-admin")
        self._busy = asyncio.Lock()

    def routes(self) -> list[Route]:
        return [Route("/admin/workers", self.add, methods=["POST"]),
                Route("/admin/workers/{name}/role", self.role, methods=["POST"]),
                Route("/admin/workers/{name}/drain", self.drain, methods=["POST"]),
                Route("/admin/workers/{name}/reopen", self.reopen, methods=["POST"]),
                Route("/admin/workers/{name}", self.remove, methods=["DELETE"])]

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def add(self, request: Request) -> JSONResponse:
        return await self._change(request, lambda body: _worker_json(self.control.add_worker(_role(body))))

    async def role(self, request: Request) -> JSONResponse:
        name = request.path_params["name"]
        return await self._change(request, lambda body: _worker_json(self.control.switch_role(name, _role(body))))

    async def drain(self, request: Request) -> JSONResponse:
        name = request.path_params["name"]
        return await self._change(request, lambda _: _drain_json(self.control.drain(name)))

    async def reopen(self, request: Request) -> JSONResponse:
        name = request.path_params["name"]

        def reopen(_: RoleBody | None) -> dict[str, Any]:
            self.control.reopen(name)
            return {"worker": name, "draining": False}

        return await self._change(request, reopen)

    async def remove(self, request: Request) -> JSONResponse:
        name = request.path_params["name"]
        return await self._change(request, lambda _: {**_drain_json(self.control.remove_worker(name)), "stopped": True})

    async def _change(self, request: Request, change: Callable[[RoleBody | None], dict[str, Any]]) -> JSONResponse:
        if self.expected_auth is None:
            return _error(403, "the admin API needs the manifest's server.admin_token set")
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.expected_auth):
            return _error(401, "missing or wrong admin token (Authorization: Bearer ...)")
        body = await _small_body(request)
        if isinstance(body, str):
            return _error(400, body)
        if self._busy.locked():
            return _error(409, "another change to the pools is under way")
        async with self._busy:
            try:
                answer = await asyncio.get_running_loop().run_in_executor(self._thread, change, body)
            except ValueError as e:  # a bad role or name, the last decode worker: the caller's to fix
                return _error(400, str(e))
            except NoHealthyWorker as e:
                return _error(409, f"no worker can take the requests: {e}")
            except TimeoutError as e:
                return _error(504, str(e))
        return JSONResponse(answer)


class RoleBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]


async def _small_body(request: Request) -> RoleBody | None | str:
    """The body: a `RoleBody`, None when empty, or what is wrong with it (larger than `MAX_BODY_BYTES`,
    or not a role)."""
    data = b""
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            return f"the body is larger than {MAX_BODY_BYTES} bytes"
    if not data.strip():
        return None
    try:
        return RoleBody.model_validate_json(data)
    except ValidationError:
        return 'the body must be {"role": "prefill"} or {"role": "decode"}'


def _role(body: RoleBody | None) -> str:
    if body is None:
        raise ValueError('this call needs a body: {"role": "prefill"} or {"role": "decode"}')
    return body.role


def _worker_json(worker: WorkerRef) -> dict[str, Any]:
    return {"worker": worker.name, "role": worker.pool}


def _drain_json(report: DrainReport) -> dict[str, Any]:
    return {"worker": report.worker, "draining": True, "moved": report.moved, "recomputed": report.recomputed,
            "failed_moves": report.failed_moves, "pauses_s": report.pauses_s, "seconds": report.seconds}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)
