"""Side-by-side benchmark CLI: Ray's object store, Ray's NIXL variants and our NIXL_POOL.

``make bench`` runs ``ray-rdt-pool bench --quick --out bench-results``; the full run
drops ``--quick``. See docs/benchmarks.md for the figures and what they mean. By default
it starts its own Ray on this host (``--nodes 2``: two Ray nodes of this host);
``--address`` joins a running cluster instead, and ``--netns-nodes N --rate R`` measures
the weight sync on the network-namespace test bed (:mod:`ray_rdt_pool.bench.testbed_sync`).

Each transfer is one repetition of this chain (``--fetch get``, the default)::

    driver  t0 = monotonic(); receiver.consume.remote(sender.produce.remote())
    sender  produce(): ray.put(tensors[, _tensor_transport=...]) -> returns [ref]
    receiver consume([ref]): [set_target_for_ref]; ray.get(ref) -> t_got; checksum
    driver  sender.wait_released(): when the sender's RDT store (and our pool) freed it

Phases (all from ``time.monotonic()``, one clock for every process on this machine):

* ``put``: the sender's ``ray.put`` call alone (serialize, RDT metadata, pool copy).
* ``fetch``: the receiver's ``set_target_for_ref`` (target variants) + ``ray.get``.
* ``e2e``: from the driver submitting ``produce`` to ``ray.get`` returning in the
  receiver with every tensor in its memory (``t_got - t0``). The checksums (both sides)
  and the sender's in-place update happen outside this interval for every variant.
* ``release``: from the end of the receiver's method (its tensors and ref dropped) to
  the moment the sender's RDT store has run the transport's ``garbage_collect`` and
  dropped the object; for our transport also until ``ray_rdt_pool.stats()`` shows an
  empty pool. n/a for the object-store variants.
* ``GB/s``: payload bytes / median e2e. ``meta B``: ``len(pickle.dumps(metadata))`` of
  the object's tensor-transport metadata, taken in the sender (n/a without RDT).

With ``--fetch arg`` the sender returns the tensors from an RDT method and the receiver
takes them as a task argument: ``e2e`` ends when the receiver's method starts (Ray
fetched the tensors before calling it); ``put`` and ``fetch`` are not observable.

Every transfer is verified: the sender changes every word in place before each
repetition and checksums its tensors; the receiver checksums what it got; a mismatch
fails the run (exit status 2) naming the variant, workload and repetition.

``sync_stream`` streams the ``sync`` weight set in buckets instead (ours:
``WeightSender.stream(..., max_inflight=2)`` into a ``WeightReceiver`` over the
receiver's weights; Ray's variants: the same buckets, one ``ray.put`` and one receiver
task each, two in flight). ``e2e`` ends when the last bucket is in the receiver's
weights; ``put`` and ``fetch`` are the bucket puts and loads, summed. On one node our
receivers copy the buckets straight out of the trainer's tensors (source reads: no put,
``source_read_buckets`` in the samples), across nodes they READ them by reference
(``reference_buckets``; ``put`` is then the time spent describing them). After the run
(Ray stopped) the memcpy and NIXL READ rates of :mod:`ray_rdt_pool.bench.floor` are
measured and give the floors of ``sync`` (pack + READ) and ``sync_stream``
(max(pack, READ) + one bucket; with source reads, one cma copy). So are the sender's own
pack rate and the rate of a READ over two read lanes; the last table gives each speedup
target of the topology (:data:`~ray_rdt_pool.bench.targets.TARGETS`), whether ours
met it, and the least ours could reach in this run: its time outside ``ray_rdt_pool``
plus the payload at those two rates (see
:func:`~ray_rdt_pool.bench.targets.target_floors`).

``experience`` and ``experience_samples`` send one RL batch (batched: a tensor per
field; per sample: a tensor per (sample, field)); the report compares their put+get.
The ``transferqueue`` variant (package ``transferqueue``, the ``bench`` extra) moves
them with TransferQueue's own KV API: ``kv_batch_put`` in the sender, ``kv_batch_get``
in the receiver (``put``, ``fetch``), ``kv_clear`` after the checksum (``release``).
Without the package it is reported as not available, and the rest runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import psutil

from ray_rdt_pool.bench import env as E
from ray_rdt_pool.bench import plot
from ray_rdt_pool.bench import report as R
from ray_rdt_pool.bench import targets as T
from ray_rdt_pool.bench import workloads as W
from ray_rdt_pool.bench.actors import Receiver, Sender
from ray_rdt_pool.bench.variants import (
    OTHER_VARIANTS,
    OUR_VARIANTS,
    RAY_VARIANTS,
    TQ_ACTOR_CPUS,
    VARIANT_NAMES,
    ZERO_COPY_ENV,
    Variant,
    our_transport_unavailable_reason,
    register_ours,
    transferqueue_unavailable_reason,
    variant_by_name,
)
from ray_rdt_pool.nixl.backend import PROGRESS_HOLD_S

_MIB = 1 << 20
#: Default wait before the idle CPU window: past ours' fast-progress hold after a put.
IDLE_SETTLE_S = PROGRESS_HOLD_S + 0.5


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
        description="Side-by-side RDT benchmark: object store, Ray NIXL variants, NIXL_POOL.",
        epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    pool = (a.pool_mib * _MIB if a.pool_mib is not None
            else _round_up(int(largest * 1.25) + 8 * _MIB, _MIB))
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
        object_store_bytes=a.object_store_mib * _MIB, seed=a.seed, actor_logs=a.actor_logs,
        ucx_probe=not a.no_ucx_probe, floor=not a.no_floor, json_path=a.json,
        plot_path=a.plot, out_dir=a.out)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


# ----------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on stderr (a plain line per step when not a terminal)."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._label = ""
        self._last_group = ""

    def _render(self) -> None:
        frac = self.done / self.total
        bar = "#" * int(frac * 30)
        text = (f"[{bar:<30}] {self.done}/{self.total} {self._label} "
                f"{time.monotonic() - self.start:5.1f}s")
        if self.tty:
            self.stream.write("\r" + text[:120].ljust(120))
            self.stream.flush()
        else:
            group = self._label.split(" ")[0]
            if group != self._last_group:
                self._last_group = group
                self.stream.write(text + "\n")
                self.stream.flush()

    def label(self, text: str) -> None:
        self._label = text
        self._render()

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._render()

    def note(self, text: str) -> None:
        """Print a line without breaking the bar."""
        if self.tty:
            self.stream.write("\r" + " " * 120 + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()
        if self.tty:
            self._render()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ----------------------------------------------------------------------------- processes


def proc_cpu(pid: int) -> tuple[float, int] | None:
    """(user+system CPU seconds, thread count) of a process on this host."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            times = proc.cpu_times()
            return times.user + times.system, proc.num_threads()
    except psutil.Error:
        return None


