"""One Ray runtime shared by the cluster tests.

Starting Ray costs 8-10 s on the CI machine, starting a cluster on a running Ray about 4 s; a
`Cluster` whose manifest says `ray.address: local` joins a Ray that is already initialized in the
process and leaves it running when it stops. So the first test that needs Ray starts one here, and
every cluster after it reuses it. A module that drives its own Ray (a multi-node cluster started by
`ray start`, subprocesses running `pdserve`) marks itself `own_ray`: the shared runtime is shut down
before it and started again after it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import ray

from pdserve.cluster.launcher import Cluster
from pdserve.cluster.supervisor import RestartBackoff

# Logical CPUs: every test cluster asks for fractions of a CPU per worker and must never wait for
# the previous cluster's killed actors to hand theirs back.
SHARED_RAY_CPUS = 16


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "own_ray: the module starts and stops Ray itself (no shared runtime)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules that drive a Ray of their own run first, before this process has started and shut down
    the shared one: a driver that joined another cluster after that had its first actors cancelled."""
    items.sort(key=lambda item: item.get_closest_marker("own_ray") is None)  # stable: order kept otherwise


@pytest.fixture(autouse=True, scope="module")
def shared_ray(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("own_ray") is not None:
        if ray.is_initialized():
            ray.shutdown()
    elif not ray.is_initialized():
        ray.init(address="local", num_cpus=SHARED_RAY_CPUS, include_dashboard=False,
                 logging_level=logging.WARNING, configure_logging=True)
    yield


@pytest.fixture(autouse=True)
def fresh_restart_backoff(request: pytest.FixtureRequest) -> None:
    """A worker a test kills rejoins after the first back-off, however many restarts earlier tests on the
    same module-scoped cluster caused (the back-off doubles with each restart, up to 30 s)."""
    for name in request.fixturenames:
        if name.endswith("cluster"):
            cluster = request.getfixturevalue(name)
            if isinstance(cluster, Cluster) and cluster._supervisor is not None:
                cluster._supervisor.backoff = RestartBackoff.of(cluster.manifest.deadlines.health)
