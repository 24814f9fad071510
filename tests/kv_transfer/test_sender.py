"""The KV sending side (`KVSender`) without Ray: a real prefill engine writes the KV, a real decode
engine behind a real `KVReceiver` takes it over a real transport, and the decode worker's control
plane is that receiver called on threads of its own (`LocalPeer`), as Ray runs an actor's calls.
Every transition of a transfer, and every failure path: peer gone, reservation refused or left
unanswered, lease lapsed, commit refused or unanswered, frames damaged once and for good, a link that
breaks, a cancel in each state, a sender closed with transfers in flight. After each, both pools are
back to fully free, and a committed request decodes exactly what transformers' `generate` does."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from helpers import random_prompts
from helpers import assert_pool_idle, wait_until

from pdserve.deadlines import KVDeadlines
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import RequestHandoff
from pdserve.engine.multimodal.placement import PromptImages
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.kv_transfer.codecs import make_codec
from pdserve.kv_transfer.interface import KVMemoryFull, Lease, TransferError
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.sender import DraftKV, KVSender, OutgoingKV, TransferOutcome
from pdserve.kv_transfer.settings import TransferSettings
from pdserve.kv_transfer.state import TransferState
from pdserve.kv_transfer.transports import start_receiver
from pdserve.wire import INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE

ARCH = "tiny-llama"
NEW_TOKENS = 6
GREEDY = SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True)


class LocalPeer:
    """A decode worker's control plane in this process (`DecodePeer`): its real receiver, each call on
    a thread of its own as Ray runs an actor's calls. `hold(call)` keeps that call's answers back until
    `release(call)`; `refuse(call, error)` makes it raise."""

    def __init__(self, receiver: KVReceiver, addresses: dict[str, str], name: str = "decode-0") -> None:
        self.receiver = receiver
        self.addresses = addresses
        self.key = self.name = name
        self.calls: list[str] = []
        self.call_times: list[float] = []  # monotonic, one per entry of `calls`
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="test-peer")
        self._gates: dict[str, threading.Event] = {}
        self._refusals: dict[str, Exception] = {}

    def hold(self, call: str) -> None:
        self._gates[call] = threading.Event()

    def release(self, call: str) -> None:
        self._gates.pop(call).set()

    def refuse(self, call: str, error: Exception) -> None:
        self._refusals[call] = error

    def _call(self, call: str, work: Callable[[], object]) -> Future:
        self.call_times.append(time.monotonic())
        self.calls.append(call)

        def run() -> object:
            gate = self._gates.get(call)
            if gate is not None:
                gate.wait(30)
            if call in self._refusals:
                raise self._refusals[call]
            return work()

        return self._pool.submit(run)

    def reserve(self, transfer_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                num_kv_tokens: int, codecs: list[str], draft_kv: str | None = None,
                output_token_ids: list[int] | None = None, images: PromptImages | None = None) -> Future[Lease]:
        def reserve() -> Lease:
            lease = self.receiver.reserve(transfer_id, request_id, prompt_token_ids, params, num_kv_tokens, codecs,
                                          draft_kv, output_token_ids, images)
            return dataclasses.replace(lease, addresses=self.addresses, node_id="node", worker_id=self.name,
                                       recompute_s=self.recompute_s)

        return self._call("reserve", reserve)

    recompute_s: float | None = None  # the decode worker's estimate of recomputing (None: not profiled)

    def renew(self, transfer_id: str) -> Future[Lease]:
        return self._call("renew", lambda: self.receiver.renew(transfer_id))

    def commit(self, transfer_id: str, handoff: RequestHandoff, recompute: bool) -> Future[list[int]]:
        return self._call("commit", lambda: self.receiver.commit(transfer_id, handoff, recompute))

    def abort(self, transfer_id: str, reason: str) -> None:
        self._call("abort", lambda: self.receiver.abort(transfer_id, reason))

    def close(self) -> None:
        for gate in self._gates.values():
            gate.set()
        self._pool.shutdown(wait=True)


@dataclasses.dataclass
class Sides:
    prefill: LLMEngine
    decode: LLMEngine
    receiver: KVReceiver
    peer: LocalPeer
    sender: KVSender
    ended: dict[str, TransferOutcome]
    decoded: list
    make: Callable[..., KVSender]
    senders: list[KVSender]

    def transfer(self, prompt: list[int], peer: LocalPeer | None = None, done: bool = True,
                 sender: KVSender | None = None, as_prefill_worker: bool = False) -> tuple[OutgoingKV, str]:
        """Start a request's transfer and its prompt pass here, every written layer handed over as the
        engine writes it, and (`done`) the pass's end. `as_prefill_worker`: the reservation asked for
        as the prefill worker has it (`pass_started` once the prompt is in the engine), else at once."""
        sender = sender or self.sender
        request_id = f"r{len(self.ended)}-{time.monotonic_ns()}"
        kv = sender.start(request_id, prompt, GREEDY, len(prompt), peer or self.peer, time.time(),
                          ask_now=not as_prefill_worker)
        self.prefill.set_layer_hook(lambda layer, chunks: [
            sender.layer_written(kv, layer, c.seq.num_computed_tokens + c.num_tokens,
                                 self.prefill.layer_blocks(c.seq, layer))
            for c in chunks])
        self.prefill.add_request(prompt, GREEDY, request_id, prefill_only=True)
        if as_prefill_worker:
            sender.pass_started(kv)
        while self.prefill.has_unfinished_requests():
            self.prefill.step()
        if done:
            sender.prompt_done(kv, self.prefill.export_handoff(request_id))
        return kv, request_id

    def outcome(self, kv: OutgoingKV, timeout: float = 20) -> TransferOutcome:
        assert wait_until(lambda: kv.request_id in self.ended, timeout), (kv.transfer.state, kv.transfer.error)
        return self.ended[kv.request_id]

    def decoded_tokens(self, request_id: str) -> list[int]:
        assert wait_until(lambda: any(o.request_id == request_id and o.finished for o in self.decoded), 20)
        return next(o for o in self.decoded if o.request_id == request_id and o.finished).token_ids

    def assert_idle(self) -> None:
        assert wait_until(lambda: self.receiver.num_in_flight == 0 and not self.decode.requests
                          and self.decode.pool.num_free == self.decode.pool.num_blocks
                          and draft_pool_free(self.decode), 10), \
            (self.receiver.num_in_flight, list(self.decode.requests))
        for request_id in list(self.prefill.requests):
            self.prefill.release(request_id)
        assert_pool_idle(self.prefill)
        assert draft_pool_free(self.prefill)
        assert wait_until(lambda: all(sender.num_transfers() == 0 for sender in self.senders), 10)


def draft_pool_free(engine: LLMEngine) -> bool:
    draft = engine.draft_model
    return draft is None or draft.pool.num_free == draft.pool.num_blocks


KV_DEADLINES = {f.name for f in dataclasses.fields(KVDeadlines)}


def settings(**overrides) -> TransferSettings:
    """Short leases and waits; `overrides` may name any field of the settings or of their `KVDeadlines`."""
    timing = {"lease_s": 2.0, "reserve_wait_s": 0.5}
    timing.update({name: overrides.pop(name) for name in list(overrides) if name in KV_DEADLINES})
    timing.setdefault("commit_timeout_s", timing["lease_s"])
    return dataclasses.replace(TransferSettings(transport="shm", deadlines=KVDeadlines(**timing), recompute=False),
                               **overrides)


@pytest.fixture(params=["shm", "tcp"])
def sides(request, model_dirs):
    prefill = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=8 * 2**20, max_num_batched_tokens=64))
    decode = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=8 * 2**20))
    with running(request.param, prefill, decode) as made:
        yield made


@contextlib.contextmanager
def running(transport: str, prefill: LLMEngine, decode: LLMEngine) -> Iterator[Sides]:
    """A prefill engine's sender and a decode engine's receiver (on its loop) over `transport`."""
    decoded: list = []
    loop = EngineLoop(decode, decoded.extend).start()
    receiver = KVReceiver(loop, lease_s=2.0, reserve_wait_s=0.5)
    receiving = start_receiver(transport, receiver, "127.0.0.1")
    stop = threading.Event()
    expiry = threading.Thread(target=lambda: [receiver.expire_leases() for _ in iter(lambda: stop.wait(0.05), True)],
                              name="test-lease-expiry")  # as the decode worker's lease thread
    expiry.start()
    peer = LocalPeer(receiver, {transport: receiving.address})
    ended: dict[str, TransferOutcome] = {}
    crashes: list[BaseException] = []
    senders: list[KVSender] = []
    codecs = {"raw": make_codec("raw", None, prefill.kv_layout)}
    draft = prefill.draft_model  # computing the draft's prompt KV (`draft_prompt_kv`): it is sent too
    offered = DraftKV(draft.kv_identity, draft.runner.kv_cache) if prefill.config.draft_prompt_kv else None

    def make(draft: DraftKV | None = offered, **overrides) -> KVSender:
        made = KVSender(settings(transport=transport, **overrides), prefill.kv_cache, codecs,
                        lambda kv, outcome: ended.__setitem__(kv.request_id, outcome), crashes.append, node_id="node",
                        draft=draft)
        senders.append(made)
        return made

    try:
        yield Sides(prefill, decode, receiver, peer, make(), ended, decoded, make, senders)
    finally:
        stop.set()
        expiry.join(5)
        for made in senders:
            made.close()
        peer.close()
        receiving.stop()
        loop.stop()
    assert crashes == []


def prompt_of(sides: Sides, n: int, seed: int) -> list[int]:
    return random_prompts(1, sides.prefill.vocab_size, n, n, seed=seed)[0]


# --- transitions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layerwise_min_tokens", [0, 10_000], ids=["layer by layer", "after the pass"])
def test_a_transfer_goes_through_every_state_to_done_and_decodes_exactly(sides, hf_reference, monkeypatch,
                                                                         layerwise_min_tokens):
    sender = sides.make(layerwise_min_tokens=layerwise_min_tokens)
    prompt = prompt_of(sides, 150, seed=1)  # chunks of 64: the layers go as each chunk writes them
    kv, request_id = sides.transfer(prompt, sender=sender, done=False)
    assert wait_until(lambda: kv.transfer.state is TransferState.TRANSFERRING)
    if layerwise_min_tokens == 0:  # every layer sent while the pass's end was not yet known
        assert wait_until(lambda: kv.cutter is not None and kv.cutter.frames_sent >= sides.prefill.kv_layout.num_layers)
    else:  # the channel is open and the link idle, with every layer written: nothing goes before the pass's end
        assert wait_until(lambda: kv.cutter is not None and kv.pending == 0)
        assert kv.cutter.frames_sent == 0
    sender.prompt_done(kv, sides.prefill.export_handoff(request_id))
    assert sides.outcome(kv) == TransferOutcome()
    assert kv.transfer.state is TransferState.DONE
    assert list(kv.transfer.events) == ["bootstrapping", "transferring", "committing", "done"]
    assert sides.decoded_tokens(request_id) == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    record = sender.transfer_log[-1]
    assert record["bytes"] > 0 and record["layerwise"] == (layerwise_min_tokens == 0) and not record["recomputed"]
    sides.assert_idle()


@pytest.mark.parametrize("layerwise_min_tokens", [0, 10_000], ids=["layer by layer", "after the pass"])
def test_a_passes_reservation_is_asked_for_beside_it_only_where_its_kv_streams_beside_it(sides, hf_reference,
                                                                                        layerwise_min_tokens):
    sender = sides.make(layerwise_min_tokens=layerwise_min_tokens)
    prompt = prompt_of(sides, 150, seed=11)
    kv, request_id = sides.transfer(prompt, sender=sender, done=False, as_prefill_worker=True)
    if layerwise_min_tokens == 0:
        assert wait_until(lambda: kv.transfer.state is TransferState.TRANSFERRING)
        assert sides.peer.calls == ["reserve"]
    else:  # the pass wrote every layer with no call to the decode worker, and nothing asks one until it ends
        assert sender.reserving() == set()
        assert sides.peer.calls == []
        assert kv.transfer.state is TransferState.BOOTSTRAPPING
    sender.prompt_done(kv, sides.prefill.export_handoff(request_id))
    assert sides.outcome(kv) == TransferOutcome()
    assert sides.peer.calls == ["reserve", "commit"]
    assert sides.decoded_tokens(request_id) == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    sides.assert_idle()


def test_a_transfer_that_ends_before_its_reservation_is_asked_for_never_calls_the_decode_worker(sides):
    sender = sides.make(layerwise_min_tokens=10_000)
    kv, _ = sides.transfer(prompt_of(sides, 40, seed=12), sender=sender, done=False, as_prefill_worker=True)
    assert not sender.end(kv, "request finished at prefill")  # (as one done at its first token)
    assert kv.transfer.state is TransferState.FAILED and kv.transfer.error == "request finished at prefill"
    sender.prompt_done(kv, sides.prefill.export_handoff(kv.request_id))  # a late pass's end asks nothing either
    assert sides.peer.calls == []
    sides.assert_idle()


def test_recomputing_on_the_decode_worker_sends_nothing_and_decodes_exactly(sides, hf_reference):
    sides.peer.recompute_s = 1e-9  # faster than any transfer
    sender = sides.make(recompute=True)
    prompt = prompt_of(sides, 40, seed=2)
    kv, request_id = sides.transfer(prompt, sender=sender)
    assert sides.outcome(kv) == TransferOutcome()
    assert kv.recompute and kv.cutter is None and sender.counters["recompute_chosen"] == 1
    assert sides.decoded_tokens(request_id) == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    sides.assert_idle()


def test_a_layer_damaged_once_is_sent_again_and_one_damaged_for_good_is_recomputed(sides, hf_reference, monkeypatch):
    damaged_layers = {0: 100, 1: 1}  # layer -> how many of its frames are damaged
    lock = threading.Lock()

    class Damaging:
        def __init__(self, channel) -> None:
            self._channel = channel

        def send(self, header, payload):
            with lock:
                if damaged_layers.get(header.layer, 0) > 0:
                    damaged_layers[header.layer] -= 1
                    header = dataclasses.replace(header, crc32=header.crc32 ^ 1)
            self._channel.send(header, payload)

        def __getattr__(self, name):
            return getattr(self._channel, name)

    sender = sides.sender
    monkeypatch.setattr(sender, "_wrap_channel", Damaging)
    prompt = prompt_of(sides, 40, seed=3)
    kv, request_id = sides.transfer(prompt)
    assert sides.outcome(kv) == TransferOutcome()
    assert sender.counters["frames_resent"] == 1 and sender.counters["recomputed"] == 1 and kv.recompute
    assert sides.receiver.counters["corrupt_frames"] >= 2
    assert sides.decoded_tokens(request_id) == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    sides.assert_idle()


# --- failures ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("error, code", [(KVMemoryFull("full"), RESOURCE_EXHAUSTED),
                                         (ValueError("prompt too long"), INVALID_ARGUMENT),
                                         (TransferError("decode worker gone"), UNAVAILABLE)])
def test_a_reservation_refused_fails_the_transfer_with_its_status(sides, error, code):
    sides.peer.refuse("reserve", error)
    kv, _ = sides.transfer(prompt_of(sides, 40, seed=4))
    outcome = sides.outcome(kv)
    assert outcome.code == code and str(error) in outcome.error and kv.transfer.state is TransferState.FAILED
    sides.assert_idle()


def test_a_reservation_left_unanswered_closes_the_peer_until_it_answers(sides):
    sender = sides.make(reserve_answer_margin_s=0.2)
    sides.peer.hold("reserve")
    kv, _ = sides.transfer(prompt_of(sides, 40, seed=5), sender=sender)
    outcome = sides.outcome(kv)
    assert outcome.peer_not_answering and "did not answer the KV reservation" in outcome.error
    assert "has not answered a KV reservation" in sender.refusal(sides.peer)
    assert sender.counters["reservations_unanswered"] == 1
    sides.peer.release("reserve")  # answered late: the reservation it made is aborted, the peer open again
    assert wait_until(lambda: sender.refusal(sides.peer) is None)
    sides.assert_idle()


def test_a_link_that_breaks_fails_the_transfer_and_aborts_it_there(sides, monkeypatch):
    class Broken:
        def __init__(self, channel) -> None:
            self._channel = channel

        def send(self, header, payload):
            raise TransferError("the link broke")

        def __getattr__(self, name):
            return getattr(self._channel, name)

    monkeypatch.setattr(sides.sender, "_wrap_channel", Broken)
    kv, _ = sides.transfer(prompt_of(sides, 40, seed=6))
    outcome = sides.outcome(kv)
    assert "the link broke" in outcome.error and outcome.code == UNAVAILABLE
    assert wait_until(lambda: "abort" in sides.peer.calls)
    sides.assert_idle()


def test_a_transfer_that_stops_making_progress_loses_its_lease(sides, monkeypatch):
    """Its frames stuck on a link that takes nothing: once the pass has stopped writing layers, no
    renewal is sent for it (the link does not move), the decode side's lease lapses, and this side's
    expires after it. (While the pass writes, its layers renew the lease: a pass slowed by a loaded
    machine can outlast a lease check.)"""
    stuck = threading.Event()

    class Stuck:
        def __init__(self, channel) -> None:
            self._channel = channel

        def send(self, header, payload):
            stuck.wait(30)
            raise TransferError("released at the test's end")

        def __getattr__(self, name):
            return getattr(self._channel, name)

    sender = sides.make(lease_s=0.5, lease_margin_s=0.1)
    monkeypatch.setattr(sender, "_wrap_channel", Stuck)
    sides.receiver.lease_s = 0.5
    kv, _ = sides.transfer(prompt_of(sides, 40, seed=7), sender=sender)
    pass_ended = time.monotonic()
    outcome = sides.outcome(kv)
    assert "lease expired" in outcome.error and sender.counters["leases_expired"] == 1
    renewed = [at for call, at in zip(sides.peer.calls, sides.peer.call_times) if call == "renew"]
    assert all(at < pass_ended + 0.5 for at in renewed), [at - pass_ended for at in renewed]  # none a lease on
    stuck.set()
    sides.assert_idle()


def test_a_pass_that_goes_on_keeps_the_lease_alive_and_one_that_stops_loses_it(sides):
    """Frames held for the pass's end: while the pass keeps writing layers (a long prompt's chunks),
    the decode side's lease is renewed; once it stops writing (a hung engine), nothing renews it, the
    lease lapses there, and the transfer fails here."""
    sender = sides.make(lease_s=0.6, layerwise_min_tokens=10_000)
    sides.receiver.lease_s = 0.6
    kv, request_id = sides.transfer(prompt_of(sides, 40, seed=8), done=False, sender=sender)
    end, blocks = kv.written[0]
    writing = threading.Event()
    writer = threading.Thread(target=lambda: [sender.layer_written(kv, 0, end, blocks)  # chunk after chunk
                                              for _ in iter(lambda: writing.wait(0.05), True)])
    writer.start()
    try:
        assert wait_until(lambda: sides.peer.calls.count("renew") >= 3, 10)  # the pass runs for more than a lease
        assert kv.transfer.state is TransferState.TRANSFERRING and sides.receiver.num_in_flight == 1
    finally:
        writing.set()
        writer.join(5)
    outcome = sides.outcome(kv)  # the pass stopped writing: its lease lapses on both sides
    assert "lease" in outcome.error or "no open transfer" in outcome.error, outcome
    sides.assert_idle()


def test_a_pass_that_stops_before_its_reservation_is_asked_for_loses_this_sides_lease(sides):
    """A short prompt's reservation is asked for as its pass ends: a pass that stops writing layers
    before that (a hung engine) still ends its transfer here, by this side's lease, with nothing asked
    of or held on the decode worker."""
    sender = sides.make(lease_s=0.6, layerwise_min_tokens=10_000)
    kv, _ = sides.transfer(prompt_of(sides, 40, seed=13), done=False, sender=sender, as_prefill_worker=True)
    outcome = sides.outcome(kv)
    assert "lease expired" in outcome.error and "the prompt pass" in outcome.error, outcome
    assert sides.peer.calls == [] and sender.counters["leases_expired"] == 1
    sides.assert_idle()


def test_a_commit_refused_fails_the_transfer(sides):
    sides.peer.refuse("commit", TransferError("transfer t was aborted while committing"))
    kv, _ = sides.transfer(prompt_of(sides, 40, seed=9))
    outcome = sides.outcome(kv)
    assert "aborted while committing" in outcome.error and kv.transfer.state is TransferState.FAILED
    sides.assert_idle()


def test_a_commit_left_unanswered_ends_in_lease_expiry(sides):
    """A decode worker that hangs in the commit (alive, its other calls answered): nothing renews the
    lease during a commit, so this side's lapses, and the transfer fails."""
    sender = sides.make(lease_s=0.5, lease_margin_s=0.1)
    sides.peer.hold("commit")
    kv, _ = sides.transfer(prompt_of(sides, 40, seed=10), sender=sender)
    outcome = sides.outcome(kv)
    assert "lease expired" in outcome.error and sender.counters["leases_expired"] == 1
    sides.peer.release("commit")  # answered late: the commit finds the transfer aborted
    sides.assert_idle()


