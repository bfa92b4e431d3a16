"""The weight-sync promises users rely on most, attacked on a real one-host Ray cluster
with real NIXL, through the public API:

* a version a receiver reports is exactly the bytes of the sync that carried it, whatever
  the timing (a receiver that is busy, late, or loads after the driver gave up);
* ``timeout_s`` means "no progress for this long", for every kind of sync: a sync longer
  than ``3 * timeout_s`` that keeps moving succeeds;
* nothing a failed sync made (pool objects, relay buckets, offers) outlives it by more
  than one later sync;
* a relay refuses an older sync without harming the newer one, relays the bytes as they
  arrived, and says truly who committed when the commit step fails;
* many-rank syncs take ``strict=False``, ``name_map`` and a dead receiver as a single
  trainer does.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ray import cloudpickle

import ray_rdt_pool
from ray_rdt_pool.weights import (
    ManifestMismatchError,
    RelayReceiverError,
    StaleVersionError,
    TrainerRankError,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightSyncTimeoutError,
    sync,
)
from tests.support.raycluster import NodePool, call, digest, held, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

# The helpers below run inside the actors; ship them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHAPE = (64, 64)  # 16 KiB of fp32: one tensor per bucket
BUCKET = 64 * 64 * 4


def _model(seed: int, n: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(SHAPE, generator=g).to(dtype) for i in range(n)}


class _Slow(WeightReceiver):
    """A receiver that sleeps ``delay`` before each bucket once armed, or dies
    (``os._exit``) at its commit."""

    delay = 0.0
    die_at_commit = False

    def _load_bucket(self, plan: Any, ref: Any, *rest: Any) -> Any:
        if self.delay:
            time.sleep(self.delay)
        return super()._load_bucket(plan, ref, *rest)

    def _finish_stream(self, *args: Any, **kw: Any) -> Any:
        if self.die_at_commit:
            os._exit(1)
        return super()._finish_stream(*args, **kw)


# -- inside the actors ---------------------------------------------------------------


def _trainer(actor: Any, n: int, seed: int = 0, names: tuple[str, ...] | None = None,
             **opts: Any) -> None:
    state = _model(seed, n)
    actor.state = {k: v for k, v in state.items() if names is None or k in names}
    actor.weight_sender = WeightSender(actor.state, bucket_bytes=BUCKET, **opts)


def _receiver(actor: Any, n: int, attr: str = "weight_receiver",
              dtype: torch.dtype = torch.float32, **opts: Any) -> None:
    dest = {k: torch.zeros(SHAPE, dtype=dtype) for k in _model(0, n)}
    setattr(actor, attr + "_dest", dest)
    setattr(actor, attr, _Slow(dest, **opts))


def _arm(actor: Any, delay: float = 0.0, die_at_commit: bool = False,
         attr: str = "weight_receiver") -> None:
    rec = getattr(actor, attr)
    rec.delay = delay
    rec.die_at_commit = die_at_commit


def _step(actor: Any, by: int = 7) -> None:
    with torch.no_grad():
        for t in actor.state.values():
            t.view(torch.int32).add_(by)  # every byte changes


def _sender_digests(actor: Any, dtype: torch.dtype | None = None) -> dict[str, str]:
    return {k: digest([v if dtype is None else v.to(dtype)])[0]
            for k, v in actor.state.items()}


def _digests(actor: Any, attr: str = "weight_receiver") -> dict[str, str]:
    return {k: digest([v])[0] for k, v in getattr(actor, attr + "_dest").items()}


def _version(actor: Any, attr: str = "weight_receiver") -> int:
    return int(getattr(actor, attr).version)


def _busy(actor: Any, seconds: float) -> None:
    time.sleep(seconds)  # an engine in a long generate


def _sender_version(actor: Any) -> int:
    return int(actor.weight_sender.version)


# -- on the driver ---------------------------------------------------------------------


#: The shared cluster's settings for this module's actors: small pools.
ENV = {"RAY_RDT_POOL_POOL_BYTES": "8M", "RAY_RDT_POOL_ARENA_BYTES": "8M"}


#: This module's actors, handed out again from one test to the next.
NODES = NodePool(ENV)


@pytest.fixture(scope="module")
def cluster(ray_cluster: str) -> Iterator[None]:
    yield
    NODES.close()


_nodes, _kill = NODES.take, NODES.give_back


def _merged(trainers: list[Any], dtype: torch.dtype | None = None) -> dict[str, str]:
    out: dict[str, str] = {}
    for t in trainers:
        out.update(call(t, _sender_digests, dtype))
    return out


def _drained(actors: list[Any], timeout: float = 30.0) -> None:
    for a in actors:
        wait_for(lambda a=a: call(a, held) == (0, 0), timeout=timeout)


# ---------------------------------------------------------------------------------------
# A version is exactly its sync's bytes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["in-place", "packed-bf16"])
def test_a_late_receiver_of_a_many_rank_sync_never_commits_other_bytes(
        cluster: None, packed: bool) -> None:
    """An engine busy in a long generate when sync 2 arrives; the driver gives up on
    sync 2 and syncs 3 to the healthy engine. When the busy engine gets to its queued
    work, the version it reports must hold that version's bytes: never version 2 with
    version 3's weights."""
    n = 6
    names = tuple(_model(0, n))
    t0, t1, e0, e1 = _nodes(4)
    ranks = [t0, t1]
    opts = {"wire_dtype": torch.bfloat16} if packed else {}
    dtype = torch.bfloat16 if packed else torch.float32
    try:
        call(t0, _trainer, n, 1, names[::2], **opts)
        call(t1, _trainer, n, 1, names[1::2], **opts)
        for e in (e0, e1):
            call(e, _receiver, n, dtype=dtype)
        seen: dict[int, dict[str, str]] = {}
        sync(ranks, [e0, e1], version=1, timeout_s=30)
        seen[1] = _merged(ranks, dtype)
        for t in ranks:
            call(t, _step)
        seen[2] = _merged(ranks, dtype)
        busy = e1.__ray_call__.remote(_busy, 6.0)
        time.sleep(0.3)
        with pytest.raises(WeightSyncTimeoutError):
            sync(ranks, [e0, e1], version=2, timeout_s=2.0)
        for t in ranks:
            call(t, _step)
        seen[3] = _merged(ranks, dtype)
        sync(ranks, [e0], version=3, timeout_s=30)
        assert call(e0, _version) == 3 and call(e0, _digests) == seen[3]
        import ray

        ray.get(busy, timeout=60)
        # Everything queued on the busy engine has run once this call answers; give a
        # late load its own time to end as well.
        time.sleep(3.0)
        v = call(e1, _version)
        got = call(e1, _digests)
        assert v in (1, 2), v
        assert got == seen[v], f"engine reports version {v} but holds other bytes"
        # And it is usable: the next sync brings it up to date.
        for t in ranks:
            call(t, _step)
        sync(ranks, [e0, e1], version=4, timeout_s=30)
        want = _merged(ranks, dtype)
        assert call(e1, _digests) == want and call(e1, _version) == 4
        _drained([*ranks, e0, e1])
    finally:
        _kill(t0, t1, e0, e1)


