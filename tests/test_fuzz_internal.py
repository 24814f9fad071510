"""Property-based fuzzing (hypothesis) of every internal channel's message parser, through the real
receiving objects: the router's token stream (`TokenStreamHub`, a real PULL socket), its KV event
hub (`KVEventHub`), the KV frame header (`FrameHeader.unpack`), the gRPC KV stream (`GrpcReceiver`),
the tcp KV transport's handshake and stream (`TcpReceiver`), the pyzmq KV control channels (`ShmReceiver` and `P2PReceiver` on `ControlServer`), the decode
side's `receive_frame` (checksum, ranges, codec) on a real engine, and a prompt-pass worker's
`EmbeddingReceiver`. Generated messages mix valid
ones, random bytes, mutated valid ones, hand-made protobuf wire (wrong wire types, bad UTF-8, huge
varints, lengths past the end), huge values and odd unicode. Properties: nothing raises but the
parser's declared error, every bad message is dropped and counted by exactly one, every good one
after them is still delivered, and each receiver keeps serving. Each parser gets at least
MIN_PER_PARSER messages; `test_zz_totals` checks the counts (derandomized: CI runs the same examples
every time)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
import time
from collections import Counter

import grpc
import pytest
import zmq
from fuzz_strategies import F32, ODD_TEXT, U32, fuzz_settings, messages
from helpers import tcp_member, wait_until, write_then_read_to_end
from hypothesis import example, given
from hypothesis import strategies as st

from pdserve.kv_events import KVEvent, KVEventBatch, parse_kv_event_batch
from pdserve.kv_transfer.codecs import frame_checksum
from pdserve.kv_transfer.interface import CorruptFrame, FrameHeader, TransferError
from pdserve.proto.pdserve.v1 import kv_transfer_pb2
from pdserve.router.kv_event_hub import KVEventHub
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.token_hub import TokenStreamHub
from pdserve.proto.pdserve.v1.internal_pb2 import TokenBatch
from pdserve.wire import (ClusterSecret, LifetimeEvent, MalformedMessage, TokenMessage, is_handoff_notice,
                          parse_token_batch)

MIN_PER_PARSER = 2000
SENT: Counter[str] = Counter()  # generated messages per parser, checked by test_zz_totals


# --- token messages ---------------------------------------------------------------------------------
GOOD_ID = "fuzz-good-\u2603"  # the request the test subscribes to


def token_messages(request_id: st.SearchStrategy[str]) -> st.SearchStrategy[TokenMessage]:
    return st.builds(
        TokenMessage, request_id=request_id, token_ids=st.lists(U32, max_size=20), logprobs=st.lists(F32, max_size=20),
        finish_reason=ODD_TEXT, text=ODD_TEXT, error=ODD_TEXT, error_code=ODD_TEXT,
        events=st.dictionaries(ODD_TEXT, st.floats(), max_size=4), cached_tokens=U32,
        first_index=st.one_of(st.integers(0, 30), U32))


def token_batches(*parts: st.SearchStrategy[TokenMessage]) -> st.SearchStrategy[bytes]:
    """One engine step's batch: the parts' messages, shuffled."""
    return st.tuples(*parts).flatmap(st.permutations).map(lambda ms: TokenBatch(messages=ms).SerializeToString())


NAMED = token_messages(st.one_of(st.just(GOOD_ID), ODD_TEXT.filter(bool)))
TOKEN_GOOD = st.integers(1, 3).flatmap(lambda n: token_batches(*[NAMED] * n))
TOKEN_BAD = st.one_of(
    token_batches(NAMED, token_messages(st.just(""))),  # a message with no request id: the whole batch goes
    st.just(b"\x0a\x05ab"),  # a field longer than the message
    st.binary(max_size=8).map(lambda b: b"\x0a\x04\x0a\x02\xff\xfe" + b),  # a request id that is not UTF-8
)
TOKEN_MESSAGES = messages(TOKEN_GOOD, TOKEN_BAD, list(range(1, 10)))


def classify(parse, kind: str, data: bytes, error: type[Exception]) -> bool:
    """Whether `data` parses; only `error` may be raised, and the kind's verdict must hold."""
    try:
        parse(data)
        ok = True
    except error:
        ok = False
    assert kind == "any" or ok == (kind == "good"), (kind, data)
    return ok


@pytest.fixture(scope="module")
def secret() -> ClusterSecret:
    return ClusterSecret.generate()


def push_socket(address: str, secret: ClusterSecret) -> zmq.Socket:
    """An authenticated peer (a cluster member sending garbage: the parser is the last line)."""
    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    secret.client(socket)
    socket.connect(address)
    return socket


