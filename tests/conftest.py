"""Test-session hooks.

The pytest process is an unusual Ray driver: it starts and stops some forty local Ray
clusters (and two-node ``Cluster`` s) in one interpreter. In 2 of about 9 fresh-clone runs
of the whole suite it segfaulted *after* every test had passed and the summary was
printed, during interpreter finalization, with no Python frame to show (the cause is not
found; Ray's and NIXL's native teardown after many init/shutdown cycles is the suspect).
The product's own exit path is tested where it matters, in drivers that exit normally:
``tests/test_lifecycle.py`` (twice in a row, and with received views alive at exit).

So the session ends with an explicit teardown (Ray, then this package's runtime) and
``os._exit`` with pytest's exit status, instead of the interpreter's finalization. Any
thread still alive at that point is named on stderr, to help find the cause later.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest

_status: list[int] = []


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
