"""The same-node path on a real Ray cluster: receivers map the sender's shared pool.

The module's actors run on the test process's shared cluster (one Ray node), with the
default ``same_node="map"`` (``ENV``).
Every get of a pooled object must be served with no NIXL READ (``stats().reads_posted``
stays 0, ``mapped_gets`` counts them), bytes are compared by sha256 on both sides, and
the leases are attacked: views kept after the ref died, a block of the same size put
meanwhile, a receiver writing into its views, a receiver killed while holding views,
and a thousand cycles that must leave pool, leases and registrations at baseline.
The two-node case (NIXL between Ray nodes) is in tests/integration/test_multinode.py.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest
import ray
import torch

import ray_rdt_pool
from tests.support import actors
from tests.support.raycluster import actor_env, call, digest, wait_drained, wait_for

pytestmark = pytest.mark.ray

ray_rdt_pool.register()


#: The module's actors' settings.
ENV = {"RAY_RDT_POOL_POOL_BYTES": "32M", "RAY_RDT_POOL_ARENA_BYTES": "32M",
       "RAY_RDT_POOL_SAME_NODE": "map"}


@pytest.fixture(scope="module", autouse=True)
def cluster(ray_cluster):
    yield


@ray.remote(enable_tensor_transport=True, runtime_env=actor_env(ENV))
class Sender(actors.Sender):
    def put(self, n: int, fill: int):
        ts = [torch.full((n,), fill, dtype=torch.int32), torch.arange(n, dtype=torch.float64)]
        return [ray.put(ts, _tensor_transport="nixl_pool")], digest(ts)

    @ray.method(tensor_transport="nixl_pool")
    def make(self, n: int, fill: int):
        return torch.full((n,), fill, dtype=torch.int64)

    def put_by_reference(self, obj_id: str, n: int):
        """An object sent by reference (read where it lies, never in the pool): puts
        no pool into being."""
        from ray_rdt_pool._ray.owned import put_owned

        self.lent = [torch.arange(n, dtype=torch.int64)]
        return put_owned(obj_id, self.lent, by_reference=True), digest(self.lent)

    def free_owned(self, obj_id: str) -> bool:
        from ray_rdt_pool._ray.owned import free_owned

        return free_owned(obj_id)


@ray.remote(enable_tensor_transport=True, runtime_env=actor_env(ENV))
class Receiver(actors.Receiver):
    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[str, list[torch.Tensor]] = {}

    def get(self, refs, keep: str | None = None, scribble: bool = False):
        ts = ray.get(refs[0])
        d = digest(ts)
        if scribble:  # a private copy-on-write mapping: nobody else may see this
            for t in ts:
                t.fill_(-1)
        if keep:
            self.kept[keep] = ts
        return d

    def kept_digest(self, key: str):
        return digest(self.kept[key])

    def drop(self, key: str) -> None:
        del self.kept[key]

    def take(self, t):  # a task argument: Ray's __ray_recv__ on _ray_system
        return int(t.sum())

    def get_owned(self, obj_id: str, wire_device):
        from ray_rdt_pool._ray.owned import fetch_owned

        return digest(fetch_owned(obj_id, *wire_device))

    def cycles(self, sender, n: int):
        """``n`` put/get/free cycles; returns the change of this process's counters."""
        before = ray_rdt_pool.stats()
        for i in range(n):
            t = ray.get(sender.make.remote(4096 + (i % 7) * 1000, i))
            assert int(t[0]) == i and int(t[-1]) == i
            del t
        after = ray_rdt_pool.stats()
        return {k: getattr(after, k) - getattr(before, k)
                for k in ("mapped_gets", "reads_posted", "nixl_registrations")}

    def fork_keeping(self, key: str) -> None:
        """Fork a child that inherits the views kept under ``key``, then drop them here
        (as a DataLoader worker's parent may); the child checks their bytes when told."""
        ts = self.kept.pop(key)
        want = [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in ts]
        go_r, go_w = os.pipe()
        res_r, res_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # numpy and hashlib only: a forked child must not use torch's threads
            ok = b"0"
            try:
                os.read(go_r, 1)
                got = [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in ts]
                ok = b"1" if got == want else b"0"
            finally:
                os.write(res_w, ok)
                os._exit(0)
        os.close(go_r)
        os.close(res_w)
        self.child = (pid, go_w, res_r)
        del ts
        ray_rdt_pool.stats()  # drains: our views' lease drops

    def child_kept_its_bytes(self) -> bool:
        pid, go_w, res_r = self.child
        os.write(go_w, b"x")
        ok = os.read(res_r, 1) == b"1"
        os.waitpid(pid, 0)
        os.close(go_w)
        os.close(res_r)
        return ok


