"""`pdserve soak`: minutes of trace-driven load with faults injected, and proof that nothing was lost.

A local cluster (2 prefill + 2 decode workers, `--kv-corrupt-percent` of every KV frame corrupted on
the wire all along) serves the Azure conversation trace's arrivals, replayed at `--rate` requests/s
for the first `LOAD_SHARE` of the run, greedy, each request with a deadline. Meanwhile `--kills`
workers are killed (SIGKILL, by pid), spread evenly between a fifth and three fifths of the run, a
decode worker first, then a prefill worker, and so on: each time the worker of that pool holding the
most requests, once every worker of the pool serves (the last kill's victim is back) and one holds a
request; Ray restarts each. When the trace is done and every killed worker is back, `--storm`
streams are opened and cancelled at once; throughput probes run before, right after, and `settle_s`
after.

Afterwards: every request ended completed or with an explicit error; completed outputs are compared
token by token with the same prompts run undisturbed on one in-process engine (tokens duplicated,
lost or wrong must be 0); every pool is fully free (the cluster's idle audit). The report: requests,
faults, recoveries (per kill, over the requests the router retried because of it, read from their
lifetime records: from the kill to the retry, and to the request's next token; the longest wait of
any request in flight at the kill; and until the killed worker served again; and per pool, the
median and 99th percentile over every retried request), the storm's time to free every pool, and
throughput around it. Written as JSON; `docs/reliability.md` quotes it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray

from pdserve.client import AsyncClient, Client, PDServeError
from pdserve.cluster.bench.loadgen import trace_arrivals
from pdserve.cluster.bench.report import provenance
from pdserve.cluster.bench.workload import (DEFAULT_TRACE, RequestShape, find_trace, load_azure_trace,
                                            random_token_prompts, scale_requests)
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import load_manifest
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.workers import WorkerRef
from pdserve.wire import LifetimeEvent, WorkerStatus

LOAD_SHARE = 0.75  # of the run, trace arrivals; the rest drains them and holds the storm
KILLS_FROM, KILLS_TO = 0.2, 0.6  # the kills' span (shares of the run), within the trace's arrivals
POOLS_KILLED = ("decode", "prefill")  # in turn
PROBE_PROMPTS = (8, 8, 256, 256)  # prompt lengths of the probe's streams
VICTIM_WAIT_S = 10.0  # how long a kill waits for its pool to hold a request
REJOIN_WAIT_S = 60.0  # how long a kill waits for the last victim of its pool to serve again
STORM_PROMPT = 16
STORM_QUIET_S = 1.0  # the storm's cancel waits this long after the last stream that started


@dataclass
class SoakConfig:
    minutes: float = 5.0
    model: str = "llama-20m"
    rate: float = 2.0  # trace requests per second
    max_tokens: int = 32
    max_model_len: int = 1024
    input_scale: float = 0.25
    storm: int = 1000
    kills: int = 2  # workers SIGKILLed, decode and prefill in turn
    kv_corrupt_percent: float = 2.0
    deadline_s: float = 120.0
    probe_s: float = 6.0  # each throughput probe around the storm
    settle_s: float = 10.0  # before a third probe: is the second one the storm's after-effect or the steady state?
    seed: int = 0
    out: Path = Path("bench-results/soak.json")
    log: Any = print


@dataclass
class Stream:
    """One trace request as the client saw it."""

    prompt: list[int]
    started: float = 0.0
    ended: float = 0.0
    code: str = ""  # OK or the gRPC status name it failed with
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    lifetime: dict[str, Any] = field(default_factory=dict)  # the router's lifetime record


class _LifetimeRecords(logging.Handler):
    """Collects the router's lifetime records (one JSON log line per request) by client request id."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: dict[str, dict[str, Any]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        lifetime = json.loads(record.getMessage())
        self.records[lifetime["client_request_id"]] = lifetime


