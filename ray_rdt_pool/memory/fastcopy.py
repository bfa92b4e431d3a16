"""Host-memory copies: streaming stores where the compiled copy helper is built, else memmove.

Owns the choice of copy for host moves. :func:`stream_copy` returns ``rdt_stream_copy``
of the optional copy helper (``native/_copy.c``, built by ``python -m
ray_rdt_pool.memory.native build``), or None without it; :func:`copy_for` picks it for
host copies of at least ``Tuning.stream_copy_bytes`` in all and :func:`ctypes.memmove`
for the rest. Both take ``(destination address, source address, bytes)`` and release the
GIL (ctypes foreign calls), so the pack threads copy in parallel. :func:`move_batch`
returns ``rdt_copy_moves``, which runs a whole list of such moves in one call: copies of
at least :data:`MANY_MOVES` moves use it (:func:`run_batch`, :func:`host_moves`).
:func:`fp8_quantizer` returns the helper's quantizing copy (``rdt_quantize_fp8``: a
weight into FP8 with block scales, bit for bit torch's arithmetic), or None without it.

Why: plain stores read each destination line before overwriting it; for a copy larger
than the caches that is a third more memory traffic. glibc's memmove switches to
streaming stores only above a cache-derived threshold, far above the few-MiB units of a
threaded pack and most tensors of a model's weights. Small copies keep plain stores:
their bytes stay in cache for whoever reads them next.

No torch, Ray or NIXL: ctypes and the standard library (numpy inside :func:`run_batch`).
Threads: any; the helper is loaded once under a lock, on first use (nothing at import).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MANY_MOVES", "batch_unit", "copy_for", "fp8_dequantizer", "fp8_quantizer",
           "host_moves",
           "move_batch", "run_batch", "stream_copy", "stream_kind", "streams"]

#: What ``rdt_stream_kind()`` returns, by name.
_KINDS = {0: "memmove", 1: "sse2-stream"}
_memmove = ctypes.memmove
#: Copies of at least this many moves (packs of this many tensors) go through numpy
#: arrays and one call of the helper; below it numpy's fixed cost is larger.
MANY_MOVES = 256

# All six set once, under _lock, by the first _load() of the process.
_lock = threading.Lock()
_loaded = False
_fn: Callable[[int, int, int], Any] | None = None
_batch: Callable[[int, int, int], Any] | None = None
_quantize: Callable[..., int] | None = None
_dequantize: Callable[..., int] | None = None
_kind = "memmove"


def _load() -> None:
    global _loaded, _fn, _batch, _quantize, _dequantize, _kind
    with _lock:
        if _loaded:
            return
        from ray_rdt_pool.memory import native

        fn, batch, quantize, dequantize, kind = None, None, None, None, "memmove"
        lib = native.load_copy()
        if lib is not None:
            try:
                fn = lib.rdt_stream_copy
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
                fn.restype = None
                batch = lib.rdt_copy_moves
                batch.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                batch.restype = None
                quantize = lib.rdt_quantize_fp8
                quantize.argtypes = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_int64] * 5,
                                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
                quantize.restype = ctypes.c_int
                dequantize = lib.rdt_dequantize_fp8
                dequantize.argtypes = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_int64] * 4,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_int64]
                dequantize.restype = ctypes.c_int
                kind = _KINDS.get(int(lib.rdt_stream_kind()), "memmove")
            except AttributeError:  # a library that is not the helper: memmove
                fn, batch, quantize, dequantize, kind = None, None, None, None, "memmove"
        _fn = fn if kind != "memmove" else None
        _batch = batch
        _quantize = quantize
        _dequantize = dequantize
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


def fp8_quantizer() -> Callable[..., int] | None:
    """The quantizing copy, or None without the helper: ``(src, bf16, rows, cols, ld,
    bm, bn, e5m2, q, scales)`` quantizes a row-major bf16 (``bf16`` 1) or fp32 source of
    ``rows x cols`` (row ``i`` at element ``i * ld``) into FP8 (``e5m2`` 1:
    float8_e5m2, else float8_e4m3fn) in groups of ``bm x bn``: ``q`` gets the
    contiguous FP8 bytes, ``scales`` the fp32 scales, ``ceil(rows / bm) x ceil(cols /
    bn)`` row-major. Returns 0, or -1 for arguments it refuses."""
    if not _loaded:
        _load()
    return _quantize


def fp8_dequantizer() -> Callable[..., int] | None:
    """The dequantizing copy, or None without the helper: ``(q, e5m2, rows, cols, bm, bn,
    scales, dst, bf16, ld)`` writes the contiguous ``rows x cols`` FP8 bytes ``q`` times
    their group's fp32 scale (groups of ``bm x bn``, ``scales`` as
    :func:`fp8_quantizer` writes them) into ``dst``, fp32 (``bf16`` 0) or bf16, row ``i``
    at element ``i * ld``: torch's ``q.float() * scale`` then ``.to(dtype)``, bit for bit.
    Returns 0, or -1 for arguments it refuses."""
    if not _loaded:
        _load()
    return _dequantize


def stream_kind() -> str:
    """``sse2-stream``, or ``memmove`` (no helper, or not an x86-64 CPU): what a copy of at
    least ``stream_min`` bytes uses for its moves of 128 KiB and more."""
    if not _loaded:
        _load()
    return _kind


def copy_for(total: int, stream_min: int) -> Callable[[int, int, int], Any]:
    """The copy for the moves of one host copy of ``total`` bytes: streaming stores from
    ``stream_min`` bytes (0: never) where the compiled helper exists, else memmove."""
    fn = stream_copy() if 0 < stream_min <= total else None
    return _memmove if fn is None else fn


def streams(copy: Callable[[int, int, int], Any]) -> bool:
    """Whether ``copy`` (from :func:`copy_for`) is the streaming copy, not memmove."""
    return copy is not _memmove


def run_batch(moves: Any, stream: bool) -> bool:
    """Run ``(destination, source, bytes)`` moves (an ``(n, 3)`` int64 array, or a
    sequence of triples) in one call of the compiled helper; False (nothing copied) where
    the helper is missing."""
    fn = move_batch()
    if fn is None:
        return False
    import numpy as np

    arr = np.ascontiguousarray(moves, dtype=np.int64).reshape(-1, 3)
    fn(arr.ctypes.data, len(arr), 1 if stream else 0)
    return True


def host_moves(moves: Sequence[tuple[int, int, int]], total: int, stream_min: int) -> None:
    """Run host ``(destination, source, bytes)`` moves of ``total`` bytes in all: in one
    call of the compiled helper when there are many, else one copy each (streaming
    stores from ``stream_min`` bytes in all, as :func:`copy_for`)."""
    copy = copy_for(total, stream_min)
    if len(moves) >= MANY_MOVES and run_batch(moves, streams(copy)):
        return
    for dst, src, n in moves:
        if n:
            copy(dst, src, n)


def batch_unit(stream: bool) -> Callable[[Sequence[tuple[int, int, int]]], Any] | None:
    """A threaded pack's per-unit copy through the compiled helper (one foreign call per
    unit of moves), or None where the helper is missing."""
    if move_batch() is None:
        return None

    def batch(unit: Sequence[tuple[int, int, int]]) -> None:
        run_batch(unit, stream)
    return batch
