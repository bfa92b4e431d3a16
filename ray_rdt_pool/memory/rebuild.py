"""The receive side of the layout: an object's tensors rebuilt as views of its block, or copied out.

Owns :func:`rebuild` (views of one contiguous block: they keep the block, and so its
lease or arena bytes, alive until the last view dies), :func:`unpack_into` (copies into
the caller's target tensors, finished before it returns) and :func:`copy_bytes` (moves
within one device's memory). Stateless: every function runs on its caller's thread (the
receiver's fetch or wait).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.runs import RunGroup, Runs, TensorRun
from ray_rdt_pool.memory.blocks import device_block
from ray_rdt_pool.memory.dtypes import empty_tensor, torch_dtype
from ray_rdt_pool.memory.fastcopy import host_moves

if TYPE_CHECKING:
    import torch

__all__ = ["contiguous_strides", "copy_bytes", "empty_like_run_list", "rebuild",
           "unpack_into"]

_IS_CPU = operator.attrgetter("is_cpu")
_NBYTES = operator.attrgetter("nbytes")


def rebuild(block: torch.Tensor, runs: Sequence[TensorRun],
            starts: Sequence[int]) -> list[torch.Tensor]:
    """Rebuild the tensors of an object as views of one contiguous uint8 block.

    ``starts`` are the packed offsets of the runs' first tensors (``meta.run_starts()``).
    Each run of equal (shape, dtype) tensors becomes one reshape and one ``unbind``, so
    thousands of row views cost a few torch calls, not one per tensor. When ``runs`` is a
    :class:`~ray_rdt_pool.core.runs.Runs` (what the decoder returns), a repeated group costs a
    few torch calls too, however many repetitions it has: see :func:`_rebuild_group`.
    """
    out: list[torch.Tensor] = []
    if not isinstance(runs, Runs):
        for run, start in zip(runs, starts):
            _rebuild_run(block, run, start, out)
        return out
    at = 0  # index in `starts` of the group's first run
    for g, placed in zip(runs.groups, runs.layout()[0]):
        # The layout is the one run_starts() came from; `starts` only places it, so a
        # caller may pass offsets shifted as a whole.
        shift = starts[at] - placed.first[0]
        for piece_starts, stride, reps in placed.pieces(g.repeat):
            piece = [s + shift for s in piece_starts]
            if reps == 1:
                for run, start in zip(g.runs, piece):
                    _rebuild_run(block, run, start, out)
            else:
                _rebuild_group(block, g, piece, stride, reps, out)
        at += len(g.runs) * g.repeat
    return out


def _rebuild_run(block: torch.Tensor, run: TensorRun, start: int,
                 out: list[torch.Tensor]) -> None:
    dt = torch_dtype(run.dtype)
    each = run.nbytes_each
    if run.count == 1:
        out.append(block[start:start + each].view(dt).view(run.shape))
        return
    flat = block[start:start + each * run.count].view(dt)
    if each or _stack_fits(run.count, run.shape):
        out.extend(flat.view((run.count, *run.shape)).unbind(0))
    else:
        # Empty tensors whose other dims make the stack (count, *shape) overflow the
        # 64-bit counts torch keeps (``(2**60, 0)`` sixteen times: each tensor is
        # valid, their stack is not): one view each. With bytes, the stack is never
        # larger than the block.
        out.extend(flat.view(run.shape) for _ in range(run.count))


#: torch keeps element counts and strides in signed 64-bit integers.
_I64_LIMIT = 1 << 63


def _stack_fits(lead: int, shape: tuple[int, ...]) -> bool:
    """Whether torch can make a ``(lead, *shape)`` tensor: its element count, and its
    strides, are at most ``lead`` times the product of the nonzero dims."""
    n = lead
    for d in shape:
        if d:
            n *= d
    return n < _I64_LIMIT


def _rebuild_group(block: torch.Tensor, g: RunGroup, starts: Sequence[int], stride: int,
                   rep: int, out: list[torch.Tensor]) -> None:
    """The tensors of ``rep`` uniform repetitions of a group, a few torch calls per run.

    Tensor ``q`` of a run in every repetition (a *field* of the pattern) is a regular
    strided array of the block: one ``as_strided`` view of shape ``(rep, *shape)``
    and one ``unbind``. A run with more tensors than the group has repetitions is cut
    per repetition instead (one reshape and one ``unbind`` each), whichever is fewer
    calls. The results go to their places in the output with slice assignments, so no
    Python step runs per tensor.
    """
    per_rep = g.tensors_per_repeat
    res: list[Any] = [None] * (per_rep * rep)
    col = 0
    for run, s in zip(g.runs, starts):
        dt = torch_dtype(run.dtype)
        n = run.nbytes_each
        c = run.count
        if not n and not _stack_fits(max(c, rep), run.shape):
            # Empty tensors too large to stack (see _rebuild_run): one view each.
            empty = block[s:s].view(dt)
            for k in range(rep):
                at = k * per_rep + col
                res[at:at + c] = [empty.view(run.shape) for _ in range(c)]
        elif c <= rep:
            # A typed view over every repetition of the run; its storage offset is in
            # elements of dt (the layout keeps s and the stride multiples of the itemsize).
            typed = block[s:s + (rep - 1) * stride + c * n].view(dt)
            numel = run.numel
            size = (rep, *run.shape)
            strides = (stride // run.itemsize, *contiguous_strides(run.shape))
            base = typed.storage_offset()
            for q in range(c):
                res[col + q::per_rep] = typed.as_strided(size, strides, base + q * numel).unbind(0)
        else:
            shape = (c, *run.shape)
            for k in range(rep):
                b = s + k * stride
                at = k * per_rep + col
                res[at:at + c] = block[b:b + c * n].view(dt).view(shape).unbind(0)
        col += c
    out.extend(res)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-contiguous strides in elements, as torch computes them (a 0 dim counts as 1)."""
    strides: list[int] = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def unpack_into(targets: Sequence[torch.Tensor], offsets: Sequence[int], base: int,
                total: int, device: str, device_id: int, stream_min: int = 0) -> None:
    """Copy each tensor of a received object from its block at ``base`` into ``targets``.

    Host to host is one copy per tensor (streaming stores from ``stream_min`` bytes in
    all, as :func:`~ray_rdt_pool.memory.pack.pack_into`); anything involving CUDA goes
    through torch views of the block and is finished before returning.
    """
    if device == "cpu" and all(map(_IS_CPU, targets)):
        import torch

        host_moves(list(zip(map(torch.Tensor.data_ptr, targets), [base + o for o in offsets],
                            map(_NBYTES, targets))), total, stream_min)
        return
    import torch

    block = device_block(base, total, device, device_id, None)
    with torch.no_grad():  # a requires_grad Parameter is a fine target
        for t, off in zip(targets, offsets):
            n = t.numel() * t.element_size()
            if n:
                t.copy_(block[off:off + n].view(t.dtype).view(t.shape))
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bytes(moves: Sequence[tuple[int, int, int]], device: str, device_id: int,
               stream_min: int = 0) -> None:
    """Copy ``(destination, source, bytes)`` ranges within one device's memory, finished
    before returning: on the host one copy per range (streaming stores from
    ``stream_min`` bytes in all, as :func:`~ray_rdt_pool.memory.pack.pack_into`), torch
    copies on this thread's stream (then synchronised) on CUDA."""
    if device == "cpu":
        host_moves(moves, sum([n for _d, _s, n in moves]), stream_min)
        return
    import torch

    for dst, src, n in moves:
        if n:
            device_block(dst, n, device, device_id, None).copy_(
                device_block(src, n, device, device_id, None))
    torch.cuda.current_stream(device_id).synchronize()


def empty_like_run_list(runs: Sequence[TensorRun], device: str = "cpu") -> list[torch.Tensor]:
    """Fresh tensors matching the runs (used when an object has no bytes to read)."""
    out: list[torch.Tensor] = []
    for run in runs:
        dt = torch_dtype(run.dtype)
        out.extend(empty_tensor(run.shape, dt, device) for _ in range(run.count))
    return out
