"""A cluster under load and under faults: liveness is not load, cancels at every phase, request ids,
backpressure, and threads that fail loudly. Real Ray actors and gRPC; faults are injected into the
running workers with Ray's `__ray_call__` (a function run inside the actor), not by mocks."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
import ray
from cluster_helpers import (assert_aborted, assert_idle, attribute_owner, install_gate, manifest, on_worker,
                             open_gate, prefill_job_states, record_engine_aborts, set_layerwise_min_tokens,
                             wait_until_idle, worker)
from helpers import random_prompts, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import AsyncClient, Client, DeadlineExceeded, PDServeError, ResourceExhausted
from pdserve.cluster.launcher import Cluster

ARCH = "tiny-llama"
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the injected functions travel by value


def inject_exception(self, path: str) -> None:
    """Replace the callable at `path` with one that raises, as a bug in that code would."""
    owner, name = attribute_owner(self, path)

    def broken(*args, **kwargs):
        raise RuntimeError(f"injected fault in {path}")

    setattr(owner, name, broken)


def quarter_core_pools(**extra) -> dict:
    """Pools asking Ray for a quarter core per worker: this module keeps up to three small clusters up at
    once (Ray's CPUs are logical: the workers still use what they need)."""
    return {pool: {"num_cpus": 0.25, **extra} for pool in ("prefill", "decode")}


def wait_healthy(cluster: Cluster, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while not all(w.healthy for w in cluster.workers):
        assert time.time() < deadline, [(w.name, w.healthy) for w in cluster.workers]
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(model_dirs):
    """The module's cluster. The faults at the end of the file cost its workers a restart each."""
    with Cluster(manifest(model_dirs[ARCH], pools=quarter_core_pools(max_restarts=10)), log=lambda _: None) as c:
        yield c


def test_a_busy_worker_stays_healthy(cluster, hf_reference):
    prefill = worker(cluster, "prefill")
    # Every ordinary thread of the prefill actor blocked for 4 s: its pings must still answer.
    blockers = [prefill.handle.__ray_call__.remote(lambda self: time.sleep(4)) for _ in range(70)]
    channel = grpc.insecure_channel(cluster.address)
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.time() + 3.5
    while time.time() < deadline:
        assert all(w.healthy for w in cluster.workers), [(w.name, w.healthy) for w in cluster.workers]
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        time.sleep(0.1)
    ray.get(blockers)
    channel.close()

    # The reported case: 150 requests at once; busy workers are not dead ones.
    prompts = random_prompts(150, hf_reference[ARCH].vocab_size, 5, 60, seed=21)

    async def burst():
        async with AsyncClient(cluster.address, timeout=120) as client:
            return await asyncio.gather(*(client.generate(p, temperature=0, max_tokens=4, ignore_eos=True)
                                          for p in prompts), return_exceptions=True)

    results = asyncio.run(burst())
    errors = [r for r in results if isinstance(r, Exception) and not isinstance(r, ResourceExhausted)]
    assert not errors, errors[:3]  # past the admission limit (64) busy, never "no healthy worker"
    completed = [(p, r) for p, r in zip(prompts, results) if not isinstance(r, Exception)]
    assert len(completed) >= 64
    for prompt, r in completed[:10]:
        assert r.token_ids == hf_reference[ARCH].greedy(prompt, 4)
    assert_idle(cluster)


def test_reservations_waiting_for_blocks_leave_the_calls_that_free_blocks_a_thread(cluster):
    """More reservations waiting (for blocks, here held at a gate) than the decode actor has ordinary
    threads: an abort, a lease renewal and a commit's kind of call still run at once."""
    from pdserve.engine import SamplingParams

    decode = worker(cluster, "decode")
    on_worker(decode, install_gate, "receiver.reserve")
    ids = [f"held-{i}" for i in range(70)]
    held = [decode.handle.reserve.remote(t, t, [3] * 20, SamplingParams(max_tokens=4), 20) for t in ids]
    try:
        time.sleep(1)  # the reservations reach the actor and take its threads
        assert ray.get(decode.handle.abort_transfer.remote("no-such-transfer", "test"), timeout=10) is False
        with pytest.raises(ray.exceptions.RayTaskError, match="no-such-transfer"):
            ray.get(decode.handle.renew_lease.remote("no-such-transfer"), timeout=10)
    finally:
        ray.get([decode.handle.abort_transfer.remote(t, "test over") for t in ids], timeout=60)  # tombstones
        on_worker(decode, open_gate)
    for ref in held:
        with pytest.raises(ray.exceptions.RayTaskError, match="aborted"):
            ray.get(ref, timeout=60)
    assert_idle(cluster)


def test_duplicate_client_request_ids_are_harmless(cluster, hf_reference):
    prompts = random_prompts(2, hf_reference[ARCH].vocab_size, 20, 40, seed=22)

    async def both():
        async with AsyncClient(cluster.address, timeout=60) as client:
            return await asyncio.gather(*(client.generate(p, request_id="same", temperature=0, max_tokens=8,
                                                          ignore_eos=True) for p in prompts))

    results = asyncio.run(both())
    assert [r.request_id for r in results] == ["same", "same"]  # echoed back
    assert results[0].server_request_id != results[1].server_request_id and results[0].server_request_id
    for prompt, r in zip(prompts, results):
        assert r.token_ids == hf_reference[ARCH].greedy(prompt, 8)
    assert_idle(cluster)


# Where the request is held when its deadline passes: (pool, method gated, the prefill job's states
# there). A short prompt's reservation is asked for as its pass ends: held there, the job waits in
# "bootstrapping" with its first token out.
# phase -> (the pool gated, the callable held there, the states the job is seen in meanwhile: "queued",
# or its transfer's state)
PHASES = {
    "queued": ("prefill", "_start", ("queued",)),
    "reserving": ("decode", "receiver.reserve", ("bootstrapping",)),
    "prefilling": ("prefill", "engine.step", ("bootstrapping", "transferring")),
    "transferring": ("decode", "receiver._decode", ("transferring",)),  # a frame being taken in
    "committing": ("decode", "receiver.commit", ("committing",)),
}


# Over shm every prompt streams its KV layer by layer beside its pass; over gRPC these short prompts'
# KV leaves when the pass ends (the default `layerwise_min_tokens`): a cancel meets either path.
@pytest.fixture(scope="module", params=["shm-layerwise", "grpc-held"])
def transport_cluster(request, model_dirs):
    if request.param == "shm-layerwise":  # the module's cluster streams every prompt's KV layer by layer
        yield request.getfixturevalue("cluster")
        return
    with Cluster(manifest(model_dirs[ARCH], transport="grpc", pools=quarter_core_pools(),
                          kv_transfer={"layerwise_min_tokens": 1024}), log=lambda _: None) as c:
        yield c


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_cancel_at_each_phase_frees_both_pools(transport_cluster, phase):
    cluster = transport_cluster
    pool, path, states = PHASES[phase]
    gated, prefill = worker(cluster, pool), worker(cluster, "prefill")
    on_worker(gated, install_gate, path)
    try:
        with Client(cluster.address) as client, ThreadPoolExecutor(1) as background:
            # A prompt of its own: a cancel lands a little after the client gives up, so an earlier
            # phase's prompt may have run to the end and be cached on the decode worker.
            prompt = [7 + list(PHASES).index(phase)] * 80
            call = background.submit(client.generate, prompt, timeout=2.0, temperature=0, max_tokens=50)
            deadline = time.time() + 10
            while not set(states) & set(on_worker(prefill, prefill_job_states)):
                assert time.time() < deadline, f"the request never reached {states}"
                time.sleep(0.02)
            with pytest.raises(DeadlineExceeded):
                call.result(15)
            # The router's abort takes the job out where it is held, the gate still closed: a request
            # never aborted would stay there until the gate opens, then run to its end.
            assert wait_until(lambda: on_worker(prefill, prefill_job_states) == [], 10), \
                f"the abort never reached the request held at {phase}: {on_worker(prefill, prefill_job_states)}"
    finally:
        on_worker(gated, open_gate)
    assert_idle(cluster)
    with Client(cluster.address, timeout=30) as client:  # and the cluster serves on
        assert len(client.generate([7] * 30, max_tokens=3, ignore_eos=True).token_ids) == 3


def hold_reservations(self) -> None:
    """Hold the decode worker's reservations until `release_reservations`; `self.reserved` is set
    once one has been granted."""
    original, self.release, self.reserved = self.receiver.reserve, threading.Event(), threading.Event()
    self.holding = threading.Event()

    def held(*args, **kwargs):
        self.holding.set()
        self.release.wait(60)
        lease = original(*args, **kwargs)
        self.reserved.set()
        return lease

    self.receiver.reserve = held
    self.restore_reserve = lambda: setattr(self.receiver, "reserve", original)


def release_reservations(self) -> bool:
    """Release them once one is held (bounded: on a loaded machine the reservation, sent beside the
    prompt pass or after it, can reach the decode worker after the first token reached the client); whether one had
    been granted before."""
    self.holding.wait(30)
    granted = self.reserved.is_set()
    self.restore_reserve()
    self.release.set()
    return granted


def stream_releasing_reservations(cluster, decode, prompt: list[int]) -> tuple[list[int], bool | None]:
    """Stream `prompt` (greedy, 8 tokens), releasing `decode`'s held reservations once the first token
    is out (at the end if none came): the tokens, and whether one had been granted before."""
    granted = None
    try:
        with Client(cluster.address, timeout=90) as client:
            tokens: list[int] = []
            for chunk in client.generate(prompt, stream=True, temperature=0, max_tokens=8, ignore_eos=True):
                if granted is None:
                    granted = on_worker(decode, release_reservations)
                tokens.extend(chunk.token_ids)
    finally:
        if granted is None:
            on_worker(decode, release_reservations)
    return tokens, granted


@pytest.mark.parametrize("layerwise_min_tokens", [0, 1024], ids=["asked beside the pass", "asked as it ends"])
def test_the_prompt_pass_never_waits_for_the_reservation(cluster, hf_reference, layerwise_min_tokens):
    """The first token comes while the decode worker's reservation is held up, whether it was asked
    for beside the pass (a prompt whose KV streams beside it) or as the pass ended; the layers written
    before the lease came are sent when it does, and the output is exact."""
    prefill, decode = worker(cluster, "prefill"), worker(cluster, "decode")
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 70, 70, seed=21)[0]
    before = on_worker(prefill, set_layerwise_min_tokens, layerwise_min_tokens)
    on_worker(decode, hold_reservations)
    try:
        tokens, granted_before_first_token = stream_releasing_reservations(cluster, decode, prompt)
    finally:
        on_worker(prefill, set_layerwise_min_tokens, before)
    assert granted_before_first_token is False, "the first token waited for the reservation"
    assert tokens == hf_reference[ARCH].greedy(prompt, 8)
    assert_idle(cluster)


def refuse_a_held_reservation(self) -> None:
    """The next reservation waits until `release_reservations`, then finds the KV memory full (once)."""
    from pdserve.kv_transfer.interface import KVMemoryFull

    original, self.release, self.reserved = self.receiver.reserve, threading.Event(), threading.Event()
    self.holding = threading.Event()

    def refused(*args, **kwargs):
        self.receiver.reserve = original
        self.holding.set()
        self.release.wait(60)
        raise KVMemoryFull("the decode worker's KV memory stayed full (injected)")

    self.receiver.reserve = refused
    self.restore_reserve = lambda: setattr(self.receiver, "reserve", original)


def test_a_full_decode_pool_after_the_first_token_is_waited_out_not_an_error(cluster, hf_reference):
    """The first token is streamed while the reservation is still waiting; then the decode pool turns
    out full (RESOURCE_EXHAUSTED from the prefill worker). The client has tokens already: the router
    retries (a resume from them) instead of ending the stream with an error, and the output is exact."""
    decode = worker(cluster, "decode")
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 70, 70, seed=22)[0]
    retries = cluster.router.stats.retries
    on_worker(decode, refuse_a_held_reservation)
    tokens, _ = stream_releasing_reservations(cluster, decode, prompt)  # then the reservation fails
    assert tokens == hf_reference[ARCH].greedy(prompt, 8)
    assert cluster.router.stats.retries == retries + 1
    assert_idle(cluster)


