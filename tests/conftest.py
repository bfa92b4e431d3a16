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
