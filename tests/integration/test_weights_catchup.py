"""Catch-up from a peer engine (``catch_up(peer, receivers)``) on a real one-host Ray
cluster with real NIXL: an engine killed and restarted reaches the running engines'
version from one of them with the trainer dead, byte-exact; down a relay chain; an
older or equal version is refused; a peer that cannot serve, a receiver that needs
another shard, and bad arguments are typed errors; a trainer's sync into the peer waits
for the catch-up instead of changing its weights under the reads.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ray import cloudpickle

import ray_rdt_pool
from ray_rdt_pool.errors import InvalidInputError, SelectError, ShapeMismatchError
from ray_rdt_pool.weights import (
    StaleVersionError,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    catch_up,
    sync,
)
from tests.support.raycluster import NodePool, call, digest, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, SHAPE, BUCKET = 8, (64, 64), 64 * 64 * 4


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(SHAPE, generator=g) for i in range(N)}


def _trainer(actor: Any) -> None:
    actor.state = _model(1)
    actor.weight_sender = WeightSender(actor.state, bucket_bytes=BUCKET)


def _step(actor: Any) -> None:
    with torch.no_grad():
        for t in actor.state.values():
            t.view(torch.int32).add_(3)


def _engine(actor: Any, rows: int | None = None, slow: float = 0.0, rank: int = 0) -> None:
    """An engine: its weights under the trainer's names mapped to its own (``name_map``),
    as an engine that renames does; ``rows``: a TP shard of that many rows, rank
    ``rank``'s."""

    def select(name: str, shape: tuple[int, ...]) -> Any:
        return None if rows is None else (slice(rank * rows, (rank + 1) * rows),)

    class Slow(WeightReceiver):
        def _load_bucket(self, *a: Any) -> Any:
            time.sleep(slow)
            return super()._load_bucket(*a)

    shape = SHAPE if rows is None else (rows, SHAPE[1])
    actor.dest = {f"model.{k}": torch.zeros(shape) for k in _model(0)}
    actor.weight_receiver = Slow(actor.dest, name_map=lambda n: f"model.{n}",
                                 select=select if rows is not None else None)


def _loader_engine(actor: Any) -> None:
    actor.weight_receiver = WeightReceiver(load_weights=lambda pairs: None)


def _digests(actor: Any) -> list[str]:
    return digest(list(actor.dest.values()))


def _version(actor: Any) -> int:
    return int(actor.weight_receiver.version)


def _trainer_digests(actor: Any) -> list[str]:
    return digest(list(actor.state.values()))


def _drained(actor: Any) -> bool:
    st = ray_rdt_pool.stats()
    return bool(st.live_objects == 0 and st.pool_used == 0 and st.signal_sessions == 0
                and st.signals_waiting == 0)


#: The shared cluster's settings for this module's actors: small pools.
ENV = {"RAY_RDT_POOL_POOL_BYTES": "8M", "RAY_RDT_POOL_ARENA_BYTES": "8M"}


#: This module's actors, handed out again from one test to the next.
NODES = NodePool(ENV)


@pytest.fixture(scope="module")
def cluster(ray_cluster: str) -> Iterator[None]:
    yield
    NODES.close()


_nodes, _kill = NODES.take, NODES.give_back


@pytest.mark.parametrize("relay", [None, "chain"], ids=["fan-out", "relay"])
def test_a_restarted_engine_catches_up_from_a_peer_with_the_trainer_dead(
        cluster: None, relay: str | None) -> None:
    import ray

    trainer, e0, e1, e2 = _nodes(4)
    try:
        call(trainer, _trainer)
        for e in (e0, e1, e2):
            call(e, _engine)
        for _step_i in range(2):
            call(trainer, _step)
            v = sync(trainer, [e0, e1, e2], timeout_s=60).version
        want = call(trainer, _trainer_digests)
        ray.kill(e1)
        ray.kill(e2)
        ray.kill(trainer)  # the trainer is gone; the peer alone has the weights
        e1, e2 = _nodes(2, fresh=True)  # restarted engines: version 0, zeros
        for e in (e1, e2):
            call(e, _engine)
        rep = catch_up(e0, [e1, e2], relay=relay, timeout_s=60)
        assert rep.version == v and rep.ray_calls == 1 + 3 * 2
        for e in (e1, e2):
            assert call(e, _version) == v
            assert call(e, _digests) == want
        assert call(e0, _version) == v and call(e0, _digests) == want
        for e in (e0, e1, e2):
            wait_for(lambda e=e: call(e, _drained), timeout=30)
        # A receiver at the peer's version (or newer) refuses it, writing nothing.
        with pytest.raises(StaleVersionError):
            catch_up(e1, [e2], timeout_s=60)
    finally:
        _kill(trainer, e0, e1, e2)


