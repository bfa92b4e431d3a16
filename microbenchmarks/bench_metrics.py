"""Metrics on vs off: the cost of ray_rdt_pool's Ray metrics, and the pool chart of the docs.

Role: two sender/receiver actor pairs, one with metrics on and one with
``RAY_RDT_POOL_METRICS=0``, run the same put + get + free cycles in alternating rounds on
one cluster. The script prints the median cycle time and the median in-actor ``ray.put``
time of each, their ratios, the spread between rounds of the same setting (the noise),
and the cost of one observer call measured directly in the metrics-on sender.

    python -m microbenchmarks.bench_metrics [--objects 200] [--tensors 16] [--rounds 3]

With ``--chart PATH`` it instead runs a weight-sync loop (one sender, one receiver,
~20 iterations) on a cluster with Ray's metrics export on, scrapes the Prometheus
endpoint while it runs, and draws the sender pool and receive arena usage over time
(docs/observability_pool.png is made this way).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

import ray
import torch

import ray_rdt_pool
from ray_rdt_pool.cli import stats_table as stats_cli

POOL_ENV = {"RAY_RDT_POOL_POOL_BYTES": "128M", "RAY_RDT_POOL_ARENA_BYTES": "128M",
            "RAY_DEDUP_LOGS": "0"}


@ray.remote(enable_tensor_transport=True)
class Sender:
    def __init__(self, n_tensors: int, numel: int) -> None:
        ray_rdt_pool.register()
        self.tensors = [torch.randn(numel) for _ in range(n_tensors)]
        self.kept: dict[int, Any] = {}

    def produce(self, key: int = 0, hold: bool = False, scale: int = 1) -> tuple[list[Any], float]:
        tensors = self.tensors if scale == 1 else [t.repeat(scale) for t in self.tensors]
        t0 = time.perf_counter()
        ref = ray.put(tensors, _tensor_transport="nixl_pool")
        dt = time.perf_counter() - t0
        if hold:
            self.kept[key] = ref
        return [ref], dt

    def drop(self, key: int) -> None:
        self.kept.pop(key, None)

    def metrics_on(self) -> bool:
        from ray_rdt_pool._ray.runtime import runtime

        return runtime().observer is not None

    def observer_cost(self, n: int = 2000) -> dict[str, float]:
        """Seconds per observer call, measured on this process's own observer."""
        from ray_rdt_pool._ray.runtime import runtime

        rt = runtime()
        obs = rt.observer
        if obs is None:
            return {}
        t0 = time.perf_counter()
        for _ in range(n):
            obs.on_put(rt, 1 << 20, 1e-4, 5e-5, False)
        t_put = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(n // 10):
            obs.flush()
        t_flush = (time.perf_counter() - t0) / (n // 10)
        t0 = time.perf_counter()
        for _ in range(n // 10):
            rt.stats()
        t_stats = (time.perf_counter() - t0) / (n // 10)
        return {"on_put_s": t_put, "flush_s": t_flush, "stats_s": t_stats}


@ray.remote(enable_tensor_transport=True)
class Receiver:
    def __init__(self) -> None:
        ray_rdt_pool.register()
        self.held: Any = None

    def consume(self, refs: list[Any], hold: bool = False) -> int:
        tensors = ray.get(refs[0])
        if hold:
            self.held = tensors
        return len(tensors)

    def release(self) -> None:
        self.held = None


def _cycles(sender: Any, receiver: Any, n: int) -> tuple[list[float], list[float]]:
    cycle, put = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        refs, put_s = ray.get(sender.produce.remote())
        ray.get(receiver.consume.remote(refs))
        del refs  # the only ref: the sender frees the object
        cycle.append(time.perf_counter() - t0)
        put.append(put_s)
    return cycle, put


def _pair(metrics: bool, n_tensors: int, numel: int) -> tuple[Any, Any]:
    opts: dict[str, Any] = {}
    if not metrics:
        opts["runtime_env"] = {"env_vars": {"RAY_RDT_POOL_METRICS": "0"}}
    s = Sender.options(**opts).remote(n_tensors, numel)
    r = Receiver.options(**opts).remote()
    assert ray.get(s.metrics_on.remote()) is metrics
    return s, r


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": POOL_ENV})
    ray_rdt_pool.register()
    pairs = {True: _pair(True, args.tensors, args.numel),
             False: _pair(False, args.tensors, args.numel)}
    for s, r in pairs.values():  # warm up: pools, agents, metadata
        _cycles(s, r, 20)
    rounds: dict[bool, list[tuple[list[float], list[float]]]] = {True: [], False: []}
    for i in range(args.rounds):
        order = (True, False) if i % 2 == 0 else (False, True)
        for on in order:
            rounds[on].append(_cycles(*pairs[on], args.objects))
    cost = ray.get(pairs[True][0].observer_cost.remote())
    ray.shutdown()

    def med(values: list[float]) -> float:
        return statistics.median(values)

    out: dict[str, Any] = {"objects": args.objects, "tensors": args.tensors,
                           "tensor_bytes": args.numel * 4, "rounds": args.rounds}
    for on in (True, False):
        tag = "on" if on else "off"
        cycles = [c for rc, _p in rounds[on] for c in rc]
        puts = [p for _rc, rp in rounds[on] for p in rp]
        round_meds = [med(rc) for rc, _p in rounds[on]]
        out[f"cycle_ms_{tag}"] = med(cycles) * 1e3
        out[f"put_us_{tag}"] = med(puts) * 1e6
        out[f"round_cycle_ms_{tag}"] = [round(m * 1e3, 3) for m in round_meds]
    out["cycle_ratio_on_off"] = out["cycle_ms_on"] / out["cycle_ms_off"]
    out["put_ratio_on_off"] = out["put_us_on"] / out["put_us_off"]
    spreads = [max(v) / min(v) - 1 for v in (out["round_cycle_ms_on"], out["round_cycle_ms_off"])]
    out["round_spread"] = max(spreads)
    out["observer_us"] = {k: v * 1e6 for k, v in cost.items()}
    return out


# ---------------------------------------------------------------------------------------
# The chart: a real sync loop, scraped from Ray's Prometheus export
# ---------------------------------------------------------------------------------------

_CHART_SERIES = ("ray_rdt_pool_sender_used_bytes", "ray_rdt_pool_arena_used_bytes",
                 "ray_rdt_pool_objects_put_total", "ray_rdt_pool_objects_received_total")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_chart(args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": POOL_ENV}, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 1000})
    ray_rdt_pool.register()
    sender = Sender.remote(16, (1 << 20) // 4)  # 16 x 1 MiB
    receiver = Receiver.remote()
    ids = {"sender": sender._actor_id.hex(), "receiver": receiver._actor_id.hex()}
    # Warm-up (not drawn): agents, pool, arena and metadata exist before the timeline.
    refs, _ = ray.get(sender.produce.remote(-1, True))
    ray.get(receiver.consume.remote(refs, False))
    del refs
    ray.get(sender.drop.remote(-1))
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    t_start = time.monotonic()

    def scraper() -> None:
        while not stop.is_set():
            try:
                rows = stats_cli.scrape(url)
            except OSError:
                rows = []
            t = time.monotonic() - t_start
            for name, labels, value in rows:
                if name in _CHART_SERIES and labels.get("actor") in ids.values():
                    samples.append({"t": t, "name": name, "actor": labels["actor"],
                                    "value": value})
            stop.wait(0.25)

    th = threading.Thread(target=scraper, daemon=True)
    th.start()
    time.sleep(2)
    marks = []
    for i in range(args.iterations):
        scale = 1 + i % 3  # 16, 32, 48 MiB versions of the weights
        t0 = time.monotonic() - t_start
        refs, _ = ray.get(sender.produce.remote(i, True, scale))
        ray.get(receiver.consume.remote(refs, True))
        del refs
        time.sleep(args.hold)
        ray.get(receiver.release.remote())
        ray.get(sender.drop.remote(i))
        marks.append((t0, time.monotonic() - t_start, 16 * scale))
        time.sleep(args.hold)
    time.sleep(4)
    stop.set()
    th.join()
    ray.shutdown()
    _draw(samples, ids, marks, args.chart)
    if args.samples:
        with open(args.samples, "w") as f:
            json.dump({"ids": ids, "marks": marks, "samples": samples}, f)
    peak_s = max((s["value"] for s in samples
                  if s["name"] == _CHART_SERIES[0] and s["actor"] == ids["sender"]), default=0)
    return {"chart": args.chart, "samples": len(samples), "iterations": args.iterations,
            "peak_sender_used_mib": peak_s / (1 << 20), "url": url}


def _draw(samples: list[dict[str, Any]], ids: dict[str, str],
          marks: list[tuple[float, float, int]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def pts(name: str, who: str) -> tuple[list[float], list[float]]:
        sel = [s for s in samples if s["name"] == name and s["actor"] == ids[who]]
        return [s["t"] for s in sel], [s["value"] for s in sel]

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1]})
    for t0, t1, _mib in marks:
        ax1.axvspan(t0, t1, color="0.92", lw=0)
    t, v = pts("ray_rdt_pool_sender_used_bytes", "sender")
    ax1.step(t, [x / (1 << 20) for x in v], where="post", label="sender pool used (sender)")
    t, v = pts("ray_rdt_pool_arena_used_bytes", "receiver")
    ax1.step(t, [x / (1 << 20) for x in v], where="post", ls="--",
             label="receive arena used (receiver)")
    ax1.set_ylabel("MiB")
    ax1.set_title("nixl_pool during a 20-iteration weight sync, scraped from Ray's "
                  "Prometheus export", fontsize=10)
    ax1.legend(loc="upper right", fontsize=8)
    t, v = pts("ray_rdt_pool_objects_put_total", "sender")
    ax2.step(t, v, where="post", label="objects_put_total (sender; 1 warm-up object)")
    t, v = pts("ray_rdt_pool_objects_received_total", "receiver")
    ax2.step(t, v, where="post", ls="--",
             label="objects_received_total (receiver; 1 warm-up object)")
    ax2.set_ylabel("objects")
    ax2.set_xlabel("seconds (shaded: from put to free of one object; the export trails by "
                   "up to ~1.5 s: 1 s report interval + 0.25 s scrape)")
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m microbenchmarks.bench_metrics",
                                description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, default=200, help="cycles per round")
    p.add_argument("--tensors", type=int, default=16, help="tensors per object")
    p.add_argument("--numel", type=int, default=4096, help="float32 elements per tensor")
    p.add_argument("--rounds", type=int, default=3, help="rounds per setting, alternating")
    p.add_argument("--chart", default=None, help="draw the sync-loop chart to this PNG")
    p.add_argument("--iterations", type=int, default=20, help="sync iterations (--chart)")
    p.add_argument("--hold", type=float, default=2.0, help="seconds held/idle (--chart)")
    p.add_argument("--samples", default=None, help="also save the scraped samples (JSON)")
    args = p.parse_args(argv)
    cmd = "python -m microbenchmarks.bench_metrics " + " ".join(sys.argv[1:] if argv is None
                                                                else argv)
    print(f"command: {cmd.strip()}  (cpus: {os.cpu_count()})")
    if args.chart:
        print(json.dumps(run_chart(args), indent=1))
        return 0
    res = run_bench(args)
    print(f"cycle (put + get + free) median: on {res['cycle_ms_on']:.3f} ms, "
          f"off {res['cycle_ms_off']:.3f} ms, ratio on/off {res['cycle_ratio_on_off']:.3f}")
    print(f"in-actor ray.put median: on {res['put_us_on']:.1f} us, off {res['put_us_off']:.1f} "
          f"us, ratio on/off {res['put_ratio_on_off']:.3f}")
    print(f"round medians (ms): on {res['round_cycle_ms_on']}, off {res['round_cycle_ms_off']}; "
          f"spread between rounds of one setting: {100 * res['round_spread']:.1f}%")
    print("observer cost per call (us): "
          + ", ".join(f"{k} {v:.1f}" for k, v in res["observer_us"].items()))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
