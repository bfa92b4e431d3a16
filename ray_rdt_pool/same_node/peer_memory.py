"""Source reads: a same-node receiver copies straight out of the sender process.

The weights API's stream may skip the pool when its receivers share the sender's node:
a receiver copies a bucket out of the sender's memory (``process_vm_readv``, the kernel's
cross-memory attach, which UCX's cma transport uses too) through :func:`peer_reader`,
after :func:`probe_source` showed it may.

Lifetime: nothing here owns the tensors read: the stream keeps them alive and unchanged
until every receiver acknowledged their bucket. The 16-byte probe (:func:`this_process`)
is allocated once per process and never freed. Any thread may call these.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray_rdt_pool.same_node._libc import IoVec, libc
from ray_rdt_pool.same_node.info import process_start, still_running

logger = logging.getLogger(__name__)

__all__ = ["SourceProcess", "peer_batch_reader", "peer_reader", "probe_source",
           "this_process"]

_probe: ctypes.Array[ctypes.c_char] | None = None


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
    readv = libc.process_vm_readv

    def copy(dst: int, src: int, n: int) -> None:
        while n > 0:
            local = IoVec(dst, n)
            remote = IoVec(src, n)
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

    readv = libc.process_vm_readv
    one = peer_reader(pid)
    iov_p = ctypes.POINTER(IoVec)

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
