"""ray_rdt_pool: a pooled, one-sided NIXL tensor transport for Ray Direct Transport.

Public entry points live here. Heavy imports (torch, Ray, NIXL) happen lazily inside
the functions, so importing the package does nothing at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    import torch

    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.snapshot import TransportStats

__version__ = "0.1.0"

#: The name Ray knows the transport by. Ray upper-cases transport names, so
#: ``tensor_transport="nixl_pool"`` works as well.
TRANSPORT = "NIXL_POOL"


def register() -> str:
    """Register the ``nixl_pool`` transport with Ray in this process.

    Call it in the driver before creating actors, and again at the top of each actor's
    ``__init__`` (Ray registers custom transports on actors asynchronously, so a put in
    ``__init__`` could otherwise run first). Repeated calls are no-ops. Returns
    :data:`TRANSPORT`.
    """
    from ray_rdt_pool.transport import register as _register

    return _register()


def setup_worker() -> None:
    """Register the transport in a Ray worker process: a ``worker_process_setup_hook``.

    ``ray.init(runtime_env={"worker_process_setup_hook": "ray_rdt_pool.setup_worker"})``
    runs it in every worker before any task or actor, so actors need not call
    :func:`register` themselves (the driver still does, before defining actor classes).
    With a hook of your own, call :func:`register` from it instead.
    """
    register()


def configure(**options: Any) -> PoolConfig:
    """Configure this process's transport before its first put or get.

    Options are the fields of :class:`ray_rdt_pool.config.PoolConfig` (``pool_bytes``,
    ``arena_bytes``, ``strict``, ...); unset ones come from the environment variables
    in the README, then the defaults. Raises ConfigurationError when called after first
    use, or again with different values.
    """
    from ray_rdt_pool.transport import configure as _configure

    return _configure(**options)


def set_cuda_stream(stream: Any) -> None:
    """Name the CUDA stream that produces the tensors this process sends.

    Before packing, the transport waits for that stream (by default the current stream
    of the tensors' device), and it finishes the pack copy before any metadata exists.
    """
    from ray_rdt_pool.transport import set_cuda_stream as _set

    _set(stream)


def stats() -> TransportStats:
    """A frozen snapshot of this process's pool, arena and NIXL counters."""
    from ray_rdt_pool.transport import stats as _stats

    return _stats()


def register_memory(tensor: torch.Tensor) -> None:
    """Register a tensor's storage with NIXL once, so objects in it are sent zero-copy.

    Such tensors are read by reference (no snapshot): leave them unmodified until the
    objects that hold them are freed. They mix with pooled tensors in one object. The
    storage stays registered (and alive) until :func:`deregister_memory` and the last
    object naming it is freed.
    """
    from ray_rdt_pool.transport import register_memory as _register_memory

    _register_memory(tensor)


def shutdown() -> None:
    """Stop this process's transport: the progress thread, the NIXL agent, its GCS key.

    Runs by itself at interpreter exit (``atexit``); call it earlier to tear down
    before Ray does. The transport cannot be used again in the process afterwards.
    """
    from ray_rdt_pool.transport import shutdown as _shutdown

    _shutdown()


def deregister_memory(tensor: torch.Tensor) -> None:
    """Undo one :func:`register_memory` of the same storage."""
    from ray_rdt_pool.transport import deregister_memory as _deregister_memory

    _deregister_memory(tensor)


__all__ = [
    "TRANSPORT",
    "ConfigurationError",
    "InvalidInputError",
    "PoolExhaustedError",
    "RdtPoolError",
    "ReadStillRunningError",
    "RegistrationError",
    "TransferError",
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
