"""`pdserve bench migration`: how long a stream pauses when its request moves to another decode worker
with its KV (live migration), against moving it by recompute, over context lengths.

A local cluster (1 prefill + 2 decode workers, one thread each) serves one greedy stream at a time, a
fresh random prompt each (no run is served from a prefix cache). After `tokens_before` tokens the
router moves the request to the other decode worker: *moved*, its KV sent over the KV-transfer layer
(`ActiveRequest.migrate`), or *recomputed*, ended there and resumed on the other worker from its
prompt and tokens (the fallback for a lost worker). The pause is the longest gap between two tokens
the client received from the moment the move began; the two ways alternate, run by run. Beside them,
in the same run: the stream's median gap between tokens (a decode step as the client sees it) and the
time the same number of tokens' KV takes through the transport (the launcher's transfer probe, reserve
to abort). The target is a pause no longer than two decode steps plus that transfer time.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ray

from pdserve.client import Client
from pdserve.cluster.bench.report import provenance
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import load_manifest
from pdserve.router.frontend import ActiveRequest

WINDOW_S = 10.0  # the pause is looked for among the tokens this long after the move began
PROBES = 3  # transfer probes per context length (their median)


@dataclass
class MigrationBenchConfig:
    model: str = "pystd-llama"
    contexts: tuple[int, ...] = (256, 512, 1024)  # tokens in context when the request moves (prompt + output)
    repeats: int = 20  # runs per context length and way of moving
    tokens_before: int = 16  # output tokens before the move
    tokens_after: int = 16  # output tokens after it
    transport: str = "auto"
    out: Path = Path("bench-results/migration.json")


class _Stream:
    """One streaming request, consumed on a thread: when each chunk arrived, and how many tokens."""

    def __init__(self, address: str, prompt: list[int], max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.arrivals: list[float] = []
        self.tokens: list[int] = []
        self.failure: Exception | None = None
        # Why a thread: the benchmark moves the request while its tokens arrive.
        self._thread = threading.Thread(target=self._consume, args=(address, prompt, max_tokens))
        self._thread.start()

    def _consume(self, address: str, prompt: list[int], max_tokens: int) -> None:
        try:
            with Client(address, timeout=120) as client:
                for chunk in client.generate(prompt, stream=True, max_tokens=max_tokens, temperature=0,
                                             ignore_eos=True):
                    self.arrivals.append(time.perf_counter())
                    self.tokens.extend(chunk.token_ids)
        except Exception as e:  # the run fails with it, not lost with the thread
            self.failure = e

    def wait_tokens(self, n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.tokens) < n:
            if self.failure is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the stream stopped before {n} tokens: {self.failure}")
            time.sleep(0.001)

    def join(self) -> None:
        self._thread.join(120)
        if self.failure is not None:
            raise self.failure

    def pause_after(self, began: float) -> float:
        """The longest gap between two chunks from `began` on (within `WINDOW_S`)."""
        times = self.arrivals
        return max((b - a for a, b in zip(times, times[1:]) if began < b <= began + WINDOW_S), default=0.0)

    def step_s(self) -> float:
        """The median gap between chunks (a decode step as the client sees it)."""
        return statistics.median(b - a for a, b in zip(self.arrivals, self.arrivals[1:]))


def _manifest(cfg: MigrationBenchConfig):
    pool = {"num_cpus": 1, "threads": 1}
    return load_manifest({
        "model": cfg.model, "mode": "disaggregated", "max_model_len": max(cfg.contexts) + cfg.tokens_after,
        "kv_memory_mb": 256, "server": {"address": "127.0.0.1:0", "http_address": None},
        # Every move sends the KV: recompute is the other way, measured as such.
        "kv_transfer": {"transport": cfg.transport, "recompute": False},
        "router": {"local_prefill_tokens": 0},
        "pools": {"prefill": {**pool, "replicas": 1}, "decode": {**pool, "replicas": 2}},
    })


def _one(cluster: Cluster, cfg: MigrationBenchConfig, prompt: list[int], way: str) -> dict:
    stream = _Stream(cluster.address, prompt, cfg.tokens_before + cfg.tokens_after)
    stream.wait_tokens(cfg.tokens_before)
    stack = cluster.router_stack
    active = _only_active(stack.frontend.active)
    began = time.perf_counter()
    if way == "moved":
        outcome = stack.loop.run(_move(active, cluster))
        if not outcome.moved:
            ended = "; the request had ended (raise tokens_after)" if len(stream.tokens) >= stream.max_tokens else ""
            raise RuntimeError(f"the move failed: {outcome.reason}{ended}")
        extra = {"worker_pause_s": outcome.pause_s, "kv_bytes": outcome.kv_bytes, "kv_tokens": outcome.kv_tokens}
    else:
        stack.loop.loop.call_soon_threadsafe(active.resume_elsewhere, "moved by recompute (benchmark)")
        extra = {}
    stream.join()
    return {"way": way, "pause_s": stream.pause_after(began), "step_s": stream.step_s(), **extra}


def _only_active(active: set[ActiveRequest], timeout_s: float = 10.0) -> ActiveRequest:
    """The one request in flight (the previous run's may take a moment to finish in the router)."""
    deadline = time.monotonic() + timeout_s
    while len(active) != 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(active)} requests in flight, one expected")
        time.sleep(0.001)
    return next(iter(active))


