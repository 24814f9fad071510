"""The KV receivers attacked as a stranger (or a member gone wrong) would, on loopback, each attack with
the bound the receiver now meets:

  - a flood of bytes before any proof (HTTP/2 SETTINGS for gRPC, garbage proofs for tcp) holds up no
    member's transfer (it took 11 s on the hand-made HTTP/2, whose HPACK went quadratic);
  - idle sockets lock out no member (256 of them took every place of the hand-made receiver);
  - a refusing peer costs a log line per interval, its text cut and repr'd (GOAWAY texts were logged
    raw, 64 KiB each, newlines included);
  - a frame header announcing a gigabyte allocates nothing (it zero-filled 1 GiB);
  - the cluster's key never crosses the wire (its token went in clear without TLS);
  - the gloo/NCCL rendezvous store listens on the configured host only (it bound every interface);
  - a control message past its bound is never delivered.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Iterator

import grpc
import pytest
import zmq
from helpers import tcp_member, wait_until, write_then_read_to_end
from kv_helpers import RecordingSink, frame

from pdserve.kv_transfer.interface import FrameHeader
from pdserve.kv_transfer.transports import control, make_sender, start_receiver, tcp
from pdserve.kv_transfer.transports.grpc_stream import PROOF_METADATA, TRANSFER_METADATA, _proof
from pdserve.proto.pdserve.v1 import kv_transfer_pb2
from pdserve.wire import ClusterSecret

MEMBER_DELAY_BOUND_S = 3.0  # a member's small transfer during an attack (it takes milliseconds alone)


@pytest.fixture
def secret() -> ClusterSecret:
    return ClusterSecret.generate()


@pytest.fixture
def kv_tls(tmp_path) -> dict[str, str]:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"cert": tmp_path / "kv.crt", "key": tmp_path / "kv.key", "ca": tmp_path / "ca.crt"}
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    ca.cert_pem.write_to_path(paths["ca"])
    return {k: str(v) for k, v in paths.items()}


def member_transfer(kind: str, address: str, secret: ClusterSecret, tls: dict[str, str] | None = None) -> float:
    """Seconds a member's one-frame transfer takes, from opening its channel to the receiver's confirmation."""
    sender = make_sender(kind, tls=tls, secret=secret)
    try:
        started = time.monotonic()
        channel = sender.open(address, "t1")
        channel.send(*frame(0, 4096, seed=1))
        channel.finish(timeout=30)
        channel.close()
        return time.monotonic() - started
    finally:
        sender.close()


@contextlib.contextmanager
def flooding(address: str, write: Iterator[bytes]) -> Iterator[list[int]]:
    """A stranger writing `write`'s chunks on connection after connection (the receiver cuts each off)
    until the block ends; yields the bytes written so far."""
    host, port = tcp.split_address(address)
    stop, written = threading.Event(), [0]

    def flood() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection((host, port), timeout=5) as sock:
                    for chunk in write:
                        if stop.is_set():
                            return
                        sock.sendall(chunk)
                        written[0] += len(chunk)
            except OSError:  # cut off: connect again
                pass

    thread = threading.Thread(target=flood, name="test-flood", daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: written[0] > 1 << 20, timeout=10), "the flood never got going"
        yield written
    finally:
        stop.set()
        thread.join(10)


def settings_frames() -> Iterator[bytes]:
    """HTTP/2's preface, then SETTINGS frames changing the header table size, 1,000 per chunk, forever."""
    yield b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    value = 0
    while True:
        chunk = []
        for _ in range(1000):
            value += 1
            payload = struct.pack(">HI", 1, value % 65536)  # SETTINGS_HEADER_TABLE_SIZE
            chunk.append(len(payload).to_bytes(3, "big") + bytes([4, 0]) + (0).to_bytes(4, "big") + payload)
        yield b"".join(chunk)


def garbage_proofs() -> Iterator[bytes]:
    while True:
        yield bytes(64 << 10)


@pytest.mark.parametrize("kind", ["tcp", "grpc"])
def test_a_flood_before_any_proof_holds_up_no_member(kind, secret):
    receiver = start_receiver(kind, RecordingSink(), "127.0.0.1", secret=secret)
    try:
        with flooding(receiver.address, settings_frames() if kind == "grpc" else garbage_proofs()) as written:
            took = member_transfer(kind, receiver.address, secret)
            assert written[0] > 1 << 20
        assert took < MEMBER_DELAY_BOUND_S, f"a member's transfer took {took:.1f} s under the flood"
    finally:
        receiver.stop()


