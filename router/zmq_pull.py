"""The router's receiving sockets (token stream, KV events): a PULL socket bound to a random port,
drained by a task on the router's event loop (`zmq.asyncio`), not by a thread of its own."""

from __future__ import annotations

import asyncio
import logging
import threading
from abc import ABC, abstractmethod

import zmq
import zmq.asyncio

from pdserve.wire import ClusterSecret

log = logging.getLogger(__name__)

# A peer's message is allocated as its header declares: bounded, CURVE or not. The largest real ones
# (a long request's last token message with its text; a worker's KV snapshot) are far below.
MAX_MESSAGE_BYTES = 64 << 20


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the caller runs on `loop` (inside one of its callbacks or tasks)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class PullHub(ABC):
    """A PULL socket on a free port of `host` (the workers' PUSH sockets connect to `address`); with
    `secret`, only the cluster's members get a message through. A task on `loop` hands each message
    to `_on_message`, in order; if that task fails, `_crashed` hears why (it is logged, too)."""

    def __init__(self, name: str, host: str, secret: ClusterSecret | None, loop: asyncio.AbstractEventLoop) -> None:
        # On the process's one libzmq context, so that one ZAP handler serves its blocking sockets too.
        socket = zmq.asyncio.Context.shadow(zmq.Context.instance().underlying).socket(zmq.PULL)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            if secret is not None:
                secret.server(socket)
            port = socket.bind_to_random_port(f"tcp://{host}")
        except BaseException:
            socket.close()
            raise
        self.address = f"tcp://{host}:{port}"
        self._socket = socket
        self._name = name
        self._loop = loop
        self._task: asyncio.Task | None = None
        self._ended = threading.Event()
        loop.call_soon_threadsafe(self._start)

    def close(self, timeout: float = 2.0) -> None:
        """Stop receiving, from any thread (off the loop it waits, bounded, for the task to end)."""
        try:
            self._loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:  # the loop is closed, and the task with it
            self._socket.close()
            return
        if not on_loop(self._loop):
            self._ended.wait(timeout)

    @abstractmethod
    def _on_message(self, data: bytes) -> None:
        """One message off the socket, on the loop."""

    @abstractmethod
    def _crashed(self, error: BaseException) -> None:
        """The receiving task failed with `error` (on the loop): nothing more arrives."""

    def _start(self) -> None:
        self._task = self._loop.create_task(self._drain(), name=self._name)
        self._task.add_done_callback(self._finished)

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _drain(self) -> None:
        while True:
            self._on_message(await self._socket.recv())
            # A message already queued comes back as a finished future, and awaiting one gives the
            # loop no turn: without this, a steady flow of messages would starve every stream.
            await asyncio.sleep(0)

    def _finished(self, task: asyncio.Task) -> None:
        self._socket.close()  # here, not in `_drain`: a task cancelled before its first step never runs it
        try:
            if not task.cancelled() and task.exception() is not None:
                log.error("the router's %s failed", self._name, exc_info=task.exception())
                self._crashed(task.exception())
        except Exception:
            log.exception("handling the failure of the router's %s failed too", self._name)
        finally:
            self._ended.set()