def _stream_opts(kind: str) -> dict[str, Any]:
    return {"source_reads": False} if kind == "packed" else {}


@pytest.mark.parametrize("kind", ["packed", "in-place", "relay", "ranks", "publish"])
def test_a_sync_longer_than_three_timeouts_that_keeps_moving_succeeds(
        cluster: None, kind: str) -> None:
    """``timeout_s`` is "no progress for this long": every bucket is acknowledged within
    0.7 s, the whole sync takes about 6 s, and ``timeout_s=2`` must not cut it."""
    timeout_s, delay = 2.0, 0.7
    # A receiver reads from two ranks at once: twice the buckets take as long.
    n = 18 if kind == "ranks" else 9
    names = tuple(_model(0, n))
    actors = _nodes(4 if kind == "ranks" else 3)
    try:
        if kind == "ranks":
            ranks = actors[:2]
            call(ranks[0], _trainer, n, 3, names[::2])
            call(ranks[1], _trainer, n, 3, names[1::2])
            trainer: Any = ranks
            recs = actors[2:]
        else:
            call(actors[0], _trainer, n, 3, **_stream_opts(kind))
            trainer, recs = actors[0], actors[1:]
        for r in recs:
            call(r, _receiver, n)
        extra: dict[str, Any] = {}
        if kind == "relay":
            extra["relay"] = "chain"
        if kind == "publish":
            extra["mode"] = "publish"
        # A first sync creates each process's agents, seconds on a loaded host: what is
        # timed here is a sync whose every step moves.
        sync(trainer, recs, timeout_s=60.0, **extra)
        call(recs[0], _arm, delay)
        t_start = time.monotonic()
        rep = sync(trainer, recs, timeout_s=timeout_s, **extra)
        took = time.monotonic() - t_start
        assert took > 3 * timeout_s, took  # the test proves nothing otherwise
        want = _merged(trainer if isinstance(trainer, list) else [trainer])
        for r in recs:
            assert call(r, _digests) == want
            assert call(r, _version) == rep.version
    finally:
        _kill(*actors)


