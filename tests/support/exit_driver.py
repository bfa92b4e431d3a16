"""A driver that receives nixl_pool objects and then exits; run by
tests/integration/test_lifecycle.py.

``python -m tests.support.exit_driver plain``: receive objects (several refs in one ``ray.get``,
some views still alive), then leave the interpreter without any clean-up call: the
``atexit`` hook must stop the progress thread and destroy the agent before finalization.

``python -m tests.support.exit_driver shutdown``: the same, then call ``ray_rdt_pool.shutdown()``
and print what it left behind as one JSON line.

``python -m tests.support.exit_driver stream``: as ``plain``, and the driver is also a trainer:
it streams a dict of weights with ``WeightSender`` to an actor that cannot read it in
place (``same_node="off"``), so the buckets go by reference and the driver's storages
stay registered; it prints whether the actor's weights match as one JSON line, then
leaves the interpreter with those registrations held (no ``close()``).

``python -m tests.support.exit_driver restart``: the driver sends an object to an actor, then
``ray.shutdown()`` and ``ray.init()`` again in the same process, and sends again to a new
actor; prints the two sums the actors computed as one JSON line.

``python -m tests.support.exit_driver restart_map``: as ``restart`` with ``same_node="map"``
everywhere, and the driver also gets an actor's object in each session; prints, per
session, how many gets the actor and the driver mapped and how many READs they posted.

``python -m tests.support.exit_driver overflow``: as ``plain``, and the driver also puts an
object larger than its pool and drops it, so an empty overflow region lingers for reuse
(``overflow_linger_s``) when the interpreter exits. After the ``atexit`` shutdown it
prints whether that region was unmapped and how many memories were stranded (kept
because a deregistration failed) as one JSON line.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import sys
import threading
from typing import Any

import ray
import torch

import ray_rdt_pool

#: The overflow regions the ``overflow`` mode checks at exit.
_AT_EXIT: list[Any] = []


def _report_at_exit() -> None:
    """Registered before the transport's own exit hook, so it runs after it (atexit runs
    the latest registered first): what the exit shutdown left of the overflow regions."""
    if not _AT_EXIT:
        return
    from ray_rdt_pool._ray.runtime import runtime

    print(json.dumps({"unmapped": [r.mem._map.closed for r in _AT_EXIT],
                      "stranded": len(runtime().registry._stranded)}))
    sys.stdout.flush()


atexit.register(_report_at_exit)
ray_rdt_pool.register()


@ray.remote(enable_tensor_transport=True)
class Sender:
    def __init__(self) -> None:
        ray_rdt_pool.register()

    def put(self, i: int) -> list[ray.ObjectRef]:
        return [ray.put([torch.full((1000 + i,), float(i)), torch.arange(i + 1)],
                        _tensor_transport="nixl_pool")]


@ray.remote(enable_tensor_transport=True)
class Receiver:
    def __init__(self) -> None:
        ray_rdt_pool.register()  # before its first get (Ray registers it asynchronously)

    def total(self, box: list[ray.ObjectRef]) -> float:
        return float(ray.get(box[0])[0].sum())

    def total_and_counts(self, box: list[ray.ObjectRef]) -> tuple[float, int, int]:
        total = self.total(box)
        st = ray_rdt_pool.stats()
        return total, st.mapped_gets, st.reads_posted


def restart() -> None:
    """Send from the driver across a Ray restart in this process: the new cluster's GCS
    is empty, so the driver's agent must publish its metadata there again."""
    totals = []
    for k in range(2):
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=128 << 20,
                 runtime_env={"env_vars": {"RAY_RDT_POOL_METRICS": "0",
                                           "RAY_RDT_POOL_FETCH_TIMEOUT_S": "15"}})
        r = Receiver.remote()
        ref = ray.put([torch.arange(1000, dtype=torch.float32) + k],
                      _tensor_transport="nixl_pool")
        totals.append(ray.get(r.total.remote([ref]), timeout=90))
        del ref
        ray.kill(r)
        ray.shutdown()
    print(json.dumps({"totals": totals}))


def restart_map() -> None:
    """Same-node objects across a Ray restart in this process: the new cluster's GCS
    holds no same-node entry of the driver's pool and the driver has a new node ID, so
    the entry must be published there again for the new actors to map the driver's
    objects; and the driver, as a receiver, must map the new actors' objects."""
    env = {"RAY_RDT_POOL_METRICS": "0", "RAY_RDT_POOL_SAME_NODE": "map",
           "RAY_RDT_POOL_POOL_BYTES": "16M", "RAY_RDT_POOL_FETCH_TIMEOUT_S": "15"}
    sessions = []
    for k in range(2):
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=128 << 20, runtime_env={"env_vars": env})
        r, s = Receiver.remote(), Sender.remote()
        ref = ray.put([torch.arange(1000, dtype=torch.float32) + k],
                      _tensor_transport="nixl_pool")
        total, mapped, reads = ray.get(r.total_and_counts.remote([ref]), timeout=90)
        box = ray.get(s.put.remote(k), timeout=90)
        before = ray_rdt_pool.stats()
        got = ray.get(box[0], timeout=90)
        ok = torch.equal(got[0], torch.full((1000 + k,), float(k)))
        after = ray_rdt_pool.stats()
        sessions.append({"total": total, "actor_mapped": mapped, "actor_reads": reads,
                         "driver_ok": ok,
                         "driver_mapped": after.mapped_gets - before.mapped_gets,
                         "driver_reads": after.reads_posted - before.reads_posted})
        del ref, box, got
        ray.kill(r)
        ray.kill(s)
        ray.shutdown()
    print(json.dumps({"sessions": sessions}))


