"""`pdserve bench cluster`: deployments side by side on the same machine, model and requests.

For each deployment (disaggregated over shm, grpc and gloo, colocated):
  - TTFT at low load: requests one at a time (prompt lengths from an Azure trace, `--trace`), with
    the breakdown the API returns: queue, prefill, first-token delivery (TTFT - queue - prefill), and
    the KV transfer that runs after the prompt pass and before the second token;
  - streaming overhead per token: the client's median gap between tokens minus the decode worker's
    median step time for the same steps (batch 1): what gRPC + pyzmq + detokenizing add per token;
  - KV bytes/s (disaggregated): 2K-token prompts, bytes moved over (commit acknowledged - first layer
    pushed); the "tail" is the time from the end of the prompt pass (its step sampled the first
    token) until the receiver has answered every frame: the transfer that layer-wise streaming does not hide
    behind the prompt pass (the commit call after it is not transfer); the hidden share is
    1 - tail / (the time the same bytes take on the transport alone, measured by probes beside it).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import ray

from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import load_manifest
from pdserve.cluster.workload import DEFAULT_TRACE, RequestShape, azure_trace_shapes, random_token_prompts
from pdserve.engine.model_loader import load_tokenizer
from pdserve.engine.presets import resolve_model
from pdserve.router.client import Client

DEPLOYMENTS = (("disaggregated", "shm"), ("disaggregated", "grpc"), ("disaggregated", "gloo"), ("colocated", "shm"))


@dataclass
class ClusterBenchConfig:
    model: str = "llama-20m"
    num_requests: int = 24
    max_tokens: int = 16
    long_prompt: int = 2000  # "2K tokens", within the benchmark's max_model_len of 2048
    num_long: int = 8
    trace: str = DEFAULT_TRACE  # prompt lengths from this Azure trace (in the trace folders)
    gpus_per_worker: float = 0.0  # > 0: every worker's engine on CUDA (0.5 each: both pools share one GPU)
    out: Path = Path("bench-results/cluster.json")


@dataclass
class DeploymentResult:
    name: str
    ttft_ms: float = 0.0
    queued_ms: float = 0.0
    prefill_ms: float = 0.0
    first_token_delivery_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    client_itl_ms: float = 0.0
    worker_step_ms: float = 0.0
    kv_mb_per_s: float | None = None
    kv_tail_ms: float | None = None
    kv_mb_per_request: float | None = None
    transport_mb_per_s: float | None = None
    hidden_share: float | None = None
    sender_done_ms: float | None = None  # the sender handed its last frame over, from the pass's end (< 0: before)
    raw: dict = field(default_factory=dict)


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else 0.0


def bench_deployment(cfg: ClusterBenchConfig, mode: str, transport: str, prompts: list[list[int]],
                     log=print) -> DeploymentResult:
    manifest = load_manifest({
        "model": cfg.model, "mode": mode, "kv_transfer": {"transport": transport}, "max_model_len": 2048,
        "kv_memory_mb": 256, "server": {"address": "127.0.0.1:0", "http_address": None},
        "pools": {pool: {"num_cpus": 1, "threads": 1, "num_gpus": cfg.gpus_per_worker} for pool in ("prefill", "decode")},
    })
    result = DeploymentResult(f"{mode}/{transport}" if mode == "disaggregated" else mode)
    with Cluster(manifest, log=lambda _: None) as cluster, Client(cluster.address, timeout=300) as client:
        for p in prompts[:2]:  # warm-up
            client.generate(p, temperature=0, max_tokens=4, ignore_eos=True)
        decode_workers = [w for w in cluster.workers if w.pool == "decode"]
        steps_before = [len(ray.get(w.handle.stats.remote())["steps"]) for w in decode_workers]
        timings, gaps = [], []
        for p in prompts:
            arrivals = []
            for chunk in client.generate(p, stream=True, temperature=0, max_tokens=cfg.max_tokens, ignore_eos=True):
                arrivals.append(time.perf_counter())
                if chunk.timings:
                    timings.append(chunk.timings)
            gaps += [b - a for a, b in zip(arrivals[1:], arrivals[2:])]  # steady decode, after the handoff
        steps = []
        for w, before in zip(decode_workers, steps_before):
            steps += [s for n, s in ray.get(w.handle.stats.remote())["steps"][before:] if n == 1]
        result.ttft_ms = _median_ms([t["ttft"] for t in timings])
        result.queued_ms = _median_ms([t["queued"] for t in timings])
        result.prefill_ms = _median_ms([t["prefill"] for t in timings])
        result.first_token_delivery_ms = _median_ms([t["ttft"] - t["queued"] - t["prefill"] for t in timings])
        result.kv_transfer_ms = _median_ms([t["kv_transfer"] for t in timings])
        result.client_itl_ms = _median_ms(gaps)
        result.worker_step_ms = _median_ms(steps)
        log(f"  {result.name}: TTFT {result.ttft_ms:.1f} ms (queue {result.queued_ms:.1f}, prefill "
            f"{result.prefill_ms:.1f}, delivery {result.first_token_delivery_ms:.1f}), transfer "
            f"{result.kv_transfer_ms:.1f} ms, ITL {result.client_itl_ms:.2f} ms vs step {result.worker_step_ms:.2f} ms")

        if mode == "disaggregated":
            long_prompts = random_token_prompts([RequestShape(cfg.long_prompt, 2)] * cfg.num_long,
                                                client.model_info().vocab_size, seed=99)
            prefill = next(w for w in cluster.workers if w.pool == "prefill")
            before = len(ray.get(prefill.handle.stats.remote())["transfers"])
            for p in long_prompts:
                client.generate(p, temperature=0, max_tokens=2, ignore_eos=True)
            log_entries = ray.get(prefill.handle.stats.remote())["transfers"][before:]
            decode = next(w for w in cluster.workers if w.pool == "decode")
            probes = [ray.get(prefill.handle.probe_transfer.remote(decode.handle, cfg.long_prompt))
                      for _ in range(cfg.num_long)]
            result.transport_mb_per_s = statistics.median(p["bytes"] / p["seconds"] for p in probes) / 2**20
            rates = [e["bytes"] / (e["committed"] - e["first_layer"]) for e in log_entries]
            result.kv_mb_per_s = statistics.median(rates) / 2**20
            result.kv_tail_ms = _median_ms([e["delivered"] - e["prompt_done"] for e in log_entries])
            result.sender_done_ms = _median_ms([e["last_layer"] - e["prompt_done"] for e in log_entries])
            result.kv_mb_per_request = statistics.median(e["bytes"] for e in log_entries) / 2**20
            # Hidden: the part of the time the bytes take on the transport alone that the prompt pass covers.
            alone_ms = result.kv_mb_per_request / result.transport_mb_per_s * 1e3
            result.hidden_share = max(0.0, 1 - result.kv_tail_ms / alone_ms)
            log(f"  {result.name}: KV {result.kv_mb_per_request:.1f} MiB per {cfg.long_prompt}-token prompt, "
                f"{result.kv_mb_per_s:.0f} MiB/s overlapped with the prompt pass, tail after the prompt pass "
                f"{result.kv_tail_ms:.1f} ms; transport alone {result.transport_mb_per_s:.0f} MiB/s "
                f"({alone_ms:.1f} ms for these bytes: {result.hidden_share:.0%} hidden; the sender handed its last frame "
                f"over {result.sender_done_ms:+.1f} ms from the prompt pass's end)")
    return result


def run(cfg: ClusterBenchConfig, log=print) -> list[DeploymentResult]:
    shapes, source = azure_trace_shapes(cfg.num_requests, input_scale=0.25, output_scale=1.0, max_prompt=512,
                                        max_output=cfg.max_tokens, trace=cfg.trace)
    log(f"workload: {len(shapes)} requests, one at a time, prompt lengths from {source}; "
        f"{cfg.max_tokens} output tokens each; model {cfg.model}")
    prompts = random_token_prompts(shapes, len(load_tokenizer(resolve_model(cfg.model))))
    results = [bench_deployment(cfg, mode, transport, prompts, log) for mode, transport in DEPLOYMENTS]
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps({
        "date": date.today().isoformat(), "machine": f"{platform.machine()} {platform.processor()}",
        "model": cfg.model, "gpus_per_worker": cfg.gpus_per_worker, "workload": source,
        "results": [r.__dict__ for r in results]}, indent=2))
    log(summary_table(results))
    log(f"results written to {cfg.out}")
    return results


def summary_table(results: list[DeploymentResult]) -> str:
    lines = ["| deployment | TTFT | queue | prefill | first-token delivery | KV transfer (before token 2) | "
             "client ITL | worker step | streaming overhead/token |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.ttft_ms:.1f} | {r.queued_ms:.1f} | {r.prefill_ms:.1f} | "
                     f"{r.first_token_delivery_ms:.1f} | {r.kv_transfer_ms:.1f} | {r.client_itl_ms:.2f} | "
                     f"{r.worker_step_ms:.2f} | {r.client_itl_ms - r.worker_step_ms:.2f} |")
    lines += ["", "| transport | KV per request (MiB) | transport alone (MiB/s) | in serving, first layer to commit "
              "(MiB/s) | tail after the prompt pass (ms) | sender's last frame, from the pass's end (ms) | hidden behind the "
              "prompt pass |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.kv_mb_per_s is not None:
            lines.append(f"| {r.name} | {r.kv_mb_per_request:.2f} | {r.transport_mb_per_s:.0f} | {r.kv_mb_per_s:.0f} | "
                         f"{r.kv_tail_ms:.1f} | {r.sender_done_ms:+.1f} | {r.hidden_share:.0%} |")
    return "\n".join(lines)
