"""What the router and the workers say to each other: the one neutral module both import.

  router -> worker   `WorkRequest`, an argument of a Ray actor call (validated on construction).
  both               `LifetimeEvent`: the names of a request's lifetime events (router's and workers').
  worker -> cluster  `WorkerStatus`, a worker's health report (the answer to `ping` and `profile`):
                     what the supervisor, placement, the idle audit and /metrics read.
  worker -> router   `MoveOutcome`, the answer to a decode worker's `migrate` call: whether a running
                     request moved to another decode worker with its KV.
  worker -> router   `TokenMessage`s (protobuf, `proto/pdserve/v1/internal.proto`) over pyzmq: a
                     worker's `TokenSink` PUSHes one `TokenBatch` per engine step, every request's new
                     tokens in it, to the router's PULL socket; `parse_token_batch` turns bytes back
                     into messages or raises `MalformedMessage`. A message with no tokens whose events name
                     `LifetimeEvent.HANDOFF_COMMITTED` is the prefill worker's notice that the decode worker holds
                     the request (its KV handoff committed): it has no output position.

`ClusterSecret` authenticates these sockets (and the KV events and KV control channels): CURVE,
with one key per cluster; peers without it never get a message through.

No torch here: the router imports this module.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from collections import deque
from typing import TYPE_CHECKING, Any
from enum import StrEnum
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread
from google.protobuf.message import DecodeError

from pdserve.engine.block_pool import KVPoolStatus
from pdserve.engine.cost_model import StepCost
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.pdserve.v1.internal_pb2 import TokenBatch, TokenMessage

if TYPE_CHECKING:
    from pdserve.engine.multimodal.placement import EmbeddingSpec

__all__ = ["WorkRequest", "WorkerStatus", "MoveOutcome", "KVPoolStatus", "TokenMessage", "LifetimeEvent", "is_handoff_notice",
           "TokenSink", "MalformedMessage", "parse_token_batch", "token_message", "Tombstones", "ClusterSecret",
           "rejected_peers", "RESOURCE_EXHAUSTED", "INTERNAL", "UNAVAILABLE", "INVALID_ARGUMENT"]

log = logging.getLogger(__name__)

# Error codes a worker puts on a failed request (gRPC status names; the router maps them).
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # a queue or KV memory is full: retry later
INTERNAL = "INTERNAL"  # the worker itself failed (its engine loop or a thread died)
UNAVAILABLE = "UNAVAILABLE"  # a peer or a transfer failed
INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the worker's engine refused the request


@dataclass(frozen=True)
class EncodedImages:
    """A request's images as an encode worker made them: it holds their embeddings under `key` for a
    while, and sends them to the worker that asks (`EncodeWorker.send_embeddings`)."""

    encoder: Any  # the encode worker's Ray actor handle
    encoder_name: str
    key: str  # what the encoder holds them under
    images: tuple[EmbeddingSpec, ...]  # each image's rows, width and dtype: what the receiver allocates


@dataclass(frozen=True)
class WorkRequest:
    """One request, tokenized and validated by the router, as a worker receives it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Encoded images, one placeholder token in the prompt each (a vision-language model's request): the
    # worker that runs the prompt pass decodes and encodes them, expanding the placeholders...
    images: tuple[bytes, ...] = ()
    # ... unless an encode worker made their embeddings, which it sends over the KV-transfer layer when
    # asked (the images stay, for a worker that cannot get them to encode instead).
    encoded: EncodedImages | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        ids = self.prompt_token_ids
        # (the types counted at C speed: a prompt of thousands of ids is checked for every request)
        if not isinstance(ids, list) or not ids or set(map(type, ids)) != {int} or min(ids) < 0:
            raise ValueError("prompt_token_ids must be a non-empty list of non-negative integers")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        if not isinstance(self.images, tuple) or not all(isinstance(i, bytes) for i in self.images):
            raise ValueError("images must be a tuple of bytes")


@dataclass(frozen=True)
class WorkerStatus:
    """A worker's health report. Read by attribute everywhere: a field renamed on one side fails loudly
    instead of reading as 0. The fields after `step_budget` belong to one role (the other's are empty)."""

    worker_id: str
    node_id: str
    node_ip: str
    model_digest: str  # of the model files it loaded ("" on a single machine, where nothing is shipped)
    alive: bool  # False: its engine loop or another of its threads failed (`fault` says how)
    fault: str | None
    profiled: bool  # its step costs are measured (a restarted worker measures them before taking work)
    kv: KVPoolStatus
    requests: int  # in its engine
    transfers: int  # KV transfers in flight, either side
    step_cost: StepCost  # fitted from its measured steps
    step_budget: int  # tokens one engine step computes at most
    draft_blocks: int = 0  # blocks its draft model's KV pool holds (speculative decoding with a draft model)
    # A vision-language model's: image embeddings received from the encode pool (frames, bytes, corrupt, refused)
    embedding_counts: dict[str, int] = field(default_factory=dict)
    # Prefill only:
    jobs: int = 0  # requests queued or handing their KV off
    chunk_tokens: int = 0  # the longest prompt chunk one step computes (LAPS's chunk, else the step budget)
    short_prompt_tokens: int = 0  # LAPS's threshold of a short prompt (0: no LAPS)
    metrics: str = ""  # the KV sender's Prometheus exposition
    # Decode only:
    kv_addresses: dict[str, str] = field(default_factory=dict)  # transport -> where its KV receiver listens
    receiver_counts: dict[str, int] = field(default_factory=dict)  # the KV receiver's counters, by event
    # Speculative decoding's share of a decode step, recently: tokens per sequence (1: none) and drafting's seconds
    step_tokens_per_seq: float = 1.0
    step_propose_s: float = 0.0

    @property
    def holdings(self) -> dict[str, int]:
        """What it holds (only the nonzero): KV blocks beyond its prefix cache (its draft model's too),
        requests in its engine, transfers and queued jobs. Nothing, when idle."""
        held = {"blocks": self.kv.held_blocks, "draft_blocks": self.draft_blocks, "requests": self.requests,
                "transfers": self.transfers, "jobs": self.jobs}
        return {k: v for k, v in held.items() if v}


@dataclass(frozen=True)
class MoveOutcome:
    """How a decode worker's move of one running request to another decode worker ended."""

    moved: bool  # the target holds the request now, and the source nothing of it
    reason: str = ""  # why it did not move (it goes on where it was, unless the source failed)
    tried: bool = True  # False: the request was not decoding there (queued, prefilling, gone): nothing was sent
    # Not moved, but the target may hold it: the move failed while its commit was asked, whose answer may
    # have been lost (or the source died). The router tells the target to drop it.
    in_doubt: bool = False
    recomputed: bool = False  # moved, but the target rebuilt the KV from the tokens (cheaper than sending it)
    kv_tokens: int = 0  # the tokens whose KV moved
    kv_bytes: int = 0
    pause_s: float = 0.0  # from taking it out of the source's batch to the target's commit
    events: dict[str, float] = field(default_factory=dict)  # the source's lifetime events of the request


class Tombstones:
    """Ids of requests aborted recently (bounded). Ray may run a threaded actor's calls out of order,
    so an abort can overtake the call that starts the request; the start then finds the tombstone."""

    def __init__(self, capacity: int = 65536) -> None:
        self._order: deque[str] = deque()
        self._ids: set[str] = set()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._ids:
                return
            self._order.append(request_id)
            self._ids.add(request_id)
            if len(self._order) > self._capacity:
                self._ids.discard(self._order.popleft())

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._ids


class LifetimeEvent(StrEnum):
    """What happened to a request, and where (as DistServe's `LifetimeEventType`). A request's events map
    these names to wall-clock seconds: on its token messages, in its response's timings and in its
    lifetime log line. Listed in the order a disaggregated request meets them."""

    ACCEPTED = "accepted"  # router: the API layer received it
    ROUTED = "routed"  # router: placed on its workers
    ENCODED = "encoded"  # router: an encode worker made its images' embeddings (requests with images)
    PREFILL_QUEUED = "prefill_queued"  # the worker that runs its prompt pass queued it
    PREFILL_START = "prefill_start"
    KV_RESERVED = "kv_reserved"  # decode worker: it reserved the KV's blocks (asked for beside the pass or as it ends)
    TRANSFER_START = "transfer_start"  # decode worker: its KV transfer's first frame
    PREFILL_END = "prefill_end"
    FIRST_TOKEN = "first_token"  # router: its first token reached the stream
    TRANSFER_END = "transfer_end"  # decode worker: every frame delivered
    HANDOFF_COMMITTED = "handoff_committed"  # prefill worker's notice: the decode worker holds it (not logged)
    DECODE_START = "decode_start"
    MIGRATED = "migrated"  # decode worker: it took the request over from another, KV and all (the last such move)
    DECODE_END = "decode_end"
    FINISHED = "finished"  # router: it ended
    RETRY = "retry"  # router: a new attempt began; recorded as `retry_<attempt>` (`retry`)

    @classmethod
    def retry(cls, attempt: int) -> str:
        """The name of the `attempt`th retry's event (attempts count from 1)."""
        return f"{cls.RETRY}_{attempt}"

    @classmethod
    def of(cls, name: str) -> LifetimeEvent:
        """The event a recorded name stands for; ValueError for a name that is none."""
        base, _, attempt = name.rpartition("_")
        if base == cls.RETRY and attempt.isdigit() and int(attempt) > 0:
            return cls.RETRY
        if name == cls.RETRY:  # recorded only with its attempt
            raise ValueError(f"{name!r} without its attempt is not a recorded lifetime event")
        return cls(name)


def is_handoff_notice(message: TokenMessage) -> bool:
    return (LifetimeEvent.HANDOFF_COMMITTED in message.events and not message.token_ids
            and not message.error)


class MalformedMessage(ValueError):
    pass


def parse_token_batch(data: bytes) -> list[TokenMessage]:
    """The token messages of one `TokenBatch`; MalformedMessage for bytes that are not one, or a batch
    holding a message without its request id (the whole batch is refused: it came from no worker)."""
    batch = TokenBatch()
    try:
        batch.ParseFromString(data)
    except DecodeError as e:
        raise MalformedMessage(f"not a TokenBatch: {e}") from None
    if not all(message.request_id for message in batch.messages):
        raise MalformedMessage("TokenBatch with a message without request_id")
    return list(batch.messages)


def token_message(request_id: str, token_ids: list[int] | None = None, *, logprobs: list[float] | None = None,
                  finish_reason: str | None = None, text: str | None = None, error: str | None = None,
                  error_code: str = "", events: dict[str, float] | None = None, cached_tokens: int = 0,
                  first_index: int = 0, draft_tokens: int = 0, accepted_draft_tokens: int = 0,
                  prompt_tokens: int = 0) -> TokenMessage:
    """One request's message; `error` (with `error_code`, a gRPC status name) fails the request.
    `first_index`: the output position of `token_ids[0]` (the router puts a request's messages in that
    order)."""
    return TokenMessage(request_id=request_id, token_ids=token_ids or [], logprobs=logprobs or [],
                        finish_reason=finish_reason or "", text=text or "", error=error or "",
                        error_code=error_code, events=events or {}, cached_tokens=cached_tokens,
                        first_index=first_index, draft_tokens=draft_tokens,
                        accepted_draft_tokens=accepted_draft_tokens, prompt_tokens=prompt_tokens)


class TokenSink:
    """A worker's sending end. Thread-safe: the engine loop and transfer threads both send."""

    def __init__(self, address: str, secret: ClusterSecret | None = None) -> None:
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 1000)
        if secret is not None:
            secret.client(self._socket)
        self._socket.connect(address)
        self._lock = threading.Lock()

    def send(self, request_id: str, token_ids: list[int] | None = None, **fields: Any) -> None:
        """One request's message on its own (a notice, an error, a last token): `token_message`'s fields."""
        self.send_step([token_message(request_id, token_ids, **fields)])

    def send_step(self, messages: list[TokenMessage]) -> None:
        """Every message of one engine step in one pyzmq message (vLLM v1's batched outputs): the
        router's hub wakes once per step and worker, not once per request."""
        if not messages:
            return
        data = TokenBatch(messages=messages).SerializeToString()
        with self._lock:
            self._socket.send(data)

    def close(self) -> None:
        self._socket.close()


