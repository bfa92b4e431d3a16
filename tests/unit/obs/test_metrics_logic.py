"""The metrics exporter without a cluster: Ray's ``is_initialized`` stands in for
``ray.init()``/``ray.shutdown()``, the transport runs over the fake NIXL. What is checked
is what the exporter last set on each gauge, against ``stats()``."""

from __future__ import annotations

import gc
import math
import pickle
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.config import PoolConfig
from ray_rdt_pool.obs import metrics
from ray_rdt_pool.same_node._libc import PAGE
from ray_rdt_pool.testing import World

_NAMES = [name for name, _doc, _fn in metrics.GAUGES]


@pytest.fixture()
def ray_up(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    import ray

    up = {"v": True}
    monkeypatch.setattr(ray, "is_initialized", lambda: up["v"])
    monkeypatch.setattr(metrics, "_actor_tag", lambda: "test")
    return up


def _runtime(world: World, node: str | None = None) -> Runtime:
    rt = Runtime(PoolConfig(pool_bytes=4 << 20, arena_bytes=4 << 20, metrics=False),
                 backend_factory=world.factory, directory=world, node_id=lambda: node)
    rt.observer = metrics.MetricsExporter(rt, refresh_interval_s=0.01, poll_interval_s=0.05)
    return rt


def _gauge(rt: Runtime, name: str) -> float:
    """The value last exported, NaN before the exporter's first flush set it (so every
    comparison an :func:`_eventually` waits on is false until then)."""
    gauges = rt.observer._last_gauges  # type: ignore[union-attr]
    value = gauges[_NAMES.index(name)] if gauges else None
    return math.nan if value is None else value


def _eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_gauges_follow_again_after_ray_is_restarted(ray_up: dict[str, bool]) -> None:
    """An event while Ray was down left the exporter's refresh pending for good: no later
    event woke its thread, so after ray.init() the gauges never moved again."""
    rt = _runtime(World())
    try:
        rt.put("a", [torch.ones(10)])
        assert _eventually(lambda: _gauge(rt, "sender_live_objects") == 1)
        rt.free("a")
        assert _eventually(lambda: _gauge(rt, "sender_live_objects") == 0)
        ray_up["v"] = False  # ray.shutdown()
        rt.put("b", [torch.ones(10)])
        time.sleep(0.2)
        ray_up["v"] = True  # ray.init() again
        for i in range(5):
            rt.put(f"c{i}", [torch.ones(10)])
        assert _eventually(lambda: _gauge(rt, "sender_live_objects") == 6)
    finally:
        rt.shutdown()


def test_lease_and_mapping_gauges_drop_without_an_event(ray_up: dict[str, bool]) -> None:
    """Leases drop on the sender's ticks and same-node mappings when their views die:
    neither is an event, and the exporter stopped polling once nothing was live, so both
    gauges kept their old values."""
    world = World()
    s, r = _runtime(world, "node-a"), _runtime(world, "node-a")
    try:
        meta = pickle.loads(pickle.dumps(s.put("a", [torch.full((PAGE,), 7,
                                                                dtype=torch.int32)])))
        views: Any = r.wait(r.fetch("a", meta, None), -1)
        s.free("a")  # Ray frees it: the receiver's views hold a lease
        assert _eventually(lambda: _gauge(s, "sender_leased_bytes") > 0
                           and _gauge(r, "mapped_bytes") > 0)
        del views
        gc.collect()
        for _ in range(3):  # what the progress threads do
            r.receiver.reap()
            s.sender.reap()
        assert (s.stats().leased_bytes, r.stats().mapped_bytes) == (0, 0)
        assert _eventually(lambda: _gauge(s, "sender_leased_bytes") == 0
                           and _gauge(r, "mapped_bytes") == 0)
    finally:
        s.shutdown()
        r.shutdown()


def test_source_reads_are_exported(ray_up: dict[str, bool]) -> None:
    """A weights stream read in place on one node fired no observer event: a receiver
    whose streams all went so never exported its source reads, received bytes or arena
    use."""
    from ray_rdt_pool.same_node.peer_memory import this_process

    rt = _runtime(World(), node="n1")
    try:
        a = torch.randn(300, 40)
        spec = [(a.data_ptr(), tuple(a.shape), "float32")]
        dst = torch.empty_like(a)
        for _ in range(3):
            rt.receiver.sources.read(this_process("n1"), spec, targets=[dst])
        assert torch.equal(dst, a)
        counters = rt.observer._last_counters  # type: ignore[union-attr]
        assert _eventually(lambda: counters.get("source_reads") == 3)
        assert counters.get("bytes_received") == 3 * a.nbytes
        out = rt.receiver.sources.read(this_process("n1"), spec)  # into the arena
        assert _eventually(lambda: _gauge(rt, "arena_used_bytes") == rt.stats().arena_used > 0)
        del out
    finally:
        rt.shutdown()


def test_a_peer_removed_by_housekeeping_is_exported(ray_up: dict[str, bool],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress thread's removal of an idle peer is no event, and nothing is live by
    then, so the exporter had stopped polling: the remote_agents gauge stayed at 1 and
    remote_agents_removed at 0 for good."""
    from ray_rdt_pool.receive import peers as peers_mod

    monkeypatch.setattr(peers_mod, "PEER_IDLE_S", 0.3)  # for the 120 s
    monkeypatch.setattr(peers_mod, "HOUSEKEEPING_S", 0.05)
    w = World()
    s, r = _runtime(w), _runtime(w)
    try:
        m = pickle.loads(pickle.dumps(s.put("a", [torch.ones(1000)])))
        out = r.wait(r.fetch("a", m, None), -1)
        del out
        gc.collect()
        s.free("a")
        assert _eventually(lambda: _gauge(r, "remote_agents") == 1)
        time.sleep(1.0)  # idle for longer than PEER_IDLE_S, the exporter quiet by now
        r.receiver.reap()  # what the progress thread does
        assert _eventually(lambda: r.stats().remote_agents == 0)
        counters = r.observer._last_counters  # type: ignore[union-attr]
        assert _eventually(lambda: _gauge(r, "remote_agents") == 0)
        assert counters.get("remote_agents_removed") == 1
    finally:
        s.shutdown()
        r.shutdown()


def test_the_observability_tables_list_every_metric_and_no_other() -> None:
    """docs/observability.md's gauge, counter and histogram tables name exactly the series
    this module exports (with Ray's ``ray_`` prefix, and ``_total`` on counters)."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "observability.md").read_text()
    listed = set(re.findall(r"^\| `(ray_rdt_pool_[a-z_]+)", doc, re.M))
    ray = "ray_" + metrics.PREFIX
    exported = {ray + name for name, _d, _f in metrics.GAUGES}
    exported |= {ray + name + "_total" for name, _d, _f in metrics.COUNTERS}
    exported |= {ray + name for name, _d in metrics.HISTOGRAMS}
    exported.add(ray + metrics.ERRORS_NAME + "_total")
    assert listed == exported
