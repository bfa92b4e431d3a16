"""Same-node sharing: the sender's pool in shared memory, its lease table, and receivers'
private mappings of it.

Role. A sender whose pool is host memory keeps it in a ``memfd`` (anonymous shared memory
with no name in any file system, so nothing is left behind when a process crashes). A
receiver on the same Ray node opens it through ``/proc/<pid>/fd/<fd>`` and maps the
whole pool once *privately* (copy-on-write): the tensors of each object it gets are
views of the sender's bytes, no copy is made, and a receiver that writes into them
changes only its own pages. The pool stays registered with NIXL for receivers on other
nodes.

Leases. The sender must not reuse a block while a receiver still has views of it, so
every mapping holds a lease, counted in a *lease table*: a second ``memfd`` owned by the
sender, with one row per receiver process and one ``uint32`` counter per pool page
(an object's slot is the page where its first block starts). A row has one writer, the
receiver that claimed it (under ``flock`` on the table), so no atomic operations are
needed across processes; the sender only reads counts, and clears a row only after its
receiver has died. Ray frees an object only when no ref to it is left, so a receiver
always takes its lease before the sender can see the object freed. Each row also has a
release log (the slots whose count dropped to zero, see :class:`LeaseTable`), so the
sender checks only the slots that changed, not every placement it holds back.

Lifetimes, one owner each:

* :class:`SharedHostRegion` (the pool's memory): created and closed by the registry
  for the sender, like any region.
* :class:`LeaseTable`: created and closed by the sender with its pool. A block whose
  slot has a lease goes back to the pool only when the last lease drops; rows of dead
  receivers are cleared by :meth:`LeaseTable.sweep` (the sender's progress tick).
* :class:`MappedPool` (a receiver's handle on one sender's pool: two descriptors, the
  table mapping and its row, and the pool's private mapping): created and released by
  the receiver. When an object's views die, its pages of the private mapping are given
  back to the file (``MADV_DONTNEED`` drops the private copies) *before* its lease is
  dropped, so copy-on-write pages never outlive the lease and a reused block is never
  seen through old pages. A fragmented object, or one whose pages views of an earlier
  get still use, is copied out instead. Its pool descriptor, table mapping (the row's
  counts), private mapping, shared view and CUDA opening (``_CudaMapping``) live as long
  as the handle, or until the last lease when the handle is closed with leases held (the
  sender exited, the handle was evicted, the receiver shut down): a lease taken is always
  returned.

Fork. A receiver's pool mapping is private, but its untouched pages are the pool's: a
forked child that kept them would see the block's next object once the parent's lease
dropped. The receiver (its ``os.register_at_fork`` hooks, registered with its first
handle) has the child replace each object's range its views use by anonymous memory
holding the same bytes (:func:`privatize`) and forget every handle
(:meth:`MappedPool.forget`: the row is the parent's; the rest of the pool mapping goes),
while the parent holds one more lease per mapping until the child has copied
and the child, first thing, takes leases of its own in a row of its own
(:class:`ChildLeases`), so a parent killed during the copy cannot free the blocks.

CUDA pools. A sender whose pool is CUDA memory publishes torch's CUDA IPC export of it
(:class:`CudaExport`) instead of a descriptor; a receiver whose landing GPU is that GPU
opens it once (:class:`MappedPool` ``.cuda``) and copies each object out of it, device to
device, under a lease held only for the copy: IPC memory cannot be mapped copy-on-write,
so views of it would not be private.

Source reads. The weights API's stream may skip the pool when its receivers share the
sender's node: a receiver copies a bucket straight out of the sender process
(``process_vm_readv``) through :func:`peer_reader`, after :func:`probe_source` showed it
may. Nothing here owns the tensors read: the stream keeps them alive until every receiver
acknowledged their bucket. The 16-byte probe (:func:`this_process`) is allocated once per
process and never freed.

Threads: the sender's lease checks run on ``_ray_system`` (``garbage_collect``) and on
the progress thread; a receiver changes its row only under its receiver lock.
Imports no torch, Ray or NIXL at module level.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from ray_rdt_pool.errors import WireFormatError
from ray_rdt_pool.memory.tensors import HostRegion

logger = logging.getLogger(__name__)

__all__ = [
    "HOST_INFO_VERSION", "PAGE", "ChildLeases", "CudaExport", "HostInfo", "LeaseTable",
    "MappedPool", "NotVisibleError", "SharedHostRegion", "SourceProcess", "export_cuda_pool",
    "lease_slot", "lease_slots", "mappable_spans", "peer_batch_reader", "peer_reader",
    "privatize", "probe_source", "still_running", "this_process", "unmap",
]

PAGE = mmap.PAGESIZE
#: Version of the directory entry a sender publishes for same-node receivers (3: lease
#: tables with release logs).
HOST_INFO_VERSION = 3
#: Receiver processes one sender's lease table holds at once; more fall back to NIXL.
LEASE_ROWS = 128
_MAGIC = 0x52445450_4C534532  # "RDTPLSE2"
_ROW_BASE = 4  # header words before the row owners: magic, rows, slots, log entries
#: Entries of a row's release log: one page holds its write index, then the entries.
LOG_ENTRIES = PAGE // 8 - 1
_TAG_MASK = 0xFFFFFFFF

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                         ctypes.c_void_p]
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MADV_DONTNEED = 4
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE


def page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


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


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None once it is gone: with the
    pid, it names a process even after the pid is reused.

    Gone means no such process (``ENOENT``/``ESRCH``) or one that has exited but is not
    yet reaped (a zombie): it has released its memory and will never write or free
    anything again. Its parent (for a Ray worker, the raylet) may take seconds to reap it
    on a loaded machine, and a receiver must not serve that sender's objects meanwhile.

    Raises OSError when it cannot tell: the stat file could not be read for another
    reason (no free descriptor, no memory, no permission). A caller deciding whether a
    process is gone must then take it as alive (:func:`still_running`): clearing a live
    receiver's lease row would hand its blocks out again under its views."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ESRCH):
            return None
        raise
    try:
        fields = text[text.rindex(b")") + 2:].split()
        if fields[0] in (b"Z", b"X"):
            return None
        return int(fields[19])
    except (ValueError, IndexError) as e:
        raise OSError(f"/proc/{pid}/stat is not in the expected format") from e


def still_running(pid: int, start: int) -> bool:
    """Whether the process ``pid`` started at ``start`` still runs; True when that cannot
    be told now (see :func:`process_start`): only a process known to be gone is gone."""
    try:
        return process_start(pid) == start
    except OSError as e:
        logger.debug("cannot tell whether process %d runs (%s): taken as running", pid, e)
        return True


# ---------------------------------------------------------------------------------------
# What a sender publishes (versioned, validated: a peer's bytes are never trusted)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaExport:
    """How a same-node receiver opens a sender's CUDA pool through CUDA IPC.

    The fields are those of torch's IPC export of the pool's storage (``_share_cuda_``):
    the allocation's IPC handle, the pool's size and offset inside it, torch's shared
    reference counter (which keeps the sender's allocation alive while a receiver has it
    open) and the event the opener waits on. ``uuid`` names the physical GPU, since each
    process numbers only the GPUs it sees.
    """

    uuid: str
    handle: bytes
    size: int
    offset: int
    ref_handle: bytes
    ref_offset: int
    event_handle: bytes
    event_sync: bool

    def items(self) -> list[Any]:
        return [self.uuid, self.handle, self.size, self.offset, self.ref_handle,
                self.ref_offset, self.event_handle, self.event_sync]

    @staticmethod
    def parse(items: Any) -> CudaExport:
        if not isinstance(items, list) or len(items) != 8:
            raise WireFormatError("same-node CUDA entry must be a list of 8 items")
        uuid, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = items
        if not isinstance(uuid, str) or not 0 < len(uuid) <= 128:
            raise WireFormatError("same-node CUDA entry has no valid GPU uuid")
        for b in (handle, ref_handle, event_handle):
            if not isinstance(b, bytes) or len(b) > 1024:
                raise WireFormatError("same-node CUDA entry handles must be bytes (<= 1 KiB)")
        if not handle:
            raise WireFormatError("same-node CUDA entry has an empty IPC handle")
        for x in (size, offset, ref_offset):
            if type(x) is not int or not 0 <= x < 1 << 63:
                raise WireFormatError("same-node CUDA entry sizes must be non-negative ints")
        if type(event_sync) is not bool:
            raise WireFormatError("same-node CUDA entry event flag must be a bool")
        return CudaExport(uuid, handle, size, offset, ref_handle, ref_offset, event_handle,
                          event_sync)


@dataclass(frozen=True)
class HostInfo:
    """How a same-node receiver finds a sender's shared pool and lease table.

    A host pool is a memfd (``pool_fd``/``pool_ino``); a CUDA pool has ``cuda`` instead
    (its descriptor fields are 0)."""

    node_id: str
    pid: int
    start: int  # the sender's start time: with the pid, names the process
    pool_fd: int
    pool_ino: int
    pool_base: int
    pool_bytes: int
    table_fd: int
    table_ino: int
    rows: int
    slots: int
    cuda: CudaExport | None = None

    def encode(self) -> bytes:
        return bytes(msgpack.packb([HOST_INFO_VERSION, self.node_id, self.pid, self.start,
                                    self.pool_fd,
                                    self.pool_ino, self.pool_base, self.pool_bytes,
                                    self.table_fd, self.table_ino, self.rows, self.slots,
                                    PAGE, None if self.cuda is None else self.cuda.items()]))

    @staticmethod
    def decode(data: bytes) -> HostInfo:
        """Parse a published entry; WireFormatError for anything malformed."""
        try:
            items = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:
            raise WireFormatError(f"same-node entry is not valid msgpack: {e}") from e
        if not isinstance(items, list) or not items:
            raise WireFormatError("same-node entry must be a list of 14 items")
        if items[0] != HOST_INFO_VERSION:
            raise WireFormatError(
                f"same-node entry version {items[0]!r}, this process reads version "
                f"{HOST_INFO_VERSION}; run the same ray_rdt_pool version on every process")
        if len(items) != 14:
            raise WireFormatError("same-node entry must be a list of 14 items")
        node_id = items[1]
        if not isinstance(node_id, str) or not 0 < len(node_id) <= 256:
            raise WireFormatError("same-node entry has no valid node id")
        ints = items[2:13]
        if not all(type(x) is int and 0 <= x < 1 << 63 for x in ints):
            raise WireFormatError("same-node entry fields must be non-negative ints")
        pid, start, pfd, pino, base, nbytes, tfd, tino, rows, slots, page = ints
        if page != PAGE or nbytes % PAGE or base % PAGE or not 0 < rows <= 254 or (
                slots * PAGE < nbytes) or slots > _TAG_MASK:
            raise WireFormatError("same-node entry describes an impossible pool or table")
        cuda = None if items[13] is None else CudaExport.parse(items[13])
        if cuda is not None and cuda.size < nbytes:
            raise WireFormatError("same-node CUDA entry: its storage is smaller than the pool")
        return HostInfo(node_id, pid, start, pfd, pino, base, nbytes, tfd, tino, rows, slots,
                        cuda)


def export_cuda_pool(tensor: Any) -> CudaExport:
    """The CUDA IPC export of a sender's pool tensor (it must start its storage).

    Raises OSError (the caller falls back to NIXL for same-node receivers) where torch
    cannot export it, e.g. memory from another allocator."""
    import torch

    if tensor.storage_offset() != 0 or tensor.data_ptr() % PAGE:
        # Receivers find the pool at the start of the storage they open, in pages.
        raise OSError("the CUDA pool does not start a page-aligned storage")
    storage = tensor.untyped_storage()
    try:
        dev, handle, size, offset, ref_handle, ref_offset, ev, ev_sync = (
            storage._share_cuda_())
        uuid = str(torch.cuda.get_device_properties(int(dev)).uuid)
    except Exception as e:  # torch raises RuntimeError/TypeError of its own kinds
        raise OSError(f"CUDA IPC export of the pool failed: {e}") from e
    return CudaExport(uuid, bytes(handle), int(size), int(offset), bytes(ref_handle or b""),
                      int(ref_offset or 0), bytes(ev or b""), bool(ev_sync))


class _CudaMapping:
    """A receiver's opening of a sender's CUDA pool (one per sender, via torch's IPC
    cache): the storage and the pool's device address in this process."""

    def __init__(self, cuda: CudaExport, pool_bytes: int) -> None:
        import torch

        index = _visible_index(cuda.uuid)
        if index is None:
            raise NotVisibleError("the sender's GPU is not visible in this process")
        if index != torch.cuda.current_device():
            raise NotVisibleError(f"the sender's GPU is cuda:{index}, this process lands "
                              f"objects on cuda:{torch.cuda.current_device()}")
        try:
            self.storage = torch.UntypedStorage._new_shared_cuda(
                index, cuda.handle, cuda.size, cuda.offset, cuda.ref_handle,
                cuda.ref_offset, cuda.event_handle, cuda.event_sync)
        except Exception as e:
            raise OSError(f"opening the sender's CUDA pool failed: {e}") from e
        if self.storage.nbytes() < pool_bytes:
            raise OSError("the sender's CUDA pool is smaller than published")
        self.index = index
        self.base = int(self.storage.data_ptr())