def test_a_peer_that_cannot_serve_and_bad_arguments_are_typed(cluster: None) -> None:
    trainer, tp0, full, loader, tp1, tp0b = _nodes(6)
    try:
        call(trainer, _trainer)
        call(tp0, _engine, 32)  # TP rank 0: rows 0-31
        call(full, _engine)
        call(loader, _loader_engine)
        call(tp1, _engine, 32, 0.0, 1)  # rank 1: rows 32-63, the same shapes
        call(tp0b, _engine, 32)  # a restarted rank 0
        sync(trainer, [tp0], timeout_s=60)
        # A shard cannot fill a full engine: the shapes are named.
        with pytest.raises(ShapeMismatchError, match=r"shard|\(32, 64\)"):
            catch_up(tp0, [full], timeout_s=60)
        assert call(full, _version) == 0
        # Nor another rank's shard of the same shape: the rows are named.
        with pytest.raises(SelectError, match=r"holds \[0:32, 0:64\] .* selects \[32:64"):
            catch_up(tp0, [tp1], timeout_s=60)
        assert call(tp1, _version) == 0
        # The same rank's shard is served exactly, and serves on in turn.
        assert catch_up(tp0, [tp0b], timeout_s=60).version == call(tp0, _version)
        assert call(tp0b, _digests) == call(tp0, _digests)
        with pytest.raises(SelectError):
            catch_up(tp0b, [tp1], timeout_s=60)
        # An engine that loads through load_weights holds nothing by name.
        with pytest.raises(WeightSyncError, match="load_weights only"):
            catch_up(loader, [full], timeout_s=60)
        # An engine with no version yet has nothing to serve.
        with pytest.raises(WeightSyncError, match="no version yet"):
            catch_up(full, [tp0], timeout_s=60)
        with pytest.raises(InvalidInputError, match="cannot catch up from itself"):
            catch_up(tp0, [tp0, full])
        with pytest.raises(InvalidInputError, match="peer engine's actor handle"):
            catch_up([tp0], [full])  # type: ignore[arg-type]
        for e in (tp0, full):
            wait_for(lambda e=e: call(e, _drained), timeout=30)
    finally:
        _kill(trainer, tp0, full, loader, tp1, tp0b)


def test_a_trainer_sync_into_the_peer_waits_for_the_catch_up(cluster: None) -> None:
    """The peer serves a slow receiver; the trainer's next sync into the peer (a plain
    actor: its calls queue) starts only once the catch-up ended: the late engine gets
    exactly the peer's old version, and the peer then the new one."""
    trainer, peer, late = _nodes(3)
    try:
        call(trainer, _trainer)
        call(peer, _engine)
        call(late, _engine, None, 0.3)  # 8 buckets x 0.3 s
        v1 = sync(trainer, [peer], timeout_s=60).version
        old = call(peer, _digests)
        call(trainer, _step)
        out: dict[str, Any] = {}

        def trainer_sync() -> None:
            out["v2"] = sync(trainer, [peer], timeout_s=60).version

        th = threading.Thread(target=trainer_sync)
        rep_box: list[Any] = []
        cu = threading.Thread(target=lambda: rep_box.append(
            catch_up(peer, [late], timeout_s=60)))
        cu.start()
        time.sleep(0.5)
        th.start()
        cu.join(120)
        th.join(120)
        assert rep_box and rep_box[0].version == v1
        assert call(late, _digests) == old and call(late, _version) == v1
        assert out["v2"] > v1 and call(peer, _version) == out["v2"]
        assert call(peer, _digests) == call(trainer, _trainer_digests)
    finally:
        _kill(trainer, peer, late)


def test_a_peer_that_a_sync_wrote_in_part_refuses_to_serve(cluster: None) -> None:
    """The trainer's sync into the peer has written some buckets in place and not
    committed (the peer loads slowly): a catch-up from it then would hand out bytes of
    two versions under the old number, so it is a typed error and the late engine keeps
    its version; once the sync committed, the catch-up serves the new version exactly."""
    trainer, late = _nodes(2)
    # Threaded, as an engine that serves while it loads: its state can be read meanwhile.
    peer, = _nodes(1, max_concurrency=4)
    try:
        call(trainer, _trainer)
        call(peer, _engine, None, 0.3)  # 8 buckets x 0.3 s
        call(late, _engine)
        v1 = sync(trainer, [peer], timeout_s=60).version
        call(trainer, _step)
        handle = sync(trainer, [peer], timeout_s=60, wait=False)
        wait_for(lambda: call(peer, lambda self: self.weight_receiver._torn), 30)
        with pytest.raises(WeightSyncError, match="written in part"):
            catch_up(peer, [late], timeout_s=60)
        assert call(late, _version) == 0
        v2 = handle.result(120).version
        assert v2 > v1 and call(peer, _version) == v2
        rep = catch_up(peer, [late], timeout_s=60)
        assert rep.version == v2 and call(late, _version) == v2
        assert call(late, _digests) == call(trainer, _trainer_digests)
        assert all(call(a, _drained) for a in (trainer, peer, late))
    finally:
        _kill(trainer, peer, late)


