"""The libc calls same-node sharing makes through ctypes, and the page size.

Owns nothing: bindings and constants only, set up once at import. Any thread may call
them (ctypes releases the GIL around each call).
"""

from __future__ import annotations

import ctypes
import logging
import mmap

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                        ctypes.c_void_p]
libc.madvise.restype = ctypes.c_int
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

MREMAP_MAYMOVE = 1
MREMAP_FIXED = 2
MAP_FAILED = ctypes.c_void_p(-1).value
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MADV_DONTNEED = 4
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE


class IoVec(ctypes.Structure):
    """One ``struct iovec`` of ``process_vm_readv``."""

    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


libc.process_vm_readv.restype = ctypes.c_ssize_t
libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong,
                                  ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.c_ulong]


def page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def unmap(addr: int, length: int) -> None:
    """Drop a mapping (its copy-on-write pages go with it)."""
    if libc.munmap(addr, length) != 0:
        logger.warning("munmap of a same-node mapping failed (errno %d)", ctypes.get_errno())
