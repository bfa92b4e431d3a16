"""Tests of ray_rdt_pool.weights: real syncs on Ray (layout planning and validation without
Ray are in tests/unit/weights/test_weights_check.py).

The module shares one small cluster and three actors
(a trainer and two receivers) for the whole module; each test sets the actors' state
through ``__ray_call__`` and leaves the trainer's pool drained.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ray import cloudpickle

import ray_rdt_pool
from ray_rdt_pool.errors import PoolExhaustedError, ShapeMismatchError
from ray_rdt_pool.weights import (
    ManifestReleasedError,
    WeightReceiver,
    WeightSender,
    WeightSyncTimeoutError,
    sync,
)
from tests.support import weights_state
from tests.support.raycluster import call, shared_actors, wait_drained, wait_for
from tests.support.weights_state import KINDS, SMALL, Spec, make_state
from tests.support.weights_state import mismatch as _mismatch

# The helpers below run inside the actors; ship them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(weights_state)

POOL = 8 << 20
ENV = {"RAY_RDT_POOL_POOL_BYTES": "8M", "RAY_RDT_POOL_ARENA_BYTES": "64M"}



# ---------------------------------------------------------------------------------------
# No Ray
# ---------------------------------------------------------------------------------------



# ---------------------------------------------------------------------------------------
# Ray: one cluster, four actors
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def actors(ray_cluster: str) -> Iterator[dict[str, Any]]:
    import ray

    @ray.remote(enable_tensor_transport=True)
    class Node:
        def __init__(self) -> None:
            ray_rdt_pool.register()
            torch.set_num_threads(1)

    with shared_actors(ENV, dict.fromkeys(("trainer", "r1", "r2"), Node)) as nodes:
        yield nodes


def _set(node: Any, attr: str, value: Any) -> None:
    setattr(node, attr, value)


def _setup_sender(node: Any, spec: Spec, seed: int, bucket_bytes: int) -> None:
    node.state = make_state(spec, seed)
    node.weight_sender = WeightSender(node.state, bucket_bytes=bucket_bytes)


def _setup_receiver(node: Any, state: dict[str, torch.Tensor], **opts: Any) -> None:
    node.state = state
    node.weight_receiver = WeightReceiver(state, **opts)


def _state(node: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in node.state.items()}


def _perturb(node: Any) -> None:
    with torch.no_grad():
        for t in node.state.values():
            if t.is_floating_point():
                t.mul_(1.5).add_(0.25)


def _stats(node: Any) -> Any:
    return ray_rdt_pool.stats()


def _publish(node: Any) -> Any:
    return node.weight_sender.publish()


def _load(node: Any, manifest: Any, release: bool = True, keep: bool = False) -> Any:
    rep = node.weight_receiver.load(manifest, release=release)
    if keep:
        node.kept = manifest
    return rep


def assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                       dtype: torch.dtype | None = None) -> None:
    assert set(got) == set(want)
    for k in want:
        w = want[k] if dtype is None or not want[k].is_floating_point() else want[k].to(dtype)
        assert got[k].dtype == w.dtype and torch.equal(got[k], w), k


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["stream", "publish"])
def test_sync_exact_and_direct_without_new_registrations(actors: dict[str, Any],
                                                         mode: str) -> None:
    tr, r1, r2 = actors["trainer"], actors["r1"], actors["r2"]
    call(tr, _setup_sender, SMALL, 1, 4096)
    call(r1, _setup_receiver, make_state(SMALL, 2))
    call(r2, _setup_receiver, make_state(SMALL, 2), direct=False)
    rep = sync(tr, [r1, r2], mode=mode)
    want = call(tr, _state)
    assert_state_equal(call(r1, _state), want)
    assert_state_equal(call(r2, _state), want)
    d, c = rep.loads
    assert d.direct_buckets == d.buckets == rep.buckets > 1 and d.copied_buckets == 0
    assert c.direct_buckets == 0 and c.copied_buckets == rep.buckets
    # The first sync copies through the arena (buffers seen once are not registered);
    # from the second on the parameters are registered once and read in place.
    call(tr, _perturb)
    sync(tr, [r1, r2], mode=mode)
    assert_state_equal(call(r1, _state), call(tr, _state))
    regs = call(r1, _stats).nixl_registrations
    call(tr, _perturb)
    sync(tr, [r1, r2], mode=mode)
    assert_state_equal(call(r1, _state), call(tr, _state))
    assert call(r1, _stats).nixl_registrations == regs
    wait_drained(tr)


def _count_calls(node: Any, module: str, name: str, on: bool) -> int:
    """Count the calls of ``module.name`` in this actor from now on (``on``), or stop
    counting and return the count."""
    import importlib

    mod = importlib.import_module(module)
    if on:
        orig = getattr(mod, name)
        counts = node.__dict__.setdefault("counts", {})
        counts[name] = 0

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return orig(*args, **kwargs)

        counted.orig = orig  # type: ignore[attr-defined]
        setattr(mod, name, counted)
        return 0
    setattr(mod, name, getattr(mod, name).orig)
    return int(node.counts.pop(name))


def _replace_dest(node: Any, name: str, shape: tuple[int, ...]) -> None:
    node.state[name] = torch.zeros(shape, dtype=node.state[name].dtype)


def _reshape_in_place(node: Any, name: str, shape: tuple[int, ...]) -> None:
    t = node.state[name]
    t.data = torch.randn(shape).to(t.dtype)  # same tensor object, another shape


@pytest.mark.ray
def test_stream_plans_and_checks_a_layout_once_until_something_changes(
        actors: dict[str, Any]) -> None:
    """Each stream of one model sends the same layout: the trainer buckets it and the
    receiver checks it once, until a tensor is replaced, reshaped in place or an
    option changes; then both plan afresh and a mismatch is still refused."""
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _setup_sender, SMALL, 21, 4096)
    call(r1, _setup_receiver, make_state(SMALL, 22))
    call(tr, _count_calls, "ray_rdt_pool.weights.planning", "_plan_layout", True)
    call(r1, _count_calls, "ray_rdt_pool.weights.weight_receiver", "plan_load", True)
    try:
        for _ in range(3):
            call(tr, _perturb)
            sync(tr, [r1], mode="stream")
            assert_state_equal(call(r1, _state), call(tr, _state))
        assert call(tr, _count_calls, "ray_rdt_pool.weights.planning", "_plan_layout",
                    False) == 1
        assert call(r1, _count_calls, "ray_rdt_pool.weights.weight_receiver", "plan_load",
                    False) == 1
        call(tr, _count_calls, "ray_rdt_pool.weights.planning", "_plan_layout", True)
        call(r1, _count_calls, "ray_rdt_pool.weights.weight_receiver", "plan_load", True)
        # A destination replaced by one of another shape is refused, not written past.
        call(r1, _replace_dest, "layers.0.w", (16, 32))
        with pytest.raises(ShapeMismatchError):
            sync(tr, [r1], mode="stream")
        # A fresh destination of the right shape gets the bytes (not the old tensor).
        call(r1, _replace_dest, "layers.0.w", (32, 32))
        call(tr, _perturb)
        sync(tr, [r1], mode="stream")
        assert_state_equal(call(r1, _state), call(tr, _state))
        # The trainer's tensor reshaped in place: a new layout, which r1 refuses.
        call(tr, _reshape_in_place, "layers.0.w", (32, 16))
        with pytest.raises(ShapeMismatchError):
            sync(tr, [r1], mode="stream")
        call(tr, _reshape_in_place, "layers.0.w", (32, 32))
        call(tr, _perturb)
        sync(tr, [r1], mode="stream")
        assert_state_equal(call(r1, _state), call(tr, _state))
        # An option changed on the receiver is checked again.
        call(r1, _set_option, "strict", False)
        call(tr, _perturb)
        sync(tr, [r1], mode="stream")
        assert_state_equal(call(r1, _state), call(tr, _state))
    finally:
        planned = call(tr, _count_calls, "ray_rdt_pool.weights.planning", "_plan_layout",
                       False)
        checked = call(r1, _count_calls, "ray_rdt_pool.weights.weight_receiver", "plan_load",
                       False)
    # The trainer planned for its reshape and back; r1 checked each change of its own
    # and the refused layout, and kept the plan of the layout it had seen.
    assert planned == 2
    assert checked == 4
    wait_drained(tr)


def _set_option(node: Any, name: str, value: Any) -> None:
    setattr(node.weight_receiver, name, value)


@pytest.mark.ray
def test_name_map_and_bf16_conversion(actors: dict[str, Any]) -> None:
    tr, r1 = actors["trainer"], actors["r1"]
    spec = {f"model.{k}": v for k, v in SMALL.items()}
    spec["model.extra"] = ((3,), torch.float32)  # not in the destination: skipped
    call(tr, _setup_sender, spec, 3, 4096)
    dest = {k.removeprefix("model."): v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in make_state(spec, 4).items() if k != "model.extra"}
    call(r1, _setup_receiver, dest,
         name_map=lambda n: None if n == "model.extra" else n.removeprefix("model."))
    for mode in ("stream", "publish"):
        call(tr, _perturb)
        rep = sync(tr, [r1], mode=mode)
        assert rep.loads[0].copied_buckets == rep.buckets  # conversion: through the arena
        assert rep.loads[0].skipped == 1
        want = {k.removeprefix("model."): v for k, v in call(tr, _state).items()
                if k != "model.extra"}
        assert_state_equal(call(r1, _state), want, dtype=torch.bfloat16)
    wait_drained(tr)


@pytest.mark.ray
@pytest.mark.parametrize("kind", list(KINDS))
def test_mismatch_raises_before_anything_is_written(actors: dict[str, Any], kind: str) -> None:
    tr, r1, r2 = actors["trainer"], actors["r1"], actors["r2"]
    call(tr, _setup_sender, SMALL, 6, 4096)
    good = make_state(SMALL, 7)
    bad, opts = _mismatch(kind)
    call(r1, _setup_receiver, good)
    call(r2, _setup_receiver, bad, **opts)
    put0 = call(tr, _stats).objects_put
    with pytest.raises(KINDS[kind]):  # stream: every receiver validates before any put
        sync(tr, [r1, r2], mode="stream")
    assert call(tr, _stats).objects_put == put0
    assert_state_equal(call(r1, _state), good)
    assert_state_equal(call(r2, _state), {k: v.clone() for k, v in bad.items()})
    # publish: the receiver validates the whole manifest before the first bucket
    manifest = call(tr, _publish)
    with pytest.raises(KINDS[kind]):
        call(r2, _load, manifest)
    assert_state_equal(call(r2, _state), bad)
    del manifest
    wait_drained(tr)


@pytest.mark.ray
def test_broadcast_frees_sender_blocks_after_last_holder(actors: dict[str, Any]) -> None:
    import ray

    tr, r1, r2 = actors["trainer"], actors["r1"], actors["r2"]
    call(tr, _setup_sender, SMALL, 8, 4096)
    call(r1, _setup_receiver, make_state(SMALL, 9))
    call(r2, _setup_receiver, make_state(SMALL, 9))
    manifest = call(tr, _publish)
    nb = len(manifest.layout.buckets)
    assert nb > 1 and call(tr, _stats).live_objects == nb
    # Both load concurrently; r2 keeps its copy of the manifest (refs unreleased).
    ray.get([r1.__ray_call__.remote(_load, manifest),
             r2.__ray_call__.remote(_load, manifest, release=False, keep=True)])
    want = call(tr, _state)
    assert_state_equal(call(r1, _state), want)
    assert_state_equal(call(r2, _state), want)
    del manifest  # the driver's copy
    time.sleep(1.0)
    st = call(tr, _stats)
    assert st.live_objects == nb and st.pool_used > 0  # r2 still holds the refs
    call(r2, _set, "kept", None)  # the last holder lets go
    st = wait_drained(tr)
    assert st.fallbacks == 0


@pytest.mark.ray
def test_released_manifest_cannot_be_loaded_twice(actors: dict[str, Any]) -> None:
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _setup_sender, SMALL, 10, 4096)
    call(r1, _setup_receiver, make_state(SMALL, 11))
    manifest = call(tr, _publish)
    call(r1, _load, manifest, release=False, keep=True)  # keeps its copy with refs
    with pytest.raises(ManifestReleasedError):
        call(r1, _load_kept_twice)
    del manifest
    call(r1, _set, "kept", None)
    wait_drained(tr)


def _load_kept_twice(node: Any) -> None:
    node.weight_receiver.load(node.kept)  # release=True consumes the refs
    node.weight_receiver.load(node.kept)


class FailingReceiver(WeightReceiver):
    """Fails on one bucket, as a READ error would."""

    fail_at = 2

    def _load_bucket(self, plan: Any, ref: Any, *rest: Any) -> Any:
        if plan.index == self.fail_at:
            raise RuntimeError(f"injected failure on bucket {plan.index}")
        return super()._load_bucket(plan, ref, *rest)


def _setup_failing(node: Any, state: dict[str, torch.Tensor]) -> None:
    node.state = state
    node.weight_receiver = FailingReceiver(state)


@pytest.mark.ray
def test_stream_failure_leaves_a_prefix_and_drains_the_pool(actors: dict[str, Any]) -> None:
    tr, r1, r2 = actors["trainer"], actors["r1"], actors["r2"]
    spec: Spec = {f"w{i}": ((32, 32), torch.float32) for i in range(8)}  # 8 buckets of 4 KiB
    call(tr, _setup_sender, spec, 20, 4096)
    call(r1, _setup_receiver, make_state(spec, 21))
    before = make_state(spec, 21)
    call(r2, _setup_failing, make_state(spec, 21))
    with pytest.raises(RuntimeError, match="injected failure on bucket 2"):
        sync(tr, [r1, r2], max_inflight=2)
    want, got = call(tr, _state), call(r2, _state)
    for i in range(8):  # bucket i holds w{i}: 0-1 loaded, 2 (failed) and later untouched
        assert torch.equal(got[f"w{i}"], want[f"w{i}"] if i < 2 else before[f"w{i}"]), i
    assert call(r2, _version) == 0
    wait_drained(tr)


def _version(node: Any) -> int:
    return int(node.weight_receiver.version)


BIG: Spec = {f"layer{i}.w": ((256, 256), torch.float32) for i in range(48)}  # 12 MiB
BIG.update({f"layer{i}.b": ((256,), torch.float32) for i in range(48)})


@pytest.mark.ray
def test_stream_bounded_memory_and_pipelining_on_off(actors: dict[str, Any]) -> None:
    tr, r1, r2 = actors["trainer"], actors["r1"], actors["r2"]
    bucket = 1 << 20
    call(tr, _setup_sender, BIG, 12, bucket)
    results = {}
    for inflight in (1, 2):
        call(r1, _setup_receiver, make_state(BIG, 13))
        call(r2, _setup_receiver, make_state(BIG, 13), direct=False)
        rep = sync(tr, [r1, r2], mode="stream", max_inflight=inflight)
        s = rep.stream
        assert s is not None
        model_bytes = sum(math.prod(shape) * 4 for shape, _dt in BIG.values())
        assert s.nbytes == model_bytes > s.pool_capacity == POOL  # model larger than the pool
        assert s.fallbacks == 0
        assert len(s.pool_used_samples) == s.buckets >= 12
        assert s.peak_pool_used <= min(s.pool_capacity, inflight * bucket)
        results[inflight] = (call(r1, _state), call(r2, _state))
        wait_drained(tr)
    want = call(tr, _state)
    for a, b in results.values():
        assert_state_equal(a, want)
        assert_state_equal(b, want)
    assert call(tr, _stats).fallbacks == 0


@pytest.mark.ray
def test_stream_refuses_bucket_larger_than_pool(actors: dict[str, Any]) -> None:
    tr, r1 = actors["trainer"], actors["r1"]
    spec: Spec = {"huge": ((3 << 20,), torch.float32)}  # 12 MiB in one tensor > 8 MiB pool
    call(tr, _setup_sender, spec, 14, 1 << 20)
    call(r1, _setup_receiver, make_state(spec, 15))
    put0 = call(tr, _stats).objects_put
    with pytest.raises(PoolExhaustedError):
        sync(tr, [r1])
    assert call(tr, _stats).objects_put == put0


def _setup_packed_sender(node: Any, spec: Spec, seed: int, bucket_bytes: int) -> None:
    node.state = make_state(spec, seed)
    node.weight_sender = WeightSender(node.state, bucket_bytes=bucket_bytes,
                                      source_reads=False)


@pytest.mark.ray
def test_stream_through_a_pool_of_one_bucket(actors: dict[str, Any]) -> None:
    """bucket_bytes == pool_bytes with max_inflight=2, every bucket packed: the sender
    frees the acknowledged bucket (once the receivers' same-node mappings let go of it)
    to make room for the next. It used to wait timeout_s for a free only it could make,
    then raise WeightSyncTimeoutError."""
    tr, r1, r2 = actors["trainer"], actors["r1"], actors["r2"]
    spec: Spec = {f"w{i}": ((1 << 20,), torch.float32) for i in range(4)}  # 4 MiB each
    call(tr, _setup_packed_sender, spec, 30, POOL)  # 2 buckets of 8 MiB, the whole pool
    call(r1, _setup_receiver, make_state(spec, 31))
    call(r2, _setup_receiver, make_state(spec, 31), direct=False)
    rep = sync(tr, [r1, r2], max_inflight=2, timeout_s=30.0)
    s = rep.stream
    assert s is not None and s.buckets == 2 and s.fallbacks == 0
    assert s.peak_pool_used == POOL == s.pool_capacity
    want = call(tr, _state)
    assert_state_equal(call(r1, _state), want)
    assert_state_equal(call(r2, _state), want)
    wait_drained(tr)


def _setup_slow_sender(node: Any, spec: Spec, seed: int, delay_s: float) -> None:
    """A sender whose source takes ``delay_s`` to produce the state (a trainer still
    busy with its step)."""
    node.state = make_state(spec, seed)
    state = node.state

    def slow() -> dict[str, torch.Tensor]:
        time.sleep(delay_s)
        return state

    node.weight_sender = WeightSender(slow, bucket_bytes=4096)


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["publish", "stream"])
def test_a_sync_that_outlasts_timeout_s_raises_weight_sync_timeout_error(
        actors: dict[str, Any], mode: str) -> None:
    """sync(mode="publish") waited for the trainer's publish with a bare ray.get, so a
    slow trainer raised Ray's GetTimeoutError, naming nothing of the weights API. Every
    wait of sync() raises WeightSyncTimeoutError (still a TimeoutError) naming what it
    waited for; a publish that ends after the timeout leaves nothing in the trainer's
    pool, even while the error is held."""
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _setup_slow_sender, SMALL, 40, 4.0)
    call(r1, _setup_receiver, make_state(SMALL, 41))
    with pytest.raises(WeightSyncTimeoutError) as ei:
        sync(tr, [r1], mode=mode, timeout_s=1.0)
    assert isinstance(ei.value, TimeoutError)
    assert f"WeightSender.{mode} at 'weight_sender'" in str(ei.value), str(ei.value)
    assert "trainer" in str(ei.value) and "longer than" in str(ei.value), str(ei.value)
    wait_drained(tr, timeout=60)  # once the trainer's call has ended
    del ei


def _setup_tied(node: Any, seed: int, tied: bool, sender: bool) -> None:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False))
    if tied:
        m[1].weight = m[0].weight
    node.model = m
    node.state = dict(m.state_dict(keep_vars=True))
    if sender:
        node.weight_sender = WeightSender(m, bucket_bytes=4096)
    else:
        node.weight_receiver = WeightReceiver(m)


def _is_tied(node: Any) -> bool:
    return node.model[1].weight is node.model[0].weight


@pytest.mark.ray
def test_tied_weights_module(actors: dict[str, Any]) -> None:
    tr, r1, r2 = actors["trainer"], actors["r1"], actors["r2"]
    call(tr, _setup_tied, 16, True, True)
    call(r1, _setup_tied, 17, True, False)
    call(r2, _setup_tied, 17, False, False)  # untied receiver: both names written
    sync(tr, [r1, r2])
    want = call(tr, _state)
    assert_state_equal(call(r1, _state), want)
    assert_state_equal(call(r2, _state), want)
    assert call(r1, _is_tied) and not call(r2, _is_tied)
    wait_drained(tr)


def _publish_then_train(node: Any) -> Any:
    """publish(), then modify the weights in place at once, as a trainer would."""
    manifest = node.weight_sender.publish()
    _perturb(node)
    return manifest


@pytest.mark.ray
def test_publish_larger_than_the_pool_is_a_snapshot(actors: dict[str, Any]) -> None:
    """The model (12 MiB) does not fit the 8 MiB pool: the buckets that do not fit go to
    overflow memory, still snapshots, so a trainer that keeps training as soon as
    publish() returns never tears the weights the receivers load."""
    tr, r1 = actors["trainer"], actors["r1"]
    call(tr, _setup_sender, BIG, 16, 4 << 20)
    want = call(tr, _state)
    call(r1, _setup_receiver, make_state(BIG, 17))
    manifest = call(tr, _publish_then_train)
    assert manifest.overflow, "expected some buckets in overflow memory"
    st = call(tr, _stats)
    assert st.overflow_objects == len(manifest.overflow) and st.overflow_bytes > 0
    call(r1, _load, manifest)
    assert_state_equal(call(r1, _state), want)  # the weights of publish time
    del manifest
    st = wait_drained(tr)
    assert st.overflow_objects == 0
    # The emptied overflow regions linger for reuse (overflow_linger_s), then go.
    wait_for(lambda: call(tr, _stats).overflow_capacity == 0)


