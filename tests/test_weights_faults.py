"""Weight sync under races and partial failures, in process (no cluster).

A :class:`WeightSender`'s ``stream()`` and real :class:`WeightReceiver` s run in this
process: a stand-in for Ray runs each ``__ray_call__`` at once, in the order the calls
are made (as a plain actor runs one caller's calls), and the transport is a ``Runtime``
over the fake NIXL of tests/fakenixl.py (``same_node="off"``: every bucket is READ). Each
test stages one interleaving or failure that real Ray makes hard to hit on demand; the
real-Ray counterparts are in test_weights.py and test_weights_engine.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ray_rdt_pool.transport as T
from ray_rdt_pool.config import PoolConfig
from ray_rdt_pool.errors import PoolExhaustedError
from ray_rdt_pool.transport import Runtime, free_owned, put_owned
from ray_rdt_pool.weights import (
    Manifest,
    WeightLayout,
    WeightReceiver,
    WeightSender,
    plan_layout,
)
from tests.fakenixl import World

# ---------------------------------------------------------------------------------------
# The stand-in for Ray
# ---------------------------------------------------------------------------------------


class _Ref:
    """A finished call: its value or its error."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        try:
            self.value = fn()
        except BaseException as e:
            self.error = e


def _get(ref: Any, timeout: float | None = None) -> Any:
    if isinstance(ref, list):
        return [_get(r) for r in ref]
    if not isinstance(ref, _Ref):
        return ref  # a manifest bucket's "ref" is its tensor list
    if ref.error is not None:
        raise ref.error
    return ref.value


class Actor:
    """An actor instance: holds a ``weight_receiver``."""

    weight_receiver: WeightReceiver


class Handle:
    """An actor handle: ``__ray_call__.remote(fn, *args)`` runs ``fn(actor, *args)`` now."""

    _count = 0

    def __init__(self, actor: Actor) -> None:
        Handle._count += 1
        n = Handle._count
        self._actor_id = type("Id", (), {"hex": lambda self: f"{n:032x}"})()
        self.actor = actor
        handle = self

        class Call:
            @staticmethod
            def remote(fn: Callable[..., Any], *args: Any) -> _Ref:
                # Ray pickles a task's arguments: the receiver gets its own lists.
                copied = tuple(list(a) if isinstance(a, list) else a for a in args)
                return _Ref(lambda: fn(handle.actor, *copied))

        self.__ray_call__ = Call


@pytest.fixture()
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Runtime]]:
    """``make(**config)``: this process's transport, over the fake NIXL, with Ray's
    ``get`` and ``wait`` standing in for finished calls."""
    import ray

    monkeypatch.setattr(ray, "get", _get)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (refs, []))
    made: list[Runtime] = []

    def make(**cfg: Any) -> Runtime:
        cfg.setdefault("pool_bytes", 1 << 20)
        cfg.setdefault("arena_bytes", 1 << 20)
        world = World()
        rt = Runtime(PoolConfig(metrics=False, same_node="off", **cfg),
                     backend_factory=world.factory, directory=world, node_id=lambda: "n1")
        monkeypatch.setattr(T, "_runtime", rt)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.shutdown()


def receiver_node(dest: Any, cls: type[WeightReceiver] = WeightReceiver, **opts: Any
                  ) -> tuple[Actor, Handle]:
    a = Actor()
    a.weight_receiver = cls(dest, **opts)
    return a, Handle(a)


def filled(value: float, n: int = 6) -> dict[str, torch.Tensor]:
    """``w0`` .. ``w{n-1}``, 4 KiB each (one bucket each at 4 KiB buckets), all ``value``."""
    return {f"w{i}": torch.full((32, 32), float(value)) for i in range(n)}


def manifest(version: int, state: dict[str, torch.Tensor], mid: str = ""
             ) -> tuple[WeightLayout, list[list[torch.Tensor]], Manifest]:
    """A manifest whose bucket "refs" are the tensor lists themselves (ray.get is the
    identity for them here)."""
    layout, groups = plan_layout(state, 4096)
    refs: list[Any] = [[list(g)] for g in groups]
    return layout, groups, Manifest(layout, refs, version, id=mid or f"m{version}")


def values(dest: dict[str, torch.Tensor]) -> list[float]:
    return [float(t.flatten()[0]) for t in dest.values()]


class FailingReceiver(WeightReceiver):
    """Fails on bucket ``fail_at`` (None: never), as a failed READ or loader would."""

    fail_at: int | None = None

    def _load_bucket(self, plan: Any, ref: Any, *rest: Any) -> Any:
        if plan.index == self.fail_at:
            raise RuntimeError(f"injected failure on bucket {plan.index}")
        return super()._load_bucket(plan, ref, *rest)


