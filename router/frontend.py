"""What every client API of the router shares: one request's way from validation to its last token.

`Frontend.prompt_ids` turns a prompt into token ids on a few threads of its own, never on the event
loop that serves every stream (a long text takes the tokenizer seconds), and refuses text too long
for the context before tokenizing it. `Frontend.start` validates a request (model name, prompt,
limits), places it (`routing.Router`: UNAVAILABLE at once when a pool has no live worker,
RESOURCE_EXHAUSTED with a retry-after hint when every live one is full or no placement can meet the
TTFT objective), dispatches it with a Ray call that returns immediately, and hands back its
`ActiveRequest`. Iterating `ActiveRequest.responses` yields the gRPC API's own `GenerateResponse`
messages as token messages arrive from the workers (pyzmq); the HTTP API translates them. Every
failure is a `RequestFailed` carrying a gRPC status code name, its message (the same words on every
API) and, for bad input, the request field at fault; each API maps it to its own errors. Output past
what the context leaves after the prompt is refused, never cut short unasked.

`ActiveRequest.migrate` moves a running request to another decode worker with its KV (live
migration: the stream pauses, then goes on from there with the next token); `Frontend.drain` takes a
worker out of placement and moves every request it holds away, for a scale-down or a role change.

`ActiveRequest.finish` ends a request once, on every path: it gives back its placement, aborts it on
every worker it touched unless it completed (a cancel, a deadline or a failure frees its KV there),
counts it in the metrics and writes its lifetime (DistServe's per-request events) as one JSON log
line on the `pdserve.lifetime` logger.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pdserve.diagnostics import shown
from pdserve.engine.detokenizer import GrowingText, TextStream
from pdserve.engine.multimodal.images import ImageLimits, check_image_header
from pdserve.engine.sampling_params import (
    BadParameter,
    SamplingParams,
    check_output_room,
    check_prompt,
    check_prompt_text,
)
from pdserve.proto.pdserve.v1 import pdserve_pb2
from pdserve.router.aborts import AbortBatcher
from pdserve.router.encoders import EncodeCollector, EncodePool
from pdserve.router.image_urls import ImageFetch
from pdserve.router.admission import Overloaded
from pdserve.router.metrics import RouterMetrics
from pdserve.router.routing import Placement, Router
from pdserve.router.token_hub import TokenStreamHub
from pdserve.router.workers import NoHealthyWorker, WorkerRef
from pdserve.wire import (
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    LifetimeEvent,
    MoveOutcome,
    TokenMessage,
    WorkRequest,
    is_handoff_notice,
)

log = logging.getLogger(__name__)
lifetime_log = logging.getLogger("pdserve.lifetime")
DEAD_WORKER_CHECK_S = 0.5  # how often a waiting stream looks whether its workers are still healthy
# Later tokens held this long for an earlier one: that one was lost (its worker died with it unsent,
# and may be back already), so the attempt is retried from the tokens the client has.
LOST_MESSAGE_S = 2.0
RETRY_POLL_S = 0.1  # how often a retry that found no healthy worker looks again
# A worker's fault or a failed transfer: another worker may well serve the request.
RETRYABLE = (INTERNAL, UNAVAILABLE)
NOT_FOUND, CANCELLED, OK = "NOT_FOUND", "CANCELLED", "OK"
# Threads that tokenize and render chat templates. A prompt's text is bounded by the context (see
# `prompt_ids`), so each job is short; a few threads keep a slow one from holding up the others.
TOKENIZER_THREADS = 4
T = TypeVar("T")
COMPLETED_KEPT = 65536  # the requests that ended last, for the online planner's window
MOVES_AT_ONCE = 8  # a drain's moves in flight (a decode worker runs 16 at once: `MIGRATE_THREADS`)
MOVE_TRIES = 3  # moves of one request that failed before a drain moves it by recompute instead
DRAIN_POLL_S = 0.05  # how often a drain looks for requests to move while its moves run
# A client's request id is echoed in every response and logged (as its repr, where a line could be forged).
MAX_REQUEST_ID_CHARS = 256


class RequestFailed(Exception):
    """A request refused or failed; `code` is a gRPC status code name, `param` the request field at
    fault when one is (OpenAI's error `param`). Each API words it the same: `message` as it is."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param

    @classmethod
    def bad_input(cls, e: ValueError) -> RequestFailed:
        """INVALID_ARGUMENT for a value that breaks a rule, naming its field when the rule says which."""
        return cls(INVALID_ARGUMENT, str(e), param=e.param if isinstance(e, BadParameter) else None)


@dataclass(frozen=True)
class RetryBudget:
    """How a request that loses a worker is tried again."""

    max_retries: int = 3  # attempts after the first; past them the request fails with UNAVAILABLE
    wait_s: float = 30.0  # how long a retry waits for a healthy worker (one being restarted, say)


@dataclass
class DrainReport:
    """What draining a worker took (`Frontend.drain`)."""

    worker: str
    moved: int = 0  # running requests moved with their KV (or, where the target judged it cheaper, their tokens)
    recomputed: int = 0  # requests whose moves kept failing, resumed elsewhere from their tokens
    failed_moves: int = 0
    pauses_s: list[float] = field(default_factory=list)  # each move: out of the batch there until committed here
    seconds: float = 0.0


@dataclass(frozen=True)
class ObservedRequest:
    """What the online planner reads of a request: when it came, its lengths, and which prompt blocks
    it shared with others."""

    arrived: float  # wall clock
    prompt_len: int
    # Generated: by one that completed; so far, by one still running (a lower bound); for one that
    # failed, the most it asked for.
    output_len: int
    # The prompt's cacheable full blocks, 8 bytes each (the start of each chained block hash): two
    # requests share a prefix of k blocks when their first k ids are equal. Compact: it is kept a while.
    block_ids: bytes = b""
    block_size: int = 0

    def block_id_list(self) -> tuple[int, ...]:
        return tuple(i for (i,) in struct.iter_unpack("<Q", self.block_ids))


@dataclass
class ServedModel:
    name: str
    tokenizer: Any
    info: pdserve_pb2.ModelInfo
    # The most characters one token stands for (model_loader.max_token_chars); None: no such bound.
    max_token_chars: int | None = None
    image_limits: ImageLimits | None = None  # a vision-language model's; None: it takes no images
    image_fetch: ImageFetch = ImageFetch()  # which image URLs the chat API takes (data: only by default)
    image_tokens: int = 1  # the tokens an image is expected to take (a 1024x1024 one's), for placement

    def check_image_count(self, count: int) -> ImageLimits:
        """Refuse (BadParameter) `count` images for one request of this model; its image limits."""
        limits = self.image_limits
        if limits is None or limits.max_images == 0:
            raise BadParameter("images", f"model {self.name!r} takes no images")
        limits.check_count(count)
        return limits

    def check_images(self, ids: list[int], images: tuple[bytes, ...]) -> None:
        """Refuse (BadParameter) images this model cannot take: too many, too large, not an image by
        their header, or not one placeholder each in the prompt. Reads headers only (no decoding)."""
        limits = self.check_image_count(len(images))
        placeholders = ids.count(self.info.image_token_id)
        if placeholders != len(images):
            raise BadParameter("images", f"the prompt has {placeholders} image placeholders ({self.info.image_token!r}) "
                                         f"for {len(images)} images: one per image, in order")
        for index, data in enumerate(images):
            check_image_header(data, limits, index)


class Frontend:
    def __init__(self, model: ServedModel, router: Router, hub: TokenStreamHub,
                 retry: RetryBudget = RetryBudget()) -> None:
        self.model = model
        self.router = router
        self.hub = hub
        self.retry = retry
        self.metrics = RouterMetrics(router)
        self.aborts = AbortBatcher()
        self.active: set[ActiveRequest] = set()  # started and not finished (on the router's event loop)
        self.completed: deque[ObservedRequest] = deque(maxlen=COMPLETED_KEPT)  # ended (on the loop; read anywhere)
        self._tokenizer_threads = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, "router-tokenizer")
        self.encoders: EncodePool | None = None  # the encode pool, where the cluster has one
        self.metrics.registry.register(EncodeCollector(lambda: self.encoders))

    @contextmanager
    def refusals(self, api: str) -> Iterator[None]:
        """Around a request's validation and start: bad input (ValueError) becomes INVALID_ARGUMENT;
        every refusal is counted and logged (a lifetime line without a request id: none was given)."""
        try:
            yield
        except (ValueError, RequestFailed) as e:
            failed = e if isinstance(e, RequestFailed) else RequestFailed.bad_input(e)
            self.metrics.ended(api, failed.code)
            lifetime_log.info(json.dumps({"request_id": None, "api": api, "code": failed.code,
                                          "error": failed.message, "accepted": time.time()}))
            raise failed from None

    def check_model(self, name: str) -> None:
        if name and name != self.model.name:
            raise RequestFailed(NOT_FOUND, f"unknown model {shown(name)}; this server serves {self.model.name!r}",
                                param="model")

    async def off_loop(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`work(*args, **kwargs)` on the tokenizer threads: tokenizer work, which would stall every stream
        on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_threads,
                                                                functools.partial(work, *args, **kwargs))

    async def tokenize(self, text: str) -> list[int]:
        """`text`'s token ids, as the Tokenize API gives them (no special tokens added)."""
        return await self.off_loop(self.model.tokenizer.encode, text, add_special_tokens=False)

    async def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """A prompt's token ids. Text that cannot fit the context is refused (ValueError naming `param`)
        untokenized."""
        if not isinstance(prompt, str):
            return list(prompt)
        check_prompt_text(prompt, self.model.max_token_chars, self.model.info.max_model_len, param)
        return await self.tokenize(prompt)

    def default_max_tokens(self, ids: list[int], default: int) -> int:
        """The output length of a request that sets none: `default`, or what the context leaves when
        that is less (the request did not ask for more: nothing to refuse)."""
        return max(1, min(default, self.model.info.max_model_len - len(ids)))

    def close(self) -> None:
        self._tokenizer_threads.shutdown(wait=False, cancel_futures=True)

    async def observed(self) -> list[ObservedRequest]:
        """The requests that ended lately and those running (the online planner's window: without the
        running ones, long outputs would be missing from it until they end)."""
        return [*self.completed, *(active.observed() for active in self.active)]

    def workers_lost(self) -> None:
        """Workers became unhealthy (on the router's event loop): each stream waiting on one of them is
        told at once, as a worker's own error tells it, instead of at its next look."""
        for active in list(self.active):
            active.check_workers()

    async def drain(self, worker: WorkerRef, timeout_s: float = 300.0) -> DrainReport:
        """Take `worker` out of placement and move every request it decodes to the other decode
        workers with its KV (a request whose moves keep failing is resumed elsewhere from its tokens);
        returns once no request depends on it (its prompts finished too). It stays out of placement
        until `reopen`. Raises NoHealthyWorker when no other decode worker can take its requests,
        TimeoutError past `timeout_s`."""
        others = [w for w in self.router.decode_pool if w is not worker and w.healthy and not w.draining]
        if worker.pool == "decode" and not others:
            raise NoHealthyWorker(f"{worker.name} is the last decode worker taking requests: draining it would leave none")
        started = time.monotonic()
        worker.draining = True
        try:
            return await self._drain(worker, started, timeout_s)
        except BaseException:  # it could not be drained: it serves on as before
            worker.draining = False
            raise

    async def _drain(self, worker: WorkerRef, started: float, timeout_s: float) -> DrainReport:
        name = worker.name
        report, tries = DrainReport(name), Counter[ActiveRequest]()
        moving: dict[ActiveRequest, tuple[WorkerRef, asyncio.Task[MoveOutcome]]] = {}  # by request: target, move
        incoming = Counter[WorkerRef]()  # moves under way by target: they hold no admission slot there yet
        resumed: set[ActiveRequest] = set()  # sent away by recompute: their streams retry on their own

        def count(done: list[ActiveRequest]) -> None:
            for active in done:
                target, task = moving.pop(active)
                incoming[target] -= 1
                outcome = task.result()
                if outcome.moved:
                    report.moved += 1
                    report.pauses_s.append(outcome.pause_s)
                elif outcome.tried:
                    report.failed_moves += 1
                    tries[active] += 1

        while holding := [a for a in self.active if worker in (*a.placement.depends_on, a.placement.moving_to)]:
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"worker {name} still holds {len(holding)} requests after {timeout_s:.0f} s")
            count([a for a, (_, task) in moving.items() if task.done()])
            for active in holding:
                if active in moving or active in resumed or not active.decoding_on(worker) or \
                        len(moving) >= MOVES_AT_ONCE:
                    continue
                if tries[active] >= MOVE_TRIES:
                    report.recomputed += 1
                    resumed.add(active)
                    active.resume_elsewhere(f"its moves off draining worker {name} failed {MOVE_TRIES} times")
                    continue
                target = self.router.move_target(active.placement, incoming)
                incoming[target] += 1
                moving[active] = (target, asyncio.create_task(active.migrate(target)))
            if moving:
                await asyncio.wait([task for _, task in moving.values()], timeout=DRAIN_POLL_S)
            else:
                await asyncio.sleep(DRAIN_POLL_S)
        if moving:  # their requests are off the worker: their outcomes are due at once
            await asyncio.wait([task for _, task in moving.values()])
            count(list(moving))
        report.seconds = time.monotonic() - started
        return report

    async def _encode_then_dispatch(self, active: ActiveRequest) -> None:
        """Dispatch a request with images once an encode worker has made their embeddings (or none could:
        its prefill worker encodes them then). Its stream hears of a failure as it hears of a worker's."""
        work = active.work
        try:
            encoded = await self.encoders.encode(work.request_id, work.images)
        except ValueError as e:  # an image the encoder could not decode
            self.hub.deliver(TokenMessage(request_id=work.request_id, error_code=INVALID_ARGUMENT, error=str(e)))
            return
        except Exception:  # a bug of ours: the prefill worker encodes instead, and the log says why
            log.exception("request %s: the encode pool failed; its prefill worker encodes its images", work.request_id)
            encoded = None
        if active.work is not work or active.finished:  # retried (without embeddings) or ended meanwhile
            return
        if encoded is not None:
            active.events[LifetimeEvent.ENCODED] = time.time()
        active.work = dataclasses.replace(work, encoded=encoded)
        try:
            _dispatch(self.hub, active.work, active.placement)
        except Exception as e:  # a Ray call that could not even be sent: retried as a worker's fault
            self.hub.deliver(TokenMessage(request_id=work.request_id, error_code=UNAVAILABLE,
                                          error=f"could not dispatch the request: {type(e).__name__}: {e}"))

    def reopen(self, worker: WorkerRef) -> None:
        """Let a drained worker take requests again."""
        worker.draining = False

    def start(self, api: str, ids: list[int], params: SamplingParams, client_request_id: str = "",
              accepted: float | None = None, max_tokens_param: str = "max_tokens",
              images: tuple[bytes, ...] = ()) -> ActiveRequest:
        """Validate, place and dispatch a prompt (`prompt_ids`); raises ValueError (a bad prompt or image,
        or more output than the context leaves: `max_tokens_param` names the field that asked) or
        RequestFailed. `accepted`: when the API layer received the request (its parsing and tokenizing
        count in the TTFT), else now. `images`: one per placeholder in `ids`; the worker that runs the
        prompt pass expands the placeholders (and refuses a prompt they make too long)."""
        accepted = accepted or time.time()
        info = self.model.info
        check_prompt(ids, info.vocab_size, info.max_model_len)
        check_output_room(len(ids), params.max_tokens, info.max_model_len, max_tokens_param)
        if images:
            self.model.check_images(ids, images)
        work = WorkRequest(uuid.uuid4().hex, ids, params, images)  # unique, whatever the client calls it
        if self.hub.error is not None:
            raise RequestFailed(UNAVAILABLE, f"the router's token stream failed: {self.hub.error}")
        try:
            placement = self.router.place(work)
        except NoHealthyWorker as e:
            raise RequestFailed(UNAVAILABLE, str(e)) from None
        except Overloaded as e:
            raise RequestFailed(RESOURCE_EXHAUSTED, str(e), e.retry_after_s) from None
        self.metrics.routed(placement)
        active = ActiveRequest(self, api, work, placement, client_request_id or work.request_id,
                               {LifetimeEvent.ACCEPTED: accepted, LifetimeEvent.ROUTED: time.time()})
        if images and self.encoders is not None:  # its prompt pass waits for the embeddings, not its worker
            self.active.add(active)
            active.encoding = asyncio.get_running_loop().create_task(self._encode_then_dispatch(active))
            return active
        try:
            _dispatch(self.hub, work, placement)
        except Exception as e:  # a Ray call that could not even be sent: give the placement back
            self.hub.unsubscribe(work.request_id)
            self.router.finished(placement)
            raise RequestFailed(UNAVAILABLE, f"could not dispatch the request: {type(e).__name__}: {e}") from None
        self.active.add(active)
        return active


