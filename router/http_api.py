"""The OpenAI-compatible HTTP API (Starlette, served by uvicorn beside the gRPC server).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat template), `GET
/v1/models`, `GET /metrics` (Prometheus) and `GET /health` (the cluster's pools, workers and model in
JSON: `router.health_report`). Requests go the same way as gRPC ones (`router.frontend`: placement,
admission control, metrics, lifetime events); responses stream as server-sent events when asked.
Errors use OpenAI's format and status codes, in the gRPC API's words, with `param` naming the request
field at fault: 400 bad input (`max_tokens` past what the context leaves included), 401 bad or
missing API key (the manifest's `server.auth_token`, compared in constant time; /metrics and /health
are open, as vLLM's are), 404 unknown model (`model_not_found`) or route, 413 a body past the size
limit (the manifest's `server.max_request_bytes`; no more of it is read), 429 with `Retry-After` when
the cluster is full, 503 when a pool has no live worker or a peer or transfer failed, 500 when a
worker reports a fault of its own. The status is decided by the request's first response (a worker's
refusal is still a 429); a failure after that arrives as an SSE event `{"error": ...}` before `[DONE]`.

Beyond OpenAI's fields: `top_k`, `ignore_eos` and `stop_token_ids` (as vLLM takes them), `speculative`
(false: no speculative decoding for the request), `proposer` ("suffix" or "draft_model": that one
alone, where the deployment runs both), and `timings` (the phases and lifetime events of the request)
on the last response.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.client import MAX_MESSAGE_BYTES
from pdserve.diagnostics import shown
from pdserve.engine.sampling_params import BadParameter, SamplingParams
from pdserve.proto.pdserve.v1 import pdserve_pb2
from pdserve.router.image_urls import ImageFetch
from pdserve.router.frontend import ActiveRequest, Frontend, RequestFailed, check_request_id
from pdserve.router.pool_admin import PoolAdmin
from pdserve.router.health_report import HealthReport
from pdserve.router.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)
API = "http"
DISCONNECT_CHECK_S = 0.25  # how often a request waiting for its answer looks whether its client left
T = TypeVar("T")
# gRPC status code name -> (HTTP status, OpenAI error type)
STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "INTERNAL": (500, "internal_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}
# Validation stops at a list's first bad element: each error costs the loop time and memory, and a body
# of a million bad elements would make a million of them.
FAIL_FAST = Field(fail_fast=True)
MAX_PROBLEMS_SHOWN = 3  # of a body's validation errors, in the message
# A request's whole body, from its headers' end (which `http_connections` bounds): 16 MiB at 2.2 Mbit/s.
# A peer that sends headers and then nothing would otherwise hold its connection, one of those capped.
BODY_TIMEOUT_S = 60.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
# vLLM's and SGLang's extensions that change what is generated, with the value that changes nothing: a
# request may send that value (clients often do), any other is refused rather than dropped unseen.
NEUTRAL_EXTENSIONS: dict[str, tuple[object, ...]] = {
    "repetition_penalty": (1, 1.0), "min_p": (0, 0.0), "min_tokens": (0,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "include_stop_str_in_output": (False,), "bad_words": ([],),
    "allowed_token_ids": (), "prompt_logprobs": (), "truncate_prompt_tokens": (), "echo": (False,), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (), "regex": (),
    "json_schema": (), "ebnf": (), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "chat_template": (), "chat_template_kwargs": ({},), "use_beam_search": (False,),
    "length_penalty": (1, 1.0), "no_stop_trim": (False,), "return_tokens_as_token_ids": (False,),
}


# --- request bodies -------------------------------------------------------------------------------
class _Body(BaseModel):
    # Fields this server does not know are ignored (clients send newer ones); known fields it cannot
    # honour are refused below, never silently dropped.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = ""
    # Ranges the engine's own rules check too are left to them (SamplingParams.validate), so that a
    # bad value is refused in the gRPC API's words; only OpenAI's own narrower ranges are checked here.
    max_tokens: int | None = None
    temperature: float | None = Field(None, le=2)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1)  # vLLM's and SGLang's -1, like 0: no cut
    seed: int | None = None
    stop: str | Annotated[list[str], FAIL_FAST] | None = None
    stop_token_ids: Annotated[list[int], FAIL_FAST] | None = None
    ignore_eos: bool | None = None
    speculative: bool | None = None  # pdserve's: false turns speculative decoding off for the request
    proposer: str | None = None  # pdserve's: "suffix" or "draft_model" where the deployment runs both
    # OpenAI's spec allows null for every optional field: null means the default.
    n: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None  # refused unless empty: its values are never read
    response_format: dict[str, Any] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in NEUTRAL_EXTENSIONS and value is not None and value not in NEUTRAL_EXTENSIONS[name]:
                if name == "min_tokens" and self.ignore_eos and not self.stop and not self.stop_token_ids:
                    continue  # nothing can end the output before max_tokens: a benchmark's usual recipe
                raise BadParameter(name, f"{name} is not supported (leave it out)")
        if (self.n or 1) != 1:
            raise BadParameter("n", f"n must be 1 (one choice per request), got {self.n}")
        if self.presence_penalty or self.frequency_penalty:
            raise BadParameter("presence_penalty" if self.presence_penalty else "frequency_penalty",
                               "presence_penalty and frequency_penalty are not supported (leave them 0)")
        if self.logit_bias:
            raise BadParameter("logit_bias", "logit_bias is not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise BadParameter("response_format", "response_format: only {\"type\": \"text\"} is supported")

    def sampling_params(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        given = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p), ("seed", self.seed),
                                   ("speculative", self.speculative),
                                   ("proposer", self.proposer or None)) if v is not None}  # "": unset, as over gRPC
        return SamplingParams(max_tokens=max_tokens, top_k=max(0, self.top_k or 0), stop=self.stop or (),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=bool(self.ignore_eos),
                              logprobs=logprobs, **given)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBody(_Body):
    prompt: (str | Annotated[list[int], FAIL_FAST] | Annotated[list[str], FAIL_FAST]
             | Annotated[list[Annotated[list[int], FAIL_FAST]], FAIL_FAST])
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise BadParameter("prompt", f"one prompt per request, got {len(p)}")
            p = p[0]
        if self.echo or self.suffix is not None or (self.best_of or 1) != 1:
            raise BadParameter("echo" if self.echo else "suffix" if self.suffix is not None else "best_of",
                               "echo, suffix and best_of are not supported")
        if self.logprobs:
            raise BadParameter("logprobs", "logprobs must be 0 or unset: the sampled token's log-probability is "
                                           "returned, no alternatives")
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[dict[str, Any]], FAIL_FAST] | None = None

    @field_validator("content")
    @classmethod
    def _text_and_image_parts(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        # A part of another kind (audio, a file) would be dropped by the chat template unseen.
        for part in v if isinstance(v, list) else ():
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            image = part.get("image_url")
            if kind == "image_url" and isinstance(image, dict) and isinstance(image.get("url"), str):
                continue
            raise ValueError(f"content parts must be {{\"type\": \"text\", \"text\": ...}} or {{\"type\": "
                             f"\"image_url\", \"image_url\": {{\"url\": ...}}}}, got a part of type {shown(kind)}")
        return v

    def images_as_parts(self, fetch: ImageFetch) -> tuple[dict[str, Any], list[bytes]]:
        """The message for the chat template, each image part an `{"type": "image"}` part (which a
        vision-language model's template renders as its placeholder), and the images' bytes in order."""
        message = self.model_dump(exclude_none=True)
        if not isinstance(self.content, list):
            return message, []
        images = [fetch.image_bytes(part["image_url"]["url"]) for part in self.content if part["type"] == "image_url"]
        message["content"] = [{"type": "image"} if part["type"] == "image_url" else part for part in self.content]
        return message, images


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs:
            raise BadParameter("top_logprobs", "top_logprobs must be 0 or unset: only the sampled token's "
                                               "log-probability is returned")
        if self.tools or self.functions or self.tool_choice not in (None, "none"):
            raise BadParameter("tools" if self.tools else "functions" if self.functions else "tool_choice",
                               "tools and functions are not supported")


# --- the app --------------------------------------------------------------------------------------
def create_app(frontend: Frontend, health: Callable[[], HealthReport], auth_token: str | None = None,
               max_body_bytes: int = MAX_MESSAGE_BYTES, admin: PoolAdmin | None = None) -> Starlette:
    """The ASGI app. `health` reports the cluster (GET /health: its JSON, 200 while it serves, else
    503); a request body past `max_body_bytes` is answered 413 with no more of it read. `admin`: the
    routes that reshape the pools (`pool_admin`)."""
    api = _OpenAIApi(frontend, auth_token, health, max_body_bytes)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        *(admin.routes() if admin is not None else ()),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _bug})


class _OpenAIApi:
    def __init__(self, frontend: Frontend, auth_token: str | None, health: Callable[[], HealthReport],
                 max_body_bytes: int) -> None:
        self.frontend = frontend
        self.expected_auth = auth_token.encode() if auth_token else None
        self.health_report = health
        self.max_body_bytes = max_body_bytes

    # --- routes ---------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionBody, _CompletionFormat)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatBody, _ChatFormat)

    async def models(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            self.frontend.check_model(request.path_params["model"])
        except RequestFailed as e:
            return error_response(e)
        return JSONResponse(self._model_card())

    async def metrics(self, request: Request) -> Response:
        return Response(self.frontend.metrics.exposition(), media_type=CONTENT_TYPE)

    async def health(self, request: Request) -> Response:
        report = self.health_report()
        return JSONResponse(report.to_json(), status_code=200 if report.serving else 503)

    # --- the request path -----------------------------------------------------------------------
    async def _generate(self, request: Request, body_type: type[_Body], fmt_type: type[_Format]) -> Response:
        try:
            return await self._serve(request, body_type, fmt_type)
        except Exception as e:  # a bug: still answered in OpenAI's format, on a connection kept open
            log.exception("an HTTP request failed")
            return error_response(_as_bug(e))

    async def _serve(self, request: Request, body_type: type[_Body], fmt_type: type[_Format]) -> Response:
        accepted = time.time()
        if (denied := self._denied(request)) is not None:
            return denied
        frontend = self.frontend
        try:
            with frontend.refusals(API):
                body = _parse(body_type, await _read_body(request, self.max_body_bytes))
                frontend.check_model(body.model)
                check_request_id(request.headers.get("x-request-id", ""))
                body.check_supported()
                fmt = fmt_type(frontend, body)
                await fmt.read_prompt()
                active = frontend.start(API, fmt.prompt_ids, fmt.params, request.headers.get("x-request-id", ""),
                                        accepted, fmt.max_tokens_param, tuple(fmt.images))
        except RequestFailed as e:
            if e.param == "prompt":  # the rules' name for what this endpoint's body calls otherwise
                e.param = fmt_type.prompt_param
            return error_response(e)
        fmt.id = f"{fmt.id_prefix}-{active.request_id}"
        responses = active.responses()
        streaming = False
        try:
            # The first response decides the status: a refusal by a worker (its queue or KV memory
            # full) is still a 429 with Retry-After, not an error event under a 200.
            first = await _unless_gone(request, anext(responses))
            if body.stream:
                streaming = True  # from here the stream ends the request
                return _RequestStream(self._sse(active, fmt, first, responses), active)
            return JSONResponse(await _unless_gone(request, self._whole(active, fmt, first, responses)))
        except RequestFailed as e:
            return error_response(e)
        except ClientGone:  # nobody to answer: the request ends (CANCELLED) and frees its KV
            return Response(status_code=499)
        finally:
            if not streaming:
                active.finish()

    @staticmethod
    async def _whole(active: ActiveRequest, fmt: _Format, first: pdserve_pb2.GenerateResponse,
                     rest: AsyncIterator[pdserve_pb2.GenerateResponse]) -> dict[str, Any]:
        text, ids, logprobs, last = [first.text_delta], list(first.token_ids), list(first.logprobs), first
        async for r in rest:
            text.append(r.text_delta)
            ids += r.token_ids
            logprobs += r.logprobs
            last = r
        return fmt.whole("".join(text), ids, logprobs, last, active)

    @staticmethod
    async def _sse(active: ActiveRequest, fmt: _Format, first: pdserve_pb2.GenerateResponse,
                   rest: AsyncIterator[pdserve_pb2.GenerateResponse]) -> AsyncIterator[str]:
        """The server-sent events of one request: its chunks, the usage chunk when asked, `[DONE]`."""
        try:
            if (opening := fmt.opening()) is not None:
                yield _sse(opening)
            yield _sse(fmt.chunk(first))
            async for r in rest:
                yield _sse(fmt.chunk(r))
            if fmt.body.include_usage:
                yield _sse(fmt.envelope([], usage=fmt.usage(active)))
        except RequestFailed as e:
            yield _sse(_error_body(e))
        except Exception as e:  # a bug: the client still gets an error event and the stream's end
            log.exception("request %s: the HTTP stream failed", shown(active.request_id))
            yield _sse(_error_body(_as_bug(e)))
        finally:
            active.finish()
        yield "data: [DONE]\n\n"

    # --- helpers --------------------------------------------------------------------------------
    def _denied(self, request: Request) -> Response | None:
        if self.expected_auth is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.expected_auth):
            return None
        self.frontend.metrics.ended(API, "UNAUTHENTICATED")
        return error_response(RequestFailed("UNAUTHENTICATED", "missing or wrong API key (Authorization: Bearer ...)"))

    def _model_card(self) -> dict[str, Any]:
        info = self.frontend.model.info
        return {"id": info.name, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": info.max_model_len}


# --- response formats -----------------------------------------------------------------------------
class _Format:
    """One endpoint's request reading and response shapes."""

    object_name = ""
    id_prefix = ""
    prompt_param = "prompt"  # the body's field that holds the prompt

    def __init__(self, frontend: Frontend, body: _Body) -> None:
        self.frontend = frontend
        self.body = body
        self.model = frontend.model.name
        self.created = int(time.time())
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"  # replaced by the server's request id once started
        self.prompt_ids: list[int] = []
        self.images: list[bytes] = []  # a chat's image parts, in order
        self.params: SamplingParams
        self.max_tokens_param = "max_tokens"  # the field that set the output length, for errors about it

    def envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def usage(self, active: ActiveRequest) -> dict[str, Any]:
        prompt = active.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": active.output_tokens,
                "total_tokens": prompt + active.output_tokens,
                "prompt_tokens_details": {"cached_tokens": active.cached_tokens},
                # OpenAI's names for predicted tokens that were, or were not, in the output: here
                # speculative decoding's draft tokens
                "completion_tokens_details": {
                    "accepted_prediction_tokens": active.accepted_draft_tokens,
                    "rejected_prediction_tokens": active.draft_tokens - active.accepted_draft_tokens}}

    async def read_prompt(self) -> None:
        """Set `prompt_ids` and `params` from the body (tokenizing off the event loop)."""
        raise NotImplementedError

    def opening(self) -> dict[str, Any] | None:
        return None

    def chunk(self, r: pdserve_pb2.GenerateResponse) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self, text: str, ids: list[int], logprobs: list[float], last: pdserve_pb2.GenerateResponse,
              active: ActiveRequest) -> dict[str, Any]:
        raise NotImplementedError

    def _tokens(self, ids: list[int]) -> list[str]:
        return [self.frontend.model.tokenizer.decode([t]) for t in ids]


