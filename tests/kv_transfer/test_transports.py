"""Every transport's two halves on loopback, in one process: frames arrive whole and in order per
channel, large frames too; the sink's verdicts (corrupt, failed) reach the sending side as the
interface says; gRPC with mutual TLS accepts only a client of the same CA."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import zmq
from helpers import wait_until
from kv_helpers import FunctionSink, RecordingSink, frame

from pdserve.kv_transfer.interface import CorruptFrame, FrameHeader, TransferError
from pdserve.kv_transfer.transports import TRANSPORT_NAMES, control, make_sender, start_receiver
from pdserve.kv_transfer.transports.p2p import P2PReceiver, P2PSender


# The torch.distributed transport with payloads on a device: (backend, sender's device, receiver's).
# `gloo-tensors` runs NCCL's code path (tensor payloads, frames in lockstep) with gloo on the CPU;
# `nccl` needs two GPUs, since NCCL refuses two ranks on one device.
ON_DEVICE = {"gloo-tensors": ("gloo", "cpu", "cpu"), "nccl": ("nccl", "cuda:0", "cuda:1")}


def skip_without_two_gpus() -> None:
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()):
        pytest.skip(f"NCCL needs two GPUs here (this machine: {torch.cuda.device_count()} visible)")


@pytest.fixture(params=[*(name for name in TRANSPORT_NAMES if name != "nccl"), *ON_DEVICE])
def pair(request):
    made = []

    def make(sink, tls=None):
        if request.param in ON_DEVICE:
            if request.param == "nccl":
                skip_without_two_gpus()
            backend, send_on, receive_on = ON_DEVICE[request.param]
            receiver = P2PReceiver(sink, backend, "127.0.0.1", device=torch.device(receive_on))
            sender = P2PSender(backend, "127.0.0.1", device=torch.device(send_on))
        else:
            receiver = start_receiver(request.param, sink, "127.0.0.1", tls=tls)
            sender = make_sender(request.param, "127.0.0.1", tls=tls)
        made.append((sender, receiver))
        return sender, receiver

    yield make
    for sender, receiver in made:
        sender.close()
        receiver.stop()


def test_frames_arrive_whole_and_in_order(pair):
    sink = RecordingSink()
    sender, receiver = pair(sink)
    # Small frames, and frames beyond one gRPC message (1.5 MiB; 3 MiB after 9 MiB: assembled in part of
    # the buffer the larger one left) and one shared-memory slot (8 MiB).
    sizes = [1, 1000, 5 << 20, 9 << 20, 3 << 20, 70000]
    frames = [frame(i, n, seed=i) for i, n in enumerate(sizes)]
    for round_ in range(2):  # a second transfer reuses what the first set up (segment, group, connection)
        channel = sender.open(receiver.address, "t1")
        for header, data in frames:
            channel.send(header, data if channel.device is None else torch.from_numpy(data).to(channel.device))
        channel.finish(timeout=30)
        channel.close()
        assert channel.bytes_sent == sum(sizes)
    assert [(h, p) for h, p in sink.frames] == [(h, d.tobytes()) for h, d in frames] * 2


def test_a_corrupt_verdict_is_not_an_error_a_failure_is(pair):
    corrupt = RecordingSink(CorruptFrame)
    sender, receiver = pair(corrupt)
    channel = sender.open(receiver.address, "t1")
    channel.send(*frame(0, 100, seed=0, device=channel.device))
    channel.finish(timeout=30)  # the receiver counted it; `commit` names the layer for a resend
    channel.close()

    failing = RecordingSink(TransferError)
    sender, receiver = pair(failing)
    channel = sender.open(receiver.address, "t1")
    with pytest.raises(TransferError, match="the sink says no"):  # at the send (frames in lockstep) or finish
        channel.send(*frame(0, 100, seed=0, device=channel.device))
        channel.finish(timeout=30)
    channel.close()


def test_concurrent_transfers_to_one_receiver_each_arrive_whole(pair):
    """Two transfers share one receiving half (and, for torch.distributed, one process group, whose
    NCCL sends match receives in issue order): no frame of one lands in the other's."""
    sink = RecordingSink()
    sender, receiver = pair(sink)
    sent: dict[str, list[bytes]] = {"a": [], "b": []}

    def transfer(transfer_id: str, seed: int) -> None:
        channel = sender.open(receiver.address, transfer_id)
        for i in range(12):
            header, data = frame(i % 3, 1000 * (1 + (i * seed) % 7), seed=seed * 100 + i, device=channel.device)
            channel.send(dataclasses.replace(header, transfer_id=transfer_id), data)
            sent[transfer_id].append(data.tobytes() if channel.device is None else data.cpu().numpy().tobytes())
        channel.finish(timeout=30)
        channel.close()

    threads = [threading.Thread(target=transfer, args=(t, seed)) for t, seed in (("a", 3), ("b", 5))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for transfer_id in sent:
        assert [d for h, d in sink.frames if h.transfer_id == transfer_id] == sent[transfer_id]


def test_a_transfer_the_receiver_refuses_leaves_the_others_to_it_whole(pair):
    """The receiver refuses every frame of one transfer (aborted there: a cancel, a request done at
    its first token) while another transfer to it goes on. The refused one's channel fails; the other
    still arrives whole (torch.distributed: their shared process group stays, its sends and receives
    in step; it was torn down, failing every transfer to that peer)."""
    accepted = RecordingSink()

    def sink(header, payload):
        if header.transfer_id == "aborted":
            raise TransferError("transfer aborted")
        accepted.receive_frame(header, payload)

    sender, receiver = pair(FunctionSink(sink))
    going_on, aborted = sender.open(receiver.address, "going-on"), sender.open(receiver.address, "aborted")
    sent = []
    for i in range(6):
        header, data = frame(i, 3000, seed=i, device=going_on.device)
        going_on.send(dataclasses.replace(header, transfer_id="going-on"), data)
        sent.append(data.tobytes() if going_on.device is None else data.cpu().numpy().tobytes())
        if i == 2:
            with pytest.raises(TransferError, match="transfer aborted"):  # at the send (in lockstep) or finish
                header, data = frame(i, 3000, seed=10 + i, device=aborted.device)
                aborted.send(dataclasses.replace(header, transfer_id="aborted"), data)
                aborted.finish(timeout=30)
            aborted.close()
    going_on.finish(timeout=30)
    going_on.close()
    assert [d for h, d in accepted.frames] == sent


def test_a_gloo_channel_closed_with_frames_unanswered_leaves_the_group_to_the_others():
    """A transfer that ends early (a cancel, a request done at its first token) closes its channel
    while its frames still wait on the receiver's lane. gloo matches sends by tag, so the pair's
    group stays for the transfer beside it, and the early one's sends complete as the receiver takes
    its frames (tearing the group down failed every transfer to that decode worker)."""
    sink = RecordingSink()

    def slow_sink(header, payload):
        time.sleep(0.1)  # frames queue up on the group's lane
        sink.receive_frame(header, payload)

    receiver = P2PReceiver(FunctionSink(slow_sink), "gloo", "127.0.0.1")
    sender = P2PSender("gloo", "127.0.0.1")
    try:
        early, going_on = sender.open(receiver.address, "early"), sender.open(receiver.address, "going-on")
        group = early.group
        for i in range(3):
            header, data = frame(i, 2000, seed=i)
            early.send(dataclasses.replace(header, transfer_id="early"), data)
        early.close()  # its three frames unanswered
        for i in range(3):
            header, data = frame(i, 2000, seed=10 + i)
            going_on.send(dataclasses.replace(header, transfer_id="going-on"), data)
        going_on.finish(timeout=30)
        going_on.close()
        def layers(transfer_id: str) -> list[int]:
            with sink.lock:
                return [h.layer for h, _ in sink.frames if h.transfer_id == transfer_id]

        assert layers("going-on") == [0, 1, 2]
        # Every frame the receiver was told of, taken whole: gloo matches by tag, so the early
        # channel's last frame may reach the sink after the transfer beside it finished.
        assert wait_until(lambda: layers("early") == [0, 1, 2], timeout=10), layers("early")
        settling = [t for t in threading.enumerate() if t.name == "kv-gloo-settle"]
        for thread in settling:  # the early channel's sends: done, since the receiver took their frames
            thread.join(10)
        assert not any(thread.is_alive() for thread in settling)
        later = sender.open(receiver.address, "later")
        assert later.group is group
        later.close()
    finally:
        sender.close()
        receiver.stop()


@pytest.mark.parametrize("kind", ["tcp", "grpc"])
def test_a_channel_whose_frame_the_receiver_refused_fails_a_later_send(kind):
    """The receiver refuses a frame (its transfer was aborted there). A later send fails, saying why,
    instead of the sender pushing the rest of the prompt's KV for nobody until the commit finds out."""
    receiver, sender = start_receiver(kind, RecordingSink(TransferError)), make_sender(kind)
    try:
        channel = sender.open(receiver.address, "t1")
        channel.send(*frame(0, 100, seed=0))

        def refused() -> bool:
            try:
                channel.send(*frame(1, 100, seed=1))
            except TransferError as e:
                assert "the sink says no" in str(e)
                return True
            return False

        assert wait_until(refused, timeout=10)
        channel.close()
    finally:
        sender.close()
        receiver.stop()


@pytest.mark.parametrize("kind", ["tcp", "grpc"])
def test_mutual_tls_takes_only_senders_of_its_ca(tmp_path, kind):
    trustme = pytest.importorskip("trustme")

    def files(ca, name: str) -> dict[str, str]:
        cert = ca.issue_cert("127.0.0.1", "localhost")
        paths = {"cert": tmp_path / f"{name}.crt", "key": tmp_path / f"{name}.key", "ca": tmp_path / f"{name}-ca.crt"}
        cert.cert_chain_pems[0].write_to_path(paths["cert"])
        cert.private_key_pem.write_to_path(paths["key"])
        ca.cert_pem.write_to_path(paths["ca"])
        return {k: str(v) for k, v in paths.items()}

    cluster, stranger = files(trustme.CA(), "cluster"), files(trustme.CA(), "stranger")
    sink = RecordingSink()
    receiver = start_receiver(kind, sink, "127.0.0.1", tls=cluster)
    senders = {name: make_sender(kind, tls=tls) for name, tls in [("member", cluster), ("stranger", stranger),
                                                                  ("plain", None)]}
    try:
        header, data = frame(0, 4096, seed=1)
        for name, sender in senders.items():
            with contextlib.nullcontext() if name == "member" else pytest.raises(TransferError):
                channel = sender.open(receiver.address, "t1")  # tcp: the handshake fails here
                try:
                    channel.send(header, data)  # grpc: at a send once the call has failed, or at the finish
                    channel.finish(timeout=10)
                finally:
                    channel.close()
        assert sink.frames == [(header, data.tobytes())]  # only the member's frame got in
    finally:
        for sender in senders.values():
            sender.close()
        receiver.stop()


def test_a_channel_closed_from_another_thread_ends_its_send_promptly_and_leaks_nothing(tmp_path):
    """A cancel closes the channel while its sender waits for a free shared-memory slot (the receiver
    is slow): the send ends with TransferError at once, and no segment file is left behind. A finish
    meanwhile (a drain) fails within its own timeout."""
    from pdserve.kv_transfer.transports.shm import SHM_DIR, SLOTS

    release = threading.Event()

    def slow_sink(header, payload):
        release.wait(10)

    receiver = start_receiver("shm", FunctionSink(slow_sink))
    sender = make_sender("shm")
    errors: list[BaseException] = []
    try:
        channel = sender.open(receiver.address, "t1")
        segment = SHM_DIR / channel.segment.name

        def send_many():
            try:
                for i in range(SLOTS + 4):
                    channel.send(*frame(0, 1000, seed=i))
            except TransferError as e:
                errors.append(e)

        thread = threading.Thread(target=send_many)
        thread.start()
        assert wait_until(lambda: not channel.segment.free, 10)  # every slot taken: the sender waits
        with pytest.raises(TransferError, match="still being sent"):  # within its timeout, not the send's 30 s
            channel.finish(timeout=0.2)
        channel.close()
        thread.join(5)  # the receiver holds its frames for 10 s: only the close ends the send before
        assert not thread.is_alive()
        assert len(errors) == 1 and "closed" in str(errors[0])
    finally:
        release.set()
        sender.close()
        receiver.stop()
    assert not segment.exists()


@pytest.mark.parametrize("kind", ["shm", "gloo"])
def test_sequential_channels_to_a_peer_reuse_one_control_socket_and_only_one_in_step(kind):
    """A control socket costs its CURVE handshake before the first answer: channels in turn to one
    receiver share one. A channel whose frame was refused, that was closed mid-send from another
    thread, or whose receiver's address was forgotten while it was open, hands its socket to nobody,
    and a closed channel's finish cannot touch a socket it gave back; every transfer after each still
    arrives whole."""
    from pdserve.wire import ClusterSecret

    secret = ClusterSecret.generate()
    release = threading.Event()
    kept = RecordingSink()

    def sink(header, payload):
        if header.transfer_id == "refused":
            raise TransferError("transfer aborted")
        if header.transfer_id == "slow":
            release.wait(10)
        kept.receive_frame(header, payload)

    receiver = start_receiver(kind, FunctionSink(sink), secret=secret)
    sender = make_sender(kind, secret=secret)

    def transfer(transfer_id: str, seed: int) -> tuple[FrameHeader, bytes]:
        channel = sender.open(receiver.address, transfer_id)
        header, data = frame(0, 1000, seed=seed, transfer_id=transfer_id)
        channel.send(header, data)
        channel.finish(timeout=10)
        channel.close()
        return header, data.tobytes()

    try:
        sent = [transfer(f"t{i}", i) for i in range(4)]
        assert sender.clients.made == 1
        refused = sender.open(receiver.address, "refused")
        with pytest.raises(TransferError, match="transfer aborted"):
            refused.send(*frame(0, 1000, seed=9, transfer_id="refused"))
            refused.finish(timeout=10)
        refused.close()
        sent.append(transfer("t4", 4))
        assert sender.clients.made == 2

        slow = sender.open(receiver.address, "slow")
        errors: list[BaseException] = []

        def send_and_finish():
            try:
                slow.send(*frame(0, 1000, seed=10, transfer_id="slow"))
                slow.finish(timeout=10)
            except TransferError as e:
                errors.append(e)

        thread = threading.Thread(target=send_and_finish)
        thread.start()
        assert wait_until(lambda: slow.control.unanswered, 10)
        slow.close()  # a cancel while the owner waits for the answer
        thread.join(5)
        assert not thread.is_alive() and len(errors) == 1
        release.set()
        sent.append(transfer("t5", 5))
        assert sender.clients.made == 3

        done_with = sender.open(receiver.address, "done-with")
        done_with.close()  # idle: its socket goes to the next channel
        busy = sender.open(receiver.address, "busy")
        assert busy.control is done_with.control
        header, data = frame(0, 1000, seed=11, transfer_id="busy")
        busy.send(header, data)
        with pytest.raises(TransferError, match="transfer done-with: the channel is closed"):
            done_with.finish(timeout=1)  # not a wait on the socket the busy channel now owns
        busy.finish(timeout=10)
        sent.append((header, data.tobytes()))

        sender.forget(receiver.address)  # the receiver moved (restarted) while a channel to it was open
        busy.close()
        sent.append(transfer("t6", 6))
        assert sender.clients.made == 4  # the forgotten address's socket was closed, not kept
        assert wait_until(lambda: len(kept.frames) == len(sent) + 1, 10)  # the slow one's frame is taken too
        assert [f for f in kept.frames if f[0].transfer_id != "slow"] == sent
    finally:
        release.set()
        sender.close()
        receiver.stop()


def test_shm_slots_hold_the_frames_the_sender_expects_and_larger_ones_wait_their_turn():
    """Told its frames' size (a model whose frames pass the default 8 MiB slot), the sender makes slots
    that hold them, so they are copied into a slot, not sent inline; a frame larger still (a lossy
    codec's worst case) goes inline, with no more messages in flight than a segment has slots."""
    from pdserve.kv_transfer.transports.shm import SEGMENT_BYTES

    release = threading.Event()
    sink = RecordingSink()

    def slow_sink(header, payload):
        release.wait(10)
        sink.receive_frame(header, payload)

    receiver = start_receiver("shm", FunctionSink(slow_sink))
    sender = make_sender("shm", frame_bytes=9 << 20)
    frames = [frame(i, (9 if i == 0 else 10) << 20, seed=i) for i in range(10)]
    try:
        channel = sender.open(receiver.address, "t1")
        segment = channel.segment
        assert segment.slot_bytes >= 9 << 20 and 2 <= segment.slots and segment.slots * segment.slot_bytes <= SEGMENT_BYTES
        channel.send(*frames[0])
        assert len(segment.free) == segment.slots - 1  # in a slot (nobody has taken an answer yet)
        thread = threading.Thread(target=lambda: [channel.send(*f) for f in frames[1:]])
        thread.start()
        deadline = time.monotonic() + 10  # the receiver holds the first frame: the sender waits for answers
        while len(channel.control.unanswered) < segment.slots and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # time enough to send one more, were inline frames unbounded
        assert thread.is_alive() and len(channel.control.unanswered) == segment.slots
        release.set()
        thread.join(30)
        assert not thread.is_alive()
        channel.finish(timeout=30)
        channel.close()
        assert [(h, p) for h, p in sink.frames] == [(h, d.tobytes()) for h, d in frames]
    finally:
        release.set()
        sender.close()
        receiver.stop()


def test_a_shm_segment_the_receiver_could_not_map_is_not_reused(monkeypatch):
    """The receiver fails to map a new segment (out of file descriptors, say): that frame's answer
    unlinks the segment's name all the same, so the segment is released, not pooled, and the next
    transfer gets a fresh one (reused, every frame on it failed: the segment is gone)."""
    from pdserve.kv_transfer.transports.shm import ShmReceiver

    sink = RecordingSink()
    receiver, sender = start_receiver("shm", sink), make_sender("shm")
    original, failures = ShmReceiver._mapping, [1]

    def mapping_fails_once(self, name):
        if failures:
            failures.pop()
            raise OSError(24, "Too many open files")
        return original(self, name)

    monkeypatch.setattr(ShmReceiver, "_mapping", mapping_fails_once)
    try:
        channel = sender.open(receiver.address, "t1")
        channel.send(*frame(0, 1000, seed=0))
        with pytest.raises(TransferError, match="Too many open files"):
            channel.finish(timeout=10)
        channel.close()
        channel = sender.open(receiver.address, "t1")
        header, data = frame(1, 1000, seed=1)
        channel.send(header, data)
        channel.finish(timeout=10)
        channel.close()
        assert sink.frames == [(header, data.tobytes())]
    finally:
        sender.close()
        receiver.stop()


def test_shm_slots_come_back_whichever_thread_takes_the_answers():
    """A drain takes answers on its own thread while the sender thread still sends (a cancel with
    frames queued), and a close from a third thread may land mid-send: every slot is free again
    either way, so the segment goes back to the pool whole, never short of slots."""
    from pdserve.kv_transfer.transports.shm import SLOTS

    receiver = start_receiver("shm", RecordingSink())
    sender = make_sender("shm")
    channel = sender.open(receiver.address, "t1")
    try:
        errors: list[BaseException] = []

        def send_many():
            try:
                for i in range(300):
                    channel.send(*frame(0, 64, seed=i))
            except TransferError as e:  # slots lost: it waited for one in vain
                errors.append(e)

        thread = threading.Thread(target=send_many)
        thread.start()
        while thread.is_alive():  # bounded: the sender ends within a few seconds, or a send's 30 s wait
            try:
                channel.finish(0.01)
            except TransferError:
                pass
        assert not errors, errors
        channel.finish(10)
        assert sorted(channel.segment.free) == list(range(SLOTS))
        channel.control.close()  # a close's first step, landing while the next frame is being copied in
        with pytest.raises(TransferError):
            channel.send(*frame(0, 64, seed=0))
        assert sorted(channel.segment.free) == list(range(SLOTS))
    finally:
        channel.close()
        sender.close()
        receiver.stop()


def test_a_group_whose_join_is_answered_too_late_is_torn_down_on_both_sides(monkeypatch):
    """The receiving half forms its side of a gloo group but answers the JOIN after the sender gave
    up: the sender's failure tells it to leave, so it holds no group nobody will use."""
    from pdserve.kv_transfer.transports import p2p

    monkeypatch.setattr(p2p, "GROUP_TIMEOUT_S", 0.5)
    receiver = P2PReceiver(RecordingSink(), "gloo", "127.0.0.1")
    handle = receiver._server._handle

    def answer_late(kind, parts):
        deferred = handle(kind, parts)
        if kind != p2p.JOIN:
            return deferred
        return p2p.Deferred(deferred.lane, lambda: (deferred.work(), time.sleep(1.0)))

    receiver._server._handle = answer_late
    sender = P2PSender("gloo", "127.0.0.1")
    try:
        with pytest.raises(TransferError, match="cannot form a gloo group"):
            sender.open(receiver.address, "t1")
        deadline = time.monotonic() + 5
        while receiver._groups and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not receiver._groups and not sender._groups
    finally:
        sender.close()
        receiver.stop()


@pytest.mark.parametrize("late", [False, True], ids=["in-time", "late"])
def test_a_join_the_receiver_refuses_fails_the_open_saying_why(monkeypatch, late):
    """A receiver dials only a store on the address the JOIN came from: a sender whose host setting
    names another ("localhost" for 127.0.0.1) is refused at once, and its open fails at once naming
    the cause (it waited out the group timeout, 30 s, and reported gloo's timeout instead). A refusal
    that came too late for that look is still the error named once the group fails to form."""
    from pdserve.kv_transfer.transports import p2p

    if late:
        monkeypatch.setattr(p2p, "JOIN_REFUSAL_S", 0.0)
        monkeypatch.setattr(p2p, "GROUP_TIMEOUT_S", 2.0)
    receiver = P2PReceiver(RecordingSink(), "gloo", "127.0.0.1")
    sender = P2PSender("gloo", "localhost")
    try:
        started = time.monotonic()
        with pytest.raises(TransferError, match="names a store on 'localhost'"):
            sender.open(receiver.address, "t1")
        assert time.monotonic() - started < 5
    finally:
        sender.close()
        receiver.stop()


def test_a_peer_that_never_joins_its_group_holds_up_no_open_to_another_peer(monkeypatch):
    """Forming a gloo group with a peer that never answers its JOIN waits out the group timeout;
    meanwhile a channel to another peer opens (its group formed) and delivers, before that wait ends."""
    from pdserve.kv_transfer.transports import p2p

    monkeypatch.setattr(p2p, "GROUP_TIMEOUT_S", 4.0)
    silent, answering = (P2PReceiver(RecordingSink(), "gloo", "127.0.0.1") for _ in range(2))
    handle, joined = silent._server._handle, threading.Event()

    def ignore_joins(kind, parts):
        if kind != p2p.JOIN:
            return handle(kind, parts)
        joined.set()
        return None

    silent._server._handle = ignore_joins
    sender = P2PSender("gloo", "127.0.0.1")
    failures: list[TransferError] = []

    def open_to_silent() -> None:
        try:
            sender.open(silent.address, "t1")
        except TransferError as e:
            failures.append(e)

    stuck = threading.Thread(target=open_to_silent)
    try:
        stuck.start()
        assert joined.wait(5)
        channel = sender.open(answering.address, "t1")
        channel.send(*frame(0, 100, seed=1))
        channel.finish(10)
        channel.close()
        assert stuck.is_alive(), "the open to the other peer waited until the silent peer's formation ended"
        stuck.join(15)
        assert len(failures) == 1 and "cannot form a gloo group" in str(failures[0])
    finally:
        stuck.join(15)
        sender.close()
        silent.stop()
        answering.stop()


def test_a_sender_stalled_mid_frame_holds_up_no_other_sender(monkeypatch):
    """A prefill worker announces a frame and then stalls before sending its bytes (frozen, or its
    NCCL kernel hung): the receiver's receive for it waits out the group timeout. Meanwhile another
    sender forms its group with the same receiver and its frames arrive, each at once."""
    from pdserve.kv_transfer.transports import p2p

    monkeypatch.setattr(p2p, "GROUP_TIMEOUT_S", 6.0)
    sink = RecordingSink()
    receiver = P2PReceiver(sink, "gloo", "127.0.0.1")
    stalled, other = P2PSender("gloo", "127.0.0.1"), P2PSender("gloo", "127.0.0.1")
    try:
        channel = stalled.open(receiver.address, "stalled")
        header, _ = frame(0, 1000, seed=0)
        # What `P2PChannel.send` announces first; the tagged send of the bytes never follows.
        channel.control.send(p2p.FRAME, [header.pack(), channel.group.id.encode(), p2p._TAG.pack(channel.group.tag())])
        time.sleep(0.2)  # the receiver is in that frame's receive
        started = time.monotonic()
        going_on = other.open(receiver.address, "going-on")
        for layer in range(3):
            going_on.send(*frame(layer, 1000, seed=layer))
        going_on.finish(timeout=p2p.GROUP_TIMEOUT_S / 2)
        took = time.monotonic() - started
        going_on.close()
        assert [h.layer for h, _ in sink.frames] == [0, 1, 2]
        assert took < p2p.GROUP_TIMEOUT_S / 2, f"the other sender waited {took:.1f} s behind the stalled one"
        with pytest.raises(TransferError, match="p2p receive failed"):  # the stalled frame's receive times out
            channel.control.wait(lambda: not channel.control.unanswered, 2 * p2p.GROUP_TIMEOUT_S)
        channel.close()
    finally:
        stalled.close()
        other.close()
        receiver.stop()


def test_a_shm_channel_closed_before_its_first_frame_leaves_its_segment_to_the_next():
    """A transfer can end before any frame went out (a request done at its first token while its
    frames still waited their turn): its fresh segment, never seen by the receiver, is pooled like
    any other, and the next transfer uses it (the receiver maps it then)."""
    sink = RecordingSink()
    receiver, sender = start_receiver("shm", sink), make_sender("shm")
    try:
        unused = sender.open(receiver.address, "t1")
        unused.close()
        assert (sender.segments_made, len(sender._pools[receiver.address])) == (1, 1)
        channel = sender.open(receiver.address, "t2")
        assert channel.segment is unused.segment
        header, data = frame(0, 1000, seed=0)
        channel.send(header, data)
        channel.finish(timeout=10)
        channel.close()
        assert sink.frames == [(header, data.tobytes())]
        assert (sender.segments_made, len(sender._pools[receiver.address])) == (1, 1)
    finally:
        sender.close()
        receiver.stop()


def test_a_channel_closing_after_its_address_was_forgotten_releases_its_segment():
    """The peer restarted elsewhere while a transfer to its old address was still open: that
    channel's segment is released on both sides when it closes, not pooled again for an address
    nothing will use."""
    receiver = start_receiver("shm", RecordingSink())
    sender = make_sender("shm")
    try:
        channel = sender.open(receiver.address, "t1")
        channel.send(*frame(0, 1000, seed=0))
        channel.finish(10)
        name = channel.segment.name
        assert name in receiver._maps
        sender.forget(receiver.address)
        channel.close()
        assert receiver.address not in sender._pools and channel.segment.map.closed
        deadline = time.monotonic() + 5
        while name in receiver._maps and time.monotonic() < deadline:  # the release goes over the wire
            time.sleep(0.05)
        assert name not in receiver._maps
    finally:
        sender.close()
        receiver.stop()


def test_segments_whose_release_notice_cannot_be_sent_are_unmapped_here_all_the_same(monkeypatch):
    """The notice to the receiver needs a socket of its own: when making it fails (out of file
    descriptors, say), every idle segment of the address is still unmapped and unlocked here (the
    first such failure left them all held before), and the receiver's sweep takes its side once it
    maps a new one."""
    receiver = start_receiver("shm", RecordingSink())
    sender = make_sender("shm")
    try:
        channels = [sender.open(receiver.address, f"t{i}") for i in range(2)]  # open together: two segments
        for channel in channels:
            channel.send(*frame(0, 1000, seed=0))
            channel.finish(10)
            channel.close()
        segments = list(sender._pools[receiver.address])
        assert len(segments) == 2

        def no_socket(*args, **kwargs):
            raise zmq.ZMQError(errno.EMFILE)

        monkeypatch.setattr(control, "ControlClient", no_socket)
        sender.forget(receiver.address)
        assert all(segment.map.closed and segment.path is None for segment in segments)
    finally:
        monkeypatch.undo()
        sender.close()
        receiver.stop()


def kill(child: subprocess.Popen) -> None:
    """SIGKILL a child process of the test (stopped or not) unless it has ended, and reap it."""
    if child.poll() is None:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)


