"""`pdserve bench overload`: a burst far past the cluster's capacity, and what becomes of every request.

Sends `num_requests` greedy requests (Azure conversation lengths scaled to the model) spread evenly
over `burst_s` seconds against a cluster it starts from the manifest (default: deploy/local.yaml),
each with a deadline. Every request must end completed or RESOURCE_EXHAUSTED (never UNAVAILABLE,
never past its deadline); a sample of the completed outputs is compared with transformers'
`generate`; peak resident memory of the router's process (which also runs this load generator) and
of every worker is reported; afterwards every pool must be fully free.
"""

from __future__ import annotations

import asyncio
import json
import random
import resource
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pdserve.client import AsyncClient, PDServeError, ResourceExhausted
from pdserve.cluster.bench.report import provenance
from pdserve.cluster.bench.workload import azure_trace_shapes, random_token_prompts
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import load_manifest
from pdserve.engine.models.presets import resolve_model


@dataclass
class OverloadConfig:
    manifest: str | None = None
    num_requests: int = 1000
    burst_s: float = 2.0
    deadline_s: float = 120.0
    max_tokens: int = 32
    reference_sample: int = 40
    seed: int = 0
    out: Path = Path("bench-results/overload.json")


@dataclass
class Outcome:
    index: int
    status: str  # "ok" | a gRPC status name
    seconds: float
    retry_after_s: float | None = None
    token_ids: list[int] | None = None


async def _one(client: AsyncClient, index: int, prompt: list[int], max_tokens: int, delay: float,
               deadline_s: float) -> Outcome:
    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    try:
        r = await client.generate(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True, timeout=deadline_s)
        return Outcome(index, "ok", time.perf_counter() - t0, token_ids=r.token_ids)
    except ResourceExhausted as e:
        return Outcome(index, e.code.name, time.perf_counter() - t0, retry_after_s=e.retry_after_s)
    except PDServeError as e:
        return Outcome(index, e.code.name, time.perf_counter() - t0)


async def _burst(address: str, token: str | None, prompts: list[list[int]], max_tokens: list[int],
                 cfg: OverloadConfig) -> list[Outcome]:
    gap = cfg.burst_s / max(1, len(prompts))
    async with AsyncClient(address, token=token) as client:
        return await asyncio.gather(*(_one(client, i, p, n, i * gap, cfg.deadline_s)
                                      for i, (p, n) in enumerate(zip(prompts, max_tokens))))


def _divergence(model: torch.nn.Module, prompt: list[int], expected: list[int], got: list[int]) -> dict:
    """Where a served output first left the reference, and how close the reference's top two logits
    were there (a near-tie that float rounding in another batch shape can flip, or a real error)."""
    at = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    logits = model(torch.tensor([prompt + expected[:at]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return {"prompt_len": len(prompt), "position": at, "expected": expected[at], "got": got[at],
            "top2_logit_gap": float(top[0] - top[1]),
            "gap_to_served_token": float(logits[expected[at]] - logits[got[at]])}


def run(cfg: OverloadConfig) -> dict:
    manifest = load_manifest(cfg.manifest)
    manifest.server.address, manifest.server.http_address = "127.0.0.1:0", None
    model_dir = resolve_model(manifest.model)
    limit = manifest.max_model_len or 1024
    shapes, source = azure_trace_shapes(cfg.num_requests, 0.25, 1.0, limit - cfg.max_tokens, cfg.max_tokens)
    prompts = random_token_prompts(shapes, AutoConfig.from_pretrained(model_dir).vocab_size, seed=cfg.seed)
    max_tokens = [s.output_len for s in shapes]
    rss_mb = lambda b: round(b / 2**20, 1)  # noqa: E731
    router_rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with Cluster(manifest) as cluster:
        workers_before = {n: s["peak_rss_bytes"] for n, s in cluster.worker_stats().items()}
        print(f"sending {cfg.num_requests} requests over {cfg.burst_s:g} s (deadline {cfg.deadline_s:g} s) ...",
              flush=True)
        t0 = time.perf_counter()
        outcomes = asyncio.run(_burst(cluster.address, manifest.server.token, prompts, max_tokens, cfg))
        elapsed = time.perf_counter() - t0
        workers_after = {n: s["peak_rss_bytes"] for n, s in cluster.worker_stats().items()}
        t_idle = time.time()
        idle, _ = cluster.wait_idle(timeout_s=30.0)
        idle_after_s = time.time() - t_idle
    router_rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    counts = Counter(o.status for o in outcomes)
    ok = [o for o in outcomes if o.status == "ok"]
    sample = random.Random(cfg.seed).sample(ok, min(cfg.reference_sample, len(ok)))
    print(f"checking {len(sample)} completed outputs against transformers' generate ...", flush=True)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mismatches = []
    with torch.inference_mode():
        for o in sample:
            prompt = prompts[o.index]
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens[o.index],
                                     min_new_tokens=max_tokens[o.index], do_sample=False, pad_token_id=0,
                                     eos_token_id=None)  # as ignore_eos: EOS is a token like any other
            expected = out[0, len(prompt):].tolist()
            if expected != o.token_ids:
                mismatches.append(_divergence(reference, prompt, expected, o.token_ids))
    refused = [o.retry_after_s for o in outcomes if o.status == "RESOURCE_EXHAUSTED"]
    result = {
        "benchmark": "overload", "provenance": provenance(), "config": {**asdict(cfg), "out": str(cfg.out)},
        "manifest": manifest.model_dump(mode="json"), "workload": source,  # secrets show as **********
        "offered_rate_rps": cfg.num_requests / cfg.burst_s, "elapsed_s": elapsed,
        "completed_rate_rps": len(ok) / elapsed, "outcomes": dict(counts),
        "past_deadline": sum(o.status == "DEADLINE_EXCEEDED" or o.seconds > cfg.deadline_s for o in outcomes),
        "latency_s_p50": {s: statistics.median(o.seconds for o in outcomes if o.status == s) for s in counts},
        "retry_after_s_median": statistics.median(refused) if refused else None,
        "reference_checked": len(sample), "reference_mismatches": len(mismatches),
        "mismatch_details": mismatches,
        "peak_rss_mb": {"router_and_loadgen": {"before": rss_mb(router_rss_before), "after": rss_mb(router_rss_after)},
                        **{n: {"before": rss_mb(workers_before[n]), "after": rss_mb(workers_after[n])}
                           for n in workers_after}},
        "pools_free_afterwards": idle, "pools_free_after_s": idle_after_s,
    }
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("offered_rate_rps", "completed_rate_rps", "outcomes", "past_deadline",
                                              "reference_checked", "reference_mismatches", "peak_rss_mb",
                                              "pools_free_afterwards")}, indent=2))
    print(f"wrote {cfg.out}")
    return result


