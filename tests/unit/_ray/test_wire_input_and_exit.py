"""Wire bytes, bad input and the end of a process, with the fake NIXL: corrupted wire
bytes and values whose order no flat list makes are WireFormatErrors, bad tensors change
nothing, shutdown leaves nothing behind, GCS round trips hold no lock, and an oversized
put leaves no reference cycle.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from ray_rdt_pool._ray.metadata import PoolTransportMetadata
from ray_rdt_pool.errors import (
    InvalidInputError,
    TransferError,
    WireFormatError,
)
from tests.support.fake_world import (
    fetch_stalled as _fetch_stalled,
)
from tests.support.fake_world import (
    make,
    roundtrip,
    same,
    ship,
)
from tests.support.fake_world import (
    stall_lookups as _stall_lookups,
)


def test_corrupted_wire_bytes_raise_wire_format_error(world):
    s, r = make(world), make(world)
    meta = s.put("a", [torch.randn(10)])
    bad = PoolTransportMetadata(tensor_meta=[], tensor_device="cpu", wire=meta.wire[:-3])
    with pytest.raises(WireFormatError):
        r.fetch("a", bad, None)
    assert r.stats().transfers_in_flight == 0


def test_bad_tensors_raise_invalid_input_and_change_nothing(world):
    s = make(world)
    s.put("keep", [torch.ones(3)])
    before = s.stats()
    for bad in ([torch.ones(2), "x"], [torch.ones(2), torch.empty(2, device="meta")],
                [torch.ones(2).to_sparse()],
                [torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)]):
        with pytest.raises(InvalidInputError):
            s.put("bad", bad)
    after = s.stats()
    assert (after.pool_used, after.live_objects) == (before.pool_used, before.live_objects)


def test_shutdown_stops_everything_and_removes_the_directory_entry(world):
    s, r = make(world), make(world)
    roundtrip(s, r, "a", [torch.arange(3)])
    world.mode = "PROC"
    req = r.fetch("b", ship(s.put("b", [torch.arange(3)])), None)
    assert s.agent_name in world.kv
    s.shutdown()
    r.shutdown()
    r.shutdown()  # twice is fine
    assert s.agent_name not in world.kv and r.agent_name not in world.kv
    assert req.inner.transfer.final == "CUT"
    with pytest.raises(TransferError, match="shut down"):
        s.backend()


def test_gcs_round_trips_hold_no_lock(world):
    """A slow GCS (metadata lookup on the receiver, publish on the sender) must not block
    the process's other work: stats(), puts, aborts and frees go on meanwhile."""
    s, r = make(world), make(world)
    meta = ship(s.put("a", [torch.arange(3)]))
    real_publish = world.publish
    gate, real_lookup = _stall_lookups(world)
    out, t = _fetch_stalled(r, meta, gate)
    r.put("own", [torch.ones(3)])  # the blocked process sends meanwhile
    r.free("own")
    r.abort("zz")
    assert r.stats().transfers_in_flight == 0
    assert t.is_alive()  # still inside the lookup
    gate.set()
    t.join(10)
    assert out and same(out[0], [torch.arange(3)])
    world.lookup = real_lookup

    gate.clear()
    gate.entered.clear()

    def slow_publish(name, *args):
        if name == s.agent_name:
            gate.entered.set()
            gate.wait(10)
        return real_publish(name, *args)

    world.publish = slow_publish
    s.registry.pin(torch.zeros(16))  # a new registration: the next put publishes
    t = threading.Thread(target=lambda: out.append(s.put("b", [torch.arange(4)])))
    t.start()
    assert gate.entered.wait(10)
    assert same(roundtrip(r, s, "c", [torch.arange(2)]), [torch.arange(2)])  # s receives
    s.free("a")
    assert s.stats().live_objects == 0
    assert not gate.is_set() and t.is_alive()  # all of the above ran during the publish
    gate.set()
    t.join(10)
    assert len(out) == 2 and s.stats().live_objects == 1


def test_an_oversized_put_leaves_no_reference_cycle(world):
    """Ray frees a sender's object when the ObjectRef dies; a reference cycle through an
    exception's traceback (the pool-exhausted path) kept the caller's frames, and so the
    ref and the tensors, alive until the next garbage collection."""
    import weakref

    s = make(world, pool_bytes=1 << 20)
    gc.collect()
    gc.disable()
    try:
        t = torch.zeros(1 << 19)  # 2 MiB > the pool
        alive = weakref.ref(t)
        s.put("big", [t])
        del t
        assert alive() is None, "something still holds the sent tensor"
    finally:
        gc.enable()


def test_a_value_whose_order_is_not_one_flat_tensors_makes_is_a_wire_format_error(
        monkeypatch):
    """The receiver rebuilt a flat value's repeats with the order as it came: an index
    past the tensors was a raw IndexError, and a negative one or a tensor left out
    ([1, 1]) silently put another tensor in its place."""
    import types

    from ray_rdt_pool._ray import patches

    a, b, c = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    monkeypatch.setattr(patches, "_rdt_context_local",
                        lambda: types.SimpleNamespace(rdt_tensors=[a, b]))
    for order in ([0, 5], [0, -1], [1, 1], [1, 0], [0, 0], [0, True], [0, 1.0]):
        with pytest.raises(WireFormatError, match="same ray_rdt_pool version"):
            patches._flat_from_rdt("list", 2, None, order)
    stand_in, tensors = patches.flat_tensors([a, b, a, c, b], torch.Tensor)
    monkeypatch.setattr(patches, "_rdt_context_local",
                        lambda: types.SimpleNamespace(rdt_tensors=tensors))
    out = patches._flat_from_rdt(stand_in.kind, stand_in.n, stand_in.keys, stand_in.order)
    assert [t is x for t, x in zip(out, [a, b, a, c, b])] == [True] * 5
