"""The runtime of one process as a whole, with the fake NIXL of ray_rdt_pool.testing: a
round trip, the metadata it ships, configuration before the first use and after
shutdown, a forked child, observers, Ray sessions, and the stand-in for flat values.

Split from the fake-NIXL tests of the transport's logic (once test_runtime_logic.py);
the same behaviours run end to end on real Ray and NIXL in
tests/integration/test_transport.py and test_reliability.py.
"""

from __future__ import annotations

import io
import logging
import pickle
import threading
from typing import Any

import pytest
import torch

from ray_rdt_pool.errors import (
    ConfigurationError,
    WireFormatError,
)
from ray_rdt_pool.testing import World
from tests.support.fake_world import (
    make,
    roundtrip,
    same,
    ship,
)


def test_round_trip_and_free(world):
    s, r = make(world), make(world)
    ts = [torch.randn(100, 3), torch.arange(7), torch.ones(2, dtype=torch.bool)]
    out = roundtrip(s, r, "a", ts)
    assert same(out, ts)
    assert s.stats().live_objects == 1
    s.free("a")
    st = s.stats()
    assert (st.pool_used, st.live_objects, st.objects_freed) == (0, 0, 1)
    assert not world.violations


def test_pickled_metadata_is_small_and_carries_no_agent_metadata(world):
    s = make(world)
    w = torch.randn(10_000, 16)
    meta = s.put("v", [w[i] for i in range(10_000)])
    raw = pickle.dumps(meta)
    assert len(raw) < 1000
    assert s.backend().metadata() not in raw
    back = pickle.loads(raw)
    assert len(back.tensor_meta) == 10_000
    assert back.tensor_meta[9_999] == (torch.Size([16]), torch.float32)


def test_a_forked_child_never_shuts_down_the_runtime_it_inherited(world, monkeypatch):
    """A forked child (a DataLoader worker, say) that exits normally runs the atexit
    shutdown(): on the inherited runtime that would remove the parent's agent key from
    Ray's GCS and tear down the parent's NIXL state. Only the process that made the
    runtime shuts it down."""
    import os

    from ray_rdt_pool._ray import runtime as runtime_module

    rt = make(world)
    r, w = os.pipe()
    monkeypatch.setattr(rt, "shutdown", lambda: os.write(w, str(os.getpid()).encode() + b" "))
    monkeypatch.setattr(runtime_module, "_runtime", rt)
    pid = os.fork()
    if pid == 0:  # the child: what its atexit would run
        try:
            runtime_module.shutdown()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    runtime_module.shutdown()  # the parent: its own runtime does shut down
    os.close(w)
    with os.fdopen(r, "rb") as f:
        shut = f.read().split()
    assert shut == [str(os.getpid()).encode()]


def test_configure_during_the_first_put_in_another_thread(monkeypatch):
    """configure() checked "not started" under its own lock while another thread's first
    put was making the agent under the runtime's: it replaced (and shut down) the runtime
    under that put, which then failed blaming a shutdown() nobody called, or succeeded
    into the closed runtime (an object nothing would ever free). Now exactly one wins:
    configure() raises ConfigurationError, and the put lands in the live runtime."""
    from ray_rdt_pool._ray import runtime as runtime_module
    from ray_rdt_pool.nixl import backend as _nixl

    w = World()
    making, go = threading.Event(), threading.Event()

    def slow_factory(name, interval, **kw):  # making an agent takes a while (UCX)
        making.set()
        go.wait(10)
        return w.factory(name, interval, **kw)

    monkeypatch.setattr(_nixl, "NixlBackend", slow_factory)
    monkeypatch.setattr(runtime_module, "KVDirectory", lambda: w)
    monkeypatch.setattr(runtime_module, "ray_node_id", lambda: None)
    for name, value in (("_runtime", None), ("_config", None), ("_configured", False),
                        ("_atexit_registered", True)):
        monkeypatch.setattr(runtime_module, name, value)
    monkeypatch.setenv("RAY_RDT_POOL_METRICS", "0")
    rt = runtime_module.runtime()  # an early stats(), say: nothing started
    res: dict[str, Any] = {}

    def put():
        try:
            res["meta"] = runtime_module.runtime().put("obj", [torch.arange(16.0)])
        except Exception as e:
            res["err"] = e

    t = threading.Thread(target=put)
    t.start()
    assert making.wait(10)
    threading.Timer(0.2, go.set).start()
    try:
        with pytest.raises(ConfigurationError, match="first used in another thread"):
            runtime_module.configure(pool_bytes=2 << 20)
    finally:
        go.set()
        t.join(10)
    assert "err" not in res and runtime_module.runtime() is rt and not rt.closed
    assert rt.stats().live_objects == 1
    rt.free("obj")
    assert rt.stats().live_objects == 0
    rt.shutdown()
    # configure() before anything started still replaces the runtime, and a put that
    # reaches the retired one is told so.
    monkeypatch.setattr(runtime_module, "_runtime", None)
    monkeypatch.setattr(runtime_module, "_configured", False)
    old = runtime_module.runtime()
    go.set()
    runtime_module.configure(pool_bytes=2 << 20)
    assert runtime_module.runtime() is not old and old.closed
    with pytest.raises(ConfigurationError, match="configure\\(\\) replaced"):
        old.put("x", [torch.ones(4)])
    runtime_module.runtime().shutdown()