def _pid(worker: Any) -> int:
    return os.getpid()


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.duration = cfg.minutes * 60
        self.streams: list[Stream] = []
        self.kills: list[dict[str, Any]] = []
        self.cluster: Cluster | None = None
        self.vocab = 0
        self.outputs: list[int] = []  # each trace request's output length
        self._watchers: list[asyncio.Task] = []  # one per kill: until the killed worker serves again

    # --- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        room = 2 * cfg.storm + 64  # admission: the storm and the trace are let in whole
        manifest = load_manifest({
            "model": cfg.model, "max_model_len": cfg.max_model_len,
            # Room for every kill to land on one worker.
            "pools": {p: {"replicas": 2, "num_cpus": 0.5, "max_restarts": max(5, cfg.kills)}
                      for p in ("prefill", "decode")},
            "router": {"max_active_decodes": room, "max_queued_prefills": room},
            "server": {"address": "127.0.0.1:0", "http_address": "127.0.0.1:0"},
            "faults": {"kv_corrupt_percent": cfg.kv_corrupt_percent, "seed": cfg.seed},
        })
        lifetimes, logger = _LifetimeRecords(), logging.getLogger("pdserve.lifetime")
        saved = logger.level, logger.propagate
        logger.setLevel(logging.INFO)
        logger.propagate = False  # the records are for the report, not the console
        logger.addHandler(lifetimes)
        try:
            storm, idle, status, audit, faults, retries = self._serve(manifest)
        finally:
            logger.removeHandler(lifetimes)
            logger.level, logger.propagate = saved
        for i, s in enumerate(self.streams):
            s.lifetime = lifetimes.records.get(_label(i), {})
        cfg.log("soak: running the same prompts undisturbed on one engine for the reference ...")
        reference = self._reference([s.prompt for s in self.streams], self.outputs)
        return self._report(storm, reference, idle, status, audit, faults, retries)

    def _serve(self, manifest: Any) -> tuple[dict, bool, list[WorkerStatus], dict, dict, int]:
        cfg = self.cfg
        with Cluster(manifest, log=cfg.log) as cluster:
            self.cluster = cluster
            with Client(cluster.address, timeout=30) as client:
                self.vocab = client.model_info().vocab_size
            arrivals, prompts, self.outputs = self._workload()
            self.streams = [Stream(p) for p in prompts]
            cfg.log(f"soak: {len(prompts)} requests over {self.duration * LOAD_SHARE:.0f} s, kills at "
                    f"{', '.join(f'{p} {t * self.duration:.0f} s' for p, t in self._kill_times())}, storm of "
                    f"{cfg.storm}")
            storm = asyncio.run(self._drive(cluster.address, arrivals, self.outputs))
            idle, status = cluster.wait_idle(60)
            return storm, idle, status, self._wait_audit(cluster), self._fault_counts(cluster), cluster.router.stats.retries

    def _workload(self) -> tuple[list[float], list[list[int]], list[int]]:
        cfg = self.cfg
        n = max(1, round(cfg.rate * self.duration * LOAD_SHARE))
        trace = load_azure_trace(find_trace(DEFAULT_TRACE))
        rows = scale_requests([trace[i % len(trace)] for i in range(n)], cfg.input_scale, 1.0, cfg.max_model_len,
                              max_output=cfg.max_tokens)
        stamps = [r.arrival_s + (i // len(trace)) * (trace[-1].arrival_s + 1) for i, r in enumerate(rows)]
        span = max(stamps[-1] - stamps[0], 1e-9)
        arrivals = trace_arrivals(stamps, speedup=span / (self.duration * LOAD_SHARE))
        prompts = random_token_prompts(rows, self.vocab, cfg.seed)
        return arrivals, prompts, [r.output_len for r in rows]

    async def _drive(self, address: str, arrivals: list[float], outputs: list[int]) -> dict[str, Any]:
        t0 = time.monotonic()
        async with AsyncClient(address, timeout=self.cfg.deadline_s) as client:
            load = [asyncio.create_task(self._one(client, i, t0 + a, n))
                    for i, (a, n) in enumerate(zip(arrivals, outputs))]
            for pool, at in self._kill_times():
                await asyncio.sleep(max(0.0, t0 + at * self.duration - time.monotonic()))
                await self._kill(pool)
            await asyncio.gather(*load)
            await asyncio.sleep(max(0.0, t0 + LOAD_SHARE * self.duration - time.monotonic()))
            await asyncio.gather(*self._watchers)  # the storm measures aborts on the whole cluster
            return await self._storm(client)

    def _kill_times(self) -> list[tuple[str, float]]:
        """(pool, when as a share of the run) of each kill."""
        n = self.cfg.kills
        return [(POOLS_KILLED[i % 2], KILLS_FROM + (KILLS_TO - KILLS_FROM) * i / max(1, n - 1)) for i in range(n)]

    async def _one(self, client: AsyncClient, i: int, at: float, max_tokens: int) -> None:
        s = self.streams[i]
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        s.started = time.monotonic()
        try:
            async for chunk in client.generate_stream(s.prompt, max_tokens=max_tokens, temperature=0,
                                                      ignore_eos=True, request_id=_label(i)):
                s.tokens += chunk.token_ids
                s.token_times.append(time.monotonic())
            s.code = "OK"
        except PDServeError as e:
            s.code = e.code.name
        s.ended = time.monotonic()

    async def _kill(self, pool: str) -> None:
        """SIGKILL the worker of `pool` holding the most requests, once every worker of the pool serves
        (up to `REJOIN_WAIT_S`: each kill is measured on a whole pool) and one holds a request (up to
        `VICTIM_WAIT_S`: a kill in a lull would measure nothing); note what was in flight."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + REJOIN_WAIT_S
        while not all(w.healthy for w in self.cluster.workers if w.pool == pool) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        workers = [w for w in self.cluster.workers if w.pool == pool and w.healthy]
        # The pids first: a short prompt pass is over sooner than one more call would take.
        pids = await loop.run_in_executor(
            None, lambda: ray.get([w.handle.__ray_call__.remote(_pid) for w in workers], timeout=30))
        deadline = time.monotonic() + VICTIM_WAIT_S
        while True:
            status = await loop.run_in_executor(
                None, lambda: ray.get([w.handle.ping.remote() for w in workers], timeout=30))
            held, victim = max((s.requests + s.jobs, w.name) for w, s in zip(workers, status))
            if held or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        victim, pid = next((w, pid) for w, pid in zip(workers, pids) if w.name == victim)
        at, wall = time.monotonic(), time.time()
        os.kill(pid, signal.SIGKILL)
        in_flight = [i for i, s in enumerate(self.streams) if s.started and not s.ended]
        self.cfg.log(f"soak: killed {victim.name} (pid {pid}) with {len(in_flight)} requests in flight")
        kill = {"worker": victim.name, "pool": pool, "at": at, "wall": wall, "in_flight": in_flight}
        self.kills.append(kill)
        self._watchers.append(asyncio.create_task(self._watch_rejoin(victim, kill)))

    async def _watch_rejoin(self, worker: WorkerRef, kill: dict[str, Any]) -> None:
        while worker.healthy and time.monotonic() - kill["at"] < 10:  # the supervisor has yet to notice
            await asyncio.sleep(0.05)
        while not worker.healthy and time.monotonic() - kill["at"] < 300:
            await asyncio.sleep(0.05)
        kill["rejoined_s"] = time.monotonic() - kill["at"] if worker.healthy else None

    async def _storm(self, client: AsyncClient) -> dict[str, Any]:
        """Open `storm` streams, cancel them all at once, and time how long until every pool is free.

        The cancel comes once the router has placed every stream and those it can run are streaming:
        beyond the decode pools' batch limit (`max_num_seqs` per worker) the rest wait in a queue, so
        the storm hits streams in every state (streaming, transferring, queued)."""
        cfg, loop = self.cfg, asyncio.get_running_loop()
        before = await self._probe(client)
        routed_before = self.cluster.router.stats.requests_routed
        started = 0

        def placed_now() -> int:  # placements count a retried stream again: at most every stream
            return min(cfg.storm, self.cluster.router.stats.requests_routed - routed_before)

        async def hold(prompt: list[int]) -> None:
            nonlocal started
            async for _ in client.generate_stream(prompt, max_tokens=cfg.max_model_len - STORM_PROMPT - 1,
                                                  temperature=0, ignore_eos=True):
                started += 1
                await asyncio.sleep(3600)  # holds the stream open until cancelled

        prompts = random_token_prompts([RequestShape(STORM_PROMPT, 0)] * cfg.storm, self.vocab, cfg.seed + 1)
        tasks = [asyncio.create_task(hold(p)) for p in prompts]
        deadline, last_start, seen = time.monotonic() + 60, time.monotonic(), 0
        while started < cfg.storm and time.monotonic() < deadline and not any(t.done() for t in tasks):
            await asyncio.sleep(0.05)
            if started > seen:
                seen, last_start = started, time.monotonic()
            if placed_now() == cfg.storm and time.monotonic() - last_start > STORM_QUIET_S:
                break  # every stream is placed and no more are starting: the rest are queued
        opened, placed = started, placed_now()
        t_cancel = time.monotonic()
        for t in tasks:
            t.cancel()
        ended = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [e for e in ended if isinstance(e, Exception)]  # cancelled ones end in CancelledError
        refused = Counter(e.code.name if isinstance(e, PDServeError) else type(e).__name__ for e in failed)
        if failed:
            cfg.log(f"soak: {len(failed)} storm streams failed before the cancel, e.g. {failed[0]}")
        idle, _ = await loop.run_in_executor(None, lambda: self.cluster.wait_idle(60))
        freed_s = time.monotonic() - t_cancel
        after = await self._probe(client)
        await asyncio.sleep(cfg.settle_s)
        settled = await self._probe(client)
        cfg.log(f"soak: storm of {placed} streams ({opened} streaming) cancelled; every pool free after "
                f"{freed_s:.2f} s; throughput {before:.0f} -> {after:.0f} tokens/s ({settled:.0f} after "
                f"{cfg.settle_s:.0f} s more)")
        return {"streams": cfg.storm, "placed": placed, "opened": opened, "refused": dict(refused),
                "freed_s": freed_s, "freed": idle,
                "tokens_per_s_before": before, "tokens_per_s_after": after, "tokens_per_s_settled": settled}

    async def _probe(self, client: AsyncClient) -> float:
        """Generated tokens per second of 4 greedy streams back to back for `probe_s`: two short prompts
        and two long ones, each far from the router's bound for prefilling on the decode worker
        (measured 30 to 60 tokens here), so that every probe takes the same paths. A 32-token probe
        sat on that bound and flipped between the paths with the step costs, by up to 40%."""
        shapes = [RequestShape(n, 0) for n in PROBE_PROMPTS]
        prompts = random_token_prompts(shapes, self.vocab, self.cfg.seed + 2)
        tokens, t_end = 0, time.monotonic() + self.cfg.probe_s

        async def loop_one(prompt: list[int]) -> None:
            nonlocal tokens
            while time.monotonic() < t_end:
                tokens += len((await client.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True)).token_ids)

        t0 = time.monotonic()
        await asyncio.gather(*(loop_one(p) for p in prompts))
        return tokens / (time.monotonic() - t0)

    def _wait_audit(self, cluster: Cluster) -> dict[str, Any]:
        audits = cluster.audit.clean + cluster.audit.dirty
        deadline = time.monotonic() + 60
        while cluster.audit.clean + cluster.audit.dirty == audits and time.monotonic() < deadline:
            time.sleep(0.2)
        last = cluster.audit.last
        return {"clean": bool(last and last.clean), "held": last.held if last else None,
                "audits_clean": cluster.audit.clean, "audits_dirty": cluster.audit.dirty}

    @staticmethod
    def _fault_counts(cluster: Cluster) -> dict[str, int]:
        """KV frames corrupted, as counted by the workers alive now (a killed worker's count died with it)."""
        counts = ray.get([w.handle.__ray_call__.remote(lambda self: dict(self.faults.counts)) for w in cluster.workers],
                         timeout=30)
        return dict(sum((Counter(c) for c in counts), Counter()))

    def _reference(self, prompts: list[list[int]], outputs: list[int]) -> list[list[int]]:
        done = [i for i, s in enumerate(self.streams) if s.code == "OK"]
        llm = LLM(self.cfg.model, max_model_len=self.cfg.max_model_len, kv_memory_bytes=256 * 2**20)
        results = llm.generate([prompts[i] for i in done],
                               [SamplingParams.greedy(outputs[i], ignore_eos=True) for i in done])
        out: list[list[int]] = [[] for _ in prompts]
        for i, r in zip(done, results):
            out[i] = list(r.token_ids)
        return out

    # --- the report -----------------------------------------------------------------------------
    def _report(self, storm: dict, reference: list[list[int]], idle: bool, status: list[WorkerStatus],
                audit: dict, faults: dict, retries: int) -> dict[str, Any]:
        codes = Counter(s.code or "NEVER_ENDED" for s in self.streams)
        duplicated = lost = wrong = 0
        for s, ref in zip(self.streams, reference):
            if s.code != "OK":
                continue
            duplicated += max(0, len(s.tokens) - len(ref))
            lost += max(0, len(ref) - len(s.tokens))
            wrong += sum(a != b for a, b in zip(s.tokens, ref))
        for k in self.kills:
            k.update(self._recovery(k))
        report = {
            "benchmark": "soak", "provenance": provenance(),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.cfg).items() if k != "log"},
            "requests": len(self.streams), "codes": dict(codes), "retries": retries,
            "faults": {"workers_killed": len(self.kills), **faults, "storm_streams": storm["placed"]},
            "kills": self.kills,
            "recovery_s": {pool: _spread([t for k in self.kills if k["pool"] == pool for t in k["recoveries_s"]])
                           for pool in POOLS_KILLED[:min(2, len(self.kills))]},
            "tokens": {"duplicated": duplicated, "lost": lost, "wrong": wrong,
                       "compared": sum(len(r) for r in reference)},
            "storm": storm, "pools_free_at_end": idle, "audit": audit,
            "held_at_end": {s.worker_id: s.holdings for s in status if s.holdings},
        }
        report["ok"] = (codes.get("NEVER_ENDED", 0) == 0 and duplicated == lost == wrong == 0 and idle
                        and audit["clean"] and storm["freed"])
        self.cfg.out.parent.mkdir(parents=True, exist_ok=True)
        self.cfg.out.write_text(json.dumps(report, indent=2))
        return report

    def _recovery(self, kill: dict[str, Any]) -> dict[str, Any]:
        """What one kill cost the requests in flight at that moment. Those the router retried after the
        kill were affected: from the kill to their retry (detection) and to their first token after the
        retry (recovery; a token the dead worker sent just before dying can arrive after the kill).
        Every one of them: the longest wait for a next token that spans the kill."""
        at, wall = kill.pop("at"), kill.pop("wall")
        in_flight = [self.streams[i] for i in kill.pop("in_flight")]
        detect, recover, waits = [], [], []
        for s in in_flight:
            times = [s.started, *s.token_times, s.ended]
            waits += [b - max(a, at) for a, b in zip(times, times[1:]) if b > at]
            record = s.lifetime
            since_kill = [record["accepted"] + ms / 1e3 - wall for name, ms in record.get("events_ms", {}).items()
                          if LifetimeEvent.of(name) is LifetimeEvent.RETRY]
            retried = [t for t in since_kill if t >= 0]
            if retried:
                detect.append(first := min(retried))
                recover.append(next((t - at for t in s.token_times if t - at > first), s.ended - at))
        return {"in_flight": len(in_flight), "affected": len(recover),
                "detect_s": max(detect, default=None), "recovery_s": max(recover, default=0.0),
                "recoveries_s": recover, "longest_wait_s": max(waits, default=0.0)}


def _spread(values: list[float]) -> dict[str, Any]:
    """Median, 99th percentile (nearest rank: the largest under 100 values) and largest, of how many."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {"n": len(ordered), "p50": statistics.median(ordered),
            "p99": ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)], "max": ordered[-1]}


def _label(i: int) -> str:
    return f"soak-{i}"


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    return Soak(cfg).run()


def _kills_said(report: dict[str, Any]) -> str:
    pools = Counter(k["pool"] for k in report["kills"])
    said = ", ".join(f"{pool} workers {n} time{'s' if n > 1 else ''}" for pool, n in pools.items())
    return f"SIGKILLs: {said}" if said else "no worker killed"


def _pool_rows(report: dict[str, Any]) -> list[str]:
    """Per pool, over its kills: what was retried, detection, and recovery's spread over every retried
    request."""
    rows = []
    for pool, spread in report["recovery_s"].items():
        kills = [k for k in report["kills"] if k["pool"] == pool]
        detected = [k["detect_s"] for k in kills if k["detect_s"] is not None]
        rejoined = [k["rejoined_s"] for k in kills if k["rejoined_s"] is not None]
        rows += [
            f"| {pool} kills ({', '.join(sorted({k['worker'] for k in kills}))}): requests in flight / retried | "
            f"{len(kills)} kills: {sum(k['in_flight'] for k in kills)} / {spread['n']} |",
            f"| {pool} kills: detected, median of the kills | "
            f"{_seconds(statistics.median(detected) if detected else None)} |",
            f"| {pool} kills: kill to the next token after the retry, p50 / p99 / max of the retried requests | "
            f"**{_seconds(spread['p50'])} / {_seconds(spread['p99'])}** / {_seconds(spread['max'])} |",
            f"| {pool} kills: longest wait of any request in flight, largest | "
            f"{_seconds(max(k['longest_wait_s'] for k in kills))} |",
            f"| {pool} worker serving again after its kill, median | "
            f"{_seconds(statistics.median(rejoined) if rejoined else None)} |",
        ]
    return rows


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def markdown(report: dict[str, Any]) -> str:
    """The soak's section of docs/benchmarks.md: what ran, what was lost (nothing, to pass), and what the
    faults cost."""
    c, t, st, audit = report["config"], report["tokens"], report["storm"], report["audit"]
    ok = report["codes"].get("OK", 0)
    errors = report["requests"] - ok
    lines = [
        f"{c['model']}; the Azure conversation trace's arrivals at {c['rate']:g} req/s for {c['minutes']:g} min; "
        f"2 prefill + 2 decode workers; {c['kv_corrupt_percent']:g}% of KV frames corrupted; {_kills_said(report)}; "
        f"a storm of {c['storm']} streams cancelled at once. "
        f"**{'PASS' if report['ok'] else 'FAIL'}**.",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| trace requests completed | {ok} of {report['requests']}, {errors} ended otherwise "
        f"({', '.join(f'{code} {n}' for code, n in sorted(report['codes'].items()) if code != 'OK') or 'none'}) |",
        f"| tokens duplicated / lost / wrong, of {t['compared']:,} compared with an undisturbed run | "
        f"**{t['duplicated']} / {t['lost']} / {t['wrong']}** |",
    ]
    if len(report["kills"]) <= 2:
        for k in report["kills"]:
            lines.append(f"| {k['pool']} kill ({k['worker']}): {k['affected']} of {k['in_flight']} in flight retried; "
                         f"detected / next token after the retry / longest wait of any | {_seconds(k['detect_s'])} / "
                         f"**{_seconds(k['recovery_s'])}** / {_seconds(k['longest_wait_s'])} |")
            lines.append(f"| {k['pool']} worker serving again after its kill | {_seconds(k['rejoined_s'])} |")
    else:
        lines += _pool_rows(report)
    lines += [
        f"| storm of {st['placed']} streams ({st['opened']} streaming): cancel to every pool free | "
        f"**{st['freed_s']:.2f} s** |",
        f"| throughput of 4 probe streams: before the storm / right after / {c['settle_s']:g} s later | "
        f"{st['tokens_per_s_before']:.0f} / {st['tokens_per_s_after']:.0f} / {st['tokens_per_s_settled']:.0f} "
        f"tokens/s |",
        f"| pools free at the end; idle audit | {'yes' if report['pools_free_at_end'] else 'no'}; "
        f"{audit['audits_clean']} clean audits, {audit['audits_dirty']} dirty |",
        "",
        "How it is measured, what each fault exercises, and the targets: "
        "[Reliability](reliability.md#the-soak-run).",
    ]
    return "\n".join(lines)
