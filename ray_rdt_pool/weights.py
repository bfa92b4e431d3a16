"""Weight sync over ``nixl_pool``: publish a model's tensors in buckets, load them in place.

Role: the layer an RL trainer and its inference workers use to move a named state
(``Mapping[str, Tensor]`` or an ``nn.Module``'s parameters and persistent buffers) from
one actor to many, on top of the ``nixl_pool`` transport. See docs/weight-sync.md.

* **Sender** (inside the trainer actor): :class:`WeightSender` splits the state, in
  order, into buckets of at most ``bucket_bytes`` and ``ray.put``\\ s each bucket as one
  ``nixl_pool`` object (one copy into the sender pool, which is also a snapshot).
  :meth:`WeightSender.publish` puts every bucket at once and returns a picklable
  :class:`Manifest` (names, shapes, dtypes, bucket membership and the bucket refs) that
  any number of receivers may load. :meth:`WeightSender.stream` instead drives the
  receivers bucket by bucket with at most ``max_inflight`` buckets outstanding, and
  never puts a bucket before the pool has room for it, so a model larger than the pool
  syncs with bounded sender memory and no fallback registrations.
* **Receiver** (inside an inference actor): :class:`WeightReceiver` (or the one-shot
  :func:`load_manifest`) validates the whole layout against its destination first
  (names after mapping, shapes, dtype casting rule) and raises a
  :class:`ManifestMismatchError` subclass before writing anything; then loads bucket by
  bucket, in place. A bucket whose tensors all match the destination exactly (same
  dtype and shape, contiguous CPU destination) lands directly in the destination
  tensors through ``set_target_for_ref`` (no copy on the receiver); any other bucket is
  read into the receive arena and ``copy_``-ed (with dtype conversion) under
  ``torch.no_grad()``. Each bucket's views and ref are dropped as soon as it is loaded.
* **Driver**: :func:`sync` runs one sync between a trainer actor that holds a
  ``WeightSender`` and inference actors that hold a ``WeightReceiver`` (found by
  attribute name through Ray's ``__ray_call__``), in ``"stream"`` or ``"publish"`` mode.

Failure semantics (what the code guarantees; details in docs/weight-sync.md): a mismatch
raises before any destination tensor is written. When a transfer fails midway, on each
receiver the buckets before the failing one are fully loaded, the buckets after it are
untouched, and the failing bucket's destination tensors are undefined if it was landing
directly (a failed READ may have written part of it) and untouched if it was going
through the arena (the copy starts only after the whole READ succeeded).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from ray_rdt_pool.errors import InvalidInputError, PoolExhaustedError, RdtPoolError, fmt_bytes
from ray_rdt_pool.layout import BLOCK_ALIGN, align_up, packed_offsets

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "RECEIVER_ATTR",
    "SENDER_ATTR",
    "Bucket",
    "BucketPlan",
    "BucketReport",
    "DtypeMismatchError",
    "DuplicateTargetError",
    "LoadPlan",
    "LoadReport",
    "Manifest",
    "ManifestMismatchError",
    "ManifestReleasedError",
    "MissingWeightsError",
    "ShapeMismatchError",
    "StreamReport",
    "SyncReport",
    "TensorEntry",
    "UnexpectedWeightsError",
    "WeightLayout",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "can_cast",
    "load_manifest",
    "named_tensors",
    "plan_layout",
    "sync",
]

#: 32 MiB: small enough that two buckets (double buffering) fit a modest sender pool
#: and a receive arena, large enough that per-bucket costs (a few Ray task round trips,
#: one READ) are small next to the copy.
DEFAULT_BUCKET_BYTES = 32 << 20

#: Attribute names :func:`sync` looks up on the trainer and inference actors.
SENDER_ATTR = "weight_sender"
RECEIVER_ATTR = "weight_receiver"

Casting = Literal["no", "same_kind", "unsafe"]
StateLike = torch.nn.Module | Mapping[str, torch.Tensor]
NameMap = Mapping[str, str | None] | Callable[[str], str | None] | None


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


class WeightSyncError(RdtPoolError):
    """Base class of the weight-sync errors (a subclass of :class:`RdtPoolError`)."""


class ManifestMismatchError(WeightSyncError, ValueError):
    """The manifest does not fit the destination; nothing was written.

    Raised by :meth:`WeightReceiver.check` (and so by every load) after validating the
    whole layout, before the first destination tensor is touched. ``problems`` lists
    every problem found as ``(kind, name, detail)``; the exception's class is the kind
    of the first one in the order duplicate, shape, dtype, missing, unexpected.
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


_ERROR_ORDER: tuple[type[ManifestMismatchError], ...] = (
    DuplicateTargetError, ShapeMismatchError, DtypeMismatchError, MissingWeightsError,
    UnexpectedWeightsError)


