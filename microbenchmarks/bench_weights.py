"""Weight-sync benchmark: ray_rdt_pool.weights against the best way on Ray's built-in nixl.

One trainer actor holds a transformer-shaped weight set (bf16 matrices, fp32 norms and
biases; about 500 MiB and 200 tensors at the full size, about 64 MiB with --quick) and
syncs it to two receiver actors ``--syncs`` times. Variants, each run alone (the previous
variant's actors are killed first: idle NIXL agents burn CPU on a small machine):

* ``pool-stream``: :func:`ray_rdt_pool.weights.sync`, streaming, ``max_inflight=2``
  (packing bucket k+1 overlaps the receivers' reads of bucket k); the sender pool holds
  two buckets only, far less than the model.
* ``pool-stream-packed``: the same with ``WeightSender(source_reads=False)``: every
  bucket is packed into the pool (a snapshot) and read from there, as for a lazy source.
  ``pool-stream`` instead reads the trainer's tensors in place on one node and by
  reference across nodes (no pack).
* ``pool-stream-serial``: the same as ``pool-stream`` with ``max_inflight=1``
  (pipelining off).
* ``pool-publish``: every bucket put at once, then both receivers load the manifest;
  the pool holds the whole model.
* ``ray-nixl``: Ray's own ``nixl`` transport, the best way we know: per sync the
  trainer ``ray.put``\\ s its tensors with ``_tensor_transport="nixl"`` (registered by
  reference, no copy) and each receiver ``set_target_for_ref``\\ s its own parameters and
  ``ray.get``\\ s. Ray's memory pool is not used in this variant (peak pool: n/a).

Receivers land the bytes directly in their parameters in every variant. Between syncs
the trainer changes every tensor a little; after the last sync the receivers' checksums
must equal the trainer's. Reported per variant: cold (first) and warm (median of the
rest) seconds per sync, GB/s of the weight set at the warm median, the sender's peak
pool bytes, and the ratio against ``ray-nixl``.

Run: python -m microbenchmarks.bench_weights [--quick] [--json PATH]

``--suite engine`` instead syncs a Hugging Face ``LlamaForCausalLM`` (built from a config,
~100M parameters, 384 MiB fp32 at ``--hf-size full``) from an fp32 trainer into two
engine-like receivers, each variant alone:

* ``anchor-ray-nixl``: Ray's WeightSyncManager pattern on Ray's ``nixl``: the trainer puts
  its state dict as dicts of at most 64 MiB (``ray.put(..., _tensor_transport="nixl")``),
  each receiver ``ray.get``\\ s them all, then ``load_state_dict``.
* ``pool-stream``: ``sync(mode="stream")`` into ``WeightReceiver(load_weights=...)`` (a
  name -> parameter ``copy_``, through the receive arena); the full-pull baseline.
* ``pool-stream-tp2``: two TP ranks, ``select`` = each rank's dim-0 half of every 2-D
  tensor, loaded into rank-sized tensors.
* ``wire-fp32-to-bf16`` / ``wire-bf16-to-bf16``: bf16 receivers, fp32 or bf16 on the wire
  (``WeightSender(wire_dtype=torch.bfloat16)``).

It prints per variant the warm median sync time, the receive-side seconds per rank
(``LoadReport.seconds``), the bytes read per rank (``stats().bytes_received``), each
receiver's peak extra RSS (VmHWM reset through /proc/self/clear_refs, and a 2 ms
/proc/self/statm sampler), then the issue's target ratios measured in the same run.
``--nodes 2`` puts the receivers on a second Ray node (ray.cluster_utils.Cluster).

    python -m microbenchmarks.bench_weights --suite engine [--nodes 2] [--syncs 11]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from typing import Any

import ray
import torch

import ray_rdt_pool
from ray_rdt_pool.weights import WeightReceiver, WeightSender, sync

VARIANTS = ("pool-stream", "pool-stream-packed", "pool-stream-serial", "pool-publish",
            "ray-nixl")
MIB = 1 << 20

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


def weight_layout(hidden: int, layers: int, vocab: int) -> Layout:
    """A decoder's weights: per layer 6 bf16 matrices and 4 fp32 vectors, plus embedding
    (bf16) and final norm (fp32)."""
    d, f = hidden, 4 * hidden
    bf, fp = torch.bfloat16, torch.float32
    out: Layout = [("embed", (vocab, d), bf)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "attn_norm", (d,), fp), (p + "q", (d, d), bf), (p + "k", (d, d), bf),
                (p + "v", (d, d), bf), (p + "o", (d, d), bf), (p + "mlp_norm", (d,), fp),
                (p + "up", (f, d), bf), (p + "up_bias", (f,), fp), (p + "down", (d, f), bf),
                (p + "down_bias", (d,), fp)]
    out.append(("final_norm", (d,), fp))
    return out


def layout_bytes(layout: Layout) -> int:
    return sum(torch.Size(s).numel() * torch.empty(0, dtype=dt).element_size()
               for _n, s, dt in layout)


def build(layout: Layout, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g, dtype=torch.float32).to(dt) for n, s, dt in layout}


@ray.remote(enable_tensor_transport=True, num_cpus=0)
class Node:
    """A trainer or a receiver; one process each."""

    def __init__(self, layout: Layout, seed: int, pool_bytes: int, bucket_bytes: int,
                 source_reads: bool = True) -> None:
        ray_rdt_pool.register()
        ray_rdt_pool.configure(pool_bytes=pool_bytes, arena_bytes=64 * MIB)
        torch.set_num_threads(1)
        self.state = build(layout, seed)
        self.tensors = list(self.state.values())
        self.weight_sender = WeightSender(self.state, bucket_bytes=bucket_bytes,
                                          source_reads=source_reads)
        self.weight_receiver = WeightReceiver(self.state)

    def ready(self) -> int:
        return os.getpid()

    def step(self) -> None:
        """A cheap stand-in for an optimizer step: every tensor changes in place."""
        with torch.no_grad():
            for t in self.tensors:
                t.view(-1)[:64].add_(1)

    def checksum(self) -> list[float]:
        return [float(t.view(-1)[:4096].float().sum()) + float(t.view(-1)[-1])
                for t in self.tensors]

    def stats(self) -> dict[str, Any]:
        return ray_rdt_pool.stats().as_dict()

    # -- Ray's nixl baseline --

    def nixl_put(self) -> list[Any]:
        return [ray.put(self.tensors, _tensor_transport="nixl")]

    def nixl_load(self, box: list[Any]) -> None:
        ray.experimental.set_target_for_ref(box[0], self.tensors)
        got = ray.get(box[0])
        assert all(g.data_ptr() == t.data_ptr() for g, t in zip(got, self.tensors))


def _teardown(actors: list[Any], settle_s: float) -> None:
    """Kill a variant's actors and let their memory go before the next variant starts."""
    import ray

    for a in actors:
        ray.kill(a)
    gc.collect()
    time.sleep(settle_s)


