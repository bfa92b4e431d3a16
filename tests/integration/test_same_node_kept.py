"""Same-node receivers that keep many objects (a replay buffer, a cache actor), on a real
Ray cluster with real NIXL.

The module's actors run on the test process's shared cluster (one Ray node), with
``same_node="map"`` (``ENV``). The objects are put
with ``put_owned`` and freed with ``free_owned`` (the same pool, placement, mapping and
lease path as ``ray.put`` and Ray's free, without 20,000 Ray objects to make and collect,
which takes minutes on a small machine). Checked: a sender holding back thousands of
blocks for a receiver's views stays idle (CPU seconds of its process, not wall time), a
receiver's mappings do not grow with the objects it keeps, and pages a receiver wrote
never show through when the block holds the next object.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import ray
import torch

import ray_rdt_pool
from tests.support import actors
from tests.support.raycluster import actor_env, call, wait_drained, wait_for

pytestmark = pytest.mark.ray

ray_rdt_pool.register()


#: The module's actors' settings.
ENV = {"RAY_RDT_POOL_POOL_BYTES": "128M", "RAY_RDT_POOL_ARENA_BYTES": "16M",
       "RAY_RDT_POOL_SAME_NODE": "map"}


@pytest.fixture(scope="module", autouse=True)
def cluster(ray_cluster):
    yield


@ray.remote(enable_tensor_transport=True, runtime_env=actor_env(ENV))
class Sender(actors.Sender):
    def put_many(self, prefix: str, n: int, fill: int | None = None, size: int = 4):
        """``n`` small objects in one call; their wire bytes, and the pool offset of each."""
        from ray_rdt_pool._ray.owned import put_owned
        from ray_rdt_pool._ray.runtime import runtime

        wires, offsets = [], []
        for i in range(n):
            wire, _dev = put_owned(f"{prefix}{i}", [torch.full(
                (size,), i if fill is None else fill, dtype=torch.int32)])
            wires.append(wire)
            offsets.append(runtime().sender.sent[f"{prefix}{i}"].blocks[0][0])
        return wires, offsets

    def free_many(self, prefix: str, n: int) -> int:
        from ray_rdt_pool._ray.owned import free_owned

        return sum(free_owned(f"{prefix}{i}") for i in range(n))


@ray.remote(enable_tensor_transport=True, runtime_env=actor_env(ENV))
class Receiver(actors.Receiver):
    def __init__(self) -> None:
        super().__init__()
        self.kept: list[list[torch.Tensor]] = []

    def keep(self, prefix: str, wires, scribble: bool = False) -> list[int]:
        """Fetch and keep every object; the first element of each as received."""
        from ray_rdt_pool._ray.owned import fetch_owned

        first = []
        for i, w in enumerate(wires):
            ts = fetch_owned(f"{prefix}{i}", w, "cpu")
            first.append(int(ts[0][0]))
            if scribble:  # private copy-on-write pages: nobody else may see this
                ts[0].fill_(-1)
            self.kept.append(ts)
        return first

    def values(self, obj_id: str, wire: bytes) -> list[int]:
        """Fetch one object and return its first tensor's values (the views die here)."""
        from ray_rdt_pool._ray.owned import fetch_owned

        return fetch_owned(obj_id, wire, "cpu")[0].tolist()

    def maps(self) -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    def drop(self) -> None:
        self.kept = []
        gc.collect()
        ray_rdt_pool.stats()  # drains: the views' leases drop


def stats(actor):
    return call(actor, lambda self: ray_rdt_pool.stats())


@pytest.fixture(scope="module")
def pair():
    """The module's sender and receiver; each test frees every object, drops every view
    and waits until the sender holds no lease before it ends."""
    return Sender.remote(), Receiver.remote()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_sender_holding_back_20000_blocks_for_a_receiver_stays_idle(pair) -> None:
    """A receiver keeps 20,000 small objects whose refs are gone: the sender holds their
    blocks back for its leases. Its progress tick used to check every held-back object
    against the lease table, 0.6 of a core while idle; now it reads the receivers'
    release logs, and idles as it does with nothing held back."""
    n = 20_000
    s, r = pair
    wires, _offsets = ray.get(s.put_many.remote("k", n), timeout=300)
    assert ray.get(r.keep.remote("k", wires), timeout=300) == list(range(n))
    del wires
    assert ray.get(s.free_many.remote("k", n), timeout=120) == n
    st = stats(s)
    assert (st.live_objects, st.leased_objects) == (0, n), st
    pid = ray.get(s.pid.remote())
    time.sleep(1.0)  # the sweep and the first full check of the held-back objects
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(4.0)
    core = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    assert core <= 0.05, f"an idle sender used {core:.3f} of a core"
    ray.get(r.drop.remote())
    st = wait_drained(s, timeout=60)
    st = wait_for(lambda: (x := stats(s)).leased_objects == 0 and x, timeout=30)
    assert st.leased_bytes == 0 and st.pool_used == 0
    rst = stats(r)
    assert (rst.mapped_objects, rst.reads_posted) == (0, 0), rst


def test_mappings_do_not_grow_with_the_objects_a_receiver_keeps(pair) -> None:
    """Each kept object used to be a mapping of its own (5,000 objects: 5,728 more lines
    in /proc/self/maps), so the kernel's vm.max_map_count (65,530) capped what a receiver
    could keep, and past it every mmap in the process failed. Now the pool is mapped
    once and every object is a view of it."""
    n = 5_000
    s, r = pair
    wires, _ = ray.get(s.put_many.remote("w", 1))
    assert ray.get(r.keep.remote("w", wires)) == [0]  # the pool and its mapping exist
    before = ray.get(r.maps.remote())
    wires, _ = ray.get(s.put_many.remote("m", n), timeout=300)
    assert ray.get(r.keep.remote("m", wires), timeout=300) == list(range(n))
    gained = ray.get(r.maps.remote()) - before
    assert gained < 500, f"{gained} more mappings for {n} kept objects"
    assert stats(r).mapped_objects == n + 1
    ray.get(s.free_many.remote("w", 1))
    ray.get(s.free_many.remote("m", n))
    ray.get(r.drop.remote())
    wait_drained(s, timeout=60)
    wait_for(lambda: stats(s).leased_objects == 0, timeout=30)
    assert stats(r).mapped_objects == 0


def test_pages_a_receiver_wrote_never_show_the_blocks_next_object(pair) -> None:
    """A receiver writes into its views (copy-on-write: its own pages) and drops them;
    the sender reuses the block for the next object, which the receiver maps: it must
    see the new bytes. With one mapping of the whole pool, the written pages stay in
    that mapping unless they are given back to the file before the lease drops."""
    s, r = pair
    for size in (4, 5000):  # one page; two pages
        wires, (off_a,) = ray.get(s.put_many.remote("a", 1, fill=7, size=size))
        assert ray.get(r.keep.remote("a", wires, scribble=True)) == [7]
        assert ray.get(s.free_many.remote("a", 1)) == 1
        wait_for(lambda: stats(s).leased_objects == 1, timeout=10)
        ray.get(r.drop.remote())
        wait_drained(s)
        wait_for(lambda: stats(s).leased_objects == 0, timeout=10)
        wires, (off_b,) = ray.get(s.put_many.remote("b", 1, fill=9, size=size))
        assert off_b == off_a  # the same block: the receiver's written pages were there
        got = ray.get(r.values.remote("b0", wires[0]))
        assert got == [9] * size, "the receiver saw its own earlier writes"
        ray.get(s.free_many.remote("b", 1))
        wait_drained(s)
    assert stats(r).reads_posted == 0
