"""The router's receiving end of token streaming: one PULL socket, fanned out to per-request queues."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import zmq


class TokenStreamHub:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="token-hub", daemon=True)
        self._thread.start()

    def subscribe(self, request_id: str) -> asyncio.Queue:
        """Messages for `request_id` arrive on the returned queue (call from the consuming event loop)."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._subscribers[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def unsubscribe(self, request_id: str) -> None:
        with self._lock:
            self._subscribers.pop(request_id, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._socket.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):  # bounded wait, so close() is noticed
                continue
            while True:
                try:
                    message: dict[str, Any] = self._socket.recv_json(zmq.NOBLOCK)
                except zmq.Again:
                    break
                with self._lock:
                    target = self._subscribers.get(message["rid"])
                if target is not None:  # messages of requests nobody waits for (cancelled) are dropped
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, message)
