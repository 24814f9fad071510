"""The client-facing gRPC service: the request path of `router.frontend` behind the PDServe API.

A refusal or failure (`RequestFailed`) ends the call with its gRPC status code; RESOURCE_EXHAUSTED
carries the trailing metadata `retry-after-ms`. The client's `request_id` is only echoed back.
`add_to_server` registers the service with request deserializers that never raise, so that bytes
that are no message of the method's type get INVALID_ARGUMENT too (gRPC itself would answer UNKNOWN).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError, Message

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.frontend import Frontend, RequestFailed, check_request_id

MAX_DETAILS_CHARS = 500  # a status message travels in a header (16 KiB at most, non-ASCII percent-encoded)


class Undecodable:
    """What a request deserializer gives for bytes that do not parse: the servicer refuses it."""

    def __init__(self, message: str) -> None:
        self.message = message


class RouterService(pdserve_pb2_grpc.PDServeServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    # --- RPCs -----------------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):  # noqa: N802
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return self.frontend.model.info

    async def Tokenize(self, request, context):  # noqa: N802
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            self.frontend.check_model(request.model)
            # Text no prompt of this model could hold is refused untokenized: tokenizing 16 MiB holds one of
            # the tokenizer threads every request shares for seconds.
            ids = await self.frontend.prompt_ids(request.text, "text")
        except ValueError as e:
            await abort(context, RequestFailed.bad_input(e))
        except RequestFailed as e:
            await abort(context, e)
        return pdserve_pb2.TokenizeResponse(token_ids=ids)

    async def Generate(self, request: pdserve_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        frontend, accepted = self.frontend, time.time()
        try:
            with frontend.refusals("grpc"):
                if isinstance(request, Undecodable):
                    raise ValueError(request.message)
                frontend.check_model(request.model)
                check_request_id(request.request_id)
                kind = request.WhichOneof("prompt")
                if kind is None:
                    raise ValueError("prompt is missing: set text or token_ids")
                params = sampling_params(request.params)
                ids = await frontend.prompt_ids(request.text if kind == "text" else list(request.token_ids.ids))
                if not request.params.max_tokens:  # unset: the default, within what the context leaves
                    params = dataclasses.replace(params, max_tokens=frontend.default_max_tokens(ids, params.max_tokens))
                active = frontend.start("grpc", ids, params, request.request_id, accepted,
                                        images=tuple(image.data for image in request.images))
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
    SamplingParams' own defaults. Raises ValueError (BadParameter naming the field) on bad values."""
    optional = {name: getattr(p, name) for name in ("temperature", "top_p", "seed", "speculative") if p.HasField(name)}
    if p.max_tokens:
        optional["max_tokens"] = p.max_tokens
    return SamplingParams(top_k=p.top_k, stop_token_ids=tuple(p.stop_token_ids), stop=tuple(p.stop),
                          ignore_eos=p.ignore_eos, logprobs=p.logprobs, proposer=p.proposer or None, **optional)


async def abort(context: grpc.aio.ServicerContext, e: RequestFailed) -> None:
    code = getattr(grpc.StatusCode, e.code, grpc.StatusCode.UNKNOWN)
    # Cut: a longer message could exceed the header limit, and the client would see RESOURCE_EXHAUSTED instead.
    message = e.message if len(e.message) <= MAX_DETAILS_CHARS else e.message[:MAX_DETAILS_CHARS] + "..."
    if e.retry_after_s is None:
        await context.abort(code, message)
    ms = max(1, round(e.retry_after_s * 1000))
    await context.abort(code, f"{message} (retry after {ms} ms)", trailing_metadata=(("retry-after-ms", str(ms)),))


def _lenient(message_type: type[Message]):
    """A request deserializer that returns `Undecodable` instead of raising."""
    def parse(data: bytes) -> Message | Undecodable:
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return Undecodable(f"malformed request: not a {message_type.DESCRIPTOR.full_name} message ({e})")
    return parse


def add_to_server(service: RouterService, server: grpc.aio.Server) -> None:
    """What the generated `add_PDServeServicer_to_server` does, with `_lenient` request deserializers."""
    pb = pdserve_pb2
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            service.Tokenize, request_deserializer=_lenient(pb.TokenizeRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.GetModelInfo, request_deserializer=_lenient(pb.GetModelInfoRequest),
            response_serializer=pb.ModelInfo.SerializeToString),
    }
    name = pb.DESCRIPTOR.services_by_name["PDServe"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
