"""Decode side of the handoff: reserve blocks under a lease, take frames into them, commit or abort.

A reservation shares the leading blocks the decode worker's prefix cache already holds (the lease
says how many: the sender skips them) and agrees on a codec: the first of those offered that this
side can decode, else raw. It waits a bounded time (`reserve_wait_s`) for free blocks before it gives
up with `KVMemoryFull`, so a full decode pool slows prefill down instead of failing requests at once.
A lease starts at the reservation, which the prefill side makes beside the prompt pass (or as it
ends, for a prompt whose KV goes after it), and
every frame that arrives (a damaged or undecodable one too: its sender is alive) and every `renew`
extends it: it cannot expire under a transfer that makes progress.

Frames arrive from any transport, on its threads, through `receive_frame`: checked (its checksum), decoded
and written straight into the reserved blocks (one copy), without a round trip through the engine
loop; no running request reads those blocks. Each transfer's lock orders writes against an abort,
so a block is never written after it was freed. On CUDA a frame is taken on the receiving
thread's own stream (`side_streams.beside_the_engine`), not queued behind the engine's steps, and
its write has landed before the lock is let go. A corrupt frame, or one that does not decode (its
codec's own fault included), is counted and dropped; `commit` then names the layers still
incomplete, the sender sends their frames once more, and if they still do not arrive the request is
recomputed here from its tokens (`commit(..., recompute=True)`).

With a draft model on both sides (`SpeculativeConfig.draft_kv`: send), a reservation the sender asks
for holds blocks of the draft's pool too, where it has room (the lease says how many draft layers to
send: numbered after the target's, raw, from the prompt's first token). They are best effort: the
commit waits for the target's layers only, and the draft KV counts only if it all arrived (else the
draft's prompt pass runs here).

An abort may arrive before the reservation it cancels (Ray runs a threaded actor's calls in any
order); the request's (or the transfer's) tombstone makes that reservation fail.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.block_pool import OutOfBlocks
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import ImportReservation, LLMEngine, RequestHandoff
from pdserve.engine.multimodal.placement import PromptImages
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.kv_cache import KVLayout, PagedKVCache
from pdserve.kv_transfer.codecs import Codec, frame_checksum, make_codec, parse_offer, usable_codec
from pdserve.kv_transfer.interface import CorruptFrame, FrameHeader, KVMemoryFull, Lease, TransferError, shown
from pdserve.kv_transfer.side_streams import beside_the_engine, landed
from pdserve.kv_transfer.state import Transfer, TransferState
from pdserve.wire import Tombstones

log = logging.getLogger(__name__)
RESERVE_RETRY_S = 1.0  # a reservation waiting for room tries again this often at least (`_wait_for_room`)
FIRST_FRAME = "first_frame"  # the transfer's event: its first frame was written into the blocks
ENDED_KEPT = 4096  # transfers remembered after they end, for their frames still on the way (`admit_frame`)


@dataclass
class _Incoming:
    transfer: Transfer
    reservation: ImportReservation
    num_tokens: int
    codec: Codec
    expires_at: float  # time.monotonic(): a step of the wall clock must not expire every transfer
    first_token: int  # the first token the target's layers carry (those before are cached here)
    target_layers: int
    # [layer, token]: whether that token's KV of that layer (the target's layers, then the draft's) arrived intact
    written: np.ndarray
    # Frames are written into the blocks under `lock`, and only while the transfer takes frames: an
    # abort (failing the transfer) or the commit (handing the blocks to the engine) ends that under
    # the lock, so after any write under way.
    lock: threading.Lock = field(default_factory=threading.Lock)
    takes_frames: bool = True
    moved: bool = False  # a running request moved here from another decode worker, not a prompt's handoff

    def first_of(self, layer: int) -> int:
        """The first token `layer` carries: the draft's layers carry the whole prompt."""
        return self.first_token if layer < self.target_layers else 0

    def incomplete_layers(self) -> list[int]:
        """The target's layers still incomplete (the draft's are best effort: `draft_arrived`)."""
        return np.flatnonzero(~self.written[: self.target_layers, self.first_token :].all(axis=1)).tolist()

    def draft_arrived(self) -> bool:
        return len(self.written) > self.target_layers and bool(self.written[self.target_layers :].all())


