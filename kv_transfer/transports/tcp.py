"""tcp: KV frames straight over a TCP connection, in mutual TLS when the manifest gives certificates;
the default across nodes.

A frame leaves the KV buffer in one `sendmsg` with its header, and arrives by `recv_into` in the
buffer the receiving half keeps per connection (no copy in user space on either side; with TLS,
`ssl` encrypts and decrypts in place of the copy). A sender keeps idle connections per decode worker
and runs one channel at a time on each, so concurrent transfers to one decode worker use a
connection each, and sequential ones reuse them.

The wire (integers little-endian):

    receiver -> sender    HELLO   MAGIC, a fresh 32-byte nonce R
    sender   -> receiver  PROOF   a fresh 32-byte nonce S, HMAC-SHA256(key, "sender" R S)
    receiver -> sender    PROOF   HMAC-SHA256(key, "receiver" R S)
    then, for each channel on the connection, in turn:
    sender   -> receiver  FRAME   "F", header length (u16), `FrameHeader.pack()`, the payload ...
                          END     "E"
    receiver -> sender    REFUSED "R", text length (u16), text: once per channel, as soon as the
                                  sink refuses one of its frames (the rest are still read)
                          DONE    "D": every frame before END was handed to the sink

The key is the cluster's secret (`ClusterSecret.key`); it never crosses the wire, and both sides prove
they hold it, so a receiver takes frames only from members and a sender sends KV only to one. Without
a secret (the manifest turned authentication off), the key is empty and the proofs prove nothing.

Before a peer has proved membership, the receiving half bounds what it spends on it (`gate`): a
deadline, a budget of such connections apart from members', a share per address. After, a frame's
payload is read only once the sink admitted its header (`FrameSink.admit_frame`: a transfer held
here, a payload no larger than its tokens can take), so no header a peer writes makes the receiver
allocate more than a reservation holds; a refused frame is read through a small scratch buffer and
dropped. A member whose connection breaks the wire's rules is cut off.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.kv_transfer.interface import (MAX_FRAME_BYTES, CorruptFrame, FrameHeader, FrameSink, Payload,
                                          TransferError, shown)
from pdserve.kv_transfer.transports.gate import AUTH_DEADLINE_S, ConnectionBudget, RefusalLog, Slot
from pdserve.kv_transfer.transports.idle import IdlePool
from pdserve.threads import start_guarded

if TYPE_CHECKING:
    from pdserve.wire import ClusterSecret

log = logging.getLogger(__name__)

MAGIC = b"PDKV\x01"
NONCE_BYTES = 32
_MAC_BYTES = 32
FRAME, END, REFUSED, DONE = b"F", b"E", b"R", b"D"
_FRAME_HEAD = struct.Struct("<cH")  # kind, header length
_LENGTH = struct.Struct("<H")
MAX_HEADER_BYTES = 4096  # a FrameHeader packs to ~60 bytes and two names
CONNECT_TIMEOUT_S = 10.0  # connecting and proving membership, on the sending side
SEND_TIMEOUT_S = 30.0  # a write the receiver does not take for this long: it is stuck or gone
MEMBER_IDLE_S = 300.0  # a member's connection that sends nothing for this long is closed
ACCEPT_POLL_S = 0.25  # how often the accepting thread looks at its stop flag and the handshakes' deadlines
SCRATCH_BYTES = 256 << 10  # a refused frame's payload is read through this much, and dropped
SPARE_MAX_BYTES = 32 << 20  # a connection's payload buffer is kept for its next frames up to this size
# A peer that vanished without closing (a half-open connection) is noticed within about 40 s: by
# keepalive probes on an idle connection, and by the user timeout (data unacknowledged) on a busy one.
_KEEPALIVE = {"TCP_KEEPIDLE": 20, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 4, "TCP_USER_TIMEOUT": 40_000}


# --- what both halves share ---------------------------------------------------------------------
def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tls_context(tls: dict[str, str], server_side: bool) -> ssl.SSLContext:
    """Mutual TLS: this side shows `cert` and trusts only peers whose certificate `ca` signed (a
    client checks the server's name against its certificate too)."""
    missing = {"cert", "key", "ca"} - set(tls)
    if missing:
        raise ValueError(f"KV TLS needs cert, key and ca (mutual TLS); missing {sorted(missing)}")
    for name in ("cert", "key", "ca"):
        if not Path(tls[name]).is_file():
            raise ValueError(f"KV TLS {name} file {tls[name]!r} does not exist")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls["cert"], tls["key"])
    context.load_verify_locations(tls["ca"])
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _tune(sock: socket.socket) -> None:
    """No Nagle delay (a frame goes out with its header), and keepalive probes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE.items():
        if hasattr(socket, name):  # Linux; macOS has only some of them
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _proof(key: bytes, role: bytes, nonce_r: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(key, role + nonce_r + nonce_s, hashlib.sha256).digest()


def _key(secret: ClusterSecret | None) -> bytes:
    return secret.key if secret is not None else b""


def _cut_off(sock: socket.socket) -> None:
    """End both directions of `sock` from any thread: a read or write under way fails at once. On the
    descriptor itself: `SSLSocket.shutdown` would also tear its TLS state down under that call."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # not connected any more
        pass