def run_variant(name: str, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    total = layout_bytes(layout)
    bucket = args.bucket_mib * MIB
    pool = {"pool-publish": total + 64 * MIB, "ray-nixl": 64 * MIB}.get(name, 2 * bucket)
    trainer = _placed(Node, args, "trainer").remote(layout, 0, pool, bucket,
                                                    source_reads=name != "pool-stream-packed")
    receivers = [_placed(Node, args, "receiver").remote(layout, 100 + i, pool, bucket)
                 for i in range(args.receivers)]
    actors = [trainer, *receivers]
    ray.get([a.ready.remote() for a in actors])
    times: list[float] = []
    peak = 0
    waits: list[float] = []
    by_ref: list[int] = []  # per stream: buckets READ by reference (no pack)
    in_place: list[int] = []  # per stream: buckets read in place (same node)
    direct = True
    try:
        for _ in range(args.syncs):
            ray.get(trainer.step.remote())
            t0 = time.perf_counter()
            if name == "ray-nixl":
                box = ray.get(trainer.nixl_put.remote())
                ray.get([r.nixl_load.remote(box) for r in receivers])
                del box
            else:
                mode = "publish" if name == "pool-publish" else "stream"
                rep = sync(trainer, receivers, mode=mode,
                           max_inflight=1 if name == "pool-stream-serial" else 2)
                peak = max(peak, rep.sender_pool_used)
                direct = direct and all(ld.direct_buckets == ld.buckets for ld in rep.loads)
                if rep.stream is not None:
                    waits.append(rep.stream.pool_wait_seconds)
                    by_ref.append(rep.stream.reference_buckets)
                    in_place.append(rep.stream.source_read_buckets)
                    assert rep.stream.fallbacks == 0, rep.stream
            times.append(time.perf_counter() - t0)
        want = ray.get(trainer.checksum.remote())
        ok = all(ray.get(r.checksum.remote()) == want for r in receivers)
        st = ray.get(trainer.stats.remote())
    finally:
        _teardown(actors, args.settle)
        del actors, trainer, receivers
    warm = times[1:] or times
    med = statistics.median(warm)
    return {
        "variant": name, "bytes": total, "tensors": len(layout), "syncs": len(times),
        "cold_s": times[0], "warm_median_s": med, "warm_min_s": min(warm),
        "warm_max_s": max(warm), "gbps": total / med / 1e9,
        "peak_pool_bytes": None if name == "ray-nixl" else peak,
        "pool_capacity": None if name == "ray-nixl" else st["pool_capacity"],
        "fallbacks": st["fallbacks"], "direct": direct if name != "ray-nixl" else True,
        "pool_wait_median_s": statistics.median(waits) if waits else None,
        "checksums_ok": ok, "times_s": times, "reference_buckets": by_ref,
        "source_read_buckets": in_place, "loadavg_after": list(os.getloadavg()),
    }


# ---------------------------------------------------------------------------------------
# --suite engine: a Hugging Face Llama into inference-engine-like receivers
# ---------------------------------------------------------------------------------------

#: Hugging Face Llama shapes (random init from a config, no download). ``full`` has
#: ~100M parameters, ~400 MB fp32.
HF_SIZES = {
    "full": dict(vocab_size=16384, hidden_size=768, intermediate_size=2048,
                 num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
    "medium": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                   num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
    "small": dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}
ENGINE_VARIANTS = ("anchor-ray-nixl", "pool-stream", "pool-stream-tp2", "wire-fp32-to-bf16",
                   "wire-bf16-to-bf16")
#: Ray's WeightSyncManager pattern chunks the state dict into dicts of this many bytes.
ANCHOR_CHUNK = 64 * MIB


def _hf_model(shape: dict[str, int], seed: int, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, max_position_embeddings=256, tie_word_embeddings=False,
                      attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def tp_select(rank: int, tp: int) -> Any:
    """Each rank takes its dim-0 share of every 2-D tensor; 1-D tensors whole."""
    def select(name: str, shape: tuple[int, ...]) -> Any:
        if len(shape) != 2:
            return None
        n = shape[0] // tp
        return (slice(rank * n, (rank + 1) * n),)
    return select


class _MemWatch:
    """Peak RSS of this process during one sync: VmHWM reset through
    /proc/self/clear_refs (the kernel's own peak, exact), or, where that reset is refused,
    a thread reading /proc/self/statm every 2 ms. Only one of them: the polling thread
    costs the receiver about a tenth of a core and the GIL every 2 ms, which would slow
    the very sync it watches."""

    def __init__(self) -> None:
        import threading

        self.threading = threading
        self.base0 = _rss()  # before any sync: model built, transport not yet used
        self.thread: Any = None

    def begin(self) -> None:
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_ok = True
        except OSError:
            self.hwm_ok = False
        self.before = _rss()
        self.peak = self.before
        self.stop = self.threading.Event()
        self.thread = None
        if self.hwm_ok:
            return

        def run() -> None:
            while not self.stop.is_set():
                self.peak = max(self.peak, _rss())
                time.sleep(0.002)
        self.thread = self.threading.Thread(target=run, daemon=True)
        self.thread.start()

    def end(self) -> dict[str, int]:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        peak = max(self.peak, _hwm() if self.hwm_ok else 0, _rss())
        return {"before": self.before, "peak": peak, "base0": self.base0,
                "sampled_peak": self.peak}


@ray.remote(enable_tensor_transport=True, num_cpus=0)
class HFNode:
    """The trainer (fp32 Llama) or an inference receiver, one process each.

    Receiver kinds: ``model`` (the full Llama in ``dtype``; our receiver goes through
    ``load_weights``, a name -> parameter ``copy_``, as an engine's loader does), or
    ``tp`` (rank ``rank`` of 2: a dict of dim-0 halves of the 2-D weights, loaded by
    ``load_weights`` from a ``select``-ed pull).
    """

    def __init__(self, shape: dict[str, int], seed: int, pool_bytes: int, arena_bytes: int,
                 bucket_bytes: int, kind: str = "model", dtype: str = "float32",
                 rank: int = 0, wire: str | None = None) -> None:
        ray_rdt_pool.register()
        ray_rdt_pool.configure(pool_bytes=pool_bytes, arena_bytes=arena_bytes)
        torch.set_num_threads(1)
        dt = getattr(torch, dtype)
        self.model = _hf_model(shape, seed, dt)
        self.params = dict(self.model.named_parameters())
        self.kind = kind
        if kind == "trainer":
            wd = getattr(torch, wire) if wire else None
            self.weight_sender = WeightSender(self.model, bucket_bytes=bucket_bytes,
                                              wire_dtype=wd)
        elif kind == "tp":
            sel = tp_select(rank, 2)
            self.shards = {}
            for n, p in self.params.items():
                s = sel(n, tuple(p.shape))
                self.shards[n] = (p.detach()[s[0]] if s else p.detach()).clone()
            del self.model, self.params
            gc.collect()
            self.weight_receiver = WeightReceiver(load_weights=self._load_shards, select=sel)
        else:
            self.weight_receiver = WeightReceiver(load_weights=self._load_model)
        self.mem = _MemWatch()

    @torch.no_grad()
    def _load_model(self, pairs: Any) -> None:
        for n, t in pairs:
            self.params[n].copy_(t)

    @torch.no_grad()
    def _load_shards(self, pairs: Any) -> None:
        for n, t in pairs:
            self.shards[n].copy_(t)

    def ready(self) -> int:
        return os.getpid()

    def nbytes(self) -> tuple[int, int]:
        return (sum(p.numel() * p.element_size() for p in self.model.parameters()),
                sum(p.numel() for p in self.model.parameters()))

    @torch.no_grad()
    def step(self) -> None:
        for p in self.model.parameters():
            p.view(-1)[:64].add_(1e-3)

    def checksum(self, dtype: str = "float32", rank: int | None = None) -> list[float]:
        dt = getattr(torch, dtype)
        out = []
        if self.kind == "tp" or rank is not None:
            src = self.shards if self.kind == "tp" else {
                n: (p.detach()[tp_select(rank, 2)(n, tuple(p.shape))[0]]
                    if p.dim() == 2 else p.detach()) for n, p in self.params.items()}
        else:
            src = {n: p.detach() for n, p in self.params.items()}
        for n in sorted(src):
            out.append(float(src[n].to(dt).float().sum()))
        return out

    def bytes_received(self) -> int:
        return int(ray_rdt_pool.stats().bytes_received)

    def mem_begin(self) -> None:
        self.mem.begin()

    def mem_end(self) -> dict[str, int]:
        return self.mem.end()

    # -- the anchor: Ray's WeightSyncManager pattern on Ray's nixl --

    def anchor_put(self) -> list[Any]:
        """Split the state dict into ~64 MiB dicts and put each on Ray's nixl."""
        refs, cur, size = [], {}, 0
        for n, t in self.model.state_dict().items():
            if cur and size + t.nbytes > ANCHOR_CHUNK:
                refs.append(ray.put(cur, _tensor_transport="nixl"))
                cur, size = {}, 0
            cur[n] = t
            size += t.nbytes
        if cur:
            refs.append(ray.put(cur, _tensor_transport="nixl"))
        return [refs]

    def anchor_load(self, box: list[Any]) -> float:
        """Get every chunk, then load_state_dict; returns the receive-side seconds."""
        t0 = time.perf_counter()
        sd: dict[str, torch.Tensor] = {}
        for r in box[0]:
            sd.update(ray.get(r))
        self.model.load_state_dict(sd)
        del sd
        return time.perf_counter() - t0


def run_engine_variant(name: str, shape: dict[str, int], args: argparse.Namespace,
                       version0: int) -> dict[str, Any]:
    bucket = args.bucket_mib * MIB
    pool = 64 * MIB if name == "anchor-ray-nixl" else 2 * bucket
    arena = args.arena_mib * MIB
    wire = "bfloat16" if name == "wire-bf16-to-bf16" else None
    rdt = "bfloat16" if name.startswith("wire-") else "float32"
    # --nodes 2: the trainer on the head node, the receivers on a second Ray node.
    tr, rc = _placed(HFNode, args, "trainer"), _placed(HFNode, args, "receiver")
    trainer = tr.remote(shape, 0, pool, arena, bucket, kind="trainer", wire=wire)
    if name == "pool-stream-tp2":
        receivers = [rc.remote(shape, 100 + i, pool, arena, bucket, kind="tp", rank=i)
                     for i in range(2)]
    else:
        receivers = [rc.remote(shape, 100 + i, pool, arena, bucket, kind="model",
                                   dtype=rdt) for i in range(args.receivers)]
    actors = [trainer, *receivers]
    ray.get([a.ready.remote() for a in actors])
    nbytes, nparams = ray.get(trainer.nbytes.remote())
    times: list[float] = []
    recv_s: list[list[float]] = []
    got: list[list[int]] = []
    mems: list[list[dict[str, int]]] = []
    buckets = 0
    try:
        for k in range(args.syncs):
            ray.get(trainer.step.remote())
            before = ray.get([r.bytes_received.remote() for r in receivers])
            ray.get([r.mem_begin.remote() for r in receivers])
            t0 = time.perf_counter()
            if name == "anchor-ray-nixl":
                box = ray.get(trainer.anchor_put.remote())
                rs = ray.get([r.anchor_load.remote(box) for r in receivers])
                buckets = len(box[0])
                del box
            else:
                rep = sync(trainer, receivers, mode="stream", max_inflight=2,
                           version=version0 + k)
                rs = [ld.seconds for ld in rep.loads]
                buckets = rep.buckets
                assert rep.stream is not None and rep.stream.fallbacks == 0, rep.stream
            times.append(time.perf_counter() - t0)
            mems.append(ray.get([r.mem_end.remote() for r in receivers]))
            after = ray.get([r.bytes_received.remote() for r in receivers])
            recv_s.append(rs)
            got.append([a - b for a, b in zip(after, before)])
        if name == "pool-stream-tp2":
            ok = all(ray.get(r.checksum.remote()) == ray.get(trainer.checksum.remote(rank=i))
                     for i, r in enumerate(receivers))
        else:
            want = ray.get(trainer.checksum.remote(rdt))
            ok = all(ray.get(r.checksum.remote(rdt)) == want for r in receivers)
    finally:
        _teardown(actors, args.settle)
        del actors, trainer, receivers
    warm = slice(1, None) if len(times) > 1 else slice(None)
    wt, wr, wm = times[warm], recv_s[warm], mems[warm]
    nrec = len(wr[0])
    # Peak extra memory per receiver: max over warm syncs of (peak RSS during the sync -
    # RSS just before it), and of (peak - RSS before the first sync, i.e. counting what the
    # transport keeps between syncs: arena, registrations, allocator caches).
    extra = [max(m[i]["peak"] - m[i]["before"] for m in wm) for i in range(nrec)]
    extra0 = [max(m[i]["peak"] - m[i]["base0"] for m in mems) for i in range(nrec)]
    return {
        "variant": name, "suite": "engine", "bytes": nbytes, "params": nparams,
        "syncs": len(times), "warm_syncs": len(wt), "buckets": buckets,
        "cold_s": times[0], "warm_median_s": statistics.median(wt), "warm_min_s": min(wt),
        "warm_max_s": max(wt),
        "recv_median_s": [statistics.median(r[i] for r in wr) for i in range(nrec)],
        "bytes_received": got[-1], "peak_extra_bytes": extra, "peak_extra_vs_base0": extra0,
        "checksums_ok": ok, "times_s": times, "recv_s": recv_s, "mem": mems,
        "loadavg_after": list(os.getloadavg()),
    }


def _ratio_line(label: str, num: float, den: float, target: str, ok: bool | None) -> str:
    r = num / den if den else float("nan")
    verdict = "" if ok is None else ("MET" if ok else "MISSED")
    return f"{label:58s} {r:6.2f}   {target:14s} {verdict}"


def engine_suite(args: argparse.Namespace, command: str) -> int:
    shape = HF_SIZES[args.hf_size]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] \
        if args.variants_given else list(ENGINE_VARIANTS)
    unknown = sorted(set(variants) - set(ENGINE_VARIANTS))
    if unknown:
        raise SystemExit(f"unknown engine variants {unknown}; choose from {ENGINE_VARIANTS}")
    print(f"engine suite: LlamaForCausalLM {args.hf_size} {shape}; {args.nodes} Ray "
          f"node(s); {args.receivers} "
          f"receivers, {args.syncs} syncs (1 cold + {args.syncs - 1} warm), buckets/chunks of "
          f"{args.bucket_mib} MiB, receiver arena {args.arena_mib} MiB; {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    ray_rdt_pool.register()
    cluster = _start_ray(args)
    results = []
    try:
        for i, v in enumerate(variants):
            r = run_engine_variant(v, shape, args, version0=1 + i * 1000)
            results.append(r)
            print(f"  {v:20s} cold {r['cold_s'] * 1e3:8.1f} ms  warm median "
                  f"{r['warm_median_s'] * 1e3:8.1f} ms  load {r['loadavg_after'][0]:.1f}  "
                  f"ok={r['checksums_ok']}", flush=True)
    finally:
        _stop_ray(cluster)
    if results:
        print(f"\nmodel: {results[0]['params'] / 1e6:.1f}M params, "
              f"{results[0]['bytes'] / MIB:.1f} MiB fp32")
    print(f"{'variant':20s} {'cold s':>7s} {'warm med s':>10s} {'min s':>6s} {'max s':>6s} "
          f"{'recv s/rank':>13s} {'MiB recv/rank':>15s} {'peak extra MiB/rank':>20s} "
          f"{'vs base0':>11s} {'bkts':>4s}")
    for r in results:
        got = "n/a (Ray)" if r["variant"] == "anchor-ray-nixl" else \
            "/".join(f"{b / MIB:.0f}" for b in r["bytes_received"])
        print(f"{r['variant']:20s} {r['cold_s']:7.2f} {r['warm_median_s']:10.3f} "
              f"{r['warm_min_s']:6.3f} {r['warm_max_s']:6.3f} "
              f"{'/'.join(f'{x:.3f}' for x in r['recv_median_s']):>13s} "
              f"{got:>15s} "
              f"{'/'.join(f'{b / MIB:.0f}' for b in r['peak_extra_bytes']):>20s} "
              f"{'/'.join(f'{b / MIB:.0f}' for b in r['peak_extra_vs_base0']):>11s} "
              f"{r['buckets']:4d}")
    by = {r["variant"]: r for r in results}
    lines = []
    a, s = by.get("anchor-ray-nixl"), by.get("pool-stream")
    if a and s:
        sp = a["warm_median_s"] / s["warm_median_s"]
        lines.append(_ratio_line("anchor: ray-nixl time / pool-stream time (speedup)",
                                 a["warm_median_s"], s["warm_median_s"], ">= 2.0", sp >= 2))
        me, ma = max(s["peak_extra_bytes"]), max(a["peak_extra_bytes"])
        lines.append(_ratio_line("anchor: pool-stream / ray-nixl peak extra receiver mem",
                                 me, ma, "<= 0.5", me <= 0.5 * ma))
        me0, ma0 = max(s["peak_extra_vs_base0"]), max(a["peak_extra_vs_base0"])
        lines.append(_ratio_line("  same, counting memory kept between syncs (vs base0)",
                                 me0, ma0, "<= 0.5", me0 <= 0.5 * ma0))
    t = by.get("pool-stream-tp2")
    if t and s:
        lines.append(_ratio_line("tp2: bytes received per rank / full pull",
                                 max(t["bytes_received"]), max(s["bytes_received"]),
                                 "~0.5", None))
        rt, rs = max(t["recv_median_s"]), max(s["recv_median_s"])
        lines.append(_ratio_line("tp2: receive-side s per rank (READ+load) / full pull",
                                 rt, rs, "<= 0.6", rt <= 0.6 * rs))
        lines.append(_ratio_line("tp2: whole-sync s / full pull", t["warm_median_s"],
                                 s["warm_median_s"], "<= 0.8",
                                 t["warm_median_s"] <= 0.8 * s["warm_median_s"]))
    w32, w16 = by.get("wire-fp32-to-bf16"), by.get("wire-bf16-to-bf16")
    if w32 and w16:
        lines.append(_ratio_line("wire: bf16 / fp32 bytes received per receiver",
                                 max(w16["bytes_received"]), max(w32["bytes_received"]),
                                 "~0.5", None))
        lines.append(_ratio_line("wire: bf16 / fp32 on the wire, whole-sync s",
                                 w16["warm_median_s"], w32["warm_median_s"], "<= 0.75",
                                 w16["warm_median_s"] <= 0.75 * w32["warm_median_s"]))
    if lines:
        print(f"\n{'ratio (same run, warm medians)':58s} {'value':>6s}   {'target':14s} verdict")
        print("\n".join(lines))
    bad = [r["variant"] for r in results if not r["checksums_ok"]]
    if bad:
        print(f"CHECKSUM MISMATCH in {bad}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "suite": "engine", "shape": shape,
                       "cpus": os.cpu_count(), "torch": torch.__version__,
                       "ray": ray.__version__, "args": vars(args), "results": results,
                       "ratios": lines}, f, indent=2)
        print(f"wrote {args.json}")
    return 1 if bad else 0


def _start_ray(args: argparse.Namespace) -> Any:
    """One local Ray node, or (``--nodes 2``) two Ray nodes on this machine as
    tests/test_multinode.py makes them: separate raylets and object stores, so NIXL moves
    the bytes. The trainer's node has the resource ``trainer``, the receivers' node
    ``receiver``. Returns the Cluster to shut down (None for one node)."""
    if args.nodes != 2:
        ray.init(address="local", include_dashboard=False, logging_level="warning",
                 log_to_driver=False)
        return None
    from pathlib import Path

    from ray.cluster_utils import Cluster

    current = Path("/tmp/ray/ray_current_cluster")
    previous = current.read_bytes() if current.exists() else None
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"trainer": 1}, "include_dashboard": False})
    # Cluster records its address there; put it back so no other process joins ours.
    if previous is None:
        current.unlink(missing_ok=True)
    else:
        current.write_bytes(previous)
    cluster.add_node(num_cpus=2, resources={"receiver": args.receivers})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    return cluster


