"""The sender's lease table: which same-node receiver holds which pool page.

The table is a second ``memfd`` owned by the sender, with one row per receiver process
and one ``uint32`` count per pool page (an object's *slot* is the page its first block
starts at). A row has one writer, the receiver that claimed it under ``flock`` on the
table (:class:`~.pool_handle.MappedPool`), so no atomic operations are needed across
processes; the sender only reads counts, and clears a row only after its receiver died.
Ray frees an object only when no ref to it is left, so a receiver always takes its lease
before the sender can see the object freed. Each row also has a release log, so the
sender checks only the slots that changed.

Lifetime: a :class:`LeaseTable` is created and closed by the sender with its pool; a
block whose slot has a lease goes back to the pool only when the last lease drops.
Threads: the sender's ``_ray_system`` (``garbage_collect``) and its progress thread,
serialised by the sender's lock.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Sequence
from typing import Any

from ray_rdt_pool.same_node._libc import PAGE, PROT_RW, page_up
from ray_rdt_pool.same_node.info import MAX_SLOTS, still_running

__all__ = ["LEASE_ROWS", "LOG_ENTRIES", "LeaseTable", "lease_slot", "lease_slots",
           "table_layout"]

#: Receiver processes one sender's lease table holds at once; more fall back to NIXL.
LEASE_ROWS = 128
MAGIC = 0x52445450_4C534532  # "RDTPLSE2"
ROW_BASE = 4  # header words before the row owners: magic, rows, slots, log entries
#: Entries of a row's release log: one page holds its write index, then the entries.
LOG_ENTRIES = PAGE // 8 - 1
#: A log entry is ``(index << 32) | slot``: each half is this wide.
TAG_MASK = MAX_SLOTS


def lease_slot(pool_offset: int) -> int:
    """The lease slot of an object whose first block starts at ``pool_offset``: its page.

    The one definition the sender (which reads the counts) and every receiver (which
    writes them) use, whatever the pool region's block alignment: a CUDA pool's blocks
    are 4 KiB-aligned, smaller than a page on a 64 KiB-page host, where two objects may
    then share a slot (a lease on one holds the other too: later reuse, never early)."""
    return pool_offset // PAGE


def lease_slots(pool_bytes: int) -> int:
    """Slots of the lease table of a pool of ``pool_bytes``: one per page."""
    return page_up(pool_bytes) // PAGE


def table_layout(rows: int, slots: int) -> tuple[int, int]:
    """(offset of the counts, size) of a lease table: a header page (row owners), one
    release-log page per row, then one ``uint32`` count per row and slot."""
    counts_at = PAGE * (1 + rows)
    return counts_at, counts_at + page_up(rows * slots * 4)


class LeaseTable:
    """The sender's table of receivers' leases on its pool pages (see the module doc).

    Each row also has a release log, written by its receiver only: a ring of
    :data:`LOG_ENTRIES` entries, each ``(index << 32) | slot`` in one aligned word, for
    every count that dropped to zero, and the number of entries ever written (published
    after the entry). :meth:`released` reads only the entries written since its last
    call, so checking freed placements costs what changed, not what is leased."""

    slot = staticmethod(lease_slot)  # the slot of an object starting at a pool offset

    def __init__(self, slots: int, rows: int = LEASE_ROWS) -> None:
        import numpy as np

        self.rows, self.slots = rows, slots
        counts_at, size = table_layout(rows, slots)
        self.fd = os.memfd_create("ray_rdt_pool-leases", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=PROT_RW)
        except BaseException:
            os.close(self.fd)
            raise
        self.ino = os.fstat(self.fd).st_ino
        self.header = np.frombuffer(self._map, dtype=np.uint64, count=PAGE // 8)
        self.header[:4] = (MAGIC, rows, slots, LOG_ENTRIES)
        self.logs = np.frombuffer(self._map, dtype=np.uint64, offset=PAGE,
                                  count=rows * PAGE // 8).reshape(rows, PAGE // 8)
        self.counts = np.frombuffer(self._map, dtype=np.uint32, offset=counts_at,
                                    count=rows * slots).reshape(rows, slots)
        # What released() last read (the caller's lock guards them): the row owners, the
        # claimed rows among them, and how many entries of each row's log it consumed.
        self._owners = np.zeros(2 * rows, dtype=np.uint64)
        self._rows: list[int] = []
        self._read = [0] * rows
        self.rescan = True  # set by sweep(): the next released() answers None

    def _claimed(self) -> list[int]:
        owners = self.header[ROW_BASE:ROW_BASE + 2 * self.rows:2]
        return [int(r) for r in owners.nonzero()[0]]

    def held(self, slot: int) -> bool:
        """Whether any receiver holds a lease on the object starting at page ``slot``.

        Reads only claimed rows: reading an untouched row would allocate its pages."""
        counts = self.counts
        return any(counts[r, slot] for r in self._claimed())

    def held_many(self, slots: Sequence[int]) -> list[bool]:
        """:meth:`held` of each of ``slots``, in one pass over the claimed rows."""
        import numpy as np

        rows = self._claimed()
        if not rows or not slots:
            return [False] * len(slots)
        at = np.fromiter(slots, dtype=np.int64, count=len(slots))
        claimed = np.array(rows, dtype=np.int64)
        held: Any = self.counts[claimed[:, None], at].any(axis=0)
        return [bool(x) for x in held]

    def released(self) -> set[int] | None:
        """Slots whose count some receiver dropped to zero since the last call, or None
        when the caller must check every leased placement instead (first call, a row
        claimed, given back or cleared by :meth:`sweep`, a log that wrapped since it was
        last read). The read positions are taken before returning None, so a release
        after that check is in the next answer. The caller serialises calls."""
        import numpy as np

        owners = self.header[ROW_BASE:ROW_BASE + 2 * self.rows]
        if self.rescan or not np.array_equal(owners, self._owners):
            self.rescan = False
            self._owners[:] = owners
            self._rows = [int(r) for r in self._owners[::2].nonzero()[0]]
            for r in self._rows:
                self._read[r] = int(self.logs[r, 0])
            return None
        out: set[int] = set()
        for r in self._rows:
            log = self.logs[r]
            i, w = self._read[r], int(log[0])
            if w == i:
                continue
            if not 0 < w - i <= LOG_ENTRIES:
                self.rescan = True
                return self.released()
            pos = np.arange(i, w, dtype=np.uint64)
            entries = log[1 + pos % LOG_ENTRIES]
            if int(log[0]) - i > LOG_ENTRIES:  # the writer lapped us while we read
                self.rescan = True
                return self.released()
            # An entry whose index is not its own is not visible here yet (a store order
            # weaker than x86's): consume up to it, the rest next time.
            ok = (entries >> 32) == (pos & TAG_MASK)
            n = len(ok) if ok.all() else int(ok.argmin())
            out.update((entries[:n] & TAG_MASK).tolist())
            self._read[r] = i + n
        return out

    def sweep(self) -> int:
        """Clear the rows of receivers that died (their leases die with them); returns
        how many. Under the table's ``flock``, so no receiver claims a row meanwhile. A
        receiver whose state cannot be read now (the sender is out of descriptors, say)
        keeps its row: only one known to be gone loses it."""
        cleared = 0
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            for r in self._claimed():
                pid = int(self.header[ROW_BASE + 2 * r])
                start = int(self.header[ROW_BASE + 2 * r + 1])
                if still_running(pid, start):
                    continue
                self._clear_row(r)
                self.header[ROW_BASE + 2 * r:ROW_BASE + 2 * r + 2] = 0
                cleared += 1
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        if cleared:
            self.rescan = True  # counts went to zero with no entry in any log
        return cleared

    def _clear_row(self, r: int) -> None:
        start = table_layout(self.rows, self.slots)[0] + r * self.slots * 4
        length = self.slots * 4
        # Punch the row's pages out of the memfd rather than write zeros into all of them.
        lo, hi = page_up(start), (start + length) // PAGE * PAGE
        try:
            if hi > lo:
                self._map.madvise(mmap.MADV_REMOVE, lo, hi - lo)
            self.counts[r, :(lo - start) // 4] = 0
            self.counts[r, (hi - start) // 4:] = 0
        except (OSError, ValueError, AttributeError):
            self.counts[r] = 0

    def close(self) -> None:
        self.header = None  # type: ignore[assignment]
        self.counts = None  # type: ignore[assignment]
        self.logs = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
