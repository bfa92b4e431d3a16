"""A relayed stream (``sync(..., relay="chain")``) on a real one-host Ray cluster with
real NIXL: byte-exact down a chain of four receivers over several syncs, each bucket
sent by the trainer once, versions all-or-nothing, a receiver that dies or hangs in the
middle of the chain named by a typed error with the others on their old version and
still usable, and the buckets a receiver holds for its successor bounded by
``max_inflight`` and all released after the sync.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ray import cloudpickle

from ray_rdt_pool.errors import InvalidInputError
from ray_rdt_pool.weights import RelayReceiverError, WeightReceiver, WeightSender, sync
from tests.support.raycluster import actor_env, call, digest, node_class, wait_drained

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

# The helpers below run inside the actors; ship them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

N_TENSORS = 12
SHAPE = (64, 64)  # 16 KiB of fp32: one tensor per bucket
BUCKET = 64 * 64 * 4


def _state(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(SHAPE, generator=g).to(dtype)
            for i in range(N_TENSORS)}


class _Faulty(WeightReceiver):
    """A receiver that dies (``os._exit``) or hangs (``sleep``) at one bucket, or is
    slow at every bucket, once armed."""

    fault: tuple[str, int, float] | None = None

    def _load_bucket(self, plan: Any, ref: Any, *rest: Any) -> Any:
        f = self.fault
        if f is not None and f[0] == "slow":
            time.sleep(f[2])
        elif f is not None and plan.index == f[1]:
            if f[0] == "die":
                os._exit(1)
            time.sleep(f[2])
        return super()._load_bucket(plan, ref, *rest)


def _trainer(actor: Any) -> None:
    actor.state = _state(0)
    actor.weight_sender = WeightSender(actor.state, bucket_bytes=BUCKET)


def _receiver(actor: Any, dtype: torch.dtype = torch.float32, direct: bool = True) -> None:
    actor.state = {k: torch.zeros(SHAPE, dtype=dtype) for k in _state(0)}
    actor.weight_receiver = _Faulty(actor.state, direct=direct)


def _arm(actor: Any, fault: tuple[str, int, float] | None) -> None:
    actor.weight_receiver.fault = fault


def _step(actor: Any) -> None:
    with torch.no_grad():
        for t in actor.state.values():
            t.view(torch.int32).add_(7)  # every byte changes


def _digests(actor: Any, dtype: torch.dtype | None = None) -> list[str]:
    return digest([t if dtype is None else t.to(dtype) for t in actor.state.values()])


def _version(actor: Any) -> int:
    return int(actor.weight_receiver.version)


def _relay_stats(actor: Any) -> tuple[tuple[int, int], Any]:
    """((objects held now, the most snapshots held at once in the last relay), stats):
    a receiver holds no object of its own but what it relays."""
    import ray_rdt_pool
    from ray_rdt_pool.weights.receiving import relay_peak

    st = ray_rdt_pool.stats()
    return (int(st.live_objects), relay_peak()), st


#: The module's actors' settings (over the shared cluster's, same_node "off" among them).
ENV = {"RAY_RDT_POOL_POOL_BYTES": "8M", "RAY_RDT_POOL_ARENA_BYTES": "8M"}


class _Pool:
    """The module's actors, kept from test to test (an actor takes seconds to start here,
    and a test sets each one's state afresh): a trainer, and receivers handed out in
    order. ``_actors`` takes them, ``_kill`` gives them back and ends only those that
    died or no longer answer (one that hangs in a bucket)."""

    node: Any = None
    trainer: Any = None
    receivers: list[Any] = []


@pytest.fixture(scope="module")
def cluster(ray_cluster: str) -> Iterator[None]:
    _Pool.node = node_class(runtime_env=actor_env(ENV))
    yield
    _Pool.trainer, _Pool.receivers = None, []


def _actors(n: int, **receiver_opts: Any) -> tuple[Any, list[Any]]:
    if _Pool.trainer is None:
        _Pool.trainer = _Pool.node.remote()
    trainer = _Pool.trainer
    call(trainer, _trainer)
    while len(_Pool.receivers) < n:
        _Pool.receivers.append(_Pool.node.remote())
    rs = _Pool.receivers[:n]
    for r in rs:
        call(r, _receiver, **receiver_opts)
    return trainer, rs


def _kill(*actors: Any) -> None:
    """Give the actors back to the pool; end those that died or hang."""
    import ray

    for a in actors:
        try:
            ray.get(a.__ray_call__.remote(lambda self: None), timeout=5)
            continue
        except Exception:  # dead, or busy in a hung bucket
            ray.kill(a)
        if a is _Pool.trainer:
            _Pool.trainer = None
        _Pool.receivers = [r for r in _Pool.receivers if r is not a]


def _exact(trainer: Any, receivers: list[Any]) -> None:
    want = call(trainer, _digests)
    for i, r in enumerate(receivers):
        assert call(r, _digests) == want, f"receiver {i} holds other bytes"


def test_a_relayed_sync_is_byte_exact_down_the_chain_and_sends_each_bucket_once(
        cluster: None) -> None:
    trainer, rs = _actors(4)
    # Receiver 2 loads through its arena: it relays a snapshot, not its tensors.
    call(rs[2], _receiver, direct=False)
    try:
        for step in range(3):
            call(trainer, _step)
            before = [call(r, _relay_stats)[1] for r in rs]
            rep = sync(trainer, rs, relay="chain", max_inflight=2, timeout_s=60)
            _exact(trainer, rs)
            assert rep.buckets == N_TENSORS and len(rep.loads) == 4
            assert [call(r, _version) for r in rs] == [rep.version] * 4
            after = [call(r, _relay_stats) for r in rs]
            put = [a[1].objects_put - b.objects_put for a, b in zip(after, before)]
            # Every receiver but the last published every bucket for its successor ...
            assert put == [N_TENSORS] * 3 + [0], (step, put)
            got = [a[1].bytes_received - b.bytes_received for a, b in zip(after, before)]
            # ... and each read the whole model once, from the one before it.
            assert got == [N_TENSORS * BUCKET] * 4, (step, got)
            for (held, _peak), st in after:
                assert held == 0 and st.live_objects == 0 and st.pool_used == 0
        wait_drained(trainer)
    finally:
        _kill(trainer, *rs)


def test_relay_order_by_placement_and_bad_options(cluster: None) -> None:
    trainer, rs = _actors(3)
    try:
        call(trainer, _step)
        rep = sync(trainer, rs, relay="chain", relay_order="placement", timeout_s=60)
        _exact(trainer, rs)
        assert [call(r, _version) for r in rs] == [rep.version] * 3
        with pytest.raises(InvalidInputError, match="relay must be"):
            sync(trainer, rs, relay="ring")
        with pytest.raises(InvalidInputError, match="relay_order"):
            sync(trainer, rs, relay="chain", relay_order="random")
        with pytest.raises(InvalidInputError, match="mode='stream'"):
            sync(trainer, rs, relay="chain", mode="publish")
        assert [call(r, _version) for r in rs] == [rep.version] * 3
    finally:
        _kill(trainer, *rs)


@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_middle_receiver_that_dies_or_hangs_is_named_and_the_others_stay_usable(
        cluster: None, fault: str) -> None:
    trainer, rs = _actors(4)
    try:
        call(trainer, _step)
        v1 = sync(trainer, rs, relay="chain", timeout_s=60).version
        call(trainer, _step)
        call(rs[1], _arm, (fault, 5, 120.0))
        t0 = time.monotonic()
        with pytest.raises(RelayReceiverError) as info:
            sync(trainer, rs, relay="chain", timeout_s=10)
        assert time.monotonic() - t0 < 20  # named within timeout_s of its last progress
        err = info.value
        assert err.receiver == 1 and err.bucket == 5 and err.stalled == (fault == "hang")
        assert err.actor_id == rs[1]._actor_id.hex() and "receiver 1" in str(err)
        survivors = [rs[0], rs[2], rs[3]]
        # Nobody committed: every survivor is on the old version and holds nothing.
        assert [call(r, _version) for r in survivors] == [v1] * 3
        for r in survivors:
            (held, _peak), st = call(r, _relay_stats)
            assert held == 0 and st.live_objects == 0
        # A later sync to the survivors works, byte-exact.
        rep = sync(trainer, survivors, relay="chain", timeout_s=60)
        _exact(trainer, survivors)
        assert [call(r, _version) for r in survivors] == [rep.version] * 3
        assert rep.version > v1
    finally:
        _kill(trainer, *rs)


def test_relay_snapshots_are_bounded_by_max_inflight_and_released(cluster: None) -> None:
    """Receivers that load through their arena relay snapshots from their own pool: a
    fast receiver ahead of a slow successor holds at most ``max_inflight`` of them."""
    trainer, rs = _actors(3, direct=False)
    try:
        call(rs[1], _arm, ("slow", -1, 0.05))
        regs = []
        for m in (2, 3, 2):
            call(trainer, _step)
            sync(trainer, rs, relay="chain", max_inflight=m, timeout_s=60)
            _exact(trainer, rs)
            stats = [call(r, _relay_stats) for r in rs]
            peaks = [peak for (_held, peak), _st in stats]
            assert peaks[0] <= m and peaks[1] <= m and peaks[2] == 0, (m, peaks)
            assert peaks[0] == m, (m, peaks)  # the fast one did run ahead
            for (held, _peak), st in stats:
                assert held == 0 and st.live_objects == 0 and st.pool_used == 0
            regs.append([st.nixl_registrations - st.nixl_deregistrations
                         for _h, st in stats])
        assert regs[1] == regs[2], regs  # a warm sync registers nothing new
    finally:
        _kill(trainer, *rs)
