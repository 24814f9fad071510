"""Only a cluster's own members get through its internal channels, over real sockets on loopback:

  - pyzmq (token stream, KV events, the shm/gloo KV control channel): CURVE with the cluster's key.
    A rogue peer, without CURVE or with a key of its own, sends well-formed messages; none is
    delivered (the hubs' parsers never see them), and members on the same sockets are served.
  - KV over tcp: both sides prove they hold the cluster's key (an HMAC of fresh nonces) before a
    frame is read; over gRPC, each call carries a proof made for it (UNAUTHENTICATED without one). The
    key itself never crosses the wire. Mutual TLS with certificates made here by trustme (no client
    certificate, or one of another CA: refused).
  - No socket-facing code deserializes with pickle or anything else that can run code.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import struct
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers import wait_until
import zmq

from pdserve.kv_events import KVEvent, KVEventBatch, KVEventPublisher
from pdserve.kv_transfer.interface import FrameHeader, TransferError
from pdserve.kv_transfer.transports import TRANSPORT_NAMES, make_sender, start_receiver
from pdserve.kv_transfer.transports import control
from pdserve.kv_transfer.transports.control import ControlClient, ControlServer
from pdserve.kv_transfer.transports.grpc_stream import PROOF_METADATA, TRANSFER_METADATA, _proof
from pdserve.proto.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.router.kv_event_hub import KVEventHub
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.token_hub import TokenStreamHub
from pdserve.proto.pdserve.v1.internal_pb2 import TokenBatch
from pdserve.wire import ClusterSecret, TokenMessage, TokenSink, rejected_peers

REPO = Path(__file__).resolve().parent.parent


def rogue(kind: int, address: str, server_key: bytes | None) -> zmq.Socket:
    """A stranger's socket: plaintext (server_key None), or CURVE with the server's public key (which
    is no secret) but a keypair of its own."""
    socket = zmq.Context.instance().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, 1000)  # a send with no pipe to queue on (its handshake failed) gives up
    if server_key is not None:
        public, secret = zmq.curve_keypair()
        socket.curve_publickey, socket.curve_secretkey, socket.curve_serverkey = public, secret, server_key
    socket.connect(address)
    return socket


def send_as_stranger(socket: zmq.Socket, *parts: bytes) -> None:
    """Send, or find that the socket has no peer to queue the message for: either way it delivers nothing."""
    try:
        socket.send_multipart(parts)
    except zmq.Again:
        pass


@pytest.fixture
def secret() -> ClusterSecret:
    return ClusterSecret.generate()


def test_the_secret_stays_out_of_reprs(secret):
    assert secret.secret_key.decode() not in repr(secret)
    assert repr(secret.key) not in repr(secret) and secret.key.hex() not in repr(secret)


# --- pyzmq: token stream ------------------------------------------------------------------------
def test_token_stream_takes_messages_only_from_members(secret, router_loop):
    hub = TokenStreamHub(router_loop.loop, "127.0.0.1", secret)
    rejected_before = rejected_peers()

    async def run() -> list[TokenMessage]:
        queue = hub.subscribe("r1")
        forged = TokenBatch(messages=[TokenMessage(request_id="r1", token_ids=[666], finish_reason="stop")])
        forged = forged.SerializeToString()
        strangers = [rogue(zmq.PUSH, hub.address, None), rogue(zmq.PUSH, hub.address, secret.public_key),
                     rogue(zmq.PUSH, hub.address, ClusterSecret.generate().public_key)]
        for s in strangers:
            send_as_stranger(s, forged)
        await asyncio.sleep(1.0)  # time enough for any of them to arrive
        member = TokenSink(hub.address, secret)
        member.send("r1", [1, 2, 3], finish_reason="length")
        got = [await asyncio.wait_for(queue.get(), 5)]
        await asyncio.sleep(0.2)
        while not queue.empty():
            got.append(queue.get_nowait())
        member.close()
        for s in strangers:
            s.close()
        return got

    try:
        got = router_loop.run(run())
    finally:
        hub.close()
    assert [list(m.token_ids) for m in got] == [[1, 2, 3]]  # the forged messages never came through
    assert hub.malformed == 0  # ... and never reached the parser
    assert rejected_peers() > rejected_before  # the CURVE stranger was refused by the ZAP handler


def test_a_hub_with_the_secret_refuses_a_member_of_another_cluster(secret, router_loop):
    hub = TokenStreamHub(router_loop.loop, "127.0.0.1", secret)

    async def run() -> list[list[int]]:
        queue = hub.subscribe("r1")
        other = TokenSink(hub.address, ClusterSecret.generate())
        other.send("r1", [7], first_index=0)
        await asyncio.sleep(1.0)  # time enough for it to arrive, had it been let in
        other.close()
        member = TokenSink(hub.address, secret)  # and the hub does take its own members' messages
        member.send("r1", [8], first_index=0)
        got = [list((await asyncio.wait_for(queue.get(), 5)).token_ids)]
        member.close()
        return got + [list(queue.get_nowait().token_ids) for _ in range(queue.qsize())]

    try:
        assert router_loop.run(run()) == [[8]]
    finally:
        hub.close()


# --- pyzmq: KV events -------------------------------------------------------------------------------
def test_kv_events_are_taken_only_from_members(secret, router_loop):
    hub = KVEventHub(PrefixIndex(), lambda worker: None, router_loop.loop, "127.0.0.1", secret=secret)
    forged = KVEventBatch(worker_id="intruder", epoch="e", first_seq=1,
                          events=[KVEvent(block_hash=b"h1")]).SerializeToString()
    strangers = [rogue(zmq.PUSH, hub.address, None), rogue(zmq.PUSH, hub.address, secret.public_key)]
    publisher = None
    try:
        for s in strangers:
            send_as_stranger(s, forged)
        time.sleep(1.0)
        assert hub.stats()["applied"] == 0 and hub.malformed == 0 and hub.last_seq("intruder") is None
        publisher = KVEventPublisher(hub.address, "decode-0", heartbeat_s=0.05, secret=secret)
        publisher.stored(b"block-1", None)
        assert wait_until(lambda: hub.last_seq("decode-0") == 1)
        assert hub.index.workers() == ["decode-0"]
    finally:
        if publisher is not None:
            publisher.close()
        for s in strangers:
            s.close()
        hub.close()


# --- pyzmq: the KV control channel (shm and gloo) --------------------------------------------------
def test_control_channel_answers_only_members(secret):
    handled: list[bytes] = []
    server = ControlServer("test", "127.0.0.1", lambda kind, parts: handled.append(kind), secret)
    strangers = [rogue(zmq.DEALER, server.address, None), rogue(zmq.DEALER, server.address, secret.public_key)]
    member = None
    try:
        for s in strangers:
            send_as_stranger(s, b"R", struct.pack("<Q", 0), b"pdserve-kv-" + b"0" * 32)
        assert not any(s.poll(1000) for s in strangers)  # no answer: the message was never taken
        assert handled == []
        member = ControlClient(server.address, secret=secret)
        member.send(b"R", [b"x"])
        member.wait(lambda: not member.unanswered, 5)
        assert handled == [b"R"]
    finally:
        if member is not None:
            member.close()
        for s in strangers:
            s.close()
        server.stop()


class RecordingSink:
    def __init__(self) -> None:
        self.frames: list[tuple[FrameHeader, bytes]] = []
        self.lock = threading.Lock()

    def admit_frame(self, header: FrameHeader) -> None:
        pass

    def receive_frame(self, header: FrameHeader, payload: memoryview) -> None:
        with self.lock:
            self.frames.append((header, bytes(payload)))


def frame(nbytes: int = 4096) -> tuple[FrameHeader, np.ndarray]:
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    return FrameHeader("t1", 0, 0, 16, "raw", 0, zlib.crc32(data), nbytes), data


# NCCL's control channel is gloo's (one torch.distributed transport); its data needs two GPUs.
@pytest.mark.parametrize("name", [name for name in TRANSPORT_NAMES if name != "nccl"])
def test_every_transport_carries_frames_between_members(name, secret):
    sink = RecordingSink()
    receiver = start_receiver(name, sink, "127.0.0.1", secret=secret)
    sender = make_sender(name, "127.0.0.1", secret=secret)
    try:
        header, data = frame()
        channel = sender.open(receiver.address, "t1")
        channel.send(header, data)
        channel.finish(timeout=30)
        channel.close()
        assert sink.frames == [(header, data.tobytes())]
    finally:
        sender.close()
        receiver.stop()


@pytest.mark.parametrize("name", ["shm", "tcp", "grpc"])  # gloo's control channel is the shm one (tested above)
@pytest.mark.parametrize("stranger", ["no secret", "another cluster's"])
def test_a_transport_takes_no_frame_from_a_stranger(name, stranger, secret, monkeypatch):
    # Without the secret, the shm sender's control socket never completes CURVE's handshake: its first
    # message waits for room until the send timeout (30 s), shortened here.
    monkeypatch.setattr(control, "SEND_TIMEOUT_S", 2.0)
    sink = RecordingSink()
    receiver = start_receiver(name, sink, "127.0.0.1", secret=secret)
    sender = make_sender(name, "127.0.0.1", secret=None if stranger == "no secret" else ClusterSecret.generate())
    try:
        header, data = frame()
        with pytest.raises(TransferError) as e:  # tcp: at the open (its handshake); else a send or the finish
            channel = sender.open(receiver.address, "t1")
            try:
                channel.send(header, data)
                channel.finish(timeout=2)
            finally:
                channel.close()
        assert sink.frames == []
        if name == "grpc":  # the receiver says why
            assert "UNAUTHENTICATED" in str(e.value) and "proof" in str(e.value)
            assert receiver.service.refusals.refused == 1
        if name == "tcp":
            assert "did not prove" in str(e.value) or "closed the connection" in str(e.value)
            assert wait_until(lambda: receiver.refusals.refused == 1)
    finally:
        sender.close()
        receiver.stop()


# --- gRPC KV: mutual TLS ------------------------------------------------------------------------------
@pytest.fixture
def kv_tls(tmp_path) -> Callable[[str], dict[str, str]]:
    trustme = pytest.importorskip("trustme")
    cas: dict[str, object] = {}

    def files(name: str, ca_name: str = "cluster") -> dict[str, str]:
        ca = cas.setdefault(ca_name, trustme.CA())
        cert = ca.issue_cert("127.0.0.1", "localhost")
        paths = {"cert": tmp_path / f"{name}.crt", "key": tmp_path / f"{name}.key", "ca": tmp_path / f"{ca_name}-ca.crt"}
        cert.cert_chain_pems[0].write_to_path(paths["cert"])
        cert.private_key_pem.write_to_path(paths["key"])
        ca.cert_pem.write_to_path(paths["ca"])
        return {k: str(v) for k, v in paths.items()}

    return files


@pytest.mark.parametrize("name", ["tcp", "grpc"])
def test_kv_with_mutual_tls_and_the_secret(kv_tls, secret, name):
    """The receiver needs both: a certificate of the cluster's CA and a proof of the cluster's key."""
    receiving, member = kv_tls("decode"), kv_tls("prefill")
    stranger = kv_tls("stranger", ca_name="other")
    sink = RecordingSink()
    receiver = start_receiver(name, sink, "127.0.0.1", tls=receiving, secret=secret)
    header, data = frame()
    cases = {"member": (member, secret), "wrong secret": (member, ClusterSecret.generate()),
             "no secret": (member, None), "other CA": (stranger, secret)}
    try:
        for case, (tls, case_secret) in cases.items():
            sender = make_sender(name, tls=tls, secret=case_secret)
            expected = ("UNAUTHENTICATED" if "secret" in case else "UNAVAILABLE") if name == "grpc" else None
            try:  # refused at the open (tcp's handshake), a send, or the finish
                with contextlib.nullcontext() if case == "member" else pytest.raises(TransferError, match=expected):
                    channel = sender.open(receiver.address, "t1")
                    try:
                        channel.send(header, data)
                        channel.finish(timeout=10)
                    finally:
                        channel.close()
            finally:
                sender.close()
        assert sink.frames == [(header, data.tobytes())]  # the member's frame, no other
        refusals = receiver.service.refusals if name == "grpc" else receiver.refusals
        assert wait_until(lambda: refusals.refused == (2 if name == "grpc" else 3))  # tcp counts failed handshakes
    finally:
        receiver.stop()


def test_grpc_kv_mutual_tls_requires_a_client_certificate(kv_tls, secret):
    """A client that trusts the server but presents no certificate of its own is refused at the handshake,
    even with a valid proof of the cluster's key."""
    receiving = kv_tls("decode")
    sink = RecordingSink()
    receiver = start_receiver("grpc", sink, "127.0.0.1", tls=receiving, secret=secret)
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(receiving["ca"]).read_bytes())
    channel = grpc.secure_channel(receiver.address, credentials)
    try:
        push = kv_transfer_pb2_grpc.KVTransferStub(channel).PushKV
        with pytest.raises(grpc.RpcError) as e:
            push(iter([kv_transfer_pb2.KVFrame()]), timeout=10,
                 metadata=((TRANSFER_METADATA, "t1"), (PROOF_METADATA, _proof(secret.key, "t1"))))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert sink.frames == [] and receiver.service.refusals.refused == 0  # refused before any call was made
    finally:
        channel.close()
        receiver.stop()


