"""The client-facing gRPC service: validate, tokenize, place, dispatch, stream tokens back.

Each request gets its own server id (the client's `request_id` is only echoed back), is placed by
`routing.Router` (UNAVAILABLE at once when a pool has no live worker, RESOURCE_EXHAUSTED with a
`retry-after-ms` hint when every live one is at its limit or no placement can meet the TTFT
objective), dispatched with a Ray call that returns immediately, and then fed by token messages from the workers (pyzmq). A
request ends in a completed stream or an explicit gRPC error (a worker's error carries its status
code); when the client cancels or its deadline passes, the request is aborted on every worker it
touched, which frees its KV there.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.engine.sampling_params import SamplingParams, check_prompt
from pdserve.proto.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.admission import Overloaded
from pdserve.router.placement import NoHealthyWorker, WorkerRef
from pdserve.router.routing import Placement, Router
from pdserve.router.token_hub import TokenStreamHub
from pdserve.wire import TokenMessage, WorkRequest

log = logging.getLogger(__name__)
DEAD_WORKER_CHECK_S = 0.5  # how often a waiting stream looks whether its workers are still healthy


@dataclass
class ServedModel:
    name: str
    tokenizer: Any
    info: pdserve_pb2.ModelInfo


class RouterService(pdserve_pb2_grpc.PDServeServicer):
    def __init__(self, model: ServedModel, router: Router, hub: TokenStreamHub) -> None:
        self.model = model
        self.router = router
        self.hub = hub

    @property
    def prefill_pool(self) -> list[WorkerRef]:
        return self.router.prefill_pool

    @property
    def decode_pool(self) -> list[WorkerRef]:
        return self.router.decode_pool

    # --- RPCs -----------------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):  # noqa: N802
        return self.model.info

    async def Tokenize(self, request, context):  # noqa: N802
        await self._check_model(request.model, context)
        return pdserve_pb2.TokenizeResponse(token_ids=self.model.tokenizer.encode(request.text, add_special_tokens=False))

    async def Generate(self, request, context) -> AsyncIterator[pdserve_pb2.GenerateResponse]:  # noqa: N802
        accepted = time.time()
        await self._check_model(request.model, context)
        try:
            work = self._work_request(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.hub.error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the router's token stream failed: {self.hub.error}")
        try:
            placement = self.router.place(work)
        except NoHealthyWorker as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Overloaded as e:
            await _abort_overloaded(context, str(e), e.retry_after_s)
        queue = self.hub.subscribe(work.request_id)
        events: dict[str, float] = {}
        finished = False
        try:
            _dispatch(work, placement)
            client_id = request.request_id or work.request_id
            async for response in self._stream(work, queue, placement, accepted, events, context):
                finished = bool(response.finish_reason)
                response.request_id = client_id
                yield response
        finally:
            self.hub.unsubscribe(work.request_id)
            self.router.finished(placement, events)
            if not finished:  # cancelled, deadline, or failed: free its KV wherever it is
                for worker in placement.touched:
                    worker.handle.abort.remote(work.request_id)

    # --- steps ----------------------------------------------------------------------------------
    async def _check_model(self, name: str, context) -> None:
        if name and name != self.model.name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown model {name!r}; this server serves {self.model.name!r}")

    def _work_request(self, request: pdserve_pb2.GenerateRequest) -> WorkRequest:
        p = request.params
        # Unset optional fields (and max_tokens 0) take SamplingParams' own defaults.
        optional = {name: getattr(p, name) for name in ("temperature", "top_p", "seed") if p.HasField(name)}
        if p.max_tokens:
            optional["max_tokens"] = p.max_tokens
        params = SamplingParams(top_k=p.top_k, stop_token_ids=tuple(p.stop_token_ids), stop=tuple(p.stop),
                                ignore_eos=p.ignore_eos, logprobs=p.logprobs, **optional)
        kind = request.WhichOneof("prompt")
        if kind == "text":
            ids = self.model.tokenizer.encode(request.text, add_special_tokens=False)
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
        else:
            raise ValueError("prompt is missing: set text or token_ids")
        check_prompt(ids, self.model.info.vocab_size, self.model.info.max_model_len)
        return WorkRequest(uuid.uuid4().hex, ids, params)  # unique, whatever the client calls it

    async def _stream(self, work: WorkRequest, queue: asyncio.Queue, placement: Placement, accepted: float,
                      events: dict[str, float], context) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        detok = _Detokenizer(self.model.tokenizer, work.params)
        first_at: float | None = None
        while True:
            try:
                msg: TokenMessage = await asyncio.wait_for(queue.get(), DEAD_WORKER_CHECK_S)
            except asyncio.TimeoutError:
                dead = [w.name for w in placement.depends_on if not w.healthy]
                if dead:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"worker {', '.join(dead)} stopped responding while serving the request")
                continue
            if msg.error:
                await self._abort_failed(context, msg)
            events.update(msg.events)
            tokens = list(msg.token_ids)
            response = pdserve_pb2.GenerateResponse(server_request_id=work.request_id, token_ids=tokens,
                                                    logprobs=msg.logprobs)
            if first_at is None:
                first_at = time.time()
                response.prompt_tokens = len(work.prompt_token_ids)
                response.cached_tokens = msg.cached_tokens
                self.router.first_token(placement)  # its prompt pass is over
            if msg.finish_reason:
                response.text_delta = detok.finish(tokens, msg.text)
                response.finish_reason = msg.finish_reason
                response.timings.CopyFrom(_timings(accepted, first_at, time.time(), events))
                yield response
                return
            response.text_delta = detok.add(tokens)
            yield response

    async def _abort_failed(self, context, msg: TokenMessage) -> None:
        code = getattr(grpc.StatusCode, msg.error_code or "UNAVAILABLE", grpc.StatusCode.UNAVAILABLE)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # a worker's queue or KV memory: either pool's pace
            await _abort_overloaded(context, msg.error, self.router.retry_after_s())
        await context.abort(code, msg.error)


def _dispatch(work: WorkRequest, placement: Placement) -> None:
    """Hand the request to its workers (Ray calls that return at once; the outcome arrives as token
    messages): a whole request to a colocated or locally prefilling decode worker, else the prompt to
    its prefill worker, which streams the KV to the decode worker."""
    decode = placement.decode
    if placement.local:
        decode.handle.generate.remote(work)
        return
    prefill = placement.prefill
    prefill.handle.prefill.remote(work, decode.handle,
                                  new_tokens=placement.request.new_tokens(prefill))


async def _abort_overloaded(context, message: str, retry_after_s: float) -> None:
    ms = max(1, round(retry_after_s * 1000))
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{message} (retry after {ms} ms)",
                        trailing_metadata=(("retry-after-ms", str(ms)),))


class _Detokenizer:
    """Text deltas from token ids, holding back what a stop string could still cut off."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in params.stop), default=1) - 1

    def add(self, tokens: list[int]) -> str:
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 character waits for its next token
        stable = text[: len(text) - self.hold] if self.hold else text
        if not stable.startswith(self.sent) or len(stable) <= len(self.sent):
            return ""
        delta, self.sent = stable[len(self.sent) :], stable
        return delta

    def finish(self, tokens: list[int], final_text: str) -> str:
        self.ids += tokens
        return final_text[len(self.sent) :] if final_text.startswith(self.sent) else ""


def _timings(accepted: float, first_at: float | None, done: float, ev: dict[str, float]) -> pdserve_pb2.Timings:
    prefill_start = ev.get("prefill_start", accepted)
    prefill_end = ev.get("prefill_end", prefill_start)
    decode_start = ev.get("decode_start", prefill_end)
    return pdserve_pb2.Timings(
        queued_s=max(0.0, prefill_start - accepted),
        prefill_s=max(0.0, prefill_end - prefill_start),
        kv_transfer_s=max(0.0, decode_start - prefill_end),
        decode_s=max(0.0, ev.get("decode_end", done) - decode_start),
        ttft_s=(first_at or done) - accepted,
        e2e_s=done - accepted,
    )
