"""The client-facing gRPC service: the request path of `router.frontend` behind the PDServe API.

A refusal or failure (`RequestFailed`) ends the call with its gRPC status code; RESOURCE_EXHAUSTED
carries the trailing metadata `retry-after-ms`. The client's `request_id` is only echoed back.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.frontend import Frontend, RequestFailed


class RouterService(pdserve_pb2_grpc.PDServeServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    # --- RPCs -----------------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):  # noqa: N802
        return self.frontend.model.info

    async def Tokenize(self, request, context):  # noqa: N802
        try:
            self.frontend.check_model(request.model)
        except RequestFailed as e:
            await abort(context, e)
        return pdserve_pb2.TokenizeResponse(token_ids=self.frontend.tokenize(request.text))

    async def Generate(self, request: pdserve_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        frontend, accepted = self.frontend, time.time()
        try:
            with frontend.refusals("grpc"):
                frontend.check_model(request.model)
                kind = request.WhichOneof("prompt")
                if kind is None:
                    raise ValueError("prompt is missing: set text or token_ids")
                prompt = request.text if kind == "text" else list(request.token_ids.ids)
                active = frontend.start("grpc", prompt, sampling_params(request.params), request.request_id, accepted)
        except RequestFailed as e:
            await abort(context, e)
        try:
            async for response in active.responses():
                yield response
        except RequestFailed as e:
            await abort(context, e)
        finally:
            active.finish()


def sampling_params(p: pdserve_pb2.SamplingParams) -> SamplingParams:
    """The engine's parameters from the API's; unset optional fields (and max_tokens 0) take
    SamplingParams' own defaults. Raises ValueError on bad values."""
    optional = {name: getattr(p, name) for name in ("temperature", "top_p", "seed") if p.HasField(name)}
    if p.max_tokens:
        optional["max_tokens"] = p.max_tokens
    return SamplingParams(top_k=p.top_k, stop_token_ids=tuple(p.stop_token_ids), stop=tuple(p.stop),
                          ignore_eos=p.ignore_eos, logprobs=p.logprobs, **optional)


async def abort(context: grpc.aio.ServicerContext, e: RequestFailed) -> None:
    code = getattr(grpc.StatusCode, e.code, grpc.StatusCode.UNKNOWN)
    if e.retry_after_s is None:
        await context.abort(code, e.message)
    ms = max(1, round(e.retry_after_s * 1000))
    await context.abort(code, f"{e.message} (retry after {ms} ms)", trailing_metadata=(("retry-after-ms", str(ms)),))