def measure_idle(pids: dict[str, dict[str, int]], window_s: float,
                 settle_s: float = 0.0) -> dict[str, Any]:
    """CPU cores each process used while nothing was sent, over ``window_s`` that start
    ``settle_s`` after the last transfer."""
    time.sleep(settle_s)
    before = {(v, role): proc_cpu(pid) for v, roles in pids.items() for role, pid in roles.items()}
    t0 = time.monotonic()
    time.sleep(window_s)
    wall = time.monotonic() - t0
    out: dict[str, Any] = {}
    for (v, role), b in before.items():
        a = proc_cpu(pids[v][role])
        out.setdefault(v, {})[role] = None if a is None or b is None else {
            "cores": round((a[0] - b[0]) / wall, 3), "threads": a[1], "window_s": round(wall, 3)}
    return out


def _pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return True


@dataclasses.dataclass
class Pair:
    variant: Variant
    sender: Any
    receiver: Any
    infos: dict[str, Any]
    broken: bool = False

    @property
    def pids(self) -> dict[str, int]:
        """The PIDs of the actors on this host (another host's PID means nothing here)."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        return {role: info["pid"] for role, info in self.infos.items()
                if info["node_id"] == here}


_CLASSES: dict[tuple[str, bool], Any] = {}


def _actor_class(role: str, rdt: bool) -> Any:
    """``ray.remote`` class for a role, with or without ``enable_tensor_transport``."""
    import ray

    key = (role, rdt)
    if key not in _CLASSES:
        base = Sender if role == "sender" else Receiver
        cls = type(f"{base.__name__}{'RDT' if rdt else 'Plain'}", (base,), {})
        _CLASSES[key] = ray.remote(  # type: ignore[call-overload]
            num_cpus=0, enable_tensor_transport=rdt)(cls)
    return _CLASSES[key]


def make_pair(variant: Variant, cfg: Config) -> Pair:
    """Start the variant's sender and receiver, wait until both are ready, check them."""
    import ray

    env = {ZERO_COPY_ENV: "1"} if variant.zero_copy else {}
    handles = {}
    for role in ("sender", "receiver"):
        opts: dict[str, Any] = {"max_restarts": 0}
        if cfg.placement is None:
            opts["resources"] = {role: 1}
        else:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                cfg.placement[role], soft=False)
        if env:
            opts["runtime_env"] = {"env_vars": env}
        handles[role] = _actor_class(role, variant.rdt).options(**opts).remote(
            variant, cfg.pool_bytes)
    infos = dict(zip(handles, ray.get([h.info.remote() for h in handles.values()],
                                      timeout=cfg.timeout_s)))
    pair = Pair(variant, handles["sender"], handles["receiver"], infos)
    zc = infos["sender"]["zero_copy_active"]
    if zc != variant.zero_copy:
        kill_pair(pair)
        raise BenchError(
            f"{variant.name}: {ZERO_COPY_ENV} is {'on' if zc else 'off'} in the sender's "
            f"serializer, expected {'on' if variant.zero_copy else 'off'}")
    if cfg.nodes == 2 and infos["sender"]["node_id"] == infos["receiver"]["node_id"]:
        kill_pair(pair)
        raise BenchError(f"{variant.name}: sender and receiver landed on the same node")
    if variant.tq:
        # The sender starts TransferQueue (its controller and storage actors are the
        # sender's children); only then can the receiver attach to it.
        try:
            infos["sender"]["tq_init_s"] = ray.get(pair.sender.tq_init.remote(),
                                                   timeout=cfg.timeout_s)
            infos["receiver"]["tq_init_s"] = ray.get(pair.receiver.tq_init.remote(),
                                                     timeout=cfg.timeout_s)
        except Exception:
            kill_pair(pair)
            raise
    return pair


def kill_pair(pair: Pair, wait_s: float = 20.0) -> None:
    """Kill both actors and wait until their processes are gone."""
    import ray

    if pair.variant.tq:
        # Stop TransferQueue's controller and storage actors cleanly; they would also go
        # with the sender (their owner), but not before their sockets time out.
        try:
            ray.get(pair.sender.tq_close.remote(), timeout=30)
        except Exception:
            pass
    for h in (pair.sender, pair.receiver):
        try:
            ray.kill(h, no_restart=True)
        except Exception:
            pass
    deadline = time.monotonic() + wait_s
    pids = list(pair.pids.values())
    while time.monotonic() < deadline and not all(_pid_gone(p) for p in pids):
        time.sleep(0.05)


