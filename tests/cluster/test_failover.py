"""Failover without losing a token: worker processes killed for real (SIGKILL, by pid) mid-stream and
by the manifest's fault injection, KV frames corrupted and dropped on the wire, streams cancelled in
bulk; every request completes with exactly the undisturbed tokens, and the idle audit finds the pools
fully free afterwards."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from functools import partial

import pytest
import ray
from cluster_helpers import install_gate, manifest, on_worker, open_gate, wait_clean_audit, wait_healthy, worker_pid
from helpers import random_prompts, worker_status

from pdserve.client import Client
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.supervisor import HEALTH_GROUP, WATCH_GROUP, RestartBackoff, Supervisor
from pdserve.deadlines import HealthDeadlines
from pdserve.router.frontend import DEAD_WORKER_CHECK_S
from pdserve.router.workers import WorkerRef
from pdserve.wire import WorkerStatus

ARCH = "tiny-llama"
STALL_MS = 15  # every decode step stalls this long, so a kill lands mid-stream
WORKERS = ["prefill-0", "prefill-1", "decode-2", "decode-3"]
WORKERS_1P2D = ["prefill-0", "decode-1", "decode-2"]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # functions run inside the workers travel by value



@pytest.fixture(scope="module")
def cluster(model_dirs):
    faults = {"kill_after_requests": {"prefill-0": 3}, "stall_every_steps": 1, "stall_ms": STALL_MS,
              "kv_corrupt_percent": 20, "kv_drop_percent": 10, "workers": ["prefill-1", "decode-2", "decode-3"]}
    pools = {pool: {"replicas": 2, "num_cpus": 0.25, "max_restarts": 5} for pool in ("prefill", "decode")}
    # Round robin over the prefill pool: prefill-0 takes every other request, so its third comes soon.
    router = {"prefill_policy": "round_robin"}
    with Cluster(manifest(model_dirs[ARCH], pools=pools, faults=faults, router=router), log=lambda _: None) as c:
        assert [w.name for w in c.workers] == WORKERS
        yield c



def first_worker(cluster: Cluster, pool: str, condition, timeout_s: float = 30.0):
    """The first worker of `pool` for which `condition(worker instance)` holds, asking each (bounded).
    A worker dying as it is asked (prefill-0 kills itself on a request, by the manifest) is not it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in (w for w in cluster.workers if w.pool == pool and w.healthy):
            try:
                if on_worker(w, condition):
                    return w
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                continue
        time.sleep(0.02)
    pytest.fail(f"no {pool} worker got there within {timeout_s} s")


def test_a_prefill_worker_killed_by_the_manifest_is_retried_on_another(cluster, hf_reference):
    """prefill-0 kills itself on taking its third request; every request still completes, exactly."""
    wait_healthy(cluster)
    prompts = random_prompts(8, hf_reference[ARCH].vocab_size, 20, 90, seed=11)
    retries = cluster.router.stats.retries
    with Client(cluster.address, timeout=120) as client:
        # One at a time: prefill-0 is chosen for some of them, and dies with its third in flight.
        outputs = [client.generate(p, max_tokens=6, temperature=0, ignore_eos=True).token_ids for p in prompts]
    assert outputs == [hf_reference[ARCH].greedy(p, 6) for p in prompts]
    prefill_0 = cluster.workers[0]
    assert cluster.router.stats.per_worker[prefill_0.name] >= 3, "prefill-0 never took its third request"
    assert cluster.router.stats.retries > retries
    wait_healthy(cluster)
    assert on_worker(prefill_0, lambda self: ray.get_runtime_context().was_current_actor_reconstructed)
    wait_clean_audit(cluster)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_a_decode_worker_killed_mid_stream_costs_no_token(cluster, hf_reference, sampling):
    wait_healthy(cluster)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 40, 40, seed=5)[0]
    params = dict(max_tokens=160, ignore_eos=True, **sampling)
    with Client(cluster.address, timeout=120) as client:
        undisturbed = client.generate(prompt, **params).token_ids
        if not sampling.get("seed"):
            assert undisturbed == hf_reference[ARCH].greedy(prompt, 160)
        retries = cluster.router.stats.retries
        stream = client.generate(prompt, stream=True, **params)
        streamed = []
        for chunk in stream:
            streamed += chunk.token_ids
            if len(streamed) >= 20:
                break
        victim = first_worker(cluster, "decode", lambda self: len(self.engine.requests) > 0)  # one stream runs
        victim.least_fixed_step_s = 0.0  # a bound no fit of its next process shows
        os.kill(on_worker(victim, worker_pid), signal.SIGKILL)
        t0 = time.monotonic()
        for chunk in stream:
            streamed += chunk.token_ids
            if chunk.finish_reason:
                final = chunk
        assert streamed == undisturbed  # no token repeated, none missing, the same tokens
        assert final.finish_reason == "length"
        assert cluster.router.stats.retries == retries + 1
        assert time.monotonic() - t0 < 30
    wait_healthy(cluster)  # Ray restarted it; it measured itself and rejoined
    assert victim.least_fixed_step_s > 0  # its old process's fits bound its costs no more
    wait_clean_audit(cluster)


