"""GPU benchmark: nixl_pool against Ray's built-in transports on CUDA.

Two actors share one GPU (num_gpus=0.5 each). Each variant runs alone (its actors are
the only ones alive). Every transfer is checked by a checksum computed on both sides.

Variants: ``nixl_pool`` (ours, CUDA pools; on one node the receiver opens the sender's
pool through CUDA IPC and copies device to device), ``nixl_pool_read`` (ours with
``same_node="off"``: a NIXL READ), Ray's ``nixl`` without and with its memory pool
(``nixl``, ``nixl_pool_ray``) and Ray's ``cuda_ipc`` (zero copy: the receiver's tensors
*are* the sender's, so it is no snapshot; a sender that changes its tensors after the
put changes what the receiver sees).

    python -m microbenchmarks.bench_gpu --json gpu.json            # on a GPU machine
    python -m microbenchmarks.bench_gpu --device cpu --quick       # smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import ray
import torch

import ray_rdt_pool

VARIANTS = ("nixl_pool", "nixl_pool_read", "nixl", "nixl_pool_ray", "cuda_ipc")
OURS = ("nixl_pool", "nixl_pool_read")


def workloads(quick: bool) -> dict[str, list[tuple[tuple[int, ...], str]]]:
    """name -> list of (shape, dtype) of the tensors sent."""
    k = 8 if quick else 1
    tf: list[tuple[tuple[int, ...], str]] = []
    d = 2048 // (2 if quick else 1)
    for _ in range(12 if not quick else 3):
        tf += [((3 * d, d), "bfloat16"), ((d, d), "bfloat16"), ((4 * d, d), "bfloat16"),
               ((d, 4 * d), "bfloat16"), ((d,), "float32"), ((d,), "float32")]
    return {
        "big": [(((64 << 20) // k,), "float32")],
        "many": [((16384,), "float32")] * (1000 // k),
        "views": [(("views", 10_000 // k, 256), "float32")],
        "transformer": tf,
    }


def build(spec: list[Any], device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    out: list[torch.Tensor] = []
    for shape, dt in spec:
        if shape and shape[0] == "views":
            w = torch.randn(shape[1], shape[2], generator=g).to(device)
            out.extend(w[i] for i in range(shape[1]))
        else:
            out.append(torch.randn(*shape, generator=g).to(getattr(torch, dt)).to(device))
    return out


def checksum(ts: list[torch.Tensor]) -> float:
    """One number from every tensor, with one device sync (not one per tensor)."""
    if not ts:
        return 0.0
    return float(torch.stack([t.double().sum() for t in ts]).sum().item())


def make_actors(variant: str, device: str, gpus: float, pool_bytes: int) -> tuple[Any, Any]:
    transport = {"cuda_ipc": "cuda_ipc"}.get(variant, "nixl_pool" if variant in OURS
                                                else "nixl")

    @ray.remote(num_gpus=gpus, enable_tensor_transport=True)
    class Sender:
        def __init__(self) -> None:
            ray_rdt_pool.register()
            if variant in OURS:
                ray_rdt_pool.configure(pool_bytes=pool_bytes, arena_bytes=pool_bytes,
                                       device=device, same_node=_same_node(variant))
            if variant == "nixl_pool_ray":
                ray.experimental.register_nixl_memory_pool(pool_bytes, torch.device(device))
            self.ts: list[torch.Tensor] = []

        def load(self, spec: list[Any], seed: int) -> float:
            self.ts = build(spec, device, seed)
            return checksum(self.ts)

        def put(self) -> tuple[list[Any], float]:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ref = ray.put(self.ts, _tensor_transport=transport)
            return [ref], time.perf_counter() - t0

    @ray.remote(num_gpus=gpus, enable_tensor_transport=True)
    class Receiver:
        def __init__(self) -> None:
            ray_rdt_pool.register()
            if variant in OURS:
                ray_rdt_pool.configure(pool_bytes=pool_bytes, arena_bytes=pool_bytes,
                                       device=device, same_node=_same_node(variant))

        def get(self, refs: list[Any]) -> float:
            t0 = time.perf_counter()
            self.out = ray.get(refs[0])
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        def check(self) -> float:
            """The checksum of the last get, outside the timed part; drops its tensors."""
            out, self.out = self.out, []
            return checksum(out)

        def counters(self) -> dict[str, int]:
            s = ray_rdt_pool.stats()
            return {"mapped_gets": s.mapped_gets, "reads_posted": s.reads_posted}

    return Sender.remote(), Receiver.remote()


def _measure(s: Any, r: Any, spec: list[Any], reps: int) -> dict[str, Any]:
    expected = ray.get(s.load.remote(spec, 0))
    e2e, puts, gets = [], [], []
    mismatch = ""
    for _ in range(reps):
        t0 = time.perf_counter()
        refs, put_s = ray.get(s.put.remote())
        get_s = ray.get(r.get.remote(refs))
        e2e.append(time.perf_counter() - t0)
        puts.append(put_s)
        gets.append(get_s)
        got = ray.get(r.check.remote())
        if abs(got - expected) > 1e-6 * max(1.0, abs(expected)):
            mismatch = f"{got} != {expected}"
        del refs
    med = _warm_median(e2e)
    return {"e2e_s": e2e, "put_s": puts, "get_s": gets, "median_e2e_s": med,
            "mismatch": mismatch}


def _warm_median(xs: list[float]) -> float:
    """Median without the first repetition (pool creation, first contact)."""
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def _same_node(variant: str) -> str:
    return "off" if variant == "nixl_pool_read" else "map"


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    gpus = 0.5 if device == "cuda" else 0
    ray.init(num_gpus=1 if device == "cuda" else 0, include_dashboard=False,
             log_to_driver=False,
             runtime_env={"env_vars": {"RAY_RDT_POOL_METRICS": "0"}})
    ray_rdt_pool.register()
    results: dict[str, Any] = {"device": device, "gpu": _gpu_name(), "samples": {}}
    for variant in args.variants.split(","):
        s, r = make_actors(variant, device, gpus, args.pool_bytes)
        for name, spec in workloads(args.quick).items():
            if args.workloads and name not in args.workloads.split(","):
                continue
            try:
                sample = _measure(s, r, spec, args.reps)
            except ray.exceptions.RayError as e:  # one variant failing must not end the run
                results.setdefault("errors", {})[f"{variant}/{name}"] = str(e)[-2000:]
                print(f"{variant:14s} {name:12s} FAILED: {str(e).splitlines()[-1][:200]}",
                      flush=True)
                continue
            if sample["mismatch"]:
                sys.exit(f"CHECKSUM MISMATCH {variant}/{name}: {sample['mismatch']}")
            results["samples"][f"{variant}/{name}"] = sample
            print(f"{variant:14s} {name:12s} e2e median {sample['median_e2e_s'] * 1e3:8.1f} ms"
                  f"  (put {_warm_median(sample['put_s']) * 1e3:7.1f},"
                  f" get {_warm_median(sample['get_s']) * 1e3:7.1f})", flush=True)
        if variant in OURS:
            results.setdefault("counters", {})[variant] = ray.get(r.counters.remote())
            print(f"{variant:14s} receiver counters {results['counters'][variant]}")
        ray.kill(s)
        ray.kill(r)
        time.sleep(1)
    ray.shutdown()
    for name in workloads(args.quick):
        ours = results["samples"].get(f"nixl_pool/{name}")
        if not ours:
            continue
        for other in ("nixl_pool_read", "nixl", "nixl_pool_ray", "cuda_ipc"):
            theirs = results["samples"].get(f"{other}/{name}")
            if theirs:
                ratio = theirs["median_e2e_s"] / ours["median_e2e_s"]
                results.setdefault("speedup", {})[f"{name} vs {other}"] = ratio
                print(f"speedup {name:12s} vs {other:14s} {ratio:6.2f}x")
    return results


def _gpu_name() -> str | None:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--workloads", default="")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pool-bytes", type=int, default=4 << 30,
                   help="pool and arena bytes of each actor (ours and Ray's pool); the "
                        "transformer set is 1.2 GB and the next put may come before the "
                        "last object is freed")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu for a smoke run")
    results = run(args)
    results["command"] = " ".join(["python -m microbenchmarks.bench_gpu", *sys.argv[1:]])
    results["date"] = time.strftime("%Y-%m-%d")
    results["host"] = os.uname().nodename
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
