"""What a sender publishes for same-node receivers, and how a process is named.

Owns no resource. :class:`HostInfo` is the directory entry a sender publishes for its
shared pool (versioned, validated on decode: a peer's bytes are never trusted); it lives
as long as the receiver's handle made from it. :func:`process_start` and
:func:`still_running` name a process by its pid and start time, so a reused pid is never
taken for the process that published. Any thread may call them.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass

import msgpack

from ray_rdt_pool.errors import WireFormatError
from ray_rdt_pool.same_node._libc import PAGE
from ray_rdt_pool.same_node.cuda import CudaExport

logger = logging.getLogger(__name__)

__all__ = ["HOST_INFO_VERSION", "MAX_SLOTS", "HostInfo", "process_start", "still_running"]

#: Version of the directory entry a sender publishes for same-node receivers; a receiver
#: reads only its own version.
HOST_INFO_VERSION = 3
#: Most slots a lease table may have: a slot fills the low 32 bits of a release-log entry.
MAX_SLOTS = 0xFFFFFFFF


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
                slots * PAGE < nbytes) or slots > MAX_SLOTS:
            raise WireFormatError("same-node entry describes an impossible pool or table")
        cuda = None if items[13] is None else CudaExport.parse(items[13])
        if cuda is not None and cuda.size < nbytes:
            raise WireFormatError("same-node CUDA entry: its storage is smaller than the pool")
        return HostInfo(node_id, pid, start, pfd, pino, base, nbytes, tfd, tino, rows, slots,
                        cuda)