@pytest.fixture(scope="module")
def token_hub(secret, router_loop):
    hub = TokenStreamHub(router_loop.loop, "127.0.0.1", secret=secret)
    socket = push_socket(hub.address, secret)
    yield hub, socket
    socket.close()
    hub.close()


def _one_message_batch(**fields) -> tuple[str, bytes]:
    return "good", TokenBatch(messages=[TokenMessage(request_id=GOOD_ID, **fields)]).SerializeToString()


@fuzz_settings(300)
@given(batch=st.lists(TOKEN_MESSAGES, min_size=5, max_size=12))
# A handoff notice (no tokens) delivered at once, though it names a position the stream has not reached.
@example(batch=[_one_message_batch()] * 4 + [_one_message_batch(events={LifetimeEvent.HANDOFF_COMMITTED: 0.0},
                                                                  first_index=1)])
def test_token_stream_drops_and_counts_every_malformed_message(token_hub, router_loop, batch):
    hub, socket = token_hub
    good = [data for kind, data in batch if classify(parse_token_batch, kind, data, MalformedMessage)]
    bad = len(batch) - len(good)
    mine = [m for d in good for m in parse_token_batch(d) if m.request_id == GOOD_ID]
    sentinel = f"sentinel-{SENT['token_stream']}"

    async def exchange() -> list[bytes]:
        queue = hub.subscribe(GOOD_ID)
        done = hub.subscribe(sentinel)
        before = hub.malformed
        try:
            for _, data in batch:
                socket.send(data)
            socket.send(TokenBatch(messages=[TokenMessage(request_id=sentinel, token_ids=[1])]).SerializeToString())
            await asyncio.wait_for(done.get(), 10)  # one connection keeps order: everything before is handled
            assert hub.malformed - before == bad
            return [queue.get_nowait().SerializeToString(deterministic=True) for _ in range(queue.qsize())]
        finally:
            hub.unsubscribe(GOOD_ID)
            hub.unsubscribe(sentinel)

    # The request's good messages come through intact (as bytes: NaN != NaN in a message's fields), in
    # output order: every error and every notice of a committed handoff, whatever its position (they
    # act at once); the others as the longest chain from position 0 that they allow.
    delivered_bytes = router_loop.run(exchange())
    sent = mine

    def at_once(m: TokenMessage) -> bool:
        return bool(m.error) or is_handoff_notice(m)

    assert Counter(delivered_bytes) <= Counter(m.SerializeToString(deterministic=True) for m in sent)
    delivered = [TokenMessage.FromString(d) for d in delivered_bytes]
    assert sum(map(at_once, delivered)) == sum(map(at_once, sent))
    position = 0
    for m in (m for m in delivered if not at_once(m)):
        assert m.first_index == position, (m.first_index, position)
        position += len(m.token_ids)
    held = [m for m in sent if not at_once(m) and m.SerializeToString(deterministic=True) not in delivered_bytes]
    assert all(m.first_index != position for m in held), "a message that continues the chain was held"
    assert hub.error is None
    SENT["token_stream"] += len(batch)
    SENT["token_stream_bad"] += bad
    SENT["token_stream_delivered"] += len(mine)


# --- KV events ------------------------------------------------------------------------------------
HASH = st.binary(min_size=1, max_size=40)


@st.composite
def kv_batches(draw: st.DrawFn) -> KVEventBatch:
    events = []
    for _ in range(draw(st.integers(0, 6))):
        block = draw(HASH)
        parent = draw(st.one_of(st.just(b""), HASH.filter(lambda h: h != block)))
        events.append(KVEvent(block_hash=block, parent_hash=parent, removed=draw(st.booleans())))
    return KVEventBatch(worker_id=draw(ODD_TEXT.filter(lambda s: s and not s.startswith("sentinel"))),
                        epoch=draw(st.sampled_from(["e1", "e2"]) | ODD_TEXT.filter(bool)),
                        first_seq=draw(st.one_of(st.integers(1, 8), st.integers(1, 2**64 - 1))), events=events)


def _broken(batch: KVEventBatch, how: str) -> bytes:
    if how == "worker":
        batch.worker_id = ""
    elif how == "epoch":
        batch.epoch = ""
    elif how == "seq":
        batch.first_seq = 0
    elif how == "hash":
        batch.events.add(block_hash=b"", parent_hash=b"p")
    else:
        batch.events.add(block_hash=b"h", parent_hash=b"h")  # chained on itself
    return batch.SerializeToString()