@pytest.mark.parametrize("state", ["bootstrapping", "transferring", "committing"])
def test_a_cancel_in_each_state_ends_the_transfer_on_both_sides(sides, state):
    if state == "bootstrapping":
        sides.peer.hold("reserve")
    if state == "committing":
        sides.peer.hold("commit")
    kv, _ = sides.transfer(prompt_of(sides, 40, seed=11), done=state == "committing")
    assert wait_until(lambda: kv.transfer.state.value == state)
    assert sides.sender.end(kv, "aborted by the router") is False  # not committed
    assert kv.transfer.state is TransferState.FAILED and kv.request_id not in sides.ended  # the worker's own end
    for call in ("reserve", "commit"):
        if call in sides.peer._gates:
            sides.peer.release(call)
    assert wait_until(lambda: "abort" in sides.peer.calls)
    sides.assert_idle()


def test_an_end_after_the_commit_leaves_the_request_to_the_decode_worker(sides, hf_reference):
    prompt = prompt_of(sides, 40, seed=12)
    kv, request_id = sides.transfer(prompt)
    assert sides.outcome(kv) == TransferOutcome()
    assert sides.sender.end(kv, "a fault just after") is True  # committed: nothing aborted
    assert "abort" not in sides.peer.calls
    assert sides.decoded_tokens(request_id) == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    sides.assert_idle()


