"""Unit tests of the transport's logic above NIXL, with the in-process fake of tests.fakenixl.

These cover the failure paths that real NIXL makes hard to trigger on demand; the same
behaviours run end to end on real Ray and NIXL in test_transport.py and test_reliability.py.
"""

from __future__ import annotations

import gc
import pickle
import threading
import time

import pytest
import torch

from ray_rdt_pool import transport
from ray_rdt_pool.config import PoolConfig
from ray_rdt_pool.errors import InvalidInputError, TransferError, WireFormatError
from ray_rdt_pool.transport import PoolTransportMetadata, RegistrationCache, Runtime
from tests.fakenixl import World


@pytest.fixture()
def world() -> World:
    return World()


def make(world: World, **cfg) -> Runtime:
    cfg.setdefault("pool_bytes", 1 << 20)
    cfg.setdefault("arena_bytes", 1 << 20)
    cfg.setdefault("metrics", False)
    return Runtime(PoolConfig(**cfg), backend_factory=world.factory, directory=world)


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

    monkeypatch.setattr(transport, "pack_into", boom)
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


def test_zero_copy_tensors_mix_with_pooled_ones(world):
    s, r = make(world), make(world)
    big = torch.randn(256, 64)
    with s.lock:
        s.regs.pin(big)
        s._ensure_pool()
    ts = [big[i] for i in range(256)] + [torch.arange(5)]
    out = roundtrip(s, r, "z", ts)
    assert same(out, ts)
    st = s.stats()
    assert st.zero_copy_tensors == 256
    assert st.pool_used < 1024  # only the small tensor was copied
    assert len(s.put("z2", ts).decoded().segments) == 2


def test_aborted_read_releases_everything(world):
    s, r = make(world), make(world)
    world.mode = "PROC"
    meta = ship(s.put("a", [torch.randn(1000)]))
    req = r.fetch("a", meta, None)
    assert r.stats().transfers_in_flight == 1
    threading.Timer(0.05, r.abort, ("a",)).start()
    with pytest.raises(TransferError, match="aborted"):
        r.wait(req, -1)
    st = r.stats()
    assert st.transfers_in_flight == 0 and st.arena_used == 0 and st.transfer_errors == 1
    assert not r.backend().in_flight()


def test_stalled_read_times_out_with_the_right_error_type(world):
    s, r = make(world), make(world, fetch_timeout_s=0.2)
    world.mode = "PROC"
    meta = ship(s.put("a", [torch.randn(10)]))
    with pytest.raises(TimeoutError):
        r.wait(r.fetch("a", meta, None), 0.05)  # the caller's own, shorter timeout
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="fetch_timeout_s"):
        r.wait(r.fetch("a", meta, None), -1)
    assert time.monotonic() - t0 < 5
    st = r.stats()
    assert st.transfers_in_flight == 0 and st.arena_used == 0
    assert not r.backend().in_flight()


def test_failed_read_is_a_transfer_error(world):
    s, r = make(world), make(world)
    world.mode = "ERR"
    meta = ship(s.put("a", [torch.randn(10)]))
    with pytest.raises(TransferError, match="failed"):
        r.wait(r.fetch("a", meta, None), -1)
    assert r.stats().arena_used == 0


def test_remote_is_not_removed_while_a_read_from_it_is_in_flight(world):
    s, r = make(world, pool_bytes=1 << 20), make(world, arena_bytes=8 << 20)
    world.mode = "PROC"
    meta1 = ship(s.put("a", [torch.randn(10)]))
    req1 = r.fetch("a", meta1, None)  # in flight, never completes by itself
    # The sender registers and then drops a storage: receivers must reload its metadata.
    big = [torch.randn(1 << 19)]
    s.put("fb", big)
    s.free("fb")
    del big
    gc.collect()
    world.mode = "DONE"
    meta2 = ship(s.put("b", [torch.arange(3)]))
    assert meta2.decoded().agent_version > meta1.decoded().agent_version
    done = []
    t = threading.Thread(target=lambda: done.append(r.wait(r.fetch("b", meta2, None), -1)))
    t.start()
    time.sleep(0.2)
    assert not done  # waiting for the first READ to drain
    r.backend().complete(req1.xfer)
    r.wait(req1, -1)
    t.join(5)
    assert done and same(done[0], [torch.arange(3)])
    assert not world.violations
    assert s.agent_name in r.backend().removed


def test_registration_cache_is_keyed_by_extent_and_never_stale():
    regs: list[tuple[int, int]] = []
    dereg: list[int] = []

    def register(addr, n, mem, dev):
        regs.append((addr, n))
        return len(regs)

    cache = RegistrationCache(register, dereg.append)
    a = torch.empty(4096)
    e1, new1 = cache.acquire(a)
    e2, new2 = cache.acquire(a[10:20])  # a view of the same storage: same entry
    assert new1 and not new2 and e1 is e2
    addr = a.untyped_storage().data_ptr()
    del a, e1, e2
    gc.collect()
    cache.drain()
    assert dereg == [1] and len(cache) == 0
    b = torch.empty(2048)  # may well reuse the address, with another size
    _, new = cache.acquire(b)
    assert new and regs[-1] == (b.untyped_storage().data_ptr(), 2048 * 4)
    c = torch.empty(2048)
    if c.untyped_storage().data_ptr() == addr:
        assert cache.acquire(c)[1]


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
