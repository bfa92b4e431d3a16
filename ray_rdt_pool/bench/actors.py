"""Variants and the sender/receiver actors of the side-by-side benchmark.

A :class:`Variant` says how one configuration moves tensors (object store, Ray's NIXL,
Ray's NIXL pool, target buffers, our ``NIXL_POOL`` transport, TransferQueue).
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

Two measurement hooks are installed on the sender's own RDT store instance (nothing in
Ray's code is changed): ``add_object_primary`` is wrapped to keep the transport
metadata of the last object (its pickled size is reported after the timed transfer),
and ``pop_object`` to timestamp when Ray's ``__ray_free__`` has run the transport's
``garbage_collect`` and dropped the object. That timestamp is the end of ``release``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import threading
import time
from collections import deque
from typing import Any

from ray_rdt_pool.bench import workloads as W

ZERO_COPY_ENV = "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"
#: The TransferQueue release the ``transferqueue`` variant was written against (the
#: ``bench`` extra in pyproject.toml pins it).
TQ_VERSION = "0.1.11"
#: Logical CPUs TransferQueue's own actors ask for: the controller and each of the
#: SimpleStorage units are ``num_cpus=1`` actors (2 units by default).
TQ_ACTOR_CPUS = 3
#: Where :class:`Receiver` keeps its ``WeightReceiver`` for ``WeightSender.stream``.
STREAM_RECEIVER_ATTR = "weight_receiver"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of moving a tensor list from the sender actor to the receiver actor."""

    name: str
    #: ``_tensor_transport`` / ``tensor_transport`` value, or None for the object store.
    transport: str | None
    zero_copy: bool = False
    ray_pool: bool = False
    target: bool = False
    ours: bool = False
    #: TransferQueue (a third-party store with its own API; experience workloads only)
    tq: bool = False
    summary: str = ""

    @property
    def rdt(self) -> bool:
        return self.transport is not None


VARIANTS: tuple[Variant, ...] = (
    Variant("objstore", None, summary="Ray object store, no RDT"),
    Variant("objstore_zc", None, zero_copy=True,
            summary=f"object store, {ZERO_COPY_ENV}=1 in the actors"),
    Variant("nixl", "nixl", summary="Ray RDT, built-in NIXL"),
    Variant("nixl_pool_ray", "nixl", ray_pool=True,
            summary="built-in NIXL + ray.experimental.register_nixl_memory_pool"),
    Variant("nixl_target", "nixl", target=True,
            summary="built-in NIXL + set_target_for_ref into pre-allocated buffers"),
    Variant("nixl_pool", "nixl_pool", ours=True, summary="ours: ray_rdt_pool NIXL_POOL"),
    Variant("nixl_pool_target", "nixl_pool", ours=True, target=True,
            summary="ours + set_target_for_ref"),
    Variant("transferqueue", None, tq=True,
            summary=f"TransferQueue {TQ_VERSION} (SimpleStorage): kv_batch_put of one "
                    "TensorDict with a key per sample, kv_batch_get (experience workloads)"),
)
VARIANT_NAMES: tuple[str, ...] = tuple(v.name for v in VARIANTS)
RAY_VARIANTS: tuple[str, ...] = tuple(v.name for v in VARIANTS if not (v.ours or v.tq))
OUR_VARIANTS: tuple[str, ...] = tuple(v.name for v in VARIANTS if v.ours)
#: Neither Ray's nor ours: compared with ours on its own line, never "best Ray".
OTHER_VARIANTS: tuple[str, ...] = tuple(v.name for v in VARIANTS if v.tq)


def variant_by_name(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANT_NAMES)}")


def our_transport_unavailable_reason() -> str | None:
    """Why our transport cannot be used in this process, or None when it can.

    Only checks that the package imports and exposes a callable ``register``; it does
    not register anything (registering early would add our transport to every RDT
    actor created afterwards, including the Ray variants' actors).
    """
    try:
        import ray_rdt_pool
    except ImportError as exc:
        return f"import ray_rdt_pool failed: {exc}"
    reg = getattr(ray_rdt_pool, "register", None)
    if not callable(reg):
        return "ray_rdt_pool has no register() yet (transport not implemented)"
    return None