KV_GOOD = kv_batches().map(KVEventBatch.SerializeToString)
KV_BAD = st.one_of(st.builds(_broken, kv_batches(), st.sampled_from(["worker", "epoch", "seq", "hash", "self"])),
                   st.just(b"\x22\x03\x0a"))  # an event cut short
KV_MESSAGES = messages(KV_GOOD, KV_BAD, [1, 2, 3, 4])


@pytest.fixture(scope="module")
def kv_hub(secret, router_loop):
    asked: list[str] = []
    hub = KVEventHub(PrefixIndex(), asked.append, router_loop.loop, "127.0.0.1", secret=secret)
    socket = push_socket(hub.address, secret)
    yield hub, socket
    socket.close()
    hub.close()


@fuzz_settings(300)
@given(batch=st.lists(KV_MESSAGES, min_size=5, max_size=12))
def test_kv_event_hub_drops_and_counts_every_malformed_batch(kv_hub, batch):
    hub, socket = kv_hub
    bad = sum(not classify(parse_kv_event_batch, kind, data, MalformedMessage) for kind, data in batch)
    before = hub.malformed
    for _, data in batch:
        socket.send(data)
    # The sentinel worker's events are numbered on: the hub applied everything before once it shows.
    seq = SENT["kv_sentinel"] = SENT["kv_sentinel"] + 1
    socket.send(KVEventBatch(worker_id="sentinel", epoch="s", first_seq=seq,
                             events=[KVEvent(block_hash=b"s%d" % seq)]).SerializeToString())
    deadline = time.monotonic() + 10
    while hub.last_seq("sentinel") != seq and time.monotonic() < deadline:
        time.sleep(0.001)
    assert hub.last_seq("sentinel") == seq
    assert hub.malformed - before == bad
    assert hub.error is None and not hub.is_resyncing("sentinel")
    SENT["kv_events"] += len(batch)
    SENT["kv_events_bad"] += bad


# --- KV frame headers -------------------------------------------------------------------------------
NAME = st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=40)
FIELDS = st.tuples(U32, U32, U32, U32, U32, st.integers(0, 2**64 - 1))
HEADERS = st.builds(lambda f, t, c: FrameHeader(t, f[0], f[1], f[2], c, f[3], f[4], f[5]), FIELDS, NAME, NAME)
HEADER_GOOD = HEADERS.map(FrameHeader.pack)
HEADER_BAD = st.one_of(st.binary(max_size=FrameHeader._FIXED.size - 1),  # shorter than the fixed part
                       HEADERS.map(lambda h: h.pack() + b"\0x"),  # a third name
                       HEADERS.map(lambda h: h.pack()[: FrameHeader._FIXED.size] + b"no separator"),
                       HEADERS.map(lambda h: h.pack() + b"\xff"))  # not UTF-8


@fuzz_settings(MIN_PER_PARSER)
@given(message=messages(HEADER_GOOD, HEADER_BAD, [1]), header=HEADERS)
def test_frame_header_unpack_raises_only_corrupt_frame(message, header):
    kind, data = message
    classify(FrameHeader.unpack, kind, data, CorruptFrame)
    classify(lambda b: FrameHeader.unpack(memoryview(b)), kind, data, CorruptFrame)  # as transports hand it
    assert FrameHeader.unpack(header.pack()) == header  # and whatever packs, unpacks as it was
    SENT["frame_header"] += 1


# --- the decode side's receive_frame, on a real engine ---------------------------------------------
@pytest.fixture(scope="module")
def receiving(tmp_path_factory):
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
    from pdserve.engine.engine_loop import EngineLoop
    from pdserve.engine.models.presets import make_model
    from pdserve.kv_transfer.receiver import KVReceiver

    model = make_model("tiny-llama", tmp_path_factory.mktemp("fuzz-model") / "tiny-llama", seed=0)
    engine = LLMEngine(model, EngineConfig(kv_memory_bytes=4 * 2**20))
    loop = EngineLoop(engine, lambda outputs: None).start()
    receiver = KVReceiver(loop, lease_s=600)
    opened: list[str] = []

    def open_transfer() -> str:
        """The open transfer of 40 tokens' KV, reserved anew once a bad frame ended the last one (with
        a prompt of its own: no block of it is cached, so every frame from token 0 on belongs to it)."""
        if receiver.num_in_flight == 0:
            n = len(opened)
            prompt = [3 + n % 1000] + list(range(3 + n % 7, 42 + n % 7))
            receiver.reserve(f"fz-{n}", f"fz-request-{n}", prompt, SamplingParams.greedy(max_tokens=1), 40)
            opened.append(f"fz-{n}")
        return opened[-1]

    yield receiver, open_transfer, engine
    receiver.abort_all("the fuzz test is over")
    deadline = time.monotonic() + 10
    while engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    assert engine.pool.num_free == engine.pool.num_blocks  # nothing a fuzzed frame touched leaked