def _stop_ray(cluster: Any) -> None:
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()


def _placed(cls: Any, args: argparse.Namespace, role: str) -> Any:
    """``cls`` on the trainer's or the receivers' node with ``--nodes 2``."""
    return cls.options(resources={role: 1}) if args.nodes == 2 else cls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="weight sync: nixl_pool vs Ray's nixl")
    p.add_argument("--quick", action="store_true", help="about 64 MiB instead of 500 MiB")
    p.add_argument("--hidden", type=int, help="hidden size (default 1024, quick 512)")
    p.add_argument("--layers", type=int, help="layers (default 20, quick 10)")
    p.add_argument("--vocab", type=int, help="vocabulary (default 8192, quick 4096)")
    p.add_argument("--bucket-mib", type=int, help="bucket size in MiB (default 64, quick 8)")
    p.add_argument("--syncs", type=int, help="syncs per variant (default 10, engine 6)")
    p.add_argument("--suite", choices=("basic", "engine"), default="basic",
                   help="engine: a Hugging Face Llama into engine-like receivers: the anchor "
                        "(Ray's WeightSyncManager pattern on Ray's nixl), TP=2 select, bf16 "
                        f"on the wire; variants {','.join(ENGINE_VARIANTS)}")
    p.add_argument("--hf-size", choices=tuple(HF_SIZES), default="full",
                   help="engine suite: Llama size (full ~100M params / ~400 MB fp32)")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="2 puts the receivers on a second Ray node "
                        "(ray.cluster_utils.Cluster on this machine)")
    p.add_argument("--arena-mib", type=int, default=64,
                   help="engine suite: receivers' receive arena in MiB (default 64)")
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds to wait after killing a variant's actors")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    args.variants_given = any(a.startswith("--variants")
                              for a in (sys.argv[1:] if argv is None else argv))
    args.syncs = args.syncs or (6 if args.suite == "engine" else 10)
    q = args.quick
    args.hidden = args.hidden or (512 if q else 1024)
    args.layers = args.layers or (10 if q else 20)
    args.vocab = args.vocab or (4096 if q else 8192)
    args.bucket_mib = args.bucket_mib or (8 if q else 64)
    command = shlex.join([sys.executable, "-m", "microbenchmarks.bench_weights",
                          *(sys.argv[1:] if argv is None else argv)])
    if args.suite == "engine":
        print(f"command: {command}")
        return engine_suite(args, command)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {VARIANTS}")

    layout = weight_layout(args.hidden, args.layers, args.vocab)
    total = layout_bytes(layout)
    command = shlex.join([sys.executable, "-m", "microbenchmarks.bench_weights",
                          *(sys.argv[1:] if argv is None else argv)])
    print(f"command: {command}")
    print(f"weight set: {len(layout)} tensors, {total / MIB:.1f} MiB; {args.receivers} "
          f"receivers, {args.syncs} syncs, buckets of {args.bucket_mib} MiB; {args.nodes} "
          f"Ray node(s); {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    ray_rdt_pool.register()
    cluster = _start_ray(args)
    results = []
    try:
        for v in variants:
            r = run_variant(v, layout, args)
            results.append(r)
            print(f"  {v:19s} cold {r['cold_s'] * 1e3:8.1f} ms  warm median "
                  f"{r['warm_median_s'] * 1e3:8.1f} ms  ok={r['checksums_ok']}", flush=True)
    finally:
        _stop_ray(cluster)

    base = next((r for r in results if r["variant"] == "ray-nixl"), None)
    print()
    print(f"{'variant':19s} {'cold s':>8s} {'warm med s':>10s} {'min s':>7s} {'GB/s':>6s} "
          f"{'peak pool':>12s} {'vs ray-nixl':>11s}")
    for r in results:
        ratio = base["warm_median_s"] / r["warm_median_s"] if base else None
        r["speedup_vs_ray_nixl"] = ratio
        peak = "n/a" if r["peak_pool_bytes"] is None else f"{r['peak_pool_bytes'] / MIB:.0f} MiB"
        print(f"{r['variant']:19s} {r['cold_s']:8.3f} {r['warm_median_s']:10.3f} "
              f"{r['warm_min_s']:7.3f} {r['gbps']:6.2f} {peak:>12s} "
              f"{'' if ratio is None else f'{ratio:.2f}x':>11s}")
    by = {r["variant"]: r for r in results}
    if base and "pool-stream" in by:
        want = 1.5 if args.nodes == 1 else 1.2
        sp = base["warm_median_s"] / by["pool-stream"]["warm_median_s"]
        print(f"strongest Ray form (ray-nixl by reference) / pool-stream: {sp:.2f}x "
              f"(target >= {want}x on {args.nodes} node(s): "
              f"{'MET' if sp >= want else 'MISSED'})")
    if "pool-stream" in by and "pool-stream-serial" in by:
        gain = by["pool-stream-serial"]["warm_median_s"] / by["pool-stream"]["warm_median_s"]
        print(f"pipelining (max_inflight 2 vs 1): {gain:.2f}x")
    bad = [r["variant"] for r in results if not r["checksums_ok"]]
    if bad:
        print(f"CHECKSUM MISMATCH in {bad}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "bytes": total, "tensors": len(layout),
                       "cpus": os.cpu_count(), "torch": torch.__version__,
                       "ray": ray.__version__, "args": vars(args), "results": results},
                      f, indent=2)
        print(f"wrote {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
