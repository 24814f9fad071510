"""`pdserve bench cluster`: deployments side by side on the same machine, model and requests.

Every deployment (disaggregated over shm, tcp, grpc and gloo; over shm with every prompt's KV streamed
layer by layer beside its pass, where the others send a prompt under `layerwise_min_tokens` once its
pass ends; colocated) runs at once in one Ray instance,
and the low-load requests go to them in turn, each prompt to every deployment in a shuffled order:
the machine's drift over minutes (this 2-core VM's speed moves by tens of percent) falls on all of
them alike, and each request's TTFT is compared with colocated's for the same prompt (the paired
ratio). Idle deployments wait on queues and timers, which costs each the same.

Every request of a disaggregated deployment is disaggregated: its router never prefills a short
prompt on the decode worker (`router.local_prefill_tokens: 0`) and its decode worker never recomputes
a prompt's KV instead of receiving it (`kv_transfer.recompute: false`), features that would make some
of its requests colocated ones.

For each deployment:
  - TTFT at low load: requests one at a time (prompt lengths from an Azure trace, `--trace`, with
    fresh tokens each round so no prefix cache helps), with the breakdown the API returns: queue,
    prefill, first-token delivery (TTFT - queue - prefill), and the KV transfer that runs after the
    prompt pass and before the second token; and the median of TTFT / colocated's TTFT, per prompt;
  - the same for 2K-token prompts (`--long-prompt`), which stream their KV layer by layer beside
    the pass where the trace's (at most 512 tokens) are sent once it ends;
  - streaming overhead per token: the client's median gap between tokens minus the decode worker's
    median step time for the same steps (batch 1): what gRPC + pyzmq + detokenizing add per token;
  - KV bytes/s (disaggregated), from the 2K-token prompts: bytes moved over (commit acknowledged -
    first layer pushed); the "tail" is the time from the end of the prompt pass (its step sampled
    the first token) until the receiver has answered every frame: the transfer that layer-wise
    streaming does not hide behind the prompt pass (the commit call after it is not transfer); the
    hidden share is 1 - tail / (the time the same bytes take on the transport alone, measured by
    probes after them).
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import ray

from pdserve.client import Client
from pdserve.cluster.bench.report import provenance
from pdserve.cluster.bench.workload import DEFAULT_TRACE, RequestShape, azure_trace_shapes, random_token_prompts
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import Manifest, load_manifest
from pdserve.engine.model_loader import load_tokenizer
from pdserve.engine.models.presets import resolve_model
from pdserve.router.workers import WorkerRef

# (name, mode, transport, kv_transfer settings beyond those): the low-load prompts (at most 512 tokens) are
# sent once their pass ends (`layerwise_min_tokens`), and, in "shm, layer by layer", beside the pass.
DEPLOYMENTS = (("disaggregated/shm", "disaggregated", "shm", {}),
               ("disaggregated/shm, layer by layer", "disaggregated", "shm", {"layerwise_min_tokens": 0}),
               ("disaggregated/tcp", "disaggregated", "tcp", {}), ("disaggregated/grpc", "disaggregated", "grpc", {}),
               ("disaggregated/gloo", "disaggregated", "gloo", {}),
               ("colocated", "colocated", "shm", {}))
BASELINE = "colocated"


@dataclass
class ClusterBenchConfig:
    model: str = "llama-20m"
    num_requests: int = 24  # prompt lengths taken from the trace; each deployment serves num_requests x rounds
    rounds: int = 3  # every prompt length this many times, with fresh tokens
    max_tokens: int = 16
    long_prompt: int = 2000  # "2K tokens", within the benchmark's max_model_len of 2048
    num_long: int = 8
    trace: str = DEFAULT_TRACE  # prompt lengths from this Azure trace (in the trace folders)
    # > 0: every worker's engine on CUDA. All deployments run at once, so the 10 workers' shares must
    # fit the GPUs there are (0.1 each: all of them on one GPU).
    gpus_per_worker: float = 0.0
    seed: int = 0
    out: Path = Path("bench-results/cluster.json")


@dataclass
class DeploymentResult:
    name: str
    ttft_ms: float = 0.0
    ttft_vs_colocated: float = 0.0  # median over prompts of TTFT / colocated's TTFT, same prompt
    long_ttft_ms: float = 0.0  # the same two for the 2K-token prompts
    long_ttft_vs_colocated: float = 0.0
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


@dataclass
class _Deployment:
    result: DeploymentResult
    mode: str
    cluster: Cluster
    client: Client
    timings: list[dict] = field(default_factory=list)  # per low-load request, in prompt order
    long_timings: list[dict] = field(default_factory=list)  # per 2K-token prompt, in prompt order
    gaps: list[float] = field(default_factory=list)  # client gaps between tokens after the second

    @property
    def decode_workers(self) -> list:
        return [w for w in self.cluster.workers if w.pool == "decode"]


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else 0.0


def _manifest(cfg: ClusterBenchConfig, mode: str, transport: str, kv_transfer: dict) -> Manifest:
    pool = {"num_cpus": 1, "threads": 1, "num_gpus": cfg.gpus_per_worker}
    return load_manifest({
        "model": cfg.model, "mode": mode, "kv_transfer": {"transport": transport, "recompute": False, **kv_transfer},
        "router": {"local_prefill_tokens": 0}, "max_model_len": 2048,
        "kv_memory_mb": 256, "server": {"address": "127.0.0.1:0", "http_address": None},
        "pools": {"prefill": pool, "decode": pool},
    })


def _one_request(d: _Deployment, prompt: list[int], max_tokens: int, timings_into: list[dict]) -> None:
    arrivals, timings = [], None
    for chunk in d.client.generate(prompt, stream=True, temperature=0, max_tokens=max_tokens, ignore_eos=True):
        arrivals.append(time.perf_counter())
        timings = chunk.timings or timings
    if timings is None:  # the paired ratio needs every request's
        raise RuntimeError(f"{d.result.name}: a stream ended without the request's timings")
    timings_into.append(timings)
    d.gaps += [b - a for a, b in zip(arrivals[1:], arrivals[2:])]  # steady decode, after the handoff


def _in_turn(deployments: list[_Deployment], prompts: list[list[int]], max_tokens: int, long: bool,
             order_rng: random.Random, log, every: int) -> None:
    """Every prompt to every deployment, one request at a time, in a shuffled order per prompt."""
    for i, prompt in enumerate(prompts):
        order = list(deployments)
        order_rng.shuffle(order)
        for d in order:
            _one_request(d, prompt, max_tokens, d.long_timings if long else d.timings)
        if (i + 1) % every == 0:
            log(f"  {'2K-token prompts' if long else 'low load'}: {i + 1}/{len(prompts)} prompts, each to all "
                f"{len(deployments)} deployments")


def _paired(timings: list[dict], baseline: list[dict]) -> float:
    return statistics.median(t["ttft"] / b["ttft"] for t, b in zip(timings, baseline))


def low_load(cfg: ClusterBenchConfig, deployments: list[_Deployment], prompts: list[list[int]], log=print) -> None:
    """The trace's prompts, every one to every deployment in turn."""
    steps_before = {d.result.name: [len(ray.get(w.handle.stats.remote())["steps"]) for w in d.decode_workers]
                    for d in deployments}
    _in_turn(deployments, prompts, cfg.max_tokens, False, random.Random(cfg.seed), log, len(prompts) // cfg.rounds)
    baseline = next(d for d in deployments if d.result.name == BASELINE)
    for d in deployments:
        r, timings = d.result, d.timings
        steps = []
        for w, before in zip(d.decode_workers, steps_before[d.result.name]):
            steps += [s for n, s in ray.get(w.handle.stats.remote())["steps"][before:] if n == 1]
        r.ttft_ms = _median_ms([t["ttft"] for t in timings])
        r.ttft_vs_colocated = _paired(timings, baseline.timings)
        r.queued_ms = _median_ms([t["queued"] for t in timings])
        r.prefill_ms = _median_ms([t["prefill"] for t in timings])
        r.first_token_delivery_ms = _median_ms([t["ttft"] - t["queued"] - t["prefill"] for t in timings])
        r.kv_transfer_ms = _median_ms([t["kv_transfer"] for t in timings])
        r.client_itl_ms = _median_ms(d.gaps)
        r.worker_step_ms = _median_ms(steps)
        log(f"  {r.name}: TTFT {r.ttft_ms:.1f} ms ({r.ttft_vs_colocated:.3f}x colocated, per prompt; queue "
            f"{r.queued_ms:.1f}, prefill {r.prefill_ms:.1f}, delivery {r.first_token_delivery_ms:.1f}), transfer "
            f"{r.kv_transfer_ms:.1f} ms, ITL {r.client_itl_ms:.2f} ms vs step {r.worker_step_ms:.2f} ms")


def long_prompts(cfg: ClusterBenchConfig, deployments: list[_Deployment], vocab: int, log=print) -> None:
    """2K-token prompts, every one to every deployment in turn (TTFT, paired with colocated's), then
    each disaggregated deployment's transfers of them and probes of its transport alone."""
    prompts = random_token_prompts([RequestShape(cfg.long_prompt, 2)] * cfg.num_long, vocab, seed=99)
    prefills = {d.result.name: next(w for w in d.cluster.workers if w.pool == "prefill") for d in deployments
                if d.mode == "disaggregated"}
    before = {name: len(ray.get(w.handle.stats.remote())["transfers"]) for name, w in prefills.items()}
    _in_turn(deployments, prompts, 2, True, random.Random(cfg.seed + 1), log, len(prompts))
    baseline = next(d for d in deployments if d.result.name == BASELINE)
    for d in deployments:
        d.result.long_ttft_ms = _median_ms([t["ttft"] for t in d.long_timings])
        d.result.long_ttft_vs_colocated = _paired(d.long_timings, baseline.long_timings)
        log(f"  {d.result.name}: TTFT of {cfg.long_prompt}-token prompts {d.result.long_ttft_ms:.1f} ms "
            f"({d.result.long_ttft_vs_colocated:.3f}x colocated, per prompt)")
        if d.mode == "disaggregated":
            prefill = prefills[d.result.name]
            kv_transfers(cfg, d, prefill, ray.get(prefill.handle.stats.remote())["transfers"][before[d.result.name]:],
                         log)


def kv_transfers(cfg: ClusterBenchConfig, d: _Deployment, prefill: WorkerRef, log_entries: list[dict],
                 log=print) -> None:
    """One disaggregated deployment's transfers of the 2K-token prompts, then probes of its transport alone."""
    r = d.result
    log_entries = [e for e in log_entries if not e["recomputed"]]  # none, with recompute off: a check
    if len(log_entries) != cfg.num_long:
        raise RuntimeError(f"{r.name}: {len(log_entries)} of {cfg.num_long} 2K-token prompts were transferred")
    decode = d.decode_workers[0]
    probes = [ray.get(prefill.handle.probe_transfer.remote(decode.handle, cfg.long_prompt))
              for _ in range(cfg.num_long)]
    r.transport_mb_per_s = statistics.median(p["bytes"] / p["seconds"] for p in probes) / 2**20
    rates = [e["bytes"] / (e["committed"] - e["first_layer"]) for e in log_entries]
    r.kv_mb_per_s = statistics.median(rates) / 2**20
    r.kv_tail_ms = _median_ms([e["delivered"] - e["prompt_done"] for e in log_entries])
    r.sender_done_ms = _median_ms([e["last_layer"] - e["prompt_done"] for e in log_entries])
    r.kv_mb_per_request = statistics.median(e["bytes"] for e in log_entries) / 2**20
    # Hidden: the part of the time the bytes take on the transport alone that the prompt pass covers.
    alone_ms = r.kv_mb_per_request / r.transport_mb_per_s * 1e3
    r.hidden_share = max(0.0, 1 - r.kv_tail_ms / alone_ms)
    log(f"  {r.name}: KV {r.kv_mb_per_request:.1f} MiB per {cfg.long_prompt}-token prompt, "
        f"{r.kv_mb_per_s:.0f} MiB/s overlapped with the prompt pass, tail after the prompt pass "
        f"{r.kv_tail_ms:.1f} ms; transport alone {r.transport_mb_per_s:.0f} MiB/s "
        f"({alone_ms:.1f} ms for these bytes: {r.hidden_share:.0%} hidden; the sender handed its last frame "
        f"over {r.sender_done_ms:+.1f} ms from the prompt pass's end)")


def run(cfg: ClusterBenchConfig, log=print) -> list[DeploymentResult]:
    if cfg.num_requests < 1 or cfg.rounds < 1 or cfg.num_long < 1:
        raise ValueError(f"need at least one prompt length, one round and one long prompt (got {cfg.num_requests}, "
                         f"{cfg.rounds}, {cfg.num_long})")
    shapes, source = azure_trace_shapes(cfg.num_requests, input_scale=0.25, output_scale=1.0, max_prompt=512,
                                        max_output=cfg.max_tokens, trace=cfg.trace)
    vocab = len(load_tokenizer(resolve_model(cfg.model)))
    prompts = [p for rnd in range(cfg.rounds) for p in random_token_prompts(shapes, vocab, seed=cfg.seed + rnd)]
    warm_up = random_token_prompts(shapes[:2], vocab, seed=cfg.seed + cfg.rounds)  # not measured, so no prefix hits
    log(f"workload: {len(prompts)} requests per deployment ({cfg.rounds} rounds of {len(shapes)} prompt lengths "
        f"from {source}), one at a time, each prompt to every deployment in turn; {cfg.max_tokens} output tokens "
        f"each; model {cfg.model}")
    # One Ray instance holds every deployment's workers at once; they are idle but for their own requests.
    manifests = [_manifest(cfg, mode, transport, kv) for _, mode, transport, kv in DEPLOYMENTS]
    cpus = sum(p.num_cpus * p.replicas for m in manifests for p in (m.pools.prefill, m.pools.decode))
    started_ray = not ray.is_initialized()
    if started_ray:  # a Ray of its own: never the one the last `ray start` here recorded under /tmp/ray
        ray.init(address="local", num_cpus=int(cpus + 0.999), include_dashboard=False,
                 logging_level=logging.WARNING, configure_logging=True)
    try:
        with ExitStack() as stack:
            deployments = []
            for (name, mode, _, _), manifest in zip(DEPLOYMENTS, manifests):
                log(f"starting {name} ...")
                cluster = stack.enter_context(Cluster(manifest, log=lambda _: None))
                client = stack.enter_context(Client(cluster.address, timeout=300))
                deployments.append(_Deployment(DeploymentResult(name), mode, cluster, client))
            for d in deployments:  # warm-up
                for p in warm_up:
                    d.client.generate(p, temperature=0, max_tokens=4, ignore_eos=True)
            low_load(cfg, deployments, prompts, log)
            long_prompts(cfg, deployments, vocab, log)
    finally:
        if started_ray:
            ray.shutdown()
    results = [d.result for d in deployments]
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps({
        "benchmark": "cluster", "provenance": provenance(), "model": cfg.model, "gpus_per_worker": cfg.gpus_per_worker, "workload": source,
        "prompt_lengths": cfg.num_requests, "rounds": cfg.rounds, "seed": cfg.seed,
        "results": [r.__dict__ for r in results]}, indent=2))
    log(summary_table(results))
    log(f"results written to {cfg.out}")
    return results


