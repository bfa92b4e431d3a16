"""The sender's put, with the fake NIXL: the pool allocation and its roll-back, retried
puts, allocations split over free blocks, tensors sent by reference from pinned memory
mixed with pooled ones, and the pinned uses every path gives back.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from ray_rdt_pool._ray.metadata import PoolTransportMetadata
from ray_rdt_pool.errors import (
    InvalidInputError,
)
from ray_rdt_pool.memory import allocations
from ray_rdt_pool.memory import pack as rdt_pack
from tests.support.fake_world import (
    make,
    roundtrip,
    same,
    ship,
)


def test_failed_copy_rolls_the_allocation_back(world, monkeypatch):
    s = make(world)
    s.put("keep", [torch.ones(10)])
    before = s.stats()

    def boom(*a, **k):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(rdt_pack, "pack_into", boom)
    with pytest.raises(RuntimeError, match="copy failed"):
        s.put("x", [torch.ones(1000)])
    after = s.stats()
    assert (after.pool_used, after.live_objects) == (before.pool_used, before.live_objects)
    monkeypatch.undo()
    s.put("y", [torch.ones(1000)])
    assert s.stats().live_objects == 2


def test_retried_put_of_the_same_id_replaces_its_blocks(world):
    s = make(world)
    s.put("id", [torch.ones(1000)])
    used = s.stats().pool_used
    s.put("id", [torch.ones(1000)])
    assert s.stats().pool_used == used and s.stats().live_objects == 1


def test_split_allocation_across_free_blocks_round_trips(world):
    s, r = make(world, pool_bytes=1 << 20), make(world, arena_bytes=4 << 20)
    quarter = (1 << 20) // 4 // 4
    for k in "abcd":
        s.put(k, [torch.full((quarter,), float(ord(k)))])
    s.free("b")
    s.free("d")
    big = [torch.arange(quarter * 2, dtype=torch.float32)]  # 512 KiB, largest hole 256 KiB
    out = roundtrip(s, r, "big", big)
    assert same(out, big)
    meta = s.put("big", big)
    assert len(meta.decoded().segments) == 2
    assert s.stats().fallbacks == 0


def test_zero_copy_tensors_mix_with_pooled_ones(world):
    s, r = make(world), make(world)
    big = torch.randn(256, 64)
    s.backend()
    s.registry.pin(big)
    ts = [big[i] for i in range(256)] + [torch.arange(5)]
    out = roundtrip(s, r, "z", ts)
    assert same(out, ts)
    st = s.stats()
    assert st.zero_copy_tensors == 256
    assert st.pool_used <= s.sender.pool.alloc.align  # only the small tensor was copied
    assert len(s.put("z2", ts).decoded().segments) == 2
    # deregister_memory while objects still name the storage: it stays registered until
    # they are freed, then goes (it used to stay as a cache entry, holding the storage,
    # until the cache evicted it).
    assert not s.registry.unpin(big)
    s.free("z")
    assert s.stats().registration_cache_entries == 1  # "z2" still names it
    regs = s.stats().nixl_deregistrations
    s.free("z2")
    st = s.stats()
    assert st.registration_cache_entries == 0 and st.nixl_deregistrations == regs + 1


def test_the_pinned_entry_found_is_the_extent_that_holds_the_bytes(world):
    """Two pinned storages that start at one address (a numpy array and a slice of it):
    a tensor inside the larger one is held by the larger one's entry, not by the first
    pinned entry with that start (deregistering the larger one would otherwise drop
    memory a live object still names)."""
    import numpy as np

    s = make(world)
    s.backend()
    arr = np.arange(16, dtype=np.float32)
    small, whole = torch.from_numpy(arr[:4]), torch.from_numpy(arr)
    s.registry.pin(small)
    s.registry.pin(whole)
    inside = whole[4:8]
    entry = s.registry.pinned_entry(inside.data_ptr(), inside.nbytes)
    assert entry is not None and entry.key[1] == whole.nbytes
    assert s.registry.pinned_entry(small.data_ptr(), small.nbytes) is not None


def test_a_tensor_past_a_nested_pinned_storage_is_still_sent_by_reference(world):
    """A pinned storage nested inside another (a slice of a pinned numpy array, pinned
    too): the search looked only at the span starting last before the tensor, the inner
    one, so a tensor of the outer storage lying past it was copied."""
    import numpy as np

    s, r = make(world), make(world)
    s.backend()
    arr = np.arange(100_000, dtype=np.float32)
    outer, inner = torch.from_numpy(arr), torch.from_numpy(arr[1000:2000])
    s.registry.pin(outer)
    s.registry.pin(inner)
    for k, t in enumerate((outer[10:20], outer[1500:1600], outer[50_000:50_100],
                           outer[1990:2010])):  # the last one straddles the inner's end
        z0 = s.stats().zero_copy_tensors
        out = roundtrip(s, r, f"o{k}", [t])
        assert same(out, [t]) and s.stats().zero_copy_tensors == z0 + 1, k
    assert s.stats().pool_used == 0


def test_memory_nixl_refuses_to_deregister_is_never_freed(world, monkeypatch):
    """A refused deregistration may leave NIXL holding the registration: the storage
    (and a region's memory) used to be let go anyway, so the allocator could hand the
    bytes to anyone under a live registration. It is kept now: a leaked registration,
    never a stale one."""
    import weakref

    import numpy as np

    from ray_rdt_pool import registry as registry_mod

    s = make(world)
    backend = s.backend()
    arr = np.arange(1000, dtype=np.float32)
    alive = weakref.ref(arr)
    t = torch.from_numpy(arr)
    s.registry.pin(t)
    real = backend.deregister

    def refuse(handle):
        raise RuntimeError("NIXL_ERR_BACKEND: deregister refused")

    backend.deregister = refuse
    # A captured log record's traceback would hold the storage too, and hide the bug.
    monkeypatch.setattr(registry_mod.logger, "warning", lambda *a, **k: None)
    assert s.registry.unpin(t)  # gone from the cache all the same
    backend.deregister = real
    del t, arr
    gc.collect()
    assert alive() is not None  # its memory is kept
    assert s.stats().registration_cache_entries == 0
    pinned = torch.from_numpy(np.arange(10, dtype=np.float32))  # a fresh one goes
    s.registry.pin(pinned)
    assert s.registry.unpin(pinned)


def test_deregister_memory_during_a_put_never_drops_memory_the_put_names(world,
                                                                       monkeypatch):
    """The put found the register_memory() entry, then took its use only after the
    pool allocation: a deregister_memory() on another thread in between dropped the
    registration, and the metadata named memory NIXL no longer held."""
    s, r = make(world), make(world)
    s.backend()
    pinned = torch.arange(4096, dtype=torch.float32)
    s.registry.pin(pinned)
    real = s.sender._place
    unpinned: list[bool] = []

    def unpin_first(*args, **kw):
        if not unpinned:
            t = threading.Thread(target=lambda: unpinned.append(s.registry.unpin(pinned)))
            t.start()
            t.join()
        return real(*args, **kw)

    monkeypatch.setattr(s.sender, "_place", unpin_first)
    entry = s.registry.pinned_entry(pinned.data_ptr(), pinned.nbytes)
    assert entry is not None
    src = [pinned[100:200], torch.ones(10)]
    out = roundtrip(s, r, "a", src)
    assert unpinned == [False]  # the put's use kept it registered
    assert same(out, src) and not world.violations
    assert entry.handle in s.backend().regions  # still registered while sent
    s.free("a")
    assert entry.handle not in s.backend().regions  # then it goes, with the put's use
    assert s.stats().registration_cache_entries == 0


def test_a_retried_put_whose_first_try_is_leased_returns_its_pinned_uses(world,
                                                                        monkeypatch):
    """A retried put replaced a first try a same-node receiver still mapped: the first
    try waited for the lease with its register_memory() uses still taken, and nothing
    gave them back, so deregister_memory() never deregistered the storage. (A mixed
    object is never mapped on a 4 KiB-page host: the lease is staged.)"""
    s = make(world)
    s.backend()
    buf = torch.randn(1000)
    s.registry.pin(buf)
    obj = [buf[:100], torch.randn(50)]  # one by reference, one copied
    s.put("id", obj)
    entry = s.sender.sent["id"].pinned[0]
    held = [True]

    class Leases:  # a same-node receiver's lease on every slot, while held[0]
        slot = staticmethod(lambda off: off // 4096)

        def held(self, slot):
            return held[0]

        def held_many(self, slots):
            return [held[0]] * len(slots)

        def released(self):
            return None

    monkeypatch.setattr(s.sender.leased, "table", Leases())
    s.put("id", obj)  # the retry: the first try waits for its lease
    assert entry.users == 1  # only the retry's use
    held[0] = False
    with s.sender.lock:  # the lease dropped: the first try's blocks come back
        s.sender._reap_leased_locked()
    s.free("id")
    assert entry.users == 0 and not s.sender.leased
    assert s.registry.unpin(buf)  # deregistered at once


def test_a_failed_allocation_releases_the_pinned_uses(world, monkeypatch):
    s = make(world)
    s.backend()
    pinned = torch.arange(4096, dtype=torch.float32)
    s.registry.pin(pinned)

    def full(*args, **kw):
        raise RuntimeError("no block")

    monkeypatch.setattr(s.sender, "_place", full)
    with pytest.raises(RuntimeError, match="no block"):
        s.put("a", [pinned[:10], torch.ones(10)])
    assert s.registry.unpin(pinned)  # no use left behind: it deregisters at once


def test_cuda_put_with_nothing_to_copy_works(world):
    """A CUDA pool and an object with nothing to copy (all empty) must not crash."""
    def fake_cuda(capacity, device, prefault):
        region = allocations.HostMemory(capacity)
        region.device = device  # host memory labelled as the device asked for
        return region

    s = make(world, region_factory=fake_cuda, device="cuda")
    meta = s.put("e", [torch.empty(0), torch.empty(0, 3)]).decoded()
    assert meta.total == 0 and meta.segments == ()
    assert s.stats().live_objects == 1


def test_put_by_reference_reads_in_place_and_forget_drops_only_idle_entries(world):
    """A weights stream's by-reference bucket: no pool block, one registration per storage
    held while the object lives; forgetting its keys drops nothing in use, then all."""
    from ray_rdt_pool.registry import storage_key

    s, r = make(world), make(world)
    w, ids = torch.arange(4096.0), torch.arange(100, dtype=torch.int64)
    _meta, wire = s.sender.put_by_reference("ref", [w, ids])
    pm = ship(PoolTransportMetadata(tensor_meta=[], tensor_device="cpu", wire=wire))
    w.add_(1)  # not a snapshot: the READ sees the tensors as they are now
    out = r.wait(r.fetch("ref", pm, None), -1)
    assert torch.equal(out[0], w) and torch.equal(out[1], ids)
    st = s.stats()
    assert st.pool_used == 0 and st.live_objects == 1 and st.zero_copy_tensors == 2
    assert st.registration_cache_entries == 2
    keys = [storage_key(w), storage_key(ids)]
    assert s.registry.forget(keys) == 0  # the object still uses them
    del out
    assert s.sender.free("ref")
    assert s.stats().registration_cache_entries == 2  # kept for the next stream
    assert s.registry.forget(keys) == 2
    st = s.stats()
    assert st.registration_cache_entries == 0 and st.nixl_deregistrations == 2
    with pytest.raises(InvalidInputError, match="tensor 1 cannot be sent by reference"):
        s.sender.put_by_reference("bad", [w, torch.zeros(8, 8).t()])
    st = s.stats()  # refused before anything was registered or placed
    assert st.live_objects == 0 and st.registration_cache_entries == 0
    assert not world.violations
