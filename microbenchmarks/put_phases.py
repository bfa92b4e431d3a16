"""Where a put's time goes, phase by phase, for the batched and per-sample RL batches.

Not a test. Run as ``python -m microbenchmarks.put_phases [--reps R] [--idle-ms MS]
[--workloads W,...]``.

One process, no Ray and no NIXL: the steps of ``Sender.put`` on the host path, each timed
on its own, for the ``experience`` (5 tensors) and ``experience_samples`` (5,120 tensors)
workloads of ``ray-rdt-pool bench`` at full size (``--workloads`` picks others, such
as ``views``: 10,000 row views of one weight):

* ``describe``: :func:`ray_rdt_pool.memory.describe.describe`, every fact read off every tensor,
  once by its Python loop and, where ``python -m ray_rdt_pool.memory.native build`` made the
  compiled helper for this torch, once more by the helper (rows ``python`` and
  ``native``);
* ``group``: :func:`ray_rdt_pool.core.runs.runs_from`, equal (shape, dtype) tensors grouped;
* ``offsets``: the packed offset of every tensor, from the groups;
* ``pack``: :func:`ray_rdt_pool.memory.pack.pack_into` into one pre-faulted region, with the
  default ``Tuning``'s threads, threshold and streaming stores;
* ``wire``: the segments, the :class:`~ray_rdt_pool.core.codec.WireMeta` and its bytes.

Before every put the process sleeps ``--idle-ms`` (a sender between steps: its tensors'
torch objects are no longer in cache). Then, for the per-sample tensors, the cost of
each single torch attribute read or method call that ``describe`` makes, as one list
comprehension over all of them. Medians of ``--reps`` runs, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from ray_rdt_pool.bench import workloads as W
from ray_rdt_pool.bench.env import cpu_model, loadavg

#: What ``describe`` reads off each tensor, one call each.
READS: dict[str, Callable[[Any], Any]] = {
    "is_cpu": lambda t: t.is_cpu,
    "dtype": lambda t: t.dtype,
    "nbytes": lambda t: t.nbytes,
    "dim()": lambda t: t.dim(),
    "data_ptr()": lambda t: t.data_ptr(),
    "is_contiguous()": lambda t: t.is_contiguous(),
    "is_neg()": lambda t: t.is_neg(),
}


def put_phases(tensors: list[Any], region: Any, reps: int, idle_s: float,
               native: bool = True) -> dict[str, float]:
    """Median seconds of each phase of a host put of ``tensors`` into ``region``;
    ``native``: ``describe`` may use the compiled helper (``Tuning.native``)."""
    from ray_rdt_pool.config import Tuning
    from ray_rdt_pool.core.codec import WireMeta, encode
    from ray_rdt_pool.core.runs import runs_from
    from ray_rdt_pool.memory.describe import describe
    from ray_rdt_pool.memory.pack import pack_into
    from ray_rdt_pool.send.sender import _block_segments, run_offsets

    cfg = Tuning()
    times: dict[str, list[float]] = {}
    for _ in range(reps):
        time.sleep(idle_s)
        t0 = time.perf_counter()
        d = describe(tensors, native=native)
        t1 = time.perf_counter()
        runs = runs_from(d.shapes, d.dtypes)
        t2 = time.perf_counter()
        offsets, total = run_offsets(runs)
        if total > region.nbytes:  # pack_into trusts its blocks: never copy past the region
            raise ValueError(f"the packed object needs {total:,} bytes but the region holds "
                             f"{region.nbytes:,}; pass a region of at least {total:,} bytes")
        t3 = time.perf_counter()
        pack_into(tensors, d, offsets, [(0, total)], region, None,
                  threads=cfg.pack_thread_count, threshold=cfg.pack_threshold_bytes,
                  stream_min=cfg.stream_copy_bytes)
        t4 = time.perf_counter()
        segments = _block_segments([(0, total)], region.addr, total)
        encode(WireMeta("agent", 1, "cpu", 0, total, runs, tuple(segments)))
        t5 = time.perf_counter()
        for name, s in (("describe", t1 - t0), ("group", t2 - t1), ("offsets", t3 - t2),
                        ("pack", t4 - t3), ("wire", t5 - t4), ("put", t5 - t0)):
            times.setdefault(name, []).append(s)
    return {k: statistics.median(v) for k, v in times.items()}


def read_costs(tensors: list[Any], reps: int, idle_s: float) -> dict[str, float]:
    """Median seconds of one pass of each of ``describe``'s reads over ``tensors``."""
    out: dict[str, list[float]] = {}
    for _ in range(reps):
        for name, read in READS.items():
            time.sleep(idle_s)
            t0 = time.perf_counter()
            [read(t) for t in tensors]
            out.setdefault(name, []).append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m microbenchmarks.put_phases", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=15, help="puts per layout (default 15)")
    p.add_argument("--idle-ms", type=float, default=30.0,
                   help="sleep before every put or read pass, ms (default 30)")
    p.add_argument("--workloads", default=",".join(W.EXPERIENCE_WORKLOADS),
                   help="comma-separated bench workloads of one object each (default: "
                        f"{','.join(W.EXPERIENCE_WORKLOADS)}; also many, views, big)")
    a = p.parse_args(argv)
    if a.reps < 1 or a.idle_ms < 0:
        p.error(f"--reps must be at least 1 and --idle-ms at least 0, got {a.reps}, {a.idle_ms}")
    names = [w.strip() for w in a.workloads.split(",") if w.strip()]
    bad = [w for w in names if w not in W.WORKLOADS or w in W.SYNC_WORKLOADS]
    if bad or not names:
        p.error(f"--workloads: {', '.join(bad) or 'none given'} is not a one-object workload; "
                f"choose from {', '.join(w for w in W.WORKLOADS if w not in W.SYNC_WORKLOADS)}")
    from ray_rdt_pool.memory.allocations import HostMemory
    from ray_rdt_pool.memory.describe import native_active

    idle = a.idle_ms / 1e3
    print(f"put phases: {cpu_model()}, load average {loadavg()}, {a.reps} reps, "
          f"{a.idle_ms:g} ms idle before each; medians in ms")
    layouts = {name: W.build_tensors(W.make_spec(name, W.FULL_SIZES))[0] for name in names}
    region = HostMemory(max(sum(t.nbytes for t in ts) for ts in layouts.values()) + (8 << 20),
                        prefault=True)
    kinds = {"python": False, "native": True} if native_active() else {"python": False}
    if len(kinds) == 1:
        print("  (the compiled describe helper is not built for this torch: "
              "`python -m ray_rdt_pool.memory.native build` adds a row that uses it)")
    for name, tensors in layouts.items():
        for kind, native in kinds.items():
            ph = put_phases(tensors, region, a.reps, idle, native=native)
            cells = "  ".join(f"{k} {v * 1e3:6.2f}" for k, v in ph.items())
            print(f"  {name:19s} {len(tensors):5,} tensors, {kind:6s}: {cells}")
    per_sample = layouts.get("experience_samples")
    if per_sample is not None:
        costs = read_costs(per_sample, a.reps, idle)
        print(f"  one pass of each read over the {len(per_sample):,} per-sample tensors "
              f"(ms, and ns per tensor):")
        for k, v in costs.items():
            print(f"    {k:16s} {v * 1e3:6.2f}  {v / len(per_sample) * 1e9:5.0f}")
    region.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