# --- the per-cluster secret of the internal channels ------------------------------------------------
@dataclass(frozen=True)
class ClusterSecret:
    """What proves membership of one cluster on its internal channels. The launcher makes it and hands
    it to the workers in their Ray actor arguments (Ray is the trusted control plane).

    `public_key`/`secret_key`: one CURVE keypair (z85) per cluster. Every member holds both halves (a
    decode worker serves its KV control channel and is a client of the router's token stream), so a
    second keypair for clients would add nothing: a pyzmq server (`server`) proves itself with it, and
    admits only clients (`client`) that present the same public key and prove they hold its secret.
    `key`: what the KV transports' peers prove they hold (an HMAC of fresh nonces under it, or of a
    call's own fields), so that it never crosses the wire, in clear or not.
    """

    public_key: bytes
    secret_key: bytes = field(repr=False)
    key: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> ClusterSecret:
        public_key, secret_key = zmq.curve_keypair()
        return cls(public_key, secret_key, secrets.token_bytes(32))

    @property
    def zap_domain(self) -> str:
        # Per cluster, so that servers of two clusters in one process (tests) admit only their own.
        return "pdserve-" + hashlib.sha256(self.public_key).hexdigest()[:16]

    def server(self, socket: zmq.Socket) -> None:
        """Make `socket` (before it binds) a CURVE server that admits only this cluster's members:
        a peer without CURVE fails the handshake, one with another key is refused by the ZAP handler;
        either way no message of theirs is ever delivered."""
        _members(socket.context).admit(self.zap_domain, self.public_key)
        socket.zap_domain = self.zap_domain.encode()
        socket.curve_secretkey = self.secret_key
        socket.curve_publickey = self.public_key
        socket.curve_server = True

    def client(self, socket: zmq.Socket) -> None:
        """Make `socket` (before it connects) a CURVE client of this cluster's servers."""
        socket.curve_secretkey = self.secret_key
        socket.curve_publickey = self.public_key
        socket.curve_serverkey = self.public_key