def hold_engine_loop(self) -> None:
    """The engine loop runs nothing until `release_engine_loop` (a long command, such as profiling)."""
    self.loop_gate = threading.Event()
    self.loop.submit(lambda engine: self.loop_gate.wait(60))


def test_requests_arriving_while_the_prefill_worker_profiles_are_served(cluster, hf_reference):
    """Requests reach a prefill worker while it profiles (as after a restart: Ray delivers calls made
    before the router saw it restart): the feeder took the first and waits for the engine, the second
    queues. Profiling then sets up the queues from the measured costs; both requests are served, and
    exactly (the second was left in the queues profiling replaced)."""
    prefill = worker(cluster, "prefill")
    prompts = random_prompts(2, hf_reference[ARCH].vocab_size, 50, 50, seed=23)
    on_worker(prefill, hold_engine_loop)
    profiled = prefill.handle.profile.remote()  # runs on the engine loop, behind the hold
    with ThreadPoolExecutor(2) as pool:
        with Client(cluster.address) as client:
            outputs = []
            # The first started (its reservation asked for, or its lease taken), the second queued.
            for prompt, queued in zip(prompts, (0, 1)):
                outputs.append(pool.submit(client.generate, prompt, max_tokens=4, temperature=0, timeout=60))
                deadline = time.monotonic() + 20
                while not ((states := on_worker(prefill, prefill_job_states)).count("queued") == queued
                           and len(states) == queued + 1):
                    assert time.monotonic() < deadline, states
                    time.sleep(0.05)
            on_worker(prefill, lambda self: self.loop_gate.set())
            ray.get(profiled, timeout=120)
            assert [out.result(60).token_ids for out in outputs] == [
                hf_reference[ARCH].greedy(prompt, 4) for prompt in prompts]
    assert_idle(cluster)


