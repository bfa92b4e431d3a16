"""The sender/receiver actors of the side-by-side benchmark.

The variants (:class:`~ray_rdt_pool.bench.variants.Variant`) are in
:mod:`ray_rdt_pool.bench.variants`, the measurement hooks in :mod:`ray_rdt_pool.bench.hooks`.
:class:`Sender` and :class:`Receiver` are plain classes; the driver wraps them with
``ray.remote`` and the variant's options, so the same code measures every variant.

Three ways of moving a workload:

* one object (every workload but ``sync_stream``): :meth:`Sender.produce` /
  :meth:`Receiver.consume` (``ray.put`` / ``ray.get``), or :meth:`Sender.tq_produce` /
  :meth:`Receiver.tq_consume` for TransferQueue (``kv_batch_put`` / ``kv_batch_get``);
* buckets (``sync_stream``): :meth:`Sender.stream_to` streams the weight set to the
  receiver with at most :data:`~ray_rdt_pool.bench.workloads.STREAM_MAX_INFLIGHT`
  buckets in flight: ours through ``WeightSender.stream``, Ray's variants with a loop of
  ``ray.put`` per bucket and one receiver task per bucket (:meth:`Receiver.stream_bucket`).

Timestamps that cross processes use ``time.monotonic()`` (CLOCK_MONOTONIC, one clock
for the whole machine on Linux; all nodes of ``--nodes 2`` run on this machine).
"""

from __future__ import annotations

import gc
import pickle
import threading
import time
from collections import deque
from typing import Any

from ray_rdt_pool.bench import workloads as W
from ray_rdt_pool.bench.hooks import (
    PutTimer,
    install_transport_timer,
    process_info,
    timed_weight_receiver,
)
from ray_rdt_pool.bench.tq import tq_batch, tq_unbatch
from ray_rdt_pool.bench.variants import STREAM_RECEIVER_ATTR, Variant, our_stats, register_ours


