"""The `pdserve` command line, run as a user runs it (a real subprocess; its argument checks in-process)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import ray
from cluster_helpers import assert_all_stopped, interrupt, pdserve, start_up, wait_ready
from helpers import hub_cache

from pdserve.client import Client
from pdserve.cluster import cli

HUB_ID = "pdserve-tests/tiny-llama"


def alive_nodes() -> int:
    return sum(1 for n in ray.nodes() if n["Alive"])


def test_make_model_writes_a_checkpoint(tmp_path):
    result = pdserve("make-model", "tiny-qwen2", str(tmp_path / "m"), "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "m" / "pdserve_preset.json").read_text())["seed"] == 3
    listing = pdserve("make-model", "--list")
    assert "llama-150m" in listing.stdout


def test_unknown_preset_is_a_clear_error(tmp_path):
    result = pdserve("make-model", "gpt-9", str(tmp_path / "x"))
    assert result.returncode == 2 and "unknown preset 'gpt-9'" in result.stderr


@pytest.mark.parametrize(("trace", "error"), [("no-such-trace.csv", "trace 'no-such-trace.csv' not found in"),
                                              ("mooncake_synthetic_trace.jsonl", "must be a CSV")])
def test_a_benchmark_trace_it_cannot_use_is_a_clear_error(tmp_path, capsys, trace, error):
    for command in (["bench", "cluster", "--out"], ["bench", "serve", "--out-dir"]):  # refused before any cluster starts
        assert cli.main([*command, str(tmp_path / "out"), "--trace", trace]) == 2
        assert error in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_bench_kv_times_the_transports_alone_with_frames_of_a_given_size(tmp_path, capsys):
    """`--codecs` with none: the transport table alone; `--token-bytes`: its frames as a larger model's
    (a layer's 1,536 tokens of 4 KiB: 6 MiB)."""
    out = tmp_path / "kv.json"
    result = pdserve("bench", "kv", "--transports", "tcp", "--tokens", "2048", "--repeats", "1",
                     "--token-bytes", "4096", "--codecs", "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["codecs"] == []
    rows = {row["transport"]: row for row in report["transports"]}
    assert set(rows) == {"tcp"} and rows["tcp"]["share_of_socket"] > 0
    assert all(row["frame_bytes"] == 1536 * 4096 and row["bytes"] == 4 * 2048 * 4096 for row in rows.values())
    for token_bytes in ("0", str((1 << 30) // 1536 + 1)):  # frames of no bytes, or past what a receiver believes
        assert cli.main(["bench", "kv", "--token-bytes", token_bytes, "--out", str(out)]) == 2
        assert "token bytes must make frames of 1 to" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_demo_runs_a_local_cluster_and_stops_it(tmp_path, model_dirs):
    manifest = tmp_path / "demo.yaml"
    manifest.write_text(f"model: {model_dirs['tiny-llama']}\nkv_memory_mb: 16\n"
                        "server: {address: '127.0.0.1:0', http_address: '127.0.0.1:0'}\n"
                        "pools:\n  prefill: {num_cpus: 0.5}\n  decode: {num_cpus: 0.5}\n")
    result = pdserve("demo", "--manifest", str(manifest), "--max-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(" tokens, finish=") == 6  # length, or stop where the random model says EOS
    assert "latency summary (disaggregated, 6 requests)" in result.stdout
    assert result.stdout.rstrip().endswith("cluster stopped")


@pytest.mark.timeout(300)
def test_up_interrupted_while_starting_stops_what_it_started(tmp_path, model_dirs):
    up = start_up(tmp_path, model_dirs)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            line = up.stdout.readline()
            if not line or line.startswith("starting "):
                break
        assert line.startswith("starting "), "pdserve up never started its workers"
    finally:
        rest, started = interrupt(up)
    assert up.returncode == 130 and "pdserve: interrupted" in rest and "ready:" not in rest, rest
    assert "raylet" in started.values(), "the test interrupted pdserve up before it started Ray"
    assert_all_stopped(started)


@pytest.mark.timeout(300)
def test_up_serves_until_interrupted_then_leaves_nothing_running(tmp_path, model_dirs, hf_reference,
                                                                 shared_ray_address):
    """`pdserve up` serving a model named by its Hugging Face Hub id, from the Hub's cache under
    HF_HOME with the Hub out of reach (HF_HUB_OFFLINE), as a user whose cache holds it runs it. Its
    manifest says `ray.address: local` (the default) while RAY_ADDRESS points at a running Ray (the
    tests' shared one), as in a shell that ran `ray start`: it starts a Ray of its own and leaves
    that one alone. With `--log-level info` every part's diagnostics reach its console (the workers'
    through Ray), the lifetime events stay apart from them, and Ray's notice that its new local
    instance uses token authentication is not among them."""
    hub_cache(tmp_path / "hf-home", HUB_ID, model_dirs["tiny-llama"])
    nodes = alive_nodes()
    up = start_up(tmp_path, model_dirs, model=HUB_ID, options=("--log-level", "info"),
                  env={"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": shared_ray_address})
    seen: list[str] = []
    try:
        address = wait_ready(up, seen=seen)
        with Client(address, timeout=60) as client:
            assert client.model_info().name == HUB_ID
            prompt = client.tokenize("hello there")
            assert client.generate(prompt, max_tokens=6, temperature=0, ignore_eos=True).token_ids == \
                hf_reference["tiny-llama"].greedy(prompt, 6)
        result = pdserve("generate", "--address", address, "--max-tokens", "4", "--temperature", "0", "hello")
        assert result.returncode == 0 and "finish=length" in result.stderr, result.stderr
        bad = pdserve("generate", "--address", address, "--temperature", "-1", "hello")
        assert bad.returncode == 1 and "INVALID_ARGUMENT: temperature must be a finite number >= 0" in bad.stderr
    finally:
        rest, started = interrupt(up)
    assert up.returncode == 0, rest
    assert "shutting down" in rest
    output = "".join(seen) + rest
    # A decode worker's receiver, logged at INFO in the worker's process, forwarded by Ray.
    assert re.search(r"DecodeWorker pid=\d+\).* INFO pdserve\.kv_transfer\.\S+: KV \w+ receiver listening on", output), output
    lifetimes = [line for line in output.splitlines() if line.startswith('{"request_id"')]
    assert len(lifetimes) >= 3 and all(json.loads(line)["api"] for line in lifetimes), output  # whole JSON lines
    assert "pdserve.lifetime" not in output, output  # not also formatted as a diagnostic
    assert "Token authentication is enabled" not in output, output
    assert "raylet" in started.values(), "pdserve up joined the running Ray instead of starting its own"
    assert_all_stopped(started)
    assert alive_nodes() == nodes  # the running Ray, seen through this process's connection to it


FORK_WHILE_GRPC_RUNS = """
import subprocess, threading
import pdserve.cluster.cli  # as the `pdserve` command starts
import grpc
from concurrent import futures
server = grpc.server(futures.ThreadPoolExecutor(2))
channel = grpc.insecure_channel(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
server.start()
done = threading.Event()
def call():  # gRPC threads busy, as the router's are while a benchmark starts its next cluster
    while not done.is_set():
        try:
            grpc.channel_ready_future(channel).result(timeout=0.01)
        except grpc.FutureTimeoutError:
            pass
caller = threading.Thread(target=call)
caller.start()
for _ in range(20):  # fork, then exec, as Ray starts its processes (a preexec_fn rules out vfork)
    subprocess.run(["true"], preexec_fn=lambda: None, check=True)
done.set()
caller.join()
server.stop(None)
"""


def test_processes_the_command_starts_while_grpc_runs_log_nothing_about_fork():
    """gRPC's "skipping fork() handlers" notice, once per process Ray started, is gone from the logs of
    a command that starts clusters one after another."""
    result = subprocess.run([sys.executable, "-c", FORK_WHILE_GRPC_RUNS], capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"})
    assert result.returncode == 0, result.stderr
    assert "fork" not in result.stderr, result.stderr
