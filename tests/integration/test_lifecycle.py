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


def run_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter; it must print ok and exit 0."""
    p = run(["-c", code], timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_configure_is_accepted_after_stats_before_first_use() -> None:
    code = (
        "import ray_rdt_pool\n"
        "s = ray_rdt_pool.stats()\n"
        "assert s.pool_capacity == 0 and s.agent_name == ''\n"
        "c = ray_rdt_pool.configure(pool_bytes=3 << 20, metrics=False)\n"
        "assert c.pool_bytes == 3 << 20\n"
        "from ray_rdt_pool._ray.runtime import runtime\n"
        "assert runtime().config.pool_bytes == 3 << 20\n"
        "try:\n"
        "    ray_rdt_pool.configure(pool_bytes=5 << 20)\n"
        "except ray_rdt_pool.ConfigurationError as e:\n"
        "    assert 'already called' in str(e)\n"
        "else:\n"
        "    raise SystemExit('a second, different configure() was accepted')\n"
        "print('ok')\n"
    )
    run_ok(code)


def test_configure_after_set_cuda_stream_keeps_the_stream() -> None:
    """set_cuda_stream() makes the (unstarted) runtime; a configure() with other values
    then replaced that runtime and the stream with it: packs waited on the current
    stream instead, and could race the producer."""
    code = (
        "import ray_rdt_pool\n"
        "from ray_rdt_pool._ray.runtime import runtime\n"
        "marker = object()  # stands in for a torch.cuda.Stream\n"
        "ray_rdt_pool.set_cuda_stream(marker)\n"
        "ray_rdt_pool.configure(pool_bytes=3 << 20, metrics=False)\n"
        "assert runtime().config.pool_bytes == 3 << 20\n"
        "assert runtime().sender.cuda_stream is marker, runtime().sender.cuda_stream\n"
        "print('ok')\n"
    )
    run_ok(code)


def test_register_memory_refuses_what_has_no_memory_before_anything_starts() -> None:
    """A ZeroTensor raised torch's untyped RuntimeError; a storage resized to 0 was
    "registered" as 0 bytes at address 0; deregister_memory() of a non-tensor raised
    AttributeError."""
    code = (
        "import torch, ray_rdt_pool\n"
        "from ray_rdt_pool._ray.runtime import runtime\n"
        "t = torch.ones(8); t.untyped_storage().resize_(0)\n"
        "cases = [(ray_rdt_pool.register_memory, torch._efficientzerotensor(4), 'ZeroTensor'),\n"
        "         (ray_rdt_pool.register_memory, t, 'holds no memory'),\n"
        "         (ray_rdt_pool.register_memory, torch.empty(0), 'holds no memory'),\n"
        "         (ray_rdt_pool.deregister_memory, 'x', 'got str')]\n"
        "for fn, arg, text in cases:\n"
        "    try:\n"
        "        fn(arg)\n"
        "    except ray_rdt_pool.InvalidInputError as e:\n"
        "        assert text in str(e), (text, str(e))\n"
        "    else:\n"
        "        raise SystemExit(f'{fn.__name__}({arg!r}) was accepted')\n"
        "assert not runtime().started()  # refused before the agent was made\n"
        "print('ok')\n"
    )
    run_ok(code)


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


_BLOCKS_AT_EXIT = (
    "import sys, torch\n"
    "from ray_rdt_pool.memory import blocks\n"
    "buf = torch.zeros(1 << 20, dtype=torch.uint8)\n"
    "class Holder:\n"
    "    pass\n"
    "h = Holder()\n"
    "h.self = h  # a cycle: collected late in finalization, after module globals\n"
    "h.views = [blocks.device_block(buf.data_ptr() + 64 * i, 64, 'cpu', 0,\n"
    "                               lambda: sys.stderr.write('called\\n'))[:8]\n"
    "           for i in range(1000)]\n"
    "m = torch.nn.Module()\n"
    "m.register_buffer('b', blocks.device_block(buf.data_ptr(), 128, 'cpu', 0,\n"
    "                                           lambda: sys.stderr.write('called\\n')))\n"
    "if sys.argv[1] == 'hook':\n"
    "    blocks.install_exit_hook()\n"
)


def test_blocks_alive_at_exit_make_no_python_calls_during_finalization() -> None:
    """Received views still alive at exit used to run their Python deleter while the
    interpreter tore itself down ("Exception ignored on calling ctypes callback"; after
    finalization, a crash). With the exit hook the transport installs, they do not."""
    p = run(["-c", _BLOCKS_AT_EXIT, "hook"], timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr[-2000:]
    # The control: without the hook the same script does call back during finalization.
    p = run(["-c", _BLOCKS_AT_EXIT, "none"], timeout=60)
    assert "ctypes callback" in p.stderr, p.stderr[-2000:]


def test_the_harness_drops_rays_rdt_manager_of_an_ended_session(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray 2.60 keeps its RDT manager across ``ray.shutdown()`` in one process, and the
    next session's failure monitor dies on the transfers left queued in it (seen in a
    full run as an unhandled "owner is unknown" thread exception). The test harness
    drops it between clusters; it must never drop the manager of a live session."""
    import ray

    from tests.support.raycluster import drop_stale_rdt_manager

    if ray.is_initialized():
        pytest.skip("a cluster of this process is running")
    worker = ray._private.worker.global_worker
    stale = object()
    worker._rdt_manager = stale
    try:
        with monkeypatch.context() as m:  # a live session's manager stays
            m.setattr(ray, "is_initialized", lambda: True)
            assert drop_stale_rdt_manager() is False and worker._rdt_manager is stale
        assert drop_stale_rdt_manager() is True
        assert worker._rdt_manager is None
        assert drop_stale_rdt_manager() is False  # nothing left to drop
    finally:
        if worker._rdt_manager is stale:
            worker._rdt_manager = None