class NotVisibleError(OSError):
    """The sender's GPU is not this process's landing GPU: NIXL reads its objects."""


def _visible_index(uuid: str) -> int | None:
    import torch

    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


# ---------------------------------------------------------------------------------------
# Sender side: the pool's memory and the lease table
# ---------------------------------------------------------------------------------------


class SharedHostRegion(HostRegion):
    """A pool region in a ``memfd``, mapped shared; its blocks are whole pages, so each
    object's pages are its own (a receiver's copy-on-write page never holds a
    neighbour's bytes)."""

    align = PAGE

    def __init__(self, nbytes: int, *, prefault: bool = False) -> None:
        import numpy as np
        import torch

        nbytes = page_up(nbytes)
        self.fd = os.memfd_create("ray_rdt_pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            flags = mmap.MAP_SHARED
            if prefault and hasattr(mmap, "MAP_POPULATE"):
                flags |= mmap.MAP_POPULATE
            self._map = mmap.mmap(self.fd, nbytes, flags=flags, prot=_PROT_RW)
        except BaseException:
            os.close(self.fd)
            raise
        self.ino = os.fstat(self.fd).st_ino
        self.nbytes = nbytes
        self._populated = nbytes if prefault else 0
        self.array: np.ndarray = np.frombuffer(self._map, dtype=np.uint8)
        self.tensor: torch.Tensor = torch.from_numpy(self.array)
        self.addr = self.tensor.data_ptr()
        self.device = "cpu"
        self.device_id = 0
        self.torch_device = "cpu"

    def close(self) -> None:
        super().close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=_PROT_RW)
        except BaseException:
            os.close(self.fd)
            raise
        self.ino = os.fstat(self.fd).st_ino
        self.header = np.frombuffer(self._map, dtype=np.uint64, count=PAGE // 8)
        self.header[:4] = (_MAGIC, rows, slots, LOG_ENTRIES)
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
        owners = self.header[_ROW_BASE:_ROW_BASE + 2 * self.rows:2]
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

        owners = self.header[_ROW_BASE:_ROW_BASE + 2 * self.rows]
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
            ok = (entries >> 32) == (pos & _TAG_MASK)
            n = len(ok) if ok.all() else int(ok.argmin())
            out.update((entries[:n] & _TAG_MASK).tolist())
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
                pid = int(self.header[_ROW_BASE + 2 * r])
                start = int(self.header[_ROW_BASE + 2 * r + 1])
                if still_running(pid, start):
                    continue
                self._clear_row(r)
                self.header[_ROW_BASE + 2 * r:_ROW_BASE + 2 * r + 2] = 0
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


# ---------------------------------------------------------------------------------------
# Receiver side
# ---------------------------------------------------------------------------------------


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
        self.cuda: _CudaMapping | None = None
        self._table: mmap.mmap | None = None
        try:
            if info.cuda is not None:
                self.cuda = _CudaMapping(info.cuda, info.pool_bytes)
            else:
                self.pool_fd = _open_peer_fd(info.pid, info.pool_fd, info.pool_ino,
                                             os.O_RDONLY)
            self.table_fd = _open_peer_fd(info.pid, info.table_fd, info.table_ino, os.O_RDWR)
            counts_at, size = table_layout(info.rows, info.slots)
            if os.fstat(self.table_fd).st_size < size or (
                    self.pool_fd >= 0 and os.fstat(self.pool_fd).st_size < info.pool_bytes):
                raise OSError("the shared pool or lease table is smaller than published")
            self._table = mmap.mmap(self.table_fd, size, flags=mmap.MAP_SHARED, prot=_PROT_RW)
            header = np.frombuffer(self._table, dtype=np.uint64, count=PAGE // 8)
            if int(header[0]) != _MAGIC or int(header[3]) != LOG_ENTRIES:
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
            owners = [(int(header[_ROW_BASE + 2 * r]), int(header[_ROW_BASE + 2 * r + 1]))
                      for r in range(rows)]
            for r, owner in enumerate(owners):
                if owner == (me, start):  # claimed before by this process: its row
                    return r
            for r, (pid, _s) in enumerate(owners):
                if pid == 0:
                    header[_ROW_BASE + 2 * r + 1] = start
                    header[_ROW_BASE + 2 * r] = me
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
        mapping faults every page in again: measured 6.2 against 10.6 GB/s here)."""
        if not self._shared:
            addr = _libc.mmap(None, self.info.pool_bytes, mmap.PROT_READ, mmap.MAP_SHARED,
                              self.pool_fd, 0)
            if addr in (None, _MAP_FAILED):
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
                log[1 + w % LOG_ENTRIES] = ((w & _TAG_MASK) << 32) | slot
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
            addr = _libc.mmap(None, self.info.pool_bytes, _PROT_RW,
                              mmap.MAP_PRIVATE | _MAP_NORESERVE, self.pool_fd, 0)
            if addr in (None, _MAP_FAILED):
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
        if _libc.madvise(addr, length, _MADV_DONTNEED) == 0:
            return True  # private copies dropped: reads fault in the file's pages again
        err = ctypes.get_errno()  # e.g. EINVAL for locked pages: map the file over it
        got = _libc.mmap(addr, length, _PROT_RW,
                         mmap.MAP_PRIVATE | _MAP_NORESERVE | _MAP_FIXED, self.pool_fd,
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
                header[_ROW_BASE + 2 * self.row:_ROW_BASE + 2 * self.row + 2] = 0
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
    new = _libc.mmap(None, length, _PROT_RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if new in (None, _MAP_FAILED):
        return False
    ctypes.memmove(new, addr, length)
    # One call moves the copy over the old mapping (which it unmaps): no moment where the
    # address holds nothing.
    got = _libc.mremap(new, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, addr)
    if got != addr:
        _libc.munmap(new, length)
        return False
    return True


def unmap(addr: int, length: int) -> None:
    """Drop a mapping (its copy-on-write pages go with it)."""
    if _libc.munmap(addr, length) != 0:
        logger.warning("munmap of a same-node mapping failed (errno %d)", ctypes.get_errno())


def _open_peer_fd(pid: int, fd: int, ino: int, flags: int) -> int:
    """Open another process's descriptor, checking it is the file that was published
    (the pid may have been reused by another process since)."""
    got = os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_CLOEXEC)
    if os.fstat(got).st_ino != ino:
        os.close(got)
        raise OSError(f"/proc/{pid}/fd/{fd} is not the published shared pool")
    return got


# ---------------------------------------------------------------------------------------
# Source reads: a same-node receiver copies straight out of the sender process's memory
# (``process_vm_readv``, the kernel's cross-memory attach, the same mechanism UCX's cma
# transport uses). Used by the weights API's stream, which keeps the source tensors alive
# and unchanged until every receiver acknowledged their bucket.
# ---------------------------------------------------------------------------------------


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]

_probe: ctypes.Array[ctypes.c_char] | None = None
#: CUDA openings a forked child inherited (see MappedPool.forget): never released.
_inherited_cuda: list[Any] = []


@dataclass(frozen=True)
class SourceProcess:
    """Who a same-node receiver reads from: the sender's Ray node, pid and start time
    (a pid alone may be reused), and a probe: ``len(probe)`` bytes at ``probe_addr`` in
    the sender that a receiver reads once to learn whether the kernel lets it."""

    node: str
    pid: int
    start: int
    probe_addr: int
    probe: bytes

    def alive(self) -> bool:
        return still_running(self.pid, self.start)


def this_process(node: str) -> SourceProcess | None:
    """This process as a source (None if its start time cannot be read). The probe is
    16 random bytes allocated once per process and never freed."""
    global _probe
    try:
        start = process_start(os.getpid())
    except OSError:
        return None
    if start is None:
        return None
    if _probe is None:
        _probe = ctypes.create_string_buffer(os.urandom(16), 16)
    return SourceProcess(node, os.getpid(), start, ctypes.addressof(_probe), _probe.raw)


def peer_reader(pid: int) -> Any:
    """A ``copy(dst, src, n)`` that reads ``n`` bytes at address ``src`` of process ``pid``
    into ``dst`` of this one. Raises OSError when the kernel refuses (the process is
    gone, the range is not mapped there, or reading another process is not permitted),
    so a bad address can never crash this process."""
    readv = _libc.process_vm_readv

    def copy(dst: int, src: int, n: int) -> None:
        while n > 0:
            local = _IoVec(dst, n)
            remote = _IoVec(src, n)
            got = readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got <= 0:
                err = ctypes.get_errno() if got < 0 else 0
                raise OSError(err, f"reading {n} bytes of process {pid} at {src:#x} failed: "
                                   f"{os.strerror(err) if err else 'nothing read'}")
            dst, src, n = dst + got, src + got, n - got

    return copy


#: Most iovecs one process_vm_readv takes (the kernel's UIO_MAXIOV).
_IOV_MAX = 1024


def peer_batch_reader(pid: int) -> Any:
    """A ``copy(moves)`` for a list of ``(dst, src, n)`` moves out of process ``pid``: one
    vectored ``process_vm_readv`` per 1,024 moves, so the many short runs of a strided
    selection cost a few system calls, not one each. A short or failed call is redone
    move by move (:func:`peer_reader`), which raises where the kernel refuses."""
    import numpy as np

    readv = _libc.process_vm_readv
    one = peer_reader(pid)
    iov_p = ctypes.POINTER(_IoVec)

    def copy(moves: Sequence[tuple[int, int, int]]) -> None:
        if len(moves) == 1:
            one(*moves[0])
            return
        arr = np.array(moves, dtype=np.uint64).reshape(-1, 3)
        arr = arr[arr[:, 2] > 0]
        local = np.ascontiguousarray(arr[:, [0, 2]])
        remote = np.ascontiguousarray(arr[:, [1, 2]])
        for i in range(0, len(arr), _IOV_MAX):
            k = min(_IOV_MAX, len(arr) - i)
            want = int(arr[i:i + k, 2].sum())
            got = readv(pid, ctypes.cast(local.ctypes.data + 16 * i, iov_p), k,
                        ctypes.cast(remote.ctypes.data + 16 * i, iov_p), k, 0)
            if got != want:
                for dst, src, n in arr[i:i + k].tolist():
                    one(dst, src, n)

    return copy


def probe_source(src: SourceProcess) -> bool:
    """Whether this process may read ``src``'s memory (a read of its probe matches)."""
    if len(src.probe) == 0 or len(src.probe) > 64 or not src.alive():
        return False
    buf = ctypes.create_string_buffer(len(src.probe))
    try:
        peer_reader(src.pid)(ctypes.addressof(buf), src.probe_addr, len(src.probe))
    except OSError as e:
        logger.debug("cannot read process %d's memory: %s", src.pid, e)
        return False
    return buf.raw == src.probe