class _CompletionFormat(_Format):
    object_name = "text_completion"
    id_prefix = "cmpl"

    async def read_prompt(self) -> None:
        body = self.body
        prompt = body.single_prompt()
        self.prompt_ids = await self.frontend.prompt_ids(prompt)
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = self.frontend.default_max_tokens(self.prompt_ids, COMPLETIONS_DEFAULT_MAX_TOKENS)
        self.params = body.sampling_params(max_tokens, logprobs=body.logprobs is not None)

    def _logprobs(self, ids: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.params.logprobs:
            return None
        return {"tokens": self._tokens(ids), "token_logprobs": list(logprobs), "top_logprobs": None,
                "text_offset": None}

    def chunk(self, r: pdserve_pb2.GenerateResponse) -> dict[str, Any]:
        choice = {"index": 0, "text": r.text_delta, "logprobs": self._logprobs(list(r.token_ids), list(r.logprobs)),
                  "finish_reason": r.finish_reason or None}
        return self.envelope([choice], **_timings(r))

    def whole(self, text, ids, logprobs, last, active):
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(ids, logprobs),
                  "finish_reason": last.finish_reason}
        return self.envelope([choice], usage=self.usage(active), **_timings(last))


class _ChatFormat(_Format):
    object_name = "chat.completion"
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    async def read_prompt(self) -> None:
        frontend, body, tokenizer = self.frontend, self.body, self.frontend.model.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise BadParameter("messages", f"model {self.model!r} has no chat template: use /v1/completions")
        parts = [p for m in body.messages if isinstance(m.content, list) for p in m.content if p["type"] == "image_url"]
        if parts:  # before any is decoded or fetched
            frontend.model.check_image_count(len(parts))
        # Off the event loop: the base64 of images is megabytes to decode, a fetch seconds.
        fetch = frontend.model.image_fetch
        rendered = await frontend.off_loop(lambda: [message.images_as_parts(fetch) for message in body.messages])
        messages = [message for message, _ in rendered]
        self.images = [image for _, images in rendered for image in images]
        try:
            text = await frontend.off_loop(tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                           tokenize=False)
        except Exception as e:  # a template that rejects these messages (a jinja error it raised)
            raise BadParameter("messages", f"the chat template cannot render these messages: {e}") from None
        # The rendered text is checked against the context: the template's own text counts, exactly.
        self.prompt_ids = await frontend.prompt_ids(text)
        if body.max_completion_tokens is not None:  # it wins over max_tokens, as OpenAI's and vLLM's
            max_tokens, self.max_tokens_param = body.max_completion_tokens, "max_completion_tokens"
        elif body.max_tokens is not None:
            max_tokens = body.max_tokens
        else:  # OpenAI's default: what the context leaves
            max_tokens = frontend.default_max_tokens(self.prompt_ids, frontend.model.info.max_model_len)
        self.params = body.sampling_params(max_tokens, logprobs=bool(body.logprobs))

    def _logprobs(self, ids: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.params.logprobs:
            return None
        return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                            for tok, lp in zip(self._tokens(ids), logprobs)]}

    def opening(self) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return self.envelope([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    def chunk(self, r: pdserve_pb2.GenerateResponse) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"content": r.text_delta} if r.text_delta or not r.finish_reason else {},
                  "logprobs": self._logprobs(list(r.token_ids), list(r.logprobs)),
                  "finish_reason": r.finish_reason or None}
        return self.envelope([choice], **_timings(r))

    def envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = super().envelope(choices, **extra)
        if self.body.stream:  # a stream's pieces are chunks
            out["object"] = "chat.completion.chunk"
        return out

    def whole(self, text, ids, logprobs, last, active):
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": self._logprobs(ids, logprobs), "finish_reason": last.finish_reason}
        return self.envelope([choice], usage=self.usage(active), **_timings(last))


