"""Physical floor of this machine: what any tensor transport here can at best achieve.

Measures, each on its own:

* ``memcpy``: one thread, ``torch`` ``copy_`` of 256 MiB into a pre-faulted buffer (the
  copy a pool pays on the sender), and into a fresh ``torch.empty`` (what a receiver
  pays when it allocates a new buffer per transfer: 4 KiB page faults included).
* ``memcpy_threads``: ``ctypes.memmove`` (it releases the GIL, as the pack copy does) of
  256, 64 and 4 MiB by one thread against the same bytes split in two halves over two
  threads, into an anonymous mapping whose pages are already faulted (the sender's pool
  in steady state) and into a fresh one (page faults included). The two variants run
  alternately, rep by rep, so load from other processes hits both alike.
* ``nixl_read``: raw NIXL READ between two processes with buffers registered once and
  descriptors built once; only ``initialize_xfer`` + ``transfer`` + ``check_xfer_state``
  polling + ``release_xfer_handle`` is timed. With NIXL's progress thread off (the
  initiator drives progress) and on (what Ray's agent uses). Also a 4 KiB READ latency.
* ``nixl_lanes``: the same READ by one agent against two agents of the initiator process
  (each its own UCX context) reading one half each from two threads, raw (``two agents``)
  and through ``ray_rdt_pool.nixl.backend.NixlBackend(lanes=2)`` (``read lanes``: the split,
  the lane thread and the composite handle included). The variants alternate rep by rep,
  so load from other processes hits them alike.
* ``serializer``: Ray's own per-tensor serialization cost for 10,000 small tensors, in a
  Ray actor: ``ray.put`` without RDT, the RDT placeholder path alone
  (``serialize_rdt_objects``), ``ray.put(_tensor_transport="nixl")`` in full, and the
  plain serializer again after RDT has been used in the process.
* ``ucx``: which UCX protocols and transports a NIXL READ uses here (``UCX_PROTO_INFO``).

Usage: ``python -m ray_rdt_pool.bench.floor [--json PATH] [--mib 256] [--reps 7]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ray_rdt_pool.nixl.ucx import make_agent, timed_reads

_MIB = 1 << 20


def _median_best(values: list[float], higher_is_better: bool = False) -> dict[str, float]:
    """Median and best of samples (best = max for throughputs, min for times)."""
    best = max(values) if higher_is_better else min(values)
    return {"median": statistics.median(values), "best": best, "n": len(values)}


# --------------------------------------------------------------------------- memcpy


def measure_memcpy(nbytes: int, reps: int) -> dict[str, Any]:
    """Single-thread copy_ GB/s into a pre-faulted buffer and into a fresh one."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.randn(nbytes // 4)
        dst = torch.empty_like(src)
        dst.zero_()
        dst.copy_(src)  # warm
        warm: list[float] = []
        fresh: list[float] = []
        for _ in range(reps):
            t = time.perf_counter()
            dst.copy_(src)
            warm.append(nbytes / (time.perf_counter() - t) / 1e9)
        for _ in range(reps):
            t = time.perf_counter()
            new = torch.empty_like(src)
            new.copy_(src)
            fresh.append(nbytes / (time.perf_counter() - t) / 1e9)
            del new
        assert torch.equal(dst, src)
    finally:
        torch.set_num_threads(threads)
    return {"bytes": nbytes, "prefaulted_gbps": _median_best(warm, True),
            "fresh_empty_gbps": _median_best(fresh, True)}


def _copy_gbps(pool: Any, dst: int, src: int, n: int, k: int) -> float:
    """GB/s of one copy of ``n`` bytes: one memmove, or split over ``k`` threads."""
    import ctypes

    t = time.perf_counter()
    if k == 1:
        ctypes.memmove(dst, src, n)
    else:
        _split_copy(pool, dst, src, n, k)
    return n / (time.perf_counter() - t) / 1e9


