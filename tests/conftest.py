"""Test-session hooks.

The pytest process is an unusual Ray driver: it starts and stops some forty local Ray
clusters (and two-node ``Cluster`` s) in one interpreter. In 2 of about 9 fresh-clone runs
of the whole suite it segfaulted *after* every test had passed and the summary was
printed, during interpreter finalization, with no Python frame to show (the cause is not
found; Ray's and NIXL's native teardown after many init/shutdown cycles is the suspect).
The product's own exit path is tested where it matters, in drivers that exit normally:
``tests/integration/test_lifecycle.py`` (twice in a row, and with received views alive at exit).

So the session ends with an explicit teardown (Ray, then this package's runtime) and
``os._exit`` with pytest's exit status, instead of the interpreter's finalization. Any
thread still alive at that point is named on stderr, to help find the cause later.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

_status: list[int] = []


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

#: Long modules split into this many units: each starts its own actors, in parallel.
_SPLIT = {
    "integration/test_transport.py": 2,
}

#: Measured cost of the long units (a module, or module::test for a per-test module).
# BEGIN COSTS (written by tools/test_costs.py from a measured run: make test-costs)
_COST = {
    'integration/test_transport.py': 224,
    'integration/test_reliability.py': 174,
    'integration/test_weights_relay.py': 131,
    'integration/test_examples.py': 125,
    'integration/test_source_reads.py': 88,
    'integration/test_same_node_kept.py': 84,
    'integration/test_bench_cli.py::test_cli_smallest_run_writes_complete_json': 83,
    'integration/test_async_after_faults.py': 82,
    'integration/test_cli.py': 81,
    'integration/test_same_node.py': 73,
    'integration/test_multinode.py': 71,
    'stress/test_chaos.py': 67,
    'integration/test_weights.py': 63,
    'integration/test_weights_ranks.py': 56,
    'integration/test_weights_memory.py': 44,
    'integration/test_weights_engine.py': 40,
    'integration/test_observability.py': 38,
    'integration/test_weights_tp.py': 36,
    'integration/test_lifecycle.py::test_driver_that_received_objects_exits_cleanly': 36,
    'integration/test_lifecycle.py::'
    'test_same_node_receivers_map_the_drivers_objects_after_a_ray_restart': 33,
    'integration/test_native_build.py': 28,
    'integration/test_lifecycle.py::test_driver_sends_again_after_a_ray_restart': 26,
    'integration/test_readme_blocks.py::test_readme_python_block_runs': 20,
    'integration/test_lifecycle.py::test_driver_exits_quietly_while_an_overflow_region_lingers': 17,
    'integration/test_lifecycle.py::test_shutdown_stops_the_thread_and_removes_the_agent_key': 16,
    'unit/core/test_allocator.py::test_allocator_state_machine_runs_10k_operations': 6,
    'unit/nixl/test_read_lanes.py::test_progress_is_fast_after_a_put_and_slow_when_idle': 6,
    'integration/test_bench_cli.py::test_floor_lanes_check_each_variants_bytes': 5,
}
# END COSTS


def _unit_of(nodeid: str, index_in_module: int, module_size: int) -> tuple[str, float]:
    """The work unit of test ``nodeid`` (the ``index_in_module``-th of its module's
    ``module_size``) and the unit's cost."""
    path, _, name = nodeid.partition("::")
    rel = path.split("tests/", 1)[-1]
    test = f"{rel}::{name.split('[', 1)[0]}"
    if rel.split("/", 1)[0] not in ("integration", "stress", "gpu") or rel in _PER_TEST:
        return nodeid, _COST.get(test, _COST.get(rel, 1.0))
    parts = _SPLIT.get(rel, 1)
    part = index_in_module * parts // max(module_size, 1)
    return f"{rel}#{part}", _COST.get(rel, module_size) / parts


def _units(nodeids: list[str]) -> dict[str, tuple[str, float]]:
    """The work unit and its cost of each of ``nodeids`` (in collection order)."""
    by_module: dict[str, list[str]] = {}
    for nodeid in nodeids:
        by_module.setdefault(nodeid.partition("::")[0], []).append(nodeid)
    return {nodeid: _unit_of(nodeid, i, len(ids))
            for ids in by_module.values() for i, nodeid in enumerate(ids)}


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


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: Any) -> None:
    if not _status or os.environ.get("RAY_RDT_POOL_TEST_NORMAL_EXIT") == "1":
        return  # not a whole session (e.g. --collect-only errors), or asked to finalize
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        import ray_rdt_pool

        ray_rdt_pool.shutdown()
    except Exception as e:  # the exit status is the tests', not the teardown's
        print(f"teardown before exit failed: {e!r}", file=sys.stderr)
    alive = [t.name for t in threading.enumerate()
             if t is not threading.main_thread() and t.is_alive()]
    if alive:
        print(f"threads alive at exit: {', '.join(sorted(alive))}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status[-1])
