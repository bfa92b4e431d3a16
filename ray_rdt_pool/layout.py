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
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

__all__ = [
    "BLOCK_ALIGN",
    "BlockMap",
    "align_up",
    "map_extent",
    "packed_offsets",
    "run_layout",
]

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


def run_layout(runs: Sequence[tuple[int, int, int]]) -> tuple[list[int], int]:
    """Start offset of each run of equal tensors, and the packed total.

    Each run is ``(nbytes_each, align, count)``. The result equals
    :func:`packed_offsets` on the expanded list: tensor ``k`` of run ``r`` starts at
    ``starts[r] + k * nbytes_each``, which holds because ``nbytes_each`` is a
    multiple of ``align``, so no padding arises inside a run. This costs O(runs)
    instead of O(tensors), which matters for thousands of equal views.

    A run with ``count == 0`` contributes no tensor, so, as in the expansion, it
    does not move the packing position; its reported start is where it would begin.

    Raises:
        ValueError: for a negative size or count, a non-positive alignment, or
            ``count > 1`` with ``nbytes_each`` not a multiple of ``align`` (then the
            tensors of the run would not be contiguous).
    """
    starts: list[int] = []
    end = 0
    for nbytes_each, align, count in runs:
        if nbytes_each < 0 or count < 0:
            raise ValueError(f"negative size {nbytes_each} or count {count} in a run")
        start = align_up(end, align)
        if count > 1 and nbytes_each % align:
            raise ValueError(
                f"a run of {count} tensors of {nbytes_each} bytes is not contiguous "
                f"at alignment {align}"
            )
        starts.append(start)
        if count:
            end = start + nbytes_each * count
    return starts, align_up(end, BLOCK_ALIGN)


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
