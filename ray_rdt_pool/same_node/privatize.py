"""A forked child's side of same-node mappings.

A receiver's pool mapping is private, but its untouched pages are the pool's: a forked
child that kept them would see the block's next object once the parent's lease dropped.
So the receiver's after-fork hook, in the child, replaces each object range its views
use by anonymous memory holding the same bytes (:func:`privatize`) and forgets every
handle (:meth:`~.pool_handle.MappedPool.forget`), while the parent holds one more lease per
mapping until the child has copied, and the child first takes leases of its own in a row
of its own (:class:`ChildLeases`), so a parent killed during the copy cannot free the
blocks.

Lifetime: a :class:`ChildLeases` lives from the child's after-fork hook until it has
copied (:meth:`ChildLeases.end`). Runs in the child's after-fork hook only.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Sequence

from ray_rdt_pool.same_node._libc import (
    MAP_FAILED,
    MREMAP_FIXED,
    MREMAP_MAYMOVE,
    PROT_RW,
    libc,
)
from ray_rdt_pool.same_node.pool_handle import MappedPool

logger = logging.getLogger(__name__)

__all__ = ["ChildLeases", "privatize"]


class ChildLeases:
    """A forked child's leases of its own, in a row of its own, on the slots of its
    inherited object mappings, held while it copies them (:func:`privatize`). Until it
    holds them, only the parent's extra leases (see the module doc) hold those blocks,
    and the sender clears a dead process's row: were the parent to die during the copy,
    a block could be reused under it.

    Made by the receiver's after-fork hook in the child, which calls :meth:`end` once
    it has copied: every lease goes back and the rows are freed."""

    def __init__(self, held: Sequence[tuple[MappedPool, int]], parent: int) -> None:
        """``held``: (inherited handle, slot) of each object mapping; ``parent``: the
        parent's pid, read before the fork. Sets :attr:`parent_ran`, whether the parent
        still ran once the leases were taken: if it did, its row was intact until then,
        so the blocks were never unheld. A sender whose pool cannot be opened again (it
        exited: nothing reuses its blocks) gets no lease."""
        self._own: dict[int, tuple[MappedPool, list[int]]] = {}
        for host, slot in held:
            if host.counts is None or host.cuda is not None:
                continue  # no mapping of it to copy (a CUDA pool is copied, never mapped)
            own = self._own.get(id(host))
            if own is None:
                try:
                    own = self._own[id(host)] = (MappedPool(host.info), [])
                except OSError as e:
                    logger.debug("no lease row of its own for a forked child: %s", e)
                    continue
            own[0].lease(slot)
            own[1].append(slot)
        self.parent_ran = os.getppid() == parent

    def end(self) -> None:
        for handle, slots in self._own.values():
            for slot in slots:
                handle.release_one(slot)
            handle.give_back()
        self._own.clear()


def privatize(addr: int, length: int) -> bool:
    """Replace the mapped range at ``addr`` (an object's pages of the private pool
    mapping) by anonymous private memory holding the same bytes, at the same address
    (views of it stay valid); False if that failed (nothing changed). A forked child does
    this to the ranges its inherited views use: their untouched pages are the shared
    pool's, which the sender reuses once the parent's lease drops."""
    new = libc.mmap(None, length, PROT_RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if new in (None, MAP_FAILED):
        return False
    ctypes.memmove(new, addr, length)
    # One call moves the copy over the old mapping (which it unmaps): no moment where the
    # address holds nothing.
    got = libc.mremap(new, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, addr)
    if got != addr:
        libc.munmap(new, length)
        return False
    return True
