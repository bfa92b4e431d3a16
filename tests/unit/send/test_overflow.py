"""Snapshots under pool pressure, with the fake NIXL: an object larger than the pool, or
one that meets a full pool, goes into overflow memory; an emptied overflow region lingers
for reuse, then goes; shutdown and frees after it release the regions quietly; strict
mode raises instead.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch

from ray_rdt_pool._ray.metadata import PoolTransportMetadata
from ray_rdt_pool.errors import (
    PoolExhaustedError,
    TransferError,
)
from ray_rdt_pool.memory import allocations
from ray_rdt_pool.testing import FakeClock
from tests.support.fake_world import (
    make,
    roundtrip,
    same,
    ship,
)


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


def test_without_overflow_a_full_pool_raises(world):
    s = make(world, pool_bytes=1 << 20, overflow=False)
    with pytest.raises(PoolExhaustedError, match="leave overflow=True") as e:
        s.put("big", [torch.zeros(1 << 19)])
    assert e.value.needed == 2 << 20 and e.value.capacity == 1 << 20
    st = s.stats()
    assert (st.live_objects, st.overflow_objects, st.pool_used) == (0, 0, 0)


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
        return allocations.HostMemory(capacity)

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


def test_an_object_no_overflow_memory_can_hold_is_a_pool_exhausted_error(world):
    """With overflow on, an object too large for any memory (mmap refuses the overflow
    region) raised a raw OSError or OverflowError; overflow=False already raised
    PoolExhaustedError."""
    s = make(world)
    # An expanded view of 2**64 bytes: no mapping can be that large, on any host. (A
    # size the kernel refuses, ENOMEM, takes the same path, but whether it refuses
    # depends on the host's overcommit policy.)
    with pytest.raises(PoolExhaustedError, match="overflow memory"):
        s.put("huge", [torch.zeros(1).expand(1 << 62)])
    st = s.stats()
    assert (st.live_objects, st.pool_used, st.overflow_capacity) == (0, 0, 0)
