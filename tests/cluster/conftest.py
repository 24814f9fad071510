"""One Ray runtime shared by the cluster tests.

Starting Ray costs 8-10 s on the CI machine, starting a cluster on a running Ray about 4 s; a
`Cluster` whose manifest says `ray.address: local` joins a Ray that is already initialized in the
process and leaves it running when it stops. So the first test that needs Ray starts one here (a head
node in a process of its own, `ray start --block`, stopped by pid at the end), every test process
joins it, and every cluster after that reuses it. A module that drives its own Ray (a multi-node
cluster started by `ray start`) marks itself `own_ray`: this process leaves the shared runtime before
it and joins again after it. (A process that had started a Ray head itself and shut it down could not
place actors on a cluster it joined next: they were cancelled before they ran.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import ray
from cluster_helpers import RayNode, free_port

from pdserve.cluster.launcher import RAY_DEATH_INFO_WAIT, Cluster
from pdserve.cluster.supervisor import RestartBackoff

# Logical CPUs: every test cluster asks for fractions of a CPU per worker and must never wait for
# the previous cluster's killed actors to hand theirs back.
SHARED_RAY_CPUS = 16


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "own_ray: the module starts and stops Ray itself (no shared runtime)")


@pytest.fixture(scope="session")
def shared_ray_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    # Ray switches token authentication on for `ray start` when ~/.ray/auth_token exists; the tests'
    # drivers join without a token, as on a machine that never made one. No log monitor: it globs every
    # worker's log files ten times a second (about 7% of a core over the suite, for hundreds of files)
    # to forward their lines to the drivers, which no test reads; each worker's log stays in its file.
    head = RayNode(["--head", "--node-ip-address=127.0.0.1", f"--port={address.rsplit(':', 1)[1]}",
                    f"--num-cpus={SHARED_RAY_CPUS}", "--include-dashboard=false", "--disable-usage-stats",
                    "--include-log-monitor=false"],
                   tmp_path_factory.mktemp("shared-ray") / "head.log",
                   {**os.environ, "RAY_AUTH_MODE": "disabled", RAY_DEATH_INFO_WAIT: "0"})  # as `Cluster` runs Ray
    try:
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        head.stop()


@pytest.fixture(autouse=True, scope="module")
def shared_ray(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("own_ray") is not None:
        if ray.is_initialized():
            ray.shutdown()
    elif not ray.is_initialized():
        os.environ.setdefault(RAY_DEATH_INFO_WAIT, "0")  # as `Cluster` sets it before joining
        ray.init(address=request.getfixturevalue("shared_ray_address"), logging_level=logging.WARNING,
                 configure_logging=True)
    yield


@pytest.fixture(autouse=True)
def fresh_restart_backoff(request: pytest.FixtureRequest) -> None:
    """A worker a test kills rejoins after the first back-off, however many restarts earlier tests on the
    same module-scoped cluster caused (the back-off doubles with each restart)."""
    for name in request.fixturenames:
        if name.endswith("cluster"):
            cluster = request.getfixturevalue(name)
            if isinstance(cluster, Cluster) and cluster._supervisor is not None:
                cluster._supervisor.backoff = RestartBackoff.of(cluster.manifest.deadlines.health)