def test_nothing_of_a_relay_whose_trainer_died_outlives_the_next_sync(cluster: None) -> None:
    """The trainer dies mid-relay: the receivers drop everything they relay by the end
    of the next complete sync (a plain stream from a new trainer)."""
    import ray

    n = 10
    t_old, t_new, *rs = _nodes(5)
    try:
        call(t_old, _trainer, n, 5, source_reads=False)
        call(t_new, _trainer, n, 6)
        for r in rs:
            call(r, _receiver, n, direct=False)  # relays snapshots from its own pool
        call(rs[-1], _arm, 0.3)
        box: dict[str, Any] = {}

        def doomed() -> None:
            try:
                box["rep"] = sync(t_old, rs, relay="chain", timeout_s=5.0)
            except BaseException as e:
                box["error"] = e

        run = threading.Thread(target=doomed)
        run.start()
        time.sleep(1.5)
        ray.kill(t_old)
        run.join(60)
        assert not run.is_alive() and "error" in box, box
        # Typed, and the receivers dropped the stream before it was raised.
        assert isinstance(box["error"], TrainerRankError) and box["error"].died, box
        assert box["error"].committed == ()
        call(rs[-1], _arm, 0.0)
        # The new trainer carries on from the dead one's step.
        rep = sync(t_new, rs, version=2, timeout_s=30)
        assert [call(r, _version) for r in rs] == [rep.version] * 3
        want = call(t_new, _sender_digests)
        for r in rs:
            assert call(r, _digests) == want
        _drained(rs, timeout=15)
        _drained([t_new])
    finally:
        _kill(t_old, t_new, *rs)


# ---------------------------------------------------------------------------------------
# Relay
# ---------------------------------------------------------------------------------------


def test_an_older_relayed_sync_is_refused_and_the_newer_one_goes_on(cluster: None) -> None:
    n = 8
    t_new, t_old, *rs = _nodes(5)
    try:
        call(t_new, _trainer, n, 11)
        call(t_old, _trainer, n, 12)
        for r in rs:
            call(r, _receiver, n)
            call(r, _arm, 0.2)
        box: dict[str, Any] = {}

        def newer() -> None:
            try:
                box["rep"] = sync(t_new, rs, relay="chain", version=10, timeout_s=60)
            except BaseException as e:
                box["error"] = e

        th = threading.Thread(target=newer)
        th.start()
        time.sleep(1.0)
        with pytest.raises(StaleVersionError):
            sync(t_old, rs, relay="chain", version=5, timeout_s=60)
        th.join(120)
        assert "error" not in box, repr(box.get("error"))
        assert box["rep"].version == 10
        want = call(t_new, _sender_digests)
        for r in rs:
            assert call(r, _version) == 10 and call(r, _digests) == want
        _drained(rs)
    finally:
        _kill(t_new, t_old, *rs)