@st.composite
def frames(draw: st.DrawFn, current: str, layers: int, token_bytes: int, intact: bool = False) -> tuple[FrameHeader, bytes]:
    """A raw frame of the 40-token transfer `current`, checksummed as a sender does, then valid or
    with any of its fields broken (the checksum among them); `intact`: valid."""
    start = draw(st.integers(0, 39))
    n = draw(st.integers(1, 40 - start))
    payload = draw(st.binary(min_size=n * token_bytes, max_size=n * token_bytes)) if draw(st.booleans()) \
        else bytes(n * token_bytes)
    sent = FrameHeader(current, draw(st.integers(0, layers - 1)), start, n, "raw", 0, 0, len(payload))
    fields = dataclasses.asdict(dataclasses.replace(sent, crc32=frame_checksum(sent, payload)))
    if intact:
        return FrameHeader(**fields), payload
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)):
        texts = {"transfer_id": ODD_TEXT, "codec": st.sampled_from(["int8", "cachegen", "?"]) | ODD_TEXT}
        fields[name] = draw(texts.get(name, U32))  # numbers over their whole range: level too, as gRPC carries it
    if draw(st.integers(0, 9)) == 0:
        payload = draw(st.binary(max_size=64)) if draw(st.booleans()) else payload[:-1] + b"x"
    return FrameHeader(**fields), payload


def _valid(header: FrameHeader, payload: bytes, current: str, layers: int, token_bytes: int) -> bool:
    return (header.transfer_id == current and header.payload_bytes == len(payload)
            and header.crc32 == frame_checksum(header, payload) and 0 <= header.layer < layers
            and header.codec == "raw" and header.level == 0 and header.num_tokens >= 1
            and header.start_token + header.num_tokens <= 40 and len(payload) == header.num_tokens * token_bytes)


def _layout(engine) -> tuple[int, int]:
    layout = engine.kv_layout
    return layout.num_layers, 2 * layout.num_kv_heads * layout.head_dim * 4  # raw float32, K and V


@fuzz_settings(MIN_PER_PARSER)
@given(data=st.data())
def test_receive_frame_takes_valid_frames_and_counts_every_other(receiving, data):
    receiver, open_transfer, engine = receiving
    layers, token_bytes = _layout(engine)
    current = open_transfer()
    header, payload = data.draw(frames(current, layers, token_bytes))
    before = Counter(receiver.counters)
    try:
        receiver.receive_frame(header, memoryview(payload))
        taken = True
    except (CorruptFrame, TransferError):  # CorruptFrame is a TransferError: both are declared
        taken = False
    counted = {k: receiver.counters[k] - before[k] for k in ("frames", "corrupt_frames", "refused_frames")}
    assert taken == _valid(header, payload, current, layers, token_bytes), (header, len(payload))
    assert counted == {"frames": int(taken), "corrupt_frames": 0, "refused_frames": 0} if taken \
        else sum(counted.values()) == 1 and counted["frames"] == 0, counted
    SENT["receive_frame"] += 1
    SENT["receive_frame_taken"] += taken


# --- a prompt-pass worker's receive_frame of image embeddings -------------------------------------
EMBEDDING_WIDTH = 24


@pytest.fixture(scope="module")
def receiving_embeddings():
    from pdserve.engine.multimodal.placement import EmbeddingSpec
    from pdserve.kv_transfer.embeddings import EMBEDDINGS_PREFIX, EmbeddingReceiver

    receiver = EmbeddingReceiver(EMBEDDING_WIDTH, max_rows=200, lease_s=600)
    specs = (EmbeddingSpec(b"a" * 16, 40, EMBEDDING_WIDTH, "float32"), EmbeddingSpec(b"b" * 16, 40, EMBEDDING_WIDTH, "float32"))
    opened: list[str] = []

    def open_transfer() -> str:
        """The open transfer of two images of 40 rows, reserved anew once the last one was taken."""
        if receiver.num_in_flight == 0:
            opened.append(f"{EMBEDDINGS_PREFIX}fz-{len(opened)}")
            receiver.reserve(opened[-1], "fz-request", specs)
        return opened[-1]

    yield receiver, open_transfer
    assert receiver.num_in_flight <= 1  # every transfer taken (or refused as incomplete) ended


