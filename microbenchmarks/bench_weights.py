"""Weight-sync benchmark: ray_rdt_pool.weights against the best way on Ray's built-in nixl.

One trainer actor holds a transformer-shaped weight set (bf16 matrices, fp32 norms and
biases; about 500 MiB and 200 tensors at the full size, about 64 MiB with --quick) and
syncs it to two receiver actors ``--syncs`` times. Variants, each run alone (the previous
variant's actors are killed first: idle NIXL agents burn CPU on a small machine):

* ``pool-stream``: :func:`ray_rdt_pool.weights.sync`, streaming, ``max_inflight=2``
  (packing bucket k+1 overlaps the receivers' reads of bucket k); the sender pool holds
  two buckets only, far less than the model.
* ``pool-stream-serial``: the same with ``max_inflight=1`` (pipelining off).
* ``pool-publish``: every bucket put at once, then both receivers load the manifest;
  the pool holds the whole model.
* ``ray-nixl``: Ray's own ``nixl`` transport, the best way we know: per sync the
  trainer ``ray.put``\\ s its tensors with ``_tensor_transport="nixl"`` (registered by
  reference, no copy) and each receiver ``set_target_for_ref``\\ s its own parameters and
  ``ray.get``\\ s. Ray's memory pool is not used in this variant (peak pool: n/a).

Receivers land the bytes directly in their parameters in every variant. Between syncs
the trainer changes every tensor a little; after the last sync the receivers' checksums
must equal the trainer's. Reported per variant: cold (first) and warm (median of the
rest) seconds per sync, GB/s of the weight set at the warm median, the sender's peak
pool bytes, and the ratio against ``ray-nixl``.

Run: python -m microbenchmarks.bench_weights [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from typing import Any

import ray
import torch

import ray_rdt_pool
from ray_rdt_pool.weights import WeightReceiver, WeightSender, sync

VARIANTS = ("pool-stream", "pool-stream-serial", "pool-publish", "ray-nixl")
MIB = 1 << 20

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


def weight_layout(hidden: int, layers: int, vocab: int) -> Layout:
    """A decoder's weights: per layer 6 bf16 matrices and 4 fp32 vectors, plus embedding
    (bf16) and final norm (fp32)."""
    d, f = hidden, 4 * hidden
    bf, fp = torch.bfloat16, torch.float32
    out: Layout = [("embed", (vocab, d), bf)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "attn_norm", (d,), fp), (p + "q", (d, d), bf), (p + "k", (d, d), bf),
                (p + "v", (d, d), bf), (p + "o", (d, d), bf), (p + "mlp_norm", (d,), fp),
                (p + "up", (f, d), bf), (p + "up_bias", (f,), fp), (p + "down", (d, f), bf),
                (p + "down_bias", (d,), fp)]
    out.append(("final_norm", (d,), fp))
    return out


def layout_bytes(layout: Layout) -> int:
    return sum(torch.Size(s).numel() * torch.empty(0, dtype=dt).element_size()
               for _n, s, dt in layout)


def build(layout: Layout, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g, dtype=torch.float32).to(dt) for n, s, dt in layout}


@ray.remote(enable_tensor_transport=True, num_cpus=0)
class Node:
    """A trainer or a receiver; one process each."""

    def __init__(self, layout: Layout, seed: int, pool_bytes: int, bucket_bytes: int) -> None:
        ray_rdt_pool.register()
        ray_rdt_pool.configure(pool_bytes=pool_bytes, arena_bytes=64 * MIB)
        torch.set_num_threads(1)
        self.state = build(layout, seed)
        self.tensors = list(self.state.values())
        self.weight_sender = WeightSender(self.state, bucket_bytes=bucket_bytes)
        self.weight_receiver = WeightReceiver(self.state)

    def ready(self) -> int:
        return os.getpid()

    def step(self) -> None:
        """A cheap stand-in for an optimizer step: every tensor changes in place."""
        with torch.no_grad():
            for t in self.tensors:
                t.view(-1)[:64].add_(1)

    def checksum(self) -> list[float]:
        return [float(t.view(-1)[:4096].float().sum()) + float(t.view(-1)[-1])
                for t in self.tensors]

    def stats(self) -> dict[str, Any]:
        return ray_rdt_pool.stats().as_dict()

    # -- Ray's nixl baseline --

    def nixl_put(self) -> list[Any]:
        return [ray.put(self.tensors, _tensor_transport="nixl")]

    def nixl_load(self, box: list[Any]) -> None:
        ray.experimental.set_target_for_ref(box[0], self.tensors)
        got = ray.get(box[0])
        assert all(g.data_ptr() == t.data_ptr() for g, t in zip(got, self.tensors))


def run_variant(name: str, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    total = layout_bytes(layout)
    bucket = args.bucket_mib * MIB
    pool = {"pool-publish": total + 64 * MIB, "ray-nixl": 64 * MIB}.get(name, 2 * bucket)
    trainer = Node.remote(layout, 0, pool, bucket)
    receivers = [Node.remote(layout, 100 + i, pool, bucket) for i in range(args.receivers)]
    actors = [trainer, *receivers]
    ray.get([a.ready.remote() for a in actors])
    times: list[float] = []
    peak = 0
    waits: list[float] = []
    direct = True
    try:
        for _ in range(args.syncs):
            ray.get(trainer.step.remote())
            t0 = time.perf_counter()
            if name == "ray-nixl":
                box = ray.get(trainer.nixl_put.remote())
                ray.get([r.nixl_load.remote(box) for r in receivers])
                del box
            else:
                mode = "publish" if name == "pool-publish" else "stream"
                rep = sync(trainer, receivers, mode=mode,
                           max_inflight=1 if name == "pool-stream-serial" else 2)
                peak = max(peak, rep.sender_pool_used)
                direct = direct and all(ld.direct_buckets == ld.buckets for ld in rep.loads)
                if rep.stream is not None:
                    waits.append(rep.stream.pool_wait_seconds)
                    assert rep.stream.fallbacks == 0, rep.stream
            times.append(time.perf_counter() - t0)
        want = ray.get(trainer.checksum.remote())
        ok = all(ray.get(r.checksum.remote()) == want for r in receivers)
        st = ray.get(trainer.stats.remote())
    finally:
        for a in actors:
            ray.kill(a)
        del actors, trainer, receivers
        gc.collect()
        time.sleep(args.settle)
    warm = times[1:] or times
    med = statistics.median(warm)
    return {
        "variant": name, "bytes": total, "tensors": len(layout), "syncs": len(times),
        "cold_s": times[0], "warm_median_s": med, "warm_min_s": min(warm),
        "warm_max_s": max(warm), "gbps": total / med / 1e9,
        "peak_pool_bytes": None if name == "ray-nixl" else peak,
        "pool_capacity": None if name == "ray-nixl" else st["pool_capacity"],
        "fallbacks": st["fallbacks"], "direct": direct if name != "ray-nixl" else True,
        "pool_wait_median_s": statistics.median(waits) if waits else None,
        "checksums_ok": ok, "times_s": times, "loadavg_after": list(os.getloadavg()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="weight sync: nixl_pool vs Ray's nixl")
    p.add_argument("--quick", action="store_true", help="about 64 MiB instead of 500 MiB")
    p.add_argument("--hidden", type=int, help="hidden size (default 1024, quick 512)")
    p.add_argument("--layers", type=int, help="layers (default 20, quick 10)")
    p.add_argument("--vocab", type=int, help="vocabulary (default 8192, quick 4096)")
    p.add_argument("--bucket-mib", type=int, help="bucket size in MiB (default 64, quick 8)")
    p.add_argument("--syncs", type=int, default=10)
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds to wait after killing a variant's actors")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    q = args.quick
    args.hidden = args.hidden or (512 if q else 1024)
    args.layers = args.layers or (10 if q else 20)
    args.vocab = args.vocab or (4096 if q else 8192)
    args.bucket_mib = args.bucket_mib or (8 if q else 64)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {VARIANTS}")

    layout = weight_layout(args.hidden, args.layers, args.vocab)
    total = layout_bytes(layout)
    command = shlex.join([sys.executable, "-m", "microbenchmarks.bench_weights",
                          *(sys.argv[1:] if argv is None else argv)])
    print(f"command: {command}")
    print(f"weight set: {len(layout)} tensors, {total / MIB:.1f} MiB; {args.receivers} "
          f"receivers, {args.syncs} syncs, buckets of {args.bucket_mib} MiB; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    ray_rdt_pool.register()
    ray.init(address="local", include_dashboard=False, logging_level="warning")
    results = []
    try:
        for v in variants:
            r = run_variant(v, layout, args)
            results.append(r)
            print(f"  {v:19s} cold {r['cold_s'] * 1e3:8.1f} ms  warm median "
                  f"{r['warm_median_s'] * 1e3:8.1f} ms  ok={r['checksums_ok']}", flush=True)
    finally:
        ray.shutdown()

    base = next((r for r in results if r["variant"] == "ray-nixl"), None)
    print()
    print(f"{'variant':19s} {'cold s':>8s} {'warm med s':>10s} {'min s':>7s} {'GB/s':>6s} "
          f"{'peak pool':>12s} {'vs ray-nixl':>11s}")
    for r in results:
        ratio = base["warm_median_s"] / r["warm_median_s"] if base else None
        r["speedup_vs_ray_nixl"] = ratio
        peak = "n/a" if r["peak_pool_bytes"] is None else f"{r['peak_pool_bytes'] / MIB:.0f} MiB"
        print(f"{r['variant']:19s} {r['cold_s']:8.3f} {r['warm_median_s']:10.3f} "
              f"{r['warm_min_s']:7.3f} {r['gbps']:6.2f} {peak:>12s} "
              f"{'' if ratio is None else f'{ratio:.2f}x':>11s}")
    by = {r["variant"]: r for r in results}
    if "pool-stream" in by and "pool-stream-serial" in by:
        gain = by["pool-stream-serial"]["warm_median_s"] / by["pool-stream"]["warm_median_s"]
        print(f"pipelining (max_inflight 2 vs 1): {gain:.2f}x")
    bad = [r["variant"] for r in results if not r["checksums_ok"]]
    if bad:
        print(f"CHECKSUM MISMATCH in {bad}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "bytes": total, "tensors": len(layout),
                       "cpus": os.cpu_count(), "torch": torch.__version__,
                       "ray": ray.__version__, "args": vars(args), "results": results},
                      f, indent=2)
        print(f"wrote {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