@pytest.mark.parametrize("kind", ["tcp", "grpc"])
def test_idle_sockets_lock_out_no_member(kind, secret, kv_tls):
    """300 sockets that never start TLS, from the member's own address: its transfer still goes through."""
    receiver = start_receiver(kind, RecordingSink(), "127.0.0.1", tls=kv_tls, secret=secret)
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(tcp.split_address(receiver.address), timeout=5))
        assert member_transfer(kind, receiver.address, secret, tls=kv_tls) < MEMBER_DELAY_BOUND_S
        if kind == "tcp":  # what the strangers hold is bounded: their address's share of pending places
            pending, members = receiver.budget.counts
            assert pending <= receiver.budget.max_pending_per_host
    finally:
        for sock in idle:
            sock.close()
        receiver.stop()


def test_a_refusing_tcp_peer_costs_one_log_line_per_interval_and_its_text_is_never_raw(secret, caplog):
    receiver = start_receiver("tcp", RecordingSink(), "127.0.0.1", secret=secret)
    forged = b"\nERROR pdserve: forged line\n" * 2400  # 64 KiB, newlines included
    try:
        with caplog.at_level(logging.INFO, logger="pdserve"):
            for _ in range(200):
                with socket.create_connection(tcp.split_address(receiver.address), timeout=5) as sock:
                    write_then_read_to_end(sock, forged)
            assert wait_until(lambda: receiver.refusals.refused == 200, timeout=10)
        lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(lines) == 1, lines
        assert all("\n" not in r.getMessage() and "forged line" not in r.getMessage() for r in caplog.records)
        assert sum(len(r.getMessage()) for r in caplog.records) < 4096
    finally:
        receiver.stop()


def test_a_refusing_grpc_peer_costs_one_log_line_per_interval_and_its_text_is_never_raw(secret, caplog):
    receiver = start_receiver("grpc", RecordingSink(), "127.0.0.1", secret=secret)
    channel = grpc.insecure_channel(receiver.address)
    push = channel.stream_unary("/pdserve.v1.KVTransfer/PushKV", request_serializer=None,
                                response_deserializer=kv_transfer_pb2.KVAck.FromString)
    forged = "x" * 3000 + " ERROR pdserve: forged line"  # grpcio itself refuses metadata past 8 KiB
    try:
        with caplog.at_level(logging.INFO, logger="pdserve"):
            for _ in range(200):
                with pytest.raises(grpc.RpcError) as e:
                    push(iter([b""]), timeout=10, metadata=((TRANSFER_METADATA, forged), (PROOF_METADATA, forged)))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(lines) == 1, lines
        assert sum(len(r.getMessage()) for r in caplog.records) < 4096
        assert not any("forged line" in r.getMessage() for r in caplog.records)
    finally:
        channel.close()
        receiver.stop()