@fuzz_settings(MIN_PER_PARSER)
@given(data=st.data())
def test_receive_embedding_frame_takes_valid_frames_and_counts_every_other(receiving_embeddings, data):
    receiver, open_transfer = receiving_embeddings
    current = open_transfer()
    header, payload = data.draw(frames(current, 2, EMBEDDING_WIDTH * 4))
    before = receiver.counts()
    try:
        receiver.admit_frame(header)
        receiver.receive_frame(header, memoryview(payload))
        taken = True
    except TransferError:  # CorruptFrame among them
        taken = False
    after = receiver.counts()
    counted = {k: after[f"embedding_{k}"] - before[f"embedding_{k}"] for k in ("frames", "corrupt_frames", "refused_frames")}
    assert taken == _valid(header, payload, current, 2, EMBEDDING_WIDTH * 4), (header, len(payload))
    assert counted["frames"] == int(taken) and sum(counted.values()) <= 1, counted
    if data.draw(st.integers(0, 19)) == 0:  # now and then, the transfer ends: taken whole, or refused as incomplete
        try:
            receiver.take(current)
        except TransferError:
            pass
    SENT["receive_embedding_frame"] += 1
    SENT["receive_embedding_frame_taken"] += taken


# --- the gRPC KV stream -----------------------------------------------------------------------------
def _kvframe(header: FrameHeader, payload: bytes, offset: int = 0, size: int | None = None) -> bytes:
    piece = payload[offset:] if size is None else payload[offset : offset + size]
    return kv_transfer_pb2.KVFrame(
        transfer_id=header.transfer_id, layer=header.layer, start_token=header.start_token,
        num_tokens=header.num_tokens, codec=header.codec, level=header.level, crc32=header.crc32,
        payload_bytes=header.payload_bytes, offset=offset, payload=piece).SerializeToString()


@st.composite
def kvframe_messages(draw: st.DrawFn, current: str, layers: int, token_bytes: int) -> list[bytes]:
    """One frame of the open transfer (whole, or in two pieces as large frames travel), valid or with
    fields broken; or any message, of another transfer or malformed."""
    header, payload = draw(frames(current, layers, token_bytes))
    if draw(st.booleans()) and len(payload) > 1:
        cut = draw(st.integers(1, len(payload) - 1))
        return [_kvframe(header, payload, 0, cut), _kvframe(header, payload, cut)]
    other = st.builds(_kvframe, HEADERS, st.binary(max_size=64))
    bad = st.one_of(st.just(b"\x0a\x05ab"), st.just(b"\x52\x0a" + b"x" * 9),  # fields cut short
                    st.builds(lambda n: kv_transfer_pb2.KVFrame(payload_bytes=n, offset=n + 1,
                                                                payload=b"x").SerializeToString(), U32))
    _, data = draw(messages(st.just(_kvframe(header, payload)), bad | other, list(range(1, 11))))
    return [data]


@pytest.fixture(scope="module")
def grpc_kv(receiving, secret):
    from pdserve.kv_transfer.transports.grpc_stream import PROOF_METADATA, TRANSFER_METADATA, GrpcReceiver, _proof

    receiver, _, _ = receiving
    server = GrpcReceiver(receiver, "127.0.0.1", secret=secret)
    channel = grpc.insecure_channel(server.address)
    push = channel.stream_unary("/pdserve.v1.KVTransfer/PushKV", request_serializer=None,
                                response_deserializer=kv_transfer_pb2.KVAck.FromString)

    def call(stream: list[bytes], transfer_id: str) -> kv_transfer_pb2.KVAck:
        """A member's call (its proof made for `transfer_id`) carrying these messages."""
        return push(iter(stream), timeout=30, metadata=((TRANSFER_METADATA, transfer_id),
                                                        (PROOF_METADATA, _proof(secret.key, transfer_id))))

    yield server, call
    channel.close()
    server.stop()


@fuzz_settings(300)
@given(data=st.data())
def test_grpc_kv_stream_ends_on_a_malformed_message_and_says_why(grpc_kv, receiving, data):
    server, push = grpc_kv
    receiver, open_transfer, engine = receiving
    current = open_transfer()
    if data.draw(st.integers(0, 3)) == 0:  # a call of intact frames: the good path, whatever else is drawn
        stream = [_kvframe(*frame) for frame in data.draw(st.lists(frames(current, *_layout(engine), intact=True),
                                                                   min_size=4, max_size=10))]
    else:
        items = data.draw(st.lists(kvframe_messages(current, *_layout(engine)), min_size=4, max_size=10))
        stream = [message for item in items for message in item]
    before, counters = server.service.malformed, Counter(receiver.counters)
    try:
        ack, failed = push(stream, current), None
    except grpc.RpcError as e:  # never INTERNAL or UNKNOWN: those would be a crash
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed KV stream" in e.details(), e
        ack, failed = None, e
    malformed = server.service.malformed - before
    assert malformed == (failed is not None), (malformed, failed)
    if ack is not None:  # what the call's answer counts, the receiver took
        assert (ack.frames, ack.corrupt_frames) == (receiver.counters["frames"] - counters["frames"],
                                                    receiver.counters["corrupt_frames"] - counters["corrupt_frames"])
        assert not ack.error or ack.error.startswith(("TransferError", "KVMemoryFull")), ack
        SENT["grpc_kv_frames_taken"] += ack.frames
    SENT["grpc_kv_stream"] += len(stream)


