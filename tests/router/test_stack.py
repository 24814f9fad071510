"""The router built from a manifest by `RouterStack`, on loopback with no worker behind it: the
manifest's settings reach the placement core and the servers, worker health reaches the prefix
index and the gRPC health service, and closing it leaves nothing listening."""

from __future__ import annotations

import urllib.request

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import wait_until, worker_status

from pdserve.client import Client
from pdserve.cluster.manifest import load_manifest
from pdserve.proto.pdserve.v1 import pdserve_pb2
from pdserve.router.frontend import ServedModel
from pdserve.router.stack import RouterStack
from pdserve.router.workers import WorkerRef


def listening_ports() -> set[int]:
    """The TCP ports this process listens on."""
    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.fixture
def stack():
    manifest = load_manifest({"server": {"address": "127.0.0.1:0", "http_address": "127.0.0.1:0"},
                              "router": {"policy": "least_loaded", "max_queued_prefills": 7, "max_retries": 1}})
    stack = RouterStack(manifest, "127.0.0.1", None, request_snapshot=lambda worker: None)
    yield stack
    stack.close()


def test_the_stack_places_and_serves_as_the_manifest_says(stack):
    workers = [WorkerRef("prefill-0", "prefill", None, status=worker_status()),
               WorkerRef("decode-1", "decode", None, status=worker_status())]
    served = ServedModel("tiny", None, pdserve_pb2.ModelInfo(name="tiny", max_model_len=64, block_size=16), 256)
    placement = stack.place(workers, served)
    assert [w.name for w in placement.prefill_pool] == ["prefill-0"] and placement.decode_pool == workers[1:]
    assert placement.settings.prefill_policy == "least_loaded" and placement.settings.max_queued_prefills == 7
    assert placement.settings.max_model_len == 64

    address = stack.serve()
    with Client(address, timeout=5) as client:
        assert client.model_info().name == "tiny"
    with urllib.request.urlopen(f"http://{stack.http_address}/health", timeout=5) as response:
        assert response.status == 200
    assert health(address) == health_pb2.HealthCheckResponse.SERVING

    stack.kv_events.index.replace("decode-1", [(b"h" * 16, None)])
    workers[1].healthy = False
    stack.health_changed()  # as the supervisor calls it
    assert stack.kv_events.index.num_blocks("decode-1") == 0  # out of the index at once
    assert health(address) == health_pb2.HealthCheckResponse.NOT_SERVING  # no decode worker left

    channels = [stack.tokens.address, stack.kv_events.address]  # tcp://HOST:PORT
    ports = {int(a.rsplit(":", 1)[1]) for a in [address, stack.http_address] + channels}
    assert ports <= listening_ports()
    stack.close()
    # This process's own listeners, not "nobody answers there": another test process may bind a freed port.
    # libzmq's I/O thread closes a socket's listener after `close` returns: waited for, bounded.
    assert wait_until(lambda: not ports & listening_ports(), 5), ports & listening_ports()
    assert stack.loop.loop.is_closed()
