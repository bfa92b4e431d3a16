"""Memory is never reused while a READ may still write into it, with the fake NIXL.

The fake models what NIXL may do (see ray_rdt_pool/testing.py): a READ given up on may
still write its bytes later, a cancel may fail, a release may raise. Each test that gives
up on a READ then lets the late write happen and checks that no other object's bytes
changed.
"""

from __future__ import annotations

import gc
import pickle
import threading
import time

import pytest
import torch

from ray_rdt_pool.errors import (
    TransferError,
)
from ray_rdt_pool.receive.peers import HOUSEKEEPING_S
from ray_rdt_pool.testing import FakeClock
from tests.support.fake_world import (
    make,
    roundtrip,
    same,
    ship,
)


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