# --- the tcp KV transport ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tcp_kv(receiving, secret):
    from pdserve.kv_transfer.transports.tcp import TcpReceiver

    receiver, _, _ = receiving
    server = TcpReceiver(receiver, "127.0.0.1", secret=secret)
    yield server
    server.stop()
    assert server.failures == 0  # no connection ended on a fault of the receiver's own


def _tcp_frame(header: FrameHeader, payload: bytes) -> bytes:
    from pdserve.kv_transfer.transports import tcp

    packed = header.pack()
    return tcp.FRAME + len(packed).to_bytes(2, "little") + packed + payload


def _framable(header: FrameHeader) -> bool:
    """Whether the tcp wire can carry the header: its binary form gives it back (a NUL inside a name
    does not), within the wire's bound on a header."""
    from pdserve.kv_transfer.transports.tcp import MAX_HEADER_BYTES

    try:
        return len(header.pack()) <= MAX_HEADER_BYTES and FrameHeader.unpack(header.pack()) == header
    except CorruptFrame:
        return False


@st.composite
def tcp_messages(draw: st.DrawFn, current: str, layers: int, token_bytes: int) -> tuple[bool, list[bytes]]:
    """(whether every message is well framed, the messages): frames of the open transfer (valid or
    with fields broken: they reach the sink, which refuses or takes them), ENDs, and, unless
    `framed`, messages the wire cannot carry (unknown kinds, headers that do not parse or announce
    too much, a connection cut mid-frame)."""
    from pdserve.kv_transfer.transports import tcp

    framed = draw(st.integers(0, 2)) > 0
    out = []
    for _ in range(draw(st.integers(1, 12))):
        choice = draw(st.integers(0, 9))
        if choice < 6:
            header, payload = draw(frames(current, layers, token_bytes))
            if len(payload) != header.payload_bytes or not _framable(header):  # its header cannot say where it ends
                if framed:
                    continue
                out.append(_tcp_frame(header, payload))
            else:
                out.append(_tcp_frame(header, payload))
        elif choice < 8:
            out.append(tcp.END)
        elif not framed:
            header = draw(HEADERS)
            out.append(draw(st.sampled_from([
                b"X", tcp.FRAME + (tcp.MAX_HEADER_BYTES + 1).to_bytes(2, "little"),
                tcp.FRAME + b"\x05\x00hello", _tcp_frame(dataclasses.replace(header, payload_bytes=2**40), b""),
                _tcp_frame(header, b"")[:7]]) | st.binary(max_size=64)))
    return framed, out


def answered_dones(answers: bytes) -> int:
    """The DONE answers among a tcp receiver's answers: each REFUSED is "R", a length, then text, which
    may hold a "D" of its own (it names what a peer sent)."""
    from pdserve.kv_transfer.transports import tcp

    dones, at = 0, 0
    while at < len(answers):
        kind = answers[at:at + 1]
        if kind == tcp.REFUSED:
            at += 3 + int.from_bytes(answers[at + 1:at + 3], "little")
        else:
            assert kind == tcp.DONE, answers
            dones, at = dones + 1, at + 1
    return dones


@fuzz_settings(500)
@given(data=st.data())
def test_tcp_kv_stream_takes_what_is_framed_and_cuts_off_what_is_not(tcp_kv, receiving, secret, data):
    """A member writes any messages: every well-framed frame reaches the sink (which takes it or
    refuses it), every END is answered once its frames have; what the wire cannot carry cuts off the
    connection, never in a fault of the receiver's own, and the receiver goes on serving."""
    from pdserve.kv_transfer.transports import tcp

    receiver, open_transfer, engine = receiving
    framed, messages = data.draw(tcp_messages(open_transfer(), *_layout(engine)))
    before = sum(receiver.counters[k] for k in ("frames", "corrupt_frames", "refused_frames"))
    ends = sum(m == tcp.END for m in messages)
    with tcp_member(tcp_kv.address, secret.key) as sock:
        answers = write_then_read_to_end(sock, b"".join(messages) + tcp.END)
    dones = answered_dones(answers)
    if framed:
        assert dones == ends + 1, answers
    assert tcp_kv.failures == 0
    SENT["tcp_kv_stream"] += len(messages)
    SENT["tcp_kv_reached_the_sink"] += sum(receiver.counters[k] for k in
                                           ("frames", "corrupt_frames", "refused_frames")) - before