def test_a_stalled_decode_worker_holds_up_no_transfer_to_another(sides, hf_reference, model_dirs):
    """Two decode workers: one whose channel never takes a frame, and one that takes them. The
    second's transfer commits while the first's frames wait on their own link."""
    stuck = threading.Event()
    other = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=8 * 2**20))
    decoded: list = []
    loop = EngineLoop(other, decoded.extend).start()
    receiver = KVReceiver(loop, lease_s=5.0)
    kind = next(iter(sides.peer.addresses))
    receiving = start_receiver(kind, receiver, "127.0.0.1")
    healthy = LocalPeer(receiver, {kind: receiving.address}, name="decode-1")
    real_open = sides.sender._open_channel

    def open_channel(lease, transfer_id):
        channel = real_open(lease, transfer_id)
        if lease.worker_id != "decode-0":
            return channel

        class Stuck:
            def send(self, header, payload):
                stuck.wait(30)

            def __getattr__(self, name):
                return getattr(channel, name)

        return Stuck()

    sides.sender._open_channel = open_channel
    try:
        stalled, _ = sides.transfer(prompt_of(sides, 40, seed=13))
        assert wait_until(lambda: stalled.pending > 0 and stalled.cutter is not None)
        prompt = prompt_of(sides, 40, seed=14)
        kv, request_id = sides.transfer(prompt, peer=healthy)
        assert sides.outcome(kv) == TransferOutcome()
        assert stalled.transfer.state is TransferState.TRANSFERRING
        sides.sender.end(stalled, "the test is over")
        stuck.set()
        sides.assert_idle()
    finally:
        stuck.set()
        healthy.close()
        receiving.stop()
        loop.stop()


