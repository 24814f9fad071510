"""The HTTP API's connections before a request is read, on a real uvicorn server on loopback with the
router's protocol (`bounded_h11`): a connection that sends no request, or drips its headers (before its
first request or after an answer), is closed at the deadline; one past the cap is closed as it is
accepted; a request whose headers came is never cut, however slowly its body follows, and a connection
kept alive serves its next request."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from helpers import wait_until
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pdserve.router.http_connections import bounded_h11

HEADER_TIMEOUT_S = 0.5


async def echo(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"got {len(await request.body())} bytes")


@contextmanager
def serve(max_connections: int, header_timeout_s: float) -> Iterator[tuple[str, int]]:
    """A uvicorn server with the bounded protocol, on its own thread and event loop; stopped after."""
    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=bounded_h11(max_connections, header_timeout_s),
                                           log_level="warning", lifespan="off"))
    # The server's loop runs here while the test talks to it as a client would.
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name="test-uvicorn")
    thread.start()
    try:
        assert wait_until(lambda: server.started, 10)
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def quick_deadline() -> Iterator[tuple[str, int]]:
    with serve(max_connections=16, header_timeout_s=HEADER_TIMEOUT_S) as address:
        yield address


def closed_by_server(conn: socket.socket, within_s: float) -> bool:
    """Whether the server closes `conn` within `within_s` (what it sends before is read and dropped)."""
    conn.settimeout(0.1)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if conn.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
    return False


def status_of_response(conn: socket.socket) -> bytes:
    """The status line of the next whole response on `conn` (its body read to its Content-Length)."""
    conn.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += conn.recv(65536)
    return head.split(b"\r\n")[0]


def test_a_connection_that_sends_no_request_is_closed_at_the_deadline(quick_deadline):
    with socket.create_connection(quick_deadline) as silent:
        assert closed_by_server(silent, 10)


def test_headers_dripped_a_byte_at_a_time_are_cut_at_the_deadline(quick_deadline):
    with socket.create_connection(quick_deadline) as dripping:
        dripping.settimeout(0.1)
        started = time.monotonic()
        for byte in b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1000:
            try:
                dripping.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                if dripping.recv(1) == b"":
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:  # closed with bytes of ours unread: the kernel resets it
                break
        assert time.monotonic() - started < 10  # closed long before the 1000 bytes of its header were all sent


def test_a_request_whose_headers_came_is_not_cut_and_the_connection_serves_the_next(quick_deadline):
    body = b"x" * 8
    with socket.create_connection(quick_deadline) as client:
        client.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n")
        for i in range(len(body)):  # the body takes four deadlines to come
            time.sleep(HEADER_TIMEOUT_S / 2)
            client.sendall(body[i:i + 1])
        assert status_of_response(client) == b"HTTP/1.1 200 OK"
        client.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")  # kept alive
        assert status_of_response(client) == b"HTTP/1.1 200 OK"
        assert closed_by_server(client, 10)  # and after it, the deadline holds again


def test_after_an_answer_the_next_request_s_headers_are_timed_again(quick_deadline):
    """A byte that arrives stops uvicorn's own keep-alive timer: headers dripped after an answer are cut
    by the deadline the answer set again."""
    with socket.create_connection(quick_deadline) as client:
        client.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert status_of_response(client) == b"HTTP/1.1 200 OK"
        started = time.monotonic()
        client.settimeout(0.1)
        for byte in b"POST /echo HTTP/1.1\r\nX-Pad: " + b"a" * 1000:  # a byte every 0.1 s: 100 s in all
            try:
                client.send(bytes([byte]))
                if client.recv(1) == b"":
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        assert time.monotonic() - started < 4  # within the deadline, not uvicorn's 5 s keep-alive


def test_a_connection_past_the_cap_is_closed_as_it_is_accepted():
    with serve(max_connections=2, header_timeout_s=60) as address:
        held = [socket.create_connection(address) for _ in range(2)]
        try:
            with socket.create_connection(address) as third:
                assert closed_by_server(third, 10)
            for conn in held:  # the two within the cap are served
                conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
                assert status_of_response(conn) == b"HTTP/1.1 200 OK"
        finally:
            for conn in held:
                conn.close()