# --- helpers --------------------------------------------------------------------------------------
class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


class BodyRefused(RequestFailed):
    """A request body refused before it was all read: `status` (413: too large, 408: too slow) and
    OpenAI's error `code` say why."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__("INVALID_ARGUMENT", message)
        self.status = status
        self.openai_code = code


def _too_large(limit: int) -> BodyRefused:
    return BodyRefused(413, "request_too_large", f"the request body is larger than {limit} bytes, the most this "
                                                 "server takes (server.max_request_bytes)")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, read as it comes up to `limit` bytes and within BODY_TIMEOUT_S; past either, a
    BodyRefused, with no more of it read (none when its Content-Length says too much). Starlette's own
    limit would answer in plain text, where OpenAI's clients expect their error format."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise _too_large(limit)
    except TimeoutError:
        raise BodyRefused(408, "request_timeout", f"the request body did not all come within {BODY_TIMEOUT_S:.0f} s "
                                                  f"({len(body)} bytes came)") from None
    return bytes(body)


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled and ClientGone
    raised. (A streamed answer notices a disconnect by itself: Starlette cancels the stream.)"""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_CHECK_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        task.cancel()


class _RequestStream(StreamingResponse):
    """An SSE response that ends its request on every path: the stream's own end, a client that
    went away (which cancels the stream, possibly before it started), or an error."""

    def __init__(self, content: AsyncIterator[str], active: ActiveRequest) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.active = active

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.active.finish()


