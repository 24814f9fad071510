"""The receiving side of the handoff on a real engine: frames land in the reserved blocks, a decode-side
prefix hit is not sent, a corrupt frame is asked for again, and every failure path frees the reservation."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace

import pytest
import torch
from helpers import TEST_PRESETS, random_prompts
from helpers import assert_pool_idle, run_all, wait_until
from kv_helpers import synthetic_tables

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.engine_loop import EngineLoop
from pdserve.kv_transfer.codecs import make_codec, offers
from pdserve.kv_transfer.interface import CorruptFrame, FrameHeader, KVMemoryFull, TransferError
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.frames import FrameCutter, LevelController, LevelSizes, make_frame
from pdserve.kv_transfer.transports.p2p import P2PReceiver, P2PSender
from pdserve.kv_transfer.state import IllegalTransition, Transfer, TransferState

ARCH = "tiny-llama"
GREEDY = SamplingParams.greedy(max_tokens=6, ignore_eos=True)


@pytest.fixture()
def sides(model_dirs):
    """A prefill engine holding one prefilled request, and a decode engine behind a receiver."""
    prefill = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=8 * 2**20))
    decode = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=8 * 2**20))
    outputs = []
    loop = EngineLoop(decode, outputs.extend).start()
    yield prefill, decode, KVReceiver(loop, lease_s=0.2), outputs
    loop.stop()


def send_layer(receiver, prefill, request_id, layer, first_token=0, transfer_id="t1", corrupt=False, level=0):
    """Send one layer's KV of the held request from `first_token` on as one raw frame (`corrupt`: its
    checksum wrong; `level`: what its header says, raw having only 0)."""
    seq = prefill.requests[request_id]
    slots = prefill.kv_cache.token_slots(seq.block_table, first_token, seq.num_computed_tokens - first_token)
    payload = memoryview(make_codec("raw", None, prefill.kv_layout).encode(
        prefill.kv_cache.read_tokens(layer, slots), layer)).cast("B")
    header, payload = make_frame(transfer_id, layer, first_token, len(slots), "raw", level, payload, None)
    receiver.receive_frame(replace(header, crc32=header.crc32 ^ int(corrupt)), payload)


def wait_finished(outputs):
    deadline = time.time() + 10
    while not any(o.finished for o in outputs) and time.time() < deadline:
        time.sleep(0.01)
    return next(o for o in outputs if o.finished)


def prefilled(prefill: LLMEngine, prompt: list[int]) -> str:
    request_id = prefill.add_request(prompt, GREEDY, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    return request_id


def reserve(receiver, prefill, request_id, transfer_id="t1"):
    handoff = prefill.export_handoff(request_id)
    return handoff, receiver.reserve(transfer_id, request_id, handoff.prompt_token_ids, handoff.params,
                                     handoff.num_computed_tokens)


def test_a_full_handoff_commits_and_decodes(sides, hf_reference):
    prefill, decode, receiver, outputs = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 40, 40, seed=1)[0]
    request_id = prefilled(prefill, prompt)
    handoff, lease = reserve(receiver, prefill, request_id)
    assert lease.num_blocks == 3 and lease.cached_blocks == 0
    for layer in range(decode.kv_layout.num_layers):
        send_layer(receiver, prefill, request_id, layer)
    assert receiver.commit("t1", handoff) == []
    prefill.release(request_id)
    assert wait_finished(outputs).token_ids == hf_reference[ARCH].greedy(prompt, 6)
    assert_pool_idle(decode)


def test_a_prefix_the_decode_side_holds_is_not_sent(sides, hf_reference):
    prefill, decode, receiver, outputs = sides
    first = random_prompts(1, hf_reference[ARCH].vocab_size, 40, 40, seed=6)[0]
    receiver.loop.call(lambda e: e.add_request(first, GREEDY, "warm"))  # computes and caches 2 full blocks
    wait_finished(outputs)
    outputs.clear()
    prompt = first[:32] + random_prompts(1, hf_reference[ARCH].vocab_size, 20, 20, seed=7)[0]
    request_id = prefilled(prefill, prompt)
    handoff, lease = reserve(receiver, prefill, request_id)
    assert (lease.num_blocks, lease.cached_blocks) == (4, 2)
    with pytest.raises(TransferError, match="outside"):  # a frame for cached tokens would overwrite shared blocks
        send_layer(receiver, prefill, request_id, 0, first_token=16, transfer_id="t1")
    handoff, lease = reserve(receiver, prefill, request_id, transfer_id="t2")
    for layer in range(decode.kv_layout.num_layers):
        send_layer(receiver, prefill, request_id, layer, first_token=32, transfer_id="t2")
    assert receiver.commit("t2", handoff) == []
    assert wait_finished(outputs).token_ids == hf_reference[ARCH].greedy(prompt, 6)
    prefill.release(request_id)


def test_kv_that_came_through_a_lossy_codec_never_enters_the_prefix_cache(sides, hf_reference):
    """Another request sharing the prefix must not take int8-rounded KV for exact KV."""
    prefill, decode, receiver, outputs = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 40, 40, seed=8)[0]
    request_id = prefilled(prefill, prompt)
    handoff = prefill.export_handoff(request_id)
    lease = receiver.reserve("t1", request_id, handoff.prompt_token_ids, handoff.params,
                             handoff.num_computed_tokens, codecs=["int8"])
    assert lease.codec == "int8"
    int8 = make_codec("int8", None, prefill.kv_layout)
    seq = prefill.requests[request_id]
    for layer in range(decode.kv_layout.num_layers):
        slots = prefill.kv_cache.token_slots(seq.block_table, 0, seq.num_computed_tokens)
        payload = int8.encode(prefill.kv_cache.read_tokens(layer, slots), layer)
        receiver.receive_frame(*make_frame("t1", layer, 0, len(slots), "int8", 0, payload, None))
    assert receiver.commit("t1", handoff) == []
    wait_finished(outputs)
    prefill.release(request_id)
    again = receiver.reserve("t2", "again", prompt, GREEDY, len(prompt))
    assert again.cached_blocks == 0  # nothing of the lossy request was cached
    receiver.abort("t2", "done")


def test_a_corrupt_frame_is_dropped_and_its_layer_reported_incomplete(sides, hf_reference):
    prefill, decode, receiver, outputs = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=2)[0]
    request_id = prefilled(prefill, prompt)
    handoff, _ = reserve(receiver, prefill, request_id)
    with pytest.raises(CorruptFrame, match="checksum mismatch"):
        send_layer(receiver, prefill, request_id, 0, corrupt=True)
    send_layer(receiver, prefill, request_id, 1)
    assert receiver.commit("t1", handoff) == [0] and receiver.counters["corrupt_frames"] == 1
    send_layer(receiver, prefill, request_id, 0)  # sent again: now complete
    assert receiver.commit("t1", handoff) == []
    assert wait_finished(outputs).token_ids == hf_reference[ARCH].greedy(prompt, 6)
    prefill.release(request_id)


def test_a_frame_intact_on_the_wire_that_does_not_decode_is_dropped_as_corrupt(sides, hf_reference):
    """Its checksum holds (the sender checksummed what it sent), but raw has no level 1: the frame is
    dropped and counted as a damaged one is, so its layer is sent again (and, failing that, recomputed);
    the transfer is not aborted under the sender, whose commit would then find nothing to commit."""
    prefill, decode, receiver, outputs = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=56)[0]
    request_id = prefilled(prefill, prompt)
    handoff, _ = reserve(receiver, prefill, request_id)
    seq = prefill.requests[request_id]
    slots = prefill.kv_cache.token_slots(seq.block_table, 0, 30)
    kv = make_codec("raw", None, prefill.kv_layout).encode(prefill.kv_cache.read_tokens(0, slots), 0)
    with pytest.raises(CorruptFrame, match="level 1"):
        receiver.receive_frame(*make_frame("t1", 0, 0, 30, "raw", 1, kv, None))
    assert receiver.counters["corrupt_frames"] == 1 and receiver.num_in_flight == 1
    send_layer(receiver, prefill, request_id, 1)
    assert receiver.commit("t1", handoff) == [0]
    send_layer(receiver, prefill, request_id, 0)  # sent again: now complete
    assert receiver.commit("t1", handoff) == []
    assert wait_finished(outputs).token_ids == hf_reference[ARCH].greedy(prompt, 6)
    prefill.release(request_id)


@pytest.mark.parametrize("fault", ["raises", "wrong shape"])
def test_a_frame_its_codec_fails_on_is_dropped_as_corrupt_and_the_codec_refused_from_then_on(
        sides, hf_reference, monkeypatch, fault):
    """A codec's own bug (an exception that is no CorruptFrame, or KV of the wrong shape) on an intact
    frame: dropped and counted as a frame that does not decode, the transfer left open, so the layer is
    sent again (recomputed at worst), instead of the exception ending the transport's stream; and the
    codec is refused from then on, so later transfers go raw instead of each paying for it again."""
    prefill, decode, receiver, outputs = sides
    int8 = make_codec("int8", None, prefill.kv_layout)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=57)[0]
    request_id = prefilled(prefill, prompt)
    handoff = prefill.export_handoff(request_id)
    lease = receiver.reserve("t1", request_id, handoff.prompt_token_ids, handoff.params, len(prompt),
                             codecs=offers({"int8": int8}))
    assert lease.codec == "int8"
    agreed = receiver._get("t1").codec
    decode_intact = agreed.decode

    def broken(payload, layer, *args):
        if fault == "raises":
            raise IndexError("index 7 is out of bounds for axis 0 with size 7")
        return decode_intact(payload, layer, *args)[:, 1:]

    monkeypatch.setattr(agreed, "decode", broken)
    seq = prefill.requests[request_id]
    kv = prefill.kv_cache.read_tokens(0, prefill.kv_cache.token_slots(seq.block_table, 0, len(prompt)))
    with pytest.raises(CorruptFrame, match="IndexError" if fault == "raises" else "shape"):
        receiver.receive_frame(*make_frame("t1", 0, 0, len(prompt), "int8", 0, int8.encode(kv, 0), None))
    assert receiver.counters["corrupt_frames"] == 1 and receiver.num_in_flight == 1
    assert receiver.negotiate(offers({"int8": int8})).name == "raw"
    for layer in range(1, decode.kv_layout.num_layers):
        send_layer(receiver, prefill, request_id, layer)  # raw frames: every transfer takes them
    assert receiver.commit("t1", handoff) == [0]
    send_layer(receiver, prefill, request_id, 0)  # sent again: now complete
    assert receiver.commit("t1", handoff) == []
    assert wait_finished(outputs).token_ids == hf_reference[ARCH].greedy(prompt, 6)
    prefill.release(request_id)


@pytest.mark.parametrize("damage", [dict(layer=1), dict(start_token=16), dict(level=1), dict(codec="int8"),
                                    dict(transfer_id="t2")], ids=lambda d: next(iter(d)))
def test_a_frame_whose_header_was_damaged_is_dropped_as_corrupt(sides, hf_reference, damage):
    """Frames of 16 tokens: each damaged field but the codec and the id still names something this
    transfer could take (tokens [0, 16) of layer 0 as layer 1's, or as tokens [16, 32), or at level
    1), so only the checksum covering the header keeps good KV out of the wrong place; a damaged codec
    or transfer id is caught as damage too, to be sent again, not as a refusal that ends the transfer."""
    prefill, decode, receiver, outputs = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 32, 32, seed=10)[0]
    request_id = prefilled(prefill, prompt)
    handoff, _ = reserve(receiver, prefill, request_id)
    seq = prefill.requests[request_id]
    raw = make_codec("raw", None, prefill.kv_layout)
    frames = []
    for layer in range(decode.kv_layout.num_layers):
        for start in (0, 16):
            slots = prefill.kv_cache.token_slots(seq.block_table, start, 16)
            kv = raw.encode(prefill.kv_cache.read_tokens(layer, slots), layer)
            frames.append(make_frame("t1", layer, start, 16, "raw", 0, kv, None))
    header, payload = frames[0]
    with pytest.raises(CorruptFrame, match="checksum mismatch"):
        receiver.receive_frame(replace(header, **damage), payload)
    assert receiver.counters["corrupt_frames"] == 1 and receiver.counters["frames"] == 0
    for header, payload in frames:
        receiver.receive_frame(header, payload)
    assert receiver.commit("t1", handoff) == []
    assert wait_finished(outputs).token_ids == hf_reference[ARCH].greedy(prompt, 6)
    prefill.release(request_id)


def test_cachegen_is_agreed_only_between_workers_holding_the_same_tables(sides, tmp_path):
    """Tables profiled apart (here: on other calibration KV) would decode every frame wrong without an
    error, so a prefill worker's offer (`offers` of its codecs) carries their digest and the decode
    side takes cachegen only when its own tables match; an offer without one (which tables, nobody
    knows) is refused too."""
    prefill, decode, receiver, _ = sides
    layout = decode.kv_layout
    receiver.model_dir = synthetic_tables(tmp_path / "decode", layout)
    same = make_codec("cachegen", synthetic_tables(tmp_path / "same", layout), layout)
    other = make_codec("cachegen", synthetic_tables(tmp_path / "other", layout, seed=200), layout)
    int8 = make_codec("int8", None, layout)
    assert same.digest == make_codec("cachegen", receiver.model_dir, layout).digest != other.digest
    assert offers({"cachegen": same, "int8": int8}) == [f"cachegen@{same.digest}", "int8"]
    assert receiver.negotiate(offers({"cachegen": other, "int8": int8})).name == "int8"
    assert receiver.negotiate(offers({"cachegen": other})).name == "raw"
    assert receiver.negotiate(["cachegen"]).name == "raw"
    agreed = receiver.negotiate(offers({"cachegen": same, "int8": int8}))
    assert agreed.name == "cachegen" and agreed.digest == same.digest


def test_frames_on_a_device_go_through_the_nccl_path_into_the_blocks(sides, hf_reference):
    """NCCL's code path with gloo on the CPU standing in for the GPUs: the sender keeps raw KV where
    the cache is (no host copy), frames travel as tensors in lockstep and are checksummed where they
    live, the receiver decodes the received tensor in place; a damaged one is caught."""
    prefill, decode, receiver, outputs = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 45, 45, seed=9)[0]
    request_id = prefilled(prefill, prompt)
    handoff, lease = reserve(receiver, prefill, request_id)
    cpu = torch.device("cpu")
    receiving = P2PReceiver(receiver, "gloo", device=cpu)
    sending = P2PSender("gloo", device=cpu)
    try:
        channel = sending.open(receiving.address, "t1")
        raw = make_codec("raw", None, prefill.kv_layout)
        outgoing = FrameCutter("t1", channel, LevelController(raw, LevelSizes({}), 1e9, None), prefill.kv_cache,
                                    0, len(prompt), frame_tokens=32)
        seq = prefill.requests[request_id]
        for layer in range(decode.kv_layout.num_layers):
            outgoing.send_through(layer, seq.block_table, len(prompt))
        channel.finish(timeout=30)
        channel.close()
        assert outgoing.frames_sent == 2 * decode.kv_layout.num_layers and receiver.counters["corrupt_frames"] == 0
        layout = decode.kv_layout
        zeros = torch.zeros(2, 32, layout.num_kv_heads, layout.head_dim)
        header, payload = make_frame("t1", 0, 0, 32, "raw", 0, raw.encode(zeros, 0), cpu)
        payload[7] ^= 1  # damaged on the way
        with pytest.raises(CorruptFrame, match="checksum mismatch"):
            receiver.receive_frame(header, payload)
    finally:
        sending.close()
        receiving.stop()
    assert receiver.commit("t1", handoff) == []
    assert wait_finished(outputs).token_ids == hf_reference[ARCH].greedy(prompt, 6)
    prefill.release(request_id)


class DirectChannel:
    """A channel that hands each frame straight to the receiver as it travels: host bytes, or a tensor
    on `device` (the CUDA ends of the NCCL path without its wire: NCCL refuses two ranks on one GPU,
    and its wire is tested on two)."""

    def __init__(self, receive, device: torch.device | None = None) -> None:
        self.receive, self.device, self.bytes_sent = receive, device, 0

    def send(self, header: FrameHeader, payload) -> None:
        if self.device is not None and self.device.type == "cuda":
            assert payload.is_cuda  # raw KV bound for a GPU never goes through the host
            # Handed on from the default stream once the frame is whole (the sender made it on its
            # side stream), as a shm or gRPC thread would: the receiver takes it on a stream of its
            # own. Done with it before it is freed.
            torch.cuda.current_stream(self.device).synchronize()
            default = torch.cuda.default_stream(self.device)
            with torch.cuda.stream(default):
                self.receive(header, payload)
            default.synchronize()
        else:
            self.receive(header, payload)
        self.bytes_sent += header.payload_bytes


def hand_off(prefill: LLMEngine, receiver: KVReceiver, prompt: list[int], transfer_id: str, codec: str = "raw",
             device: torch.device | None = None) -> tuple[int, int]:
    """Prefill `prompt`, reserve on the decode side offering `codec`, send each layer what the decode
    side lacks, commit. Returns (tokens the decode side held already, payload bytes sent)."""
    request_id = prefilled(prefill, prompt)
    handoff = prefill.export_handoff(request_id)
    lease = receiver.reserve(transfer_id, request_id, handoff.prompt_token_ids, handoff.params,
                             handoff.num_computed_tokens, codecs=[codec])
    assert lease.codec == codec
    held = lease.cached_blocks * prefill.kv_layout.block_size
    channel = DirectChannel(receiver.receive_frame, device)
    chosen = make_codec(codec, None, prefill.kv_layout)
    outgoing = FrameCutter(transfer_id, channel, LevelController(chosen, LevelSizes({}), 1e9, None),
                                prefill.kv_cache, held, len(prompt), frame_tokens=32)
    for layer in range(prefill.kv_layout.num_layers):
        outgoing.send_through(layer, prefill.requests[request_id].block_table, len(prompt))
    assert receiver.commit(transfer_id, handoff) == [] and receiver.counters["corrupt_frames"] == 0
    prefill.release(request_id)
    return held, channel.bytes_sent


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_kv_a_scaled_codec_cannot_carry_travels_raw_and_exact(sides, hf_reference, codec):
    """A token whose KV holds inf or NaN has no absmax to scale by: the frames holding one go raw,
    so they land exactly as they are (not as a token of garbage), and every other frame in the
    agreed codec."""
    prefill, decode, receiver, outputs = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 64, 64, seed=10)[0]
    request_id = prefilled(prefill, prompt)
    handoff = prefill.export_handoff(request_id)
    receiver.reserve("t1", request_id, handoff.prompt_token_ids, handoff.params, len(prompt), codecs=[codec])
    seq, layers = prefill.requests[request_id], prefill.kv_layout.num_layers
    slots = prefill.kv_cache.token_slots(seq.block_table, 0, len(prompt))
    poisoned = prefill.kv_cache.read_tokens(1, slots)
    poisoned[0, 3, 0, 1], poisoned[1, 40, 0, 0] = float("inf"), float("nan")  # frames [0, 32) and [32, 64)
    prefill.kv_cache.write_tokens(1, slots, poisoned)
    headers = []
    channel = DirectChannel(lambda header, payload: (headers.append(header), receiver.receive_frame(header, payload)))
    outgoing = FrameCutter("t1", channel, LevelController(make_codec(codec, None, prefill.kv_layout),
                                                               LevelSizes({}), 1e9, None),
                                prefill.kv_cache, 0, len(prompt), frame_tokens=32)
    for layer in range(layers):
        outgoing.send_through(layer, seq.block_table, len(prompt))
    assert [(h.layer, h.codec) for h in headers] == [(layer, "raw" if layer == 1 else codec)
                                                     for layer in range(layers) for _ in range(2)]
    arrived = decode.kv_cache.read_tokens(1, decode.kv_cache.token_slots(
        receiver._get("t1").reservation.block_ids, 0, len(prompt)))
    torch.testing.assert_close(arrived, poisoned, rtol=0, atol=0, equal_nan=True)
    receiver.abort("t1", "done")
    prefill.release(request_id)


@pytest.mark.parametrize("arch", TEST_PRESETS)
def test_every_family_hands_off_exactly_sends_only_the_missing_prefix_and_takes_lossy_codecs(
        model_dirs, hf_reference, arch):
    """Sliding windows, local/global layers, QKV biases, norms after attention: the KV that travels is
    whatever each family's layers cache, and raw KV gives transformers' own greedy output."""
    config = EngineConfig(kv_memory_bytes=8 * 2**20)
    prefill, decode = LLMEngine(model_dirs[arch], config), LLMEngine(model_dirs[arch], config)
    outputs = []
    loop = EngineLoop(decode, outputs.extend).start()
    receiver = KVReceiver(loop, lease_s=5.0)
    vocab = hf_reference[arch].vocab_size
    first, rest = random_prompts(2, vocab, 40, 40, seed=21)
    try:
        for i, prompt in enumerate((first, first[:32] + rest)):  # the second starts with two blocks the first left
            held, sent = hand_off(prefill, receiver, prompt, f"raw{i}")
            layout = prefill.kv_layout
            assert (held, sent) == (32 * i, (len(prompt) - 32 * i) * layout.bytes_per_block // layout.block_size)
            assert wait_finished(outputs).token_ids == hf_reference[arch].greedy(prompt, 6)
            outputs.clear()
        for codec in ("int8", "fp8"):
            hand_off(prefill, receiver, rest, codec, codec=codec)
            assert len(wait_finished(outputs).token_ids) == 6
            outputs.clear()
    finally:
        loop.stop()
    assert_pool_idle(prefill)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_raw_kv_goes_from_cache_to_cache_and_decodes_exactly(model_dirs, hf_reference):
    """Prefill and decode engines on CUDA: each layer's KV is read out on the side stream as a tensor
    on the GPU, checksummed and decoded there; the output is that of a colocated run on the GPU."""
    config = EngineConfig(device="cuda", kv_memory_bytes=64 * 2**20)
    prefill, decode, colocated = (LLMEngine(model_dirs[ARCH], config) for _ in range(3))
    prompts = random_prompts(4, hf_reference[ARCH].vocab_size, 20, 400, seed=11)
    want = [run_all(colocated, [p], GREEDY)[0].token_ids for p in prompts]  # one at a time, as handed off
    outputs = []
    loop = EngineLoop(decode, outputs.extend).start()
    receiver = KVReceiver(loop, lease_s=5.0)
    try:
        for i, prompt in enumerate(prompts):
            hand_off(prefill, receiver, prompt, f"t{i}", device=decode.kv_cache.data.device)
            assert wait_finished(outputs).token_ids == want[i]
            outputs.clear()
    finally:
        loop.stop()
    assert_pool_idle(prefill)


def test_a_request_whose_kv_never_arrives_is_recomputed_from_its_tokens(sides, hf_reference):
    prefill, decode, receiver, outputs = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 20, 20, seed=3)[0]
    request_id = prefilled(prefill, prompt)
    handoff, _ = reserve(receiver, prefill, request_id)
    assert receiver.commit("t1", handoff) == [0, 1]
    assert receiver.commit("t1", handoff, recompute=True) == []
    assert receiver.counters["recomputed"] == 1
    out = wait_finished(outputs)
    assert out.token_ids == hf_reference[ARCH].greedy(prompt, 6)  # the first token once, then the rest
    prefill.release(request_id)
    assert_pool_idle(decode)


def test_a_frame_after_an_abort_is_refused(sides, hf_reference):
    prefill, decode, receiver, _ = sides
    request_id = prefilled(prefill, random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=8)[0])
    reserve(receiver, prefill, request_id)
    receiver.abort("t1", "cancelled")
    with pytest.raises(TransferError, match="no open transfer"):
        send_layer(receiver, prefill, request_id, 0)
    assert receiver.loop.call(lambda e: (len(e.requests), e.num_free_blocks)) == (0, decode.pool.num_blocks)


def test_lease_expiry_frees_the_reservation(sides, hf_reference):
    prefill, decode, receiver, _ = sides
    request_id = prefilled(prefill, random_prompts(1, hf_reference[ARCH].vocab_size, 50, 50, seed=4)[0])
    reserve(receiver, prefill, request_id)
    assert receiver.loop.call(lambda e: e.num_free_blocks) < decode.pool.num_blocks
    assert receiver.expire_leases(now=time.monotonic()) == []  # not yet
    assert receiver.expire_leases(now=time.monotonic() + 1.0) == ["t1"]
    assert receiver.num_in_flight == 0
    assert receiver.loop.call(lambda e: e.num_free_blocks) == decode.pool.num_blocks
    assert not receiver.abort("t1", "again")  # idempotent


def test_a_step_of_the_wall_clock_expires_no_lease(sides, hf_reference, monkeypatch):
    """Leases run on the monotonic clock: the wall clock set an hour ahead (NTP, a VM resumed) must
    not end every transfer under way."""
    prefill, decode, receiver, _ = sides
    request_id = prefilled(prefill, random_prompts(1, hf_reference[ARCH].vocab_size, 50, 50, seed=14)[0])
    reserve(receiver, prefill, request_id)
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 3600)
    assert receiver.expire_leases() == [] and receiver.num_in_flight == 1
    monkeypatch.undo()
    assert receiver.abort("t1", "the test is over")


def fill_pool(receiver, decode) -> list:
    """Reserve until another 1000-token reservation no longer fits."""
    held = []
    while receiver.loop.call(lambda e: e.num_free_blocks) >= 1000 // decode.config.block_size + 1:
        held.append(receiver.reserve(f"t{len(held)}", f"r{len(held)}", [5] * 1000, GREEDY, 1000))
    return held


def test_a_prompt_the_decode_engine_refuses_is_a_valueerror_the_requests_fault_and_holds_nothing(sides):
    """The engine's ValueError (a token outside the vocabulary here) travels as such, so the prefill
    worker reports INVALID_ARGUMENT, which no retry elsewhere would cure, not UNAVAILABLE."""
    _, decode, receiver, _ = sides
    prompt = [decode.vocab_size + 5] * 20
    with pytest.raises(ValueError, match="prompt token ids must be"):
        receiver.reserve("t1", "r1", prompt, GREEDY, len(prompt))
    assert receiver.num_in_flight == 0
    assert_pool_idle(decode)


def test_reserve_waits_a_bounded_time_then_says_memory_is_full(sides):
    _, decode, receiver, _ = sides
    receiver.reserve_wait_s = 0.3
    held = fill_pool(receiver, decode)
    t0 = time.monotonic()
    with pytest.raises(KVMemoryFull, match="stayed full for 0.3 s: request 'big' needs 63 KV blocks"):
        receiver.reserve("big-t", "big", [5] * 1000, GREEDY, 1000)
    assert 0.3 <= time.monotonic() - t0 < 5
    for lease in held:
        receiver.abort(lease.transfer_id, "test over")
    assert receiver.num_in_flight == 0
    assert receiver.loop.call(lambda e: e.num_free_blocks) == decode.pool.num_blocks


def test_a_waiting_reservation_is_granted_when_blocks_free_up(sides):
    _, decode, receiver, _ = sides
    receiver.reserve_wait_s = 10
    held = fill_pool(receiver, decode)
    release = threading.Timer(0.3, receiver.abort, args=(held[0].transfer_id, "make room"))
    release.start()
    t0 = time.monotonic()
    lease = receiver.reserve("big-t", "big", [5] * 1000, GREEDY, 1000)
    assert 0.2 < time.monotonic() - t0 < 5 and lease.num_blocks == 63
    release.join()
    for lease in held[1:] + [lease]:
        receiver.abort(lease.transfer_id, "test over")
    assert receiver.loop.call(lambda e: e.num_free_blocks) == decode.pool.num_blocks


def test_a_waiting_reservation_tries_again_when_blocks_free_not_at_every_engine_pass(sides):
    """Each try hashes the prompt and looks its prefix up on the engine loop, between steps: with many
    reservations waiting, at every pass of the loop (each step, each idle wait) that was milliseconds
    of every step. Nothing freed, it tries again only every RESERVE_RETRY_S."""
    from pdserve.kv_transfer import receiver as receiver_module

    _, decode, receiver, _ = sides
    receiver.reserve_wait_s = 0.8
    held = fill_pool(receiver, decode)
    tries, begin_import = [], decode.begin_import

    def counted(*args):
        tries.append(time.monotonic())
        return begin_import(*args)

    decode.begin_import = counted
    busy = threading.Event()
    ticking = threading.Thread(target=lambda: [receiver.loop.call(lambda e: None) for _ in range(400)
                                               if not busy.wait(0.002)])  # the loop passes, as steps would
    ticking.start()
    try:
        with pytest.raises(KVMemoryFull):
            receiver.reserve("big-t", "big", [5] * 1000, GREEDY, 1000)
    finally:
        busy.set()
        ticking.join(10)
    assert len(tries) <= 0.8 / receiver_module.RESERVE_RETRY_S + 2, len(tries)
    del decode.begin_import
    for lease in held:
        receiver.abort(lease.transfer_id, "test over")
    assert receiver.loop.call(lambda e: e.num_free_blocks) == decode.pool.num_blocks


def test_a_reservation_waiting_for_blocks_ends_when_its_transfer_is_aborted(sides):
    """The prefill side gives up on a transfer whose reservation waits for room (its request ended at
    its first token): the abort names the transfer, not the request, and the wait ends at once."""
    _, decode, receiver, _ = sides
    receiver.reserve_wait_s = 10
    held = fill_pool(receiver, decode)
    abort = threading.Timer(0.3, receiver.abort, args=("big-t", "done at its first token"))
    abort.start()
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="was aborted"):
        receiver.reserve("big-t", "big", [5] * 1000, GREEDY, 1000)
    assert time.monotonic() - t0 < 3
    abort.join()
    for lease in held:
        receiver.abort(lease.transfer_id, "test over")
    assert receiver.num_in_flight == 0
    assert receiver.loop.call(lambda e: e.num_free_blocks) == decode.pool.num_blocks


def test_an_abort_that_overtakes_its_reservation_wins(sides):
    _, decode, receiver, _ = sides
    assert not receiver.abort_request("early", "cancelled before the reservation arrived")
    with pytest.raises(TransferError, match="was aborted"):
        receiver.reserve("t-early", "early", [5] * 40, GREEDY, 40)
    assert receiver.num_in_flight == 0
    assert receiver.loop.call(lambda e: (len(e.requests), e.num_free_blocks)) == (0, decode.pool.num_blocks)


def test_an_abort_landing_while_its_reservation_is_made_wins(sides):
    """The abort finds no reservation yet and records its tombstone just as `reserve` inserts its
    entry and looks for one: whichever comes first, the reservation ends aborted, nothing held."""
    _, decode, receiver, _ = sides
    tombstones, outcome = receiver.aborted, []

    class ReserveInBetween:  # runs `reserve` on another thread at the moment the abort adds its tombstone
        def add(self, transfer_id):
            def reserve():
                try:
                    outcome.append(receiver.reserve(transfer_id, "r-late", [5] * 40, GREEDY, 40))
                except TransferError as e:
                    outcome.append(e)
            thread = threading.Thread(target=reserve)
            thread.start()
            thread.join(1.0)  # the reservation completes here unless the abort holds the receiver's lock
            tombstones.add(transfer_id)
            self.thread = thread

        def __contains__(self, key):
            return key in tombstones

    receiver.aborted = in_between = ReserveInBetween()
    assert not receiver.abort("t-late", "cancelled")
    in_between.thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], TransferError), outcome
    assert receiver.num_in_flight == 0
    assert receiver.loop.call(lambda e: (len(e.requests), e.num_free_blocks)) == (0, decode.pool.num_blocks)


def test_a_recompute_commit_overtaken_by_an_abort_does_not_revive_the_request(sides, hf_reference):
    """An abort (a cancel, lease expiry) lands after the commit found its transfer and before it takes
    it out: the commit fails instead of recomputing a request whose blocks the abort freed."""
    prefill, decode, receiver, outputs = sides
    request_id = prefilled(prefill, random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=9)[0])
    handoff, _ = reserve(receiver, prefill, request_id)
    found = receiver._get

    def found_then_aborted(transfer_id):
        incoming = found(transfer_id)
        receiver.abort(transfer_id, "cancelled")
        return incoming

    receiver._get = found_then_aborted
    with pytest.raises(TransferError, match="aborted while committing"):
        receiver.commit("t1", handoff, recompute=True)
    assert receiver.counters["recomputed"] == 0
    time.sleep(0.3)  # a revived request would be decoding by now
    assert receiver.loop.call(lambda e: (len(e.requests), e.num_free_blocks)) == (0, decode.pool.num_blocks)
    assert not outputs
    prefill.release(request_id)


def test_a_cancel_after_the_commit_took_its_transfer_out_is_not_undone(sides, hf_reference):
    """The router's cancel lands after the commit took the transfer out and before the engine admits
    the request: it finds no transfer, leaves its tombstone and aborts on the engine first; the
    commit then refuses, instead of admitting (reviving) a request nobody waits for."""
    prefill, decode, receiver, outputs = sides
    request_id = prefilled(prefill, random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=10)[0])
    handoff, _ = reserve(receiver, prefill, request_id)
    loop = receiver.loop

    class CancelFirst:  # the engine loop, with the cancel (as the decode worker runs it) queued first
        def __getattr__(self, name):
            return getattr(loop, name)

        def call(self, command, **kwargs):
            receiver.loop = loop
            assert not receiver.abort_request(request_id, "cancelled")  # the transfer is out already
            loop.call(lambda e: e.abort_request(request_id))
            return loop.call(command, **kwargs)

    receiver.loop = CancelFirst()
    with pytest.raises(TransferError, match="was aborted"):
        receiver.commit("t1", handoff, recompute=True)
    time.sleep(0.3)  # a revived request would be decoding by now
    assert loop.call(lambda e: (len(e.requests), e.num_free_blocks)) == (0, decode.pool.num_blocks)
    assert not outputs
    prefill.release(request_id)


def test_a_commit_waits_for_a_frame_being_written(sides, hf_reference):
    """A resent frame is still being written when the commit comes: the commit hands the blocks to the
    engine only after that write (the engine may reuse them at once: a commit that fails frees them),
    and a frame after the commit is refused."""
    prefill, decode, receiver, outputs = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 40, 40, seed=13)[0]
    request_id = prefilled(prefill, prompt)
    handoff, _ = reserve(receiver, prefill, request_id)
    for layer in range(decode.kv_layout.num_layers):
        send_layer(receiver, prefill, request_id, layer)
    writing, finish_write = threading.Event(), threading.Event()
    write_tokens = receiver.kv_cache.write_tokens

    def slow_write(*args):
        writing.set()
        assert finish_write.wait(10)
        write_tokens(*args)

    receiver.kv_cache.write_tokens = slow_write
    resend = threading.Thread(target=send_layer, args=(receiver, prefill, request_id, 0))
    resend.start()
    assert writing.wait(10)
    committed = []
    commit = threading.Thread(target=lambda: committed.append(receiver.commit("t1", handoff)))
    commit.start()
    commit.join(0.5)
    assert commit.is_alive() and not committed  # waiting for the write, not admitting beside it
    finish_write.set()
    resend.join(10)
    commit.join(10)
    assert committed == [[]]
    receiver.kv_cache.write_tokens = write_tokens
    with pytest.raises(TransferError, match="no open transfer"):  # and none is written after the commit
        send_layer(receiver, prefill, request_id, 1)
    prefill.release(request_id)
    assert wait_finished(outputs).token_ids == hf_reference[ARCH].greedy(prompt, 6)


@pytest.mark.parametrize("damage", [None, "checksum", "level"])
def test_layers_that_keep_arriving_renew_the_lease(sides, hf_reference, damage):
    """Each layer 0.1 s after the one before, past the reservation's 0.2 s lease: every frame that
    arrives extends the lease, and a renewal the same way. A damaged frame too (a link that damages
    every frame for longer than the lease: its sender is alive), or one intact that does not decode,
    so the commit then names those layers for a resend, and the recompute after it can come, instead
    of the lease lapsing under them."""
    prefill, decode, receiver, outputs = sides  # lease_s = 0.2
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 40, 40, seed=5)[0]
    request_id = prefilled(prefill, prompt)
    handoff, _ = reserve(receiver, prefill, request_id)
    reserved_at = time.monotonic()
    layers = list(range(decode.kv_layout.num_layers))
    for layer in layers:
        time.sleep(0.1)
        with pytest.raises(CorruptFrame) if damage else contextlib.nullcontext():
            send_layer(receiver, prefill, request_id, layer, corrupt=damage == "checksum", level=int(damage == "level"))
        # The reservation's own lease ended at reserved_at + 0.2; this layer's runs 0.2 s from now.
        assert receiver.expire_leases(now=reserved_at + 0.1 * (layer + 1) + 0.15) == []
    renewed_at = time.monotonic()
    renewed = receiver.renew("t1")  # a renewal extends it the same way
    assert renewed.lease_s == 0.2
    assert receiver.expire_leases(now=renewed_at + renewed.lease_s - 0.01) == []
    if damage:
        assert receiver.commit("t1", handoff) == layers
    assert receiver.commit("t1", handoff, recompute=damage is not None) == []
    assert wait_finished(outputs).token_ids == hf_reference[ARCH].greedy(prompt, 6)


def every_layer_delivered(sides, hf_reference, seed: int) -> tuple[list[int], str, object]:
    """A 30-token prompt prefilled, reserved as transfer t1, and every layer of it received: its
    prompt, request id and handoff."""
    prefill, decode, receiver, _ = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=seed)[0]
    request_id = prefilled(prefill, prompt)
    handoff, _ = reserve(receiver, prefill, request_id)
    for layer in range(decode.kv_layout.num_layers):
        send_layer(receiver, prefill, request_id, layer)
    return prompt, request_id, handoff


def commit_behind_a_busy_loop(receiver, handoff) -> tuple[threading.Thread, threading.Event, list]:
    """A commit of t1 on a thread (not started yet) while the engine loop is busy until the event is
    set, so its admission waits; the list gets what the commit returned, or its TransferError."""
    loop_busy, committed = threading.Event(), []
    receiver.loop.post(lambda e: loop_busy.wait(10))

    def commit() -> None:
        try:
            committed.append(receiver.commit("t1", handoff))
        except TransferError as e:
            committed.append(e)

    return threading.Thread(target=commit), loop_busy, committed


class RunOnFirstRelease:
    """A lock that runs `then` the moment it is first released (`then` may take it too)."""

    def __init__(self, lock: threading.Lock, then) -> None:
        self.lock, self.then = lock, then

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        then, self.then = self.then, None
        if then is not None:
            then()


def test_a_commit_landing_in_the_middle_of_lease_expiry_either_wins_or_loses_whole(sides, hf_reference):
    """Expiry finds the lease lapsed; a commit then takes the transfer out before expiry ends it (the
    engine loop is busy, so the commit's admission waits). Exactly one may win: a commit that fails
    must be the expiry's doing (counted, the blocks freed), never a tombstone the expiry left on a
    transfer it no longer found, while reporting that it expired nothing."""
    prefill, decode, receiver, outputs = sides
    prompt, request_id, handoff = every_layer_delivered(sides, hf_reference, seed=57)
    commit_thread, loop_busy, committed = commit_behind_a_busy_loop(receiver, handoff)

    def commit_takes_the_transfer() -> None:  # bounded: until the commit took it out, or found it gone
        commit_thread.start()
        wait_until(lambda: "t1" not in receiver._incoming or committed, timeout=5)

    receiver._lock = RunOnFirstRelease(receiver._lock, commit_takes_the_transfer)
    expired = receiver.expire_leases(now=time.monotonic() + 10)
    loop_busy.set()
    commit_thread.join(10)
    prefill.release(request_id)
    if committed == [[]]:
        assert expired == [] and wait_finished(outputs).token_ids == hf_reference[ARCH].greedy(prompt, 6)
    else:
        assert expired == ["t1"] and receiver.counters["leases_expired"] == 1, (expired, committed)
        receiver.loop.call(lambda e: None)  # the engine abort the expiry queued has run
        assert_pool_idle(decode)


class CommitOnFirstRelease:
    """A transfer's lock that lets its commit in the moment the lock is first released: a commit
    landing in the middle of whatever took it (the race at its widest)."""

    def __init__(self, transfer: Transfer) -> None:
        self.transfer, self.lock, self.armed, self.committed = transfer, threading.Lock(), True, None

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        if self.armed:
            self.armed = False  # the commit takes the lock too
            self.committed = self.transfer.advance_unless_finished(TransferState.DONE)


def test_a_failure_racing_the_commit_wins_or_loses_quietly():
    """A cancel or lease expiry fails the transfer while its commit moves it to success: one of
    them wins, and the loser is told so (False), never by an exception halfway through its cleanup
    (the prefill worker's `_finish` would leave the request's blocks held)."""
    t = Transfer("t", "r")
    t.advance(TransferState.TRANSFERRING)
    t.advance(TransferState.COMMITTING)
    t._lock = CommitOnFirstRelease(t)
    assert t.fail("cancelled") and t._lock.committed is False and t.state == TransferState.FAILED
    t = Transfer("t", "r")
    for state in (TransferState.TRANSFERRING, TransferState.COMMITTING, TransferState.DONE):
        t.advance(state)
    assert not t.fail("cancelled") and t.state == TransferState.DONE


def test_state_machine_rejects_illegal_moves():
    t = Transfer("t", "r")
    with pytest.raises(IllegalTransition):
        t.advance(TransferState.DONE)
    t.advance(TransferState.TRANSFERRING)
    with pytest.raises(IllegalTransition):
        t.advance(TransferState.DONE)  # only through COMMITTING
    assert t.fail("boom") and not t.fail("twice") and t.error == "boom"
    with pytest.raises(IllegalTransition):
        t.advance(TransferState.COMMITTING)


def test_a_commit_naming_another_request_is_refused_and_frees_the_reservation(sides, hf_reference):
    """A commit must admit the request its reservation was made for: one naming another request
    (a caller's bug) would otherwise abort that one and leave this reservation's blocks held."""
    prefill, decode, receiver, _ = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 32, 32, seed=11)[0]
    request_id = prefilled(prefill, prompt)
    handoff, _ = reserve(receiver, prefill, request_id)
    with pytest.raises(TransferError, match="not 'someone-else'"):
        receiver.commit("t1", replace(handoff, request_id="someone-else"))
    assert receiver.num_in_flight == 0
    assert wait_until(lambda: not decode.requests)  # the abort runs on the engine loop
    assert_pool_idle(decode)
    prefill.release(request_id)


def test_a_frame_cachegen_would_make_larger_than_raw_travels_raw(sides, hf_reference, tmp_path):
    """KV far outside the range the tables were profiled on costs CacheGen an escape per value (4
    bytes on top of its symbol): a frame that would come out larger than raw goes raw, exact; the
    others in cachegen."""
    prefill, decode, receiver, _ = sides
    layout = prefill.kv_layout
    receiver.model_dir = synthetic_tables(tmp_path, layout)
    cachegen = make_codec("cachegen", receiver.model_dir, layout)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 64, 64, seed=12)[0]
    request_id = prefilled(prefill, prompt)
    handoff = prefill.export_handoff(request_id)
    receiver.reserve("t1", request_id, handoff.prompt_token_ids, handoff.params, len(prompt),
                     codecs=offers({"cachegen": cachegen}))
    seq = prefill.requests[request_id]
    slots = prefill.kv_cache.token_slots(seq.block_table, 0, len(prompt))
    outlying = prefill.kv_cache.read_tokens(1, slots) * 1e6
    prefill.kv_cache.write_tokens(1, slots, outlying)
    headers = []
    channel = DirectChannel(lambda header, payload: (headers.append(header), receiver.receive_frame(header, payload)))
    outgoing = FrameCutter("t1", channel, LevelController(cachegen, LevelSizes({}), 1e9, None),
                                prefill.kv_cache, 0, len(prompt), frame_tokens=32)
    for layer in range(layout.num_layers):
        outgoing.send_through(layer, seq.block_table, len(prompt))
    assert [(h.layer, h.codec) for h in headers] == [(layer, "raw" if layer == 1 else "cachegen")
                                                     for layer in range(layout.num_layers) for _ in range(2)]
    assert all(h.payload_bytes < 32 * layout.bytes_per_token_layer for h in headers if h.codec == "cachegen")
    arrived = decode.kv_cache.read_tokens(1, decode.kv_cache.token_slots(
        receiver._get("t1").reservation.block_ids, 0, len(prompt)))
    torch.testing.assert_close(arrived, outlying, rtol=0, atol=0)
    receiver.abort("t1", "done")
    prefill.release(request_id)


def test_a_closed_receiver_takes_no_reservation_even_one_under_way(sides, hf_reference):
    """A decode worker that failed closes its receiver, then aborts every request in its engine: a
    reservation whose blocks were being taken as it closed must not stay open (its blocks freed by
    that abort would take its frames while another request holds them)."""
    prefill, decode, receiver, _ = sides
    prompts = random_prompts(2, hf_reference[ARCH].vocab_size, 40, 40, seed=13)
    request_ids = [prefilled(prefill, prompt) for prompt in prompts]
    reserve_blocks = receiver._reserve_blocks

    def closing_meanwhile(*args):
        reservation = reserve_blocks(*args)
        receiver.close("decode worker failed")  # lands between taking the blocks and the lease
        return reservation

    receiver._reserve_blocks = closing_meanwhile
    with pytest.raises(TransferError, match="decode worker failed"):
        reserve(receiver, prefill, request_ids[0])
    with pytest.raises(TransferError, match="decode worker failed"):  # and none after
        reserve(receiver, prefill, request_ids[1], transfer_id="t2")
    assert receiver.num_in_flight == 0
    assert wait_until(lambda: not decode.requests)  # the reserved blocks' abort runs on the engine loop
    assert_pool_idle(decode)
    for request_id in request_ids:
        prefill.release(request_id)


def test_a_commit_whose_admission_comes_after_the_receiver_closed_is_refused(sides, hf_reference):
    """The commit took its transfer out (so closing finds nothing to abort) and queued its admission
    behind a busy engine loop; the worker fails meanwhile. Admitted, the request would run on a worker
    that reports itself dead, with nobody told; refused, the prefill side reports it and the router
    places it again."""
    prefill, decode, receiver, outputs = sides
    _, request_id, handoff = every_layer_delivered(sides, hf_reference, seed=58)
    commit_thread, loop_busy, committed = commit_behind_a_busy_loop(receiver, handoff)
    commit_thread.start()
    assert wait_until(lambda: receiver.num_in_flight == 0)  # taken out, its admission queued
    assert receiver.close("decode worker failed") == []
    loop_busy.set()
    commit_thread.join(10)
    prefill.release(request_id)
    assert len(committed) == 1 and isinstance(committed[0], TransferError), committed
    assert "decode worker failed" in str(committed[0])
    receiver.loop.call(lambda e: None)  # the engine abort the failed commit queued has run
    assert_pool_idle(decode)
