"""The prefill worker: computes prompts, samples the first token, streams KV to a decode worker.

Per request (`prefill`): reserve blocks on the chosen decode worker (a lease), run the prompt with
`prefill_only`, push each layer's KV the moment the forward pass writes it (the engine's layer hook),
then commit the handoff (first token included) and free the local blocks. Every failure aborts the
transfer on both sides and reports an error for the request to the router.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import torch

from pdserve.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.kv_transfer.interface import LayerChannel, TransferError
from pdserve.kv_transfer.state import Transfer, TransferState
from pdserve.kv_transfer.transports import GrpcTransport, RayChannel
from pdserve.wire import TokenSink, WorkRequest

log = logging.getLogger(__name__)
COMMIT_TIMEOUT_S = 30.0


@dataclass
class _Outgoing:
    transfer: Transfer
    channel: LayerChannel
    decode: Any  # the decode worker's actor handle
    started: float
    last_layer_at: float = 0.0


class PrefillWorker:
    def __init__(self, worker_id: str, model_dir: str, engine_config: dict, token_sink: str, transport: str) -> None:
        self.worker_id = worker_id
        self.engine = LLMEngine(model_dir, EngineConfig(**engine_config))
        self.engine.set_layer_hook(self._push_layer)
        self.sink = TokenSink(token_sink)
        self.transport_name = transport
        self._grpc = GrpcTransport() if transport == "grpc" else None
        self._outgoing: dict[str, _Outgoing] = {}
        self.transfer_log: deque[dict] = deque(maxlen=1024)  # completed transfers, for benchmarks
        # One sender thread keeps layer pushes in order and off the forward pass's thread.
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-send")
        self._finishers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-commit")
        self.loop = EngineLoop(self.engine, self._on_outputs).start()

    def ping(self) -> dict:
        engine = self.engine
        return {"worker_id": self.worker_id, "free_blocks": engine.num_free_blocks,
                "total_blocks": engine.pool.num_blocks, "requests": len(engine.requests),
                "transfers": len(self._outgoing), "alive": self.loop.fatal_error is None}

    def stats(self) -> dict:
        return {"transfers": list(self.transfer_log)}

    def probe_transfer(self, decode: Any, decode_kv_address: str | None, num_tokens: int) -> dict:
        """Transport bandwidth alone: push every layer of `num_tokens` tokens of KV, then abort it."""
        transfer_id = uuid.uuid4().hex
        lease = ray.get(decode.reserve.remote(transfer_id, f"probe-{transfer_id}", [3] * num_tokens,
                                              SamplingParams.greedy(max_tokens=1), num_tokens))
        layout = self.engine.kv_layout
        data = torch.randn(1, 2, lease.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim).to(
            layout.dtype)
        channel = self._open_channel(decode, decode_kv_address, transfer_id)
        t0 = time.perf_counter()
        for layer in range(layout.num_layers):
            channel.push_layer(layer, data)
        channel.finish(COMMIT_TIMEOUT_S)
        seconds = time.perf_counter() - t0
        ray.get(decode.abort_transfer.remote(transfer_id, "probe finished"))
        return {"bytes": channel.bytes_sent, "seconds": seconds}

    def _open_channel(self, decode: Any, decode_kv_address: str | None, transfer_id: str) -> LayerChannel:
        if self._grpc is not None:
            return self._grpc.open(decode_kv_address, transfer_id)
        return RayChannel(decode, transfer_id)

    def prefill(self, work: WorkRequest, decode: Any, decode_kv_address: str | None) -> None:
        """Start one request's prefill and handoff; the outcome reaches the router as token messages."""
        transfer = Transfer(uuid.uuid4().hex, work.request_id)
        started = time.time()
        try:
            # Raises when the decode worker refuses; the lease itself stays on the decode side.
            ray.get(decode.reserve.remote(transfer.transfer_id, work.request_id, work.prompt_token_ids,
                                          work.params, len(work.prompt_token_ids)))
            transfer.advance(TransferState.RESERVED)
            channel = self._open_channel(decode, decode_kv_address, transfer.transfer_id)
            self._outgoing[work.request_id] = _Outgoing(transfer, channel, decode, started)
            self.loop.call(lambda e: e.add_request(work.prompt_token_ids, work.params, work.request_id,
                                                   prefill_only=True))
        except Exception as e:
            self._fail(work.request_id, transfer, decode, f"prefill could not start: {_reason(e)}")

    def abort(self, request_id: str) -> bool:
        outgoing = self._outgoing.pop(request_id, None)
        if outgoing is not None:
            outgoing.transfer.fail("aborted")
            outgoing.decode.abort_transfer.remote(outgoing.transfer.transfer_id, "aborted by the router")
        return self.loop.call(lambda e: e.abort_request(request_id))

    def shutdown(self) -> None:
        self.loop.stop()
        self._sender.shutdown(wait=False, cancel_futures=True)
        self._finishers.shutdown(wait=False, cancel_futures=True)
        self.sink.close()
        if self._grpc:
            self._grpc.close()

    # --- on the engine loop thread --------------------------------------------------------------
    def _push_layer(self, layer: int, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            outgoing = self._outgoing.get(chunk.seq.request_id)
            if chunk.samples and outgoing is not None:  # the chunk that completes the prompt
                outgoing.transfer.advance(TransferState.TRANSFERRING)
                # The blocks stay held until the commit, so reading them later on the sender is safe.
                self._sender.submit(self._send_layer, outgoing, layer, list(chunk.seq.block_table))

    def _send_layer(self, outgoing: _Outgoing, layer: int, block_ids: list[int]) -> None:
        if outgoing.transfer.state.is_terminal:
            return
        outgoing.channel.push_layer(layer, self.engine.kv_cache.read(block_ids, layer))
        outgoing.last_layer_at = time.time()

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        for out in outputs:
            outgoing = self._outgoing.get(out.request_id)
            events = {"prefill_start": outgoing.started if outgoing else now, "prefill_end": now}
            if out.finish_reason == "prefilled" and outgoing is not None:
                self.sink.send(out.request_id, out.new_token_ids, logprobs=out.logprobs, events=events,
                               cached_tokens=out.num_cached_tokens)
                handoff = self.engine.export_handoff(out.request_id)
                self._finishers.submit(self._commit, out.request_id, outgoing, handoff)
            else:  # finished on its first token (stop, length, abort): nothing to hand over
                self.sink.send(out.request_id, out.new_token_ids, logprobs=out.logprobs,
                               finish_reason=out.finish_reason, text=out.text, events=events,
                               cached_tokens=out.num_cached_tokens)
                if outgoing is not None:
                    self._drop_transfer(out.request_id, outgoing, "request finished at prefill")

    # --- on a commit thread ---------------------------------------------------------------------
    def _commit(self, request_id: str, outgoing: _Outgoing, handoff: Any) -> None:
        try:
            self._sender.submit(lambda: None).result(COMMIT_TIMEOUT_S)  # every queued layer is pushed
            outgoing.channel.finish(COMMIT_TIMEOUT_S)
            ray.get(outgoing.decode.commit.remote(outgoing.transfer.transfer_id, handoff), timeout=COMMIT_TIMEOUT_S)
            outgoing.transfer.bytes_moved = outgoing.channel.bytes_sent
            outgoing.transfer.advance(TransferState.SUCCESS)
            ev = outgoing.transfer.events
            self.transfer_log.append({"bytes": outgoing.channel.bytes_sent, "first_layer": ev["transferring"],
                                      "last_layer": outgoing.last_layer_at, "committed": ev["success"]})
        except Exception as e:
            self._fail(request_id, outgoing.transfer, outgoing.decode, f"KV transfer failed: {_reason(e)}")
        finally:
            self._outgoing.pop(request_id, None)
            self.loop.submit(lambda eng: eng.abort_request(request_id))  # frees the held blocks

    def _drop_transfer(self, request_id: str, outgoing: _Outgoing, reason: str) -> None:
        self._outgoing.pop(request_id, None)
        if outgoing.transfer.fail(reason):
            outgoing.decode.abort_transfer.remote(outgoing.transfer.transfer_id, reason)

    def _fail(self, request_id: str, transfer: Transfer, decode: Any, reason: str) -> None:
        log.warning("request %s: %s", request_id, reason)
        self._outgoing.pop(request_id, None)
        if transfer.fail(reason):
            decode.abort_transfer.remote(transfer.transfer_id, reason)
        self.loop.submit(lambda e: e.abort_request(request_id))
        self.sink.send(request_id, error=reason)


def _reason(e: BaseException) -> str:
    """The innermost message of an exception, without Ray's wrapping."""
    cause = getattr(e, "cause", None) or e.__cause__
    if isinstance(e, TransferError) or cause is None:
        return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return _reason(cause)
