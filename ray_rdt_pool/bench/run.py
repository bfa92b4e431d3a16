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
target of the topology (:data:`~ray_rdt_pool.bench.speedup_targets.TARGETS`), whether ours
met it, and the least ours could reach in this run: its time outside ``ray_rdt_pool``
plus the payload at those two rates (see
:func:`~ray_rdt_pool.bench.speedup_targets.target_floors`).

``experience`` and ``experience_samples`` send one RL batch (batched: a tensor per
field; per sample: a tensor per (sample, field)); the report compares their put+get.
The ``transferqueue`` variant (package ``transferqueue``, the ``bench`` extra) moves
them with TransferQueue's own KV API: ``kv_batch_put`` in the sender, ``kv_batch_get``
in the receiver (``put``, ``fetch``), ``kv_clear`` after the checksum (``release``).
Without the package it is reported as not available, and the rest runs.

The options are in :mod:`~ray_rdt_pool.bench.options`, the measuring loop in
:mod:`~ray_rdt_pool.bench.runner`, progress lines and CPU counts in
:mod:`~ray_rdt_pool.bench.progress`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ray_rdt_pool.bench import env as E
from ray_rdt_pool.bench import plot
from ray_rdt_pool.bench import report as R
from ray_rdt_pool.bench import speedup_targets as T
from ray_rdt_pool.bench import workloads as W
from ray_rdt_pool.bench.options import MIB, BenchError, Config, parse_config
from ray_rdt_pool.bench.progress import Progress
from ray_rdt_pool.bench.runner import Runner
from ray_rdt_pool.bench.variants import (
    OTHER_VARIANTS,
    OUR_VARIANTS,
    RAY_VARIANTS,
    TQ_ACTOR_CPUS,
)

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
    floors (:func:`~ray_rdt_pool.bench.speedup_targets.target_floors`): the sender's own pack
    (its threads and streaming stores, ``pack_gbps``) and a READ split over two read
    lanes (``read_lanes_gbps``). Failures are recorded, never raised: the floor is
    context, not a result.
    """
    from ray_rdt_pool.bench import floor as F
    from ray_rdt_pool.bench import pack_threads as bench_pack

    sync = [w for w in W.SYNC_WORKLOADS if w in runner.payloads]
    size = runner.payloads[sync[0]] if sync else max(runner.payloads.values(), default=0)
    nbytes = min(size, 256 * MIB) // MIB * MIB or MIB
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
    rate("fp8_pack_gbps", lambda: float(
        bench_pack.measure_fp8_pack_gbps(min(nbytes, 64 * MIB), reps)["fp8_gbps"]))
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


if __name__ == "__main__":
    sys.exit(main())