class KVReceiver:
    def __init__(self, loop: EngineLoop, model_dir: str | Path | None = None, lease_s: float = 30.0,
                 reserve_wait_s: float = 10.0) -> None:
        self.loop = loop
        self.model_dir = model_dir
        self.lease_s = lease_s
        self.reserve_wait_s = reserve_wait_s
        self.layout = loop.engine.kv_layout
        self.kv_cache = loop.engine.kv_cache
        draft = loop.engine.draft_model  # its prompt KV may come with the target's
        self.draft_identity = draft.kv_identity if draft is not None else None
        self.draft_cache: PagedKVCache | None = draft.runner.kv_cache if draft is not None else None
        self._draft_raw = make_codec("raw", None, self.draft_cache.layout) if self.draft_cache is not None else None
        self._refused_drafts: set[str] = set()  # draft KV offered unlike this worker's (logged once each)
        self.aborted = Tombstones()
        # frames, corrupt_frames, refused_frames (dropped: no open transfer, or one the frame cannot
        # belong to), recomputed, bytes, cached_blocks, draft_kv_arrived, draft_kv_incomplete,
        # draft_kv_declined (offered, not taken)
        self.counters: Counter[str] = Counter()  # under `_counting`: frames arrive on many threads at once
        self._counting = threading.Lock()
        self._codecs: dict[str, Codec | None] = {}  # by offer; None: cannot be used here
        self._failed_codecs: set[str] = set()  # names of codecs that failed on an intact frame (`_give_up_on`)
        self._incoming: dict[str, _Incoming] = {}
        # Transfers that ended lately -> the most payload bytes one of their frames may have: frames
        # already on their way are still admitted (and refused once taken whole), so that a transport
        # whose two sides must stay in step (a process group's sends) is not torn down by a cancel.
        self._ended: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self.closed: str | None = None  # why no reservation is taken any more (`close`)

    # --- control plane --------------------------------------------------------------------------
    def reserve(self, transfer_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                num_kv_tokens: int, codecs: list[str] | tuple[str, ...] = ("raw",),
                draft_kv: str | None = None, output_token_ids: list[int] | None = None,
                images: PromptImages | None = None) -> Lease:
        """`draft_kv`: the sender can send the draft model's prompt KV too, of the draft it names
        (`DraftModelProposer.kv_identity`); taken when it is this worker's draft. `output_token_ids`:
        set (perhaps empty) for a running request moved here from another decode worker: the tokens
        it sampled before its last, whose KV comes with the prompt's. `images`: where a multimodal
        prompt's images are."""
        if self.closed is not None:
            raise TransferError(self.closed)
        transfer = Transfer(transfer_id, request_id)
        codec = self.negotiate(codecs)  # before any block is taken: nothing to give back if it fails
        try:
            reservation = self._reserve_blocks(transfer_id, request_id, prompt_token_ids, params, num_kv_tokens,
                                               self._takes_draft(draft_kv), output_token_ids or [], images)
        except Exception as e:
            transfer.fail(f"reserve failed: {e}")
            raise
        transfer.advance(TransferState.TRANSFERRING)
        draft_layers = self.draft_cache.layout.num_layers if reservation.draft_block_ids else 0
        incoming = _Incoming(transfer, reservation, num_kv_tokens, codec, time.monotonic() + self.lease_s,
                             reservation.cached_blocks * self.layout.block_size, self.layout.num_layers,
                             np.zeros((self.layout.num_layers + draft_layers, num_kv_tokens), dtype=bool),
                             moved=output_token_ids is not None)
        with self._lock:
            closed = self.closed
            if closed is None:
                self._incoming[transfer_id] = incoming
        if closed is not None:  # closed while the blocks were being reserved: nothing may write into them
            transfer.fail(closed)
            self.loop.post(lambda e: e.abort_request(request_id))
            raise TransferError(closed)
        self._count("cached_blocks", reservation.cached_blocks)
        if draft_kv is not None and not draft_layers:  # another draft, or no room in the draft pool
            self._count("draft_kv_declined")
        if request_id in self.aborted or transfer_id in self.aborted:  # aborted while being made
            self.abort(transfer_id, "aborted during the reservation")
            raise TransferError(f"request {request_id!r} was aborted")
        return self._lease(incoming)

    def _lease(self, incoming: _Incoming) -> Lease:
        reservation = incoming.reservation
        return Lease(incoming.transfer.transfer_id, reservation.num_blocks, self.lease_s, reservation.cached_blocks,
                     incoming.codec.name, draft_layers=len(incoming.written) - incoming.target_layers)

    def _takes_draft(self, offered: str | None) -> bool:
        """Whether a sender's draft KV (`offered`: its draft's identity) can serve this worker's draft."""
        if offered is None or self.draft_identity is None:
            return False
        if offered != self.draft_identity and shown(offered) not in self._refused_drafts:
            if len(self._refused_drafts) < 64:  # bounded: a peer's text, cut
                self._refused_drafts.add(shown(offered))
            log.warning("draft KV %s refused: this decode worker's draft is %r (give both pools the same "
                        "speculative settings); its draft's prompt pass runs here", shown(offered), self.draft_identity)
        return offered == self.draft_identity

    def negotiate(self, offered: list[str] | tuple[str, ...]) -> Codec:
        """The first offered codec (`codecs.offers`) this side can decode, holding what the offer's
        digest names; raw when none (it always can)."""
        for offered_as in [*offered, "raw"]:
            if offered_as not in self._codecs:
                self._codecs[offered_as] = self._usable(*parse_offer(offered_as))
            if self._codecs[offered_as] is not None:
                return self._codecs[offered_as]
        raise AssertionError("raw is always available")

    def _usable(self, name: str, digest: str) -> Codec | None:
        """The codec `name` if this side can decode it as the offer's sender encodes (None: logged)."""
        codec = usable_codec(name, self.model_dir, self.layout, "refused, negotiating down")
        if codec is not None and codec.digest != digest:
            log.warning("codec %r refused, negotiating down: the prefill worker's tables or coding (digest %r) "
                        "are not this worker's (%r); profile once, give both pools the same model directory "
                        "and the same pdserve version", name, digest, codec.digest)
            return None
        return codec

    def _reserve_blocks(self, transfer_id: str, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams, num_kv_tokens: int, draft_kv: bool,
                        output_token_ids: list[int], images: PromptImages | None) -> ImportReservation:
        deadline = time.monotonic() + self.reserve_wait_s

        def ended() -> bool:
            # Either tombstone: the prefill side ends a transfer on its own (a request done at its
            # first token, a preemption) by the transfer's id, and nothing aborts the request here.
            return request_id in self.aborted or transfer_id in self.aborted or self.closed is not None

        while True:
            if ended():
                raise TransferError(self.closed or f"request {request_id!r} was aborted")
            try:
                return self.loop.call(lambda e: e.begin_import(request_id, prompt_token_ids, params, num_kv_tokens,
                                                               draft_kv, output_token_ids, images),
                                      timeout=max(1.0, deadline - time.monotonic()), kind="kv")
            except OutOfBlocks as e:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise KVMemoryFull(f"decode worker's KV memory stayed full for {self.reserve_wait_s:g} s: {e}") \
                        from None
                self._wait_for_room(e.free, min(remaining, RESERVE_RETRY_S), ended)
            except ValueError:  # the request's own fault (its prompt), as the engine found it: no retry cures it
                raise
            except Exception as e:
                raise TransferError(f"decode worker cannot take request {request_id!r}: {e}") from e

    def _wait_for_room(self, free: int, timeout: float, ended: Callable[[], bool]) -> None:
        """Until the pool has more than `free` blocks free (what it had when the reservation failed),
        the reservation `ended`, or `timeout`. Trying again sooner repeats the failure on the engine
        loop between its steps (the prompt's hashing and prefix lookup: with many reservations
        waiting, milliseconds per step); `timeout` (RESERVE_RETRY_S at most) covers room made another
        way (a prefix the request can share, cached meanwhile)."""
        deadline = time.monotonic() + timeout
        pool = self.loop.engine.pool
        while not ended() and self.loop.running and pool.num_free <= free and time.monotonic() < deadline:
            self.loop.wait_progress(min(deadline - time.monotonic(), 0.1))  # a stopped loop: the next try says so

    # --- data plane: every transport's FrameSink ------------------------------------------------
    def admit_frame(self, header: FrameHeader) -> None:
        """TransferError unless the frame could belong to a transfer held here (`FrameSink`): its layer
        and tokens within what it carries, its codec the agreed one or raw, and its payload no larger
        than those tokens' raw KV (a sender sends raw any frame its codec would make larger)."""
        with self._lock:
            incoming = self._incoming.get(header.transfer_id)
            ended_most = self._ended.get(header.transfer_id)
        if incoming is not None:
            self._check_frame(incoming, header)
            most = header.num_tokens * self._layout_of(incoming, header.layer).bytes_per_token_layer
        elif ended_most is not None:
            most = ended_most
        else:
            raise TransferError(f"no open transfer {shown(header.transfer_id)} (aborted, expired or never reserved)")
        if header.payload_bytes > most:
            raise TransferError(f"frame of {header.payload_bytes} bytes for {header.num_tokens} tokens "
                                f"(at most {most})")

    def _check_frame(self, incoming: _Incoming, header: FrameHeader) -> None:
        layers = len(incoming.written)
        if not 0 <= header.layer < layers:
            raise TransferError(f"layer {header.layer} outside [0, {layers})")
        first = incoming.first_of(header.layer)
        if not first <= header.start_token < header.start_token + header.num_tokens <= incoming.num_tokens:
            raise TransferError(f"frame tokens [{header.start_token}, {header.start_token + header.num_tokens}) "
                                f"outside the [{first}, {incoming.num_tokens}) this transfer carries")
        agreed = incoming.codec.name if header.layer < incoming.target_layers else "raw"  # the draft's: raw
        if header.codec not in (agreed, "raw"):
            raise TransferError(f"frame in codec {shown(header.codec)}, {agreed!r} was agreed")

    def _layout_of(self, incoming: _Incoming, layer: int) -> KVLayout:
        return self.layout if layer < incoming.target_layers else self.draft_cache.layout

    def receive_frame(self, header: FrameHeader, payload: memoryview | torch.Tensor) -> None:
        with beside_the_engine(self.kv_cache.data.device):
            self._receive(header, payload)

    def _receive(self, header: FrameHeader, payload: memoryview | torch.Tensor) -> None:
        try:
            self._verify(header, payload)
        except CorruptFrame:  # the sender is alive all the same: its transfer's lease lasts (its id intact)
            if (damaged := self._find(header.transfer_id)) is not None:
                self._extend(damaged)
            raise
        try:
            incoming = self._get(header.transfer_id)
        except TransferError:
            self._count("refused_frames")
            raise
        self._extend(incoming)  # a frame that arrives is progress, even one not taken
        try:
            kv = self._decode(incoming, header, payload)
        except CorruptFrame as e:  # intact on the wire, yet it does not decode: dropped as a damaged frame is,
            # so its layer is sent again and then recomputed here, rather than the whole transfer failing
            self._count("corrupt_frames")
            log.warning("transfer %s: frame of layer %d at token %d dropped: %s", shown(header.transfer_id),
                        header.layer, header.start_token, e)
            raise
        except TransferError as e:
            self._count("refused_frames")
            self.abort(header.transfer_id, str(e))
            raise
        if header.layer < incoming.target_layers:
            cache, block_ids, layer = self.kv_cache, incoming.reservation.block_ids, header.layer
        else:
            cache, block_ids = self.draft_cache, incoming.reservation.draft_block_ids
            layer = header.layer - incoming.target_layers
        slots = cache.token_slots(block_ids, header.start_token, header.num_tokens)
        with incoming.lock:
            if not incoming.takes_frames or incoming.transfer.state.is_terminal:
                self._count("refused_frames")
                raise TransferError(f"transfer {shown(header.transfer_id)} already ended "
                                    f"({incoming.transfer.error or 'committing'})")
            try:
                cache.write_tokens(layer, slots, kv)
            finally:
                landed(self.kv_cache.data.device)
            incoming.written[header.layer, header.start_token : header.start_token + header.num_tokens] = True
            incoming.transfer.bytes_moved += payload.nbytes
            incoming.transfer.events.setdefault(FIRST_FRAME, time.time())
        self._count("frames")
        self._count("bytes", payload.nbytes)

    def _verify(self, header: FrameHeader, payload: memoryview | torch.Tensor) -> None:
        """CorruptFrame (counted) unless the frame's checksum holds. Checked first: it covers the
        transfer's id too, and a damaged id is a corrupt frame (sent again), not a frame of no open
        transfer (which ends the transfer as refused)."""
        if payload.nbytes != header.payload_bytes or frame_checksum(header, payload) != header.crc32:
            self._count("corrupt_frames")
            log.warning("transfer %s: frame of layer %d at token %d dropped: checksum mismatch (its header or "
                        "its bytes)", shown(header.transfer_id), header.layer, header.start_token)
            raise CorruptFrame(f"checksum mismatch on a frame of layer {header.layer} (its header or its bytes)")

    def _decode(self, incoming: _Incoming, header: FrameHeader, payload: memoryview | torch.Tensor) -> torch.Tensor:
        """The KV of a frame whose checksum holds; TransferError for a frame that could not belong to
        this transfer, CorruptFrame for one that does not decode (for whatever reason)."""
        self._check_frame(incoming, header)
        layout = self._layout_of(incoming, header.layer)
        if header.layer >= incoming.target_layers:  # the draft's KV
            codec = self._draft_raw
        else:
            codec = incoming.codec if header.codec == incoming.codec.name else self.negotiate(["raw"])
        try:
            kv = codec.decode(payload, header.layer, header.level, header.num_tokens, layout.dtype)
        except (CorruptFrame, TransferError):
            raise
        except Exception as e:  # a fault of the codec's own (a bug): the frame is dropped as one that does
            # not decode, so the request is recomputed here at worst
            self._give_up_on(codec, e)
            raise CorruptFrame(f"codec {codec.name!r} failed on it: {type(e).__name__}: {e}") from e
        expected = (2, header.num_tokens, layout.num_kv_heads, layout.head_dim)
        if tuple(kv.shape) != expected:
            self._give_up_on(codec, ValueError(f"decoded to shape {tuple(kv.shape)}, not {expected}"))
            raise CorruptFrame(f"codec {codec.name!r} decoded it to shape {tuple(kv.shape)}, not {expected}")
        return kv

    def _give_up_on(self, codec: Codec, error: Exception) -> None:
        """A codec that failed on an intact frame is agreed to no more (raw, which every transfer
        falls back to, excepted): later reservations negotiate down to raw, rather than each of its
        transfers sending its KV twice and recomputing it. Its first error is logged with the traceback."""
        with self._lock:
            first = codec.name not in self._failed_codecs
            self._failed_codecs.add(codec.name)
            if codec.name != "raw":
                for offer, known in self._codecs.items():
                    if known is codec:
                        self._codecs[offer] = None
        if first:
            log.error("codec %r failed on an intact frame%s: %s: %s", codec.name,
                      "" if codec.name == "raw" else ", so it is refused from now on (transfers negotiate down to raw)",
                      type(error).__name__, error, exc_info=error)

    # --- control plane, continued ---------------------------------------------------------------
    def renew(self, transfer_id: str) -> Lease:
        """Extend a lease whose transfer is still making progress on the sending side."""
        return self._lease(self._extend(self._get(transfer_id)))

    def _extend(self, incoming: _Incoming) -> _Incoming:
        incoming.expires_at = time.monotonic() + self.lease_s
        return incoming

    def commit(self, transfer_id: str, handoff: RequestHandoff, recompute: bool = False) -> list[int]:
        """Admit the request once every layer is complete; returns the layers still incomplete (empty
        once admitted: the sender sends those layers' frames again and commits once more).
        `recompute`: give up on the KV and recompute it here from the handoff's tokens."""
        incoming = self._get(transfer_id)
        if handoff.request_id != incoming.transfer.request_id:  # a caller's bug: refuse, holding on to nothing
            self.abort(transfer_id, f"committed as request {handoff.request_id!r}")
            raise TransferError(f"transfer {transfer_id} is request {incoming.transfer.request_id!r}'s, "
                                f"not {handoff.request_id!r}'s")
        if not recompute:
            incomplete = incoming.incomplete_layers()
            if incomplete:
                return incomplete
        with self._lock:  # taken out first, so lease expiry cannot abort a commit under way
            owned = self._take_out(transfer_id) is incoming
        if not owned:  # an abort took it out since `_get`: it frees the blocks; a recompute would revive it
            raise TransferError(f"transfer {transfer_id} was aborted while committing")
        with incoming.lock:  # a frame being written ends first; none is written once the engine has the blocks
            incoming.takes_frames = False
        incoming.transfer.advance_unless_finished(TransferState.COMMITTING)

        def admit(engine: LLMEngine) -> None:
            # On the loop, after any abort queued before: a cancel now finds no open transfer and only
            # leaves its tombstone (before queueing its engine abort), so admitting would revive the request.
            if handoff.request_id in self.aborted or transfer_id in self.aborted:
                raise TransferError(f"request {handoff.request_id!r} was aborted")
            if self.closed is not None:  # the worker failed after this commit took the transfer out
                raise TransferError(self.closed)
            if recompute:
                engine.resume_request(handoff)
            else:
                engine.commit_import(handoff, incoming.codec.lossless, draft_arrived)

        draft_arrived = incoming.draft_arrived()
        try:
            self.loop.call(admit, kind="kv")
            if recompute:
                self._count("recomputed")
                log.warning("request %s: KV did not arrive intact, recomputing it here", handoff.request_id)
            elif len(incoming.written) > incoming.target_layers:  # a draft KV was reserved for
                self._count("draft_kv_arrived" if draft_arrived else "draft_kv_incomplete")
        except Exception as e:
            incoming.transfer.fail(f"commit failed: {e}")
            self.loop.post(lambda eng: eng.abort_request(handoff.request_id))
            raise TransferError(str(e)) from e
        incoming.transfer.advance(TransferState.DONE)
        return []

    def started_at(self, transfer_id: str) -> float:
        """When the transfer's first frame arrived (when it was reserved, if none did: recomputed here)."""
        events = self._get(transfer_id).transfer.events
        return events.get(FIRST_FRAME, events[TransferState.TRANSFERRING.value])

    def is_move(self, transfer_id: str) -> bool:
        """Whether the transfer moves a running request here (reserved with its sampled tokens)."""
        return self._get(transfer_id).moved

    def reserved_at(self, transfer_id: str) -> float:
        """When the transfer's blocks were reserved."""
        return self._get(transfer_id).transfer.events[TransferState.TRANSFERRING.value]

    def abort(self, transfer_id: str, reason: str) -> bool:
        """Free the reservation (idempotent). True if this call did it."""
        with self._lock:  # the tombstone under the lock `reserve` inserts under, so it sees one or the other
            incoming = self._take_out(transfer_id)
            if incoming is None:  # perhaps not reserved yet: the reservation will find this tombstone
                self.aborted.add(transfer_id)
        return incoming is not None and self._end(incoming, reason)

    def _end(self, incoming: _Incoming, reason: str) -> bool:
        """Fail a transfer taken out of `_incoming` and free its blocks, unless it ended already."""
        with incoming.lock:  # no frame is being written into the blocks while they are freed
            if not incoming.transfer.fail(reason):
                return False
        request_id = incoming.transfer.request_id
        self.loop.post(lambda e: e.abort_request(request_id))
        return True

    def abort_request(self, request_id: str, reason: str) -> bool:
        self.aborted.add(request_id)
        with self._lock:
            ids = [t for t, inc in self._incoming.items() if inc.transfer.request_id == request_id]
        return any([self.abort(t, reason) for t in ids])

    def close(self, reason: str) -> list[str]:
        """Take no reservation any more, and abort every open one (the worker failed); returns their
        request ids. A reservation under way as this runs is aborted as it ends, so no transfer
        writes into blocks the worker's engine-wide abort freed."""
        with self._lock:
            self.closed = self.closed or reason
        return self.abort_all(reason)

    def abort_all(self, reason: str) -> list[str]:
        """Abort every open transfer; returns their request ids."""
        with self._lock:
            open_transfers = [(t, inc.transfer.request_id) for t, inc in self._incoming.items()]
        return [request_id for t, request_id in open_transfers if self.abort(t, reason)]

    def expire_leases(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        # Checked and taken out at once: a frame, a renewal or a commit landing in between wins instead
        # (an abort by id would leave its tombstone, and a commit under way would fail on it).
        with self._lock:
            late = [self._take_out(t) for t, inc in list(self._incoming.items()) if inc.expires_at < now]
        expired = [inc.transfer.transfer_id for inc in late if self._end(inc, "lease expired")]
        self._count("leases_expired", len(expired))
        return expired

    def _count(self, name: str, amount: int = 1) -> None:
        with self._counting:
            self.counters[name] += amount

    def counts(self) -> dict[str, int]:
        """The counters as they stand (frames, bytes, refused, corrupt, recomputed, ...)."""
        with self._counting:
            return dict(self.counters)

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._incoming)

    def _take_out(self, transfer_id: str) -> _Incoming | None:
        """Take an open transfer out, remembering it among those that ended. Under `_lock`."""
        incoming = self._incoming.pop(transfer_id, None)
        if incoming is not None:
            carried = (incoming.num_tokens - incoming.first_token) * self.layout.bytes_per_token_layer
            if len(incoming.written) > incoming.target_layers:  # the draft's layers carry the whole prompt
                carried = max(carried, incoming.num_tokens * self.draft_cache.layout.bytes_per_token_layer)
            self._ended[transfer_id] = carried
            if len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
        return incoming

    def _find(self, transfer_id: str) -> _Incoming | None:
        with self._lock:
            return self._incoming.get(transfer_id)

    def _get(self, transfer_id: str) -> _Incoming:
        incoming = self._find(transfer_id)
        if incoming is None:
            raise TransferError(f"no open transfer {shown(transfer_id)} (aborted, expired or never reserved)")
        return incoming
