"""A free-list allocator over the byte range of a registered memory pool.

Pure (stdlib only): it hands out ``(offset, length)`` blocks of ``[0, capacity)`` and
knows nothing of the memory behind them. Each object (a key) owns a group of blocks
that is placed all or nothing; the object's packed bytes are the concatenation of
its blocks in order (see :mod:`ray_rdt_pool.core.layout`).

Placement: one block whenever a single free block fits (best fit: the smallest such
block, ties to the lowest offset), which keeps large holes intact; otherwise as few
blocks as possible, the largest free blocks first, with the last piece carved from
the smallest remaining block that holds the remainder.

Cost: allocate and free are O(k log F) for k blocks of the object and F free blocks.
Free blocks are indexed by start and by end in dicts, so freeing finds both
neighbours in O(1), and kept in a list sorted by ``(length, start)`` searched with
``bisect`` for best fit; no operation scans or re-sorts the free list.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

from ray_rdt_pool.core.layout import BLOCK_ALIGN, align_up
from ray_rdt_pool.errors import ConfigurationError, InvalidInputError, PoolExhaustedError

__all__ = ["AllocatorStats", "Block", "BlockAllocator"]


class Block(NamedTuple):
    """A byte range ``[offset, offset + length)`` of the pool."""

    offset: int
    length: int


@dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of an allocator's occupancy, in bytes and counts."""

    capacity: int
    used: int
    free: int
    largest_free_block: int
    free_blocks: int
    live_objects: int


# One coalescing step of _release, enough to undo it exactly:
# (merged_start, merged_length, left neighbour or None, right neighbour or None).
_Undo = tuple[int, int, tuple[int, int] | None, tuple[int, int] | None]


