"""The router end to end on real workers: prefix-cache-aware placement from the workers' KV events,
an index that matches every worker's own cache, conditional disaggregation, a worker that leaves
and comes back, and early rejection."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import ray
from cluster_helpers import assert_idle, manifest

from pdserve.client import AsyncClient, Client, ResourceExhausted
from pdserve.cluster.launcher import Cluster
from pdserve.engine.block_pool import hash_prompt_blocks

ARCH = "tiny-llama"
BS = 16
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def cluster(model_dirs):
    m = manifest(model_dirs[ARCH], router={"policy": "estimated_ttft", "local_prefill_tokens": 24},
                 pools={"prefill": {"replicas": 2, "num_cpus": 0.25}, "decode": {"num_cpus": 0.25}})
    c = Cluster(m, log=lambda _: None)
    c.start()
    yield c
    c.stop()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)  # distinct seeds share no prefix
    return [rng.randrange(3, 900) for _ in range(n)]


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def prefill_worker_of(cluster: Cluster, before: dict) -> str:
    after = cluster.router.stats.per_worker
    (name,) = [w for w in after if after[w] != before.get(w, 0)]
    return name


def test_shared_prefixes_go_where_they_are_cached_and_report_cached_tokens(cluster, hf_reference):
    base = prompt(1, 160)  # 10 full blocks
    with Client(cluster.address) as client:
        before = dict(cluster.router.stats.per_worker)
        first = client.generate(base + prompt(2, 40), max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        holder = prefill_worker_of(cluster, before)
        assert first.cached_tokens == 0
        # Its blocks reach the router as KV events.
        hashes = hash_prompt_blocks(base, BS)
        assert wait_for(lambda: cluster.router.index.match(hashes).get(holder) == len(hashes))
        for i in range(4):
            tail = prompt(10 + i, 40)
            before = dict(cluster.router.stats.per_worker)
            out = client.generate(base + tail, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
            assert prefill_worker_of(cluster, before) == holder  # where the 160 shared tokens are
            assert out.cached_tokens >= len(base)
            assert out.token_ids == hf_reference[ARCH].greedy(base + tail, NEW_TOKENS)
            assert out.timings["kv_transfer"] > 0
    s = cluster.router.snapshot_stats()
    assert s["oracle_cached_tokens"] >= s["predicted_cached_tokens"] >= 4 * len(base)
    assert_idle(cluster)


def test_the_index_equals_every_workers_own_cache(cluster):
    with Client(cluster.address) as client:
        for i in range(6):
            client.generate(prompt(100 + i, 60 + 30 * i), max_tokens=3, temperature=0)
    assert_idle(cluster)

    def exact() -> bool:
        for w in cluster.workers:
            snap = ray.get(w.handle.kv_snapshot.remote())
            if dict(snap.blocks) != cluster.router.index.blocks(w.name):
                return False
        return True

    assert wait_for(exact)  # events are flushed within milliseconds; heartbeats within a second


def test_short_uncached_prompts_prefill_on_their_decode_worker(cluster, hf_reference):
    with Client(cluster.address) as client:
        before = cluster.router.stats.local_prefills
        short = prompt(200, 20)
        out = client.generate(short, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        assert cluster.router.stats.local_prefills == before + 1
        assert out.timings["kv_transfer"] == 0 and out.token_ids == hf_reference[ARCH].greedy(short, NEW_TOKENS)
        long_ = prompt(201, 100)
        out = client.generate(long_, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        assert cluster.router.stats.local_prefills == before + 1 and out.timings["kv_transfer"] > 0
        assert out.token_ids == hf_reference[ARCH].greedy(long_, NEW_TOKENS)
    assert_idle(cluster)


def test_early_rejection_reaches_no_worker(cluster):
    """Refused at placement, before any worker sees the request (what makes it fast)."""
    settings = cluster.router.settings
    settings.ttft_slo_s = 1e-6  # no prompt pass can meet this
    stats = cluster.router.stats
    rejections, routed = stats.early_rejections, dict(stats.per_worker)
    try:
        with Client(cluster.address) as client:
            with pytest.raises(ResourceExhausted, match="TTFT objective") as e:
                client.generate(prompt(300, 200), max_tokens=4, temperature=0)
    finally:
        settings.ttft_slo_s = None
    assert e.value.retry_after_s is not None
    assert stats.early_rejections == rejections + 1 and stats.per_worker == routed
    assert_idle(cluster)


def test_a_worker_that_disappears_leaves_the_index_and_placement_until_it_is_back(cluster):
    with Client(cluster.address) as client:
        before = dict(cluster.router.stats.per_worker)
        client.generate(prompt(900, 80), max_tokens=2, temperature=0)
    victim = next(w for w in cluster.router.prefill_pool if w.name == prefill_worker_of(cluster, before))
    other = next(w for w in cluster.router.prefill_pool if w is not victim)
    assert wait_for(lambda: cluster.router.index.num_blocks(victim.name) > 0)
    ray.kill(victim.handle, no_restart=False)  # the actor dies; Ray starts it again
    t0 = time.monotonic()
    assert wait_for(lambda: not victim.healthy, 10)
    # The supervisor marks it unhealthy within its round and drops it from the index as the round ends.
    health = cluster.manifest.deadlines.health
    assert wait_for(lambda: cluster.router.index.num_blocks(victim.name) == 0, health.ping_timeout_s)
    # Within one health interval of the supervisor seeing it (pings time out after ping_timeout_s).
    assert time.monotonic() - t0 < health.hung_after_s + 1.0
    with Client(cluster.address) as client:
        for i in range(10_000):
            if victim.healthy:
                break
            before = dict(cluster.router.stats.per_worker)
            client.generate(prompt(1000 + i, 80), max_tokens=2, temperature=0)  # new: no cache anywhere
            # The victim may have come back while this request was placed; then it may take it.
            assert prefill_worker_of(cluster, before) == other.name or victim.healthy
            if time.monotonic() - t0 > 120:
                pytest.fail("the killed worker did not come back within 120 s")
        assert victim.status.profiled  # the supervisor had it measure itself again before it took work
    # Back, it takes work again. Prompts arriving together: one at a time, the two idle workers' fitted
    # costs alone decide, and the restarted one's profile (measured while the other served) may be
    # the higher one every time; with a queue on the other, the estimates send work to both.
    # A profile measured on a busy machine can be much the higher, so bursts grow (fresh prompts each)
    # until the queue on the other outweighs it: a worker left out of placement would take none.
    before = dict(cluster.router.stats.per_worker)

    async def burst(first_seed: int, size: int) -> None:
        async with AsyncClient(cluster.address, timeout=120) as client:
            await asyncio.gather(*(client.generate(prompt(first_seed + i, 200), max_tokens=2, temperature=0)
                                   for i in range(size)))

    for first_seed, size in ((500, 8), (600, 16), (700, 32), (800, 64)):
        asyncio.run(burst(first_seed, size))
        if cluster.router.stats.per_worker[victim.name] > before.get(victim.name, 0):
            break
    assert cluster.router.stats.per_worker[victim.name] > before.get(victim.name, 0)
    assert_idle(cluster)
