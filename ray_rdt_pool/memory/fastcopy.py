"""The host-memory copy of large packs: streaming stores where the compiled helper exists.

Pure module: ctypes and the standard library only (no torch, Ray or NIXL).

:func:`stream_copy` returns ``rdt_stream_copy`` from the optional extension
``ray_rdt_pool.memory._copy`` (built from ``_copy.c`` at install when a C compiler is present),
or None without it; the torch layer (:mod:`ray_rdt_pool.memory.tensors`) uses it for host copies
of at least ``Tuning.stream_copy_bytes`` in all and :func:`ctypes.memmove` for the
rest. Both take ``(destination address, source address, bytes)`` and release the GIL
(ctypes foreign calls), so the pack threads copy in parallel. :func:`move_batch` returns
``rdt_copy_moves``, which runs a whole list of such moves in one call: packs of thousands
of small tensors use it.

Why: plain stores read each destination line before overwriting it; for a copy larger
than the caches that is a third more memory traffic. glibc's memmove switches to
streaming stores only above a cache-derived threshold (114 MiB on a 2-core Xeon VM this
project is measured on), so the few-MiB units of a threaded pack, and every tensor of
a model's weights, used plain stores. Small copies keep plain stores: their bytes stay in
cache for whoever reads them next.

Threads: any; the helper is loaded once under a lock, on first use (nothing at import).
"""

from __future__ import annotations

import ctypes
import importlib
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["move_batch", "stream_copy", "stream_kind"]

#: What ``rdt_stream_kind()`` returns, by name.
_KINDS = {0: "memmove", 1: "sse2-stream"}

_lock = threading.Lock()
_loaded = False
_fn: Callable[[int, int, int], Any] | None = None
_batch: Callable[[int, int, int], Any] | None = None
_kind = "memmove"


def _load() -> None:
    global _loaded, _fn, _batch, _kind
    with _lock:
        if _loaded:
            return
        try:
            mod = importlib.import_module("ray_rdt_pool.memory._copy")
            lib = ctypes.CDLL(mod.__file__)
            fn = lib.rdt_stream_copy
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            fn.restype = None
            batch = lib.rdt_copy_moves
            batch.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            batch.restype = None
            kind = _KINDS.get(int(lib.rdt_stream_kind()), "memmove")
        except (ImportError, OSError, AttributeError):
            fn, batch, kind = None, None, "memmove"  # no compiler at install: memmove
        _fn = fn if kind != "memmove" else None
        _batch = batch
        _kind = kind
        _loaded = True


def stream_copy() -> Callable[[int, int, int], Any] | None:
    """The streaming-store copy ``(dst, src, n)``, or None where the helper is missing."""
    if not _loaded:
        _load()
    return _fn


def move_batch() -> Callable[[int, int, int], Any] | None:
    """The batched copy ``(address of moves, count, stream)``, or None without the helper.

    ``moves`` is a C-contiguous array of ``count`` int64 triples (destination address,
    source address, bytes), copied in order: one foreign call for a whole pack instead
    of one per tensor. With ``stream`` non-zero each move is a :func:`stream_copy` copy
    (memmove where the CPU has no streaming stores), else a memmove. The caller keeps the
    array alive until the call returns.
    """
    if not _loaded:
        _load()
    return _batch


def stream_kind() -> str:
    """``sse2-stream``, or ``memmove`` (no helper, or not an x86-64 CPU): what a copy of at
    least ``stream_min`` bytes uses for its moves of 128 KiB and more."""
    if not _loaded:
        _load()
    return _kind

