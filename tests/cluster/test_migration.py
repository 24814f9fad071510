"""Live migration on a real cluster: running requests move between decode workers with their KV, the
stream goes on with exactly the tokens an undisturbed run gives, and a source lost at any moment of a
move falls back to recompute with nothing lost; a target lost leaves the request where it was."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest
import ray
from cluster_helpers import (Streams, install_gate, manifest, on_worker, undisturbed, wait_clean_audit,
                             wait_healthy, worker_pid)
from helpers import random_prompts

from pdserve.client import Client
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.pool_client import AdminRefused, change
from pdserve.cluster.status import fetch_health, render
from pdserve.router.frontend import ActiveRequest

ARCH = "tiny-llama"
STALL_MS = 15  # every decode step stalls this long, so streams are still running when they move
WORKERS = ["prefill-0", "decode-1", "decode-2"]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # functions run inside the workers travel by value



@pytest.fixture(scope="module")
def cluster(model_dirs):
    pools = {"prefill": {"replicas": 1, "num_cpus": 0.25},
             "decode": {"replicas": 2, "num_cpus": 0.25, "max_restarts": 5}}
    faults = {"stall_every_steps": 1, "stall_ms": STALL_MS, "workers": WORKERS[1:]}
    with Cluster(manifest(model_dirs[ARCH], pools=pools, faults=faults), log=lambda _: None) as c:
        assert [w.name for w in c.workers] == WORKERS
        yield c



def active_requests(cluster: Cluster) -> list[ActiveRequest]:
    return list(cluster.router_stack.frontend.active)


def decoding_worker(cluster: Cluster):
    """The decode worker holding the most streams, as the router placed them."""
    decode = [w for w in cluster.workers if w.pool == "decode"]
    return max(decode, key=lambda w: sum(a.placement.decode is w for a in active_requests(cluster)))


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_draining_a_decode_worker_moves_its_streams_with_their_kv(cluster, hf_reference, sampling):
    """Every stream the drained worker decodes moves to the other one mid-stream (no retry, no
    recompute); each client gets exactly the undisturbed tokens; the drained worker ends holding
    nothing and takes no request until reopened."""
    wait_healthy(cluster)
    prompts = random_prompts(4, hf_reference[ARCH].vocab_size, 30, 200, seed=31)
    params = [dict(max_tokens=100, ignore_eos=True, temperature=0) if sampling == "greedy" else
              dict(max_tokens=100, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7 + i) for i in range(4)]
    expected = undisturbed(cluster, prompts, params)
    if sampling == "greedy":
        assert expected == [hf_reference[ARCH].greedy(p, 100) for p in prompts]
    stats = cluster.router.stats
    retries, moved = stats.retries, stats.moved
    streams = Streams(cluster, prompts, params)
    try:
        streams.wait_tokens(10)
        source = decoding_worker(cluster)
        holding = sum(a.placement.decode is source for a in active_requests(cluster))
        report = cluster.drain(source.name, timeout_s=60)
        assert report.moved == holding >= 1 and report.recomputed == 0 and report.failed_moves == 0, report
        assert all(0 < p < 5 for p in report.pauses_s), report
        assert not any(a.placement.decode is source for a in active_requests(cluster))
        assert on_worker(source, lambda self: len(self.engine.requests)) == 0
        with Client(cluster.address, timeout=60) as client:  # new requests go elsewhere while it is drained
            client.generate(prompts[0], max_tokens=4)
        assert on_worker(source, lambda self: self.engine.scheduler.has_work) is False
        health = fetch_health(cluster.http_address)
        (shown,) = [w for pool in health["pools"] for w in pool["workers"] if w["name"] == source.name]
        assert shown["draining"] and "draining" in render(health)
    finally:
        streams.join()
        cluster.reopen(source.name)
    assert not streams.failures and streams.tokens == expected, streams.failures
    assert stats.retries == retries and stats.moved == moved + holding
    wait_clean_audit(cluster)


def test_without_an_auth_token_the_admin_api_changes_nothing(cluster):
    with pytest.raises(AdminRefused, match="^403: the admin API needs the manifest's server.admin_token"):
        change(cluster.http_address, "POST", "/decode-1/drain", None)
    assert not any(w.draining for w in cluster.workers)


def move_one(cluster: Cluster, stream: Streams):
    """Start moving the one running stream to the other decode worker, on the router's loop; the
    source, the target, and the move's future."""
    stream.wait_tokens(10)
    (active,) = active_requests(cluster)
    source = active.placement.decode
    target = next(w for w in cluster.workers if w.pool == "decode" and w is not source)
    future = cluster.router_stack.loop.run(_start(active, target))
    return source, target, future


async def _start(active: ActiveRequest, target):
    return asyncio.ensure_future(active.migrate(target))


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


