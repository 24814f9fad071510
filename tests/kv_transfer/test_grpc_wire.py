"""The gRPC KV transport speaks plain gRPC over its own HTTP/2: its sending half pushes into a
grpcio server with grpcio's default limits and its receiving half takes pushes from a grpcio client
(grpcio's flow control, frame sizes, status trailers and GOAWAY on the other side), with and without
mutual TLS; one stream carries more than its flow-control window, streams share a connection, a
call cancelled before its headers went out leaves the connection's HPACK state sound, and a receiver
gone, a stalled link, a connection broken mid-stream or a peer that says nothing each end with a
clear error, the next transfer connecting anew."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers import wait_until
from kv_helpers import RecordingSink, frame

from pdserve.kv_transfer.interface import FrameHeader, TransferError
from pdserve.kv_transfer.transports import grpc_stream, http2, make_sender, start_receiver
from pdserve.proto.pdserve.v1 import kv_transfer_pb2
from pdserve.wire import ClusterSecret

PUSH = "/pdserve.v1.KVTransfer/PushKV"
SIZES = [100, 3 << 19, (9 << 20) + 7]  # one message; one message of 1.5 MiB; three pieces of up to 4 MiB


class GrpcioReceiver:
    """A grpcio server implementing PushKV from the .proto alone, with grpcio's default limits (4 MiB
    messages): frames put together by offset."""

    def __init__(self, tls: dict[str, str] | None = None, abort: tuple[grpc.StatusCode, str] | None = None,
                 options: list[tuple[str, int]] | None = None) -> None:
        self.frames: dict[tuple[str, int, int], bytearray] = {}
        self.metadata: dict[str, str] = {}
        self._abort = abort
        self.server = grpc.server(futures.ThreadPoolExecutor(4), options=options or [])
        handler = grpc.stream_unary_rpc_method_handler(self._push, kv_transfer_pb2.KVFrame.FromString,
                                                       kv_transfer_pb2.KVAck.SerializeToString)
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("pdserve.v1.KVTransfer",
                                                                                   {"PushKV": handler})])
        if tls:
            credentials = grpc.ssl_server_credentials(
                [(Path(tls["key"]).read_bytes(), Path(tls["cert"]).read_bytes())],
                root_certificates=Path(tls["ca"]).read_bytes(), require_client_auth=True)
            port = self.server.add_secure_port("127.0.0.1:0", credentials)
        else:
            port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def _push(self, messages, context) -> kv_transfer_pb2.KVAck:
        self.metadata = dict(context.invocation_metadata())
        count = 0
        for message in messages:
            if self._abort is not None:
                context.abort(*self._abort)
            key = (message.transfer_id, message.layer, message.start_token)
            data = self.frames.setdefault(key, bytearray(message.payload_bytes))
            data[message.offset : message.offset + len(message.payload)] = message.payload
            count += message.offset + len(message.payload) == message.payload_bytes
        return kv_transfer_pb2.KVAck(frames=count)

    def stop(self) -> None:
        self.server.stop(None)


def deliver_one(sender, address: str, transfer_id: str, seed: int = 0) -> tuple[FrameHeader, bytes]:
    """One transfer of one small frame, finished: what the receiver must have got."""
    header, data = frame(0, 1000, seed=seed, transfer_id=transfer_id)
    channel = sender.open(address, transfer_id)
    channel.send(header, data)
    channel.finish(timeout=30)
    channel.close()
    return header, data.tobytes()


@pytest.fixture
def tls_files(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()

    def files(name: str) -> dict[str, str]:
        cert = ca.issue_cert("127.0.0.1", "localhost")
        paths = {"cert": tmp_path / f"{name}.crt", "key": tmp_path / f"{name}.key", "ca": tmp_path / "ca.crt"}
        cert.cert_chain_pems[0].write_to_path(paths["cert"])
        cert.private_key_pem.write_to_path(paths["key"])
        ca.cert_pem.write_to_path(paths["ca"])
        return {k: str(v) for k, v in paths.items()}

    return files


@pytest.mark.parametrize("security", ["plaintext", "mutual TLS"])
def test_the_sending_half_pushes_into_a_grpcio_server(security, tls_files):
    """grpcio's windows start at 64 KiB and its frames at 16 KiB: the sender keeps to both, and a
    frame cut into pieces arrives whole."""
    server = GrpcioReceiver(tls_files("server") if security == "mutual TLS" else None)
    sender = grpc_stream.GrpcSender(tls_files("client") if security == "mutual TLS" else None)
    frames = [frame(layer, size, seed=layer) for layer, size in enumerate(SIZES)]
    try:
        channel = sender.open(server.address, "t1")
        for header, data in frames:
            channel.send(header, data)
        channel.finish(timeout=30)
        channel.close()
        assert {key: bytes(data) for key, data in server.frames.items()} == \
            {(h.transfer_id, h.layer, h.start_token): data.tobytes() for h, data in frames}
    finally:
        sender.close()
        server.stop()


def test_a_grpcio_server_s_status_and_metadata_travel_as_grpc_says():
    """The token reaches the server as call metadata; an error status and its percent-encoded
    message come back to the sender decoded."""
    secret = ClusterSecret.generate()
    server = GrpcioReceiver(abort=(grpc.StatusCode.PERMISSION_DENIED, "nö: 100% refused"))
    sender = grpc_stream.GrpcSender(secret=secret)
    try:
        channel = sender.open(server.address, "t1")
        with pytest.raises(TransferError, match="PERMISSION_DENIED: nö: 100% refused"):
            channel.send(*frame(0, 1000, seed=0))
            channel.finish(timeout=30)
        channel.close()
        assert server.metadata[grpc_stream.CLUSTER_METADATA] == secret.token
    finally:
        sender.close()
        server.stop()


def test_a_grpcio_client_pushes_into_the_receiving_half():
    """Messages as protobuf writes them (the payload last, read straight into its frame), and with the
    payload field first (read whole, then parsed), a frame in pieces of either kind."""
    sink = RecordingSink()
    receiver = start_receiver("grpc", sink)
    channel = grpc.insecure_channel(receiver.address)
    push = channel.stream_unary(PUSH, request_serializer=None, response_deserializer=kv_transfer_pb2.KVAck.FromString)
    frames = [frame(layer, size, seed=layer) for layer, size in enumerate([100, 5 << 20, 7 << 20])]

    def message(h: FrameHeader, data: np.ndarray, at: int, payload_first: bool) -> bytes:
        fields = kv_transfer_pb2.KVFrame(transfer_id=h.transfer_id, layer=h.layer, start_token=h.start_token,
                                         num_tokens=h.num_tokens, codec=h.codec, level=h.level, crc32=h.crc32,
                                         payload_bytes=h.payload_bytes, offset=at)
        payload = kv_transfer_pb2.KVFrame(payload=data[at : at + (3 << 20)].tobytes()).SerializeToString()
        return payload + fields.SerializeToString() if payload_first else fields.SerializeToString() + payload

    try:
        messages = [message(h, data, at, payload_first=(h.layer + at // (3 << 20)) % 2 == 1)
                    for h, data in frames for at in range(0, data.nbytes, 3 << 20)]
        ack = push(iter(messages), timeout=30)
        assert (ack.frames, ack.corrupt_frames, ack.error) == (3, 0, "")
        assert sink.frames == [(h, data.tobytes()) for h, data in frames]
        with pytest.raises(grpc.RpcError) as e:  # a method the receiver does not have
            channel.stream_unary("/pdserve.v1.KVTransfer/PullKV")(iter([b""]), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "PushKV" in e.value.details()
    finally:
        channel.close()
        receiver.stop()


def test_one_stream_carries_more_than_its_flow_control_window_and_streams_share_a_connection():
    """160 MiB on one stream (2.5 windows: the receiver grants more as it reads), while two more
    transfers go on the same connection from other threads: every frame arrives whole, in order per
    transfer."""
    sink = RecordingSink()
    received = {}

    def counting_sink(header: FrameHeader, payload: memoryview) -> None:
        if header.transfer_id == "long":  # not kept: only counted and checked
            assert np.frombuffer(payload, np.uint8)[:: 1 << 16].tolist() == big[:: 1 << 16].tolist()
            received[header.layer] = payload.nbytes
        else:
            sink(header, payload)

    receiver = start_receiver("grpc", counting_sink)
    sender = make_sender("grpc")
    big = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    errors: list[BaseException] = []

    def transfer(transfer_id: str, frames: list[tuple[FrameHeader, np.ndarray]]) -> None:
        try:
            channel = sender.open(receiver.address, transfer_id)
            for header, data in frames:
                channel.send(header, data)
            channel.finish(timeout=60)
            channel.close()
        except BaseException as e:  # noqa: BLE001 (the test asserts there were none)
            errors.append(e)

    def short(transfer_id: str) -> list[tuple[FrameHeader, np.ndarray]]:
        return [frame(layer, 300_000, seed=layer, transfer_id=transfer_id) for layer in range(30)]

    try:
        long_frames = [(FrameHeader("long", layer, 0, 1, "raw", 0, 0, big.nbytes), big) for layer in range(40)]
        threads = [threading.Thread(target=transfer, args=args)
                   for args in [("long", long_frames), ("a", short("a")), ("b", short("b"))]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert received == {layer: big.nbytes for layer in range(40)}
        for transfer_id in "ab":
            assert [(h, data) for h, data in sink.frames if h.transfer_id == transfer_id] == \
                [(h, data.tobytes()) for h, data in short(transfer_id)]
        assert len(sender._links) == 1  # one connection carried all three
    finally:
        sender.close()
        receiver.stop()


def test_a_receiver_gone_fails_the_transfer_at_once_saying_so():
    receiver = start_receiver("grpc", RecordingSink())
    address = receiver.address
    receiver.stop()
    sender = make_sender("grpc")
    try:
        started = time.monotonic()
        channel = sender.open(address, "t1")
        with pytest.raises(TransferError, match="UNAVAILABLE: .*cannot connect"):
            channel.send(*frame(0, 1000, seed=0))
            channel.finish(timeout=30)
        assert time.monotonic() - started < 10
        channel.close()
    finally:
        sender.close()


def test_a_connection_broken_mid_stream_fails_its_calls_and_the_next_transfer_connects_anew():
    sink = RecordingSink()
    receiver = start_receiver("grpc", sink)
    sender = make_sender("grpc")
    try:
        channel = sender.open(receiver.address, "t1")
        channel.send(*frame(0, 1000, seed=0))
        assert wait_until(lambda: len(sink.frames) == 1, 10)
        for accepted in list(receiver._connections):  # the receiving side's end of the connection goes
            accepted.connection.close("closed by the test")
        with pytest.raises(TransferError, match="UNAVAILABLE"):
            for layer in range(1, 100):  # a send finds the stream gone, or else the finish does
                channel.send(*frame(layer, 1000, seed=layer))
                time.sleep(0.01)
            channel.finish(timeout=10)
        channel.close()
        delivered = deliver_one(sender, receiver.address, "t2", seed=1)
        assert sink.frames[-1] == delivered
    finally:
        sender.close()
        receiver.stop()


def test_a_stalled_link_fails_the_send_within_the_timeout_and_the_next_transfer_connects_anew(monkeypatch):
    """A receiver that takes nothing: once the socket's buffers are full nothing is written, and the
    send waiting for room gives up after SEND_TIMEOUT_S, closing the stuck connection."""
    monkeypatch.setattr(grpc_stream, "SEND_TIMEOUT_S", 1.0)
    monkeypatch.setattr(grpc_stream, "WINDOW_BYTES", 1 << 20)
    release = threading.Event()
    sink = RecordingSink()

    def held(header: FrameHeader, payload: memoryview) -> None:
        release.wait(30)
        sink(header, payload)

    receiver = start_receiver("grpc", held)
    sender = make_sender("grpc")
    try:
        channel = sender.open(receiver.address, "t1")
        with pytest.raises(TransferError, match="took nothing for 1 s"):
            for layer in range(200):  # 200 MiB: far more than loopback's socket buffers hold
                channel.send(*frame(layer % 4, 1 << 20, seed=layer % 4))
        channel.close()
        release.set()
        delivered = deliver_one(sender, receiver.address, "t2")
        assert delivered in sink.frames  # beside what the old connection brought
    finally:
        release.set()
        sender.close()
        receiver.stop()


def test_the_connection_refuses_a_peer_that_breaks_http2_and_keeps_serving_others():
    """Bytes that are not HTTP/2 end their own connection (GOAWAY), not the receiving half."""
    sink = RecordingSink()
    receiver = start_receiver("grpc", sink)
    host, port = receiver.address.rsplit(":", 1)
    try:
        for garbage in [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                        http2.PREFACE + http2.frame(http2.FrameType.DATA, 0, 2, b"x" * 10),  # DATA on an idle stream
                        http2.PREFACE + http2.frame(http2.FrameType.PING, 0, 0, b"x" * 7),  # a PING of 7 bytes
                        http2.PREFACE + http2.frame(http2.FrameType.HEADERS, http2.END_HEADERS, 1, b"\xff" * 9)]:
            with socket.create_connection((host, int(port)), timeout=10) as peer:
                peer.sendall(garbage)
                answer = b""
                while chunk := peer.recv(65536):
                    answer += chunk
            if garbage.startswith(http2.PREFACE):
                assert bytes([http2.FrameType.GOAWAY]) in answer  # told why before the close
        assert wait_until(lambda: not receiver._connections, 10)
        sender = make_sender("grpc")
        delivered = deliver_one(sender, receiver.address, "t1")
        sender.close()
        assert sink.frames == [delivered]
    finally:
        receiver.stop()


@pytest.mark.parametrize("peer", ["pdserve", "grpcio"])
def test_a_call_cancelled_before_its_headers_went_out_leaves_the_connection_sound(monkeypatch, peer):
    """Header blocks are HPACK-encoded as they go out: one dropped unsent (its call closed while the
    link still connects) takes nothing from the table the peer decodes with, and the stream the peer
    never saw is not reset on the wire."""
    real_connect = grpc_stream.pipes.connect

    def slow_connect(address, tls):
        time.sleep(0.3)
        return real_connect(address, tls)

    monkeypatch.setattr(grpc_stream.pipes, "connect", slow_connect)
    sink = RecordingSink()
    server = start_receiver("grpc", sink) if peer == "pdserve" else GrpcioReceiver()
    sender = make_sender("grpc")
    try:
        sender.open(server.address, "t0").close()
        for transfer_id in ("t1", "t2"):
            deliver_one(sender, server.address, transfer_id)
        received = [h.transfer_id for h, _ in sink.frames] if peer == "pdserve" else \
            [key[0] for key in server.frames]
        assert received == ["t1", "t2"]
    finally:
        sender.close()
        server.stop()


def test_after_a_grpcio_server_s_goaway_new_transfers_go_on_a_new_connection():
    """grpcio's max_connection_age sends GOAWAY: the call under way finishes on the old connection,
    new ones open a new connection instead of failing on the old."""
    server = GrpcioReceiver(options=[("grpc.max_connection_age_ms", 500), ("grpc.max_connection_age_grace_ms", 20_000)])
    sender = make_sender("grpc")
    try:
        long_call = sender.open(server.address, "long")
        long_call.send(*frame(0, 1000, seed=0, transfer_id="long"))
        time.sleep(1.5)  # the GOAWAY has come
        for transfer_id in ("t1", "t2"):
            deliver_one(sender, server.address, transfer_id)
        long_call.finish(timeout=10)
        long_call.close()
        assert sorted(key[0] for key in server.frames) == ["long", "t1", "t2"]
    finally:
        sender.close()
        server.stop()


def test_a_connection_that_makes_no_call_gives_its_place_up(monkeypatch):
    """A peer that connects and says nothing (or only things this receiver does not take) is
    closed CALL_DEADLINE_S later: strangers cannot hold the receiver's connections."""
    monkeypatch.setattr(grpc_stream, "CALL_DEADLINE_S", 1.0)
    receiver = start_receiver("grpc", RecordingSink())
    host, port = receiver.address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as silent, \
                socket.create_connection((host, int(port)), timeout=10) as preface_only:
            preface_only.sendall(http2.PREFACE + http2.frame(http2.FrameType.SETTINGS, 0, 0))
            started = time.monotonic()
            for peer in (silent, preface_only):
                while peer.recv(65536):  # until the receiver closes it
                    pass
            assert time.monotonic() - started < 5
        assert wait_until(lambda: not receiver._connections, 5)
    finally:
        receiver.stop()


