"""Where a tensor's bytes lie: its storage, how far it reaches into it, and whether memory is there.

Owns the address facts that :mod:`~ray_rdt_pool.memory.describe` checks on every put and
the weight sync checks for overlaps: the storage and base address of a tensor, the bytes
a copy of it reads, why a tensor's bytes may have no memory behind them, and the runs of
memory a strided tensor spans. Stateless: every function reads the tensor it is given, on
its caller's thread.
"""

from __future__ import annotations

import math
from typing import Any

from ray_rdt_pool.errors import InvalidInputError

__all__ = ["MAX_SPANNED_RUNS", "NO_MEMORY", "memory_problem", "reach", "runs_meet",
           "spanned_runs", "storage_base", "storage_extent"]

#: Addresses below this are never memory (Linux maps nothing under ``vm.mmap_min_addr``,
#: 64 KiB by default): a tensor whose bytes start there has no storage behind them, and
#: its address is just its storage offset.
NO_MEMORY = 1 << 16


def storage_base(t: Any, i: int) -> tuple[Any, int]:
    """Tensor ``i``'s storage and its address, or InvalidInputError for a tensor subclass
    with no storage of its own (a DTensor of FSDP2 or tensor parallelism, a wrapper
    subclass), whose reads raise torch's untyped RuntimeError."""
    try:
        t.data_ptr()
        storage = t.untyped_storage()
        return storage, storage.data_ptr()
    except RuntimeError as e:
        raise InvalidInputError(
            f"tensor {i} (a {type(t).__name__}) has no memory of its own to send ({e}); "
            "send plain tensors: for a DTensor its local shard (t.to_local()) or the "
            "whole tensor (t.full_tensor())") from e


def reach(t: Any, n: int) -> int:
    """Bytes from ``t``'s first element to the end of its last one (``n`` is its
    ``nbytes``, not 0): what of its storage a copy of ``t`` reads."""
    if t.is_contiguous():
        return n
    last = sum((k - 1) * s for k, s in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def memory_problem(t: Any, n: int | None = None, p: int | None = None) -> str | None:
    """Why the bytes of dense tensor ``t`` (``n`` of them from address ``p``; by default
    its own) have no memory behind them, or None when they have: a ZeroTensor (address
    0), a storage with no memory of its own (a DTensor), a storage resized to 0 bytes
    (the address is then the view's offset, of any size), or a storage shrunk under a
    view that reaches past it. Reading or writing such a tensor touches memory that is
    not its own."""
    n = t.nbytes if n is None else n
    if not n:
        return None
    if t._is_zerotensor():
        return ("is a ZeroTensor (torch._efficientzerotensor, which some autograd formulas "
                f"return for an all-zero result): its {n:,} bytes have no memory behind "
                "them. Use t.clone() instead (real zeros of the same shape)")
    try:
        storage, base = storage_base(t, 0)
    except InvalidInputError as e:
        return f"is a {type(t).__name__} with no memory of its own ({e.__cause__}); use " \
               "plain tensors: for a DTensor its local shard (t.to_local()) or the whole " \
               "tensor (t.full_tensor())"
    p = t.data_ptr() if p is None else p
    if base and base <= p and p + reach(t, n) <= base + storage.nbytes():
        return None
    if base == 0:
        return (f"has {n:,} bytes but its storage holds {storage.nbytes():,} (resized to 0, "
                "as FSDP does to free a parameter's memory); use it while its storage is "
                "allocated, or a copy made then")
    return (f"reaches byte {p - base + reach(t, n):,} of its storage, which holds only "
            f"{storage.nbytes():,} (the storage was resized under the view); use it while "
            "its storage holds the view, or a copy made then")


#: The most runs :func:`spanned_runs` lists for one tensor (32 MiB of run starts).
MAX_SPANNED_RUNS = 1 << 22


def spanned_runs(t: Any) -> tuple[Any, int] | None:
    """The bytes dense tensor ``t`` covers, as ``(starts, length)``: a sorted int64 tensor
    of run start addresses, each run ``length`` bytes long; None when that takes more
    than :data:`MAX_SPANNED_RUNS` runs. Dimensions that tile memory densely merge into one
    run, so a contiguous tensor or a transpose of one is a single run and a column slice
    of a matrix is one run per row."""
    import torch

    item = t.element_size()
    dims = sorted((st * item, k) for k, st in zip(t.shape, t.stride()) if k > 1)
    length = item
    while dims and dims[0][0] == length:
        length *= dims.pop(0)[1]
    count = math.prod(k for _st, k in dims)
    if count > MAX_SPANNED_RUNS:
        return None
    starts = torch.tensor([t.data_ptr()], dtype=torch.int64)
    for st, k in dims:
        starts = (starts[:, None] + torch.arange(k, dtype=torch.int64) * st).reshape(-1)
    return starts.sort().values, length


def runs_meet(a: tuple[Any, int], b: tuple[Any, int]) -> bool:
    """Whether two :func:`spanned_runs` results share a byte. Runs of one tensor have one
    length, so for each run of ``b`` the run of ``a`` starting last before it ends is the
    one of ``a`` that reaches furthest into it."""
    import torch

    (sa, la), (sb, lb) = a, b
    i = torch.searchsorted(sa, sb + lb) - 1
    hit = i >= 0
    return bool((sa[i[hit]] + la > sb[hit]).any())


def storage_extent(t: Any) -> tuple[int, int]:
    """Where ``t``'s storage lies: its base address and size. Two storage objects can
    share a base address and differ in size (``torch.from_numpy`` of an array and of a
    slice of it), and an ``as_strided`` view over the smaller one cannot reach the
    other's tensors; storages of one extent are the same bytes, whatever object holds
    them."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()