def _split_copy(pool: Any, dst: int, src: int, n: int, threads: int) -> None:
    """One memmove of ``n`` bytes cut into ``threads`` 64-byte-aligned parts.

    The calling thread copies the first part and ``pool``'s workers the others, the way
    a parallel pack does, so the figure includes waking them and waiting for them.
    """
    import ctypes

    step = (-(-n // threads) + 63) // 64 * 64  # ceil(n / threads), 64-byte aligned
    futures = [pool.submit(ctypes.memmove, dst + o, src + o, min(step, n - o))
               for o in range(step, n, step)]
    ctypes.memmove(dst, src, min(step, n))
    for f in futures:
        f.result()


def measure_memcpy_threads(sizes: list[int], reps: int, threads: int = 2) -> dict[str, Any]:
    """GB/s of one memmove on 1 thread against the same copy split over ``threads``.

    Per size: into an anonymous mapping faulted beforehand (``prefaulted``) and into a
    fresh mapping per rep (``fresh``: the first touch of every 4 KiB page is timed too).
    The source is always faulted. Reps alternate which variant runs first.
    ``*_ratio``: median GB/s with ``threads`` over median GB/s with one.
    """
    import ctypes
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import torch

    out: dict[str, Any] = {"threads": threads, "sizes": {}}
    biggest = max(sizes)
    src = torch.randint(0, 256, (biggest,), dtype=torch.uint8)
    src_addr = src.data_ptr()
    warm_map = mmap.mmap(-1, biggest, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    warm_buf = (ctypes.c_char * biggest).from_buffer(warm_map)
    warm_addr = ctypes.addressof(warm_buf)
    ctypes.memset(warm_addr, 1, biggest)  # fault every destination page
    with ThreadPoolExecutor(max_workers=threads - 1) as pool:
        _split_copy(pool, warm_addr, src_addr, biggest, threads)  # start the workers
        for n in sizes:
            # Small copies are fast: more reps keep the median meaningful.
            n_reps = reps if n >= 16 * _MIB else reps * 10
            samples: dict[str, list[float]] = {
                f"{where}_{k}t": [] for where in ("prefaulted", "fresh") for k in (1, threads)}
            # Pre-faulted reps first, all together: fresh mappings in between would evict
            # the caches a 4 MiB copy otherwise stays in.
            for rep in range(n_reps):
                for k in ((1, threads) if rep % 2 == 0 else (threads, 1)):
                    samples[f"prefaulted_{k}t"].append(
                        _copy_gbps(pool, warm_addr, src_addr, n, k))
            for rep in range(n_reps):
                for k in ((1, threads) if rep % 2 == 0 else (threads, 1)):
                    fresh = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                    buf = (ctypes.c_char * n).from_buffer(fresh)
                    addr = ctypes.addressof(buf)
                    samples[f"fresh_{k}t"].append(_copy_gbps(pool, addr, src_addr, n, k))
                    # Both ends: the first part is the caller's, the last a worker's.
                    ok = all(ctypes.string_at(addr + o, 64) == ctypes.string_at(src_addr + o, 64)
                             for o in (0, n - 64))
                    del buf
                    fresh.close()
                    if not ok:
                        raise AssertionError("threaded memcpy floor copied wrong bytes")
            row: dict[str, Any] = {k: _median_best(v, True) for k, v in samples.items()}
            for where in ("prefaulted", "fresh"):
                row[f"{where}_ratio"] = (row[f"{where}_{threads}t"]["median"]
                                         / row[f"{where}_1t"]["median"])
            out["sizes"][n] = row
    del warm_buf
    warm_map.close()
    return out


# --------------------------------------------------------------------------- NIXL READ


def _read_target(conn: Connection, nbytes: int, prog_thread: bool) -> None:
    """Target process: register one buffer, publish it, then keep the agent alive."""
    import torch

    from ray_rdt_pool.bench.workloads import checksum

    agent = make_agent(f"floor-target-{os.getpid()}", prog_thread)
    buf = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32)
    agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), buf.data_ptr(), nbytes, checksum([buf])))
    # With the progress thread off this loop is what makes progress on the target side.
    while not conn.poll(0.001):
        agent.get_new_notifs()
    conn.recv()


