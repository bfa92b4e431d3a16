"""Unit tests of the transport's logic above NIXL, with the in-process fake of ray_rdt_pool.testing.

These cover the failure paths that real NIXL makes hard to trigger on demand; the same
behaviours run end to end on real Ray and NIXL in test_transport.py and test_reliability.py.
The fake models what NIXL may do (see ray_rdt_pool/testing.py): a READ given up on may still
write its bytes later, a cancel may fail, a release may raise, and a reload merges.
Each test that gives up on a READ then lets the late write happen and checks that no
other object's bytes changed.
"""

from __future__ import annotations

import gc
import io
import logging
import pickle
import re
import threading
import time
from typing import Any

import pytest
import torch

from ray_rdt_pool._ray.metadata import PoolTransportMetadata
from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.config import PoolConfig
from ray_rdt_pool.core.clock import SYSTEM_CLOCK
from ray_rdt_pool.errors import (
    ConfigurationError,
    InvalidInputError,
    PoolExhaustedError,
    TransferError,
    WireFormatError,
)
from ray_rdt_pool.memory import blocks as rdt_blocks
from ray_rdt_pool.memory import pack as rdt_pack
from ray_rdt_pool.memory import rebuild as rdt_rebuild
from ray_rdt_pool.memory import regions as rdt_regions
from ray_rdt_pool.receive.peers import HOUSEKEEPING_S
from ray_rdt_pool.testing import FakeClock, World


@pytest.fixture()
def world() -> World:
    return World()


def make(world: World, region_factory=None, clock=SYSTEM_CLOCK, **cfg) -> Runtime:
    cfg.setdefault("pool_bytes", 1 << 20)
    cfg.setdefault("arena_bytes", 1 << 20)
    cfg.setdefault("metrics", False)
    return Runtime(PoolConfig().with_overrides(**cfg), backend_factory=world.factory,
                   directory=world, region_factory=region_factory, clock=clock)


def ship(meta: PoolTransportMetadata) -> PoolTransportMetadata:
    """What the owner and receiver see: the metadata after a pickle round trip."""
    return pickle.loads(pickle.dumps(meta))


def roundtrip(sender: Runtime, receiver: Runtime, obj_id: str, tensors, targets=None):
    meta = ship(sender.put(obj_id, tensors))
    req = receiver.fetch(obj_id, meta, targets)
    return receiver.wait(req, -1)


def same(a, b) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8))
        for x, y in zip(a, b)) and len(a) == len(b)


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


def test_arena_block_returns_when_views_die_and_storage_is_the_block_only(world):
    s, r = make(world), make(world)
    w = torch.randn(64, 16)
    out = roundtrip(s, r, "a", [w[i] for i in range(64)])
    st = r.stats()
    assert st.arena_used == 64 * 16 * 4 and st.arena_live_blocks == 1
    assert out[5].untyped_storage().nbytes() == 64 * 16 * 4
    assert len(pickle.dumps(out[5])) < 2 * 64 * 16 * 4 + 2000
    keep = out[7]
    del out
    gc.collect()
    assert r.stats().arena_used > 0  # one view still alive
    del keep
    gc.collect()
    st = r.stats()
    assert st.arena_used == 0 and st.arena_live_blocks == 0


def test_warm_loop_makes_no_registrations(world):
    s, r = make(world), make(world)
    for i in range(10):
        out = roundtrip(s, r, f"o{i}", [torch.randn(1000), torch.randn(10)])
        del out
        s.free(f"o{i}")
        if i == 0:
            warm = (s.stats().nixl_registrations, r.stats().nixl_registrations)
    assert (s.stats().nixl_registrations, r.stats().nixl_registrations) == warm == (1, 1)


def test_full_arena_falls_back_to_a_registered_buffer_and_releases_it(world):
    s, r = make(world, pool_bytes=4 << 20), make(world, arena_bytes=1 << 20)
    ts = [torch.randn(1 << 19)]  # 2 MiB > arena
    out = roundtrip(s, r, "a", ts)
    assert same(out, ts)
    st = r.stats()
    assert st.receive_fallbacks == 1
    assert st.nixl_registrations == st.nixl_deregistrations + 1  # only the arena stays


def test_target_buffers_copy_first_then_register_once_and_read_in_place(world):
    s, r = make(world), make(world)
    ts = [torch.randn(33, 3), torch.arange(12, dtype=torch.int16)]
    bufs = [torch.zeros(33, 3), torch.zeros(12, dtype=torch.int16)]
    out = roundtrip(s, r, "a", ts, bufs)  # first sighting: arena + copy, no registration
    assert all(a is b for a, b in zip(out, bufs)) and same(bufs, ts)
    first = r.stats()
    assert first.nixl_registrations == 1 and first.arena_used == 0  # just the arena
    ts2 = [t + 1 for t in ts]
    roundtrip(s, r, "b", ts2, bufs)  # they came back: registered, read in place
    assert same(bufs, ts2)
    regs = r.stats().nixl_registrations
    assert regs == 3
    last = r.backend().xfers[max(r.backend().xfers)]
    assert {a for a, _, _ in last.local} <= {b.data_ptr() for b in bufs}
    roundtrip(s, r, "c", ts, bufs)
    assert same(bufs, ts) and r.stats().nixl_registrations == regs  # cached
    fresh = [torch.zeros(33, 3), torch.zeros(12, dtype=torch.int16)]
    roundtrip(s, r, "d", ts, fresh)  # one-off buffers never pay a registration
    assert same(fresh, ts) and r.stats().nixl_registrations == regs


def test_received_tensors_reused_as_targets_are_read_into_in_place_and_not_cached(world):
    """A receiver that passes the tensors it got back as the next targets (a weight-sync
    loop): they lie in our arena, already registered. The registration cache used to
    register them on the second sighting and hold their storage, so their arena block
    never came back while the cache kept the entry."""
    s, r = make(world), make(world)
    ts = [torch.randn(33, 3), torch.arange(12, dtype=torch.int16)]
    bufs = roundtrip(s, r, "a", ts)
    regs = r.stats().nixl_registrations
    for k in range(3):
        ts2 = [t + k + 1 for t in ts]
        out = roundtrip(s, r, f"b{k}", ts2, bufs)
        assert all(a is b for a, b in zip(out, bufs)) and same(bufs, ts2)
        last = r.backend().xfers[max(r.backend().xfers)]
        assert {a for a, _, _ in last.local} <= {b.data_ptr() for b in bufs}  # in place
    st = r.stats()
    assert st.nixl_registrations == regs and st.registration_cache_entries == 0
    del bufs, out
    gc.collect()
    r.receiver.reap()
    assert r.stats().arena_used == 0


def test_arena_targets_dropped_during_their_read_keep_their_block_until_it_ends(world):
    s, r = make(world), make(world)
    bufs = roundtrip(s, r, "a", [torch.zeros(1000)])
    world.mode = "PROC"
    req = r.fetch("b", ship(s.put("b", [torch.full((1000,), 3.0)])), bufs)
    r.abort("b")
    with pytest.raises(TransferError):
        r.wait(req, -1)
    handle = req.inner.transfer.handle
    del bufs, req  # the caller and Ray let go of the targets and the fetch
    gc.collect()
    assert r.stats().arena_used > 0  # NIXL may still write there: the block stays
    world.mode = "DONE"
    c = [torch.full((1000,), 9.0)]
    out_c = roundtrip(s, r, "c", c)
    r.backend().complete(handle)  # the late write
    assert same(out_c, c)
    r.backend().tick()
    del out_c
    gc.collect()
    assert r.stats().arena_used == 0 and not world.violations