@st.composite
def handshakes(draw: st.DrawFn, key: bytes) -> bytes:
    """What a stranger writes after the receiver's greeting: anything, a proof under another key, a
    proof cut short, or (reading the greeting) a proof of the right form for the wrong nonce."""
    from pdserve.kv_transfer.transports import tcp

    nonce_s = draw(st.binary(min_size=32, max_size=32))
    return draw(st.one_of(
        st.binary(max_size=200),
        st.just(nonce_s + tcp._proof(ClusterSecret.generate().key, b"sender", bytes(32), nonce_s)),
        st.just(nonce_s + tcp._proof(key, b"sender", bytes(32), nonce_s)),  # right key, another nonce
        st.binary(max_size=63),
    ))


@fuzz_settings(300)
@given(data=st.data())
def test_tcp_kv_handshake_lets_no_stranger_in(tcp_kv, receiving, secret, data):
    """Whatever a peer without the cluster's key writes, the receiver closes the connection without a
    frame reaching the sink or a fault of its own, and frees the connection's place."""
    receiver, _, _ = receiving
    written = data.draw(handshakes(secret.key))
    before = sum(receiver.counters[k] for k in ("frames", "corrupt_frames", "refused_frames"))
    host, port = tcp_kv.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        write_then_read_to_end(sock, written + _tcp_frame(FrameHeader("t", 0, 0, 1, "raw", 0, 0, 4), b"abcd"))
    assert sum(receiver.counters[k] for k in ("frames", "corrupt_frames", "refused_frames")) == before
    assert wait_until(lambda: tcp_kv.budget.counts == (0, 0), 10)
    assert tcp_kv.failures == 0
    SENT["tcp_kv_handshake"] += 1


def test_tcp_and_grpc_receivers_still_serve_a_member_after_the_fuzzing(tcp_kv, grpc_kv, receiving, secret):
    from pdserve.kv_transfer.transports.tcp import TcpSender

    receiver, open_transfer, engine = receiving
    layers, token_bytes = _layout(engine)
    sent = FrameHeader(open_transfer(), layers - 1, 39, 1, "raw", 0, 0, token_bytes)
    valid = dataclasses.replace(sent, crc32=frame_checksum(sent, bytes(token_bytes)))
    _, push = grpc_kv
    ack = push([_kvframe(valid, bytes(token_bytes))], valid.transfer_id)
    assert (ack.frames, ack.error) == (1, ""), ack
    sender = TcpSender(secret=secret)
    try:
        frames_before = receiver.counters["frames"]
        channel = sender.open(tcp_kv.address, valid.transfer_id)
        channel.send(valid, bytes(token_bytes))
        channel.finish(10)
        channel.close()
        assert receiver.counters["frames"] == frames_before + 1
    finally:
        sender.close()


# --- the pyzmq KV control channels (shared memory and gloo transports) ------------------------------
SEQ = struct.Struct("<Q")
# Parts that look like what each kind carries: segment names (shm), group ids and store addresses
# (gloo; none names a reachable store, so no JOIN waits for one to answer).
LOOKALIKE_PARTS = [b"pdserve-kv-" + b"0" * 32, b"../../etc/passwd", b"pdserve-kv-\xff", b"0" * 32,
                   b"10.9.8.7:29500", b"127.0.0.1:0", b"127.0.0.1:99999", b"127.0.0.1:x", b"no-port", b"\xff:1"]


@st.composite
def control_messages(draw: st.DrawFn) -> list[bytes]:
    """[kind, seq, *parts]: well formed or not, for every kind of the shm and gloo receivers."""
    from pdserve.kv_transfer.transports import p2p, shm

    kinds = [shm.FRAME, shm.INLINE, shm.RELEASE, p2p.JOIN, p2p.LEAVE, b"", b"?", b"FF"]
    kind = draw(st.sampled_from(kinds) | st.binary(max_size=3))
    parts = [draw(HEADER_GOOD | st.binary(max_size=40)) for _ in range(draw(st.integers(0, 3)))]
    if draw(st.booleans()) and parts:
        parts[draw(st.integers(0, len(parts) - 1))] = draw(st.sampled_from(LOOKALIKE_PARTS))
    seq = SEQ.pack(draw(st.integers(0, 2**64 - 1))) if draw(st.integers(0, 7)) else draw(st.binary(max_size=9))
    return draw(st.sampled_from([[kind, seq, *parts], [kind], []]))