# ----------------------------------------------------------------------------- measuring


class Runner:
    """Runs the configured variants and workloads and collects samples."""

    def __init__(self, cfg: Config, progress: Progress) -> None:
        self.cfg = cfg
        self.progress = progress
        self.samples: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.mismatches: list[str] = []
        self.variant_info: dict[str, dict[str, Any]] = {}
        self.skipped: dict[str, dict[str, str]] = {}
        self.idle: dict[str, Any] = {}
        #: experience workloads: W.per_tensor_floor in our sender's process
        self.tensor_floor: dict[str, dict[str, Any]] = {}
        self._ours_registered = False
        order = [w for w in W.WORKLOADS if w in cfg.workloads]
        # sync first, on fresh actors, so its first iteration is really cold; the streamed
        # sync right after it, so the two weight-sync workloads run back to back.
        first = [w for w in W.SYNC_WORKLOADS if w in order]
        self.workload_order = first + [w for w in order if w not in first]
        self.specs = {w: W.make_spec(w, cfg.sizes) for w in self.workload_order}
        self.payloads = {w: W.payload_bytes(s) for w, s in self.specs.items()}

    def skip_reason(self, variant: Variant, workload: str) -> str | None:
        """Why a variant/workload pair is not measured (None: it is).

        Plain pickling of a row view (no zero-copy) writes the view's whole base storage,
        so ``objstore`` would serialize rows x weight bytes for ``views``; past half the
        object store that cannot finish in a sane time (or at all).
        """
        spec = self.specs[workload]
        if variant.tq and not spec.is_experience:
            return ("TransferQueue stores RL samples (kv_batch_put of a TensorDict, one key "
                    "per sample): measured on the experience workloads only")
        if variant.ours and variant.target and spec.is_stream:
            return ("the weights API lands every bucket in the receiver's tensors itself "
                    "(set_target_for_ref); that is the nixl_pool row")
        if variant.transport is None and not variant.zero_copy and workload == "views":
            s = self.cfg.sizes
            serialized = s.views_rows * s.views_rows * s.views_cols * 4
            if serialized > self.cfg.object_store_bytes // 2:
                return (f"pickle writes each view's whole {self.payloads[workload] / _MIB:.1f}"
                        f" MiB base storage: {s.views_rows:,} views would serialize "
                        f"{serialized / (1 << 30):.1f} GiB (> half the object store)")
        return None

    def n_transfers(self, workload: str) -> int:
        spec = self.specs[workload]
        return spec.iterations if spec.is_sync else self.cfg.warmup + self.cfg.reps

    def _check_sum(self, sample: dict[str, Any], variant: str, workload: str, rep: int,
                   upd: dict[str, Any], res: dict[str, Any], where: str) -> None:
        """Compare the receiver's checksum with the sender's; record a mismatch."""
        sample["checksum_ok"] = res["checksum"] == upd["checksum"]
        if not sample["checksum_ok"]:
            msg = (f"CHECKSUM MISMATCH variant={variant} workload={workload} rep={rep}: "
                   f"sender {upd['checksum']:#x}, receiver {res['checksum']:#x} "
                   f"({res['n_tensors']} tensors {where})")
            self.mismatches.append(msg)
            self.progress.note(msg)

    def _failed_sample(self, sample: dict[str, Any], exc: Exception, variant: str,
                       workload: str, rep: int) -> dict[str, Any]:
        """Record a repetition that raised: the error on the sample, and a run failure."""
        sample["error"] = f"{type(exc).__name__}: {exc}"
        sample["traceback"] = traceback.format_exc(limit=8)
        self._fail(f"variant={variant} workload={workload} rep={rep}: "
                   f"{sample['error'].splitlines()[0][:300]}")
        return sample

    def _fail(self, text: str) -> None:
        self.failures.append(text)
        self.progress.note("FAIL: " + text)

    # -- availability ---------------------------------------------------------------

    def availability(self) -> dict[str, str]:
        """Reasons for variants that cannot run here (empty when all can)."""
        out = {}
        ours_reason = (our_transport_unavailable_reason()
                       if any(v in OUR_VARIANTS for v in self.cfg.variants) else None)
        for name in self.cfg.variants:
            v = variant_by_name(name)
            if v.ours and ours_reason:
                out[name] = ours_reason
            elif v.target and self.cfg.fetch == "arg":
                out[name] = "set_target_for_ref needs the ray.get path (--fetch get)"
            elif v.tq:
                why = transferqueue_unavailable_reason()
                if why is None and self.cfg.fetch == "arg":
                    why = "TransferQueue has no task-argument path (--fetch get only)"
                if why is not None:
                    out[name] = why
        return out

    def uses_transferqueue(self, unavailable: dict[str, str]) -> bool:
        """Whether TransferQueue's actors will be started (they need logical CPUs)."""
        return any(variant_by_name(n).tq and n not in unavailable for n in self.cfg.variants) \
            and any(s.is_experience for s in self.specs.values())

    def _register_ours_in_driver(self) -> None:
        if not self._ours_registered:
            register_ours(None)
            self._ours_registered = True

    # -- one transfer ---------------------------------------------------------------

    def transfer(self, pair: Pair, workload: str, rep: int, kind: str) -> dict[str, Any]:
        import ray

        if self.specs[workload].is_stream:
            return self.transfer_stream(pair, workload, rep, kind)
        cfg, v = self.cfg, pair.variant
        sample: dict[str, Any] = {"variant": v.name, "workload": workload, "rep": rep,
                                  "kind": kind, "payload_bytes": self.payloads[workload],
                                  "fetch_path": "kv_batch_get" if v.tq else cfg.fetch}
        try:
            upd = ray.get(pair.sender.refresh.remote(rep), timeout=cfg.timeout_s)
            sample.update(sender_update_s=upd["update_s"], sender_checksum_s=upd["checksum_s"],
                          checksum_sender=upd["checksum"])
            if v.tq:
                t0 = time.monotonic()
                res = ray.get(pair.receiver.tq_consume.remote(pair.sender.tq_produce.remote()),
                              timeout=cfg.timeout_s)
            elif cfg.fetch == "get":
                t0 = time.monotonic()
                res = ray.get(pair.receiver.consume.remote(pair.sender.produce.remote()),
                              timeout=cfg.timeout_s)
            else:
                method = pair.sender.produce_ret
                if v.transport is not None:
                    method = method.options(tensor_transport=v.transport)
                t0 = time.monotonic()
                res = ray.get(pair.receiver.consume_arg.remote(method.remote()),
                              timeout=cfg.timeout_s)
            rel = ray.get(pair.sender.wait_released.remote(cfg.release_timeout_s),
                          timeout=cfg.timeout_s + cfg.release_timeout_s)
        except Exception as exc:
            return self._failed_sample(sample, exc, v.name, workload, rep)
        got = res["r_got"]
        put_s = res["s_put_end"] - res["s_start"] if "s_start" in res else None
        fetch_s = got - res["r_start"] if cfg.fetch == "get" or v.tq else None
        if v.tq:
            release_s = res["release_s"]  # kv_clear of the batch in the receiver
        else:
            release_s = (rel["freed_at"] - res["r_end"]) if rel["freed_at"] else None
        sample.update(
            e2e_s=got - t0,
            put_s=put_s,
            fetch_s=fetch_s,
            # the sender's put and the receiver's get calls, with the hand-off between
            # them left out (the per-sample vs batched target compares these)
            put_get_s=put_s + fetch_s if put_s is not None and fetch_s is not None else None,
            dispatch_s=res["s_start"] - t0 if "s_start" in res else None,
            handoff_s=res["r_start"] - res["s_put_end"] if "s_put_end" in res else None,
            **_receiver_fields(res),
            meta_bytes=rel["meta_bytes"],
            release_s=release_s,
            release_timed_out=bool(v.rdt and rel["freed_at"] is None),
            gbps=self.payloads[workload] / (got - t0) / 1e9,
            # ours: the parts of put and get spent inside ray_rdt_pool itself
            ours_put_s=res.get("ours_put_s"),
            ours_get_s=res.get("ours_get_s"),
        )
        if rel.get("stats") is not None:
            sample["sender_stats"] = rel["stats"]
        self._check_sum(sample, v.name, workload, rep, upd, res, "received")
        if v.rdt and rel["freed_at"] is None:
            self.progress.note(f"warning: {v.name}/{workload} rep {rep}: object not freed "
                               f"within {cfg.release_timeout_s:.0f} s (release n/a)")
        if res["into_targets"] is False:
            self.progress.note(f"warning: {v.name}/{workload} rep {rep}: tensors were not "
                               "fetched into the target buffers")
        return sample

    def transfer_stream(self, pair: Pair, workload: str, rep: int, kind: str
                        ) -> dict[str, Any]:
        """One ``sync_stream`` step: update the weights in place, stream them, verify.

        ``e2e``: from the driver submitting the sender's stream to the moment the last
        bucket was in the receiver's weights. ``put``: the sender's ``ray.put`` calls of
        every bucket, summed; ``fetch``: the receiver's bucket loads, summed (they
        overlap each other, so put + fetch may exceed e2e).
        """
        import ray

        cfg, v = self.cfg, pair.variant
        sample: dict[str, Any] = {"variant": v.name, "workload": workload, "rep": rep,
                                  "kind": kind, "payload_bytes": self.payloads[workload],
                                  "fetch_path": "stream"}
        try:
            upd = ray.get(pair.sender.refresh.remote(rep), timeout=cfg.timeout_s)
            sample.update(sender_update_s=upd["update_s"], sender_checksum_s=upd["checksum_s"],
                          checksum_sender=upd["checksum"])
            t0 = time.monotonic()
            snd = ray.get(pair.sender.stream_to.remote(pair.receiver, cfg.timeout_s),
                          timeout=2 * cfg.timeout_s)
            res = ray.get(pair.receiver.stream_result.remote(), timeout=cfg.timeout_s)
            if res["r_got"] is None:
                raise BenchError("the stream ended but the receiver loaded no bucket")
        except Exception as exc:
            return self._failed_sample(sample, exc, v.name, workload, rep)
        got = res["r_got"]
        sample.update(
            e2e_s=got - t0,
            put_s=snd["put_s"],
            fetch_s=res["fetch_s"],
            dispatch_s=snd["s_start"] - t0,
            sender_stream_s=snd["s_end"] - snd["s_start"],
            **_receiver_fields(res),
            meta_bytes=snd["meta_bytes"],
            release_s=None,
            buckets=snd["buckets"],
            puts=snd["puts"],
            gbps=self.payloads[workload] / (got - t0) / 1e9,
        )
        for key in ("pool_wait_s", "fallbacks", "peak_pool_used", "ours_put_s",
                    "source_read_buckets", "reference_buckets"):
            if key in snd:
                sample[key] = snd[key]
        sample["ours_get_s"] = res.get("ours_get_s")
        self._check_sum(sample, v.name, workload, rep, upd, res, "in the receiver's weights")
        if res["into_targets"] is False:
            self.progress.note(f"warning: {v.name}/{workload} rep {rep}: buckets were not "
                               "fetched into the receiver's weights")
        return sample

    # -- one workload on one pair ----------------------------------------------------

    def _setup_workload(self, pair: Pair, workload: str) -> None:
        import ray

        spec = self.specs[workload]
        ray.get([pair.sender.build.remote(spec, self.cfg.seed),
                 pair.receiver.prepare.remote(spec)], timeout=self.cfg.timeout_s)

    def _teardown_workload(self, pair: Pair, workload: str) -> None:
        import ray

        if pair.variant.name == "nixl_pool" and workload in W.EXPERIENCE_WORKLOADS:
            try:  # context for the per-sample target, never a result: errors are noted
                self.tensor_floor[workload] = ray.get(pair.sender.tensor_floor.remote(),
                                                      timeout=self.cfg.timeout_s)
            except Exception as exc:
                self.tensor_floor[workload] = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            ray.get([pair.sender.drop.remote(), pair.receiver.drop.remote()],
                    timeout=self.cfg.timeout_s)
            if pair.variant.ours:
                stats = ray.get([pair.sender.stats.remote(), pair.receiver.stats.remote()],
                                timeout=self.cfg.timeout_s)
                for role, st in zip(("sender", "receiver"), stats):
                    self.variant_info[pair.variant.name].setdefault(
                        f"{role}_stats_after", {})[workload] = st
        except Exception as exc:
            pair.broken = True
            self._fail(f"variant={pair.variant.name} workload={workload}: teardown failed: "
                       f"{type(exc).__name__}: {exc}")

    def _kind(self, workload: str, i: int) -> str:
        if self.specs[workload].is_sync:
            return "cold" if i == 0 else "warm"
        return "warmup" if i < self.cfg.warmup else "measured"

    def _run_one(self, pair: Pair, workload: str, i: int) -> None:
        self.progress.label(f"{pair.variant.name}/{workload} {i + 1}/{self.n_transfers(workload)}")
        sample = self.transfer(pair, workload, i, self._kind(workload, i))
        self.samples.append(sample)
        if sample.get("error"):
            pair.broken = True
        self.progress.advance()

    def _new_pair(self, name: str) -> Pair | None:
        v = variant_by_name(name)
        try:
            if v.ours:
                self._register_ours_in_driver()
            pair = make_pair(v, self.cfg)
        except Exception as exc:
            self._fail(f"variant={name}: setup failed: {type(exc).__name__}: {exc}")
            self.variant_info[name]["setup_error"] = f"{type(exc).__name__}: {exc}"
            return None
        self.variant_info[name]["actors"] = pair.infos
        return pair

    def run(self, unavailable: dict[str, str]) -> None:
        names = [n for n in self.cfg.variants if n not in unavailable]
        for n in self.cfg.variants:
            v = variant_by_name(n)
            self.variant_info[n] = {"available": n not in unavailable,
                                    "reason": unavailable.get(n), "summary": v.summary,
                                    "transport": v.transport}
        if self.cfg.schedule == "sequential":
            for name in names:
                self._run_sequential(name)
        else:
            self._run_interleaved(names)

    def _measures_anything(self, name: str) -> bool:
        """False when every selected workload skips this variant: no actors are started
        for it (TransferQueue's start-up alone takes seconds)."""
        v = variant_by_name(name)
        return any(self.skip_reason(v, w) is None for w in self.workload_order)

    def _run_sequential(self, name: str) -> None:
        t_variant = time.monotonic()
        if not self._measures_anything(name):
            for workload in self.workload_order:
                reason = self.skip_reason(variant_by_name(name), workload)
                self.skipped.setdefault(workload, {})[name] = str(reason)
                self.progress.advance(self.n_transfers(workload))
            return
        pair = self._new_pair(name)
        self.variant_info[name]["actor_start_s"] = round(time.monotonic() - t_variant, 3)
        for workload in self.workload_order:
            skip = self.skip_reason(variant_by_name(name), workload)
            if skip:
                self.skipped.setdefault(workload, {})[name] = skip
            if pair is None or skip:
                self.progress.advance(self.n_transfers(workload))
                continue
            try:
                self._setup_workload(pair, workload)
            except Exception as exc:
                self._fail(f"variant={name} workload={workload}: setup failed: "
                           f"{type(exc).__name__}: {exc}")
                pair.broken = True
            done = 0
            while done < self.n_transfers(workload) and not pair.broken:
                self._run_one(pair, workload, done)
                done += 1
            self.progress.advance(self.n_transfers(workload) - done)
            if not pair.broken:
                self._teardown_workload(pair, workload)
            if pair.broken:  # start over with fresh actors for the next workload
                kill_pair(pair)
                pair = self._new_pair(name)
        if pair is not None:
            self.progress.label(f"{name} idle CPU")
            self.idle.update(measure_idle({name: pair.pids}, self.cfg.idle_s,
                                          self.cfg.idle_settle_s))
            kill_pair(pair)
        self.variant_info[name]["wall_s"] = round(time.monotonic() - t_variant, 3)

    def _run_interleaved(self, names: list[str]) -> None:
        pairs = {n: p for n in names
                 if self._measures_anything(n) and (p := self._new_pair(n)) is not None}
        for n in names:
            if n not in pairs and not self._measures_anything(n):
                for workload in self.workload_order:
                    self.skipped.setdefault(workload, {})[n] = str(
                        self.skip_reason(variant_by_name(n), workload))
                    self.progress.advance(self.n_transfers(workload))
        for workload in self.workload_order:
            active = {}
            for n, pair in pairs.items():
                skip = self.skip_reason(pair.variant, workload)
                if skip:
                    self.skipped.setdefault(workload, {})[n] = skip
                    self.progress.advance(self.n_transfers(workload))
                else:
                    active[n] = pair
            for n, pair in list(active.items()):
                try:
                    self._setup_workload(pair, workload)
                except Exception as exc:
                    self._fail(f"variant={n} workload={workload}: setup failed: {exc}")
                    pair.broken = True
            for i in range(self.n_transfers(workload)):
                for pair in active.values():
                    if pair.broken:
                        self.progress.advance()
                        continue
                    self._run_one(pair, workload, i)
            for n, pair in list(active.items()):
                if not pair.broken:
                    self._teardown_workload(pair, workload)
                if pair.broken:
                    kill_pair(pair)
                    fresh = self._new_pair(n)
                    if fresh is None:
                        del pairs[n]
                    else:
                        pairs[n] = fresh
        self.progress.label("idle CPU")
        self.idle.update(measure_idle({n: p.pids for n, p in pairs.items()}, self.cfg.idle_s,
                                       self.cfg.idle_settle_s))
        for pair in pairs.values():
            kill_pair(pair)


