"""The sending side of the KV protocol (`KVSender`): for each request, reserve on its decode worker,
send what the decode worker lacks of its KV as the prompt pass writes it, commit, and end once, on
every path. Ray-free: the decode worker's control plane comes in as a `DecodePeer` whose calls return
futures, so everything that waits on a peer (a reservation, a renewal, a commit) is a future the
sender's loop looks at, and the loop never blocks on one.

Threads (both started here; their failures fail the worker through `on_crash`):
  - the loop (`kv-sender`) drives every transfer's state machine (`state.Transfer`): takes leases,
    decides what to send and when, asks for commits, has what arrived incomplete sent again, renews
    and expires leases, and ends transfers;
  - one link per decode worker (`_Link`), its data path, apart from every other decode worker's, so
    one that stalls holds up its own transfers only: on one thread (`kv-link-send`) channels are
    opened and frames read out of the cache, encoded and sent, in order; on another (`kv-link-end`)
    channels are finished (their frames' answers waited for) and closed.

One transfer's way (any failure, in any state, ends it FAILED through `end`):

    BOOTSTRAPPING  the reservation is asked for beside the prompt pass where its layers may go beside
         |         it, else as the pass ends (`pass_started`); the layers the pass writes are recorded
         | lease granted (refused, or unanswered past the bound: FAILED)
    TRANSFERRING   a channel is opened on the link, unless recomputing the KV on the decode worker is
         |         expected to be faster than sending it; layers go as the pass writes them (passes of
         |         `layerwise_min_tokens` or more) or all at once when it ends; while no frame goes,
         |         the decode side's lease is renewed
         | the pass is over and every frame delivered (the channel finished on the link)
    COMMITTING     commit asked for: no incomplete layer -> DONE; some -> TRANSFERRING, sent once more,
         |         then committed with recompute (the decode worker rebuilds the KV from the tokens)
    DONE | FAILED  `on_end` tells the worker: its blocks can go, and the router is told of a failure

Both sides hold a lease. The decode side's lapses when no frame or renewal comes for `lease_s`; this
side's when the transfer makes no progress (a frame taken by the channel, a renewal or commit
answered) for `sender_lease_s` (`pdserve.deadlines.KVDeadlines`). A transfer whose frames wait
behind other transfers on a link that is moving is renewed, not expired; one behind a stuck link is
not.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.llm_engine import RequestHandoff
from pdserve.engine.multimodal.placement import PromptImages
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.codecs import Codec, offers
from pdserve.kv_transfer.frames import FrameCutter, LevelController, LevelSizes, make_frame, streams_beside_pass
from pdserve.kv_transfer.interface import (PROBE_PREFIX, KVMemoryFull, LayerChannel, Lease, SendingTransport,
                                          TransferError)
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.settings import TransferSettings
from pdserve.kv_transfer.state import Transfer, TransferState
from pdserve.kv_transfer.transports import forget_moved, make_sender
from pdserve.threads import start_guarded
from pdserve.wire import INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE

log = logging.getLogger(__name__)

DRAIN_S = 0.5  # a channel ended early is closed once its frames in flight are answered, waiting this long
ENDING_THREADS = 4  # per decode worker: its transfers' channels finished or closed at once, at most
DEFAULT_BANDWIDTH = 200e6  # bytes/s assumed for a peer not yet probed (the launcher probes each)
COUNTED = ("frames_resent", "recomputed", "recompute_chosen", "leases_expired", "reservations_unanswered")


class DecodePeer(Protocol):
    """A decode worker's KV control plane as the sending side calls it. Every call returns at once."""

    key: Hashable  # one per decode worker, kept across its restarts
    name: str  # for messages

    def reserve(self, transfer_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                num_kv_tokens: int, codecs: list[str], draft_kv: str | None = None,
                output_token_ids: list[int] | None = None, images: PromptImages | None = None) -> Future[Lease]:
        """`draft_kv`: this side can send the draft model's prompt KV too, of the draft it names.
        `output_token_ids`: set (perhaps empty) for a running request moved from another decode worker:
        the tokens it sampled before its last, whose KV comes with the prompt's. `images`: where the
        prompt's images are (their KV is cached under their content there)."""

    def renew(self, transfer_id: str) -> Future[Lease]: ...

    def commit(self, transfer_id: str, handoff: RequestHandoff, recompute: bool) -> Future[list[int]]:
        """The layers still incomplete; empty once the decode worker holds the request."""

    def abort(self, transfer_id: str, reason: str) -> None:
        """Free the reservation there (best effort: its lease frees it anyway)."""


@dataclass(frozen=True)
class DraftKV:
    """The draft model's KV on a prefill worker that sends it (`EngineConfig.draft_prompt_kv`)."""

    identity: str  # `DraftModelProposer.kv_identity`: a decode worker takes it only for the same draft
    kv_cache: PagedKVCache


