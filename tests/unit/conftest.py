"""The unit tests run without a Ray cluster: ``make test-unit`` runs them alone."""

from __future__ import annotations

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