def test_two_receivers_of_one_engine_relayed_at_once(cluster: None) -> None:
    """A policy and a reference model in each engine, each synced by its own trainer
    with a relay, at the same time."""
    n = 8
    t_pol, t_ref, *es = _nodes(5, max_concurrency=4)
    try:
        call(t_pol, _trainer, n, 21)
        call(t_ref, _trainer, n, 22)
        for e in es:
            call(e, _receiver, n, "weight_receiver")
            call(e, _receiver, n, "ref_receiver")
            call(e, _arm, 0.1, attr="weight_receiver")
            call(e, _arm, 0.1, attr="ref_receiver")
        reports: list[Any] = []
        errors: list[BaseException] = []

        def one(t: Any, attr: str) -> None:
            try:
                reports.append(sync(t, es, relay="chain", receiver_attr=attr, timeout_s=60))
            except BaseException as err:
                errors.append(err)

        ths = [threading.Thread(target=one, args=(t_pol, "weight_receiver")),
               threading.Thread(target=one, args=(t_ref, "ref_receiver"))]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        assert not errors and len(reports) == 2, errors
        for t, attr in ((t_pol, "weight_receiver"), (t_ref, "ref_receiver")):
            want = call(t, _sender_digests)
            for e in es:
                assert call(e, _digests, attr) == want, attr
        _drained(es)
    finally:
        _kill(t_pol, t_ref, *es)


def _scaling_loader(actor: Any) -> None:
    """An engine whose loader scales its input in place before keeping it."""
    actor.loaded = {}

    def load_weights(pairs: Any) -> None:
        for name, t in pairs:
            t.mul_(2.0)
            actor.loaded[name] = t.clone()

    actor.weight_receiver = WeightReceiver(load_weights=load_weights)


def test_a_relay_forwards_the_bytes_as_they_arrived(cluster: None) -> None:
    n = 6
    trainer, eng, last = _nodes(3)
    try:
        call(trainer, _trainer, n, 31)
        call(eng, _scaling_loader)
        call(last, _receiver, n)
        sync(trainer, [eng, last], relay="chain", timeout_s=60)
        assert call(last, _digests) == call(trainer, _sender_digests)
    finally:
        _kill(trainer, eng, last)


def test_a_receiver_dying_at_the_relay_commit_is_reported_truly(cluster: None) -> None:
    n = 4
    trainer, *rs = _nodes(4)
    try:
        call(trainer, _trainer, n, 41)
        for r in rs:
            call(r, _receiver, n)
        v1 = sync(trainer, rs, relay="chain", timeout_s=60).version
        call(trainer, _step)
        call(rs[1], _arm, die_at_commit=True)
        with pytest.raises(RelayReceiverError) as info:
            sync(trainer, rs, relay="chain", timeout_s=20)
        err = info.value
        assert err.receiver == 1
        versions = {i: call(rs[i], _version) for i in (0, 2)}
        committed = tuple(i for i, v in versions.items() if v > v1)
        # The error says who committed, and the docs' promise holds: the others did.
        assert err.committed == committed, (err.committed, versions, str(err))
        if committed:
            assert "no receiver committed" not in str(err)
        want = call(trainer, _sender_digests)
        for i in committed:
            assert call(rs[i], _digests) == want
    finally:
        _kill(trainer, *rs)


# ---------------------------------------------------------------------------------------
# Many trainer ranks
# ---------------------------------------------------------------------------------------


def _shards(actor: Any, rank: int, world: int, n: int, seed: int) -> None:
    full = _model(seed, n)
    step = SHAPE[0] // world
    actor.state = {k: v[rank * step:(rank + 1) * step].clone() for k, v in full.items()}
    actor.weight_sender = WeightSender(actor.state, bucket_bytes=BUCKET, shard=(rank, world))


def _full_digests(n: int, seed: int, names: Any = None) -> dict[str, str]:
    return {k: digest([v])[0] for k, v in _model(seed, n).items()
            if names is None or k in names}


def _receiver_without(actor: Any, n: int, drop: str, **opts: Any) -> None:
    dest = {k: torch.zeros(SHAPE) for k in _model(0, n) if k != drop}
    actor.weight_receiver_dest = dest
    actor.weight_receiver = WeightReceiver(dest, **opts)


