"""Variants and the sender/receiver actors of the side-by-side benchmark.

A :class:`Variant` says how one configuration moves tensors (object store, Ray's NIXL,
Ray's NIXL pool, target buffers, our ``NIXL_POOL`` transport). :class:`Sender` and
:class:`Receiver` are plain classes; the driver wraps them with ``ray.remote`` and the
variant's options, so the same code measures every variant.

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
from typing import Any

from microbenchmarks import _bench_workloads as W

ZERO_COPY_ENV = "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"


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
)
VARIANT_NAMES: tuple[str, ...] = tuple(v.name for v in VARIANTS)
RAY_VARIANTS: tuple[str, ...] = tuple(v.name for v in VARIANTS if not v.ours)
OUR_VARIANTS: tuple[str, ...] = tuple(v.name for v in VARIANTS if v.ours)


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

    ctx = ray._private.worker.global_worker.get_serialization_context()
    return {
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "torch_threads": torch.get_num_threads(),
        "zero_copy_env": os.environ.get(ZERO_COPY_ENV),
        # The flag is read once, when ray._private.ray_constants is imported; this is
        # the value the serializer really uses.
        "zero_copy_active": bool(getattr(ctx, "_zero_copy_tensors_enabled", False)),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
    }


class Sender:
    """Owns the workload's tensors and produces one object per transfer."""

    def __init__(self, variant: Variant, pool_bytes: int) -> None:
        import ray
        import torch

        self.variant = variant
        self.tensors: list[Any] | None = None
        self.bases: list[Any] = []
        self._lock = threading.Lock()
        self._last_obj_id: str | None = None
        self._last_meta: Any = None
        self._freed_at: dict[str, float] = {}
        self.registered: str | None = None
        if variant.ours:
            self.registered = register_ours(pool_bytes)
        if variant.ray_pool:
            ray.experimental.register_nixl_memory_pool(pool_bytes, torch.device("cpu"))
        if variant.rdt:
            self._install_hooks()

    def _install_hooks(self) -> None:
        import ray

        store = ray._private.worker.global_worker.rdt_manager.rdt_store
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
        self.tensors, self.bases = W.build_tensors(spec, seed)
        return {"n_tensors": len(self.tensors)}

    def drop(self) -> None:
        self.tensors, self.bases = None, []
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

        t_start = time.monotonic()
        if self.variant.transport is None:
            ref = ray.put(self.tensors)
        else:
            ref = ray.put(self.tensors, _tensor_transport=self.variant.transport)
        t_put = time.monotonic()
        return [ref], {"s_start": t_start, "s_put_end": t_put}

    def produce_ret(self) -> list[Any]:
        """Return the tensor list from the method (task-argument path)."""
        return self.tensors  # type: ignore[return-value]

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
        self.targets: list[Any] | None = None
        self.registered: str | None = None
        if variant.ours:
            self.registered = register_ours(pool_bytes)

    def info(self) -> dict[str, Any]:
        return {**_process_info(self.variant), "registered": self.registered}

    def prepare(self, spec: W.WorkloadSpec) -> None:
        """Pre-allocate target buffers (target variants only) and settle memory."""
        self.targets = W.allocate_like_layout(spec) if self.variant.target else None
        gc.collect()

    def drop(self) -> None:
        self.targets = None
        gc.collect()

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

        t_start = time.monotonic()
        refs, sender_ts = produced
        ref = refs[0]
        if self.targets is not None:
            ray.experimental.set_target_for_ref(ref, self.targets)
        tensors = ray.get(ref)
        t_got = time.monotonic()
        out = self._finish(tensors, t_got)
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
