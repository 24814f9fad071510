"""Helpers for the cluster tests: small manifests, waiting until every pool is free again, running
code inside a worker actor (Ray's `__ray_call__`) to gate or break it, and the `pdserve` command."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import ray
import yaml

from pdserve.client import Client
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
    # A retry waits up to 90 s for a healthy worker, not the default 30: a killed worker's restart (a
    # fresh process importing torch and transformers) took longer on the CI machine's two loaded cores.
    router = {"local_prefill_tokens": 0, "retry_wait_s": 90, **extra.pop("router", {})}
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


def wait_clean_audit(cluster: Cluster, timeout_s: float = 30.0) -> None:
    """Until an idle audit made from now on finds every pool fully free (bounded)."""
    audits = cluster.audit.clean + cluster.audit.dirty
    deadline = time.monotonic() + timeout_s
    while True:
        last = cluster.audit.last
        if cluster.audit.clean + cluster.audit.dirty > audits and last.clean:
            return
        assert time.monotonic() < deadline, f"no clean idle audit within {timeout_s} s: {last}"
        time.sleep(0.2)


def set_layerwise_min_tokens(self, tokens: int) -> int:
    """Inside the prefill worker: the passes streamed layer by layer from now on; the setting before."""
    before = self.sender.settings.layerwise_min_tokens
    self.sender.settings = dataclasses.replace(self.sender.settings, layerwise_min_tokens=tokens)
    return before


def record_engine_aborts(self) -> None:
    """On a worker: keep the id of every request its engine aborted while holding it
    (`self.test_engine_aborts`): the proof that a cancel reached the worker and stopped its tokens."""
    self.test_engine_aborts, abort = [], self.engine.abort_request

    def recording(request_id: str) -> bool:
        held = abort(request_id)
        if held:
            self.test_engine_aborts.append(request_id)
        return held

    self.engine.abort_request = recording


def lifetime_records(caplog) -> list[dict]:
    """The router's lifetime lines (one per request that ended) that `caplog` caught."""
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "pdserve.lifetime"]


def wait_for_lifetime_record(caplog, timeout_s: float = 10.0) -> dict:
    """The lifetime record of the request that ended last, once the router has written it."""
    deadline = time.monotonic() + timeout_s
    while not lifetime_records(caplog):  # written when the router has ended the request
        assert time.monotonic() < deadline, "the router never ended the request"
        time.sleep(0.05)
    return lifetime_records(caplog)[-1]


def assert_aborted(cluster: Cluster, caplog, code: str, max_tokens: int) -> None:
    """The request that ended last ended with `code` before its `max_tokens`, a decode worker's engine
    aborted it (it was running there: its tokens stopped), and every pool is free again."""
    ended = wait_for_lifetime_record(caplog)
    deadline = time.monotonic() + 10
    assert ended["code"] == code and ended["output_tokens"] < max_tokens, ended
    decode = [w for w in cluster.workers if w.pool == "decode"]
    while not any(ended["request_id"] in on_worker(w, lambda self: self.test_engine_aborts) for w in decode):
        assert time.monotonic() < deadline, f"no decode worker aborted {ended['request_id']}"
        time.sleep(0.05)
    assert_idle(cluster)


def worker(cluster: Cluster, pool: str):
    return next(w for w in cluster.workers if w.pool == pool)


def worker_pid(self) -> int:
    """Inside a worker: its process id (to kill it for real, by pid)."""
    return os.getpid()


