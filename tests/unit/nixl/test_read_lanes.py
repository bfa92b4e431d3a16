"""Read lanes (ray_rdt_pool.nixl.lanes): the descriptor split, the composite handle of a split
READ, registrations and peers on every lane, the configuration, and the runtime's wiring.

Fast and without Ray: :class:`NixlBackend` runs here over :class:`FakeAgent`, a stand-in
for ``nixl_agent`` whose READs can be made to stall, fail, refuse cancels or raise, per
lane. The real-NIXL test (two processes, two lanes, byte-exact) is at the end.
"""

from __future__ import annotations

import ctypes
import itertools
import multiprocessing as mp
import os
import pickle
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.config import PoolConfig, Tuning, from_env
from ray_rdt_pool.errors import (
    ConfigurationError,
    ReadStillRunningError,
    RegistrationError,
    TransferError,
)
from ray_rdt_pool.nixl.backend import PROGRESS_HOLD_S, NixlBackend
from ray_rdt_pool.nixl.lanes import SPLIT_ALIGN, SplitRead, split_pairs
from ray_rdt_pool.testing import World

MIB = 1 << 20

# --------------------------------------------------------------------------- split_pairs


@st.composite
def desc_pairs(draw: Any) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    lengths = draw(st.lists(st.integers(0, 3 * SPLIT_ALIGN + 7), min_size=0, max_size=12))
    local, remote = [], []
    la, ra = 1 << 20, 1 << 40
    for n in lengths:
        la += draw(st.integers(0, 3))  # gaps: pairs need not be adjacent
        ra += draw(st.integers(0, 5))
        local.append((la, n, 0))
        remote.append((ra, n, 1))
        la += n
        ra += n
    return local, remote


def _stream(local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]]
            ) -> list[tuple[int, int]]:
    """Every byte as (local address, remote address), in stream order."""
    return [(la + i, ra + i) for (la, n, _), (ra, _m, _) in zip(local, remote) for i in range(n)]


@settings(max_examples=300, deadline=None)
@given(desc_pairs(), st.integers(1, 5), st.sampled_from([1, 64, SPLIT_ALIGN]))
def test_split_covers_every_byte_once_in_equal_pairs_and_balanced(pairs, parts, align):
    local, remote = pairs
    groups = split_pairs(local, remote, parts, align=align)
    total = sum(n for _a, n, _d in local)
    assert len(groups) <= parts
    pieces_l = [d for g in groups for d in g[0]]
    pieces_r = [d for g in groups for d in g[1]]
    for g_l, g_r in groups:
        assert g_l and len(g_l) == len(g_r)
        for (_la, n, ld), (_ra, m, rd) in zip(g_l, g_r):
            assert n == m and n > 0 and (ld, rd) == (0, 1)
    # Every byte exactly once, each paired with the same remote byte as before, in order.
    assert _stream(pieces_l, pieces_r) == _stream(local, remote)
    sizes = [sum(n for _a, n, _d in g[0]) for g in groups]
    assert sum(sizes) == total
    if total >= parts * align:
        assert len(groups) == parts
    if groups and len(groups) == parts:
        for s in sizes:
            assert abs(s - total / parts) <= align + 1, (sizes, total, parts, align)


def test_split_of_one_big_pair_cuts_at_page_multiples():
    groups = split_pairs([(4096, 10 * MIB + 100, 0)], [(1 << 30, 10 * MIB + 100, 0)], 2)
    assert [len(g[0]) for g in groups] == [1, 1]
    (a0, n0, _), (a1, n1, _) = groups[0][0][0], groups[1][0][0]
    assert n0 % SPLIT_ALIGN == 0 and a1 == a0 + n0 and n0 + n1 == 10 * MIB + 100
    assert groups[1][1][0][0] == (1 << 30) + n0


def test_split_rejects_unequal_pairs():
    with pytest.raises(ValueError, match="descriptor 1"):
        split_pairs([(0, 4, 0), (8, 4, 0)], [(0, 4, 0), (8, 5, 0)], 2)
    with pytest.raises(ValueError):
        split_pairs([(0, 4, 0)], [], 2)


# --------------------------------------------------------------------------- a fake agent


class _X:
    def __init__(self, local: list[Any], remote: list[Any], peer: str) -> None:
        self.local, self.remote, self.peer = local, remote, peer
        self.state = "PROC"
        self.released = False
        self.thread = threading.current_thread().name