class Sender:
    """Owns the workload's tensors and produces one object per transfer."""

    def __init__(self, variant: Variant, pool_bytes: int) -> None:
        import ray
        import torch

        self.variant = variant
        self.spec: W.WorkloadSpec | None = None
        self.tensors: list[Any] | None = None
        self.bases: list[Any] = []
        self.weight_sender: Any = None  # ours, sync_stream: a WeightSender
        self.buckets: list[list[int]] = []  # Ray's variants, sync_stream: tensor indices
        self.tq_keys: list[str] = []
        self._tq_puts = 0
        self._lock = threading.Lock()
        self._last_obj_id: str | None = None
        self._last_meta: Any = None
        self._freed_at: dict[str, float] = {}
        self.registered: str | None = None
        self._ours_time: dict[str, float] | None = None
        self._stream_ours0 = 0.0  # our get time already counted by earlier streams
        if variant.ours:
            self.registered = register_ours(pool_bytes)
            self._ours_time = install_transport_timer()
        if variant.ray_pool:
            ray.experimental.register_nixl_memory_pool(pool_bytes, torch.device("cpu"))
        if variant.rdt:
            self._install_hooks()

    def _install_hooks(self) -> None:
        from ray_rdt_pool._ray.patches import rdt_store

        store = rdt_store()
        add_orig = store.add_object_primary
        pop_orig = store.pop_object

        def add_object_primary(obj_id: str, tensors: list[Any], transport: str) -> Any:
            meta = add_orig(obj_id, tensors, transport)
            with self._lock:
                self._last_obj_id, self._last_meta = obj_id, meta
            return meta

        def pop_object(obj_id: str) -> Any:
            out = pop_orig(obj_id)
            with self._lock:
                self._freed_at[obj_id] = time.monotonic()
            return out

        store.add_object_primary = add_object_primary
        store.pop_object = pop_object

    def info(self) -> dict[str, Any]:
        return {**process_info(self.variant), "registered": self.registered}

    def build(self, spec: W.WorkloadSpec, seed: int) -> dict[str, Any]:
        self.spec = spec
        self.tensors, self.bases = W.build_tensors(spec, seed)
        if spec.is_stream:
            if self.variant.ours:
                from ray_rdt_pool.weights import WeightSender

                names = [name for name, _shape, _dt in W.named_layout(spec)]
                self.weight_sender = WeightSender(dict(zip(names, self.tensors)),
                                                  bucket_bytes=spec.bucket_bytes)
            else:
                self.buckets = W.stream_buckets(spec)
        if self.variant.tq:
            self.tq_keys = [f"sample-{i}" for i in range(spec.sizes.exp_samples)]
        return {"n_tensors": len(self.tensors)}

    def tensor_floor(self) -> dict[str, Any]:
        """:func:`W.per_tensor_floor` of the built tensors, in this actor's process."""
        assert self.tensors is not None, "build() first"
        return W.per_tensor_floor(self.tensors)

    def drop(self) -> None:
        self.tensors, self.bases = None, []
        self.weight_sender, self.buckets, self.spec = None, [], None
        gc.collect()

    def refresh(self, step: int) -> dict[str, Any]:
        """Update the weights in place (untimed by e2e) and return their checksum."""
        assert self.tensors is not None, "build() first"
        t0 = time.monotonic()
        W.refresh(self.bases, step)
        t1 = time.monotonic()
        ck = W.checksum(self.tensors)
        return {"update_s": t1 - t0, "checksum": ck, "checksum_s": time.monotonic() - t1}

    def produce(self) -> tuple[list[Any], dict[str, float]]:
        """``ray.put`` the tensor list; return the ref nested in a list, and timestamps."""
        import ray

        ours0 = self._ours_time["put_s"] if self._ours_time else 0.0
        t_start = time.monotonic()
        if self.variant.transport is None:
            ref = ray.put(self.tensors)
        else:
            ref = ray.put(self.tensors, _tensor_transport=self.variant.transport)
        t_put = time.monotonic()
        out = {"s_start": t_start, "s_put_end": t_put}
        if self._ours_time:
            out["ours_put_s"] = self._ours_time["put_s"] - ours0
        return [ref], out

    def produce_ret(self) -> list[Any]:
        """Return the tensor list from the method (task-argument path)."""
        return self.tensors  # type: ignore[return-value]

    # -- sync_stream ------------------------------------------------------------------

    def stream_to(self, receiver: Any, timeout_s: float) -> dict[str, Any]:
        """Stream the weight set to ``receiver``, bucket by bucket, and return timings.

        Ours: ``WeightSender.stream([receiver], max_inflight=2)`` (the receiver holds a
        ``WeightReceiver`` at ``weight_receiver``). Ray's variants: the same buckets,
        each ``ray.put`` with the variant's transport (or into the object store) and
        handed to one ``receiver.stream_bucket`` task; at most two unacknowledged, so
        the put of bucket k+1 overlaps the receiver's fetch of bucket k. ``put_s`` is
        the sum of the bucket puts (:class:`PutTimer`).
        """
        import ray

        assert self.spec is not None and self.tensors is not None, "build() first"
        with self._lock:
            self._freed_at.clear()
        ours0 = self._ours_time["put_s"] if self._ours_time else 0.0
        out: dict[str, Any] = {"s_start": time.monotonic()}
        with PutTimer() as timer:
            if self.variant.ours:
                rep = self.weight_sender.stream([receiver], max_inflight=W.STREAM_MAX_INFLIGHT,
                                                receiver_attr=STREAM_RECEIVER_ATTR,
                                                timeout_s=timeout_s)
                out.update(buckets=rep.buckets, pool_wait_s=rep.pool_wait_seconds,
                           fallbacks=rep.fallbacks, peak_pool_used=rep.peak_pool_used,
                           source_read_buckets=rep.source_read_buckets,
                           reference_buckets=rep.reference_buckets)
            else:
                inflight: deque[Any] = deque()
                for k, idx in enumerate(self.buckets):
                    while len(inflight) >= W.STREAM_MAX_INFLIGHT:
                        ray.get(inflight.popleft(), timeout=timeout_s)
                    tensors = [self.tensors[i] for i in idx]
                    if self.variant.transport is None:
                        ref = ray.put(tensors)
                    else:
                        ref = ray.put(tensors, _tensor_transport=self.variant.transport)
                    inflight.append(receiver.stream_bucket.remote(k, [ref]))
                    del ref, tensors  # the receiver's task holds the ref now
                while inflight:
                    ray.get(inflight.popleft(), timeout=timeout_s)
                out["buckets"] = len(self.buckets)
        out.update(s_end=time.monotonic(), put_s=timer.total_s, puts=timer.count)
        if self._ours_time:
            out["ours_put_s"] = self._ours_time["put_s"] - ours0
            if self.variant.ours:  # no ray.put: a stream packs (or describes) buckets itself
                out["put_s"] = out["ours_put_s"]
        with self._lock:
            meta, self._last_meta = self._last_meta, None
        out["meta_bytes"] = len(pickle.dumps(meta)) if meta is not None else None
        return out

    # -- TransferQueue ----------------------------------------------------------------

    def tq_init(self) -> float:
        """Start TransferQueue (controller and SimpleStorage units, owned by this actor)."""
        import transfer_queue as tq

        t = time.monotonic()
        tq.init()
        return time.monotonic() - t

    def tq_close(self) -> None:
        import transfer_queue as tq

        tq.close()

    def tq_produce(self) -> tuple[dict[str, Any], dict[str, float]]:
        """``kv_batch_put`` the batch (one key per sample) into a fresh partition."""
        import transfer_queue as tq

        assert self.spec is not None and self.tensors is not None, "build() first"
        self._tq_puts += 1
        partition = f"bench-{self._tq_puts}"
        t_start = time.monotonic()
        tq.kv_batch_put(keys=self.tq_keys, partition_id=partition,
                        fields=tq_batch(self.spec, self.tensors))
        t_put = time.monotonic()
        return ({"keys": self.tq_keys, "partition": partition},
                {"s_start": t_start, "s_put_end": t_put})

    def wait_released(self, timeout_s: float) -> dict[str, Any]:
        """Wait until the last RDT object is freed here; report when, and its metadata size.

        For our transport the pool must also be empty (``pool_used == 0`` and no live
        objects, read from ``ray_rdt_pool.stats()``).
        """
        out: dict[str, Any] = {"freed_at": None, "meta_bytes": None, "stats": None}
        if not self.variant.rdt:
            return out
        with self._lock:
            obj_id, meta = self._last_obj_id, self._last_meta
            self._last_meta = None
        if meta is not None:
            out["meta_bytes"] = len(pickle.dumps(meta))
        deadline = time.monotonic() + timeout_s
        freed = None
        while time.monotonic() < deadline:
            with self._lock:
                freed = self._freed_at.pop(obj_id, None) if obj_id else None
            if freed is not None:
                break
            time.sleep(0.0005)
        if freed is not None and self.variant.ours:
            freed = self._wait_pool_empty(freed, min(deadline, time.monotonic() + 2.0))
        out["freed_at"] = freed
        out["obj_id"] = obj_id
        if self.variant.ours:
            out["stats"] = our_stats()
        with self._lock:
            self._freed_at.clear()
        return out

    @staticmethod
    def _wait_pool_empty(freed: float, deadline: float) -> float | None:
        """Time our pool was seen empty (``freed`` if it already was), None on timeout."""
        first = True
        while True:
            stats = our_stats() or {}
            if not stats.get("pool_used") and not stats.get("live_objects"):
                return freed if first else time.monotonic()
            first = False
            if time.monotonic() > deadline:
                return None
            time.sleep(0.0005)

    def stats(self) -> dict[str, Any] | None:
        return our_stats() if self.variant.ours else None


