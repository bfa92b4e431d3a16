"""What a bucket costs: one stream of the same model in few and in many buckets.

One trainer actor and one receiver actor on one Ray node, ``same_node="off"`` (every
bucket goes as NIXL READs, as between nodes) or ``"map"``; a 64 MiB fp32 model in 64
tensors of 1 MiB, streamed with ``sync(mode="stream")`` in 4 buckets of 16 MiB and in 64
buckets of 1 MiB, alternating, ``--syncs`` times each after a warm-up. Prints the warm
medians, their ratio (the per-bucket cost shows as the ratio above 1) and the Ray calls
each sync made (``SyncReport.ray_calls``), which must not grow with the bucket count.

Run: python -m microbenchmarks.bench_buckets [--syncs 9] [--same-node off|map]
(``RAY_RDT_POOL_*`` settings in the environment reach the actors.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import ray
import torch

MIB = 1 << 20


def _trainer(actor: Any, bucket_mib: int) -> None:
    from ray_rdt_pool.weights import WeightSender

    if not hasattr(actor, "state"):
        g = torch.Generator().manual_seed(0)
        actor.state = {f"w{i}": torch.randn(MIB // 4, generator=g) for i in range(64)}
    actor.weight_sender = WeightSender(actor.state, bucket_bytes=bucket_mib * MIB)


def _receiver(actor: Any) -> None:
    from ray_rdt_pool.weights import WeightReceiver

    actor.state = {f"w{i}": torch.zeros(MIB // 4) for i in range(64)}
    actor.weight_receiver = WeightReceiver(actor.state)


def _step(actor: Any) -> None:
    with torch.no_grad():
        for t in actor.state.values():
            t.add_(1.0)


def _equal(actor: Any, other: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(actor.state[k], v) for k, v in other.items())


def _state(actor: Any) -> dict[str, torch.Tensor]:
    return actor.state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--syncs", type=int, default=9)
    p.add_argument("--same-node", default="off", choices=("off", "map"))
    args = p.parse_args()
    import ray_rdt_pool
    from ray_rdt_pool.weights import sync

    env = {"RAY_RDT_POOL_SAME_NODE": args.same_node, "RAY_RDT_POOL_POOL_BYTES": "96M",
           "RAY_RDT_POOL_ARENA_BYTES": "96M", "RAY_RDT_POOL_METRICS": "0"}
    # Other settings of this package in the caller's environment reach the actors too.
    env.update({k: v for k, v in os.environ.items() if k.startswith("RAY_RDT_POOL_")})
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    ray_rdt_pool.register()

    @ray.remote(enable_tensor_transport=True)
    class Node:
        def __init__(self) -> None:
            torch.set_num_threads(1)

    tr, rc = Node.remote(), Node.remote()
    ray.get(rc.__ray_call__.remote(_receiver))
    times: dict[int, list[float]] = {4: [], 64: []}
    calls: dict[int, int] = {}
    buckets = {4: 16, 64: 1}
    version = 0
    for rep in range(args.syncs + 1):
        for n in (4, 64):
            ray.get(tr.__ray_call__.remote(_trainer, buckets[n]))
            ray.get(tr.__ray_call__.remote(_step))
            version += 1
            t0 = time.perf_counter()
            r = sync(tr, [rc], timeout_s=60, version=version)
            dt = time.perf_counter() - t0
            assert r.buckets == n, (r.buckets, n)
            calls[n] = r.ray_calls
            if rep:
                times[n].append(dt)
    want = ray.get(tr.__ray_call__.remote(_state))
    assert ray.get(rc.__ray_call__.remote(_equal, want)), "the receiver holds other bytes"
    med = {n: statistics.median(ts) for n, ts in times.items()}
    print(f"same_node={args.same_node}, 64 MiB in 64 tensors, {args.syncs} warm syncs each")
    for n in (4, 64):
        print(f"  {n:>2} buckets: {med[n] * 1e3:7.1f} ms median, {calls[n]} Ray calls per sync")
    print(f"  64 / 4 buckets: {med[64] / med[4]:.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