@ray.remote(enable_tensor_transport=True)
class Engine:
    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        from ray_rdt_pool.weights import WeightReceiver

        ray_rdt_pool.register()
        self.state = {k: torch.zeros(v) for k, v in shapes.items()}
        self.weight_receiver = WeightReceiver(self.state)

    def state_digests(self) -> dict[str, str]:
        return {k: _digest(v) for k, v in self.state.items()}


def _digest(t: torch.Tensor) -> str:
    """The tensor's bytes, hashed: a float sum depends on the thread count (the actor
    sums on one thread, the driver on two) and differed for about 1 state in 40."""
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def stream() -> None:
    from ray_rdt_pool.weights import WeightSender

    state = {f"w{i}": torch.randn(256, 256) for i in range(8)}
    sender = WeightSender(state, bucket_bytes=1 << 20)
    env = {"env_vars": {"RAY_RDT_POOL_SAME_NODE": "off", "RAY_RDT_POOL_METRICS": "0"}}
    e = Engine.options(runtime_env=env).remote({k: tuple(v.shape) for k, v in state.items()})
    rep = sender.stream([e])
    ok = ray.get(e.state_digests.remote()) == {k: _digest(v) for k, v in state.items()}
    print(json.dumps({"ok": ok, "reference_buckets": rep.reference_buckets,
                      "buckets": rep.buckets,
                      "cached": ray_rdt_pool.stats().registration_cache_entries}))


def _start_pack_helpers() -> int:
    """A threaded pack copy in this process (the helpers a large put starts); returns
    how many pack helper threads run afterwards."""
    from ray_rdt_pool.core.layout import packed_offsets
    from ray_rdt_pool.memory.describe import describe
    from ray_rdt_pool.memory.pack import pack_into
    from ray_rdt_pool.memory.regions import HostRegion

    src = [torch.randn(4 << 20)]  # 16 MiB: several 4 MiB units, so helpers start
    d = describe(src)
    offsets, total = packed_offsets(d.nbytes, d.aligns)
    region = HostRegion(total)
    pack_into(src, d, offsets, [(0, total)], region, None, threads=3, threshold=0)
    assert torch.equal(region.tensor[:total].view(torch.float32), src[0])
    region.close()
    return sum(t.name.startswith("ray_rdt_pool-pack-") for t in threading.enumerate())


def overflow() -> None:
    """Put an object larger than the pool from this driver and drop it: its overflow
    region is empty and lingering when this returns."""
    import time

    from ray_rdt_pool._ray.runtime import runtime

    big = ray.put([torch.ones(24 << 20, dtype=torch.uint8)], _tensor_transport="nixl_pool")
    _AT_EXIT.extend(runtime().sender.overflow)
    del big
    deadline = time.monotonic() + 60
    while ray_rdt_pool.stats().overflow_objects and time.monotonic() < deadline:
        time.sleep(0.05)
    st = ray_rdt_pool.stats()
    print(json.dumps({"regions": len(_AT_EXIT), "overflow_objects": st.overflow_objects,
                      "lingering": st.overflow_capacity}))


def main(mode: str) -> None:
    if mode == "restart":
        ray_rdt_pool.configure(pool_bytes=16 << 20, arena_bytes=16 << 20, metrics=False)
        restart()
        sys.stdout.flush()
        return
    if mode == "restart_map":
        ray_rdt_pool.configure(pool_bytes=16 << 20, arena_bytes=16 << 20, metrics=False,
                               same_node="map")
        restart_map()
        sys.stdout.flush()
        return
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 << 20,
             runtime_env={"env_vars": {"RAY_RDT_POOL_POOL_BYTES": "16M",
                                       "RAY_RDT_POOL_METRICS": "0"}})
    # overflow: the emptied region still lingers at exit, however slow the run.
    linger = {"overflow_linger_s": 3600.0} if mode == "overflow" else {}
    ray_rdt_pool.configure(pool_bytes=16 << 20, arena_bytes=16 << 20, metrics=False,
                           **linger)
    s = Sender.remote()
    boxes = ray.get([s.put.remote(i) for i in range(12)])
    got = ray.get([b[0] for b in boxes])  # one call, many refs
    assert all(torch.equal(g[0], torch.full((1000 + i,), float(i))) for i, g in enumerate(got))
    keep = got[:4]  # views still alive at exit
    if mode == "stream":
        stream()
    if mode == "overflow":
        overflow()
    if mode == "shutdown":
        from ray.experimental.internal_kv import _internal_kv_get

        name = ray_rdt_pool.stats().agent_name
        helpers = _start_pack_helpers()
        ray_rdt_pool.shutdown()
        ray_rdt_pool.shutdown()
        threads = [t.name for t in threading.enumerate() if t.name.startswith("ray_rdt_pool")]
        key = _internal_kv_get(f"agent/{name}", namespace="ray_rdt_pool")
        try:
            ray.get(ray.get(s.put.remote(99))[0])
            after = "ok"
        except Exception as e:  # Ray wraps the transport's error
            after = f"{type(e).__name__}: {e}"
        print(json.dumps({"threads": threads, "key": key is not None, "after": after,
                          "kept": len(keep), "helpers_before": helpers}))
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plain")