class Receiver:
    """Fetches the object, verifies it, and reports when the tensors were in hand."""

    def __init__(self, variant: Variant, pool_bytes: int) -> None:
        import torch  # noqa: F401  (imported now, not during the first timed transfer)

        self.variant = variant
        self.spec: W.WorkloadSpec | None = None
        self.targets: list[Any] | None = None
        self.registered: str | None = None
        # sync_stream: the receiver's weights (every variant lands the stream in them),
        # ours through a WeightReceiver, Ray's per bucket (self.stream_dest[k]).
        self.dest: list[Any] = []
        self.weight_receiver: Any = None
        self.stream_dest: list[list[Any]] = []
        self._stream_fetch_s = 0.0
        self._stream_last: float | None = None
        self._stream_into_targets: bool | None = None
        self._ours_time: dict[str, float] | None = None
        self._stream_ours0 = 0.0  # our get time already counted by earlier streams
        if variant.ours:
            self.registered = register_ours(pool_bytes)
            self._ours_time = install_transport_timer()

    def info(self) -> dict[str, Any]:
        return {**process_info(self.variant), "registered": self.registered}

    def prepare(self, spec: W.WorkloadSpec) -> None:
        """Pre-allocate target buffers (target variants) or, for ``sync_stream``, the
        receiver's weights (every variant), and settle memory."""
        self.spec = spec
        self.targets = None
        if spec.is_stream:
            self._stream_ours0 = self._ours_time["get_s"] if self._ours_time else 0.0
            self.dest = W.allocate_like_layout(spec)
            if self.variant.ours:
                names = [name for name, _shape, _dt in W.named_layout(spec)]
                self.weight_receiver = timed_weight_receiver(dict(zip(names, self.dest)))
            else:
                self.stream_dest = [[self.dest[i] for i in idx]
                                    for idx in W.stream_buckets(spec)]
        elif self.variant.target:
            self.targets = W.allocate_like_layout(spec)
        gc.collect()

    def drop(self) -> None:
        self.targets, self.spec = None, None
        self.dest, self.weight_receiver, self.stream_dest = [], None, []
        gc.collect()

    def stats(self) -> dict[str, Any] | None:
        return our_stats() if self.variant.ours else None

    def _finish(self, tensors: list[Any], t_got: float) -> dict[str, Any]:
        into_targets = None
        if self.targets is not None:
            into_targets = len(tensors) == len(self.targets) and all(
                a.data_ptr() == b.data_ptr() for a, b in zip(tensors, self.targets))
        ck = W.checksum(tensors)
        t_ck = time.monotonic()
        return {"r_got": t_got, "checksum": ck, "checksum_s": t_ck - t_got,
                "into_targets": into_targets, "n_tensors": len(tensors)}

    def consume(self, produced: tuple[list[Any], dict[str, float]]) -> dict[str, Any]:
        """``ray.get`` the nested ref here (the fetch happens in this process)."""
        import ray

        ours0 = self._ours_time["get_s"] if self._ours_time else 0.0
        t_start = time.monotonic()
        refs, sender_ts = produced
        ref = refs[0]
        if self.targets is not None:
            ray.experimental.set_target_for_ref(ref, self.targets)
        tensors = ray.get(ref)
        t_got = time.monotonic()
        ours_get = self._ours_time["get_s"] - ours0 if self._ours_time else None
        out = self._finish(tensors, t_got)
        if ours_get is not None:
            out["ours_get_s"] = ours_get
        del tensors, ref, refs, produced
        out.update(sender_ts)
        out["r_start"] = t_start
        out["r_end"] = time.monotonic()
        return out

    def consume_arg(self, tensors: list[Any]) -> dict[str, Any]:
        """Task-argument path: Ray resolved (fetched) the tensors before this method ran."""
        t_got = time.monotonic()
        out = self._finish(tensors, t_got)
        del tensors
        out["r_start"] = t_got
        out["r_end"] = time.monotonic()
        return out

    # -- sync_stream ------------------------------------------------------------------

    def stream_bucket(self, k: int, box: list[Any]) -> int:
        """Ray's variants: land bucket ``k`` in the receiver's weights.

        ``nixl_target`` reads straight into them (``set_target_for_ref``); the others
        ``ray.get`` the bucket and ``copy_`` each tensor into its weight, as a weight
        loader does.
        """
        import ray

        t = time.monotonic()
        ref = box[0]
        dst = self.stream_dest[k]
        if self.variant.target:
            ray.experimental.set_target_for_ref(ref, dst)
            got = ray.get(ref)
            ok = len(got) == len(dst) and all(
                a.data_ptr() == b.data_ptr() for a, b in zip(got, dst))
            self._stream_into_targets = ok and self._stream_into_targets is not False
        else:
            got = ray.get(ref)
            for d, g in zip(dst, got):
                d.copy_(g)
        del got, ref
        box.clear()
        now = time.monotonic()
        self._stream_fetch_s += now - t
        self._stream_last = now
        return k

    def stream_result(self) -> dict[str, Any]:
        """After a stream: when the last bucket landed, the seconds spent receiving, and
        the checksum of the receiver's weights (untimed). Resets the stream timers."""
        if self.weight_receiver is not None:
            rec = self.weight_receiver
            t_got, fetch_s = rec.last_loaded, rec.fetch_s
            rec.last_loaded, rec.fetch_s = None, 0.0
        else:
            t_got, fetch_s = self._stream_last, self._stream_fetch_s
            self._stream_last, self._stream_fetch_s = None, 0.0
        into = self._stream_into_targets
        self._stream_into_targets = None
        ours_get = None
        if self._ours_time:
            ours_get = self._ours_time["get_s"] - self._stream_ours0
            self._stream_ours0 = self._ours_time["get_s"]
        t = time.monotonic()
        ck = W.checksum(self.dest)
        return {"r_got": t_got, "fetch_s": fetch_s, "checksum": ck,
                "checksum_s": time.monotonic() - t, "n_tensors": len(self.dest),
                "into_targets": into, "ours_get_s": ours_get}

    # -- TransferQueue ----------------------------------------------------------------

    def tq_init(self) -> float:
        """Attach to the TransferQueue the sender started (its client only)."""
        import transfer_queue as tq

        t = time.monotonic()
        tq.init()
        return time.monotonic() - t

    def tq_consume(self, produced: tuple[dict[str, Any], dict[str, float]]) -> dict[str, Any]:
        """``kv_batch_get`` the batch, verify it, then ``kv_clear`` it (timed as release)."""
        import transfer_queue as tq

        assert self.spec is not None, "prepare() first"
        t_start = time.monotonic()
        info, sender_ts = produced
        batch = tq.kv_batch_get(keys=info["keys"], partition_id=info["partition"])
        t_got = time.monotonic()
        tensors = tq_unbatch(self.spec, batch)
        out = self._finish(tensors, t_got)
        del tensors, batch
        out.update(sender_ts)
        out["r_start"] = t_start
        t = time.monotonic()
        tq.kv_clear(keys=info["keys"], partition_id=info["partition"])
        out["release_s"] = time.monotonic() - t
        out["r_end"] = time.monotonic()
        return out
