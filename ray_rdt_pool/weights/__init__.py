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
  never packs a bucket before the pool has room for it, so a model larger than the pool
  syncs with bounded sender memory and no fallback registrations; its buckets are pool
  objects the stream owns (:class:`PoolBucket`, no Ray object), freed at the receivers'
  acknowledgements. When every receiver shares the trainer's Ray node, a stream sends
  buckets as :class:`SourceBucket` addresses instead, and the receivers copy them
  straight out of the trainer's tensors; otherwise a module's buckets go by reference,
  READ over NIXL from the trainer's tensors (``source_reads``; the tensors are kept until
  every receiver acknowledged their bucket, and ``stream()`` returns only after that).
  ``wire_dtype`` sends tensors in another dtype (e.g. fp32 as bf16), converted by the
  pack copy itself.
* **Receiver** (inside an inference actor): :class:`WeightReceiver` (or the one-shot
  :func:`load_manifest`) validates the whole layout against its destination first
  (names after mapping, shapes, dtype casting rule) and raises a
  :class:`ManifestMismatchError` subclass before writing anything; then loads bucket by
  bucket, in place. A bucket whose tensors all match the destination exactly (same
  dtype and shape, contiguous CPU destination) lands directly in the destination
  tensors through ``set_target_for_ref`` (no copy on the receiver); any other bucket is
  read into the receive arena and ``copy_``-ed (with dtype conversion) under
  ``torch.no_grad()``. Each bucket's views and ref are dropped as soon as it is loaded.
  With ``select`` a receiver reads only part of each tensor (a tensor-parallel shard)
  through ``transport.fetch_selected``. One writer at a time: a load holds the receiver
  while it writes, a stream from its begin to its commit, which the sender sends only
  once every receiver acknowledged every bucket; an older writer is refused, a newer
  one supersedes a stream (which then never commits), so the version never goes down
  and always names the bytes held.
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

import asyncio
import logging
import math
import os
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from ray_rdt_pool.core.layout import BLOCK_ALIGN, align_up, packed_offsets
from ray_rdt_pool.core.selection import Slices
from ray_rdt_pool.errors import (
    DtypeMismatchError,
    DuplicateNameError,
    DuplicateTargetError,
    InvalidInputError,
    LoaderError,
    ManifestMismatchError,
    ManifestReleasedError,
    MissingWeightsError,
    PoolExhaustedError,
    SelectError,
    ShapeMismatchError,
    SourceExhaustedError,
    StaleVersionError,
    UnexpectedWeightsError,
    WeightSyncError,
    WeightSyncTimeoutError,
    WireDtypeError,
    fmt_bytes,
)
from ray_rdt_pool.registry import storage_key

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from ray_rdt_pool.same_node.shared import SourceProcess

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "RECEIVER_ATTR",
    "SENDER_ATTR",
    "Bucket",
    "BucketLayout",
    "BucketPlan",
    "BucketReport",
    "DtypeMismatchError",
    "DuplicateNameError",
    "DuplicateTargetError",
    "LoadPlan",
    "LoadReport",
    "LoaderError",
    "Manifest",
    "ManifestMismatchError",
    "ManifestReleasedError",
    "MissingWeightsError",
    "SelectError",
    "ShapeMismatchError",
    "SourceBucket",
    "SourceExhaustedError",
    "StaleVersionError",
    "StreamReport",
    "SyncReport",
    "TensorEntry",
    "UnexpectedWeightsError",
    "WeightLayout",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "WireDtypeError",
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
#: ``(name, tensor)`` pairs, e.g. ``model.named_parameters()`` or a generator.
Pairs = Iterable[tuple[str, torch.Tensor]]
SourceLike = StateLike | Pairs
Source = SourceLike | Callable[[], SourceLike]
#: What ``load_weights`` receives: ``(name, tensor)`` pairs valid during the call only.
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
NameMap = Mapping[str, str | None] | Callable[[str], str | None] | None
#: ``WeightSender(wire_dtype=)``: one dtype for every floating-point tensor, or
#: ``(name, tensor) -> dtype | None`` per tensor (``None``: send as it is).
WireDtype = torch.dtype | Callable[[str, torch.Tensor], torch.dtype | None] | None
#: ``WeightReceiver(select=)``: ``(name, full_shape) -> slices | None`` (``None``: all of it).
Select = Callable[[str, tuple[int, ...]], Sequence[slice] | slice | None]


_ERROR_ORDER: tuple[type[ManifestMismatchError], ...] = (
    SelectError, DuplicateTargetError, ShapeMismatchError, DtypeMismatchError, MissingWeightsError,
    UnexpectedWeightsError)


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
    #: unique per publish: a receiver may load the manifest it loaded last once more
    id: str = ""

    @property
    def released(self) -> bool:
        """True when every bucket ref has been dropped from this copy."""
        return all(r is None for r in self.refs)

    def release(self) -> None:
        """Drop this copy's bucket refs (the sender frees once every copy is dropped)."""
        for k in range(len(self.refs)):
            self.refs[k] = None


def named_tensors(state: StateLike, what: str | None = "weight"
                  ) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a state, in order, each checked with
    :func:`_check_weight` (``what`` names the tensors in its errors; None: not checked).

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
        if what is not None:
            _check_weight(name, t, what)
    return items


def _check_weight(name: str, t: torch.Tensor, what: str) -> None:
    """InvalidInputError unless ``t`` is a dense CPU or CUDA tensor whose bytes have
    memory behind them (not on the meta device, a ZeroTensor, a DTensor, or a storage
    resized or shrunk under it), and, as a destination, one whose elements each have
    bytes of their own. Anything else is read or written out of bounds, or not at all."""
    from ray_rdt_pool.memory.tensors import memory_problem

    desc = f"{what} {name!r} ({tuple(t.shape)} {t.dtype})"
    if t.is_nested or t.layout is not torch.strided:
        raise InvalidInputError(f"{desc} has layout {t.layout}; only dense (strided) "
                                "tensors are synced: convert with t.to_dense()")
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidInputError(
            f"{desc} is on the {t.device.type} device, which holds no bytes to "
            f"{'write' if what != 'weight' else 'send'}; materialize it on cpu or cuda "
            "first (for a module built on meta: module.to_empty(device=...))")
    why = memory_problem(t)
    if why is not None:
        raise InvalidInputError(f"{desc} {why}")
    if what != "weight" and t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:
        raise InvalidInputError(
            f"{desc} has elements that share memory (strides {t.stride()}, an expanded "
            "view): a load would write several weights into one place. Load into a "
            "tensor with memory of its own (t.contiguous()) and expand that")


def _identity_key(t: torch.Tensor) -> tuple[Any, ...]:
    # The lazy conjugate and negative bits are part of what a tensor reads as: c.conj()
    # shares c's memory but is another tensor.
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype, t.device, t.is_conj(), t.is_neg())


