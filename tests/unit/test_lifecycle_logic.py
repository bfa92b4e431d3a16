"""Process lifecycle without a cluster: configuration before first use, interpreter exit
with received views alive, and the test harness's clean-up between clusters.

Each case runs in its own interpreter, because what is tested is what happens to a
process (its configuration lock, its exit path). The drivers with a cluster are in
tests/integration/test_lifecycle.py.
"""

from __future__ import annotations

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


_BLOCKS_AT_EXIT = (
    "import sys, torch\n"
    "from ray_rdt_pool.memory import blocks\n"
    "buf = torch.zeros(1 << 20, dtype=torch.uint8)\n"
    "class Holder:\n"
    "    pass\n"
    "h = Holder()\n"
    "h.self = h  # a cycle: collected late in finalization, after module globals\n"
    "h.views = [blocks.device_block(buf.data_ptr() + 64 * i, 64, 'cpu', 0,\n"
    "                                lambda: sys.stderr.write('called\\n'))[:8]\n"
    "           for i in range(1000)]\n"
    "m = torch.nn.Module()\n"
    "m.register_buffer('b', blocks.device_block(buf.data_ptr(), 128, 'cpu', 0,\n"
    "                                            lambda: sys.stderr.write('called\\n')))\n"
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
