"""The pdserve client SDK, exported as `import pdserve`. Needs only grpcio and protobuf (no torch, no ray).

    import pdserve
    with pdserve.Client("127.0.0.1:50051") as client:
        print(client.generate("The water was", max_tokens=16, temperature=0).text)
        for chunk in client.generate("Hello", stream=True):
            print(chunk.text_delta, end="")
"""

from __future__ import annotations

import ipaddress
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

# The API's message-size limit, for both ends (the router's server imports it from here).
MAX_MESSAGE_BYTES = 16 * 2**20
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


# --- errors ---------------------------------------------------------------------------------------
class PDServeError(Exception):
    """A call failed; `code` is the gRPC status code, `message` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidArgument(PDServeError): pass  # noqa: E701
class NotFound(PDServeError): pass  # noqa: E701
class Unavailable(PDServeError): pass  # noqa: E701
class ResourceExhausted(PDServeError):
    """The cluster is at capacity; `retry_after_s` is the server's hint for when to try again."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(code, message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(PDServeError): pass  # noqa: E701
class Cancelled(PDServeError): pass  # noqa: E701
class Unauthenticated(PDServeError): pass  # noqa: E701


class InsecureTokenWarning(UserWarning):
    """A client's auth token would cross the network in clear text: a channel without TLS to another
    machine. Anyone on the path can read the token and replay it."""


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument, grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable, grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded, grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def _error(e: grpc.RpcError) -> PDServeError:
    code = e.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        hint = dict(e.trailing_metadata() or ()).get("retry-after-ms")
        return ResourceExhausted(code, e.details() or "", int(hint) / 1000 if hint and hint.isdigit() else None)
    return _ERRORS.get(code, PDServeError)(code, e.details() or "")


# --- results --------------------------------------------------------------------------------------
@dataclass
class StreamChunk:
    token_ids: list[int]
    text_delta: str
    logprobs: list[float]
    finish_reason: str | None
    timings: dict[str, float] | None
    request_id: str
    prompt_tokens: int = 0  # set on the first chunk
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (first chunk)
    events: dict[str, float] | None = None  # the request's lifetime events (Unix seconds), on the last chunk


@dataclass
class Completion:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    server_request_id: str = ""  # unique per request (request_id echoes the client's own label)
    draft_tokens: int = 0  # speculative decoding: draft tokens verified (the worker that finished it)
    accepted_draft_tokens: int = 0  # of those, accepted
    # Lifetime events (name -> Unix seconds: accepted, routed, prefill_queued, ..., finished), with the last chunk.
    events: dict[str, float] = field(default_factory=dict)

    def add(self, r: pdserve_pb2.GenerateResponse) -> StreamChunk:
        self.request_id = self.request_id or r.request_id
        self.server_request_id = self.server_request_id or r.server_request_id
        self.token_ids += r.token_ids
        self.text += r.text_delta
        self.logprobs += r.logprobs
        self.prompt_tokens = self.prompt_tokens or r.prompt_tokens
        self.cached_tokens = self.cached_tokens or r.cached_tokens
        timings = None
        if r.finish_reason:
            self.finish_reason = r.finish_reason
            self.draft_tokens, self.accepted_draft_tokens = r.draft_tokens, r.accepted_draft_tokens
            t = r.timings
            timings = self.timings = {"queued": t.queued_s, "prefill": t.prefill_s, "kv_transfer": t.kv_transfer_s,
                                      "decode": t.decode_s, "ttft": t.ttft_s, "e2e": t.e2e_s}
            self.events = dict(t.events)
        return StreamChunk(list(r.token_ids), r.text_delta, list(r.logprobs), r.finish_reason or None, timings,
                           r.request_id, r.prompt_tokens, r.cached_tokens, self.events if r.finish_reason else None)


