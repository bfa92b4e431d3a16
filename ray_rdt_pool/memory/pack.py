"""The pack: each tensor's bytes copied to its packed offset in the object's pool blocks.

Owns :func:`pack_into` (host pools: memmoves of spans of adjacent tensors, streaming
stores for large packs, threaded above a threshold) and :func:`pack_torch` (CUDA pools
and packs that convert dtypes: batched torch copies). Stateless: both run on their
caller's thread (the sender's put), which for a large pack shares the copy with the pack
helpers of :mod:`ray_rdt_pool.memory.pack_pool` and returns only once none of them
writes into the blocks any more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.layout import BlockMap
from ray_rdt_pool.errors import InvalidInputError
from ray_rdt_pool.memory import pack_pool
from ray_rdt_pool.memory.dtypes import dtype_name, torch_dtype
from ray_rdt_pool.memory.extent import storage_extent
from ray_rdt_pool.memory.fastcopy import MANY_MOVES, batch_unit, copy_for, run_batch, streams
from ray_rdt_pool.memory.pack_pool import Move, PackJob, array_units, run_job, run_moves
from ray_rdt_pool.memory.rebuild import contiguous_strides

if TYPE_CHECKING:
    import torch

    from ray_rdt_pool.memory.allocations import HostMemory
    from ray_rdt_pool.memory.describe import Described

__all__ = ["pack_into", "pack_torch"]

#: Default ``threshold`` of :func:`pack_into` (the sender passes its configured
#: ``pack_threshold_bytes``): smaller copies stay on the calling thread.
_PACK_THRESHOLD = 8 << 20


def _move_array(dst: Any, src: Any, nbytes: Any, at: int) -> Any:
    """Spans from :func:`_span_arrays` as an ``(n, 3)`` int64 array of moves, the packed
    offsets turned into addresses from ``at``."""
    import numpy as np

    moves = np.empty((len(nbytes), 3), dtype=np.int64)
    moves[:, 0] = dst + at
    moves[:, 1] = src
    moves[:, 2] = nbytes
    return moves


def _pack_threaded(tensors: Sequence[torch.Tensor], d: Described, offsets: Sequence[int],
                   blocks: Sequence[tuple[int, int]], region: HostMemory,
                   idx: Sequence[int], threads: int,
                   copy: Callable[[int, int, int], Any]) -> None:
    """:func:`pack_into` on up to ``threads`` threads (runs on the calling thread).

    The same spans as the one-thread loop are mapped to physical moves through the block
    map and cut into units; ``threads - 1`` helpers and the calling thread copy them. The
    caller materialises the non-plain tensors meanwhile (torch ops that allocate) and
    copies those itself. It returns only once no helper touches the pool any more, and
    re-raises the first failure of any thread.
    """
    base = region.addr
    bmap = None if len(blocks) == 1 else BlockMap(blocks)
    b0 = blocks[0][0] if blocks else 0
    nbytes, ptrs, plain = d.nbytes, d.ptrs, d.plain

    def physical(dst: int, src: int, n: int) -> list[Move]:
        if bmap is None:
            return [(base + b0 + dst, src, n)]
        out: list[Move] = []
        for phys, m in bmap.map(dst, n):
            out.append((base + phys, src, m))
            src += m
        return out

    leftovers: list[int] = []

    def materialise() -> None:
        for i in leftovers:
            # As in the one-thread path: torch materialises the logical values.
            t = _logical(tensors[i], i).contiguous()
            for dst, src, n in physical(offsets[i], t.data_ptr(), nbytes[i]):
                copy(dst, src, n)

    batch = batch_unit(streams(copy))
    if bmap is None and batch is not None and len(idx) >= MANY_MOVES:
        # Many tensors: spans, moves and units as arrays, one foreign call per unit.
        dst, src, nb = _span_arrays(idx, nbytes, ptrs, plain, offsets, leftovers)
        units = array_units(_move_array(dst, src, nb, base + b0), pack_pool.PACK_CHUNK)
        run_job(PackJob(units, copy, batch), threads, materialise)
        return
    moves: list[Move] = []
    for span_dst, span_src, span_len in _all_spans(idx, nbytes, ptrs, plain, offsets,
                                                   leftovers):
        moves.extend(physical(span_dst, span_src, span_len))
    run_moves(moves, threads, copy, materialise,
              batch if len(moves) >= MANY_MOVES else None)


def _spans(idx: Iterable[int], nbytes: Sequence[int], ptrs: Sequence[int],
           plain: Sequence[bool], offsets: Sequence[int], leftovers: list[int]
           ) -> Iterator[tuple[int, int, int]]:
    """The copies of a pack as ``(packed offset, source address, length)`` spans: runs of
    tensors adjacent both in memory and in the packed space make one span. Tensors whose
    bytes cannot be copied as they lie go to ``leftovers``; empty ones are skipped.
    One rule for the one-thread and the threaded pack (tests/unit/memory/test_pack.py compares)."""
    span_src = span_dst = span_len = 0
    for i in idx:
        n = nbytes[i]
        if n == 0:
            continue
        if not plain[i]:
            leftovers.append(i)
            continue
        src = ptrs[i]
        dst = offsets[i]
        if span_len and src == span_src + span_len and dst == span_dst + span_len:
            span_len += n
            continue
        if span_len:
            yield span_dst, span_src, span_len
        span_src, span_dst, span_len = src, dst, n
    if span_len:
        yield span_dst, span_src, span_len


def _span_arrays(idx: Sequence[int] | None, nbytes: Sequence[int], ptrs: Sequence[int],
                 plain: Sequence[bool], offsets: Sequence[int], leftovers: list[int]
                 ) -> tuple[Any, Any, Any]:
    """:func:`_spans` as three int64 numpy arrays (packed offsets, source addresses,
    lengths), found in one pass over arrays: the same spans in the same order
    (tests/unit/memory/test_pack.py holds it)."""
    import numpy as np

    if isinstance(idx, range) and idx == range(len(nbytes)):
        idx = None  # every tensor, in order: no gather needed
    nb = np.array(nbytes, dtype=np.int64)
    src = np.array(ptrs, dtype=np.int64)
    dst = np.array(offsets, dtype=np.int64)
    ok = np.array(plain, dtype=np.bool_)
    pos = np.arange(len(nb)) if idx is None else np.array(idx, dtype=np.int64)
    if idx is not None:
        nb, src, dst, ok = nb[pos], src[pos], dst[pos], ok[pos]
    some = nb > 0
    leftovers.extend(pos[some & ~ok].tolist())
    keep = some & ok
    nb, src, dst = nb[keep], src[keep], dst[keep]
    if not len(nb):
        return dst, src, nb
    joins = np.zeros(len(nb), dtype=np.bool_)
    ends = nb[:-1]
    joins[1:] = (src[1:] == src[:-1] + ends) & (dst[1:] == dst[:-1] + ends)
    starts = np.flatnonzero(~joins)
    return dst[starts], src[starts], np.add.reduceat(nb, starts)


def _span_lists(idx: Sequence[int] | None, nbytes: Sequence[int], ptrs: Sequence[int],
                plain: Sequence[bool], offsets: Sequence[int], leftovers: list[int]
                ) -> tuple[list[int], list[int], list[int]]:
    """:func:`_span_arrays` as three lists."""
    dst, src, nb = _span_arrays(idx, nbytes, ptrs, plain, offsets, leftovers)
    return dst.tolist(), src.tolist(), nb.tolist()


def _all_spans(idx: Sequence[int] | None, nbytes: Sequence[int], ptrs: Sequence[int],
               plain: Sequence[bool], offsets: Sequence[int], leftovers: list[int]
               ) -> Iterable[tuple[int, int, int]]:
    """The spans of a pack, by :func:`_span_lists` for many tensors, else :func:`_spans`."""
    n = len(nbytes) if idx is None else len(idx)
    if n >= MANY_MOVES:
        return zip(*_span_lists(idx, nbytes, ptrs, plain, offsets, leftovers))
    return _spans(range(len(nbytes)) if idx is None else idx, nbytes, ptrs, plain, offsets,
                  leftovers)


def pack_into(tensors: Sequence[torch.Tensor], d: Described, offsets: Sequence[int],
              blocks: Sequence[tuple[int, int]], region: HostMemory,
              which: Sequence[int] | None = None, *, threads: int = 1,
              threshold: int = _PACK_THRESHOLD, stream_min: int = 0) -> None:
    """Copy each tensor's own bytes to its packed offset in the object's pool blocks.

    ``offsets`` are positions in the object's packed space, which is the concatenation
    of ``blocks`` (physical (offset, length) pairs in ``region``); ``which`` limits the
    copy to some tensors. Runs of tensors adjacent both in memory and in the packed
    space are copied as one span, and every span is one memmove: a torch op per small
    tensor costs more than its copy.

    Stores: a pack into blocks of at least ``stream_min`` bytes in all (0: never) copies
    with streaming stores where the compiled helper exists (:mod:`ray_rdt_pool.memory.fastcopy`).

    Threads: with ``threads`` > 1 and at least ``threshold`` bytes to copy, the calling
    thread and up to ``threads - 1`` daemon helper threads (started on first use, shared
    by the process) copy the spans in units of a few MiB; the call returns once every
    byte is in place and re-raises a helper's failure. Otherwise the calling thread
    copies everything, as below.
    """
    # The blocks' total bounds the bytes to copy from above and costs next to nothing, so
    # small objects pay no per-tensor sum for the threshold test.
    room = blocks[0][1] if len(blocks) == 1 else sum([n for _, n in blocks])
    copy = copy_for(room, stream_min)
    if threads > 1 and room >= threshold and (
            sum(d.nbytes) if which is None else sum([d.nbytes[i] for i in which])) >= threshold:
        _pack_threaded(tensors, d, offsets, blocks, region,
                       range(len(d.nbytes)) if which is None else which, threads, copy)
        return
    base = region.addr
    bmap = None if len(blocks) == 1 else BlockMap(blocks)
    b0 = blocks[0][0] if blocks else 0
    nbytes, ptrs, plain = d.nbytes, d.ptrs, d.plain
    leftovers: list[int] = []

    def move(dst: int, src: int, n: int) -> None:
        if bmap is None:
            copy(base + b0 + dst, src, n)
            return
        for phys, m in bmap.map(dst, n):
            copy(base + phys, src, m)
            src += m

    if bmap is None and (len(nbytes) if which is None else len(which)) >= MANY_MOVES:
        # Thousands of small tensors (an RL batch stored per sample): one foreign call for
        # all the moves instead of a ctypes call per tensor, which costs as much as
        # copying a few KiB.
        dst, src, nb = _span_arrays(which, nbytes, ptrs, plain, offsets, leftovers)
        if run_batch(_move_array(dst, src, nb, base + b0), streams(copy)):
            spans: Iterable[tuple[int, int, int]] = ()
        else:
            spans = zip(dst.tolist(), src.tolist(), nb.tolist())
    else:
        spans = _all_spans(which, nbytes, ptrs, plain, offsets, leftovers)
    if bmap is None:
        at = base + b0
        for span_dst, span_src, span_len in spans:
            copy(at + span_dst, span_src, span_len)
    else:
        for span_dst, span_src, span_len in spans:
            move(span_dst, span_src, span_len)

    for i in leftovers:
        # Strided, conjugated or negated views: let torch materialise the logical
        # values, then move the bytes like any other span.
        t = _logical(tensors[i], i).contiguous()
        move(offsets[i], t.data_ptr(), nbytes[i])


def _logical(t: torch.Tensor, i: int) -> torch.Tensor:
    """Tensor ``i``'s logical values (its lazy conjugate and negative bits applied), or
    InvalidInputError where torch has no kernel for that (a negative view of a dtype it
    cannot negate: bool, unsigned, float8, made with ``torch._neg_view``)."""
    try:
        return t.resolve_conj().resolve_neg()
    except (NotImplementedError, RuntimeError) as e:
        raise InvalidInputError(
            f"tensor {i} ({tuple(t.shape)} {t.dtype}) is a lazy "
            f"{'negative' if t.is_neg() else 'conjugate'} view that torch cannot resolve "
            f"({type(e).__name__}: {e}); send a tensor without that bit") from e


def pack_torch(tensors: Sequence[torch.Tensor], d: Described, offsets: Sequence[int],
               block: torch.Tensor, which: Sequence[int] | None = None, *, threads: int = 1,
               threshold: int = _PACK_THRESHOLD) -> None:
    """Copy tensors into one device block with a single batched torch op.

    Used where memmove cannot reach (CUDA memory) and for tensors converted to another
    dtype on the way (``d.dtypes`` names the packed dtype): ``torch._foreach_copy_``
    issues the copies of all tensors as one operation instead of one ``copy_`` per
    tensor, converting as it copies. Strided sources are fine: torch copies their
    logical values.

    Consecutive tensors that are evenly spaced views of one storage (the rows of a
    matrix, say), landing evenly spaced in the block, are copied as one strided tensor:
    10,000 row views cost one copy, not 10,000 (see :func:`_strided_groups`).

    Threads: on a CPU block with ``threads`` > 1 and at least ``threshold`` bytes to
    write, the copies are cut into pieces of a few MiB along their first dimension and
    run on the calling thread and pack helpers (torch releases the GIL while it copies;
    a dtype conversion runs at a fraction of memcpy speed, so it gains the most).
    """
    import torch

    idx = [i for i in (range(len(tensors)) if which is None else which) if d.nbytes[i]]
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for first, k, src_step, dst_step in _strided_groups(tensors, d, offsets, idx):
        t = tensors[first]
        # The described dtype: it differs from t.dtype when the pack converts (pack_as).
        dt = torch_dtype(d.dtypes[first])
        n = d.nbytes[first]
        o = offsets[first]
        if k == 1:
            dsts.append(block[o:o + n].view(dt).view(t.shape))
            srcs.append(_logical(t, first))
            continue
        item = t.element_size()
        span = block[o:o + dst_step * (k - 1) + n].view(dt)
        dsts.append(span.as_strided((k, *t.shape),
                                    (dst_step // item, *contiguous_strides(tuple(t.shape)))))
        srcs.append(t.as_strided((k, *t.shape), (src_step // item, *t.stride()),
                                 t.storage_offset()))
    if not dsts:
        return
    if threads > 1 and block.device.type == "cpu" and sum(
            t.nbytes for t in dsts) >= threshold:
        _copy_pieces(dsts, srcs, threads)
        return
    with torch.no_grad():  # bytes only: never record autograd history on the pool
        torch._foreach_copy_(dsts, srcs)


def _copy_pieces(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
                 threads: int) -> None:
    """``dst.copy_(src)`` for each pair, cut along dim 0 into pieces of about
    ``PACK_CHUNK`` destination bytes, on up to ``threads`` threads (caller)."""
    import torch

    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in zip(dsts, srcs):
        rows = dst.shape[0] if dst.dim() else 0
        per_row = dst.nbytes // rows if rows else 0
        step = max(1, pack_pool.PACK_CHUNK // per_row) if per_row else 0
        if rows < 2 or step >= rows:
            pieces.append((dst, src))
            continue
        for a in range(0, rows, step):
            pieces.append((dst[a:a + step], src[a:a + step]))

    def copy(unit: Sequence[Move]) -> None:
        with torch.no_grad():  # per thread: grad mode is thread-local
            for i, _, _ in unit:
                dst, src = pieces[i]
                dst.copy_(src)

    run_job(PackJob([[(i, 0, 0)] for i in range(len(pieces))], batch=copy), threads)


def _strided_groups(tensors: Sequence[torch.Tensor], d: Described, offsets: Sequence[int],
                    idx: Sequence[int]) -> Iterator[tuple[int, int, int, int]]:
    """Cut ``idx`` into groups ``(first index, count, source step, block step)``.

    A group of more than one holds consecutive tensors of one storage extent with the same
    shape, strides and dtype (packed as their own dtype, no lazy conjugate or negation),
    whose addresses advance by the same positive step, a multiple of the item size, and
    whose block offsets advance by another: one ``as_strided`` view covers each side.
    Anything else is a group of one.
    """
    i = 0
    while i < len(idx):
        a = idx[i]
        t = tensors[a]
        k = 1
        src_step = dst_step = 0
        if _groupable(t, d, a) and i + 1 < len(idx):
            item = t.element_size()
            storage = None
            while i + k < len(idx):
                b, prev = idx[i + k], idx[i + k - 1]
                u = tensors[b]
                s_step = d.ptrs[b] - d.ptrs[prev]
                o_step = offsets[b] - offsets[prev]
                if k == 1:
                    if s_step <= 0 or s_step % item or o_step <= 0 or o_step % item:
                        break
                    src_step, dst_step = s_step, o_step
                elif s_step != src_step or o_step != dst_step:
                    break
                if (d.shapes[b] != d.shapes[a] or u.dtype != t.dtype
                        or d.dtypes[b] != d.dtypes[a] or u.stride() != t.stride()
                        or not _groupable(u, d, b)):
                    break
                if storage is None:
                    storage = storage_extent(t)
                if storage_extent(u) != storage:
                    break
                k += 1
        yield a, k, src_step, dst_step
        i += k


def _groupable(t: torch.Tensor, d: Described, i: int) -> bool:
    return (dtype_name(t.dtype) == d.dtypes[i] and not t.is_conj() and not t.is_neg()
            and t.numel() > 0)
