"""Where received bytes land, with the fake NIXL: the arena of the sender's device, a
CUDA object on a receiver without CUDA (a typed error naming the fix), and empty
tensors of dtypes torch cannot fill.
"""

from __future__ import annotations

import pytest
import torch

from ray_rdt_pool._ray.metadata import PoolTransportMetadata
from ray_rdt_pool.errors import (
    TransferError,
)
from ray_rdt_pool.memory import allocations
from ray_rdt_pool.memory import blocks as rdt_blocks
from tests.support.fake_world import (
    make,
    roundtrip,
    same,
    ship,
)


def test_cuda_object_on_a_receiver_without_cuda_names_the_fix(world):
    s, r = make(world), make(world)
    meta = ship(s.put("a", [torch.arange(6)]))
    meta.tensor_device = "cuda"  # what a sender of CUDA tensors reports
    if torch.cuda.is_available():
        pytest.skip("this process has a GPU; see tests/gpu/test_cuda.py")
    with pytest.raises(TransferError, match="set_target_device_for_ref"):
        r.fetch("a", meta, None)
    st = r.stats()
    assert st.arena_capacity == 0 and st.transfers_in_flight == 0
    out = r.wait(r.fetch("a", meta, [torch.zeros(6, dtype=torch.int64)]), -1)
    assert same(out, [torch.arange(6)])  # set_target_device_for_ref(ref, "cpu") works


def test_landing_uses_the_arena_of_the_senders_device(world, monkeypatch):
    made = []

    def fake_regions(capacity, device, prefault):
        made.append(device)
        region = allocations.HostMemory(capacity)
        region.device = device
        return region

    from ray_rdt_pool.receive import receiver as rdt_receiver

    real_block = rdt_blocks.device_block
    monkeypatch.setattr(rdt_receiver, "cuda_available", lambda: True)
    # Without a GPU the "cuda" block is host memory: view it as such.
    monkeypatch.setattr(rdt_blocks, "device_block",
                        lambda addr, n, dev, i, on_free: real_block(addr, n, "cpu", 0, on_free))
    s, r = make(world), make(world, region_factory=fake_regions)
    meta = ship(s.put("a", [torch.arange(6)]))
    meta.tensor_device = "cuda"
    req = r.fetch("a", meta, None)
    assert made == ["cuda"] and req.inner.transfer.landing.device == "cuda"
    last = r.backend().xfers[max(r.backend().xfers)]
    assert last.local[0][0] == r.receiver.arenas["cuda"].addr  # landed in the cuda arena
    assert same(r.wait(req, -1), [torch.arange(6)])


def test_an_empty_cuda_object_on_a_receiver_without_cuda_is_a_transfer_error(world):
    """An object of empty CUDA tensors (a GPU actor's empty batch) took fetch's
    empty-object shortcut, which built tensors on the sender's device before the no-CUDA
    check: torch's untyped 'not compiled with CUDA' error reached ray.get."""
    import msgpack

    if torch.cuda.is_available():
        pytest.skip("needs a process without CUDA")
    s, r = make(world), make(world)
    raw = [2, s.backend().name, 0, "cuda", 0, 0, [1, 1, 2, 0, 4, 12, 1], []]
    meta = PoolTransportMetadata(tensor_meta=[], tensor_device="cuda",
                                 wire=msgpack.packb(raw, use_bin_type=True))
    with pytest.raises(TransferError, match="no CUDA device"):
        r.fetch("e", meta, None)
    with pytest.raises(TransferError, match="no CUDA device"):
        r.fetch_selected("e", meta, [None], None)
    assert r.stats().arena_used == 0


def test_empty_float4_tensors_arrive_under_deterministic_algorithms(world):
    """With ``torch.use_deterministic_algorithms(True)`` torch fills what ``torch.empty``
    allocates, and has no fill for float4_e2m1fn_x2, a wire dtype, even for no elements:
    a receiver that made the empty tensors of an object (or of a selection) with
    ``torch.empty`` failed with torch's untyped NotImplementedError."""
    s, r = make(world), make(world)
    f4 = torch.empty(0, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    f4_2d = torch.empty(2, 0, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    x = torch.arange(4.0)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        only_empty = roundtrip(s, r, "a", [f4, f4_2d])  # nothing to read
        mixed = roundtrip(s, r, "b", [x, f4])
        meta = ship(s.put("c", [x, torch.zeros(4, 3, dtype=torch.uint8).view(
            torch.float4_e2m1fn_x2)]))
        selected = r.fetch_selected("c", meta, [(slice(1, 1),), (slice(2, 2),)], None)
    finally:
        torch.use_deterministic_algorithms(was)
    assert same(only_empty, [f4, f4_2d]) and same(mixed, [x, f4])
    assert [(t.shape, t.dtype) for t in selected] == [
        ((0,), torch.float32), ((0, 3), torch.float4_e2m1fn_x2)]