def _read_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; ConnectionError if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def _read(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    _read_exactly(sock, memoryview(data))
    return bytes(data)


def _send_all(sock: socket.socket, parts: list[memoryview]) -> None:
    """Write every part in order: one `sendmsg` (gather) on a plain socket, each part on a TLS one."""
    if isinstance(sock, ssl.SSLSocket):
        for part in parts:
            sock.sendall(part)
        return
    views = [part for part in parts if len(part)]
    while views:
        sent = sock.sendmsg(views)
        while sent:  # drop what went out; a partial write resumes inside its part
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0


# --- the sending half ---------------------------------------------------------------------------
class _Connection:
    """One proven connection to a receiving half, owned by one channel at a time."""

    def __init__(self, address: str, tls: ssl.SSLContext | None, key: bytes) -> None:
        self.address = address
        host, port = split_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as e:
            raise TransferError(f"cannot connect to the KV receiver at {address}: {e}") from e
        try:
            _tune(sock)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
            hello = _read(sock, len(MAGIC) + NONCE_BYTES)
            if not hello.startswith(MAGIC):
                raise TransferError(f"{address} is not a pdserve KV receiver (it greeted with {shown(hello[:8])})")
            nonce_r, nonce_s = hello[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
            sock.sendall(nonce_s + _proof(key, b"sender", nonce_r, nonce_s))
            if not hmac.compare_digest(_read(sock, _MAC_BYTES), _proof(key, b"receiver", nonce_r, nonce_s)):
                raise TransferError(f"the KV receiver at {address} did not prove it belongs to this cluster")
        except TransferError:
            sock.close()
            raise
        except (OSError, ValueError) as e:  # ssl.SSLError and timeouts are OSErrors
            sock.close()
            raise TransferError(f"KV receiver at {address}: setting the connection up failed: {e}") from e
        sock.settimeout(SEND_TIMEOUT_S)
        self.sock = sock

    def fresh(self) -> bool:
        """Whether an idle connection can take a channel: nothing to read (a receiver that closed it,
        or sent what no channel asked for)."""
        pending = isinstance(self.sock, ssl.SSLSocket) and self.sock.pending()
        return not pending and not select.select([self.sock], [], [], 0)[0]

    def close(self) -> None:
        _cut_off(self.sock)
        self.sock.close()


class TcpChannel:
    device = None  # payloads are host bytes

    def __init__(self, transport: TcpSender, address: str, transfer_id: str) -> None:
        self.transport = transport
        self.transfer_id = transfer_id
        self.bytes_sent = 0
        self._connection = transport.take_connection(address)
        self._lock = threading.Lock()  # the owner's send and finish; a close from another thread cuts in
        self._closed = False
        self._done = False  # DONE read: the connection is in step for the next channel
        self._refusal: str | None = None

    def send(self, header: FrameHeader, payload: Payload) -> None:
        view = memoryview(payload).cast("B")
        packed = header.pack()
        with self._lock:
            self._check_open()
            self._read_answers(block=False)
            if self._refusal is not None:
                raise TransferError(f"KV receiver refused a frame: {self._refusal}")
            try:
                _send_all(self._connection.sock, [memoryview(_FRAME_HEAD.pack(FRAME, len(packed)) + packed), view])
            except OSError as e:
                raise self._broken(e) from e
            self.bytes_sent += view.nbytes

    def finish(self, timeout: float) -> None:
        with self._lock:
            self._check_open()
            if not self._done:
                deadline = time.monotonic() + timeout
                try:
                    self._connection.sock.sendall(END)
                    while not self._done:
                        self._read_answers(block=True, deadline=deadline)
                except (OSError, TransferError) as e:
                    raise self._broken(e) from e
            if self._refusal is not None:
                raise TransferError(f"KV receiver refused a frame: {self._refusal}")

    def _read_answers(self, block: bool, deadline: float | None = None) -> None:
        """Take the receiver's answers: whatever is there already, or (`block`) at least one by `deadline`."""
        sock = self._connection.sock
        while True:
            pending = isinstance(sock, ssl.SSLSocket) and sock.pending()
            if not block and not pending and not select.select([sock], [], [], 0)[0]:
                return
            if block:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError("KV receiver did not confirm the frames in time")
                sock.settimeout(left)
            try:
                kind = _read(sock, 1)
                if kind == DONE:
                    self._done = True
                elif kind == REFUSED:
                    (length,) = _LENGTH.unpack(_read(sock, _LENGTH.size))
                    self._refusal = self._refusal or _read(sock, length).decode(errors="replace")
                else:
                    raise TransferError(f"KV receiver sent {shown(kind)}, which no channel asked for")
            finally:
                sock.settimeout(SEND_TIMEOUT_S)
            if block:
                return

    def _broken(self, error: BaseException) -> TransferError:
        """The error a failed write or read ends the channel with (its connection is closed with it)."""
        if self._closed:
            return TransferError(f"transfer {self.transfer_id}: the channel was closed")
        return error if isinstance(error, TransferError) else TransferError(f"KV connection failed: {error}")

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transfer {self.transfer_id}: the channel is closed")

    def close(self) -> None:
        """A channel that read its DONE gives its connection back for the next; any other closes it
        (mid-frame, nothing tells where the next frame would start)."""
        self._closed = True
        if not self._lock.acquire(blocking=False):  # a send or finish under way: cut it short
            _cut_off(self._connection.sock)
            self._lock.acquire()
        try:
            connection, self._connection = self._connection, None
            if connection is None:
                return
            if self._done:
                self.transport.give_back(connection)
            else:
                connection.close()
        finally:
            self._lock.release()


class TcpSender:
    name = "tcp"

    def __init__(self, tls: dict[str, str] | None = None, secret: ClusterSecret | None = None) -> None:
        self._tls = tls_context(tls, server_side=False) if tls else None
        self._key = _key(secret)
        self._idle: IdlePool[_Connection] = IdlePool()
        self._lock = threading.Lock()
        self.connections_made = 0

    def open(self, address: str, transfer_id: str) -> TcpChannel:
        return TcpChannel(self, address, transfer_id)

    def take_connection(self, address: str) -> _Connection:
        connection = self._idle.take(address, usable=_Connection.fresh)
        if connection is not None:
            return connection
        connection = _Connection(address, self._tls, self._key)
        with self._lock:
            self.connections_made += 1
        return connection

    def give_back(self, connection: _Connection) -> None:
        self._idle.give_back(connection.address, connection)

    def forget(self, address: str) -> None:
        self._idle.forget(address)

    def close(self) -> None:
        self._idle.close()


# --- the receiving half -------------------------------------------------------------------------
class TcpReceiver:
    """Accepts connections on one thread, and serves each on a thread of its own (bounded by
    `gate`'s budgets). `on_crash` is told if the accepting thread dies; a connection's failure ends
    only that connection."""

    name = "tcp"

    def __init__(self, sink: FrameSink, host: str = "127.0.0.1", tls: dict[str, str] | None = None,
                 secret: ClusterSecret | None = None,
                 on_crash: Callable[[BaseException], None] = lambda error: None) -> None:
        self.sink = sink
        self._tls = tls_context(tls, server_side=True) if tls else None
        self._key = _key(secret)
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=128)
        self._listener.settimeout(ACCEPT_POLL_S)
        self.address = join_address(host, self._listener.getsockname()[1])
        self.budget = ConnectionBudget()
        self.refusals = RefusalLog(log, f"KV tcp receiver on {self.address}")
        self.failures = 0  # connections that ended on an error of this side's own (a bug: logged)
        self._stopped = threading.Event()
        self._on_crash = on_crash
        # Accepting, and cutting off handshakes past their deadline, apart from the connections' threads.
        self._thread = start_guarded("kv-tcp-accept", self._accept_loop, on_crash)
        log.info("KV tcp receiver listening on %s", self.address)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            self.budget.cut_late()
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopped.is_set():
                    return
                raise
            slot = self.budget.open(str(peer[0]), lambda sock=sock: _cut_off(sock))
            # One thread per connection, for as long as it lives: reads block on the peer (bounded by
            # the deadline until it proves membership, then by MEMBER_IDLE_S), and the budgets bound
            # how many there are.
            start_guarded("kv-tcp-connection", lambda sock=sock, slot=slot: self._serve(sock, slot),
                          self._connection_failed)

    def _connection_failed(self, error: BaseException) -> None:
        self.failures += 1

    def _serve(self, sock: socket.socket, slot: Slot) -> None:
        try:
            sock.settimeout(AUTH_DEADLINE_S)  # each read; the accepting thread cuts the whole off by the deadline
            _tune(sock)
            if self._tls is not None:  # no I/O yet: the handshake is part of the proof, under its deadline
                sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                slot.close = lambda sock=sock: _cut_off(sock)  # the descriptor is the TLS socket's now
            try:
                self._prove(sock, slot)
            except (OSError, ValueError, TransferError) as e:  # ssl.SSLError and timeouts are OSErrors
                self.refusals.refused_peer(slot.host, shown(str(e), 160))
                return
            sock.settimeout(MEMBER_IDLE_S)
            try:
                _FrameReader(sock, self.sink, self._stopped).run()
            except (OSError, TransferError) as e:
                log.info("KV tcp receiver: connection from %s ended: %s", shown(slot.host, 64), shown(str(e), 160))
        finally:
            self.budget.release(slot)
            _cut_off(sock)
            sock.close()

    def _prove(self, sock: socket.socket, slot: Slot) -> None:
        """The TLS handshake, then check the peer's proof of membership and give this side's; the
        connection then counts as a member's."""
        if isinstance(sock, ssl.SSLSocket):
            sock.do_handshake()
        nonce_r = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(MAGIC + nonce_r)
        answer = _read(sock, NONCE_BYTES + _MAC_BYTES)
        nonce_s, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(mac, _proof(self._key, b"sender", nonce_r, nonce_s)):
            raise TransferError("no proof of membership: it does not match this cluster's key")
        if not self.budget.prove(slot):
            raise TransferError("the members' connections are all taken (or its handshake was late)")
        sock.sendall(_proof(self._key, b"receiver", nonce_r, nonce_s))

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2 * ACCEPT_POLL_S + 1)
        self._listener.close()
        self.budget.close_all()