class FakeAgent:
    """Just enough of ``nixl_agent`` for NixlBackend; bytes move by memmove.

    ``post``: what ``transfer()`` does: "DONE" (copy now), "PROC" (stall until
    :meth:`complete`), "ERR", or "raise". ``cancel``: whether releasing a stalled READ
    succeeds. ``state_raises``: ``check_xfer_state`` raises. ``release_raises``: every
    release raises. Every call checks that the lane's lock is held by the caller.
    """

    def __init__(self, name: str, hub: dict[str, FakeAgent]) -> None:
        self.name = name
        hub[name] = self
        self.backend: NixlBackend | None = None
        self.regs: dict[int, tuple[int, int]] = {}
        self.remotes: dict[str, int] = {}
        self.xfers: dict[int, _X] = {}
        self.ids = iter(range(1, 1 << 30))
        self.post = "DONE"
        self.cancel = False
        self.state_raises = False
        self.release_raises = False
        self.register_raises = False
        self.remove_raises = False
        self.notifs = 0
        self.destroyed = False

    def _locked(self) -> None:
        b = self.backend
        if b is not None:
            lane = next(ln for ln in b._lanes if ln.agent is self)
            assert lane.lock._is_owned(), f"{self.name} called without its lane's lock"

    def register_memory(self, reg: list[tuple[int, int, int, str]], mem: str) -> int:
        self._locked()
        if self.register_raises:
            raise RuntimeError("NIXL_ERR_BACKEND: register failed")
        h = next(self.ids)
        self.regs[h] = (reg[0][0], reg[0][1])
        return h

    def deregister_memory(self, h: int) -> None:
        self._locked()
        del self.regs[h]

    def get_agent_metadata(self) -> bytes:
        return f"md:{self.name}".encode()

    def add_remote_agent(self, md: bytes) -> bytes:
        self._locked()
        name = md.decode().split(":", 1)[1]
        self.remotes[name] = self.remotes.get(name, 0) + 1
        return name.encode()

    def remove_remote_agent(self, name: str) -> None:
        self._locked()
        if self.remove_raises or name not in self.remotes:
            raise RuntimeError(f"NIXL_ERR_NOT_FOUND: {name}")
        del self.remotes[name]
        for x in self.xfers.values():
            if x.peer == name and x.state == "PROC":
                x.state = "ERR"

    def get_xfer_descs(self, descs: Any, mem: str) -> list[tuple[int, int, int]]:
        return [tuple(int(v) for v in d) for d in descs]  # type: ignore[misc]

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str, msg: bytes) -> int:
        self._locked()
        assert op == "READ"
        if peer not in self.remotes:
            raise RuntimeError(f"NIXL_ERR_NOT_FOUND: remote agent {peer}")
        for a, n, _d in local:
            assert any(s <= a and a + n <= s + m for s, m in self.regs.values()), \
                f"{self.name}: local {a:#x}+{n} not registered here"
        h = next(self.ids)
        self.xfers[h] = _X(local, remote, peer)
        return h

    def transfer(self, h: int) -> str:
        self._locked()
        if self.post == "raise":  # an error status: the READ did not start
            self.xfers[h].state = "ERR"
            raise RuntimeError("NIXL_ERR_BACKEND: post failed")
        if self.post == "ERR":
            self.xfers[h].state = "ERR"
            return "ERR"
        if self.post == "DONE":
            self.complete(h)
            return "DONE"
        return "PROC"

    def complete(self, h: int) -> None:
        x = self.xfers[h]
        assert not x.released, "a released READ wrote"
        for (la, n, _), (ra, _m, _) in zip(x.local, x.remote):
            ctypes.memmove(la, ra, n)
        x.state = "DONE"

    def check_xfer_state(self, h: int) -> str:
        self._locked()
        x = self.xfers[h]
        assert not x.released, "state of a released handle"
        if self.state_raises:  # NIXL's binding raises for an error status: it ended
            x.state = "ERR"
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        return x.state

    def release_xfer_handle(self, h: int) -> None:
        self._locked()
        x = self.xfers[h]
        assert not x.released, "handle released twice"
        if self.release_raises:
            raise RuntimeError("NIXL_ERR_BACKEND: release failed")
        if x.state == "PROC":
            if not self.cancel:
                raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: cannot cancel")
            x.state = "CANCELLED"
        x.released = True

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.notifs += 1
        return {}

    def live(self) -> list[_X]:
        return [x for x in self.xfers.values() if not x.released]

    def __del__(self) -> None:
        self.destroyed = True


