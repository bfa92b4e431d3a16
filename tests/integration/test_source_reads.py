"""Source reads: a weights stream whose receivers share the trainer's Ray node copies each
bucket straight out of the trainer's tensors (``process_vm_readv``), with no pool copy and
no NIXL READ.

What is promised (docs/weight-sync.md, "Source reads"): the bytes are exact; the trainer
keeps a bucket's tensors alive until every receiver has acknowledged it, and does not
return before; a bucket that cannot be read as it lies (a strided view, a wire-dtype
conversion) and every bucket of a stream with any receiver that cannot read the trainer
(another node, ``same_node="off"``, a kernel that forbids it) go through NIXL: read by
reference from the trainer's tensors for a module or mapping, through the pool otherwise
(tests/integration/test_multinode.py streams across two nodes); a read of a process that
is gone is a typed ``TransferError``, never a crash, and leaks no arena block.

The reader and the receiver runtime without Ray are in
tests/unit/same_node/test_source_reads_logic.py. This module shares one cluster.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ray import cloudpickle

import ray_rdt_pool
from ray_rdt_pool.weights import ReceiverError, WeightReceiver, WeightSender, sync
from ray_rdt_pool.weights.advanced import plan_layout
from tests.support.raycluster import call, node_class, shared_actors, wait_drained, wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---------------------------------------------------------------------------------------
# No Ray
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Real Ray and NIXL: one node
# ---------------------------------------------------------------------------------------

ENV = {"RAY_RDT_POOL_POOL_BYTES": "8M", "RAY_RDT_POOL_ARENA_BYTES": "8M",
       "RAY_RDT_POOL_METRICS": "0"}
BUCKET = 64 << 10


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(96, 64 + i, generator=g) for i in range(12)} | {
        "ids": torch.randint(0, 1 << 40, (5000,), generator=g)}


@pytest.fixture(scope="module")
def actors(ray_cluster: str) -> Iterator[dict[str, Any]]:
    ray_rdt_pool.register()
    Node = node_class()
    threaded = node_class(max_concurrency=4)
    off = (Node, {"RAY_RDT_POOL_SAME_NODE": "off"})
    with shared_actors(ENV, {"trainer": Node, "r1": Node, "r2": threaded, "off": off},
                       setup_hook=True) as nodes:
        yield nodes


def _set_sender(node: Any, seed: int, lazy: bool = False, **opts: Any) -> None:
    node.state = make_state(seed)
    if lazy:  # new tensors made just in time, dropped by the sender after their bucket
        src: Any = lambda: ((k, v.clone()) for k, v in node.state.items())  # noqa: E731
    else:
        src = node.state
    node.weight_sender = WeightSender(src, bucket_bytes=BUCKET, **opts)


def _set_receiver(node: Any, seed: int, **opts: Any) -> None:
    node.state = make_state(seed)
    node.weight_receiver = WeightReceiver(node.state, **opts)


def _state(node: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in node.state.items()}


def _stats(node: Any) -> Any:
    return ray_rdt_pool.stats()


def _mutate(node: Any) -> None:
    with torch.no_grad():
        for v in node.state.values():
            v.add_(1)


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.ray
@pytest.mark.parametrize("lazy", [False, True], ids=["mapping", "lazy"])
def test_stream_reads_the_trainers_tensors(actors: dict[str, Any], lazy: bool) -> None:
    tr, r1, r2 = actors["trainer"], actors["r1"], actors["r2"]
    call(tr, _set_sender, 1, lazy)
    for r in (r1, r2):
        call(r, _set_receiver, 2)
    before = {n: call(a, _stats) for n, a in (("tr", tr), ("r1", r1), ("r2", r2))}
    for _step in range(3):
        rep = sync(tr, [r1, r2], mode="stream", max_inflight=2)
        assert rep.stream is not None
        assert rep.stream.source_read_buckets == rep.buckets > 3
        assert rep.stream.peak_pool_used == 0
        want = call(tr, _state)
        assert_equal(call(r1, _state), want)
        assert_equal(call(r2, _state), want)  # threaded: buckets may arrive out of order
        call(tr, _mutate)  # the next step's weights; stream() returned, so this is safe
    after = {n: call(a, _stats) for n, a in (("tr", tr), ("r1", r1), ("r2", r2))}
    assert after["tr"].objects_put == before["tr"].objects_put  # nothing was packed
    for n in ("r1", "r2"):
        assert after[n].source_reads - before[n].source_reads == 3 * rep.buckets
        assert after[n].reads_posted == before[n].reads_posted
        assert after[n].mapped_gets == before[n].mapped_gets
        assert after[n].arena_used == 0
    wait_drained(tr)


def _count_stats(node: Any, on: bool) -> int:
    """Count the stream's stats() calls in this actor from now on (``on``), or stop and
    return the count."""
    from ray_rdt_pool.weights import stream

    if on:
        orig = stream.pool_stats
        node.stats_calls = 0

        def counted() -> Any:
            node.stats_calls += 1
            return orig()

        counted.orig = orig  # type: ignore[attr-defined]
        stream.pool_stats = counted  # type: ignore[assignment]
        return 0
    stream.pool_stats = stream.pool_stats.orig  # type: ignore[attr-defined]
    return int(node.stats_calls)


@pytest.mark.ray
def test_buckets_read_in_place_cost_no_pool_stats_each(actors: dict[str, Any]) -> None:
    """A bucket read in place adds nothing to the pool: its pool_used sample repeats the
    last one instead of asking the transport for its stats (which costs as much as
    describing the bucket), so a stream's stats calls do not grow with its buckets."""
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _set_sender, 3)
    call(r1, _set_receiver, 4)
    call(tr, _count_stats, True)
    try:
        rep = sync(tr, [r1], mode="stream")
    finally:
        calls = call(tr, _count_stats, False)
    s = rep.stream
    assert s is not None and s.source_read_buckets == s.buckets > 3
    assert len(s.pool_used_samples) == s.buckets and s.peak_pool_used == 0
    assert_equal(call(r1, _state), call(tr, _state))
    assert calls <= 4  # the pool's capacity, the start, the first sample, the report
    wait_drained(tr)


