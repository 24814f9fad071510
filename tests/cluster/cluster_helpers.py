"""Helpers for the cluster tests: small manifests, waiting until every pool is free again, running
code inside a worker actor (Ray's `__ray_call__`) to gate or break it, and the `pdserve` command."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import ray

from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import load_manifest
from pdserve.wire import WorkerStatus

# Functions of this module run inside worker actors (`on_worker`), where tests/ is not importable.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def manifest(model_dir, mode="disaggregated", transport="shm", **extra):
    """A small test cluster. Every disaggregated request takes the KV transfer path and sends its KV
    unless the test says otherwise (`router={"local_prefill_tokens": None}` measures conditional
    disaggregation's threshold, which sends short prompts to their decode worker;
    `kv_transfer={"recompute": True}` lets a slow link make the decode worker recompute the KV). Every
    prompt streams its KV layer by layer beside its pass (the path where most threads meet), unless
    the test sets `kv_transfer.layerwise_min_tokens`."""
    router = {"local_prefill_tokens": 0, **extra.pop("router", {})}
    kv_transfer = {"transport": transport, "lease_s": 5, "recompute": False, "layerwise_min_tokens": 0,
                   **extra.pop("kv_transfer", {})}
    data = {
        "model": str(model_dir), "mode": mode, "kv_memory_mb": 16, "max_model_len": 512, "kv_transfer": kv_transfer,
        "server": {"address": "127.0.0.1:0", "http_address": "127.0.0.1:0", **extra.pop("server", {})},
        "pools": {"prefill": {"num_cpus": 0.5}, "decode": {"num_cpus": 0.5}},
        "router": router,
        **extra,
    }
    return load_manifest(data)


def pdserve(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The `pdserve` command line, run as a user runs it (a real subprocess)."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def wait_until_idle(cluster: Cluster, timeout_s: float = 10.0) -> list[WorkerStatus]:
    """Poll the workers until every pool is fully free (bounded); return their last status."""
    return cluster.wait_idle(timeout_s)[1]


def assert_idle(cluster: Cluster) -> None:
    status = wait_until_idle(cluster)
    for s in status:
        assert not s.holdings, f"{s.worker_id} holds {s.holdings}: {s}"


def worker(cluster: Cluster, pool: str):
    return next(w for w in cluster.workers if w.pool == pool)


def on_worker(ref, fn, *args):
    """Run `fn(worker_instance, *args)` inside the worker actor."""
    return ray.get(ref.handle.__ray_call__.remote(fn, *args), timeout=30)


def prefill_job_states(self) -> list[str]:
    """Inside a prefill worker: the state of each job it holds: "queued", or its transfer's state."""
    with self._lock:
        return [job.kv.transfer.state.value if job.kv is not None else job.state for job in self._jobs.values()]


def attribute_owner(self, path: str) -> tuple[object, str]:
    """The object holding the attribute at dotted `path` inside the worker, and the attribute's name."""
    owner_path, _, name = path.rpartition(".")
    owner = self
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    return owner, name


def install_gate(self, path: str, when=lambda *args, **kwargs: True) -> None:
    """Make the worker's method at `path` ("_start", "receiver.reserve", ...) wait until `open_gate`:
    every call, or those whose arguments `when` accepts."""
    owner, name = attribute_owner(self, path)
    original, gate = getattr(owner, name), threading.Event()

    def gated(*args, **kwargs):
        if when(*args, **kwargs):
            gate.wait(30)
        return original(*args, **kwargs)

    setattr(owner, name, gated)
    self.test_gate = (gate, lambda: setattr(owner, name, original))


def open_gate(self) -> None:
    gate, restore = self.test_gate
    restore()
    gate.set()