# ----------------------------------------------------------------------------- cluster


def place_on_nodes(nodes: Sequence[dict[str, Any]], here: str, want: int,
                   address: str) -> dict[str, str]:
    """Role -> node id on a running cluster: the driver's node first, and with ``want``
    2 the receiver on another node. Raises BenchError naming the counts if too few."""
    alive = [n["NodeID"] for n in nodes if n.get("Alive")]
    if len(alive) < want:
        raise BenchError(
            f"--nodes {want} puts the sender and the receiver on {want} distinct Ray nodes, "
            f"but the cluster at {address} has {len(alive)} alive node(s); add a node to "
            "it, or run with --nodes 1")
    order = sorted(alive, key=lambda n: n != here)  # the driver's node first
    return {"sender": order[0], "receiver": order[want - 1]}


def start_ray(cfg: Config, min_cpus: int = 0) -> Any:
    """Start Ray (1 node, or a 2-node ``Cluster`` on this machine), or join the cluster at
    ``cfg.address`` and fill ``cfg.placement``; return a stop function.

    ``min_cpus``: logical CPUs the cluster must offer at least (TransferQueue's actors ask
    for one each; ours ask for none). Only Ray's scheduler sees the number.
    """
    import logging

    import ray

    ncpu = max(os.cpu_count() or 1, min_cpus if cfg.nodes == 1 else (min_cpus + 1) // 2)
    common: dict[str, Any] = {"log_to_driver": cfg.actor_logs, "logging_level": logging.WARNING}
    if cfg.address:
        ray.init(address=cfg.address, **common)
        try:
            cfg.placement = place_on_nodes(
                ray.nodes(), ray.get_runtime_context().get_node_id(), cfg.nodes, cfg.address)
        except BaseException:
            ray.shutdown()
            raise
        return ray.shutdown
    if cfg.nodes == 1:
        ray.init(address="local", num_cpus=ncpu, resources={"sender": 1000, "receiver": 1000},
                 object_store_memory=cfg.object_store_bytes, include_dashboard=False, **common)
        return ray.shutdown
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": ncpu, "resources": {"sender": 1000},
        "object_store_memory": cfg.object_store_bytes, "include_dashboard": False})
    cluster.add_node(num_cpus=ncpu, resources={"receiver": 1000},
                     object_store_memory=cfg.object_store_bytes)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, **common)

    def stop() -> None:
        ray.shutdown()
        cluster.shutdown()

    return stop


