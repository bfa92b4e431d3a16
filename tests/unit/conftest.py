"""The unit tests run without a Ray cluster: ``make test-unit`` runs them alone."""

from __future__ import annotations

import sys
from typing import Any

import pytest


def pytest_collection_modifyitems(config: Any, items: list[pytest.Item]) -> None:
    # A cluster test under unit/ would make `make test-unit` start Ray: it belongs in
    # integration/.
    wrong = [i.nodeid for i in items if "/unit/" in i.nodeid.replace("\\", "/")
             and i.get_closest_marker("ray") is not None]
    if wrong:
        raise pytest.UsageError(f"tests marked ray under tests/unit/: {wrong}")


@pytest.fixture()
def world() -> Any:
    """A fresh fake NIXL world (ray_rdt_pool.testing): agents, GCS and clock of one process."""
    from ray_rdt_pool.testing import World

    return World()


@pytest.fixture(autouse=True)
def _no_ray_in_this_process() -> None:
    """A unit test runs in a process without Ray. Under ``make test`` the integration
    modules ran first on the same pytest-xdist worker, on the worker's shared cluster:
    while this process is connected to it, a runtime of the fake NIXL world finds a Ray
    node ID and takes the same-node path, and the test process's settings are in its
    environment. The shared cluster ends here (a later cluster module starts it again)."""
    if "ray" in sys.modules:
        from tests.support.raycluster import end_shared_cluster

        end_shared_cluster()