def test_a_short_finish_timing_out_leaves_the_connection_to_the_other_transfers():
    """A drain's short finish on one transfer says nothing about the link: a receiver busy in its sink
    sends nothing for a while. The other transfer on the connection goes on."""
    def slow_sink(header: FrameHeader, payload: memoryview) -> None:
        if header.transfer_id == "A":
            time.sleep(1.0)

    receiver = start_receiver("grpc", slow_sink)
    sender = make_sender("grpc")
    try:
        a, b = sender.open(receiver.address, "A"), sender.open(receiver.address, "B")
        a.send(*frame(0, 1000, seed=0, transfer_id="A"))
        time.sleep(0.1)
        b.send(*frame(0, 1000, seed=1, transfer_id="B"))
        with pytest.raises(TransferError, match="did not finish"):
            b.finish(0.5)
        a.finish(10)  # the link was left alone
        a.close()
        b.close()
    finally:
        sender.close()
        receiver.stop()


def test_a_frame_whose_pieces_leave_a_gap_ends_the_call_as_malformed():
    """Each piece must start where the last ended: a gap would hand the sink whatever the reused buffer held."""
    sink = RecordingSink()
    receiver = start_receiver("grpc", sink)
    channel = grpc.insecure_channel(receiver.address)
    push = channel.stream_unary(PUSH, request_serializer=kv_transfer_pb2.KVFrame.SerializeToString,
                                response_deserializer=kv_transfer_pb2.KVAck.FromString)
    header, data = frame(0, 12, seed=0)
    fields = dict(transfer_id=header.transfer_id, layer=header.layer, start_token=header.start_token,
                  num_tokens=header.num_tokens, codec=header.codec, crc32=header.crc32, payload_bytes=12)
    try:
        ack = push(iter([kv_transfer_pb2.KVFrame(**fields, offset=0, payload=data[:4].tobytes()),
                         kv_transfer_pb2.KVFrame(**fields, offset=8, payload=data[8:].tobytes())]), timeout=30)
        assert "out of order" in ack.error and ack.frames == 0 and sink.frames == []
        assert receiver.service.malformed == 1
    finally:
        channel.close()
        receiver.stop()
