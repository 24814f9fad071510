"""The cluster's Prometheus metrics, served by the router (`GET /metrics` on its HTTP server).

One registry, three sources:
- the router's records of every request: TTFT, TPOT and end-to-end latency histograms, outcomes by
  API and status code, prompt, cached and generated tokens, and each placement decision per policy;
- its view of the pools, read at scrape time: queue depth and running requests per worker, health,
  KV blocks used/free/cached and prefix-cache lookups and hits (from each worker's last health report);
- each worker's own registry (KV transfers: bytes, durations and outcomes per transport and codec),
  whose text exposition arrives with its health report and is re-exported here with `pool` and
  `worker` labels, so one scrape of the router sees the whole cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.workers import WorkerRef

if TYPE_CHECKING:
    from pdserve.router.routing import Placement, Router

# vLLM's buckets, so dashboards made for it read these too.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Router accept to first token at the router",
                              ["api"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds",
                              "Mean time between output tokens of a completed request (after the first)",
                              ["api"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Router accept to last token, completed requests",
                             ["api"], buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter("pdserve_requests", "Requests ended, by API and gRPC status code name (OK: completed)",
                                ["api", "code"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of requests past their prompt pass, "
                                     "by prefilling worker",
                                     ["worker"], registry=r)
        self.cached_tokens = Counter("pdserve_prompt_cached_tokens",
                                     "Prompt tokens served from a prefix cache, by prefilling worker", ["worker"],
                                     registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Output tokens streamed to clients", ["api"],
                                         registry=r)
        self.decisions = Counter("pdserve_router_decisions",
                                 "Workers chosen, per pool and policy (every request has one decode-pool choice); "
                                 "placement: disaggregated (prefill pool, then a KV transfer), local (prefilled on "
                                 "its decode worker) or colocated",
                                 ["pool", "policy", "worker", "placement"], registry=r)
        self.retries = Counter("pdserve_request_retries", "Attempts started again after a request lost a worker; "
                               "phase: prefill (before its first token: placed afresh) or decode (resumed on a "
                               "decode worker from the tokens already streamed)", ["phase"], registry=r)
        self.draft_tokens = Counter("pdserve_spec_draft_tokens", "Speculative decoding: draft tokens verified, by "
                                    "decode worker (counted when a request ends)", ["worker"], registry=r)
        self.accepted_draft_tokens = Counter("pdserve_spec_accepted_draft_tokens", "Speculative decoding: draft "
                                             "tokens accepted, by decode worker (counted when a request ends)",
                                             ["worker"], registry=r)
        r.register(_PoolCollector(router))

    def routed(self, placement: Placement) -> None:
        """Count each choice a policy made: the decode (or colocated) worker, and the prefill worker
        when the prompt goes to the prefill pool."""
        router = self.router
        prefill_policy, decode_policy = router.settings.prefill_policy, router.settings.decode_policy
        if router.mode == "colocated":  # one worker does both phases; the prefill policy chose it
            self.decisions.labels("decode", prefill_policy, placement.decode.name, "colocated").inc()
            return
        kind = "local" if placement.local else "disaggregated"
        self.decisions.labels("decode", decode_policy, placement.decode.name, kind).inc()
        if not placement.local:
            self.decisions.labels("prefill", prefill_policy, placement.prefiller.name, kind).inc()

    def retried(self, phase: str) -> None:
        self.retries.labels(phase).inc()

    def speculated(self, worker: str, draft_tokens: int, accepted_draft_tokens: int) -> None:
        self.draft_tokens.labels(worker).inc(draft_tokens)
        self.accepted_draft_tokens.labels(worker).inc(accepted_draft_tokens)

    def prompt_served(self, worker: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.labels(worker).inc(prompt_tokens)
        self.cached_tokens.labels(worker).inc(cached_tokens)

    def ended(self, api: str, code: str, output_tokens: int = 0, ttft_s: float | None = None,
              e2e_s: float | None = None) -> None:
        """A request ended; latencies are observed for completed ones (code OK) only."""
        self.requests.labels(api, code).inc()
        if output_tokens:
            self.generation_tokens.labels(api).inc(output_tokens)
        if code != "OK" or ttft_s is None or e2e_s is None:
            return
        self.ttft.labels(api).observe(ttft_s)
        self.e2e.labels(api).observe(e2e_s)
        if output_tokens > 1:
            self.tpot.labels(api).observe((e2e_s - ttft_s) / (output_tokens - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector:
    """The pools as the router sees them at scrape time, and every worker's own exported figures."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        workers = self.router.prefill_pool + self.router.decode_pool
        labels = ["pool", "worker"]
        queue = GaugeMetricFamily("pdserve_queue_depth", "Prompts placed on a worker and not yet past their "
                                  "first token (the router's own count)", labels=labels)
        running = GaugeMetricFamily("pdserve_running_requests", "Requests in the worker's engine (last report)",
                                    labels=labels)
        healthy = GaugeMetricFamily("pdserve_worker_healthy", "1 while the worker takes requests", labels=labels)
        blocks = GaugeMetricFamily("pdserve_kv_blocks", "KV blocks per worker: used (held by requests), free "
                                   "(allocatable, evictable cached blocks included), cached (holding a prefix)",
                                   labels=labels + ["state"])
        queried = CounterMetricFamily("pdserve_prefix_cache_queried_blocks", "Prompt blocks looked up in the "
                                      "worker's prefix cache", labels=labels)
        hits = CounterMetricFamily("pdserve_prefix_cache_hit_blocks", "Prompt blocks found in the worker's prefix "
                                   "cache", labels=labels)
        hit_rate = GaugeMetricFamily("pdserve_prefix_cache_hit_rate", "Hit blocks / queried blocks since the worker "
                                     "started", labels=labels)
        received = CounterMetricFamily("pdserve_kv_receiver_events", "The receiving side of KV transfers: frames "
                                       "taken, corrupt frames dropped, requests recomputed, bytes, cached blocks "
                                       "not sent", labels=labels + ["event"])
        for w in workers:
            s, key = w.status, [w.pool, w.name]
            queue.add_metric(key, len(w.queued))
            healthy.add_metric(key, 1.0 if w.healthy else 0.0)
            if s is None:  # no report yet
                continue
            running.add_metric(key, s.requests)
            kv = s.kv
            blocks.add_metric(key + ["used"], kv.held_blocks)
            blocks.add_metric(key + ["free"], kv.free_blocks)
            blocks.add_metric(key + ["cached"], kv.cached_blocks)
            q, h = kv.prefix_queried_blocks, kv.prefix_hit_blocks
            queried.add_metric(key, q)
            hits.add_metric(key, h)
            hit_rate.add_metric(key, h / q if q else 0.0)
            for event, value in s.receiver_counts.items():
                received.add_metric(key + [event], value)
        yield from (queue, running, healthy, blocks, queried, hits, hit_rate, received)
        yield from federate(workers)


def federate(workers: Iterable[WorkerRef]) -> Iterable[Metric]:
    """Every worker's exposition (`status.metrics`, as of its last health report: at most one
    supervisor round old), merged into one family per name, each sample labelled with its worker."""
    families: dict[str, Metric] = {}
    for w in workers:
        text = w.status.metrics if w.status is not None else ""
        if not text:
            continue
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):  # the parser's reading of a counter's start time: not a figure
                continue
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "pool": w.pool, "worker": w.name}, s.value, s.timestamp,
                                  s.exemplar)
    return families.values()
