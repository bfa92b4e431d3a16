"""The exception hierarchy of ray_rdt_pool (pure: no torch, Ray or NIXL).

Every error the package raises on purpose, the weight-sync API's included, is one class
of this tree::

    RdtPoolError
    ├── PoolExhaustedError (MemoryError)
    ├── WireFormatError (ValueError)
    ├── RegistrationError
    ├── TransferError
    │   └── ReadStillRunningError
    ├── ConfigurationError (ValueError)
    ├── InvalidInputError (ValueError, TypeError)
    ├── NativeBuildError (RuntimeError)
    └── WeightSyncError
        ├── ManifestMismatchError (ValueError)
        │   ├── DuplicateTargetError
        │   ├── ShapeMismatchError
        │   ├── DtypeMismatchError
        │   ├── MissingWeightsError
        │   ├── UnexpectedWeightsError
        │   └── SelectError
        ├── ManifestReleasedError (ValueError)
        ├── WireDtypeError (ValueError)
        ├── WeightSyncTimeoutError (TimeoutError)
        ├── StaleVersionError (ValueError)
        ├── SourceExhaustedError (ValueError)
        ├── DuplicateNameError (ValueError)
        ├── LoaderError
        ├── CommitHookError
        ├── RankLayoutError (ValueError)
        │   ├── RankOverlapError
        │   └── RankMissingError
        ├── TrainerRankError
        └── ReceiverError
            └── RelayReceiverError

Each also derives from the built-in exception in brackets, the one a caller would
naturally catch, so existing ``except`` clauses keep working. Messages carry the numbers
involved and name the fix. The weight-sync errors are importable from
``ray_rdt_pool.weights`` as well. Errors with fields beyond the message keep them
through pickling (``__reduce__``): Ray pickles an exception to hand it to the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "CommitHookError",
    "ConfigurationError",
    "DtypeMismatchError",
    "DuplicateNameError",
    "DuplicateTargetError",
    "InvalidInputError",
    "LoaderError",
    "ManifestMismatchError",
    "ManifestReleasedError",
    "MissingWeightsError",
    "NativeBuildError",
    "PoolExhaustedError",
    "RankLayoutError",
    "RankMissingError",
    "RankOverlapError",
    "RdtPoolError",
    "ReadStillRunningError",
    "ReceiverError",
    "RegistrationError",
    "RelayReceiverError",
    "SelectError",
    "ShapeMismatchError",
    "SourceExhaustedError",
    "StaleVersionError",
    "TrainerRankError",
    "TransferError",
    "UnexpectedWeightsError",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "WireDtypeError",
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

    Raised by the transport with ``overflow=False`` when the sender pool cannot
    hold an object, instead of copying it into overflow memory, and by
    ``WeightSender.stream`` for a bucket larger than the pool (a stream never uses
    overflow memory). What to do: raise ``pool_bytes`` (or ``RAY_RDT_POOL_POOL_BYTES``),
    free objects sooner by dropping their refs, or leave ``overflow`` on so oversized
    objects are copied into overflow memory (still a snapshot, at the cost of a NIXL
    registration); for a stream, lower ``bucket_bytes``.
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


# -- weight sync (ray_rdt_pool.weights) --


class WeightSyncError(RdtPoolError):
    """Base class of the weight-sync errors (a subclass of :class:`RdtPoolError`)."""


class ManifestMismatchError(WeightSyncError, ValueError):
    """The manifest does not fit the destination; nothing was written.

    Raised by :meth:`WeightReceiver.check` (and so by every load) after validating the
    whole layout, before the first destination tensor is touched. ``problems`` lists
    every problem found as ``(kind, name, detail)``; the exception's class is the kind
    of the first one in the order select, duplicate, shape, dtype, missing, unexpected.
    """

    kind = "mismatch"

    def __init__(self, message: str, problems: Sequence[tuple[str, str, str]] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


class DuplicateTargetError(ManifestMismatchError):
    """Two manifest names map to the same destination name. Fix the name map."""

    kind = "duplicate"


class ShapeMismatchError(ManifestMismatchError):
    """A manifest tensor and its destination have different shapes (no reshaping)."""

    kind = "shape"


class DtypeMismatchError(ManifestMismatchError):
    """A manifest dtype cannot be cast to its destination's dtype under the casting rule.

    With ``casting="same_kind"`` (the default) a cast is allowed when
    ``torch.can_cast(src, dst)``: within a kind (float32 -> bfloat16, int64 -> int32)
    or up the order bool -> integer -> floating -> complex. Casts down that order
    (float -> integer, anything but bool -> bool, complex -> real) are refused.
    ``casting="no"`` refuses any change, ``casting="unsafe"`` allows whatever
    ``Tensor.copy_`` does.
    """

    kind = "dtype"


class MissingWeightsError(ManifestMismatchError):
    """Destination tensors that no manifest tensor maps to (``strict=True``)."""

    kind = "missing"


class UnexpectedWeightsError(ManifestMismatchError):
    """Manifest tensors whose (mapped) name is not in the destination (``strict=True``).

    Map such names to ``None`` in ``name_map`` to skip them on purpose.
    """

    kind = "unexpected"


class SelectError(ManifestMismatchError):
    """The receiver's ``select`` does not fit a manifest tensor; nothing was read.

    Raised by :meth:`WeightReceiver.check` (so by every load, and for a lazy stream at
    the bucket holding the tensor) before any byte of the load is read or written, when
    ``select(name, full_shape)`` returns something other than ``None`` or a tuple of
    ``slice`` objects with step 1 that fit the full shape (at most one per dimension,
    ``0 <= start <= stop <= size`` after negative indices are counted from the end), or
    raises. The message names the tensor, its full shape and what was returned. Fix the
    ``select`` callable: return e.g. ``(slice(rank * n, (rank + 1) * n),)`` for a dim-0
    shard, or ``None`` for the whole tensor.
    """

    kind = "select"


class ManifestReleasedError(WeightSyncError, ValueError):
    """A manifest whose bucket refs were already dropped was loaded again.

    :meth:`WeightReceiver.load` consumes the refs it loads (``release=True``) so the
    sender can free its pool blocks; pass ``release=False`` to load one manifest twice.
    """


class WireDtypeError(WeightSyncError, ValueError):
    """``WeightSender(wire_dtype=...)`` asks for a dtype a tensor cannot be sent as.

    Raised by the sender while it computes the layout: for a module or mapping before
    any bucket is put, for a lazy source before the bucket holding the tensor is put
    (earlier buckets of a stream are loaded, the receivers' versions unchanged). The
    wire dtype must be a ``torch.dtype`` the transport carries, and the conversion must
    stay within the casting order (``torch.can_cast(tensor.dtype, wire_dtype)``: e.g.
    float32 -> bfloat16 or int64 -> int32, never float -> int or complex -> real).
    ``name`` is the tensor (``None`` for a bad ``wire_dtype`` argument). Fix: return
    ``None`` from the ``wire_dtype`` callable for tensors to send as they are.
    """

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name

    def __reduce__(self) -> Any:
        return (type(self), (str(self.args[0]) if self.args else "", self.name))


class WeightSyncTimeoutError(WeightSyncError, TimeoutError):
    """Nothing moved for ``timeout_s``; the message names what was waited for.

    A sync's receivers, the sender pool's room, or (``sync()``) the trainer's publish or
    stream: every wait of the weights API applies ``timeout_s`` as "no progress for this
    long", not as a bound on the whole sync."""


class StaleVersionError(WeightSyncError, ValueError):
    """A manifest or stream is not newer than the receiver's last complete load.

    Raised by :meth:`WeightReceiver.load` and by :meth:`WeightSender.stream` (when a
    receiver begins, before any bucket is put), always before anything is written: when
    the version is not newer than the receiver's last complete load, or than a load or
    stream in progress there (``loading=True``), including for a load that waited for a
    concurrent one and finds, when its turn comes, that a newer version was committed.
    ``version`` is the refused version, ``current`` the receiver's (or the one it is
    loading). Fix: pass a larger ``version=`` to ``publish``/``stream`` (e.g. the
    trainer step), or create a new receiver to start over.
    """

    def __init__(self, version: int, current: int, what: str = "manifest",
                 loading: bool = False) -> None:
        where = (f"version {current}, which this receiver is loading now" if loading else
                 f"this receiver's last complete load (version {current})")
        super().__init__(
            f"{what} version {version} is not newer than {where}; refused, nothing was "
            f"written. Publish or stream with a version > {current} (e.g. the trainer "
            "step), or create a new WeightReceiver to start over")
        self.loading = loading
        self.version = version
        self.current = current
        self.what = what

    def __reduce__(self) -> Any:
        return (type(self), (self.version, self.current, self.what, self.loading))


class SourceExhaustedError(WeightSyncError, ValueError):
    """A one-shot source (an iterator or generator) was used for a second sync.

    An iterator can be consumed once: the second ``publish``/``stream``/``layout``
    would see no tensors. Fix: pass a zero-argument callable that returns a fresh
    iterable (e.g. ``WeightSender(lambda: model.named_parameters())``), which is called
    once per sync, or pass the iterator as ``state=`` to each call.
    """


class DuplicateNameError(WeightSyncError, ValueError):
    """A lazy source yielded the same tensor name twice.

    Raised by the sender when the duplicate arrives. ``name`` is the tensor,
    ``bucket`` the bucket being filled then (it is not sent), ``applied`` the buckets
    every receiver had already loaded (streaming; empty for ``publish``, which returns
    nothing). The receivers' versions are unchanged. Fix the source so each name is
    yielded once.
    """

    def __init__(self, name: str, bucket: int, applied: Sequence[int] = (),
                 detail: str = "") -> None:
        msg = (f"the weight source yielded {name!r} twice (the second time while bucket "
               f"{bucket} was being filled); yield each name once")
        super().__init__(msg + (f"; {detail}" if detail else ""))
        self.detail = detail
        self.name = name
        self.bucket = bucket
        self.applied = tuple(applied)

    def __reduce__(self) -> Any:
        return (type(self), (self.name, self.bucket, self.applied, self.detail))


class LoaderError(WeightSyncError):
    """The receiver's ``load_weights`` callable raised while loading a bucket.

    ``bucket`` is the bucket index, ``names`` the (mapped) names passed in that call;
    the original exception is the ``__cause__``. The bucket's arena block was released
    and the receiver's version is unchanged (buckets before it stay loaded). Fix the
    loader (often: a name it does not know; map it with ``name_map`` or to ``None``).
    """

    def __init__(self, message: str, bucket: int = -1, names: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.names = tuple(names)

    def __reduce__(self) -> Any:
        return (type(self), (str(self.args[0]) if self.args else "", self.bucket, self.names))


class CommitHookError(WeightSyncError):
    """A receiver committed a version, then its ``on_commit`` callable raised.

    The version is live on that receiver (its ``version`` is ``version``): the hook runs
    after the swap, so the weights are not in question, only what the hook was to do
    (for example, resetting a prefix cache). ``receiver`` is its index in the sync's
    receivers (-1 when the driver did not say), ``committed`` every receiver that
    committed the version (when the driver knows). The hook's exception is the
    ``__cause__``. Fix the hook; the next sync calls it again.
    """

    def __init__(self, message: str, version: int = 0, receiver: int = -1,
                 committed: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.version = version
        self.receiver = receiver
        self.committed = tuple(committed)

    def __reduce__(self) -> Any:
        return (type(self), (str(self.args[0]) if self.args else "", self.version,
                             self.receiver, self.committed))


class RankLayoutError(WeightSyncError, ValueError):
    """The trainer ranks of a many-rank sync do not add up to one model.

    Raised on the driver before any receiver is called, so nothing was read or written.

    ``name`` is the tensor, ``ranks`` the trainer ranks (positions in the list passed to
    ``sync``) involved.
    """

    def __init__(self, message: str, name: str = "", ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.name = name
        self.ranks = tuple(ranks)

    def __reduce__(self) -> Any:
        return (type(self), (str(self.args[0]) if self.args else "", self.name, self.ranks))


class RankOverlapError(RankLayoutError):
    """Several trainer ranks hold one name, and not as dim-0 shards that fit together.

    Either some of them are not ``WeightSender(..., shard=(rank, world))``, or their
    shards differ in dtype or trailing dimensions. Fix: give each name to one rank, or
    declare the shards."""


class RankMissingError(RankLayoutError):
    """A sharded name lacks a rank's shard, or the ranks are not the declared world.

    Every rank of the world must hold its dim-0 shard of a sharded name (empty or not),
    and ``sync`` must get the ranks that ``shard=(rank, world)`` declares, in rank order.
    Fix: pass every rank, in rank order, and have each hold its shard."""


class TrainerRankError(WeightSyncError):
    """A trainer rank failed or died during a sync (a one-trainer sync's trainer is
    rank 0).

    ``rank`` is its position in the list passed to ``sync``; ``died`` whether its actor
    is gone. No receiver committed a version it had not read whole: the receivers that
    did not finish keep their previous version and stay usable (``committed`` lists the
    receivers that had every byte before the failure and committed). Fix: restart the
    rank, then sync again.
    """

    def __init__(self, message: str, rank: int = -1, died: bool = False,
                 committed: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.died = died
        self.committed = tuple(committed)

    def __reduce__(self) -> Any:
        return (type(self), (str(self.args[0]) if self.args else "", self.rank, self.died,
                             self.committed))


class ReceiverError(WeightSyncError):
    """A receiver of a sync died, or stopped answering for ``timeout_s``, while the sync
    still needed it.

    ``receiver`` is its index in the ``receivers`` passed to the sync, ``actor_id`` its
    actor's id (hex), ``bucket`` the bucket it failed at, ``stalled`` True when it
    stopped answering (False: it died), and ``committed`` the receivers that committed
    the version anyway: none, unless it died at the commit step itself (receivers commit
    one by one there, with no atomicity across them). The Ray error, if any, is the
    ``__cause__``. Every other receiver that is alive keeps its previous version (or
    the new one, if listed in ``committed``) and stays usable; sync the survivors again,
    without this receiver or after replacing it.
    """

    def __init__(self, message: str, receiver: int = -1, actor_id: str = "",
                 bucket: int = -1, stalled: bool = False,
                 committed: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.receiver = receiver
        self.actor_id = actor_id
        self.bucket = bucket
        self.stalled = stalled
        self.committed = tuple(committed)

    def __reduce__(self) -> Any:
        return (type(self), (str(self.args[0]) if self.args else "", self.receiver,
                             self.actor_id, self.bucket, self.stalled, self.committed))


class RelayReceiverError(ReceiverError):
    """A :class:`ReceiverError` of a relayed stream: the receiver the chain broke at.

    A stalled receiver in a chain holds up every receiver after it, so the one named is
    the first that did not pass on what it was given."""