@pytest.mark.ray
def test_stream_falls_back_to_the_pool(actors: dict[str, Any]) -> None:
    tr, r1, off = actors["trainer"], actors["r1"], actors["off"]
    # the sender turned it off
    call(tr, _set_sender, 3, source_reads=False)
    call(r1, _set_receiver, 4)
    mapped = call(r1, _stats).mapped_gets
    rep = sync(tr, [r1], mode="stream")
    assert rep.stream is not None and rep.stream.source_read_buckets == 0
    assert call(r1, _stats).mapped_gets - mapped == rep.buckets
    assert_equal(call(r1, _state), call(tr, _state))
    # one receiver with same_node="off": no bucket is read in place; both receivers READ
    # the trainer's tensors by reference over NIXL (a mapping source), nothing is packed
    call(tr, _set_sender, 5)
    call(r1, _set_receiver, 6)
    call(off, _set_receiver, 6)
    reads = call(r1, _stats).reads_posted
    rep = sync(tr, [r1, off], mode="stream")
    assert rep.stream is not None and rep.stream.source_read_buckets == 0
    assert rep.stream.reference_buckets == rep.buckets and rep.stream.peak_pool_used == 0
    assert call(off, _stats).source_reads == 0 and call(off, _stats).reads_posted > 0
    assert call(r1, _stats).reads_posted - reads == rep.buckets  # not mappable: READ
    want = call(tr, _state)
    assert_equal(call(r1, _state), want)
    assert_equal(call(off, _state), want)
    wait_drained(tr)


def _set_mixed_sender(node: Any) -> None:
    node.state = make_state(7)
    node.state["w3"] = torch.randn(64, 96).t()  # a strided view: packed, not read as it lies
    node.weight_sender = WeightSender(node.state, bucket_bytes=BUCKET)