# ----------------------------------------------------------------------------- main


def _config_json(cfg: Config) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["sizes"] = dataclasses.asdict(cfg.sizes)
    return d


def _title(cfg: Config, env: dict[str, Any], stamp: str) -> str:
    mode = "QUICK run" if cfg.quick else "full run"
    return (f"ray_rdt_pool side-by-side, {mode}, {stamp}: {env['cores']}-core "
            f"{env['cpu_model']}, {cfg.nodes} node(s)"
            f"{f' of the cluster at {cfg.address}' if cfg.address else ''}, {cfg.schedule}, "
            f"fetch={cfg.fetch}, "
            f"ray {env['versions'].get('ray')}")


_STREAM_NOTE = (
    "  sync_stream: put = the sender's ray.put of every bucket (ours: its own pack, or the "
    "description of a bucket read in place or by reference), summed; fetch = the "
    "receiver's bucket loads, summed\n"
    "  (they overlap: put + fetch may exceed e2e). Every variant lands the buckets in the "
    "receiver's weights:\n"
    "  ours through WeightReceiver (set_target_for_ref into them), nixl_target with "
    "set_target_for_ref, the others ray.get + copy_.")


def _path_label(cfg: Config, spec: W.WorkloadSpec) -> str:
    """What the table header says about how the receiver got the data."""
    if spec.is_stream:
        return (f"stream, {W.STREAM_MAX_INFLIGHT} buckets in flight "
                f"(ours: WeightSender.stream)")
    if spec.is_experience and "transferqueue" in cfg.variants:
        return f"{cfg.fetch}; transferqueue: kv_batch_put/kv_batch_get"
    return cfg.fetch


