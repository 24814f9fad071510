"""Byte pipes under the gRPC transport's HTTP/2 connections: a TCP socket, or TLS over one.

A pipe is read by one thread and written by another at once. A plain socket allows that; an
`ssl.SSLSocket` does not (OpenSSL's connection object must not be used by two threads at once:
CPython issues 76714 and 151508), so TLS runs through memory BIOs: one `ssl.SSLObject` under a
lock, with the socket's own reads and writes outside it, so a reader waiting for bytes never holds
up a writer.

A plain pipe writes a frame's header and its payload with one `sendmsg`, straight from the
payload's buffer; both kinds read straight into the buffer given (`recv_into`).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Protocol

Buffer = bytes | bytearray | memoryview

CONNECT_TIMEOUT_S = 10.0  # connecting; then setting up (the TLS handshake, HTTP/2's preface) at most this long
_TLS_READ_BYTES = 256 << 10  # ciphertext read from the socket at a time
# A peer that vanished without closing (a half-open connection) is noticed within about 40 s: by
# keepalive probes on an idle connection, and by the user timeout (data unacknowledged) on a busy one.
_KEEPALIVE = {"TCP_KEEPIDLE": 20, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 4, "TCP_USER_TIMEOUT": 40_000}


class Pipe(Protocol):
    peer: str

    def handshake(self) -> None:
        """Finish setting the pipe up (TLS); on the reading thread, before anything else. Until
        `settle`, every read must come by the set-up's deadline (CONNECT_TIMEOUT_S from the pipe's
        making): a peer that trickles its handshake or preface is cut off."""

    def settle(self) -> None:
        """Set up: reads wait as long as it takes from now on (keepalive finds a vanished peer)."""

    def recv_into(self, view: memoryview) -> int:
        """Read at most len(view) bytes into `view`; 0 when the peer closed the connection."""

    def send(self, parts: Sequence[Buffer]) -> None:
        """Write every part, in order, whole."""

    def shutdown(self) -> None:
        """End both directions: a read or write under way on another thread returns at once. Idempotent."""

    def close(self) -> None: ...


def tune(sock: socket.socket) -> None:
    """No Nagle delay (a frame goes out with its header), and keepalive probes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE.items():
        if hasattr(socket, name):  # Linux; macOS has only some of them
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _SocketPipe:
    """What both pipes share: their socket, its peer's name, and the set-up's deadline (reads before
    `settle` end by it)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.peer = peer_name(sock)
        self._deadline: float | None = time.monotonic() + CONNECT_TIMEOUT_S

    def _bound(self) -> None:
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not set up within {CONNECT_TIMEOUT_S:g} s")
            self._sock.settimeout(left)

    def settle(self) -> None:
        self._deadline = None
        self._sock.settimeout(None)

    def shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more, or closed
            pass

    def close(self) -> None:
        self._sock.close()


class PlainPipe(_SocketPipe):
    def handshake(self) -> None:
        pass

    def recv_into(self, view: memoryview) -> int:
        self._bound()
        return self._sock.recv_into(view)

    def send(self, parts: Sequence[Buffer]) -> None:
        views = [memoryview(part).cast("B") for part in parts if len(part)]
        while views:
            sent = self._sock.sendmsg(views)
            while sent:  # drop what went out; a partial write resumes inside its part
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0], sent = views[0][sent:], 0

class TlsPipe(_SocketPipe):
    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None) -> None:
        super().__init__(sock)
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side, server_hostname)
        self._tls_lock = threading.Lock()  # the SSLObject and its BIOs
        self._send_lock = threading.Lock()  # records reach the socket in the order they were made

    def handshake(self) -> None:
        """Refuses a peer that does not speak h2."""
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                if not self._pull():
                    raise ConnectionError("the peer closed the connection during the TLS handshake") from None
        self._flush()
        if self._tls.selected_alpn_protocol() != "h2":
            raise ssl.SSLError(f"the peer did not agree to HTTP/2 (ALPN {self._tls.selected_alpn_protocol()!r})")

    def recv_into(self, view: memoryview) -> int:
        while True:
            with self._tls_lock:
                try:
                    return self._tls.read(len(view), view)
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:  # the peer's close_notify
                    return 0
                answer = self._outgoing.pending  # a read can make records of its own (TLS 1.3 key updates)
            if answer:
                self._flush()
            if not self._pull():
                return 0

    def send(self, parts: Sequence[Buffer]) -> None:
        with self._send_lock:
            with self._tls_lock:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:  # a memory BIO takes everything; write may still do it record by record
                        view = view[self._tls.write(view) :]
                records = self._outgoing.read()
            self._sock.sendall(records)

    def _pull(self) -> bool:
        """Ciphertext from the socket into the TLS object; False at the socket's end."""
        self._bound()
        data = self._sock.recv(_TLS_READ_BYTES)
        if not data:
            return False
        with self._tls_lock:
            self._incoming.write(data)
        return True

    def _flush(self) -> None:
        with self._send_lock:
            with self._tls_lock:
                records = self._outgoing.read()
            if records:
                self._sock.sendall(records)

def connect(address: str, tls: ssl.SSLContext | None) -> Pipe:
    """A pipe to `address` ("host:port", "[v6]:port"); the TLS handshake is left to `handshake`."""
    host, port = split_address(address)
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    tune(sock)
    return TlsPipe(sock, tls, False, host) if tls is not None else PlainPipe(sock)


def accepted(sock: socket.socket, tls: ssl.SSLContext | None) -> Pipe:
    """A pipe over a socket a listener accepted."""
    tune(sock)
    return TlsPipe(sock, tls, True) if tls is not None else PlainPipe(sock)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_name(sock: socket.socket) -> str:
    """"host:port" of the socket's peer ("?" once it is gone)."""
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return join_address(host, port)


def tls_context(cert: str, key: str, ca: str, server_side: bool) -> ssl.SSLContext:
    """Mutual TLS: this side shows `cert` and trusts only peers whose certificate `ca` signed; HTTP/2 by ALPN."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    context.load_verify_locations(ca)
    context.verify_mode = ssl.CERT_REQUIRED  # a client checks the server's name too (PROTOCOL_TLS_CLIENT)
    context.set_alpn_protocols(["h2"])
    return context
