"""Partial reads: which bytes of each tensor a selection of slices covers.

Pure (ints and bytes). A *selection* of one tensor is a tuple of step-1 slices, at most
one per dim (:data:`Slices`; a lone slice or None also do). :func:`plan_selection` turns
one selection per tensor into a :class:`SelectionPlan`: the byte ranges to read and where
each lands, packed as the transport packs whole tensors. The receiver uses it for a
partial READ (the weights API's ``select``), a source read, and a copy out of a mapping;
the sender's object-store path checks selections with :func:`selection_bounds`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.layout import packed_offsets
from ray_rdt_pool.core.runs import DTYPES
from ray_rdt_pool.errors import InvalidInputError

if TYPE_CHECKING:
    from ray_rdt_pool.core.codec import WireMeta

__all__ = ["SelectionPlan", "Slices", "check_selection_count", "plan_for_object",
           "plan_selection", "selected_ranges", "selection_bounds"]

#: One tensor's selection: step-1 slices, at most one per dim.
Slices = tuple[slice, ...]


@dataclass
class SelectionPlan:
    """What a partial READ lands: per tensor its selected shape, dtype and offset in the
    landing, and the byte ranges ``(landing offset, packed offset, length)`` to read."""

    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    offsets: list[int]
    total: int
    ranges: list[tuple[int, int, int]]

    @property
    def nbytes(self) -> int:
        """The bytes read (``total`` adds the alignment padding of the landing)."""
        return sum(n for _lo, _p, n in self.ranges)


def plan_for_object(meta: WireMeta, selection: Sequence[Any]) -> SelectionPlan:
    """Plan a READ of only the selected part of each tensor (see transport.fetch_selected)."""
    check_selection_count(selection, meta.num_tensors)
    return plan_selection(meta.shapes_dtypes(), meta.tensor_offsets(), selection)


def check_selection_count(selection: Sequence[Any], n: int) -> None:
    """InvalidInputError unless ``selection`` has one entry per tensor of the object."""
    if len(selection) != n:
        raise InvalidInputError(f"{len(selection)} selections for an object of {n} tensors; "
                                "pass one (a tuple of slices, or None) per tensor")


def plan_selection(shapes_dtypes: Iterable[tuple[tuple[int, ...], str]],
                   bases: Sequence[int], selection: Sequence[Any]) -> SelectionPlan:
    """:func:`plan_for_object` for tensors whose bytes start at ``bases`` (packed offsets
    of a pool object, or addresses in a source process): the ranges read from there."""
    shapes: list[tuple[int, ...]] = []
    dtypes: list[str] = []
    rel: list[list[tuple[int, int]]] = []
    items: list[int] = []
    for i, ((shape, dt), sel) in enumerate(zip(shapes_dtypes, selection)):
        item = DTYPES[dt][1]
        out, ranges = selected_ranges(i, shape, item, sel)
        shapes.append(out)
        dtypes.append(dt)
        rel.append(ranges)
        items.append(item)
    sizes = [sum(n for _o, n in r) for r in rel]
    offsets, total = packed_offsets(sizes, items)
    ranges_out: list[tuple[int, int, int]] = []
    for off, base, ranges in zip(offsets, bases, rel):
        pos = off
        for o, n in ranges:
            ranges_out.append((pos, base + o, n))
            pos += n
    return SelectionPlan(shapes, dtypes, offsets, total, ranges_out)


def selection_bounds(i: int, shape: tuple[int, ...], sel: Any) -> list[tuple[int, int]]:
    """The ``[start, stop)`` of selection ``sel`` of tensor ``i`` (of ``shape``) on every
    dim, or InvalidInputError: a tuple of at most one step-1 slice per dim (a lone slice
    or None also do). The one check of a selection, whether it is read or, for an object
    this process holds, sliced."""
    if sel is None:
        sel = ()
    if isinstance(sel, slice):
        sel = (sel,)
    if not isinstance(sel, tuple) or len(sel) > len(shape) or not all(
            isinstance(s, slice) for s in sel):
        raise InvalidInputError(
            f"selection {i} is {sel!r} for a tensor of shape {shape}: pass a tuple of at most "
            f"{len(shape)} slices (or None for the whole tensor)")
    bounds: list[tuple[int, int]] = []
    for dim, size in enumerate(shape):
        start, stop, step = (sel[dim] if dim < len(sel) else slice(None)).indices(size)
        if step != 1:
            raise InvalidInputError(
                f"selection {i} has step {step} on dim {dim}; only step-1 slices can be "
                "read as byte ranges: read the range and slice it afterwards")
        bounds.append((start, max(start, stop)))
    return bounds


def selected_ranges(i: int, shape: tuple[int, ...], item: int, sel: Any
                    ) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """The selected shape and the ``(offset, length)`` byte ranges that selection ``sel``
    covers in a C-contiguous tensor of ``shape`` with ``item``-byte elements."""
    bounds = selection_bounds(i, shape, sel)
    out = tuple(b - a for a, b in bounds)
    if 0 in out:
        return out, []
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    narrow = [d for d, (a, b) in enumerate(bounds) if (a, b) != (0, shape[d])]
    if not narrow:
        n = 1
        for x in shape:
            n *= x
        return out, [(0, n * item)]
    k = narrow[-1]
    width = out[k] * strides[k]
    ranges = [((sum(j * s for j, s in zip(idx, strides)) + bounds[k][0] * strides[k]) * item,
               width * item)
              for idx in itertools.product(*(range(a, b) for a, b in bounds[:k]))]
    return out, ranges