def transferqueue_unavailable_reason() -> str | None:
    """Why the ``transferqueue`` variant cannot run here, or None when it can.

    Looks the package up without importing it (its import pulls in tensordict, zmq and
    its controller's Ray actors).
    """
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("transfer_queue") is None:
        return (f"package transferqueue is not installed (pip install -e '.[bench]', or "
                f"pip install transferqueue=={TQ_VERSION})")
    try:
        version = importlib.metadata.version("transferqueue")
    except importlib.metadata.PackageNotFoundError:
        return "module transfer_queue is importable but the transferqueue distribution is not"
    if version != TQ_VERSION:
        return f"transferqueue {version} is installed; this variant is written for {TQ_VERSION}"
    return None


def register_ours(pool_bytes: int | None) -> str:
    """Register our transport in this process and configure its pool size if possible."""
    import ray_rdt_pool

    name = ray_rdt_pool.register()
    configure = getattr(ray_rdt_pool, "configure", None)
    if pool_bytes and callable(configure):
        configure(pool_bytes=pool_bytes)
    return str(name)


def our_stats() -> dict[str, Any] | None:
    """``ray_rdt_pool.stats()`` as a plain dict (defensive about its shape)."""
    try:
        import ray_rdt_pool

        stats = ray_rdt_pool.stats()
    except Exception as exc:  # the transport is optional; report, do not fail here
        return {"error": f"{type(exc).__name__}: {exc}"}
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        return dataclasses.asdict(stats)
    if isinstance(stats, dict):
        return dict(stats)
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}


def _process_info(variant: Variant) -> dict[str, Any]:
    import ray
    import torch

    from ray_rdt_pool._ray.patches import serialization_context
    from ray_rdt_pool.memory.describe import native_active

    ctx = serialization_context()
    return {
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "torch_threads": torch.get_num_threads(),
        "zero_copy_env": os.environ.get(ZERO_COPY_ENV),
        # The flag is read once, when ray._private.ray_constants is imported; this is
        # the value the serializer really uses.
        "zero_copy_active": bool(getattr(ctx, "_zero_copy_tensors_enabled", False)),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "native_describe": native_active(),
    }


class PutTimer:
    """Sums the wall time of every ``ray.put`` made in this process while active.

    A measurement hook for ``sync_stream``: the weights API calls ``ray.put`` once per
    bucket inside ``WeightSender.stream``; Ray's variants call it in our own loop. Both
    look ``ray.put`` up on the ``ray`` module at call time, so swapping the module
    attribute for the duration of one stream times every bucket's put the same way for
    every variant (nothing in Ray's code changes; the original is restored on exit).
    """

    def __init__(self) -> None:
        self.total_s = 0.0
        self.count = 0
        self._orig: Any = None

    def __enter__(self) -> PutTimer:
        import ray

        self._orig = orig = ray.put

        def timed_put(*args: Any, **kwargs: Any) -> Any:
            t = time.monotonic()
            try:
                return orig(*args, **kwargs)
            finally:
                self.total_s += time.monotonic() - t
                self.count += 1

        ray.put = timed_put
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        ray.put = self._orig