def _parse(body_type: type[_Body], raw: bytes) -> _Body:
    """The request body, validated; BadParameter naming its first bad fields (`param`: the first)."""
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False, include_input=False)
        # A path is field names, union members and list indices (no client's key: every dict field takes
        # any key); a message is pydantic's, or one of ours that shows a client's value cut short.
        fields = [".".join(str(part) for part in err["loc"]) or "body" for err in errors[:MAX_PROBLEMS_SHOWN]]
        problems = [f"{field}: {err['msg'][:300]}" for field, err in zip(fields, errors)]
        more = f" (and {len(errors) - len(problems)} more)" if len(errors) > len(problems) else ""
        raise BadParameter(fields[0], "invalid request: " + "; ".join(problems) + more) from None


def _timings(r: pdserve_pb2.GenerateResponse) -> dict[str, Any]:
    if not r.HasField("timings"):
        return {}
    return {"timings": MessageToDict(r.timings, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _error_body(e: RequestFailed) -> dict[str, Any]:
    """OpenAI's error object: the message in the gRPC API's words, the request field at fault in `param`."""
    status, kind = STATUS.get(e.code, (500, "internal_error"))
    code = e.openai_code if isinstance(e, BodyRefused) else e.code.lower()
    if e.code == "NOT_FOUND" and e.param == "model":  # OpenAI's answer to a model it does not serve
        kind, code = "invalid_request_error", "model_not_found"
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": code}}


def error_response(e: RequestFailed) -> JSONResponse:
    status = e.status if isinstance(e, BodyRefused) else STATUS.get(e.code, (500, "internal_error"))[0]
    headers = {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, round(e.retry_after_s * 1000)))
    return JSONResponse(_error_body(e), status_code=status, headers=headers)


def _as_bug(e: Exception) -> RequestFailed:
    return RequestFailed("UNKNOWN", f"a bug in the router (its log has the traceback): {type(e).__name__}: {e}")


async def _bug(request: Request, exc: Exception) -> JSONResponse:
    """Another route's exception, still in OpenAI's format (Starlette logs its traceback)."""
    return error_response(_as_bug(exc))


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's format."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {exc.detail}", "type": kind,
                                   "param": None, "code": None}}, status_code=exc.status_code)
