"""Bucketing a state on the sender: the layout of a module or mapping, the buckets of a
lazy source as its pairs arrive, and the wire dtype of each tensor.

Owns the bucketing rule (in order, at most ``bucket_bytes`` packed bytes per bucket, a
larger tensor alone; ties within a bucket become aliases) and ``wire_dtype`` checks.
Stateless but for :class:`LayoutMemo` (a sender's last layout): :func:`plan_layout`
returns a new layout, :func:`iter_buckets` is a generator that holds at most the
bucket being filled. Runs on the sender's thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ray_rdt_pool.core.layout import BLOCK_ALIGN, align_up, packed_offsets
from ray_rdt_pool.errors import DuplicateNameError, InvalidInputError, WireDtypeError
from ray_rdt_pool.weights.fp8 import (
    FP8,
    SCALE_SUFFIX,
    WireScale,
    block_of,
    quantize,
    scale_shape,
)
from ray_rdt_pool.weights.manifest import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_WIRE_SCALE,
    Bucket,
    BucketLayout,
    TensorEntry,
    WeightLayout,
    dtype_str,
    itemsize,
)
from ray_rdt_pool.weights.state import (
    StateLike,
    WireDtype,
    check_weight,
    identity_key,
    memory_key,
    named_tensors,
)


def check_bucket_bytes(bucket_bytes: Any) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InvalidInputError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")


def check_wire_dtype(wire_dtype: WireDtype) -> None:
    if wire_dtype is None or callable(wire_dtype):
        return
    if not isinstance(wire_dtype, torch.dtype) or not wire_dtype.is_floating_point:
        raise WireDtypeError(
            f"wire_dtype must be a floating-point torch.dtype (applied to every "
            f"floating-point tensor), a callable (name, tensor) -> dtype | None, or None; "
            f"got {wire_dtype!r}")
    _wire_carries(wire_dtype, None)


def _wire_carries(dt: torch.dtype, name: str | None) -> None:
    from ray_rdt_pool.core.runs import DTYPES

    if dtype_str(dt) not in DTYPES:
        who = f" for {name!r}" if name is not None else ""
        raise WireDtypeError(f"wire_dtype{who} is {dt}, which the nixl_pool wire does not "
                             f"carry; use one of {', '.join(DTYPES)}", name)


def _scaled(wire: torch.dtype, t: torch.Tensor) -> bool:
    """Whether ``t`` sent as ``wire`` is quantized into FP8 with scales: a tensor that is
    FP8 already travels as it is (its scales, if any, are tensors of their own)."""
    return wire in FP8 and t.dtype not in FP8


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
            f"wire_dtype({name!r}, <{dtype_str(t.dtype)} tensor>) returned "
            f"{type(got).__name__} {got!r}; return a torch.dtype, or None to send {name!r} "
            "as it is", name)
    _wire_carries(got, name)
    if not torch.can_cast(t.dtype, got):
        raise WireDtypeError(
            f"wire_dtype asks to send {name!r} ({dtype_str(t.dtype)}) as "
            f"{dtype_str(got)}, a cast down the order bool -> integer -> floating -> "
            f"complex; return None for {name!r} to send it as {dtype_str(t.dtype)}", name)
    return got


def plan_layout(state: StateLike, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                wire_dtype: WireDtype = None, wire_scale: WireScale = DEFAULT_WIRE_SCALE
                ) -> tuple[WeightLayout, list[list[torch.Tensor]]]:
    """Split a state, in order, into buckets of at most ``bucket_bytes`` packed bytes.

    Returns the layout and, per bucket, the (detached) tensors to put. A tensor larger
    than ``bucket_bytes`` gets a bucket of its own. Names that are the same tensor as an
    earlier name (same storage, offset, shape, strides and dtype) become aliases.
    ``wire_dtype`` (see :class:`WeightSender`) sets the dtype each tensor is sent as;
    the layout's entries, sizes and buckets are those of the wire dtypes, and the put
    converts (:func:`_put_bucket`). An alias is sent as its canonical tensor is. A
    tensor sent as FP8 takes two entries, the FP8 weight and its scales (``wire_scale``,
    see :mod:`.fp8`), and appears twice in its bucket's tensors, once for each.
    """
    layout, tensors, _picks = _plan_layout(state, bucket_bytes, wire_dtype, wire_scale)
    return layout, tensors


def _plan_layout(state: StateLike, bucket_bytes: int, wire_dtype: WireDtype,
                 wire_scale: WireScale = DEFAULT_WIRE_SCALE
                 ) -> tuple[WeightLayout, list[list[torch.Tensor]], list[list[int]]]:
    """:func:`plan_layout`, plus each bucket's positions in ``named_tensors(state)``."""
    check_bucket_bytes(bucket_bytes)
    check_wire_dtype(wire_dtype)
    items = named_tensors(state)
    seen: dict[tuple[Any, ...], str] = {}
    aliases: list[tuple[str, str]] = []
    groups: list[list[tuple[str, torch.Tensor, torch.dtype]]] = []
    cur: list[tuple[str, torch.Tensor, torch.dtype]] = []
    picks: list[list[int]] = []
    end = 0
    for i, (name, t) in enumerate(items):
        key = identity_key(t)
        if t.numel() > 0 and key in seen:
            aliases.append((name, seen[key]))
            continue
        seen.setdefault(key, name)
        wire = _wire_of(wire_dtype, name, t)
        new, end = _place(end, _parts(wire, t, wire_scale), bucket_bytes, bool(cur))
        if new:
            groups.append(cur)
            cur = []
        if not cur:
            picks.append([])
        cur.append((name, t, wire))
        picks[-1].extend([i, i] if _scaled(wire, t) else [i])  # an FP8 weight's scale too
    if cur:
        groups.append(cur)
    entries: list[TensorEntry] = []
    buckets: list[Bucket] = []
    tensors: list[list[torch.Tensor]] = []
    for k, group in enumerate(groups):
        spec = _bucket_spec(k, group, [], wire_scale)
        entries.extend(spec.entries)
        buckets.append(spec.bucket)
        tensors.append(_per_entry(group))
    return (WeightLayout(tuple(entries), tuple(buckets), tuple(aliases), bucket_bytes), tensors,
            picks)


