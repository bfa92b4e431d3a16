"""Snapshots of a put, without Ray: ``Runtime.get_snapshot`` (what a get through Ray's
object store hands over) with the fake NIXL, and the object-store form of a snapshot
tensor pickled and loaded. The same promise end to end, through Ray's object store, is
tests/integration/test_transport.py::test_a_get_through_the_object_store_is_the_snapshot_too.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.raycluster import digest


def test_a_stored_snapshot_tensor_round_trips_and_refuses_a_wrong_byte_count():
    """The object-store form of a snapshot tensor, pickled and loaded without Ray: exact
    bytes for a dtype torch's own pickle cannot load, and a byte count that does not
    match the shape is a WireFormatError (numpy would have broadcast a short array
    over the whole tensor)."""
    import pickle

    import numpy as np

    from ray_rdt_pool._ray.patches import _StoredTensor, _tensor_from_store
    from ray_rdt_pool.errors import WireFormatError

    t = torch.arange(6, dtype=torch.int32).view(torch.uint16).reshape(3, 4)
    back = pickle.loads(pickle.dumps(_StoredTensor(t)))
    assert back.dtype == torch.uint16 and back.shape == (3, 4)
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))
    assert back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    with pytest.raises(WireFormatError, match="1 bytes, not 24"):
        _tensor_from_store("float32", (2, 3), np.zeros(1, dtype=np.uint8))
    assert _tensor_from_store("float32", (0, 3), np.zeros(0, dtype=np.uint8)).shape == (0, 3)
    # A dtype torch cannot fill, under deterministic algorithms (torch.empty fills then).
    x = torch.tensor([1, 2, 3, 250], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        back = pickle.loads(pickle.dumps(_StoredTensor(x)))
    finally:
        torch.use_deterministic_algorithms(prev)
    assert back.view(torch.uint8).tolist() == [1, 2, 3, 250]


def test_get_snapshot_follows_the_sender_through_retried_puts():
    """Runtime.get_snapshot, unit-level (the in-process fake NIXL): the put's bytes after
    the tensors changed, copies with storages of their own; a retried put that fails
    before placing keeps the first try, one that fails placing releases it and its
    metadata (kept until a free that never comes, before)."""
    from ray_rdt_pool._ray.runtime import Runtime
    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.errors import InvalidInputError, PoolExhaustedError
    from ray_rdt_pool.testing import World

    world = World()
    rt = Runtime(PoolConfig(pool_bytes=1 << 20, arena_bytes=1 << 20, metrics=False,
                            overflow=False), backend_factory=world.factory, directory=world)
    ts = [torch.zeros(1000), torch.ones(4, 4)[:, 1]]
    rt.put("a", ts)
    ts[0].add_(1)
    snap = rt.get_snapshot("a")
    assert digest(snap) == digest([torch.zeros(1000), torch.ones(4)])
    assert [t.untyped_storage().nbytes() for t in snap] == [4000, 16]
    with pytest.raises(InvalidInputError):
        rt.put("a", [torch.empty(2, device="meta")])
    assert digest(rt.get_snapshot("a")) == digest(snap)
    with pytest.raises(PoolExhaustedError):
        rt.put("a", [torch.zeros(1 << 19)])
    assert rt.get_snapshot("a") is None
    assert rt.stats().live_objects == 0 and rt.get_snapshot("never put") is None
    rt.shutdown()
