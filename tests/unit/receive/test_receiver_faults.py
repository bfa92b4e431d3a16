"""Faults on the receiver's same-node and source-read paths, with the fake NIXL.

Sender and receiver run in this process (see tests/unit/same_node/test_same_node_logic.py for how);
the faults are injected where a real one would arise: the GCS lookup of a sender's
shared pool, the landing of a copy out of a mapping, a source-read bucket of which this
receiver takes nothing. Each checks the error's type and that nothing is left behind
(leases, arena blocks), through ``stats()``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ray_rdt_pool.errors import TransferError
from ray_rdt_pool.receive import mapped as mapped_mod
from ray_rdt_pool.same_node.peer_memory import this_process
from ray_rdt_pool.testing import World
from tests.support.fake_world import get, settle
from tests.support.fake_world import make_on_node as make


def test_a_failed_lookup_of_the_senders_pool_reads_with_nixl_and_asks_again(
        world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The GCS lookup of a same-node sender's pool ran outside the failure mapping: a
    GCS hiccup reached ray.get as a raw exception, although NIXL could read the
    object. Now it is read with NIXL, logged once, and the pool is asked for again later."""
    s, r = make(world), make(world)
    calls = []
    real = world.lookup_host

    def flaky(name: str) -> bytes | None:
        calls.append(name)
        if len(calls) <= 2:
            raise RuntimeError("GCS unreachable")  # what Ray's internal_kv raises varies
        return real(name)

    world.lookup_host = flaky  # type: ignore[method-assign]
    src = [torch.arange(1000, dtype=torch.float32)]
    with caplog.at_level(logging.DEBUG, logger="ray_rdt_pool.receive.mapped"):
        assert torch.equal(get(s, r, "a", src)[0], src[0])
        assert torch.equal(get(s, r, "b", src)[0], src[0])  # not asked again yet
    st = r.stats()
    assert (st.mapped_gets, st.reads_posted, st.transfer_errors) == (0, 2, 0)
    assert len(calls) == 1
    warned = [x for x in caplog.records if x.levelno == logging.WARNING
              and "GCS unreachable" in x.getMessage()]
    assert len(warned) == 1
    monkeypatch.setattr(mapped_mod, "HOST_RETRY_S", 0.0)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="ray_rdt_pool.receive.mapped"):
        r.receiver.mapped.host_retry[s.agent_name] = 0.0  # its retry time has come
        assert torch.equal(get(s, r, "c", src)[0], src[0])  # fails again: NIXL, quietly
    assert not [x for x in caplog.records if x.levelno >= logging.WARNING]
    assert torch.equal(get(s, r, "d", src)[0], src[0])  # the GCS answers: mapped
    st = r.stats()
    assert (st.mapped_gets, st.reads_posted, st.transfer_errors) == (1, 3, 0)
    assert len(calls) == 3


@pytest.mark.parametrize("mode", ["copy", "map-targets"])
def test_a_failure_after_the_lease_is_a_transfer_error_and_returns_the_lease(
        world: World, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A copy out of a mapping that fails (its landing cannot be allocated, a target
    cannot be written) used to reach ray.get as the raw exception. Now: TransferError,
    chained, counted, and the lease is back."""
    s = make(world)
    r = make(world, same_node="copy" if mode == "copy" else "map")
    src = [torch.arange(5000, dtype=torch.int64)]

    def boom(*_a, **_k):
        raise MemoryError("cannot allocate 40000 bytes")

    if mode == "copy":
        monkeypatch.setattr(r.receiver.landings, "local", boom)
        targets = None
    else:
        monkeypatch.setattr("ray_rdt_pool.memory.rebuild.unpack_into", boom)
        targets = [torch.empty_like(src[0])]
    with pytest.raises(TransferError, match="shared pool of same-node sender") as info:
        get(s, r, "a", src, targets=targets)
    assert isinstance(info.value.__cause__, MemoryError)
    assert s.sender.free("a")
    settle(r, s)
    st = r.stats()
    assert (st.transfer_errors, st.mapped_objects, st.mapped_bytes, st.arena_used) == (
        1, 0, 0, 0)
    assert s.stats().leased_objects == 0 and s.stats().pool_used == 0
    monkeypatch.undo()
    assert torch.equal(get(s, r, "b", src, targets=targets)[0], src[0])  # still works


@pytest.mark.parametrize("selection", [
    [(slice(0, 0), slice(0, 4)), (slice(0, 0),)],  # empty slices
    [(slice(0, 0),), (slice(7, 7),)],
])
def test_a_source_read_of_which_this_receiver_takes_nothing_is_empty_tensors(
        world: World, selection) -> None:
    """A receiver with ``select=`` on the trainer's node, and a bucket whose tensors it all
    maps to nothing: read_source asked the arena for 0 bytes, which raised an untyped
    ValueError ("not enough values to unpack") and left an allocator entry behind on
    every sync."""
    r = make(world, node="n1")
    me = this_process("n1")
    assert me is not None
    a, b = torch.randn(30, 4), torch.randn(50)
    spec = [(t.data_ptr(), tuple(t.shape), "float32") for t in (a, b)]
    for _ in range(3):
        out = r.receiver.sources.read(me, spec, selection)
        assert [tuple(o.shape) for o in out] == [(0, 4), (0,)]
        assert all(o.dtype == torch.float32 and o.numel() == 0 for o in out)
    st = r.stats()
    assert (st.arena_used, st.arena_live_blocks, st.transfer_errors) == (0, 0, 0)
    # The same receiver still reads a real selection.
    out = r.receiver.sources.read(me, spec, [(slice(1, 3),), None])
    assert torch.equal(out[0], a[1:3]) and torch.equal(out[1], b)
    del out
    settle(r)
    assert r.stats().arena_live_blocks == 0