class HeaderSink:
    """A `FrameSink` that admits every frame and keeps its header."""

    def __init__(self, sunk: list[FrameHeader]) -> None:
        self.sunk = sunk

    def admit_frame(self, header: FrameHeader) -> None:
        pass

    def receive_frame(self, header: FrameHeader, payload: object) -> None:
        self.sunk.append(header)


@pytest.fixture(scope="module", params=["shm", "gloo"])
def kv_control(request, secret):
    from pdserve.kv_transfer.transports.p2p import P2PReceiver
    from pdserve.kv_transfer.transports.shm import ShmReceiver

    sunk: list[FrameHeader] = []
    receiver_class = {"shm": ShmReceiver, "gloo": P2PReceiver}[request.param]
    receiver = receiver_class(HeaderSink(sunk), host="127.0.0.1", secret=secret)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    secret.client(socket)
    socket.connect(receiver.address)
    yield request.param, receiver, socket
    socket.close()
    receiver.stop()


@fuzz_settings(300)
@given(batch=st.lists(control_messages(), min_size=5, max_size=12))
def test_kv_control_channel_answers_or_drops_and_counts_every_message(kv_control, batch):
    from pdserve.kv_transfer.transports.control import CORRUPT, FAILED, OK
    from pdserve.kv_transfer.transports.p2p import LEAVE
    from pdserve.kv_transfer.transports.shm import RELEASE

    name, receiver, socket = kv_control
    server = receiver._server
    dropped, refused = server.dropped, server.refused
    envelopes = [m for m in batch if len(m) >= 2 and len(m[1]) == SEQ.size]
    for message in batch:
        socket.send_multipart(message) if message else socket.send(b"")
    no_op = {"shm": [RELEASE, b"pdserve-kv-" + b"f" * 32], "gloo": [LEAVE, b"f" * 32]}[name]
    socket.send_multipart([no_op[0], SEQ.pack(2**64 - 1), *no_op[1:]])  # a release of nothing: answered OK
    answers, no_op_answers = [], []
    # Every envelope is answered once, the no-op too: in order per lane, in any order across lanes (gloo
    # answers a group's messages on the group's own lane, so the no-op's may come before another's).
    while not (no_op_answers and len(answers) == len(envelopes) + 1):
        assert socket.poll(10_000), "the control channel stopped answering"
        seq, status, text = socket.recv_multipart()
        answers.append(status[0])
        if seq == SEQ.pack(2**64 - 1):
            no_op_answers.append(status[0])
        # Refused as declared (CORRUPT for a CorruptFrame, FAILED naming a TransferError), never by an
        # accident of parsing (IndexError, ...).
        assert status[0] in (OK, CORRUPT) or text.split(b":")[0] in (b"CorruptFrame", b"TransferError"), text
    assert len(answers) == len(envelopes) + 1 and OK in no_op_answers and set(answers) <= {OK, CORRUPT, FAILED}
    assert server.dropped - dropped == len(batch) - len(envelopes)
    assert server.refused - refused == sum(a != OK for a in answers)
    assert server.failure is None
    SENT[f"kv_control_{name}"] += len(batch)


# --- the totals ---------------------------------------------------------------------------------------
def test_zz_totals():
    """Runs last in this file: every parser got its share of generated messages."""
    parsers = ["token_stream", "kv_events", "frame_header", "receive_frame", "receive_embedding_frame",
               "grpc_kv_stream", "tcp_kv_stream",
               "tcp_kv_handshake", "kv_control_shm", "kv_control_gloo"]
    counts = {name: SENT[name] for name in parsers}
    print(f"fuzzed internal messages: {counts}, total {sum(counts.values())}; {dict(SENT)}")
    least = {name: 300 if name == "tcp_kv_handshake" else MIN_PER_PARSER for name in parsers}  # a connection each
    assert all(counts[name] >= least[name] for name in parsers), counts
    # Not vacuous: many messages were bad, and many good ones got through (fewer over gRPC, where a
    # call ends at its first bad message and only a call answered counts its frames: a quarter of its
    # calls carry intact frames only, so that a draw of mostly broken streams cannot leave it untested).
    assert min(SENT["token_stream_bad"], SENT["token_stream_delivered"], SENT["kv_events_bad"],
               SENT["receive_frame_taken"], SENT["receive_embedding_frame_taken"],
               SENT["tcp_kv_reached_the_sink"]) >= 50, SENT
    assert SENT["grpc_kv_frames_taken"] >= 10, SENT
    assert sum(counts.values()) >= 10_000, counts
