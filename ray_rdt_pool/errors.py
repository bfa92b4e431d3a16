"""The exception hierarchy of ray_rdt_pool (pure: no torch, Ray or NIXL).

Every error the package raises on purpose derives from :class:`RdtPoolError`, and each
also derives from the built-in exception a caller would naturally catch (``MemoryError``
for an exhausted pool, ``ValueError`` for malformed input), so existing ``except``
clauses keep working. Messages carry the numbers involved and name the fix.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "InvalidInputError",
    "NativeBuildError",
    "PoolExhaustedError",
    "RdtPoolError",
    "ReadStillRunningError",
    "RegistrationError",
    "TransferError",
    "WireFormatError",
]


def fmt_bytes(n: int) -> str:
    """Format a byte count with thousands separators, e.g. ``1,048,576 bytes``."""
    return f"{n:,} bytes"


class RdtPoolError(Exception):
    """Base class of every error raised on purpose by ray_rdt_pool.

    Catch this to handle any failure of the transport in one place.
    """


class PoolExhaustedError(RdtPoolError, MemoryError):
    """An object does not fit in the free space of a pool.

    Raised by the allocator when the free bytes of the sender pool (or the receive
    arena) cannot hold an object, and by the transport in strict mode instead of
    falling back to direct registration. What to do: raise ``pool_bytes`` (or
    ``RAY_RDT_POOL_POOL_BYTES``), free objects sooner by dropping their refs, or leave
    strict mode off so oversized objects fall back to direct registration.
    """

    def __init__(self, needed: int, free: int, largest_free: int, capacity: int,
                 what: str = "pool", remedy: str = "raise pool_bytes (RAY_RDT_POOL_POOL_BYTES)"):
        self.needed = needed
        self.free = free
        self.largest_free = largest_free
        self.capacity = capacity
        self.what = what
        self.remedy = remedy
        super().__init__(
            f"the {what} cannot hold an object: it needs {fmt_bytes(needed)}, "
            f"the largest free block is {fmt_bytes(largest_free)} and "
            f"{fmt_bytes(free)} are free of {fmt_bytes(capacity)}; "
            f"{remedy}, or drop refs to free objects sooner"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Ray pickles exceptions across processes; keep the structured fields.
        return (type(self), (self.needed, self.free, self.largest_free, self.capacity,
                             self.what, self.remedy))


class WireFormatError(RdtPoolError, ValueError):
    """Object metadata received from a peer is malformed.

    Raised by the wire decoder when the bytes are truncated, of another format
    version, or describe tensors outside the blocks they claim. Nothing was
    transferred. What to do: make sure sender and receiver run the same
    ray_rdt_pool version; a persistent error points to corruption or a bug.

    Also raised on the sender, before anything is copied, if the encoder's own check
    finds that its grouping of an object's tensors does not hold every tensor exactly
    once (a bug in this package: report it with the object's shapes and dtypes).
    """


class RegistrationError(RdtPoolError):
    """NIXL refused to register memory, or the agent could not be created.

    Raised when the pool, the receive arena or a fallback buffer cannot be
    registered with NIXL (for example NIXL is not installed, or CUDA memory from
    ``expandable_segments`` allocations). What to do: follow the message; it names
    the size and device that failed.
    """


class TransferError(RdtPoolError):
    """A one-sided NIXL READ failed, was aborted or timed out.

    Raised on the receiver. The sender's blocks are untouched and the receiver's
    buffers are released. What to do: check that the sender actor is alive; the
    object can be fetched again while its ref is in scope.
    """


def shut_down_error() -> TransferError:
    """The error of a put, fetch or registration once ``ray_rdt_pool.shutdown()`` began
    in this process: the transport cannot be used in it again."""
    return TransferError("nixl_pool was shut down in this process "
                         "(ray_rdt_pool.shutdown()); start a new process to use it")


class ReadStillRunningError(TransferError):
    """A READ failed to post as a whole, and NIXL could neither cancel nor cut off a part
    of it that did start.

    Raised on the receiver by the NIXL backend when one part of a READ failed to post
    and another part kept running past ``post_timeout_s`` while removing the sender's
    agent failed too. ``running`` is the handle of what may still write; the receiver
    keeps the memory it reads into reserved until NIXL reports it ended (nothing is
    reused under a late write) and sets ``running`` to None before the error reaches
    the caller, so the error pickles. What to do: as for :class:`TransferError`; the
    memory comes back by itself once the READ ends or its peer is removed.
    """

    def __init__(self, message: str, running: object = None) -> None:
        super().__init__(message)
        self.running = running


class ConfigurationError(RdtPoolError, ValueError):
    """A configuration value is invalid or arrives too late.

    Raised by ``configure()`` and by the environment parser for a non-positive
    size, an unknown device, or a change after the pool is in use. What to do:
    call ``configure()`` once, before the first put or get in the process.
    """


class InvalidInputError(RdtPoolError, ValueError, TypeError):
    """The tensors handed to the transport cannot be sent as given.

    Raised for mixed device types in one object, non-tensor items, unsupported
    dtypes or devices, and target buffers that do not match the object. It is
    both a ``ValueError`` and a ``TypeError`` so either ``except`` catches it.
    What to do: the message names the offending index and the fix.
    """


class NativeBuildError(RdtPoolError, RuntimeError):
    """The optional compiled helper (``python -m ray_rdt_pool.memory.native build``) did not build.

    Raised by :func:`ray_rdt_pool.memory.native.build` when no C++ compiler runs or the compile
    fails; the message carries the compiler's last lines. Nothing else depends on the
    helper: without it ``describe`` uses its Python loop. What to do: install a C++
    compiler (or set ``CXX``) and build again, or go on without the helper.
    """
