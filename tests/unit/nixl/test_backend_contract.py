"""The fake NIXL (ray_rdt_pool.testing) and real NIXL answer the same checks.

Each test runs once on :class:`FakeBackend` and once on :class:`NixlBackend` (agents in
this process, host memory, UCX), so the fake cannot drift from what real NIXL does on
the paths the owners take: register, metadata, load_remote, start_read, state, release,
remove_remote, deregister, the merged view a reload makes, and split READs.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ray_rdt_pool.testing import World

KIB = 1 << 10


def _have_nixl() -> bool:
    try:
        import nixl._api  # noqa: F401
    except Exception:
        return False
    return True


class Agents:
    """Backends of one kind for one test, closed after it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.world = World()
        self.made: list[Any] = []

    def make(self, **kw: Any) -> Any:
        name = f"contract-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if self.kind == "fake":
            b = self.world.factory(name, 0.002, **kw)
        else:
            from ray_rdt_pool.nixl.backend import NixlBackend

            b = NixlBackend(name, 0.002, **kw)
        self.made.append(b)
        return b

    def close(self) -> None:
        for b in reversed(self.made):
            b.close()


@pytest.fixture(params=["fake", pytest.param("nixl", marks=pytest.mark.skipif(
    not _have_nixl(), reason="NIXL is not installed"))])
def agents(request: pytest.FixtureRequest) -> Iterator[Agents]:
    a = Agents(request.param)
    try:
        yield a
    finally:
        a.close()


def _host(n: int, fill: int | None = None) -> torch.Tensor:
    if fill is None:
        return torch.randint(0, 256, (n,), dtype=torch.uint8)
    return torch.full((n,), fill, dtype=torch.uint8)


def _read(b: Any, peer: str, dst: torch.Tensor, src: torch.Tensor, n: int,
          split: bool = False) -> str:
    """READ ``n`` bytes of ``src`` into ``dst``; the state it ended in (released)."""
    h = b.start_read([(dst.data_ptr(), n, 0)], [(src.data_ptr(), n, 0)], peer, "DRAM",
                     "DRAM", split=split)
    deadline = time.monotonic() + 30
    while (state := b.state(h)) == "PROC":
        assert time.monotonic() < deadline, "the READ did not end"
        time.sleep(0.001)
    assert b.state(h) == state  # an ended READ stays ended until released
    b.release(h)
    return str(state)


def _not_found(fn: Callable[[], Any]) -> None:
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
        fn()


def test_a_read_round_trip(agents: Agents) -> None:
    a, b = agents.make(), agents.make()
    src, dst = _host(64 * KIB), _host(64 * KIB, 0)
    ra = a.register(src.data_ptr(), src.numel(), "DRAM", 0)
    rb = b.register(dst.data_ptr(), dst.numel(), "DRAM", 0)
    md = a.metadata()
    assert isinstance(md, bytes) and md
    peer = b.load_remote(md)
    assert peer == a.name
    assert _read(b, peer, dst, src, 64 * KIB) == "DONE"
    assert torch.equal(dst, src)
    b.remove_remote(peer)
    b.deregister(rb)
    a.deregister(ra)
    assert not agents.world.violations


def test_a_read_sees_only_what_was_loaded_and_a_reload_merges(agents: Agents) -> None:
    a, b = agents.make(), agents.make()
    s1, s2, dst = _host(16 * KIB), _host(16 * KIB), _host(16 * KIB, 0)
    a.register(s1.data_ptr(), s1.numel(), "DRAM", 0)
    b.register(dst.data_ptr(), dst.numel(), "DRAM", 0)
    _not_found(lambda: b.start_read([(dst.data_ptr(), 4 * KIB, 0)],
                                    [(s1.data_ptr(), 4 * KIB, 0)], a.name, "DRAM", "DRAM"))
    peer = b.load_remote(a.metadata())
    # Past the end of the remote registration.
    _not_found(lambda: b.start_read([(dst.data_ptr(), 4 * KIB, 0)],
                                    [(s1.data_ptr() + 14 * KIB, 4 * KIB, 0)], peer, "DRAM",
                                    "DRAM"))
    # Registered after the peer's metadata was loaded: not in the view until a reload.
    a.register(s2.data_ptr(), s2.numel(), "DRAM", 0)
    _not_found(lambda: b.start_read([(dst.data_ptr(), 4 * KIB, 0)],
                                    [(s2.data_ptr(), 4 * KIB, 0)], peer, "DRAM", "DRAM"))
    assert b.load_remote(a.metadata()) == peer
    for src in (s1, s2):  # the reload kept the first section and added the second
        dst.zero_()
        assert _read(b, peer, dst, src, 16 * KIB) == "DONE"
        assert torch.equal(dst, src)
    assert not agents.world.violations