@contextmanager
def _text(name: str) -> Iterator[None]:
    """Around setting the text field `name`: text that has no UTF-8 form (a lone surrogate), which
    protobuf cannot send, is InvalidArgument as the server's refusals are, not a UnicodeEncodeError."""
    try:
        yield
    except UnicodeEncodeError as e:
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"{name} is not valid text: the character at index "
                                                                f"{e.start} ({e.object[e.start]!r}) has no UTF-8 form "
                                                                f"({e.reason})") from None


def _request(prompt: str | Sequence[int], *, model: str = "", request_id: str = "", temperature: float | None = None,
             top_k: int = 0, top_p: float | None = None, seed: int | None = None, max_tokens: int | None = None,
             stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
             logprobs: bool = False, speculative: bool | None = None,
             proposer: str | None = None, images: Sequence[bytes] = ()) -> pdserve_pb2.GenerateRequest:
    """Build a GenerateRequest; unset temperature/top_p/seed/max_tokens keep the server's defaults (1.0, 1.0,
    none, 16 or what the context leaves when less)."""
    if isinstance(images, (bytes, bytearray)) or not all(isinstance(i, (bytes, bytearray)) for i in images):
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "images must be a list of encoded images (bytes)")
    params = pdserve_pb2.SamplingParams(top_k=top_k, max_tokens=max_tokens or 0, stop_token_ids=list(stop_token_ids),
                                        ignore_eos=ignore_eos, logprobs=logprobs)
    with _text("stop"):
        params.stop.extend(stop)
    if temperature is not None:
        params.temperature = temperature
    if top_p is not None:
        params.top_p = top_p
    if seed is not None:
        params.seed = seed
    if speculative is not None:
        params.speculative = speculative
    if proposer is not None:
        with _text("proposer"):
            params.proposer = proposer
    req = pdserve_pb2.GenerateRequest(params=params, images=[pdserve_pb2.Image(data=bytes(i)) for i in images])
    with _text("model"):
        req.model = model
    with _text("request_id"):
        req.request_id = request_id
    if isinstance(prompt, str):
        with _text("prompt"):
            req.text = prompt
    else:
        if any(t < 0 for t in prompt):
            raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "prompt token ids must be >= 0")
        req.token_ids.ids.extend(prompt)
    return req


def _tokenize_request(text: str, model: str) -> pdserve_pb2.TokenizeRequest:
    req = pdserve_pb2.TokenizeRequest()
    with _text("model"):
        req.model = model
    with _text("text"):
        req.text = text
    return req


def _credentials(target: str, token: str | None, root_certificates: bytes | None, client_cert: bytes | None,
                 client_key: bytes | None) -> tuple[list, grpc.ChannelCredentials | None]:
    """A client's call metadata and channel credentials (None: no TLS). Called once per client: a token
    that would cross the network in clear text is warned of once."""
    metadata = [("authorization", f"Bearer {token}")] if token else []
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key must be given together")
    creds = None
    if root_certificates is not None or client_cert is not None:  # TLS; with a client certificate: mutual
        creds = grpc.ssl_channel_credentials(root_certificates, private_key=client_key, certificate_chain=client_cert)
    elif token and not _on_this_machine(target):
        warnings.warn(f"the auth token goes to {target} in clear text, readable on the network: this channel has no "
                      "TLS (give root_certificates)", InsecureTokenWarning, stacklevel=3)
    return metadata, creds


def _on_this_machine(target: str) -> bool:
    """Whether a gRPC target (HOST:PORT, or a dns:, ipv4:, ipv6: or unix: URI) names only loopback
    addresses or a Unix socket. A name other than localhost counts as remote: it may resolve anywhere."""
    scheme, _, rest = target.partition(":")
    if scheme in ("unix", "unix-abstract"):
        return True
    if scheme in ("dns", "ipv4", "ipv6"):
        addresses = rest.split("/")[-1].split(",")  # dns://authority/HOST:PORT names the host last
    else:
        addresses = [target]
    return all(_loopback(urlsplit(f"//{address}").hostname or "") for address in addresses)


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return False