class BackgroundStream:
    """One greedy streaming request, consumed on a thread: its tokens, when the first came, and any
    failure (seen by the test, not lost with the thread)."""

    def __init__(self, cluster: Cluster, prompt: list[int], max_tokens: int) -> None:
        self.tokens: list[int] = []
        self.first = threading.Event()
        self.failures: list[Exception] = []
        self._thread = threading.Thread(target=self._consume, args=(cluster.address, prompt, max_tokens))
        self._thread.start()

    def _consume(self, address: str, prompt: list[int], max_tokens: int) -> None:
        try:
            with Client(address, timeout=120) as client:
                for chunk in client.generate(prompt, stream=True, max_tokens=max_tokens, temperature=0,
                                             ignore_eos=True):
                    self.tokens.extend(chunk.token_ids)
                    self.first.set()
        except Exception as e:
            self.failures.append(e)

    def join(self) -> None:
        self._thread.join(120)


def gate_handoffs(self, moment: str) -> None:
    """Stop the worker's KV handoffs until `open_gate`, and set `test_reached` when one is stopped:
    "mid-pass" after layer 0's KV went out, "before-commit" once the prompt pass is over (the first
    token leaves) and before the commit."""
    reached, gate = threading.Event(), threading.Event()

    def stop_here():
        reached.set()
        gate.wait(30)

    if moment == "mid-pass":
        runner = self.engine.runner
        original_hook = runner.layer_hook

        def hook(layer, chunks):
            original_hook(layer, chunks)
            if layer == 0:
                stop_here()

        runner.layer_hook = hook
        restore = partial(setattr, runner, "layer_hook", original_hook)
    else:  # the channel's frames are waited for on the link, just before the commit
        original_finish = self.sender._finish_channel

        def finish(*args):
            stop_here()
            return original_finish(*args)

        self.sender._finish_channel = finish
        restore = partial(setattr, self.sender, "_finish_channel", original_finish)
    self.test_reached, self.test_gate = reached, (gate, restore)


@pytest.mark.parametrize("moment", ["mid-pass", "before-commit"])
@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_a_worker_killed_during_the_kv_handoff_costs_no_token(cluster, hf_reference, moment, victim):
    """The prefill or the decode worker of a transfer dies in the middle of the prompt pass (layer 0
    sent), or after the first token left but before the handoff committed. The request is tried again
    elsewhere; the client sees each token once (a first token already sent is not sent again)."""
    wait_healthy(cluster)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 60, 60, seed=17)[0]
    prefill_workers = [w for w in cluster.workers if w.pool == "prefill"]
    for w in prefill_workers:
        on_worker(w, gate_handoffs, moment)
    retries = cluster.router.stats.retries
    stream = BackgroundStream(cluster, prompt, 12)
    killed = None
    try:
        serving = first_worker(cluster, "prefill", lambda self: self.test_reached.is_set())
        if moment == "before-commit":
            assert stream.first.wait(60), "no first token"
        killed = serving if victim == "prefill" else first_worker(
            cluster, "decode", lambda self: self.receiver.num_in_flight > 0)
        os.kill(on_worker(killed, worker_pid), signal.SIGKILL)
    finally:
        for w in prefill_workers:  # a killed worker restarts ungated
            if w is not killed:
                on_worker(w, open_gate)
        stream.join()
    assert not stream.failures and stream.tokens == hf_reference[ARCH].greedy(prompt, 12), stream.failures
    assert cluster.router.stats.retries == retries + 1
    wait_healthy(cluster)
    wait_clean_audit(cluster)


