"""Weight sync across Ray nodes with real link limits: one trainer to N engine nodes.

Builds a :class:`ray_rdt_pool.bench.testbed.TestBed` of ``max(--engines) + 1`` nodes (each in
its own network namespace, each link limited to ``--rate`` both ways) and runs this file
as the Ray driver on the head. The trainer actor lives on node 0 and holds a
``WeightSender`` over a model of ``--tensors`` fp32 tensors, ``--size-mib`` in all;
engine ``k`` lives on node ``k`` and holds a ``WeightReceiver`` over zeros of the same
shapes. For each engine count N: one cold sync, then ``--syncs`` timed ones of
``sync(trainer, engines, mode="stream")``; before each, the trainer changes every byte of
every tensor, and after each, every engine's bytes must equal the trainer's (SHA-256 of
all tensors), or the run fails. ``--relay none,chain`` runs each round once per relay
(``sync(relay=)``), so both are measured in one run under the same conditions. The
engines of one N are killed before the next N starts (idle actors cost CPU on a small
host).

Reported per N: the median and every time of the timed syncs (driver wall clock around
``sync``), and the link floor: without relay N * size / rate (the trainer's egress
carries every engine's copy), with a chain (size + (N - 1) * bucket) / rate. Prints a
table and writes ``testbed_sync.json`` to ``--out``.

    python -m ray_rdt_pool.bench.testbed_sync --engines 1,2,4,8 --rate 500mbit --out DIR

``--ranks M`` (a comma-separated list) splits the model over M trainer ranks instead,
rank r holding the names i with i % M == r, each rank on its own node (nodes 0 to M-1,
engines on the nodes after them), and syncs with ``sync([rank_0, ..., rank_M-1],
engines)``; one rank is the single trainer above. Each (M, N) pair is measured; the
floor is then max(N / M, 1) * size / rate (a rank's egress carries its share to every
engine, an engine's ingress the whole model). ``--ranks`` and ``--relay`` combine in one
loop, one table row per (M, N, relay); with M ranks a chain runs per rank, each starting
at another engine (its floor is shown as one trainer's chain: a lower bound).
``--rank-engines`` gives the engine counts for M > 1 (default: ``--engines``).

``--floors tcp,nixl`` then measures, on the same links, a plain TCP chain and a chain of
NIXL READs and notifications between bare agents (:mod:`ray_rdt_pool.bench.chains`, no
Ray) for each engine count: what the links allow, what UCX allows, and ours.

    python -m ray_rdt_pool.bench.testbed_sync --ranks 1,4 --rank-engines 4 --relay none,chain

``--trace`` times each engine's bucket loads in the last timed sync of each row (host
clock, shared by the namespaces) and prints the medians: where a chain's time above its
floor goes.

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
    from ray_rdt_pool.bench.testbed_cli import add_bed_args

    ap = argparse.ArgumentParser(prog="python -m ray_rdt_pool.bench.testbed_sync",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="1,2,4,8",
                    help="comma-separated engine counts, each engine its own Ray node")
    ap.add_argument("--ranks", default="1",
                    help="comma-separated trainer rank counts, each rank its own Ray node")
    ap.add_argument("--rank-engines", default=None,
                    help="engine counts for more than one rank (default: --engines)")
    ap.add_argument("--size-mib", type=int, default=64, help="model size, MiB")
    ap.add_argument("--tensors", type=int, default=32, help="tensors in the model")
    ap.add_argument("--bucket-mib", type=float, default=2.0, help="bucket size, MiB")
    ap.add_argument("--syncs", type=int, default=3, help="timed syncs per engine count")
    ap.add_argument("--max-inflight", type=int, default=2, help="sync(max_inflight=)")
    ap.add_argument("--mode", default="stream", choices=("stream", "publish"),
                    help="sync(mode=)")
    ap.add_argument("--relay", default="none",
                    help="comma-separated sync(relay=) values to compare in one run: "
                         "none, chain (e.g. none,chain); each sync round runs every one")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                    help="the model's dtype (the trainer's and the engines' tensors)")
    ap.add_argument("--wire", default="none",
                    help="comma-separated wire dtypes to compare in one run: none (the "
                         "model's dtype), fp8 (float8_e4m3fn with 128 x 128 block scales); "
                         "each sync round runs every one")
    ap.add_argument("--trace", action="store_true",
                    help="time each engine's bucket loads (the last timed sync of each "
                         "row) and summarise where a chain's time goes")
    ap.add_argument("--floors", default="",
                    help="comma-separated chains to measure on the same links after ours, "
                         "for each engine count: tcp (a plain TCP chain), nixl (NIXL READs "
                         "and notifications between bare agents, no Ray)")
    ap.add_argument("--pool-mib", type=int, default=32, help="each actor's nixl_pool, MiB")
    ap.add_argument("--out", default=None, help="folder for testbed_sync.json")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="driver timeout, seconds")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    add_bed_args(ap, nodes=None)
    args = ap.parse_args(argv)
    args.engine_counts = sorted({int(x) for x in str(args.engines).split(",") if x.strip()})
    if not args.engine_counts or args.engine_counts[0] < 1:
        ap.error(f"--engines must list counts >= 1, got {args.engines!r}")
    args.rank_counts = sorted({int(x) for x in str(args.ranks).split(",") if x.strip()})
    if not args.rank_counts or args.rank_counts[0] < 1 or args.rank_counts[-1] > args.tensors:
        ap.error(f"--ranks must list counts from 1 to --tensors, got {args.ranks!r}")
    many = str(args.engines if args.rank_engines is None else args.rank_engines)
    args.rank_engine_counts = sorted({int(x) for x in many.split(",") if x.strip()})
    if not args.rank_engine_counts or args.rank_engine_counts[0] < 1:
        ap.error(f"--rank-engines must list counts >= 1, got {args.rank_engines!r}")
    # Ranks sit on nodes 0 to M-1, their engines on the nodes after them.
    args.nodes_needed = max(m + n for m in args.rank_counts
                            for n in (args.engine_counts if m == 1
                                      else args.rank_engine_counts))
    args.floor_kinds = [x.strip() for x in str(args.floors).split(",") if x.strip()]
    if set(args.floor_kinds) - {"tcp", "nixl"}:
        ap.error(f"--floors takes tcp and nixl, got {args.floors!r}")
    args.relays = [x.strip() for x in str(args.relay).split(",") if x.strip()]
    if not args.relays or set(args.relays) - {"none", "chain"}:
        ap.error(f"--relay must list none and/or chain, got {args.relay!r}")
    args.wires = [x.strip() for x in str(args.wire).split(",") if x.strip()]
    if not args.wires or set(args.wires) - {"none", "fp8"}:
        ap.error(f"--wire must list none and/or fp8, got {args.wire!r}")
    if args.relays != ["none"] and args.mode != "stream":
        ap.error("--relay chain needs --mode stream")
    if args.size_mib * MIB % args.tensors or (args.size_mib * MIB // args.tensors) % 4096:
        ap.error("--size-mib must split into --tensors equal tensors of whole 4 KiB rows")
    return args


# ------------------------------------------------------------------ driver side (node 0)


def _peer_class() -> Any:
    import ray

    @ray.remote(num_cpus=0, enable_tensor_transport=True)  # type: ignore[call-overload]
    class Peer:
        """The trainer (sender) or an engine (receiver); one process on one node each."""

        def __init__(self, role: str, numel: int, tensors: int, bucket_bytes: int,
                     pool_bytes: int, rank: int = 0, ranks: int = 1, dtype: str = "fp32",
                     fp8: bool = False) -> None:
            import torch

            import ray_rdt_pool
            from ray_rdt_pool.weights import WeightReceiver, WeightSender

            ray_rdt_pool.register()
            ray_rdt_pool.configure(pool_bytes=pool_bytes, arena_bytes=pool_bytes)
            torch.set_num_threads(1)
            g = torch.Generator().manual_seed(1234)
            # 2-D, so that FP8 block scales (128 x 128) apply as to a real layer.
            shape = (numel // 1024, 1024)
            dt = torch.bfloat16 if dtype == "bf16" else torch.float32
            self.state = {f"layers.{i}.weight": (torch.randn(shape, generator=g).to(dt)
                                                 if role == "trainer"
                                                 else torch.zeros(shape, dtype=dt))
                          for i in range(tensors)}
            if role == "trainer":  # rank r of M holds the names i with i % M == r
                self.state = {k: v for i, (k, v) in enumerate(self.state.items())
                              if i % ranks == rank}
            if role == "trainer":
                self.weight_sender = WeightSender(self.state, bucket_bytes=bucket_bytes)
                if fp8:
                    self.weight_sender_fp8 = WeightSender(
                        self.state, bucket_bytes=bucket_bytes,
                        wire_dtype=torch.float8_e4m3fn, wire_scale=(128, 128))
            else:
                self.weight_receiver = WeightReceiver(self.state)

        def where(self) -> str:
            return str(ray.util.get_node_ip_address())

        def step(self) -> None:
            """Change every byte: a stale byte on an engine then fails the digest."""
            import torch

            with torch.no_grad():
                for t in self.state.values():
                    t.view(torch.int16 if t.element_size() == 2 else torch.int32).add_(1)

        def digest(self, wire: str = "none") -> dict[str, str]:
            """SHA-256 of each tensor; for ``wire="fp8"`` of what an engine must hold
            after an FP8 sync (the tensor quantized and dequantized)."""
            import torch

            from ray_rdt_pool.weights.fp8 import dequantize, quantize

            out = {}
            for k, t in self.state.items():
                if wire == "fp8":
                    q, s = quantize(t, torch.float8_e4m3fn, (128, 128))
                    t = dequantize(q, s, (128, 128), t.dtype)
                out[k] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
            return out

        def trace(self) -> list[tuple[str, int, float, float]]:
            """Start timing (host clock: every namespace shares it) this engine's bucket
            loads; returns what was timed since the last call."""
            log: list[tuple[Any, ...]] = getattr(self, "log", [])
            self.log: list[tuple[Any, ...]] = []
            if getattr(self, "traced", False):
                return log
            self.traced = True
            rec = self.weight_receiver
            load = rec._load_bucket

            def timed_load(plan: Any, *rest: Any) -> Any:
                t0 = time.time()
                try:
                    return load(plan, *rest)
                finally:
                    self.log.append(("load", plan.index, t0, time.time()))

            rec._load_bucket = timed_load  # type: ignore[method-assign,assignment]
            return log

    return Peer


#: How a test bed process is grouped in the CPU accounting, by its command line.
_GROUPS = (("gcs_server", "gcs"), ("raylet", "raylet"), ("ray::", "actors"),
           ("testbed_sync", "driver"), ("dashboard", "agents"), ("runtime_env", "agents"),
           ("log_monitor", "agents"), ("monitor.py", "agents"))


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far: by the test bed's processes (those in its network
    namespaces: every namespace shares the host's process table), by group, and by the
    whole host ("host", from /proc/stat: user, system and interrupt time)."""
    tick = os.sysconf("SC_CLK_TCK")
    ours = {f"net:[{p.stat().st_ino}]" for p in Path("/run/netns").glob("rtb*")}
    out: dict[str, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.readlink(d / "ns" / "net") not in ours:
                continue
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        group = next((g for key, g in _GROUPS if key in cmd), "other")
        out[group] = out.get(group, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    out["host"] = sum(cpu[i] for i in (0, 1, 2, 5, 6)) / tick  # user, nice, system, irqs
    return out


def _where_time_goes(logs: list[list[tuple[str, int, float, float]]]) -> dict[str, float]:
    """Medians, in ms, over every bucket and engine (chain order) of one sync: the load
    (READ, write, publish), the gap between one engine's loads, and the handoff (the
    previous engine's load end to this one's load start: a signal and a wake-up)."""
    loads = [{k: (a, b) for w, k, a, b in log if w == "load"} for log in logs]

    def med(xs: list[float]) -> float:
        return round(1e3 * statistics.median(xs), 2) if xs else float("nan")

    out = {"load_ms": med([b - a for ls in loads for a, b in ls.values()])}
    out["between_loads_ms"] = med([ls[k + 1][0] - ls[k][1] for ls in loads for k in ls
                                   if k + 1 in ls])
    out["handoff_ms"] = med([loads[i][k][0] - loads[i - 1][k][1]
                             for i in range(1, len(loads)) for k in loads[i]
                             if k in loads[i - 1]])
    starts = [a for ls in loads for a, _b in ls.values()]
    ends = [b for ls in loads for _a, b in ls.values()]
    if starts:
        out["first_to_last_load_ms"] = round(1e3 * (max(ends) - min(starts)), 1)
        out["last_engine_span_ms"] = round(1e3 * (max(b for _a, b in loads[-1].values())
                                                  - min(a for a, _b in loads[-1].values())), 1)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from ray_rdt_pool.weights import sync

    ray.init(log_to_driver=False)
    n_nodes = len([n for n in ray.nodes() if n["Alive"]])
    if n_nodes < args.nodes_needed:
        raise SystemExit(f"{n_nodes} Ray nodes, need {args.nodes_needed}")
    size = args.size_mib * MIB
    numel = size // args.tensors // (2 if args.dtype == "bf16" else 4)
    fp8 = "fp8" in args.wires
    bucket = int(args.bucket_mib * MIB)
    pool = args.pool_mib * MIB
    Peer = _peer_class()

    def on(i: int) -> Any:
        return Peer.options(resources={f"node{i}": 0.01})

    results = []
    trainer_ip = None
    version = 0
    for m in args.rank_counts:
        ranks = [on(r).remote("trainer", numel, args.tensors, bucket, pool, r, m,
                              args.dtype, fp8)
                 for r in range(m)]
        rank_ips = ray.get([t.where.remote() for t in ranks])
        trainer_ip = trainer_ip or rank_ips[0]
        # One rank is the single trainer of today's sync(trainer, engines).
        source: Any = ranks[0] if m == 1 else ranks
        # A variant is a relay and a wire dtype; results are keyed "relay" or
        # "relay/wire".
        variants = [(r, w) for r in args.relays for w in args.wires]
        for n in args.engine_counts if m == 1 else args.rank_engine_counts:
            # Engines sit on the nodes after the trainer ranks'.
            engines = [on(m + k).remote("engine", numel, args.tensors, bucket, pool, 0, 1,
                                        args.dtype)
                       for k in range(n)]
            ips = ray.get([e.where.remote() for e in engines])
            if len(set(ips) | set(rank_ips)) != n + m:
                raise SystemExit(f"trainer ranks {rank_ips} and engines {ips} do not sit "
                                 f"on {n + m} distinct nodes")
            times: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
            reported: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
            loads: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
            nbytes: dict[tuple[str, str], int] = {}
            traces: dict[tuple[str, str], dict[str, float]] = {}
            cold: dict[tuple[str, str], float] = {}
            idle: dict[str, float] = {}
            if args.trace:  # what the test bed costs with no sync running
                cpu0 = _cpu_seconds()
                time.sleep(3.0)
                cpu1 = _cpu_seconds()
                idle = {f"idle_cpu_{g}": round((cpu1[g] - cpu0.get(g, 0.0)) / 3.0
                                               / (os.cpu_count() or 1), 3) for g in cpu1}
                print(f"  idle: {idle}", file=sys.stderr, flush=True)
            # Each round runs every variant, so drift on a shared host hits them alike.
            for k in range(args.syncs + 1):
                for var in variants:
                    relay, wire = var
                    version += 1
                    ray.get([t.step.remote() for t in ranks])
                    if args.trace:
                        ray.get([e.trace.remote() for e in engines])
                        cpu0 = _cpu_seconds()
                    t0 = time.perf_counter()
                    rep = sync(source, engines, mode=args.mode,
                               max_inflight=args.max_inflight, version=version,
                               relay=None if relay == "none" else relay,
                               sender_attr="weight_sender_fp8" if wire == "fp8"
                               else "weight_sender")
                    wall = time.perf_counter() - t0
                    if args.trace:
                        cpu1 = _cpu_seconds()  # before the digests, which cost CPU too
                    want: dict[str, str] = {}
                    for d in ray.get([t.digest.remote(wire) for t in ranks]):
                        want.update(d)
                    got = ray.get([e.digest.remote() for e in engines])
                    bad = [i + 1 for i, d in enumerate(got) if d != want]
                    if bad or len(want) != args.tensors:
                        raise SystemExit(f"{m} ranks, {n} engines, relay={relay}, "
                                         f"wire={wire}, sync {k}: engines {bad} hold other "
                                         "bytes than the trainer")
                    nbytes[var] = rep.nbytes
                    if k == 0:
                        cold[var] = wall
                    else:
                        times[var].append(wall)
                        reported[var].append(rep.seconds)
                        loads[var].append(os.getloadavg()[0])
                    if args.trace and k == args.syncs:
                        traces[var] = _where_time_goes(
                            ray.get([e.trace.remote() for e in engines]))
                        # The share of the host's cores each group kept busy.
                        traces[var].update({
                            f"cpu_{g}": round((cpu1[g] - cpu0.get(g, 0.0)) / wall
                                              / (os.cpu_count() or 1), 3)
                            for g in cpu1})
                        print(f"  where the time goes: {traces[var]}", file=sys.stderr,
                              flush=True)
                    print(f"ranks={m} engines={n} relay={relay} wire={wire} sync={k} "
                          f"{wall:.3f} s (byte-exact)", file=sys.stderr, flush=True)
            for e in engines:
                ray.kill(e)
            del engines
            time.sleep(1.0)
            for var in variants:
                results.append({"ranks": m, "engines": n, "relay": var[0], "wire": var[1],
                                "median_s": statistics.median(times[var]),
                                "times_s": times[var], "cold_s": cold[var],
                                "sync_report_s": reported[var], "load1": loads[var],
                                "nbytes": nbytes[var],
                                "trace": {**traces[var], **idle} if var in traces
                                else None, "byte_exact": True})
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
    kinds = [k for k in ("tcp", "nixl") if k in report.get("floors", {})]
    where = "trainer ranks on nodes 0 to M-1" if many else "trainer on node 0"
    wires = any(r.get("wire", "none") != "none" for r in report["results"])
    lines = [f"sync(mode={report['mode']!r}) of {report['size_mib']} MiB in "
             f"{report['tensors']} {report.get('dtype', 'fp32')} tensors, "
             f"{report['bucket_mib']:g} MiB buckets, {where}, "
             f"one engine per node, {rate} per node (test bed, "
             f"{report['host']['cpu']}, {report['host']['cores']} cores)",
             f"| {'ranks | ' if many else ''}engines | relay | {'wire | ' if wires else ''}"
             f"median of {report['syncs']} "
             f"| all times | vs 1 {'trainer to 1 ' if many else ''}engine | link floor | "
             "floor vs 1 engine |" + (" vs the model's dtype |" if wires else "")
             + "".join(f" {k} chain, no Ray | ours vs it |" for k in kinds),
             "|---|---|---|---|---|---|---|" + ("---|" if many else "")
             + ("---|---|" if wires else "") + "---|---|" * len(kinds)]
    # The ratio's base: one trainer to one engine without relay (a chain of one is the
    # same sync).
    ones = [r for r in report["results"] if r["engines"] == 1 and r.get("ranks", 1) == 1
            and r.get("wire", "none") == "none"]
    base = min(ones, key=lambda r: r.get("relay", "none") != "none")["median_s"] if ones \
        else None
    one_floor = next((r["floor_s"] for r in ones if r["floor_s"]), None)
    for r in report["results"]:
        times = ", ".join(f"{t:.2f}" for t in r["times_s"])
        ratio = f"{r['median_s'] / base:.2f}x" if base else "-"
        floor = f"{r['floor_s']:.2f} s" if r["floor_s"] is not None else "-"
        fratio = f"{r['floor_s'] / one_floor:.2f}x" if r["floor_s"] and one_floor else "-"
        extra = ""
        if wires:
            same = next((o for o in report["results"] if o.get("wire", "none") == "none"
                         and all(o.get(f) == r.get(f) for f in ("ranks", "engines", "relay"))),
                        None)
            extra += f" {r['median_s'] / same['median_s']:.2f}x |" if same else " - |"
        for k in kinds:
            c = r.get(f"{k}_chain_s")
            extra += (f" {c:.2f} s | {r['median_s'] / c:.2f}x |" if c else " - | - |")
        lines.append(f"| {str(r.get('ranks', 1)) + ' | ' if many else ''}{r['engines']} | "
                     f"{r.get('relay', 'none')} | "
                     f"{r.get('wire', 'none') + ' | ' if wires else ''}"
                     f"{r['median_s']:.2f} s | {times} | {ratio} "
                     f"| {floor} | {fratio} |{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.driver:
        print(RESULT_TAG + json.dumps(measure(args)), flush=True)
        return 0

    import logging

    from ray_rdt_pool.bench.env import cpu_model
    from ray_rdt_pool.bench.testbed import TestBed
    from ray_rdt_pool.bench.testbed_cli import bed_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    reason = TestBed.available()
    if reason is not None:
        print(f"the test bed cannot run here: {reason}", file=sys.stderr)
        return 2
    nodes = args.nodes_needed
    pypath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": pypath, "RAY_RDT_POOL_METRICS": "0", "RAY_DEDUP_LOGS": "0"}
    bed = bed_from_args(args, nodes, env=env)
    load_before = list(os.getloadavg())
    floors: dict[str, dict[int, list[float]]] = {k: {} for k in args.floor_kinds}
    with bed:
        out = bed.run_driver(_DRIVER, [*(argv if argv is not None else sys.argv[1:]),
                                        "--driver"], timeout=args.timeout_s,
                             echo_stderr=True)
        # The floors, on the same links, once Ray's actors are gone.
        from ray_rdt_pool.bench.chains import run_chain

        for kind in args.floor_kinds:
            for n in args.engine_counts:
                floors[kind][n] = run_chain(bed, kind, n, args.size_mib * MIB,
                                            int(args.bucket_mib * MIB), args.syncs + 1)
                print(f"{kind} chain, {n} hop(s): {floors[kind][n]}", file=sys.stderr,
                      flush=True)
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_TAG)]
    if not lines:
        print(f"the driver printed no result:\n{out[-3000:]}", file=sys.stderr)
        return 1
    got = json.loads(lines[-1][len(RESULT_TAG):])
    rate_bps = bed.rate_bps
    size = args.size_mib * MIB
    bucket = int(args.bucket_mib * MIB)
    for r in got["results"]:
        # Without relay a rank's egress carries its share to every engine and an
        # engine's ingress the whole model; a chain carries each bucket once per link,
        # plus one bucket per hop to fill the pipeline.
        # An FP8 model is smaller on the wire: its floor counts what the sender sent.
        model = r["nbytes"] if r.get("wire", "none") != "none" and r.get("ranks", 1) == 1 \
            else size
        if r.get("relay") == "chain":
            sent = model + (r["engines"] - 1) * bucket
        else:
            sent = max(r["engines"] / r.get("ranks", 1), 1.0) * model
        r["floor_s"] = sent * 8 / rate_bps if rate_bps else None
        for kind, per_n in floors.items():
            if r.get("relay") == "chain" and r.get("ranks", 1) == 1 \
                    and r.get("wire", "none") == "none" and r["engines"] in per_n:
                r[f"{kind}_chain_s"] = statistics.median(per_n[r["engines"]])
    report = {
        "what": "testbed_sync", "mode": args.mode, "relays": args.relays,
        "dtype": args.dtype, "wires": args.wires,
        "size_mib": args.size_mib,
        "tensors": args.tensors, "bucket_mib": args.bucket_mib, "syncs": args.syncs,
        "ranks": args.rank_counts,
        "max_inflight": args.max_inflight, "rate": bed.rate, "burst": bed.burst,
        "floors": {k: {str(n): ts for n, ts in v.items()} for k, v in floors.items()},
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