def _set_mixed_receiver(node: Any) -> None:
    node.state = make_state(8)
    node.state["w3"] = torch.zeros(96, 64)
    node.weight_receiver = WeightReceiver(node.state)


@pytest.mark.ray
def test_only_buckets_that_lie_as_sent_are_read_in_place(actors: dict[str, Any]) -> None:
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _set_mixed_sender)
    call(r1, _set_mixed_receiver)
    rep = sync(tr, [r1], mode="stream")
    assert rep.stream is not None and rep.stream.source_read_buckets == rep.buckets - 1
    assert_equal(call(r1, _state), call(tr, _state))
    # a wire dtype converts in the pack: the buckets it converts go through the pool,
    # the one of integers only (sent as they are) is read in place
    call(tr, _set_sender, 9, wire_dtype=torch.bfloat16)
    call(r1, _set_receiver, 10)
    layout, _groups = plan_layout(make_state(9), BUCKET, torch.bfloat16)
    as_is = {b.index for b in layout.buckets} - {
        e.bucket for e in layout.entries if e.dtype == "bfloat16"}
    assert 0 < len(as_is) < len(layout.buckets)
    rep = sync(tr, [r1], mode="stream")
    assert rep.stream is not None and rep.stream.source_read_buckets == len(as_is)
    want = {k: v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v
            for k, v in call(tr, _state).items()}
    assert_equal(call(r1, _state), want)
    wait_drained(tr)


