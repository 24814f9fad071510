"""Reshaping a running cluster over its HTTP API's admin routes and `pdserve workers`: only with the
admin token (not the clients'), bad names and roles refused with a clear answer, a role switched, a worker drained and
reopened, the last decode worker kept."""

from __future__ import annotations

import json

import pytest
import ray
from cluster_helpers import manifest, pdserve
from helpers import wait_until

from pdserve.cluster.launcher import Cluster
from pdserve.cluster.pool_client import AdminRefused, change
from pdserve.cluster.status import fetch_health

ARCH = "tiny-llama"
TOKEN = "admin-s3cret"
CLIENT_TOKEN = "client-s3cret"


@pytest.fixture(scope="module")
def cluster(model_dirs):
    pools = {"prefill": {"replicas": 1, "num_cpus": 0.25}, "decode": {"replicas": 2, "num_cpus": 0.25}}
    server = {"auth_token": CLIENT_TOKEN, "admin_token": TOKEN}
    with Cluster(manifest(model_dirs[ARCH], pools=pools, server=server), log=lambda _: None) as c:
        yield c


def roles(cluster: Cluster) -> dict[str, str]:
    health = fetch_health(cluster.http_address)
    return {w["name"]: w["role"] for pool in health["pools"] for w in pool["workers"]}


@pytest.mark.parametrize("token, body, path, status", [
    (None, {"role": "decode"}, "", "401"),
    ("wrong", {"role": "decode"}, "", "401"),
    (CLIENT_TOKEN, {"role": "decode"}, "", "401"),  # a client's token is not an operator's
    (TOKEN, {"role": "colocated"}, "", "400"),
    (TOKEN, {"role": "decode", "extra": 1}, "", "400"),
    (TOKEN, None, "", "400"),  # add needs a role
    (TOKEN, {"role": "x" * 2000}, "", "400"),  # past the body's bound
    (TOKEN, None, "/no-such-worker/drain", "400"),
])
def test_bad_admin_calls_are_refused_with_a_reason_and_change_nothing(cluster, token, body, path, status):
    before = roles(cluster)
    with pytest.raises(AdminRefused, match=f"^{status}: "):
        change(cluster.http_address, "POST", path, token, body)
    assert roles(cluster) == before


def test_workers_are_drained_reopened_and_switched_from_the_command_line(cluster):
    address = cluster.http_address
    drained = json.loads(pdserve("workers", "drain", "decode-1", "--token", TOKEN, "--address", address).stdout)
    assert drained["worker"] == "decode-1" and drained["draining"] and drained["moved"] == 0
    health = fetch_health(address)
    assert [w["draining"] for p in health["pools"] for w in p["workers"] if w["name"] == "decode-1"] == [True]
    pdserve("workers", "reopen", "decode-1", "--token", TOKEN, "--address", address)
    assert not cluster.router.decode_pool[0].draining

    switched = pdserve("workers", "role", "decode-2", "prefill", "--token", TOKEN, "--address", address)
    assert switched.returncode == 0, switched.stderr
    new = json.loads(switched.stdout)
    assert new == {"worker": "prefill-3", "role": "prefill"}
    assert roles(cluster) == {"prefill-0": "prefill", "prefill-3": "prefill", "decode-1": "decode"}

    last = pdserve("workers", "remove", "decode-1", "--token", TOKEN, "--address", address)
    assert last.returncode == 2 and "last decode worker" in last.stderr
    assert "decode-1" in roles(cluster)

    # A switch asks for its new worker before draining the old one; refused, it starts none (or stops
    # it again): Ray's free CPUs are what the three workers leave, and nothing changes.
    refused = pdserve("workers", "role", "decode-1", "prefill", "--token", TOKEN, "--address", address)
    assert refused.returncode == 2 and "last decode worker" in refused.stderr
    assert roles(cluster) == {"prefill-0": "prefill", "prefill-3": "prefill", "decode-1": "decode"}
    held = 0.25 * len(cluster.workers)  # each worker's num_cpus
    assert wait_until(lambda: abs(ray.available_resources().get("CPU", 0.0) + held - ray.cluster_resources()["CPU"])
                      < 1e-6, timeout=30)
