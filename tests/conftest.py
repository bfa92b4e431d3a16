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
# unit, so its module-scoped cluster starts once; every other test is a unit of its own.
# Units are handed out longest first (the costs below, in seconds of one run on two
# cores; a module not listed costs 1 per test), so that no long unit starts last and
# leaves the other workers idle at the end.

#: Modules whose tests start no shared cluster (each test runs its own driver or README
#: block in a subprocess with a cluster of its own, or needs none): each test is a unit
#: of its own.
_PER_TEST = {
    "integration/test_bench_cli.py",
    "integration/test_lifecycle.py",
    "integration/test_readme_blocks.py",
}

#: Long modules split into this many units: each starts its own cluster, in parallel.
_SPLIT = {
    "integration/test_transport.py": 2,
}

#: Measured cost of the long units (a module, or module::test for a per-test module).
_COST = {
    "integration/test_bench_cli.py::test_cli_smallest_run_writes_complete_json": 235,
    "integration/test_examples.py": 200,
    "integration/test_cli.py": 200,
    "integration/test_weights_ranks.py": 60,
    "integration/test_weights_relay.py": 120,
    "integration/test_transport.py": 400,
    "integration/test_reliability.py": 260,
    "integration/test_same_node.py": 200,
    "integration/test_async_after_faults.py": 110,
    "integration/test_same_node_kept.py": 90,
    "integration/test_observability.py": 90,
    "stress/test_chaos.py": 80,
    "stress/test_testbed.py": 70,
    "integration/test_weights.py": 80,
    "integration/test_multinode.py": 60,
    "integration/test_weights_memory.py": 50,
    "integration/test_lifecycle.py::test_driver_that_received_objects_exits_cleanly": 55,
    "integration/test_lifecycle.py::test_driver_sends_again_after_a_ray_restart": 40,
    "integration/test_lifecycle.py::"
    "test_same_node_receivers_map_the_drivers_objects_after_a_ray_restart": 40,
    "integration/test_lifecycle.py::test_shutdown_stops_the_thread_and_removes_the_agent_key":
        30,
    "integration/test_lifecycle.py::"
    "test_driver_exits_quietly_while_an_overflow_region_lingers": 25,
    "integration/test_readme_blocks.py": 35,
    "integration/test_native_build.py": 40,
    "integration/test_weights_tp.py": 40,
    "integration/test_source_reads.py": 40,
    "integration/test_weights_engine.py": 30,
    "unit/core/test_allocator.py::test_allocator_state_machine_runs_10k_operations": 15,
}


def _unit_of(item: Any, index_in_module: int, module_size: int) -> tuple[str, float]:
    """The work unit of ``item`` (its xdist group) and the unit's cost."""
    path, _, name = item.nodeid.partition("::")
    rel = path.split("tests/", 1)[-1]
    test = f"{rel}::{name.split('[', 1)[0]}"
    if rel.split("/", 1)[0] not in ("integration", "stress", "gpu") or rel in _PER_TEST:
        return item.nodeid, _COST.get(test, _COST.get(rel, 1.0))
    parts = _SPLIT.get(rel, 1)
    part = index_in_module * parts // max(module_size, 1)
    return f"{rel}#{part}", _COST.get(rel, module_size) / parts


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if config.getoption("dist", "no") != "loadgroup":
        return
    by_module: dict[str, list[Any]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.partition("::")[0], []).append(item)
    cost: dict[str, float] = {}
    order: dict[str, int] = {}
    group: dict[int, str] = {}
    for module_items in by_module.values():
        for i, item in enumerate(module_items):
            unit, c = _unit_of(item, i, len(module_items))
            cost[unit] = c
            order.setdefault(unit, len(order))
            group[id(item)] = unit
            item.add_marker(pytest.mark.xdist_group(unit))
    # Longest unit first; a unit's tests stay together and in their order.
    items.sort(key=lambda it: (-cost[group[id(it)]], order[group[id(it)]]))


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
