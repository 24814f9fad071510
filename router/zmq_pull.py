"""The router's receiving sockets (token stream, KV events): a PULL socket bound to a random port, and
the loop that drains it on a hub's own thread."""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from pdserve.wire import ClusterSecret

POLL_MS = 100  # bounded waits, so a hub's close() is noticed
# A peer's message is allocated as its header declares: bounded, CURVE or not. The largest real ones
# (a long request's last token message with its text; a worker's KV snapshot) are far below.
MAX_MESSAGE_BYTES = 64 << 20


def bind_pull(host: str, secret: ClusterSecret | None = None) -> tuple[zmq.Socket, str]:
    """A PULL socket on a free port of `host`, and its address for the workers' PUSH sockets; with
    `secret`, only the cluster's members get a message through."""
    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if secret is not None:
        secret.server(socket)
    port = socket.bind_to_random_port(f"tcp://{host}")
    return socket, f"tcp://{host}:{port}"


def drain(socket: zmq.Socket, stop: threading.Event, deliver: Callable[[bytes], None]) -> None:
    """Hand every message to `deliver`, in order, until `stop` is set."""
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while not stop.is_set():
        if not poller.poll(POLL_MS):
            continue
        while True:
            try:
                data = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            deliver(data)
