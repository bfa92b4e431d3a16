"""The receiver's arena, with the fake NIXL: a block comes back when the views die, a warm
loop registers nothing, a full arena falls back to a one-off registered buffer, and reaps
racing for the last dropped READ raise nothing.
"""

from __future__ import annotations

import gc
import pickle

import torch

from tests.support.fake_world import (
    make,
    roundtrip,
    same,
)


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
