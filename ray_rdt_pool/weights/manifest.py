"""The picklable description of a sync: layouts, buckets, manifests, bucket messages.

Owns the records that travel between the trainer and its receivers (no data, no torch
objects inside): :class:`TensorEntry`, :class:`Bucket`, :class:`WeightLayout` (a whole
state), :class:`BucketLayout` (one bucket of a lazy source), :class:`Manifest` (a
published state with its bucket refs), and the two messages a stream sends for a bucket
instead of a Ray object, :class:`SourceBucket` and :class:`PoolBucket`. All are frozen
(but ``Manifest``, whose refs a load drops) and safe to share between threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ray_rdt_pool.errors import InvalidInputError

if TYPE_CHECKING:
    from ray import ObjectRef

    from ray_rdt_pool.same_node.peer_memory import SourceProcess

#: The default ``bucket_bytes`` (``ray_rdt_pool.weights`` says why this size).
DEFAULT_BUCKET_BYTES = 32 << 20
#: The default scale groups of an FP8 wire: the 128 x 128 blocks of vLLM's block-FP8
#: layers (a tensor that is not 2-D takes one scale).
DEFAULT_WIRE_SCALE: tuple[int, int] = (128, 128)


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidInputError(f"dtype {name!r} is not available in this torch build")
    return dt


def itemsize(dtype: torch.dtype) -> int:
    # Not torch.empty(0, dtype=dtype).element_size(): under deterministic algorithms
    # torch fills what it allocates, and has no fill for float4_e2m1fn_x2.
    return dtype.itemsize


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a layout: its name, shape, dtype and place in a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  #: torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``
    bucket: int
    index: int  #: position in its bucket's object (the list given to ``ray.put``)
    nbytes: int
    #: an FP8 weight's scale groups (see :mod:`.fp8`); its scale is the next entry
    block: tuple[int, ...] | None = None
    #: an FP8 weight's dtype on the sender (what a loader gets it back as)
    orig: str | None = None
    #: a scale entry: the name of the FP8 weight it scales
    scale_of: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)


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


def layout_of(specs: Sequence[BucketLayout], bucket_bytes: int) -> WeightLayout:
    return WeightLayout(tuple(e for s in specs for e in s.entries),
                        tuple(s.bucket for s in specs),
                        tuple(a for s in specs for a in s.aliases), bucket_bytes)