def test_a_refused_target_registration_gives_back_the_ones_taken(world):
    """Registering the second of two target buffers failed: the first buffer's cache use
    was never given back, so its registration (and its storage) stayed for good."""
    s, r = make(world), make(world, registration_cache_bytes=1)
    meta = ship(s.put("a", [torch.ones(100), torch.ones(200)]))
    bufs = [torch.empty(100), torch.empty(200)]
    r.wait(r.fetch("a", meta, bufs), -1)  # the first sighting copies
    backend = r.backend()
    real, calls = backend.register, []

    def refuse_the_second(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("NIXL_ERR_BACKEND: register refused")
        return real(*args, **kwargs)

    backend.register = refuse_the_second
    with pytest.raises(TransferError):
        r.wait(r.fetch("a", meta, bufs), -1)
    backend.register = real
    assert len(calls) == 2
    st = r.stats()
    # Over its 1-byte bound, the cache keeps only entries in use: none is.
    assert (st.registration_cache_entries, st.registration_cache_bytes) == (0, 0)
    assert st.nixl_registrations == st.nixl_deregistrations + 1  # only the arena stays


def test_a_lazy_conjugate_target_is_refused(world):
    """A conjugate view passed describe()'s walk: the READ wrote the sender's bytes into
    its storage, and the caller read their conjugates."""
    s, r = make(world), make(world)
    src = [torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)]
    meta = ship(s.put("a", src))
    for bad, text in ((torch.zeros(2, dtype=torch.complex64).conj(), "conjugate"),
                      (torch.zeros(2, dtype=torch.complex64).conj().imag, "negative")):
        if text == "negative":
            meta = ship(s.put("b", [torch.zeros(2)]))
        with pytest.raises(InvalidInputError, match=f"lazy {text} view"):
            r.fetch("a" if text == "conjugate" else "b", meta, [bad])
    assert r.stats().transfers_in_flight == 0


@pytest.mark.parametrize("order", ["in order", "reversed", "many, last overlaps first"])
def test_overlapping_target_buffers_are_refused_and_disjoint_slices_are_not(world, order):
    """Target buffers that share bytes were accepted: tensor 1's bytes overwrote part of
    tensor 0 (on the copy path the last written won; NIXL writes them in no fixed
    order), and the fetch returned normally."""
    s, r = make(world), make(world)
    n = 40 if order.startswith("many") else 2
    src = [torch.full((4,), float(i)) for i in range(n)]
    meta = ship(s.put("o", src))
    buf = torch.empty(4 * n + 2)
    bad = [buf[4 * i:4 * i + 4] for i in range(n)]
    if order == "reversed":
        bad = [buf[2:6], buf[0:4]]
    elif order.startswith("many"):
        bad[-1] = buf[2:6]
    else:
        bad[1] = buf[2:6]
    with pytest.raises(InvalidInputError, match=r"target buffers .* share memory"):
        r.fetch("o", meta, bad)
    st = r.stats()
    assert (st.transfers_in_flight, st.arena_used) == (0, 0)
    good = [buf[4 * i:4 * i + 4] for i in range(n)][::-1]  # disjoint, out of address order
    out = r.wait(r.fetch("o", meta, good), -1)
    assert all(torch.equal(o, t) for o, t in zip(out, src))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint16, torch.float8_e4m3fn])
