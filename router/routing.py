"""The router's decision for each request, and the load bookkeeping that the policies read.

`place` hashes the prompt's full blocks (the engine's chained hashes), asks the prefix index how
many leading blocks each worker caches, then:

1. chooses the decode worker (the decode pool's policy; in colocated mode the one worker does both
   phases and the prefill policy chooses it);
2. conditional disaggregation: when the part of the prompt that decode worker does not cache is
   short enough, the request prefills there and skips the transfer. The threshold (`local_prefill_tokens`)
   is the manifest's, or, with the estimated_ttft policy, measured: the longest prompt whose compute in a
   decode step costs no more than its KV transfer takes (the decode worker's fitted step cost
   against the transfer times the router has seen) and delays the decode batch by no more than the
   step's own fixed cost (a local prefill must not stretch the running requests' TPOT), judged per
   request (its cached prefix included); and a prompt still prefills remotely when the decode
   worker's own line of local prefills would make it later than the best prefill worker's estimate;
3. otherwise chooses the prefill worker (the prefill pool's policy) and, when that policy estimates
   TTFT and even the best estimate exceeds `reject_factor` x the TTFT objective, refuses the request
   at once (Overloaded: RESOURCE_EXHAUSTED) instead of queueing it to miss its objective anyway.

It books the request's load on the workers it chose (admission slots, queued prompt work, KV blocks)
until `first_token` and `finished` give it back, and counts what it decided (`stats`), including
the cached prefix an oracle that knows every worker's cache would have found: the best match in the
exact index.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.router.admission import Overloaded, PoolAdmission
from pdserve.router.policies import RouteRequest, TransferCost, make_policy
from pdserve.router.policies.estimated_ttft import is_short
from pdserve.router.prefix_index import ApproximateIndex, PrefixIndex
from pdserve.router.workers import NoHealthyWorker, QueuedPrefill, WorkerRef, placeable_workers
from pdserve.wire import LifetimeEvent, WorkRequest


@dataclass
class RoutingSettings:
    prefill_policy: str = "estimated_ttft"
    decode_policy: str = "estimated_ttft"
    policy_options: dict[str, Any] = field(default_factory=dict)  # cache_aware's and kv_cost's knobs
    prefix_index: str = "exact"  # exact: from the workers' KV events; approximate: from decisions
    ttft_slo_s: float | None = None  # early rejection is off without an objective
    reject_factor: float = 2.0
    local_prefill_tokens: int | None = None  # None: measured with the estimated_ttft policy, else 0 (off)
    max_queued_prefills: int = 64
    max_active_decodes: int = 128
    max_model_len: int = 2048
    image_token_id: int | None = None  # a vision-language model's image placeholder
    # The tokens an image is expected to take once its placeholder is expanded (a 1024x1024 one's): only
    # the worker that decodes an image knows its own count, and placement needs the prompt's size before.
    image_tokens: int = 1

    @classmethod
    def from_spec(cls, spec: Any, max_model_len: int, image_token_id: int | None = None,
                  image_tokens: int = 1) -> "RoutingSettings":
        """From a manifest's `router` section (`cluster.manifest.RouterSpec`, read by attribute: the
        router imports nothing of the cluster): the cluster's router and the simulator's alike."""
        prefill_policy, decode_policy = spec.pool_policies
        return cls(prefill_policy=prefill_policy, decode_policy=decode_policy,
                   policy_options={**spec.cache_aware.model_dump(), "overlap_weight": spec.kv_overlap_weight},
                   prefix_index=spec.prefix_index, ttft_slo_s=spec.ttft_slo_s, reject_factor=spec.reject_factor,
                   local_prefill_tokens=spec.local_prefill_tokens, max_queued_prefills=spec.max_queued_prefills,
                   max_active_decodes=spec.max_active_decodes, max_model_len=max_model_len,
                   image_token_id=image_token_id, image_tokens=image_tokens)


@dataclass
class RoutingStats:
    """Cumulative counts since start (a benchmark takes differences over a run)."""

    requests_routed: int = 0
    prompt_tokens: int = 0
    predicted_cached_tokens: int = 0  # the index's match on the worker that prefills
    oracle_cached_tokens: int = 0  # the best match on any worker (the exact index)
    local_prefills: int = 0
    early_rejections: int = 0
    retries: int = 0  # placements of requests that lost a worker (`place_again`)
    prefill_pool_down: int = 0  # prompts prefilled on their decode worker as no prefill worker was healthy
    moved: int = 0  # running requests moved to another decode worker with their KV
    per_worker: Counter = field(default_factory=Counter)


@dataclass(eq=False)
class Placement:
    """The workers one request holds load on, touched, and currently depends on."""

    request: RouteRequest
    decode: WorkerRef
    prefill: WorkerRef | None = None  # None: it prefills on `decode` (colocated, or conditional)
    # The workers whose death loses the attempt: both until the decode worker has the request (the
    # first token may leave before the KV handoff commits), then the decode worker alone.
    depends_on: list[WorkerRef] = field(default_factory=list)
    prefill_pending: bool = True  # until the first token
    decode_pending: bool = True  # until the end
    # The decode worker the request is being moved to, KV and all (`Router.moved` makes it `decode`):
    # touched, since it may hold the request already; depended on only once the move is done.
    moving_to: WorkerRef | None = None
    # The worker that runs (or ran) the prompt pass: a locally prefilled request's first decode worker,
    # even after a move took it elsewhere.
    prefiller: WorkerRef = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prefiller = self.prefill or self.decode

    @property
    def touched(self) -> list[WorkerRef]:
        return [w for w in (self.prefill, self.decode, self.moving_to) if w is not None]

    @property
    def local(self) -> bool:
        return self.prefill is None

    def handed_over(self) -> None:
        """The decode worker sent tokens: it holds the request, whatever becomes of the prefill worker."""
        self.depends_on = [self.decode]


class Router:
    def __init__(self, mode: str, prefill_pool: list[WorkerRef], decode_pool: list[WorkerRef], block_size: int,
                 settings: RoutingSettings, index: PrefixIndex) -> None:
        self.mode = mode
        self.prefill_pool = prefill_pool
        self.decode_pool = decode_pool
        self.block_size = block_size
        self.settings = settings
        self.index = index  # exact, fed by the workers' KV events
        self.approximate = ApproximateIndex() if settings.prefix_index == "approximate" else None
        self.transfer = TransferCost()
        self.prefill_policy = make_policy(settings.prefill_policy, "prefill", self.transfer, settings.policy_options)
        self.decode_policy = make_policy(settings.decode_policy, "decode", self.transfer, settings.policy_options)
        self.prefill_admission = PoolAdmission("prefill", settings.max_queued_prefills)
        self.decode_admission = PoolAdmission("decode", settings.max_active_decodes)
        self.stats = RoutingStats()
        self._lock = threading.Lock()  # placements come from the gRPC loop; stats are read elsewhere

    # --- decisions ------------------------------------------------------------------------------
    def place(self, work: WorkRequest) -> Placement:
        """Choose and book workers for `work`; raises NoHealthyWorker or Overloaded."""
        request = self._route_request(work)
        with self._lock:
            return self._place(request)

    def place_again(self, work: WorkRequest, generated: list[int], avoid: list[WorkerRef] = ()) -> Placement:
        """Place a request that lost a worker once more (`work` carries the new attempt's id). It was
        admitted once, so no admission limit or early rejection turns it away now. With tokens already
        generated it resumes on a decode worker, which prefills prompt + those tokens itself: the lost
        worker's KV is gone, and a prefix cache may still hold part of it. The workers of the failed
        attempt (`avoid`) are taken only when no other is healthy: the supervisor may not have noticed
        yet that the one that failed is dead. Raises NoHealthyWorker."""
        request = self._route_request(work, generated)
        with self._lock:
            self.stats.retries += 1
            if not generated:
                return self._place(request, admitted=True, avoid=avoid)
            decode = self.decode_policy.choose(request, _preferring(placeable_workers(self.decode_pool), avoid)).worker
            return self._book(request, decode=decode, prefill=None)

    def _place(self, request: RouteRequest, admitted: bool = False, avoid: list[WorkerRef] = ()) -> Placement:
        def open_workers(pool: list[WorkerRef], admission: PoolAdmission) -> list[WorkerRef]:
            healthy = placeable_workers(pool)
            return _preferring(healthy, avoid) if admitted else admission.open_workers(healthy)

        decode_open = open_workers(self.decode_pool, self.decode_admission)
        if self.mode == "colocated":
            return self._book(request, decode=self.prefill_policy.choose(request, decode_open).worker, prefill=None)
        decode = self.decode_policy.choose(request, decode_open).worker
        if self.settings.local_prefill_tokens is not None:  # the manifest's rule, as it says
            if request.new_tokens(decode) <= self.settings.local_prefill_tokens:
                return self._book(request, decode=decode, prefill=None)
        try:
            prefill_open = open_workers(self.prefill_pool, self.prefill_admission)
        except NoHealthyWorker:  # the whole prefill pool is down: the decode worker prefills, as Dynamo's does
            self.stats.prefill_pool_down += 1
            return self._book(request, decode=decode, prefill=None)
        choice = self.prefill_policy.choose(request, prefill_open)
        if self._measured_local(request, decode, choice.estimate_s):
            return self._book(request, decode=decode, prefill=None)
        slo = self.settings.ttft_slo_s
        if (not admitted and choice.estimate_s is not None and slo is not None
                and choice.estimate_s > self.settings.reject_factor * slo):
            self.stats.early_rejections += 1
            raise Overloaded(f"no prefill worker can meet the TTFT objective of {slo * 1e3:.0f} ms: the best "
                             f"estimate is {choice.estimate_s * 1e3:.0f} ms", choice.estimate_s - slo)
        return self._book(request, decode=decode, prefill=choice.worker)

    @staticmethod
    def local_estimate_s(request: RouteRequest, decode: WorkerRef) -> float:
        """TTFT of a prefill on `decode`: the prompts already placed there to prefill, then one step of
        its running batch with this prompt in it (where it speculates: each sequence's drafts verified in
        that step too, and the drafting before it)."""
        cost, status = decode.step_cost, decode.status
        ahead = decode.queued.values()
        queued = sum(cost.compute_s(q.new_tokens, q.cached_tokens) for q in ahead)
        running = cost.step_s(decode.outstanding * status.step_tokens_per_seq, 0)
        if decode.outstanding:  # an empty batch drafts nothing
            running += status.step_propose_s
        return queued + running + cost.compute_s(request.new_tokens(decode), request.cached_tokens(decode))

    def _measured_local(self, request: RouteRequest, decode: WorkerRef, remote_estimate_s: float | None) -> bool:
        """With the estimated_ttft policy and no manifest threshold: whether this prompt prefills on `decode`.
        Its compute there must cost no more than its transfer takes and than one decode step's fixed
        cost (a local prefill must not stretch the running requests' TPOT), and its TTFT there must
        not exceed the best prefill worker's estimate (a line of local prefills sends prompts away)."""
        s = self.settings
        cost = decode.step_cost
        if (s.local_prefill_tokens is not None or s.prefill_policy != "estimated_ttft" or remote_estimate_s is None
                or not cost.measured):
            return False
        compute = cost.compute_s(request.new_tokens(decode), request.cached_tokens(decode))
        if compute > min(decode.fixed_step_s(), self.transfer.predict(request.num_prompt_tokens)):
            return False
        return self.local_estimate_s(request, decode) <= remote_estimate_s

    def local_prefill_limit(self, decode: WorkerRef) -> int:
        """The longest uncached prompt that may prefill on `decode` (for a prompt with no cached prefix):
        the manifest's, else with the estimated_ttft policy the measured bound of `_measured_local`."""
        if self.settings.local_prefill_tokens is not None:
            return self.settings.local_prefill_tokens
        cost, transfer = decode.step_cost, self.transfer
        if self.settings.prefill_policy != "estimated_ttft" or not cost.measured:
            return 0
        fixed = decode.fixed_step_s()
        return cost.max_tokens_within(lambda n: min(fixed, transfer.predict(n)), self.settings.max_model_len)

    def _route_request(self, work: WorkRequest, generated: list[int] = ()) -> RouteRequest:
        """What the policies see of `work`; a resumed request's "prompt" is its prompt + `generated`."""
        tokens = work.prompt_token_ids + list(generated)
        n = len(tokens) + len(work.images) * (self.settings.image_tokens - 1)  # each placeholder expanded
        # As the engine does: full blocks only, and never the last prompt token (its pass makes the logits).
        # With images, the text before the first: the engine hashes image blocks with the images' content,
        # which only the worker that decodes them knows.
        cached_end = work.prompt_token_ids.index(self.settings.image_token_id) if work.images else len(tokens) - 1
        cacheable = cached_end // self.block_size * self.block_size
        hashes = hash_prompt_blocks(tokens[:cacheable], self.block_size)
        exact = self.index.match(hashes) if hashes else {}
        seen = self.approximate.match(hashes) if self.approximate is not None and hashes else exact
        request = RouteRequest(work.request_id, n, work.params.max_tokens - len(generated), self.block_size, hashes,
                               seen, max_model_len=self.settings.max_model_len)
        request.oracle_cached_tokens = max(exact.values(), default=0) * self.block_size
        return request

    # --- bookkeeping ----------------------------------------------------------------------------
    def _book(self, request: RouteRequest, decode: WorkerRef, prefill: WorkerRef | None) -> Placement:
        p = Placement(request, decode, prefill)
        p.depends_on = p.touched
        for w in p.touched:
            w.outstanding += 1
        prefiller = p.prefiller
        prefiller.queued[request.request_id] = QueuedPrefill(request.new_tokens(prefiller),
                                                             request.cached_tokens(prefiller),
                                                             is_short(request, prefiller))
        decode.active_blocks += request.num_blocks_with_output
        if prefill is not None:
            prefill.active_blocks += request.num_blocks
        if self.approximate is not None and request.block_hashes:
            self.approximate.set_capacity(prefiller.name, prefiller.total_blocks or 1)
            self.approximate.record(prefiller.name, request.block_hashes)
        s = self.stats
        s.requests_routed += 1
        s.prompt_tokens += request.num_prompt_tokens
        s.predicted_cached_tokens += request.cached_tokens(prefiller)
        s.oracle_cached_tokens += request.oracle_cached_tokens
        s.local_prefills += self.mode != "colocated" and prefill is None
        s.per_worker[prefiller.name] += 1
        return p

    def first_token(self, p: Placement) -> None:
        """The prompt pass is over: its load on the prefill worker is given back (that worker may still
        be sending the KV: the request depends on it until `Placement.handed_over`)."""
        with self._lock:
            if not p.prefill_pending:
                return
            p.prefill_pending = False
            p.prefiller.queued.pop(p.request.request_id, None)
            if p.prefill is not None:
                p.prefill.outstanding -= 1
                p.prefill.active_blocks -= p.request.num_blocks
                self.prefill_admission.left()

    def finished(self, p: Placement, events: dict[str, float] | None = None) -> None:
        """The request ended (completed, failed or cancelled): give back all it holds."""
        self.first_token(p)
        with self._lock:
            if not p.decode_pending:
                return
            p.decode_pending = False
            p.decode.outstanding -= 1
            p.decode.active_blocks -= p.request.num_blocks_with_output
            self.decode_admission.left()
        events = events or {}
        if p.prefill is not None and LifetimeEvent.DECODE_START in events and LifetimeEvent.PREFILL_END in events:
            handoff_s = events[LifetimeEvent.DECODE_START] - events[LifetimeEvent.PREFILL_END]
            self.transfer.observe(p.request.num_prompt_tokens, max(0.0, handoff_s))

    def add_worker(self, worker: WorkerRef) -> None:
        """A worker joins its pool (`worker.pool`); it is placed on from the next request."""
        with self._lock:
            (self.prefill_pool if worker.pool == "prefill" else self.decode_pool).append(worker)

    def remove_worker(self, worker: WorkerRef) -> None:
        """A worker leaves its pool (drained first: nothing depends on it)."""
        with self._lock:
            pool = self.prefill_pool if worker.pool == "prefill" else self.decode_pool
            pool[:] = [w for w in pool if w is not worker]
            if self.approximate is not None:
                self.approximate.drop(worker.name)

    def move_target(self, p: Placement, incoming: Mapping[WorkerRef, int] | None = None) -> WorkerRef:
        """The decode worker to move a running request to: the decode policy's choice among the others
        open for placement, those with room under the admission limit (counting `incoming`, the moves
        under way to each) first: the request was admitted once, so a full pool still takes it, as a
        retry's. Raises NoHealthyWorker when there is none."""
        with self._lock:
            others = placeable_workers([w for w in self.decode_pool if w is not p.decode])
            incoming = incoming or {}
            room = [w for w in others if w.outstanding + incoming.get(w, 0) < self.decode_admission.limit]
            return self.decode_policy.choose(p.request, room or others).worker

    def moved(self, p: Placement, target: WorkerRef) -> None:
        """The request's decode worker handed it to `target` with its KV: its load there from now on."""
        with self._lock:
            p.moving_to = None
            if not p.decode_pending:  # it ended meanwhile, and gave back its load on the old one
                return
            blocks = p.request.num_blocks_with_output
            p.decode.outstanding -= 1
            p.decode.active_blocks -= blocks
            target.outstanding += 1
            target.active_blocks += blocks
            p.decode = target
            p.depends_on = [target]
            self.stats.moved += 1

    def retry_after_s(self) -> float:
        return max(self.prefill_admission.retry_after_s(), self.decode_admission.retry_after_s())

    def snapshot_stats(self) -> dict[str, Any]:
        with self._lock:
            s = self.stats
            out = {k: v for k, v in vars(s).items() if k != "per_worker"}
            out["per_worker"] = dict(s.per_worker)
        decode = [w for w in self.decode_pool if w.healthy]
        prefill = [w for w in self.prefill_pool if w.healthy] or decode
        out.update(prefill_policy=self.settings.prefill_policy, decode_policy=self.settings.decode_policy,
                   prefix_index=self.settings.prefix_index,
                   short_prompt_tokens=prefill[0].short_prompt_tokens if prefill else 0,
                   long_chunk_tokens=prefill[0].chunk_tokens if prefill else 0,
                   local_prefill_tokens=self.local_prefill_limit(decode[0]) if decode and self.mode != "colocated" else 0,
                   transfer_cost={"x0_s": self.transfer.x0, "x1_s_per_token": self.transfer.x1})
        return out


def _preferring(workers: list[WorkerRef], avoid: list[WorkerRef]) -> list[WorkerRef]:
    """`workers` other than those in `avoid`, or all of them when no other is left."""
    return [w for w in workers if w not in avoid] or workers
