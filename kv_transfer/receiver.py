"""Decode side of the handoff: reserve blocks under a lease, take layer payloads, commit or abort.

A reservation waits a bounded time (`reserve_wait_s`) for free blocks before it gives up with
`KVMemoryFull`, so a full decode pool slows prefill down instead of failing requests at once. A lease
starts at the reservation, which the prefill side makes just before the prompt pass, and every layer
that arrives (and every `renew`) extends it: it cannot expire under a transfer that makes progress.
An abort may arrive before the reservation it cancels (Ray runs a threaded actor's calls in any
order); the request's (or the transfer's) tombstone makes that reservation fail.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from pdserve.engine.block_pool import OutOfBlocks
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.kv_cache import KVBlocks
from pdserve.engine.llm_engine import RequestHandoff
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.codec import RawCodec, checksum
from pdserve.kv_transfer.interface import KVMemoryFull, Lease, TransferError
from pdserve.kv_transfer.state import Transfer, TransferState
from pdserve.wire import Tombstones


@dataclass
class _Incoming:
    transfer: Transfer
    num_blocks: int
    num_tokens: int
    expires_at: float
    layers: set[int]


class KVReceiver:
    def __init__(self, loop: EngineLoop, lease_s: float = 30.0, reserve_wait_s: float = 10.0) -> None:
        self.loop = loop
        self.lease_s = lease_s
        self.reserve_wait_s = reserve_wait_s
        layout = loop.engine.kv_layout
        self.num_layers = layout.num_layers
        self.block_size = layout.block_size
        self._layer_shape = (1, 2, 0, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.dtype = layout.dtype
        self.aborted = Tombstones()
        self._incoming: dict[str, _Incoming] = {}
        self._lock = threading.Lock()

    def reserve(self, transfer_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                num_kv_tokens: int) -> Lease:
        transfer = Transfer(transfer_id, request_id)
        try:
            blocks = self._reserve_blocks(request_id, prompt_token_ids, params, num_kv_tokens)
        except Exception as e:
            transfer.fail(f"reserve failed: {e}")
            raise
        transfer.advance(TransferState.RESERVED)
        lease = Lease(transfer_id, blocks, time.time() + self.lease_s)
        with self._lock:
            self._incoming[transfer_id] = _Incoming(transfer, blocks, num_kv_tokens, lease.expires_at, set())
        if request_id in self.aborted or transfer_id in self.aborted:  # aborted while being made
            self.abort(transfer_id, "aborted during the reservation")
            raise TransferError(f"request {request_id!r} was aborted")
        return lease

    def _reserve_blocks(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        num_kv_tokens: int) -> int:
        deadline = time.monotonic() + self.reserve_wait_s
        while True:
            if request_id in self.aborted:
                raise TransferError(f"request {request_id!r} was aborted")
            try:
                return self.loop.call(lambda e: e.begin_import(request_id, prompt_token_ids, params, num_kv_tokens),
                                      timeout=max(1.0, deadline - time.monotonic()), kind="kv")
            except OutOfBlocks as e:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise KVMemoryFull(f"decode worker's KV memory stayed full for {self.reserve_wait_s:g} s: {e}") \
                        from None
                self.loop.wait_progress(min(remaining, 0.1))
            except Exception as e:
                raise TransferError(f"decode worker cannot take request {request_id!r}: {e}") from e

    def receive_layer(self, transfer_id: str, layer: int, payload: bytes | np.ndarray, crc: int) -> None:
        incoming = self._get(transfer_id)
        try:
            if checksum(payload) != crc:
                raise TransferError(f"checksum mismatch on layer {layer}")
            if not 0 <= layer < self.num_layers:
                raise TransferError(f"layer {layer} outside [0, {self.num_layers})")
            shape = list(self._layer_shape)
            shape[2] = incoming.num_blocks
            data = RawCodec.decode(payload, self.dtype, tuple(shape))
            kv = KVBlocks(incoming.transfer.request_id, list(range(incoming.num_blocks)), layer, data,
                          incoming.num_tokens, self.block_size)
            self.loop.call(lambda e: e.import_kv(kv), kind="kv")
        except Exception as e:
            self.abort(transfer_id, f"layer {layer}: {e}")
            raise TransferError(str(e)) from e
        incoming.transfer.advance_unless_finished(TransferState.TRANSFERRING)
        incoming.transfer.bytes_moved += memoryview(payload).nbytes
        incoming.layers.add(layer)
        incoming.expires_at = time.time() + self.lease_s

    def renew(self, transfer_id: str) -> Lease:
        """Extend a lease whose transfer is still making progress on the sending side."""
        incoming = self._get(transfer_id)
        incoming.expires_at = time.time() + self.lease_s
        return Lease(transfer_id, incoming.num_blocks, incoming.expires_at)

    def commit(self, transfer_id: str, handoff: RequestHandoff) -> None:
        incoming = self._get(transfer_id)
        missing = set(range(self.num_layers)) - incoming.layers
        if missing:
            self.abort(transfer_id, f"commit with layers {sorted(missing)} missing")
            raise TransferError(f"transfer {transfer_id}: layers {sorted(missing)} never arrived")
        with self._lock:  # taken out first, so lease expiry cannot abort a commit under way
            self._incoming.pop(transfer_id, None)
        try:
            self.loop.call(lambda e: e.commit_import(handoff), kind="kv")
        except Exception as e:
            incoming.transfer.fail(f"commit failed: {e}")
            self.loop.submit(lambda eng: eng.abort_request(handoff.request_id))
            raise TransferError(str(e)) from e
        incoming.transfer.advance(TransferState.SUCCESS)

    def abort(self, transfer_id: str, reason: str) -> bool:
        """Free the reservation (idempotent). True if this call did it."""
        with self._lock:
            incoming = self._incoming.pop(transfer_id, None)
        if incoming is None:  # perhaps not reserved yet: the reservation will find this tombstone
            self.aborted.add(transfer_id)
            return False
        if not incoming.transfer.fail(reason):
            return False
        request_id = incoming.transfer.request_id
        self.loop.submit(lambda e: e.abort_request(request_id))
        return True

    def abort_request(self, request_id: str, reason: str) -> bool:
        self.aborted.add(request_id)
        with self._lock:
            ids = [t for t, inc in self._incoming.items() if inc.transfer.request_id == request_id]
        return any([self.abort(t, reason) for t in ids])

    def abort_all(self, reason: str) -> list[str]:
        """Abort every open transfer; returns their request ids."""
        with self._lock:
            open_transfers = [(t, inc.transfer.request_id) for t, inc in self._incoming.items()]
        return [request_id for t, request_id in open_transfers if self.abort(t, reason)]

    def expire_leases(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        with self._lock:
            late = [t for t, inc in self._incoming.items() if inc.expires_at < now]
        return [t for t in late if self.abort(t, "lease expired")]

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._incoming)

    def _get(self, transfer_id: str) -> _Incoming:
        with self._lock:
            incoming = self._incoming.get(transfer_id)
        if incoming is None:
            raise TransferError(f"no open transfer {transfer_id!r} (aborted, expired or never reserved)")
        return incoming