def sending_child(transport: str, address: str, take_the_answer: bool = True) -> subprocess.Popen:
    """A process that sends one frame to `address` over `transport` and waits to be killed. It says
    'sent' once the frame is answered; or, not taking the answer (shm), prints its segment's name."""
    then = ("channel.finish(10)\nprint('sent', flush=True)\n" if take_the_answer
            else "print(channel.segment.name, flush=True)\n")
    return subprocess.Popen([sys.executable, "-c", "import time, zlib\n"
                             "from pdserve.kv_transfer.interface import FrameHeader\n"
                             "from pdserve.kv_transfer.transports import make_sender\n"
                             f"channel = make_sender({transport!r}).open({address!r}, 't1')\n"
                             "data = bytes(1000)\n"
                             "channel.send(FrameHeader('t1', 0, 0, 16, 'raw', 0, zlib.crc32(data), 1000), data)\n"
                             f"{then}time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)


def test_a_receiver_removes_the_file_of_a_sender_killed_before_it_took_the_answer(monkeypatch):
    """A sender SIGKILLed between announcing a frame and taking the answer has not unlinked its
    segment's file: within a sweep, the receiver, finding nobody holds the segment, unmaps it and
    removes the file."""
    from pdserve.kv_transfer.transports import control
    from pdserve.kv_transfer.transports.shm import SHM_DIR

    monkeypatch.setattr(control, "SWEEP_S", 0.2)
    receiver = start_receiver("shm", RecordingSink())
    child = sending_child("shm", receiver.address, take_the_answer=False)
    try:
        name = child.stdout.readline().strip()
        assert wait_until(lambda: name in receiver._maps, timeout=10)
        assert (SHM_DIR / name).is_file()  # it never takes the answer: its file stays linked
        kill(child)
        assert wait_until(lambda: not (SHM_DIR / name).exists(), timeout=10)
        assert name not in receiver._maps
    finally:
        kill(child)
        receiver.stop()


def test_a_receiver_unmaps_the_segments_of_a_sender_killed_after_they_were_mapped():
    """A sender SIGKILLed once its segment is mapped on both sides (the name already unlinked) never
    sends the release: the receiver drops that mapping when it next maps a segment (a restarted
    sender's first frame), and keeps the mappings of living senders."""
    receiver = start_receiver("shm", RecordingSink())
    child = sending_child("shm", receiver.address)
    living, restarted = make_sender("shm"), make_sender("shm")
    channels = []
    try:
        assert child.stdout.readline().strip() == "sent"
        (orphan,) = receiver._maps
        kept = living.open(receiver.address, "t2")
        channels.append(kept)
        kept.send(*frame(0, 1000, seed=1))
        kept.finish(10)
        assert {orphan, kept.segment.name} <= set(receiver._maps)
        kill(child)
        channel = restarted.open(receiver.address, "t3")
        channels.append(channel)
        channel.send(*frame(0, 1000, seed=2))
        channel.finish(10)
        assert orphan not in receiver._maps
        assert {kept.segment.name, channel.segment.name} <= set(receiver._maps)
    finally:
        kill(child)
        for channel in channels:
            channel.close()
        living.close()
        restarted.close()
        receiver.stop()


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_receiver_lets_go_of_what_a_killed_sender_held_within_a_sweep(monkeypatch, transport):
    """A sender SIGKILLed mid-life sends no goodbye (no shm release, no gloo LEAVE), and no other
    sender comes: within a sweep of the receiver's control loop, its shared memory mapping or its
    process group is gone. A living sender's is kept through the sweeps, and still delivers."""
    from pdserve.kv_transfer.transports import control

    monkeypatch.setattr(control, "SWEEP_S", 0.2)
    sink = RecordingSink()
    receiver = start_receiver(transport, sink)
    held = (lambda: set(receiver._maps)) if transport == "shm" else (lambda: set(receiver._groups))
    child, living = sending_child(transport, receiver.address), make_sender(transport)
    try:
        assert child.stdout.readline().strip() == "sent"
        orphan = held()
        channel = living.open(receiver.address, "t2")
        channel.send(*frame(0, 1000, seed=1))
        channel.finish(10)
        kept = held() - orphan
        assert len(orphan) == len(kept) == 1
        kill(child)
        deadline = time.monotonic() + 10
        while held() != kept and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held() == kept
        time.sleep(3 * control.SWEEP_S)  # the living sender's survives more sweeps, and is used again
        channel.send(*frame(1, 1000, seed=2))
        channel.finish(10)
        channel.close()
        assert held() == kept and len(sink.frames) == 3
    finally:
        kill(child)
        living.close()
        receiver.stop()


def test_a_frozen_sender_holds_up_no_other_sender_between_frames(monkeypatch):
    """A prefill worker frozen (SIGSTOP) with its group formed and nothing in flight: its store never
    answers the receiver's liveness check, which must not hold up the others' groups and frames. Once
    it is killed, its group goes."""
    from pdserve.kv_transfer.transports import control

    monkeypatch.setattr(control, "SWEEP_S", 0.2)
    sink = RecordingSink()
    receiver = start_receiver("gloo", sink)
    child, other = sending_child("gloo", receiver.address), make_sender("gloo")
    try:
        assert child.stdout.readline().strip() == "sent"
        (frozen,) = receiver._groups
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(3 * control.SWEEP_S)  # its check is under way, and waits
        started = time.monotonic()
        channel = other.open(receiver.address, "t2")
        for layer in range(3):
            channel.send(*frame(layer, 1000, seed=layer))
        channel.finish(timeout=5)
        channel.close()
        assert time.monotonic() - started < 5 and len(sink.frames) == 4
        kill(child)
        deadline = time.monotonic() + 10
        while frozen in receiver._groups and time.monotonic() < deadline:
            time.sleep(0.05)
        assert frozen not in receiver._groups and len(receiver._groups) == 1
    finally:
        kill(child)
        other.close()
        receiver.stop()


def test_a_control_loop_that_dies_tells_its_owner(monkeypatch):
    """The receiving half's control loop failing (here in its sweep) is not left to a log line: its
    owner is told, so a decode worker reports itself dead and is restarted, instead of every sender
    to it waiting out its reservations."""
    from pdserve.kv_transfer.transports import control

    monkeypatch.setattr(control, "SWEEP_S", 0.05)
    told: list[BaseException] = []
    crashed = threading.Event()

    def sweep() -> None:
        raise OSError("the sweep broke")

    def on_crash(error: BaseException) -> None:
        told.append(error)
        crashed.set()

    server = control.ControlServer("test", "127.0.0.1", lambda kind, parts: None, sweep=sweep, on_crash=on_crash)
    try:
        assert crashed.wait(5)
        assert server.failure is told[0] and str(told[0]) == "the sweep broke"
    finally:
        server.stop()


def test_closing_a_control_client_is_not_held_up_by_a_send_to_a_stalled_peer(monkeypatch):
    """A peer that takes no message (its process stalled) fills the client's queue, and a send then
    waits for room; a close from another thread (a cancel) ends that send at once, instead of waiting
    behind it for the send's whole timeout."""
    import zmq

    from pdserve.kv_transfer.transports import control

    monkeypatch.setattr(control, "SEND_TIMEOUT_S", 8.0)
    stalled = zmq.Context.instance().socket(zmq.ROUTER)  # bound, never read
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.LINGER, 0)
    port = stalled.bind_to_random_port("tcp://127.0.0.1")
    client = control.ControlClient(f"tcp://127.0.0.1:{port}")
    sent, ended = [0], []

    def keep_sending() -> None:
        try:
            while True:
                client.send(b"x", [b"\0" * 65536])
                sent[0] += 1
        except TransferError as e:
            ended.append(e)

    thread = threading.Thread(target=keep_sending, daemon=True)
    thread.start()
    try:
        def queue_full() -> bool:
            before = sent[0]
            time.sleep(0.5)
            return sent[0] == before

        assert wait_until(queue_full, timeout=20)
        t0 = time.monotonic()
        client.close()
        thread.join(timeout=3)
        assert time.monotonic() - t0 < 2 and not thread.is_alive()
        assert "closed" in str(ended[0])
    finally:
        client.close()
        stalled.close()


def test_stopping_a_control_server_lets_its_lanes_finish_their_work():
    """Work under way on a lane (a gloo group being torn down, say) ends before `stop` returns, so a
    process that exits right after stopping its receiver does not exit under it."""
    from pdserve.kv_transfer.transports import control

    started, finished = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        time.sleep(0.5)
        finished.set()

    server = control.ControlServer("test", "127.0.0.1", lambda kind, parts: None)
    server.run_on_lane("group", work)
    assert started.wait(5)
    assert server.stop() and finished.is_set()


def test_a_segment_left_by_a_killed_sender_is_swept_and_a_living_one_kept():
    """A sender SIGKILLed after making a segment, before its receiver mapped it, leaves the file linked;
    the next sender started on the node removes it, and leaves the segments of living senders alone."""
    from pdserve.kv_transfer.transports.shm import SHM_DIR, _Segment, sweep_orphan_segments

    child = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                              "from pdserve.kv_transfer.transports.shm import _Segment\n"
                              "print(_Segment(slots=1, slot_bytes=4096).name, flush=True)\ntime.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        orphan = SHM_DIR / child.stdout.readline().strip()
    finally:
        kill(child)
    living = _Segment(slots=1, slot_bytes=4096)
    # Files under the making name: one left by a sender killed while making it (old), one being made now.
    half_made, being_made = (SHM_DIR / f".making-pdserve-kv-{uuid.uuid4().hex}" for _ in range(2))
    for path in (half_made, being_made):
        path.write_bytes(b"")
    os.utime(half_made, (time.time() - 120, time.time() - 120))
    try:
        assert orphan.is_file() and living.path.is_file()
        assert sweep_orphan_segments() >= 2
        assert not orphan.exists() and living.path.is_file()
        assert not half_made.exists() and being_made.exists()
    finally:
        living.close()
        for path in (orphan, half_made, being_made):
            path.unlink(missing_ok=True)


class NeverConnects:
    """Stands in for an NCCL group whose first operation sets its communicator up and, in torch's
    blocking mode, waits for a peer that never joins with no bound of its own (NCCL needs a GPU; the
    bound around it is what is tested)."""

    def __init__(self) -> None:
        self.peer_joins = threading.Event()

    def send(self, tensors, rank, tag):
        return self

    def wait(self, timeout):
        self.peer_joins.wait(10)


def test_an_nccl_groups_first_operation_is_given_up_on_past_the_group_timeout(monkeypatch, caplog):
    """Past the bound the group is given up with an error saying why (the open fails, and with it the
    transfer: the router places the request again) instead of holding the opening thread forever; if
    the operation ever ends, that is logged."""
    from pdserve.kv_transfer.transports import p2p

    monkeypatch.setattr(p2p, "GROUP_TIMEOUT_S", 0.2)
    monkeypatch.setattr(p2p, "CONNECT_MARGIN_S", 0.1)
    group = NeverConnects()
    started = time.monotonic()
    with pytest.raises(TransferError, match="did not connect within 0.3 s: its peer never joined"):
        p2p._connect(group, torch.device("cpu"), 0, None)
    assert time.monotonic() - started < 2
    with caplog.at_level(logging.WARNING, logger=p2p.__name__):
        group.peer_joins.set()
        assert wait_until(lambda: "connected after all" in caplog.text)


class UnparsableHeader(FrameHeader):
    """Packs as a faulty sender would: a transfer id that is not UTF-8."""

    def pack(self) -> bytes:
        return super().pack()[: -len(f"{self.transfer_id}\0{self.codec}")] + b"\xff\0raw"


def assert_the_next_transfer_delivers(sender, receiver) -> None:
    channel = sender.open(receiver.address, "t2")
    channel.send(*frame(0, 64, seed=4))
    channel.finish(10)
    assert len(receiver.sink.frames) == 1
    channel.close()


def test_a_p2p_frame_whose_header_does_not_parse_fails_the_transfer_and_its_group_goes(monkeypatch):
    """No receive is posted for a frame whose header does not parse, so its send never completes:
    answered FAILED (not CORRUPT, which would have the sender send it again and wait out the group
    timeout), the sender drops the group, and its LEAVE ends the receiver's half (aborted, not left
    to whenever the last reference goes)."""

    receiver = P2PReceiver(RecordingSink(), "gloo", "127.0.0.1")
    aborted, abort = [], receiver._abort
    monkeypatch.setattr(receiver, "_abort", lambda group_id, joined: (aborted.append(group_id),
                                                                      abort(group_id, joined)))
    sender = P2PSender("gloo", "127.0.0.1")
    try:
        channel = sender.open(receiver.address, "t1")
        group_id = channel.group.id
        header, payload = frame(0, 64, seed=3)
        channel.send(UnparsableHeader(*dataclasses.astuple(header)), payload)
        started = time.monotonic()
        with pytest.raises(TransferError, match="malformed frame header"):
            channel.finish(10)
        assert time.monotonic() - started < 5 and channel.control.corrupt == 0
        assert not sender._groups and wait_until(lambda: aborted == [group_id] and not receiver._groups)
        channel.close()
        assert_the_next_transfer_delivers(sender, receiver)  # in a fresh group
    finally:
        sender.close()
        receiver.stop()


def test_an_shm_frame_whose_header_does_not_parse_fails_its_transfer_and_leaves_the_next_one_whole():
    """Answered FAILED, not CORRUPT: a CORRUPT answer before the receiver had mapped the segment
    unlinked it unmapped and returned it to the pool, and the pair's next transfer found it gone."""
    receiver = start_receiver("shm", RecordingSink(), host="127.0.0.1")
    sender = make_sender("shm", host="127.0.0.1", frame_bytes=1024)
    try:
        channel = sender.open(receiver.address, "t1")
        header, payload = frame(0, 64, seed=5)
        channel.send(UnparsableHeader(*dataclasses.astuple(header)), payload)
        with pytest.raises(TransferError, match="malformed frame header"):
            channel.finish(10)
        channel.close()
        assert_the_next_transfer_delivers(sender, receiver)
    finally:
        sender.close()
        receiver.stop()


class HeldSink(RecordingSink):
    """Takes nothing until `open` is set: a receiver (or a link) slower than the sender."""

    def __init__(self) -> None:
        super().__init__()
        self.open = threading.Event()

    def receive_frame(self, header: FrameHeader, payload: memoryview | torch.Tensor) -> None:
        self.open.wait(10)
        super().receive_frame(header, payload)


def steady(count: Callable[[], int], steady_s: float, timeout_s: float) -> int:
    """`count()` once it has not changed for `steady_s` (within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= steady_s:
            return now
    raise AssertionError(f"still changing after {timeout_s} s: {last}")


@pytest.mark.parametrize("kind", ["grpc", "gloo"])
def test_a_sender_on_an_asynchronous_transport_keeps_pace_with_its_receiver(monkeypatch, kind):
    """gRPC queues frames for grpcio's thread and gloo posts host sends asynchronously: without a
    bound, the sender ran through the whole prompt at once (its lease renewed as if each frame had
    gone, the prompt's KV held in memory), and `finish` was left to wait for all of it, within a
    fixed 30 s however slow the link. With a window, `send` waits once that much is unanswered."""
    from pdserve.kv_transfer.transports import grpc_stream, p2p

    monkeypatch.setattr(grpc_stream if kind == "grpc" else p2p, "WINDOW_BYTES", 1 << 20)
    sink = HeldSink()
    receiver = start_receiver(kind, sink, host="127.0.0.1")
    sender = make_sender(kind, host="127.0.0.1")
    frames = [frame(layer, 256 << 10, seed=layer) for layer in range(256)]  # 64 MiB
    sent: list[int] = []
    try:
        channel = sender.open(receiver.address, "t1")

        def send_all() -> None:
            for header, payload in frames:
                channel.send(header, payload)
                sent.append(header.layer)

        sending = threading.Thread(target=send_all)  # why: it blocks, and the test watches it do so
        sending.start()
        # Blocked, not run through: it stops once grpcio's, gloo's and the kernel's buffers hold what the
        # receiver has not taken (how much varies with their own flow control; never the whole prompt).
        blocked_at = steady(lambda: len(sent), steady_s=1.0, timeout_s=8.0)
        assert sending.is_alive() and blocked_at < len(frames), blocked_at
        sink.open.set()
        sending.join(30)
        assert not sending.is_alive() and len(sent) == len(frames)
        channel.finish(30)
        assert [h.layer for h, _ in sink.frames] == list(range(len(frames)))
        channel.close()
    finally:
        sink.open.set()
        sender.close()
        receiver.stop()