class BlockAllocator:
    """Places groups of blocks for keyed objects in ``[0, capacity)``.

    Not thread-safe: callers sharing one allocator across threads must serialise
    every call (the transport holds a lock around it).

    Args:
        capacity: Size of the pool in bytes, a positive multiple of ``align``.
        align: Every block offset and length is a multiple of this.
        name: What the pool is called in error messages ("pool", "receive arena").
        remedy: The fix an exhaustion error suggests; ``None`` keeps the default of
            :class:`~ray_rdt_pool.errors.PoolExhaustedError`.
    """

    def __init__(
        self,
        capacity: int,
        align: int = BLOCK_ALIGN,
        name: str = "pool",
        *,
        remedy: str | None = None,
    ) -> None:
        if type(align) is not int or align <= 0:
            raise ConfigurationError(f"{name} alignment must be a positive int, got {align!r}")
        if type(capacity) is not int or capacity <= 0 or capacity % align:
            raise ConfigurationError(
                f"{name} capacity must be a positive multiple of {align:,} bytes, "
                f"got {capacity!r}"
                + (f" (try {align_up(capacity, align):,})"
                   if type(capacity) is int and capacity > 0 else "")
            )
        self.capacity = capacity
        self.align = align
        self.name = name
        self._remedy = remedy
        self._start_len: dict[int, int] = {}  # free block start -> length
        self._end_start: dict[int, int] = {}  # free block end -> start
        self._by_size: list[tuple[int, int]] = []  # sorted (length, start) of free blocks
        self._live: dict[Hashable, tuple[Block, ...]] = {}
        self._used = 0
        self._add_free(0, capacity)

    # -- free-list primitives (no coalescing; callers keep the list maximal) --

    def _add_free(self, start: int, length: int) -> None:
        self._start_len[start] = length
        self._end_start[start + length] = start
        insort(self._by_size, (length, start))

    def _remove_free(self, start: int, length: int) -> None:
        del self._start_len[start]
        del self._end_start[start + length]
        i = bisect_left(self._by_size, (length, start))
        del self._by_size[i]

    def _release(self, offset: int, length: int) -> _Undo:
        """Return a block to the free list, merged with both free neighbours."""
        left: tuple[int, int] | None = None
        right: tuple[int, int] | None = None
        start, end = offset, offset + length
        left_start = self._end_start.get(start)
        if left_start is not None:
            left = (left_start, start - left_start)
            self._remove_free(*left)
            start = left_start
        right_len = self._start_len.get(end)
        if right_len is not None:
            right = (end, right_len)
            self._remove_free(*right)
            end += right_len
        self._add_free(start, end - start)
        return (start, end - start, left, right)

    def _undo_release(self, undo: _Undo) -> None:
        start, length, left, right = undo
        self._remove_free(start, length)
        if left is not None:
            self._add_free(*left)
        if right is not None:
            self._add_free(*right)

    def _carve(self, start: int, length: int, take: int) -> Block:
        """Take ``take`` bytes from the front of free block ``(start, length)``."""
        self._remove_free(start, length)
        if take < length:
            self._add_free(start + take, length - take)
        return Block(start, take)

    # -- placement --

    def _plan(self, size: int, max_blocks: int | None) -> list[tuple[int, int, int]] | None:
        """Choose ``(start, length, take)`` free-block pieces for ``size`` bytes.

        Returns ``None`` when the free list cannot hold ``size`` within
        ``max_blocks`` pieces. Reads the free list only.
        """
        by_size = self._by_size
        # (size, -1) sorts before every (size, start): the first fitting entry is the
        # smallest block that fits, and among equal lengths the lowest offset.
        i = bisect_left(by_size, (size, -1))
        if i < len(by_size):
            length, start = by_size[i]
            return [(start, length, size)]
        if size > self.capacity - self._used:
            return None
        # No single block fits: k-1 largest blocks whole, then the remainder.
        plan: list[tuple[int, int, int]] = []
        remaining = size
        j = len(by_size) - 1
        while True:
            length, start = by_size[j]
            if length >= remaining:
                break
            # Taking this block whole still leaves a remainder for one more piece.
            if max_blocks is not None and len(plan) + 2 > max_blocks:
                return None
            plan.append((start, length, length))
            remaining -= length
            j -= 1
        # The remainder fits in by_size[j], so the smallest block that holds it lies
        # at or below j, never among the blocks taken whole above it.
        j = bisect_left(by_size, (remaining, -1))
        length, start = by_size[j]
        plan.append((start, length, remaining))
        return plan

    def allocate(
        self, key: Hashable, nbytes: int, max_blocks: int | None = None
    ) -> tuple[Block, ...]:
        """Place ``nbytes`` (rounded up to ``align``) for ``key``, all or nothing.

        ``nbytes == 0`` records the key with no blocks. Re-allocating a live key
        replaces its blocks atomically: its old blocks count as free for the new
        placement, and they stay exactly as they were if the new one fails.

        Args:
            key: Identifies the object; any hashable.
            nbytes: Bytes the object needs.
            max_blocks: Most blocks the object may span; ``None`` for no limit.

        Returns:
            The object's blocks in virtual order (their concatenation is the
            object's packed space).

        Raises:
            PoolExhaustedError: if the object does not fit; nothing changed.
            InvalidInputError: for a negative size or ``max_blocks < 1``.
        """
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidInputError(f"allocation size must be an int >= 0, got {nbytes!r}")
        if max_blocks is not None and max_blocks < 1:
            raise InvalidInputError(f"max_blocks must be >= 1 or None, got {max_blocks!r}")
        size = align_up(nbytes, self.align)
        old = self._live.get(key)
        undo: list[_Undo] = []
        if old:
            undo = [self._release(b.offset, b.length) for b in old]
            self._used -= sum(b.length for b in old)
        plan = self._plan(size, max_blocks) if size else []
        if plan is None:
            error = self._exhausted(size, max_blocks)
            # Reverse order: each release saw the free list its predecessors left.
            for step in reversed(undo):
                self._undo_release(step)
            if old:
                self._used += sum(b.length for b in old)
            try:
                raise error
            finally:
                # A local holding the exception while its traceback holds this frame is a
                # reference cycle: it would keep the caller's frames (and the tensors of
                # the object being put) alive until the next garbage collection.
                del error
        blocks = tuple(self._carve(start, length, take) for start, length, take in plan)
        self._used += size
        self._live[key] = blocks
        return blocks

    def _exhausted(self, size: int, max_blocks: int | None) -> PoolExhaustedError:
        free = self.capacity - self._used
        remedy = self._remedy
        if size <= free and max_blocks is not None:
            # Enough bytes, but only in more pieces than the caller accepts.
            base = remedy or "raise pool_bytes (RAY_RDT_POOL_POOL_BYTES)"
            remedy = f"it may span at most {max_blocks} block(s); {base}"
        kwargs = {} if remedy is None else {"remedy": remedy}
        return PoolExhaustedError(
            size, free, self.largest_free(), self.capacity, what=self.name, **kwargs
        )

    def free(self, key: Hashable) -> int:
        """Release the blocks of ``key``; returns the bytes freed (0 for an unknown key)."""
        blocks = self._live.pop(key, None)
        if blocks is None:
            return 0
        freed = 0
        for b in blocks:
            self._release(b.offset, b.length)
            freed += b.length
        self._used -= freed
        return freed

    # -- queries --

    def blocks(self, key: Hashable) -> tuple[Block, ...] | None:
        """The blocks of ``key`` in virtual order, or ``None`` if it is not live."""
        return self._live.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def largest_free(self) -> int:
        """Length of the largest free block (0 when the pool is full)."""
        return self._by_size[-1][0] if self._by_size else 0

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` would fit now if split over any number of blocks."""
        if nbytes < 0:
            raise InvalidInputError(f"allocation size must be >= 0, got {nbytes!r}")
        return align_up(nbytes, self.align) <= self.capacity - self._used

    def free_list(self) -> list[Block]:
        """The free blocks sorted by offset (O(F log F); for diagnostics and tests)."""
        return sorted(Block(s, n) for s, n in self._start_len.items())

    def stats(self) -> AllocatorStats:
        """Occupancy now."""
        return AllocatorStats(
            capacity=self.capacity,
            used=self._used,
            free=self.capacity - self._used,
            largest_free_block=self.largest_free(),
            free_blocks=len(self._start_len),
            live_objects=len(self._live),
        )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"BlockAllocator(name={self.name!r}, capacity={s.capacity:,}, used={s.used:,}, "
            f"free_blocks={s.free_blocks}, live_objects={s.live_objects})"
        )