def _copy_all(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``d.copy_(src)`` for each pair as a load does it: outside autograd, and for a
    destination made under ``torch.inference_mode()`` (an engine's weights, often)
    inside that mode, the only one that lets it be written in place."""
    with torch.no_grad():
        for d, src in pairs:
            if d.is_inference():
                with torch.inference_mode():
                    d.copy_(src)
            else:
                d.copy_(src)


def _check_wire_dtype(wire_dtype: WireDtype) -> None:
    if wire_dtype is None or callable(wire_dtype):
        return
    if not isinstance(wire_dtype, torch.dtype) or not wire_dtype.is_floating_point:
        raise WireDtypeError(
            f"wire_dtype must be a floating-point torch.dtype (applied to every "
            f"floating-point tensor), a callable (name, tensor) -> dtype | None, or None; "
            f"got {wire_dtype!r}")
    _wire_carries(wire_dtype, None)


def _wire_carries(dt: torch.dtype, name: str | None) -> None:
    from ray_rdt_pool.core.wire import DTYPES

    if _dtype_str(dt) not in DTYPES:
        who = f" for {name!r}" if name is not None else ""
        raise WireDtypeError(f"wire_dtype{who} is {dt}, which the nixl_pool wire does not "
                             f"carry; use one of {', '.join(DTYPES)}", name)


def _wire_of(wire_dtype: WireDtype, name: str, t: torch.Tensor) -> torch.dtype:
    """The dtype ``t`` is sent as: ``t.dtype`` unless ``wire_dtype`` says otherwise."""
    if wire_dtype is None:
        return t.dtype
    if isinstance(wire_dtype, torch.dtype):  # checked in WeightSender.__init__
        return wire_dtype if t.is_floating_point() else t.dtype
    got = wire_dtype(name, t)
    if got is None or got == t.dtype:
        return t.dtype
    if not isinstance(got, torch.dtype):
        raise WireDtypeError(
            f"wire_dtype({name!r}, <{_dtype_str(t.dtype)} tensor>) returned "
            f"{type(got).__name__} {got!r}; return a torch.dtype, or None to send {name!r} "
            "as it is", name)
    _wire_carries(got, name)
    if not torch.can_cast(t.dtype, got):
        raise WireDtypeError(
            f"wire_dtype asks to send {name!r} ({_dtype_str(t.dtype)}) as "
            f"{_dtype_str(got)}, a cast down the order bool -> integer -> floating -> "
            f"complex; return None for {name!r} to send it as {_dtype_str(t.dtype)}", name)
    return got


def plan_layout(state: StateLike, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                wire_dtype: WireDtype = None
                ) -> tuple[WeightLayout, list[list[torch.Tensor]]]:
    """Split a state, in order, into buckets of at most ``bucket_bytes`` packed bytes.

    Returns the layout and, per bucket, the (detached) tensors to put. A tensor larger
    than ``bucket_bytes`` gets a bucket of its own. Names that are the same tensor as an
    earlier name (same storage, offset, shape, strides and dtype) become aliases.
    ``wire_dtype`` (see :class:`WeightSender`) sets the dtype each tensor is sent as;
    the layout's entries, sizes and buckets are those of the wire dtypes, and the put
    converts (:func:`_put_bucket`). An alias is sent as its canonical tensor is.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InvalidInputError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    _check_wire_dtype(wire_dtype)
    items = named_tensors(state)
    seen: dict[tuple[Any, ...], str] = {}
    aliases: list[tuple[str, str]] = []
    groups: list[list[tuple[str, torch.Tensor, torch.dtype]]] = []
    cur: list[tuple[str, torch.Tensor, torch.dtype]] = []
    end = 0
    for name, t in items:
        key = _identity_key(t)
        if t.numel() > 0 and key in seen:
            aliases.append((name, seen[key]))
            continue
        seen.setdefault(key, name)
        wire = _wire_of(wire_dtype, name, t)
        size = _itemsize(wire)
        n = t.numel() * size
        grown = align_up(align_up(end, size) + n, BLOCK_ALIGN)
        if cur and grown > bucket_bytes:
            groups.append(cur)
            cur, end = [], 0
        cur.append((name, t, wire))
        end = align_up(end, size) + n
    if cur:
        groups.append(cur)
    entries: list[TensorEntry] = []
    buckets: list[Bucket] = []
    tensors: list[list[torch.Tensor]] = []
    for k, group in enumerate(groups):
        spec = _bucket_spec(k, group, [])
        entries.extend(spec.entries)
        buckets.append(spec.bucket)
        tensors.append([t.detach() for _n, t, _w in group])
    return WeightLayout(tuple(entries), tuple(buckets), tuple(aliases), bucket_bytes), tensors


def _itemsize(dtype: torch.dtype) -> int:
    # Not torch.empty(0, dtype=dtype).element_size(): under deterministic algorithms
    # torch fills what it allocates, and has no fill for float4_e2m1fn_x2.
    return dtype.itemsize


def _bucket_spec(k: int, group: Sequence[tuple[str, torch.Tensor, torch.dtype]],
                 aliases: Sequence[tuple[str, str]]) -> BucketLayout:
    """Bucket ``k``'s layout: entries in object order with their wire dtypes and sizes."""
    items = [_itemsize(w) for _n, _t, w in group]
    sizes = [t.numel() * i for (_n, t, _w), i in zip(group, items)]
    _offsets, total = packed_offsets(sizes, items)
    entries = tuple(TensorEntry(name, tuple(t.shape), _dtype_str(w), k, i, n)
                    for i, ((name, t, w), n) in enumerate(zip(group, sizes)))
    return BucketLayout(Bucket(k, tuple(n for n, _t, _w in group), total), entries,
                        tuple(aliases))


def _conversions(tensors: Sequence[torch.Tensor], entries: Sequence[TensorEntry]
                 ) -> dict[int, torch.dtype]:
    """``id(tensor)`` -> the wire dtype, for the tensors whose entry names another dtype."""
    return {id(t): e.torch_dtype for t, e in zip(tensors, entries)
            if _dtype_str(t.dtype) != e.dtype}


def _put_bucket(tensors: list[torch.Tensor], entries: Sequence[TensorEntry]) -> ObjectRef:
    """``ray.put`` one bucket; tensors whose entry names another dtype are converted by
    the pack copy itself (``transport.pack_as``), not by a separate cast."""
    import ray

    convert = _conversions(tensors, entries)
    if not convert:
        return ray.put(tensors, _tensor_transport=_transport())
    from ray_rdt_pool._ray.transport import pack_as

    with pack_as(convert):
        return ray.put(tensors, _tensor_transport=_transport())


@dataclass(frozen=True)
class BucketLayout:
    """The layout of one bucket of a lazy source, sent to the receivers with the bucket.

    A lazy (iterable) source is bucketed as its pairs arrive, so receivers learn the
    layout bucket by bucket: ``entries`` are the bucket's tensors in object order,
    ``aliases`` the ``(alias, canonical)`` pairs whose canonical is in this bucket.
    """

    bucket: Bucket
    entries: tuple[TensorEntry, ...]
    aliases: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class SourceBucket:
    """A stream bucket that same-node receivers copy straight out of the sender's
    tensors instead of a pool object: the sender process and, per tensor of the bucket
    (in object order), the address of its first byte there. Shapes and dtypes come from
    the layout each receiver validated, so a receiver never reads more than the layout
    says. The sender keeps the tensors alive and does not return from ``stream()``
    before every receiver acknowledged the bucket."""

    source: SourceProcess
    addrs: tuple[int, ...]


@dataclass(frozen=True)
class PoolBucket:
    """A stream bucket packed into the sender's pool as an object the stream owns, not
    a Ray object: its id, versioned wire metadata and device type. Receivers map, READ
    or copy it through the transport (``transport.fetch_owned``) with no Ray object
    round trip; the sender frees it once every receiver acknowledged the bucket, or,
    when the stream fails, once the receivers finished or were told to drop it."""

    obj_id: str
    wire: bytes
    device: str


def _owned_bucket(obj_id: str, tensors: list[torch.Tensor], entries: Sequence[TensorEntry],
                  by_reference: bool = False) -> PoolBucket:
    """Put one stream bucket as an object the stream owns: packed into the pool (a
    snapshot; tensors whose entry names another dtype are converted by the pack copy
    itself), or ``by_reference`` with no pack, receivers READ the tensors where they lie
    and the sender keeps them, unchanged, until every receiver acknowledged it."""
    from ray_rdt_pool._ray.transport import put_owned

    convert = None if by_reference else _conversions(tensors, entries) or None
    wire, device = put_owned(obj_id, tensors, convert, by_reference=by_reference)
    return PoolBucket(obj_id, wire, device)


def _registration_cache_bytes() -> int:
    from ray_rdt_pool._ray.transport import runtime

    return int(runtime().config.registration_cache_bytes)


def _source_readable(tensors: Sequence[torch.Tensor], entries: Sequence[TensorEntry]) -> bool:
    """Can receivers copy these bytes as they lie (CPU, contiguous, no lazy bit, no
    wire-dtype conversion)? Otherwise the bucket goes through the pool."""
    return len(tensors) == len(entries) and all(
        t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()
        and _dtype_str(t.dtype) == e.dtype for t, e in zip(tensors, entries))


@dataclass
class _Packed:
    spec: BucketLayout
    tensors: list[torch.Tensor]


def _pairs(source: Iterable[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for item in source:
        pair = tuple(item) if isinstance(item, (tuple, list)) else None
        if pair is None or len(pair) != 2 or not isinstance(pair[0], str) \
                or not isinstance(pair[1], torch.Tensor):
            raise InvalidInputError(
                f"a lazy weight source yields (name: str, tensor: torch.Tensor) pairs, got "
                f"{type(item).__name__} {str(item)[:80]!r}")
        yield pair[0], pair[1]


def _pack(k: int, cur: list[tuple[str, torch.Tensor, torch.dtype]],
          aliases: list[tuple[str, str]]) -> _Packed:
    """Make bucket ``k`` of ``cur`` and empty ``cur`` and ``aliases`` (so the caller,
    a suspended generator, keeps no reference to the tensors)."""
    packed = _Packed(_bucket_spec(k, cur, aliases), [t.detach() for _n, t, _w in cur])
    cur.clear()
    aliases.clear()
    return packed


def _iter_buckets(pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                  wire_dtype: WireDtype = None) -> Iterator[_Packed]:
    """Bucket ``pairs`` as they arrive, with :func:`plan_layout`'s rule.

    Holds at most the bucket being filled (plus the pair that starts the next one).
    Aliases (tied tensors) are found only within a bucket: a tensor already handed out
    may have been freed, and a new one may reuse its address, so identity across
    buckets is not checked; a tie across buckets is sent twice. Raises
    :class:`DuplicateNameError` when a name comes again, :class:`WireDtypeError` when
    ``wire_dtype`` refuses a tensor (before its bucket is yielded).
    """
    names: set[str] = set()
    cur: list[tuple[str, torch.Tensor, torch.dtype]] = []
    aliases: list[tuple[str, str]] = []
    keys: dict[tuple[Any, ...], str] = {}
    end = 0
    k = 0
    for name, t in pairs:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise InvalidInputError(
                f"a lazy source yielded ({type(name).__name__}, {type(t).__name__}); it must "
                "yield (str name, torch.Tensor) pairs")
        if name in names:
            raise DuplicateNameError(name, k)
        names.add(name)
        _check_weight(name, t, "weight")
        key = _identity_key(t)
        if t.numel() > 0 and key in keys:
            aliases.append((name, keys[key]))
            continue
        wire = _wire_of(wire_dtype, name, t)
        size = _itemsize(wire)
        n = t.numel() * size
        grown = align_up(align_up(end, size) + n, BLOCK_ALIGN)
        if cur and grown > bucket_bytes:
            yield _pack(k, cur, aliases)
            k += 1
            keys = {}
            end = 0
        keys.setdefault(key, name)
        cur.append((name, t, wire))
        end = align_up(end, size) + n
        del t
    if cur:
        yield _pack(k, cur, aliases)


def _layout_of(specs: Sequence[BucketLayout], bucket_bytes: int) -> WeightLayout:
    return WeightLayout(tuple(e for s in specs for e in s.entries),
                        tuple(s.bucket for s in specs),
                        tuple(a for s in specs for a in s.aliases), bucket_bytes)


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
    #: payload bytes the sender sent (every bucket, in the wire dtype, without padding),
    #: whatever each receiver selected of them (its ``loads[i].nbytes``)
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
    #: buckets every receiver copied straight out of the sender's tensors (same node,
    #: ``source_reads``): no pool, no NIXL READ; the others went through the pool
    source_read_buckets: int = 0
    #: buckets receivers READ over NIXL straight from the sender's tensors (a module or
    #: mapping, receivers not all able to read in place): no pack, no pool
    reference_buckets: int = 0


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
    from ray_rdt_pool._ray.transport import runtime

    return int(runtime().config.pool_capacity)


class WeightSender:
    """Publishes a named state as ``nixl_pool`` buckets. Lives in the trainer actor.

    Args:
        source: The state to send. Either a state (an ``nn.Module``, a
            ``Mapping[str, Tensor]``), or a lazy source: an iterable or generator of
            ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``), or a
            zero-argument callable returning any of these (called once per sync).
            An iterator or generator is one-shot: a second sync raises
            :class:`SourceExhaustedError`; pass a callable instead. Optional when every
            call passes ``state=``.
        bucket_bytes: Most packed bytes per bucket. For :meth:`stream` keep
            ``max_inflight * bucket_bytes`` within the sender's ``pool_bytes``, and
            ``bucket_bytes`` within each receiver's ``arena_bytes`` (buckets that are
            copied rather than landed directly go through the arena).
        wire_dtype: The dtype tensors are sent as. A ``torch.dtype`` (floating point)
            applies to every floating-point tensor (integer and bool tensors are sent
            as they are), e.g. ``torch.bfloat16`` sends fp32 master weights in half the
            bytes; a callable ``(name, tensor) -> dtype | None`` decides per tensor
            (``None``: as it is). The conversion is the pack copy into the pool (no
            separate cast); the layout carries the wire dtypes and sizes, and receivers
            cast to their destination dtypes. A conversion down the casting order
            (float -> int, complex -> real) raises :class:`WireDtypeError` before the
            bucket is put. A tied tensor is sent once, as its first name decides.
        source_reads: Let :meth:`stream` skip the pool: when every receiver runs on
            this Ray node and may read this process, each receiver copies the buckets
            straight out of the source tensors; otherwise, for the module or mapping
            given as ``source``, each receiver READs them by reference over NIXL (their
            storages stay registered in the transport's storage cache until a stream no
            longer sends them, or :meth:`close`). Either way the source tensors must not
            change while ``stream()`` runs (see docs/weight-sync.md, "Source reads" and
            "By reference across nodes"). ``False``: always the pool.

    Each publish snapshots the state (the pool copy is made at ``ray.put``), and a stream
    returns only after every receiver loaded every bucket and committed, so either way
    the trainer may keep training as soon as the call returns. ``version`` is the
    version of the last successful publish or stream (0 before any); a call without
    ``version=`` uses one more than the highest version this sender used, successful
    or not, so a retry after a stream that failed on some receivers (others may have
    committed it) is never refused as stale.
    """

    def __init__(self, source: Source | None = None, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 wire_dtype: WireDtype = None, source_reads: bool = True) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) \
                or bucket_bytes <= 0:
            raise InvalidInputError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        _check_flag("source_reads", source_reads)
        _check_wire_dtype(wire_dtype)
        self.source = source
        self.bucket_bytes = bucket_bytes
        self.wire_dtype = wire_dtype
        self.source_reads = source_reads
        self.version = 0
        self._used = 0  # the highest version sent to any receiver, successful or not
        self._spent = False  # a one-shot (iterator) source was consumed
        # Storage keys of the source tensors the last stream sent by reference: their
        # registrations stay in the transport's storage cache for the next stream, and
        # go once a stream no longer sends them (a replaced tensor) or at close().
        self._ref_keys: set[Any] = set()

    def close(self) -> None:
        """Let go of the NIXL registrations kept for by-reference streams (the storages
        of the source's tensors, in the transport's storage cache). The sender stays
        usable: a later stream registers them again. A sender that is dropped without
        ``close()`` leaves them to the cache's LRU bound (``registration_cache_bytes``)."""
        keys, self._ref_keys = self._ref_keys, set()
        _forget_registrations(keys)

    def _acquire(self, state: SourceLike | None
                 ) -> tuple[StateLike | None, Iterator[tuple[str, torch.Tensor]] | None]:
        """This sync's weights: ``(state, None)`` for a module or mapping, else
        ``(None, pairs)`` for a lazy source (consumed once, as the buckets are made)."""
        if state is None:
            src = self.source
            if src is None:
                raise InvalidInputError("WeightSender has no source; pass state= or source=")
            if isinstance(src, Iterator):
                if self._spent:
                    raise SourceExhaustedError(
                        f"the WeightSender's source is a one-shot {type(src).__name__}, "
                        "already consumed by an earlier sync; pass a zero-argument "
                        "callable that returns a fresh iterable, e.g. WeightSender(lambda: "
                        "model.named_parameters()), or pass state= to each call")
                self._spent = True
                return None, _pairs(src)
            if callable(src) and not isinstance(src, torch.nn.Module):
                src = src()
            state = src
        if isinstance(state, (torch.nn.Module, Mapping)):
            return state, None
        if isinstance(state, Iterable) and not isinstance(state, (str, bytes, torch.Tensor)):
            return None, _pairs(state)
        raise InvalidInputError(
            f"a weight source is an nn.Module, a Mapping[str, Tensor], an iterable of "
            f"(name, tensor) pairs or a callable returning one; got {type(state).__name__}")

    def _next_version(self, version: int | None) -> int:
        if version is None:
            return max(self.version, self._used) + 1
        if isinstance(version, bool) or not isinstance(version, int):
            raise InvalidInputError(f"version must be an int, got {version!r}")
        return version

    def layout(self, state: SourceLike | None = None) -> WeightLayout:
        """The layout the next publish would have (no data is moved).

        A lazy source is consumed to compute it (a callable is called once more; a
        one-shot iterator is spent).
        """
        eager, pairs = self._acquire(state)
        if eager is not None:
            return plan_layout(eager, self.bucket_bytes, self.wire_dtype)[0]
        assert pairs is not None
        specs = []
        for packed in _iter_buckets(pairs, self.bucket_bytes, self.wire_dtype):
            specs.append(packed.spec)
            del packed
        return _layout_of(specs, self.bucket_bytes)

    def publish(self, state: SourceLike | None = None, *, version: int | None = None
                ) -> Manifest:
        """Put every bucket now and return the manifest.

        ``version`` is the manifest's version (an int, e.g. the trainer step); without
        it, one more than the highest version this sender used. Receivers refuse a
        manifest that is not newer than their last complete load
        (:class:`StaleVersionError`).

        A lazy source is consumed whole here, bucket by bucket: each bucket is put as
        soon as it is full and its source tensors are dropped then. Every bucket is a
        snapshot: the trainer may modify its weights as soon as this returns. Buckets
        that do not fit the pool are copied into overflow memory (listed in
        ``Manifest.overflow``; with ``strict=True`` in the pool config they raise
        ``PoolExhaustedError`` instead). Nothing is ever sent by reference unless the
        trainer registered its memory with ``register_memory()``. Use :meth:`stream`
        for states larger than the pool. A lazy source that repeats a name raises
        :class:`DuplicateNameError` and publishes nothing.
        """

        v = self._next_version(version)
        eager, pairs = self._acquire(state)
        refs: list[list[ObjectRef] | None] = []
        overflow: list[int] = []
        fallbacks = _stats().fallbacks

        def put(k: int, tensors: list[torch.Tensor], entries: Sequence[TensorEntry]) -> None:
            nonlocal fallbacks
            refs.append([_put_bucket(tensors, entries)])
            now = _stats().fallbacks
            if now != fallbacks:
                overflow.append(k)
                fallbacks = now

        if eager is not None:
            layout, groups = plan_layout(eager, self.bucket_bytes, self.wire_dtype)
            for k, tensors in enumerate(groups):
                put(k, tensors, [e for e in layout.entries if e.bucket == k])
        else:
            assert pairs is not None
            specs: list[BucketLayout] = []
            try:
                for packed in _iter_buckets(pairs, self.bucket_bytes, self.wire_dtype):
                    specs.append(packed.spec)
                    put(packed.spec.bucket.index, packed.tensors, packed.spec.entries)
                    packed.tensors.clear()  # the pool holds the snapshot now
                    del packed
            except DuplicateNameError as e:
                refs.clear()  # frees the buckets put so far
                raise DuplicateNameError(e.name, e.bucket, (),
                                         "publish() published nothing") from None
            except BaseException:
                refs.clear()
                raise
            layout = _layout_of(specs, self.bucket_bytes)
        self.version = v
        self._used = max(self._used, v)  # the next default is past every version used
        return Manifest(layout, refs, v, tuple(overflow), int(_stats().pool_used),
                        uuid.uuid4().hex)

    def stream(self, receivers: Sequence[ActorHandle], state: SourceLike | None = None, *,
               version: int | None = None, receiver_attr: str = RECEIVER_ATTR,
               max_inflight: int = 2, timeout_s: float = 300.0) -> StreamReport:
        """Sync ``receivers`` bucket by bucket with bounded sender pool memory.

        Each receiver actor must hold a :class:`WeightReceiver` at ``receiver_attr``.
        ``version`` as in :meth:`publish`; a receiver whose last complete load is not
        older refuses the stream when it begins (:class:`StaleVersionError`, before any
        bucket is put).

        For a module or mapping, every receiver first validates the whole layout (a
        mismatch raises here, before any bucket is put). For a lazy source (an iterable
        of pairs) the layout is not known up front: each bucket is filled as pairs
        arrive and sent with its own :class:`BucketLayout`, which each receiver
        validates before writing that bucket; a mismatch then raises at that bucket
        (earlier buckets are loaded, the receivers' versions unchanged), and
        ``strict`` missing tensors are found after the last bucket.

        Then for each bucket: wait until fewer than ``max_inflight`` buckets are
        unacknowledged and the pool has room for it, pack it into the pool as an object
        this stream owns (:class:`PoolBucket`: not a Ray object, so no object-store round
        trip), and ask every receiver to load it (``__ray_call__``); the object is freed
        once every receiver acknowledged it. "Room" means the pool has the bucket's bytes
        free and this stream's pool use (``pool_used`` beyond what was in use when the
        stream began) stays within ``max_inflight * bucket_bytes``. A lazy source is only
        pulled for the next bucket once there is room for a full bucket, and the sender
        drops its tensors as soon as their bucket is packed, so beyond the model and the
        pool the sync holds at most ``max_inflight`` buckets of source tensors plus one
        tensor. No bucket is ever packed without room, so there is no fallback
        registration. With ``max_inflight >= 2`` packing bucket ``k+1`` overlaps the
        receivers' reads of bucket ``k``; ``max_inflight=1`` serialises them.

        ``source_reads=True`` skips the pack for a bucket whose tensors lie as they are
        sent, and keeps its tensors until every receiver acknowledged it: with every
        receiver on this Ray node and able to read this process, the receivers get the
        tensors' addresses and copy them out of this process (:class:`SourceBucket`);
        otherwise, for the module or mapping this sender holds as ``source`` (not
        ``state=``), whose bytes fit the storage cache (``registration_cache_bytes``),
        they READ them by reference over NIXL. Other buckets go through the pool as
        above.

        Once every receiver acknowledged every bucket, the sender tells each to commit
        (:meth:`WeightReceiver.finish_stream`, one more call per receiver) and waits for
        it: a receiver never commits a stream this sender gave up on, and when
        ``stream()`` returns every receiver's ``version`` is the new one.

        Raises ``PoolExhaustedError`` if a bucket cannot fit the pool at all (up front
        for a module or mapping, at that bucket for a lazy source),
        :class:`WeightSyncTimeoutError` if pool space or acks take longer than
        ``timeout_s``, :class:`DuplicateNameError` if a lazy source repeats a name,
        and re-raises a receiver's error (its other buckets still drain). On any error
        (a begin refused included) every receiver is told to drop the stream, then the
        sender frees every bucket it still holds, so no bucket stays pinned; a bucket
        whose receiver call has not ended by then (it outlasted ``timeout_s``) is freed
        once that call ends, never under it. A failure
        at the commit itself may leave some receivers committed; the version is used
        up either way (the next default version is past it).
        """
        import ray

        receivers = _actor_handles(receivers, "stream()")
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) \
                or max_inflight < 1:
            raise InvalidInputError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        deadline_s = _timeout(timeout_s)
        t0 = time.perf_counter()
        v = self._next_version(version)
        eager, pairs = self._acquire(state)
        capacity = _pool_capacity()
        bb = self.bucket_bytes
        items: Iterator[tuple[int, list[torch.Tensor], BucketLayout | None,
                              Sequence[TensorEntry]]]
        layout: WeightLayout | None = None
        biggest = 0
        if eager is not None:
            layout, groups = plan_layout(eager, bb, self.wire_dtype)
            for b in layout.buckets:
                if b.nbytes > capacity:
                    raise _too_big(b, capacity)
            biggest = max((b.nbytes for b in layout.buckets), default=0)
            per_bucket: list[list[TensorEntry]] = [[] for _ in layout.buckets]
            for e in layout.entries:
                per_bucket[e.bucket].append(e)
            items = ((b.nbytes, g, None, es)
                     for b, g, es in zip(layout.buckets, groups, per_bucket))
        else:
            assert pairs is not None
            items = ((p.spec.bucket.nbytes, p.tensors, p.spec, p.spec.entries)
                     for p in _iter_buckets(pairs, bb, self.wire_dtype))
        session = f"{os.getpid()}-{v}-{uuid.uuid4().hex[:8]}"

        src_proc: SourceProcess | None = None
        if self.source_reads:
            from ray_rdt_pool._ray.transport import source_process

            src_proc = source_process()
        # From here on ``v`` may be committed by some receiver, even if the stream fails:
        # the next default version is past it.
        self._used = max(self._used, v)
        begins = [r.__ray_call__.remote(_remote_begin, receiver_attr, session, layout, v,
                                        src_proc)
                  for r in receivers]
        finishes: list[Any] = []
        direct = by_ref = False
        direct_buckets = ref_buckets = 0
        ref_keys: set[Any] = set()
        st0 = _stats()
        fallbacks0 = st0.fallbacks
        used0 = int(st0.pool_used)
        # Double buffering in bytes: this stream's buckets may hold at most max_inflight
        # buckets' worth of the pool, counting freed buckets whose blocks a same-node
        # receiver's mapping still leases.
        samples: list[int] = []
        # Per bucket in flight: the receivers' acks, for a source-read bucket its tensors,
        # kept alive (and so unmoved) until every receiver has copied them, and for a
        # pool bucket its object id, freed only then.
        inflight: deque[_InFlight] = deque()
        owned: str | None = None  # a pool bucket packed but not yet in ``inflight``
        # A module's or mapping's buckets read in place go out together, one task per
        # receiver for a run of them: the tensors they keep are the source's own (no
        # memory beyond the model), describing them costs nothing, and each task costs a
        # Ray round trip of its own. (Buckets by reference are described one by one, a
        # registration lookup and the wire bytes each: sent as they are made, the
        # receivers READ one while the next is described.)
        run: _Run = _Run()
        acked: list[list[BucketReport]] = [[] for _ in receivers]
        wait_s = 0.0
        k = 0
        sent = 0  # payload bytes of every bucket sent (a module's layout.total_bytes)
        try:
            began = _get_all(begins, deadline_s, "validating the layout on the receivers")
            # Source reads only when every receiver can: a bucket is then never packed.
            direct = src_proc is not None and all(ok for _sk, ok in began)
            # Otherwise, for the module or mapping this sender holds, receivers READ the
            # tensors where they lie over NIXL: their storages stay registered between
            # syncs (so the metadata does not change) without holding memory the source
            # does not hold itself. Not for a state= or a callable's state: it may be new
            # memory each sync, which would be registered, and kept, every time.
            by_ref = (self.source_reads and not direct and layout is not None
                      and state is None
                      and isinstance(self.source, (torch.nn.Module, Mapping))
                      and layout.total_bytes <= _registration_cache_bytes())
            while True:
                while len(inflight) >= max_inflight:
                    _retire(inflight, acked, deadline_s)
                if layout is None and not direct:
                    # Lazy: pull the next bucket's tensors only once a full bucket fits.
                    lim = min(capacity, used0 + max_inflight * max(bb, biggest))
                    wait_s += _make_room(min(bb, capacity), lim, capacity, deadline_s,
                                         inflight, acked)
                item = next(items, None)
                if item is None:
                    run.send(inflight, receivers, receiver_attr, session)
                    break
                nbytes, tensors, spec, entries = item
                del item
                sent += sum(e.nbytes for e in entries)
                if nbytes > capacity:
                    assert spec is not None
                    raise _too_big(spec.bucket, capacity)
                biggest = max(biggest, nbytes)
                keep: list[torch.Tensor] | None = None
                box: list[Any]
                if direct and _source_readable(tensors, entries):
                    assert src_proc is not None
                    box = [SourceBucket(src_proc, tuple(t.data_ptr() for t in tensors))]
                    keep = tensors
                    direct_buckets += 1
                elif by_ref and _source_readable(tensors, entries):
                    owned = f"ws:{session}/{k}"
                    ref_keys.update(storage_key(t) for t in tensors if t.numel())
                    box = [_owned_bucket(owned, tensors, entries, by_reference=True)]
                    keep = tensors
                    ref_buckets += 1
                else:
                    run.send(inflight, receivers, receiver_attr, session)
                    limit = min(capacity, used0 + max_inflight * max(bb, biggest))
                    # A conversion or a CUDA tensor packs into one contiguous block.
                    one_block = any(t.is_cuda for t in tensors) \
                        or bool(_conversions(tensors, entries))
                    wait_s += _make_room(nbytes, limit, capacity, deadline_s, inflight, acked,
                                         one_block)
                    owned = f"ws:{session}/{k}"
                    box = [_owned_bucket(owned, tensors, entries)]
                    tensors.clear()  # the pool holds the snapshot; drop the source's tensors
                del tensors
                if keep is not None and layout is not None and owned is None:
                    samples.append(int(_stats().pool_used))
                    run.add(k, box, keep, owned)
                    owned = None
                    del keep, box
                    k += 1
                    continue
                try:
                    samples.append(int(_stats().pool_used))
                    # In flight before the first call (see _Run.send).
                    acks: list[Any] = []
                    inflight.append((acks, keep, [owned] if owned else []))
                    owned = None
                    for r in receivers:
                        acks.append(r.__ray_call__.remote(_remote_bucket, receiver_attr,
                                                          session, k, box, spec))
                finally:
                    box.clear()
                    del keep
                k += 1
            while inflight:
                _retire(inflight, acked, deadline_s)
            # Every receiver has every bucket: only now may they commit (a receiver that
            # commits at its last bucket would commit a stream this sender gave up on).
            finishes = [r.__ray_call__.remote(_remote_finish, receiver_attr, session, k)
                        for r in receivers]
            skipped = _get_all(finishes, deadline_s, "committing the stream on the receivers")
        except BaseException as e:
            # Let the receivers finish (or fail) what they hold so every ref drains, then
            # have every receiver that began drop the stream (and any bucket it holds out
            # of order): one that was refused, or that failed, holds nothing to drop.
            pending = [a for acks, _keep, _oid in inflight for a in acks] + begins + finishes
            if pending:
                _wait_quietly(pending, deadline_s)
                for acks, _keep, _oids in inflight:
                    for i, a in enumerate(acks):
                        try:
                            acked[i].extend(ray.get(a, timeout=0))
                        except Exception:  # the error that counts is e
                            pass
            aborts = [r.__ray_call__.remote(_remote_abort, receiver_attr, session)
                      for r in receivers]
            _wait_quietly(aborts, min(deadline_s, 30.0))
            # Only now: a receiver still loading a bucket reads its pool block (or the
            # source's kept tensors). One whose call has not ended even so (a plain
            # actor runs the bucket calls queued before the abort; a stuck receiver)
            # may still read it: such buckets are let go only once that call ends.
            late = [b for b in inflight if not _ended(b[0])]
            gone = {id(b) for b in late}
            _free_owned([o for b in inflight if id(b) not in gone for o in b[2]]
                        + run.owned + [owned])
            if late:
                _LATE.add(late, session)
            inflight.clear()
            run = _Run()
            self._ref_keys |= ref_keys  # the next complete stream sorts them out
            if isinstance(e, DuplicateNameError):
                applied = sorted(set.intersection(*[{r.bucket for r in a} for a in acked]))
                raise DuplicateNameError(
                    e.name, e.bucket, applied,
                    f"bucket(s) {_ranges(applied)} were loaded on every receiver before it; "
                    f"no receiver committed version {v} (their versions are unchanged)"
                ) from None
            raise
        self.version = v
        if by_ref or self._ref_keys:
            # Tensors the source no longer holds (replaced) need not stay registered.
            _forget_registrations(self._ref_keys - ref_keys)
            self._ref_keys = ref_keys
        loads = tuple(_summarise(v, sorted(reps, key=lambda r: r.bucket), sk)
                      for reps, sk in zip(acked, skipped))
        return StreamReport(
            version=v, buckets=k, nbytes=sent,
            receivers=len(receivers), max_inflight=max_inflight,
            seconds=time.perf_counter() - t0, pool_capacity=capacity,
            peak_pool_used=max(samples, default=0), pool_used_samples=tuple(samples),
            fallbacks=int(_stats().fallbacks - fallbacks0), pool_wait_seconds=wait_s,
            loads=loads, source_read_buckets=direct_buckets, reference_buckets=ref_buckets)


def _actor_handles(receivers: Any, what: str) -> list[ActorHandle]:
    """``receivers`` as a list of distinct actor handles, or InvalidInputError: anything
    else would fail later as an AttributeError deep in a Ray call, after the stream's
    version was used."""
    if _is_actor(receivers):
        raise InvalidInputError(f"{what} takes a list of receiver actors, got one actor "
                                f"handle; pass [handle]")
    try:
        handles = list(receivers)
    except TypeError:
        raise InvalidInputError(f"{what} takes a list of receiver actors, got "
                                f"{type(receivers).__name__}") from None
    if not handles:
        raise InvalidInputError(f"{what} needs at least one receiver actor")
    for i, r in enumerate(handles):
        if not _is_actor(r):
            raise InvalidInputError(f"{what}: receiver {i} is a {type(r).__name__}, not an "
                                    f"actor handle; pass the handles that .remote() on an "
                                    f"actor class returned")
    ids = [r._actor_id.hex() for r in handles]
    if len(set(ids)) != len(ids):
        raise InvalidInputError(f"{what} got the same receiver actor twice")
    return handles


def _is_actor(obj: Any) -> bool:
    """Whether ``obj`` can be called as an actor here (what a stream uses of a handle)."""
    return hasattr(obj, "__ray_call__") and hasattr(obj, "_actor_id")


def _check_flag(name: str, value: Any) -> None:
    """A bool option, or InvalidInputError: a string such as "no" is truthy."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {value!r}")


def _timeout(timeout_s: Any) -> float:
    """``timeout_s`` as a float, or InvalidInputError: Ray's waits refuse a negative one
    and overflow on an infinite one, which would surface half-way through a stream."""
    import numbers

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) \
            or not 0 < float(timeout_s) < math.inf:
        raise InvalidInputError(f"timeout_s must be a finite number of seconds > 0, got "
                                f"{timeout_s!r}; pass e.g. timeout_s=300.0")
    return float(timeout_s)


def _wait_quietly(refs: list[Any], timeout_s: float) -> None:
    """Wait for ``refs`` during a failed stream's clean-up, whose aborts and frees must run
    whatever the wait raises (the stream's own error is the one raised)."""
    import ray

    try:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    except Exception as e:  # the stream's error is the one that counts
        logger.warning("waiting for receivers while a stream failed raised %r", e)


def _too_big(b: Bucket, capacity: int) -> PoolExhaustedError:
    s = _stats()
    return PoolExhaustedError(
        b.nbytes, int(s.pool_free) if s.pool_capacity else capacity,
        int(s.pool_largest_free_block) if s.pool_capacity else capacity,
        capacity, what=f"sender pool (bucket {b.index}: {b.names[:3]}...)",
        remedy="streaming never falls back: lower bucket_bytes or raise "
               "pool_bytes (RAY_RDT_POOL_POOL_BYTES) above the largest tensor")


def _ranges(ks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``; ``"none"`` when empty."""
    if not ks:
        return "none"
    out: list[str] = []
    start = prev = ks[0]
    for x in [*ks[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def _get_all(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as e:
        # Ray's frames in the traceback hold the refs waited for: a held error must not
        # keep them alive (nor what a late result pins, a publish's buckets).
        traceback.clear_frames(e.__traceback__)
        raise WeightSyncTimeoutError(f"{what} took longer than {timeout_s}s") from e


def _collect(acks: list[Any], acked: list[list[BucketReport]], timeout_s: float) -> None:
    import ray

    # Wait for every receiver first, so one receiver's error is raised only after the
    # others are done with this bucket too (their refs drain before we give up).
    ray.wait(acks, num_returns=len(acks), timeout=timeout_s)
    for i, reps in enumerate(_get_all(acks, timeout_s, "waiting for receivers to load a bucket")):
        acked[i].extend(reps)  # a receiver may load buckets that arrived early with this one


#: Stream buckets in flight (one, or a run sent together): the receivers' acks, the
#: tensors kept for buckets read in place or by reference, and the owned object ids.
_InFlight = tuple[list[Any], list[torch.Tensor] | None, list[str]]


@dataclass
class _Run:
    """Consecutive buckets of a module or mapping that are not packed, gathered to go to
    each receiver in one task (:meth:`send`): their boxes, kept tensors and object ids."""

    ks: list[int] = field(default_factory=list)
    boxes: list[list[Any]] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)
    owned: list[str] = field(default_factory=list)

    def add(self, k: int, box: list[Any], kept: list[torch.Tensor], owned: str | None
            ) -> None:
        self.ks.append(k)
        self.boxes.append(box)
        self.kept.extend(kept)
        if owned is not None:
            self.owned.append(owned)

    def send(self, inflight: deque[_InFlight], receivers: Sequence[ActorHandle],
             attr: str, session: str) -> None:
        if not self.ks:
            return
        # In flight before the first call: if a later receiver's call cannot even be
        # made, the clean-up still sees the earlier calls, which may read these buckets.
        acks: list[Any] = []
        inflight.append((acks, self.kept, self.owned))
        ks, boxes = self.ks, self.boxes
        self.ks, self.boxes, self.kept, self.owned = [], [], [], []
        for r in receivers:
            acks.append(r.__ray_call__.remote(_remote_run, attr, session, ks, boxes))


def _forget_registrations(keys: set[Any]) -> None:
    if keys:
        from ray_rdt_pool._ray.transport import forget_registrations

        forget_registrations(keys)


def _ended(refs: list[Any]) -> bool:
    """Whether every call of ``refs`` has ended (done or failed); False if that cannot be
    told now."""
    import ray

    try:
        ready, _rest = ray.wait(refs, num_returns=len(refs), timeout=0)
    except Exception:
        return False
    return len(ready) == len(refs)


class _LateBuckets:
    """Buckets of failed streams that a receiver's call may still read (it had not ended
    when the stream's clean-up gave up waiting): each is freed, and its kept source
    tensors dropped, only once every receiver call for it has ended. Freeing them at once
    let a queued call READ a block the pool had handed to another object, and load those
    bytes. Held by at most ``max_inflight`` buckets per failed stream.

    Threads: the stream's thread adds; one daemon thread, started on demand and ended
    when nothing is left, polls twice a second and frees."""

    POLL_S = 0.5

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[_InFlight] = []
        self._thread: threading.Thread | None = None

    def add(self, items: list[_InFlight], session: str) -> None:
        logger.warning("stream %s failed while %d bucket(s) were still being read by a "
                       "receiver; they stay in the sender pool until those calls end",
                       session, len(items))
        with self._lock:
            self._items.extend(items)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="ray_rdt_pool-late-buckets")
                self._thread.start()

    def held(self) -> int:
        with self._lock:
            return len(self._items)

    def _run(self) -> None:
        import ray

        while True:
            time.sleep(self.POLL_S)
            with self._lock:
                items = list(self._items)
            # After ray.shutdown() no receiver call runs any more, and none ends either.
            down = not ray.is_initialized()
            for item in items:
                if not down and not _ended(item[0]):
                    continue
                with self._lock:  # by identity: == on tensors is elementwise
                    self._items = [i for i in self._items if i is not item]
                if item[1] is not None:
                    item[1].clear()
                try:
                    _free_owned(item[2])
                except Exception:
                    logger.warning("freeing a late stream bucket failed", exc_info=True)
            with self._lock:
                if not self._items:
                    self._thread = None
                    return


_LATE = _LateBuckets()


def _free_owned(obj_ids: Sequence[str | None]) -> None:
    from ray_rdt_pool._ray.transport import free_owned

    for oid in obj_ids:
        if oid is not None:
            free_owned(oid)


def _retire(inflight: deque[_InFlight], acked: list[list[BucketReport]],
            timeout_s: float) -> None:
    """Wait for the oldest bucket in flight on every receiver, then drop it. Its acks are
    collected before it leaves ``inflight``: a source-read bucket's tensors and a pool
    bucket's block must outlive the receivers' reads (a receiver's failure leaves it in
    ``inflight`` for the caller's clean-up). The list is emptied, not just dropped, since
    the lazy bucket iterator still refers to it until it has made the next bucket's
    tensors."""
    _collect(inflight[0][0], acked, timeout_s)
    _acks, kept, oids = inflight.popleft()
    if kept is not None:
        kept.clear()
    _free_owned(oids)


def _fits(s: Any, nbytes: int, limit: int, capacity: int, one_block: bool = False) -> bool:
    """Does a pack of ``nbytes`` fit the pool (stats ``s``) with its use within ``limit``?"""
    used = s.pool_used if s.pool_capacity else 0
    if not s.pool_capacity:
        free = capacity
    elif one_block or s.pool_device == "cuda":
        free = s.pool_largest_free_block  # a CUDA or converting pack takes one block
    else:
        free = s.pool_free
    return bool(free >= nbytes and used + nbytes <= limit)


def _make_room(nbytes: int, limit: int, capacity: int, timeout_s: float,
               inflight: deque[_InFlight], acked: list[list[BucketReport]],
               one_block: bool = False) -> float:
    """Block until ``nbytes`` fit the sender pool (see :func:`_fits`), retiring this
    stream's buckets in flight, oldest first, while they do not: their blocks are what
    usually holds the room, and only this thread frees them (a pool of fewer than
    ``max_inflight`` buckets would otherwise wait for itself). Then wait for the rest
    (blocks a same-node receiver still maps, other objects). Returns the seconds waited.
    """
    t0 = time.monotonic()
    while inflight and not _fits(_stats(), nbytes, limit, capacity, one_block):
        _retire(inflight, acked, timeout_s)
    _wait_for_pool(nbytes, limit, capacity, timeout_s, one_block)
    return time.monotonic() - t0


def _wait_for_pool(nbytes: int, limit: int, capacity: int, timeout_s: float,
                   one_block: bool = False) -> float:
    """Block until ``nbytes`` fit the sender pool with its use staying within ``limit``.

    Returns the seconds waited.
    """
    from ray_rdt_pool._ray.transport import runtime

    def fits(s: Any) -> bool:
        return _fits(s, nbytes, limit, capacity, one_block)

    t0 = time.monotonic()
    if runtime().wait_for(fits, timeout_s) is None:
        s = _stats()
        used = s.pool_used if s.pool_capacity else 0
        raise WeightSyncTimeoutError(
            f"for {timeout_s}s the sender pool had {fmt_bytes(int(used))} in use of "
            f"{fmt_bytes(capacity)} (this stream may use up to {fmt_bytes(limit)}), but "
            f"the next bucket needs {fmt_bytes(nbytes)}"
            + (f" in one block (the largest free one has "
               f"{fmt_bytes(int(s.pool_largest_free_block))})" if one_block else "")
            + "; other objects hold the pool (drop their refs, or raise pool_bytes) or a "
            "same-node receiver still maps this stream's blocks")
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


def _check_layout(entries: Sequence[TensorEntry], buckets: Sequence[Bucket],
                  first: int = 0) -> None:
    """WeightSyncError unless the layout agrees with itself, as the sender makes it:
    bucket ``i`` of ``buckets`` has index ``first + i``; each entry names one of them and
    a known dtype, a shape of non-negative ints and the bytes it makes; each bucket's
    entries sit at positions 0 to n-1, in the order of its names. The receiver plans
    its writes on these facts: a layout that breaks one left a destination unwritten
    with the version committed, or gave it another tensor's bytes."""
    problems: list[str] = []
    positions: dict[int, int] = {}
    for i, b in enumerate(buckets):
        if b.index != first + i:
            problems.append(f"bucket {first + i} is listed as bucket {b.index!r}")
        positions[b.index] = i
    names: dict[int, dict[int, str]] = {}
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            problems.append(f"{e.name!r} is listed twice")
        seen.add(e.name)
        shape_ok = type(e.shape) is tuple and all(type(k) is int and k >= 0 for k in e.shape)
        try:
            size = _itemsize(_dtype_of(e.dtype)) if isinstance(e.dtype, str) else None
        except InvalidInputError:
            size = None
        if not shape_ok or size is None:
            problems.append(f"{e.name!r} has shape {e.shape!r} and dtype {e.dtype!r}")
        elif e.nbytes != math.prod(e.shape) * size:
            problems.append(f"{e.name!r} ({e.shape} {e.dtype}) is said to be "
                            f"{e.nbytes!r} bytes")
        if e.bucket not in positions:
            problems.append(f"{e.name!r} is in bucket {e.bucket!r}, which the layout does "
                            "not list")
        elif names.setdefault(e.bucket, {}).setdefault(e.index, e.name) != e.name:
            problems.append(f"{e.name!r} and {names[e.bucket][e.index]!r} are both at "
                            f"position {e.index!r} of bucket {e.bucket}")
    for b in buckets:
        at = names.get(b.index, {})
        if [at.get(i) for i in range(len(b.names))] != list(b.names) or len(at) != len(b.names):
            problems.append(f"bucket {b.index}'s tensors are not at positions 0 to "
                            f"{len(b.names) - 1} in the order of its names")
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise WeightSyncError(
            f"the weight layout contradicts itself: {'; '.join(problems[:3])}{more}. Nothing "
            "was written; run the same ray_rdt_pool version on the sender and the receivers")


def _check_arrived(plan: BucketPlan, got: Sequence[torch.Tensor] | None = None,
                   wire: bytes | None = None) -> None:
    """WeightSyncError unless bucket ``plan.index`` arrived as its layout says: one
    tensor per entry, of the entry's dtype and shape (or, read in part, the selected
    part's). ``got``: the tensors received; ``wire``: the object's metadata (whole
    tensors), for a bucket not fetched yet. Checked before anything is written: ``copy_`` would
    broadcast or cast a tensor of another shape or dtype into the destination without a
    word, and a landing would blame the destination."""
    from ray_rdt_pool.core.wire import decode

    facts = list(decode(wire).shapes_dtypes()) if wire is not None else [
        (tuple(g.shape), _dtype_str(g.dtype)) for g in got or ()]
    entries = plan.entries
    # The metadata describes whole tensors; what a partial read returns, the parts.
    whole = wire is not None or plan.select is None
    want = [(e.shape if whole else _selected_shape(plan.select[e.index], e.shape),  # type: ignore[index]
             e.dtype) for e in entries]
    if len(facts) == len(entries) and all(
            facts[e.index] == (tuple(w), d) for e, (w, d) in zip(entries, want)):
        return
    raise WeightSyncError(
        f"bucket {plan.index} arrived as {len(facts)} tensor(s) {facts[:4]}"
        f"{' ...' if len(facts) > 4 else ''}, but its layout lists {len(entries)}: "
        f"{want[:4]}{' ...' if len(want) > 4 else ''}; nothing of it was written. The "
        "sender and this receiver disagree on the layout: run the same ray_rdt_pool "
        "version on both")


@dataclass
class BucketPlan:
    """How one bucket is loaded: landed in ``targets`` (direct) or copied via ``copies``."""

    index: int
    nbytes: int
    targets: list[torch.Tensor] | None  # direct landing buffers, one per object tensor
    copies: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (idx, dest)
    loads: list[tuple[int, str]] = field(default_factory=list)  # (idx, name) for load_weights
    #: per object tensor, the part to read (``transport.fetch_selected``; an empty dim-0
    #: slice skips a tensor nobody takes), or None: the bucket is read whole. ``nbytes``
    #: is then the selected bytes.
    select: list[Slices | None] | None = None
    #: the bucket's manifest entries in object order (what a source read copies)
    entries: list[TensorEntry] = field(default_factory=list)
    #: (idx, dest, what): destinations an earlier bucket of a lazy stream wrote from
    #: another manifest tensor; compared, not written, before anything of the bucket is
    #: (:class:`_Check`)
    verify: list[tuple[int, torch.Tensor, str]] = field(default_factory=list)


@dataclass
class LoadPlan:
    """The result of :meth:`WeightReceiver.check`: a validated layout, planned per bucket."""

    layout: WeightLayout
    buckets: list[BucketPlan]
    skipped: int


def _can_land(d: torch.Tensor, e: TensorEntry) -> bool:
    return (d.device.type == "cpu" and d.dtype == e.torch_dtype and tuple(d.shape) == e.shape
            and d.is_contiguous() and not d.is_conj() and not d.is_neg())


def _skip(e: TensorEntry) -> Slices | None:
    """The selection that reads nothing of ``e`` (None, i.e. all of it, for a scalar)."""
    return (slice(0, 0), *(slice(0, n) for n in e.shape[1:])) if e.shape else None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and _identity_key(a) == _identity_key(b)


def _same_bytes(dest: torch.Tensor, src: torch.Tensor) -> bool:
    """Would ``dest.copy_(src)`` leave ``dest`` bit for bit as it is? (NaNs included.)"""
    if tuple(dest.shape) != tuple(src.shape):
        return False
    with torch.no_grad():
        got = src.to(device=dest.device, dtype=dest.dtype)

        def raw(t: torch.Tensor) -> torch.Tensor:
            return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)

        return bool(torch.equal(raw(dest), raw(got)))


def _normalize_select(raw: Any, shape: tuple[int, ...]) -> Slices | None:
    """``select``'s answer as one step-1 slice per dimension, or None for the whole
    tensor. Raises ValueError (with what is wrong) for an answer that does not fit."""
    if raw is None:
        return None
    if isinstance(raw, slice):
        raw = (raw,)
    if not isinstance(raw, (tuple, list)) or not all(isinstance(x, slice) for x in raw):
        raise ValueError("it is not a tuple of slice objects")
    if len(raw) > len(shape):
        raise ValueError(f"{len(raw)} slices for a tensor of {len(shape)} dimension(s)")
    out: list[slice] = []
    for d, (sl, size) in enumerate(zip(raw, shape)):
        if sl.step not in (None, 1):
            raise ValueError(f"dim {d}: step {sl.step!r}; only step 1 is read")
        bounds = []
        for v, default in ((sl.start, 0), (sl.stop, size)):
            if v is None:
                v = default
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"dim {d}: {sl} has a non-int bound {v!r}")
            bounds.append(v + size if v < 0 else v)
        start, stop = bounds
        if not 0 <= start <= stop <= size:
            raise ValueError(f"dim {d}: {sl} does not fit size {size} "
                             f"(needs 0 <= start <= stop <= {size})")
        out.append(slice(start, stop))
    out += [slice(0, size) for size in shape[len(out):]]
    if all(sl.start == 0 and sl.stop == size for sl, size in zip(out, shape)):
        return None
    return tuple(out)


def _selected_shape(sel: Slices | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape if sel is None else tuple(sl.stop - sl.start for sl in sel)


class _ToLoader:
    """A manifest tensor that goes to ``load_weights`` under ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _Check:
    """A destination tensor an earlier bucket of a lazy stream already wrote from another
    manifest tensor (a tie the sender sent twice, or two tensors into one tied
    destination): the bucket compares its bytes instead of writing them, and refuses the
    bucket unless they are equal."""

    __slots__ = ("dest", "what")

    def __init__(self, dest: torch.Tensor, what: str) -> None:
        self.dest = dest
        self.what = what


_Target = torch.Tensor | _ToLoader | _Check | None


class _Claims(dict[tuple[Any, ...], tuple[str, int, str, str]]):
    """Destination memory claimed so far: identity key -> (canonical manifest name, its
    bucket, the manifest name written there, the destination name). ``spans`` holds the
    byte ranges of the contiguous claimed tensors, (device, start, end, destination
    name), sorted and disjoint; ``strided`` the others with their byte runs
    (:func:`~ray_rdt_pool.memory.tensors.byte_runs`), so that a destination that shares bytes
    with another without being the same tensor (a slice of it, a dtype view, a
    conjugate, a transpose, a column slice crossing another) is found, while strided
    views that interleave without sharing a byte are not."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[str, int, int, str]] = []
        self.strided: list[tuple[str, int, int, str, tuple[Any, int] | None]] = []

    def copy(self) -> _Claims:
        c = _Claims()
        c.update(self)
        c.spans = list(self.spans)
        c.strided = list(self.strided)
        return c

    def overlap(self, d: torch.Tensor, dn: str) -> tuple[str, bool] | None:
        """The claimed destination that ``d`` (named ``dn``, not claimed yet) shares
        bytes with, as (its name, False), or None, when ``d`` is then recorded. (name,
        True) when ``d`` and a strided claimed tensor span each other's bytes but have
        too many runs to compare (over ``MAX_BYTE_RUNS``): they are refused, since they
        could not be shown apart."""
        import bisect

        from ray_rdt_pool.memory.tensors import byte_runs, reach, runs_meet

        if not d.nbytes:
            return None
        dev, start = str(d.device), d.data_ptr()
        end = start + reach(d, d.nbytes)
        dense = d.is_contiguous()
        mine: list[tuple[Any, int] | None] = []  # d's runs, made once when first needed

        def meets(theirs: tuple[Any, int] | None, name: str) -> tuple[str, bool] | None:
            if not mine:
                mine.append((_one(start), end - start) if dense else byte_runs(d))
            if mine[0] is None or theirs is None:
                return name, True
            return (name, False) if runs_meet(mine[0], theirs) else None

        # The last span starting at or before ``start``, then those starting before ``end``.
        i = bisect.bisect_right(self.spans, (dev, start, math.inf, ""))
        j = i - 1 if i and self.spans[i - 1][0] == dev and self.spans[i - 1][2] > start else i
        while j < len(self.spans) and self.spans[j][0] == dev and self.spans[j][1] < end:
            _dev, s, e, name = self.spans[j]
            found = (name, False) if dense else meets((_one(s), e - s), name)
            if found is not None:
                return found
            j += 1
        for sdev, s, e, name, theirs in self.strided:
            if sdev == dev and s < end and start < e:
                found = meets(theirs, name)
                if found is not None:
                    return found
        if dense:
            self.spans.insert(i, (dev, start, end, dn))
        else:
            self.strided.append((dev, start, end, dn, mine[0] if mine else byte_runs(d)))
        return None


def _one(addr: int) -> torch.Tensor:
    """The start of a single run, as :func:`~ray_rdt_pool.memory.tensors.byte_runs` lists it."""
    return torch.tensor([addr], dtype=torch.int64)


@dataclass
class _Stream:
    """One stream in progress on a receiver."""

    session: str
    version: int
    plan: LoadPlan | None  # the whole layout's plan; None for a lazy (bucket-by-bucket) stream
    claimed: dict[str, str] = field(default_factory=dict)  # lazy: target name -> manifest name
    skipped: int = 0
    next: int = 0
    pending: dict[int, tuple[list[ObjectRef], BucketLayout | None]] = field(
        default_factory=dict)
    failed: str | None = None
    #: it still holds its version's reservation (given back once: by its commit, or by
    #: its first failure; a second give-back would drop another load's reservation)
    reserved: bool = True
    draining: bool = False
    #: lazy: destination memory written so far, across buckets (see :class:`_Check`)
    mem: _Claims = field(default_factory=_Claims)
    #: the sender process this receiver accepted source-read buckets from, if any
    source: SourceProcess | None = None


class WeightReceiver:
    """Loads manifests into a destination in place. Lives in the inference actor.

    Args:
        dest: An ``nn.Module`` (its ``state_dict(keep_vars=True)``: live parameters and
            persistent buffers) or a ``Mapping[str, Tensor]`` of the tensors to write.
            May be ``None`` when ``load_weights`` is given.
        load_weights: A callable taking an iterable of ``(name, tensor)`` pairs, such as
            an inference engine's ``model.load_weights``. Each bucket's tensors whose
            (mapped) name is not in ``dest`` are passed to it as soon as the bucket
            arrives, in the manifest's dtype. The tensors are views of the receive arena,
            valid during the call only: copy what you keep (the arena block returns when
            the call ends). An exception in it raises :class:`LoaderError`.
        name_map: Maps a manifest name to a destination name: a dict (unlisted names
            keep their name) or a callable; ``None`` as the value skips the tensor.
        casting: dtype rule, see :func:`can_cast`. The destination's dtype is the
            target: fp32 weights load into a bf16 model converted.
        strict: Raise on destination tensors no manifest tensor maps to
            (:class:`MissingWeightsError`) and on manifest tensors whose mapped name is
            not in the destination and that no ``load_weights`` takes
            (:class:`UnexpectedWeightsError`). With ``False`` both are ignored (extras
            are skipped).
        direct: Land exactly matching buckets in the destination tensors
            (``set_target_for_ref``); ``False`` always reads into the arena and copies.
        select: Sharded pulls: ``select(name, full_shape)`` returns the part of manifest
            tensor ``name`` this receiver needs, as a tuple of ``slice`` objects (step 1,
            one per leading dimension; the rest are whole), or ``None`` for all of it.
            Only those bytes are read (``transport.fetch_selected``), and tensors nobody
            takes are not read at all. The destination tensor has the selected shape;
            ``load_weights`` gets the selected part. An answer that does not fit the
            full shape raises :class:`SelectError` before anything is read. Buckets with
            a selection go through the arena (no direct landing); aliases (tied
            tensors) get their canonical tensor's selection.

    ``version`` is the version of the last manifest or stream fully loaded (0 before
    any); it never goes down. A load whose version is not newer raises
    :class:`StaleVersionError`. One writer at a time: a load writes the destination
    under one lock, a stream each bucket; a load or stream checks its version when it
    starts, again when it takes the receiver over (after any write in progress), and
    once more when it commits, all under the version lock. So concurrent loads (an
    actor with ``max_concurrency > 1``, :meth:`load_async`, a driver's publish during a
    stream) are safe: of two loads of one version exactly one succeeds; an older one
    that starts writing after a newer one committed raises :class:`StaleVersionError`
    before it writes; a newer load or stream supersedes a stream in progress (whose
    later buckets and commit are then refused), and an older one is refused while it
    runs. A load that fails midway leaves ``version`` as it was.
    """

    def __init__(self, dest: StateLike | None = None, *, load_weights: LoadWeights | None = None,
                 name_map: NameMap = None, casting: Casting = "same_kind", strict: bool = True,
                 direct: bool = True, select: Select | None = None) -> None:
        if select is not None and not callable(select):
            raise InvalidInputError(f"select must be callable (name, full_shape) -> slices | "
                                    f"None, got {type(select).__name__}")
        _check_flag("strict", strict)
        _check_flag("direct", direct)
        if dest is None and load_weights is None:
            raise InvalidInputError("WeightReceiver needs a dest (module or mapping), a "
                                    "load_weights callable, or both")
        if load_weights is not None and not callable(load_weights):
            raise InvalidInputError(f"load_weights must be callable, got "
                                    f"{type(load_weights).__name__}")
        if dest is not None:
            named_tensors(dest, "destination tensor")  # validate early
        can_cast(torch.float32, torch.float32, casting)
        _mapper(name_map)
        self.dest = dest
        self.load_weights = load_weights
        self.name_map = name_map
        self.casting = casting
        self.strict = strict
        self.direct = direct
        self.select = select
        self._version = 0
        self._loaded = False  # any complete load yet (so any first version is accepted)
        self._last_id = ""  # Manifest.id of the last complete load
        self._reserved: list[int] = []  # versions being loaded now
        # Guards the version, the reservations and the stream state. Never held while
        # waiting for _writing (taken first when both are needed).
        self._lock = threading.Lock()
        # Held while bytes are written (a whole load(), one stream bucket) and at a
        # stream's commit, so no commit ever sees another writer's bytes in flight.
        self._writing = threading.Lock()
        # The stream that holds this receiver between its calls (begin, buckets, commit).
        self._stream: _Stream | None = None

    @property
    def version(self) -> int:
        """The version of the last complete load (0 before any)."""
        return self._version

    def _reserve(self, version: int, what: str = "manifest", manifest_id: str = "") -> None:
        """Check that ``version`` is newer than the last complete load and than every load
        in progress, and reserve it, atomically; else raise StaleVersionError.

        The one exception: the manifest loaded last (same ``Manifest.id``) may be loaded
        again when no load of it is in progress (``release=False`` re-loads)."""
        with self._lock:
            top = max(self._reserved, default=None)
            if top is not None and version <= top:
                raise StaleVersionError(version, top, what, loading=True)
            self._newer_locked(version, what, manifest_id)
            self._reserved.append(version)

    def _unreserve(self, version: int) -> None:
        with self._lock:
            self._unreserve_locked(version)

    def _unreserve_locked(self, version: int) -> None:
        if version in self._reserved:
            self._reserved.remove(version)

    def _newer_locked(self, version: int, what: str, manifest_id: str = "") -> None:
        """StaleVersionError unless ``version`` is newer than the last complete load (or
        is the manifest loaded last, loaded again)."""
        again = bool(manifest_id) and manifest_id == self._last_id and version == self._version
        if self._loaded and version <= self._version and not again:
            raise StaleVersionError(version, self._version, what)

    def _take_over_locked(self, version: int, what: str, manifest_id: str = "") -> None:
        """Before a load writes or a stream begins: re-check the version (a load may have
        committed a newer one since the reservation), refuse if a stream of the same or a
        newer version holds the receiver, and supersede an older one (it never commits)."""
        self._newer_locked(version, what, manifest_id)
        st = self._stream
        if st is not None and st.failed is None and st.version >= version:
            raise StaleVersionError(version, st.version, what, loading=True)
        if st is not None:
            self._drop_locked(st, f"{what} version {version} superseded it on this receiver")

    def _drop_locked(self, st: _Stream, why: str) -> None:
        """End stream ``st`` without a commit: its later buckets and its commit are refused,
        and the buckets it holds early are dropped."""
        if self._stream is st:
            self._stream = None
        self._fail_locked(st, why)

    def _commit_locked(self, version: int, what: str, manifest_id: str = "") -> None:
        self._newer_locked(version, what, manifest_id)  # never lets the version go down
        self._unreserve_locked(version)
        self._version, self._loaded, self._last_id = version, True, manifest_id

    # -- validation --

    def _dests(self) -> dict[str, torch.Tensor]:
        # Unchecked: a lazy stream asks for them at every bucket, and only the ones a
        # manifest tensor writes need checking (_claim does, once per load or bucket).
        return dict(named_tensors(self.dest, None)) if self.dest is not None else {}

    def _resolve(self, sources: Sequence[tuple[str, TensorEntry]],
                 dests: Mapping[str, torch.Tensor], claimed: dict[str, str],
                 problems: list[tuple[str, str, str]], mem: _Claims | None = None,
                 lazy: bool = False
                 ) -> tuple[dict[str, _Target], int, dict[str, Slices | None]]:
        """Map each source name to its target (a dest tensor, the loader, or skipped),
        and each entry with a target to its selection (``select``).

        ``mem`` collects the destination memory written: two different manifest tensors
        into one destination tensor (a tied destination, an untied sender) is a
        ``duplicate`` problem, since only the last one written would stay; in a ``lazy``
        stream, where a tie across buckets is sent twice, a later bucket's tensor is
        compared with what the earlier one wrote instead (:class:`_Check`)."""
        mem = _Claims() if mem is None else mem
        mapname = _mapper(self.name_map)
        resolved: dict[str, _Target] = {}
        selections: dict[str, Slices | None] = {}
        bad_select: set[str] = set()
        skipped = 0
        for name, e in sources:
            try:
                dn = mapname(name)
                if dn is not None and not isinstance(dn, str):
                    raise TypeError(f"returned a {type(dn).__name__}")
            except Exception as err:
                resolved[name] = None
                problems.append(("unexpected", name, (
                    f"name_map({name!r}) failed ({type(err).__name__}: {err}); make it "
                    "return a destination name (a str), or None to skip the tensor")))
                continue
            if dn is None:
                resolved[name] = None
                skipped += 1
                continue
            d = dests.get(dn)
            if d is None and self.load_weights is None:
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
            if e.name not in selections and e.name not in bad_select:
                try:
                    selections[e.name] = self._select(e)
                except ValueError as err:
                    bad_select.add(e.name)
                    problems.append(("select", e.name, str(err)))
            if e.name in bad_select:
                continue
            shape = _selected_shape(selections[e.name], e.shape)
            what = "in the manifest" if shape == e.shape else \
                f"as selected (of {e.shape} in the manifest)"
            if d is None:
                resolved[name] = _ToLoader(dn)
                continue
            if tuple(d.shape) != shape:
                problems.append(("shape", name, f"{name!r} is {shape} {what} but "
                                 f"{dn!r} is {tuple(d.shape)} in the destination"))
            elif not can_cast(e.torch_dtype, d.dtype, self.casting):
                problems.append(("dtype", name, f"{name!r} is {e.dtype} in the manifest and "
                                 f"{dn!r} is {_dtype_str(d.dtype)}; casting={self.casting!r} "
                                 "does not allow that conversion"))
            else:
                resolved[name] = self._claim(mem, lazy, name, dn, d, e, problems)
        return resolved, skipped, selections

    @staticmethod
    def _claim(mem: _Claims, lazy: bool, name: str, dn: str, d: torch.Tensor, e: TensorEntry,
               problems: list[tuple[str, str, str]]) -> _Target:
        """``d`` as the target of manifest name ``name`` (entry ``e``), unless another
        manifest tensor already writes that memory (see :meth:`_resolve`)."""
        if d.numel() == 0:
            return d
        _check_weight(dn, d, "destination tensor")  # its memory may have gone since
        key = _identity_key(d)
        prior = mem.get(key)
        if prior is None:
            met = mem.overlap(d, dn)
            if met is not None:
                other, unsure = met
                from ray_rdt_pool.memory.tensors import MAX_BYTE_RUNS

                how = (f"spans the bytes of destination {other!r} in over "
                       f"{MAX_BYTE_RUNS:,} strided runs, too many to show that they do "
                       "not overlap" if unsure else
                       f"shares memory with destination {other!r} without being the same "
                       "tensor (a slice, a view of another dtype or layout of it): one "
                       "would overwrite the other's bytes")
                problems.append(("duplicate", name, (
                    f"destination {dn!r} (for {name!r}) {how}. Give each weight memory "
                    "of its own, or map one of them to None")))
                return None
            mem[key] = (e.name, e.bucket, name, dn)
            return d
        canon, bucket, pname, pdn = prior
        if canon == e.name:
            return d  # one manifest tensor under two names (tied on both sides)
        if lazy and bucket != e.bucket:
            return _Check(d, f"{name!r} (into {dn!r}) and {pname!r} (into {pdn!r}, bucket "
                             f"{bucket}) are one tensor in the destination")
        problems.append(("duplicate", name, (
            f"{name!r} and {pname!r} are different tensors in the manifest, but {dn!r} and "
            f"{pdn!r} are one tensor (tied) in the destination, which would keep only the "
            "one written last; tie them in the sender too (it then sends the tensor once), "
            "map one of them to None, or untie the destination")))
        return None

    def _select(self, e: TensorEntry) -> Slices | None:
        """``select``'s part of entry ``e``, normalized; ValueError naming the fix if it
        does not fit."""
        if self.select is None:
            return None
        try:
            raw = self.select(e.name, e.shape)
        except Exception as err:
            raise ValueError(
                f"select({e.name!r}, {e.shape}) raised {type(err).__name__}: {err}; make "
                "select return a tuple of step-1 slices for every manifest tensor, or None "
                "for the whole tensor") from None
        try:
            return _normalize_select(raw, e.shape)
        except ValueError as err:
            raise ValueError(
                f"select({e.name!r}, {e.shape}) returned {raw!r}: {err}. Return a tuple of "
                "step-1 slices within the full shape (e.g. (slice(r * n, (r + 1) * n),) for "
                "a dim-0 shard), or None for the whole tensor") from None

    def _missing(self, dests: Mapping[str, torch.Tensor], claimed: Mapping[str, str],
                 problems: list[tuple[str, str, str]], written: _Claims) -> None:
        """Destination names that receive nothing (``strict``). A name that is another
        name of a destination tensor that receives something (a tied weight: same
        memory, shape, strides and dtype; ``written`` from :meth:`_resolve`) is written
        with it: a sender's ``named_parameters()`` lists a tied tensor once, a
        ``state_dict`` under every name."""
        if not self.strict:
            return
        for dn, d in dests.items():
            if dn not in claimed and not (d.numel() > 0 and _identity_key(d) in written):
                problems.append(("missing", dn, f"destination {dn!r} receives no tensor "
                                 "from the manifest"))

    @staticmethod
    def _raise(problems: list[tuple[str, str, str]], written: str = "nothing was written"
               ) -> None:
        if problems:
            kinds = {p[0] for p in problems}
            cls = next(c for c in _ERROR_ORDER if c.kind in kinds)
            shown = "\n  ".join(f"[{k}] {d}" for k, _n, d in problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise cls(f"the weight manifest does not match the destination ({len(problems)} "
                      f"problem(s); {written}):\n  {shown}{more}", problems)

    def check(self, layout: WeightLayout) -> LoadPlan:
        """Validate ``layout`` against the destination and plan the load; writes nothing.

        Raises a :class:`ManifestMismatchError` subclass listing every problem, or
        :class:`WeightSyncError` for a layout that contradicts itself.
        """
        _check_layout(layout.entries, layout.buckets)
        dests = self._dests()
        by_name = layout.by_name()
        sources = [(e.name, e) for e in layout.entries]
        sources += [(a, by_name[c]) for a, c in layout.aliases if c in by_name]
        problems: list[tuple[str, str, str]] = []
        claimed: dict[str, str] = {}
        mem = _Claims()
        resolved, skipped, selections = self._resolve(sources, dests, claimed, problems, mem)
        self._missing(dests, claimed, problems, mem)
        self._raise(problems)
        return LoadPlan(layout, self._plan_buckets(layout, resolved, selections), skipped)

    def _plan_buckets(self, layout: WeightLayout, resolved: Mapping[str, _Target],
                      selections: Mapping[str, Slices | None] | None = None
                      ) -> list[BucketPlan]:
        selections = selections or {}
        alias_of: dict[str, list[str]] = {}
        for a, c in layout.aliases:
            alias_of.setdefault(c, []).append(a)
        plans: list[BucketPlan] = []
        by_bucket: dict[int, list[TensorEntry]] = {}
        for e in layout.entries:
            by_bucket.setdefault(e.bucket, []).append(e)
        for b in layout.buckets:
            entries = sorted(by_bucket.get(b.index, []), key=lambda e: e.index)
            targets = [resolved.get(e.name) for e in entries]
            dests = [t if isinstance(t, torch.Tensor) else None for t in targets]
            # A bucket that must first be compared with what an earlier bucket wrote into
            # a tied destination is read into the arena, so a refusal writes none of it.
            checked = any(isinstance(t, _Check) for t in targets) or any(
                isinstance(resolved.get(a), _Check) for e in entries
                for a in alias_of.get(e.name, ()))
            land = self.direct and not checked and all(
                d is not None and _can_land(d, e) for d, e in zip(dests, entries))
            if land:
                ptrs = [d.data_ptr() for d in dests if d is not None and d.numel() > 0]
                land = len(ptrs) == len(set(ptrs))
            wanted = [selections.get(e.name) for e in entries]
            select = None
            if self.select is not None:
                # Read part of the bucket when a tensor is selected or nobody takes one
                # (an empty dim-0 slice skips it).
                taken = [self._taken(e, t, alias_of, resolved) for e, t in zip(entries, targets)]
                if any(w is not None for w in wanted) or not all(taken):
                    select = [w if ok else _skip(e) for w, ok, e in zip(wanted, taken, entries)]
                    land = False
            plan = BucketPlan(b.index, b.nbytes, list(dests) if land else None,  # type: ignore
                              entries=entries)
            if select is not None:
                plan.select = select
                plan.nbytes = sum(
                    math.prod(_selected_shape(sl, e.shape)) * _itemsize(e.torch_dtype)
                    for sl, e in zip(select, entries))
            for e, t in zip(entries, targets):
                if isinstance(t, _ToLoader):
                    plan.loads.append((e.index, t.name))
                elif isinstance(t, _Check):
                    plan.verify.append((e.index, t.dest, t.what))
                elif not land and t is not None:
                    plan.copies.append((e.index, t))
                for a in alias_of.get(e.name, ()):
                    at = resolved.get(a)
                    if isinstance(at, _ToLoader):
                        plan.loads.append((e.index, at.name))
                    elif isinstance(at, _Check):
                        plan.verify.append((e.index, at.dest, at.what))
                    elif at is not None and not (isinstance(t, torch.Tensor)
                                                 and _same_memory(at, t)):
                        plan.copies.append((e.index, at))
            plans.append(plan)
        return plans

    @staticmethod
    def _taken(e: TensorEntry, t: _Target, alias_of: Mapping[str, list[str]],
               resolved: Mapping[str, _Target]) -> bool:
        """Does any name of entry ``e`` (itself or an alias) have a target?"""
        return t is not None or any(resolved.get(a) is not None
                                    for a in alias_of.get(e.name, ()))

    # -- loading --

    def _load_bucket(self, plan: BucketPlan, ref: ObjectRef | SourceBucket | PoolBucket,
                     source: SourceProcess | None = None) -> BucketReport:
        import ray

        t0 = time.perf_counter()
        direct = plan.targets is not None
        src: list[torch.Tensor]
        if isinstance(ref, SourceBucket):
            if source is None or ref.source != source:
                raise WeightSyncError(
                    f"bucket {plan.index} names a source process this receiver did not "
                    "accept for the stream; only WeightSender.stream sends such buckets")
            got = self._read_source(plan, ref)
            src = got
        elif isinstance(ref, PoolBucket):
            from ray_rdt_pool._ray.transport import fetch_owned

            _check_arrived(plan, wire=ref.wire)

            # Targets are written in place (or copied into on first sight), as a get
            # with set_target_for_ref would.
            got = fetch_owned(ref.obj_id, ref.wire, ref.device,
                              plan.targets if plan.select is None else None, plan.select)
            src = got if plan.select is not None or plan.targets is None else plan.targets
        elif plan.select is not None:
            from ray_rdt_pool._ray import transport

            got = transport.fetch_selected(ref, plan.select)
            src = got
        elif plan.targets is not None:
            from ray.experimental import set_target_for_ref

            set_target_for_ref(ref, plan.targets)
            got = ray.get(ref)
            if any(g is not t and g.data_ptr() != t.data_ptr()
                   for g, t in zip(got, plan.targets)):
                # Ray ignored the targets (e.g. one was collected): copy instead.
                direct = False
                _check_arrived(plan, got)
                _copy_all(zip(plan.targets, got))
            src = plan.targets
        else:
            got = ray.get(ref)
            src = got
        if src is got and not isinstance(ref, PoolBucket):
            # (Landed in the targets, the transport compared them with the object first.)
            _check_arrived(plan, got)
        for idx, d, what in plan.verify:
            if not _same_bytes(d, src[idx]):
                del got, src
                raise DuplicateTargetError(
                    f"{what}, but bucket {plan.index} brings other bytes than the earlier "
                    f"bucket wrote; bucket {plan.index} was not written. Tie the tensors in "
                    "the sender, map one of them to None, or untie the destination",
                    [("duplicate", what, "different bytes into one destination tensor")])
        if plan.copies:
            _copy_all((d, src[idx]) for idx, d in plan.copies)
        if plan.loads:
            assert self.load_weights is not None
            batch = [(name, src[idx]) for idx, name in plan.loads]
            names = [n for n, _t in batch]
            try:
                with torch.no_grad():
                    self.load_weights(batch)
            except Exception as e:
                batch.clear()
                del got, src
                # The loader's frames may hold the arena views: let the block return.
                traceback.clear_frames(e.__traceback__)
                shown = ", ".join(repr(n) for n in names[:8])
                more = f" and {len(names) - 8} more" if len(names) > 8 else ""
                raise LoaderError(
                    f"load_weights raised {type(e).__name__}: {e} while loading bucket "
                    f"{plan.index} ({len(names)} tensor(s): {shown}{more}); the bucket's "
                    "arena block was released and the receiver's version is unchanged. Fix "
                    "the loader, or map names it does not take to None with name_map",
                    plan.index, names) from e
            batch.clear()
        del got, src
        return BucketReport(plan.index, plan.nbytes, direct, time.perf_counter() - t0)

    @staticmethod
    def _read_source(plan: BucketPlan, sb: SourceBucket) -> list[torch.Tensor]:
        """Copy bucket ``plan.index`` straight out of the sender's tensors: into the
        destination tensors when it lands directly, else into the receive arena (only
        the selected part of each tensor with ``select``)."""
        from ray_rdt_pool._ray.transport import read_source

        entries = plan.entries
        if len(sb.addrs) != len(entries):
            raise WeightSyncError(
                f"bucket {plan.index} arrived with {len(sb.addrs)} source addresses for "
                f"{len(entries)} tensors; the sender and this receiver disagree on the layout")
        tensors = [(a, e.shape, e.dtype) for a, e in zip(sb.addrs, entries)]
        return read_source(sb.source, tensors, plan.select, plan.targets)

    def accept_source(self, session: str, source: SourceProcess) -> bool:
        """For stream ``session`` (just begun): accept buckets read straight out of
        ``source`` if :meth:`can_read_source`; buckets naming any other process are
        refused."""
        ok = self.can_read_source(source)
        with self._lock:
            st = self._stream
            if st is None or st.session != session:
                return False
            st.source = source if ok else None
        return ok

    def can_read_source(self, source: SourceProcess) -> bool:
        """Whether this receiver can copy stream buckets straight out of ``source`` (the
        sender's process): same Ray node, ``same_node`` not ``"off"`` here, and the
        kernel lets it read that process (see docs/weight-sync.md)."""
        from ray_rdt_pool._ray.transport import can_read_source

        return can_read_source(source)

    def load(self, manifest: Manifest, *, release: bool = True) -> LoadReport:
        """Validate, then load every bucket of ``manifest`` in order, in place.

        Raises :class:`StaleVersionError` (writing nothing) when ``manifest.version`` is
        not newer than :attr:`version`, or than a load or stream in progress. Loads on
        one receiver run one at a time (a concurrent one waits, then checks its version
        again before it writes: an older one then raises). A load newer than a stream in
        progress supersedes that stream once its bucket in progress is written (the
        stream's later buckets and its commit are refused). With ``release=True`` each
        bucket's ref is removed from ``manifest`` (this process's copy) as soon as the
        bucket is loaded.
        """
        _check_flag("release", release)
        if not isinstance(manifest, Manifest):
            raise InvalidInputError(f"load() takes a Manifest (from WeightSender.publish), "
                                    f"got {type(manifest).__name__}")
        v, mid = manifest.version, manifest.id
        self._reserve(v, "manifest", mid)
        try:
            # Refused manifests (a layout mismatch, released buckets) write nothing, so
            # they must not supersede a healthy stream either: check before taking over.
            plan = self._plan(manifest)
            with self._writing:
                with self._lock:
                    self._take_over_locked(v, "manifest", mid)
                report = self._load(manifest, plan, release)
                with self._lock:
                    self._commit_locked(v, "manifest", mid)
        finally:
            self._unreserve(v)
        return report

    def _plan(self, manifest: Manifest) -> LoadPlan:
        plan = self.check(manifest.layout)
        missing = [k for k, r in enumerate(manifest.refs) if r is None]
        if missing:
            raise ManifestReleasedError(
                f"bucket(s) {missing[:10]} of manifest version {manifest.version} were "
                "already released; load a fresh manifest, or pass release=False to load "
                "one twice")
        return plan

    def _load(self, manifest: Manifest, plan: LoadPlan, release: bool) -> LoadReport:
        reports: list[BucketReport] = []
        for bp in plan.buckets:
            box = manifest.refs[bp.index]
            assert box is not None
            reports.append(self._load_bucket(bp, box[0]))
            if release:
                manifest.refs[bp.index] = None
            del box
        return _summarise(manifest.version, reports, plan.skipped)

    async def load_async(self, manifest: Manifest, *, release: bool = True) -> LoadReport:
        """:meth:`load` in a worker thread, for ``async def`` actor methods.

        The actor's event loop keeps serving other calls while the buckets are read and
        copied (``asyncio.to_thread``).
        """
        return await asyncio.to_thread(self.load, manifest, release=release)

    # -- streaming (called through __ray_call__ by WeightSender.stream) --

    def begin_stream(self, session: str, layout: WeightLayout | None, version: int) -> int:
        """Validate a streamed layout and get ready for its buckets.

        ``layout=None`` starts a lazy stream, whose buckets each bring their own
        :class:`BucketLayout`. Raises :class:`StaleVersionError` when ``version`` is not
        newer than :attr:`version`, or than a load or stream in progress. A stream in
        progress of an older version (its sender gave up, or died) is superseded: its
        later buckets and its commit are refused. Returns the number of manifest tensors
        this receiver will skip (0 for a lazy stream; :meth:`finish_stream` returns its
        count).
        """
        self._reserve(version, "stream")
        try:
            plan = self.check(layout) if layout is not None else None
            with self._lock:
                self._take_over_locked(version, "stream")
                self._stream = _Stream(session, version, plan)
        except BaseException:
            self._unreserve(version)
            raise
        return plan.skipped if plan is not None else 0

    def abort_stream(self, session: str | None = None) -> None:
        """Drop the stream in progress (``session``, or any) and the buckets it holds.
        It never commits; a bucket being written now finishes, and is the last."""
        with self._lock:
            st = self._stream
            if st is None or (session is not None and st.session != session):
                return
            self._drop_locked(st, "the stream was aborted")

    def load_stream_bucket(self, session: str, k: int, box: list[ObjectRef],
                           spec: BucketLayout | None = None) -> list[BucketReport]:
        """Load bucket ``k`` of the current stream; returns the buckets loaded by this call.

        Buckets are loaded in order. One that arrives early (an async or threaded actor
        may run the calls out of order) is kept and loaded, by the call that loads its
        predecessor, right after it; such a call returns ``[]``. After a failure the
        stream's later buckets are refused. Nothing is committed here: the version is
        committed by :meth:`finish_stream`, which the sender calls once every receiver
        acknowledged every bucket.
        """
        with self._lock:
            st = self._stream
            if st is None or st.session != session:
                box.clear()
                raise WeightSyncError(
                    f"bucket {k} of stream {session} arrived, but this receiver is not in "
                    "that stream (a newer load or stream superseded it, or it was aborted)")
            if st.failed is not None:
                box.clear()
                raise WeightSyncError(f"bucket {k} skipped: {st.failed}")
            if (st.plan is None) != (spec is not None) or k < st.next or k in st.pending:
                self._fail_locked(st, f"bucket {k} does not belong to this stream "
                                      f"(expected {st.next})")
                box.clear()
                raise WeightSyncError(st.failed)
            st.pending[k] = (box, spec)
            if st.draining:
                return []  # the call loading an earlier bucket loads this one too
            st.draining = True
        reports: list[BucketReport] = []
        loaded_k = False
        while True:
            # One bucket per hold of _writing: a newer load waits for this bucket only,
            # and supersedes the stream before its next one.
            with self._writing:
                with self._lock:
                    item = None
                    if self._stream is st and st.failed is None:
                        item = st.pending.pop(st.next, None)
                    if item is None:
                        st.draining = False
                        if st.failed is not None and not loaded_k:
                            raise WeightSyncError(f"bucket {k} skipped: {st.failed}")
                        return reports
                    j = st.next
                kbox, kspec = item
                del item
                try:
                    reports.append(self._stream_one(st, j, kbox[0], kspec))
                except BaseException as e:
                    with self._lock:
                        self._fail_locked(st, f"bucket {j} failed on this receiver: {e!r}")
                        st.draining = False
                    raise
                finally:
                    kbox.clear()
                with self._lock:
                    st.next = j + 1
                loaded_k = loaded_k or j == k

    def _fail_locked(self, st: _Stream, why: str) -> None:
        """Stream ``st`` failed here: it keeps the receiver (so its later buckets are
        refused with ``why``) until it is aborted or superseded, and never commits."""
        if st.reserved:
            st.reserved = False
            self._unreserve_locked(st.version)
        if st.failed is None:
            st.failed = why
        for b, _s in st.pending.values():
            b.clear()
        st.pending.clear()

    def _stream_one(self, st: _Stream, k: int, ref: ObjectRef | SourceBucket | PoolBucket,
                    spec: BucketLayout | None
                    ) -> BucketReport:
        if st.plan is not None:
            return self._load_bucket(st.plan.buckets[k], ref, st.source)
        assert spec is not None
        if spec.bucket.index != k:
            raise WeightSyncError(f"bucket {k} arrived with the layout of bucket "
                                  f"{spec.bucket.index}")
        _check_layout(spec.entries, (spec.bucket,), k)
        by_name = {e.name: e for e in spec.entries}
        sources = [(e.name, e) for e in spec.entries]
        sources += [(a, by_name[c]) for a, c in spec.aliases if c in by_name]
        problems: list[tuple[str, str, str]] = []
        claimed, mem = dict(st.claimed), st.mem.copy()
        resolved, skipped, selections = self._resolve(sources, self._dests(), claimed,
                                                      problems, mem, lazy=True)
        self._raise(problems, f"bucket {k} was not written; bucket(s) {_ranges(range(k))} "
                              f"were, and the version stays {self._version}")
        layout = WeightLayout(spec.entries, (spec.bucket,), spec.aliases)
        rep = self._load_bucket(self._plan_buckets(layout, resolved, selections)[0], ref,
                                st.source)
        st.claimed, st.mem, st.skipped = claimed, mem, st.skipped + skipped
        return rep

    def finish_stream(self, session: str, buckets: int) -> int:
        """Commit a stream after its ``buckets`` buckets: the sender calls it once every
        receiver acknowledged every bucket. Checks for destination tensors that received
        nothing (``strict``; a lazy stream's only chance to), then commits the version.
        A stream that was aborted, superseded or failed here never commits. Returns the
        number of manifest tensors skipped."""
        with self._writing, self._lock:
            st = self._stream
            if st is None or st.session != session:
                raise WeightSyncError(
                    f"stream {session} ended, but this receiver is not in that stream (a "
                    "newer load or stream superseded it, or it was aborted); the version "
                    f"stays {self._version}")
            if st.failed is not None:
                raise WeightSyncError(f"stream {session} failed on this receiver: {st.failed}")
            if st.next != buckets or st.pending:
                raise WeightSyncError(f"stream {session} ended after {buckets} bucket(s), but "
                                      f"this receiver loaded {st.next}")
            problems: list[tuple[str, str, str]] = []
            if st.plan is None:
                self._missing(self._dests(), st.claimed, problems, st.mem)
            if problems:
                self._drop_locked(st, "destination tensors received nothing")
            self._raise(problems, f"all {buckets} bucket(s) were written, but the version "
                                  f"stays {self._version}")
            try:
                self._commit_locked(st.version, "stream")
                st.reserved = False  # the commit gave it back
            finally:
                self._drop_locked(st, "it was committed")  # or lost to a newer version
        return st.plan.skipped if st.plan is not None else st.skipped


def load_manifest(manifest: Manifest, dest: StateLike | None = None, *,
                  load_weights: LoadWeights | None = None, name_map: NameMap = None,
                  casting: Casting = "same_kind", strict: bool = True, direct: bool = True,
                  release: bool = True, select: Select | None = None) -> LoadReport:
    """Load ``manifest`` into ``dest`` in place: ``WeightReceiver(dest, ...).load(...)``."""
    receiver = WeightReceiver(dest, load_weights=load_weights, name_map=name_map,
                              casting=casting, strict=strict, direct=direct, select=select)
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


def _remote_begin(actor: Any, attr: str, session: str, layout: WeightLayout | None,
                  version: int, source: SourceProcess | None = None) -> tuple[int, bool]:
    """Begin a stream on a receiver: (tensors it skips, whether it can read ``source``)."""
    rec = _find(actor, attr, WeightReceiver)
    skipped = rec.begin_stream(session, layout, version)
    return skipped, source is not None and rec.accept_source(session, source)


def _remote_bucket(actor: Any, attr: str, session: str, k: int, box: list[ObjectRef],
                   spec: BucketLayout | None = None) -> list[BucketReport]:
    # On an async actor this runs on its event loop (Ray runs a sync __ray_call__
    # there), so it blocks the loop for one bucket; it still works, in any order.
    return _find(actor, attr, WeightReceiver).load_stream_bucket(session, k, box, spec)


def _remote_run(actor: Any, attr: str, session: str, ks: list[int],
                boxes: list[list[Any]]) -> list[BucketReport]:
    """Load a run of consecutive buckets (read in place or by reference), in order."""
    rec = _find(actor, attr, WeightReceiver)
    out: list[BucketReport] = []
    try:
        for k, box in zip(ks, boxes):
            out.extend(rec.load_stream_bucket(session, k, box))
    finally:
        boxes.clear()
    return out


def _remote_finish(actor: Any, attr: str, session: str, buckets: int) -> int:
    return _find(actor, attr, WeightReceiver).finish_stream(session, buckets)


def _remote_abort(actor: Any, attr: str, session: str) -> None:
    rec = getattr(actor, attr, None)
    if isinstance(rec, WeightReceiver):
        rec.abort_stream(session)


def _remote_load(actor: Any, attr: str, manifest: Manifest) -> LoadReport:
    return _find(actor, attr, WeightReceiver).load(manifest)


def _remote_publish(actor: Any, attr: str, version: int | None = None) -> Manifest:
    return _find(actor, attr, WeightSender).publish(version=version)


def _remote_stream(actor: Any, attr: str, receivers: list[ActorHandle], receiver_attr: str,
                   max_inflight: int, timeout_s: float, version: int | None = None
                   ) -> StreamReport:
    return _find(actor, attr, WeightSender).stream(
        receivers, version=version, receiver_attr=receiver_attr, max_inflight=max_inflight,
        timeout_s=timeout_s)


def sync(trainer: ActorHandle, receivers: Sequence[ActorHandle], *,
         mode: Literal["stream", "publish"] = "stream", max_inflight: int = 2,
         sender_attr: str = SENDER_ATTR, receiver_attr: str = RECEIVER_ATTR,
         timeout_s: float = 300.0, version: int | None = None) -> SyncReport:
    """Driver-side: sync the trainer's weights to every receiver and wait for it.

    The trainer actor holds a :class:`WeightSender` at ``sender_attr``; each receiver a
    :class:`WeightReceiver` at ``receiver_attr``. ``mode="stream"`` runs
    :meth:`WeightSender.stream` in the trainer (bounded pool memory, pipelined with
    ``max_inflight >= 2``). ``mode="publish"`` puts every bucket, hands the manifest to
    all receivers at once (they load concurrently), then drops the driver's copy, so the
    sender frees the pool when the last receiver is done. ``version`` is passed to
    ``publish``/``stream`` (default: one more than the highest version the sender
    used, successful or not). Every wait that outlasts its bound raises
    :class:`WeightSyncTimeoutError` naming what it waited for.
    """
    timeout_s = _timeout(timeout_s)
    if not _is_actor(trainer):
        raise InvalidInputError(f"sync() takes the trainer's actor handle first, got "
                                f"{type(trainer).__name__}")
    receivers = _actor_handles(receivers, "sync()")
    if mode not in ("stream", "publish"):
        raise InvalidInputError(f"mode must be 'stream' or 'publish', got {mode!r}")
    t0 = time.perf_counter()
    if mode == "stream":
        rep: StreamReport = _get_all(
            [trainer.__ray_call__.remote(_remote_stream, sender_attr, receivers,
                                         receiver_attr, max_inflight, timeout_s, version)],
            timeout_s * 2, f"the streaming sync (WeightSender.stream at {sender_attr!r} "
                           "on the trainer)")[0]
        return SyncReport("stream", rep.version, time.perf_counter() - t0, rep.nbytes,
                          rep.buckets, rep.loads, rep, rep.peak_pool_used)
    published = [trainer.__ray_call__.remote(_remote_publish, sender_attr, version)]
    try:
        manifest: Manifest = _get_all(
            published, timeout_s,
            f"publishing on the trainer (WeightSender.publish at {sender_attr!r})")[0]
    finally:
        # A held timeout's traceback must not keep the ref, and through it the buckets
        # of a publish that ends later, in the trainer's pool.
        published.clear()
    layout, version, used = manifest.layout, manifest.version, manifest.sender_pool_used
    try:
        loads = tuple(_get_all([r.__ray_call__.remote(_remote_load, receiver_attr, manifest)
                                for r in receivers], timeout_s,
                               "loading the manifest on the receivers"))
    finally:
        manifest.release()  # even on error: a held traceback must not pin the pool
        del manifest
    return SyncReport("publish", version, time.perf_counter() - t0, layout.total_bytes,
                      len(layout.buckets), loads, None, used)