def test_a_delivery_waiting_on_a_dead_receiver_holds_up_no_other_transfer_and_ending_it_cuts_it_short(sides,
                                                                                                        hf_reference):
    """The first transfer's channel never has its frames answered (its receiving half died with the
    decode worker's first incarnation): its finish waits on its own thread, while the next transfer
    to the same decode worker commits; ending the first closes its channel, and its wait ends."""
    waited: list[float] = []
    first: list[object] = []

    class NeverAnswered:
        def __init__(self, channel) -> None:
            self._channel = channel
            first[:] = first or [self]

        def finish(self, timeout):
            if self is not first[0]:
                return self._channel.finish(timeout)
            started = time.monotonic()
            while not self._closed_for_test and time.monotonic() - started < timeout:
                time.sleep(0.01)
            waited.append(time.monotonic() - started)
            raise TransferError("the KV receiver did not answer")

        def close(self):
            self._closed_for_test = True
            self._channel.close()

        _closed_for_test = False

        def __getattr__(self, name):
            return getattr(self._channel, name)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(sides.sender, "_wrap_channel", NeverAnswered)
    try:
        stuck, _ = sides.transfer(prompt_of(sides, 40, seed=15))
        assert wait_until(lambda: stuck.finishing)
        prompt = prompt_of(sides, 40, seed=16)
        kv, request_id = sides.transfer(prompt)
        assert sides.outcome(kv) == TransferOutcome()
        assert sides.decoded_tokens(request_id) == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
        sides.sender.end(stuck, "the decode worker died")
        assert wait_until(lambda: waited) and waited[0] < 5
        sides.assert_idle()
    finally:
        monkeypatch.undo()