def measure_nixl_read(nbytes: int, reps: int, prog_thread: bool,
                      small_bytes: int = 4096, small_reps: int = 200) -> dict[str, Any]:
    """GB/s of a NIXL READ of ``nbytes`` between two processes, plus small-READ latency."""
    import torch

    from ray_rdt_pool.bench.workloads import checksum

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_read_target, args=(child, nbytes, prog_thread), daemon=True)
    proc.start()
    try:
        agent = make_agent(f"floor-initiator-{os.getpid()}", prog_thread)
        dst = torch.zeros(nbytes // 4, dtype=torch.int32)  # zero_ pre-faults
        agent.register_memory(dst)
        if not parent.poll(60):
            raise TimeoutError("NIXL target process did not start within 60 s")
        meta, addr, n, expected = parent.recv()
        peer = agent.add_remote_agent(meta)
        local = agent.get_xfer_descs([(dst.data_ptr(), n, 0)], "DRAM")
        remote = agent.get_xfer_descs([(addr, n, 0)], "DRAM")
        first = timed_reads(agent, local, remote, peer, 1)[0]
        times = timed_reads(agent, local, remote, peer, reps)
        ok = checksum([dst]) == expected
        small_l = agent.get_xfer_descs([(dst.data_ptr(), small_bytes, 0)], "DRAM")
        small_r = agent.get_xfer_descs([(addr, small_bytes, 0)], "DRAM")
        small = timed_reads(agent, small_l, small_r, peer, small_reps)
        parent.send("stop")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return {
        "bytes": nbytes,
        "prog_thread": prog_thread,
        "first_read_s": first,
        "gbps": _median_best([nbytes / t / 1e9 for t in times], True),
        "small_bytes": small_bytes,
        "small_read_us": _median_best([t * 1e6 for t in small]),
        "checksum_ok": ok,
    }


def _read_halves(pool: Any, agents: list[Any], halves: list[tuple[Any, Any]],
                 peers: list[str]) -> None:
    """One READ cut in two: half 1 on ``pool``'s thread (agent 1), half 0 here (agent 0)."""
    fut = pool.submit(timed_reads, agents[1], *halves[1], peers[1], 1)
    timed_reads(agents[0], *halves[0], peers[0], 1)
    fut.result()


def measure_nixl_lanes(nbytes: int, reps: int) -> dict[str, Any]:
    """GB/s of a READ of ``nbytes`` by one agent vs two agents (halves, two threads).

    One target process (progress thread off, as the transport runs it); in this process
    two raw agents that both register the destination and load the target, and a
    ``NixlBackend`` with two lanes over its own destination. ``*_ratio``: median GB/s
    over the one-agent median. Each READ's destination is zeroed before it and checked
    after it, outside the timing; ``checksum_failed`` names the variants whose bytes
    were wrong.
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from ray_rdt_pool.bench.workloads import checksum
    from ray_rdt_pool.nixl.backend import NixlBackend

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_read_target, args=(child, nbytes, False), daemon=True)
    proc.start()
    backend: NixlBackend | None = None
    try:
        agents = [make_agent(f"floor-lane{k}-{os.getpid()}", False) for k in range(2)]
        dst = torch.zeros(nbytes // 4, dtype=torch.int32)  # zero_ pre-faults
        for a in agents:
            a.register_memory(dst)
        backend = NixlBackend(f"floor-lanes-{os.getpid()}", 0.005, lanes=2,
                              split_bytes=1 << 20)
        dst2 = torch.zeros(nbytes // 4, dtype=torch.int32)
        backend.register(dst2.data_ptr(), nbytes, "DRAM", 0, lanes=True)
        if not parent.poll(60):
            raise TimeoutError("NIXL target process did not start within 60 s")
        meta, addr, n, expected = parent.recv()
        peers = [a.add_remote_agent(meta) for a in agents]
        peer2 = backend.load_remote(meta)
        full = (agents[0].get_xfer_descs([(dst.data_ptr(), n, 0)], "DRAM"),
                agents[0].get_xfer_descs([(addr, n, 0)], "DRAM"))
        h = n // 2
        halves = [(a.get_xfer_descs([(dst.data_ptr() + k * h, h, 0)], "DRAM"),
                   a.get_xfer_descs([(addr + k * h, h, 0)], "DRAM"))
                  for k, a in enumerate(agents)]

        def lanes_read() -> None:
            assert backend is not None
            x = backend.start_read([(dst2.data_ptr(), n, 0)], [(addr, n, 0)], peer2, "DRAM",
                                   "DRAM", split=True)
            while (s := backend.state(x)) == "PROC":
                pass
            backend.release(x)
            if s != "DONE":
                raise RuntimeError(f"split READ ended {s}")

        samples: dict[str, list[float]] = {"one_agent": [], "two_agents": [],
                                           "read_lanes": []}
        # The one-agent and two-agent READs share dst: without zeroing it before each
        # READ, a two-agent path that moves no byte would pass on the one-agent bytes.
        dsts = {"one_agent": dst, "two_agents": dst, "read_lanes": dst2}
        failed: set[str] = set()

        def checked_run(key: str) -> float:
            dsts[key].zero_()
            t = time.perf_counter()
            runs[key]()
            elapsed = time.perf_counter() - t
            if checksum([dsts[key]]) != expected:
                failed.add(key)
            return elapsed

        with ThreadPoolExecutor(max_workers=1) as pool:
            runs: dict[str, Callable[[], Any]] = {
                "one_agent": lambda: timed_reads(agents[0], *full, peers[0], 1),
                "two_agents": lambda: _read_halves(pool, agents, halves, peers),
                "read_lanes": lanes_read,
            }
            for key in runs:  # connect every agent, start the threads
                checked_run(key)
            order = list(runs)
            for rep in range(reps):
                for key in order[rep % 3:] + order[:rep % 3]:
                    samples[key].append(nbytes / checked_run(key) / 1e9)
        parent.send("stop")
    finally:
        if backend is not None:
            backend.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    out: dict[str, Any] = {"bytes": nbytes, "checksum_ok": not failed,
                           "checksum_failed": [k for k in samples if k in failed]}
    for key, values in samples.items():
        out[f"{key}_gbps"] = _median_best(values, True)
    for key in ("two_agents", "read_lanes"):
        out[f"{key}_ratio"] = (out[f"{key}_gbps"]["median"]
                               / out["one_agent_gbps"]["median"])
    return out


# --------------------------------------------------------------------------- serializer


def _serializer_actor_body(count: int, floats: int, reps: int) -> dict[str, Any]:
    """Runs inside a Ray actor (enable_tensor_transport=True): per-tensor serializer costs."""
    import gc

    import ray
    import torch

    from ray_rdt_pool._ray.patches import serialization_context

    ctx = serialization_context()
    separate = [torch.randn(floats) for _ in range(count)]
    weight = torch.randn(count, floats)
    views = [weight[i] for i in range(count)]

    def timed(fn: Callable[[], Any], n: int) -> list[float]:
        out = []
        for _ in range(n):
            gc.collect()
            t = time.perf_counter()
            keep = fn()
            out.append(time.perf_counter() - t)
            del keep
        return out

    def rdt_put(tensors: list[Any]) -> Callable[[], Any]:
        def run() -> Any:
            ref = ray.put(tensors, _tensor_transport="nixl")
            return ref
        return run

    res: dict[str, Any] = {"count": count, "floats_per_tensor": floats}
    # Order matters: the RDT path registers a custom torch.Tensor serializer in this
    # process, which changes the plain path afterwards. Plain first.
    res["serialize_plain"] = timed(lambda: ctx.serialize(separate), reps)
    res["put_plain"] = timed(lambda: ray.put(separate), reps)
    res["serialize_rdt_placeholders"] = timed(
        lambda: ctx.serialize_rdt_objects(separate, "NIXL"), reps)
    res["put_nixl_separate"] = timed(rdt_put(separate), max(1, reps // 2))
    res["put_nixl_views"] = timed(rdt_put(views), max(1, reps // 2))
    res["serialize_plain_after_rdt"] = timed(lambda: ctx.serialize(separate), reps)
    res["put_plain_after_rdt"] = timed(lambda: ray.put(separate), reps)
    return res


def measure_serializer(count: int, floats: int, reps: int) -> dict[str, Any]:
    """Per-tensor cost of Ray's serializer paths (starts a local Ray instance)."""
    import logging

    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING)
    try:
        @ray.remote(num_cpus=0, enable_tensor_transport=True)  # type: ignore[call-overload]
        class SerializerProbe:
            def run(self, count: int, floats: int, reps: int) -> dict[str, Any]:
                return _serializer_actor_body(count, floats, reps)

        actor = SerializerProbe.remote()  # type: ignore[attr-defined]
        raw = ray.get(actor.run.remote(count, floats, reps), timeout=600)
        ray.kill(actor)
    finally:
        if started:
            ray.shutdown()
    out: dict[str, Any] = {"count": raw.pop("count"),
                           "floats_per_tensor": raw.pop("floats_per_tensor")}
    for key, times in raw.items():
        out[key] = {"total_ms": _median_best([t * 1e3 for t in times]),
                    "per_tensor_us": statistics.median(times) / count * 1e6}
    return out


