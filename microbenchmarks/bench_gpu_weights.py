"""GPU weight-sync benchmark: the weights API on CUDA against Ray's anchor pattern.

One trainer and two receivers share one GPU (``num_gpus=0.3`` each), as an RL trainer and
its rollout engines do on one node. The state is the ``transformer`` set of
``bench_gpu`` (bf16 matrices and fp32 vectors, about 1.2 GB; ``--quick``: about 75 MB).
Each variant runs alone (its actors are the only ones alive) for ``--syncs`` syncs; the
trainer changes its weights before every sync, and after the last one every receiver's
checksum must equal the trainer's. A sync's time runs from the driver's call until every
receiver has loaded and synchronised its device.

Variants:

* ``anchor-ray-nixl`` / ``anchor-ray-cuda_ipc``: Ray's ``WeightSyncManager`` pattern on
  Ray's own transports: the state dict in dict chunks of 64 MiB, each ``ray.put`` with
  ``_tensor_transport``; every receiver ``ray.get``\\ s all of them, then copies them into
  its weights. Ray's ``cuda_ipc`` shares the trainer's memory itself (zero copy, no
  snapshot).
* ``pool-stream``: ``WeightSender.stream`` (64 MiB buckets, ``max_inflight=2``, CUDA
  pools) into a ``load_weights`` loader that copies into the receiver's weights, as an
  engine's loader does.
* ``pool-stream-dest``: the same stream into ``WeightReceiver(dest)``: buckets land in
  the receiver's weights (no loader copy).

    python -m microbenchmarks.bench_gpu_weights --json gpu-weights.json     # on a GPU
    python -m microbenchmarks.bench_gpu_weights --device cpu --quick        # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import ray
import torch

import ray_rdt_pool
from microbenchmarks.bench_gpu import build, workloads

VARIANTS = ("anchor-ray-nixl", "anchor-ray-cuda_ipc", "pool-stream", "pool-stream-dest")
CHUNK = 64 << 20  # Ray's chunks, and our buckets unless --bucket-mib says otherwise


def _state(spec: list[Any], device: str, seed: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": t for i, t in enumerate(build(spec, device, seed))}


@ray.remote(enable_tensor_transport=True, num_cpus=0)
class Node:
    """The trainer or a receiver: a state dict of CUDA (or CPU) tensors."""

    def __init__(self, variant: str, role: str, spec: list[Any], device: str,
                 pool_bytes: int, bucket_bytes: int = CHUNK) -> None:
        from ray_rdt_pool.weights import WeightReceiver, WeightSender

        ray_rdt_pool.register()
        self.device = device
        if variant.startswith("pool-"):
            ray_rdt_pool.configure(pool_bytes=pool_bytes, arena_bytes=pool_bytes,
                                   device=device, same_node="map")
        self.state = _state(spec, device, 0 if role == "trainer" else 1)
        if role == "trainer":
            self.weight_sender = WeightSender(self.state, bucket_bytes=bucket_bytes)
        elif variant == "pool-stream":
            self.weight_receiver = WeightReceiver(load_weights=self._load)
        elif variant == "pool-stream-dest":
            self.weight_receiver = WeightReceiver(self.state)
        self._sync()

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def _load(self, pairs: Any) -> None:
        for n, t in pairs:
            self.state[n].copy_(t)

    @torch.no_grad()
    def step(self) -> None:
        for t in self.state.values():
            t.view(-1)[:64].add_(1)
        self._sync()

    def anchor_put(self, transport: str) -> list[Any]:
        refs, cur, size = [], {}, 0
        for n, t in self.state.items():
            if cur and size + t.nbytes > CHUNK:
                refs.append(ray.put(cur, _tensor_transport=transport))
                cur, size = {}, 0
            cur[n] = t
            size += t.nbytes
        if cur:
            refs.append(ray.put(cur, _tensor_transport=transport))
        return [refs]

    @torch.no_grad()
    def anchor_load(self, box: list[Any]) -> None:
        sd: dict[str, torch.Tensor] = {}
        for r in box[0]:
            sd.update(ray.get(r))
        for n, t in sd.items():
            self.state[n].copy_(t)
        del sd
        self._sync()

    def device_sync(self) -> None:
        self._sync()

    def checksum(self) -> float:
        return float(torch.stack([t.double().sum() for t in self.state.values()]).sum())

    def counters(self) -> dict[str, int]:
        s = ray_rdt_pool.stats()
        return {"mapped_gets": s.mapped_gets, "reads_posted": s.reads_posted}


def run_variant(variant: str, spec: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    from ray_rdt_pool.weights import sync

    gpus = 0.3 if args.device == "cuda" else 0
    opts = {"num_gpus": gpus}
    bb = args.bucket_mib << 20
    tr = Node.options(**opts).remote(variant, "trainer", spec, args.device, args.pool_bytes,
                                     bb)
    rs = [Node.options(**opts).remote(variant, "receiver", spec, args.device, args.pool_bytes,
                                      bb) for _ in range(2)]
    times: list[float] = []
    try:
        ray.get([a.device_sync.remote() for a in (tr, *rs)])
        for k in range(args.syncs):
            ray.get(tr.step.remote())
            t0 = time.perf_counter()
            if variant.startswith("anchor-"):
                box = ray.get(tr.anchor_put.remote(variant.removeprefix("anchor-ray-")))
                ray.get([r.anchor_load.remote(box) for r in rs])
                del box
            else:
                sync(tr, rs, mode="stream", max_inflight=2, version=k + 1)
                ray.get([r.device_sync.remote() for r in rs])
            times.append(time.perf_counter() - t0)
        want = ray.get(tr.checksum.remote())
        got = ray.get([r.checksum.remote() for r in rs])
        ok = all(abs(g - want) <= 1e-6 * max(1.0, abs(want)) for g in got)
        counters = ray.get(rs[0].counters.remote()) if variant.startswith("pool-") else {}
    finally:
        for a in (tr, *rs):
            ray.kill(a)
        time.sleep(1)
    warm = times[1:] if len(times) > 1 else times
    return {"variant": variant, "times_s": times, "warm_median_s": statistics.median(warm),
            "cold_s": times[0], "checksums_ok": ok, "counters": counters}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--syncs", type=int, default=6)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--bucket-mib", type=int, default=64, help="our bucket size (Ray's "
                   "chunks stay 64 MiB)")
    p.add_argument("--pool-bytes", type=int, default=1 << 30,
                   help="pool and arena bytes of our actors (at least 2 buckets)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu for a smoke run")
    spec = workloads(args.quick)["transformer"]
    ray.init(num_gpus=1 if args.device == "cuda" else 0, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"RAY_RDT_POOL_METRICS": "0"}})
    ray_rdt_pool.register()
    nbytes = sum(t.nbytes for t in build(spec, "cpu", 0))
    print(f"state: {len(spec)} tensors, {nbytes / 2**20:.0f} MiB on {args.device}; "
          f"1 trainer, 2 receivers, {args.syncs} syncs (1 cold), our buckets "
          f"{args.bucket_mib} MiB", flush=True)
    results: dict[str, Any] = {"device": args.device, "bytes": nbytes, "results": [],
                               "errors": {}}
    try:
        for v in args.variants.split(","):
            if v == "anchor-ray-cuda_ipc" and args.device != "cuda":
                continue
            try:
                r = run_variant(v, spec, args)
            except ray.exceptions.RayError as e:  # one variant failing must not end the run
                results["errors"][v] = str(e)[-2000:]
                print(f"{v:20s} FAILED: {str(e).splitlines()[-1][:200]}", flush=True)
                continue
            results["results"].append(r)
            print(f"{v:20s} warm median {r['warm_median_s'] * 1e3:9.1f} ms  cold "
                  f"{r['cold_s'] * 1e3:9.1f} ms  ok={r['checksums_ok']} {r['counters']}",
                  flush=True)
    finally:
        ray.shutdown()
    by = {r["variant"]: r for r in results["results"]}
    for ours in ("pool-stream", "pool-stream-dest"):
        for other in ("anchor-ray-nixl", "anchor-ray-cuda_ipc"):
            if ours in by and other in by:
                ratio = by[other]["warm_median_s"] / by[ours]["warm_median_s"]
                results.setdefault("speedup", {})[f"{ours} vs {other}"] = ratio
                print(f"speedup {ours:18s} vs {other:20s} {ratio:7.2f}x")
    bad = [r["variant"] for r in results["results"] if not r["checksums_ok"]]
    results["command"] = " ".join(["python -m microbenchmarks.bench_gpu_weights", *sys.argv[1:]])
    results["date"] = time.strftime("%Y-%m-%d")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if bad:
        sys.exit(f"CHECKSUM MISMATCH: {bad}")


if __name__ == "__main__":
    main()
