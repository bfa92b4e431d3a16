"""The receiver's registration cache, with the fake NIXL: it holds storages (not
pointers), evicts the least recently used, and never an entry in use.
"""

from __future__ import annotations

import torch

from tests.support.fake_world import (
    make,
    ship,
)


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