def test_a_deregistered_section_stays_in_a_peers_view_until_removed(agents: Agents) -> None:
    a, b = agents.make(), agents.make()
    src, dst = _host(16 * KIB), _host(16 * KIB, 0)
    ra = a.register(src.data_ptr(), src.numel(), "DRAM", 0)
    b.register(dst.data_ptr(), dst.numel(), "DRAM", 0)
    peer = b.load_remote(a.metadata())
    a.deregister(ra)
    b.load_remote(a.metadata())  # merges: the old section is not dropped
    assert _read(b, peer, dst, src, 4 * KIB) == "DONE"
    # Real NIXL reads the stale section; the fake reads it too and reports the owners'
    # mistake, which they must never make.
    assert bool(agents.world.violations) == (agents.kind == "fake")
    b.remove_remote(peer)
    b.load_remote(a.metadata())
    _not_found(lambda: b.start_read([(dst.data_ptr(), 4 * KIB, 0)],
                                    [(src.data_ptr(), 4 * KIB, 0)], peer, "DRAM", "DRAM"))


def test_a_removed_peer_is_read_no_more(agents: Agents) -> None:
    a, b = agents.make(), agents.make()
    src, dst = _host(16 * KIB), _host(16 * KIB, 0)
    a.register(src.data_ptr(), src.numel(), "DRAM", 0)
    b.register(dst.data_ptr(), dst.numel(), "DRAM", 0)
    peer = b.load_remote(a.metadata())
    assert _read(b, peer, dst, src, 16 * KIB) == "DONE"
    b.remove_remote(peer)
    _not_found(lambda: b.start_read([(dst.data_ptr(), 4 * KIB, 0)],
                                    [(src.data_ptr(), 4 * KIB, 0)], peer, "DRAM", "DRAM"))
    assert not agents.world.violations


def test_split_reads_are_decided_alike(agents: Agents) -> None:
    """A READ is split (``on_split``) only with ``split=True`` into memory registered
    with every lane, and only from ``split_bytes`` up; either way every byte lands."""
    splits: list[int] = []
    a = agents.make()
    b = agents.make(lanes=2, split_bytes=64 * KIB, on_split=lambda: splits.append(1))
    src, dst = _host(256 * KIB), _host(256 * KIB, 0)
    a.register(src.data_ptr(), src.numel(), "DRAM", 0)
    b.register(dst.data_ptr(), dst.numel(), "DRAM", 0, lanes=True)
    peer = b.load_remote(a.metadata())
    assert _read(b, peer, dst, src, 256 * KIB, split=True) == "DONE"
    assert torch.equal(dst, src) and len(splits) == 1
    dst.zero_()
    assert _read(b, peer, dst, src, 256 * KIB) == "DONE"  # not asked to split
    assert _read(b, peer, dst, src, 32 * KIB, split=True) == "DONE"  # below split_bytes
    assert torch.equal(dst, src) and len(splits) == 1
    assert not agents.world.violations


def test_a_tick_runs_with_the_progress_step(agents: Agents) -> None:
    b = agents.make()
    ran: list[int] = []
    b.add_tick(lambda: ran.append(1))
    if agents.kind == "fake":
        b.tick()  # the fake has no progress thread: the test steps it
    deadline = time.monotonic() + 10
    while not ran:
        assert time.monotonic() < deadline, "the tick never ran"
        time.sleep(0.005)


def test_the_documented_example_runs() -> None:
    """ray_rdt_pool.testing's example (the owners over the fake) does what it says."""
    import doctest

    import ray_rdt_pool.testing

    result = doctest.testmod(ray_rdt_pool.testing, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