# --------------------------------------------------------------------------- CLI

_SER_LABELS = {
    "serialize_plain": "Ray serializer, no RDT (ctx.serialize)",
    "put_plain": "ray.put, no RDT (serialize + object store)",
    "serialize_rdt_placeholders": "RDT placeholder path only (serialize_rdt_objects)",
    "put_nixl_separate": 'ray.put(_tensor_transport="nixl"), separate tensors',
    "put_nixl_views": 'ray.put(_tensor_transport="nixl"), row views of one weight',
    "serialize_plain_after_rdt": "Ray serializer, no RDT, after RDT used in process",
    "put_plain_after_rdt": "ray.put, no RDT, after RDT used in process",
}


def format_report(res: dict[str, Any]) -> str:
    """The floor as a small two-column table."""
    env = res["env"]
    rows: list[tuple[str, str]] = []
    if "memcpy" in res:
        m = res["memcpy"]
        mib = m["bytes"] // _MIB
        for key, what in (("prefaulted_gbps", "into a pre-faulted buffer"),
                          ("fresh_empty_gbps", "into a fresh torch.empty")):
            rows.append((f"memcpy {mib} MiB, 1 thread, {what}",
                         f"{m[key]['median']:6.2f} GB/s  (best {m[key]['best']:.2f})"))
    if "memcpy_threads" in res:
        mt = res["memcpy_threads"]
        k = mt["threads"]
        for n, row in mt["sizes"].items():
            for where, what in (("prefaulted", "pre-faulted"), ("fresh", "fresh")):
                one, many = row[f"{where}_1t"], row[f"{where}_{k}t"]
                rows.append((f"memcpy x{k} threads {int(n) // _MIB} MiB, {what} (memmove)",
                             f"{many['median']:6.2f} GB/s vs 1 thread {one['median']:6.2f}"
                             f"  = {row[f'{where}_ratio']:.2f}x"))
    for key in ("nixl_read_prog_off", "nixl_read_prog_on"):
        if key in res:
            r = res[key]
            mode = "progress thread on (Ray)" if r["prog_thread"] else "progress thread off"
            ok = "" if r["checksum_ok"] else "  CHECKSUM MISMATCH"
            rows.append((f"NIXL READ {r['bytes'] // _MIB} MiB, 2 processes, {mode}",
                         f"{r['gbps']['median']:6.2f} GB/s  (best {r['gbps']['best']:.2f}){ok}"))
            rows.append((f"NIXL READ {r['small_bytes'] // 1024} KiB latency, {mode}",
                         f"{r['small_read_us']['median']:6.1f} us"))
    if "nixl_lanes" in res:
        r = res["nixl_lanes"]
        # Each row names its own bad bytes: a ratio over a one-agent READ that went
        # wrong is as unusable as a wrong two-lane one.
        bad = set(r.get("checksum_failed", ()))
        one = r["one_agent_gbps"]["median"]
        for key, what in (("two_agents", "two agents, halves on 2 threads"),
                          ("read_lanes", "NixlBackend read lanes=2")):
            wrong = [k for k in ("one_agent", key) if k in bad]
            ok = f"  CHECKSUM MISMATCH ({', '.join(wrong)})" if wrong else ""
            rows.append((f"NIXL READ {r['bytes'] // _MIB} MiB, two lanes: {what}",
                         f"{r[f'{key}_gbps']['median']:6.2f} GB/s vs 1 agent {one:6.2f}"
                         f"  = {r[f'{key}_ratio']:.2f}x{ok}"))
    if "serializer" in res:
        s = res["serializer"]
        rows.append((f"Ray serializer, {s['count']:,} x {s['floats_per_tensor'] * 4} B "
                     "tensors (median)", "total ms, per tensor"))
        for key, label in _SER_LABELS.items():
            if key in s:
                rows.append(("  " + label, f"{s[key]['total_ms']['median']:8.1f} ms, "
                                           f"{s[key]['per_tensor_us']:6.1f} us"))
    if "ucx" in res:
        u = res["ucx"]
        rows.append((f"UCX {u['ucx_version']} (UCX_TLS={u['UCX_TLS'] or 'unset'}), NIXL READ",
                     "; ".join(u["read_protocols"]) or "n/a"))
        rows.append(("UCX control messages", ", ".join(u["am_transports"]) or "n/a"))
    width = max(len(r[0]) for r in rows) + 2 if rows else 0
    head = (f"Physical floor: {env['cpu_model']}, {env['cores']} cores; load average "
            f"{env['loadavg_start']} at start, {env.get('loadavg_end')} at end")
    return "\n".join([head] + [f"  {a:<{width}}{b}" for a, b in rows])


