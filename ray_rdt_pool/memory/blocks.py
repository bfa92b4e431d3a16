"""Blocks of raw host or CUDA memory as uint8 tensors with their own lifetime (DLPack).

Owns the DLPack record of every block :func:`device_block` made and that torch has not
freed yet: a record lives here until torch frees the block's storage and calls its
deleter, on whatever thread drops the last view, which then runs the block's ``on_free``
(a lease or arena block goes back). At interpreter exit, :func:`freeze_blocks_at_exit`
turns the deleters of blocks still alive into a C no-op, so nothing calls back into
Python while the interpreter tears down.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["device_block", "freeze_blocks_at_exit", "install_exit_hook"]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]
_DL_DEVICE = {"cpu": 1, "cuda": 2}
# Address of a DLPack record -> (the record, its shape array, on_free): the entry keeps
# both ctypes objects alive until torch calls the deleter, which pops it.
_live_blocks: dict[int, tuple[Any, Any, Callable[[], None] | None]] = {}


@_DELETER
def _dl_deleter(managed: Any) -> None:
    entry = _live_blocks.pop(ctypes.addressof(managed.contents), None)
    if entry is not None and entry[2] is not None:
        entry[2]()


def freeze_blocks_at_exit() -> None:
    """At interpreter exit: blocks still alive stop calling back into Python.

    A block's deleter is a Python callback. Tensors that outlive this point are freed
    while the interpreter tears itself down (module globals cleared first, the runtime
    later), or after it, from C++ destructors; a Python callback then raises inside
    finalization or crashes the process. So each live block's deleter becomes a C
    function that does nothing (``getpid`` ignores the pointer it is passed), and its
    DLPack record is kept alive for good, since torch reads the deleter when it frees
    the storage. Nothing is lost: the callbacks return leases and arena blocks of a
    process that is exiting. Runs from ``atexit`` (registered by the transport before
    its ``shutdown``, so after it).
    """
    addr = ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
    if addr is None:
        return
    noop = _DELETER(addr)
    for managed, _shape, _on_free in list(_live_blocks.values()):
        managed.deleter = noop
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(managed))  # never freed: see above
    _live_blocks.clear()


_exit_hook_installed = False


def install_exit_hook() -> None:
    """Register :func:`freeze_blocks_at_exit` with ``atexit`` once per process."""
    global _exit_hook_installed
    if not _exit_hook_installed:
        import atexit

        atexit.register(freeze_blocks_at_exit)
        _exit_hook_installed = True


def device_block(addr: int, nbytes: int, device: str, device_id: int,
                 on_free: Callable[[], None] | None) -> torch.Tensor:
    """A uint8 tensor over raw memory ``[addr, addr+nbytes)`` whose storage is just that.

    Built through a DLPack capsule whose deleter runs ``on_free`` once torch frees the
    storage, i.e. when the last view of the block dies. This works for CUDA memory,
    where a numpy view of the region would not.
    """
    import torch.utils.dlpack

    managed = _DLManagedTensor()
    shape = (ctypes.c_int64 * 1)(nbytes)
    t = managed.dl_tensor
    t.data = addr
    t.device = _DLDevice(_DL_DEVICE[device], device_id)
    t.ndim = 1
    t.dtype = _DLDataType(1, 8, 1)  # kDLUInt, 8 bits, 1 lane
    t.shape = shape
    t.strides = None
    t.byte_offset = 0
    managed.deleter = _dl_deleter
    _live_blocks[ctypes.addressof(managed)] = (managed, shape, on_free)
    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype = ctypes.py_object
    capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule: Any = None
    try:
        capsule = capsule_new(ctypes.addressof(managed), b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        # No tensor took the capsule (torch renames the one it takes): nothing will call
        # the deleter, so the memory's owner is told now (a Ctrl-C, say).
        valid = ctypes.pythonapi.PyCapsule_IsValid
        valid.restype = ctypes.c_int
        valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
        if capsule is None or valid(capsule, b"dltensor"):
            entry = _live_blocks.pop(ctypes.addressof(managed), None)
            if entry is not None and entry[2] is not None:
                entry[2]()
        raise