def test_closing_the_sender_ends_every_transfer_and_leaks_nothing(sides):
    sides.peer.hold("commit")
    kvs = [sides.transfer(prompt_of(sides, 40, seed=20 + i))[0] for i in range(3)]
    assert wait_until(lambda: all(kv.transfer.state is TransferState.COMMITTING for kv in kvs))
    sides.sender.close()
    assert all(kv.transfer.state is TransferState.FAILED for kv in kvs)
    sides.peer.release("commit")
    sides.assert_idle()


# --- the draft model's prompt KV, sent with the target's -------------------------------------------
@pytest.fixture(params=["shm", "tcp"])
def draft_sides(request, model_dirs, tiny_llama_draft):
    """A prefill engine that computes the draft model's prompt KV beside the target's, and a decode
    engine that drafts with the same draft."""
    spec = SpeculativeConfig(method="draft_model", draft_model=str(tiny_llama_draft), max_draft_tokens=4)
    prefill = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=8 * 2**20, max_num_batched_tokens=64,
                                                       speculative=spec, draft_prompt_kv=True))
    decode = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=8 * 2**20, speculative=spec))
    with running(request.param, prefill, decode) as made:
        yield made


def draft_kv_of(engine: LLMEngine, request_id: str, num_tokens: int) -> torch.Tensor:
    """[layer, 2, token, head, dim]: the draft model's KV of a request's first tokens, in `engine`'s draft pool."""
    draft = engine.draft_model
    cache = draft.runner.kv_cache
    slots = cache.token_slots(draft.blocks_of(request_id), 0, num_tokens)
    return torch.stack([cache.read_tokens(layer, slots) for layer in range(cache.layout.num_layers)])


