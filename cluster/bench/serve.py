"""`pdserve bench serve`: open-loop serving benchmark; SLO attainment and goodput per configuration.

Each configuration is started by the benchmark, measured, and stopped, one at a time on this machine:

  disaggregated       deploy/local.yaml: 1 prefill + 1 decode worker, 1 thread each
  colocated-chunked   2 colocated workers, max_num_batched_tokens 256 (Sarathi-style chunked prefill)
  colocated           2 colocated workers, max_num_batched_tokens = max_model_len (prompts not chunked)
  transformers-serve  `transformers serve --continuous-batching`, torch on 2 threads (the same cores),
                      the KV memory and step token budget of one pdserve engine
  disaggregated-1p2d  1 prefill + 2 decode workers sharing the 2 cores (not in the default set)
  disaggregated-http  the disaggregated deployment driven over its OpenAI-compatible HTTP API instead of
                      gRPC (not in the default set): side by side with `disaggregated`, the HTTP layer's cost

Every pdserve configuration is also scraped (its Prometheus /metrics) before and after each run, and
the scrape's counts are checked against the run's own records (`metrics_check`).

Workload: Azure conversation trace lengths scaled to the model (prompts x input_scale, outputs x
output_scale, clipped to max_model_len), random prompts that tokenize back to themselves (so the
text-only baseline gets the same tokens), greedy, exactly the trace's output length (EOS ignored).
Every run draws prompts of its own (the warm-up, the calibration and each rate too; the same ones at a
given rate in every configuration), so no run is served from a prefix cache an earlier one filled;
each run's share of prompt tokens served from cache, from /metrics, says so.
Arrivals are Poisson at the searched rate, or the trace's own timestamps scaled to that rate.

Objectives: a few requests one at a time on the disaggregated configuration give the idle TTFT and
TPOT; the tight pair is (2 x idle p90 TTFT, 1.5 x idle TPOT), the loose one (5 x, 3 x). Goodput is
the highest rate at which >= 90% of sent requests meet both (serve_metrics.GoodputSearch).

The load generator runs in a separate process: pdserve's router lives in this process, and a client
sharing its interpreter would tax the router alone, not the baseline's server.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import platform
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from pdserve.cluster.bench.loadgen import (
    GrpcClient,
    OpenAIClient,
    Request,
    StreamClient,
    poisson_arrivals,
    run_load,
    run_sequential,
    trace_arrivals,
    write_jsonl,
)
from pdserve.cluster.bench.report import SMOKE_CAVEAT, plot_record, provenance
from pdserve.cluster.bench.serve_metrics import (
    Goodput,
    GoodputSearch,
    Objective,
    RequestRecord,
    attainment,
    percentile,
    rate_key,
    summarize,
    summarize_runs,
)
from pdserve.cluster.bench.workload import (DEFAULT_TRACE, TraceRequest, check_azure_trace, find_trace,
                                            load_azure_trace, run_seed, scale_requests)

DEFAULT_CONFIGS = ("disaggregated", "colocated-chunked", "colocated", "transformers-serve")
CONFIGS = DEFAULT_CONFIGS + ("disaggregated-1p2d", "disaggregated-http")  # on request: a rebalanced split; HTTP
DESCRIPTIONS = {
    "disaggregated": "deploy/local.yaml: 1 prefill + 1 decode worker, 1 thread each",
    "disaggregated-1p2d": "1 prefill + 2 decode workers, 1 thread each, sharing the 2 cores (the decode pool "
                          "is the bottleneck of the 1 + 1 split)",
    "disaggregated-http": "deploy/local.yaml as `disaggregated`, driven over the OpenAI-compatible HTTP API "
                          "(/v1/completions, SSE) instead of gRPC",
    "colocated-chunked": "colocated, 2 workers (1 + 1 replicas), 1 thread each, max_num_batched_tokens 256",
    "colocated": "colocated, 2 workers (1 + 1 replicas), 1 thread each, max_num_batched_tokens = max_model_len",
    "transformers-serve": "transformers serve --continuous-batching, 1 process, torch threads {threads}; "
                          "KV cache and step budget of one pdserve engine",
}
# How each configuration's stream times its tokens (ITL is measured between these events).
STREAMING = {
    "transformers-serve": "one SSE event per decoded text piece (a token that decodes to no text yet sends none): "
                          "ITL is per event; TPOT uses the server's own token count",
    "disaggregated-http": "one SSE event per engine step of the request (one token each), as gRPC sends one message",
}
CHUNKED_BUDGET = 256
# A workload whose median prompt is this long or longer gets a section of its own on the docs page: which
# deployment carries more flips with prompt length, so the short- and long-prompt tables stand side by side.
LONG_PROMPTS_FROM = 400
LOOP_KEYS = ("wall_s", "forward_s", "kv_s", "other_s")


@dataclass
class ServeBenchConfig:
    model: str = "llama-20m"
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    requests_per_rate: int = 64
    start_rate: float | None = None  # None: one request per idle e2e latency
    min_rate: float = 0.05
    max_rate: float = 64.0
    rel_tol: float = 0.1
    max_runs: int = 10  # per configuration, over all objective pairs
    seed: int = 0
    trace: str = DEFAULT_TRACE
    trace_arrivals: bool = False
    input_scale: float = 0.25
    output_scale: float = 0.25
    max_output: int | None = None
    max_model_len: int = 1024
    calibration_requests: int = 8
    tight: tuple[float, float] | None = None  # (ttft_s, tpot_s); None: from calibration
    loose: tuple[float, float] | None = None
    cdf_rate: float | None = None  # None: the highest rate every configuration measured
    timeout_s: float = 300.0
    baseline_threads: int = 2  # transformers serve's torch threads: the cores pdserve's two workers get
    out_dir: Path = Path("bench-results/serve")
    progress: bool = True
    smoke: bool = False  # a --quick run: its figures are marked as no measurement

    def quick(self) -> "ServeBenchConfig":
        """A smoke run: few short requests, two runs per configuration."""
        return replace(self, requests_per_rate=6, calibration_requests=3, max_runs=2, max_output=8, rel_tol=0.5,
                       smoke=True)


# --- workload -------------------------------------------------------------------------------------
def roundtrip_prompt(tokenizer: Any, n: int, rng: random.Random, attempts: int = 20) -> list[int]:
    """`n` random token ids whose decoded text tokenizes back to exactly them.

    Random ids rarely survive decode/encode (the tokenizer merges them differently); re-encoding once
    and cutting to `n` almost always gives a fixed point. A server that takes text then sees the
    very prompt pdserve gets as ids.
    """
    vocab = len(tokenizer)
    for _ in range(attempts):
        ids = tokenizer(tokenizer.decode([rng.randrange(3, vocab) for _ in range(n)]))["input_ids"][:n]
        if len(ids) == n and tokenizer(tokenizer.decode(ids))["input_ids"] == ids:
            return ids
    raise RuntimeError(f"no prompt of {n} tokens survived decode/encode in {attempts} attempts")


@dataclass
class ServeWorkload:
    """The trace's request shapes; every run draws token contents of its own (`requests(tag)`), so
    none is served from a prefix cache that an earlier run, the warm-up or the calibration filled."""

    path: Path
    shapes: list[TraceRequest]
    tokenizer: Any
    seed: int

    def requests(self, tag: str, n: int | None = None) -> list[Request]:
        """The first `n` shapes (all: None) with prompts drawn for run `tag` (the same tag, the same prompts)."""
        rng = random.Random(run_seed(self.seed, "serve", tag))
        requests = []
        for i, shape in enumerate(self.shapes[:n]):
            ids = roundtrip_prompt(self.tokenizer, shape.prompt_len, rng)
            requests.append(Request(f"{tag}-{i}", ids, shape.output_len, text=self.tokenizer.decode(ids)))
        return requests


def build_workload(cfg: ServeBenchConfig, tokenizer: Any) -> ServeWorkload:
    check_azure_trace(cfg.trace)
    path = find_trace(cfg.trace)
    shapes = scale_requests(load_azure_trace(path, cfg.requests_per_rate), cfg.input_scale, cfg.output_scale,
                            cfg.max_model_len, cfg.max_output)
    return ServeWorkload(path, shapes, tokenizer, cfg.seed)


def arrivals_for(cfg: ServeBenchConfig, shapes: list[TraceRequest], rate: float) -> list[float]:
    if not cfg.trace_arrivals:
        return poisson_arrivals(len(shapes), rate, cfg.seed)
    # Replay the trace's gaps, sped up so that its mean rate is `rate`: burstiness is kept.
    span = shapes[-1].arrival_s - shapes[0].arrival_s
    if len(shapes) > 1 and span <= 0:
        raise ValueError(f"the trace's {len(shapes)} requests all arrive at once: no rate to scale its gaps to "
                         f"(leave out --trace-arrivals for Poisson arrivals)")
    trace_rate = (len(shapes) - 1) / span if span > 0 else rate
    return trace_arrivals([s.arrival_s for s in shapes], speedup=rate / trace_rate)


# --- configurations -------------------------------------------------------------------------------
def manifest_for(name: str, cfg: ServeBenchConfig) -> dict[str, Any]:
    from pdserve.cluster.manifest import DEFAULT_MANIFEST

    data = yaml.safe_load(DEFAULT_MANIFEST.read_text())
    # Workers measure their own prompt passes: a stored profile (the simulator's input, which the
    # simulator benchmark compares against these runs) must not stand in for what is measured here.
    data.update(model=cfg.model, max_model_len=cfg.max_model_len, profile="measure")
    data["server"].update(address="127.0.0.1:0", http_address="127.0.0.1:0")
    if name == "disaggregated-1p2d":  # threads need not match cores: the prefill worker is mostly idle
        data["pools"]["prefill"].update(num_cpus=0.5)
        data["pools"]["decode"].update(replicas=2, num_cpus=0.75)
    elif not name.startswith("disaggregated"):
        data["mode"] = "colocated"
        for pool in ("prefill", "decode"):
            data["pools"][pool].update(replicas=1, threads=1)
        data["max_num_batched_tokens"] = CHUNKED_BUDGET if name == "colocated-chunked" else cfg.max_model_len
    return data


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    """K and V of every layer for one token (float32 by default, as the manifest's dtype); a
    vision-language model's are its language model's."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir).get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * dtype_bytes


@dataclass
class Target:
    """A running configuration: how to reach it and, for pdserve, its workers' cumulative counters."""

    client: StreamClient
    worker_stats: Callable[[], dict[str, dict]] | None = None
    api: str = ""  # the pdserve API the client speaks (the `api` label of its metrics)
    metrics_url: str | None = None  # pdserve's Prometheus endpoint
    kv_transfers: bool = True  # pdserve moves KV between workers (disaggregated): its metrics have those families
    grpc_client: StreamClient | None = None  # for an HTTP target: the same cluster over gRPC (idle comparison)


@contextmanager
def serving(name: str, cfg: ServeBenchConfig, model_dir: Path, log: Callable[[str], None]) -> Iterator[Target]:
    """Start configuration `name`, yield a Target, stop it on every path."""
    from pdserve.cluster.launcher import Cluster
    from pdserve.cluster.manifest import load_manifest

    if name == "transformers-serve":
        from pdserve.cluster.bench.serve_baselines import TransformersServe

        # One pdserve engine's KV memory and step budget (the default manifest's), so that neither a
        # bigger cache nor a bigger batch decides the comparison.
        m = load_manifest(manifest_for("disaggregated", cfg))
        kv_tokens = m.kv_memory_mb * 2**20 // kv_bytes_per_token(model_dir)
        with TransformersServe(model_dir, threads=cfg.baseline_threads, kv_cache_tokens=kv_tokens,
                               max_batch_tokens=m.max_num_batched_tokens,
                               log_path=cfg.out_dir / "transformers-serve.log", log=log) as server:
            yield Target(OpenAIClient(server.base_url, model=str(model_dir), timeout=cfg.timeout_s,
                                      extra_body=server.request_fields()))
        return
    with Cluster(load_manifest(manifest_for(name, cfg)), log=lambda s: log(f"  {s}")) as cluster:
        metrics_url = f"http://{cluster.http_address}/metrics"
        if name == "disaggregated-http":
            client = OpenAIClient(f"http://{cluster.http_address}", model=cluster.manifest.served_name,
                                  timeout=cfg.timeout_s,
                                  extra_body={"ignore_eos": True, "stream_options": {"include_usage": True}},
                                  prompt_ids=True, event_per_token=True)
            yield Target(client, cluster.worker_stats, "http", metrics_url,
                         grpc_client=GrpcClient(cluster.address, timeout=cfg.timeout_s))
        else:
            yield Target(GrpcClient(cluster.address, timeout=cfg.timeout_s), cluster.worker_stats, "grpc", metrics_url,
                         kv_transfers=cluster.manifest.mode == "disaggregated")


def loop_split(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Each worker's engine-loop time over a run (differences of cumulative counters) and its shares."""
    out = {}
    for worker, stats in after.items():
        prev = before.get(worker, {}).get("loop", {})
        d = {k: stats["loop"][k] - prev.get(k, 0.0) for k in LOOP_KEYS}
        wall = d["wall_s"]
        shares = {f"{k[:-2]}_share": d[k] / wall if wall > 0 else None for k in LOOP_KEYS[1:]}
        busy = (d["forward_s"] + d["kv_s"] + d["other_s"]) / wall if wall > 0 else None
        out[worker] = {**d, **shares, "busy": busy, "peak_rss_bytes": stats.get("peak_rss_bytes")}
    return out


# --- the metrics endpoint ------------------------------------------------------------------------
METRICS_SETTLE_S = 1.5  # > two supervisor rounds: every worker's figures are in the router's view
# Families the endpoint must export (issue 13's list), by the name prometheus-client's parser gives them.
METRIC_FAMILIES = (
    "pdserve_time_to_first_token_seconds", "pdserve_time_per_output_token_seconds",
    "pdserve_e2e_request_latency_seconds", "pdserve_queue_depth", "pdserve_running_requests", "pdserve_kv_blocks",
    "pdserve_prefix_cache_hit_rate", "pdserve_prompt_cached_tokens", "pdserve_kv_transfer_bytes",
    "pdserve_kv_transfer_duration_seconds", "pdserve_kv_transfers", "pdserve_router_decisions", "pdserve_requests",
)
# Exported by prefill workers' KV senders: a colocated cluster, which has none, has none of these.
KV_TRANSFER_FAMILIES = ("pdserve_kv_transfer_bytes", "pdserve_kv_transfer_duration_seconds", "pdserve_kv_transfers")


@dataclass
class Scrape:
    """One scrape of a Prometheus endpoint, parsed by prometheus-client's own parser."""

    families: set[str]  # every family exported, with samples or not yet
    samples: dict[tuple[str, tuple], float]  # by (sample name, sorted labels)

    def total(self, sample: str, **labels: str) -> float:
        """The sum of `sample` over the series whose labels include `labels`."""
        return sum(v for (name, lbls), v in self.samples.items()
                   if name == sample and all(dict(lbls).get(k) == x for k, x in labels.items()))


def scrape_metrics(url: str) -> Scrape:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as resp:
        families = list(text_string_to_metric_families(resp.read().decode()))
    return Scrape({f.name for f in families},
                  {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples})


def metrics_check(before: Scrape, after: Scrape, recs: list[RequestRecord], api: str,
                  kv_transfers: bool = True) -> dict[str, Any]:
    """The scrape's counts over a run (after - before) against the run's own records, and the families
    missing from it (the KV transfer ones expected only with `kv_transfers`)."""

    def delta(sample: str, **labels: str) -> float:
        return after.total(sample, **labels) - before.total(sample, **labels)

    ok = sum(r.outcome == "ok" for r in recs)
    pairs = {  # figure: (from /metrics, from the records)
        "completed": (delta("pdserve_requests_total", api=api, code="OK"), ok),
        "rejected": (delta("pdserve_requests_total", api=api, code="RESOURCE_EXHAUSTED"),
                     sum(r.outcome == "rejected" for r in recs)),
        "ttft_observations": (delta("pdserve_time_to_first_token_seconds_count", api=api), ok),
        "output_tokens": (delta("pdserve_generation_tokens_total", api=api), sum(r.output_tokens for r in recs)),
        "routed": (delta("pdserve_router_decisions_total", pool="decode"), sum(r.outcome != "rejected" for r in recs)),
    }
    expected = [f for f in METRIC_FAMILIES if kv_transfers or f not in KV_TRANSFER_FAMILIES]
    missing = [f for f in expected if f not in after.families]
    mismatches = {k: v for k, v in pairs.items() if v[0] != v[1]}
    # Reported, not compared: a request that ends on its first token is placed for a transfer but never makes one.
    transfers = {"kv_transfers_ended": delta("pdserve_kv_transfers_total"),
                 "disaggregated_placements": delta("pdserve_router_decisions_total", pool="prefill")}
    prompt_tokens = delta("pdserve_prompt_tokens_total")
    cached = delta("pdserve_prompt_cached_tokens_total") / prompt_tokens if prompt_tokens else None
    return {"figures": {k: {"metrics": v[0], "records": v[1]} for k, v in pairs.items()}, "transfers": transfers,
            "cached_prompt_share": cached,
            "missing_families": missing, "mismatches": mismatches, "consistent": not missing and not mismatches}


# --- measurement ----------------------------------------------------------------------------------
@dataclass
class ConfigResult:
    name: str
    runs: dict[float, list[RequestRecord]] = field(default_factory=dict)
    loops: dict[float, dict[str, dict]] = field(default_factory=dict)
    metrics_checks: dict[float, dict[str, Any]] = field(default_factory=dict)  # /metrics against the records
    idle_apis: dict[str, Any] | None = None  # gRPC and HTTP one request at a time on one cluster (HTTP target)
    load_avg: dict[float, tuple[float, float]] = field(default_factory=dict)  # 1-min load, run start and end
    goodput: list[Goodput] = field(default_factory=list)
    error: str | None = None


def calibrate(cfg: ServeBenchConfig, pool: concurrent.futures.Executor, target: Target, requests: list[Request],
              log: Callable[[str], None]) -> dict[str, float]:
    """Idle latencies: requests one at a time (after the warm-up); TPOT at batch 1 is the idle step."""
    recs = pool.submit(run_sequential, target.client, requests[:cfg.calibration_requests],
                       config="calibration").result()
    bad = [r for r in recs if r.outcome != "ok"]
    if bad:
        raise RuntimeError(f"calibration request failed: {bad[0].error}")
    ttft = [r.ttft for r in recs]
    tpot = [r.tpot for r in recs if r.tpot is not None]
    e2e = [r.e2e for r in recs]
    out = {"requests": len(recs), "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
           "tpot_p50_s": percentile(tpot, 50), "e2e_mean_s": sum(e2e) / len(e2e)}
    log(f"idle: TTFT p50 {out['ttft_p50_s'] * 1e3:.1f} ms, p90 {out['ttft_p90_s'] * 1e3:.1f} ms; "
        f"TPOT p50 {out['tpot_p50_s'] * 1e3:.2f} ms (the idle decode step seen by a client); "
        f"e2e mean {out['e2e_mean_s'] * 1e3:.0f} ms")
    return out


IDLE_API_ROUNDS = 3


def idle_apis(cfg: ServeBenchConfig, pool: concurrent.futures.Executor, target: Target, workload: ServeWorkload,
              log: Callable[[str], None]) -> dict[str, Any]:
    """The HTTP layer's cost at idle: requests of the same shapes one at a time over gRPC and over HTTP
    on one cluster, in alternating rounds (so drift hits both), each round with prompts of its own;
    medians per API and their differences."""
    recs: dict[str, list[RequestRecord]] = {"grpc": [], "http": []}
    for round_ in range(IDLE_API_ROUNDS):
        for api, client in (("grpc", target.grpc_client), ("http", target.client)):
            batch = workload.requests(f"idle-{api}-{round_}", max(cfg.calibration_requests, 8))
            recs[api] += pool.submit(run_sequential, client, batch, config=f"idle-{api}").result()
    bad = [r for rs in recs.values() for r in rs if r.outcome != "ok"]
    if bad:
        raise RuntimeError(f"idle API comparison: a request failed: {bad[0].error}")
    out: dict[str, Any] = {"requests_per_api": len(recs["grpc"]), **api_medians(recs["grpc"], recs["http"])}
    t, tp = out["ttft_p50_s"], out["tpot_p50_s"]
    log(f"  idle, one request at a time ({out['requests_per_api']} per API): TTFT p50 gRPC {_ms(t['grpc'])}, HTTP "
        f"{_ms(t['http'])}; TPOT p50 gRPC {_ms(tp['grpc'])}, HTTP {_ms(tp['http'])}")
    return out


def objectives_from(cfg: ServeBenchConfig, idle: dict[str, float] | None) -> list[Objective]:
    tight = cfg.tight or (2 * idle["ttft_p90_s"], 1.5 * idle["tpot_p50_s"])
    loose = cfg.loose or (5 * idle["ttft_p90_s"], 3 * idle["tpot_p50_s"])
    return [Objective("tight", *tight), Objective("loose", *loose)]


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


WARM_BURST = 24  # requests sent at once after the sequential warm-up


def warm_up(pool: concurrent.futures.Executor, target: Target, requests: list[Request], name: str) -> None:
    # First requests pay one-off costs (connections, lazy initialisation, transformers serve's batching
    # manager: ~10 s, kernels for new shapes): the shortest, a middle and the longest prompt, not measured.
    by_len = sorted(requests, key=lambda r: len(r.token_ids))
    picks = [by_len[0], by_len[len(by_len) // 2], by_len[-1]]
    warm = [replace(r, request_id=f"{name}-warm-{i}", max_tokens=min(r.max_tokens, 4)) for i, r in enumerate(picks)]
    recs = pool.submit(run_sequential, target.client, warm, config=f"{name}-warmup").result()
    # Then a concurrent burst: the first large batches pay their own one-off costs, which otherwise
    # land on the search's first rate (its p90 TTFT was 4x the next runs').
    burst = [replace(r, request_id=f"{name}-warm-burst-{i}", max_tokens=min(r.max_tokens, 8))
             for i, r in enumerate(requests[:WARM_BURST])]
    recs += pool.submit(run_load, target.client, burst, [0.0] * len(burst), config=f"{name}-warmup", rate=0.0,
                        progress=False).result()
    if any(r.outcome != "ok" for r in recs):
        raise RuntimeError(f"{name}: warm-up failed: {next(r.error for r in recs if r.outcome != 'ok')}")


def bench_config(result: ConfigResult, cfg: ServeBenchConfig, model_dir: Path, workload: ServeWorkload,
                 pool: concurrent.futures.Executor, state: dict[str, Any], log: Callable[[str], None]) -> None:
    """Start a configuration, calibrate if none has, search goodput per objective pair, stop.

    Fills `result` as it goes, so the runs measured before a failure are kept.
    """
    name = result.name
    jsonl = cfg.out_dir / "requests.jsonl"
    with serving(name, cfg, model_dir, log) as target:
        warm_up(pool, target, workload.requests(f"warmup-{name}"), name)
        if state.get("objectives") is None:
            state["calibration"] = calibrate(cfg, pool, target, workload.requests("calibration", cfg.calibration_requests),
                                             log)
            state["objectives"] = objectives_from(cfg, state["calibration"])
            for o in state["objectives"]:
                log(f"objective {o.name}: TTFT <= {o.ttft_s * 1e3:.1f} ms and TPOT <= {o.tpot_s * 1e3:.2f} ms")
        if name not in cfg.configs:  # started only to calibrate
            return
        if target.grpc_client is not None:
            result.idle_apis = idle_apis(cfg, pool, target, workload, log)
        start_rate = cfg.start_rate or 1 / state["calibration"]["e2e_mean_s"]

        def measure(rate: float) -> list[RequestRecord]:
            # The same prompts at this rate in every configuration; none that an earlier run sent.
            reqs = [replace(r, request_id=f"{name}-{r.request_id}") for r in workload.requests(f"rate-{rate:g}")]
            before = target.worker_stats() if target.worker_stats else None
            scraped = None
            if target.metrics_url:  # after the previous run's worker figures have arrived
                time.sleep(METRICS_SETTLE_S)
                scraped = scrape_metrics(target.metrics_url)
            load_before = os.getloadavg()[0]
            recs = pool.submit(run_load, target.client, reqs, arrivals_for(cfg, workload.shapes, rate), config=name,
                               rate=rate, progress=cfg.progress).result()
            # The machine may be shared: a load above the cores in use says the figures are disturbed.
            result.load_avg[rate] = (load_before, os.getloadavg()[0])
            if target.worker_stats:
                result.loops[rate] = loop_split(before, target.worker_stats())
            if scraped is not None:
                time.sleep(METRICS_SETTLE_S)  # workers' figures arrive with their next health reports
                check = result.metrics_checks[rate] = metrics_check(scraped, scrape_metrics(target.metrics_url),
                                                                    recs, target.api, target.kv_transfers)
                cached = check["cached_prompt_share"]
                log(f"  prompt tokens served from a prefix cache: {'n/a' if cached is None else f'{cached:.1%}'}")
                if not check["consistent"]:
                    log(f"  /metrics disagrees with the run's records: missing families {check['missing_families']}, "
                        f"(/metrics, records) differing {check['mismatches']}")
            write_jsonl(recs, jsonl)
            s = summarize(recs)
            short = sum(r.outcome == "ok" and r.output_tokens != r.max_tokens for r in recs)
            log(f"  {name} @ {rate:g} req/s: ok {s['ok']}/{s['sent']} (rejected {s['rejected']}, errors "
                f"{s['errors']}{f', {short} short answers' if short else ''}), TTFT p50 {_ms(s['ttft_s']['p50'])} "
                f"p90 {_ms(s['ttft_s']['p90'])}, TPOT p50 {_ms(s['tpot_s']['p50'])} p90 {_ms(s['tpot_s']['p90'])}, "
                f"{s['output_tokens_per_s']:.0f} tok/s")
            return recs

        search = GoodputSearch(measure, start_rate, min_rate=cfg.min_rate, max_rate=cfg.max_rate,
                               rel_tol=cfg.rel_tol, max_runs=cfg.max_runs)
        result.runs = search.runs  # the same dict, filled as runs are measured
        for objective in state["objectives"]:
            g = search.goodput(objective)
            result.goodput.append(g)
            log(f"  {name}: goodput ({objective.name}) {g.rate:g} req/s"
                f"{'' if g.failed_rate is None else f' (missed at {g.failed_rate:g})'}"
                f"{f' [{g.note}]' if g.note else ''}")
        if cfg.cdf_rate:
            search.records(cfg.cdf_rate)  # the CDF plot's rate, measured in every configuration


# --- report ---------------------------------------------------------------------------------------
def software() -> dict[str, Any]:
    """The software a benchmark ran on, and the machine's load at its end (whether it was shared)."""
    import torch
    import transformers

    return {"platform": platform.platform(), "load_avg_1m_at_end": os.getloadavg()[0],
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None  # None: the denominator config had no goodput


def assemble(cfg: ServeBenchConfig, state: dict[str, Any], results: list[ConfigResult], model_dir: Path,
             workload: ServeWorkload, cdf_rate: float | None) -> dict[str, Any]:
    objectives = state["objectives"]
    goodput = {r.name: {g.objective.name: g.rate for g in r.goodput} for r in results if not r.error}
    ratios = {o.name: {f"disaggregated/{other}": _ratio(goodput.get("disaggregated", {}).get(o.name),
                                                          goodput.get(other, {}).get(o.name))
                       for other in ("colocated-chunked", "transformers-serve")}
              for o in objectives}
    prompt_lens = [s.prompt_len for s in workload.shapes]
    output_lens = [s.output_len for s in workload.shapes]
    return {
        "benchmark": "serve-long-prompts" if percentile(prompt_lens, 50) >= LONG_PROMPTS_FROM else "serve",
        "provenance": provenance(cfg.smoke),
        "software": software(),
        "model": {"name": cfg.model, "dir": str(model_dir), "max_model_len": cfg.max_model_len},
        "workload": {
            "trace": str(workload.path), "requests_per_rate": len(workload.shapes), "input_scale": cfg.input_scale,
            "output_scale": cfg.output_scale, "max_output": cfg.max_output,
            "arrivals": "trace timestamps, scaled to the rate" if cfg.trace_arrivals else "poisson",
            "seed": cfg.seed, "sampling": "greedy, EOS ignored (exactly max_tokens)",
            "tokens": "fresh per run (warm-up, calibration and each rate; seeded by run, the same at a rate in "
                      "every configuration)",
            "prompt_len": {"mean": sum(prompt_lens) / len(prompt_lens), "p50": percentile(prompt_lens, 50),
                           "max": max(prompt_lens)},
            "output_len": {"mean": sum(output_lens) / len(output_lens), "p50": percentile(output_lens, 50),
                           "max": max(output_lens)},
        },
        "search": {"start_rate": cfg.start_rate, "min_rate": cfg.min_rate, "max_rate": cfg.max_rate,
                   "rel_tol": cfg.rel_tol, "max_runs_per_config": cfg.max_runs, "target_attainment": 0.9},
        "calibration": state.get("calibration"),
        "objectives": [asdict(o) for o in objectives],
        "configs": {
            r.name: {
                "description": DESCRIPTIONS[r.name].format(threads=cfg.baseline_threads), "error": r.error,
                "streaming": STREAMING.get(r.name, "gRPC stream: every message's tokens stamped on arrival"),
                "goodput": {g.objective.name: {"rate": g.rate, "failed_rate": g.failed_rate,
                                               "attainment": g.attainment, "converged": g.converged,
                                               "note": g.note} for g in r.goodput},
                "idle_apis": r.idle_apis,
                "runs": [{**run, "load_avg_1m": r.load_avg.get(run["rate"]), "worker_loop": r.loops.get(run["rate"]),
                          "metrics_check": r.metrics_checks.get(run["rate"])}
                         for run in summarize_runs(r.runs.items(), objectives)],
            }
            for r in results
        },
        "goodput_ratios": ratios,
        "cdf_rate": cdf_rate,
        "http_vs_grpc": http_cost(results),
    }


def http_cost(results: list[ConfigResult]) -> dict[str, dict] | None:
    """The HTTP layer's cost: at every rate both `disaggregated` (gRPC) and `disaggregated-http` ran,
    the medians of TTFT (per request), TPOT (per token) and e2e over each, and their differences."""
    by_name = {r.name: r for r in results}
    grpc, http = by_name.get("disaggregated"), by_name.get("disaggregated-http")
    if grpc is None or http is None:
        return None
    return {f"{rate:g}": api_medians(grpc.runs[rate], http.runs[rate]) for rate in sorted(set(grpc.runs) & set(http.runs))}


def api_medians(grpc: list[RequestRecord], http: list[RequestRecord]) -> dict[str, dict]:
    """Median TTFT, TPOT and e2e of the completed requests over each API, and HTTP's excess."""
    out = {}
    for metric in ("ttft", "tpot", "e2e"):
        g, h = (percentile([getattr(r, metric) for r in recs if r.outcome == "ok" and getattr(r, metric) is not None],
                           50) for recs in (grpc, http))
        out[f"{metric}_p50_s"] = {"grpc": g, "http": h, "http_minus_grpc": None if g is None or h is None else h - g}
    return out


def plot(results: list[ConfigResult], objectives: list[Objective], cdf_rate: float | None, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    done = [r for r in results if r.runs]
    paths = []
    fig, axes = plt.subplots(1, len(objectives), figsize=(5.5 * len(objectives), 4), squeeze=False)
    for ax, o in zip(axes[0], objectives):
        for r in done:
            rates = sorted(r.runs)
            ax.plot(rates, [attainment(r.runs[x], o) for x in rates], marker="o", label=r.name)
        ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
        ax.set(xscale="log", xlabel="request rate (req/s)", ylabel="SLO attainment", ylim=(-0.02, 1.02),
               title=f"{o.name}: TTFT <= {o.ttft_s * 1e3:.0f} ms, TPOT <= {o.tpot_s * 1e3:.1f} ms")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(ScalarFormatter())
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "attainment.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    if cdf_rate is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for r in done:
            ok = [x for x in r.runs[cdf_rate] if x.outcome == "ok"]
            for ax, values in zip(axes, ([x.ttft for x in ok], [x.tpot for x in ok if x.tpot is not None])):
                xs = sorted(v * 1e3 for v in values)
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=r.name)
        for ax, metric in zip(axes, ("TTFT", "TPOT")):
            # Log scale: configurations can differ by orders of magnitude.
            ax.set(xscale="log", xlabel=f"{metric} (ms)", ylabel="fraction of completed requests",
                   title=f"{metric} at {cdf_rate:g} req/s")
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "latency_cdf.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


# --- the docs' section ----------------------------------------------------------------------------
def _goodput_cell(g: dict[str, Any]) -> str:
    """A goodput as the docs show it: the rate, the bracket when the search ran out, why it stopped."""
    if not g["rate"]:  # the note would say the same: missed even at the lowest rate
        return "0" if g["failed_rate"] is None else f"0 (missed at {g['failed_rate']:.2f})"
    cell = f"{g['rate']:.2f}"
    if g["failed_rate"] is not None and not g["converged"]:
        cell += f" (missed at {g['failed_rate']:.2f})"
    return cell + (f"; {g['note']}" if g["note"] else "")


def _loops_busy(loops: dict[str, dict]) -> str:
    """Each worker's engine-loop busy share of a run, and how much of that the forward pass took."""
    return ", ".join(f"{worker} {loop['busy']:.2f} ({loop['forward_share'] / loop['busy']:.0%} of it the forward pass)"
                     if loop["busy"] else f"{worker} idle" for worker, loop in sorted(loops.items()))


def markdown(results: dict[str, Any]) -> str:
    """The serve benchmark's section of docs/benchmarks.md: the workload, the objectives, each
    deployment's goodput per objective and its latencies at the rate every deployment ran, the ratios."""
    w, objectives, cdf = results["workload"], results["objectives"], results["cdf_rate"]
    p, o = w["prompt_len"], w["output_len"]
    cached = [run["metrics_check"]["cached_prompt_share"] for c in results["configs"].values() for run in c["runs"]
              if run.get("metrics_check") and run["metrics_check"].get("cached_prompt_share") is not None]
    lines = [
        f"{results['model']['name']} (max_model_len {results['model']['max_model_len']}); "
        f"{w['requests_per_rate']} requests per rate from {Path(w['trace']).name}, lengths x {w['input_scale']:g} "
        f"(prompts) and x {w['output_scale']:g} (outputs): prompts mean {p['mean']:.0f} tokens (p50 {p['p50']:.0f}, "
        f"max {p['max']}), outputs mean {o['mean']:.0f} (max {o['max']}); {w['arrivals']} arrivals; {w['sampling']}. "
        f"Prompts drawn afresh for every run"
        + (f" (the most any run served from a prefix cache: {max(cached):.1%} of its prompt tokens)." if cached else "."),
        "",
        "Objectives: " + "; ".join(f"**{x['name']}** TTFT ≤ {x['ttft_s'] * 1e3:.0f} ms and TPOT ≤ "
                                    f"{x['tpot_s'] * 1e3:.1f} ms" for x in objectives)
        + ". Goodput: the highest rate measured at which at least 90% of the requests sent met both.",
        "",
    ]
    at = f" at {cdf:g} req/s" if cdf is not None else ""
    header = ["deployment", *(f"goodput, {x['name']} (req/s)" for x in objectives), f"TTFT p50 / p90{at}",
              f"TPOT p50 / p90{at}", f"output tok/s{at}"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    at_cdf = {name: run for name, c in results["configs"].items() for run in c["runs"] if run["rate"] == cdf}
    for name, c in results["configs"].items():
        if c["error"]:
            error = " ".join(c["error"].split()).replace("|", "\\|")  # one table cell
            lines.append(f"| {name} | failed: {error} |" + " |" * (len(header) - 2))
            continue
        run = at_cdf.get(name)
        latency = ["n/a"] * 3 if run is None else [
            f"{_ms(run['ttft_s']['p50'])} / {_ms(run['ttft_s']['p90'])}",
            f"{_ms(run['tpot_s']['p50'])} / {_ms(run['tpot_s']['p90'])}", f"{run['output_tokens_per_s']:.0f}"]
        goodputs = [_goodput_cell(c["goodput"][x["name"]]) if x["name"] in c["goodput"] else "n/a" for x in objectives]
        lines.append(f"| {name} | " + " | ".join([*goodputs, *latency]) + " |")
    busy = [f"{name}: {_loops_busy(run['worker_loop'])}" for name, run in at_cdf.items() if run.get("worker_loop")]
    if busy:  # where the time goes
        lines += ["", f"Engine loops busy{at} (share of the run's wall time): " + "; ".join(busy) + "."]
    ratios = [f"{pair} {ratio:.2f}x ({objective})" for objective, pairs in results["goodput_ratios"].items()
              for pair, ratio in pairs.items() if ratio is not None]
    if ratios:
        lines += ["", "Goodput ratios: " + "; ".join(ratios) + "."]
    http = results["configs"].get("disaggregated-http")
    if results["http_vs_grpc"] and http and not http["error"]:
        lines += ["", *_http_cost_lines(http["idle_apis"], results["http_vs_grpc"])]
    return "\n".join(lines)


def _signed_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:+.1f} ms".replace("-", "−")


def _http_cost_lines(idle: dict[str, Any] | None, by_rate: dict[str, dict]) -> list[str]:
    """The HTTP layer's cost: the same deployment's medians over gRPC and over `/v1/completions`
    (streamed), one at a time on one cluster and at each rate both ran, with HTTP's excess."""
    lines = ["The OpenAI HTTP API beside gRPC (`disaggregated-http` is `disaggregated` driven over streamed "
             "`/v1/completions`), medians. The idle row is the direct measure: one cluster, the two APIs in "
             "alternating rounds. Each rate's row compares the two configurations' runs, on clusters of their "
             "own minutes apart, so it holds the machine's drift as well.", "",
             "| load | TTFT gRPC | TTFT HTTP | HTTP − gRPC | TPOT gRPC | TPOT HTTP | HTTP − gRPC |",
             "|" + "---|" * 7]
    rows = ([(f"idle, one at a time ({idle['requests_per_api']} per API, same cluster)", idle)] if idle else [])
    rows += [(f"{float(rate):g} req/s", medians) for rate, medians in by_rate.items()]
    for load, m in rows:
        t, tp = m["ttft_p50_s"], m["tpot_p50_s"]
        lines.append(f"| {load} | {_ms(t['grpc'])} | {_ms(t['http'])} | {_signed_ms(t['http_minus_grpc'])} | "
                     f"{_ms(tp['grpc'])} | {_ms(tp['http'])} | {_signed_ms(tp['http_minus_grpc'])} |")
    excess = {metric: [m[metric]["http_minus_grpc"] for m in by_rate.values()
                       if m[metric]["http_minus_grpc"] is not None] for metric in ("ttft_p50_s", "tpot_p50_s")}
    if all(excess.values()):
        lines += ["", f"Over the rates, HTTP's median excess: {_signed_ms(percentile(excess['ttft_p50_s'], 50))} "
                      f"per request (TTFT), {_signed_ms(percentile(excess['tpot_p50_s'], 50))} per token (TPOT)."]
    return lines


# --- entry point ----------------------------------------------------------------------------------
def run(cfg: ServeBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; write results.json, requests.jsonl and plots to cfg.out_dir; return the results."""
    from transformers import AutoConfig

    from pdserve.engine.model_loader import context_limit, load_tokenizer
    from pdserve.engine.models.presets import resolve_model

    unknown = set(cfg.configs) - set(CONFIGS)
    if unknown or not cfg.configs:
        raise ValueError(f"configurations must be among {', '.join(CONFIGS)}; got {', '.join(cfg.configs) or 'none'}")
    if cfg.requests_per_rate < 1 or cfg.calibration_requests < 1:
        raise ValueError("--requests-per-rate and --calibration-requests must be >= 1")
    model_dir = resolve_model(cfg.model)
    served = context_limit(AutoConfig.from_pretrained(model_dir), cfg.max_model_len)
    if served < cfg.max_model_len:  # the workload would hold requests the cluster refuses or cuts short
        raise ValueError(f"model {cfg.model!r} serves at most {served} tokens: --max-model-len {cfg.max_model_len} "
                         f"is more")
    workload = build_workload(cfg, load_tokenizer(model_dir))
    if cfg.trace_arrivals:
        arrivals_for(cfg, workload.shapes, 1.0)  # a trace with no gaps to replay fails now, not after the clusters start
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "requests.jsonl").write_text("")
    shapes = workload.shapes
    log(f"workload: {len(shapes)} requests per rate from {workload.path}, prompts drawn afresh for every run; "
        f"prompts mean {sum(s.prompt_len for s in shapes) / len(shapes):.0f} tokens, outputs mean "
        f"{sum(s.output_len for s in shapes) / len(shapes):.0f} tokens")

    state: dict[str, Any] = {}
    if cfg.tight and cfg.loose and cfg.start_rate:
        state["objectives"] = objectives_from(cfg, None)
    order = list(cfg.configs)
    if "objectives" not in state:  # calibration runs on the disaggregated configuration, first
        order = ["disaggregated"] + [c for c in order if c != "disaggregated"]
    results: list[ConfigResult] = []
    # spawn: a clean interpreter for the load generator (no Ray, no router threads inherited).
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        for name in order:
            log(f"\n== {name}: {DESCRIPTIONS[name].format(threads=cfg.baseline_threads)}")
            r, t0 = ConfigResult(name), time.monotonic()
            try:
                bench_config(r, cfg, model_dir, workload, pool, state, log)
            except Exception as e:  # noqa: BLE001 (reported in the results; the other configurations go on)
                if "objectives" not in state:
                    raise  # without the calibration there is nothing to measure against
                log(f"  {name} failed: {type(e).__name__}: {e}")
                r.error = f"{type(e).__name__}: {e}"
            log(f"  ({name}: {time.monotonic() - t0:.0f} s including start and stop)")
            if name in cfg.configs:
                results.append(r)

    # The CDFs compare configurations at one rate that all of them ran.
    measured = [set(r.runs) for r in results if r.runs]
    common = set.intersection(*measured) if measured else set()
    cdf_rate = rate_key(cfg.cdf_rate) if cfg.cdf_rate else max(common, default=None)
    cdf_rate = cdf_rate if cdf_rate in common else None
    out = assemble(cfg, state, results, model_dir, workload, cdf_rate)
    (cfg.out_dir / "results.json").write_text(json.dumps(out, indent=2))  # kept should the plotting fail
    plots = plot(results, state["objectives"], cdf_rate, cfg.out_dir)
    out["plots"] = [plot_record(p) for p in plots]
    (cfg.out_dir / "results.json").write_text(json.dumps(out, indent=2))

    log("\ngoodput (req/s, >= 90% of requests within both objectives):")
    if cfg.smoke:
        log(f"  a smoke run (--quick): {SMOKE_CAVEAT}")
    for o in state["objectives"]:
        row = ", ".join(f"{r.name} {next((f'{g.rate:g}' for g in r.goodput if g.objective == o), 'failed')}"
                        for r in results)
        log(f"  {o.name:6} {row}")
        for k, v in out["goodput_ratios"][o.name].items():
            log(f"         {k}: {'n/a' if v is None else f'{v:.2f}x'}")
    log(f"wrote {cfg.out_dir / 'results.json'}, {cfg.out_dir / 'requests.jsonl'}, "
        + ", ".join(str(p) for p in plots))
    return out