def measure_floor(runner: Runner, reps: int = 5) -> dict[str, Any]:
    """Copy and NIXL READ GB/s on this machine, now (Ray is down, our actors gone).

    The same measurements as ``python -m ray_rdt_pool.bench.floor`` (one thread copying into
    a pre-faulted buffer; a READ between two processes with NIXL's progress thread off),
    at the weight set's size (at most 256 MiB), so the sync floors use rates from the
    same run. Also the best this design reaches at each of its two steps, for the target
    floors (:func:`~ray_rdt_pool.bench.targets.target_floors`): the sender's own pack
    (its threads and streaming stores, ``pack_gbps``) and a READ split over two read
    lanes (``read_lanes_gbps``). Failures are recorded, never raised: the floor is
    context, not a result.
    """
    from ray_rdt_pool.bench import floor as F
    from ray_rdt_pool.bench import pack as bench_pack

    sync = [w for w in W.SYNC_WORKLOADS if w in runner.payloads]
    size = runner.payloads[sync[0]] if sync else max(runner.payloads.values(), default=0)
    nbytes = min(size, 256 * _MIB) // _MIB * _MIB or _MIB
    out: dict[str, Any] = {"bytes": nbytes, "reps": reps}

    def rate(key: str, fn: Callable[[], float]) -> None:
        try:
            out[key] = fn()
        except Exception as exc:
            out[key.replace("_gbps", "_error")] = f"{type(exc).__name__}: {exc}"

    def checked(r: dict[str, Any], ok_key: str, key: str, what: str) -> float:
        if r.get(ok_key) is False:
            raise AssertionError(f"wrong bytes after the {what}")
        return float(r[key]["median"] if isinstance(r[key], dict) else r[key])

    rate("memcpy_gbps", lambda: F.measure_memcpy(nbytes, reps)["prefaulted_gbps"]["median"])
    rate("read_gbps", lambda: checked(F.measure_nixl_read(nbytes, reps, prog_thread=False),
                                      "checksum_ok", "gbps", "READ"))
    rate("pack_gbps", lambda: checked(bench_pack.measure_pack_gbps(nbytes, reps),
                                      "same_bytes", "gbps", "pack"))
    rate("read_lanes_gbps", lambda: checked(F.measure_nixl_lanes(nbytes, reps),
                                            "checksum_ok", "read_lanes_gbps", "split READ"))
    return out