@dataclass(frozen=True)
class TransferOutcome:
    """How a transfer ended, as the worker is told (`on_end`)."""

    error: str | None = None  # None: committed (the decode worker holds the request)
    code: str = UNAVAILABLE  # a failure's gRPC status name
    peer_not_answering: bool = False  # its decode worker left a reservation unanswered past the bound


@dataclass(eq=False)
class OutgoingKV:
    """One request's transfer, as the sender drives it. The engine thread records layers into it;
    the loop and the link read them under `lock`."""

    transfer: Transfer
    num_kv_tokens: int  # the tokens whose KV goes: the prompt's (a moved request's: and all but its last token's)
    params: SamplingParams
    new_tokens: int  # the tokens this worker computes (its prefix cache holds the rest); a move computes none
    peer: DecodePeer
    link: _Link
    reservation: Future[Lease]  # answered once the decode worker grants the lease (or refuses)
    objective_deadline: float | None  # wall clock: when the request's TTFT objective ends, if it has one
    reserve_deadline: float = float("inf")  # monotonic: the reservation's answer is due (once asked for)
    lock: threading.Lock = field(default_factory=threading.Lock)
    written: dict[int, tuple[int, list[int]]] = field(default_factory=dict)  # layer -> (final up to, block ids)
    lease: Lease | None = None
    transport: str = "none"  # the transport its KV goes over, once chosen
    cutter: FrameCutter | None = None  # once its channel is open
    recompute: bool = False  # the decode worker rebuilds the KV from the tokens: nothing is sent
    layerwise: bool = False  # its layers go as the pass writes them
    sending: bool = False  # layers the pass writes from now on go to the link at once
    handoff: RequestHandoff | None = None  # once the prompt pass is over
    delivered: Future | None = None  # every frame handed so far answered (the channel finished)
    commit: Future[list[int]] | None = None
    resent: bool = False
    renewal: Future[Lease] | None = None
    pending: int = 0  # work queued on the link for it
    progress_at: float = field(default_factory=time.monotonic)  # this side's lease runs from here
    contacted_at: float = field(default_factory=time.monotonic)  # a frame or renewal extended the decode side's
    written_at: float = field(default_factory=time.monotonic)  # the pass last wrote a layer of it
    times: dict[str, float] = field(default_factory=dict)  # wall clock: first and last frame, pass end, delivery
    finishing: bool = False  # its channel's finish waits for the decode worker's answers
    ended: bool = False
    unasked: Callable[[], Future[Lease]] | None = None  # the reservation call, until `KVSender._ask` sends it

    @property
    def request_id(self) -> str:
        return self.transfer.request_id


class _WorkQueue:
    """Threads that run what is submitted, in the order it came (with one thread, one piece after the
    other). A transfer's `pending` counts what is queued for it; `done` hears of each piece done."""

    def __init__(self, name: str, done: Callable[[OutgoingKV], None], on_crash: Callable[[BaseException], None],
                 threads: int = 1) -> None:
        self._done = done
        self._queue: deque[tuple[OutgoingKV, Callable[[], Any], Future]] = deque()
        self._ready = threading.Condition()
        self._stopped = False
        self.progress_at = time.monotonic()  # a piece of work last finished
        for _ in range(threads):
            start_guarded(name, self._run, on_crash)

    def submit(self, kv: OutgoingKV, work: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._ready:
            if self._stopped:
                future.set_exception(TransferError("the KV sender is closed"))
                return future
            with kv.lock:
                kv.pending += 1
            self._queue.append((kv, work, future))
            self._ready.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._queue or self._stopped)
                if not self._queue:
                    return
                kv, work, future = self._queue.popleft()
            try:
                future.set_result(work())
            except Exception as e:  # the piece's own failure: whoever waits on it handles it
                future.set_exception(e)
            finally:
                with kv.lock:
                    kv.pending -= 1
                self.progress_at = time.monotonic()
                self._done(kv)

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            dropped, self._queue = list(self._queue), deque()
            self._ready.notify()
        for kv, _, future in dropped:
            with kv.lock:
                kv.pending -= 1
            future.set_exception(TransferError("the KV sender is closed"))


class _Link:
    """The data path to one decode worker, apart from every other's: one that stalls holds up only
    its own. `sends` (one thread) opens channels and sends frames, in order. `ends` waits for a
    transfer's frames to be answered before its commit, and closes channels: a transfer whose frames
    are all out commits without waiting behind the next transfer's frames, and on threads of their
    own (ENDING_THREADS), since a channel to a decode worker that died can wait its whole timeout
    for answers (shared memory's and gloo's control channels do not see a peer die) while the others'
    transfers go on."""

    def __init__(self, name: str, done: Callable[[OutgoingKV], None],
                 on_crash: Callable[[BaseException], None]) -> None:
        self.name = name
        self.unanswered: tuple[Future, float] | None = None  # a reservation left unanswered past the bound, since
        self.sends = _WorkQueue("kv-link-send", done, on_crash)
        self.ends = _WorkQueue("kv-link-end", done, on_crash, threads=ENDING_THREADS)

    def refusal(self) -> str | None:
        """Why no transfer should start for this decode worker now: it has not answered a reservation
        made past the bound yet (the link reopens once that one is answered, whatever the answer)."""
        unanswered = self.unanswered
        if unanswered is None:
            return None
        reservation, since = unanswered
        if reservation.done():
            self.unanswered = None
            return None
        return f"{self.name} has not answered a KV reservation made {time.monotonic() - since:.0f} s ago"

    def stop(self) -> None:
        self.sends.stop()
        self.ends.stop()