def summary_table(results: list[DeploymentResult]) -> str:
    lines = ["| deployment | TTFT | TTFT / colocated's, per prompt | queue | prefill | first-token delivery | "
             "KV transfer (before token 2) | client ITL | worker step | streaming overhead/token | TTFT, 2K-token "
             "prompts | its / colocated's, per prompt |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.ttft_ms:.1f} | {r.ttft_vs_colocated:.3f} | {r.queued_ms:.1f} | "
                     f"{r.prefill_ms:.1f} | {r.first_token_delivery_ms:.1f} | {r.kv_transfer_ms:.1f} | "
                     f"{r.client_itl_ms:.2f} | {r.worker_step_ms:.2f} | {r.client_itl_ms - r.worker_step_ms:.2f} | "
                     f"{r.long_ttft_ms:.1f} | {r.long_ttft_vs_colocated:.3f} |")
    lines += ["", "| transport | KV per request (MiB) | transport alone (MiB/s) | in serving, first layer to commit "
              "(MiB/s) | tail after the prompt pass (ms) | sender's last frame, from the pass's end (ms) | hidden behind the "
              "prompt pass |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.kv_mb_per_s is not None:
            lines.append(f"| {r.name} | {r.kv_mb_per_request:.2f} | {r.transport_mb_per_s:.0f} | {r.kv_mb_per_s:.0f} | "
                         f"{r.kv_tail_ms:.1f} | {r.sender_done_ms:+.1f} | {r.hidden_share:.0%} |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    """The results as the docs show them (from a results file)."""
    rows = [DeploymentResult(**r) for r in results["results"]]
    return (f"Every deployment at once in one Ray instance on {results['model']}; requests one at a time, each "
            f"prompt to every deployment in turn ({results['rounds']} rounds of {results['prompt_lengths']} prompt "
            f"lengths from {Path(results['workload']).name}, fresh tokens each round); times in ms, medians. Every "
            "disaggregated request goes through the KV transfer (no local prefill, no recompute).\n\n"
            + summary_table(rows))
