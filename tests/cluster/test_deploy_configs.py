"""What deploy/ ships is valid: every deployment manifest loads (and the local one serves), every `ray up` config passes Ray's own
schema, and the node types (cloud configs, KubeRay worker groups, on-premises start commands) offer the
custom resources the manifests' pools ask for."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import yaml
from cluster_helpers import assert_idle

from pdserve.client import Client
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import load_manifest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
RAY_CONFIGS = sorted((DEPLOY / "ray").glob("*.yaml"))


def pool_resources() -> set[str]:
    """Every custom resource a shipped manifest's pools ask for."""
    wanted = set()
    for path in MANIFESTS:
        m = load_manifest(path)
        for pool in (m.pools.prefill, m.pools.decode):
            if pool.replicas:
                wanted |= set(pool.resources)
    return wanted


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_loads(path):
    load_manifest(path)


@pytest.mark.parametrize("path", RAY_CONFIGS, ids=lambda p: p.name)
def test_every_ray_config_passes_rays_schema_and_offers_the_pool_resources(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(path.read_text())
    if config["provider"]["type"] == "fake_multinode":
        validate_config(config)  # written out in full (this Ray install lacks the provider's defaults file)
    else:
        validate_config(prepare_config(config))
    if config["provider"]["type"] == "local":  # no node types: the start commands say each host's pool
        offered = {r for r in ("prefill", "decode") if r in " ".join(config["worker_start_ray_commands"])}
    else:
        offered = {r for t in config["available_node_types"].values() for r in t.get("resources", {})}
    assert pool_resources() <= offered


def test_the_kuberay_cluster_has_a_worker_group_per_pool():
    cluster = yaml.safe_load((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    assert cluster["kind"] == "RayCluster"
    offered = set()
    for group in cluster["spec"]["workerGroupSpecs"]:
        offered |= set(json.loads(json.loads(group["rayStartParams"]["resources"])))
    assert pool_resources() <= offered


def test_the_shipped_local_manifest_serves_over_both_apis():
    """deploy/local.yaml as shipped (the default of `pdserve up` and `pdserve demo`), but for its fixed
    ports: the shipped model, a request through the SDK and one through the OpenAI client."""
    data = yaml.safe_load((DEPLOY / "local.yaml").read_text())
    data["server"].update(address="127.0.0.1:0", http_address="127.0.0.1:0")
    with Cluster(load_manifest(data), log=lambda _: None) as cluster:
        with Client(cluster.address, timeout=120) as client:
            out = client.generate("def main():\n", max_tokens=8, temperature=0, ignore_eos=True)
        assert len(out.token_ids) == 8 and out.text
        api = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="none", max_retries=0)
        model = api.models.list().data[0].id
        reply = api.completions.create(model=model, prompt="import os\n", max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].text
        assert_idle(cluster)
