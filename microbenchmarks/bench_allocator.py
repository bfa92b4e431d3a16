"""Allocator microbenchmark: our layout + BlockAllocator versus Ray's MemoryPoolManager.

Not a test. Run as ``python -m microbenchmarks.bench_allocator [--quick]``.

Ray's ``MemoryPoolManager.allocate_group`` both places an object and copies its
tensors into the pool, so two pairs of figures are reported, each like-for-like:

* allocation only: Ray's ``allocate_group`` + ``free_object`` on a subclass whose
  ``_copy_into_pool`` does nothing, versus ours in two forms: from per-tensor sizes
  (``packed_offsets`` -> ``BlockAllocator.allocate`` -> ``free``, the same inputs
  Ray uses), and the transport's path (shapes/dtypes -> ``runs_from`` ->
  ``run_layout`` -> allocate -> free), which also builds the runs the wire carries.
* allocation and copy: Ray's unmodified ``allocate_group`` + ``free_object`` versus
  the transport's path plus a plain per-tensor ``copy_`` of each tensor's bytes
  into a CPU pool tensor.

All variants run interleaved in one process on CPU tensors; each figure is the
median over repetitions of the mean time of one allocate+free cycle.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ray_rdt_pool.core.allocator import BlockAllocator
from ray_rdt_pool.core.layout import BLOCK_ALIGN, BlockMap, packed_offsets, run_layout
from ray_rdt_pool.core.runs import runs_from

_DTYPE_NAME = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.bool: "bool",
    torch.uint8: "uint8",
}


@dataclass
class Workload:
    name: str
    tensors: list[torch.Tensor]
    # Objects kept live between holes before the measured object is placed.
    holes: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def many_small(n: int) -> Workload:
    return Workload(f"{n:,} x 1 KiB float32", [torch.randn(256) for _ in range(n)])


def transformer_like(layers: int = 12, hidden: int = 512) -> Workload:
    """About 200 tensors: a few big matrices, many small norms and biases."""
    ts: list[torch.Tensor] = [torch.randn(4096, hidden).to(torch.bfloat16)]  # embedding
    for _ in range(layers):
        ts += [torch.randn(hidden), torch.randn(hidden)]  # norm weight/bias, fp32
        for _ in range(4):  # q, k, v, o and their biases
            ts += [torch.randn(hidden, hidden).to(torch.bfloat16),
                   torch.randn(hidden).to(torch.bfloat16)]
        ts += [torch.randn(hidden), torch.randn(hidden)]
        ts += [torch.randn(4 * hidden, hidden).to(torch.bfloat16),
               torch.randn(4 * hidden).to(torch.bfloat16),
               torch.randn(hidden, 4 * hidden).to(torch.bfloat16),
               torch.randn(hidden).to(torch.bfloat16)]
    ts += [torch.randn(hidden), torch.randn(hidden)]  # final norm
    ts += [torch.arange(2048, dtype=torch.int64), torch.ones(2048, dtype=torch.bool)]
    while len(ts) < 200:
        ts.append(torch.randn(hidden))
    return Workload(f"{len(ts)} mixed (transformer-like, {layers} layers)", ts)


def fragmented(holes: int) -> Workload:
    w = many_small(16)
    return Workload(f"16 x 1 KiB in a pool with {holes:,} free holes", w.tensors, holes)


class OurPool:
    def __init__(self, capacity: int) -> None:
        self.alloc = BlockAllocator(capacity)
        self.pool = torch.zeros(capacity, dtype=torch.uint8)

    def place(
        self, key: str, tensors: Sequence[torch.Tensor]
    ) -> tuple[Any, list[int], list[tuple[int, int, int]]]:
        """Place an object as the transport does; returns its blocks and tensor offsets."""
        runs = runs_from([t.shape for t in tensors], [_DTYPE_NAME[t.dtype] for t in tensors])
        specs = [(r.nbytes_each, r.itemsize, r.count) for r in runs]
        starts, total = run_layout(specs)
        blocks = self.alloc.allocate(key, total)
        return blocks, starts, specs

    @staticmethod
    def offsets(starts: list[int], specs: list[tuple[int, int, int]]) -> list[int]:
        out: list[int] = []
        for start, (n, _, count) in zip(starts, specs):
            out.extend(range(start, start + n * count, n) if n else [start] * count)
        return out

    def place_sizes(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        sizes = [t.element_size() for t in tensors]
        nbytes = [t.numel() * e for t, e in zip(tensors, sizes)]
        _, total = packed_offsets(nbytes, sizes)
        self.alloc.allocate(key, total)

    def place_and_copy(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        blocks, starts, specs = self.place(key, tensors)
        offsets = self.offsets(starts, specs)
        if len(blocks) == 1:
            # The usual case: one slice of the pool per tensor, as in Ray's copy.
            base = blocks[0].offset
            for t, off in zip(tensors, offsets):
                src = t.reshape(-1).view(torch.uint8)
                self.pool[base + off : base + off + src.numel()].copy_(src)
            return
        bmap = BlockMap(blocks)
        for t, off in zip(tensors, offsets):
            src = t.reshape(-1).view(torch.uint8)
            done = 0
            for p_off, n in bmap.map(off, src.numel()):
                self.pool[p_off : p_off + n].copy_(src[done : done + n])
                done += n

    def free(self, key: str) -> None:
        self.alloc.free(key)


def ray_pools(capacity: int) -> tuple[Any, Any]:
    from ray.experimental.rdt.nixl_memory_pool import MemoryPoolManager

    class NoCopy(MemoryPoolManager):  # type: ignore[misc]
        def _copy_into_pool(self, *args: Any) -> None:
            pass

    cpu = torch.device("cpu")
    return MemoryPoolManager(capacity, cpu), NoCopy(capacity, cpu)


def fill_holes(place: Callable[[str, list[torch.Tensor]], Any], free: Callable[[str], Any],
               holes: int) -> None:
    hole = [torch.randn(256)]
    for i in range(holes):
        place(f"hole{i}", hole)
        place(f"fence{i}", hole)
    for i in range(holes):
        free(f"hole{i}")


def time_cycles(fn: Callable[[], None], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def run(w: Workload, reps: int, iters: int) -> dict[str, float]:
    capacity = -(-(2 * w.nbytes + 4 * 1024 * (2 * w.holes + 64)) // BLOCK_ALIGN) * BLOCK_ALIGN
    ours = OurPool(capacity)
    ray_copy, ray_nocopy = ray_pools(capacity)
    if w.holes:
        fill_holes(ours.place, ours.free, w.holes)
        fill_holes(ray_copy.allocate_group, ray_copy.free_object, w.holes)
        fill_holes(ray_nocopy.allocate_group, ray_nocopy.free_object, w.holes)
    ts = w.tensors

    def ray_alloc() -> None:
        ray_nocopy.allocate_group("obj", ts)
        ray_nocopy.free_object("obj")

    def ours_sizes() -> None:
        ours.place_sizes("obj", ts)
        ours.free("obj")

    def ours_runs() -> None:
        ours.place("obj", ts)
        ours.free("obj")

    def ray_copy_fn() -> None:
        ray_copy.allocate_group("obj", ts)
        ray_copy.free_object("obj")

    def ours_copy() -> None:
        ours.place_and_copy("obj", ts)
        ours.free("obj")

    variants = {"ray_alloc": ray_alloc, "ours_sizes": ours_sizes, "ours_runs": ours_runs,
                "ray_copy": ray_copy_fn, "ours_copy": ours_copy}
    for fn in variants.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, fn in variants.items():  # interleaved, so drift hits all alike
            samples[name].append(time_cycles(fn, iters))
    return {k: statistics.median(v) for k, v in samples.items()}


def fmt_t(s: float) -> str:
    return f"{s * 1e6:,.1f} us" if s < 1e-3 else f"{s * 1e3:,.2f} ms"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and holes")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per figure")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    holes = 500 if args.quick else 2000
    torch.set_num_threads(1)
    torch.manual_seed(0)

    cmd = shlex.join([".venv/bin/python", "-m", "microbenchmarks.bench_allocator",
                      *(sys.argv[1:] if argv is None else argv)])
    print(f"command: {cmd}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, "
          f"loadavg {tuple(round(x, 2) for x in os.getloadavg())}, "
          f"python {platform.python_version()}, torch {torch.__version__}, "
          f"torch threads 1")
    print(f"{reps} repetitions, median of per-cycle means; one cycle = allocate + free "
          f"of one object\n")
    workloads = [
        (many_small(10_000), 5 if args.quick else 10),
        (transformer_like(), 10 if args.quick else 20),
        (fragmented(holes), 50 if args.quick else 200),
    ]
    rows = [
        ("ray_alloc", "Ray allocate_group + free_object, copy stubbed", None),
        ("ours_sizes", "ours: packed_offsets + allocate + free", "ray_alloc"),
        ("ours_runs", "ours: runs_from + run_layout + allocate + free", "ray_alloc"),
        ("ray_copy", "Ray allocate_group + free_object (with copy)", None),
        ("ours_copy", "ours: runs_from + run_layout + allocate + copy_ + free", "ray_copy"),
    ]
    print("| workload | variant | median per cycle | Ray / ours |")
    print("|---|---|---:|---:|")
    for w, iters in workloads:
        r = run(w, reps, iters)
        for key, label, base in rows:
            ratio = f"{r[base] / r[key]:.2f}x" if base else ""
            print(f"| {w.name} ({w.nbytes / 2**20:,.1f} MiB) | {label} | {fmt_t(r[key])} "
                  f"| {ratio} |", flush=True)
    print(
        "\nOne cycle = placing one object and freeing it. 'copy stubbed' = a subclass of "
        "Ray's MemoryPoolManager whose _copy_into_pool does nothing (placement, free-list "
        "handling and region slicing remain). packed_offsets uses the same per-tensor "
        "inputs as Ray (numel * element_size); runs_from + run_layout is the transport's "
        "path and also builds the runs sent on the wire. copy_ = a plain per-tensor copy "
        "into a CPU uint8 pool tensor, like Ray's. Ray / ours above 1: ours is faster."
    )


if __name__ == "__main__":
    main()