def _env() -> dict[str, Any]:
    from ray_rdt_pool.bench.env import cpu_model, loadavg

    return {"cores": os.cpu_count(), "cpu_model": cpu_model(), "loadavg_start": loadavg()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ray_rdt_pool.bench.floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="bytes for memcpy and READ (MiB)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--small-count", type=int, default=10_000, help="tensors for serializer")
    p.add_argument("--small-floats", type=int, default=256, help="float32 per small tensor")
    p.add_argument("--skip", default="", help="comma list of: memcpy,nixl,serializer,ucx")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    args = p.parse_args(argv)
    from ray_rdt_pool.nixl.ucx import probe_ucx

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    nbytes = args.mib * _MIB
    res: dict[str, Any] = {"env": _env(), "config": vars(args)}
    if "memcpy" not in skip:
        res["memcpy"] = measure_memcpy(nbytes, args.reps)
        res["memcpy_threads"] = measure_memcpy_threads(
            sorted({nbytes, 64 * _MIB, 4 * _MIB}, reverse=True), args.reps)
    if "nixl" not in skip:
        res["nixl_read_prog_off"] = measure_nixl_read(nbytes, args.reps, prog_thread=False)
        res["nixl_read_prog_on"] = measure_nixl_read(nbytes, args.reps, prog_thread=True)
        res["nixl_lanes"] = measure_nixl_lanes(nbytes, args.reps)
    if "serializer" not in skip:
        res["serializer"] = measure_serializer(args.small_count, args.small_floats,
                                               max(3, args.reps // 2))
    if "ucx" not in skip:
        res["ucx"] = probe_ucx()
    from ray_rdt_pool.bench.env import loadavg

    res["env"]["loadavg_end"] = loadavg()
    print(format_report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {args.json}")
    failed = [k for k, v in res.items() if isinstance(v, dict) and v.get("checksum_ok") is False]
    if failed:
        print(f"FAIL: checksum mismatch in {', '.join(failed)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
