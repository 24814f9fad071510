"""Image embeddings over the KV-transfer layer: an encode worker's sending side and a prompt-pass
worker's receiving side, over every transport on loopback, arrive bit-exact (images split across
frames too); the receiver sizes everything from its reservation and refuses frames that do not fit
it, corrupt ones included, before they cost it anything."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_helpers import RecordingSink

from pdserve.encode_worker.worker import HeldEmbeddings
from pdserve.engine.multimodal.vision import EncodedImage
from pdserve.kv_transfer import embeddings
from pdserve.kv_transfer.embeddings import EMBEDDINGS_PREFIX, EmbeddingReceiver, EmbeddingSender, SinkByKind
from pdserve.kv_transfer.frames import make_frame
from pdserve.kv_transfer.interface import CorruptFrame, TransferError
from pdserve.kv_transfer.settings import TransferSettings
from pdserve.kv_transfer.transports import start_receiver

HIDDEN = 48


def image(seed: int, rows: int, dtype: torch.dtype = torch.float32) -> EncodedImage:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, HIDDEN, generator=generator).to(dtype)
    return EncodedImage(seed.to_bytes(16, "little"), rows, (1, 2, rows // 2) if rows % 2 == 0 else None, values)


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc", "gloo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embeddings_arrive_exact_over_every_transport(transport, dtype, monkeypatch):
    # Small frames, so that an image's rows span several (one frame holds 40 rows of float32, 80 of bfloat16).
    monkeypatch.setattr(embeddings, "FRAME_BYTES", 40 * HIDDEN * 4)
    images = [image(1, 7, dtype), image(2, 130, dtype), image(3, 1, dtype)]
    receiver = EmbeddingReceiver(HIDDEN, max_rows=1000, lease_s=30)
    listening = start_receiver(transport, SinkByKind(None, receiver), "127.0.0.1")
    sender = EmbeddingSender(TransferSettings(transport=transport, host="127.0.0.1"), node_id="node")
    try:
        for attempt in range(2):  # the second reuses what the first set up (segment, connection, group)
            transfer_id = f"{EMBEDDINGS_PREFIX}r{attempt}"
            lease = receiver.reserve(transfer_id, f"r{attempt}", tuple(i.spec for i in images))
            lease = dataclasses.replace(lease, addresses={transport: listening.address}, node_id="node")
            sent = sender.send(lease, images, timeout_s=30)
            assert sent == sum(i.embeddings.nbytes for i in images)
            arrived = receiver.take(transfer_id)
            assert [a.spec for a in arrived] == [i.spec for i in images]
            for a, i in zip(arrived, images):
                assert a.embeddings.dtype == dtype and torch.equal(a.embeddings, i.embeddings)
        assert receiver.counts()["embedding_corrupt_frames"] == 0
    finally:
        sender.close()
        listening.stop()


def reserved(receiver: EmbeddingReceiver, *images: EncodedImage, transfer_id: str = f"{EMBEDDINGS_PREFIX}t") -> str:
    receiver.reserve(transfer_id, "r", tuple(i.spec for i in images))
    return transfer_id


def rows_frame(transfer_id: str, index: int, img: EncodedImage, start: int, n: int, codec: str = "raw"):
    return make_frame(transfer_id, index, start, n, codec, 0, embeddings.tensor_bytes(img.embeddings[start:start + n]),
                      None)


def test_frames_that_do_not_fit_the_reservation_are_refused_before_their_payload():
    receiver = EmbeddingReceiver(HIDDEN, max_rows=100, lease_s=30)
    img = image(4, 10)
    tid = reserved(receiver, img)
    good_header, _ = rows_frame(tid, 0, img, 0, 10)
    for bad in (dataclasses.replace(good_header, transfer_id=f"{EMBEDDINGS_PREFIX}other"),  # never reserved
                dataclasses.replace(good_header, layer=1),  # no second image
                dataclasses.replace(good_header, start_token=5),  # rows past the image's 10
                dataclasses.replace(good_header, payload_bytes=good_header.payload_bytes * 1000),  # not its rows' bytes
                dataclasses.replace(good_header, codec="cachegen")):  # embeddings travel raw
        with pytest.raises(TransferError):
            receiver.admit_frame(bad)
    receiver.admit_frame(good_header)


def test_a_corrupt_frame_is_dropped_and_the_transfer_is_not_taken_incomplete():
    receiver = EmbeddingReceiver(HIDDEN, max_rows=100, lease_s=30)
    img = image(5, 10)
    tid = reserved(receiver, img)
    header, payload = rows_frame(tid, 0, img, 0, 6)
    damaged = bytearray(payload)
    damaged[3] ^= 0xFF
    with pytest.raises(CorruptFrame):
        receiver.receive_frame(header, memoryview(damaged))
    receiver.receive_frame(*rows_frame(tid, 0, img, 6, 4))
    with pytest.raises(TransferError, match="6 rows did not arrive"):
        receiver.take(tid)
    with pytest.raises(TransferError):  # ended: its buffers let go, nothing more taken into them
        receiver.receive_frame(header, payload)
    assert receiver.counts()["embedding_corrupt_frames"] == 1


def test_reservations_this_model_cannot_take_are_refused():
    receiver = EmbeddingReceiver(HIDDEN, max_rows=100, lease_s=30)
    wide = EncodedImage(b"w" * 16, 4, None, torch.zeros(4, HIDDEN + 1))
    for specs in ((wide.spec,), (image(6, 60).spec, image(7, 41).spec),  # too wide; more rows than a prompt
                  (dataclasses.replace(image(8, 4).spec, dtype="int64"),)):
        with pytest.raises(ValueError):
            receiver.reserve(f"{EMBEDDINGS_PREFIX}x", "r", specs)
    with pytest.raises(ValueError):  # not an embeddings transfer's id
        receiver.reserve("kv-transfer", "r", (image(9, 4).spec,))


def test_a_worker_taking_both_kinds_hands_each_frame_to_its_receiver():
    kv = RecordingSink()
    receiver = EmbeddingReceiver(HIDDEN, max_rows=100, lease_s=30)
    both = SinkByKind(kv, receiver)
    img = image(10, 3)
    tid = reserved(receiver, img)
    both.receive_frame(*rows_frame(tid, 0, img, 0, 3))
    kv_header, kv_payload = rows_frame("kv-1", 0, img, 0, 3)
    both.receive_frame(kv_header, kv_payload)
    assert [h.transfer_id for h, _ in kv.frames] == ["kv-1"] and torch.equal(receiver.take(tid)[0].embeddings,
                                                                               img.embeddings)
    with pytest.raises(TransferError):  # a prefill worker takes no KV
        SinkByKind(None, receiver).admit_frame(kv_header)


def test_held_embeddings_are_let_go_past_their_bound():
    held = HeldEmbeddings(capacity_bytes=3 * 10 * HIDDEN * 4)
    for key in "abcd":
        held.put(key, [image(ord(key), 10)])
    with pytest.raises(LookupError):
        held.get("a")  # the oldest, past the bound
    assert [held.get(k)[0].content_hash for k in "bcd"] == [ord(k).to_bytes(16, "little") for k in "bcd"]
    assert held.bytes == 3 * 10 * HIDDEN * 4


def test_a_frame_of_more_rows_than_a_frame_carries_is_refused(monkeypatch):
    monkeypatch.setattr(embeddings, "FRAME_BYTES", 4 * HIDDEN * 4)  # 4 rows of float32 a frame
    receiver = EmbeddingReceiver(HIDDEN, max_rows=100, lease_s=30)
    img = image(11, 10)
    tid = reserved(receiver, img)
    receiver.admit_frame(rows_frame(tid, 0, img, 0, 4)[0])
    with pytest.raises(TransferError, match="more than a frame carries"):
        receiver.admit_frame(rows_frame(tid, 0, img, 0, 6)[0])


def test_reservations_in_flight_are_bounded():
    receiver = EmbeddingReceiver(HIDDEN, max_rows=100, lease_s=30)
    for i in range(embeddings.MAX_IN_FLIGHT):
        reserved(receiver, image(i, 2), transfer_id=f"{EMBEDDINGS_PREFIX}{i}")
    with pytest.raises(TransferError, match="in flight"):
        reserved(receiver, image(99, 2), transfer_id=f"{EMBEDDINGS_PREFIX}one-more")
    receiver.abort(f"{EMBEDDINGS_PREFIX}0", "done with it")
    receiver.abort(f"{EMBEDDINGS_PREFIX}0", "twice: nothing")
    reserved(receiver, image(99, 2), transfer_id=f"{EMBEDDINGS_PREFIX}one-more")


def test_the_encoder_lets_go_of_a_restarted_workers_old_address():
    """A receiving worker that restarted listens elsewhere: the sending half forgets the old address."""
    images = [image(12, 3)]
    sender = EmbeddingSender(TransferSettings(transport="tcp", host="127.0.0.1"), node_id="node")
    forgotten: list[str] = []
    listening = []
    try:
        for attempt in range(2):
            receiver = EmbeddingReceiver(HIDDEN, max_rows=100, lease_s=30)
            listening.append(start_receiver("tcp", receiver, "127.0.0.1"))
            lease = dataclasses.replace(receiver.reserve(f"{EMBEDDINGS_PREFIX}{attempt}", "r", (images[0].spec,)),
                                        addresses={"tcp": listening[-1].address}, node_id="node", worker_id="w")
            sender.send(lease, images, timeout_s=30)
            assert torch.equal(receiver.take(lease.transfer_id)[0].embeddings, images[0].embeddings)
            if attempt == 0:
                sender._transports["tcp"].forget = forgotten.append  # what the sender lets go of, recorded
                listening[0].stop()  # the worker restarts: a new receiver, a new address
        assert forgotten == [listening[0].address]
    finally:
        sender.close()
        listening[-1].stop()