class Rig:
    """A NixlBackend over FakeAgents plus a source and a destination buffer."""

    def __init__(self, lanes: int = 2, nbytes: int = 16 * MIB, split_bytes: int = 8 * MIB,
                 post_timeout_s: float = 5.0) -> None:
        self.hub: dict[str, FakeAgent] = {}
        self.splits = 0

        def count() -> None:
            self.splits += 1

        def make(name: str) -> FakeAgent:
            a = FakeAgent(name, self.hub)
            a.backend = getattr(self, "b", None)
            return a

        self.b = NixlBackend("me", 0.002, lanes=lanes, split_bytes=split_bytes,
                             on_split=count, post_timeout_s=post_timeout_s,
                             agent_factory=make)
        self.hub["me"].backend = self.b
        assert list(self.hub) == ["me"]  # lanes 1.. wait for the first receive
        self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.reg = self.b.register(self.dst.data_ptr(), nbytes, "DRAM", 0, lanes=True)
        self.agents = [self.hub["me"]] + [self.hub[f"me-lane{k}"] for k in range(1, lanes)]
        assert self.b.load_remote(b"md:peer") == "peer"

    def descs(self, n: int | None = None, pieces: int = 3
              ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        n = self.dst.numel() if n is None else n
        step = -(-n // pieces)
        offs = range(0, n, step)
        return ([(self.dst.data_ptr() + o, min(step, n - o), 0) for o in offs],
                [(self.src.data_ptr() + o, min(step, n - o), 0) for o in offs])

    def read(self, n: int | None = None, split: bool = True) -> Any:
        local, remote = self.descs(n)
        return self.b.start_read(local, remote, "peer", "DRAM", "DRAM", split=split)

    def parts(self, h: SplitRead) -> list[tuple[FakeAgent, int]]:
        out = []
        for p in h.parts:
            agent = p.lane.agent
            hid = p.handle if p.handle is not None else None
            out.append((agent, hid))
        return out

    def close(self) -> None:
        self.b.close()


@pytest.fixture()
def rig():
    r = Rig()
    yield r
    r.close()


# --------------------------------------------------------------------------- posting


def test_large_read_is_split_over_both_lanes_and_lands_byte_exact(rig):
    h = rig.read()
    assert isinstance(h, SplitRead) and len(h.parts) == 2 and rig.splits == 1
    (a0, h0), (a1, h1) = rig.parts(h)
    assert (a0.name, a1.name) == ("me", "me-lane1")
    # Part 0 on the calling thread, part 1 on lane 1's own thread.
    assert a0.xfers[h0].thread == threading.current_thread().name
    assert a1.xfers[h1].thread == "ray_rdt_pool-lane1"
    bytes0 = sum(n for _a, n, _d in a0.xfers[h0].local)
    bytes1 = sum(n for _a, n, _d in a1.xfers[h1].local)
    assert bytes0 + bytes1 == 16 * MIB and abs(bytes0 - bytes1) <= 2 * 4096
    assert rig.b.state(h) == "DONE"
    rig.b.release(h)
    assert torch.equal(rig.dst, rig.src)
    assert not a0.live() and not a1.live()
    # The worker thread is reused, not started per READ.
    names = [t.name for t in threading.enumerate()].count("ray_rdt_pool-lane1")
    rig.b.release(rig.read())
    assert [t.name for t in threading.enumerate()].count("ray_rdt_pool-lane1") == names == 1


def test_small_or_unsplittable_reads_stay_on_lane_zero(rig):
    for h in (rig.read(n=8 * MIB - 1), rig.read(split=False)):
        assert not isinstance(h, SplitRead)
        assert h in rig.agents[0].xfers and not rig.agents[1].xfers
        assert rig.b.state(h) == "DONE"
        rig.b.release(h)
    assert rig.splits == 0
    assert not [t for t in threading.enumerate() if t.name == "ray_rdt_pool-lane1"]
    one = Rig(lanes=1)
    try:
        assert not isinstance(one.read(), SplitRead) and one.splits == 0
    finally:
        one.close()


def test_three_lanes_split_in_three():
    r = Rig(lanes=3, nbytes=24 * MIB)
    try:
        h = r.read()
        assert [p.lane.index for p in h.parts] == [0, 1, 2]
        assert r.b.state(h) == "DONE"
        r.b.release(h)
        assert torch.equal(r.dst, r.src)
    finally:
        r.close()


# --------------------------------------------------------------------------- state


def test_state_is_proc_until_every_part_is_done(rig):
    rig.agents[1].post = "PROC"
    h = rig.read()
    (a0, h0), (a1, h1) = rig.parts(h)
    assert a0.xfers[h0].state == "DONE"
    assert rig.b.state(h) == "PROC"
    a1.complete(h1)
    assert rig.b.state(h) == "DONE"
    rig.b.release(h)
    assert torch.equal(rig.dst, rig.src)


def test_a_failed_part_with_another_running_waits_for_it_when_it_cannot_be_cancelled(rig):
    rig.agents[0].post = "PROC"
    rig.agents[1].post = "PROC"
    h = rig.read()
    (a0, h0), (a1, h1) = rig.parts(h)
    a0.xfers[h0].state = "ERR"
    # ERR would tell the receiver that nothing writes any more: not while part 1 runs.
    assert rig.b.state(h) == "PROC"
    a1.complete(h1)
    assert rig.b.state(h) == "ERR"
    rig.b.release(h)
    assert not a0.live() and not a1.live()


def test_a_failed_part_cancels_the_others_where_nixl_can(rig):
    for a in rig.agents:
        a.post, a.cancel = "PROC", True
    h = rig.read()
    (a0, h0), (a1, h1) = rig.parts(h)
    a1.xfers[h1].state = "ERR"
    assert rig.b.state(h) == "ERR"
    assert a0.xfers[h0].state == "CANCELLED" and a0.xfers[h0].released
    rig.b.release(h)  # releases the ERR part; the cancelled one is not touched again
    assert not a0.live() and not a1.live()


def test_a_part_whose_state_raises_counts_as_err(rig):
    rig.agents[1].post = "PROC"
    h = rig.read()
    rig.agents[1].state_raises = True
    assert rig.b.state(h) == "ERR"
    rig.agents[1].state_raises = False
    rig.b.release(h)


# --------------------------------------------------------------------------- release


def test_release_tries_every_part_and_a_refused_part_stays_pollable(rig):
    for a in rig.agents:
        a.post = "PROC"
    h = rig.read()
    (a0, h0), (a1, h1) = rig.parts(h)
    rig.agents[0].cancel = True  # lane 0 cancels, lane 1 cannot
    with pytest.raises(RuntimeError, match="cannot cancel"):
        rig.b.release(h)
    assert a0.xfers[h0].released and a0.xfers[h0].state == "CANCELLED"
    assert not a1.xfers[h1].released
    # The caller polls it until it ends: only part 1 is asked.
    assert rig.b.state(h) == "PROC"
    a1.complete(h1)
    assert rig.b.state(h) == "ERR"  # one part was cancelled: not a whole READ
    rig.b.release(h)
    assert not a0.live() and not a1.live()


def test_release_errors_on_ended_parts_are_raised_after_trying_all(rig):
    h = rig.read()
    assert rig.b.state(h) == "DONE"
    rig.agents[0].release_raises = True
    with pytest.raises(RuntimeError, match="release failed"):
        rig.b.release(h)
    assert not rig.agents[1].live() and len(rig.agents[0].live()) == 1
    rig.agents[0].release_raises = False
    assert rig.b.state(h) == "DONE"
    rig.b.release(h)
    assert not rig.agents[0].live()


# --------------------------------------------------------------------------- post failures


@pytest.mark.parametrize("failing,how", [(1, "raise"), (1, "ERR"), (0, "raise"), (0, "ERR")])
def test_a_part_that_fails_to_post_releases_the_others_before_raising(rig, failing, how):
    rig.agents[failing].post = how
    with pytest.raises((RuntimeError, TransferError)):
        rig.read()
    assert not rig.agents[0].live() and not rig.agents[1].live()
    assert rig.splits == 0
    rig.agents[failing].post = "DONE"
    h = rig.read()  # the lanes still work
    assert rig.b.state(h) == "DONE"
    rig.b.release(h)


def test_a_posted_part_that_cannot_be_cancelled_is_waited_for_before_raising(rig):
    rig.agents[0].post = "PROC"  # posted, running, and NIXL cannot cancel it
    rig.agents[1].post = "raise"
    a0 = rig.agents[0]

    def finish_later() -> None:
        time.sleep(0.2)
        for h, x in list(a0.xfers.items()):
            if x.state == "PROC":
                with rig.b._lanes[0].lock:
                    a0.complete(h)

    t = threading.Thread(target=finish_later)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="post failed"):
        rig.read()
    t.join()
    assert time.monotonic() - t0 >= 0.15  # it waited for the running part
    assert not a0.live()


def test_a_posted_part_that_never_ends_is_cut_off_after_the_post_timeout():
    r = Rig(post_timeout_s=0.2)
    try:
        r.agents[1].post = "PROC"
        r.agents[0].post = "raise"
        with pytest.raises(RuntimeError, match="post failed"):
            r.read()
        # Lane 1 lost the peer (the cut); lane 0 still has it.
        assert "peer" not in r.agents[1].remotes and "peer" in r.agents[0].remotes
        assert not r.agents[1].live()
    finally:
        r.close()


@pytest.mark.parametrize("stuck,failing", [(1, 0), (0, 1)])
def test_a_part_that_can_be_neither_cut_off_nor_cancelled_is_handed_back(stuck, failing):
    """The cut-off by removing the agent can fail too (NIXL raising on remove). The part
    may then still write, so start_read must not claim that nothing does: it raises
    ReadStillRunningError holding the part, which stays pollable until NIXL ends it."""
    r = Rig(post_timeout_s=0.1)
    try:
        r.agents[stuck].post = "PROC"
        r.agents[stuck].remove_raises = True
        r.agents[failing].post = "raise"
        with pytest.raises(ReadStillRunningError, match="may still write") as info:
            r.read()
        assert isinstance(info.value, TransferError)
        assert "post failed" in str(info.value.__cause__)
        running = info.value.running
        assert isinstance(running, SplitRead)
        assert [p.lane.agent for p in running.parts] == [r.agents[stuck]]
        assert len(r.agents[stuck].live()) == 1 and not r.agents[failing].live()
        assert r.b.state(running) == "PROC"
        (h,) = [h for h, x in r.agents[stuck].xfers.items() if not x.released]
        with r.b._lanes[stuck].lock:
            r.agents[stuck].complete(h)  # the late write lands; then it has ended
        assert r.b.state(running) == "DONE"
        r.b.release(running)
        assert not r.agents[stuck].live()
        e = pickle.loads(pickle.dumps(ReadStillRunningError("m")))
        assert isinstance(e, ReadStillRunningError) and e.running is None
    finally:
        r.close()


def test_a_single_lane_read_that_cannot_be_stopped_is_handed_back():
    r = Rig(lanes=1, post_timeout_s=0.1)
    try:
        a = r.agents[0]
        a.post, a.remove_raises = "PROC", True
        # transfer() says PROC; make the post itself fail after starting the READ:
        # NIXL returning ERR for a READ it cannot tell is not running.
        real = a.transfer

        def started_then_failed(h: int) -> str:
            real(h)
            raise RuntimeError("NIXL_ERR_BACKEND: post failed")
        a.transfer = started_then_failed  # type: ignore[method-assign]
        with pytest.raises(ReadStillRunningError) as info:
            r.read(split=False)
        assert r.b.state(info.value.running) == "PROC" and len(a.live()) == 1
    finally:
        r.close()


# --------------------------------------------------------------------------- registrations, peers


def test_lane_registration_covers_every_lane_and_deregisters_everywhere(rig):
    assert all(len(a.regs) == 1 for a in rig.agents)
    plain = rig.b.register(rig.src.data_ptr(), 4096, "DRAM", 0)
    assert len(rig.agents[0].regs) == 2 and len(rig.agents[1].regs) == 1
    rig.b.deregister(plain)
    rig.b.deregister(rig.reg)
    assert not rig.agents[0].regs and not rig.agents[1].regs


def test_a_lane_refusing_a_registration_rolls_back_the_others(rig):
    rig.agents[1].register_raises = True
    with pytest.raises(RegistrationError, match="read lane 1"):
        rig.b.register(rig.src.data_ptr(), 4096, "DRAM", 0, lanes=True)
    assert len(rig.agents[0].regs) == 1 and len(rig.agents[1].regs) == 1  # only rig.reg


def test_peers_are_loaded_into_and_removed_from_every_lane(rig):
    assert all(a.remotes == {"peer": 1} for a in rig.agents)
    rig.b.load_remote(b"md:peer")  # a reload merges on every lane
    assert all(a.remotes == {"peer": 2} for a in rig.agents)
    rig.agents[0].remove_raises = True
    with pytest.raises(RuntimeError, match="NOT_FOUND"):
        rig.b.remove_remote("peer")
    assert "peer" not in rig.agents[1].remotes  # lane 0's failure did not skip lane 1
    rig.agents[0].remove_raises = False
    with pytest.raises(RuntimeError, match="NOT_FOUND"):
        rig.b.remove_remote("peer")  # lane 1 has it no more: reported, lane 0 still done
    assert all(not a.remotes for a in rig.agents)
    assert rig.b.metadata() == b"md:me"


def test_close_stops_the_lane_threads_and_destroys_every_agent():
    r = Rig()
    r.b.release(r.read())
    assert any(t.name == "ray_rdt_pool-lane1" for t in threading.enumerate())
    agents = list(r.agents)
    r.close()
    r.close()  # twice is fine
    assert not any(t.name == "ray_rdt_pool-lane1" and t.is_alive()
                   for t in threading.enumerate())
    assert all(ln.agent is None for ln in r.b._lanes)
    assert agents[0].notifs > 0  # the progress thread progressed lane 0 ...
    assert agents[1].notifs == 0  # ... and only lane 0


def test_lanes_are_made_on_first_receive_only():
    hub: dict[str, FakeAgent] = {}
    b = NixlBackend("s", 0.01, lanes=2, agent_factory=lambda n: FakeAgent(n, hub))
    try:
        buf = torch.zeros(4096, dtype=torch.uint8)
        h = b.register(buf.data_ptr(), 4096, "DRAM", 0)  # a sender's pool: lane 0 only
        assert b.lanes == 1 and list(hub) == ["s"]
        b.load_remote(b"md:peer")  # first use as a receiver
        assert b.lanes == 2 and hub["s-lane1"].remotes == {"peer": 1}
        assert not hub["s-lane1"].regs  # lane 0's earlier registration stays lane 0's
        b.deregister(h)
    finally:
        b.close()


def test_deregistering_after_close_is_a_no_op():
    """A region freed after shutdown() destroyed the agents (Ray frees its last object
    later, or a free races the shutdown) is deregistered through a closed backend: that
    raised AttributeError on the missing agent, and the registry logged a WARNING and
    kept the memory for good. Destroying an agent dropped its registrations already."""
    hub: dict[str, FakeAgent] = {}
    b = NixlBackend("s", 0.01, lanes=2, agent_factory=lambda n: FakeAgent(n, hub))
    buf = torch.zeros(8192, dtype=torch.uint8)
    one = b.register(buf.data_ptr(), 4096, "DRAM", 0)
    both = b.register(buf.data_ptr() + 4096, 4096, "DRAM", 0, lanes=True)
    b.close()
    b.deregister(one)
    b.deregister(both)


def test_a_lane_that_cannot_be_created_leaves_fewer_lanes(caplog):
    def factory(name: str) -> FakeAgent:
        if name.endswith("lane1"):
            raise RuntimeError("no UCX context")
        return FakeAgent(name, {})

    b = NixlBackend("solo", 0.01, lanes=2, agent_factory=factory)
    try:
        assert b.load_remote(b"md:peer") == "peer"
        assert b.lanes == 1
        assert "using 1 lane" in caplog.text
    finally:
        b.close()


# --------------------------------------------------------------------------- configuration


def test_config_read_lanes_and_split_bytes():
    c = PoolConfig().tuning
    assert c.read_lanes == 0 and c.read_split_bytes == 8 * MIB
    assert c.read_lane_count == max(1, min(os.cpu_count() or 1, 2))
    assert Tuning(read_lanes=3).read_lane_count == 3
    assert Tuning(read_lanes=1).read_lane_count == 1
    for bad in (-1, 17, 1.5, True, "2"):
        with pytest.raises(ConfigurationError, match="read_lanes=2"):
            Tuning(read_lanes=bad)
    for bad in (0, -5, True, 2.0):
        with pytest.raises(ConfigurationError, match="read_split_bytes=8 << 20"):
            Tuning(read_split_bytes=bad)
    env = from_env({"RAY_RDT_POOL_READ_LANES": "2", "RAY_RDT_POOL_READ_SPLIT_BYTES": "4M"})
    assert (env.tuning.read_lanes, env.tuning.read_split_bytes) == (2, 4 * MIB)
    with pytest.raises(ConfigurationError):
        from_env({"RAY_RDT_POOL_READ_LANES": "99"})


def test_progress_is_fast_after_a_put_and_slow_when_idle():
    """A peer's first READ needs the sender's progress calls (the handshake), later ones
    do not: the thread progresses every interval_s for PROGRESS_HOLD_S after active()
    (what a put calls) and every idle_interval_s otherwise, and active() cuts an idle
    sleep short. Counted in progress calls, with wide margins (2 ms against 1 s)."""
    hub: dict[str, FakeAgent] = {}
    b = NixlBackend("quiet", 0.002, idle_interval_s=1.0,
                    agent_factory=lambda n: FakeAgent(n, hub))
    a = hub["quiet"]

    def calls_within(seconds: float) -> int:
        n0 = a.notifs
        time.sleep(seconds)
        return a.notifs - n0

    try:
        after_start = calls_within(0.4)  # the hold starts with the agent
        time.sleep(PROGRESS_HOLD_S)
        idle = calls_within(1.5)  # 1 or 2 calls at 1 s (0.1 s would give 15)
        b.active()
        woken = calls_within(0.3)  # without the wake-up: none until the idle sleep ends
        fast = calls_within(0.3)
        assert idle <= 3, idle
        assert min(after_start, woken, fast) >= 10, (after_start, woken, fast)
        time.sleep(PROGRESS_HOLD_S + 0.1)
        assert calls_within(1.5) <= 3  # slow again once the hold has passed
        t0 = time.monotonic()
    finally:
        b.close()
    assert time.monotonic() - t0 < 0.9  # close() wakes an idle sleep too


def test_puts_keep_progress_fast_and_the_config_reaches_the_backend():
    world, made = World(), []

    def factory(*args: Any, **kw: Any) -> Any:
        made.append(kw)
        b = world.factory(*args, **kw)
        b.active = lambda: made.append("active")  # type: ignore[attr-defined]
        return b

    rt = Runtime(PoolConfig(pool_bytes=4 * MIB, arena_bytes=4 * MIB, metrics=False,
                            tuning=Tuning(progress_idle_interval_s=0.04)),
                 backend_factory=factory, directory=world)
    rt.put("a", [torch.ones(8)])
    rt.put("b", [torch.ones(8)])
    assert made[0]["idle_interval_s"] == 0.04 and made[1:] == ["active", "active"]
    rt.shutdown()


def test_config_progress_idle_interval():
    assert Tuning().progress_idle_interval_s == 0.02
    assert Tuning(progress_idle_interval_s=0.005).progress_idle_interval_s == 0.005
    for bad in (0.001, 1.5):  # below progress_interval_s (0.005), above 1 s
        with pytest.raises(ConfigurationError, match=r"progress_idle_interval_s=0\.02"):
            Tuning(progress_idle_interval_s=bad)
    env = from_env({"RAY_RDT_POOL_PROGRESS_IDLE_INTERVAL_S": "0.1"})
    assert env.tuning.progress_idle_interval_s == 0.1
    with pytest.raises(ConfigurationError):
        from_env({"RAY_RDT_POOL_PROGRESS_IDLE_INTERVAL_S": "0"})


# --------------------------------------------------------------------------- the runtime's wiring


def _runtime(world: World, **cfg: Any) -> Runtime:
    cfg.setdefault("pool_bytes", 32 * MIB)
    cfg.setdefault("arena_bytes", 32 * MIB)
    cfg.setdefault("metrics", False)
    return Runtime(PoolConfig().with_overrides(**cfg), backend_factory=world.factory,
                   directory=world)


def test_runtime_splits_arena_reads_only_and_counts_them():
    world = World()
    s, r = _runtime(world), _runtime(world, read_lanes=2, read_split_bytes=1 * MIB)
    big = [torch.randn(MIB // 2)]  # 2 MiB
    small = [torch.randn(1000)]
    for i, ts in enumerate((big, small)):
        meta = pickle.loads(pickle.dumps(s.put(f"o{i}", ts)))
        out = r.wait(r.fetch(f"o{i}", meta, None), -1)
        assert torch.equal(out[0], ts[0])
    assert r.backend().lanes == 2 and r.stats().split_reads == 1
    assert r.stats().nixl_registrations == 1  # the arena, once, on every lane
    # Target buffers seen once land in the arena (split) and are copied out; from the
    # second sighting on they are read into directly (lane 0 only: not split).
    meta = pickle.loads(pickle.dumps(s.put("t", big)))
    tgt = [torch.empty_like(big[0])]
    r.wait(r.fetch("t", meta, tgt), -1)
    assert torch.equal(tgt[0], big[0]) and r.stats().split_reads == 2
    tgt[0].zero_()
    r.wait(r.fetch("t", meta, tgt), -1)
    assert torch.equal(tgt[0], big[0]) and r.stats().split_reads == 2
    # A one-off buffer (arena full) is not split either.
    huge = [torch.randn(40 * MIB // 4)]
    meta = pickle.loads(pickle.dumps(s.put("h", huge)))
    assert torch.equal(r.wait(r.fetch("h", meta, None), -1)[0], huge[0])
    st = r.stats()
    assert st.receive_fallbacks == 1 and st.split_reads == 2
    assert not world.violations
    one = _runtime(world, read_lanes=1, read_split_bytes=1 * MIB)
    meta = pickle.loads(pickle.dumps(s.put("z", big)))
    one.wait(one.fetch("z", meta, None), -1)
    assert one.backend().lanes == 1 and one.stats().split_reads == 0


# --------------------------------------------------------------------------- real NIXL


def _nixl_sender(conn: Any, nbytes: int) -> None:
    """Sender process: a one-lane backend with a registered source buffer. It has sent
    nothing for longer than PROGRESS_HOLD_S when the receiver connects, so every lane's
    handshake runs against its slow, idle progress interval."""
    from ray_rdt_pool.nixl.backend import NixlBackend

    b = NixlBackend(f"lanes-src-{os.getpid()}", 0.002, idle_interval_s=0.05)
    g = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    b.register(src.data_ptr(), nbytes, "DRAM", 0)
    time.sleep(PROGRESS_HOLD_S + 0.3)
    conn.send((b.metadata(), src.data_ptr()))
    conn.recv()  # its own progress thread handles the handshakes meanwhile
    b.close()


def _have_nixl() -> bool:
    try:
        import nixl._api  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _have_nixl(), reason="NIXL is not installed")
def test_two_real_lanes_read_byte_exact_between_two_processes():
    nbytes = 24 * MIB + 4096 + 123
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nixl_sender, args=(child, nbytes), daemon=True)
    proc.start()
    splits: list[int] = []
    b = NixlBackend(f"lanes-dst-{os.getpid()}", 0.002, lanes=2, split_bytes=8 * MIB,
                    on_split=lambda: splits.append(1))
    try:
        assert b.lanes == 1  # lanes 1.. come with the first receive
        # An arena-like region: one mapping, registered with both lanes, read at an offset.
        arena = torch.zeros(nbytes + 8192, dtype=torch.uint8)
        reg = b.register(arena.data_ptr(), arena.numel(), "DRAM", 0, lanes=True)
        assert b.lanes == 2
        assert parent.poll(120), "sender did not start"
        md, src_addr = parent.recv()
        peer = b.load_remote(md)
        g = torch.Generator().manual_seed(7)
        expected = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        base = arena.data_ptr() + 4096
        # Three segments with a hole on the remote side, as a fragmented object has.
        cuts = [0, 5 * MIB + 17, 17 * MIB, nbytes]
        local = [(base + a, b_ - a, 0) for a, b_ in itertools.pairwise(cuts)]
        remote = [(src_addr + a, b_ - a, 0) for a, b_ in itertools.pairwise(cuts)]
        for rep in range(3):
            arena.zero_()
            h = b.start_read(local, remote, peer, "DRAM", "DRAM", split=True)
            assert isinstance(h, SplitRead) and len(h.parts) == 2
            deadline = time.monotonic() + 60
            while (state := b.state(h)) == "PROC":
                assert time.monotonic() < deadline, "split READ did not finish"
                time.sleep(0.001)
            assert state == "DONE", (rep, h)
            b.release(h)
            view = arena[4096:4096 + nbytes]
            assert torch.equal(view, expected), f"rep {rep}: bytes differ"
            assert int(arena[:4096].sum()) == 0 and int(arena[4096 + nbytes:].sum()) == 0
        assert len(splits) == 3
        b.remove_remote(peer)
        b.deregister(reg)
    finally:
        b.close()
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("cancel", [True, False], ids=["cancelled", "cannot-cancel"])
def test_a_ctrl_c_as_the_post_returns_unwinds_the_read_it_started(cancel):
    """A KeyboardInterrupt raised as transfer() returned (the user's Ctrl-C during the
    post) passed `except Exception` with the READ running, neither released nor handed
    back: the receiver took it for "nothing posted" and gave the landing to the next
    object, which the READ then overwrote."""
    r = Rig(lanes=1, post_timeout_s=0.1)
    try:
        a = r.agents[0]
        a.post, a.cancel, a.remove_raises = "PROC", cancel, not cancel
        real = a.transfer

        def interrupted(h: int) -> str:
            real(h)
            raise KeyboardInterrupt
        a.transfer = interrupted  # type: ignore[method-assign]
        if cancel:
            with pytest.raises(KeyboardInterrupt):
                r.read(split=False)
            assert not a.live() and [x.state for x in a.xfers.values()] == ["CANCELLED"]
        else:
            with pytest.raises(ReadStillRunningError) as info:
                r.read(split=False)
            assert isinstance(info.value.__cause__, KeyboardInterrupt)
            assert r.b.state(info.value.running) == "PROC" and len(a.live()) == 1
    finally:
        r.close()