class _Members:
    """The ZAP credentials callback of one zmq context: per domain (cluster), the one public key it admits."""

    def __init__(self, underlying: int) -> None:
        self.keys: dict[str, bytes] = {}
        self.rejected = 0
        # A blocking context over the same libzmq context: the handler runs on a thread of its own,
        # also for servers whose sockets are zmq.asyncio's.
        self._context = zmq.Context.shadow(underlying)
        self._authenticator = zmq.auth.thread.ThreadAuthenticator(self._context, log=log)
        self._authenticator.start()

    def admit(self, domain: str, public_key: bytes) -> None:
        self.keys[domain] = public_key
        self._authenticator.configure_curve_callback(domain, self)

    def callback(self, domain: str, key: bytes) -> bool:
        expected = self.keys.get(domain)
        if expected is not None and hmac.compare_digest(key, expected):
            return True
        self.rejected += 1
        if self.rejected == 1 or self.rejected % 100 == 0:  # bounded: a flood of strangers must not flood the log
            log.warning("refused a pyzmq peer without this cluster's key (domain %s; %d refused so far)",
                        domain, self.rejected)
        return False


# A ZAP handler is bound per libzmq context (one inproc endpoint each), whichever pyzmq objects (a
# blocking one, asyncio shadows of it) wrap that context: one per context, made on first use.
_AUTHENTICATORS: dict[int, _Members] = {}
_AUTHENTICATORS_LOCK = threading.Lock()


def _members(context: zmq.Context) -> _Members:
    with _AUTHENTICATORS_LOCK:
        if context.underlying not in _AUTHENTICATORS:
            _AUTHENTICATORS[context.underlying] = _Members(context.underlying)
        return _AUTHENTICATORS[context.underlying]


def rejected_peers() -> int:
    """How many pyzmq peers this process's servers refused for want of their cluster's key."""
    with _AUTHENTICATORS_LOCK:
        return sum(m.rejected for m in _AUTHENTICATORS.values())
