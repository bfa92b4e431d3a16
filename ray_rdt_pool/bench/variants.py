"""The variants of the side-by-side benchmark and whether each can run here.

A :class:`Variant` says how one configuration moves tensors (object store, Ray's NIXL,
Ray's NIXL pool, target buffers, our ``NIXL_POOL`` transport, TransferQueue).
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