# --- no code-executing deserialization --------------------------------------------------------------
# Everything the project's packages run (router, workers, transports, SDK, cluster); whatever crosses a
# socket is parsed by protobuf, JSON (pydantic) or fixed struct layouts. Ray's own actor calls are
# pickled by Ray: docs/security.md says what that means.
PACKAGES = ("sdk", "router", "kv_transfer", "prefill_worker", "decode_worker", "cluster", "engine")
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib", "jsonpickle"}
UNSAFE_CALLS = {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load"),
                ("yaml", "load_all"), ("pickle", "loads"), ("pickle", "load"), ("pandas", "read_pickle"),
                ("pd", "read_pickle")}


def unsafe_deserialization(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [f"{node.module or ''}.{a.name}" for a in node.names])
            found += [f"import {n}" for n in names if UNSAFE_MODULES & set(n.split("."))]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in {"eval", "exec", "__import__"}:
                found.append(f"{func.id}()")
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                if (func.value.id, func.attr) in UNSAFE_CALLS:
                    found.append(f"{func.value.id}.{func.attr}()")
                if func.attr == "load" and func.value.id in {"np", "numpy"} and any(
                        k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                        for k in node.keywords):
                    found.append(f"{func.value.id}.load(allow_pickle=...)")
    return found


def test_the_check_finds_what_it_looks_for():
    bad = ("import pickle\nfrom ray import cloudpickle\nimport torch, yaml, numpy as np\ntorch.load('x')\n"
           "yaml.load(s)\nnp.load(f, allow_pickle=True)\neval('1')\n")
    assert sorted(unsafe_deserialization(bad)) == sorted([
        "import pickle", "import ray.cloudpickle", "torch.load()", "yaml.load()", "np.load(allow_pickle=...)", "eval()"])
    assert unsafe_deserialization("model.eval()\nyaml.safe_load(s)\nnp.load(f)\nnp.load(f, allow_pickle=False)\n") == []


def test_no_code_executing_deserialization_in_the_project():
    problems = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            found = unsafe_deserialization(path.read_text())
            if found:
                problems[str(path.relative_to(REPO))] = found
    assert problems == {}, f"code-executing deserialization (never for data from a socket): {problems}"