class ManifestReleasedError(WeightSyncError, ValueError):
    """A manifest whose bucket refs were already dropped was loaded again.

    :meth:`WeightReceiver.load` consumes the refs it loads (``release=True``) so the
    sender can free its pool blocks; pass ``release=False`` to load one manifest twice.
    """


class WeightSyncTimeoutError(WeightSyncError, TimeoutError):
    """The sender waited longer than ``timeout_s`` for pool space or receiver acks."""


# ---------------------------------------------------------------------------------------
# Layout and manifest (picklable, no torch objects inside)
# ---------------------------------------------------------------------------------------


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidInputError(f"dtype {name!r} is not available in this torch build")
    return dt


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a layout: its name, shape, dtype and place in a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  #: torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``
    bucket: int
    index: int  #: position in its bucket's object (the list given to ``ray.put``)
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtype_of(self.dtype)


@dataclass(frozen=True)
class Bucket:
    """One bucket: the names it holds, in object order, and its packed pool size."""

    index: int
    names: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class WeightLayout:
    """Names, shapes, dtypes and bucket membership of a state, without any data.

    ``aliases`` lists ``(alias, canonical)`` pairs: names that the sender found to be the
    same tensor as an earlier name (tied weights). They are sent once and written to
    every destination they map to.
    """

    entries: tuple[TensorEntry, ...]
    buckets: tuple[Bucket, ...]
    aliases: tuple[tuple[str, str], ...] = ()
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    @property
    def total_bytes(self) -> int:
        """Payload bytes (sum of tensor sizes, aliases counted once)."""
        return sum(e.nbytes for e in self.entries)

    @property
    def names(self) -> list[str]:
        """Every name, aliases included, in layout order."""
        return [e.name for e in self.entries] + [a for a, _c in self.aliases]

    def by_name(self) -> dict[str, TensorEntry]:
        return {e.name: e for e in self.entries}


@dataclass
class Manifest:
    """What receivers need to load one published state: the layout and the bucket refs.

    ``refs[k]`` is ``[ref]`` for bucket ``k`` (a one-element list, so Ray does not resolve
    the ref when the manifest is a task argument) or ``None`` once released. Picklable;
    pass it to any number of receivers. The sender's pool blocks of bucket ``k`` are
    freed when every process holding ``refs[k]`` (the driver, each receiver's copy) has
    dropped it. ``overflow`` lists buckets that did not fit the sender pool and were
    copied into overflow memory instead: still snapshots, so the trainer may keep
    training at once, but each costs a NIXL registration (raise ``pool_bytes`` to avoid
    it). ``sender_pool_used`` is the sender's ``stats().pool_used`` right after
    publishing.
    """

    layout: WeightLayout
    refs: list[list[ObjectRef] | None]
    version: int
    overflow: tuple[int, ...] = ()
    sender_pool_used: int = 0

    @property
    def released(self) -> bool:
        """True when every bucket ref has been dropped from this copy."""
        return all(r is None for r in self.refs)

    def release(self) -> None:
        """Drop this copy's bucket refs (the sender frees once every copy is dropped)."""
        for k in range(len(self.refs)):
            self.refs[k] = None


def named_tensors(state: StateLike) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a state, in order.

    For an ``nn.Module`` these are ``state_dict(keep_vars=True)``: parameters and
    persistent buffers, under every name a tied tensor has, as the module's own
    objects (not detached copies), so a receiver writes into its live parameters.
    """
    if isinstance(state, torch.nn.Module):
        items = list(state.state_dict(keep_vars=True).items())
    elif isinstance(state, Mapping):
        items = list(state.items())
    else:
        raise InvalidInputError(
            f"a weight state is an nn.Module or a Mapping[str, Tensor], got "
            f"{type(state).__name__}")
    for name, t in items:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise InvalidInputError(
                f"weight state entry {name!r} is {type(t).__name__}; every entry must map a "
                "str name to a torch.Tensor")
    return items


def _identity_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype, t.device)


def plan_layout(state: StateLike, bucket_bytes: int = DEFAULT_BUCKET_BYTES
                ) -> tuple[WeightLayout, list[list[torch.Tensor]]]:
    """Split a state, in order, into buckets of at most ``bucket_bytes`` packed bytes.

    Returns the layout and, per bucket, the (detached) tensors to put. A tensor larger
    than ``bucket_bytes`` gets a bucket of its own. Names that are the same tensor as an
    earlier name (same storage, offset, shape, strides and dtype) become aliases.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InvalidInputError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    items = named_tensors(state)
    seen: dict[tuple[Any, ...], str] = {}
    aliases: list[tuple[str, str]] = []
    groups: list[list[tuple[str, torch.Tensor]]] = []
    cur: list[tuple[str, torch.Tensor]] = []
    end = 0
    for name, t in items:
        key = _identity_key(t)
        if t.numel() > 0 and key in seen:
            aliases.append((name, seen[key]))
            continue
        seen.setdefault(key, name)
        size = t.element_size()
        n = t.numel() * size
        grown = align_up(align_up(end, size) + n, BLOCK_ALIGN)
        if cur and grown > bucket_bytes:
            groups.append(cur)
            cur, end = [], 0
        cur.append((name, t))
        end = align_up(end, size) + n
    if cur:
        groups.append(cur)
    entries: list[TensorEntry] = []
    buckets: list[Bucket] = []
    tensors: list[list[torch.Tensor]] = []
    for k, group in enumerate(groups):
        sizes = [t.numel() * t.element_size() for _n, t in group]
        _offsets, total = packed_offsets(sizes, [t.element_size() for _n, t in group])
        for i, ((name, t), n) in enumerate(zip(group, sizes)):
            entries.append(TensorEntry(name, tuple(t.shape), _dtype_str(t.dtype), k, i, n))
        buckets.append(Bucket(k, tuple(n for n, _t in group), total))
        tensors.append([t.detach() for _n, t in group])
    return WeightLayout(tuple(entries), tuple(buckets), tuple(aliases), bucket_bytes), tensors


