"""The options of ``ray-rdt-pool bench``: its argument parser and :class:`Config`."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from ray_rdt_pool.bench import speedup_targets as T
from ray_rdt_pool.bench import workloads as W
from ray_rdt_pool.bench.variants import VARIANT_NAMES
from ray_rdt_pool.nixl.backend import PROGRESS_HOLD_S

MIB = 1 << 20
#: Default wait before the idle CPU window: past ours' fast-progress hold after a put.
IDLE_SETTLE_S = PROGRESS_HOLD_S + 0.5


_EXAMPLES = """examples:
  ray-rdt-pool bench --quick                  a few minutes on one node
  ray-rdt-pool bench --out results/           every workload; JSON, table and chart
  ray-rdt-pool bench --nodes 2                sender and receiver on two Ray nodes
  ray-rdt-pool bench --quick --address auto   on the running cluster
  ray-rdt-pool bench --netns-nodes 3 --rate 1gbit
                                              the weight sync across network-namespace
                                              nodes of this host (needs root)
"""


class BenchError(RuntimeError):
    """A variant could not be set up or measured as configured."""


@dataclasses.dataclass
class Config:
    quick: bool
    sizes: W.Sizes
    variants: list[str]
    workloads: list[str]
    reps: int
    warmup: int
    nodes: int
    address: str | None
    netns_nodes: int | None
    rate: str
    schedule: str
    fetch: str
    idle_s: float
    idle_settle_s: float
    timeout_s: float
    release_timeout_s: float
    pool_bytes: int
    object_store_bytes: int
    seed: int
    actor_logs: bool
    ucx_probe: bool
    floor: bool
    json_path: str | None
    plot_path: str | None
    out_dir: str | None
    #: role -> Ray node id, when the actors join a running cluster (``--address``)
    placement: dict[str, str] | None = None


# ----------------------------------------------------------------------------- CLI


def _csv(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        # An empty list would start Ray and measure nothing (or, for workloads, crash
        # sizing the pool): refuse it here.
        raise argparse.ArgumentTypeError(
            f"--{what}s {text!r} names no {what}: choose from {', '.join(allowed)} or 'all'")
    if items == ["all"]:
        return list(allowed)
    bad = [x for x in items if x not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown {what}: {', '.join(bad)} (choose from {', '.join(allowed)} or 'all')")
    return items


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ray-rdt-pool bench",
        description="Side-by-side benchmark of moving tensors between Ray actors: Ray's "
                    "object store and its NIXL variants against nixl_pool, on the same "
                    "workloads, checksummed.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small sizes and few repetitions (2 to 4 minutes here with Ray start-up, "
                        "depending on the load)")
    p.add_argument("--variants", default="all",
                   help=f"comma list of {', '.join(VARIANT_NAMES)} (default all)")
    p.add_argument("--workloads", default="all",
                   help=f"comma list of {', '.join(W.WORKLOADS)} (default all)")
    p.add_argument("--reps", type=int, help="measured repetitions (default 5; quick 3)")
    p.add_argument("--warmup", type=int, default=1,
                   help="unmeasured first repetitions per workload (default 1)")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="2: sender and receiver on two distinct Ray nodes (without --address: "
                        "a 2-node Ray cluster on this machine)")
    p.add_argument("--address", metavar="ADDR",
                   help="join this running Ray cluster (e.g. HEAD:6379, or 'auto') instead "
                        "of starting one; the actors are pinned to its nodes")
    p.add_argument("--netns-nodes", type=int, metavar="N",
                   help="instead: the weight sync (one trainer to 1..N-1 engines) on N Ray "
                        "nodes in network namespaces of this host, links limited to --rate "
                        "(needs root; see ray_rdt_pool.bench.testbed)")
    p.add_argument("--rate", default="500mbit",
                   help="with --netns-nodes: each node's link rate as tc writes it, or "
                        "'none' (default 500mbit)")
    p.add_argument("--schedule", choices=("sequential", "interleaved"), default="sequential",
                   help="sequential: each variant's actors alone; interleaved: all alive, "
                        "repetitions alternate between variants")
    p.add_argument("--fetch", choices=("get", "arg"), default="get",
                   help="get: ray.get of a nested ref in the receiver; arg: task argument")
    sizes = p.add_argument_group("sizes (defaults: full run; --quick shrinks them)")
    for field in dataclasses.fields(W.Sizes):
        flag = "--" + field.name.replace("_", "-")
        sizes.add_argument(flag, type=int, dest=field.name,
                           help=f"default {getattr(W.FULL_SIZES, field.name)}, "
                                f"quick {getattr(W.QUICK_SIZES, field.name)}")
    p.add_argument("--idle-s", type=float, help="idle CPU window (default 1.0; quick 0.5)")
    p.add_argument("--idle-settle-s", type=float, default=IDLE_SETTLE_S,
                   help="wait this long after the transfers before the idle CPU window "
                        f"(default {IDLE_SETTLE_S}: ours keeps its fast progress interval "
                        f"for {PROGRESS_HOLD_S} s after a put, and the window measures "
                        "the idle state)")
    p.add_argument("--timeout-s", type=float, default=180.0, help="per-transfer timeout")
    p.add_argument("--pool-mib", type=int,
                   help="pool size for nixl_pool_ray and ours (default: fits the largest "
                        "workload with 25%% slack)")
    p.add_argument("--object-store-mib", type=int, default=2560,
                   help="object store per node (default 2560)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--actor-logs", action="store_true", help="forward actor logs")
    p.add_argument("--no-ucx-probe", action="store_true",
                   help="skip the UCX protocol probe (a tiny NIXL READ in a subprocess)")
    floor_for = [w for w in W.WORKLOADS
                 if w in W.SYNC_WORKLOADS or any(w in t for t in T.TARGETS.values())]
    p.add_argument("--no-floor", action="store_true",
                   help="skip the floor measured after the transfers (memcpy, NIXL READ, "
                        "the sender's pack and a READ over two lanes; a few seconds), "
                        f"which runs when any of {', '.join(floor_for)} ran: the "
                        "weight-sync floors and the targets' floors need it")
    p.add_argument("--json", metavar="PATH", help="write every sample and the summary")
    p.add_argument("--plot", metavar="PATH.png", help="write the chart")
    p.add_argument("--out", metavar="DIR",
                   help="write DIR/bench-<timestamp>.json/.png and latest.json/.png")
    return p


def parse_config(argv: Sequence[str] | None) -> Config:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        variants = _csv(a.variants, VARIANT_NAMES, "variant")
        workloads = _csv(a.workloads, W.WORKLOADS, "workload")
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    base = W.QUICK_SIZES if a.quick else W.FULL_SIZES
    overrides = {f.name: getattr(a, f.name) for f in dataclasses.fields(W.Sizes)
                 if getattr(a, f.name) is not None}
    for name, value in overrides.items():
        # The first sync step is the cold one; only the later (warm) ones are measured.
        least = 2 if name == "sync_iters" else 1
        if value < least:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} {value}: must be >= {least} (default "
                         f"{getattr(base, name)}); leave it out for the default")
    sizes = dataclasses.replace(base, **overrides)
    for flag, value in (("--pool-mib", a.pool_mib), ("--object-store-mib", a.object_store_mib)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: must be >= 1 (MiB); leave it out for the default")
    if a.netns_nodes is not None and (a.netns_nodes < 2 or a.address):
        parser.error(f"--netns-nodes {a.netns_nodes}: needs at least 2 (a trainer and an "
                     "engine) and starts its own cluster, so not with --address")
    for flag, secs in (("--timeout-s", a.timeout_s), ("--idle-s", a.idle_s)):
        if secs is not None and not secs > 0:
            parser.error(f"{flag} {secs:g}: must be > 0 seconds")
    largest = max(W.payload_bytes(W.make_spec(w, sizes)) for w in workloads)
    pool = (a.pool_mib * MIB if a.pool_mib is not None
            else _round_up(int(largest * 1.25) + 8 * MIB, MIB))
    reps = a.reps if a.reps is not None else (3 if a.quick else 5)
    if reps < 1 or a.warmup < 0:
        parser.error(f"--reps {reps} and --warmup {a.warmup}: --reps must be >= 1 and "
                     "--warmup >= 0")
    return Config(
        quick=a.quick, sizes=sizes, variants=variants, workloads=workloads, reps=reps,
        warmup=a.warmup, nodes=a.nodes, address=a.address, netns_nodes=a.netns_nodes,
        rate=a.rate, schedule=a.schedule, fetch=a.fetch,
        idle_s=a.idle_s if a.idle_s is not None else (0.5 if a.quick else 1.0),
        idle_settle_s=max(0.0, a.idle_settle_s),
        timeout_s=a.timeout_s, release_timeout_s=min(30.0, a.timeout_s), pool_bytes=pool,
        object_store_bytes=a.object_store_mib * MIB, seed=a.seed, actor_logs=a.actor_logs,
        ucx_probe=not a.no_ucx_probe, floor=not a.no_floor, json_path=a.json,
        plot_path=a.plot, out_dir=a.out)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k
