"""The receiver's peers (the senders it reads from), with the fake NIXL: reloads of a
sender's metadata never wait for other fetches, a peer waiting for its first metadata is
not idle, and dead, failed or idle peers go (or stay while NIXL may still hold them).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ray_rdt_pool.errors import (
    TransferError,
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
