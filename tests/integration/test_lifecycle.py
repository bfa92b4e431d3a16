"""Process lifecycle: configuration before first use, ``shutdown()``, interpreter exit.

Each case runs in its own interpreter, because what is tested is what happens to a
process (its configuration lock, its exit path). Two drivers start a cluster of their
own: the one that restarts Ray, and one plain driver, so that the exit of a driver that
started its cluster is tested too; the others join the test process's shared cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.raycluster import subprocess_env

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], timeout: float = 180, address: str | None = None
        ) -> subprocess.CompletedProcess[str]:
    """Run a driver; it joins the cluster at ``address``, or starts its own without one."""
    env = subprocess_env(PYTHONPATH=str(ROOT), RAY_DEDUP_LOGS="0")
    if address is not None:
        env["RAY_ADDRESS"] = address
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.ray
def test_driver_that_received_objects_exits_cleanly(ray_cluster: str) -> None:
    """The exit path (atexit) stops the progress thread and destroys the NIXL agent
    before the interpreter finalizes; a thread inside a NIXL binding at that point
    aborts the process (std::terminate). Two runs in a row must both exit 0: the first
    starts a cluster of its own, the second joins one. The second driver has also
    streamed weights by reference, so it exits holding their storages' NIXL
    registrations (and the storages): the exit path must deregister nothing out of
    order and crash nowhere."""
    for i, (mode, address) in enumerate((("plain", None), ("stream", ray_cluster))):
        p = run(["-m", "tests.support.exit_driver", mode], address=address)
        bad = [w for w in ("terminate", "Aborted", "SIGABRT", "Fatal Python error",
                           "Segmentation") if w in p.stderr]
        assert p.returncode == 0 and not bad, (i, p.returncode, bad, p.stderr[-3000:])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["reference_buckets"] == out["buckets"] > 1, out
    assert out["cached"] == 8, out  # one registration per weight, kept for the next sync


@pytest.mark.ray
def test_shutdown_stops_the_thread_and_removes_the_agent_key(ray_cluster: str) -> None:
    p = run(["-m", "tests.support.exit_driver", "shutdown"], address=ray_cluster)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["helpers_before"] >= 1  # pack helpers ran, and shutdown stopped them too
    assert out["threads"] == [] and out["key"] is False and out["kept"] == 4
    assert "shut down" in out["after"], out


@pytest.mark.ray
def test_driver_exits_quietly_while_an_overflow_region_lingers(ray_cluster: str) -> None:
    """The exit shutdown destroyed the NIXL agent before it dropped the empty overflow
    region kept for reuse: the deregistration failed with a WARNING and a traceback on
    stderr, and the region stayed mapped (stranded) to the end. Now it goes first."""
    p = run(["-m", "tests.support.exit_driver", "overflow"], address=ray_cluster)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(x) for x in p.stdout.strip().splitlines() if x.startswith("{")]
    assert lines[-2]["regions"] == 1 and lines[-2]["overflow_objects"] == 0, lines
    assert lines[-2]["lingering"] > 0, lines  # still registered for reuse at exit
    assert "Traceback" not in p.stderr and "deregistering" not in p.stderr, p.stderr[-3000:]
    assert lines[-1] == {"unmapped": [True], "stranded": 0}, lines


@pytest.mark.ray
def test_driver_sends_and_maps_again_after_a_ray_restart() -> None:
    """``ray.shutdown()`` then ``ray.init()`` in one driver, twice: its transport outlives
    each cluster. The new cluster's GCS is empty: the driver's agent metadata must reach
    it, or an actor there that READs waits for it and fails; and the same-node entry of
    its pool (published once per process, with the first session's node ID), or the new
    session's actors READ the driver's objects instead of mapping them. The driver,
    receiving from the new session's actors, maps too."""
    p = run(["-m", "tests.support.exit_driver", "restart"])
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    want = [{"read_total": 499500.0 + 1000 * k, "reader_mapped": 0, "reader_reads": 1,
             "total": 499500.0 + 1000 * k, "actor_mapped": 1, "actor_reads": 0,
             "driver_ok": True, "driver_mapped": 1, "driver_reads": 0} for k in range(2)]
    assert out["sessions"] == want, out