# ---------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BucketReport:
    """One bucket loaded on one receiver."""

    bucket: int
    nbytes: int
    direct: bool  #: landed in the destination tensors (no receiver-side copy)
    seconds: float


@dataclass(frozen=True)
class LoadReport:
    """One receiver's load of one version."""

    version: int
    buckets: int
    nbytes: int
    direct_buckets: int
    copied_buckets: int
    skipped: int  #: manifest tensors not written (mapped to None, or extra with strict=False)
    seconds: float


@dataclass(frozen=True)
class StreamReport:
    """One streaming sync as the sender saw it.

    ``pool_used_samples[k]`` is the sender's ``stats().pool_used`` right after bucket
    ``k`` was put; pool use only grows at a put, so their maximum is the peak.
    """

    version: int
    buckets: int
    nbytes: int
    receivers: int
    max_inflight: int
    seconds: float
    pool_capacity: int
    peak_pool_used: int
    pool_used_samples: tuple[int, ...]
    fallbacks: int  #: fallback registrations during the stream (0 by design)
    pool_wait_seconds: float  #: time spent waiting for the pool to free a bucket
    loads: tuple[LoadReport, ...] = ()


@dataclass(frozen=True)
class SyncReport:
    """One :func:`sync` as the driver saw it."""

    mode: str
    version: int
    seconds: float
    nbytes: int
    buckets: int
    loads: tuple[LoadReport, ...]
    stream: StreamReport | None = None
    sender_pool_used: int = 0  #: peak (stream) or after-publish (publish) sender pool bytes

    @property
    def gbps(self) -> float:
        """Payload GB/s per receiver (bytes of one copy over the sync's wall time)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------
# Sender
# ---------------------------------------------------------------------------------------


def _transport() -> str:
    from ray_rdt_pool import TRANSPORT

    return TRANSPORT


def _stats() -> Any:
    from ray_rdt_pool import stats

    return stats()


def _pool_capacity() -> int:
    s = _stats()
    if s.pool_capacity:
        return int(s.pool_capacity)
    from ray_rdt_pool.transport import runtime

    return int(runtime().config.pool_capacity)


class WeightSender:
    """Publishes a named state as ``nixl_pool`` buckets. Lives in the trainer actor.

    Args:
        source: The state to send: an ``nn.Module``, a ``Mapping[str, Tensor]``, or a
            zero-argument callable returning either. Optional when every call passes
            ``state=``.
        bucket_bytes: Most packed bytes per bucket. For :meth:`stream` keep
            ``max_inflight * bucket_bytes`` within the sender's ``pool_bytes``, and
            ``bucket_bytes`` within each receiver's ``arena_bytes`` (buckets that are
            copied rather than landed directly go through the arena).

    Each publish or stream snapshots the state (the pool copy is made at ``ray.put``),
    so the trainer may keep training as soon as the call returns.
    """

    def __init__(self, source: StateLike | Callable[[], StateLike] | None = None, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) \
                or bucket_bytes <= 0:
            raise InvalidInputError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self.source = source
        self.bucket_bytes = bucket_bytes
        self.version = 0

    def _state(self, state: StateLike | None) -> StateLike:
        if state is not None:
            return state
        src = self.source
        if src is None:
            raise InvalidInputError("WeightSender has no source; pass state= or source=")
        if callable(src) and not isinstance(src, torch.nn.Module):
            return src()
        return src

    def layout(self, state: StateLike | None = None) -> WeightLayout:
        """The layout the next publish would have (no data is moved)."""
        return plan_layout(self._state(state), self.bucket_bytes)[0]

    def publish(self, state: StateLike | None = None) -> Manifest:
        """Put every bucket now and return the manifest (version = previous + 1).

        Every bucket is a snapshot: the trainer may modify its weights as soon as this
        returns. Buckets that do not fit the pool are copied into overflow memory
        (listed in ``Manifest.overflow``; with ``strict=True`` in the pool config they
        raise ``PoolExhaustedError`` instead). Nothing is ever sent by reference unless
        the trainer registered its memory with ``register_memory()``. Use :meth:`stream`
        for states larger than the pool.
        """
        import ray

        layout, groups = plan_layout(self._state(state), self.bucket_bytes)
        transport = _transport()
        refs: list[list[ObjectRef] | None] = []
        overflow: list[int] = []
        fallbacks = _stats().fallbacks
        for k, tensors in enumerate(groups):
            refs.append([ray.put(tensors, _tensor_transport=transport)])
            now = _stats().fallbacks
            if now != fallbacks:
                overflow.append(k)
                fallbacks = now
        self.version += 1
        return Manifest(layout, refs, self.version, tuple(overflow), int(_stats().pool_used))

    def stream(self, receivers: Sequence[ActorHandle], state: StateLike | None = None, *,
               receiver_attr: str = RECEIVER_ATTR, max_inflight: int = 2,
               timeout_s: float = 300.0) -> StreamReport:
        """Sync ``receivers`` bucket by bucket with bounded sender pool memory.

        Each receiver actor must hold a :class:`WeightReceiver` at ``receiver_attr``.
        First every receiver validates the layout (a mismatch raises here, before any
        bucket is put). Then for each bucket: wait until fewer than ``max_inflight``
        buckets are unacknowledged and the pool has room for it, ``ray.put`` it, and ask
        every receiver to load it (``__ray_call__``); the local ref is dropped at once,
        so the pool blocks return when the receivers are done with it. "Room" means the
        pool has the bucket's bytes free and this stream's pool use (``pool_used`` beyond
        what was in use when the stream began) stays within
        ``max_inflight * bucket_bytes``, so acknowledged buckets whose blocks Ray has not
        garbage-collected yet still count. No bucket is ever put without room, so
        there is no fallback registration. With
        ``max_inflight >= 2`` packing bucket ``k+1`` overlaps the receivers' reads of
        bucket ``k``; ``max_inflight=1`` serialises them (no pipelining).

        Raises ``PoolExhaustedError`` up front if a bucket cannot fit the pool at all,
        :class:`WeightSyncTimeoutError` if pool space or acks take longer than
        ``timeout_s``, and re-raises a receiver's error (its other buckets still drain).
        """
        import ray

        if not receivers:
            raise InvalidInputError("stream() needs at least one receiver actor")
        ids = [r._actor_id.hex() for r in receivers]
        if len(set(ids)) != len(ids):
            raise InvalidInputError("stream() got the same receiver actor twice")
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) \
                or max_inflight < 1:
            raise InvalidInputError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        t0 = time.perf_counter()
        layout, groups = plan_layout(self._state(state), self.bucket_bytes)
        capacity = _pool_capacity()
        for b in layout.buckets:
            if b.nbytes > capacity:
                s = _stats()
                raise PoolExhaustedError(
                    b.nbytes, int(s.pool_free) if s.pool_capacity else capacity,
                    int(s.pool_largest_free_block) if s.pool_capacity else capacity,
                    capacity, what=f"sender pool (bucket {b.index}: {b.names[:3]}...)",
                    remedy="streaming never falls back: lower bucket_bytes or raise "
                           "pool_bytes (RAY_RDT_POOL_BYTES) above the largest tensor")
        version = self.version + 1
        session = f"{os.getpid()}-{version}-{uuid.uuid4().hex[:8]}"
        transport = _transport()
        deadline_s = float(timeout_s)

        begins = [r.__ray_call__.remote(_remote_begin, receiver_attr, session, layout, version)
                  for r in receivers]
        skipped = _get_all(begins, deadline_s, "validating the layout on the receivers")

        st0 = _stats()
        fallbacks0 = st0.fallbacks
        # Double buffering in bytes: this stream's buckets may hold at most max_inflight
        # buckets' worth of the pool, counting buckets that were acknowledged but whose
        # blocks Ray has not garbage-collected yet.
        biggest = max((b.nbytes for b in layout.buckets), default=0)
        limit = min(capacity, int(st0.pool_used) + max_inflight * max(self.bucket_bytes,
                                                                      biggest))
        samples: list[int] = []
        inflight: deque[list[Any]] = deque()
        acked: list[list[BucketReport]] = [[] for _ in receivers]
        wait_s = 0.0
        try:
            for k, tensors in enumerate(groups):
                while len(inflight) >= max_inflight:
                    _collect(inflight.popleft(), acked, deadline_s)
                wait_s += _wait_for_pool(layout.buckets[k].nbytes, limit, capacity, deadline_s)
                box = [ray.put(tensors, _tensor_transport=transport)]
                try:
                    samples.append(int(_stats().pool_used))
                    inflight.append([r.__ray_call__.remote(_remote_bucket, receiver_attr,
                                                           session, k, box) for r in receivers])
                finally:
                    box.clear()  # the tasks hold the ref now; ours must not pin the pool
            while inflight:
                _collect(inflight.popleft(), acked, deadline_s)
        except BaseException:
            # Let the receivers finish (or fail) what they hold so every ref drains.
            pending = [a for acks in inflight for a in acks]
            if pending:
                ray.wait(pending, num_returns=len(pending), timeout=deadline_s)
            raise
        self.version = version
        loads = tuple(_summarise(version, reps, sk) for reps, sk in zip(acked, skipped))
        return StreamReport(
            version=version, buckets=len(layout.buckets), nbytes=layout.total_bytes,
            receivers=len(receivers), max_inflight=max_inflight,
            seconds=time.perf_counter() - t0, pool_capacity=capacity,
            peak_pool_used=max(samples, default=0), pool_used_samples=tuple(samples),
            fallbacks=int(_stats().fallbacks - fallbacks0), pool_wait_seconds=wait_s,
            loads=loads)


def _get_all(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as e:
        raise WeightSyncTimeoutError(f"{what} took longer than {timeout_s}s") from e


def _collect(acks: list[Any], acked: list[list[BucketReport]], timeout_s: float) -> None:
    import ray

    # Wait for every receiver first, so one receiver's error is raised only after the
    # others are done with this bucket too (their refs drain before we give up).
    ray.wait(acks, num_returns=len(acks), timeout=timeout_s)
    for i, rep in enumerate(_get_all(acks, timeout_s, "waiting for receivers to load a bucket")):
        acked[i].append(rep)


def _wait_for_pool(nbytes: int, limit: int, capacity: int, timeout_s: float) -> float:
    """Block until ``nbytes`` fit the sender pool with its use staying within ``limit``.

    Returns the seconds waited.
    """
    from ray_rdt_pool.transport import runtime

    def fits(s: Any) -> bool:
        used = s.pool_used if s.pool_capacity else 0
        if not s.pool_capacity:
            free = capacity
        elif s.pool_device == "cuda":
            free = s.pool_largest_free_block  # a CUDA pack needs one contiguous block
        else:
            free = s.pool_free
        return bool(free >= nbytes and used + nbytes <= limit)

    t0 = time.monotonic()
    if runtime().wait_for(fits, timeout_s) is None:
        s = _stats()
        used = s.pool_used if s.pool_capacity else 0
        raise WeightSyncTimeoutError(
            f"for {timeout_s}s the sender pool had {fmt_bytes(int(used))} in use of "
            f"{fmt_bytes(capacity)} (this stream may use up to {fmt_bytes(limit)}), but "
            f"the next bucket needs {fmt_bytes(nbytes)}; other objects hold the pool "
            "(drop their refs) or a receiver is stuck")
    return time.monotonic() - t0


def _summarise(version: int, reports: Sequence[BucketReport], skipped: int = 0) -> LoadReport:
    direct = sum(r.direct for r in reports)
    return LoadReport(version, len(reports), sum(r.nbytes for r in reports), direct,
                      len(reports) - direct, skipped, sum(r.seconds for r in reports))


# ---------------------------------------------------------------------------------------
# Receiver
# ---------------------------------------------------------------------------------------


def can_cast(src: torch.dtype, dst: torch.dtype, casting: Casting = "same_kind") -> bool:
    """The dtype rule of a load: may a ``src`` tensor be written into a ``dst`` tensor?"""
    if src == dst:
        return True
    if casting == "no":
        return False
    if casting == "unsafe":
        return True
    if casting == "same_kind":
        return bool(torch.can_cast(src, dst))
    raise InvalidInputError(f"casting must be 'no', 'same_kind' or 'unsafe', got {casting!r}")


def _mapper(name_map: NameMap) -> Callable[[str], str | None]:
    if name_map is None:
        return lambda n: n
    if isinstance(name_map, Mapping):
        m = name_map
        return lambda n: m.get(n, n)
    if callable(name_map):
        return name_map
    raise InvalidInputError(f"name_map must be a mapping, a callable or None, got "
                            f"{type(name_map).__name__}")


@dataclass
class BucketPlan:
    """How one bucket is loaded: landed in ``targets`` (direct) or copied via ``copies``."""

    index: int
    nbytes: int
    targets: list[torch.Tensor] | None  # direct landing buffers, one per object tensor
    copies: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (idx, dest)


@dataclass
class LoadPlan:
    """The result of :meth:`WeightReceiver.check`: a validated layout, planned per bucket."""

    layout: WeightLayout
    buckets: list[BucketPlan]
    skipped: int


def _can_land(d: torch.Tensor, e: TensorEntry) -> bool:
    return (d.device.type == "cpu" and d.dtype == e.torch_dtype and tuple(d.shape) == e.shape
            and d.is_contiguous() and not d.is_conj() and not d.is_neg())


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and _identity_key(a) == _identity_key(b)


class WeightReceiver:
    """Loads manifests into a destination in place. Lives in the inference actor.

    Args:
        dest: An ``nn.Module`` (its ``state_dict(keep_vars=True)``: live parameters and
            persistent buffers) or a ``Mapping[str, Tensor]`` of the tensors to write.
        name_map: Maps a manifest name to a destination name: a dict (unlisted names
            keep their name) or a callable; ``None`` as the value skips the tensor.
        casting: dtype rule, see :func:`can_cast`. The destination's dtype is the
            target: fp32 weights load into a bf16 model converted.
        strict: Raise on destination tensors no manifest tensor maps to
            (:class:`MissingWeightsError`) and on manifest tensors whose mapped name is
            not in the destination (:class:`UnexpectedWeightsError`). With ``False``
            both are ignored (extras are skipped).
        direct: Land exactly matching buckets in the destination tensors
            (``set_target_for_ref``); ``False`` always reads into the arena and copies.

    ``version`` is the version of the last manifest fully loaded (0 before any).
    """

    def __init__(self, dest: StateLike, *, name_map: NameMap = None,
                 casting: Casting = "same_kind", strict: bool = True,
                 direct: bool = True) -> None:
        named_tensors(dest)  # validate early
        can_cast(torch.float32, torch.float32, casting)
        self.dest = dest
        self.name_map = name_map
        self.casting = casting
        self.strict = strict
        self.direct = direct
        self.version = 0
        self._session: tuple[str, LoadPlan, int] | None = None
        self._next = 0
        self._reports: list[BucketReport] = []
        self._failed: str | None = None

    # -- validation --

    def check(self, layout: WeightLayout) -> LoadPlan:
        """Validate ``layout`` against the destination and plan the load; writes nothing.

        Raises a :class:`ManifestMismatchError` subclass listing every problem.
        """
        dests = dict(named_tensors(self.dest))
        mapname = _mapper(self.name_map)
        problems: list[tuple[str, str, str]] = []
        claimed: dict[str, str] = {}
        resolved: dict[str, torch.Tensor | None] = {}
        by_name = layout.by_name()
        skipped = 0
        sources = [(e.name, e) for e in layout.entries]
        sources += [(a, by_name[c]) for a, c in layout.aliases if c in by_name]
        for name, e in sources:
            dn = mapname(name)
            if dn is None:
                resolved[name] = None
                skipped += 1
                continue
            d = dests.get(dn)
            if d is None:
                resolved[name] = None
                skipped += 1
                if self.strict:
                    problems.append(("unexpected", name, f"{name!r} (as {dn!r}) is not in "
                                     "the destination; map it to None to skip it"))
                continue
            if dn in claimed:
                problems.append(("duplicate", name, f"{name!r} and {claimed[dn]!r} both map "
                                 f"to {dn!r}"))
                continue
            claimed[dn] = name
            if tuple(d.shape) != e.shape:
                problems.append(("shape", name, f"{name!r} is {e.shape} in the manifest but "
                                 f"{dn!r} is {tuple(d.shape)} in the destination"))
            elif not can_cast(e.torch_dtype, d.dtype, self.casting):
                problems.append(("dtype", name, f"{name!r} is {e.dtype} in the manifest and "
                                 f"{dn!r} is {_dtype_str(d.dtype)}; casting={self.casting!r} "
                                 "does not allow that conversion"))
            resolved[name] = d
        if self.strict:
            for dn in dests:
                if dn not in claimed:
                    problems.append(("missing", dn, f"destination {dn!r} receives no tensor "
                                     "from the manifest"))
        if problems:
            kinds = {p[0] for p in problems}
            cls = next(c for c in _ERROR_ORDER if c.kind in kinds)
            shown = "\n  ".join(f"[{k}] {d}" for k, _n, d in problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise cls(f"the weight manifest does not match the destination ({len(problems)} "
                      f"problem(s); nothing was written):\n  {shown}{more}", problems)
        return LoadPlan(layout, self._plan_buckets(layout, resolved), skipped)

    def _plan_buckets(self, layout: WeightLayout, resolved: dict[str, torch.Tensor | None]
                      ) -> list[BucketPlan]:
        alias_of: dict[str, list[str]] = {}
        for a, c in layout.aliases:
            alias_of.setdefault(c, []).append(a)
        plans: list[BucketPlan] = []
        by_bucket: dict[int, list[TensorEntry]] = {}
        for e in layout.entries:
            by_bucket.setdefault(e.bucket, []).append(e)
        for b in layout.buckets:
            entries = sorted(by_bucket.get(b.index, []), key=lambda e: e.index)
            dests = [resolved.get(e.name) for e in entries]
            land = self.direct and all(d is not None and _can_land(d, e)
                                       for d, e in zip(dests, entries))
            if land:
                ptrs = [d.data_ptr() for d in dests if d is not None and d.numel() > 0]
                land = len(ptrs) == len(set(ptrs))
            plan = BucketPlan(b.index, b.nbytes, list(dests) if land else None)  # type: ignore
            for e, d in zip(entries, dests):
                if not land and d is not None:
                    plan.copies.append((e.index, d))
                for a in alias_of.get(e.name, ()):
                    ad = resolved.get(a)
                    if ad is not None and not (d is not None and _same_memory(ad, d)):
                        plan.copies.append((e.index, ad))
            plans.append(plan)
        return plans

    # -- loading --

    def _load_bucket(self, plan: BucketPlan, ref: ObjectRef) -> BucketReport:
        import ray

        t0 = time.perf_counter()
        direct = plan.targets is not None
        if plan.targets is not None:
            from ray.experimental import set_target_for_ref

            set_target_for_ref(ref, plan.targets)
            got = ray.get(ref)
            if any(g is not t and g.data_ptr() != t.data_ptr()
                   for g, t in zip(got, plan.targets)):
                # Ray ignored the targets (e.g. one was collected): copy instead.
                direct = False
                with torch.no_grad():
                    for g, t in zip(got, plan.targets):
                        t.copy_(g)
            src: list[torch.Tensor] = plan.targets
        else:
            got = ray.get(ref)
            src = got
        if plan.copies:
            with torch.no_grad():
                for idx, d in plan.copies:
                    d.copy_(src[idx])
        del got, src
        return BucketReport(plan.index, plan.nbytes, direct, time.perf_counter() - t0)

    def load(self, manifest: Manifest, *, release: bool = True) -> LoadReport:
        """Validate, then load every bucket of ``manifest`` in order, in place.

        With ``release=True`` each bucket's ref is removed from ``manifest`` (this
        process's copy) as soon as the bucket is loaded.
        """
        plan = self.check(manifest.layout)
        missing = [k for k, r in enumerate(manifest.refs) if r is None]
        if missing:
            raise ManifestReleasedError(
                f"bucket(s) {missing[:10]} of manifest version {manifest.version} were already "
                "released; load a fresh manifest, or pass release=False to load one twice")
        reports: list[BucketReport] = []
        for bp in plan.buckets:
            box = manifest.refs[bp.index]
            assert box is not None
            reports.append(self._load_bucket(bp, box[0]))
            if release:
                manifest.refs[bp.index] = None
            del box
        self.version = manifest.version
        return _summarise(manifest.version, reports, plan.skipped)

    # -- streaming (called through __ray_call__ by WeightSender.stream) --

    def begin_stream(self, session: str, layout: WeightLayout, version: int) -> int:
        """Validate a streamed layout and get ready for its buckets.

        Returns the number of manifest tensors this receiver will skip.
        """
        self._session = None
        plan = self.check(layout)
        self._session = (session, plan, version)
        self._next = 0
        self._reports = []
        self._failed = None
        return plan.skipped

    def load_stream_bucket(self, session: str, k: int, box: list[ObjectRef]) -> BucketReport:
        """Load bucket ``k`` of the current stream (buckets must arrive in order)."""
        if self._session is None or self._session[0] != session:
            raise WeightSyncError(f"bucket {k} of stream {session} arrived, but this receiver "
                                  "is not in that stream (a newer begin replaced it?)")
        _sid, plan, version = self._session
        if self._failed is not None:
            raise WeightSyncError(f"bucket {k} skipped: {self._failed}")
        if k != self._next:
            self._failed = f"bucket {k} arrived while bucket {self._next} was expected"
            raise WeightSyncError(self._failed + "; receivers must be sync (in-order) actors")
        try:
            rep = self._load_bucket(plan.buckets[k], box[0])
        except BaseException as e:
            self._failed = f"bucket {k} failed on this receiver: {e!r}"
            raise
        finally:
            box.clear()
        self._reports.append(rep)
        self._next = k + 1
        if self._next == len(plan.buckets):
            self.version = version
            self._session = None
        return rep


def load_manifest(manifest: Manifest, dest: StateLike, *, name_map: NameMap = None,
                  casting: Casting = "same_kind", strict: bool = True, direct: bool = True,
                  release: bool = True) -> LoadReport:
    """Load ``manifest`` into ``dest`` in place: ``WeightReceiver(dest, ...).load(...)``."""
    receiver = WeightReceiver(dest, name_map=name_map, casting=casting, strict=strict,
                              direct=direct)
    return receiver.load(manifest, release=release)


# ---------------------------------------------------------------------------------------
# Actor-side entry points (run through ActorHandle.__ray_call__) and the driver helper
# ---------------------------------------------------------------------------------------


def _find(actor: Any, attr: str, cls: type) -> Any:
    obj = getattr(actor, attr, None)
    if not isinstance(obj, cls):
        raise WeightSyncError(
            f"actor {type(actor).__name__} has no {cls.__name__} at attribute {attr!r} (found "
            f"{type(obj).__name__}); create one in __init__, e.g. self.{attr} = "
            f"{cls.__name__}(self.model)")
    return obj


def _remote_begin(actor: Any, attr: str, session: str, layout: WeightLayout,
                  version: int) -> int:
    return _find(actor, attr, WeightReceiver).begin_stream(session, layout, version)


def _remote_bucket(actor: Any, attr: str, session: str, k: int, box: list[ObjectRef]
                   ) -> BucketReport:
    return _find(actor, attr, WeightReceiver).load_stream_bucket(session, k, box)


def _remote_load(actor: Any, attr: str, manifest: Manifest) -> LoadReport:
    return _find(actor, attr, WeightReceiver).load(manifest)


def _remote_publish(actor: Any, attr: str) -> Manifest:
    return _find(actor, attr, WeightSender).publish()


def _remote_stream(actor: Any, attr: str, receivers: list[ActorHandle], receiver_attr: str,
                   max_inflight: int, timeout_s: float) -> StreamReport:
    return _find(actor, attr, WeightSender).stream(
        receivers, receiver_attr=receiver_attr, max_inflight=max_inflight, timeout_s=timeout_s)



def sync(trainer: ActorHandle, receivers: Sequence[ActorHandle], *,
         mode: Literal["stream", "publish"] = "stream", max_inflight: int = 2,
         sender_attr: str = SENDER_ATTR, receiver_attr: str = RECEIVER_ATTR,
         timeout_s: float = 300.0) -> SyncReport:
    """Driver-side: sync the trainer's weights to every receiver and wait for it.

    The trainer actor holds a :class:`WeightSender` at ``sender_attr``; each receiver a
    :class:`WeightReceiver` at ``receiver_attr``. ``mode="stream"`` runs
    :meth:`WeightSender.stream` in the trainer (bounded pool memory, pipelined with
    ``max_inflight >= 2``). ``mode="publish"`` puts every bucket, hands the manifest to
    all receivers at once (they load concurrently), then drops the driver's copy, so the
    sender frees the pool when the last receiver is done.
    """
    import ray

    receivers = list(receivers)
    t0 = time.perf_counter()
    if mode == "stream":
        rep: StreamReport = _get_all(
            [trainer.__ray_call__.remote(_remote_stream, sender_attr, receivers,
                                         receiver_attr, max_inflight, timeout_s)],
            timeout_s * 2, "the streaming sync")[0]
        return SyncReport("stream", rep.version, time.perf_counter() - t0, rep.nbytes,
                          rep.buckets, rep.loads, rep, rep.peak_pool_used)
    if mode != "publish":
        raise InvalidInputError(f"mode must be 'stream' or 'publish', got {mode!r}")
    manifest: Manifest = ray.get(trainer.__ray_call__.remote(_remote_publish, sender_attr),
                                 timeout=timeout_s)
    layout, version, used = manifest.layout, manifest.version, manifest.sender_pool_used
    try:
        loads = tuple(_get_all([r.__ray_call__.remote(_remote_load, receiver_attr, manifest)
                                for r in receivers], timeout_s, "loading the manifest"))
    finally:
        manifest.release()  # even on error: a held traceback must not pin the pool
        del manifest
    return SyncReport("publish", version, time.perf_counter() - t0, layout.total_bytes,
                      len(layout.buckets), loads, None, used)