def markdown(result: dict) -> str:
    """The overload benchmark's section of docs/benchmarks.md: the burst, what became of every request,
    memory before and after, and whether the pools came back free."""
    c, m = result["config"], result["manifest"]
    pools = ", ".join(f"{spec['replicas']} {pool}" for pool, spec in m["pools"].items() if spec["replicas"])
    outcomes, p50 = result["outcomes"], result["latency_s_p50"]
    others = {k: v for k, v in outcomes.items() if k not in ("ok", "RESOURCE_EXHAUSTED")}
    hint = result["retry_after_s_median"]
    refused = outcomes.get("RESOURCE_EXHAUSTED", 0)
    lines = [
        f"{m['model']} ({m['mode']}; {pools} worker(s); admission at most {m['router']['max_queued_prefills']} "
        f"prompts waiting per prefill worker and {m['router']['max_active_decodes']} requests per decode worker). "
        f"{c['num_requests']:,} greedy requests (lengths from {Path(result['workload']).name}, prompts × 1/4; "
        f"outputs capped at {c['max_tokens']} tokens) "
        f"sent evenly over {c['burst_s']:g} s: {result['offered_rate_rps']:.0f} req/s offered; each with a "
        f"{c['deadline_s']:g} s deadline.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| completed | {outcomes.get('ok', 0):,} (p50 latency {p50.get('ok', 0):.1f} s; "
        f"{result['completed_rate_rps']:.1f} req/s) |",
        f"| RESOURCE_EXHAUSTED | {refused:,}"
        + (f" (answered in {p50['RESOURCE_EXHAUSTED'] * 1e3:.1f} ms p50, retry-after hint median {hint:.1f} s)"
           if refused else "") + " |",
        f"| other errors; past the deadline | {', '.join(f'{k} {v}' for k, v in others.items()) or 'none'}; "
        f"{result['past_deadline']} |",
        f"| completed outputs checked against transformers' `generate` | {result['reference_checked']}, "
        f"{result['reference_checked'] - result['reference_mismatches']} equal |",
    ]
    for name, rss in result["peak_rss_mb"].items():
        lines.append(f"| peak RSS before → after: {name.replace('_', ' ')} | {rss['before']:.0f} → {rss['after']:.0f} MiB |")
    lines.append(f"| every pool fully free afterwards | {'yes' if result['pools_free_afterwards'] else 'no'}, "
                 f"after {result['pools_free_after_s']:.1f} s |")
    return "\n".join(lines)