@contextlib.contextmanager
def peak_allocation() -> Iterator[list[int]]:
    """The peak of Python allocations (every thread's) over the block, in bytes, above where it began."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    start = tracemalloc.get_traced_memory()[0]
    peak = [0]
    try:
        yield peak
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1] - start
        tracemalloc.stop()


GIGABYTE_HEADERS = {  # announcing 1 GiB: for a transfer the receiver does not hold, and for one it does
    "not held": FrameHeader("a-stranger", 0, 0, 16, "raw", 0, 0, 1 << 30),
    "past its reservation": FrameHeader("t1", 0, 0, 16, "raw", 0, 0, 1 << 30),
}


@pytest.mark.parametrize("header", GIGABYTE_HEADERS.values(), ids=GIGABYTE_HEADERS)
def test_a_tcp_frame_header_announcing_a_gigabyte_allocates_nothing(secret, header):
    sink = RecordingSink(most_bytes=1 << 20)
    receiver = start_receiver("tcp", sink, "127.0.0.1", secret=secret)
    try:
        with peak_allocation() as peak, tcp_member(receiver.address, secret.key) as sock:
            packed = header.pack()
            sock.sendall(tcp.FRAME + len(packed).to_bytes(2, "little") + packed + b"first bytes of many")
            assert tcp._read(sock, 1) == tcp.REFUSED  # refused at once, its payload read through a scratch buffer
            (length,) = tcp._LENGTH.unpack(tcp._read(sock, 2))
            assert b"at most 1048576 held" in tcp._read(sock, length)
        assert peak[0] < 8 << 20, f"{peak[0] >> 20} MiB allocated"
        assert sink.frames == []
    finally:
        receiver.stop()


@pytest.mark.parametrize("header", GIGABYTE_HEADERS.values(), ids=GIGABYTE_HEADERS)
def test_a_grpc_frame_announcing_a_gigabyte_allocates_nothing(secret, header):
    sink = RecordingSink(most_bytes=1 << 20)
    receiver = start_receiver("grpc", sink, "127.0.0.1", secret=secret)
    channel = grpc.insecure_channel(receiver.address)
    push = channel.stream_unary("/pdserve.v1.KVTransfer/PushKV", request_serializer=None,
                                response_deserializer=kv_transfer_pb2.KVAck.FromString)
    message = kv_transfer_pb2.KVFrame(transfer_id=header.transfer_id, layer=0, num_tokens=16, codec="raw",
                                      payload_bytes=header.payload_bytes, offset=0, payload=b"first bytes of many")
    try:
        with peak_allocation() as peak:
            ack = push(iter([message.SerializeToString()] * 3), timeout=10, metadata=(
                (TRANSFER_METADATA, header.transfer_id), (PROOF_METADATA, _proof(secret.key, header.transfer_id))))
        assert "at most 1048576 held" in ack.error and ack.frames == 0
        assert peak[0] < 8 << 20, f"{peak[0] >> 20} MiB allocated"
    finally:
        channel.close()
        receiver.stop()


class RecordingProxy:
    """A loopback TCP forwarder that keeps every byte it passes, both ways."""

    def __init__(self, target: str) -> None:
        self.target = tcp.split_address(target)
        self.captured = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="test-proxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), name="test-proxy-pipe", daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                with self._lock:
                    self.captured += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            sock.close()


@pytest.mark.parametrize("kind", ["tcp", "grpc"])
def test_the_cluster_key_never_crosses_the_wire(kind, secret):
    """Without TLS, whoever reads the network sees the KV, but not what would let it in."""
    receiver = start_receiver(kind, RecordingSink(), "127.0.0.1", secret=secret)
    proxy = RecordingProxy(receiver.address)
    try:
        member_transfer(kind, proxy.address, secret)
        captured = bytes(proxy.captured)
        assert len(captured) > 4096  # the frame went through the proxy
        for form in (secret.key, secret.key.hex().encode(), secret.key.hex().upper().encode()):
            assert form not in captured
    finally:
        proxy.close()
        receiver.stop()


def listening_hosts(port: int) -> set[str]:
    """The local addresses on which some socket of this machine listens on TCP `port` (Linux)."""
    hosts = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.split(":")
                if state == "0A" and int(port_hex, 16) == port:  # LISTEN
                    raw = bytes.fromhex(address)
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
                    hosts.add(socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6, words))
    return hosts


def test_the_rendezvous_store_listens_on_the_configured_host_only():
    from pdserve.kv_transfer.transports.p2p import P2PReceiver, P2PSender

    receiver, sender = P2PReceiver(RecordingSink(), "gloo", "127.0.0.1"), P2PSender("gloo", "127.0.0.1")
    try:
        channel = sender.open(receiver.address, "t1")
        assert listening_hosts(channel.group.store.port) == {"127.0.0.1"}
        channel.close()
    finally:
        sender.close()
        receiver.stop()


def test_a_control_message_past_its_bound_is_never_delivered(monkeypatch, secret):
    monkeypatch.setattr(control, "MAX_MESSAGE_BYTES", 1 << 20)
    handled: list[bytes] = []
    server = control.ControlServer("test", "127.0.0.1", lambda kind, parts: handled.append(kind), secret)
    sockets = []
    try:
        for kind, size in ((b"H", 2 << 20), (b"S", 100)):  # a huge message, then a small one on a new socket
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            secret.client(sock)
            sock.connect(server.address)
            sockets.append(sock)
            sock.send_multipart([kind, struct.pack("<Q", 0), bytes(size)])
        assert sockets[1].poll(10_000)  # the small one is answered
        assert handled == [b"S"]
    finally:
        for sock in sockets:
            sock.close()
        server.stop()
