"""Weight sync across Ray nodes with real link limits: one trainer to N engine nodes.

Builds a :class:`ray_rdt_pool.bench.testbed.TestBed` of ``max(--engines) + 1`` nodes (each in
its own network namespace, each link limited to ``--rate`` both ways) and runs this file
as the Ray driver on the head. The trainer actor lives on node 0 and holds a
``WeightSender`` over a model of ``--tensors`` fp32 tensors, ``--size-mib`` in all;
engine ``k`` lives on node ``k`` and holds a ``WeightReceiver`` over zeros of the same
shapes. For each engine count N: one cold sync, then ``--syncs`` timed ones of
``sync(trainer, engines, mode="stream")``; before each, the trainer changes every byte of
every tensor, and after each, every engine's bytes must equal the trainer's (SHA-256 of
all tensors), or the run fails. The engines of one N are killed before the next N starts
(idle actors cost CPU on a small host).

Reported per N: the median and every time of the timed syncs (driver wall clock around
``sync``), and the link floor without relay, N * size / rate (the trainer's egress carries
every engine's copy). Prints a table and writes ``testbed_sync.json`` to ``--out``.

    python -m ray_rdt_pool.bench.testbed_sync --engines 1,2,4,8 --rate 500mbit --out DIR

``--ranks M`` (a comma-separated list) splits the model over M trainer ranks instead,
rank r holding the names i with i % M == r, each rank on its own node (nodes 0 to M-1,
engines on the nodes after them), and syncs with ``sync([rank_0, ..., rank_M-1],
engines)``; one rank is the single trainer above. Each (M, N) pair is measured; the
floor is then max(N / M, 1) * size / rate (a rank's egress carries its share to every
engine, an engine's ingress the whole model).

    python -m ray_rdt_pool.bench.testbed_sync --ranks 1,4 --engines 1,4 --rate 500mbit

Adding a parameter: add the option in :func:`parse_args` (it reaches the driver as is,
since the driver gets the same argument list) and read it in :func:`measure`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
#: The folder that holds this copy of the package (the repository in a clone).
REPO = Path(__file__).resolve().parents[2]
RESULT_TAG = "RESULT "
#: The driver on the head runs this module by name, so it imports the package as a package.
_DRIVER = ("import runpy\n"
           "runpy.run_module('ray_rdt_pool.bench.testbed_sync', run_name='__main__', "
           "alter_sys=True)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ray_rdt_pool.bench.testbed import add_bed_args

    ap = argparse.ArgumentParser(prog="python -m ray_rdt_pool.bench.testbed_sync",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="1,2,4,8",
                    help="comma-separated engine counts, each engine its own Ray node")
    ap.add_argument("--ranks", default="1",
                    help="comma-separated trainer rank counts, each rank its own Ray node")
    ap.add_argument("--size-mib", type=int, default=64, help="model size, MiB")
    ap.add_argument("--tensors", type=int, default=32, help="tensors in the model")
    ap.add_argument("--bucket-mib", type=float, default=2.0, help="bucket size, MiB")
    ap.add_argument("--syncs", type=int, default=3, help="timed syncs per engine count")
    ap.add_argument("--max-inflight", type=int, default=2, help="sync(max_inflight=)")
    ap.add_argument("--mode", default="stream", choices=("stream", "publish"),
                    help="sync(mode=)")
    ap.add_argument("--pool-mib", type=int, default=32, help="each actor's nixl_pool, MiB")
    ap.add_argument("--out", default=None, help="folder for testbed_sync.json")
    ap.add_argument("--timeout", type=float, default=1800.0, help="driver timeout, seconds")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    add_bed_args(ap, nodes=None)
    args = ap.parse_args(argv)
    args.engine_counts = sorted({int(x) for x in str(args.engines).split(",") if x.strip()})
    if not args.engine_counts or args.engine_counts[0] < 1:
        ap.error(f"--engines must list counts >= 1, got {args.engines!r}")
    args.rank_counts = sorted({int(x) for x in str(args.ranks).split(",") if x.strip()})
    if not args.rank_counts or args.rank_counts[0] < 1 or args.rank_counts[-1] > args.tensors:
        ap.error(f"--ranks must list counts from 1 to --tensors, got {args.ranks!r}")
    if args.size_mib * MIB % args.tensors or (args.size_mib * MIB // args.tensors) % 4:
        ap.error("--size-mib must split into --tensors equal fp32 tensors")
    return args


# ------------------------------------------------------------------ driver side (node 0)


def _peer_class() -> Any:
    import ray

    @ray.remote(num_cpus=0, enable_tensor_transport=True)  # type: ignore[call-overload]
    class Peer:
        """The trainer (sender) or an engine (receiver); one process on one node each."""

        def __init__(self, role: str, numel: int, tensors: int, bucket_bytes: int,
                     pool_bytes: int, rank: int = 0, ranks: int = 1) -> None:
            import torch

            import ray_rdt_pool
            from ray_rdt_pool.weights import WeightReceiver, WeightSender

            ray_rdt_pool.register()
            ray_rdt_pool.configure(pool_bytes=pool_bytes, arena_bytes=pool_bytes)
            torch.set_num_threads(1)
            g = torch.Generator().manual_seed(1234)
            self.state = {f"layers.{i}.weight": (torch.randn(numel, generator=g)
                                                 if role == "trainer" else torch.zeros(numel))
                          for i in range(tensors)}
            if role == "trainer":  # rank r of M holds the names i with i % M == r
                self.state = {k: v for i, (k, v) in enumerate(self.state.items())
                              if i % ranks == rank}
            if role == "trainer":
                self.weight_sender = WeightSender(self.state, bucket_bytes=bucket_bytes)
            else:
                self.weight_receiver = WeightReceiver(self.state)

        def where(self) -> str:
            return str(ray.util.get_node_ip_address())

        def step(self) -> None:
            """Change every byte: a stale byte on an engine then fails the digest."""
            import torch

            with torch.no_grad():
                for t in self.state.values():
                    t.view(torch.int32).add_(1)

        def digest(self) -> dict[str, str]:
            return {k: hashlib.sha256(t.numpy().tobytes()).hexdigest()
                    for k, t in self.state.items()}

    return Peer


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from ray_rdt_pool.weights import sync

    ray.init(log_to_driver=False)
    n_nodes = len([n for n in ray.nodes() if n["Alive"]])
    first = args.rank_counts[-1]  # engines sit on the nodes after the trainer ranks'
    if n_nodes < args.engine_counts[-1] + first:
        raise SystemExit(f"{n_nodes} Ray nodes, need {args.engine_counts[-1] + first}")
    size = args.size_mib * MIB
    numel = size // args.tensors // 4
    bucket = int(args.bucket_mib * MIB)
    pool = args.pool_mib * MIB
    Peer = _peer_class()

    def on(i: int) -> Any:
        return Peer.options(resources={f"node{i}": 0.01})

    results = []
    trainer_ip = None
    for m in args.rank_counts:
        ranks = [on(r).remote("trainer", numel, args.tensors, bucket, pool, r, m)
                 for r in range(m)]
        rank_ips = ray.get([t.where.remote() for t in ranks])
        trainer_ip = trainer_ip or rank_ips[0]
        # One rank is the single trainer of today's sync(trainer, engines).
        source: Any = ranks[0] if m == 1 else ranks
        for n in args.engine_counts:
            engines = [on(first + k).remote("engine", numel, args.tensors, bucket, pool)
                       for k in range(n)]
            ips = ray.get([e.where.remote() for e in engines])
            if len(set(ips) | set(rank_ips)) != n + m:
                raise SystemExit(f"trainer ranks {rank_ips} and engines {ips} do not sit "
                                 f"on {n + m} distinct nodes")
            times: list[float] = []
            reported: list[float] = []
            for k in range(args.syncs + 1):
                ray.get([t.step.remote() for t in ranks])
                t0 = time.perf_counter()
                rep = sync(source, engines, mode=args.mode, max_inflight=args.max_inflight)
                wall = time.perf_counter() - t0
                want: dict[str, str] = {}
                for d in ray.get([t.digest.remote() for t in ranks]):
                    want.update(d)
                got = ray.get([e.digest.remote() for e in engines])
                bad = [i + 1 for i, d in enumerate(got) if d != want]
                if bad or len(want) != args.tensors:
                    raise SystemExit(f"{m} ranks, {n} engines, sync {k}: engines {bad} "
                                     "hold other bytes than the trainer ranks")
                if k == 0:
                    cold = wall
                else:
                    times.append(wall)
                    reported.append(rep.seconds)
                print(f"ranks={m} engines={n} sync={k} {wall:.3f} s (byte-exact)",
                      file=sys.stderr, flush=True)
            for e in engines:
                ray.kill(e)
            del engines
            time.sleep(1.0)
            results.append({"ranks": m, "engines": n, "median_s": statistics.median(times),
                            "times_s": times, "cold_s": cold, "sync_report_s": reported,
                            "byte_exact": True})
        for t in ranks:
            ray.kill(t)
        del ranks, source
        time.sleep(1.0)
    return {"results": results, "trainer_ip": trainer_ip, "nodes": n_nodes}


# ------------------------------------------------------------------ host side


def _git_commit() -> str | None:
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True, check=False)
    return r.stdout.strip() or None


def table(report: dict[str, Any]) -> str:
    rate = report["rate"] or "unlimited"
    many = any(r.get("ranks", 1) > 1 for r in report["results"])
    where = "trainer ranks on nodes 0 to M-1" if many else "trainer on node 0"
    lines = [f"sync(mode={report['mode']!r}) of {report['size_mib']} MiB in "
             f"{report['tensors']} tensors, {report['bucket_mib']:g} MiB buckets, {where}, "
             f"one engine per node, {rate} per node (test bed, "
             f"{report['host']['cpu']}, {report['host']['cores']} cores)",
             f"| {'ranks | ' if many else ''}engines | median of {report['syncs']} | "
             f"all times | vs 1 {'trainer to 1 ' if many else ''}engine | link floor "
             f"{'max(N/M, 1)*S/B' if many else 'N*S/B'} |",
             "|---|---|---|---|---|" + ("---|" if many else "")]
    first = report["results"][0]
    base = first["median_s"] if first["engines"] == 1 and first.get("ranks", 1) == 1 \
        else None
    for r in report["results"]:
        times = ", ".join(f"{t:.2f}" for t in r["times_s"])
        ratio = f"{r['median_s'] / base:.2f}x" if base else "-"
        floor = f"{r['floor_s']:.2f} s" if r["floor_s"] is not None else "-"
        lines.append(f"| {str(r.get('ranks', 1)) + ' | ' if many else ''}{r['engines']} | "
                     f"{r['median_s']:.2f} s | {times} | {ratio} | {floor} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.driver:
        print(RESULT_TAG + json.dumps(measure(args)), flush=True)
        return 0

    import logging

    from ray_rdt_pool.bench.env import cpu_model
    from ray_rdt_pool.bench.testbed import TestBed, bed_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    reason = TestBed.available()
    if reason is not None:
        print(f"the test bed cannot run here: {reason}", file=sys.stderr)
        return 2
    nodes = args.engine_counts[-1] + args.rank_counts[-1]
    pypath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": pypath, "RAY_RDT_POOL_METRICS": "0", "RAY_DEDUP_LOGS": "0"}
    bed = bed_from_args(args, nodes, env=env)
    load_before = list(os.getloadavg())
    with bed:
        out = bed.run_driver(_DRIVER, [*(argv if argv is not None else sys.argv[1:]),
                                        "--driver"], timeout=args.timeout,
                             echo_stderr=True)
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_TAG)]
    if not lines:
        print(f"the driver printed no result:\n{out[-3000:]}", file=sys.stderr)
        return 1
    got = json.loads(lines[-1][len(RESULT_TAG):])
    rate_bps = bed.rate_bps
    size = args.size_mib * MIB
    for r in got["results"]:
        share = max(r["engines"] / r.get("ranks", 1), 1.0)
        r["floor_s"] = share * size * 8 / rate_bps if rate_bps else None
    report = {
        "what": "testbed_sync", "mode": args.mode, "size_mib": args.size_mib,
        "tensors": args.tensors, "bucket_mib": args.bucket_mib, "syncs": args.syncs,
        "ranks": args.rank_counts,
        "max_inflight": args.max_inflight, "rate": bed.rate, "burst": bed.burst,
        "nodes": nodes, "results": got["results"],
        "bring_up_s": bed.timings.get("bring_up"), "teardown_s": bed.timings.get("teardown"),
        "host": {"cpu": cpu_model(), "cores": os.cpu_count(), "loadavg_before": load_before,
                 "loadavg_after": list(os.getloadavg())},
        "commit": _git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "note": "multi-node test bed: one network namespace per Ray node on one host, "
                "links limited by tc (not the one-host `make bench` figures)",
    }
    print(table(report))
    print(f"bring-up {report['bring_up_s']:.1f} s, teardown {report['teardown_s']:.1f} s")
    if args.out:
        path = Path(args.out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "testbed_sync.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path / 'testbed_sync.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
