"""Syncing while serving, and catching up from a peer: the figures of issue 50's targets.

One Ray node; a trainer and two engines, each holding a 64 MiB fp32 model (64 tensors
of 1 MiB) in a ``WeightReceiver(staging="shadow")``. In one run, alternating:

* **catch-up**: the trainer syncs engine 1; then engine 2, a version behind, catches up
  from engine 1 (``catch_up``). Reported: the warm medians and their ratio.
* **pause**: how long each commit held the serving lock (``last_pause_s`` of the
  shadow), the time a forward pass may wait at a commit.
* **overlap**: a rollout on engine 1 (``--steps`` forward passes under ``serving()``,
  each a little compute and a wait standing for the accelerator) alone, a sync alone,
  then both at once (``sync(..., wait=False)`` while the rollout runs). Reported: the
  overlapped time over the longer of the two alone.

Run: python -m microbenchmarks.bench_serving [--reps 5] [--steps 40]
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


def _trainer(actor: Any) -> None:
    from ray_rdt_pool.weights import WeightSender

    g = torch.Generator().manual_seed(0)
    actor.state = {f"w{i}": torch.randn(MIB // 4, generator=g) for i in range(64)}
    actor.weight_sender = WeightSender(actor.state, bucket_bytes=8 * MIB)


def _step(actor: Any) -> None:
    with torch.no_grad():
        for t in actor.state.values():
            t.add_(1.0)


def _engine(actor: Any) -> None:
    from ray_rdt_pool.weights import WeightReceiver

    actor.state = {f"w{i}": torch.zeros(MIB // 4) for i in range(64)}
    actor.weight_receiver = WeightReceiver(actor.state, staging="shadow")


def _rollout(actor: Any, steps: int, wait_s: float) -> float:
    """``steps`` forward passes: each a little compute under serving(), then a wait
    (the accelerator's part of a generation step)."""
    x = torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(steps):
        with actor.weight_receiver.serving():
            x = torch.tanh(x @ actor.state["w0"][:65536].view(256, 256))
        time.sleep(wait_s)
    return time.perf_counter() - t0


def _pause(actor: Any) -> float:
    return float(actor.weight_receiver._shadow.last_pause_s)


def _version(actor: Any) -> int:
    return int(actor.weight_receiver.version)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=40, help="forward passes of a rollout")
    p.add_argument("--wait-ms", type=float, default=5.0, help="per pass, the accelerator")
    args = p.parse_args()
    import ray_rdt_pool
    from ray_rdt_pool.weights import catch_up, sync

    env = {"RAY_RDT_POOL_POOL_BYTES": "96M", "RAY_RDT_POOL_ARENA_BYTES": "96M",
           "RAY_RDT_POOL_METRICS": "0"}
    env.update({k: v for k, v in os.environ.items() if k.startswith("RAY_RDT_POOL_")})
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    ray_rdt_pool.register()

    @ray.remote(enable_tensor_transport=True, max_concurrency=2)
    class Node:
        def __init__(self) -> None:
            torch.set_num_threads(1)

    tr, e1, e2 = Node.remote(), Node.remote(), Node.remote()
    ray.get(tr.__ray_call__.remote(_trainer))
    ray.get([e.__ray_call__.remote(_engine) for e in (e1, e2)])
    v = 0
    t_sync, t_cu, pauses = [], [], []
    for rep in range(args.reps + 1):
        ray.get(tr.__ray_call__.remote(_step))
        v += 1
        t0 = time.perf_counter()
        sync(tr, [e1], version=v)
        dt = time.perf_counter() - t0
        t0 = time.perf_counter()
        catch_up(e1, [e2])
        dc = time.perf_counter() - t0
        assert ray.get(e2.__ray_call__.remote(_version)) == v
        if rep:
            t_sync.append(dt)
            t_cu.append(dc)
            pauses.append(ray.get(e1.__ray_call__.remote(_pause)))
    s, c = statistics.median(t_sync), statistics.median(t_cu)
    print(f"64 MiB, one node; {args.reps} warm reps each")
    print(f"  trainer sync {s * 1e3:.1f} ms, catch-up from a peer {c * 1e3:.1f} ms: "
          f"{c / s:.2f}x")
    print(f"  commit pause (serving lock held): median {statistics.median(pauses) * 1e3:.1f}"
          f" ms, max {max(pauses) * 1e3:.1f} ms")
    wait_s = args.wait_ms / 1e3
    alone_r, alone_s, both = [], [], []
    for rep in range(args.reps + 1):
        t0 = time.perf_counter()
        ray.get(e1.__ray_call__.remote(_rollout, args.steps, wait_s))
        r = time.perf_counter() - t0
        ray.get(tr.__ray_call__.remote(_step))
        v += 1
        t0 = time.perf_counter()
        sync(tr, [e1], version=v)
        s1 = time.perf_counter() - t0
        ray.get(tr.__ray_call__.remote(_step))
        v += 1
        t0 = time.perf_counter()
        handle = sync(tr, [e1], version=v, wait=False)
        ray.get(e1.__ray_call__.remote(_rollout, args.steps, wait_s))
        handle.result()
        b = time.perf_counter() - t0
        if rep:
            alone_r.append(r)
            alone_s.append(s1)
            both.append(b)
    r, s1, b = (statistics.median(x) for x in (alone_r, alone_s, both))
    print(f"  rollout alone {r * 1e3:.1f} ms, sync alone {s1 * 1e3:.1f} ms, both at once "
          f"(wait=False) {b * 1e3:.1f} ms: {b / max(r, s1):.2f}x the longer")
    ray.shutdown()


if __name__ == "__main__":
    main()
