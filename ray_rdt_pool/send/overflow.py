"""The sender's overflow regions: memory registered for objects the pool cannot hold.

Role: when a snapshot put does not fit the sender pool and ``strict`` is off,
:meth:`Overflow.place` puts it in an overflow region, registering a new one (through the
registry) when none has room. The sender still owns the objects and frees their blocks.

Lifetime of a region: made by a put, reused by later oversized objects, deregistered and
freed once it has held no object for ``overflow_linger_s`` (checked at every free and by
the progress thread's tick), or with its last object once :meth:`Overflow.end_lingering`
ran at shutdown.

Threads: the put's thread places, ``_ray_system`` frees, the progress thread reaps. The
sender's lock (passed in) guards the regions' allocators and this state; registering and
deregistering run outside it. Imports no Ray and no NIXL.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING

from ray_rdt_pool.core.allocator import Block
from ray_rdt_pool.core.clock import SYSTEM_CLOCK, Clock
from ray_rdt_pool.core.layout import align_up
from ray_rdt_pool.errors import PoolExhaustedError
from ray_rdt_pool.registry import Region, Registry

if TYPE_CHECKING:
    from ray_rdt_pool.config import PoolConfig

__all__ = ["MIN_OVERFLOW_BYTES", "Overflow"]

#: Smallest overflow region: oversized objects of a few MiB share one registration.
MIN_OVERFLOW_BYTES = 64 << 20
#: Regions are whole MiBs: a quarter of a pool size that is a multiple of 64 bytes only is
#: often not a size the allocator takes.
_OVERFLOW_ALIGN = 1 << 20


class Overflow:
    """The overflow regions of one sender, in the order they were made (iterable)."""

    def __init__(self, config: PoolConfig, registry: Registry, lock: threading.RLock,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self._clock = clock  # linger is measured on it
        self.registry = registry
        self._lock = lock  # the sender's: one placement decision covers pool and overflow
        self._regions: list[Region] = []  # replaced, never shrunk in place, when one goes
        # Regions with no object, and since when (monotonic seconds).
        self._idle: dict[Region, float] = {}
        # The first moment one of the idle regions may be due: reap() takes the lock only
        # from then on.
        self._due = math.inf
        self._linger_off = False  # set by end_lingering() at shutdown

    def __iter__(self) -> Iterator[Region]:
        return iter(self._regions)

    def __len__(self) -> int:
        return len(self._regions)

    def place(self, key: Hashable, nbytes: int, max_blocks: int | None
              ) -> tuple[Region, tuple[Block, ...]]:
        """Blocks for ``nbytes`` under allocator ``key`` in an overflow region, made if none
        has room. Call without the lock held.

        Raises:
            PoolExhaustedError: if the memory for a new region could not be mapped.
            RegistrationError: if NIXL refused to register a new region.
        """
        made: Region | None = None  # the region this call registered, if any
        while True:
            spare: list[Region] = []
            found: tuple[Region, tuple[Block, ...]] | None = None
            with self._lock:
                for region in self._regions:
                    try:
                        blocks = region.alloc.allocate(key, nbytes, max_blocks=max_blocks)
                    except PoolExhaustedError:
                        continue
                    if made is not None and made is not region:
                        # Another put made a region at the same time and this object went
                        # there: ours may hold nothing, so it lingers like an emptied one
                        # instead of waiting for some free to look at it.
                        spare = self.empty_locked()
                    # In use again: its linger restarts when it next empties, or a region
                    # reused steadily would go overflow_linger_s after it first emptied.
                    self._idle.pop(region, None)
                    found = region, blocks
                    break
            if found is not None:
                self.drop(spare)
                return found
            # Registering a region takes milliseconds: not under the lock.
            size = align_up(max(nbytes, 1, MIN_OVERFLOW_BYTES, self.config.pool_capacity // 4),
                            _OVERFLOW_ALIGN)
            try:
                made = self.registry.new_region(size, self.config.device, "overflow region",
                                                False)
            except (OSError, OverflowError, MemoryError) as e:
                # The memory itself could not be had (ENOMEM, or a size no mapping takes).
                raise PoolExhaustedError(
                    nbytes, 0, 0, size, what="overflow memory",
                    remedy=f"no {size:,} bytes of {self.config.device} memory could be "
                           f"mapped ({type(e).__name__}: {e}); send a smaller object"
                ) from e
            with self._lock:
                self._regions.append(made)

    def empty_locked(self) -> list[Region]:
        """Regions to deregister now: those empty for ``overflow_linger_s``; the caller
        passes them to :meth:`drop` once it has let go of the lock.

        An emptied region lingers, registered, for the next oversized objects: every
        deregistration makes each receiver replace its view of this agent (a remove and
        a re-add), which with NIXL 1.5.1 leaves a TCP connection per read lane open in
        both processes, so a pool that overflows now and then would leak one per object.
        """
        now = self._clock.monotonic()
        linger = 0.0 if self._linger_off else self.config.overflow_linger_s
        idle = self._idle
        drop: list[Region] = []
        for r in self._regions:
            if len(r.alloc):
                idle.pop(r, None)
            elif now - idle.setdefault(r, now) >= linger:
                drop.append(r)
        if drop:
            self._regions = [r for r in self._regions if r not in drop]
            for r in drop:
                del idle[r]
        self._due = min(idle.values(), default=math.inf) + linger
        return drop

    def drop(self, regions: Sequence[Region]) -> None:
        """Deregister and free ``regions`` (from :meth:`empty_locked`), outside the lock."""
        for region in regions:
            self.registry.drop_region(region)

    def reap(self) -> None:
        """Progress-thread tick: the regions whose linger ended go."""
        if self._clock.monotonic() >= self._due:
            with self._lock:
                empty = self.empty_locked()
            self.drop(empty)

    def end_lingering(self) -> None:
        """At shutdown: no put can reuse an overflow region any more, so every empty one
        goes now, and later ones with their last object."""
        with self._lock:
            self._linger_off = True
            empty = self.empty_locked()
        self.drop(empty)

    def stats(self) -> tuple[int, int, int]:
        """(objects, bytes, registered capacity) in overflow regions now."""
        with self._lock:
            objs = sum(len(r.alloc) for r in self._regions)
            used = sum(r.alloc.stats().used for r in self._regions)
            cap = sum(r.capacity for r in self._regions)
        return objs, used, cap