def record_draft_imports(monkeypatch: pytest.MonkeyPatch, decode: LLMEngine) -> dict[str, torch.Tensor | None]:
    """request id -> the draft KV that arrived for it as its import was committed (None: none did)."""
    arrived: dict[str, torch.Tensor | None] = {}
    committed = decode.draft_model.import_committed

    def record(request_id: str, num_tokens: int) -> None:
        arrived[request_id] = draft_kv_of(decode, request_id, num_tokens).clone() if num_tokens else None
        committed(request_id, num_tokens)

    monkeypatch.setattr(decode.draft_model, "import_committed", record)
    return arrived


@pytest.mark.parametrize("layerwise_min_tokens", [0, 10_000], ids=["layer by layer", "after the pass"])
def test_the_draft_models_prompt_kv_travels_with_the_targets_exactly(draft_sides, hf_reference, tiny_llama_draft,
                                                                     monkeypatch, layerwise_min_tokens):
    """Prompts in chunks of 64, the second sharing the first's 48 first tokens: its target KV is partly
    cached on both sides, its draft's (no prefix cache) is computed and sent from its first token.
    Each request's draft KV arrives whole, bit for bit the prefill side's, which is what the draft
    computes over the prompt in one pass; the decode side drafts from it (its own prompt pass for the
    draft never runs). A third shares 128 tokens, more than a step's catch-up budget: its draft's KV
    is left to the decode side, and the request decodes exactly all the same."""
    sides = draft_sides
    arrived = record_draft_imports(monkeypatch, sides.decode)
    caught_up: list[str] = []
    catch_up = sides.decode.draft_model._catch_up_prompts
    monkeypatch.setattr(sides.decode.draft_model, "_catch_up_prompts",
                        lambda seqs: (caught_up.extend(s.request_id for s in seqs), catch_up(seqs)))
    reference = LLMEngine(tiny_llama_draft, EngineConfig(kv_memory_bytes=8 * 2**20))
    sender = sides.make(layerwise_min_tokens=layerwise_min_tokens)
    first = prompt_of(sides, 150, seed=40)
    for i, prompt in enumerate([first, first[:48] + prompt_of(sides, 30, seed=42)]):
        kv, request_id = sides.transfer(prompt, sender=sender)
        assert sides.outcome(kv) == TransferOutcome()
        assert kv.lease.draft_layers == sides.prefill.draft_model.runner.kv_cache.layout.num_layers
        assert (kv.lease.cached_blocks > 0) == (i == 1)
        sent = draft_kv_of(sides.prefill, request_id, len(prompt))
        assert torch.equal(arrived[request_id], sent)
        reference.add_request(prompt, SamplingParams.greedy(max_tokens=2), f"ref-{i}", prefill_only=True)
        while reference.has_unfinished_requests():
            reference.step()
        torch.testing.assert_close(sent, draft_kv_of_target(reference, f"ref-{i}", len(prompt)))
        assert sides.decoded_tokens(request_id) == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
        sides.prefill.release(request_id)
    assert caught_up == []
    prompt = first[:128] + prompt_of(sides, 20, seed=43)
    kv, request_id = sides.transfer(prompt, sender=sender)
    assert sides.outcome(kv) == TransferOutcome() and kv.lease.draft_layers > 0 and arrived[request_id] is None
    assert sides.decoded_tokens(request_id) == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    assert caught_up == [request_id]
    counts = sides.receiver.counts()
    assert (counts["draft_kv_arrived"], counts["draft_kv_incomplete"]) == (2, 1)
    sides.assert_idle()