class KVSender:
    """The sending side of a prefill worker's transfers (see the module's docstring)."""

    def __init__(self, settings: TransferSettings, kv_cache: PagedKVCache, codecs: dict[str, Codec],
                 on_end: Callable[[OutgoingKV, TransferOutcome], None],
                 on_crash: Callable[[BaseException], None],
                 node_id: str = "", wrap_channel: Callable[[LayerChannel], LayerChannel] = lambda c: c,
                 draft: DraftKV | None = None) -> None:
        self.settings = settings
        self.kv_cache = kv_cache
        self.draft = draft  # the draft model's prompt KV, offered with each reservation
        self.codecs = codecs  # by name, in the order they are offered; raw among them
        self.node_id = node_id
        self._on_end = on_end
        self._on_crash = on_crash
        self._wrap_channel = wrap_channel  # fault injection (the soak's corruption) wraps every channel
        self._transports: dict[str, SendingTransport] = {}  # name -> sending half, made on first use
        self._links: dict[Hashable, _Link] = {}
        self._active: set[OutgoingKV] = set()
        self._peer_addresses: dict[str, dict[str, str]] = {}  # decode worker -> where its last lease said it listens
        self._bandwidth: dict[str, float] = {}  # decode worker (node and addresses) -> bytes/s, from probes
        self._level_sizes = {name: LevelSizes.of(codec) for name, codec in codecs.items()}
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTED, 0))
        self.metrics = TransferMetrics()
        self.transfer_log: deque[dict] = deque(maxlen=1024)  # committed transfers, for benchmarks
        self._lock = threading.Lock()  # the dictionaries and sets above
        self._wake = threading.Event()
        self._stopped = threading.Event()
        # Every transfer's decisions, on one thread: nothing here waits on a peer.
        self._thread = start_guarded("kv-sender", self._run, on_crash)

    # --- the worker's calls ------------------------------------------------------------------------
    def start(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, new_tokens: int,
              peer: DecodePeer, arrived: float | None, output_token_ids: list[int] | None = None,
              images: PromptImages | None = None, ask_now: bool = True) -> OutgoingKV:
        """Start the request's transfer: ask `peer` to reserve for it. `arrived`: when the request came
        (wall clock), which its TTFT objective counts from (None: no objective applies, as for a move).
        `output_token_ids`: a decoding request moved with its KV: the tokens it has sampled (the KV of
        all but the last goes; the caller records every layer written, with no pass to wait for).
        `images`: a multimodal prompt's (its placeholders expanded). `ask_now` False (a prompt pass
        follows): the transfer records the layers written from now on, and the reservation is asked
        for by `pass_started` where its layers may go beside the pass, else once `prompt_done`."""
        transfer = Transfer(uuid.uuid4().hex, request_id)
        num_kv_tokens = len(prompt_token_ids) + max(0, len(output_token_ids or ()) - 1)

        def reserve() -> Future[Lease]:
            return peer.reserve(transfer.transfer_id, request_id, prompt_token_ids, params, num_kv_tokens,
                                offers(self.codecs), self.draft.identity if self.draft is not None else None,
                                output_token_ids=output_token_ids[:-1] if output_token_ids is not None else None,
                                images=images)

        slo = self.settings.ttft_slo_s
        kv = OutgoingKV(transfer, num_kv_tokens, params, new_tokens, peer, self._link(peer), Future(),
                        arrived + slo if slo is not None and arrived is not None else None, unasked=reserve)
        with self._lock:
            self._active.add(kv)
        kv.reservation.add_done_callback(lambda _: self._wake.set())
        if ask_now:
            self._ask(kv)
        return kv

    def pass_started(self, kv: OutgoingKV) -> None:
        """The transfer's prompt pass is in the engine: its reservation is asked for now if its layers
        may go beside the pass (a long prompt's, or any under an objective a codec's levels adapt to).
        A short prompt's KV goes once the pass ends, so its reservation is asked for then: both
        sides' work on it (Ray's call, the decode worker's blocks, the lease's channel) would share the
        cores and the GIL with the pass, about 7% of a 60-token prompt's TTFT on 2 cores. Asking after
        costs the handoff (its second token) the reservation's round trip and the channel's opening:
        5-9 ms more in `pdserve bench cluster` here, where the first token came 2-4 ms sooner."""
        adaptive = kv.objective_deadline is not None and any(c.num_levels > 1 for c in self.codecs.values())
        if streams_beside_pass(kv.new_tokens, self.settings.layerwise_min_tokens, adaptive):
            self._ask(kv)

    def _ask(self, kv: OutgoingKV) -> None:
        """Send the transfer's reservation call (once; never for a transfer that ended before)."""
        with kv.lock:
            reserve, kv.unasked = kv.unasked, None
            if reserve is not None:
                kv.reserve_deadline = time.monotonic() + self.settings.deadlines.reservation_bound_s
        if reserve is None:
            return
        try:
            answer = reserve()
        except Exception as e:  # the call could not be sent: the loop fails the transfer with it
            kv.reservation.set_exception(e)
            return
        answer.add_done_callback(lambda done: _pass_on(done, kv.reservation))

    def layer_written(self, kv: OutgoingKV, layer: int, end: int, block_ids: list[int]) -> None:
        """On the engine's thread: `layer`'s KV of every token before `end` is final (held in
        `block_ids` until the transfer ends). Sent at once while the transfer sends layer by layer."""
        with kv.lock:
            kv.written[layer] = (end, block_ids)
            kv.written_at = kv.progress_at = time.monotonic()
            send = kv.sending and not kv.ended
        if send:
            self._send_layer(kv, layer)

    def prompt_done(self, kv: OutgoingKV, handoff: RequestHandoff) -> None:
        """On the engine's thread: the pass is over (its step sampled the first token)."""
        with kv.lock:
            kv.handoff = handoff
            kv.times["prompt_done"] = time.time()
        self._wake.set()  # the loop asks for the reservation where `pass_started` did not

    def end(self, kv: OutgoingKV, reason: str) -> bool:
        """End the transfer, once, from any thread (a cancel, a fault, a job finished at its first
        token): abort it on the decode worker unless it committed, and let its channel go. Whether it
        had committed (DONE): the decode worker holds the request then."""
        self._end(kv, reason)
        return kv.transfer.state is TransferState.DONE

    def _end(self, kv: OutgoingKV, reason: str) -> bool:
        """`end`; whether this call ended it."""
        with kv.lock:
            if kv.ended:
                return False
            kv.ended = True
            cutter, finishing = kv.cutter, kv.finishing
            asked, kv.unasked = kv.unasked is None, None  # a reservation never asked for is never asked
        with self._lock:
            self._active.discard(kv)
        failed = kv.transfer.fail(reason)  # from here on no frame is read: its blocks may be another's soon
        if failed and asked:
            kv.peer.abort(kv.transfer.transfer_id, reason)
        if cutter is not None and failed and finishing:  # its delivery waits on the decode worker: cut it short
            _close_logged(cutter.channel)
        elif cutter is not None:  # frames in flight are answered first, so the channel's resources are reused
            kv.link.ends.submit(kv, lambda: self._close(cutter.channel, drain=failed, behind=kv))
        return True

    def refusal(self, peer: DecodePeer) -> str | None:
        """Why a request bound for `peer` should not start now (it left a reservation unanswered), or None."""
        with self._lock:
            link = self._links.get(peer.key)
        return link.refusal() if link is not None else None

    def reserving(self) -> set[Hashable]:
        """The decode workers with a reservation still unanswered: the next prompts bound for them
        wait in the queues, where the feeder starts other decode workers' prompts."""
        with self._lock:
            return {kv.peer.key for kv in self._active if kv.transfer.state is TransferState.BOOTSTRAPPING
                    and kv.unasked is None and not kv.reservation.done()}

    def num_transfers(self) -> int:
        with self._lock:
            return len(self._active)

    def probe(self, peer: DecodePeer, num_tokens: int, data: Callable[[int], Any]) -> dict[str, float]:
        """Send every layer of `num_tokens` tokens of raw KV (`data(n)`: n tokens' KV of one layer) to
        `peer`, then abort it: the transport's bandwidth (`seconds`: the frames) and a whole handoff's
        time (`handoff_s`: reserve to abort). The bandwidth is kept for the level controller of later
        transfers to that worker. On the calling thread."""
        transfer_id = uuid.uuid4().hex
        t_reserve = time.perf_counter()
        reservation = peer.reserve(transfer_id, f"{PROBE_PREFIX}{transfer_id}", [3] * num_tokens,
                                   SamplingParams.greedy(max_tokens=1), num_tokens, ["raw"])
        try:
            lease = reservation.result(timeout=self.settings.deadlines.reservation_bound_s)
            layout = self.kv_cache.layout
            raw, first = self.codecs["raw"], lease.cached_blocks * layout.block_size
            channel = self._open_channel(lease, transfer_id)
        except BaseException:  # the reservation may stand (granted late, or the channel failed): let it go
            peer.abort(transfer_id, "probe failed")
            raise
        try:
            t0 = time.perf_counter()
            for layer in range(layout.num_layers):
                for start in range(first, num_tokens, self.settings.frame_tokens):
                    n = min(self.settings.frame_tokens, num_tokens - start)
                    channel.send(*make_frame(transfer_id, layer, start, n, raw.name, 0, raw.encode(data(n), layer),
                                             channel.device))
            channel.finish(self.settings.deadlines.commit_timeout_s)
            seconds = time.perf_counter() - t0
        finally:
            channel.close()
            peer.abort(transfer_id, "probe finished")
        if channel.bytes_sent:  # none when the decode worker held every probe block already
            with self._lock:
                self._bandwidth[_peer_id(lease)] = channel.bytes_sent / max(seconds, 1e-9)
        return {"bytes": channel.bytes_sent, "seconds": seconds, "handoff_s": time.perf_counter() - t_reserve}

    def close(self) -> None:
        self._stopped.set()
        self._wake.set()
        with self._lock:
            links, active = list(self._links.values()), list(self._active)
        for kv in active:
            self.end(kv, "the prefill worker is shutting down")
        for link in links:
            link.stop()
        for transport in self._transports.values():
            transport.close()

    # --- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        tick = self.settings.deadlines.lease_check_s
        while not self._stopped.is_set():
            self._wake.wait(tick)
            self._wake.clear()
            with self._lock:
                active = list(self._active)
            for kv in active:  # a fault of this side's own ends the loop: the worker fails, and is restarted
                self._poll(kv, time.monotonic())

    def _poll(self, kv: OutgoingKV, now: float) -> None:
        state = kv.transfer.state
        if kv.ended or state.is_terminal:
            return
        if state is TransferState.BOOTSTRAPPING:
            if kv.unasked is not None:  # asked for once the pass is over (on this thread, not the engine's)
                if kv.handoff is not None:
                    self._ask(kv)
                else:  # this side's lease: a pass that stops writing layers (a hung engine) ends it
                    self._keep_leases(kv, now)
                return
            if kv.reservation.done():
                self._take_lease(kv, now)
            elif now > kv.reserve_deadline:
                self._reservation_unanswered(kv, now)
            return
        if state is TransferState.TRANSFERRING:
            if kv.handoff is not None and kv.delivered is None:
                self._deliver(kv)  # (again, until its frames are out)
            if kv.delivered is not None and kv.delivered.done():
                self._ask_commit(kv, now)
        elif state is TransferState.COMMITTING and kv.commit.done():
            self._committed(kv, now)
        self._keep_leases(kv, now)

    def _take_lease(self, kv: OutgoingKV, now: float) -> None:
        try:
            lease = kv.reservation.result()
        except Exception as e:
            self._fail(kv, f"prefill could not start: {_reason(e)}", _code(e))
            return
        kv.peer.name = kv.link.name = f"decode worker {lease.worker_id}"
        codec = self.codecs[lease.codec]  # one of those offered: the decode worker answers with one, or raw
        with self._lock:
            bandwidth = self._bandwidth.get(_peer_id(lease), DEFAULT_BANDWIDTH)
        controller = LevelController(codec, self._level_sizes[codec.name], bandwidth, kv.objective_deadline)
        layout = self.kv_cache.layout
        first = lease.cached_blocks * layout.block_size
        transfer_s = controller.transfer_s((kv.num_kv_tokens - first) * layout.num_layers)
        recompute = (self.settings.recompute and lease.recompute_s is not None and transfer_s is not None
                     and transfer_s > lease.recompute_s)
        if not recompute:
            try:
                kv.transport = self.settings.pick(lease.addresses, same_node=lease.node_id == self.node_id)
            except ValueError as e:  # the pools' settings disagree (a transport one lacks): not the request's
                self._fail(kv, f"prefill could not start: cannot send to {kv.peer.name}: {e}")
                return
            self._forget_old_addresses(lease)
        else:
            self.counters["recompute_chosen"] += 1
        by_objective = controller.deadline is not None and codec.num_levels > 1
        with kv.lock:
            if kv.ended:
                return
            kv.lease, kv.recompute = lease, recompute
            kv.layerwise = not recompute and streams_beside_pass(kv.new_tokens, self.settings.layerwise_min_tokens,
                                                                 by_objective)
            kv.transfer.advance(TransferState.TRANSFERRING)
            kv.progress_at = kv.contacted_at = now
        if recompute:
            return
        kv.link.sends.submit(kv, lambda: self._open(kv, controller, first)).add_done_callback(
            lambda opened: self._fail_on_error(kv, opened))
        if kv.layerwise:  # what was written before the lease came goes now; the rest as it is written
            self._start_sending(kv)

    def _start_sending(self, kv: OutgoingKV) -> None:
        with kv.lock:
            kv.sending = True
            layers = list(kv.written)
        for layer in layers:
            self._send_layer(kv, layer)

    def _deliver(self, kv: OutgoingKV) -> None:
        """The pass is over: every layer not yet handed goes; once they are out (nothing of the
        transfer's left on its link), the channel is finished, waiting for their answers."""
        if kv.recompute:
            kv.delivered = Future()
            kv.delivered.set_result(None)
            return
        if not kv.sending:
            self._start_sending(kv)
        if kv.pending == 0:
            kv.delivered = kv.link.ends.submit(kv, lambda: self._finish_channel(kv))

    def _ask_commit(self, kv: OutgoingKV, now: float) -> None:
        try:
            kv.delivered.result()
        except Exception as e:
            self._fail(kv, f"KV transfer failed: {_reason(e)}")
            return
        kv.transfer.advance_unless_finished(TransferState.COMMITTING)
        kv.progress_at = now
        kv.commit = kv.peer.commit(kv.transfer.transfer_id, kv.handoff, kv.recompute)
        kv.commit.add_done_callback(lambda _: self._wake.set())

    def _committed(self, kv: OutgoingKV, now: float) -> None:
        try:
            incomplete = kv.commit.result()
        except Exception as e:
            self._fail(kv, f"KV transfer failed: {_reason(e)}")
            return
        kv.progress_at = kv.contacted_at = now
        if not incomplete:
            if kv.transfer.advance_unless_finished(TransferState.DONE):  # else a cancel came during the commit
                self._record(kv)
                self._finish(kv, TransferOutcome())
            return
        if kv.resent and kv.handoff.images is not None:  # its embeddings are here: it starts over instead
            self._fail(kv, f"KV transfer failed: layers {incomplete} still incomplete after a resend")
            return
        if kv.resent:
            log.warning("request %s: layers %s still incomplete, the decode worker recomputes it", kv.request_id,
                        incomplete)
            self.counters["recomputed"] += 1
            kv.recompute = True
            kv.commit = kv.peer.commit(kv.transfer.transfer_id, kv.handoff, True)
            kv.commit.add_done_callback(lambda _: self._wake.set())
            return
        log.warning("request %s: layers %s arrived incomplete, sending them again", kv.request_id, incomplete)
        self.counters["frames_resent"] += 1
        kv.resent = True
        kv.transfer.advance_unless_finished(TransferState.TRANSFERRING)
        kv.delivered = None  # delivered again once the resend is out
        kv.link.sends.submit(kv, lambda: self._resend(kv, incomplete)).add_done_callback(
            lambda resent: self._fail_on_error(kv, resent))

    def _keep_leases(self, kv: OutgoingKV, now: float) -> None:
        """Renew the decode side's lease while the transfer progresses without a frame going (the pass
        writing layers whose frames are held for its end, whose KV is recomputed there or cached there;
        its frames waiting behind other transfers' on a link that moves), and expire this side's when
        the transfer stopped making progress. A pass that stops (a hung engine) renews nothing."""
        deadlines = self.settings.deadlines
        if kv.ended or kv.transfer.state.is_terminal:
            return
        if kv.renewal is not None and kv.renewal.done():
            if (error := kv.renewal.exception()) is not None:  # the decode side let the transfer go
                self._fail(kv, f"KV transfer failed: renewing its lease: {_reason(error)}")
                return
            kv.progress_at = kv.contacted_at = now
            kv.renewal = None
        if now - kv.progress_at > deadlines.sender_lease_s:
            self.counters["leases_expired"] += 1
            waiting = ("its commit's answer" if kv.transfer.state is TransferState.COMMITTING
                       else f"{kv.pending} pieces of its work on the link" if kv.pending
                       else "the prompt pass" if kv.handoff is None else "its delivery")
            self._fail(kv, f"lease expired: the transfer to {kv.peer.name} made no progress for "
                           f"{deadlines.sender_lease_s:.0f} s (waiting for {waiting})")
            return
        recent = deadlines.lease_s / 3
        progressing = now - kv.written_at < recent or (kv.pending > 0 and now - kv.link.sends.progress_at < recent)
        if kv.renewal is None and now - kv.contacted_at > recent and progressing and \
                kv.transfer.state is TransferState.TRANSFERRING:  # a commit under way is its own bound
            kv.renewal = kv.peer.renew(kv.transfer.transfer_id)

    def _reservation_unanswered(self, kv: OutgoingKV, now: float) -> None:
        """The decode worker left the reservation unanswered past the bound: its link takes no new
        transfer until it answers that one, and this one fails (the router places it elsewhere), with
        every other still waiting for a lease from it or yet to ask it for one (a short prompt in its
        pass, which would ask it next)."""
        bound = self.settings.deadlines.reservation_bound_s
        if kv.link.unanswered is None:
            self.counters["reservations_unanswered"] += 1
            kv.link.unanswered = (kv.reservation, now)
            log.warning("%s did not answer a KV reservation within %.0f s: its prompts go to other decode workers "
                        "until it does", kv.link.name, bound)
        with self._lock:
            waiting = [other for other in self._active if other.link is kv.link
                       and other.transfer.state is TransferState.BOOTSTRAPPING and not other.reservation.done()]
        outcome = TransferOutcome(f"prefill could not start: {kv.link.name} did not answer the KV reservation within "
                                  f"{bound:.0f} s", UNAVAILABLE, peer_not_answering=True)
        for other in {kv, *waiting}:
            self._finish(other, outcome)

    def _fail(self, kv: OutgoingKV, error: str, code: str = UNAVAILABLE) -> None:
        self._finish(kv, TransferOutcome(error, code))

    def _finish(self, kv: OutgoingKV, outcome: TransferOutcome) -> None:
        """End the transfer (a failure: aborted there, its channel drained) and tell the worker."""
        if self._end(kv, outcome.error or "committed"):
            if outcome.error is not None and kv.lease is not None:
                self.metrics.ended(kv.transport, kv.lease.codec, "failed")
            self._on_end(kv, outcome)

    def _record(self, kv: OutgoingKV) -> None:
        sent = kv.cutter.bytes_sent if kv.cutter is not None else 0
        kv.transfer.bytes_moved = sent
        events, layout = kv.transfer.events, self.kv_cache.layout
        self.metrics.ended(kv.transport, kv.lease.codec, "recomputed" if kv.recompute else "success", sent,
                           events[TransferState.DONE.value] - events[TransferState.TRANSFERRING.value])
        self.transfer_log.append({
            "bytes": sent, "first_layer": kv.times.get("first_frame", events[TransferState.TRANSFERRING.value]),
            "last_layer": kv.times.get("last_frame", 0.0), "prompt_done": kv.times.get("prompt_done", 0.0),
            "delivered": kv.times.get("delivered", 0.0), "committed": events[TransferState.DONE.value],
            "tokens": kv.num_kv_tokens, "recomputed": kv.recompute, "layerwise": kv.layerwise,
            "cached_tokens": kv.lease.cached_blocks * layout.block_size, "codec": kv.lease.codec,
            "levels": dict(kv.cutter.levels_used) if kv.cutter is not None else {}})

    # --- on the links -----------------------------------------------------------------------------
    def _send_layer(self, kv: OutgoingKV, layer: int) -> None:
        kv.link.sends.submit(kv, lambda: self._send_written(kv, layer)).add_done_callback(
            lambda sent: self._fail_on_error(kv, sent))

    def _piece_done(self, kv: OutgoingKV) -> None:
        """A link did a piece of the transfer's work: the loop looks again once all its work is out
        (delivery), or when it waits on that piece (a finished channel)."""
        if kv.pending == 0 and kv.handoff is not None:
            self._wake.set()

    def _send_written(self, kv: OutgoingKV, layer: int) -> None:
        with kv.lock:
            end, block_ids = kv.written[layer]
            cutter = kv.cutter
        if cutter is not None and not kv.transfer.state.is_terminal:
            cutter.send_through(layer, block_ids, end)

    def _open(self, kv: OutgoingKV, controller: LevelController, first: int) -> None:
        if kv.transfer.state.is_terminal:
            return
        channel = self._open_channel(kv.lease, kv.transfer.transfer_id)
        draft = self.draft.kv_cache if self.draft is not None and kv.lease.draft_layers else None
        cutter = FrameCutter(kv.transfer.transfer_id, channel, controller, self.kv_cache, first,
                             kv.num_kv_tokens, self.settings.frame_tokens,
                             before_frame=lambda: self._frame_due(kv), draft_cache=draft)
        with kv.lock:
            owned = not kv.ended
            if owned:
                kv.cutter = cutter
        if not owned:  # ended while it opened: `end` found no channel to close
            _close_logged(channel)

    def _frame_due(self, kv: OutgoingKV) -> None:
        """Before each of the transfer's frames is read: a transfer that ended reads no more of its
        blocks (the engine may hand them to another request); the channel took the frame before (it
        holds a bounded window unanswered): progress, which extends both sides' leases."""
        if kv.transfer.state.is_terminal:
            raise TransferError(f"transfer {kv.transfer.transfer_id} ended: no more frames")
        kv.progress_at = kv.contacted_at = time.monotonic()
        now = time.time()
        kv.times.setdefault("first_frame", now)
        kv.times["last_frame"] = now

    def _finish_channel(self, kv: OutgoingKV) -> None:
        """Wait until every frame handed so far is answered (what is left: the transport's window at most)."""
        with kv.lock:
            if kv.cutter is None or kv.ended:
                return
            kv.finishing = True
            channel = kv.cutter.channel
        try:
            channel.finish(self.settings.deadlines.commit_timeout_s)
        finally:
            kv.finishing = False
        kv.times.setdefault("delivered", time.time())

    def _resend(self, kv: OutgoingKV, layers: list[int]) -> None:
        """Send `layers` once more on a fresh channel (a finished one takes no more frames)."""
        if kv.transfer.state.is_terminal:
            return
        old = kv.cutter.channel
        fresh = self._open_channel(kv.lease, kv.transfer.transfer_id)
        with kv.lock:
            owned = not kv.ended
            if owned:
                kv.cutter.channel = fresh
            blocks = {layer: kv.written[layer][1] for layer in layers}
        _close_logged(old)
        if not owned:
            _close_logged(fresh)
            return
        kv.cutter.resend_layers(blocks)

    def _close(self, channel: LayerChannel, drain: bool, behind: OutgoingKV | None = None) -> None:
        """Close a channel; one of a transfer that ended early once its frames in flight are answered
        (a frame the decode side refused is answered too), so its resources are reused. `behind`: the
        transfer whose other work on its link (a frame being sent) goes first, for as long as a drain
        waits: a frame past `_frame_due` that went only after the drain found nothing unanswered left
        the channel closing on a frame in flight (shm then released its segment rather than reuse it)."""
        if drain and behind is not None:
            deadline = time.monotonic() + DRAIN_S
            while behind.pending > 1 and time.monotonic() < deadline:  # this piece is one
                time.sleep(0.005)
        if drain:
            try:
                channel.finish(DRAIN_S)
            except TransferError:
                pass  # not drained: `close` releases what it cannot reuse
            except Exception:  # the transport's own failure: the transfer is over, so it costs only the reuse
                log.exception("draining a KV channel failed; closing it")
        _close_logged(channel)

    def _fail_on_error(self, kv: OutgoingKV, done: Future) -> None:
        error = done.exception()
        if error is not None and not kv.transfer.state.is_terminal:
            self._fail(kv, f"KV transfer failed: {_reason(error)}")

    # --- transports -------------------------------------------------------------------------------
    def _link(self, peer: DecodePeer) -> _Link:
        with self._lock:
            if self._stopped.is_set():
                raise RuntimeError("the KV sender is closed")
            link = self._links.get(peer.key)
            if link is None:
                link = self._links[peer.key] = _Link(peer.name, self._piece_done, self._on_crash)
            return link

    def _open_channel(self, lease: Lease, transfer_id: str) -> LayerChannel:
        name = self.settings.pick(lease.addresses, same_node=lease.node_id == self.node_id)
        with self._lock:  # links open channels side by side: one sending half per transport
            transport = self._transports.get(name)
            if transport is None:
                frame_bytes = self.settings.frame_tokens * self.kv_cache.layout.bytes_per_token_layer
                transport = self._transports[name] = make_sender(
                    name, host=self.settings.host, tls=self.settings.tls, secret=self.settings.secret,
                    frame_bytes=frame_bytes)
        return self._wrap_channel(transport.open(lease.addresses[name], transfer_id))

    def _forget_old_addresses(self, lease: Lease) -> None:
        """A decode worker that restarted listens on new addresses: what the transports hold for its
        old ones (idle shm segments, tcp connections, a gloo group) is let go. Only as a transfer's
        lease is taken: a resend reopening a channel on an older lease must not take them back."""
        with self._lock:
            old = self._peer_addresses.get(lease.worker_id)
            self._peer_addresses[lease.worker_id] = lease.addresses
            transports = dict(self._transports)
        if old is not None and old != lease.addresses:
            log.info("decode worker %s moved from %s: letting go of those addresses", lease.worker_id, old)
        forget_moved(transports, old, lease.addresses)


