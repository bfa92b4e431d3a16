"""Weight sync into inference engines, without Ray: caller versions, lazy sources,
load_weights receivers and async receivers. The stream protocol runs in-process, with
``ray.get`` replaced by the identity; tests/integration/test_weights_engine.py runs the
same on a cluster.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ray import cloudpickle

from ray_rdt_pool.errors import (
    DuplicateTargetError,
    MissingWeightsError,
    ShapeMismatchError,
)
from ray_rdt_pool.weights import (
    DuplicateNameError,
    LoaderError,
    Manifest,
    SourceExhaustedError,
    StaleVersionError,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
)
from ray_rdt_pool.weights.advanced import BucketLayout, WeightLayout, plan_layout

BUCKET = 4096


SPEC = {f"w{i}": (32, 32) for i in range(6)}  # 4 KiB each: one bucket per tensor


def make_state(seed: int, spec: dict[str, tuple[int, ...]] = SPEC) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) for k, shape in spec.items()}


def pairs_of(state: dict[str, torch.Tensor], dup_at: int | None = None
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """A generator source that makes a new tensor per name (as a gather would)."""
    for i, (k, v) in enumerate(state.items()):
        if dup_at is not None and i == dup_at:
            yield "w0", v.clone()
        yield k, v.clone()


def test_lazy_source_buckets_like_a_mapping() -> None:
    state = {f"t{i}": torch.zeros(1000 + i) for i in range(10)}
    want = plan_layout(state, bucket_bytes=10_000)[0]
    for source in (lambda: iter(state.items()), lambda: list(state.items()),
                   lambda: ((k, v * 1) for k, v in state.items())):
        assert WeightSender(source, bucket_bytes=10_000).layout() == want


def test_one_shot_iterator_then_callable() -> None:
    state = make_state(1)
    sender = WeightSender(iter(state.items()), bucket_bytes=BUCKET)
    assert len(sender.layout().entries) == len(state)
    with pytest.raises(SourceExhaustedError, match="callable"):
        sender.layout()
    calls = []

    def fresh() -> Iterator[tuple[str, torch.Tensor]]:
        calls.append(1)
        return pairs_of(state)

    sender = WeightSender(fresh, bucket_bytes=BUCKET)
    assert sender.layout() == sender.layout() and len(calls) == 2


def test_duplicate_name_is_typed_and_named() -> None:
    with pytest.raises(DuplicateNameError, match="'w0'") as info:
        WeightSender(lambda: pairs_of(make_state(1), dup_at=3), bucket_bytes=BUCKET).layout()
    assert info.value.name == "w0" and info.value.bucket == 2
    assert isinstance(info.value, WeightSyncError)


def test_new_errors_pickle_with_their_fields() -> None:
    e = cloudpickle.loads(cloudpickle.dumps(StaleVersionError(3, 7)))
    assert (e.version, e.current) == (3, 7) and "3" in str(e) and "7" in str(e)
    d = cloudpickle.loads(cloudpickle.dumps(DuplicateNameError("x", 2, (0, 1), "why")))
    assert (d.name, d.bucket, d.applied) == ("x", 2, (0, 1)) and "why" in str(d)
    le = cloudpickle.loads(cloudpickle.dumps(LoaderError("boom", 4, ("a", "b"))))
    assert (le.bucket, le.names) == (4, ("a", "b"))


def _manifest(layout: WeightLayout, version: int, groups: list[list[torch.Tensor]]
              ) -> Manifest:
    # With ray.get patched to the identity, a bucket's "ref" is its tensor list.
    return Manifest(layout, [[list(g)] for g in groups], version)  # type: ignore[list-item]


@pytest.fixture
def no_ray_get(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(ray, "get", lambda ref, **kw: ref)


def test_versions_stale_and_failed_loads(no_ray_get: None) -> None:
    src, dest = make_state(1), make_state(2)
    layout, groups = plan_layout(src, BUCKET)
    rec = WeightReceiver(dest, direct=False)
    assert rec.version == 0
    rec.load(_manifest(layout, 10, groups))
    assert rec.version == 10 and all(torch.equal(dest[k], src[k]) for k in src)
    for stale in (10, 9):
        with pytest.raises(StaleVersionError, match="version 10") as info:
            rec.load(_manifest(layout, stale, groups))
        assert info.value.current == 10
    bad = [list(g) for g in groups]
    bad[2] = []  # bucket 2 fails midway: it holds none of the tensors its layout lists
    with pytest.raises(WeightSyncError, match="bucket 2 arrived as 0 tensor"):
        rec.load(_manifest(layout, 11, bad))
    assert rec.version == 10
    m = _manifest(layout, 11, groups)
    m.id = "publish-11"
    rec.load(m, release=False)
    assert rec.version == 11
    rec.load(m)  # the manifest loaded last may be loaded again (release=False re-loads)
    with pytest.raises(StaleVersionError):
        rec.load(_manifest(layout, 11, groups))  # another manifest of version 11


def test_concurrent_loads_of_one_version_one_wins(no_ray_get: None) -> None:
    layout, groups = plan_layout(make_state(1), BUCKET)
    rec = WeightReceiver(make_state(2), direct=False)
    results: list[Any] = []

    def run() -> None:
        try:
            results.append(rec.load(_manifest(layout, 5, groups)).version)
        except StaleVersionError as e:
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(5) == 1
    assert sum(isinstance(r, StaleVersionError) for r in results) == 3


def test_load_weights_gets_mapped_names_and_errors_are_typed(no_ray_get: None) -> None:
    src = make_state(1)
    layout, groups = plan_layout(src, BUCKET)
    seen: dict[str, torch.Tensor] = {}

    def load_weights(batch: Any) -> None:
        for name, t in batch:
            seen[name] = t.clone()

    dest = {"w0": torch.zeros(32, 32)}  # w0 goes to dest, the rest to the loader
    rec = WeightReceiver(dest, load_weights=load_weights, direct=False,
                         name_map=lambda n: None if n == "w5" else n.upper() if n != "w0" else n)
    plan = rec.check(layout)
    assert plan.skipped == 1 and plan.buckets[1].loads == [(0, "W1")]
    rep = rec.load(_manifest(layout, 1, groups))
    assert rep.skipped == 1 and torch.equal(dest["w0"], src["w0"])
    assert set(seen) == {"W1", "W2", "W3", "W4"}
    assert all(torch.equal(seen[k.upper()], src[k]) for k in ("w1", "w2", "w3", "w4"))
    # two manifest names onto one loader name
    with pytest.raises(DuplicateTargetError):
        WeightReceiver(load_weights=load_weights, name_map=lambda n: "same").check(layout)

    def failing(batch: Any) -> None:
        for name, _t in batch:
            if name == "w3":
                raise KeyError(f"unknown parameter {name}")

    rec = WeightReceiver(load_weights=failing)
    with pytest.raises(LoaderError, match=r"bucket 3 .*'w3'") as info:
        rec.load(_manifest(layout, 1, groups))
    assert isinstance(info.value.__cause__, KeyError) and info.value.names == ("w3",)
    assert rec.version == 0
    with pytest.raises(Exception, match="dest"):
        WeightReceiver()


def _spec(layout: WeightLayout, k: int) -> BucketLayout:
    return BucketLayout(layout.buckets[k], tuple(e for e in layout.entries if e.bucket == k))


def test_stream_protocol_out_of_order_lazy_and_missing(no_ray_get: None) -> None:
    src = make_state(1)
    layout, groups = plan_layout(src, BUCKET)
    n = len(groups)
    # Whole layout; buckets arrive out of order: early ones are held, then loaded in order.
    dest = make_state(2)
    rec = WeightReceiver(dest, direct=False)
    rec._begin_stream("s1", layout, 3)
    order = [1, 2, 0, 4, 3, 5]
    loaded = [[r.bucket for r in rec._load_stream_bucket("s1", k, [list(groups[k])])]
              for k in order]
    assert loaded == [[], [], [0, 1, 2], [], [3, 4], [5]]
    assert all(torch.equal(dest[k], src[k]) for k in src)
    assert rec.version == 0  # every bucket is in, but only the sender's finish commits
    assert rec._finish_stream("s1", n) == 0 and rec.version == 3
    with pytest.raises(StaleVersionError):
        rec._begin_stream("s2", layout, 3)
    # Lazy: each bucket brings its layout; a mismatch stops at that bucket.
    dest = make_state(2)
    dest["w3"] = torch.zeros(31, 32)
    rec = WeightReceiver(dest, direct=False)
    rec._begin_stream("s3", None, 1)
    for k in range(3):
        rec._load_stream_bucket("s3", k, [list(groups[k])], _spec(layout, k))
    with pytest.raises(ShapeMismatchError, match=r"bucket 3 was not written; bucket\(s\) 0-2"):
        rec._load_stream_bucket("s3", 3, [list(groups[3])], _spec(layout, 3))
    with pytest.raises(WeightSyncError, match="skipped"):
        rec._load_stream_bucket("s3", 4, [list(groups[4])], _spec(layout, 4))
    assert rec.version == 0
    # Lazy, strict: a destination tensor nobody sent is found at the end.
    dest = make_state(2)
    dest["extra"] = torch.zeros(2)
    rec = WeightReceiver(dest, direct=False)
    rec._begin_stream("s4", None, 1)
    for k in range(n):
        rec._load_stream_bucket("s4", k, [list(groups[k])], _spec(layout, k))
    with pytest.raises(MissingWeightsError, match="'extra'"):
        rec._finish_stream("s4", n)
    assert rec.version == 0


def test_load_async_runs_in_a_thread(no_ray_get: None) -> None:
    layout, groups = plan_layout(make_state(1), BUCKET)
    loop_thread: list[int] = []

    def slow(batch: Any) -> None:
        loop_thread.append(threading.get_ident())
        time.sleep(0.05)

    rec = WeightReceiver(load_weights=slow)

    async def main() -> list[Any]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        tick = asyncio.create_task(ticker())
        res = await asyncio.gather(rec.load_async(_manifest(layout, 1, groups)),
                                   rec.load_async(_manifest(layout, 1, groups)),
                                   return_exceptions=True)
        tick.cancel()
        assert ticks > 5  # the loop kept running during the loads
        return list(res)

    res = asyncio.run(main())
    assert sum(isinstance(r, StaleVersionError) for r in res) == 1
    assert threading.get_ident() not in loop_thread