def _set_loader_receiver(node: Any) -> None:
    node.loaded = {}

    def load_weights(batch: Any) -> None:
        for name, t in batch:
            node.loaded[name] = t.clone()

    def select(name: str, shape: tuple[int, ...]) -> Any:
        if name == "ids":
            return (slice(1000, 3000),)
        return (slice(0, shape[0] // 2), slice(8, 40))  # rows and columns: strided runs

    node.weight_receiver = WeightReceiver(load_weights=load_weights, select=select)


def _loaded(node: Any) -> dict[str, torch.Tensor]:
    return dict(node.loaded)


@pytest.mark.ray
def test_selected_parts_go_to_the_loader(actors: dict[str, Any]) -> None:
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _set_sender, 11)
    call(r1, _set_loader_receiver)
    received = call(r1, _stats).bytes_received
    rep = sync(tr, [r1], mode="stream")
    assert rep.stream is not None and rep.stream.source_read_buckets == rep.buckets
    state = call(tr, _state)
    want = {k: v[1000:3000] if k == "ids" else v[: v.shape[0] // 2, 8:40]
            for k, v in state.items()}
    assert_equal(call(r1, _loaded), want)
    assert call(r1, _stats).bytes_received - received == sum(v.nbytes for v in want.values())
    assert call(r1, _stats).arena_used == 0  # the loader's views were the arena's
    wait_drained(tr)


def _set_slow_receiver(node: Any, seed: int) -> None:
    node.state = make_state(seed)

    def load_weights(batch: Any) -> None:
        time.sleep(0.2)  # an engine busy loading: the stream is mid-way for a while
        for name, t in batch:
            node.state[name].copy_(t)

    node.weight_receiver = WeightReceiver(load_weights=load_weights)


def _loads_begun(node: Any) -> bool:
    st = node.weight_receiver._stream
    return st is not None and st.next >= 1


def _stream_to(node: Any, receivers: list[Any]) -> Any:
    return node.weight_sender.stream(receivers, timeout_s=60)


@pytest.mark.ray
@pytest.mark.parametrize("path", ["in place", "by reference", "packed"])
def test_receiver_killed_during_a_stream(actors: dict[str, Any], path: str) -> None:
    """The trainer's stream fails with a ReceiverError naming the dead receiver (and
    Ray's error), holds nothing afterwards (no pool object, no kept tensors, no use
    of a registration), and streams again to a live receiver: for buckets read in place,
    by reference over NIXL, or packed."""
    import ray

    tr, r1 = actors["trainer"], actors["r1"]
    env = {**ENV, "RAY_RDT_POOL_SAME_NODE": "off" if path != "in place" else "map"}
    victim = node_class().options(runtime_env={"env_vars": env}).remote()
    call(victim, _set_slow_receiver, 15)
    call(tr, _set_sender, 16, path == "packed")  # a lazy source is packed
    before = call(tr, _stats)
    ref = tr.__ray_call__.remote(_stream_to, [victim])
    # Begun, and a bucket into its loads (asked beside the busy receive call): a fixed
    # sleep let a loaded host kill it before the first bucket.
    loaded = victim.__ray_call__.options(concurrency_group="_ray_system")
    wait_for(lambda: ray.get(loaded.remote(_loads_begun), timeout=60), 60, interval=0.05)
    ray.kill(victim)
    with pytest.raises(ray.exceptions.RayTaskError) as err:  # not a timeout: a failure
        ray.get(ref, timeout=120)
    assert isinstance(err.value.cause, ReceiverError), err.value
    assert err.value.cause.receiver == 0 and not err.value.cause.stalled
    assert err.value.cause.actor_id == victim._actor_id.hex()
    assert "ActorDiedError" in str(err.value.cause)
    st = call(tr, _stats)
    assert st.pool_used == 0 and st.live_objects == 0, st
    packed = st.bytes_packed > before.bytes_packed
    by_ref = st.zero_copy_tensors > before.zero_copy_tensors
    assert (packed, by_ref) == (path == "packed", path == "by reference"), path
    call(r1, _set_receiver, 17)
    rep = sync(tr, [r1], mode="stream")
    assert rep.stream is not None and rep.stream.source_read_buckets == rep.buckets
    assert_equal(call(r1, _state), call(tr, _state))
    wait_drained(tr)


# ---------------------------------------------------------------------------------------
# Receivers that cannot read in place: by reference over NIXL, or through the pool
# ---------------------------------------------------------------------------------------


def _set_failing_receiver(node: Any, seed: int, bucket: int) -> None:
    node.state = make_state(seed)
    node.calls = 0

    def load_weights(batch: Any) -> None:
        node.calls += 1
        if node.calls == bucket + 1:
            raise RuntimeError("engine refused the bucket")
        for name, t in batch:
            node.state[name].copy_(t)

    node.weight_receiver = WeightReceiver(load_weights=load_weights)


@pytest.mark.ray
def test_stream_by_reference_reads_each_step_and_registers_once(
        actors: dict[str, Any]) -> None:
    """A receiver that cannot read the trainer in place READs its tensors where they lie:
    every step exact, nothing packed, the trainer holds no object once stream() returns,
    and warm steps make no registration and no metadata reload."""
    tr, off = actors["trainer"], actors["off"]
    call(tr, _set_sender, 21)
    call(off, _set_receiver, 22)
    seen = []
    for _step in range(3):
        before = call(tr, _stats)
        rep = sync(tr, [off], mode="stream")
        after = call(tr, _stats)
        assert rep.stream is not None
        assert rep.stream.reference_buckets == rep.buckets > 3
        assert rep.stream.peak_pool_used == 0 and rep.stream.source_read_buckets == 0
        assert after.bytes_packed == before.bytes_packed
        assert after.live_objects == 0  # each bucket freed at its acknowledgement
        assert_equal(call(off, _state), call(tr, _state))
        seen.append((after.nixl_registrations, call(off, _stats).remote_metadata_loads))
        call(tr, _mutate)
    assert seen[1] == seen[2], seen  # warm: the same registrations, the same metadata


@pytest.mark.ray
@pytest.mark.parametrize("how", ["reference", "pool"])
def test_failed_bucket_leaves_the_trainer_holding_nothing(actors: dict[str, Any],
                                                          how: str) -> None:
    """A receiver's loader fails at bucket 2: the stream raises it, and right after, the
    trainer's pool and object table are as before (by reference or packed alike)."""
    import ray

    tr, off = actors["trainer"], actors["off"]
    lazy = how == "pool"  # a lazy source is packed: its tensors are made just in time
    call(tr, _set_sender, 23, lazy)
    call(off, _set_failing_receiver, 24, 2)
    with pytest.raises(ray.exceptions.RayTaskError, match="engine refused the bucket"):
        sync(tr, [off], mode="stream")
    st = call(tr, _stats)
    assert st.live_objects == 0 and st.pool_used == 0, st
    call(off, _set_receiver, 25)
    rep = sync(tr, [off], mode="stream")
    assert rep.stream is not None
    assert (rep.stream.reference_buckets == rep.buckets) is (how == "reference")
    assert (rep.stream.reference_buckets == 0) is (how == "pool")
    assert_equal(call(off, _state), call(tr, _state))
    assert call(tr, _stats).live_objects == 0


def _replace_tensor(node: Any, name: str) -> None:
    """A new tensor (new storage) under ``name``, as an optimizer that reallocates would."""
    node.state[name] = torch.randn(node.state[name].shape)  # the sender reads this dict


def _close_sender(node: Any) -> None:
    node.weight_sender.close()


def _stream_state(node: Any, receivers: list[Any]) -> Any:
    """A stream of the same tensors passed as ``state=``: not held by the sender."""
    return node.weight_sender.stream(receivers, state=dict(node.state))


@pytest.mark.ray
def test_stream_by_reference_follows_a_replaced_tensor(actors: dict[str, Any]) -> None:
    """A tensor replaced between syncs (a new storage) is registered once more and read
    from its new memory, and the replaced storage's registration goes; the others stay
    registered until close(). A state= passed per call (maybe new memory every sync) is
    packed, not registered."""
    tr, off = actors["trainer"], actors["off"]
    call(tr, _set_sender, 26)
    call(off, _set_receiver, 27)
    sync(tr, [off], mode="stream")
    st0 = call(tr, _stats)
    call(tr, _replace_tensor, "w5")
    rep = sync(tr, [off], mode="stream")
    assert rep.stream is not None and rep.stream.reference_buckets == rep.buckets
    st = call(tr, _stats)
    assert st.nixl_registrations == st0.nixl_registrations + 1
    assert st.nixl_deregistrations == st0.nixl_deregistrations + 1  # the replaced one
    assert st.registration_cache_entries == st0.registration_cache_entries
    assert_equal(call(off, _state), call(tr, _state))
    call(tr, _close_sender)
    n = len(make_state(0))  # one storage per tensor
    assert call(tr, _stats).registration_cache_entries == st.registration_cache_entries - n
    call(tr, _mutate)
    rep = call(tr, _stream_state, [off])
    assert rep.reference_buckets == 0 and rep.source_read_buckets == 0
    assert call(tr, _stats).registration_cache_entries == st.registration_cache_entries - n
    assert_equal(call(off, _state), call(tr, _state))


@pytest.mark.ray
def test_state_larger_than_the_registration_cache_is_packed() -> None:
    """A trainer whose storage cache cannot hold the whole state packs every bucket (a
    by-reference sync would register and evict the same storages every time)."""
    import ray

    small = node_class().options(
        runtime_env={"env_vars": {**ENV, "RAY_RDT_POOL_REGISTRATION_CACHE_BYTES": "64K"}}).remote()
    off = node_class().options(
        runtime_env={"env_vars": {**ENV, "RAY_RDT_POOL_SAME_NODE": "off"}}).remote()
    try:
        call(small, _set_sender, 28)
        call(off, _set_receiver, 29)
        rep = sync(small, [off], mode="stream")
        assert rep.stream is not None
        assert rep.stream.reference_buckets == 0 and rep.stream.source_read_buckets == 0
        assert_equal(call(off, _state), call(small, _state))
        assert call(small, _stats).live_objects == 0
    finally:
        ray.kill(small)
        ray.kill(off)