def testbed_engine_counts(nodes: int) -> list[int]:
    """Engine counts measured on ``nodes`` test-bed nodes (node 0 is the trainer's):
    the powers of two below ``nodes``, and ``nodes - 1``."""
    counts = {nodes - 1}
    k = 1
    while k < nodes - 1:
        counts.add(k)
        k *= 2
    return sorted(counts)


def run_testbed(cfg: Config) -> int:
    """``--netns-nodes N``: :mod:`ray_rdt_pool.bench.testbed_sync` on N namespaced nodes."""
    from ray_rdt_pool.bench import testbed_sync
    from ray_rdt_pool.bench.testbed import TestBed

    reason = TestBed.available()
    if reason is not None:
        print(f"error: --netns-nodes needs the network-namespace test bed, which cannot "
              f"run here: {reason}", file=sys.stderr)
        return 2
    assert cfg.netns_nodes is not None
    argv = ["--engines", ",".join(map(str, testbed_engine_counts(cfg.netns_nodes))),
            "--rate", cfg.rate]
    if cfg.quick:
        argv += ["--size-mib", "16", "--syncs", "1"]
    if cfg.out_dir:
        argv += ["--out", cfg.out_dir]
    return testbed_sync.main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_config(argv)
    if cfg.netns_nodes is not None:
        return run_testbed(cfg)
    wall0 = time.monotonic()
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    env = E.collect_env()
    if env["loadavg_start"] and env["loadavg_start"][0] > 1.0:
        print(f"note: load average {env['loadavg_start']} on {env['cores']} cores: other "
              "processes are competing; timings will be noisy", file=sys.stderr)
    probe = E.start_ucx_probe() if cfg.ucx_probe else None
    progress = Progress(0)
    runner = Runner(cfg, progress)
    unavailable = runner.availability()
    progress.total = max(1, len([v for v in cfg.variants if v not in unavailable]) * sum(
        runner.n_transfers(w) for w in runner.workload_order))
    for name, why in unavailable.items():
        print(f"{name}: not available: {why}", file=sys.stderr)
    stop = None
    try:
        progress.label("starting Ray")
        t = time.monotonic()
        min_cpus = TQ_ACTOR_CPUS if runner.uses_transferqueue(unavailable) else 0
        stop = start_ray(cfg, min_cpus)
        env["ray_start_s"] = round(time.monotonic() - t, 2)
        env["ray_min_logical_cpus"] = min_cpus
        t = time.monotonic()
        env["ucx"] = E.finish_ucx_probe(probe)  # done before any measurement starts
        env["ucx_probe_wait_s"] = round(time.monotonic() - t, 2)
        runner.run(unavailable)
    except KeyboardInterrupt:
        progress.close()
        print("interrupted", file=sys.stderr)
        return 130
    except BenchError as exc:
        progress.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if stop is not None:
            stop()
    floor: dict[str, Any] = {}
    if cfg.floor and any(s["workload"] in W.SYNC_WORKLOADS or s["workload"] in T.TARGETS[cfg.nodes]
                         for s in runner.samples):
        progress.label("floor")
        floor = measure_floor(runner)
    progress.close()
    env["loadavg_end"] = E.loadavg()
    wall = time.monotonic() - wall0

    display = [w for w in W.WORKLOADS if w in runner.specs]
    # Every variant that was to run a workload: one that left no sample (its actors did
    # not start) then reads as failed, and never leaves a slower Ray variant the best.
    expected = {w: [v for v in cfg.variants
                    if v not in unavailable and v not in runner.skipped.get(w, {})]
                for w in display}
    summary = R.summarize(runner.samples, runner.payloads, RAY_VARIANTS, OUR_VARIANTS, display,
                          other_variants=OTHER_VARIANTS, expected=expected)
    stream_spec = runner.specs.get("sync_stream")
    floors = T.weight_sync_floors(
        floor, runner.payloads, W.stream_bucket_bytes(stream_spec) if stream_spec else None)
    vs_sync = R.stream_vs_sync(summary, cfg.variants)
    targets = T.target_floors(summary, runner.payloads, floor, cfg.nodes)
    experience = R.experience_put_get(summary, cfg.variants, OUR_VARIANTS,
                                      runner.tensor_floor)
    print(_title(cfg, env, stamp))
    print(R.format_env(env))
    for w in display:
        if w in summary:
            spec = runner.specs[w]
            print()
            print(R.format_workload(w, W.describe(spec), summary[w], unavailable,
                                    runner.skipped.get(w, {}), cfg.variants, spec.is_sync,
                                    _path_label(cfg, spec)))
            if spec.is_stream:
                print(_STREAM_NOTE)
            inside = R.format_inside_ours(w, summary, OUR_VARIANTS)
            if inside and spec.is_stream:  # the experience workloads: in their own table
                print(inside)
        if w == "sync_stream" and vs_sync:
            print()
            print(R.format_stream_vs_sync(vs_sync))
        if w == "sync_stream" and floor:
            print()
            print(T.format_floors(floor, floors, summary, OUR_VARIANTS))
        if w == "experience_samples" and "experience" in summary and w in summary:
            print()
            print(R.format_experience(experience, len(W.tensor_layout(runner.specs["experience"])),
                                      len(W.tensor_layout(spec))))
    if floor and "sync_stream" not in summary:
        print()
        print(T.format_floors(floor, floors, summary, OUR_VARIANTS))
    if targets:
        print()
        print(T.format_targets(targets, floor, cfg.nodes))
    if runner.idle:
        print()
        print(R.format_idle(runner.idle, cfg.idle_s, cfg.idle_settle_s))
    print(f"\nwall time {wall:.1f} s (including Ray start-up)")

    result = {
        "schema": 1, "started": stamp, "wall_s": wall, "ok": not (runner.failures or
                                                                 runner.mismatches),
        "config": _config_json(cfg), "env": env,
        "workloads": {w: {"description": W.describe(s), "payload_bytes": runner.payloads[w],
                          "n_tensors": len(W.tensor_layout(s)), "iterations": s.iterations,
                          "skipped": runner.skipped.get(w, {})}
                      for w, s in runner.specs.items()},
        "variants": {n: {**info, "idle_cpu": runner.idle.get(n)}
                     for n, info in runner.variant_info.items()},
        "summary": summary, "samples": runner.samples,
        "floor": {**floor, "weight_sync": floors}, "sync_stream_vs_sync": vs_sync,
        "targets": targets,
        "experience_put_get": experience, "tensor_floor": runner.tensor_floor,
        "failures": runner.failures, "checksum_mismatches": runner.mismatches,
    }
    written = _write_outputs(cfg, result, summary, unavailable, _title(cfg, env, stamp), stamp)
    for path in written:
        print(f"wrote {path}")
    if runner.mismatches:
        print("\nFAILED: checksum mismatch:\n  " + "\n  ".join(runner.mismatches),
              file=sys.stderr)
        return 2
    if runner.failures:
        print("\nFAILED:\n  " + "\n  ".join(runner.failures), file=sys.stderr)
        return 1
    return 0


