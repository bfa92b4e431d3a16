"""A receiver's handle on one same-node sender's pool.

A :class:`MappedPool` holds the pool and lease-table descriptors, the table mapping and
the row this process claimed in it, and the private (copy-on-write) mapping of the whole
pool that views of received objects point into (for a CUDA pool, the CUDA opening
instead). Every mapping holds a lease: when an object's views die, its pages are given
back to the file (``MADV_DONTNEED``) *before* its lease drops, so copy-on-write pages
never outlive the lease and a reused block is never seen through old pages.

Lifetime: created and released by the receiver. Its descriptors and mappings live as
long as the handle, or until the last lease when it is closed with leases held (the
sender exited, the handle was evicted, the receiver shut down): a lease taken is always
returned. Threads: everything here runs under the receiver's lock.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
from collections.abc import Sequence
from typing import Any

from ray_rdt_pool.same_node._libc import (
    MADV_DONTNEED,
    MAP_FAILED,
    MAP_FIXED,
    MAP_NORESERVE,
    PAGE,
    PROT_RW,
    libc,
    page_up,
    unmap,
)
from ray_rdt_pool.same_node.cuda import CudaMapping
from ray_rdt_pool.same_node.info import HostInfo, process_start, still_running
from ray_rdt_pool.same_node.leases import (
    LOG_ENTRIES,
    MAGIC,
    ROW_BASE,
    TAG_MASK,
    table_layout,
)

logger = logging.getLogger(__name__)

__all__ = ["MappedPool", "mappable_spans"]

#: CUDA openings a forked child inherited (see MappedPool.forget): never released.
_inherited_cuda: list[Any] = []


def mappable_spans(segments: Sequence[tuple[int, int, int]], total: int, info: HostInfo
                   ) -> list[tuple[int, int, int]] | None:
    """``(packed offset, pool offset, length)`` of an object whose segments lie in the
    sender's shared pool on page boundaries, one after another from packed offset 0 to
    ``total``; None when it cannot be mapped (overflow memory, ``register_memory()``
    storages): such objects are read with NIXL."""
    out: list[tuple[int, int, int]] = []
    end = total
    pos = 0
    for i, (v, a, n) in enumerate(segments):
        off = a - info.pool_base
        last = i == len(segments) - 1
        if off < 0 or off % PAGE or v != pos or off + page_up(n) > info.pool_bytes or (
                not last and n % PAGE) or v + n > end:
            return None
        out.append((v, off, n))
        pos = v + n
    return out if out and pos == total else None


class MappedPool:
    """A receiver's handle on one same-node sender's pool: the pool and lease table
    descriptors, the table mapping, and the row this process claimed. For a CUDA pool,
    the CUDA IPC opening of the pool instead of its descriptor (``cuda``).

    The counts of the row change only under the receiver's lock (one writer), and so
    does everything else here, :meth:`close` included.

    Closed with leases held (the sender exited, the handle was evicted, the receiver shut
    down), it keeps the table mapping, the shared view and the CUDA opening until the
    last lease drops: the leases taken through it are still returned."""

    def __init__(self, info: HostInfo) -> None:
        import numpy as np

        self.info = info
        self.pool_fd = self.table_fd = -1
        self.held = 0  # leases (object mappings, copies running) this process holds now
        self.closed = False  # close() ran: no new lease may be taken
        self._shared = 0  # address of the read-only view of the whole pool (0: none)
        self._view = 0  # address of the private (copy-on-write) pool mapping (0: none)
        # Slots of objects whose views of the private mapping live now (changed under the
        # receiver lock): another get of one of them is copied, never handed those pages.
        self.viewing: set[int] = set()
        # After forget() (a forked child): the private mapping's ranges it kept (address
        # -> length), each unmapped when its views die.
        self._kept: dict[int, int] | None = None
        self._closing = False  # closed while leases were held: the rest goes with the last
        self.counts: Any = None
        self._log: Any = None  # this process's row's release log (see LeaseTable)
        self.cuda: CudaMapping | None = None
        self._table: mmap.mmap | None = None
        try:
            if info.cuda is not None:
                self.cuda = CudaMapping(info.cuda, info.pool_bytes)
            else:
                self.pool_fd = _open_peer_fd(info.pid, info.pool_fd, info.pool_ino,
                                             os.O_RDONLY)
            self.table_fd = _open_peer_fd(info.pid, info.table_fd, info.table_ino, os.O_RDWR)
            counts_at, size = table_layout(info.rows, info.slots)
            if os.fstat(self.table_fd).st_size < size or (
                    self.pool_fd >= 0 and os.fstat(self.pool_fd).st_size < info.pool_bytes):
                raise OSError("the shared pool or lease table is smaller than published")
            self._table = mmap.mmap(self.table_fd, size, flags=mmap.MAP_SHARED, prot=PROT_RW)
            header = np.frombuffer(self._table, dtype=np.uint64, count=PAGE // 8)
            if int(header[0]) != MAGIC or int(header[3]) != LOG_ENTRIES:
                raise OSError("the lease table has no valid header")
            self.row = self._claim_row(header)
            self._log = np.frombuffer(self._table, dtype=np.uint64,
                                      offset=PAGE * (1 + self.row), count=PAGE // 8)
            self.counts = np.frombuffer(self._table, dtype=np.uint32,
                                        offset=counts_at + self.row * info.slots * 4,
                                        count=info.slots)
        except BaseException:
            self.close()
            raise

    def _claim_row(self, header: Any) -> int:
        me, start = os.getpid(), process_start(os.getpid())
        if start is None:
            raise OSError("cannot read this process's start time")
        fcntl.flock(self.table_fd, fcntl.LOCK_EX)
        try:
            rows = self.info.rows
            owners = [(int(header[ROW_BASE + 2 * r]), int(header[ROW_BASE + 2 * r + 1]))
                      for r in range(rows)]
            for r, owner in enumerate(owners):
                if owner == (me, start):  # claimed before by this process: its row
                    return r
            for r, (pid, _s) in enumerate(owners):
                if pid == 0:
                    header[ROW_BASE + 2 * r + 1] = start
                    header[ROW_BASE + 2 * r] = me
                    return r
        finally:
            fcntl.flock(self.table_fd, fcntl.LOCK_UN)
        raise OSError(f"all {self.info.rows} lease rows of the sender are taken")

    def alive(self) -> bool:
        """Whether the sender process still runs (its pid, started when it was); True
        when that cannot be told now."""
        return still_running(self.info.pid, self.info.start)

    def lease(self, slot: int) -> None:
        self.counts[slot] += 1
        self.held += 1

    def shared_view(self) -> int:
        """Address of one read-only, shared mapping of the whole pool, made on first use
        (under the receiver's lock, with a lease held: two first uses would each map it).

        Copies out of the pool read through it: it is never written, so it needs no
        copy-on-write, and its pages stay mapped from object to object (a fresh private
        mapping faults every page in again)."""
        if not self._shared:
            addr = libc.mmap(None, self.info.pool_bytes, mmap.PROT_READ, mmap.MAP_SHARED,
                             self.pool_fd, 0)
            if addr in (None, MAP_FAILED):
                raise OSError(ctypes.get_errno(), "mmap of the shared pool failed")
            self._shared = int(addr)
        return self._shared

    def release_one(self, slot: int) -> None:
        """One lease ends (the caller holds the receiver lock): its count (a count that
        reaches zero is logged for the sender), and the rest of a closed handle with its
        last lease."""
        counts = self.counts
        if counts is not None:
            counts[slot] -= 1
            if counts[slot] == 0:
                log = self._log
                w = int(log[0])
                # The entry first, then the index that publishes it (see LeaseTable).
                log[1 + w % LOG_ENTRIES] = ((w & TAG_MASK) << 32) | slot
                log[0] = w + 1
        self.held -= 1
        if self._closing and self.held == 0:
            self._release_mappings()

    def _release_mappings(self) -> None:
        """Close the pool's descriptor, unmap the shared view and the table; drop the
        CUDA opening."""
        self._closing = False
        if self.pool_fd >= 0:
            os.close(self.pool_fd)
            self.pool_fd = -1
        if self._shared:
            unmap(self._shared, self.info.pool_bytes)
            self._shared = 0
        if self._view:
            unmap(self._view, self.info.pool_bytes)
            self._view = 0
        # The CUDA opening goes too: torch closes the IPC handle with its last storage.
        self.cuda = None
        self.counts = None  # the table's exported buffers: gone before the close below
        self._log = None
        if self._table is not None:
            try:
                self._table.close()
            except BufferError:
                pass
            self._table = None

    def device_addr(self, offset: int) -> tuple[str, int, int]:
        """(device type, device index, address) of pool ``offset`` in this process, for
        views and copies of a CUDA pool (valid while a lease is held)."""
        cuda = self.cuda
        if cuda is None:
            raise OSError("the sender's CUDA pool is closed")
        return "cuda", cuda.index, cuda.base + offset

    def map(self, spans: Sequence[tuple[int, int, int]], total: int) -> tuple[int, int]:
        """An object's place in this process's private (copy-on-write) mapping of the
        whole pool, made on first use: (address, length in whole pages). One block only
        (a fragmented object is copied out instead). Called under the receiver's lock
        with a lease held, which keeps the pool's descriptor open (see :meth:`close`).

        One mapping per pool, not per object: mappings count against the kernel's
        ``vm.max_map_count``, and a receiver may keep many objects. The object's pages
        must be given back to the file with :meth:`drop_view` before its lease drops."""
        if len(spans) != 1:
            raise OSError("a fragmented object has no contiguous place in the pool")
        (_v, off, _n), = spans
        if not self._view:
            # The pool's size is address space: only pages a view writes take memory.
            addr = libc.mmap(None, self.info.pool_bytes, PROT_RW,
                             mmap.MAP_PRIVATE | MAP_NORESERVE, self.pool_fd, 0)
            if addr in (None, MAP_FAILED):
                raise OSError(ctypes.get_errno(), "mmap of the shared pool failed")
            self._view = int(addr)
        return self._view + off, page_up(total)

    def drop_view(self, slot: int, addr: int, length: int) -> bool:
        """The views of the object at ``addr`` (a :meth:`map` result) died: give its pages
        back to the file before its lease drops, so that this process never sees a later
        object of the block through pages it wrote. False if that failed: the caller
        must then keep the lease (the block is never reused under those pages).

        After :meth:`forget` the range is the child's own copy: it is unmapped."""
        self.viewing.discard(slot)
        if self._kept is not None:
            if self._kept.pop(addr, None) is not None:
                unmap(addr, length)
            return True
        if libc.madvise(addr, length, MADV_DONTNEED) == 0:
            return True  # private copies dropped: reads fault in the file's pages again
        err = ctypes.get_errno()  # e.g. EINVAL for locked pages: map the file over it
        got = libc.mmap(addr, length, PROT_RW,
                        mmap.MAP_PRIVATE | MAP_NORESERVE | MAP_FIXED, self.pool_fd,
                        addr - self._view)
        if got == addr:
            return True
        logger.error("cannot give a same-node mapping's pages back (madvise errno %d, mmap "
                     "errno %d): the sender's block stays leased for the life of this "
                     "process", err, ctypes.get_errno())
        return False

    def give_back(self) -> None:
        """Close, and free this process's row in the sender's table: the caller returned
        every lease it took through this handle and takes no more through this table
        (a forked child's own leases, held only while it copies; see
        :class:`ChildLeases`). The row's counts are all zero, so the sender may give it
        to another receiver at once."""
        if self.held == 0 and self.table_fd >= 0 and self._table is not None:
            import numpy as np

            header = np.frombuffer(self._table, dtype=np.uint64, count=PAGE // 8)
            fcntl.flock(self.table_fd, fcntl.LOCK_EX)
            try:
                header[ROW_BASE + 2 * self.row:ROW_BASE + 2 * self.row + 2] = 0
            finally:
                fcntl.flock(self.table_fd, fcntl.LOCK_UN)
            del header  # the table's exported buffer: gone before close() unmaps it
        self.close()

    def forget(self, kept: Sequence[tuple[int, int]] = ()) -> None:
        """In a forked child: the row and the table are the parent's. Never write them
        again (no lease taken, none returned) and let go of this process's copies of the
        descriptors and mappings; the caller has privatized the ranges of the private
        pool mapping that views use, ``kept`` ((address, length) each): the rest of that
        mapping goes now, each kept range when its views die (:meth:`drop_view`)."""
        self.counts = None  # first: release_one() of a view dying here changes nothing
        self._log = None
        view, self._view = self._view, 0
        self._kept = {}
        if view:
            pos = view
            for addr, length in sorted(kept):
                if view <= addr < view + self.info.pool_bytes:
                    if addr > pos:
                        unmap(pos, addr - pos)
                    self._kept[addr] = length
                    pos = max(pos, addr + length)
            if pos < view + self.info.pool_bytes:
                unmap(pos, view + self.info.pool_bytes - pos)
        if self.cuda is not None:
            # CUDA does not work in a forked child; letting torch close the IPC opening
            # here could. Kept, unused, until the process exits.
            _inherited_cuda.append(self.cuda)
            self.cuda = None
        self.close()
        self._release_mappings()  # even with views out: they no longer need the pool

    def close(self) -> None:
        """No new lease from here on; close the table's descriptor. Object mappings stay
        valid, and the table mapping (our row), the pool's descriptor and shared view (a
        lease holder may still be mapping or copying the object it leased, outside the
        receiver's lock) and the CUDA opening stay until the last lease held now drops.
        Closing the pool's descriptor earlier would let a mapping made under a lease find
        its number reused by another file: wrong bytes, silently."""
        self.closed = True
        if self.table_fd >= 0:
            os.close(self.table_fd)
            self.table_fd = -1
        if self.held:
            self._closing = True
        else:
            self._release_mappings()


def _open_peer_fd(pid: int, fd: int, ino: int, flags: int) -> int:
    """Open another process's descriptor, checking it is the file that was published
    (the pid may have been reused by another process since)."""
    got = os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_CLOEXEC)
    if os.fstat(got).st_ino != ino:
        os.close(got)
        raise OSError(f"/proc/{pid}/fd/{fd} is not the published shared pool")
    return got
