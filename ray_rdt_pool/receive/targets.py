"""Target buffers: checking the caller's buffers, and the descriptors that land in them.

Owns nothing: pure functions of the object's metadata and the caller's tensors (torch is
imported lazily). Called by the fetching thread, before anything is reserved, and by the
sender's local copy (``target_descs``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ray_rdt_pool.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

    from ray_rdt_pool.core.codec import WireMeta

__all__ = ["check_targets", "read_pieces", "refuse_overlapping", "target_descs"]


def read_pieces(meta: WireMeta, spans: Sequence[tuple[int, int, int]], ldev: int
                ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(local, remote) descriptors that land packed ranges ``(packed offset, local
    address, length)`` at their local addresses, split where the sender's segments
    split (the wire decoder checked that the segments cover every tensor's bytes)."""
    segments = meta.segments
    starts = [v for v, _a, _n in segments]
    local: list[tuple[int, int, int]] = []
    remote: list[tuple[int, int, int]] = []
    rdev = meta.device_id
    for off, addr, n in spans:
        i = bisect.bisect_right(starts, off) - 1
        pos, end = off, off + n
        while pos < end:
            v, a, m = segments[i]
            take = min(v + m, end) - pos
            local.append((addr + (pos - off), take, ldev))
            remote.append((a + (pos - v), take, rdev))
            pos += take
            i += 1
    return local, remote


def target_descs(targets: Sequence[torch.Tensor], meta: WireMeta
                 ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(local, remote) descriptors ``(address, bytes, device id)`` landing each packed
    tensor of ``meta`` in its contiguous target (one per tensor, in order; empty ones
    take nothing): for a READ, or for a local copy out of the sender's own blocks."""
    spans = [(off, t.data_ptr(), t.numel() * t.element_size())
             for t, off in zip(targets, meta.tensor_offsets()) if t.numel()]
    return read_pieces(meta, spans, targets[0].device.index or 0)


def check_targets(targets: Sequence[torch.Tensor], meta: WireMeta,
                  native: bool = True) -> None:
    """Raise InvalidInputError, naming the first bad buffer and the fix, unless every
    target is a contiguous tensor of its source tensor's shape and dtype, all on one
    device type. ``native``: ``PoolConfig.tuning.native``, passed on to ``describe``."""
    import torch

    from ray_rdt_pool.memory.describe import describe
    from ray_rdt_pool.memory.dtypes import dtype_name

    if len(targets) != meta.num_tensors:
        raise InvalidInputError(
            f"{len(targets)} target buffers for an object of {meta.num_tensors} tensors; "
            "pass one buffer per tensor, in the order they were sent")
    # All at once first, with the sender's one-pass attribute reads (cheap for thousands
    # of per-sample buffers); the walk below names the bad buffer.
    found: InvalidInputError | None = None
    try:
        d = describe(targets, allow_cuda=True, native=native)
    except InvalidInputError as e:
        d, found = None, e  # raised below unless the walk names a more specific fault
    if d is not None and all(d.plain):
        want = list(meta.shapes_dtypes())
        if d.shapes == [s for s, _ in want] and d.dtypes == [dt for _, dt in want]:
            refuse_overlapping(d.ptrs, d.nbytes)
            return
    for i, (t, (shape, dt)) in enumerate(zip(targets, meta.shapes_dtypes())):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(
                f"target buffer {i} is a {type(t).__name__}, not a torch.Tensor; pass "
                "preallocated tensors, one per tensor of the object")
        if tuple(t.shape) != shape or dtype_name(t.dtype) != dt:
            raise InvalidInputError(
                f"target buffer {i} is {tuple(t.shape)} {t.dtype} but the object holds "
                f"{shape} {dt}; allocate it with that shape and dtype")
        if t.is_conj() or t.is_neg():
            raise InvalidInputError(
                f"target buffer {i} is a lazy {'conjugate' if t.is_conj() else 'negative'} "
                "view: the READ writes its storage, whose bytes it shows transformed; pass "
                "a plain tensor (resolve_conj() / resolve_neg() copies)")
        if not t.is_contiguous() or t.device.type != targets[0].device.type:
            raise InvalidInputError(
                f"target buffer {i} must be contiguous and on the same device type as buffer "
                f"0 (is_contiguous={t.is_contiguous()}, device={t.device}); use "
                "torch.empty(...) or .contiguous()")
    if found is not None:
        # A buffer describe() refuses for another reason (one with no memory behind its
        # bytes: a READ into it would write near address 0).
        raise InvalidInputError(f"target buffers: {found}") from found
    refuse_overlapping([t.data_ptr() for t in targets], [t.nbytes for t in targets])


def refuse_overlapping(ptrs: Sequence[int], nbytes: Sequence[int]) -> None:
    """InvalidInputError if two (contiguous) target buffers share bytes: the READs or
    copies into them would overwrite each other, in no fixed order."""
    end = 0
    for p, n in zip(ptrs, nbytes):  # the common case: in address order, one pass
        if n:
            if p < end:
                break
            end = p + n
    else:
        return
    # Targets are on one device type, and CUDA's unified addressing keeps the addresses
    # of every device and the host apart: addresses alone tell.
    spans = sorted((p, p + n, i) for i, (p, n) in enumerate(zip(ptrs, nbytes)) if n)
    for (_s0, e0, i0), (s1, _e1, i1) in itertools.pairwise(spans):
        if s1 < e0:
            a, b = sorted((i0, i1))
            raise InvalidInputError(
                f"target buffers {a} and {b} share memory: the bytes of one would overwrite "
                "the other's. Pass buffers that do not overlap (separate tensors, or "
                "disjoint slices of one)")