def _receiver_mapped(actor: Any, n: int, name_map: Any) -> None:
    dest = {k: torch.zeros(SHAPE) for k in _model(0, n)}
    actor.weight_receiver_dest = dest
    actor.weight_receiver = WeightReceiver(dest, name_map=name_map)


def test_sharded_names_take_strict_false_and_name_map_as_one_trainer_does(
        cluster: None) -> None:
    n = 3
    names = tuple(_model(0, n))
    t0, t1, e = _nodes(3)
    try:
        for r, t in enumerate((t0, t1)):
            call(t, _shards, r, 2, n, 51)
        # strict=False: a sharded name with no destination is skipped.
        call(e, _receiver_without, n, names[1], strict=False)
        sync([t0, t1], [e], timeout_s=30)
        want = _full_digests(n, 51)
        del want[names[1]]
        assert call(e, _digests) == want
        # Two sharded names into one destination: the typed error, nothing written.
        call(e, _receiver_mapped, n, {names[0]: names[2], names[1]: names[2]})
        with pytest.raises(ManifestMismatchError, match=names[2].replace(".", r"\.")):
            sync([t0, t1], [e], timeout_s=30)

        # A name_map that raises for a sharded name: reported as a problem, typed.
        def bad(name: str) -> str:
            if name == names[0]:
                raise RuntimeError("no such layer")
            return name

        call(e, _receiver_mapped, n, bad)
        with pytest.raises(ManifestMismatchError, match="no such layer"):
            sync([t0, t1], [e], timeout_s=30)
        _drained([t0, t1])
    finally:
        _kill(t0, t1, e)


def test_a_receiver_that_dies_in_a_many_rank_sync_is_named(cluster: None) -> None:
    import ray

    n = 8
    names = tuple(_model(0, n))
    t0, t1, e0, e1 = _nodes(4)
    try:
        call(t0, _trainer, n, 61, names[::2])
        call(t1, _trainer, n, 61, names[1::2])
        for e in (e0, e1):
            call(e, _receiver, n)
        call(e1, _arm, 0.3)
        box: dict[str, BaseException] = {}

        def run() -> None:
            try:
                sync([t0, t1], [e0, e1], timeout_s=20)
            except BaseException as err:
                box["error"] = err

        th = threading.Thread(target=run)
        th.start()
        time.sleep(1.0)
        ray.kill(e1)
        th.join(60)
        err = box.get("error")
        assert isinstance(err, WeightSyncError), repr(err)
        assert "receiver 1" in str(err) and e1._actor_id.hex() in str(err), str(err)
        assert call(e0, _version) == 0  # nobody committed a partial sync
        _drained([t0, t1])
        # The survivor syncs again.
        sync([t0, t1], [e0], timeout_s=30)
        assert call(e0, _digests) == _merged([t0, t1])
        _drained([t0, t1, e0])
    finally:
        _kill(t0, t1, e0, e1)


