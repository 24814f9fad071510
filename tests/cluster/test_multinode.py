"""Serving across Ray nodes: the fake multi-node cluster of deploy/ray/fake-multinode.yaml (Ray's fake
provider: a head and four worker nodes on this machine, each its own raylet, two typed by a `prefill`
resource and two by `decode`), started as the config says. Every actor lands on a node of its type,
KV crosses nodes over TCP, and greedy outputs stay exact."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
from cluster_helpers import alive_nodes, assert_idle, manifest, start_fake_cluster

from pdserve.client import Client
from pdserve.cluster.launcher import Cluster
from pdserve.engine.model_store import ModelSource, materialize, model_digest, read_model_files

ARCH = "tiny-llama"
CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "fake-multinode.yaml"
NODES = 5  # the head, 2 prefill and 2 decode nodes
START_TIMEOUT_S = 120
pytestmark = pytest.mark.own_ray  # the driver joins the fake cluster, not the tests' shared Ray


@pytest.fixture(scope="module")
def ray_nodes(tmp_path_factory):
    """The fake cluster, stopped by pid afterwards."""
    # The autoscaler launches the nodes at its next update: each second, not each five
    head, address = start_fake_cluster(CONFIG, tmp_path_factory.mktemp("fake-multinode"),
                                       env={"AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    try:
        ray.init(address=address, logging_level="ERROR")  # joined once to watch the nodes come (a join costs ~1 s)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while alive_nodes() < NODES:  # the autoscaler launches the worker nodes
                assert time.monotonic() < deadline, f"the fake cluster did not reach {NODES} nodes"
                time.sleep(0.5)
        finally:
            ray.shutdown()
        yield address
    finally:
        head.stop()


@pytest.fixture(scope="module")
def cluster(ray_nodes, model_dirs):
    """`ray.address: auto`, as a manifest for a cluster started with `ray start` says: Ray finds it
    through RAY_ADDRESS (set here to the fake cluster, as `ray start` leaves it for the shell)."""
    pools = {"prefill": {"replicas": 2, "num_cpus": 0.5, "resources": {"prefill": 1}},
             "decode": {"replicas": 2, "num_cpus": 0.5, "resources": {"decode": 1}}}
    m = manifest(model_dirs[ARCH], transport="auto", pools=pools, ray={"address": "auto"})
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_ADDRESS", ray_nodes)
        c = Cluster(m, log=lines.append)
        c.start()
    c.start_log = lines
    yield c
    c.stop()


def test_every_actor_lands_on_a_node_of_its_type(cluster):
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    for w in cluster.workers:
        node = w.status.node_id
        assert nodes[node].get(w.pool, 0) >= 1, f"{w.name} ({w.pool}) landed on a node without {w.pool!r}"
        assert any(line.startswith(f"  {w.name} ready on node ") for line in cluster.start_log)
    assert len({w.status.node_id for w in cluster.workers}) == 4  # one actor per node: every pair crosses nodes
    # Each worker hashed its own copy: all hold the launcher's bytes.
    assert {w.status.model_digest for w in cluster.workers} == {model_digest(cluster.manifest.model)}


def test_concurrent_requests_cross_nodes_over_tcp_with_exact_greedy_outputs(cluster, hf_reference):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 900) for _ in range(rng.randint(10, 90))] for _ in range(6)]
    with Client(cluster.address, timeout=120) as client, ThreadPoolExecutor(len(prompts)) as pool:
        # All at once: transfers from both prefill nodes to both decode nodes cross at the same time.
        outputs = list(pool.map(lambda p: client.generate(p, max_tokens=8, temperature=0, ignore_eos=True).token_ids,
                                prompts))
    assert outputs == [hf_reference[ARCH].greedy(p, 8) for p in prompts]
    assert_idle(cluster)

    def sent_over_tcp() -> bool:  # the prefill workers' own figures, as their last health reports carry them
        return any('transport="tcp"' in w.status.metrics for w in cluster.workers if w.pool == "prefill")

    deadline = time.monotonic() + 10
    while not sent_over_tcp() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sent_over_tcp()


def test_a_model_directory_reaches_a_node_that_lacks_it_through_the_object_store(cluster, model_dirs, tmp_path):
    model_dir = model_dirs[ARCH]
    source = ModelSource(str(tmp_path / "not-on-that-node"), model_digest(model_dir),
                         files=ray.put(read_model_files(model_dir)))

    @ray.remote(num_cpus=0)  # on any node: none has that path
    def on_a_node(source: ModelSource, cache: str) -> str:
        return str(materialize(source, ray.get, cache_dir=Path(cache))[0])

    got = Path(ray.get(on_a_node.remote(source, str(tmp_path / "cache" / "models")), timeout=60))
    assert got.parent == tmp_path / "cache" / "shipped" and model_digest(got) == source.digest
