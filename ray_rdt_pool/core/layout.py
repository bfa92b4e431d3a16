"""Byte layout of a packed object: where each tensor lives in the object's packed space.

Pure (stdlib only). The sender and the receiver both derive tensor offsets from the
functions here, never from each other's arithmetic, so the two sides cannot drift
apart: the wire carries only shapes and dtypes, and each side recomputes the layout.

Terms used across the package:

* The *packed* (or *virtual*) space of an object is ``[0, total)``: tensors in order,
  each starting on a multiple of its own alignment (its element size), the end
  rounded up to :data:`BLOCK_ALIGN`.
* The *physical* placement of that space is a sequence of pool blocks
  ``(offset, length)``; the virtual space is their concatenation in order.
  :func:`map_extent` and :class:`BlockMap` translate a virtual range into the
  physical pieces it occupies.
* A *run* is ``(nbytes_each, align, count)``: ``count`` consecutive tensors of one size
  and alignment. A *group* is a sequence of runs repeated ``repeat`` times, one
  *repetition* after another (the wire format sends each pattern once).

The one placement rule: every tensor starts at the end of the previous one rounded up to
its own alignment. Nothing else ever pads, so the offsets of an object never depend on
how its tensors are grouped: :func:`group_layout` of any grouping equals
:func:`packed_offsets` of the tensors one by one.

Groups are *uniform* from their second repetition on: repetition ``k >= 1`` lies exactly
``(k - 1) * stride`` bytes after repetition 1, tensor for tensor, so one field of a
repeated pattern is a regular strided array of the block. The stride is not a choice
but a consequence of the rule: with ``M`` the widest alignment of the pattern (every
element size is a power of two, so all of them divide ``M``), the first tensor of width
``M`` in a repetition starts on a multiple of ``M``, which fixes where the next
repetition starts modulo ``M``; repetitions 1, 2, ... therefore start at the same offset
modulo ``M`` and lie alike. Repetition 0 starts wherever the previous group ended, so it
may sit off that grid (only if the pattern's first tensor is narrower than ``M`` and the
group starts at another offset modulo ``M`` than its later repetitions do; e.g. int8,
float64, int8 repeated from offset 0 lies at 0, 17, 33, 49, ...): :class:`Placed` says
where both lie, and :meth:`Placed.pieces` cuts a group into uniform pieces. The only
padding is each tensor's own alignment, so the wire needs no rule about where groups
begin or end, and any grouping of the same tensors gives the same bytes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from math import lcm
from typing import NamedTuple

__all__ = [
    "BLOCK_ALIGN",
    "BlockMap",
    "Placed",
    "Spec",
    "align_up",
    "group_layout",
    "group_offsets",
    "group_run_starts",
    "lay_runs",
    "map_extent",
    "packed_offsets",
    "run_layout",
]

#: One run as the layout sees it: ``(nbytes_each, align, count)``.
Spec = tuple[int, int, int]

# Every pool block starts on a 64-byte boundary. 64 is at least the largest element
# size (16, complex128), so a tensor at a block start is aligned for any dtype; it is
# also one cache line, so a memcpy into a fresh block starts aligned for the widest
# SIMD stores and two objects never share a line. Because every block length is a
# multiple of 64 too, a virtual offset and its physical offset agree modulo 64, which
# keeps each tensor element-aligned even when an object is split across blocks.
BLOCK_ALIGN = 64


def align_up(n: int, a: int) -> int:
    """Round ``n`` up to the next multiple of ``a`` (``a`` > 0); multiples stay as is."""
    if a <= 0:
        raise ValueError(f"alignment must be positive, got {a}")
    return -(-n // a) * a


def packed_offsets(nbytes: Sequence[int], aligns: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors packed in order, and the packed total.

    Tensor ``i`` starts at the end of tensor ``i - 1`` rounded up to ``aligns[i]``;
    the first starts at 0. A run of same-dtype tensors therefore packs with no
    padding. The total is the end of the last tensor rounded up to
    :data:`BLOCK_ALIGN` (0 when there are no tensors).

    Args:
        nbytes: Byte size of each tensor, ``numel * element_size``.
        aligns: Alignment of each tensor, its element size.

    Returns:
        ``(offsets, total)``.
    """
    if len(nbytes) != len(aligns):
        raise ValueError(f"{len(nbytes)} sizes but {len(aligns)} alignments")
    offsets: list[int] = []
    end = 0
    for n, a in zip(nbytes, aligns):
        if n < 0:
            raise ValueError(f"negative tensor size {n}")
        end = align_up(end, a)
        offsets.append(end)
        end += n
    return offsets, align_up(end, BLOCK_ALIGN)


