"""Target buffers (``set_target_for_ref``), with the fake NIXL: read in place once
registered, checked before any READ (shape, count, overlap, memory, conjugate and
negative views), and their blocks and registrations given back on every failure.
"""

from __future__ import annotations

import gc
import re

import pytest
import torch

from ray_rdt_pool.errors import (
    InvalidInputError,
    TransferError,
)
from ray_rdt_pool.memory import rebuild as rdt_rebuild
from tests.support.fake_world import (
    make,
    roundtrip,
    same,
    ship,
)


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