def test_configure_after_shutdown_is_refused_and_a_retired_runtime_takes_its_debug_handler(
        monkeypatch):
    """shutdown() promises the transport cannot be used again in the process, but a
    configure() with other values after it (the runtime had only served stats()) made a
    fresh, open runtime. And with RAY_RDT_POOL_DEBUG_TRANSFERS=1, the stderr handler of a runtime
    that configure(debug_transfers=False) replaced stayed installed for good."""

    from ray_rdt_pool._ray import runtime as runtime_module
    from ray_rdt_pool.obs.logs import debug_handler, disable_debug_logging

    w = World()
    monkeypatch.setattr(runtime_module, "KVDirectory", lambda: w)
    monkeypatch.setattr(runtime_module, "ray_node_id", lambda: None)
    for name, value in (("_runtime", None), ("_config", None), ("_configured", False),
                        ("_atexit_registered", True)):
        monkeypatch.setattr(runtime_module, name, value)
    monkeypatch.setenv("RAY_RDT_POOL_METRICS", "0")
    monkeypatch.setenv("RAY_RDT_POOL_DEBUG_TRANSFERS", "1")
    pkg = logging.getLogger("ray_rdt_pool")
    level = pkg.level
    try:
        first = runtime_module.runtime()  # a stats() before configure(): nothing started
        assert debug_handler() is not None and pkg.level == logging.DEBUG
        runtime_module.configure(debug_transfers=False, pool_bytes=2 << 20)
        assert first.closed and debug_handler() is None and pkg.level == level
        # A handler the user installed is not the runtime's to take away.
        from ray_rdt_pool.obs.logs import enable_debug_logging

        theirs = enable_debug_logging(io.StringIO())
        monkeypatch.setattr(runtime_module, "_runtime", None)
        monkeypatch.setattr(runtime_module, "_configured", False)
        monkeypatch.setattr(runtime_module, "_config", None)
        runtime_module.runtime()
        runtime_module.configure(debug_transfers=False)
        assert debug_handler() is theirs
        disable_debug_logging()
        for name, value in (("_runtime", None), ("_config", None), ("_configured", False)):
            monkeypatch.setattr(runtime_module, name, value)
        rt = runtime_module.runtime()
        runtime_module.shutdown()
        with pytest.raises(ConfigurationError, match=r"after ray_rdt_pool\.shutdown"):
            runtime_module.configure(pool_bytes=4 << 20)
        assert runtime_module.runtime() is rt and rt.closed
    finally:
        disable_debug_logging()
        pkg.setLevel(level)


def test_a_failing_observer_fails_no_put_free_or_fetch(world):
    """The metrics observer was called unguarded after the put was recorded: an observer
    that raised (its thread failing to start) turned a finished put into an error, so
    Ray never learnt of the object and never freed it; a free and a fetch likewise."""
    class Broken:
        def __getattr__(self, name):
            def fail(*args):
                raise RuntimeError("can't start new thread")
            return fail

    s, r = make(world), make(world)
    s.observer = r.observer = Broken()
    src = [torch.arange(10)]
    meta = ship(s.put("a", src))  # no error
    assert same(r.wait(r.fetch("a", meta, None), -1), src)
    assert s.stats().live_objects == 1
    s.free("a")
    assert s.stats().live_objects == 0


def test_flat_values_stand_in_and_rebuild(monkeypatch) -> None:
    """The stand-in for a flat value pickles to a few bytes whatever the tensor count,
    rebuilds the same container from the tensors Ray hands over, and refuses a tensor
    count that does not match (a sender and receiver of different versions)."""
    from types import SimpleNamespace

    from ray_rdt_pool._ray import patches

    a, b = torch.zeros(2), torch.ones(3)
    assert patches.flat_tensors([a, 1], torch.Tensor) is None
    assert patches.flat_tensors([], torch.Tensor) is None
    assert patches.flat_tensors({1: a}, torch.Tensor) is None
    assert patches.flat_tensors(set(), torch.Tensor) is None
    assert patches.flat_tensors([torch.nn.Parameter(a)], torch.Tensor) is None
    many = [torch.zeros(1) for _ in range(5000)]
    stand_in, ts = patches.flat_tensors(many, torch.Tensor)
    assert ts == many and len(pickle.dumps(stand_in)) < 200
    local = SimpleNamespace(rdt_tensors=[])
    monkeypatch.setattr(patches, "_rdt_context_local", lambda: local)
    for value in ([a, b, a], (b, a), {"x": a, "y": b, "z": a}):
        stand_in, ts = patches.flat_tensors(value, torch.Tensor)
        assert len(ts) == 2
        local.rdt_tensors = ts
        got = pickle.loads(pickle.dumps(stand_in))
        assert type(got) is type(value)
        items = list(got.values()) if isinstance(got, dict) else list(got)
        want = list(value.values()) if isinstance(value, dict) else list(value)
        assert all(x is y for x, y in zip(items, want))
        if isinstance(value, dict):
            assert list(got) == list(value)
        local.rdt_tensors = ts[:1]
        with pytest.raises(WireFormatError, match="names 2 tensors but 1 arrived"):
            pickle.loads(pickle.dumps(stand_in))


