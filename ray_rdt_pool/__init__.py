"""ray_rdt_pool: a pooled, one-sided NIXL tensor transport for Ray Direct Transport.

Public entry points live here. Heavy imports (torch, Ray, NIXL) happen lazily inside
the functions, so importing the package does nothing at import time.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.config import TRANSPORT, Options, PoolConfig, Tuning
from ray_rdt_pool.errors import (
    ConfigurationError,
    InvalidInputError,
    PoolExhaustedError,
    RdtPoolError,
    ReadStillRunningError,
    RegistrationError,
    TransferError,
    WireFormatError,
)
from ray_rdt_pool.obs.stats import TransportStats

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

try:
    __version__ = version("ray-rdt-pool")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"



def register() -> str:
    """Register the ``nixl_pool`` transport with Ray in this process.

    Call it in the driver before creating actors, and again at the top of each actor's
    ``__init__`` (Ray registers custom transports on actors asynchronously, so a put in
    ``__init__`` could otherwise run first). Repeated calls are no-ops. Returns
    :data:`TRANSPORT`.

    Raises ConfigurationError when the installed Ray is not the release this package was
    tested with (2.60.x); ``RAY_RDT_POOL_ALLOW_UNTESTED_RAY=1`` turns that into a warning.
    """
    from ray_rdt_pool._ray.transport import register as _register

    return _register()


def setup_worker() -> None:
    """Register the transport in a Ray worker process: a ``worker_process_setup_hook``.

    ``ray.init(runtime_env={"worker_process_setup_hook": "ray_rdt_pool.setup_worker"})``
    runs it in every worker before any task or actor, so actors need not call
    :func:`register` themselves (the driver still does, before defining actor classes).
    With a hook of your own, call :func:`register` from it instead.
    """
    register()


def configure(**options: Unpack[Options]) -> PoolConfig:
    """Configure this process's transport before its first put or get.

    Each option left None comes from its environment variable (``RAY_RDT_POOL_`` plus
    the option's name in upper case, e.g. ``RAY_RDT_POOL_POOL_BYTES``), else from the
    default. The options are the fields of :class:`ray_rdt_pool.config.PoolConfig`:

    - ``pool_bytes``: size of the sender pool (default 1 GiB).
    - ``arena_bytes``: size of the receive arena (default 1 GiB).
    - ``device``: where the sender pool lives, ``"cpu"`` or ``"cuda"``.
    - ``overflow``: copy an object the pool cannot hold into overflow memory (default
      True); False raises ``PoolExhaustedError`` instead.
    - ``prefault``: touch every pool and arena page when they are created.
    - ``fetch_timeout_s``: upper bound for one READ, in seconds (default 60).
    - ``metrics``: export metrics through ``ray.util.metrics`` (default True).
    - ``debug_transfers``: DEBUG-log every put and fetch.
    - ``registration_cache_bytes``: bytes of receive buffers kept registered with NIXL.
    - ``same_node``: receivers on the sender's node: ``"map"``, ``"copy"`` or ``"off"``.
    - ``overflow_linger_s``: seconds an emptied overflow region stays registered.

    Measured tuning values (:class:`ray_rdt_pool.config.Tuning`; leave them unless a
    benchmark on your hardware says otherwise), either as a whole ``tuning=Tuning(...)``
    or one by one, applied over ``tuning``: ``progress_interval_s``,
    ``progress_idle_interval_s``, ``pack_threads``, ``pack_threshold_bytes``,
    ``stream_copy_bytes``, ``read_lanes``, ``read_split_bytes``, ``native``.

    Raises ConfigurationError for an unknown option or a bad value, when called after
    first use, or again with different values.
    """
    from ray_rdt_pool._ray.runtime import configure as _configure

    return _configure(**options)  # it refuses an unknown name, by name


def set_cuda_stream(stream: Any) -> None:
    """Name the CUDA stream that produces the tensors this process sends.

    Before packing, the transport waits for that stream (by default the current stream
    of the tensors' device), and it finishes the pack copy before any metadata exists.
    """
    from ray_rdt_pool._ray.runtime import set_cuda_stream as _set

    _set(stream)


def stats() -> TransportStats:
    """A frozen snapshot of this process's pool, arena and NIXL counters."""
    from ray_rdt_pool._ray.runtime import stats as _stats

    return _stats()


def register_memory(tensor: torch.Tensor) -> None:
    """Register a tensor's storage with NIXL once, so objects in it are sent zero-copy.

    Such tensors are read by reference (no snapshot): leave them unmodified until the
    objects that hold them are freed. They mix with pooled tensors in one object. The
    storage stays registered (and alive) until :func:`deregister_memory` and the last
    object naming it is freed.
    """
    from ray_rdt_pool._ray.runtime import register_memory as _register_memory

    _register_memory(tensor)


def shutdown() -> None:
    """Stop this process's transport: the progress thread, the NIXL agent, its GCS key.

    Runs by itself at interpreter exit (``atexit``); call it earlier to tear down
    before Ray does. The transport cannot be used again in the process afterwards.
    """
    from ray_rdt_pool._ray.runtime import shutdown as _shutdown

    _shutdown()


def deregister_memory(tensor: torch.Tensor) -> None:
    """Undo one :func:`register_memory` of the same storage."""
    from ray_rdt_pool._ray.runtime import deregister_memory as _deregister_memory

    _deregister_memory(tensor)


__all__ = [
    "TRANSPORT",
    "ConfigurationError",
    "InvalidInputError",
    "PoolConfig",
    "PoolExhaustedError",
    "RdtPoolError",
    "ReadStillRunningError",
    "RegistrationError",
    "TransferError",
    "TransportStats",
    "Tuning",
    "WireFormatError",
    "configure",
    "deregister_memory",
    "register",
    "register_memory",
    "set_cuda_stream",
    "setup_worker",
    "shutdown",
    "stats",
]
