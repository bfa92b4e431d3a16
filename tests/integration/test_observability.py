"""Observability of nixl_pool: Ray metrics read back from Prometheus, logs, the stats view.

Own cluster: Ray's metrics export port and report interval are set when a cluster starts.

One real Ray cluster for the module, with Ray's metrics export on a free port and a 1 s
metrics report interval (Ray's default is slower; the tests still allow 60 s). The metrics
are read back over HTTP from the export, as a Prometheus server would.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import ray
import torch

import ray_rdt_pool
from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.cli import stats_table as stats_cli
from ray_rdt_pool.config import PoolConfig, from_env
from ray_rdt_pool.obs import metrics as rdt_metrics
from tests.support import actors
from tests.support.raycluster import start_ray, wait_for

pytestmark = [pytest.mark.ray,
              pytest.mark.own_cluster("Ray's metrics export port and report interval")]

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
class Sender(actors.Sender):
    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
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
class Receiver(actors.Receiver):
    def __init__(self) -> None:
        super().__init__()
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
    for name, labels, value in stats_cli.scrape(url):
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


# ---------------------------------------------------------------------------------------
# Logs
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# The stats view
# ---------------------------------------------------------------------------------------


def test_pool_table_two_actors(cluster: dict[str, Any]) -> None:
    name = f"viewed-{uuid.uuid4().hex[:8]}"
    a = Sender.options(name=name).remote()
    b = Sender.remote()
    keep_a = ray.get(a.put.remote(2, 1 << 16))
    keep_b = [ray.get(b.put.remote(1, 1 << 10)), ray.get(b.put.remote(1, 1 << 10))]

    rows = stats_cli.collect([a, b])
    assert [r["actor"] for r in rows] == ["driver", f"Sender {a._actor_id.hex()[:8]}",
                                          f"Sender {b._actor_id.hex()[:8]}"]
    assert rows[1]["live_objects"] == 1 and rows[2]["live_objects"] == 2
    assert rows[1]["pool_used"] >= 2 * (1 << 16) * 4 and rows[1]["pool_capacity"] == POOL
    assert rows[1]["pid"] != rows[2]["pid"]
    assert stats_cli._used(512 << 10, POOL) == "512.0 KiB/64.0 MiB (1%)"
    assert stats_cli._used(0, 0) == "0 B/0 B"

    table = stats_cli.pool_table([a, b])
    lines = table.splitlines()
    assert len(lines) == 4, table
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines]
    assert cells[0] == list(stats_cli.COLUMNS)
    assert cells[1][0] == "driver"
    for row, line_cells in zip(rows[1:], cells[2:]):
        assert line_cells == [
            row["actor"], str(row["pid"]),
            stats_cli._used(row["pool_used"], POOL), str(row["live_objects"]),
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
    rows = stats_cli.collect([a, b], include_driver=False, timeout=20)
    assert rows[0]["live_objects"] == 1 and "error" in rows[1]
    assert "error:" in stats_cli.render(rows).splitlines()[2]

    # The CLI, from another driver: the named actor is listed.
    cli = subprocess.run(
        [sys.executable, "-m", "ray_rdt_pool.cli.stats_table", "--address", cluster["address"],
         "--namespace", ray.get_runtime_context().namespace, "--json"],
        capture_output=True, text=True, timeout=180, check=False)
    assert cli.returncode == 0, cli.stderr[-2000:]
    listed = {r["actor_id"]: r for r in json.loads(cli.stdout)}
    assert listed[a._actor_id.hex()]["live_objects"] == 1
    del keep_a, keep_b