def _close_logged(channel: LayerChannel) -> None:
    """Close a channel; a failure (its release message not sent) is logged, never raised: the
    transfer's blocks must still be freed and its router told, whatever the channel does."""
    try:
        channel.close()
    except Exception:
        log.exception("closing a KV channel failed")


def _peer_id(lease: Lease) -> str:
    """A decode worker as its leases name it (its node and where it listens)."""
    return f"{lease.node_id}|{sorted(lease.addresses.items())}"


def _code(error: BaseException) -> str:
    """The status a failed reservation gets: busy (decode memory full) is not broken, and a prompt
    the decode worker's engine refused is the request's own fault."""
    if _is(error, KVMemoryFull):
        return RESOURCE_EXHAUSTED
    return INVALID_ARGUMENT if _is(error, ValueError) else UNAVAILABLE


def _is(error: BaseException, cls: type) -> bool:
    """Whether `error`, or the error a remote call wrapped in it (Ray's `cause`), is a `cls`."""
    return isinstance(error, cls) or isinstance(getattr(error, "cause", None), cls)


def _reason(error: BaseException) -> str:
    """The innermost message of an exception, without a remote call's wrapping."""
    cause = getattr(error, "cause", None) or error.__cause__
    if isinstance(error, TransferError) or cause is None:
        text = str(error).strip()
        return text.splitlines()[-1] if text else type(error).__name__
    return _reason(cause)


def _pass_on(answered: Future, into: Future) -> None:
    """Hand a peer call's outcome on to the future the loop watches."""
    error = answered.exception() if not answered.cancelled() else TransferError("the reservation call was cancelled")
    if error is not None:
        into.set_exception(error)
    else:
        into.set_result(answered.result())
