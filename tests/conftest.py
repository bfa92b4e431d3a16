"""Test-session hooks.

Each test process (a pytest-xdist worker, or pytest itself with ``-n 0``) runs one Ray
cluster, shared by its cluster modules (the ``ray_cluster`` fixture below; the cluster
and the helpers are in tests/support/raycluster.py), and ends it when the session ends.
A module that needs a cluster of its own says why at its top and is marked
``own_cluster``; the scheduler below runs those first.

The session used to end with ``os._exit``: in 2 of about 9 runs, when each module started
and stopped a cluster of its own (some forty per process), pytest segfaulted during
interpreter finalization after every test had passed. With one cluster per process it
ends as any driver does: the cluster and this package's transport are shut down here,
then the interpreter finalizes (the product's own exit path is tested in drivers that
exit normally, tests/integration/test_lifecycle.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest


def pytest_configure(config: Any) -> None:
    # No Ray cluster of this session, or of the drivers it runs in subprocesses, prestarts
    # idle workers for its first driver: every actor of the tests has a runtime_env of its
    # own, which no prestarted worker matches, so they only cost a Python start each.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")


@pytest.fixture(scope="module", autouse=True)
def _module_environment() -> Iterator[None]:
    """Every module starts from the session's settings of this package, and leaves them
    as it found them.

    ``start_ray`` writes a module's settings into ``os.environ`` (the driver reads them
    too), and Ray's workers inherit the driver's environment. Without this, a setting
    one module left behind (``RAY_RDT_POOL_SAME_NODE=off``, say) reached the actors of
    whichever module ran next in that process, so a module's result depended on the
    order (run after one that turned the same-node path off, the weights API's source
    reads silently stopped, found by running the modules on two pytest workers).
    """
    saved = {k: v for k, v in os.environ.items() if k.startswith(_OURS)}
    yield
    # Only this package's settings: ray.init writes settings of its own into the
    # environment (RAY_AUTH_MODE among them), which later clusters of this process
    # rely on.
    for k in [k for k in os.environ if k.startswith(_OURS)]:
        del os.environ[k]
    os.environ.update(saved)
    if "ray" in sys.modules:  # the module shut its cluster down: see drop_stale_rdt_manager
        from tests.support.raycluster import drop_stale_rdt_manager

        drop_stale_rdt_manager()


_OURS = "RAY_RDT_POOL_"


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """The shared Ray cluster of this test process, for this module: its GCS address (a
    driver in a subprocess joins it through ``RAY_ADDRESS``). Started by the first module
    that asks for it, and ended with the session; every actor the module made must be gone
    at its end (tests/support/raycluster.py)."""
    from tests.support.raycluster import module_actors_end, shared_cluster

    address = shared_cluster()
    with module_actors_end():
        yield address

# -- scheduling on pytest-xdist workers (`make test`: --dist loadgroup) -------------------
#
# A work unit runs on one worker. A module under integration/, stress/ or gpu/ is one
# unit, so its module-scoped actors start once; every other test is a unit of its own.
# The units of modules that run a cluster of their own (marked ``own_cluster``) go
# first, so that each worker leaves its shared cluster as seldom as possible; then the
# longest first (the costs below, in seconds of a measured run on two cores; a unit not
# listed costs 1 per test), so that no long unit starts last and leaves the other
# workers idle at the end.

#: Modules whose tests share no module-scoped actors (each test runs its own driver or
#: README block in a subprocess, or needs no cluster): each test is a unit of its own.
_PER_TEST = {
    "integration/test_bench_cli.py",
    "integration/test_lifecycle.py",
    "integration/test_readme_blocks.py",
}

#: Measured cost of the long units (a module, or module::test for a per-test module).
# BEGIN COSTS (written by tools/test_costs.py from a measured run: make test-costs)
_COST = {
    'integration/test_reliability.py': 210,
    'integration/test_weights_invariants.py': 142,
    'integration/test_bench_cli.py::test_cli_smallest_run_writes_complete_json': 139,
    'integration/test_cli.py': 107,
    'integration/test_examples.py': 99,
    'integration/test_transport.py': 90,
    'integration/test_weights_catchup.py': 61,
    'integration/test_async_after_faults.py': 51,
    'integration/test_same_node.py': 44,
    'integration/test_weights_relay.py': 41,
    'integration/test_observability.py': 40,
    'integration/test_multinode.py': 40,
    'integration/test_weights.py': 39,
    'integration/test_lifecycle.py::test_driver_sends_and_maps_again_after_a_ray_restart': 39,
    'integration/test_source_reads.py': 35,
    'integration/test_weights_ranks.py': 33,
    'stress/test_chaos.py': 32,
    'integration/test_same_node_kept.py': 32,
    'integration/test_lifecycle.py::test_driver_that_received_objects_exits_cleanly': 30,
    'integration/test_weights_serving.py': 26,
    'integration/test_native_build.py': 22,
    'integration/test_weights_engine.py': 20,
    'integration/test_weights_tp.py': 15,
    'integration/test_weights_memory.py': 14,
    'integration/test_lifecycle.py::test_driver_exits_quietly_while_an_overflow_region_lingers': 14,
    'integration/test_readme_blocks.py::test_readme_python_block_runs': 12,
    'unit/nixl/test_read_lanes.py::test_progress_is_fast_after_a_put_and_slow_when_idle': 8,
    'integration/test_lifecycle.py::test_shutdown_stops_the_thread_and_removes_the_agent_key': 7,
    'unit/core/test_allocator.py::test_allocator_state_machine_runs_10k_operations': 7,
    'unit/nixl/test_read_lanes.py::test_two_real_lanes_read_byte_exact_between_two_processes': 7,
    'integration/test_bench_cli.py::test_floor_lanes_check_each_variants_bytes': 5,
}
# END COSTS


def _unit_of(nodeid: str, module_size: int) -> tuple[str, float]:
    """The work unit of test ``nodeid`` (one of its module's ``module_size``) and the
    unit's cost. No module is split in several units: the suite is CPU-bound (both
    cores busy throughout a run), so a split buys no parallelism and pays for each
    unit's module-scoped actors again."""
    path, _, name = nodeid.partition("::")
    rel = path.split("tests/", 1)[-1]
    test = f"{rel}::{name.split('[', 1)[0]}"
    if rel.split("/", 1)[0] not in ("integration", "stress", "gpu") or rel in _PER_TEST:
        return nodeid, _COST.get(test, _COST.get(rel, 1.0))
    return rel, _COST.get(rel, module_size)