def test_a_negative_view_torch_cannot_resolve_is_a_typed_error(world, dtype):
    """A lazy negative view (torch._neg_view) of a dtype torch cannot negate raised
    torch's NotImplementedError out of the pack; nothing leaked, but the error was
    untyped."""
    s = make(world)
    v = torch._neg_view(torch.zeros(8, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1
                        else torch.zeros(8, dtype=dtype))
    with pytest.raises(InvalidInputError, match="lazy negative view that torch cannot"):
        s.put("o", [torch.ones(4), v])
    st = s.stats()
    assert (st.pool_used, st.live_objects) == (0, 0)
    s.put("ok", [torch._neg_view(torch.ones(4))])  # a float one still goes


def test_reaps_racing_for_the_last_dropped_read_raise_nothing(world):
    """reap() runs on the progress thread and at every fetch: two of them both saw one
    dropped READ left, and the second one's pop raised IndexError out of fetch()."""
    from collections import deque

    from ray_rdt_pool.receive.arena import Landing
    from ray_rdt_pool.receive.peers import Peer
    from ray_rdt_pool.receive.transfers import Transfer

    r = make(world).receiver

    class Raced(deque):
        def __len__(self) -> int:  # seen non-empty; then another thread takes the entry
            n = super().__len__()
            if n:
                super().popleft()
            return n

    t = Transfer("x", None, Peer("p"), Landing("temp", released=True), 0.0, final="DONE")
    r.transfers.dropped_reads = Raced([t])
    r.reap()
    assert not r.transfers.dropped_reads


def test_target_buffer_mismatch_is_rejected_before_any_read(world):
    s, r = make(world), make(world)
    meta = ship(s.put("a", [torch.randn(4, 4)]))
    for bad, text in (([torch.zeros(4, 5)], "(4, 5)"), ([], "0 target buffers"),
                      ([torch.zeros(4, 4, dtype=torch.float64)], "float64"),
                      ([torch.zeros(4, 8)[:, ::2]], "contiguous")):
        if not bad:
            bad = [torch.zeros(1), torch.zeros(1)]
            text = "2 target buffers"
        with pytest.raises(InvalidInputError, match=text.replace("(", r"\(").replace(")", r"\)")):
            r.fetch("a", meta, bad)
    assert r.stats().transfers_in_flight == 0


def test_many_target_buffers_checked_at_once_and_the_bad_one_named(world):
    """Per-sample objects bring thousands of target buffers: checked in one pass, and
    a bad one deep in the list is still named, before any read."""
    s, r = make(world), make(world)
    ts = [torch.randn(7) if i % 2 else torch.randint(0, 9, (2, 3)) for i in range(600)]
    meta = ship(s.put("a", ts))
    good = [torch.empty_like(t) for t in ts]
    for k, (bad, text) in enumerate((
            (torch.zeros(8), "target buffer 599 is (8,)"),
            (torch.zeros(7, dtype=torch.float64), "target buffer 599 is (7,) torch.float64"),
            (torch.zeros(14)[::2], "target buffer 599 must be contiguous"),
            (0.5, "target buffer 599 is a float"))):
        with pytest.raises(InvalidInputError, match=re.escape(text)):
            r.fetch(f"bad{k}", meta, [*good[:-1], bad])
    assert r.stats().transfers_in_flight == 0
    roundtrip(s, r, "b", ts, good)
    assert same(good, ts)


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

# ---------------------------------------------------------------------------------------
# Snapshots under pool pressure (overflow memory)
# ---------------------------------------------------------------------------------------


def test_object_larger_than_the_pool_is_still_a_snapshot(world):
    s = make(world, pool_bytes=1 << 20, overflow_linger_s=0)
    r = make(world, arena_bytes=8 << 20)
    t = torch.full((1 << 19,), 5.0)  # 2 MiB > 1 MiB pool
    meta = ship(s.put("big", [t]))
    t.add_(1000)  # the trainer keeps training as soon as the put returns
    out = r.wait(r.fetch("big", meta, None), -1)
    assert torch.equal(out[0], torch.full((1 << 19,), 5.0))
    st = s.stats()
    assert (st.overflow_objects, st.overflow_bytes, st.fallbacks) == (1, 2 << 20, 1)
    assert st.overflow_capacity >= 2 << 20 and st.pool_used == 0
    s.free("big")
    st = s.stats()
    assert (st.overflow_objects, st.overflow_bytes, st.overflow_capacity) == (0, 0, 0)
    assert st.registered_regions == 1  # the overflow region went with its last object
    assert not world.violations


def test_an_emptied_overflow_region_lingers_for_reuse_then_goes(world):
    """Every deregistration makes each receiver replace its view of the sender's agent
    (remove, then add), and with NIXL 1.5.1 each replacement leaves a TCP connection per
    read lane open in both processes: a pool that overflowed object after object leaked
    one per object. An emptied overflow region now stays registered for
    overflow_linger_s and takes the next oversized objects: no registration, no
    deregistration and no metadata reload per object; then it goes."""
    clock = FakeClock()
    s = make(world, pool_bytes=1 << 20, overflow_linger_s=0.5, clock=clock)
    r = make(world, arena_bytes=8 << 20)

    def send(i: int) -> None:
        obj = [torch.full((1 << 19,), float(i))]  # 2 MiB: overflow
        assert same(roundtrip(s, r, f"b{i}", obj), obj)
        s.free(f"b{i}")

    send(0)
    st0, loads0 = s.stats(), r.stats().remote_metadata_loads
    assert (st0.overflow_objects, st0.registered_regions) == (0, 2)  # pool + overflow
    assert st0.overflow_capacity >= 2 << 20
    for i in range(1, 4):
        send(i)
    st = s.stats()
    assert st.nixl_registrations == st0.nixl_registrations
    assert st.nixl_deregistrations == st0.nixl_deregistrations
    assert r.stats().remote_metadata_loads == loads0
    s.sender.reap()  # not due yet
    assert s.stats().overflow_capacity == st0.overflow_capacity
    clock.advance(0.6)
    s.sender.reap()  # the progress thread's tick
    st = s.stats()
    assert (st.overflow_capacity, st.registered_regions) == (0, 1)
    assert st.nixl_deregistrations == st0.nixl_deregistrations + 1
    assert not world.violations


def test_an_overflow_region_reused_before_its_linger_ends_stays(world):
    """The idle time of a region was stamped at its first free and kept through the puts
    that reused it, so a region in steady use went overflow_linger_s after it first
    emptied: an epoch reset (every receiver replaces its view) every linger period."""
    clock = FakeClock()
    s = make(world, pool_bytes=1 << 20, overflow_linger_s=1.0, clock=clock)
    for i in range(5):
        s.put(f"b{i}", [torch.zeros(1 << 19)])  # 2 MiB: overflow
        s.free(f"b{i}")
        clock.advance(0.3)
        s.sender.reap()  # the progress thread's tick
    st = s.stats()  # 1.5 s after its first free, 0.3 s after its last
    assert st.overflow_capacity > 0 and st.nixl_deregistrations == 0, st
    clock.advance(0.8)
    s.sender.reap()
    st = s.stats()
    assert st.overflow_capacity == 0 and st.nixl_deregistrations == 1, st


def test_shutdown_deregisters_a_lingering_overflow_region_before_the_agent_goes(world):
    """shutdown() destroyed the agent, then dropped the lingering region: with real NIXL
    that deregistration failed (a WARNING, and the memory kept for good)."""
    s = make(world, pool_bytes=1 << 20, overflow_linger_s=60)
    s.put("big", [torch.zeros(1 << 19)])
    s.free("big")
    assert s.stats().overflow_capacity > 0
    b = s.backend()
    closed_at: list[bool] = []
    deregister = b.deregister

    def watched(handle):
        closed_at.append(getattr(b, "closed", False))
        deregister(handle)

    b.deregister = watched
    s.shutdown()
    assert closed_at == [False]
    assert s.stats().overflow_capacity == 0


def test_full_pool_sends_a_snapshot_from_overflow(world):
    s, r = make(world, pool_bytes=4 << 20), make(world, arena_bytes=8 << 20)
    keep = [s.put(f"k{i}", [torch.zeros(256 << 10)]) for i in range(3)]  # 3 MiB live
    t = torch.full((768 << 10,), 5.0)  # 3 MiB: fits the capacity, not the free space
    meta = ship(s.put("x", [t]))
    t.fill_(-1)
    assert torch.equal(r.wait(r.fetch("x", meta, None), -1)[0], torch.full((768 << 10,), 5.0))
    assert s.stats().overflow_objects == 1 and len(keep) == 3


@pytest.mark.parametrize("pool_bytes", [(257 << 20) + 64, 300_000_100])
def test_overflow_works_whatever_the_pool_size(world, pool_bytes):
    """An overflow region is at least a quarter of the pool; a quarter of a pool size
    that is a multiple of 64 bytes only was not one, and the allocator refused the region:
    every object that did not fit such a pool failed with ConfigurationError."""
    s, r = make(world, pool_bytes=pool_bytes), make(world, arena_bytes=8 << 20)
    keep = s.put("small", [torch.ones(16)])
    region = s.sender.ensure_pool()
    region.alloc.allocate("filler", region.alloc.stats().free - (1 << 20))  # nearly full
    t = torch.full((2 << 20,), 7, dtype=torch.uint8)
    meta = ship(s.put("b", [t]))
    assert torch.equal(r.wait(r.fetch("b", meta, None), -1)[0], t)
    st = s.stats()
    assert st.overflow_objects == 1 and st.overflow_capacity % (1 << 20) == 0
    assert keep is not None


def test_objects_freed_after_shutdown_go_without_a_failed_deregistration(world, caplog):
    """After shutdown() (the agent destroyed, its registrations with it) Ray still frees
    the objects sent before: the overflow region's deregistration hit the closed agent,
    logged a failure with a traceback, and now also kept the region's memory for good."""
    s = make(world, pool_bytes=1 << 20)
    s.put("a", [torch.ones(1000)])
    s.put("big", [torch.ones(2 << 20, dtype=torch.uint8)])  # overflow
    s.shutdown()
    assert s.stats().live_objects == 2  # until Ray frees them
    with caplog.at_level(logging.WARNING, logger="ray_rdt_pool"):
        s.free("a")
        s.free("big")
    assert not [r for r in caplog.records if "deregistering" in r.getMessage()]
    st = s.stats()
    assert (st.live_objects, st.overflow_objects, st.overflow_capacity) == (0, 0, 0)
    assert not s.registry._stranded


def test_a_read_running_through_shutdown_keeps_its_memory_until_the_agent_is_gone(world):
    """shutdown() marked the runtime closed before it removed the GCS key and destroyed
    the agent; in that window a waiter's poll took the "shut down" error for the READ's
    end and gave its arena block back while NIXL could still write into it (a READ the
    shutdown could not cut: a metadata load of its peer held the peer's lock). Now the
    runtime counts as closed only once the agent is destroyed; new puts and fetches are
    refused from the start, and a second shutdown() returns only after the first."""
    world.mode = "PROC"
    s, r = make(world), make(world)
    f = r.fetch("o1", ship(s.put("o1", [torch.ones(1024)])), None)
    (h,) = r._backend.in_flight()
    peer = f.inner.transfer.peer
    peer.load_lock.acquire()  # a concurrent fetch is loading this peer's metadata
    gate, removing = threading.Event(), threading.Event()
    remove = world.remove

    def slow_remove(name):  # the GCS round trip of the shutdown
        removing.set()
        gate.wait(30)
        remove(name)

    world.remove = slow_remove
    first = threading.Thread(target=r.shutdown)
    first.start()
    assert removing.wait(10)
    out: dict[str, Any] = {}

    def waiter():
        try:
            r.wait(f, -1)
        except TransferError as e:
            out["err"] = e

    threads = [threading.Thread(target=waiter), threading.Thread(target=r.shutdown)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    # In the window: the READ is still running and its memory still reserved, the second
    # shutdown() has not returned, and nothing new starts.
    assert all(t.is_alive() for t in threads)
    assert r.stats().arena_used == 4096 and r._backend.xfers[h].state == "PROC"
    with pytest.raises(TransferError, match="shut down"):
        r.put("late", [torch.ones(4)])
    with pytest.raises(TransferError, match="shut down"):
        r.fetch("o2", ship(s.put("o2", [torch.ones(4)])), None)
    gate.set()
    first.join(10)
    for t in threads:
        t.join(10)
    peer.load_lock.release()
    assert not first.is_alive() and not any(t.is_alive() for t in threads)
    assert isinstance(out.get("err"), TransferError)
    r._backend.complete(h)  # a destroyed agent writes nothing: the block may go back now
    assert r.stats().arena_used == 0 and r.closed and world.violations == []
    assert r.agent_name not in world.hosts and r.agent_name not in world.kv
    with pytest.raises(TransferError, match="shut down"):
        r.registry.publish(r.agent_name)  # a put still registering writes no key back


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
    import logging

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


def test_fetch_selected_of_an_object_this_process_holds_checks_the_selection(
        world, monkeypatch):
    """owned.fetch_selected() of an object this process holds itself indexed the held
    tensor with the selection as given: a step-2 slice was taken (a READ refuses it),
    three slices on a 2-d tensor raised IndexError, a list was taken. Both paths now
    check the same way. Ray's RDT manager is a stand-in here."""
    import types

    import ray

    from ray_rdt_pool._ray import owned

    x = torch.arange(24.0).reshape(4, 6)
    store = types.SimpleNamespace(has_object=lambda oid: True, get_object=lambda oid: [x])
    mgr = types.SimpleNamespace(get_rdt_metadata=lambda oid: types.SimpleNamespace(),
                                rdt_store=store)
    monkeypatch.setattr(ray._private.worker, "global_worker",
                        types.SimpleNamespace(rdt_manager=mgr))
    ref = types.SimpleNamespace(hex=lambda: "obj")
    for bad, text in (([(slice(0, 4, 2),)], "step 2 on dim 0"),
                      ([(slice(None),) * 3], "at most 2 slices"),
                      ([[slice(0, 2)]], "pass a tuple"), ([None, None], "2 selections")):
        with pytest.raises(InvalidInputError, match=re.escape(text)):
            owned.fetch_selected(ref, bad)  # type: ignore[arg-type]
    out = owned.fetch_selected(ref, [(slice(1, 3), slice(2, 5))])  # type: ignore[arg-type]
    assert torch.equal(out[0], x[1:3, 2:5]) and out[0].is_contiguous()


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


def test_strict_mode_raises_instead_of_overflowing(world):
    s = make(world, pool_bytes=1 << 20, strict=True)
    with pytest.raises(PoolExhaustedError, match="strict mode") as e:
        s.put("big", [torch.zeros(1 << 19)])
    assert e.value.needed == 2 << 20 and e.value.capacity == 1 << 20
    st = s.stats()
    assert (st.live_objects, st.overflow_objects, st.pool_used) == (0, 0, 0)


def test_cuda_put_with_nothing_to_copy_works(world):
    """A CUDA pool and an object with nothing to copy (all empty) must not crash."""
    def fake_cuda(capacity, device, prefault):
        region = rdt_regions.HostRegion(capacity)
        region.device = device  # host memory labelled as the device asked for
        return region

    s = make(world, region_factory=fake_cuda, device="cuda")
    meta = s.put("e", [torch.empty(0), torch.empty(0, 3)]).decoded()
    assert meta.total == 0 and meta.segments == ()
    assert s.stats().live_objects == 1


# ---------------------------------------------------------------------------------------
# Memory is never reused while a READ may still write into it
# ---------------------------------------------------------------------------------------


def _second_object_survives_late_write(world, s, r, req_a):
    """Fetch another object of the same size while READ a may still write; then let a's
    late write happen and check the second object's bytes are untouched."""
    world.mode = "DONE"
    b = [torch.full((1000,), 7.0)]
    out_b = roundtrip(s, r, "b", b)
    r.backend().complete(req_a.inner.transfer.handle)  # a's bytes land now (late)
    assert same(out_b, b)
    return out_b


def test_aborted_read_keeps_its_block_until_nixl_ends_it(world):
    s, r = make(world), make(world)
    world.mode = "PROC"
    meta = ship(s.put("a", [torch.full((1000,), 1.0)]))
    req = r.fetch("a", meta, None)
    assert r.stats().transfers_in_flight == 1
    threading.Timer(0.05, r.abort, ("a",)).start()
    with pytest.raises(TransferError, match="aborted"):
        r.wait(req, -1)
    st = r.stats()
    # NIXL could not cancel it (World.cancel == "fail"): its block stays reserved.
    assert st.abandoned_transfers == 1 and st.arena_live_blocks == 1
    assert st.transfer_errors == 1
    out_b = _second_object_survives_late_write(world, s, r, req)
    r.backend().tick()  # the progress thread sees the READ ended
    st = r.stats()
    assert st.abandoned_transfers == 0 and st.late_completions == 1
    assert st.transfers_in_flight == 0 and st.arena_live_blocks == 1  # only b's views
    del out_b
    gc.collect()
    assert r.stats().arena_used == 0
    assert not world.violations and not r.backend().in_flight()


def test_cancelled_read_returns_its_block_at_once(world):
    s, r = make(world), make(world)
    world.mode, world.cancel = "PROC", "ok"
    meta = ship(s.put("a", [torch.randn(1000)]))
    req = r.fetch("a", meta, None)
    r.abort("a")
    with pytest.raises(TransferError, match="aborted"):
        r.wait(req, -1)
    st = r.stats()
    assert st.arena_used == 0 and st.abandoned_transfers == 0 and st.transfers_in_flight == 0


def test_user_timeout_then_cut_off_after_fetch_timeout(world):
    clock = FakeClock()
    s, r = make(world), make(world, fetch_timeout_s=0.3, clock=clock)
    world.mode = "PROC"
    meta = ship(s.put("a", [torch.randn(10)]))
    req = r.fetch("a", meta, None)
    with pytest.raises(TimeoutError):
        r.wait(req, 0.05)  # the caller's own, shorter timeout: Ray's TimeoutError
    assert r.stats().arena_live_blocks == 1  # NIXL may still write: block held
    r.backend().tick()
    assert r.stats().transfers_cut == 0  # not overdue yet
    clock.advance(0.35)
    r.backend().tick()  # now past fetch_timeout_s: the peer's agent is removed
    st = r.stats()
    assert st.transfers_cut == 1 and st.arena_used == 0 and st.abandoned_transfers == 0
    assert st.remote_agents_removed == 1 and world.cuts == [s.agent_name]
    world.mode = "DONE"
    assert same(roundtrip(s, r, "c", [torch.arange(4)]), [torch.arange(4)])  # reloads


def test_read_past_fetch_timeout_is_a_transfer_error_and_is_cut(world):
    s, r = make(world), make(world, fetch_timeout_s=0.2, clock=FakeClock())
    world.mode = "PROC"
    meta = ship(s.put("a", [torch.randn(10)]))
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="fetch_timeout_s"):
        r.wait(r.fetch("a", meta, None), -1)
    assert time.monotonic() - t0 < 5
    r.backend().tick()
    st = r.stats()
    assert st.transfers_in_flight == 0 and st.arena_used == 0 and st.transfers_cut == 1


def test_a_failed_cut_off_keeps_the_block_until_the_read_ends(world):
    """Removing the peer's agent can fail. The READ then runs on, so its block must stay
    reserved, the cut-off is tried again, and no other object lands there meanwhile."""
    clock = FakeClock()
    s, r = make(world), make(world, fetch_timeout_s=0.2, clock=clock)
    world.mode = "PROC"
    meta = ship(s.put("a", [torch.full((1000,), 1.0)]))
    req = r.fetch("a", meta, None)
    with pytest.raises(TimeoutError):
        r.wait(req, 0.01)
    clock.advance(0.25)
    world.remove_errors = True
    r.backend().tick()  # overdue: the cut-off is tried and refused
    st = r.stats()
    assert st.transfers_cut == 0 and st.abandoned_transfers == 1
    assert st.arena_live_blocks == 1 and st.transfers_in_flight == 1
    out_b = _second_object_survives_late_write(world, s, r, req)
    r.backend().tick()  # the late write ended it
    st = r.stats()
    assert st.abandoned_transfers == 0 and st.transfers_in_flight == 0
    assert st.late_completions == 1 and not world.violations
    del out_b
    gc.collect()
    assert r.stats().arena_used == 0


def test_a_refused_cut_off_is_tried_again(world):
    clock = FakeClock()
    s, r = make(world), make(world, fetch_timeout_s=0.1, clock=clock)
    world.mode = "PROC"
    meta = ship(s.put("a", [torch.randn(100)]))
    req = r.fetch("a", meta, None)
    with pytest.raises(TimeoutError):
        r.wait(req, 0.01)
    clock.advance(0.15)
    world.remove_errors = True
    r.backend().tick()
    assert r.stats().transfers_cut == 0 and r.stats().arena_used > 0
    world.remove_errors = False
    r.backend().tick()  # not again before the housekeeping interval
    assert r.stats().transfers_cut == 0
    clock.advance(HOUSEKEEPING_S + 0.1)
    r.backend().tick()  # retried after the housekeeping interval
    st = r.stats()
    assert st.transfers_cut == 1 and st.arena_used == 0 and st.transfers_in_flight == 0
    world.mode = "DONE"
    assert same(roundtrip(s, r, "c", [torch.arange(4)]), [torch.arange(4)])


def test_a_read_still_running_after_a_failed_post_keeps_its_block(world):
    """The backend raises ReadStillRunningError when a READ failed to post but a part of
    it runs on: its landing and peer lease must stay until NIXL ends it."""
    s, r = make(world), make(world)
    world.mode = "STUCK"
    meta = ship(s.put("a", [torch.full((1000,), 1.0)]))
    with pytest.raises(TransferError, match="post failed") as info:
        r.fetch("a", meta, None)
    assert getattr(info.value, "running", "absent") is None  # picklable for Ray
    pickle.dumps(info.value)
    st = r.stats()
    assert st.abandoned_transfers == 1 and st.arena_live_blocks == 1
    assert st.transfers_in_flight == 1
    (h,) = r.backend().in_flight()
    world.mode = "DONE"
    b = [torch.full((1000,), 7.0)]
    out_b = roundtrip(s, r, "b", b)
    r.backend().complete(h)  # the part that ran on writes late
    assert same(out_b, b)
    r.backend().tick()
    st = r.stats()
    assert st.abandoned_transfers == 0 and st.transfers_in_flight == 0
    assert not world.violations
    del out_b
    gc.collect()
    assert r.stats().arena_used == 0


class _Gate(threading.Event):
    """Holds stalled GCS lookups; ``entered`` is set once one waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()


def _stall_lookups(world: World) -> tuple[_Gate, Any]:
    """Make every metadata lookup of ``world`` wait on the returned gate (set it to let
    them through); returns the gate and the real lookup, to put back."""
    gate, real = _Gate(), world.lookup

    def slow_lookup(name):
        gate.entered.set()
        gate.wait(10)
        return real(name)

    world.lookup = slow_lookup
    return gate, real


def _fetch_stalled(r: Runtime, meta: PoolTransportMetadata, gate: _Gate
                   ) -> tuple[list, threading.Thread]:
    """Fetch ``meta`` on a thread until its lookup waits on ``gate``; returns the list
    its result lands in and the thread."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(r.wait(r.fetch("a", meta, None), -1)))
    t.start()
    assert gate.entered.wait(10)
    return out, t


def test_a_peer_waiting_for_its_first_metadata_is_not_idle_and_blocks_no_reap(world):
    """A first load holds the peer's load lock while the GCS lookup waits (up to
    fetch_timeout_s). The peer was "idle since 0", so housekeeping picked it to remove
    and blocked on that lock: reap() (the progress thread) stalled behind the GCS."""
    s, r = make(world), make(world)
    meta = ship(s.put("a", [torch.arange(5)]))
    gate, real_lookup = _stall_lookups(world)
    out, t = _fetch_stalled(r, meta, gate)
    done = threading.Event()

    def reap() -> None:
        r.receiver.peers.next_housekeeping = 0.0
        r.backend().tick()
        done.set()

    threading.Thread(target=reap, daemon=True).start()
    assert done.wait(3), "reap() blocked behind a metadata lookup"
    gate.set()
    t.join(10)
    world.lookup = real_lookup
    assert out and same(out[0], [torch.arange(5)])
    assert r.stats().remote_agents_removed == 0


def test_a_sender_never_found_in_the_directory_leaves_no_peer(world):
    s, r = make(world), make(world, fetch_timeout_s=0.1)
    meta = ship(s.put("a", [torch.arange(3)]))
    world.kv.pop(s.agent_name)
    with pytest.raises(TransferError, match="no NIXL metadata"):
        r.wait(r.fetch("a", meta, None), -1)
    assert r.stats().remote_agents == 0


def test_an_idle_peer_whose_removal_nixl_refuses_is_retried_then_forgotten(world, monkeypatch):
    from ray_rdt_pool.receive import peers as rmod

    s, r = make(world), make(world)
    assert same(roundtrip(s, r, "a", [torch.arange(3)]), [torch.arange(3)])
    monkeypatch.setattr(rmod, "PEER_IDLE_S", 0.0)
    monkeypatch.setattr(rmod, "HOUSEKEEPING_S", 0.0)
    world.remove_errors = True
    for _ in range(rmod.MAX_REMOVE_TRIES - 1):
        r.receiver.peers.next_housekeeping = 0.0
        r.backend().tick()
        assert r.stats().remote_agents == 1  # kept, to be tried again
    r.receiver.peers.next_housekeeping = 0.0
    r.backend().tick()
    assert r.stats().remote_agents == 0
    world.remove_errors = False
    assert same(roundtrip(s, r, "b", [torch.arange(4)]), [torch.arange(4)])


def test_a_peer_nixl_may_still_hold_is_not_forgotten_when_its_lookup_fails(world,
                                                                        monkeypatch):
    """After a refused removal a peer's view is "not loaded" (-1), though NIXL may still
    hold its agent. A fetch whose metadata lookup then failed (the sender exited, its GCS
    key gone) took it for a peer never loaded and forgot it: nothing removed the agent
    afterwards, and no warning said so."""
    from ray_rdt_pool.receive import peers as rmod

    s, r = make(world), make(world, fetch_timeout_s=0.2)
    assert same(roundtrip(s, r, "a", [torch.arange(3)]), [torch.arange(3)])
    monkeypatch.setattr(rmod, "PEER_IDLE_S", 0.0)
    monkeypatch.setattr(rmod, "HOUSEKEEPING_S", 0.0)
    backend = r.backend()
    world.remove_errors = True
    r.receiver.peers.next_housekeeping = 0.0
    backend.tick()  # the idle peer's removal is refused: kept, to be tried again
    assert s.agent_name in backend.loaded
    meta = ship(s.put("b", [torch.arange(5)]))
    world.kv.pop(s.agent_name)  # the sender exited cleanly
    with pytest.raises(TransferError, match="no NIXL metadata"):
        r.wait(r.fetch("b", meta, None), -1)
    world.remove_errors = False
    for _ in range(3):
        r.receiver.peers.next_housekeeping = 0.0
        backend.tick()
    assert s.agent_name not in backend.loaded  # removed, not forgotten
    assert r.stats().remote_agents == 0


def test_failed_read_is_a_transfer_error_and_releases_at_once(world):
    s, r = make(world), make(world)
    world.mode = "ERR"
    meta = ship(s.put("a", [torch.randn(10)]))
    with pytest.raises(TransferError, match="failed"):
        r.wait(r.fetch("a", meta, None), -1)
    st = r.stats()
    assert st.arena_used == 0 and st.transfer_errors == 1 and st.transfers_in_flight == 0


def test_errors_on_release_never_free_memory_early(world):
    s, r = make(world), make(world)
    world.mode, world.release_errors = "PROC", True
    meta = ship(s.put("a", [torch.full((1000,), 1.0)]))
    req = r.fetch("a", meta, None)
    r.abort("a")
    with pytest.raises(TransferError):
        r.wait(req, -1)
    assert r.stats().abandoned_transfers == 1
    _second_object_survives_late_write(world, s, r, req)
    r.backend().tick()
    assert r.stats().abandoned_transfers == 0 and not world.violations


def test_fetch_dropped_by_ray_without_waiting(world):
    """Ray starts every fetch of a multi-ref ray.get, and drops the rest when one fails."""
    s, r = make(world), make(world)
    world.mode = "PROC"
    meta = ship(s.put("a", [torch.full((1000,), 1.0)]))
    req = r.fetch("a", meta, None)
    handle = req.inner.transfer.handle
    del req
    gc.collect()
    r.backend().tick()
    assert r.stats().abandoned_transfers == 1 and r.stats().arena_live_blocks == 1
    world.mode = "DONE"
    b = [torch.full((1000,), 7.0)]
    out_b = roundtrip(s, r, "b", b)
    r.backend().complete(handle)
    assert same(out_b, b)
    r.backend().tick()
    assert r.stats().abandoned_transfers == 0 and r.stats().late_completions == 1


def test_abort_after_the_fetch_finished_does_not_fail_a_later_fetch(world):
    s, r = make(world), make(world)
    meta = ship(s.put("a", [torch.arange(6)]))
    assert same(r.wait(r.fetch("a", meta, None), -1), [torch.arange(6)])
    r.abort("a")  # arrives late
    assert r.stats().pending_aborts == 0
    assert same(r.wait(r.fetch("a", meta, None), -1), [torch.arange(6)])


def test_abort_before_the_fetch_starts_fails_it_once(world):
    s, r = make(world), make(world)
    meta = ship(s.put("a", [torch.arange(6)]))
    r.abort("a")
    with pytest.raises(TransferError, match="aborted"):
        r.fetch("a", meta, None)
    assert r.stats().pending_aborts == 0
    assert same(r.wait(r.fetch("a", meta, None), -1), [torch.arange(6)])


def test_aborts_on_a_sender_stay_bounded(world):
    s = make(world)
    for i in range(5000):
        s.abort(f"never-fetched-{i}")
    assert 0 < s.stats().pending_aborts <= 1024


# ---------------------------------------------------------------------------------------
# Peers: reloads never wait for other fetches; dead peers go
# ---------------------------------------------------------------------------------------


def test_multi_ref_get_across_a_deregistration_does_not_stall(world):
    """Ray starts both fetches of ray.get([a, b]) before waiting on either. b names a
    newer epoch after a deregistration while a's READ is in flight: b must not wait."""
    s = make(world, pool_bytes=1 << 20, overflow_linger_s=0)  # the region goes with fb
    r = make(world, arena_bytes=8 << 20)
    world.mode = "PROC"
    meta_a = ship(s.put("a", [torch.full((10,), 3.0)]))
    req_a = r.fetch("a", meta_a, None)
    big = torch.randn(1 << 19)  # 2 MiB: overflow region registered, then dropped
    s.put("fb", [big])
    s.free("fb")
    world.mode = "DONE"
    meta_b = ship(s.put("b", [torch.arange(3)]))
    assert meta_b.decoded().agent_version > meta_a.decoded().agent_version
    t0 = time.monotonic()
    req_b = r.fetch("b", meta_b, None)  # must not block on a
    assert same(r.wait(req_b, -1), [torch.arange(3)])  # Ray may wait on b first
    assert time.monotonic() - t0 < 2
    assert not world.cuts and s.agent_name not in r.backend().removed
    r.backend().complete(req_a.inner.transfer.handle)
    assert same(r.wait(req_a, -1), [torch.full((10,), 3.0)])
    # The merged view may hold the dropped region: replaced at the next idle fetch.
    assert same(roundtrip(s, r, "c", [torch.arange(2)]), [torch.arange(2)])
    assert s.agent_name in r.backend().removed and not world.cuts
    assert not world.violations


def test_receive_side_registrations_leave_the_epoch_alone(world):
    """A process that receives and sends: its receive arena, one-off receive buffers and
    cached target buffers are named by no object it sends. Registering and deregistering
    them must leave its epoch alone, or the receivers of its objects reload its metadata
    (and replace their view: a remove and re-add of its agent) after every such receive."""
    a = make(world)
    relay = make(world, arena_bytes=4096, registration_cache_bytes=1)
    c = make(world)
    assert same(roundtrip(relay, c, "x0", [torch.arange(5)]), [torch.arange(5)])
    loads, version = c.stats().remote_metadata_loads, relay.registry.version
    big = [torch.arange(4096.0)]  # 16 KiB: larger than the relay's arena
    meta = ship(a.put("big", big))
    for i in range(3):  # a one-off buffer each time; a target buffer seen twice, evicted
        assert same(relay.wait(relay.fetch(f"big{i}", meta, None), -1), big)
        t = torch.zeros(4096)
        for _ in range(2):
            relay.wait(relay.fetch(f"t{i}", meta, [t]), -1)
        assert same(roundtrip(relay, c, f"x{i + 1}", [torch.arange(i + 6)]),
                    [torch.arange(i + 6)])
    st = relay.stats()
    # Each object once, and each target's first sighting (copied out of a landing): 6.
    assert st.receive_fallbacks == 6 and st.registration_evictions == 3, st
    assert relay.registry.version == version
    assert c.stats().remote_metadata_loads == loads
    assert relay.agent_name not in c.backend().removed
    assert not world.violations


def test_nameable_memory_over_a_gone_receive_buffer_replaces_the_receivers_view(world):
    """Receive-side memory is in the metadata published while it is registered, so a
    receiver's view may keep its section after it is gone. Memory an object names that is
    registered over those bytes later (the received tensors, pinned to be sent zero-copy)
    must make that view be replaced, not merged into: a READ resolved to the stale
    section would use a registration that no longer exists. (A guard for the rule that
    lets receive-side memory leave the epoch alone: it passes without that rule too.)"""
    a = make(world)
    relay = make(world, arena_bytes=4096)
    c = make(world, arena_bytes=1 << 20)
    assert same(roundtrip(relay, c, "x0", [torch.arange(5)]), [torch.arange(5)])
    big = [torch.arange(4096.0)]
    meta = ship(a.put("big", big))
    world.mode = "PROC"
    req = relay.fetch("big", meta, None)  # lands in a one-off buffer, registered meanwhile
    world.mode = "DONE"
    # Nameable memory registered while the buffer is: what the relay publishes (and c
    # loads) now holds the buffer's section too.
    over = [torch.randn(1 << 19)]  # 2 MiB: more than the relay's pool, an overflow region
    assert same(roundtrip(relay, c, "over", [over[0]]), over)
    relay.backend().complete(req.inner.transfer.handle)
    got = relay.wait(req, -1)  # the buffer's registration goes; its memory is `got` now
    assert same(got, big)
    relay.registry.pin(got[0])  # the same bytes, registered again, nameable
    assert same(roundtrip(relay, c, "pinned", [got[0]]), big)
    assert relay.agent_name in c.backend().removed  # the view was replaced
    assert not world.violations


def test_failed_peer_is_removed_once_idle(world):
    s, r = make(world), make(world)
    roundtrip(s, r, "a", [torch.arange(3)])
    world.mode = "ERR"
    with pytest.raises(TransferError):
        roundtrip(s, r, "b", [torch.arange(3)])
    assert r.stats().remote_agents == 1
    r.backend().tick()
    st = r.stats()
    assert st.remote_agents == 0 and st.remote_agents_removed == 1


# ---------------------------------------------------------------------------------------
# Landing device, target buffers, registration cache
# ---------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("linger", [0, 0.3])
def test_overflow_regions_made_at_once_by_two_puts_leave_none_empty(world, linger):
    """Two threads whose objects both miss the pool each made an overflow region (64 MiB,
    a registration, and a metadata reload for every receiver) at the same time; the
    first region took both objects, and the second stayed registered and empty,
    counted in overflow_capacity, until some other object was freed. Now the empty one
    lingers like any emptied region (overflow_linger_s), and goes at once with 0."""
    gate = threading.Barrier(2, timeout=10)
    made: list[int] = []

    def regions(capacity, device, prefault):
        if capacity >= 64 << 20:  # an overflow region (the pool is 1 MiB)
            made.append(capacity)
            gate.wait()  # both puts are making one now
        return rdt_regions.HostRegion(capacity)

    clock = FakeClock()
    s = make(world, region_factory=regions, overflow_linger_s=linger, clock=clock)
    r = make(world, arena_bytes=8 << 20)
    assert same(roundtrip(s, r, "warm", [torch.ones(4)]), [torch.ones(4)])  # the pool
    objs = [[torch.full((1 << 19,), float(i))] for i in range(2)]  # 2 MiB each
    metas: dict[int, PoolTransportMetadata] = {}
    errors: list[BaseException] = []

    def put(i: int) -> None:
        try:
            metas[i] = ship(s.put(f"o{i}", objs[i]))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(made) == 2
    if linger:
        st = s.stats()
        assert st.overflow_capacity == 128 << 20 and st.registered_regions == 3, st
        clock.advance(linger + 0.1)
        s.sender.reap()
    st = s.stats()
    assert st.overflow_objects == 2 and st.overflow_capacity == 64 << 20, st
    assert st.registered_regions == 2  # the pool and one overflow region
    for i in range(2):
        assert same(r.wait(r.fetch(f"o{i}", metas[i], None), -1), objs[i])
        s.free(f"o{i}")
    if linger:
        clock.advance(linger + 0.1)
        s.sender.reap()
    assert s.stats().overflow_capacity == 0
    assert not world.violations


def test_landing_uses_the_arena_of_the_senders_device(world, monkeypatch):
    made = []

    def fake_regions(capacity, device, prefault):
        made.append(device)
        region = rdt_regions.HostRegion(capacity)
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



@pytest.mark.parametrize("kind", ["zero_tensor", "storage_resized_to_0"])
def test_a_target_buffer_without_memory_is_refused_before_any_read(world, kind):
    """A target buffer whose bytes have no memory behind them passes every shape, dtype
    and contiguity check; a READ into it would write near address 0."""
    s, r = make(world), make(world)
    meta = ship(s.put("t", [torch.arange(4, dtype=torch.float32)]))
    if kind == "zero_tensor":
        target = torch._efficientzerotensor(4)
    else:
        target = torch.empty(4)
        target.untyped_storage().resize_(0)
    before = r.stats()
    with pytest.raises(InvalidInputError, match="target buffers: tensor 0"):
        r.fetch("t", meta, [target])
    after = r.stats()
    assert (after.reads_posted, after.arena_used, after.transfer_errors) == (
        before.reads_posted, before.arena_used, before.transfer_errors)

def test_failed_copy_into_targets_returns_the_block_and_is_typed(world, monkeypatch):
    s, r = make(world), make(world)
    meta = ship(s.put("a", [torch.arange(6)]))

    def boom(*a, **k):
        raise RuntimeError("device lost")

    from ray_rdt_pool.receive import receiver as rdt_receiver  # noqa: F401

    monkeypatch.setattr(rdt_rebuild, "unpack_into", boom)
    with pytest.raises(TransferError, match="target buffers failed"):
        r.wait(r.fetch("a", meta, [torch.zeros(6, dtype=torch.int64)]), -1)
    st = r.stats()
    assert st.arena_used == 0 and st.transfers_in_flight == 0 and st.transfer_errors == 1


def test_copy_into_requires_grad_parameters(world):
    s, r = make(world), make(world)
    meta = ship(s.put("a", [torch.arange(6.0)]))
    p = torch.nn.Parameter(torch.zeros(6))
    out = r.wait(r.fetch("a", meta, [p]), -1)
    assert out[0] is p and torch.equal(p.detach(), torch.arange(6.0))


def test_registration_cache_holds_storages_and_evicts_lru(world):
    s = make(world)
    r = make(world, registration_cache_bytes=3 * 4096 * 4)
    ts = [torch.arange(4096.0)]
    meta = ship(s.put("a", ts))
    bufs = [torch.zeros(4096) for _ in range(5)]
    for b in bufs:  # each buffer twice: registered on its second sighting
        for _ in range(2):
            r.wait(r.fetch("a", meta, [b]), -1)
            assert torch.equal(b, ts[0])
    st = r.stats()
    assert st.registration_cache_entries == 3 and st.registration_evictions == 2
    assert st.registration_cache_bytes == 3 * 4096 * 4
    # Swap the memory under a live tensor: the old storage stays held (never reused at
    # the same address under a live registration), the new one is registered anew.
    p = bufs[-1]
    held = p.untyped_storage().data_ptr()
    p.data = torch.zeros(4096)
    for _ in range(2):
        r.wait(r.fetch("a", meta, [p]), -1)
    assert torch.equal(p, ts[0]) and p.untyped_storage().data_ptr() != held
    assert r.stats().registration_cache_entries == 3
    assert not world.violations


def test_cache_entries_in_use_are_never_evicted(world):
    s = make(world)
    r = make(world, registration_cache_bytes=1)
    meta = ship(s.put("a", [torch.arange(4096.0)]))
    b = torch.zeros(4096)
    r.wait(r.fetch("a", meta, [b]), -1)
    world.mode = "PROC"
    req = r.fetch("a", meta, [b])  # second sighting: registered, READ in place
    assert r.stats().registration_cache_entries == 1  # over the bound, but in use
    r.backend().complete(req.inner.transfer.handle)
    r.wait(req, -1)
    assert torch.equal(b, torch.arange(4096.0))
    assert r.stats().registration_cache_entries == 0  # idle: evicted


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


# ---------------------------------------------------------------------------------------
# Wire, input and process exit
# ---------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------
# Partial READs (fetch_selected) and conversion in the pack (pack_as)
# ---------------------------------------------------------------------------------------


def test_selected_reads_only_the_selected_bytes(world):
    s, r = make(world), make(world, arena_bytes=4 << 20)
    w = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    b = torch.arange(10, dtype=torch.int16)
    c = torch.randn(4, 6, 8)
    meta = ship(s.put("a", [w, b, c]))
    sel = [(slice(32, 64),), None, (slice(None), slice(2, 5))]  # dim 0, whole, dim 1
    before = r.stats().bytes_received
    out = r.fetch_selected("a", meta, sel, None)
    assert torch.equal(out[0], w[32:64]) and torch.equal(out[1], b)
    assert torch.equal(out[2], c[:, 2:5]) and out[2].is_contiguous()
    want = 32 * 48 * 4 + 10 * 2 + 4 * 3 * 8 * 4
    assert r.stats().bytes_received - before == want
    last = r.backend().xfers[max(r.backend().xfers)]
    assert sum(n for _a, n, _d in last.remote) == want  # only those bytes were read
    del out
    gc.collect()
    assert r.stats().arena_used == 0


def test_selection_errors_are_typed_and_read_nothing(world):
    s, r = make(world), make(world)
    meta = ship(s.put("a", [torch.zeros(8, 8)]))
    for bad, text in (([(slice(0, 8, 2),)], "step 2"), ([None, None], "2 selections"),
                      ([(slice(0, 1), slice(0, 1), slice(0, 1))], "at most 2 slices"),
                      ([(3,)], "tuple of at most")):
        with pytest.raises(InvalidInputError, match=text):
            r.fetch_selected("a", meta, bad, None)
    st = r.stats()
    assert st.transfers_in_flight == 0 and st.bytes_received == 0 and st.arena_used == 0
    empty = r.fetch_selected("a", meta, [(slice(3, 3),)], None)
    assert empty[0].shape == (0, 8)


def test_pack_as_converts_in_the_pack(world):
    from ray_rdt_pool._ray.conversions import pack_as

    s, r = make(world), make(world)
    w = torch.randn(100, 7)
    keep = torch.arange(5)
    with pack_as({id(w): torch.bfloat16}):
        meta = ship(s.put("a", [w, keep]))
    assert [dt for _s, dt in meta.decoded().shapes_dtypes()] == ["bfloat16", "int64"]
    out = r.wait(r.fetch("a", meta, None), -1)
    assert out[0].dtype == torch.bfloat16 and torch.equal(out[0], w.to(torch.bfloat16))
    assert torch.equal(out[1], keep)
    assert s.stats().bytes_packed < 100 * 7 * 4  # half the bytes of fp32
    with pytest.raises(InvalidInputError, match="nest"), pack_as({}), pack_as({}):
        pass


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4")
def test_pack_as_a_dtype_torch_cannot_convert_to_is_refused_before_placing(world):
    """torch has no copy kernel for float4_e2m1fn_x2: packing into it (or out of it)
    raised torch's untyped NotImplementedError out of put()."""
    from ray_rdt_pool._ray.conversions import pack_as

    s = make(world)
    t = torch.randn(4)
    with pytest.raises(InvalidInputError, match=r"no conversion from torch\.float32"), \
            pack_as({id(t): torch.float4_e2m1fn_x2}):
        s.put("a", [t])
    st = s.stats()
    assert (st.live_objects, st.pool_used) == (0, 0)


def test_an_object_no_overflow_memory_can_hold_is_a_pool_exhausted_error(world):
    """Outside strict mode an object too large for any memory (mmap refuses the overflow
    region) raised a raw OSError or OverflowError; strict mode already raised
    PoolExhaustedError."""
    s = make(world)
    # An expanded view of 2**64 bytes: no mapping can be that large, on any host. (A
    # size the kernel refuses, ENOMEM, takes the same path, but whether it refuses
    # depends on the host's overcommit policy.)
    with pytest.raises(PoolExhaustedError, match="overflow memory"):
        s.put("huge", [torch.zeros(1).expand(1 << 62)])
    st = s.stats()
    assert (st.live_objects, st.pool_used, st.overflow_capacity) == (0, 0, 0)


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


def test_an_interrupted_wait_hands_its_read_to_the_reaper(world, monkeypatch):
    """fetch_selected (the weights API's partial reads) waits on a plain receiver fetch,
    which has no __del__ safety net. A KeyboardInterrupt in its poll loop left the READ
    outstanding but not abandoned: never polled, never cut, its arena block and peer lease
    held for the life of the process. Now the interrupt abandons it: the READ is cut at
    fetch_timeout_s and its landing comes back."""

    clock = FakeClock()
    s, r = make(world), make(world, fetch_timeout_s=0.2, clock=clock)
    world.mode = "PROC"  # the READ never finishes
    meta = ship(s.put("a", [torch.arange(1000.)]))

    def interrupted(_delay: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(clock, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        r.fetch_selected("a", meta, [(slice(0, 10),)], None)
    monkeypatch.undo()
    st = r.stats()
    assert st.transfers_in_flight == 1 and st.arena_used > 0  # NIXL may still write
    clock.advance(0.3)  # past fetch_timeout_s
    r.backend().tick()
    st = r.stats()
    assert (st.transfers_in_flight, st.arena_used) == (0, 0), st
    assert st.transfers_cut + st.abandoned_transfers >= 1


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


def test_objects_of_an_ended_ray_session_are_freed_at_the_first_put_of_the_next(world):
    """A driver that calls ray.shutdown() and ray.init() again never got back the pool
    blocks of objects whose refs were alive at the shutdown: Ray never frees them, so
    every later session had less pool, and with strict=True its puts failed."""
    session = ["s1"]
    world.session = lambda: session[0]  # type: ignore[attr-defined]
    rt = make(world, pool_bytes=1 << 20, strict=True)
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


def test_a_ctrl_c_right_after_a_read_is_posted_leaves_nothing_held(world, monkeypatch):
    """A KeyboardInterrupt after start_read() returned, before the READ was recorded as
    a transfer: reap() never saw it, so its arena block, the peer's in-flight count and
    the NIXL handle stayed held for the life of the process."""
    s, r = make(world), make(world)
    meta = pickle.loads(pickle.dumps(s.put("a", [torch.full((50_000,), 1.0)])))
    real = r.events.add

    def add(name, *a, **k):
        real(name, *a, **k)
        if name == "reads_posted":
            raise KeyboardInterrupt
    monkeypatch.setattr(r.events, "add", add)
    with pytest.raises(KeyboardInterrupt):
        r.wait(r.fetch("a", meta, None), 10)
    monkeypatch.setattr(r.events, "add", real)
    deadline = time.monotonic() + 5
    while (r.stats().arena_used or r.stats().transfers_in_flight) and \
            time.monotonic() < deadline:
        gc.collect()
        r.receiver.reap()
        time.sleep(0.01)
    st = r.stats()
    assert st.arena_used == 0 and st.transfers_in_flight == 0
    assert not [x for x in world.agents[r.agent_name].xfers.values() if not x.released]
    got = r.wait(r.fetch("a", meta, None), 10)  # the next get of it is exact
    assert torch.equal(got[0], torch.full((50_000,), 1.0))
    del got
    s.free("a")
    for rt in (s, r):
        rt.shutdown()



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