class LayoutMemo:
    """One sender's last :func:`plan_layout`, made again only when a fact of the state
    it read changed (:func:`memory_key`) or the bucket size or wire dtype did: each
    sync of one model has the same layout. Holds no tensor, only the layout and each
    bucket's positions in the state. Used by the sender's task thread only."""

    def __init__(self) -> None:
        self._last: tuple[tuple[Any, ...], WeightLayout, list[list[int]]] | None = None

    def plan(self, state: StateLike, bucket_bytes: int, wire_dtype: WireDtype,
             wire_scale: WireScale = DEFAULT_WIRE_SCALE
             ) -> tuple[WeightLayout, list[list[torch.Tensor]]]:
        """:func:`plan_layout` of ``state``, the kept layout where nothing changed."""
        key = None
        # A callable wire_dtype may answer otherwise next time: never kept.
        if wire_dtype is None or isinstance(wire_dtype, torch.dtype):
            items = named_tensors(state, None)
            facts = memory_key(items)
            if facts is not None:
                key = (bucket_bytes, wire_dtype, wire_scale, facts)
            last = self._last
            if key is not None and last is not None and last[0] == key:
                return last[1], [[items[i][1].detach() for i in p] for p in last[2]]
            del items
        layout, tensors, picks = _plan_layout(state, bucket_bytes, wire_dtype, wire_scale)
        self._last = (key, layout, picks) if key is not None else None
        return layout, tensors


def _parts(wire: torch.dtype, t: torch.Tensor, wire_scale: WireScale
           ) -> list[tuple[int, int]]:
    """What a tensor sent as ``wire`` puts in its bucket: (item size, elements) of its
    weight and, sent as FP8, of its scales."""
    parts = [(itemsize(wire), t.numel())]
    if _scaled(wire, t):
        parts.append((4, math.prod(scale_shape(t.shape, block_of(t.shape, wire_scale)))))
    return parts


def _place(end: int, parts: Sequence[tuple[int, int]], bucket_bytes: int,
           open_bucket: bool) -> tuple[bool, int]:
    """The one bucketing rule, eager and lazy: whether a tensor (its ``parts``: item
    size and elements of each object tensor it puts, see :func:`_parts`) starts a new
    bucket, as adding it to the open bucket (filled to ``end``) would pass
    ``bucket_bytes``; and where the bucket it joins ends after it."""

    def after(at: int) -> int:
        for size, numel in parts:
            at = align_up(at, size) + numel * size
        return at

    if open_bucket and align_up(after(end), BLOCK_ALIGN) > bucket_bytes:
        return True, after(0)
    return False, after(end)


