"""What deploy/ ships is valid: every deployment manifest loads, every `ray up` config passes Ray's own
schema, and the node types (cloud configs, KubeRay worker groups, on-premises start commands) offer the
custom resources the manifests' pools ask for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

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
