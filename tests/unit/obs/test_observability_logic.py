"""Observability without a cluster: the metrics exporter's cost and rate limit (fake
instruments), the log lines of one process, NIXL's console output, and the imports of
the observability modules. The metrics read back from Ray's export are in
tests/integration/test_observability.py.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.config import PoolConfig, from_env
from ray_rdt_pool.obs import metrics as rdt_metrics
from ray_rdt_pool.obs.logs import debug_handler, disable_debug_logging, quiet_nixl_stdout
from ray_rdt_pool.obs.stats import TransportStats

POOL = 64 << 20


class _FakeMetric:
    def __init__(self, log: list[tuple[str, float]], name: str) -> None:
        self.log, self.name = log, name

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.log.append((self.name, value))

    inc = observe = set


class _FakeRuntime:
    def __init__(self) -> None:
        self.config = PoolConfig()
        self.calls = 0
        self.live = 0

    def stats(self) -> TransportStats:
        self.calls += 1
        fields = dict.fromkeys(TransportStats.__dataclass_fields__, 0)
        fields.update(pool_device="cpu", agent_name="fake", pool_capacity=POOL,
                      pool_used=4096 * self.live, pool_free=POOL - 4096 * self.live,
                      pool_largest_free_block=POOL - 4096 * self.live,
                      live_objects=self.live, objects_put=7 * self.calls)
        return TransportStats(**fields)


def test_observer_cost_is_bounded_and_trailing(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    # The exporter exports only in a process where Ray is up; no cluster is needed for
    # its fake instruments.
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(rdt_metrics, "_actor_tag", lambda: "test")
    log: list[tuple[str, float]] = []
    fake = rdt_metrics._Instruments(
        gauges=[(_FakeMetric(log, n), f) for n, _d, f in rdt_metrics.GAUGES],
        counters=[(_FakeMetric(log, n), f) for n, _d, f in rdt_metrics.COUNTERS],
        put_seconds=_FakeMetric(log, "put_seconds"),
        pack_seconds=_FakeMetric(log, "pack_seconds"),
        fetch_seconds=_FakeMetric(log, "fetch_seconds"),
        errors=_FakeMetric(log, "transfer_errors"))
    monkeypatch.setattr(rdt_metrics, "_instruments", fake)
    rt = _FakeRuntime()
    obs = rdt_metrics.MetricsExporter(
        rt, refresh_interval_s=0.2, poll_interval_s=60)  # type: ignore[arg-type]

    t0 = time.monotonic()
    for i in range(300):
        rt.live = i + 1
        obs.on_put(rt, 4096, 1e-4, 5e-5, False)  # type: ignore[arg-type]
    obs.on_error(rt, "timeout")  # type: ignore[arg-type]
    obs.on_error(rt, "weird")  # type: ignore[arg-type]
    burst_s = time.monotonic() - t0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ("sender_live_objects", 300.0) not in log:
        time.sleep(0.02)
    # Per event: histograms only; snapshots are rate-limited, and the last state is exported.
    assert sum(1 for n, _ in log if n == "put_seconds") == 300
    assert sum(1 for n, _ in log if n == "pack_seconds") == 300
    assert log.count(("transfer_errors", 1)) == 2
    max_flushes = 2 + int(burst_s / 0.2) + 1
    assert 1 <= rt.calls <= max_flushes, (rt.calls, burst_s)
    assert ("sender_live_objects", 300.0) in log
    # Unchanged gauges are not re-set.
    assert sum(1 for n, _ in log if n == "sender_capacity_bytes") == 1

    # A free after the burst: exported within the refresh interval (trailing refresh).
    rt.live = 0
    obs.on_free(rt)  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ("sender_live_objects", 0.0) not in log:
        time.sleep(0.02)
    assert ("sender_live_objects", 0.0) in log
    obs.close()
    # Counters are increased by the snapshot deltas: the total equals the last snapshot.
    assert rt.calls >= 2
    assert sum(v for n, v in log if n == "objects_put") == 7 * rt.calls


class _NullDirectory:
    def publish(self, name: str, version: int, reset_version: int, md: bytes) -> None:
        pass

    def lookup(self, name: str) -> None:
        return None

    def remove(self, name: str) -> None:
        pass

    def publish_host(self, name: str, info: bytes) -> None:
        pass

    def lookup_host(self, name: str) -> None:
        return None


def test_fallback_warning_once_per_process(caplog: pytest.LogCaptureFixture,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import nixl._api  # noqa: F401  (NIXL sets up its stdout handler on import)

    quiet_nixl_stdout()  # until the backend does it itself (see ray_rdt_pool.obs.logs)
    rt = Runtime(PoolConfig(pool_bytes=1 << 20, prefault=False, metrics=False),
                 directory=_NullDirectory())
    caplog.set_level(logging.DEBUG, logger="ray_rdt_pool")
    try:
        big = [torch.ones(1 << 19), torch.ones(1 << 18)]  # 3 MiB > the 1 MiB pool
        for i in range(4):
            rt.put(f"obj-{i}", big)
        small = [torch.ones(16)]
        rt.put("obj-small", small)
        warnings = [r for r in caplog.records
                    if r.name == "ray_rdt_pool.send.sender" and r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "does not fit" in warnings[0].getMessage()
        st = rt.stats()
        assert st.fallbacks == 4 and st.objects_put == 5 and st.live_objects == 5
        assert st.overflow_objects == 4
        for i in range(4):
            rt.free(f"obj-{i}")
        rt.free("obj-small")
        assert rt.stats().live_objects == 0
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    finally:
        rt.shutdown()
    assert capsys.readouterr().out == ""


def test_debug_logging_variable(caplog: pytest.LogCaptureFixture,
                                capsys: pytest.CaptureFixture[str]) -> None:
    config = from_env({"RAY_RDT_POOL_DEBUG_TRANSFERS": "1", "RAY_RDT_POOL_METRICS": "0",
                       "RAY_RDT_POOL_POOL_BYTES": "1M", "RAY_RDT_POOL_PREFAULT": "0"})
    assert config.debug_transfers
    # Before the runtime turns debug logging on: caplog puts back at teardown the level it
    # saw here. Set after, it put back DEBUG, and every later test of the process made
    # debug records (held by pytest's log capture, with the tensors among their arguments,
    # which kept an arena block alive in a later test's leak check).
    caplog.set_level(logging.DEBUG, logger="ray_rdt_pool")
    rt = Runtime(config, directory=_NullDirectory())
    try:
        assert rdt_metrics.observer_for(rt) is None  # metrics off, debug handler on
        pkg = logging.getLogger("ray_rdt_pool")
        assert pkg.level == logging.DEBUG
        assert debug_handler() in pkg.handlers
        rt.put("dbg-obj", [torch.ones(100), torch.ones(28)])
        rt.free("dbg-obj")
        puts = [r.getMessage() for r in caplog.records
                if r.levelno == logging.DEBUG and r.getMessage().startswith("put dbg-obj:")]
        assert len(puts) == 1, caplog.text
        assert "2 tensors" in puts[0] and "overflow=False" in puts[0]
    finally:
        rt.shutdown()
        disable_debug_logging()
    out, err = capsys.readouterr()
    assert out == ""
    assert "DEBUG ray_rdt_pool.send.sender" in err and "put dbg-obj" in err
    assert debug_handler() is None


_NIXL_AGENT = textwrap.dedent("""
    from ray_rdt_pool.nixl.backend import NixlBackend
    NixlBackend("stdout-check", 0.01).close()
""")


def test_nixl_console_output_goes_to_stderr_not_stdout() -> None:
    # NIXL's own logger prints INFO lines to stdout for every agent; ours moves them.
    out = subprocess.run([sys.executable, "-c", _NIXL_AGENT], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    assert "NIXL INFO" in out.stderr


def test_observability_modules_import_nothing_heavy() -> None:
    code = textwrap.dedent("""
        import sys
        import ray_rdt_pool.obs.logs, ray_rdt_pool.obs.metrics, ray_rdt_pool.cli.stats_table
        print(",".join(sorted(m for m in sys.modules
                              if m.split(".")[0] in ("torch", "ray", "nixl"))))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
