"""Observability of nixl_pool: Ray metrics read back from Prometheus, logs, the stats view.

One real Ray cluster for the module, with Ray's metrics export on a free port and a 1 s
metrics report interval (Ray's default is slower; the tests still allow 60 s). The metrics
are read back over HTTP from the export, as a Prometheus server would.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import ray
import torch

import ray_rdt_pool
from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.config import PoolConfig, from_env
from ray_rdt_pool.obs import metrics as rdt_metrics
from ray_rdt_pool.obs import view
from ray_rdt_pool.obs.logs import debug_handler, disable_debug_logging, quiet_nixl_stdout
from ray_rdt_pool.obs.stats import TransportStats
from tests.support.raycluster import start_ray, wait_for

pytestmark = pytest.mark.ray

POOL = 64 << 20
METRICS_DEADLINE_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    port = _free_port()
    start_ray({"RAY_RDT_POOL_POOL_BYTES": "64M", "RAY_RDT_POOL_ARENA_BYTES": "64M",
               "RAY_RDT_POOL_METRICS": "1"},
              address="local",  # never join a cluster someone started with `ray start`
              _metrics_export_port=port,
              _system_config={"metrics_report_interval_ms": 1000})
    yield {"url": f"http://127.0.0.1:{port}/metrics",
           "address": ray.get_runtime_context().gcs_address}
    ray.shutdown()


@ray.remote(enable_tensor_transport=True)
class Sender:
    def __init__(self, **config: Any) -> None:
        ray_rdt_pool.register()
        if config:
            ray_rdt_pool.configure(**config)
        self.refs: list[Any] = []

    def put(self, n_tensors: int = 4, numel: int = 1 << 16) -> list[Any]:
        tensors = [torch.full((numel,), float(i)) for i in range(n_tensors)]
        ref = ray.put(tensors, _tensor_transport="nixl_pool")
        self.refs.append(ref)
        return [ref]

    def drop(self) -> None:
        self.refs.clear()

    def observer_kind(self) -> str:
        from ray_rdt_pool._ray.runtime import runtime

        return type(runtime().observer).__name__

    def stats(self) -> dict[str, Any]:
        return ray_rdt_pool.stats().as_dict()


@ray.remote(enable_tensor_transport=True)
class Receiver:
    def __init__(self) -> None:
        ray_rdt_pool.register()
        self.held: list[Any] = []

    def fetch(self, refs: list[Any], hold: bool) -> int:
        tensors = ray.get(refs[0])
        if hold:
            self.held.append(tensors)
        return sum(t.numel() * t.element_size() for t in tensors)

    def release(self) -> None:
        self.held.clear()


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def series(url: str, actor: str) -> dict[str, float]:
    """``{name: value}`` of the ray_rdt_pool series of one actor (kinds summed)."""
    out: dict[str, float] = {}
    for name, labels, value in view.scrape(url):
        if name.startswith("ray_rdt_pool_") and labels.get("actor") == actor:
            key = name
            if "le" in labels:
                key = f"{name}[{labels['le']}]"
            out[key] = out.get(key, 0.0) + value if "kind" in labels else value
    return out


def wait_metrics(url: str, actor: str, ok: Callable[[dict[str, float]], bool],
                 what: str) -> dict[str, float]:
    deadline = time.monotonic() + METRICS_DEADLINE_S
    last: dict[str, float] = {}
    while time.monotonic() < deadline:
        try:
            last = series(url, actor)
        except OSError:
            last = {}
        if last and ok(last):
            return last
        time.sleep(0.5)
    shown = {k: v for k, v in last.items() if "_bucket" not in k}
    raise AssertionError(f"{what}: not seen within {METRICS_DEADLINE_S}s; last values {shown}")


# ---------------------------------------------------------------------------------------
# Metrics exported through Ray
# ---------------------------------------------------------------------------------------


def test_pool_gauges_track_put_fetch_and_free(cluster: dict[str, Any]) -> None:
    url = cluster["url"]
    sender, receiver = Sender.remote(), Receiver.remote()
    sid, rid = sender._actor_id.hex(), receiver._actor_id.hex()
    assert ray.get(sender.observer_kind.remote()) == "MetricsExporter"

    refs = ray.get(sender.put.remote(4, 1 << 16))
    nbytes = 4 * (1 << 16) * 4
    assert ray.get(receiver.fetch.remote(refs, True)) == nbytes
    st = ray.get(sender.stats.remote())
    assert st["live_objects"] == 1 and st["pool_used"] >= nbytes

    s = wait_metrics(url, sid, lambda m: m.get("ray_rdt_pool_sender_live_objects") == 1
                     and m.get("ray_rdt_pool_sender_used_bytes", 0) > 0
                     and m.get("ray_rdt_pool_put_seconds_count") == 1, "sender after put")
    assert s["ray_rdt_pool_sender_used_bytes"] == st["pool_used"]
    assert s["ray_rdt_pool_sender_capacity_bytes"] == POOL
    assert s["ray_rdt_pool_sender_free_bytes"] == POOL - st["pool_used"]
    assert s["ray_rdt_pool_objects_put_total"] == 1
    assert s["ray_rdt_pool_bytes_packed_total"] == st["bytes_packed"]
    assert s["ray_rdt_pool_nixl_registrations_total"] == 1  # the pool, once
    assert s["ray_rdt_pool_pack_seconds_count"] == 1
    assert s["ray_rdt_pool_sender_fragmentation_ratio"] == 0.0

    r = wait_metrics(url, rid, lambda m: m.get("ray_rdt_pool_arena_live_objects") == 1
                     and m.get("ray_rdt_pool_fetch_seconds_count") == 1, "receiver after get")
    assert r["ray_rdt_pool_bytes_received_total"] == nbytes
    assert r["ray_rdt_pool_objects_received_total"] == 1
    assert r["ray_rdt_pool_arena_used_bytes"] >= nbytes
    assert r["ray_rdt_pool_arena_capacity_bytes"] == POOL
    assert "ray_rdt_pool_transfer_errors_total" not in r

    # The receiver's arena block returns when its tensors die: no transport event, the
    # observer's poll must notice it.
    ray.get(receiver.release.remote())
    wait_metrics(url, rid, lambda m: m.get("ray_rdt_pool_arena_live_objects") == 0
                 and m.get("ray_rdt_pool_arena_used_bytes") == 0, "receiver after release")

    # Free: the driver's ref and the sender's own ref go away -> garbage_collect -> free.
    del refs
    ray.get(sender.drop.remote())
    # The counter is waited for with the gauges: Ray's exporter may show them in
    # different scrapes (the test once read the gauges before the counter existed).
    s = wait_metrics(url, sid, lambda m: m.get("ray_rdt_pool_sender_live_objects") == 0
                     and m.get("ray_rdt_pool_sender_used_bytes") == 0
                     and m.get("ray_rdt_pool_objects_freed_total") == 1, "sender after free")
    assert s["ray_rdt_pool_sender_free_bytes"] == POOL
    assert s["ray_rdt_pool_objects_put_total"] == 1  # counters never go back


def test_metrics_switch_off(cluster: dict[str, Any]) -> None:
    assert from_env({"RAY_RDT_POOL_METRICS": "0"}).metrics is False
    assert from_env({}).metrics is True
    assert rdt_metrics.observer_for(Runtime(PoolConfig(metrics=False))) is None
    assert isinstance(rdt_metrics.observer_for(Runtime(PoolConfig())), rdt_metrics.MetricsExporter)

    # In actors: the environment variable, and configure(metrics=False).
    by_env = Sender.options(runtime_env={"env_vars": {"RAY_RDT_POOL_METRICS": "0"}}).remote()
    by_configure = Sender.remote(metrics=False)
    assert ray.get(by_env.observer_kind.remote()) == "NoneType"
    assert ray.get(by_configure.observer_kind.remote()) == "NoneType"
    # The other settings of the job still apply (actor env vars merge with the job's).
    ray.get(by_env.put.remote(1, 16))
    assert ray.get(by_env.stats.remote())["pool_capacity"] == POOL


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


def test_observer_cost_is_bounded_and_trailing(cluster: dict[str, Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
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


# ---------------------------------------------------------------------------------------
# Logs
# ---------------------------------------------------------------------------------------


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
    rt = Runtime(config, directory=_NullDirectory())
    caplog.set_level(logging.DEBUG, logger="ray_rdt_pool")
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
        import ray_rdt_pool.obs.logs, ray_rdt_pool.obs.metrics, ray_rdt_pool.obs.view
        print(",".join(sorted(m for m in sys.modules
                              if m.split(".")[0] in ("torch", "ray", "nixl"))))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


# ---------------------------------------------------------------------------------------
# The stats view
# ---------------------------------------------------------------------------------------


def test_pool_table_two_actors(cluster: dict[str, Any]) -> None:
    name = f"viewed-{uuid.uuid4().hex[:8]}"
    a = Sender.options(name=name).remote()
    b = Sender.remote()
    keep_a = ray.get(a.put.remote(2, 1 << 16))
    keep_b = [ray.get(b.put.remote(1, 1 << 10)), ray.get(b.put.remote(1, 1 << 10))]

    rows = view.collect([a, b])
    assert [r["actor"] for r in rows] == ["driver", f"Sender {a._actor_id.hex()[:8]}",
                                          f"Sender {b._actor_id.hex()[:8]}"]
    assert rows[1]["live_objects"] == 1 and rows[2]["live_objects"] == 2
    assert rows[1]["pool_used"] >= 2 * (1 << 16) * 4 and rows[1]["pool_capacity"] == POOL
    assert rows[1]["pid"] != rows[2]["pid"]
    assert view._used(512 << 10, POOL) == "512.0 KiB/64.0 MiB (1%)"
    assert view._used(0, 0) == "0 B/0 B"

    table = view.pool_table([a, b])
    lines = table.splitlines()
    assert len(lines) == 4, table
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines]
    assert cells[0] == list(view.COLUMNS)
    assert cells[1][0] == "driver"
    for row, line_cells in zip(rows[1:], cells[2:]):
        assert line_cells == [
            row["actor"], str(row["pid"]),
            view._used(row["pool_used"], POOL), str(row["live_objects"]),
            "0 B/0 B", "0", "1/0", "0", "0"], table

    # A dead actor gets an error row instead of breaking the table.
    ray.kill(b)  # asynchronous: wait until calls to b fail

    def dead() -> bool:
        try:
            ray.get(b.__ray_call__.remote(lambda self: 0), timeout=10)
        except ray.exceptions.RayActorError:
            return True
        return False

    wait_for(dead, timeout=60)
    rows = view.collect([a, b], include_driver=False, timeout=20)
    assert rows[0]["live_objects"] == 1 and "error" in rows[1]
    assert "error:" in view.render(rows).splitlines()[2]

    # The CLI, from another driver: the named actor is listed.
    cli = subprocess.run(
        [sys.executable, "-m", "ray_rdt_pool.obs.view", "--address", cluster["address"],
         "--namespace", ray.get_runtime_context().namespace, "--json"],
        capture_output=True, text=True, timeout=180, check=False)
    assert cli.returncode == 0, cli.stderr[-2000:]
    listed = {r["actor_id"]: r for r in json.loads(cli.stdout)}
    assert listed[a._actor_id.hex()]["live_objects"] == 1
    del keep_a, keep_b