def _units(nodeids: list[str]) -> dict[str, tuple[str, float]]:
    """The work unit and its cost of each of ``nodeids``."""
    by_module: dict[str, list[str]] = {}
    for nodeid in nodeids:
        by_module.setdefault(nodeid.partition("::")[0], []).append(nodeid)
    return {nodeid: _unit_of(nodeid, len(ids)) for ids in by_module.values() for nodeid in ids}


def _distributed(config: Any) -> bool:
    """This process is a pytest-xdist worker, or its controller."""
    return hasattr(config, "workerinput") or config.getoption("dist", "no") != "no"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    # What the workers collect is what gets scheduled, in this order.
    if not _distributed(config):
        return
    units = _units([item.nodeid for item in items])
    order: dict[str, int] = {}
    for item in items:
        order.setdefault(units[item.nodeid][0], len(order))
    own = {units[it.nodeid][0] for it in items if it.get_closest_marker("own_cluster")}
    # Own clusters first, then the longest unit first; a unit's tests stay together and
    # in their order.
    items.sort(key=lambda it: (units[it.nodeid][0] not in own, -units[it.nodeid][1],
                               order[units[it.nodeid][0]]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """xdist's loadscope scheduling, with this suite's work units (``_unit_of``) as its
    scopes, handed out in the workers' collection order (``--no-loadscope-reorder``).

    Not xdist's loadgroup: pytest-xdist 3.8 groups tests by appending the group to
    ``item._nodeid``, which pytest 9 no longer reads, so every test went out as a unit of
    its own; a module's tests ran on both workers, each starting the module's actors
    (or its cluster, or the chaos run) again, in no longest-first order.
    """
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):  # type: ignore[misc]
        unit: dict[str, str] = {}

        def schedule(self) -> None:
            if self.collection is None and self.registered_collections:
                ids = list(next(iter(self.registered_collections.values())))
                self.unit = {n: u for n, (u, _c) in _units(ids).items()}
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            return self.unit.get(nodeid, nodeid)

    return UnitScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: Any) -> None:
    """The session's end: this process's shared cluster and this package's transport go
    before the interpreter finalizes (their atexit hooks would do the same, later)."""
    if "ray" in sys.modules:
        from tests.support.raycluster import end_shared_cluster

        end_shared_cluster()
    if "ray_rdt_pool._ray.runtime" in sys.modules:
        import ray_rdt_pool

        ray_rdt_pool.shutdown()