def test_a_prefill_worker_lost_after_the_commit_is_no_longer_needed(cluster, hf_reference):
    """Once the handoff committed, the prefill worker tells the router: losing it before the decode
    worker's first token (here: held back) costs no retry."""
    wait_healthy(cluster)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 60, 60, seed=19)[0]
    decode_workers = [w for w in cluster.workers if w.pool == "decode"]
    for w in decode_workers:
        on_worker(w, install_gate, "sink.send_step")  # their tokens wait: the router hears only of the commit
    committed = {w.name: on_worker(w, lambda self: len(self.sender.transfer_log))
                 for w in cluster.workers if w.pool == "prefill"}
    retries = cluster.router.stats.retries
    stream = BackgroundStream(cluster, prompt, 8)
    try:
        serving = first_worker(cluster, "prefill", lambda self, before=committed: len(self.sender.transfer_log) > before.get(
            self.worker_id, 0))
        time.sleep(1.0)  # the notice, sent before the log entry, reaches the router
        os.kill(on_worker(serving, worker_pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while serving.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not serving.healthy, "the supervisor never noticed the kill"
        time.sleep(2 * DEAD_WORKER_CHECK_S)  # the waiting stream has looked at its workers since
    finally:
        for w in decode_workers:
            on_worker(w, open_gate)
        stream.join()
    assert not stream.failures and stream.tokens == hf_reference[ARCH].greedy(prompt, 8), stream.failures
    assert cluster.router.stats.retries == retries
    wait_healthy(cluster)
    wait_clean_audit(cluster)


def test_corrupt_and_dropped_kv_frames_change_no_token(cluster, hf_reference):
    """prefill-1 corrupts a fifth of its frames and drops a tenth: resent or recomputed, never served."""
    wait_healthy(cluster)
    prompts = random_prompts(6, hf_reference[ARCH].vocab_size, 100, 300, seed=13)
    with Client(cluster.address, timeout=120) as client:
        outputs = [client.generate(p, max_tokens=4, temperature=0, ignore_eos=True).token_ids for p in prompts]
    assert outputs == [hf_reference[ARCH].greedy(p, 4) for p in prompts]
    counts = on_worker(cluster.workers[1], lambda self: dict(self.faults.counts))
    assert counts.get("kv_corrupted", 0) + counts.get("kv_dropped", 0) > 0, counts
    wait_clean_audit(cluster)


def test_the_idle_audit_is_on_metrics(cluster):
    import urllib.request

    wait_clean_audit(cluster)
    text = urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10).read().decode()
    assert 'pdserve_idle_audits_total{result="clean"}' in text
    held = [line for line in text.splitlines() if line.startswith("pdserve_idle_audit_held_blocks{")]
    assert len(held) == len(WORKERS) and all(line.endswith(" 0.0") for line in held), held


@ray.remote(num_cpus=0, concurrency_groups={HEALTH_GROUP: 1, WATCH_GROUP: 1})
class Pingable:
    def __init__(self, status: WorkerStatus) -> None:
        self.up = True
        self.status = status
        self.closed = threading.Event()

    def watch(self) -> None:
        self.closed.wait()

    def pid(self) -> int:
        return os.getpid()

    def set_up(self, up: bool) -> None:
        self.up = up

    def ping(self) -> WorkerStatus:
        if not self.up:
            raise RuntimeError("down")
        return self.status


def test_a_health_change_whose_report_failed_is_reported_by_the_next_round(cluster):
    """`on_change` (the router's health publication) raises once: the next round reports the change
    again, instead of comparing with its own start and seeing none."""
    actor = Pingable.remote(worker_status())
    calls: list[list[bool]] = []
    ref = WorkerRef("w0", "decode", actor)

    def on_change() -> None:
        calls.append([ref.healthy])
        if len(calls) == 1:
            raise RuntimeError("publication failed")

    supervisor = Supervisor([ref], on_change)  # not started: the test runs its rounds
    try:
        ray.get(actor.set_up.remote(True))  # its process is up: the first round's ping is answered in that round
        supervisor.check_once()
        assert calls == []
        ray.get(actor.set_up.remote(False))
        with pytest.raises(RuntimeError, match="publication failed"):
            supervisor.check_once()
        supervisor.check_once()
        assert calls == [[False], [False]]
        supervisor.check_once()  # nothing new: nothing reported
        assert len(calls) == 2
    finally:
        ray.kill(actor)


def test_a_worker_that_reports_its_fault_is_out_with_that_reason_until_it_reports_alive(cluster):
    """A request the worker served is failed by the router's health check or by the worker's own
    error, whichever comes first: both must name the fault, so the worker's reason is kept."""
    reason = "w0: engine loop failed: RuntimeError: boom"
    failed, restarted = Pingable.remote(worker_status(alive=False, fault=reason)), Pingable.remote(worker_status())
    ref = WorkerRef("w0", "decode", failed)
    supervisor = Supervisor([ref], on_change=lambda: None)  # not started: the test runs its rounds
    try:
        ray.get([failed.pid.remote(), restarted.pid.remote()])  # up: each round's ping is answered in it
        supervisor.check_once()
        assert not ref.healthy and ref.fault == reason and supervisor.restarts == {"w0": 1}
        ref.handle = restarted  # as Ray's restart would have it: the same name, a new process
        supervisor.check_once()
        assert ref.healthy and ref.fault is None
    finally:
        ray.kill(failed)
        ray.kill(restarted)


def test_a_workers_death_is_known_at_once_not_at_the_next_ping_round(cluster):
    """The supervisor's watch call on a worker fails the moment its process dies: the worker is
    unhealthy, and the router told, long before a ping round (a minute apart here) could see it."""
    actor = Pingable.remote(worker_status())
    ref = WorkerRef("w0", "decode", actor)
    told = threading.Event()
    deadlines = HealthDeadlines(ping_interval_s=60.0, ping_timeout_s=5.0)
    supervisor = Supervisor([ref], on_change=told.set, deadlines=deadlines).start()
    try:
        deadline = time.monotonic() + 30
        while "w0" not in supervisor.watched():  # the first round's ping answered: its watch is open
            assert time.monotonic() < deadline, "no watch call was opened on the worker"
            time.sleep(0.01)
        assert ref.healthy and not told.is_set()
        os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
        assert told.wait(30) and not ref.healthy  # the next ping round is a minute after the first
    finally:
        supervisor.stop()
        ray.kill(actor)


def test_a_worker_restarted_again_and_again_waits_longer_each_time_before_rejoining():
    now = [0.0]
    backoff = RestartBackoff(first_s=1.0, max_s=4.0, window_s=60.0, clock=lambda: now[0])

    def wait_out() -> float:
        start = now[0]
        while not backoff.may_rejoin("decode-2"):
            now[0] += 0.25
        backoff.rejoined("decode-2")
        return now[0] - start

    waits = []
    for _ in range(4):
        waits.append(wait_out())
        now[0] += 5  # serves a while, then dies again
    assert waits == [1.0, 2.0, 4.0, 4.0]  # doubling, up to max_s
    now[0] += 61  # a restart long after the last ones starts afresh
    assert wait_out() == 1.0
    assert backoff.may_rejoin("prefill-0") is False  # each worker has its own count


def test_a_stream_on_a_killed_worker_resumes_at_once_not_at_the_next_ping_round(model_dirs, hf_reference):
    """Ping rounds 20 s apart: a decode worker killed mid-stream is known lost when its process dies
    (the supervisor's watch call fails), and the stream resumes on the other decode worker then, not
    when a ping round or the stream's own look would find it."""
    # The victim stays dead: the stream's resumption, not the worker's, is what is timed.
    pools = {"prefill": {"replicas": 1, "num_cpus": 0.25},
             "decode": {"replicas": 2, "num_cpus": 0.25, "max_restarts": 0}}
    faults = {"stall_every_steps": 1, "stall_ms": STALL_MS, "workers": WORKERS_1P2D[1:]}
    slow_pings = {"ping_interval_s": 20, "ping_timeout_s": 5}
    m = manifest(model_dirs[ARCH], pools=pools, faults=faults, supervision=slow_pings, kv_transfer={"lease_s": 60})
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 40, 40, seed=9)[0]
    with Cluster(m, log=lambda _: None) as cluster, Client(cluster.address, timeout=120) as client:
        deadline = time.monotonic() + 30
        while cluster._supervisor.watched() != set(WORKERS_1P2D):  # the first round's pings answered
            assert time.monotonic() < deadline, cluster._supervisor.watched()
            time.sleep(0.01)
        stream = client.generate(prompt, stream=True, max_tokens=120, temperature=0, ignore_eos=True)
        streamed = []
        for chunk in stream:
            streamed += chunk.token_ids
            if len(streamed) >= 20:
                break
        victim = first_worker(cluster, "decode", lambda self: len(self.engine.requests) > 0)
        os.kill(on_worker(victim, worker_pid), signal.SIGKILL)
        killed = time.monotonic()
        resumed = None
        for chunk in stream:
            resumed = resumed or time.monotonic()
            streamed += chunk.token_ids
        assert streamed == hf_reference[ARCH].greedy(prompt, 120)
        assert cluster.router.stats.retries == 1
        # Its next tokens came from the other decode worker before any ping round could have seen the
        # kill (the first after start-up is 20 s later, and two missed ones make a worker lost).
        assert resumed - killed < slow_pings["ping_interval_s"]