def install_transport_timer() -> dict[str, float] | None:
    """Time spent inside our transport's own code in this process, summed.

    Wraps, on this process's ``ray_rdt_pool`` runtime object (instance attributes, the
    way the RDT store hooks above work; the package is not changed), the sender's
    ``put`` and ``put_by_reference`` (what Ray's ``ray.put`` and a weights stream call
    to lay out, copy into the pool and describe an object) into ``put_s``, and ``fetch``
    + ``wait`` (what ``ray.get`` calls to start the READ and rebuild the tensors) and the
    receiver's ``sources.read`` (a weights stream's source reads) into ``get_s``. What is
    left of a ``ray.put`` or ``ray.get`` call is Ray's own serializer and bookkeeping.
    Returns None, and times nothing, where the runtime has no such methods.
    """
    try:
        from ray_rdt_pool._ray.runtime import runtime

        rt = runtime()
    except Exception:
        return None
    names = {"put": "put_s", "fetch": "get_s", "wait": "get_s"}
    if not all(callable(getattr(rt, n, None)) for n in names):
        return None
    sender = rt.sender
    # The pack itself, wherever it is called from: ray.put (through Runtime.put) or a
    # weights stream (owned objects: Sender.put, or Sender.put_by_reference with no copy).
    names.pop("put")
    acc = {"put_s": 0.0, "get_s": 0.0}

    def timed(orig: Any, key: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.monotonic()
            try:
                return orig(*args, **kwargs)
            finally:
                acc[key] += time.monotonic() - t
        return call

    for name, key in names.items():
        setattr(rt, name, timed(getattr(rt, name), key))
    for name in ("put", "put_by_reference"):
        if callable(getattr(sender, name, None)):
            setattr(sender, name, timed(getattr(sender, name), "put_s"))
    # A weights stream on one node reads buckets straight out of the trainer instead.
    sources = getattr(rt.receiver, "sources", None)
    read = getattr(sources, "read", None)
    if callable(read):
        setattr(sources, "read", timed(read, "get_s"))  # noqa: B010
    return acc


_TIMED_RECEIVER_CLS: Any = None


def timed_weight_receiver(dest: dict[str, Any]) -> Any:
    """A ``ray_rdt_pool.weights.WeightReceiver`` for ``dest`` that also records, per
    stream, the seconds spent in its bucket loads and when the last bucket landed.

    The subclass only wraps :meth:`load_stream_bucket` (what ``WeightSender.stream``
    calls on the receiver for each bucket, through ``__ray_call__``); it is made on
    first use so that importing this module never imports our package.
    """
    global _TIMED_RECEIVER_CLS
    if _TIMED_RECEIVER_CLS is None:
        from ray_rdt_pool.weights import WeightReceiver

        class TimedWeightReceiver(WeightReceiver):
            fetch_s = 0.0
            last_loaded: float | None = None

            def load_stream_bucket(self, session: str, k: int, box: list[Any],
                                   spec: Any = None) -> Any:
                t = time.monotonic()
                reports = super().load_stream_bucket(session, k, box, spec)
                now = time.monotonic()
                self.fetch_s += now - t
                if reports:  # [] when the bucket waits for an earlier one
                    self.last_loaded = now
                return reports

        _TIMED_RECEIVER_CLS = TimedWeightReceiver
    return _TIMED_RECEIVER_CLS(dest)


def tq_batch(spec: W.WorkloadSpec, tensors: list[Any]) -> Any:
    """The experience batch as the one TensorDict (batch size N) TransferQueue stores.

    Batched layout: the field tensors as they are. Per-sample layout: each field's
    per-sample tensors stacked (a copy; part of the put, since kv_batch_put takes a
    batch and this is what a caller holding per-sample tensors has to do).
    """
    import torch
    from tensordict import TensorDict

    fields = [name for name, _dt, _seq in W.EXPERIENCE_FIELDS]
    n = spec.sizes.exp_samples
    if spec.name == "experience":
        data = dict(zip(fields, tensors))
    else:
        k = len(fields)
        data = {f: torch.stack(tensors[j::k]) for j, f in enumerate(fields)}
    return TensorDict(data, batch_size=[n])


def tq_unbatch(spec: W.WorkloadSpec, batch: Any) -> list[Any]:
    """The tensors of a TensorDict from ``kv_batch_get`` in the workload's layout order.

    TransferQueue stores samples one by one and returns a field of per-sample vectors as
    a jagged nested tensor (scalars as a dense ``[N]`` tensor); this rebuilds the sent
    list so its checksum can be compared with the sender's. It runs after the timed
    get (like the checksum): how a consumer uses the batch is not the transport's cost.
    """
    import torch

    n = spec.sizes.exp_samples
    per_field: list[list[Any]] = []
    for name, _dt, _seq in W.EXPERIENCE_FIELDS:
        value = batch[name]
        rows = list(value.unbind()) if value.is_nested else list(value.unbind(0))
        if len(rows) != n:
            raise ValueError(f"transferqueue returned {len(rows)} samples of {name}, "
                             f"expected {n}")
        per_field.append(rows)
    if spec.name == "experience":
        return [torch.stack(rows) for rows in per_field]
    return [per_field[j][i] for i in range(n) for j in range(len(per_field))]


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
        return {**_process_info(self.variant), "registered": self.registered}

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
        return {**_process_info(self.variant), "registered": self.registered}

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