def stats(actor):
    return call(actor, lambda self: ray_rdt_pool.stats())


@pytest.fixture(scope="module")
def sender():
    """The module's sender, for the tests that do not end it; each test drains it (no
    object, no lease) before it ends."""
    return Sender.remote()


@pytest.fixture(scope="module")
def receivers():
    """The module's receivers, for the tests that do not end them, shut them down or fork
    them; each test drops the views it kept. They never READ: every object they get is
    pooled by a sender of this node."""
    return [Receiver.remote() for _ in range(3)]


def test_several_receivers_see_the_right_bytes_and_a_writer_changes_only_its_own(
        sender, receivers) -> None:
    s, rs = sender, receivers
    refs, want = ray.get(s.put.remote(300_000, 5))
    assert ray.get(rs[0].get.remote(refs, keep="x", scribble=True)) == want
    # Later receivers (and the writer itself, fetching again) still see the original bytes.
    for r in rs[1:]:
        assert ray.get(r.get.remote(refs)) == want
    assert ray.get(rs[0].get.remote(refs)) == want
    # Task arguments go the same way (Ray's receive on _ray_system).
    ref = s.make.remote(1000, 3)
    assert ray.get(rs[1].take.remote(ref)) == 3000
    for r in rs:
        st = stats(r)
        assert st.reads_posted == 0, st
        assert st.mapped_gets >= 1
    assert stats(rs[0]).mapped_objects == 1  # the kept views hold one lease
    call(rs[0], lambda self: self.drop("x"))
    del refs, ref
    wait_drained(s)
    wait_for(lambda: stats(rs[0]).mapped_objects == 0, timeout=10)
    wait_for(lambda: stats(s).leased_objects == 0, timeout=10)


def test_a_leased_block_is_never_reused_and_comes_back_when_the_views_die(
        sender, receivers) -> None:
    s, r = sender, receivers[1]
    refs, want = ray.get(s.put.remote(1 << 20, 1))
    assert ray.get(r.get.remote(refs, keep="a")) == want
    del refs  # Ray frees the object; the receiver still has views of its block
    st = wait_for(lambda: (x := stats(s)).live_objects == 0 and x, timeout=10)
    assert st.leased_objects == 1 and st.leased_bytes >= 12 << 20
    # Another object of the same size: it must land elsewhere, the kept views unchanged.
    refs2, want2 = ray.get(s.put.remote(1 << 20, 2))
    assert ray.get(r.get.remote(refs2)) == want2
    assert call(r, lambda self: self.kept_digest("a")) == want
    del refs2
    call(r, lambda self: self.drop("a"))
    st = wait_drained(s)  # the block came back
    assert st.leased_objects == 0 and st.leased_bytes == 0
    assert stats(r).mapped_objects == 0 and stats(r).reads_posted == 0


def test_a_killed_receivers_leases_are_released_within_five_seconds(sender) -> None:
    s, r = sender, Receiver.remote()  # a receiver of its own: it is killed
    refs, want = ray.get(s.put.remote(1 << 18, 7))
    assert ray.get(r.get.remote(refs, keep="k")) == want
    del refs
    wait_for(lambda: stats(s).leased_objects == 1, timeout=10)
    os.kill(ray.get(r.pid.remote()), signal.SIGKILL)
    t0 = time.monotonic()
    st = wait_for(lambda: (x := stats(s)).leased_objects == 0 and x.pool_used == 0 and x,
                  timeout=15, interval=0.05)
    assert time.monotonic() - t0 < 5.0, "leases of a killed receiver outlived 5 s"
    assert st.leased_bytes == 0


def test_a_thousand_cycles_leak_nothing(sender, receivers) -> None:
    s, r = sender, receivers[2]
    ray.get(r.cycles.remote(s, 1))  # pool, agents and mappings exist: the baseline
    wait_drained(s)
    base = stats(s)
    delta = ray.get(r.cycles.remote(s, 1000), timeout=300)
    assert delta == {"mapped_gets": 1000, "reads_posted": 0, "nixl_registrations": 0}
    st = wait_drained(s)
    st = wait_for(lambda: (x := stats(s)).leased_objects == 0 and x, timeout=10)
    assert st.pool_used == 0 and st.live_objects == 0 and st.leased_bytes == 0
    assert st.nixl_registrations == base.nixl_registrations
    assert st.registered_regions == base.registered_regions
    rst = wait_for(lambda: (x := stats(r)).mapped_objects == 0 and x, timeout=10)
    assert rst.mapped_bytes == 0 and rst.arena_used == 0