# ---------------------------------------------------------------------------------------
# Finding 3: a pool that holds fewer than max_inflight buckets
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("lazy", [False, True], ids=["mapping", "lazy"])
def test_a_pool_of_one_bucket_streams_without_waiting_for_itself(runtime: Any,
                                                                 lazy: bool) -> None:
    """pool_bytes == bucket_bytes with max_inflight=2: the sender retires the
    acknowledged bucket to make room (it used to wait for timeout_s for a free that
    only it could make, then raise WeightSyncTimeoutError)."""
    rt = runtime(pool_bytes=64 << 10)
    state = {f"w{i}": torch.randn(8 << 10) for i in range(4)}  # 32 KiB each, 2 a bucket
    r1, h1 = receiver_node({k: torch.zeros_like(v) for k, v in state.items()})
    src: Any = (lambda: iter(state.items())) if lazy else state
    sender = WeightSender(src, bucket_bytes=64 << 10, source_reads=False)
    rep = sender.stream([h1], max_inflight=2, timeout_s=5.0)
    assert rep.buckets == 2 and rep.fallbacks == 0 and rep.peak_pool_used == 64 << 10
    assert all(torch.equal(r1.weight_receiver.dest[k], v)  # type: ignore[index]
               for k, v in state.items())
    assert r1.weight_receiver.version == 1
    st = rt.stats()
    assert st.pool_used == 0 and st.live_objects == 0 and st.fallbacks == 0


def test_a_pool_of_two_buckets_shared_with_another_object(runtime: Any) -> None:
    """Another object holds a page of a pool of exactly 2 buckets: the second bucket
    fits once the first is retired (it used to time out)."""
    rt = runtime(pool_bytes=64 << 10)
    put_owned("other", [torch.zeros(1024)])  # 4 KiB held by something else meanwhile
    try:
        state = {f"w{i}": torch.randn(8 << 10) for i in range(4)}
        r1, h1 = receiver_node({k: torch.zeros_like(v) for k, v in state.items()})
        sender = WeightSender(state, bucket_bytes=32 << 10, source_reads=False)
        rep = sender.stream([h1], max_inflight=2, timeout_s=5.0)
        assert rep.buckets == 4 and rep.fallbacks == 0
        assert all(torch.equal(r1.weight_receiver.dest[k], v)  # type: ignore[index]
                   for k, v in state.items())
        assert rt.stats().live_objects == 1  # only "other"
    finally:
        free_owned("other")
    assert rt.stats().pool_used == 0


@pytest.mark.parametrize("lazy", [False, True], ids=["mapping", "lazy"])
def test_a_bucket_larger_than_the_pool_fails_at_once(runtime: Any, lazy: bool) -> None:
    """A bucket the pool can never hold: PoolExhaustedError naming the sizes and the fix
    long before timeout_s, nothing put, nothing held, no receiver committed."""
    rt = runtime(pool_bytes=64 << 10)
    state = {"small": torch.randn(1024), "huge": torch.randn(32 << 10)}  # 128 KiB
    r1, h1 = receiver_node({k: torch.zeros_like(v) for k, v in state.items()})
    src: Any = (lambda: iter(state.items())) if lazy else state
    sender = WeightSender(src, bucket_bytes=4096, source_reads=False)
    t0 = time.monotonic()
    with pytest.raises(PoolExhaustedError, match="lower bucket_bytes or raise pool_bytes"):
        sender.stream([h1], timeout_s=60.0)
    assert time.monotonic() - t0 < 30.0
    st = rt.stats()
    assert st.pool_used == 0 and st.live_objects == 0 and st.fallbacks == 0
    assert r1.weight_receiver.version == 0


def test_a_converting_bucket_waits_for_one_free_block(runtime: Any) -> None:
    """A wire_dtype bucket packs into one contiguous block. With the pool's free bytes
    enough but split in two, the stream waits for a block that holds it (here another
    object is freed 0.3 s later) instead of packing into overflow memory, which costs
    a fallback registration (it used to count free bytes only)."""
    rt = runtime(pool_bytes=64 << 10)
    for i in range(4):
        put_owned(f"o{i}", [torch.zeros(4 << 10)])  # 16 KiB each: the pool is full
    free_owned("o0")
    free_owned("o2")  # 32 KiB free, largest block 16 KiB
    state = {"w": torch.randn(16 << 10)}  # 64 KiB fp32, 32 KiB as bf16
    r1, h1 = receiver_node({"w": torch.zeros(16 << 10, dtype=torch.bfloat16)})
    sender = WeightSender(state, bucket_bytes=32 << 10, wire_dtype=torch.bfloat16,
                          source_reads=False)
    timer = threading.Timer(0.3, free_owned, ("o1",))
    timer.start()
    try:
        rep = sender.stream([h1], timeout_s=10.0)
    finally:
        timer.join()
        free_owned("o3")
    assert rep.fallbacks == 0 and rt.stats().fallbacks == 0
    assert torch.equal(r1.weight_receiver.dest["w"],  # type: ignore[index]
                       state["w"].to(torch.bfloat16))
    assert rt.stats().pool_used == 0