def check_request_id(request_id: str) -> None:
    """Refuse a client's request id too long to echo in every response (checked right after the model)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise BadParameter("request_id", f"request_id may have at most {MAX_REQUEST_ID_CHARS} characters, got "
                                         f"{len(request_id)}")


class ActiveRequest:
    """One placed and dispatched request: iterate `responses`, then `finish` it (on every path).

    A request that loses a worker (its health check fails, or a worker reports its fault or a failed
    transfer) is tried again, up to the frontend's retry budget: before its first token from the
    start, on any healthy workers; after it, resumed on a decode worker from its prompt and the
    tokens the client already has, so the stream goes on with no token repeated or missing. Each
    attempt runs under its own id (`<request id>.<attempt>`), so a late message of a lost attempt
    can never reach the stream."""

    def __init__(self, frontend: Frontend, api: str, work: WorkRequest, placement: Placement, client_id: str,
                 events: dict[str, float]) -> None:
        self.frontend = frontend
        self.api = api
        self.request_id = work.request_id
        self.work = work  # the current attempt
        self.placement = placement
        self.client_id = client_id
        self.events = events  # lifetime events: name -> wall-clock seconds (the router's and the workers')
        self.code = CANCELLED  # until it completes or fails
        self.output_tokens = 0
        self.cached_tokens = 0
        self.prompt_tokens = len(work.prompt_token_ids)  # the worker's count once it answers (images expanded)
        self.draft_tokens = self.accepted_draft_tokens = 0  # speculative decoding's, from the last message
        self.generated: list[int] = []  # every token the client has been sent
        self.logprobs: list[float] = []
        self.retry_causes: list[str] = []
        self._queue: asyncio.Queue[TokenMessage] = frontend.hub.subscribe(work.request_id)
        self._attempt_started = False  # the current attempt has sent its first token
        self._finished = False
        self.encoding: asyncio.Task[None] | None = None  # its images at an encode worker, before dispatch

    async def responses(self) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """The request's responses; the last has finish_reason and timings. Raises RequestFailed."""
        try:
            async for response in self._responses():
                yield response
        except RequestFailed as e:
            self.code = e.code
            raise
        except Exception:  # a bug of ours, not the client going away: say so in the metrics and the log
            self.code = INTERNAL
            raise

    async def _responses(self) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        frontend = self.frontend
        detok = Detokenizer(frontend.model.tokenizer, self.work.params)
        while True:
            try:
                msg: TokenMessage = await asyncio.wait_for(self._queue.get(), DEAD_WORKER_CHECK_S)
            except asyncio.TimeoutError:
                lost = lost_workers(self.placement.depends_on)
                if lost:
                    await self._retry(lost)
                elif frontend.hub.gap_s(self.work.request_id) > LOST_MESSAGE_S:
                    await self._retry(f"a token message was lost: later tokens waited {LOST_MESSAGE_S:.0f} s for "
                                      f"the one at output position {len(self.generated)}")
                continue
            if msg.error:
                code = msg.error_code or UNAVAILABLE
                # A pool found full once the client has tokens (the reservation runs beside the prompt
                # pass, or after it) is waited out by a retry, which resumes from them: not an error mid-stream.
                # A failed hub fails every attempt: no retry then.
                busy_mid_stream = code == RESOURCE_EXHAUSTED and bool(self.generated)
                if (code in RETRYABLE or busy_mid_stream) and frontend.hub.error is None:
                    await self._retry(msg.error)
                    continue
                retry = frontend.router.retry_after_s() if code == RESOURCE_EXHAUSTED else None
                raise RequestFailed(code, msg.error, retry)
            if is_handoff_notice(msg):  # the decode worker holds the request: the prefill worker may go
                self.placement.handed_over()
                continue
            self.events.update(msg.events)
            tokens = list(msg.token_ids)
            self.output_tokens += len(tokens)
            self.generated += tokens
            self.logprobs += msg.logprobs
            response = pdserve_pb2.GenerateResponse(request_id=self.client_id, server_request_id=self.request_id,
                                                    token_ids=tokens, logprobs=msg.logprobs)
            if not self._attempt_started:  # this attempt's prompt pass is over
                self._attempt_started = True
                frontend.router.first_token(self.placement)
            else:  # a later message is the decode worker's (should it overtake the notice)
                self.placement.handed_over()
            if LifetimeEvent.FIRST_TOKEN not in self.events:
                self.events[LifetimeEvent.FIRST_TOKEN] = time.time()
                self.cached_tokens = msg.cached_tokens
                self.prompt_tokens = msg.prompt_tokens or self.prompt_tokens
                response.prompt_tokens = self.prompt_tokens
                response.cached_tokens = msg.cached_tokens
            if msg.finish_reason:
                self.events[LifetimeEvent.FINISHED] = time.time()
                self.code = OK
                response.text_delta = detok.finish(msg.text)
                response.finish_reason = msg.finish_reason
                self.draft_tokens, self.accepted_draft_tokens = msg.draft_tokens, msg.accepted_draft_tokens
                response.draft_tokens, response.accepted_draft_tokens = msg.draft_tokens, msg.accepted_draft_tokens
                response.timings.CopyFrom(timings(self.events))
                yield response
                return
            response.text_delta = detok.add(tokens)
            yield response

    def decoding_on(self, worker: WorkerRef) -> bool:
        """Whether `worker` decodes this request and it is past its first token (a move can take it)."""
        p = self.placement
        return not self._finished and p.decode is worker and p.moving_to is None and self._attempt_started

    async def migrate(self, target: WorkerRef) -> MoveOutcome:
        """Move the request from its decode worker to `target` with its KV (live migration): its stream
        pauses, then goes on from `target` with the next token. One that fails leaves the request where
        it was (a source that died is the health check's to notice: the request is then retried)."""
        placement, source = self.placement, self.placement.decode
        placement.moving_to = target
        try:
            outcome = await asyncio.wrap_future(
                source.handle.migrate.remote(self.work.request_id, target.handle).future())
        except Exception as e:  # the call failed: the source died, or Ray could not deliver it
            outcome = MoveOutcome(False, f"worker {source.name} failed the move: {type(e).__name__}: {e}", in_doubt=True)
        if self.placement is not placement:  # retried meanwhile: that retry's aborts covered `target` too
            return outcome
        if outcome.moved:
            for name, at in outcome.events.items():  # the source's part of the lifetime (its decode start)
                self.events.setdefault(name, at)
            self.frontend.router.moved(placement, target)
            return outcome
        placement.moving_to = None
        if outcome.in_doubt:  # the target may hold it: the source has it still, or a retry will
            self.frontend.aborts.add(target, self.work.request_id)
        return outcome

    def observed(self) -> ObservedRequest:
        """The request as the online planner sees it, running or ended (on the router's loop)."""
        prompt_len, route = len(self.work.prompt_token_ids), self.placement.request
        # A resumed request's hashes run on past its prompt (prompt + tokens so far): its prompt's blocks.
        hashes = route.block_hashes[:(prompt_len - 1) // route.block_size]
        failed = self._finished and self.code != OK
        output_len = self.work.params.max_tokens if failed else max(1, self.output_tokens)
        return ObservedRequest(self.events[LifetimeEvent.ACCEPTED], prompt_len, output_len,
                               b"".join(h[:8] for h in hashes), route.block_size)

    def resume_elsewhere(self, cause: str) -> None:
        """End the current attempt and resume the request on another worker from its tokens, as a lost
        worker would have it (counted against its retry budget)."""
        self.frontend.hub.deliver(TokenMessage(request_id=self.work.request_id, error_code=UNAVAILABLE, error=cause))

    def check_workers(self) -> None:
        """Retry at once if a worker the current attempt waits on became unhealthy: its stream gets the
        error a failed worker would send."""
        lost = lost_workers(self.placement.depends_on)
        if lost:
            self.frontend.hub.deliver(TokenMessage(request_id=self.work.request_id, error_code=UNAVAILABLE, error=lost))

    async def _retry(self, cause: str) -> None:
        """End the current attempt and start the next, on healthy workers (waiting up to the budget's
        `wait_s` for one); past the retry budget, UNAVAILABLE naming the cause."""
        frontend, budget = self.frontend, self.frontend.retry
        if len(self.retry_causes) >= budget.max_retries:
            tried = f" after {budget.max_retries} retries" if budget.max_retries else " (retries are off)"
            raise RequestFailed(UNAVAILABLE, f"request failed{tried}: {cause}")
        self.retry_causes.append(cause)
        attempt = len(self.retry_causes)
        log.warning("request %s: %s; attempt %d of %d", shown(self.request_id), cause, attempt + 1,
                    budget.max_retries + 1)
        failed = self.placement.touched
        self._end_attempt(aborted=True)
        self.work = dataclasses.replace(self.work, request_id=f"{self.request_id}.{attempt}")
        self.events[LifetimeEvent.retry(attempt)] = time.time()
        frontend.metrics.retried("decode" if self.generated else "prefill")
        deadline = time.monotonic() + budget.wait_s
        while True:
            try:
                self.placement = frontend.router.place_again(self.work, self.generated, avoid=failed)
                break
            except NoHealthyWorker as e:
                if time.monotonic() > deadline:
                    raise RequestFailed(UNAVAILABLE, f"{cause}; no worker to retry on within {budget.wait_s:.0f} s: "
                                                     f"{e}") from None
                await asyncio.sleep(RETRY_POLL_S)
        self._queue = frontend.hub.subscribe(self.work.request_id, first_index=len(self.generated))
        self._attempt_started = False
        try:
            _dispatch(frontend.hub, self.work, self.placement, self.generated, self.logprobs)
        except Exception as e:  # the Ray call could not even be sent: the next round finds it out
            await self._retry(f"could not dispatch the retry: {type(e).__name__}: {e}")

    def _end_attempt(self, aborted: bool) -> None:
        """Give back the current attempt's placement and, unless it completed, free what it holds on its
        workers. The router learns the transfer cost only from a request that ran undisturbed."""
        frontend, placement = self.frontend, self.placement
        frontend.hub.unsubscribe(self.work.request_id)
        frontend.router.finished(placement, None if self.retry_causes else self.events)
        if aborted:  # cancelled, deadline, failed or retried: free its KV wherever it is
            for worker in placement.touched:
                frontend.aborts.add(worker, self.work.request_id)

    def finish(self) -> None:
        """End the request (once): free what it holds, count it, log its lifetime."""
        if self._finished:
            return
        self._finished = True
        if self.encoding is not None:
            self.encoding.cancel()
        self.frontend.active.discard(self)
        self._end_attempt(aborted=self.code != OK)
        frontend, placement = self.frontend, self.placement
        self.events.setdefault(LifetimeEvent.FINISHED, time.time())
        ev = self.events
        accepted, first = ev[LifetimeEvent.ACCEPTED], ev.get(LifetimeEvent.FIRST_TOKEN)
        frontend.metrics.ended(self.api, self.code, self.output_tokens,
                               first - accepted if first else None, ev[LifetimeEvent.FINISHED] - accepted)
        frontend.completed.append(self.observed())
        if self.draft_tokens:
            frontend.metrics.speculated(placement.decode.name, self.draft_tokens, self.accepted_draft_tokens)
        if first is not None:
            frontend.metrics.prompt_served(placement.prefiller.name, self.prompt_tokens,
                                           self.cached_tokens)
        lifetime_log.info(json.dumps(self.lifetime()))

    @property
    def finished(self) -> bool:
        return self._finished

    def lifetime(self) -> dict[str, Any]:
        """The request's lifetime record: who served it, how it ended, what it was retried for, and its
        events in milliseconds after `accepted` (a Unix time), in the order they happened."""
        p, start = self.placement, self.events[LifetimeEvent.ACCEPTED]
        ordered = sorted(self.events.items(), key=lambda kv: kv[1])
        return {"request_id": self.request_id, "client_request_id": self.client_id, "api": self.api,
                "code": self.code, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "output_tokens": self.output_tokens,
                "draft_tokens": self.draft_tokens, "accepted_draft_tokens": self.accepted_draft_tokens,
                "prefill_worker": p.prefiller.name, "decode_worker": p.decode.name,
                "retries": self.retry_causes, "accepted": start,
                "events_ms": {name: round((t - start) * 1e3, 3) for name, t in ordered}}


def _dispatch(hub: TokenStreamHub, work: WorkRequest, placement: Placement, generated: list[int] = (),
              logprobs: list[float] = ()) -> None:
    """Hand the request to its workers (Ray calls that return at once; the outcome arrives as token
    messages): a whole request to a colocated or locally prefilling decode worker (one that resumes,
    with the tokens generated so far), else the prompt to its prefill worker, which streams the KV to
    the decode worker. A call that fails itself (the method raised, or Ray could not deliver it) sends
    no message: its failure is handed to the request's stream as one, so it is retried, not waited on."""
    decode = placement.decode
    if generated:
        target, call = decode, decode.handle.resume.remote(work, list(generated), list(logprobs))
    elif placement.local:
        target, call = decode, decode.handle.generate.remote(work)
    else:
        prefill = target = placement.prefill
        call = prefill.handle.prefill.remote(work, decode.handle, new_tokens=placement.request.new_tokens(prefill))

    def failed(future: concurrent.futures.Future) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            cause = getattr(error, "cause", None) or error  # what the worker's method raised, unwrapped
            hub.deliver(TokenMessage(request_id=work.request_id, error_code=UNAVAILABLE,
                                     error=f"worker {target.name} failed the request: {type(cause).__name__}: {cause}"))

    call.future().add_done_callback(failed)


class Detokenizer:
    """Text deltas from token ids, holding back what a stop string could still cut off."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.text = TextStream(tokenizer)
        self._sent = GrowingText()
        self._agrees = True  # what was sent is the start of the text
        self.hold = max((len(s) for s in params.stop), default=1) - 1

    def add(self, tokens: list[int]) -> str:
        self.text.add(tokens)
        if self.text.rewritten or not self._agrees:  # (only a text decoded whole changes before its end)
            self._agrees = self.text.text.startswith(str(self._sent))
        end = self.text.settled_length - self.hold
        if not self._agrees or end <= self._sent.length:
            return ""
        delta = self.text.tail(self._sent.length)[: end - self._sent.length]
        self._sent.append(delta)
        return delta

    def finish(self, final_text: str) -> str:
        sent = str(self._sent)
        return final_text[len(sent) :] if final_text.startswith(sent) else ""


def timings(ev: dict[str, float]) -> pdserve_pb2.Timings:
    """The phases of a request from its lifetime events (a phase whose events it never met, such as
    the prompt pass of a request that failed first, counts zero)."""
    accepted, done = ev[LifetimeEvent.ACCEPTED], ev.get(LifetimeEvent.FINISHED, time.time())
    prefill_start = ev.get(LifetimeEvent.PREFILL_START, accepted)
    prefill_end = ev.get(LifetimeEvent.PREFILL_END, prefill_start)
    decode_start = ev.get(LifetimeEvent.DECODE_START, prefill_end)
    return pdserve_pb2.Timings(
        queued_s=max(0.0, prefill_start - accepted),
        prefill_s=max(0.0, prefill_end - prefill_start),
        kv_transfer_s=max(0.0, decode_start - prefill_end),
        decode_s=max(0.0, ev.get(LifetimeEvent.DECODE_END, done) - decode_start),
        ttft_s=ev.get(LifetimeEvent.FIRST_TOKEN, done) - accepted,
        e2e_s=done - accepted,
        events=ev,
    )


def lost_workers(workers: Iterable[WorkerRef]) -> str | None:
    """Why an attempt waiting on `workers` cannot go on: each unhealthy one's fault as it reported it
    (the text of the error it sends its requests, which may come after this check), else that it
    stopped responding; None while all are healthy."""
    reasons = [w.fault or f"worker {w.name} stopped responding while serving the request"
               for w in workers if not w.healthy]
    return "; ".join(reasons) or None