def wait_healthy(cluster: Cluster, timeout_s: float = 90.0) -> None:
    """Until every worker of the cluster is healthy (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not all(w.healthy for w in cluster.workers):
        assert time.monotonic() < deadline, [(w.name, w.healthy) for w in cluster.workers]
        time.sleep(0.1)


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


def start_up(tmp_path, model_dirs, env: dict[str, str] | None = None, model: str | None = None,
             options: tuple[str, ...] = ()) -> subprocess.Popen:
    """`pdserve up` on a small local manifest (a real subprocess) with command-line `options`, its output
    on a pipe; its model `model` (a Hub id, say), else the tiny Llama."""
    manifest = tmp_path / "up.yaml"
    manifest.write_text(f"model: {model or model_dirs['tiny-llama']}\nkv_memory_mb: 16\n"
                        "server: {address: '127.0.0.1:0', http_address: '127.0.0.1:0'}\n"
                        "pools:\n  prefill: {num_cpus: 0.5}\n  decode: {num_cpus: 0.5}\n")
    return subprocess.Popen([sys.executable, "-m", "pdserve.cluster.cli", "up", str(manifest), *options],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})


def wait_ready(up: subprocess.Popen, timeout_s: float = 180.0, seen: list[str] | None = None) -> str:
    """The gRPC address `pdserve up` prints once it serves (its output read line by line, bounded; the
    lines read so far appended to `seen`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if seen is not None:
            seen.append(line)
        if not line:
            break
        if line.startswith("ready:"):
            return line.split("--address ")[1].split()[0]
    raise AssertionError("pdserve up never became ready")


def interrupt(up: subprocess.Popen) -> tuple[str, dict[psutil.Process, str]]:
    """Interrupt `pdserve up` as Ctrl-C does; its output from here on, and every process it had started
    (Ray's own included) by name, taken just before the interrupt."""
    started = {p: p.name() for p in psutil.Process(up.pid).children(recursive=True)}
    up.send_signal(signal.SIGINT)
    return up.communicate(timeout=120)[0], started


def assert_all_stopped(started: dict[psutil.Process, str]) -> None:
    alive = psutil.wait_procs(list(started), timeout=30)[1]  # pdserve up has exited: what it started goes with it
    assert not alive, f"still running after pdserve up stopped: {[started[p] for p in alive]}"


class RayNode:
    """A Ray node this test starts with `ray start --block` (optionally inside a network namespace), and
    stops by its own pids: never `ray stop`, which stops every Ray on the machine."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str], ns: str | None = None,
                 timeout_s: float = 120.0) -> None:
        # This interpreter's `ray start` (not the first on PATH): its workers import this pdserve, a venv's too.
        ray_start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block"]
        command = (["ip", "netns", "exec", ns] if ns else []) + ray_start + args
        self._log = log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in log_path.read_text():  # printed once the node is up, before blocking
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start did not come up: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM to `ray start --block` and to every process under it at once; what is still running
        after a short grace period is killed. (SIGTERM to `ray start` alone left the raylets a fake
        multi-node autoscaler started running, and `ray start` itself then waited on Ray processes that
        ignore SIGTERM: a teardown took 20 s.)"""
        started: list[psutil.Process] = []
        try:
            for signal_to_send, grace_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 15.0)):
                started += [p for p in _tree(self.process.pid, started) if p not in started]  # any started since
                for p in _running(started):
                    try:
                        p.send_signal(signal_to_send)
                    except psutil.NoSuchProcess:
                        pass
                deadline = time.monotonic() + grace_s
                while _running(started) and time.monotonic() < deadline:
                    time.sleep(0.1)
            self.process.wait(timeout=30)
        finally:
            self._log.close()


def _tree(pid: int, known: list[psutil.Process]) -> list[psutil.Process]:
    """The process `pid` and every process under it, and under those of `known` still running (a
    process whose parent has gone is re-parented, out of `pid`'s tree)."""
    tree = []
    for root in [pid, *(p.pid for p in _running(known))]:
        try:
            process = psutil.Process(root)
            tree += [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return tree


def _running(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running: a zombie (ended, its parent not yet reaping it) is not."""
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Streams:
    """Streaming requests consumed on threads: each one's tokens, and any failure (seen by the test)."""

    def __init__(self, cluster: Cluster, prompts: list[list[int]], params: list[dict]) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.failures: list[Exception] = []
        # A thread per stream: the test acts on the cluster (drains, kills) while they are consumed.
        self._threads = [threading.Thread(target=self._consume, args=(cluster.address, i, p, kw))
                         for i, (p, kw) in enumerate(zip(prompts, params))]
        for thread in self._threads:
            thread.start()

    def _consume(self, address: str, i: int, prompt: list[int], params: dict) -> None:
        try:
            with Client(address, timeout=120) as client:
                for chunk in client.generate(prompt, stream=True, **params):
                    self.tokens[i].extend(chunk.token_ids)
        except Exception as e:
            self.failures.append(e)

    def wait_tokens(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while min(len(t) for t in self.tokens) < n:
            assert time.monotonic() < deadline and not self.failures, (self.failures, [len(t) for t in self.tokens])
            time.sleep(0.01)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(120)


def undisturbed(cluster: Cluster, prompts: list[list[int]], params: list[dict]) -> list[list[int]]:
    with Client(cluster.address, timeout=120) as client:
        return [client.generate(p, **kw).token_ids for p, kw in zip(prompts, params)]


# Ray switches token authentication on for `ray start` when ~/.ray/auth_token exists; a test's driver
# (the test process) joins without a token, as on a machine that never made one.
FAKE_CLUSTER_ENV = {"RAY_FAKE_CLUSTER": "1", "RAY_AUTH_MODE": "disabled"}


def start_fake_cluster(config_path: Path, tmp: Path, env: dict[str, str] | None = None,
                       **config_changes: object) -> tuple[RayNode, str]:
    """The head of Ray's fake multi-node cluster of `config_path` (its autoscaler starts the worker
    "nodes", raylets on this machine) on a free port of its own (the provider's `gcs_address` tells its
    nodes where to join), with `config_changes` to the config's top level. Returns the head (stop it)
    and its address."""
    address = f"{ray.util.get_node_ip_address()}:{free_port()}"
    config = {**yaml.safe_load(config_path.read_text()), **config_changes}
    config["provider"]["gcs_address"] = address
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    head = RayNode(["--head", f"--port={address.rsplit(':', 1)[1]}", f"--autoscaling-config={tmp / 'config.yaml'}",
                    "--include-dashboard=false", "--disable-usage-stats", "--object-store-memory=200000000"],
                   tmp / "head.log", {**os.environ, **FAKE_CLUSTER_ENV, **(env or {})}, timeout_s=120)
    return head, address


def alive_nodes() -> int:
    return sum(1 for n in ray.nodes() if n["Alive"])
