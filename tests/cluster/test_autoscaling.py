"""The online planner scaling a cluster through Ray's autoscaler, on Ray's fake multi-node provider
(deploy/ray/fake-autoscaling.yaml: a head and up to three `flex` nodes, raylets on this machine, that
the autoscaler starts for workers waiting for room and stops once idle). With light traffic the planner
removes a decode worker: its running streams move to the other one with their KV (none aborted,
retried or recomputed, tokens exact) and its node goes away; a worker added waits for the node the
autoscaler starts for it and serves there."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import ray
from cluster_helpers import Streams, alive_nodes, manifest, start_fake_cluster, undisturbed, wait_clean_audit
from helpers import random_prompts
from plan_helpers import synthetic_profile

from pdserve.client import Client
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.plan.online import Split
from pdserve.engine.cost_model import StepCost
from pdserve.engine.model_store import model_digest

ARCH = "tiny-llama"
CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "fake-autoscaling.yaml"
IDLE_TIMEOUT_MINUTES = 0.1  # an idle node goes after 6 s (the shipped config: a minute)
NODE_CHANGE_S = 90  # the most a node's start or stop may take here
pytestmark = pytest.mark.own_ray  # the driver joins the fake cluster, not the tests' shared Ray


def wait_nodes(n: int) -> None:
    deadline = time.monotonic() + NODE_CHANGE_S
    while alive_nodes() != n:
        assert time.monotonic() < deadline, f"{alive_nodes()} nodes alive, not {n}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dirs):
    """1 prefill + 2 decode workers, each on a node the autoscaler starts for it; the planner may run 2
    or 3 workers and decides when the test says (its own interval is an hour). Decode steps stall, so
    streams are still running when the planner acts."""
    tmp = tmp_path_factory.mktemp("fake-autoscaling")
    head, address = start_fake_cluster(CONFIG, tmp, env={"AUTOSCALER_UPDATE_INTERVAL_S": "1"},
                                       idle_timeout_minutes=IDLE_TIMEOUT_MINUTES)
    try:
        model = model_dirs[ARCH]
        # Cheap steps: one prefill and one decode worker carry far more than the test's few requests.
        profile = synthetic_profile(StepCost(0.002, 0.0004, 0.0), decode_s=0.002)
        profile = replace(profile, model_digest=model_digest(model), max_model_len=512,
                          transfers={"tcp": profile.transfers["shm"]})  # across nodes
        profile.save(tmp / "profile.json")
        planner = {"online": True, "ttft_slo_s": 2.0, "tpot_slo_s": 0.1, "interval_s": 3600, "window_s": 600,
                   "min_requests": 2, "confirmations": 1, "cooldown_s": 0, "min_workers": 2, "max_workers": 3}
        pools = {"prefill": {"replicas": 1, "num_cpus": 1, "resources": {"prefill": 1}},
                 "decode": {"replicas": 2, "num_cpus": 1, "resources": {"decode": 1}}}
        faults = {"stall_every_steps": 1, "stall_ms": 15, "workers": ["decode-1", "decode-2"]}
        m = manifest(model, transport="auto", pools=pools, profile=str(tmp / "profile.json"), planner=planner,
                     faults=faults, ray={"address": "auto"})
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RAY_ADDRESS", address)  # as `ray start` leaves it for the shell
            c = Cluster(m, log=lambda _: None)
            c.start()
        try:
            yield c
        finally:
            c.stop()
    finally:
        head.stop()


def test_the_planner_removes_a_worker_by_migration_and_the_autoscaler_stops_its_node(cluster, hf_reference):
    assert alive_nodes() == 4 and len({w.status.node_id for w in cluster.workers}) == 3  # a node per worker
    prompts = random_prompts(4, hf_reference[ARCH].vocab_size, 30, 200, seed=61)
    greedy = dict(max_tokens=100, ignore_eos=True, temperature=0)
    expected = undisturbed(cluster, prompts, [greedy] * 4)  # also the planner's window: light traffic
    assert expected == [hf_reference[ARCH].greedy(p, 100) for p in prompts]
    decision = cluster.replanning.decide()  # decided first: its simulations take longer than a stream
    assert decision.action == "change" and decision.step == Split(1, 1), decision
    assert "removing a decode worker" in decision.reason
    stats = cluster.router.stats
    retries, moved = stats.retries, stats.moved
    streams = Streams(cluster, prompts, [greedy] * 4)
    try:
        streams.wait_tokens(10)
        holding = {w.name: sum(a.placement.decode is w for a in cluster.router_stack.frontend.active)
                   for w in cluster.workers if w.pool == "decode"}
        assert min(holding.values()) >= 1, holding  # whichever goes holds a stream
        # The planner's window holds the running requests too, with the tokens they have so far.
        observed = cluster.observed_requests()
        assert len(observed) == 8 and any(10 <= r.output_len < 100 for r in observed), observed
        cluster.replanning.carry_out(decision)
    finally:
        streams.join()
    assert sorted(w.pool for w in cluster.workers) == ["decode", "prefill"]
    assert not streams.failures and streams.tokens == expected, streams.failures
    assert stats.retries == retries and stats.moved > moved  # moved with their KV: none retried or recomputed
    health = cluster.router_stack.server.health_report().planner
    assert (health.workers_removed, health.workers_added, health.role_changes) == (1, 0, 0)
    wait_nodes(3)  # the autoscaler stopped the node left idle
    wait_clean_audit(cluster)


def test_a_worker_added_waits_for_the_node_the_autoscaler_starts_and_serves_there(cluster, hf_reference):
    if len(cluster.workers) == 3:  # as the test above leaves it: one node for each of 2 workers
        cluster.remove_worker(next(w.name for w in cluster.workers if w.pool == "decode"))
    wait_nodes(3)
    old = next(w for w in cluster.workers if w.pool == "decode")
    new = cluster.add_worker("decode", timeout_s=NODE_CHANGE_S)
    assert alive_nodes() == 4 and new.status.node_id not in {w.status.node_id for w in cluster.workers if w is not new}
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert nodes[new.status.node_id].get("decode") == 1  # a flex node
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 30, 60, seed=62)[0]
    cluster.drain(old.name, timeout_s=60)  # only the new worker takes requests to decode
    try:
        with Client(cluster.address, timeout=120) as client:
            assert client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True).token_ids == \
                hf_reference[ARCH].greedy(prompt, 8)
    finally:
        cluster.reopen(old.name)