def test_two_drivers_syncing_the_same_ranks_at_once(cluster: None) -> None:
    """Each sync commits exactly the bytes it carried, or is refused; none frees what the
    other's receivers still read. A receiver at 5 or 6 holds exactly the new weights; one
    still at 0 holds, tensor by tensor, its zeros or the new weights (both syncs carry the
    same bytes, and a failed in-place sync leaves the buckets it loaded written: loads
    form a prefix, docs/weight-sync.md), never anything else. (Both may fail: each sync
    can hold a plain actor the other needs, and then both wait out their timeout.)"""
    n = 8
    names = tuple(_model(0, n))
    t0, t1, e0, e1 = _nodes(4)
    try:
        call(t0, _trainer, n, 71, names[::2])
        call(t1, _trainer, n, 71, names[1::2])
        for e in (e0, e1):
            call(e, _receiver, n)
            call(e, _arm, 0.1)
        want = _merged([t0, t1])
        out: list[Any] = []

        def one(v: int) -> None:
            try:
                # A short timeout: when each sync holds an actor the other needs, both
                # wait it out (the sync itself takes about 2 s).
                out.append(sync([t0, t1], [e0, e1], version=v, timeout_s=15))
            except BaseException as err:
                out.append(err)

        ths = [threading.Thread(target=one, args=(v,)) for v in (5, 6)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        assert len(out) == 2, out
        for o in out:
            # Refused as stale, superseded by the newer one before it committed, or timed
            # out waiting for an actor the other sync held.
            assert not isinstance(o, BaseException) or isinstance(o, WeightSyncError), o
        zeros = {k: digest([torch.zeros(SHAPE)])[0] for k in names}
        for e in (e0, e1):
            version = call(e, _version)
            assert version in (0, 5, 6)
            got = call(e, _digests)
            if version:
                assert got == want
            else:
                assert all(got[k] in (zeros[k], want[k]) for k in names), got
        for o in out:
            if not isinstance(o, BaseException):
                assert [call(e, _version) for e in (e0, e1)] == [o.version] * 2
        _drained([t0, t1])
    finally:
        _kill(t0, t1, e0, e1)


def _orphan_offer(actor: Any) -> None:
    """A many-rank offer whose driver died before it asked the rank to hold."""
    from ray_rdt_pool.weights.rank_offer import remote_offer

    remote_offer(actor, "weight_sender", "orphan", None, "stream", 0.5)


def test_an_offer_whose_driver_died_is_freed_by_a_later_plain_stream(cluster: None) -> None:
    n = 4
    trainer, e = _nodes(2)
    try:
        call(trainer, _trainer, n, 81, source_reads=False)
        call(e, _receiver, n)
        call(trainer, _orphan_offer)  # its driver gave timeout_s=0.5
        assert call(trainer, held)[0] > 0
        time.sleep(1.5)  # past 2 * timeout_s
        sync(trainer, [e], timeout_s=30)
        _drained([trainer])
    finally:
        _kill(trainer, e)


def test_a_failed_many_rank_publish_does_not_advance_the_ranks_version(
        cluster: None) -> None:
    n = 4
    names = tuple(_model(0, n))
    t0, t1, e = _nodes(3)
    try:
        call(t0, _trainer, n, 91, names[::2])
        call(t1, _trainer, n, 91, names[1::2])
        call(e, _receiver_without, n, names[0])  # strict: a mismatch refuses the sync
        with pytest.raises(ManifestMismatchError):
            sync([t0, t1], [e], mode="publish", timeout_s=30)
        assert [call(t, _sender_version) for t in (t0, t1)] == [0, 0]
        _drained([t0, t1])
    finally:
        _kill(t0, t1, e)


# ---------------------------------------------------------------------------------------
# A sync is a few Ray calls, whatever its bucket count
# ---------------------------------------------------------------------------------------


def _trainer_buckets(actor: Any, n: int, bucket: int) -> None:
    actor.state = _model(5, n)
    actor.weight_sender = WeightSender(actor.state, bucket_bytes=bucket)


@pytest.mark.parametrize("relay", [None, "chain"], ids=["fan-out", "relay"])
def test_the_ray_calls_of_a_sync_do_not_grow_with_its_buckets(cluster: None,
                                                              relay: str | None) -> None:
    n = 16
    trainer, *rs = _nodes(3)
    try:
        for r in rs:
            call(r, _receiver, n)
        calls = {}
        version = 0
        for per_bucket in (4, 1):  # 4 and 16 buckets of the same model
            call(trainer, _trainer_buckets, n, per_bucket * BUCKET)
            version += 1
            before = [call(a, _ray_calls) for a in (trainer, *rs)]
            rep = sync(trainer, rs, relay=relay, version=version, timeout_s=60)
            after = [call(a, _ray_calls) for a in (trainer, *rs)]
            assert rep.buckets == n // per_bucket
            assert call(rs[-1], _digests) == call(trainer, _sender_digests)
            calls[rep.buckets] = (rep.ray_calls, [b - a for a, b in zip(before, after)])
        # The driver's one call, then begin, receive and commit per receiver; receivers
        # make no Ray call of their own.
        assert calls[4] == calls[16] == (1 + 3 * 2, [3 * 2, 0, 0]), calls
    finally:
        _kill(trainer, *rs)


def _ray_calls(actor: Any) -> int:
    return int(ray_rdt_pool.stats().weight_sync_ray_calls)
