"""Syncs that overlap serving, on a real one-host Ray cluster with real NIXL: an engine
with ``staging="shadow"`` generates in a loop under ``serving()`` while
``sync(..., wait=False)`` runs; every output before the commit is from version v, every
one after it from v+1, never a mix; ``on_commit`` runs with the new version; a cancelled
sync commits nothing; the handle's errors are typed.
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

from ray_rdt_pool.errors import InvalidInputError
from ray_rdt_pool.weights import (
    SyncHandle,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightSyncTimeoutError,
    sync,
)
from tests.support.raycluster import NodePool, call

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, SHAPE, BUCKET = 16, (128, 128), 128 * 128 * 4


def _trainer(actor: Any, value: float) -> None:
    actor.state = {f"w{i}": torch.full(SHAPE, value) for i in range(N)}
    actor.weight_sender = WeightSender(actor.state, bucket_bytes=BUCKET)


def _set(actor: Any, value: float) -> None:
    for t in actor.state.values():
        t.fill_(value)


class _Slow(WeightReceiver):
    delay = 0.0

    def _load_bucket(self, *a: Any) -> Any:
        time.sleep(self.delay)
        return super()._load_bucket(*a)


def _engine(actor: Any, delay: float) -> None:
    """An engine that generates in a loop on a thread of its own, each output computed
    from all its weights under ``serving()``: (the value every weight holds, or -1 for a
    mix)."""
    actor.dest = {f"w{i}": torch.zeros(SHAPE) for i in range(N)}
    actor.commits = []
    actor.weight_receiver = _Slow(actor.dest, staging="shadow",
                                  on_commit=actor.commits.append)
    actor.weight_receiver.delay = delay
    actor.outputs = []
    actor.stop = threading.Event()

    def generate() -> None:
        while not actor.stop.is_set():
            with actor.weight_receiver.serving():
                means = {float(t.mean()) for t in actor.dest.values()}
                actor.outputs.append(means.pop() if len(means) == 1 else -1.0)
            time.sleep(0.001)

    actor.loop = threading.Thread(target=generate, daemon=True)
    actor.loop.start()


def _stop(actor: Any) -> tuple[list[float], list[int], int, int]:
    actor.stop.set()
    actor.loop.join(10)
    rec = actor.weight_receiver
    return actor.outputs, actor.commits, rec.version, rec.staging_bytes


#: The shared cluster's settings for this module's actors: small pools.
ENV = {"RAY_RDT_POOL_POOL_BYTES": "8M", "RAY_RDT_POOL_ARENA_BYTES": "8M"}
#: This module's actors (two threads: a serving loop beside the sync), handed out again
#: from one test to the next.
NODES = NodePool(ENV, max_concurrency=2)


@pytest.fixture(scope="module")
def cluster(ray_cluster: str) -> Iterator[None]:
    yield
    NODES.close()


def _nodes(n: int = 2) -> list[Any]:
    return NODES.take(n)


def test_an_engine_serves_one_version_or_the_next_during_a_background_sync(
        cluster: None) -> None:
    tr, eng = _nodes()
    try:
        call(tr, _trainer, 1.0)
        call(eng, _engine, 0.0)
        assert sync(tr, [eng], version=1, timeout_s=60).version == 1
        call(eng, lambda self: setattr(self.weight_receiver, "delay", 0.05))
        call(tr, _set, 2.0)
        handle = sync(tr, [eng], version=2, timeout_s=60, wait=False)
        assert isinstance(handle, SyncHandle) and not handle.done()  # the driver goes on
        with pytest.raises(WeightSyncTimeoutError, match="goes on"):
            handle.result(timeout=0.01)
        rep = handle.result(timeout=60)
        assert rep.version == 2 and handle.done() and not handle.cancel()
        outputs, commits, version, staging = call(eng, _stop)
        assert version == 2 and commits == [1, 2]
        assert staging == N * SHAPE[0] * SHAPE[1] * 4  # one more copy of the weights
        assert -1.0 not in outputs, "a forward pass saw two versions"
        assert outputs == sorted(outputs) and {1.0, 2.0} <= set(outputs)
    finally:
        NODES.give_back(tr, eng)


def test_a_cancelled_background_sync_commits_nothing(cluster: None) -> None:
    tr, eng = _nodes()
    try:
        call(tr, _trainer, 3.0)
        call(eng, _engine, 0.2)  # 16 buckets x 0.2 s
        handle = sync(tr, [eng], version=5, timeout_s=60, wait=False)
        time.sleep(1.0)
        assert handle.cancel()
        with pytest.raises(WeightSyncError, match="cancelled"):
            handle.result(timeout=60)
        outputs, commits, version, _staging = call(eng, _stop)
        assert version == 0 and commits == [] and set(outputs) == {0.0}
        with pytest.raises(InvalidInputError, match="wait must be True or False"):
            sync(tr, [eng], wait="no")  # type: ignore[call-overload]
    finally:
        NODES.give_back(tr, eng)


def _failing_hook(actor: Any) -> None:
    def hook(version: int) -> None:
        raise RuntimeError(f"prefix cache reset failed at {version}")

    actor.weight_receiver.on_commit = hook


@pytest.mark.parametrize("mode", ["stream", "publish"])
def test_a_hook_that_raises_is_typed_and_names_who_committed(cluster: None,
                                                             mode: str) -> None:
    """``on_commit`` raises on the second engine: the driver gets CommitHookError (through
    Ray, still that class) naming it, with both engines committed, and both hold the
    new version's bytes."""
    from ray_rdt_pool.weights import CommitHookError

    tr, e0, e1 = _nodes(3)
    try:
        call(tr, _trainer, 4.0)
        for e in (e0, e1):
            call(e, _engine, 0.0)
        call(e1, _failing_hook)
        with pytest.raises(CommitHookError, match="was committed on this receiver") as err:
            sync(tr, [e0, e1], mode=mode, version=7, timeout_s=60)
        assert (err.value.receiver, err.value.committed, err.value.version) == (1, (0, 1), 7)
        for e in (e0, e1):
            outputs, _commits, version, _staging = call(e, _stop)
            assert version == 7 and outputs[-1] == 4.0
    finally:
        NODES.give_back(tr, e0, e1)