# --- sync client ----------------------------------------------------------------------------------
class Client:
    """Blocking client. `timeout` (seconds) is the default deadline of every call. TLS: `root_certificates`
    (PEM) to verify the server; `client_cert` and `client_key` (PEM) when the server requires mutual TLS;
    `token` for a server with bearer-token auth (sent in clear text without TLS: to a target that is not
    this machine, InsecureTokenWarning)."""

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = None, token: str | None = None,
                 root_certificates: bytes | None = None, client_cert: bytes | None = None,
                 client_key: bytes | None = None) -> None:
        self._metadata, creds = _credentials(target, token, root_certificates, client_cert, client_key)
        self._channel = (grpc.secure_channel(target, creds, options=GRPC_OPTIONS) if creds
                         else grpc.insecure_channel(target, options=GRPC_OPTIONS))
        self._stub = pdserve_pb2_grpc.PDServeStub(self._channel)
        self.timeout = timeout

    def generate(self, prompt: str | Sequence[int], *, stream: bool = False, timeout: float | None = None,
                 **params: Any) -> Completion | Iterator[StreamChunk]:
        """Generate for one prompt: a Completion, or with stream=True an iterator of StreamChunks.

        `params`: model, request_id, temperature, top_k, top_p, seed, max_tokens, stop, stop_token_ids,
        ignore_eos, logprobs, speculative (False: no speculative decoding for this request), proposer
        ("suffix" or "draft_model": that one alone, where the deployment runs both), images (encoded
        images for a vision-language model: the prompt holds `model_info().image_token` once per image).
        """
        req = _request(prompt, **params)
        call = self._stub.Generate(req, timeout=timeout or self.timeout, metadata=self._metadata)
        return self._iterate(call) if stream else self._collect(call)

    @staticmethod
    def _iterate(call: Any) -> Iterator[StreamChunk]:
        completion = Completion(request_id="")
        try:
            for response in call:
                yield completion.add(response)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()  # closing the iterator early cancels the request (frees its KV)

    @staticmethod
    def _collect(call: Any) -> Completion:
        completion = Completion(request_id="")
        try:
            for response in call:
                completion.add(response)
        except grpc.RpcError as e:
            raise _error(e) from None
        return completion

    def tokenize(self, text: str, model: str = "") -> list[int]:
        return list(self._unary(self._stub.Tokenize, _tokenize_request(text, model)).token_ids)

    def model_info(self) -> pdserve_pb2.ModelInfo:
        return self._unary(self._stub.GetModelInfo, pdserve_pb2.GetModelInfoRequest())

    def _unary(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- asyncio client -------------------------------------------------------------------------------
class AsyncClient:
    """asyncio client with the same calls as Client."""

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = None, token: str | None = None,
                 root_certificates: bytes | None = None, client_cert: bytes | None = None,
                 client_key: bytes | None = None) -> None:
        self._metadata, creds = _credentials(target, token, root_certificates, client_cert, client_key)
        self._channel = (grpc.aio.secure_channel(target, creds, options=GRPC_OPTIONS) if creds
                         else grpc.aio.insecure_channel(target, options=GRPC_OPTIONS))
        self._stub = pdserve_pb2_grpc.PDServeStub(self._channel)
        self.timeout = timeout

    async def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, **params: Any) -> Completion:
        completion = Completion(request_id="")
        async for _ in self._stream(prompt, completion, timeout, params):
            pass
        return completion

    def generate_stream(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                        **params: Any) -> AsyncIterator[StreamChunk]:
        return self._stream(prompt, Completion(request_id=""), timeout, params)

    async def _stream(self, prompt: str | Sequence[int], completion: Completion, timeout: float | None,
                      params: dict[str, Any]) -> AsyncIterator[StreamChunk]:
        call = self._stub.Generate(_request(prompt, **params), timeout=timeout or self.timeout, metadata=self._metadata)
        try:
            async for response in call:
                yield completion.add(response)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()

    async def tokenize(self, text: str, model: str = "") -> list[int]:
        try:
            r = await self._stub.Tokenize(_tokenize_request(text, model), timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None
        return list(r.token_ids)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
