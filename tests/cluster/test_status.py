"""The operator's view of a real running cluster (one prefill and one decode worker): `GET /health`
answers its model, addresses, pools and workers in JSON, with the load and KV use a request puts on
them; `pdserve status` (a real subprocess) prints the same as a table or as JSON; a pool with no
healthy worker left turns both to "not serving" (503, exit status 1)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import ray
from cluster_helpers import install_gate, manifest, on_worker, open_gate, pdserve, worker

from pdserve.client import Client
from pdserve.cluster.launcher import Cluster

ARCH = "tiny-llama"


@pytest.fixture(scope="module")
def cluster(model_dirs) -> Iterator[Cluster]:
    c = Cluster(manifest(model_dirs[ARCH]), log=lambda _: None)
    c.start()
    yield c
    c.stop()


def health(cluster: Cluster) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{cluster.http_address}/health", timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def workers(report: dict) -> dict[str, dict]:
    return {w["name"]: w for pool in report["pools"] for w in pool["workers"]}


def poll(cluster: Cluster, condition, timeout_s: float = 15.0) -> tuple[int, dict]:
    """/health's answer once `condition(status, report)` holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, report = health(cluster)
        if condition(status, report):
            return status, report
        assert time.monotonic() < deadline, f"/health never got there: {status} {report}"
        time.sleep(0.1)


def test_health_answers_the_cluster_in_json(cluster):
    status, report = health(cluster)
    assert status == 200 and report["status"] == "serving" and report["serving"] is True
    assert report["mode"] == "disaggregated"
    assert report["model"] == {"name": ARCH, "model_type": "llama", "max_model_len": 512, "dtype": "float32"}
    assert (report["grpc_address"], report["http_address"]) == (cluster.address, cluster.http_address)
    assert [(p["name"], p["needed"], p["healthy"]) for p in report["pools"]] == [("prefill", False, 1),
                                                                                ("decode", True, 1)]
    seen, node = workers(report), ray.util.get_node_ip_address()  # one node: this machine
    assert {name: (w["role"], w["node"], w["healthy"]) for name, w in seen.items()} == {
        "prefill-0": ("prefill", node, True), "decode-1": ("decode", node, True)}
    for w in seen.values():
        assert w["kv_blocks_total"] > 0 and w["kv_blocks_free"] == w["kv_blocks_total"] and w["kv_used"] == 0
        assert w["requests"] == 0 and w["queued_prompts"] == 0


def test_health_shows_the_load_and_kv_a_request_puts_on_its_decode_worker(cluster):
    # The decode worker's engine steps wait at a gate: the request stays on it, its KV held, until the
    # health report has shown it (a request decoded to its end between two reports would never show).
    decode_worker = worker(cluster, "decode")
    on_worker(decode_worker, install_gate, "engine.step")
    try:
        with Client(cluster.address, timeout=60) as client:
            stream = client.generate([9] * 200, stream=True, max_tokens=300, ignore_eos=True, temperature=0)
            next(stream)  # the prefill worker's token: the request is on decode-1 now
            _, report = poll(cluster, lambda s, r: workers(r)["decode-1"]["requests"] == 1)
            decode = workers(report)["decode-1"]
            assert decode["kv_used"] > 0 and decode["kv_blocks_free"] < decode["kv_blocks_total"]
            stream.close()
    finally:
        on_worker(decode_worker, open_gate)
    poll(cluster, lambda s, r: all(w["requests"] == 0 and w["kv_used"] == 0 for w in workers(r).values()))


def test_pdserve_status_prints_a_table_and_the_raw_json(cluster):
    shown = pdserve("status", "--address", cluster.http_address)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"serving (disaggregated): model {ARCH} (llama, float32, context 512 tokens)"
    assert lines[1] == f"gRPC API {cluster.address}, HTTP API {cluster.http_address}"
    assert lines[3].split() == ["POOL", "WORKER", "ROLE", "NODE", "HEALTH", "REQUESTS", "QUEUED", "KV", "USED"]
    total = workers(health(cluster)[1])["decode-1"]["kv_blocks_total"]
    node = ray.util.get_node_ip_address()
    assert lines[5].split() == ["decode", "decode-1", "decode", node, "healthy", "0", "0", "0%", f"(0/{total}", "blocks)"]
    raw = pdserve("status", "--address", cluster.http_address, "--json")
    assert raw.returncode == 0 and json.loads(raw.stdout)["model"]["name"] == ARCH


def test_status_says_where_no_cluster_answers():
    shown = pdserve("status", "--address", "127.0.0.1:9")  # the discard port: nothing listens there
    assert shown.returncode == 1
    assert "no pdserve cluster answers at http://127.0.0.1:9/health" in shown.stderr


def test_a_pool_without_a_healthy_worker_is_503_and_status_exits_1(cluster):
    """Last in the module: it kills the decode worker for good."""
    decode = next(w for w in cluster.workers if w.name == "decode-1")
    ray.kill(decode.handle, no_restart=True)
    status, report = poll(cluster, lambda s, r: s == 503)
    assert report["status"] == "not_serving" and workers(report)["decode-1"]["healthy"] is False
    shown = pdserve("status", "--address", cluster.http_address)
    assert shown.returncode == 1
    assert "decode-1" in shown.stdout and "DOWN" in shown.stdout
    assert "no healthy worker in the decode pool: the cluster cannot serve" in shown.stdout