def _write_outputs(cfg: Config, result: dict[str, Any], summary: dict[str, Any],
                   unavailable: dict[str, str], title: str, stamp: str) -> list[str]:
    written = []
    json_paths = [cfg.json_path] if cfg.json_path else []
    plot_paths = [cfg.plot_path] if cfg.plot_path else []
    if cfg.out_dir:
        os.makedirs(cfg.out_dir, exist_ok=True)
        json_paths.append(os.path.join(cfg.out_dir, f"bench-{stamp}.json"))
        plot_paths.append(os.path.join(cfg.out_dir, f"bench-{stamp}.png"))
    for path in json_paths:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
        written.append(path)
    for path in plot_paths:
        try:
            plot.write_plot(path, summary, cfg.variants, unavailable, title)
            written.append(path)
        except Exception as exc:  # a chart must not hide the measurements
            print(f"warning: plot {path} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    if cfg.out_dir:
        for src, name in ((json_paths[-1], "latest.json"), (plot_paths[-1], "latest.png")):
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(cfg.out_dir, name))
                written.append(os.path.join(cfg.out_dir, name))
    return written



def _receiver_fields(res: dict[str, Any]) -> dict[str, Any]:
    """The fields of a sample that the receiver's result reports, whatever the workload."""
    return {"receiver_checksum_s": res["checksum_s"], "checksum_receiver": res["checksum"],
            "n_tensors_received": res["n_tensors"], "into_targets": res["into_targets"]}

if __name__ == "__main__":
    sys.exit(main())