def _bucket_spec(k: int, group: Sequence[tuple[str, torch.Tensor, torch.dtype]],
                 aliases: Sequence[tuple[str, str]],
                 wire_scale: WireScale = DEFAULT_WIRE_SCALE) -> BucketLayout:
    """Bucket ``k``'s layout: entries in object order with their wire dtypes and sizes;
    an FP8 weight's entry is followed by its scales'."""
    entries: list[TensorEntry] = []
    for name, t, w in group:
        shape = tuple(t.shape)
        if _scaled(w, t):
            block = block_of(shape, wire_scale)
            entries.append(TensorEntry(name, shape, dtype_str(w), k, len(entries),
                                       t.numel(), block, dtype_str(t.dtype)))
            sshape = scale_shape(shape, block)
            entries.append(TensorEntry(name + SCALE_SUFFIX, sshape, "float32", k,
                                       len(entries), math.prod(sshape) * 4,
                                       scale_of=name))
        else:
            entries.append(TensorEntry(name, shape, dtype_str(w), k, len(entries),
                                       t.numel() * itemsize(w)))
    _offsets, total = packed_offsets([e.nbytes for e in entries],
                                     [itemsize(e.torch_dtype) for e in entries])
    return BucketLayout(Bucket(k, tuple(e.name for e in entries), total), tuple(entries),
                        tuple(aliases))


def _per_entry(group: Sequence[tuple[str, torch.Tensor, torch.dtype]]) -> list[torch.Tensor]:
    """A bucket's tensors, one per entry: an FP8 weight's twice (its scales come from
    it, when the bucket is packed: :func:`quantized`)."""
    out: list[torch.Tensor] = []
    for _n, t, w in group:
        out.extend([t.detach()] * (2 if _scaled(w, t) else 1))
    return out


def quantized(tensors: Sequence[torch.Tensor], entries: Sequence[TensorEntry]
              ) -> list[torch.Tensor]:
    """A bucket's tensors as they go on the wire: each FP8 weight and the one after it
    (the same tensor, standing for its scales) become the quantized weight and its
    scales (:func:`.fp8.quantize`); the rest as they are."""
    if not any(e.block is not None for e in entries):
        return list(tensors)
    out: list[torch.Tensor] = []
    i = 0
    for e in entries:
        if e.scale_of is not None:
            continue
        t = tensors[i]
        if e.block is not None:
            q, scale = quantize(t, e.torch_dtype, e.block)
            out.extend([q, scale])
            i += 2
        else:
            out.append(t)
            i += 1
    return out


def conversions(tensors: Sequence[torch.Tensor], entries: Sequence[TensorEntry]
                 ) -> dict[int, torch.dtype]:
    """``id(tensor)`` -> the wire dtype, for the tensors whose entry names another dtype."""
    return {id(t): e.torch_dtype for t, e in zip(tensors, entries)
            if dtype_str(t.dtype) != e.dtype}


@dataclass
class _Packed:
    spec: BucketLayout
    tensors: list[torch.Tensor]


def named_pairs(source: Iterable[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for item in source:
        pair = tuple(item) if isinstance(item, (tuple, list)) else None
        if pair is None or len(pair) != 2 or not isinstance(pair[0], str) \
                or not isinstance(pair[1], torch.Tensor):
            raise InvalidInputError(
                f"a lazy weight source yields (name: str, tensor: torch.Tensor) pairs, got "
                f"{type(item).__name__} {str(item)[:80]!r}")
        yield pair[0], pair[1]


def _pack(k: int, cur: list[tuple[str, torch.Tensor, torch.dtype]],
          aliases: list[tuple[str, str]], wire_scale: WireScale = DEFAULT_WIRE_SCALE
          ) -> _Packed:
    """Make bucket ``k`` of ``cur`` and empty ``cur`` and ``aliases`` (so the caller,
    a suspended generator, keeps no reference to the tensors)."""
    packed = _Packed(_bucket_spec(k, cur, aliases, wire_scale), _per_entry(cur))
    cur.clear()
    aliases.clear()
    return packed


def iter_buckets(pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                  wire_dtype: WireDtype = None, wire_scale: WireScale = DEFAULT_WIRE_SCALE
                  ) -> Iterator[_Packed]:
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
        check_weight(name, t, "weight")
        key = identity_key(t)
        if t.numel() > 0 and key in keys:
            aliases.append((name, keys[key]))
            continue
        wire = _wire_of(wire_dtype, name, t)
        new, end = _place(end, _parts(wire, t, wire_scale), bucket_bytes, bool(cur))
        if new:
            yield _pack(k, cur, aliases, wire_scale)
            k += 1
            keys = {}
        keys.setdefault(key, name)
        cur.append((name, t, wire))
        del t
    if cur:
        yield _pack(k, cur, aliases, wire_scale)