class _FrameReader:
    """A member's connection: frames into the sink, channel after channel."""

    def __init__(self, sock: socket.socket, sink: FrameSink, stopped: threading.Event) -> None:
        self.sock = sock
        self.sink = sink
        self.stopped = stopped
        self.buffer = bytearray()  # the payloads' buffer, reused for the connection's frames
        self.refused = False  # this channel's REFUSED was sent

    def run(self) -> None:
        head = memoryview(bytearray(_FRAME_HEAD.size))
        while not self.stopped.is_set():
            try:
                n = self.sock.recv_into(head[:1])
            except TimeoutError:
                return  # idle past MEMBER_IDLE_S: the sender reuses its connections for less
            if n == 0:
                return  # the sender closed it
            if head[0:1] == END:
                self.sock.sendall(DONE)
                self.refused = False
                continue
            if head[0:1] != FRAME:
                raise TransferError(f"message kind {shown(bytes(head[:1]))} unknown")
            _read_exactly(self.sock, head[1:])
            _, length = _FRAME_HEAD.unpack(head)
            if length > MAX_HEADER_BYTES:
                raise TransferError(f"frame header of {length} bytes (at most {MAX_HEADER_BYTES})")
            try:
                header = FrameHeader.unpack(_read(self.sock, length))
            except CorruptFrame as e:  # nothing says where its payload ends: the connection cannot go on
                raise TransferError(str(e)) from None
            if header.payload_bytes > MAX_FRAME_BYTES:
                raise TransferError(f"frame of {header.payload_bytes} bytes announced (at most {MAX_FRAME_BYTES})")
            self._take(header)

    def _take(self, header: FrameHeader) -> None:
        try:
            self.sink.admit_frame(header)
        except TransferError as e:
            self._refuse(e)  # first: the sender stops sending what would only be read and dropped
            self._skip(header.payload_bytes)
            return
        if len(self.buffer) < header.payload_bytes or len(self.buffer) > SPARE_MAX_BYTES:
            self.buffer = bytearray(header.payload_bytes)
        payload = memoryview(self.buffer)[: header.payload_bytes]
        _read_exactly(self.sock, payload)
        try:
            self.sink.receive_frame(header, payload)
        except CorruptFrame:
            pass  # counted by the sink; `commit` names its layer for a resend
        except TransferError as e:
            self._refuse(e)

    def _skip(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, SCRATCH_BYTES)))
        while nbytes:
            n = min(nbytes, len(scratch))
            _read_exactly(self.sock, scratch[:n])
            nbytes -= n

    def _refuse(self, error: TransferError) -> None:
        if not self.refused:
            text = f"{type(error).__name__}: {error}".encode()[:1024]
            self.sock.sendall(REFUSED + _LENGTH.pack(len(text)) + text)
            self.refused = True
