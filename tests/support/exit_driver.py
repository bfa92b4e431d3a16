"""A driver that receives nixl_pool objects and then exits; run by
tests/integration/test_lifecycle.py.

``python -m tests.support.exit_driver plain``: receive objects (several refs in one ``ray.get``,
some views still alive), then leave the interpreter without any clean-up call: the
``atexit`` hook must stop the progress thread and destroy the agent before finalization.

Every mode but ``restart`` joins the cluster ``RAY_ADDRESS`` names when one is set, and
starts a cluster of its own otherwise.

``python -m tests.support.exit_driver shutdown``: the same, then call ``ray_rdt_pool.shutdown()``
and print what it left behind as one JSON line.

``python -m tests.support.exit_driver stream``: as ``plain``, and the driver is also a trainer:
it streams a dict of weights with ``WeightSender`` to an actor that cannot read it in
place (``same_node="off"``), so the buckets go by reference and the driver's storages
stay registered; it prints whether the actor's weights match as one JSON line, then
leaves the interpreter with those registrations held (no ``close()``).

``python -m tests.support.exit_driver restart``: in each of two sessions (``ray.init()``,
then ``ray.shutdown()``, twice in the same process) the driver sends an object to an
actor that READs it (``same_node="off"``) and to one that maps it, and gets an object of a
third; prints, per session, the sums the actors computed and how many gets each of
them and the driver mapped and how many READs they posted, as one JSON line.

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
import os
import sys
import threading
from typing import Any

import ray
import torch

import ray_rdt_pool
from tests.support import actors

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
class Sender(actors.Sender):
    def put(self, i: int) -> list[ray.ObjectRef]:
        return [ray.put([torch.full((1000 + i,), float(i)), torch.arange(i + 1)],
                        _tensor_transport="nixl_pool")]


@ray.remote(enable_tensor_transport=True)
class Receiver(actors.Receiver):
    def total(self, box: list[ray.ObjectRef]) -> float:
        return float(ray.get(box[0])[0].sum())

    def total_and_counts(self, box: list[ray.ObjectRef]) -> tuple[float, int, int]:
        total = self.total(box)
        st = ray_rdt_pool.stats()
        return total, st.mapped_gets, st.reads_posted


def restart() -> None:
    """Send from the driver, and receive in it, across a Ray restart in this process: the
    new cluster's GCS is empty, so the driver's agent must publish its metadata there
    again (or the actor that READs waits for it and fails), and its pool's same-node
    entry too, with the driver's new node ID (or the actor that maps READs instead); and
    the driver, as a receiver, must map the new session's actors' objects."""
    env = {"RAY_RDT_POOL_METRICS": "0", "RAY_RDT_POOL_SAME_NODE": "map",
           "RAY_RDT_POOL_POOL_BYTES": "16M", "RAY_RDT_POOL_FETCH_TIMEOUT_S": "15"}
    off = {"env_vars": {**env, "RAY_RDT_POOL_SAME_NODE": "off"}}
    sessions = []
    for k in range(2):
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=128 << 20, runtime_env={"env_vars": env})
        reader = Receiver.options(runtime_env=off).remote()
        r, s = Receiver.remote(), Sender.remote()
        ref = ray.put([torch.arange(1000, dtype=torch.float32) + k],
                      _tensor_transport="nixl_pool")
        read_total, read_mapped, read_reads = ray.get(
            reader.total_and_counts.remote([ref]), timeout=90)
        total, mapped, reads = ray.get(r.total_and_counts.remote([ref]), timeout=90)
        box = ray.get(s.put.remote(k), timeout=90)
        before = ray_rdt_pool.stats()
        got = ray.get(box[0], timeout=90)
        ok = torch.equal(got[0], torch.full((1000 + k,), float(k)))
        after = ray_rdt_pool.stats()
        sessions.append({"read_total": read_total, "reader_mapped": read_mapped,
                         "reader_reads": read_reads,
                         "total": total, "actor_mapped": mapped, "actor_reads": reads,
                         "driver_ok": ok,
                         "driver_mapped": after.mapped_gets - before.mapped_gets,
                         "driver_reads": after.reads_posted - before.reads_posted})
        del ref, box, got
        for a in (reader, r, s):
            ray.kill(a)
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
    from ray_rdt_pool.memory.allocations import HostMemory
    from ray_rdt_pool.memory.describe import describe
    from ray_rdt_pool.memory.pack import pack_into

    src = [torch.randn(4 << 20)]  # 16 MiB: several 4 MiB units, so helpers start
    d = describe(src)
    offsets, total = packed_offsets(d.nbytes, d.aligns)
    region = HostMemory(total)
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
        ray_rdt_pool.configure(pool_bytes=16 << 20, arena_bytes=16 << 20, metrics=False,
                               same_node="map")
        restart()
        sys.stdout.flush()
        return
    env = {"env_vars": {"RAY_RDT_POOL_POOL_BYTES": "16M", "RAY_RDT_POOL_METRICS": "0"}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, runtime_env=env)
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=128 << 20, runtime_env=env)
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