def test_only_rays_rdt_tensor_reducer_is_replaced() -> None:
    """The swap recognises Ray's RDT reducer by its nested deserializer's name, replaces
    that one, and leaves a reducer of anyone else (or none) alone."""
    from ray import cloudpickle

    from ray_rdt_pool._ray import patches

    def reducer_closing_over(qualname: str):
        def deserialize(val):
            return val
        deserialize.__qualname__ = qualname

        def reducer(obj):
            return deserialize, (obj,)
        return reducer

    dispatch = cloudpickle.CloudPickler.dispatch
    saved = dispatch.get(torch.Tensor)
    try:
        someone_elses = reducer_closing_over("mine.<locals>.deserialize")
        dispatch[torch.Tensor] = someone_elses
        patches.by_reference_tensor_reducer()
        assert dispatch[torch.Tensor] is someone_elses
        dispatch.pop(torch.Tensor)
        patches.by_reference_tensor_reducer()
        assert torch.Tensor not in dispatch
        dispatch[torch.Tensor] = reducer_closing_over(patches._RAY_RDT_DESERIALIZER)
        patches.by_reference_tensor_reducer()
        assert dispatch[torch.Tensor] is patches._reduce_tensor
    finally:
        if saved is None:
            dispatch.pop(torch.Tensor, None)
        else:
            dispatch[torch.Tensor] = saved


@pytest.mark.parametrize("size", [1 << 60, 10 ** 30], ids=["ENOMEM", "overflow"])
@pytest.mark.parametrize("same_node", ["map", "off"])
def test_a_pool_or_arena_the_host_cannot_map_is_a_configuration_error(
        world: World, size: int, same_node: str) -> None:
    """A pool_bytes or arena_bytes larger than the host can map (a typo such as 64G on a
    smaller machine) raised a raw OSError or OverflowError from the first put; for the
    arena, a TransferError that blamed the sender, never named arena_bytes, and counted
    as a transfer failure."""
    s = make(world, pool_bytes=size, same_node=same_node)
    with pytest.raises(ConfigurationError, match=r"sender pool of .* lower pool_bytes "
                                                 r"\(RAY_RDT_POOL_POOL_BYTES\)"):
        s.put("a", [torch.ones(4)])
    assert s.stats().pool_capacity == 0
    ok = make(world)
    r = make(world, arena_bytes=size, same_node="off")
    m = pickle.loads(pickle.dumps(ok.put("b", [torch.ones(4)])))
    with pytest.raises(ConfigurationError, match=r"receive arena of .* lower arena_bytes "
                                                 r"\(RAY_RDT_POOL_ARENA_BYTES\)"):
        r.wait(r.fetch("b", m, None), 10)
    st = r.stats()
    assert st.transfer_errors == 0 and st.arena_used == 0 and st.transfers_in_flight == 0
    ok.free("b")
    for rt in (s, ok, r):
        rt.shutdown()


def test_objects_of_an_ended_ray_session_are_freed_at_the_first_put_of_the_next(world):
    """A driver that calls ray.shutdown() and ray.init() again never got back the pool
    blocks of objects whose refs were alive at the shutdown: Ray never frees them, so
    every later session had less pool, and with overflow=False its puts failed."""
    session = ["s1"]
    world.session = lambda: session[0]  # type: ignore[attr-defined]
    rt = make(world, pool_bytes=1 << 20, overflow=False)
    for i in range(3):
        rt.put(f"old{i}", [torch.ones(60_000)])  # 240 KB each: the pool holds four
    assert rt.stats().live_objects == 3
    session[0] = "s2"  # ray.shutdown(); ray.init()
    for i in range(3):
        rt.put(f"new{i}", [torch.full((60_000,), float(i))])
    st = rt.stats()
    assert st.live_objects == 3 and st.objects_freed == 3
    session[0] = "s2"
    rt.put("more", [torch.ones(4)])  # the same session: nothing of it is freed
    assert rt.stats().live_objects == 4
    for oid in ("new0", "new1", "new2", "more"):
        rt.free(oid)
    assert rt.stats().pool_used == 0 and rt.stats().live_objects == 0
    rt.shutdown()