# Where a move is stopped: before its KV frames go (the mover's link opens the channel), before the
# commit is asked (every frame out), and after the target committed, before the source hears of it.
MOMENTS = {"before-frames": "mover._open", "before-commit": "mover._finish_channel",
           "after-commit": "mover._on_end"}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_source_lost_at_any_moment_of_a_move_costs_no_token(cluster, hf_reference, moment):
    """The source dies mid-move: the request resumes elsewhere from its tokens (the fallback), and the
    client sees each token once, exact."""
    wait_healthy(cluster)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 120, 120, seed=37)[0]
    retries = cluster.router.stats.retries
    stream = Streams(cluster, [prompt], [dict(max_tokens=80, ignore_eos=True, temperature=0)])
    stream.wait_tokens(10)
    (active,) = active_requests(cluster)
    on_worker(active.placement.decode, install_gate, MOMENTS[moment])
    source, target, future = move_one(cluster, stream)
    if moment == "after-commit":  # the target holds it: its KV arrived, it was admitted
        wait_for(lambda: on_worker(target, lambda self: len(self.engine.requests)) == 1)
    else:
        wait_for(lambda: on_worker(source, lambda self: bool(self._moves)))
    os.kill(on_worker(source, worker_pid), signal.SIGKILL)
    stream.join()
    assert not stream.failures and stream.tokens[0] == hf_reference[ARCH].greedy(prompt, 80), stream.failures
    assert not cluster.router_stack.loop.run(_result(future), 60).moved
    assert cluster.router.stats.retries == retries + 1
    wait_healthy(cluster)
    wait_clean_audit(cluster)


def test_a_target_lost_mid_move_leaves_the_request_decoding_where_it_was(cluster, hf_reference):
    wait_healthy(cluster)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 120, 120, seed=41)[0]
    retries = cluster.router.stats.retries
    stream = Streams(cluster, [prompt], [dict(max_tokens=80, ignore_eos=True, temperature=0)])
    stream.wait_tokens(10)
    (active,) = active_requests(cluster)
    target = next(w for w in cluster.workers if w.pool == "decode" and w is not active.placement.decode)
    on_worker(target, install_gate, "receiver.commit")  # the move waits at its commit
    source, target, future = move_one(cluster, stream)
    wait_for(lambda: on_worker(target, lambda self: self.receiver.num_in_flight) == 1)
    os.kill(on_worker(target, worker_pid), signal.SIGKILL)
    outcome = cluster.router_stack.loop.run(_result(future), 60)
    stream.join()
    assert not outcome.moved and outcome.tried
    assert not stream.failures and stream.tokens[0] == hf_reference[ARCH].greedy(prompt, 80), stream.failures
    assert cluster.router.stats.retries == retries  # it never left its worker
    wait_healthy(cluster)
    wait_clean_audit(cluster)


async def _result(future):
    return await future


def test_workers_switch_roles_under_load_and_nothing_is_lost(cluster, hf_reference):
    """A decode worker becomes a prefill worker while streams run on it (they move to the other decode
    worker with their KV), then the first prefill worker becomes a decode worker while prompts are in
    its pass (they finish and hand over first): every stream completes exact, none is retried, and the
    router places on the new roles at once. Runs last: the module's cluster keeps its new shape."""
    wait_healthy(cluster)
    vocab = hf_reference[ARCH].vocab_size
    prompts = random_prompts(8, vocab, 30, 200, seed=43)
    greedy = dict(max_tokens=60, ignore_eos=True, temperature=0)
    retries = cluster.router.stats.retries
    first = Streams(cluster, prompts[:4], [greedy] * 4)
    first.wait_tokens(5)
    decode = decoding_worker(cluster)
    prefill = cluster.switch_role(decode.name, "prefill")
    assert prefill.pool == "prefill" and prefill in cluster.router.prefill_pool
    assert decode not in cluster.router.decode_pool and decode not in cluster.workers
    second = Streams(cluster, prompts[4:], [greedy] * 4)
    old_prefill = cluster.workers[0]
    assert old_prefill.name == "prefill-0"
    new_decode = cluster.switch_role(old_prefill.name, "decode")
    assert new_decode in cluster.router.decode_pool and old_prefill not in cluster.router.prefill_pool
    first.join()
    second.join()
    assert not first.failures and not second.failures, first.failures + second.failures
    assert first.tokens + second.tokens == [hf_reference[ARCH].greedy(p, 60) for p in prompts]
    assert cluster.router.stats.retries == retries
    with Client(cluster.address, timeout=60) as client:  # the new workers serve
        outputs = [client.generate(p, **greedy).token_ids for p in prompts[:4]]
    assert outputs == [hf_reference[ARCH].greedy(p, 60) for p in prompts[:4]]
    served = cluster.router_stats()["per_worker"]
    assert served.get(prefill.name, 0) > 0
    assert sorted(w.pool for w in cluster.workers) == ["decode", "decode", "prefill"]
    wait_clean_audit(cluster)