def _beside(actor: Any, fn: Any) -> Any:
    """Run ``fn`` on ``actor`` beside a call that holds its own thread (a receive loop)."""
    import ray

    return ray.get(actor.__ray_call__.options(concurrency_group="_ray_system").remote(fn),
                   timeout=60)


def _loaded(actor: Any) -> int:
    st = actor.weight_receiver._stream
    return -1 if st is None else int(st.next)


@pytest.mark.parametrize("relay", [None, "chain"], ids=["fan-out", "relay"])
def test_a_peer_killed_mid_catch_up_leaves_the_receivers_free_for_a_retry(
        cluster: None, relay: str | None) -> None:
    """The peer dies while two slow receivers read from it: the catch-up is a typed error
    saying no receiver committed; by the time it is raised every receiver has dropped the
    stream (a receive loop waiting on the dead peer, or on the receiver before it in the
    chain, has ended), and a retry of the same version from another engine succeeds at
    once, byte-exact."""
    import ray

    trainer, p0, peer, r1, r2 = _nodes(5)
    try:
        call(trainer, _trainer)
        for e in (p0, peer):
            call(e, _engine)
        for r in (r1, r2):
            call(r, _engine, None, 0.3)  # 8 buckets x 0.3 s
        v1 = sync(trainer, [p0, peer], timeout_s=60).version
        box: dict[str, Any] = {}

        def doomed() -> None:
            try:
                box["rep"] = catch_up(peer, [r1, r2], relay=relay, timeout_s=60,
                                      bucket_bytes=BUCKET)
            except BaseException as e:
                box["error"] = e

        run = threading.Thread(target=doomed)
        run.start()
        wait_for(lambda: _beside(r1, _loaded) >= 1 or box, 60)
        assert not box, box
        ray.kill(peer)
        run.join(120)
        err = box.get("error")
        assert isinstance(err, WeightSyncError), box
        assert "died" in str(err) and "no receiver committed" in str(err), err
        for r in (r1, r2):
            assert _beside(r, _loaded) == -1  # no stream holds it
            assert call(r, _version) == 0
        rep = catch_up(p0, [r1, r2], relay=relay, timeout_s=60)
        assert rep.version == v1
        want = call(p0, _digests)
        for r in (r1, r2):
            assert call(r, _version) == v1 and call(r, _digests) == want
        assert all(call(a, _drained) for a in (p0, r1, r2))
    finally:
        _kill(trainer, p0, peer, r1, r2)


def _generate(actor: Any, seconds: float) -> str:
    time.sleep(seconds)  # a long request on the engine's one thread
    return "tokens"


def test_a_peer_that_dies_before_its_begin_ran_leaves_no_stream_behind(
        cluster: None) -> None:
    """The late engine is busy serving a request (its one thread), so the catch-up's
    begin waits in its queue; the peer dies meanwhile. The driver's abort reaches the
    engine first (on Ray's error-path thread) and finds nothing; the begin that runs
    later must not hold the engine at that version: a retry from another engine
    succeeds as soon as the request ended."""
    import ray

    trainer, p0, peer, late = _nodes(4)
    try:
        call(trainer, _trainer)
        for e in (p0, peer, late):
            call(e, _engine)
        v1 = sync(trainer, [p0, peer], timeout_s=60).version
        busy = late.__ray_call__.remote(_generate, 3.0)
        box: dict[str, Any] = {}

        def doomed() -> None:
            try:
                box["rep"] = catch_up(peer, [late], timeout_s=60)
            except BaseException as e:
                box["error"] = e

        run = threading.Thread(target=doomed)
        run.start()
        time.sleep(1.0)  # the begin is queued behind the request
        ray.kill(peer)
        run.join(120)
        assert isinstance(box.get("error"), WeightSyncError), box
        assert ray.get(busy, timeout=60) == "tokens"
        rep = catch_up(p0, [late], timeout_s=60)
        assert rep.version == v1 and call(late, _version) == v1
        assert call(late, _digests) == call(p0, _digests)
    finally:
        _kill(trainer, p0, peer, late)