def lay_runs(pos: int, runs: Sequence[Spec]) -> tuple[list[int], int]:
    """Start of each run laid out in order from packed position ``pos``, and the end.

    Each run starts at the current end rounded up to its alignment; its tensors follow
    each other with no padding (``nbytes_each`` is a multiple of ``align``). A run with
    ``count == 0`` contributes no tensor, so, as in the expansion, it does not move the
    end; its reported start is where it would begin. The end is not rounded.

    Raises:
        ValueError: for a negative size or count, a non-positive alignment, or
            ``count > 1`` with ``nbytes_each`` not a multiple of ``align`` (then the
            tensors of the run would not be contiguous).
    """
    starts: list[int] = []
    end = pos
    for nbytes_each, align, count in runs:
        if nbytes_each < 0 or count < 0:
            raise ValueError(f"negative size {nbytes_each} or count {count} in a run")
        if align <= 0:
            raise ValueError(f"alignment must be positive, got {align}")
        start = -(-end // align) * align  # align_up, inlined: this loop runs per run
        if count > 1 and nbytes_each % align:
            raise ValueError(
                f"a run of {count} tensors of {nbytes_each} bytes is not contiguous "
                f"at alignment {align}"
            )
        starts.append(start)
        if count:
            end = start + nbytes_each * count
    return starts, end


def run_layout(runs: Sequence[Spec]) -> tuple[list[int], int]:
    """Start offset of each run of equal tensors, and the packed total.

    Each run is ``(nbytes_each, align, count)``. The result equals
    :func:`packed_offsets` on the expanded list: tensor ``k`` of run ``r`` starts at
    ``starts[r] + k * nbytes_each``, which holds because ``nbytes_each`` is a
    multiple of ``align``, so no padding arises inside a run. This costs O(runs)
    instead of O(tensors), which matters for thousands of equal views. Runs with
    ``count == 0`` are placed as :func:`lay_runs` says.

    Raises:
        ValueError: as :func:`lay_runs`.
    """
    starts, end = lay_runs(0, runs)
    return starts, align_up(end, BLOCK_ALIGN)


class Placed(NamedTuple):
    """Where one group of runs lies in the packed space.

    Run ``j`` of repetition 0 starts at ``first[j]``; run ``j`` of repetition ``k >= 1``
    starts at ``origin[j] + k * stride``. When ``first == origin`` (the usual case) the
    whole group is uniform. A group with one repetition has ``stride == 0``.
    """

    first: list[int]
    origin: list[int]
    stride: int

    def pieces(self, repeat: int) -> list[tuple[list[int], int, int]]:
        """The group as uniform pieces ``(run starts of the piece's first repetition,
        stride, repetitions)``, in order: one piece, or repetition 0 alone and then the
        others when repetition 0 lies off the grid."""
        if repeat == 1 or self.first == self.origin:
            return [(self.first, self.stride, repeat)]
        return [(self.first, 0, 1),
                ([o + self.stride for o in self.origin], self.stride, repeat - 1)]


def group_layout(groups: Sequence[tuple[Sequence[Spec], int]]) -> tuple[list[Placed], int]:
    """Place groups of runs in order; return where each lies and the packed total.

    Group ``g`` is ``(runs, repeat)``: ``runs`` laid out ``repeat`` times back to back.
    Tensor ``q`` of run ``j`` in repetition ``k`` starts ``q * nbytes_each`` after the
    run start :class:`Placed` gives. The result equals :func:`packed_offsets` on the
    expanded tensors: this is the same rule, computed in O(runs of the patterns)
    instead of O(tensors) (two repetitions are laid out; the rest follow by stride).

    Raises:
        ValueError: as :func:`lay_runs`; for ``repeat < 1``; or for repetitions that
            would not be uniform from the second on, which happens only with alignments
            that are not powers of two (never for dtypes).
    """
    placed: list[Placed] = []
    end = 0
    for g, (runs, repeat) in enumerate(groups):
        if repeat < 1:
            raise ValueError(f"group {g}: repeat must be at least 1, got {repeat}")
        first, end0 = lay_runs(end, runs)
        f = next((j for j, (_n, _a, c) in enumerate(runs) if c), None)
        if repeat == 1 or f is None:  # one repetition, or nothing to repeat
            placed.append(Placed(first, first, 0))
            end = end0
            continue
        second, end1 = lay_runs(end0, runs)
        stride = align_up(end1, runs[f][1]) - second[f]
        period = lcm(*(a for _n, a, c in runs if c))
        if stride % period:
            raise ValueError(
                f"group {g}: repetitions 1 and 2 would start at different offsets modulo "
                f"{period} (alignments must be powers of two)"
            )
        placed.append(Placed(first, [x - stride for x in second], stride))
        end = end1 + (repeat - 2) * stride
    return placed, align_up(end, BLOCK_ALIGN)


def group_run_starts(placed: Placed, repeat: int) -> list[int]:
    """Start of every run of a placed group, repetition after repetition."""
    out: list[int] = []
    for starts, stride, reps in placed.pieces(repeat):
        if reps == 1:
            out += starts
            continue
        m = len(starts)
        part = [0] * (m * reps)
        for j, s in enumerate(starts):
            # One C-level slice assignment per run of the pattern, not one step per run.
            part[j::m] = range(s, s + reps * stride, stride) if stride else [s] * reps
        out += part
    return out


def group_offsets(runs: Sequence[Spec], placed: Placed, repeat: int) -> list[int]:
    """Packed offset of every tensor of a placed group, in order.

    Costs one C-level slice assignment per tensor of the pattern or per repetition of a
    run, whichever is fewer, never a Python step per tensor.
    """
    per_rep = sum(c for _n, _a, c in runs)
    out: list[int] = []
    for starts, stride, reps in placed.pieces(repeat):
        part = [0] * (per_rep * reps)
        col = 0
        for (n, _a, c), s in zip(runs, starts):
            if c <= reps:
                # Tensor q of this run, in every repetition: one strided range.
                for q in range(c):
                    first = s + q * n
                    part[col + q::per_rep] = (range(first, first + reps * stride, stride)
                                              if stride else [first] * reps)
            else:
                # The run's tensors in one repetition: one contiguous range.
                for k in range(reps):
                    base = s + k * stride
                    at = k * per_rep + col
                    part[at:at + c] = range(base, base + c * n, n) if n else [base] * c
            col += c
        out += part
    return out


class BlockMap:
    """Maps ranges of an object's virtual space onto its physical blocks.

    Building the map costs O(B) for B blocks; each :meth:`map` then costs
    O(log B + pieces), so a sender copying thousands of tensors builds it once.
    """

    __slots__ = ("_blocks", "_starts", "total")

    def __init__(self, blocks: Sequence[tuple[int, int]]) -> None:
        starts: list[int] = []
        pos = 0
        for offset, length in blocks:
            if length < 0 or offset < 0:
                raise ValueError(f"invalid block (offset={offset}, length={length})")
            starts.append(pos)
            pos += length
        self._blocks: list[tuple[int, int]] = [(o, n) for o, n in blocks]
        self._starts = starts
        #: Size of the virtual space, the sum of the block lengths.
        self.total: int = pos

    def map(self, virt_off: int, length: int) -> list[tuple[int, int]]:
        """Physical ``(offset, length)`` pieces of virtual range ``[virt_off, +length)``.

        Pieces come in virtual order and split only at block boundaries; an empty
        range maps to no pieces.

        Raises:
            ValueError: if the range is negative or reaches past the last block.
        """
        if virt_off < 0 or length < 0 or virt_off + length > self.total:
            raise ValueError(
                f"virtual range [{virt_off}, {virt_off + length}) is outside "
                f"[0, {self.total})"
            )
        pieces: list[tuple[int, int]] = []
        if length == 0:
            return pieces
        # The block holding virt_off is the last one starting at or before it;
        # zero-length blocks share a start with their successor and bisect_right
        # skips past them.
        i = bisect_right(self._starts, virt_off) - 1
        pos = virt_off
        end = virt_off + length
        while pos < end:
            b_off, b_len = self._blocks[i]
            inner = pos - self._starts[i]
            take = min(b_len - inner, end - pos)
            if take > 0:
                pieces.append((b_off + inner, take))
                pos += take
            i += 1
        return pieces


def map_extent(
    virt_off: int, length: int, blocks: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Physical ``(offset, length)`` pieces of virtual range ``[virt_off, virt_off+length)``.

    The virtual space is the concatenation of ``blocks`` in order. One-shot form of
    :class:`BlockMap` (which it builds, O(B)); map many ranges with a ``BlockMap``.

    Raises:
        ValueError: if the range is negative or reaches past the blocks.
    """
    return BlockMap(blocks).map(virt_off, length)
