"""The same-node path with the fake NIXL, sender and receiver in one process.

The shared pool, the lease table and the private mappings are real (memfd, /proc, mmap);
only NIXL and the GCS are the in-process fakes, so every READ posted is counted and the
tests can assert that a mapped get posts none. Real Ray actors (separate processes, a
killed receiver, two Ray nodes) are in tests/integration/test_same_node.py.
"""

from __future__ import annotations

import errno
import gc
import os
import re
import select
import threading
import time
import traceback

import pytest
import torch

from ray_rdt_pool._ray.metadata import PoolTransportMetadata
from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.config import PoolConfig
from ray_rdt_pool.errors import PoolExhaustedError, RegistrationError, WireFormatError
from ray_rdt_pool.receive import fork as fork_mod
from ray_rdt_pool.receive import mapped as mapped_mod
from ray_rdt_pool.same_node import _libc, info, leases, memfd, peer_memory, pool_handle
from ray_rdt_pool.same_node._libc import PAGE
from ray_rdt_pool.same_node.info import HostInfo, process_start, still_running
from ray_rdt_pool.same_node.leases import LeaseTable
from ray_rdt_pool.testing import World
from tests.support.fake_world import get, settle, ship
from tests.support.fake_world import make_on_node as make


def test_a_mapped_get_is_a_view_with_no_read_and_a_private_copy_on_write(world: World) -> None:
    s, r = make(world), make(world)
    src = [torch.arange(1000, dtype=torch.float32), torch.ones(3, 7, dtype=torch.int64)]
    got = get(s, r, "a", src)
    assert all(torch.equal(a, b) for a, b in zip(got, src))
    st = r.stats()
    assert (st.mapped_gets, st.reads_posted, st.mapped_objects) == (1, 0, 1)
    assert st.mapped_bytes > 0 and st.arena_used == 0
    # Writing into the views changes only this receiver's pages.
    got[0].fill_(-1.0)
    pool = s.sender.pool
    assert pool is not None
    again = get(s, make(world), "a2", src)  # another receiver: original bytes
    assert torch.equal(again[0], src[0])
    view = pool.mem.tensor  # the sender's own memory is untouched
    off = s.sender.sent["a"].blocks[0][0]
    assert torch.equal(view[off:off + 4000].view(torch.float32), src[0])


