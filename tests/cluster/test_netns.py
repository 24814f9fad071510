"""Serving across a real network hop: two Ray nodes in two network namespaces this test creates,
joined by a veth pair with private addresses that exist only inside them. The prefill worker runs in
one namespace, the decode worker in the other; the KV crosses the veth over gRPC; greedy outputs are
exact. The namespaces (and with them the veth pair) are removed afterwards. Skipped where the test may
not create namespaces."""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from cluster_helpers import RayNode

ARCH = "tiny-llama"
DRIVER = Path(__file__).resolve().parent / "netns_driver.py"
HEAD_PORT = 6380  # inside namespace a: no other process on the machine sees it
TIMEOUT_S = 180
# Ray 2.60's token authentication, with a token of this test's own for the head, the node and the driver.
RAY_ENV = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def run(*cmd: str, ns: str | None = None, **kw) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    return subprocess.run(full, check=True, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)


@pytest.fixture(scope="module")
def namespaces():
    """Two namespaces, a and b, with 10.213.x.1 and 10.213.x.2 on the two ends of a veth pair."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    tag = uuid.uuid4().hex[:6]
    a, b, veth = f"pds-{tag}-a", f"pds-{tag}-b", f"pds{tag}"
    net = f"10.213.{random.randrange(1, 255)}"
    made = []
    try:
        for ns in (a, b):
            try:
                run("ip", "netns", "add", ns)
                made.append(ns)
                run("true", ns=ns)
            except subprocess.CalledProcessError as e:
                pytest.skip(f"cannot create or enter network namespaces here: {e.stderr.strip()}")
        # Both ends made inside the namespaces: removing the namespaces removes the pair on every path.
        run("ip", "link", "add", f"{veth}a", "netns", a, "type", "veth", "peer", "name", f"{veth}b", "netns", b)
        for ns, end, host in ((a, f"{veth}a", 1), (b, f"{veth}b", 2)):
            run("ip", "-n", ns, "addr", "add", f"{net}.{host}/24", "dev", end)
            run("ip", "-n", ns, "link", "set", end, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
        yield {"a": (a, f"{net}.1"), "b": (b, f"{net}.2")}
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def ray_nodes(namespaces, tmp_path_factory):
    (a, ip_a), (b, ip_b) = namespaces["a"], namespaces["b"]
    common = ["--num-cpus=1", "--disable-usage-stats", "--object-store-memory=150000000"]
    logs = tmp_path_factory.mktemp("ray-nodes")
    nodes = [RayNode(["--head", f"--node-ip-address={ip_a}", f"--port={HEAD_PORT}", "--include-dashboard=false",
                      '--resources={"prefill": 1}', *common], logs / "head.log", RAY_ENV, ns=a, timeout_s=TIMEOUT_S)]
    try:
        nodes.append(RayNode([f"--address={ip_a}:{HEAD_PORT}", f"--node-ip-address={ip_b}", '--resources={"decode": 1}',
                              *common], logs / "node.log", RAY_ENV, ns=b, timeout_s=TIMEOUT_S))
        yield f"{ip_a}:{HEAD_PORT}"
    finally:
        for node in reversed(nodes):
            node.stop()


def test_kv_crosses_a_veth_between_namespaces_over_tcp_with_exact_outputs(namespaces, ray_nodes, model_dirs,
                                                                          hf_reference):
    (a, ip_a), (_, ip_b) = namespaces["a"], namespaces["b"]
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 900) for _ in range(rng.randint(8, 80))] for _ in range(4)]
    manifest = {"model": str(model_dirs[ARCH]), "kv_memory_mb": 16, "max_model_len": 512,
                "kv_transfer": {"transport": "auto", "recompute": False}, "router": {"local_prefill_tokens": 0},
                "server": {"address": "127.0.0.1:0", "http_address": None},
                "pools": {"prefill": {"num_cpus": 0.5, "resources": {"prefill": 1}},
                          "decode": {"num_cpus": 0.5, "resources": {"decode": 1}}},
                "ray": {"address": ray_nodes}}
    job = json.dumps({"manifest": manifest, "prompts": prompts, "max_tokens": 8})
    out = run(sys.executable, str(DRIVER), ns=a, env=RAY_ENV, input=job)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["outputs"] == [hf_reference[ARCH].greedy(p, 8) for p in prompts]
    assert result["idle"]
    workers = result["workers"]
    assert {w["pool"]: w["node_ip"] for w in workers.values()} == {"prefill": ip_a, "decode": ip_b}
    decode = next(w for w in workers.values() if w["pool"] == "decode")
    assert decode["kv_addresses"]["tcp"].startswith(f"{ip_b}:")  # it listens on its own node's address
    prefill = next(w for w in workers.values() if w["pool"] == "prefill")
    assert 'transport="tcp"' in prefill["metrics"] and 'outcome="success"' in prefill["metrics"]