def draft_kv_of_target(engine: LLMEngine, request_id: str, num_tokens: int) -> torch.Tensor:
    """`draft_kv_of` for an engine that runs the draft model as its target (a held request's KV)."""
    cache = engine.kv_cache
    slots = cache.token_slots(engine.requests[request_id].block_table, 0, num_tokens)
    return torch.stack([cache.read_tokens(layer, slots) for layer in range(cache.layout.num_layers)])


def test_a_draft_kv_that_cannot_come_whole_is_computed_on_the_decode_side(draft_sides, hf_reference, monkeypatch):
    """A sender whose draft is another (refused at the reservation), a decode side whose draft pool has
    no room, and draft frames lost on the way (the commit waits for the target's layers only, and
    sends nothing again): each request decodes exactly, its draft's prompt pass run on the decode side."""
    sides = draft_sides
    arrived = record_draft_imports(monkeypatch, sides.decode)
    target_layers = sides.prefill.kv_layout.num_layers
    draft = sides.prefill.draft_model

    other = sides.make(draft=DraftKV("another draft", draft.runner.kv_cache))
    prompt = prompt_of(sides, 40, seed=50)
    kv, request_id = sides.transfer(prompt, sender=other)
    assert sides.outcome(kv) == TransferOutcome() and kv.lease.draft_layers == 0
    assert kv.cutter.num_layers == target_layers and arrived[request_id] is None
    assert sides.decoded_tokens(request_id) == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)

    pool = sides.decode.draft_model.pool
    taken = pool.allocate(pool.num_free)  # the decode loop is idle: nothing else takes or frees draft blocks
    try:
        prompt = prompt_of(sides, 40, seed=51)
        kv, request_id = sides.transfer(prompt)
        assert sides.outcome(kv) == TransferOutcome() and kv.lease.draft_layers == 0
        assert arrived[request_id] is None
        assert sides.decoded_tokens(request_id) == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    finally:
        assert wait_until(lambda: not sides.decode.requests)  # idle again before the test touches the pool
        pool.free(taken)

    class LosingDraftFrames:
        def __init__(self, channel) -> None:
            self._channel = channel

        def send(self, header, payload):
            if header.layer >= target_layers:
                header = dataclasses.replace(header, crc32=header.crc32 ^ 1)
            self._channel.send(header, payload)

        def __getattr__(self, name):
            return getattr(self._channel, name)

    monkeypatch.setattr(sides.sender, "_wrap_channel", LosingDraftFrames)
    prompt = prompt_of(sides, 40, seed=52)
    kv, request_id = sides.transfer(prompt)
    assert sides.outcome(kv) == TransferOutcome() and kv.lease.draft_layers > 0
    assert arrived[request_id] is None and sides.sender.counters["frames_resent"] == 0
    assert sides.decoded_tokens(request_id) == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    counts = sides.receiver.counts()
    assert counts["draft_kv_incomplete"] == 1 and "draft_kv_arrived" not in counts and counts["corrupt_frames"] > 0
    assert counts["draft_kv_declined"] == 2  # another draft, and no room
    sides.assert_idle()