def test_leases_held_at_shutdown_come_back_when_the_views_die(sender) -> None:
    """``ray_rdt_pool.shutdown()`` in a receiver that keeps running, while it holds
    mapped views: once they die, the sender's block comes back (it stayed leased until
    the receiver process exited)."""
    s, r = sender, Receiver.remote()  # a receiver of its own: its transport is shut down
    refs, want = ray.get(s.put.remote(1 << 16, 6))
    assert ray.get(r.get.remote(refs, keep="s")) == want
    call(r, lambda self: ray_rdt_pool.shutdown())
    del refs
    # Ray freed it; the views live on after shutdown and hold the block
    wait_for(lambda: (x := stats(s)).live_objects == 0 and x.leased_objects == 1, timeout=10)
    assert call(r, lambda self: self.kept_digest("s")) == want
    call(r, lambda self: self.drop("s"))
    st = wait_for(lambda: (x := stats(s)).leased_objects == 0 and x, timeout=10)
    assert st.leased_bytes == 0 and st.pool_used == 0
    ray.kill(r)


def test_a_forked_child_of_a_receiver_keeps_the_bytes_of_its_views(sender) -> None:
    """A receiver forks holding mapped views and drops its own: the child's inherited
    private mappings used to show whatever the sender put into the reused block next.
    The child copies them at fork, and the block comes back once it has."""
    s, r = sender, Receiver.remote()  # a receiver of its own: it forks
    refs, want = ray.get(s.put.remote(1 << 18, 3))
    assert ray.get(r.get.remote(refs, keep="f")) == want
    ray.get(r.fork_keeping.remote("f"))
    del refs
    wait_drained(s)
    wait_for(lambda: stats(s).leased_objects == 0, timeout=10)  # the child has copied
    refs2, want2 = ray.get(s.put.remote(1 << 18, 4))  # the same size: the same block
    assert ray.get(r.get.remote(refs2)) == want2
    assert ray.get(r.child_kept_its_bytes.remote())
    assert stats(r).reads_posted == 0
    del refs2
    wait_drained(s)
    ray.kill(r)


def test_a_pool_made_after_the_first_contact_is_mapped(receivers) -> None:
    """A receiver first meets a sender that has no pool yet (an object sent by
    reference, as a trainer's stream buckets are): that sender's pool, made later, is
    mapped all the same. The receiver used to keep "no shared pool" for good and READ
    every later pooled object of it."""
    s, r = Sender.remote(), receivers[0]  # a sender of its own: it has no pool yet
    base = stats(r)
    wd, want = ray.get(s.put_by_reference.remote("ws:first", 5000))
    assert ray.get(r.get_owned.remote("ws:first", wd)) == want  # READ: not in a pool
    before = stats(r)
    assert (before.reads_posted - base.reads_posted,
            before.mapped_gets - base.mapped_gets) == (1, 0), before
    assert stats(s).pool_capacity == 0  # no pool yet
    refs, want = ray.get(s.put.remote(300_000, 9))  # makes the shared pool
    assert ray.get(r.get.remote(refs)) == want
    ref = s.make.remote(1000, 4)
    assert ray.get(r.take.remote(ref)) == 4000
    after = stats(r)
    assert (after.mapped_gets - before.mapped_gets, after.reads_posted) == (
        2, before.reads_posted), after
    assert ray.get(s.free_owned.remote("ws:first"))
    del refs, ref
    wait_drained(s)
    ray.kill(s)


def test_a_get_from_an_exited_sender_fails(receivers) -> None:
    s, r = Sender.remote(), receivers[1]  # a sender of its own: it is killed
    assert ray.get(r.take.remote(s.make.remote(100, 1))) == 100  # r maps s's pool
    ref = s.make.remote(1000, 2)  # owned by the driver: it outlives the sender
    ray.wait([ref], fetch_local=False)
    pid = ray.get(s.pid.remote())
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=10)
    before = stats(r)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(r.take.remote(ref), timeout=60)
    after = stats(r)
    assert after.mapped_gets == before.mapped_gets and after.reads_posted == 0
    assert after.transfer_errors == before.transfer_errors + 1
