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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray

from engine import EngineConfig, LLMEngine, RequestOutput
from engine.engine_loop import EngineLoop
from engine.scheduler import ScheduledChunk
from kv_transfer.receiver import TransferError
from kv_transfer.state import Transfer, TransferState
from kv_transfer.transports import GrpcTransport, LayerChannel, RayChannel
from router.wire import TokenSink, WorkRequest

log = logging.getLogger(__name__)
COMMIT_TIMEOUT_S = 30.0


@dataclass
class _Outgoing:
    transfer: Transfer
    channel: LayerChannel
    decode: Any  # the decode worker's actor handle
    started: float


class PrefillWorker:
    def __init__(self, worker_id: str, model_dir: str, engine_config: dict, token_sink: str, transport: str) -> None:
        self.worker_id = worker_id
        self.engine = LLMEngine(model_dir, EngineConfig(**engine_config))
        self.engine.set_layer_hook(self._push_layer)
        self.sink = TokenSink(token_sink)
        self.transport_name = transport
        self._grpc = GrpcTransport() if transport == "grpc" else None
        self._outgoing: dict[str, _Outgoing] = {}
        self._finishers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-commit")
        self.loop = EngineLoop(self.engine, self._on_outputs).start()

    def ping(self) -> dict:
        engine = self.engine
        return {"worker_id": self.worker_id, "free_blocks": engine.num_free_blocks,
                "total_blocks": engine.pool.num_blocks, "requests": len(engine.requests),
                "transfers": len(self._outgoing), "alive": self.loop.fatal_error is None}

    def prefill(self, work: WorkRequest, decode: Any, decode_kv_address: str | None) -> None:
        """Start one request's prefill and handoff; the outcome reaches the router as token messages."""
        transfer = Transfer(uuid.uuid4().hex, work.request_id)
        started = time.time()
        try:
            lease = ray.get(decode.reserve.remote(transfer.transfer_id, work.request_id, work.prompt_token_ids,
                                                  work.params, len(work.prompt_token_ids)))
            transfer.advance(TransferState.RESERVED)
            channel = (self._grpc.open(decode_kv_address, transfer.transfer_id) if self._grpc
                       else RayChannel(decode, transfer.transfer_id))
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
                outgoing.channel.push_layer(layer, self.engine.kv_cache.read(chunk.seq.block_table, layer))

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        for out in outputs:
            outgoing = self._outgoing.get(out.request_id)
            events = {"prefill_start": outgoing.started if outgoing else now, "prefill_end": now}
            if out.finish_reason == "prefilled" and outgoing is not None:
                self.sink.send(out.request_id, out.new_token_ids, logprobs=out.logprobs, events=events,
                               cached=out.num_cached_tokens)
                handoff = self.engine.export_handoff(out.request_id)
                self._finishers.submit(self._commit, out.request_id, outgoing, handoff)
            else:  # finished on its first token (stop, length, abort): nothing to hand over
                self.sink.send(out.request_id, out.new_token_ids, logprobs=out.logprobs, finish=out.finish_reason,
                               text=out.text, events=events, cached=out.num_cached_tokens)
                if outgoing is not None:
                    self._drop_transfer(out.request_id, outgoing, "request finished at prefill")

    # --- on a commit thread ---------------------------------------------------------------------
    def _commit(self, request_id: str, outgoing: _Outgoing, handoff: Any) -> None:
        try:
            outgoing.channel.finish(COMMIT_TIMEOUT_S)
            ray.get(outgoing.decode.commit.remote(outgoing.transfer.transfer_id, handoff), timeout=COMMIT_TIMEOUT_S)
            outgoing.transfer.bytes_moved = outgoing.channel.bytes_sent
            outgoing.transfer.advance(TransferState.SUCCESS)
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