def test_a_leased_block_is_not_reused_until_the_views_die(world: World) -> None:
    s, r = make(world), make(world)
    first = torch.full((PAGE * 4 // 4,), 7, dtype=torch.int32)
    kept = get(s, r, "a", [first])
    assert s.sender.free("a")  # Ray freed it; the receiver still holds views
    st = s.stats()
    assert (st.leased_objects, st.live_objects) == (1, 0)
    assert st.leased_bytes == first.numel() * 4
    off_a = s.sender.leased[next(iter(s.sender.leased))].blocks[0][0]
    # A put of the same size lands elsewhere; the kept views are unchanged.
    other = get(s, make(world), "b", [torch.full_like(first, 9)])
    assert s.sender.sent["b"].blocks[0][0] != off_a
    assert torch.equal(kept[0], first) and torch.equal(other[0], torch.full_like(first, 9))
    settle(s, r)
    assert s.stats().leased_objects == 1  # views alive: still held
    del kept
    settle(s, r)
    st = s.stats()
    assert (st.leased_objects, st.leased_bytes) == (0, 0)
    assert r.stats().mapped_objects == 0 and r.stats().mapped_bytes == 0


def test_free_returns_at_once_and_a_full_pool_waits_for_no_lease(world: World) -> None:
    s, r = make(world, pool_bytes=1 << 20, overflow=False), make(world)
    kept = get(s, r, "a", [torch.ones(200_000, dtype=torch.float32)])
    s.sender.free("a")
    from ray_rdt_pool.errors import PoolExhaustedError

    with pytest.raises(PoolExhaustedError):  # the leased block is not handed out again
        s.put("b", [torch.ones(200_000, dtype=torch.float32)])
    del kept
    gc.collect()
    r.receiver.reap()  # the receiver's lease drops; the sender's next put finds the block
    assert s.put("c", [torch.ones(200_000, dtype=torch.float32)]) is not None


def test_copy_mode_targets_and_selection_copy_once_and_keep_no_lease(world: World) -> None:
    s = make(world)
    src = [torch.randn(64, 33), torch.arange(10, dtype=torch.int16)]
    sel = [(slice(2, 5), slice(1, 4)), None]
    r = make(world, same_node="copy")
    got = get(s, r, "a", src)
    assert all(torch.equal(a, b) for a, b in zip(got, src))
    st = r.stats()
    assert st.mapped_gets == 1 and st.reads_posted == 0 and st.mapped_objects == 0
    assert st.arena_used > 0  # the copy lives in the receiver's arena
    part = get(s, r, "s", src, sel=sel)
    assert torch.equal(part[0], src[0][2:5, 1:4]) and torch.equal(part[1], src[1])
    assert r.stats().mapped_objects == 0  # copy mode: the selection is a copy too
    r2 = make(world)
    targets = [torch.empty_like(t) for t in src]
    out = get(s, r2, "b", src, targets=targets)
    assert out[0] is targets[0] and torch.equal(targets[0], src[0])
    settle(r2)
    assert r2.stats().mapped_objects == 0 and r2.stats().reads_posted == 0


def test_a_mapped_selection_is_a_leased_view_of_the_selected_part(world: World) -> None:
    """map mode: fetch_selected hands out views of the mapping where the selection is
    contiguous in its tensor (no copy, only the selected pages touched); they hold the
    lease until they die, and writing into them changes nothing for the sender. A
    strided selection is copied out, contiguous, as on every other path."""
    s, r = make(world), make(world)
    src = [torch.randn(64, 33), torch.arange(10, dtype=torch.int16), torch.randn(8, 4)]
    part = get(s, r, "c", src, sel=[(slice(2, 5), slice(1, 4)), None, (slice(4, 8),)])
    assert torch.equal(part[0], src[0][2:5, 1:4]) and torch.equal(part[1], src[1])
    assert torch.equal(part[2], src[2][4:])
    assert all(p.is_contiguous() for p in part)
    st = r.stats()
    assert (st.mapped_gets, st.reads_posted, st.mapped_objects) == (1, 0, 1)
    assert st.arena_used == 0  # nothing was copied
    assert st.bytes_received == 3 * 3 * 4 + 10 * 2 + 4 * 4 * 4  # the selected bytes
    part[0].fill_(-1)
    pool = s.sender.pool
    off = s.sender.sent["c"].blocks[0][0]
    assert torch.equal(pool.mem.tensor[off:off + 64 * 33 * 4].view(torch.float32)
                       .view(64, 33), src[0])  # private: the sender's bytes are unchanged
    del part
    settle(r)
    assert r.stats().mapped_objects == 0


@pytest.mark.parametrize("mode", ["map", "copy", "off"])
def test_a_strided_selection_is_contiguous_on_every_path(world: World, mode: str) -> None:
    """transport.fetch_selected promises contiguous tensors; map mode returned strided
    views of the mapping for slices past dim 0. Copied out, they hold no lease."""
    s, r = make(world), make(world, same_node=mode)
    src = [torch.randn(64, 33), torch.randn(8, 4, 5), torch.randn(6)]
    sel = [(slice(2, 5), slice(1, 4)), (slice(None), slice(1, 3)), (slice(2, 2),)]
    part = get(s, r, "c", src, sel=sel)
    want = [src[0][2:5, 1:4], src[1][:, 1:3], src[2][2:2]]
    for p, w in zip(part, want):
        assert p.is_contiguous() and p.shape == w.shape and torch.equal(p, w)
    st = r.stats()
    assert st.mapped_gets == (0 if mode == "off" else 1)
    assert (st.mapped_objects, st.mapped_bytes) == (0, 0)  # nothing holds the mapping


def test_other_nodes_overflow_and_off_use_nixl(world: World) -> None:
    s = make(world, pool_bytes=1 << 20)
    far = make(world, node="node-b")
    src = [torch.arange(4096, dtype=torch.float64)]
    assert torch.equal(get(s, far, "a", src)[0], src[0])
    assert (far.stats().mapped_gets, far.stats().reads_posted) == (0, 1)
    off = make(world, same_node="off")
    get(s, off, "b", src)
    assert (off.stats().mapped_gets, off.stats().reads_posted) == (0, 1)
    near = make(world)
    big = [torch.ones(600_000, dtype=torch.float32)]  # 2.4 MB > 1 MiB pool: overflow
    assert torch.equal(get(s, near, "c", big)[0], big[0])
    assert (near.stats().mapped_gets, near.stats().reads_posted) == (0, 1)
    # An unshared sender publishes nothing: receivers read it with NIXL.
    private = make(world, same_node="off")
    near2 = make(world)
    get(private, near2, "d", src)
    assert (near2.stats().mapped_gets, near2.stats().reads_posted) == (0, 1)


@pytest.mark.parametrize("mode", ["map", "copy"])
def test_a_fragmented_object_is_mapped_contiguously(world: World, mode: str) -> None:
    s, r = make(world, pool_bytes=16 * PAGE), make(world, same_node=mode)
    # Fill the pool with four-page objects, free every other one: two free holes.
    keep = []
    for i in range(4):
        get(s, make(world, same_node="off"), f"f{i}", [torch.zeros(PAGE, dtype=torch.int32)])
        keep.append(f"f{i}")
    s.sender.free("f0")
    s.sender.free("f2")
    src = torch.arange(2 * PAGE, dtype=torch.int32)  # eight pages: spans both holes
    got = get(s, r, "g", [src])
    assert len(s.sender.sent["g"].blocks) == 2
    assert torch.equal(got[0], src) and r.stats().mapped_gets == 1


@pytest.mark.parametrize("how", ["targets", "selection"])
def test_a_fragmented_object_is_copied_into_targets_and_selections(world: World, how: str
                                                                   ) -> None:
    """In map mode a fragmented object is copied out of its pieces (it has no contiguous
    place in the pool mapping): into target buffers, and for a selection, too."""
    s, r = make(world, pool_bytes=16 * PAGE), make(world)
    for i in range(4):
        get(s, make(world, same_node="off"), f"f{i}", [torch.zeros(PAGE, dtype=torch.int32)])
    s.sender.free("f0")
    s.sender.free("f2")
    src = [torch.arange(PAGE, dtype=torch.int32).reshape(64, -1),
           torch.arange(PAGE, dtype=torch.float32) * 3]  # eight pages: both holes
    if how == "targets":
        out = [torch.empty_like(t) for t in src]
        got = get(s, r, "g", src, targets=out)
        assert got[0] is out[0] and got[1] is out[1]
        want = src
    else:
        sel = [(slice(3, 60), slice(5, 40)), (slice(1000, 3000),)]
        got = get(s, r, "g", src, sel=sel)
        want = [src[0][3:60, 5:40], src[1][1000:3000]]
    assert len(s.sender.sent["g"].blocks) == 2
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    st = r.stats()
    assert (st.mapped_gets, st.reads_posted, st.mapped_objects) == (1, 0, 0)
    s.sender.free("g")
    settle(r, s)
    assert s.stats().leased_objects == 0


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_kept_objects_share_one_mapping_of_the_pool(world: World) -> None:
    """Each mapped object used to be a mapping of its own: a receiver keeping many hit
    the kernel's vm.max_map_count. Now the pool is mapped once; a second get of an
    object whose views live (and may have been written) is a copy of the pool's bytes,
    and pages a view wrote go back to the file before the block is reused."""
    n = 63
    s, r = make(world, pool_bytes=(n + 1) * PAGE), make(world)
    get(s, r, "warm", [torch.arange(10)])  # the handle and its mappings exist
    before = _maps()
    metas = [ship(s.put(f"k{i}", [torch.full((300 + i,), i, dtype=torch.int32)]))
             for i in range(n)]  # the pool is full now
    kept = [r.wait(r.fetch(f"k{i}", m, None), -1) for i, m in enumerate(metas)]
    assert _maps() - before < 5
    assert r.stats().mapped_objects == n
    kept[7][0].fill_(-1)  # this receiver's private pages
    again = r.wait(r.fetch("k7", metas[7], None), -1)  # the same object again
    assert bool((again[0] == 7).all()) and int(kept[7][0][0]) == -1
    assert (r.stats().mapped_gets, r.stats().mapped_objects) == (n + 2, n)  # a copy
    off = s.sender.sent["k7"].blocks[0][0]
    s.sender.free("k7")
    del kept[7], again
    settle(r, s)
    assert (s.stats().leased_objects, r.stats().mapped_objects) == (0, n - 1)
    nxt = get(s, r, "n", [torch.full((307,), 9, dtype=torch.int32)])
    assert s.sender.sent["n"].blocks[0][0] == off  # the block of k7, written by us
    assert bool((nxt[0] == 9).all())
    for i in range(n):
        s.sender.free(f"k{i}")
    del kept, nxt
    settle(r, s)
    assert (s.stats().leased_objects, r.stats().mapped_objects) == (0, 0)


def test_the_sender_checks_only_the_slots_released(world: World,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's tick checked every held-back placement against every lease row
    (0.6 of a core while a receiver kept 20,000 objects). It reads the receivers'
    release logs and checks only the slots they name; a log that wrapped since it was
    last read, or a row claimed or cleared, means one check of everything."""
    s, r = make(world), make(world)
    kept = {i: get(s, r, f"k{i}", [torch.full((10,), i)]) for i in range(20)}
    slots = {i: s.sender.sent[f"k{i}"].blocks[0][0] // PAGE for i in range(20)}
    for i in range(20):
        s.sender.free(f"k{i}")
    table = s.sender.leases
    assert table is not None
    checked: list[list[int]] = []
    real = table.held_many
    monkeypatch.setattr(table, "held_many", lambda sl: checked.append(list(sl)) or real(sl))
    s.sender.reap()  # the first check is of everything
    assert sorted(checked[-1]) == sorted(slots.values())
    s.sender.reap()
    assert checked[-1] == []  # nothing changed: nothing checked
    del kept[3], kept[11]
    settle(r)
    s.sender.reap()
    assert sorted(checked[-1]) == sorted([slots[3], slots[11]])
    assert s.stats().leased_objects == 18
    host = r.receiver.mapped.hosts[s.agent_name]
    assert host is not None
    spare = host.info.slots - 1  # a page no object of this test starts at
    with r.receiver.lock:  # more releases than a log holds: one check of everything
        for _ in range(leases.LOG_ENTRIES + 1):
            host.lease(spare)
            host.release_one(spare)
    s.sender.reap()
    assert len(checked[-1]) == 18
    kept.clear()
    settle(r, s)
    assert s.stats().leased_objects == 0


def test_a_dead_receivers_row_is_cleared() -> None:
    table = LeaseTable(slots=64, rows=4)
    try:
        h = table.header
        # Row 1 claimed by a process that no longer exists (start time that never was).
        h[4 + 2 * 1], h[4 + 2 * 1 + 1] = os.getpid(), 1
        table.counts[1, 5] = 3
        # Row 2 claimed by this live process.
        h[4 + 2 * 2], h[4 + 2 * 2 + 1] = os.getpid(), process_start(os.getpid())
        table.counts[2, 6] = 1
        assert table.held(5) and table.held(6)
        assert table.sweep() == 1
        assert not table.held(5) and table.held(6)
        assert int(h[4 + 2]) == 0
    finally:
        table.close()


def test_an_exited_but_unreaped_process_counts_as_gone() -> None:
    """A zombie (exited, not yet reaped by its parent) still has /proc/<pid>/stat with its
    start time; it must read as gone, or a receiver would serve a dead sender's objects
    while the raylet is slow to reap it (seen on a loaded machine in the chaos run)."""
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        for _ in range(500):  # until the child has exited (its state turns to Z)
            with open(f"/proc/{child}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.01)
        else:
            pytest.fail("the child never became a zombie")
        assert process_start(child) is None  # what every alive() check and sweep reads
    finally:
        os.waitpid(child, 0)
    assert process_start(child) is None
    assert process_start(os.getpid()) is not None


@pytest.mark.parametrize("err", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EACCES])
def test_a_process_whose_state_cannot_be_read_counts_as_running(
        world: World, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    """Only a missing process (or a zombie) is gone. A /proc/<pid>/stat that cannot be
    read for another reason (the sender out of descriptors: EMFILE) used to read as
    "gone": the sweep cleared a live receiver's row, its leased block went back to the
    pool under its views, and a receiver's get raised "the sender has exited"."""
    s, r = make(world), make(world)
    kept = get(s, r, "a", [torch.full((PAGE,), 7, dtype=torch.int32)])
    assert s.sender.free("a")
    assert s.stats().leased_objects == 1
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)  # a pid that is gone (reaped)
    real_open = open

    def failing_open(path, *args, **kwargs):
        if str(path).startswith("/proc/") and str(path).endswith("/stat"):
            raise OSError(err, os.strerror(err), path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(info, "open", failing_open, raising=False)
    with pytest.raises(OSError):
        process_start(os.getpid())
    assert still_running(os.getpid(), 1)  # cannot tell: taken as running
    table = s.sender.leases
    assert table is not None
    assert table.sweep() == 0
    settle(s, r)
    assert s.stats().leased_objects == 1  # the lease of the live receiver still holds
    # ...and a live sender is not taken for an exited one.
    again = get(s, r, "b", [torch.arange(100)])
    assert torch.equal(again[0], torch.arange(100)) and r.stats().transfer_errors == 0
    monkeypatch.undo()
    assert process_start(child) is None and not still_running(child, 1)  # really gone
    assert torch.equal(kept[0], torch.full((PAGE,), 7, dtype=torch.int32))
    del kept, again
    settle(r, s)
    assert s.stats().leased_objects == 0


def _gone_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    return child


def test_rows_of_dead_receivers_come_back_with_nothing_leased(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Receivers come and go (restarted actors, task workers); in copy mode, or when views
    die before Ray's free, nothing ever waits for a lease. The sweep used to run only
    while something waited, so once 128 receivers had come and gone every new one was
    refused a row; and a receiver refused once never asked again."""
    monkeypatch.setattr(mapped_mod, "HOST_RETRY_S", 0.0)
    s = make(world)
    s.put("warm", [torch.arange(10)])
    table = s.sender.leases
    assert table is not None
    gone = _gone_pid()
    for row in range(table.rows):  # every row claimed by a receiver that exited
        table.header[4 + 2 * row], table.header[4 + 2 * row + 1] = gone, 1
    r = make(world, same_node="copy")
    src = [torch.arange(3000, dtype=torch.int32)]
    assert torch.equal(get(s, r, "a", src)[0], src[0])
    st = r.stats()
    assert (st.mapped_gets, st.reads_posted) == (0, 1)  # no free row: read with NIXL
    assert s.stats().leased_objects == 0
    settle(s)  # the sender's tick, with nothing leased
    assert torch.equal(get(s, r, "b", src)[0], src[0])  # asked again: a row is free now
    st = r.stats()
    assert (st.mapped_gets, st.reads_posted) == (1, 1)


@pytest.mark.parametrize("mode", ["views", "evicted"])
def test_leases_taken_before_a_close_drop_when_the_views_die(world: World, mode: str
                                                             ) -> None:
    """``ray_rdt_pool.shutdown()`` in a process that keeps running (or a handle closed
    while its views live) used to drop the lease table mapping at once: the views' later
    unmap never lowered the count, so the sender kept the block until this process
    exited. Now the table stays mapped until the last lease, and after shutdown (no
    progress thread) the views' deleter returns the lease itself."""
    s, r = make(world), make(world)
    src = torch.arange(5000, dtype=torch.int64)
    kept = get(s, r, "a", [src])
    if mode == "views":
        r.shutdown()
    else:  # what _host's eviction or the housekeeping of a dead sender does
        host = r.receiver.mapped.hosts[s.agent_name]
        assert host is not None
        with r.receiver.lock:
            r.receiver.mapped.hosts[s.agent_name] = None
            host.close()
    assert s.sender.free("a")
    settle(s)
    assert s.stats().leased_objects == 1  # the views live: the block stays leased
    assert torch.equal(kept[0], src)
    del kept
    if mode == "evicted":
        settle(r)  # the progress tick drains
    else:
        gc.collect()  # no tick after shutdown: the deleter alone
    s.sender.reap()
    st = s.stats()
    assert (st.leased_objects, st.leased_bytes) == (0, 0)
    st = r.stats()
    assert (st.mapped_objects, st.mapped_bytes) == (0, 0)


def test_after_shutdown_a_view_dying_while_the_lock_is_held_still_returns_its_lease(
        world: World) -> None:
    """With no progress thread (after shutdown, in a forked child), a deleter that found
    the receiver lock held by a thread that does not drain left its lease queued for
    good: the sender's block stayed leased for the life of this process."""
    s, r = make(world), make(world)
    kept = get(s, r, "a", [torch.arange(5000, dtype=torch.int64)])
    r.shutdown()
    assert s.sender.free("a")
    held, go = threading.Event(), threading.Event()

    def hold() -> None:
        with r.receiver.lock:
            held.set()
            go.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    del kept
    gc.collect()  # the deleter runs now, and cannot take the lock
    go.set()
    t.join(10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        s.sender.reap()
        if s.stats().leased_objects == 0 and r.receiver.mapped.objects == 0:
            break  # (the drain thread counts after it returned the lease)
        time.sleep(0.02)
    assert s.stats().leased_objects == 0
    assert r.receiver.mapped.objects == 0


def test_after_shutdown_a_view_dying_during_a_fork_returns_its_lease(world: World) -> None:
    """The fork hooks hold drains off; a view that died meanwhile (after shutdown: no
    progress thread) left its lease queued with nobody to return it."""
    s, r = make(world), make(world)
    rc = r.receiver
    kept = get(s, r, "a", [torch.arange(5000, dtype=torch.int64)])
    r.shutdown()
    fork_mod.before(rc.mapped)
    try:
        del kept
        gc.collect()  # the deleter finds drains held off: its release is queued
        assert rc.mapped.unmaps
    finally:
        fork_mod.after_parent(rc.mapped)
    assert not rc.mapped.unmaps
    for fd, _extra in rc.mapped.forks.pending:  # no child was made: settle the extra leases
        os.close(fd)
    for _fd, extra in rc.mapped.forks.pending:
        for host, slot in extra:
            host.release_one(slot)
    rc.mapped.forks.pending = []
    s.sender.free("a")
    s.sender.reap()
    assert s.stats().leased_objects == 0


def test_a_release_queued_at_the_end_of_a_drain_is_not_left_behind(world: World,
                                                                   monkeypatch) -> None:
    """A deleter run by GC inside a drain, after its unmap loop, saw the drain running
    and left its release for it; the drain had passed that loop and never saw it."""
    s, r = make(world), make(world)
    rc = r.receiver
    kept = get(s, r, "a", [torch.arange(5000, dtype=torch.int64)])
    views = [kept]
    real = rc.mapped.forks.settle_locked

    def gc_inside_the_drain() -> None:
        if views:
            views.clear()
            gc.collect()  # kept's views die here: their deleter queues the release
        real()

    pr, pw = os.pipe()  # a fork whose child has not copied yet: the drain settles it
    os.set_blocking(pr, False)
    rc.mapped.forks.pending = [(pr, [])]
    monkeypatch.setattr(rc.mapped.forks, "settle_locked", gc_inside_the_drain)
    del kept
    try:
        with rc.lock:
            rc.drain.run_locked()
            assert not rc.mapped.unmaps and rc.mapped.objects == 0
    finally:
        rc.mapped.forks.pending = []
        os.close(pr)
        os.close(pw)
    s.sender.free("a")
    s.sender.reap()
    assert s.stats().leased_objects == 0


@pytest.mark.parametrize("mode", ["map", "copy"])
def test_a_handle_closed_between_lookup_and_lease_is_looked_up_again(world: World, mode: str
                                                                    ) -> None:
    """Another thread may close our handle on a sender between ``_host()`` and the lease
    (evicting the least recently used handle, or the housekeeping of a sender it takes
    for dead): the lease used to hit the closed table (TypeError out of ray.get)."""
    s, r = make(world), make(world, same_node=mode)
    src = [torch.arange(100)]
    get(s, r, "a", src)
    host = r.receiver.mapped.hosts[s.agent_name]
    assert host is not None
    real = r.receiver.mapped._backend
    closed = []

    def close_on_another_thread():
        if not closed:
            def evict() -> None:
                with r.receiver.lock:
                    r.receiver.mapped.hosts.pop(s.agent_name, None)
                    host.close()
            t = threading.Thread(target=evict)
            t.start()
            t.join()
            closed.append(True)
        return real()

    r.receiver.mapped._backend = close_on_another_thread
    got = get(s, r, "b", src)
    r.receiver.mapped._backend = real
    assert closed and torch.equal(got[0], src[0])
    st = r.stats()
    assert (st.mapped_gets, st.reads_posted, st.transfer_errors) == (2, 0, 0)
    del got
    settle(r, s)
    assert r.stats().mapped_objects == 0 and s.stats().leased_objects == 0


@pytest.mark.parametrize("mode", ["map", "copy"])
def test_a_handle_closed_between_lease_and_mapping_still_maps_the_pool(
        world: World, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mapping (or the first copy's shared view) is made after the lease, outside the
    receiver lock, and another thread may close the handle meanwhile. close() used to
    close the pool's descriptor at once: the mapping then failed (a NIXL READ instead),
    or, had the number been reused by a file opened meanwhile, mapped that file."""
    s, r = make(world), make(world, same_node=mode)
    src = [torch.arange(5000, dtype=torch.int64)]
    get(s, r, "warm", [torch.arange(3)])  # opens the handle
    host = r.receiver.mapped.hosts[s.agent_name]
    assert host is not None
    if host._shared:  # copy mode: make the next copy the first, which maps the pool
        _libc.unmap(host._shared, host.info.pool_bytes)
        host._shared = 0
    decoys: list[int] = []
    name = "map" if mode == "map" else "shared_view"
    real = getattr(pool_handle.MappedPool, name)

    def close_then_reuse_the_number(self, *args):
        if not decoys:
            def evict() -> None:
                with r.receiver.lock:
                    r.receiver.mapped.hosts.pop(s.agent_name, None)
                    self.close()
            if r.receiver.lock._is_owned():
                evict()  # under our lock: the close came just before it was taken
            else:
                t = threading.Thread(target=evict)
                t.start()
                t.join()
            fd = os.memfd_create("decoy")
            os.ftruncate(fd, 8 << 20)
            os.pwrite(fd, b"\xee" * 65536, 0)
            decoys.append(fd)
        return real(self, *args)

    monkeypatch.setattr(pool_handle.MappedPool, name, close_then_reuse_the_number)
    try:
        got = get(s, r, "a", src)
        assert decoys and torch.equal(got[0], src[0])
        st = r.stats()
        assert (st.mapped_gets, st.reads_posted) == (2, 0)
        del got
        settle(r, s)
        assert r.stats().mapped_objects == 0 and s.stats().leased_objects == 0
        assert host.pool_fd == -1  # closed with the last lease
    finally:
        for fd in decoys:
            os.close(fd)


def test_the_shared_view_is_made_under_the_receiver_lock(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two first copies on two threads each mapped the whole pool and one mapping was
    lost (a pool-sized leak per sender): the view must be made under the lock."""
    s, r = make(world), make(world, same_node="copy")
    seen: list[bool] = []
    real = pool_handle.MappedPool.shared_view

    def checked(self):
        seen.append(r.receiver.lock._is_owned())
        return real(self)

    monkeypatch.setattr(pool_handle.MappedPool, "shared_view", checked)
    src = [torch.arange(100)]
    assert torch.equal(get(s, r, "a", src)[0], src[0])
    assert seen and all(seen)


def test_handles_are_evicted_least_recently_used_first_even_with_views_out(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit moves the handle to the end (the busiest sender used to be evicted first);
    a handle evicted while its views live keeps their lease until they die."""
    monkeypatch.setattr(mapped_mod, "MAX_HOSTS", 2)
    a, b, c = make(world), make(world), make(world)
    r = make(world)
    src = [torch.arange(2000, dtype=torch.int32)]
    kept = get(a, r, "a1", src)
    get(b, r, "b1", src)
    get(a, r, "a2", src)  # a is the most recently used now
    get(c, r, "c1", src)
    assert list(r.receiver.mapped.hosts) == [a.agent_name, c.agent_name]
    get(b, r, "b2", src)  # evicts a, whose views of a1 live
    assert list(r.receiver.mapped.hosts) == [c.agent_name, b.agent_name]
    assert a.sender.free("a1")
    settle(a, r)
    assert a.stats().leased_objects == 1 and torch.equal(kept[0], src[0])
    del kept
    settle(r, a)
    assert a.stats().leased_objects == 0 and r.stats().mapped_objects == 0


def _memfds() -> set[tuple[str, int]]:
    """(name, inode) of every memfd this process has open (pools and lease tables)."""
    out: set[tuple[str, int]] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("/memfd:ray_rdt_pool"):
                out.add((link.split()[0], os.stat(f"/proc/self/fd/{fd}").st_ino))
        except OSError:
            continue
    return out


def test_a_failed_publish_leaves_the_pool_private_and_fails_no_put(world: World) -> None:
    """Publishing the same-node entry (a GCS write) failed the put and left the whole
    pool behind (its memfd, mapping and NIXL registration): one more per retried put. A
    GCS blip must not fail a put that NIXL can serve: the pool stays private, and
    same-node receivers read it with NIXL."""
    before = _memfds()
    fails = [2]
    real = world.publish_host

    def flaky(name: str, info: bytes) -> None:
        if fails[0]:
            fails[0] -= 1
            raise RuntimeError("GCS unavailable")
        real(name, info)

    world.publish_host = flaky  # type: ignore[method-assign]
    s, r = make(world), make(world)
    src = [torch.arange(1000, dtype=torch.float32)]
    for i in range(3):
        assert torch.equal(get(s, r, f"o{i}", src)[0], src[0])
    st = s.stats()
    assert (st.registered_regions, st.nixl_registrations, st.objects_put) == (1, 1, 3)
    assert s.sender.leases is None  # not shared: nothing for a receiver to lease
    rst = r.stats()
    assert (rst.mapped_gets, rst.reads_posted, rst.transfer_errors) == (0, 3, 0)
    new = sorted(name for name, _ino in _memfds() - before)
    assert new == ["/memfd:ray_rdt_pool"]  # one pool, no lease table


def test_a_pool_nixl_refuses_is_a_registration_error_and_leaves_nothing(world: World
                                                                       ) -> None:
    before = _memfds()
    s = make(world)
    s.backend()
    backend = world.agents[s.agent_name]
    real = backend.register
    calls = []

    def refuse_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("NIXL_ERR_BACKEND: cannot register memory")
        return real(*args, **kwargs)

    backend.register = refuse_once  # type: ignore[method-assign]
    with pytest.raises(RegistrationError, match="sender pool") as info:
        s.put("a", [torch.arange(10)])
    assert isinstance(info.value.__cause__, RuntimeError)
    st = s.stats()
    assert (st.registered_regions, st.pool_capacity, st.live_objects) == (0, 0, 0)
    assert not _memfds() - before  # the pool's memfd is closed again
    assert s.put("a", [torch.arange(10)]) is not None  # the next put makes the pool
    assert s.stats().registered_regions == 1


def test_sender_and_receiver_agree_on_the_slot_whatever_the_pool_alignment(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's slot was ``offset // region align`` and the receiver's ``offset //
    PAGE``: they disagree where the pool's blocks are not page-sized (a CUDA pool's are
    4 KiB, the page 64 KiB on some hosts), and the sender looked at the wrong count and
    reused a block under a receiver's views. Staged here with blocks of two pages."""
    monkeypatch.setattr(memfd.SharedHostMemory, "align", 2 * PAGE)
    s, r = make(world), make(world)
    first = torch.full((PAGE // 2,), 1, dtype=torch.int32)  # half a block
    get(s, make(world, same_node="off"), "pad", [first])  # takes the first block
    kept = get(s, r, "a", [torch.full((PAGE // 2,), 7, dtype=torch.int32)])
    assert s.sender.sent["a"].blocks[0][0] == 2 * PAGE
    assert s.sender.free("a")
    settle(s)
    assert s.stats().leased_objects == 1  # the receiver's lease is seen
    get(s, make(world, same_node="off"), "b", [torch.full((PAGE // 2,), 9, dtype=torch.int32)])
    assert s.sender.sent["b"].blocks[0][0] != 2 * PAGE
    assert int(kept[0][0]) == 7 and int(kept[0][-1]) == 7
    del kept
    settle(r, s)
    assert s.stats().leased_objects == 0


def test_mapped_views_reused_as_targets_are_copied_into_and_not_cached(world: World
                                                                      ) -> None:
    """Views of a same-node mapping passed as the targets of READs from another node's
    sender (a weight-sync loop): the registration cache registered them on the second
    sighting and held their storage, so the mapping, and the same-node sender's lease on
    its block, outlived every view (the arena's case is bug 48)."""
    local, remote, r = make(world), make(world, node="node-b"), make(world)
    views = get(local, r, "A", [torch.arange(4096, dtype=torch.float32)])
    assert r.stats().mapped_gets == 1
    meta = ship(remote.put("B", [torch.full((4096,), 3.0)]))
    for _ in range(3):
        out = r.wait(r.fetch("B", meta, views), -1)
        assert out[0] is views[0] and bool((views[0] == 3).all())
    st = r.stats()
    assert st.reads_posted == 3 and st.registration_cache_entries == 0
    del views, out
    assert local.sender.free("A")
    settle(r, local)
    assert (local.stats().leased_objects, local.stats().pool_used) == (0, 0)
    assert r.stats().mapped_objects == 0


def _fork(child) -> int:
    """Run ``child()`` in a forked child; returns its pid. The child exits 0 if it
    returned, 1 (with the traceback on stderr) if it raised. It checks bytes with numpy,
    not torch ops, whose thread pool a forked child must not use."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _reap_child(pid: int) -> None:
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child failed (see stderr)"


def test_a_forked_child_keeps_the_bytes_of_its_inherited_views(world: World) -> None:
    """A map-mode receiver forks (a DataLoader worker, fork-start multiprocessing) while
    it holds received views. The child inherits the private mappings, whose untouched
    pages are the sender's shared pool, but not the lease: the parent dropped its views,
    the sender reused the block, and the child's views showed the next object."""
    s, r = make(world), make(world)
    n = PAGE
    views = {"a": get(s, r, "a", [torch.full((n,), 7, dtype=torch.int32)])}
    go_r, go_w = os.pipe()

    def child() -> None:
        os.read(go_r, 1)  # until the parent has reused the block
        assert (views["a"][0].numpy() == 7).all()

    pid = _fork(child)
    try:
        views.clear()  # the parent's views die: its lease drops
        settle(r)
        assert s.sender.free("a")
        settle(s)
        get(s, make(world, same_node="off"), "b", [torch.full((n,), 9, dtype=torch.int32)])
    finally:
        os.write(go_w, b"x")
        _reap_child(pid)
    settle(r, s)
    assert s.stats().leased_objects == 0 and r.stats().mapped_objects == 0


def test_until_the_child_copied_its_mappings_the_parent_holds_their_blocks(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between fork() and the child's copy, the parent's views may die and Ray free the
    object: the parent holds one more lease per mapping until the child has copied."""
    s, r = make(world), make(world)
    n = PAGE
    views = {"a": get(s, r, "a", [torch.full((n,), 7, dtype=torch.int32)])}
    go_r, go_w = os.pipe()
    real = fork_mod.privatize

    def slow_privatize(addr: int, length: int) -> bool:
        os.read(go_r, 1)  # the child is slow to copy: the parent goes on meanwhile
        return real(addr, length)

    monkeypatch.setattr(fork_mod, "privatize", slow_privatize)

    def child() -> None:
        assert (views["a"][0].numpy() == 7).all()

    pid = _fork(child)
    monkeypatch.undo()
    try:
        views.clear()
        settle(r)
        assert s.sender.free("a")
        settle(s)
        assert s.stats().leased_objects == 1  # the child has not copied yet
        off_a = next(iter(s.sender.leased.values())).blocks[0][0]
        get(s, make(world, same_node="off"), "b", [torch.full((n,), 9, dtype=torch.int32)])
        assert s.sender.sent["b"].blocks[0][0] != off_a
    finally:
        os.write(go_w, b"x")
        _reap_child(pid)
    settle(r, s)
    assert s.stats().leased_objects == 0 and r.stats().mapped_objects == 0


def _read1(fd: int, timeout: float = 20.0) -> bytes:
    """One byte from a pipe, or TimeoutError: a process of a failed test must not wait
    forever on a peer that will never write (its own copy keeps the pipe open)."""
    ready, _w, _x = select.select([fd], [], [], timeout)
    if not ready:
        raise TimeoutError("no word on the pipe")
    return os.read(fd, 1)


@pytest.mark.parametrize("copy_fails", [False, True])
def test_a_forked_child_holds_its_blocks_if_its_parent_dies_while_it_copies(
        world: World, copy_fails: bool) -> None:
    """Only the parent's extra leases held the blocks a forked child was copying. The
    parent died meanwhile (a receiver process killed just after it forked): the sender
    cleared the dead parent's row and reused the block, and the child copied the next
    object's bytes. The child now takes leases of its own, in a row of its own, first.
    Three processes: this one sends, a forked receiver forks again and dies while its
    child copies (the copy waits on a pipe). A child whose copy failed still maps the
    pool: it keeps its leases until it exits."""
    s = make(world)
    n = PAGE
    meta = ship(s.put("a", [torch.full((n,), 7, dtype=torch.int32)]))
    off_a = s.sender.sent["a"].blocks[0][0]
    table = s.sender.leases
    assert table is not None
    copying_r, copying_w = os.pipe()  # the grandchild is inside its copy
    go_r, go_w = os.pipe()  # let it finish
    done_r, done_w = os.pipe()  # what it saw

    def receiver() -> None:
        r = make(world)
        views = r.wait(r.fetch("a", meta, None), -1)
        assert r.stats().mapped_gets == 1
        real = fork_mod.privatize

        def slow_privatize(addr: int, length: int) -> bool:
            os.write(copying_w, b"c")
            _read1(go_r)
            return False if copy_fails else real(addr, length)

        fork_mod.privatize = slow_privatize  # type: ignore[assignment]
        if os.fork() == 0:
            if copy_fails:  # its block is still held after its hook has run
                os.write(done_w, b"1" if table.held(off_a // PAGE) else b"0")
                _read1(go_r)
            os.write(done_w, b"1" if (views[0].numpy() == 7).all() else b"0")
            os._exit(0)
        _read1(copying_r)
        os._exit(0)  # dies holding its views, its lease and its extra lease

    pid = _fork(receiver)
    try:
        _reap_child(pid)
        assert s.stats().leased_objects == 0  # leases are counted once the object is freed
        assert s.sender.free("a")
        settle(s)  # sweeps the dead receiver's row
        assert s.stats().leased_objects == 1  # the grandchild's own lease holds the block
        get(s, make(world, same_node="off"), "b", [torch.full((n,), 9, dtype=torch.int32)])
        assert s.sender.sent["b"].blocks[0][0] != off_a
    finally:
        os.write(go_w, b"x")
        seen = _read1(done_r)
        if copy_fails:
            assert seen == b"1"  # held once its hook had run
            os.write(go_w, b"x")
            seen = _read1(done_r)
        for fd in (copying_r, copying_w, go_r, go_w, done_r, done_w):
            os.close(fd)
    assert seen == b"1"  # the grandchild copied "a", not "b"
    settle(s)
    if copy_fails:  # until the grandchild is gone, its views still show block "a"
        deadline = time.monotonic() + 10
        while s.stats().leased_objects and time.monotonic() < deadline:
            time.sleep(0.05)
            settle(s)
    st = s.stats()
    assert (st.leased_objects, st.live_objects) == (0, 1)
    assert not table._claimed()  # its row was given back once it had copied


def test_a_forked_child_never_writes_the_parents_lease_row(world: World) -> None:
    """The child's inherited views die and it drains: it used to lower the parent's
    count through the inherited table (the parent's block freed under its live views,
    its count wrapping to 0xFFFFFFFF later). A get in the child takes a row of its own,
    and a put into the inherited shared pool is refused."""
    s, r = make(world), make(world)
    n = PAGE
    src = torch.full((n,), 7, dtype=torch.int32)
    views = {"a": get(s, r, "a", [src])}
    host = r.receiver.mapped.hosts[s.agent_name]
    assert host is not None
    table = s.sender.leases
    assert table is not None
    slot = s.sender.sent["a"].blocks[0][0] // PAGE
    row = host.row
    later = ship(s.put("c", [torch.full((n,), 5, dtype=torch.int32)]))
    slot_c = s.sender.sent["c"].blocks[0][0] // PAGE

    def child() -> None:
        before = int(table.counts[row, slot])  # the parent's lease (and its extra one)
        views.clear()
        gc.collect()
        r.stats()  # drains: the mapping goes, the parent's count stays
        assert int(table.counts[row, slot]) == before
        got = r.wait(r.fetch("c", later, None), -1)  # maps "c" with a row of its own
        assert (got[0].numpy() == 5).all()
        mine = r.receiver.mapped.hosts[s.agent_name]
        assert mine is not None and mine.row != row
        assert int(table.counts[mine.row, slot_c]) == 1
        assert int(table.counts[row, slot_c]) == 0
        with pytest.raises(RegistrationError, match="forked"):
            s.put("d", [torch.arange(10)])
        # exits holding its views of "c": its row is swept once it is gone

    pid = _fork(child)
    _reap_child(pid)
    assert s.sender.free("a") and s.sender.free("c")
    settle(s, r)
    assert s.stats().leased_objects == 1  # the parent's views of "a" still live...
    assert torch.equal(views["a"][0], src)
    views.clear()
    settle(r, s)
    st = s.stats()
    assert (st.leased_objects, st.pool_used) == (0, 0)  # ...and the child's row was swept
    assert r.stats().mapped_objects == 0


def test_host_entries_are_validated() -> None:
    good = HostInfo("n", 1, 2, 3, 4, PAGE, PAGE * 8, 5, 6, 4, 8)
    assert HostInfo.decode(good.encode()) == good
    for bad in (b"\x00", good.encode()[:-1], HostInfo("n", 1, 2, 3, 4, PAGE, PAGE * 8, 5, 6,
                                                      4, 2).encode()):
        with pytest.raises(WireFormatError):
            HostInfo.decode(bad)


def test_the_shared_view_outlives_a_close_until_the_last_copy_lease(world: World) -> None:
    """Copies read through one read-only view of the pool; a handle closed (sender gone)
    while a copy holds a lease keeps that view mapped until the lease ends."""
    s, r = make(world), make(world, same_node="copy")
    src = [torch.arange(5000, dtype=torch.int64)]
    assert torch.equal(get(s, r, "a", src)[0], src[0])
    host = r.receiver.mapped.hosts[s.agent_name]
    assert host is not None
    base = host.shared_view()
    import ctypes

    off = s.sender.sent["a"].blocks[0][0]
    host.lease(0)
    host.close()
    assert ctypes.string_at(base + off, 16) == src[0][:2].numpy().tobytes()  # still mapped
    host.release_one(0)
    assert host.shared_view is not None and host.held == 0
    assert host._shared == 0  # unmapped with the last lease


def test_leases_of_a_dropped_sender_handle_still_count_until_the_views_die(world: World
                                                                          ) -> None:
    """When a sender exits, the receiver drops its handle (``_close_dead_hosts``); views
    mapped from it stay valid and stay counted in ``mapped_objects`` until they die."""
    s, r = make(world), make(world)
    kept = get(s, r, "a", [torch.arange(3000, dtype=torch.int32)])
    host = r.receiver.mapped.hosts[s.agent_name]
    assert host is not None
    r.receiver.mapped.hosts[s.agent_name] = None  # what the housekeeping does for a dead sender
    host.close()
    st = r.stats()
    assert (st.mapped_objects, st.mapped_bytes) == (1, 12032)
    assert int(kept[0][-1]) == 2999  # the mapping outlives the handle
    del kept
    settle(r)
    st = r.stats()
    assert (st.mapped_objects, st.mapped_bytes) == (0, 0)


def test_a_self_drain_never_runs_inside_a_locked_change_of_the_arena(world):
    """With no progress thread (a forked child, after shutdown()) a dying mapping's
    deleter drains at once; the receiver's lock is re-entrant, so when GC ran that
    deleter on a thread inside an arena allocation (under the lock, between planning and
    carving the block) the drain freed a block in the middle of it: a KeyError out of the
    landing, and the arena's free lists broken for every later landing. The deleter now
    leaves the drain to a helper thread when its thread holds the lock."""
    s, r = make(world), make(world)
    rc = r.receiver
    mapped = r.wait(r.fetch("m", ship(s.put("m", [torch.ones(1024)])), None), -1)
    assert r.stats().mapped_objects == 1
    src = peer_memory.this_process("node-a")
    x = torch.full((100_000,), 3.0)

    def land(n=1024):
        return rc.sources.read(src, [(x.data_ptr(), (n,), "float32")])[0]

    a1, a2, b = land(), land(), land()  # the arena: a1 [0,4K), a2 [4K,8K), b [8K,12K)
    rc.drain.self_drain = True  # as in a forked child: no progress thread drains
    del a2
    gc.collect()  # a hole at [4K,8K), given back at the next drain
    holder, cycle = [b], [mapped]
    cycle.append(cycle)  # the mapped views die only when GC collects this cycle
    del b, mapped, cycle
    alloc = rc.arenas["cpu"].alloc
    plan = alloc._plan

    def plan_then_collect(*args):
        p = plan(*args)
        holder.clear()  # b dies meanwhile (another thread lets go of it)
        gc.collect()  # and GC runs the mapping's deleter on this thread, under the lock
        return p

    was_enabled = gc.isenabled()
    gc.disable()
    alloc._plan = plan_then_collect
    try:
        got = land()
    finally:
        alloc._plan = plan
        if was_enabled:
            gc.enable()
    assert torch.equal(got, x[:1024])
    kept = [land(100_000) for _ in range(3)]  # later landings are fine too
    assert all(torch.equal(k, x) for k in kept)
    del got, kept, a1
    gc.collect()
    deadline = time.monotonic() + 10  # the helper thread drains once the lock is free
    while (r.stats().mapped_objects, r.stats().arena_used) != (0, 0):
        assert time.monotonic() < deadline, r.stats()
        time.sleep(0.01)


def test_a_fetch_after_shutdown_keeps_no_handle_on_a_same_node_sender(world):
    """A same-node fetch after shutdown() opened a handle on the sender's pool (its
    descriptors and a row of its lease table) before it found the runtime shut down;
    shutdown() had closed the handles already, so this one stayed open for good."""
    s, r = make(world), make(world)
    meta = ship(s.put("a", [torch.arange(1024.0)]))
    got = r.wait(r.fetch("a", meta, None), -1)
    del got
    gc.collect()
    r.receiver.reap()
    r.shutdown()
    fds = len(os.listdir("/proc/self/fd"))
    meta2 = ship(s.put("b", [torch.arange(1024.0)]))
    for _ in range(3):
        with pytest.raises(Exception, match="shut down"):
            r.fetch("b", meta2, None)
        with pytest.raises(Exception, match="shut down"):  # past the runtime's own check
            r.receiver.mapped.host(meta2.decoded().agent, meta2.decoded().agent_version)
    assert not r.receiver.mapped.hosts and len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.parametrize("mode", ["map", "copy"])
def test_debug_logging_names_every_same_node_get_and_source_read(world, caplog, mode):
    """RAY_RDT_POOL_DEBUG_TRANSFERS promises a line for every put and every fetch; gets mapped from
    a same-node sender's pool (the default path on one node) and source reads logged
    none."""
    import logging

    from ray_rdt_pool.obs.logs import disable_debug_logging

    # The runtimes add the package's stderr handler: it must not outlive this test (a
    # later one in this process would find it bound to this test's captured stderr).
    try:
        s, r = make(world, debug_transfers=True), make(world, debug_transfers=True,
                                                       same_node=mode)
        x = torch.arange(1024.0)
        with caplog.at_level(logging.DEBUG, logger="ray_rdt_pool"):
            got = r.wait(r.fetch("a", ship(s.put("a", [x])), None), -1)
            r.receiver.sources.read(peer_memory.this_process("node-a"),
                                   [(x.data_ptr(), (1024,), "float32")],
                                   targets=[torch.empty(1024)])
    finally:
        disable_debug_logging()
    lines = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.DEBUG]
    assert any(ln.startswith("put a:") for ln in lines)
    assert any(ln.startswith("fetched a:") and f"same-node sender's pool ({mode})" in ln
               for ln in lines), lines
    assert any(ln.startswith("read 1 tensors, 4096 bytes in place") for ln in lines), lines
    assert torch.equal(got[0], x)


def test_a_pool_full_of_leased_blocks_says_so(world, caplog):
    """A pool held by same-node receivers' views of objects Ray freed refused a put
    (strict) with "drop refs to free objects sooner" and no word of the leases, and the
    overflow warning likewise: the fix is on the receivers."""
    import logging

    for strict in (True, False):
        s, r = make(world, pool_bytes=1 << 20, overflow=not strict), make(world)
        kept = get(s, r, "a", [torch.ones((1 << 20) // 4 - 4096)])
        s.sender.free("a")
        settle(s)
        assert s.stats().leased_bytes > 0 and s.stats().live_objects == 0
        want = r"bytes of it are objects already freed whose blocks same-node receivers " \
               r"still hold views of \(1 objects\).*same_node='copy'"
        if strict:
            with pytest.raises(PoolExhaustedError, match=want):
                s.put("b", [torch.ones(100_000)])
        else:
            with caplog.at_level(logging.WARNING, logger="ray_rdt_pool"):
                s.put("b", [torch.ones(100_000)])
            assert any(re.search(want, rec.getMessage()) for rec in caplog.records)
            s.free("b")
        del kept


def test_a_ctrl_c_inside_a_mapped_get_gives_the_lease_back(world, monkeypatch):
    """A KeyboardInterrupt while a same-node get mapped the sender's block (only
    OSError was undone there), or while the block's tensor was being made, kept the
    lease: the sender's block stayed leased after Ray freed the object, for good."""
    s, r = make(world), make(world)
    src = [torch.full((100_000,), 3.0)]
    assert torch.equal(get(s, r, "w", src)[0], src[0])  # opens the sender's pool
    s.free("w")
    settle(s, r)
    assert r.stats().mapped_gets == 1
    real_map, real_dlpack = pool_handle.MappedPool.map, torch.utils.dlpack.from_dlpack

    def map_then_interrupted(self, spans, total):
        real_map(self, spans, total)
        raise KeyboardInterrupt

    def dlpack_interrupted(capsule):
        raise KeyboardInterrupt

    for where in ("map", "tensor"):
        if where == "map":
            monkeypatch.setattr(pool_handle.MappedPool, "map", map_then_interrupted)
        else:
            monkeypatch.setattr(torch.utils.dlpack, "from_dlpack", dlpack_interrupted)
        meta = ship(s.put(where, src))
        with pytest.raises(KeyboardInterrupt):
            r.wait(r.fetch(where, meta, None), 10)
        monkeypatch.setattr(pool_handle.MappedPool, "map", real_map)
        monkeypatch.setattr(torch.utils.dlpack, "from_dlpack", real_dlpack)
        s.free(where)
        settle(s, r)
        ss, rs = s.stats(), r.stats()
        assert (ss.leased_objects, ss.pool_used, rs.mapped_objects) == (0, 0, 0), where
    for rt in (s, r):
        rt.shutdown()


def _fetch_by_reference(s: Runtime, r: Runtime, obj_id: str, tensors) -> list[torch.Tensor]:
    """What the weights stream's by-reference buckets do: no pool, a READ."""
    s.sending()
    _meta, wire = s.sender.put_by_reference(obj_id, tensors)
    pmeta = PoolTransportMetadata(tensor_meta=[], tensor_device="cpu", wire=wire)
    return r.wait(r.fetch(obj_id, pmeta, None), -1)


def test_a_pool_made_after_the_first_contact_is_mapped_and_lookups_stay_bounded(
        world: World) -> None:
    """A receiver that met a sender before its pool existed kept "no shared pool" for
    good and READ every pooled object of it. It asks again only for an object of a newer
    registration epoch: never once per fetch."""
    asked: list[str] = []
    real = world.lookup_host

    def counted(name: str) -> bytes | None:
        asked.append(name)
        return real(name)

    world.lookup_host = counted  # type: ignore[method-assign]
    s, r = make(world), make(world)
    lent = [torch.arange(5000, dtype=torch.int64)]
    for i in range(3):  # one storage, one epoch: looked up once
        assert torch.equal(_fetch_by_reference(s, r, f"w{i}", lent)[0], lent[0])
        s.sender.free(f"w{i}")
    assert len(asked) == 1 and r.stats().reads_posted == 3
    src = [torch.arange(1000, dtype=torch.float32)]
    for i in range(3):  # the pool is made at the first: asked again once, then mapped
        assert torch.equal(get(s, r, f"p{i}", src)[0], src[0])
    st = r.stats()
    assert (st.mapped_gets, st.reads_posted, len(asked)) == (3, 3, 2), (st, asked)
    # Another node stays a definite answer, whatever epoch later objects name.
    far = make(world, node="node-b")
    for i in range(3):
        get(s, far, f"f{i}", src)
        _fetch_by_reference(s, far, f"fw{i}", [torch.ones(100 + i)])
    assert far.stats().mapped_gets == 0 and len(asked) == 3


def test_an_object_put_while_the_pool_entry_is_published_does_not_hide_the_pool(
        world: World) -> None:
    """A by-reference object put on another thread after the pool was registered but
    before its same-node entry was published names the pool's epoch; a receiver that
    fetches it finds no entry. Objects naming the pool must still be of a newer epoch,
    or that receiver would READ them until the sender registered something else."""
    s, r = make(world), make(world)
    lent = [torch.arange(3000, dtype=torch.int64)]
    real = world.publish_host

    def late(name: str, info: bytes) -> None:
        if name == s.agent_name and not world.hosts:
            assert torch.equal(_fetch_by_reference(s, r, "w", lent)[0], lent[0])
        real(name, info)

    world.publish_host = late  # type: ignore[method-assign]
    src = [torch.arange(1000, dtype=torch.float32)]
    assert torch.equal(get(s, r, "p", src)[0], src[0])
    st = r.stats()
    assert (st.mapped_gets, st.reads_posted) == (1, 1), st


def test_a_new_ray_session_gets_the_pool_entry_again_with_its_node_id(world: World) -> None:
    """``ray.shutdown()`` and ``ray.init()`` in one process: the new session's directory
    starts empty and this process is on a new node ID. The entry is published there again
    before the first object of the new session, so its receivers map the pool."""
    session, node = ["s1"], ["node-a"]
    world.session = lambda: session[0]  # type: ignore[attr-defined]
    s = Runtime(PoolConfig(pool_bytes=4 << 20, arena_bytes=4 << 20, metrics=False),
                backend_factory=world.factory, directory=world, node_id=lambda: node[0])
    src = [torch.arange(1000, dtype=torch.float32)]
    assert torch.equal(get(s, make(world), "a", src)[0], src[0])
    world.hosts.clear()  # the new session's GCS
    world.kv.clear()
    session[0], node[0] = "s2", "node-c"
    r = make(world, node="node-c")
    assert torch.equal(get(s, r, "b", src)[0], src[0])
    st = r.stats()
    assert (st.mapped_gets, st.reads_posted) == (1, 0), st
    assert HostInfo.decode(world.hosts[s.agent_name]).node_id == "node-c"
    assert s.stats().live_objects == 1  # "a" went with its session