async def _move(active: ActiveRequest, cluster: Cluster):
    return await active.migrate(cluster.router.move_target(active.placement))


def run(cfg: MigrationBenchConfig, log=print) -> dict:
    rng = random.Random(0)
    rows = []
    with Cluster(_manifest(cfg), log=lambda _: None) as cluster:
        vocab = cluster.router_stack.frontend.model.info.vocab_size
        prefill = next(w for w in cluster.workers if w.pool == "prefill")
        decode = next(w for w in cluster.workers if w.pool == "decode")
        for context in cfg.contexts:
            probes = [ray.get(prefill.handle.probe_transfer.remote(decode.handle, context), timeout=120)
                      for _ in range(PROBES)]
            transfer_s = statistics.median(p["handoff_s"] for p in probes)
            runs = []
            for repeat in range(cfg.repeats):
                for way in ("moved", "recomputed") if repeat % 2 == 0 else ("recomputed", "moved"):
                    prompt = [rng.randrange(3, vocab) for _ in range(context - cfg.tokens_before)]
                    runs.append(_one(cluster, cfg, prompt, way))
            row = _row(context, transfer_s, runs)
            rows.append(row)
            log(f"  {context:5d} tokens: moved p50 {row['moved_p50_s'] * 1e3:.1f} ms (p99 "
                f"{row['moved_p99_s'] * 1e3:.1f}), recomputed p50 {row['recomputed_p50_s'] * 1e3:.1f} ms; "
                f"target {row['target_s'] * 1e3:.1f} ms")
    result = {"benchmark": "migration", "provenance": provenance(),
              "config": {k: str(v) for k, v in asdict(cfg).items()}, "rows": rows}
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(result, indent=2))
    log(markdown(result))
    log(f"wrote {cfg.out}")
    return result


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _row(context: int, transfer_s: float, runs: list[dict]) -> dict:
    by_way = {way: [r for r in runs if r["way"] == way] for way in ("moved", "recomputed")}
    step_s = statistics.median(r["step_s"] for r in runs)
    row = {"context": context, "step_s": step_s, "transfer_s": transfer_s, "target_s": 2 * step_s + transfer_s,
           "kv_bytes": statistics.median(r["kv_bytes"] for r in by_way["moved"]),
           "worker_pause_p50_s": statistics.median(r["worker_pause_s"] for r in by_way["moved"]), "runs": runs}
    for way, way_runs in by_way.items():
        pauses = [r["pause_s"] for r in way_runs]
        row[f"{way}_p50_s"], row[f"{way}_p99_s"] = statistics.median(pauses), _percentile(pauses, 0.99)
    return row


def markdown(result: dict) -> str:
    cfg, rows = result["config"], result["rows"]
    lines = [
        f"{cfg['model']}, a local cluster of 1 prefill + 2 decode workers (one torch thread each, KV transport "
        f"{cfg['transport']}), one greedy stream at a time, each prompt fresh; {cfg['repeats']} runs per context "
        f"length and way, alternating. After {cfg['tokens_before']} tokens the request moves to the other decode "
        "worker: *moved* with its KV (live migration), or *recomputed* from its tokens there. The pause is the "
        "longest gap between two tokens the client received from the move's start; the target, two decode steps "
        "(the stream's median gap) plus the transfer of the same tokens' KV (the transfer probe, reserve to abort).",
        "",
        "| context (tokens) | KV moved | moved p50 (ms) | moved p99 (ms) | recomputed p50 (ms) | recomputed p99 (ms) "
        "| decode step (ms) | KV transfer (ms) | target (ms) | moved p50 within |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        met = "yes" if r["moved_p50_s"] <= r["target_s"] else f"no (+{(r['moved_p50_s'] / r['target_s'] - 1):.0%})"
        lines.append(f"| {r['context']} | {r['kv_bytes'] / 2**20:.1f} MiB | {r['moved_p50_s'] * 1e3:.1f} | "
                     f"{r['moved_p99_s'] * 1e3:.1f} | {r['recomputed_p50_s'] * 1e3:.1f} | "
                     f"{r['recomputed_p99_s'] * 1e3:.1f} | {r['step_s'] * 1e3:.1f} | {r['transfer_s'] * 1e3:.1f} | "
                     f"{r['target_s'] * 1e3:.1f} | {met} |")
    ratio = [r["recomputed_p50_s"] / r["moved_p50_s"] for r in rows]
    worker = ", ".join(f"{r['worker_pause_p50_s'] * 1e3:.1f}" for r in rows)
    lines += ["", f"Recomputing paused the stream {min(ratio):.1f}–{max(ratio):.1f}× as long as moving with the KV "
              f"(medians). Of the moved pause, the source worker's part (out of its batch until the target's commit) "
              f"was {worker} ms (median, per context length); the rest is the target's first step and the token's way "
              "to the client. The worker's part exceeds the KV's transfer by the wait for the step under way when "
              "the move is asked (the request leaves the batch between two steps) and the commit's round trip. "
              "Sending the KV while the request still decodes on the source, and only the blocks written since "
              "once it has left the batch (pre-copy), would take most of the transfer out of the pause."]
    return "\n".join(lines)