def test_a_cancel_while_decoding_stops_the_request_and_frees_both_pools(cluster, caplog):
    for w in cluster.workers:
        on_worker(w, record_engine_aborts)
    with caplog.at_level(logging.INFO, logger="pdserve.lifetime"), Client(cluster.address, timeout=60) as client:
        stream = client.generate([11] * 50, stream=True, temperature=0, max_tokens=400, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        assert_aborted(cluster, caplog, "CANCELLED", 400)


def test_streams_cancelled_at_once_are_aborted_in_batches(cluster):
    """40 streams cancelled together: their aborts reach each worker in a few calls carrying many ids
    (one call per request and worker would be 80), and both pools end fully free."""
    streams, started = 40, 0

    async def hold(client: AsyncClient, prompt: list[int]) -> None:
        nonlocal started
        async for _ in client.generate_stream(prompt, temperature=0, max_tokens=400, ignore_eos=True):
            started += 1
            await asyncio.sleep(3600)  # open until cancelled

    async def storm() -> None:
        async with AsyncClient(cluster.address, timeout=120) as client:
            tasks = [asyncio.create_task(hold(client, [5 + i] * 40)) for i in range(streams)]
            for _ in range(1200):  # 60 s at most
                if started >= streams or any(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.05)
            assert started >= streams, [t.exception() for t in tasks if t.done()][:3]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    aborts = cluster.router_stack.server.service.frontend.aborts
    calls_before = aborts.calls
    asyncio.run(storm())
    assert_idle(cluster)
    assert 0 < aborts.calls - calls_before <= streams, aborts.calls - calls_before


def test_overload_ends_in_completions_or_resource_exhausted(model_dirs, hf_reference):
    """A short version of the overload benchmark: every request completes or is refused with a hint."""
    limits = {"router": {"max_queued_prefills": 8, "max_active_decodes": 24}, "kv_memory_mb": 4,
              "pools": quarter_core_pools()}
    distinct = random_prompts(12, hf_reference[ARCH].vocab_size, 10, 120, seed=23)
    prompts = [distinct[i % len(distinct)] for i in range(120)]
    with Cluster(manifest(model_dirs[ARCH], **limits), log=lambda _: None) as c:
        async def burst():
            async with AsyncClient(c.address, timeout=60) as client:
                return await asyncio.gather(*(client.generate(p, temperature=0, max_tokens=8, ignore_eos=True)
                                              for p in prompts), return_exceptions=True)

        t0 = time.time()
        results = asyncio.run(burst())
        elapsed = time.time() - t0
        refused = [r for r in results if isinstance(r, ResourceExhausted)]
        other_errors = [r for r in results if isinstance(r, Exception) and not isinstance(r, ResourceExhausted)]
        assert not other_errors, other_errors[:3]  # no UNAVAILABLE, no deadline passed
        assert refused and len(refused) < len(results), (len(refused), len(results))
        assert all(e.retry_after_s and 0 < e.retry_after_s <= 30 for e in refused)
        for prompt, r in zip(prompts, results):
            if not isinstance(r, Exception):
                assert r.token_ids == hf_reference[ARCH].greedy(prompt, 8)
        assert elapsed < 60
        for name, stats in c.worker_stats().items():
            assert 0 < stats["peak_rss_bytes"] < 4 * 2**30, (name, stats["peak_rss_bytes"])
        assert_idle(c)


# --- faults -------------------------------------------------------------------------------------
# (pool, the callable replaced by a raising one, whether a request must already be decoding)
FAULTS = {
    "prefill engine loop": ("prefill", "engine.step", False),
    "prefill output callback": ("prefill", "loop._on_outputs", False),
    "prefill feeder thread": ("prefill", "_start", False),
    "prefill KV sender loop": ("prefill", "sender._poll", False),
    "decode engine loop": ("decode", "engine.step", True),
    "decode lease thread": ("decode", "receiver.expire_leases", True),
}


@pytest.fixture
def faulty_cluster(cluster):
    """The module's cluster with retries off: the request that met the fault must end with an
    explicit error naming it (tests/cluster/test_failover.py shows the retries). These tests come
    last in the file: each costs a worker a restart, and the last breaks the router's token hub."""
    frontend = cluster.router_stack.frontend
    budget = frontend.retry
    frontend.retry = replace(budget, max_retries=0)
    yield cluster
    frontend.retry = budget


@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_exception_in_a_long_lived_thread_fails_its_requests_explicitly(faulty_cluster, fault):
    pool, path, while_decoding = FAULTS[fault]
    c = faulty_cluster
    wait_healthy(c)
    target = worker(c, pool)
    restarts = c.restarts.get(target.name, 0)
    with Client(c.address, timeout=30) as client:
        t0 = time.time()
        with pytest.raises(PDServeError) as failure:
            if not while_decoding:
                on_worker(target, inject_exception, path)
            stream = client.generate([13] * 40, stream=True, max_tokens=460, ignore_eos=True)
            if while_decoding:  # tokens after the first come from the decode worker: the handoff is done
                for _ in range(3):
                    next(stream)
                on_worker(target, inject_exception, path)
            for _ in stream:
                pass
        assert time.time() - t0 < 15, "the request hung instead of failing"
        assert failure.value.code == grpc.StatusCode.UNAVAILABLE, failure.value
        assert "retries are off" in failure.value.message, failure.value
        assert "injected fault" in failure.value.message and target.name in failure.value.message
        deadline = time.time() + 10
        while c.restarts.get(target.name, 0) == restarts:  # the supervisor has Ray restart the worker
            assert time.time() < deadline, "the failed worker was not restarted"
            time.sleep(0.05)
        wait_healthy(c)
        assert len(client.generate([13] * 20, max_tokens=3, ignore_eos=True).token_ids) == 3
    assert not [s for s in wait_until_idle(c) if s.kv.held_blocks]


def test_a_worker_method_that_raises_fails_its_request_instead_of_leaving_it_waiting(faulty_cluster):
    """The prefill worker's `prefill` raises (a bug outside its own error handling): no token message
    will ever come, and the worker stays healthy. The call's failure reaches the request at once as an
    explicit UNAVAILABLE naming it (retried when retries are on), not as the client's deadline."""
    c = faulty_cluster
    wait_healthy(c)
    target = worker(c, "prefill")
    on_worker(target, inject_exception, "queues.put")
    try:
        with Client(c.address, timeout=30) as client:
            t0 = time.time()
            with pytest.raises(PDServeError) as failure:
                client.generate([19] * 40, max_tokens=4, ignore_eos=True)
            assert time.time() - t0 < 10, "the request waited instead of failing"
            assert failure.value.code == grpc.StatusCode.UNAVAILABLE, failure.value
            assert "injected fault in queues.put" in failure.value.message and target.name in failure.value.message
    finally:
        on_worker(target, lambda self: vars(self.queues).pop("put", None) and None)
    assert_idle(c)
    with Client(c.address, timeout=30) as client:
        assert len(client.generate([19] * 20, max_tokens=3, ignore_eos=True).token_ids) == 3


def test_a_failed_token_hub_fails_waiting_streams_explicitly(faulty_cluster):
    c = faulty_cluster
    wait_healthy(c)
    with Client(c.address, timeout=30) as client:
        stream = client.generate([17] * 40, stream=True, max_tokens=460, ignore_eos=True)
        next(stream)
        fault = RuntimeError("injected fault in the token hub")
        c.router_stack.tokens._on_message = lambda data: (_ for _ in ()).throw(fault)
        with pytest.raises(PDServeError, match="token stream failed.*injected fault") as failure:
            for _ in stream:
                pass
        assert failure.value.code == grpc.StatusCode.INTERNAL
        with pytest.raises(PDServeError, match="token stream failed") as refused:
            client.generate("hello", max_tokens=2)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
