"""Weight sync into inference engines: caller versions, lazy sources, load_weights
receivers, async receivers and the one-line worker set-up.

The in-process tests of the stream protocol are in
tests/unit/weights/test_weights_engine_logic.py. This module shares one cluster started with
``worker_process_setup_hook="ray_rdt_pool.setup_worker"``: its actors never call
``ray_rdt_pool.register()``.
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
from ray_rdt_pool.weights import (
    DuplicateNameError,
    LoaderError,
    Manifest,
    SourceExhaustedError,
    StaleVersionError,
    WeightReceiver,
    WeightSender,
    WeightSyncTimeoutError,
    sync,
)
from tests.support.raycluster import call, shared_actors, wait_drained, wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.ray

ENV = {"RAY_RDT_POOL_POOL_BYTES": "8M", "RAY_RDT_POOL_ARENA_BYTES": "16M",
       "RAY_RDT_POOL_METRICS": "0"}
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


# ---------------------------------------------------------------------------------------
# No Ray
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Ray: one cluster whose workers register the transport through the setup hook
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def actors(ray_cluster: str) -> Iterator[dict[str, Any]]:
    import ray

    ray_rdt_pool.register()  # the driver, before defining the actor classes

    @ray.remote(enable_tensor_transport=True)
    class Node:  # never calls ray_rdt_pool.register(): the setup hook did
        def __init__(self) -> None:
            torch.set_num_threads(1)

        def put(self, n: int) -> list[Any]:
            return [ray.put([torch.arange(n, dtype=torch.float32)],
                            _tensor_transport="nixl_pool")]

        @ray.method(tensor_transport="nixl_pool")
        def ret(self, n: int) -> list[torch.Tensor]:
            return [torch.full((n,), 2.0)]

        def total(self, box: list[Any]) -> float:
            return float(ray.get(box[0])[0].sum())

        def consume(self, tensors: list[torch.Tensor]) -> float:
            return float(tensors[0].sum())

    @ray.remote(enable_tensor_transport=True, max_concurrency=4)
    class AsyncNode:
        def __init__(self) -> None:
            torch.set_num_threads(1)

        async def ping(self) -> str:
            return "pong"

        async def load(self, manifest: Manifest) -> Any:
            return await self.weight_receiver.load_async(manifest)

    with shared_actors(ENV, {"trainer": Node, "r1": Node, "ar": AsyncNode},
                       setup_hook=True) as nodes:
        yield nodes


def _stats(node: Any) -> Any:
    return ray_rdt_pool.stats()


def _state(node: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in node.state.items()}


def _version(node: Any) -> int:
    return int(node.weight_receiver.version)


def _set_sender(node: Any, seed: int, lazy: str = "", dup_at: int | None = None) -> None:
    node.state = make_state(seed)
    src: Any = node.state
    if lazy == "callable":
        src = lambda: pairs_of(node.state, dup_at)  # noqa: E731
    elif lazy == "iterator":
        src = pairs_of(node.state, dup_at)
    node.weight_sender = WeightSender(src, bucket_bytes=BUCKET)


def _set_receiver(node: Any, seed: int, **opts: Any) -> None:
    node.state = make_state(seed)
    node.weight_receiver = WeightReceiver(node.state, **opts)


def _set_loader_receiver(node: Any, fail_on: str | None = None, sleep_s: float = 0.0) -> None:
    node.state = {}
    node.arena_seen = []

    def load_weights(batch: Any) -> None:
        st = ray_rdt_pool.stats()  # one node: the buckets are mapped views (same_node=map)
        node.arena_seen.append(st.arena_used + st.mapped_bytes)
        for name, t in batch:
            if name == fail_on:
                raise KeyError(f"the engine has no parameter {name!r}")
            node.state[name] = t.clone()
        time.sleep(sleep_s)

    node.weight_receiver = WeightReceiver(load_weights=load_weights)


def _publish(node: Any, version: int | None = None) -> Manifest:
    return node.weight_sender.publish(version=version)


def _load(node: Any, manifest: Manifest) -> Any:
    return node.weight_receiver.load(manifest)


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_setup_hook_registers_the_transport_in_every_worker(actors: dict[str, Any]) -> None:
    import ray

    tr, r1 = actors["trainer"], actors["r1"]
    put0 = call(tr, _stats).objects_put
    box = ray.get(tr.put.remote(100), timeout=60)
    assert ray.get(r1.total.remote(box), timeout=60) == sum(range(100))
    assert ray.get(r1.consume.remote(tr.ret.remote(10)), timeout=60) == 20.0
    assert call(tr, _stats).objects_put >= put0 + 2  # both went through nixl_pool
    del box
    wait_drained(tr)


def test_caller_versions_publish_and_stream(actors: dict[str, Any]) -> None:
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _set_sender, 1)
    call(r1, _set_receiver, 2)
    m = call(tr, _publish, 10)
    assert m.version == 10 and call(r1, _load, m).version == 10
    m = call(tr, _publish, 10)
    with pytest.raises(StaleVersionError, match="version 10 is not newer"):
        call(r1, _load, m)
    del m
    put0 = call(tr, _stats).objects_put
    with pytest.raises(StaleVersionError):
        sync(tr, [r1], version=7)
    assert call(tr, _stats).objects_put == put0  # refused before any bucket was put
    assert sync(tr, [r1], version=11).version == 11
    assert sync(tr, [r1]).version == 12  # counts up from the caller's last version
    assert call(r1, _version) == 12
    assert_equal(call(r1, _state), call(tr, _state))
    wait_drained(tr)


def test_lazy_stream_bounded_and_exact(actors: dict[str, Any]) -> None:
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _set_sender, 3, "callable")
    call(r1, _set_receiver, 4)
    for mode in ("stream", "publish", "stream"):
        # The published buckets go back only once Ray frees their refs, which may land
        # after the next sync began: each stream's peak is its own only from an empty pool.
        wait_drained(tr)
        rep = sync(tr, [r1], mode=mode)  # type: ignore[arg-type]
        assert rep.buckets == len(SPEC) and rep.loads[0].buckets == len(SPEC)
        if mode == "stream":
            assert rep.stream is not None and rep.stream.fallbacks == 0
            assert rep.stream.peak_pool_used <= 2 * BUCKET
        assert_equal(call(r1, _state), call(tr, _state))
    assert call(r1, _version) == 3
    wait_drained(tr)


def test_one_shot_iterator_second_sync_raises(actors: dict[str, Any]) -> None:
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _set_sender, 5, "iterator")
    call(r1, _set_receiver, 6)
    sync(tr, [r1])
    with pytest.raises(SourceExhaustedError, match="callable"):
        sync(tr, [r1])
    wait_drained(tr)


def test_lazy_duplicate_name_reports_applied_buckets(actors: dict[str, Any]) -> None:
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _set_sender, 7, "callable", 3)
    call(r1, _set_receiver, 8)
    v0 = call(r1, _version)
    with pytest.raises(DuplicateNameError, match=r"'w0'.*bucket\(s\) 0-1 were loaded") as info:
        sync(tr, [r1])
    assert info.value.applied == (0, 1)
    assert call(r1, _version) == v0
    with pytest.raises(DuplicateNameError, match="published nothing"):
        call(tr, _publish)
    wait_drained(tr)


def test_load_weights_receiver_arena_returns(actors: dict[str, Any]) -> None:
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _set_sender, 9)
    call(r1, _set_loader_receiver)
    for mode in ("stream", "publish"):
        rep = sync(tr, [r1], mode=mode)  # type: ignore[arg-type]
        assert rep.loads[0].copied_buckets == len(SPEC)
        assert_equal(call(r1, _state), call(tr, _state))
        assert all(u > 0 for u in call(r1, lambda n: n.arena_seen))  # views, not copies
        # Every block (or lease) came back once the loader returned.
        wait_for(lambda: (x := call(r1, _stats)).arena_used == 0 and x.mapped_objects == 0,
                 timeout=10)
    call(r1, _set_loader_receiver, "w2")
    v0 = call(r1, _version)
    for mode in ("stream", "publish"):
        with pytest.raises(LoaderError, match=r"bucket 2 .*'w2'") as info:
            sync(tr, [r1], mode=mode)  # type: ignore[arg-type]
        assert "KeyError" in str(info.value)
        assert call(r1, _stats).arena_used == 0
        assert call(r1, _version) == v0
    wait_drained(tr)


def _stream_or_timeout(node: Any, receivers: list[Any], timeout_s: float) -> str:
    try:
        return f"ok {node.weight_sender.stream(receivers, timeout_s=timeout_s).version}"
    except WeightSyncTimeoutError as e:
        return f"timeout {e}"


def test_a_stream_the_sender_gave_up_on_never_commits(actors: dict[str, Any]) -> None:
    """The trainer's stream() times out waiting for a slow receiver (0.4 s per bucket,
    timeout_s=0.2) and raises; the receiver finishes the bucket it is loading, and a
    receiver used to commit the version on its own once its last bucket landed. Only
    the sender's commit, sent once every receiver has every bucket, commits: the version
    stays, and the next default-versioned sync (a new version) commits."""
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _set_sender, 13)
    call(r1, _set_loader_receiver, None, 0.4)
    v0 = call(r1, _version)
    got = call(tr, _stream_or_timeout, [r1], 0.2)
    assert got.startswith("timeout") and "0.2s" in got and "receiver 0" in got, got
    # r1 runs its calls in order: its receive (stopped by the trainer's ABORT after the
    # bucket it was loading), the abort, then this call
    assert 0 < len(call(r1, _state)) < len(SPEC)  # a prefix was loaded ...
    assert call(r1, _version) == v0  # ... and never committed
    wait_drained(tr)
    rep = sync(tr, [r1])
    assert rep.version > v0 and call(r1, _version) == rep.version
    assert_equal(call(r1, _state), call(tr, _state))
    wait_drained(tr)


def test_async_receiver_serves_calls_during_load(actors: dict[str, Any]) -> None:
    import ray

    tr, ar = actors["trainer"], actors["ar"]
    call(tr, _set_sender, 11)
    call(ar, _set_loader_receiver, None, 0.3)  # 6 buckets x 0.3 s
    m = call(tr, _publish, 100)
    loads = [ar.load.remote(m), ar.load.remote(m)]  # one version, twice, concurrently
    time.sleep(0.5)
    t0 = time.monotonic()
    assert ray.get(ar.ping.remote(), timeout=30) == "pong"
    assert time.monotonic() - t0 < 1.0
    assert len(ray.wait(loads, num_returns=2, timeout=0)[1]) >= 1  # a load still running
    outcomes = []
    for ref in loads:
        try:
            outcomes.append(ray.get(ref, timeout=60).version)
        except StaleVersionError as e:
            outcomes.append(e)
    assert outcomes.count(100) == 1
    assert sum(isinstance(o, StaleVersionError) for o in outcomes) == 1
    del m
    # stream() into an async actor: its receive call runs off the actor's event loop,
    # which keeps serving while the buckets load (0.3 s each)
    call(ar, _set_loader_receiver, None, 0.3)
    call(tr, _set_sender, 12)
    box: list[Any] = []
    th = threading.Thread(target=lambda: box.append(sync(tr, [ar], version=101)))
    th.start()
    time.sleep(0.8)  # begun, a bucket or two into its loads
    t0 = time.monotonic()
    assert ray.get(ar.ping.remote(), timeout=30) == "pong"
    assert time.monotonic() - t0 < 1.0  # not after the ~1.8 s of loads
    assert th.is_alive()  # the stream still runs
    th.join(60)
    rep = box[0]
    assert rep.loads[0].buckets == len(SPEC) and call(ar, _version) == 101
    assert_equal(call(ar, _state), call(tr, _state))
    wait_drained(tr)
