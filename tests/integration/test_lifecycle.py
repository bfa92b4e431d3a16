"""Process lifecycle: configuration before first use, ``shutdown()``, interpreter exit.

Each case runs in its own interpreter, because what is tested is what happens to a
process (its configuration lock, its exit path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_DEDUP_LOGS": "0"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.ray
def test_driver_that_received_objects_exits_cleanly() -> None:
    """The exit path (atexit) stops the progress thread and destroys the NIXL agent
    before the interpreter finalizes; a thread inside a NIXL binding at that point
    aborts the process (std::terminate). Two runs in a row must both exit 0 (each starts
    its own cluster: about 15 s). The second driver has also streamed weights by
    reference, so it exits holding their storages' NIXL registrations (and the storages):
    the exit path must deregister nothing out of order and crash nowhere."""
    for i, mode in enumerate(("plain", "stream")):
        p = run(["-m", "tests.support.exit_driver", mode])
        bad = [w for w in ("terminate", "Aborted", "SIGABRT", "Fatal Python error",
                           "Segmentation") if w in p.stderr]
        assert p.returncode == 0 and not bad, (i, p.returncode, bad, p.stderr[-3000:])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["reference_buckets"] == out["buckets"] > 1, out
    assert out["cached"] == 8, out  # one registration per weight, kept for the next sync


@pytest.mark.ray
def test_shutdown_stops_the_thread_and_removes_the_agent_key() -> None:
    p = run(["-m", "tests.support.exit_driver", "shutdown"])
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["helpers_before"] >= 1  # pack helpers ran, and shutdown stopped them too
    assert out["threads"] == [] and out["key"] is False and out["kept"] == 4
    assert "shut down" in out["after"], out


@pytest.mark.ray
def test_driver_exits_quietly_while_an_overflow_region_lingers() -> None:
    """The exit shutdown destroyed the NIXL agent before it dropped the empty overflow
    region kept for reuse: the deregistration failed with a WARNING and a traceback on
    stderr, and the region stayed mapped (stranded) to the end. Now it goes first."""
    p = run(["-m", "tests.support.exit_driver", "overflow"])
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(x) for x in p.stdout.strip().splitlines() if x.startswith("{")]
    assert lines[-2]["regions"] == 1 and lines[-2]["overflow_objects"] == 0, lines
    assert lines[-2]["lingering"] > 0, lines  # still registered for reuse at exit
    assert "Traceback" not in p.stderr and "deregistering" not in p.stderr, p.stderr[-3000:]
    assert lines[-1] == {"unmapped": [True], "stranded": 0}, lines


@pytest.mark.ray
def test_driver_sends_again_after_a_ray_restart() -> None:
    """``ray.shutdown()`` then ``ray.init()`` in one driver: its transport outlives the
    first cluster, and its agent's metadata must reach the second cluster's (empty) GCS,
    or an actor there waits for it and fails."""
    p = run(["-m", "tests.support.exit_driver", "restart"])
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["totals"] == [499500.0, 500500.0], out


@pytest.mark.ray
def test_same_node_receivers_map_the_drivers_objects_after_a_ray_restart() -> None:
    """``ray.shutdown()`` then ``ray.init()`` in one driver: the new cluster's GCS held no
    same-node entry of the driver's pool (published once per process, with the first
    session's node ID), so the new session's actors READ the driver's objects instead
    of mapping them. The driver, receiving from the new session's actors, maps too."""
    p = run(["-m", "tests.support.exit_driver", "restart_map"])
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    want = [{"total": 499500.0 + 1000 * k, "actor_mapped": 1, "actor_reads": 0,
             "driver_ok": True, "driver_mapped": 1, "driver_reads": 0} for k in range(2)]
    assert out["sessions"] == want, out


