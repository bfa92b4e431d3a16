"""Pack copy microbenchmark: ``pack_into`` on one thread against several.

Not a test. Run as ``python -m ray_rdt_pool.bench.pack_threads [--threads N] [--reps R]``.

Each workload is described and laid out once, exactly as ``Sender.put`` does, and packed
into one pre-faulted ``HostMemory`` (the sender's pool in steady state) by three
variants, interleaved rep by rep so load from other processes hits them alike:

* ``1 thread``: ``pack_into(..., threads=1)``, the copy before threading existed;
* ``N threads``: ``threads=N`` with the configured ``pack_threshold_bytes`` (what the
  sender does with the default configuration);
* ``N forced``: ``threads=N, threshold=0``, every object threaded, to show what the
  threshold saves on small objects;
* ``1 stream`` and ``N stream``: as ``1 thread`` and ``N threads``, with streaming stores
  from ``stream_copy_bytes`` (the configured default; what the sender does) where the
  compiled copy helper is built (``ray_rdt_pool.memory.fastcopy``; the header names the copy).

The figure per variant is the median time of one ``pack_into`` call (small objects: the
mean of a batch of calls per sample); ratios are the 1-thread median over the other.
The first pack of every variant is checked to leave the same bytes as the 1-thread one.
The calling thread also runs the benchmark, so ``N`` counts it, as ``pack_threads`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ray_rdt_pool.bench.env import cpu_model, loadavg
from ray_rdt_pool.config import Tuning
from ray_rdt_pool.core.layout import packed_offsets
from ray_rdt_pool.memory.allocations import HostMemory
from ray_rdt_pool.memory.describe import Described, describe
from ray_rdt_pool.memory.fastcopy import stream_kind
from ray_rdt_pool.memory.pack import pack_into

_MIB = 1 << 20


@dataclass
class Workload:
    name: str
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def workloads() -> list[Workload]:
    """256 MiB in one tensor and in 1,000, 1,000 x 64 KiB, an RL batch in its two layouts,
    and a small object.

    Separate tensors are separate allocations, so each is its own span (one move).
    """
    return [
        Workload("256 MiB, 1 tensor", [torch.randn(256 * _MIB // 4)]),
        Workload("256 MiB as 1,000 tensors",
                 [torch.randn(256 * _MIB // 4 // 1000) for _ in range(1000)]),
        Workload("1,000 x 64 KiB", [torch.randn(16 * 1024) for _ in range(1000)]),
        Workload("the batch as 5 fields", _batched_fields()),
        Workload("5,120 sample fields", _per_sample_batch()),
        Workload("10 x 4 KiB", [torch.randn(1024) for _ in range(10)]),
    ]


def _batched_fields(samples: int = 1024, tokens: int = 1024) -> list[torch.Tensor]:
    """The side-by-side benchmark's ``experience`` object: the same 24 MiB as
    :func:`_per_sample_batch`, one tensor per field."""
    return [torch.randint(0, 32_000, (samples, tokens)),
            torch.ones(samples, tokens, dtype=torch.int64), torch.randn(samples, tokens),
            torch.randn(samples, tokens), torch.randn(samples)]


def _per_sample_batch(samples: int = 1024, tokens: int = 1024) -> list[torch.Tensor]:
    """The side-by-side benchmark's ``experience_samples`` object: per sample, input ids
    and attention mask (int64, [tokens]), old log-probs and advantages (float32,
    [tokens]) and a 0-d float32 reward; 5,120 tensors, 24 MiB."""
    out: list[torch.Tensor] = []
    for _ in range(samples):
        out += [torch.randint(0, 32_000, (tokens,)), torch.ones(tokens, dtype=torch.int64),
                torch.randn(tokens), torch.randn(tokens), torch.randn(())]
    return out


def _bench_one(w: Workload, region: HostMemory, variants: dict[str, tuple[int, int, int]],
               reps: int) -> dict[str, Any]:
    """Median seconds per pack_into call for each variant, interleaved rep by rep."""
    d: Described = describe(w.tensors)
    offsets, total = packed_offsets(d.nbytes, d.aligns)
    blocks = [(0, total)]
    region.tensor[:total].fill_(0)
    pack_into(w.tensors, d, offsets, blocks, region)
    reference = region.tensor[:total].clone()
    identical = True
    for threads, threshold, stream in variants.values():
        region.tensor[:total].fill_(0)
        pack_into(w.tensors, d, offsets, blocks, region, threads=threads, threshold=threshold,
                  stream_min=stream)
        identical = identical and torch.equal(region.tensor[:total], reference)
    # Batch calls of small objects so one sample is well above the timer's noise.
    def call(threads: int, threshold: int, stream: int) -> Callable[[], None]:
        return lambda: pack_into(w.tensors, d, offsets, blocks, region, threads=threads,
                                 threshold=threshold, stream_min=stream)

    per_call = _time_calls(call(1, 0, 0), 1)
    batch = max(1, min(1000, int(2e-3 / max(per_call, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(reps):
        # Rotate the order, so no variant always runs right after another's cache effects.
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_time_calls(call(*variants[name]), batch))
    medians = {name: statistics.median(v) for name, v in samples.items()}
    return {"workload": w.name, "bytes": w.nbytes, "tensors": len(w.tensors),
            "batch": batch, "identical": identical, "median_s": medians,
            "best_s": {name: min(v) for name, v in samples.items()}}


def _time_calls(fn: Callable[[], None], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:8.2f} ms" if s >= 1e-3 else f"{s * 1e6:8.1f} us"


def format_report(res: dict[str, Any]) -> str:
    names = res["variants"]
    base = names[0]
    head = (f"pack_into: {res['cpu_model']}, {res['cores']} cores; threads={res['threads']}, "
            f"threshold={res['threshold'] // _MIB} MiB, stream copy {res['stream_kind']} from "
            f"{res['stream_min'] // _MIB} MiB, reps={res['reps']}; load average "
            f"{res['loadavg_start']} at start, {res['loadavg_end']} at end")
    cols = [f"{'workload':<26}"] + [f"{n:>12}" for n in names] + [
        f"{'x ' + n:>16}" for n in names[1:]] + ["  same bytes"]
    lines = [head, "  " + "".join(cols)]
    for r in res["rows"]:
        med = r["median_s"]
        cells = [f"{r['workload']:<26}"] + [f"{_fmt_time(med[n]):>12}" for n in names]
        cells += [f"{med[base] / med[n]:>15.2f}x" for n in names[1:]]
        cells.append("  yes" if r["identical"] else "  NO")
        lines.append("  " + "".join(cells))
    lines.append("  (median time per pack_into call; 'x V' = 1 thread / V, above 1 is faster)")
    lines.append("  best of the reps (least disturbed by other processes):")
    for r in res["rows"]:
        best = r["best_s"]
        cells = [f"{r['workload']:<26}"] + [f"{_fmt_time(best[n]):>12}" for n in names]
        cells += [f"{best[base] / best[n]:>15.2f}x" for n in names[1:]]
        lines.append("  " + "".join(cells))
    return "\n".join(lines)


def measure_pack_gbps(nbytes: int, reps: int = 5) -> dict[str, Any]:
    """GB/s of the sender's pack of one ``nbytes`` float32 tensor, as ``Sender.put`` runs
    it with the default :class:`Tuning` (its threads, threshold and streaming-store
    size), into a pre-faulted region: the best this machine copies a large object into
    the pool. ``same_bytes``: the packed bytes equal the tensor's."""
    cfg = Tuning()
    w = Workload("one tensor", [torch.randn(max(1, nbytes // 4))])
    region = HostMemory(w.nbytes + (1 << 20), prefault=True)
    name = f"{cfg.pack_thread_count} threads"
    res = _bench_one(w, region, {name: (cfg.pack_thread_count, cfg.pack_threshold_bytes,
                                        cfg.stream_copy_bytes)}, reps)
    same = torch.equal(region.tensor[:w.nbytes].view(torch.float32), w.tensors[0])
    return {"bytes": w.nbytes, "threads": cfg.pack_thread_count, "copy": stream_kind(),
            "gbps": w.nbytes / res["median_s"][name] / 1e9, "same_bytes": same}


def measure_fp8_pack_gbps(nbytes: int, reps: int = 5) -> dict[str, Any]:
    """GB/s of bf16 weights (``nbytes`` of them, 2-D) quantized to FP8 with 128 x 128
    block scales, as a sender with ``wire_dtype=torch.float8_e4m3fn`` does before its
    pack, beside a plain copy of the same bf16 bytes: what sending FP8 costs the
    trainer. A figure, not a floor."""
    from ray_rdt_pool.weights.fp8 import quantize

    cols = 4096
    w = torch.randn(max(1, nbytes // 2 // cols), cols).to(torch.bfloat16)
    out = torch.empty_like(w)
    times: dict[str, list[float]] = {"fp8": [], "copy": []}
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        quantize(w, torch.float8_e4m3fn, (128, 128))
        times["fp8"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out.copy_(w)
        times["copy"].append(time.perf_counter() - t0)
    n = w.numel() * 2
    return {"bytes": n, "fp8_gbps": n / statistics.median(times["fp8"]) / 1e9,
            "copy_gbps": n / statistics.median(times["copy"]) / 1e9,
            "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    config = Tuning()
    p = argparse.ArgumentParser(prog="python -m ray_rdt_pool.bench.pack_threads",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=config.pack_thread_count,
                   help="threads of the threaded variants, caller included "
                        "(default: Tuning().pack_thread_count)")
    p.add_argument("--threshold", type=int, default=config.pack_threshold_bytes,
                   help="threshold of the 'N threads' variant in bytes "
                        "(default: Tuning().pack_threshold_bytes)")
    p.add_argument("--reps", type=int, default=15, help="samples per variant and workload")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    args = p.parse_args(argv)
    threads = max(2, args.threads)  # one thread against one thread measures nothing
    # The caller and the helpers are the threads under test: keep torch's own pool out.
    torch.set_num_threads(1)
    stream = config.stream_copy_bytes
    variants: dict[str, tuple[int, int, int]] = {  # name: (threads, threshold, stream_min)
        "1 thread": (1, args.threshold, 0),
        f"{threads} threads": (threads, args.threshold, 0),
        f"{threads} forced": (threads, 0, 0),
        "1 stream": (1, args.threshold, stream),
        f"{threads} stream": (threads, args.threshold, stream),
    }
    res: dict[str, Any] = {"cpu_model": cpu_model(), "cores": os.cpu_count(),
                           "threads": threads, "threshold": args.threshold,
                           "stream_kind": stream_kind(), "stream_min": stream,
                           "reps": args.reps, "loadavg_start": loadavg(),
                           "variants": list(variants), "rows": []}
    loads = workloads()
    region = HostMemory(max(w.nbytes for w in loads) + (1 << 20), prefault=True)
    for w in loads:
        res["rows"].append(_bench_one(w, region, variants, args.reps))
    res["loadavg_end"] = loadavg()
    print(format_report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")
    if not all(r["identical"] for r in res["rows"]):
        print("FAIL: a threaded pack left different bytes than the 1-thread pack",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
