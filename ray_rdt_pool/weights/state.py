"""What the weights API takes in: a named state, its tensors and the options' types.

Owns the type aliases of the API (a state, a lazy source, a loader, a name map, a wire
dtype, a selection), :func:`named_tensors` and the checks every sent or written tensor
passes (:func:`check_weight`), and tensor identity (:func:`identity_key`: ties;
:func:`memory_key`: every fact a check reads, to tell that nothing changed).
Stateless: plain functions, called from the sender's and the receiver's threads alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch

from ray_rdt_pool.errors import InvalidInputError

Casting = Literal["no", "same_kind", "unsafe"]
StateLike = torch.nn.Module | Mapping[str, torch.Tensor]
#: ``(name, tensor)`` pairs, e.g. ``model.named_parameters()`` or a generator.
Pairs = Iterable[tuple[str, torch.Tensor]]
SourceLike = StateLike | Pairs
Source = SourceLike | Callable[[], SourceLike]
#: What ``load_weights`` receives: ``(name, tensor)`` pairs valid during the call only.
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
NameMap = Mapping[str, str | None] | Callable[[str], str | None] | None
#: ``WeightSender(wire_dtype=)``: one dtype for every floating-point tensor, or
#: ``(name, tensor) -> dtype | None`` per tensor (``None``: send as it is).
WireDtype = torch.dtype | Callable[[str, torch.Tensor], torch.dtype | None] | None
#: ``WeightReceiver(select=)``: ``(name, full_shape) -> slices | None`` (``None``: all of it).
Select = Callable[[str, tuple[int, ...]], Sequence[slice] | slice | None]


def named_tensors(state: StateLike, what: str | None = "weight"
                  ) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a state, in order, each checked with
    :func:`check_weight` (``what`` names the tensors in its errors; None: not checked).

    For an ``nn.Module`` these are ``state_dict(keep_vars=True)``: parameters and
    persistent buffers, under every name a tied tensor has, as the module's own
    objects (not detached copies), so a receiver writes into its live parameters.
    """
    if isinstance(state, torch.nn.Module):
        items = list(state.state_dict(keep_vars=True).items())
    elif isinstance(state, Mapping):
        items = list(state.items())
    else:
        raise InvalidInputError(
            f"a weight state is an nn.Module or a Mapping[str, Tensor], got "
            f"{type(state).__name__}")
    for name, t in items:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise InvalidInputError(
                f"weight state entry {name!r} is {type(t).__name__}; every entry must map a "
                "str name to a torch.Tensor")
        if what is not None:
            check_weight(name, t, what)
    return items


def check_weight(name: str, t: torch.Tensor, what: str) -> None:
    """InvalidInputError unless ``t`` is a dense CPU or CUDA tensor whose bytes have
    memory behind them (not on the meta device, a ZeroTensor, a DTensor, or a storage
    resized or shrunk under it), and, as a destination, one whose elements each have
    bytes of their own. Anything else is read or written out of bounds, or not at all."""
    from ray_rdt_pool.memory.extent import memory_problem

    desc = f"{what} {name!r} ({tuple(t.shape)} {t.dtype})"
    if t.is_nested or t.layout is not torch.strided:
        raise InvalidInputError(f"{desc} has layout {t.layout}; only dense (strided) "
                                "tensors are synced: convert with t.to_dense()")
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidInputError(
            f"{desc} is on the {t.device.type} device, which holds no bytes to "
            f"{'write' if what != 'weight' else 'send'}; materialize it on cpu or cuda "
            "first (for a module built on meta: module.to_empty(device=...))")
    why = memory_problem(t)
    if why is not None:
        raise InvalidInputError(f"{desc} {why}")
    if what != "weight" and t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:
        raise InvalidInputError(
            f"{desc} has elements that share memory (strides {t.stride()}, an expanded "
            "view): a load would write several weights into one place. Load into a "
            "tensor with memory of its own (t.contiguous()) and expand that")


def identity_key(t: torch.Tensor) -> tuple[Any, ...]:
    # The lazy conjugate and negative bits are part of what a tensor reads as: c.conj()
    # shares c's memory but is another tensor.
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype, t.device, t.is_conj(), t.is_neg())


def memory_key(items: Sequence[tuple[str, torch.Tensor]]) -> tuple[Any, ...] | None:
    """Every fact of named tensors that a layout, a check or a plan reads (name, kind,
    where the bytes lie and how far the storage reaches, shape, strides, dtype, device,
    lazy bits), without the tensors themselves; None where a fact cannot be read (the
    full check then runs and raises its own error). Equal keys give the same layout and
    the same check result."""
    try:
        out = []
        for name, t in items:
            s = t.untyped_storage()
            out.append((name, type(t), t.layout, t.is_nested, t._is_zerotensor(),
                        s.data_ptr(), s.nbytes(), t.storage_offset(), t.shape, t.stride(),
                        t.dtype, t.device, t.is_conj(), t.is_neg()))
        return tuple(out)
    except Exception:
        return None


def check_flag(name: str, value: Any) -> None:
    """A bool option, or InvalidInputError: a string such as "no" is truthy."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {value!r}")


def check_shard(shard: Any) -> tuple[int, int] | None:
    """``WeightSender(shard=)`` as ``(rank, world)``, or InvalidInputError."""
    if shard is None:
        return None
    ok = (isinstance(shard, (tuple, list)) and len(shard) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) for x in shard)
          and 0 <= shard[0] < shard[1])
    if not ok:
        raise InvalidInputError(f"shard must be (rank, world) with 0 <= rank < world, got "
                                f"{shard!r}; e.g. shard=(dist.get_rank(), "
                                "dist.get_world_size())")
    return int(shard[0]), int(shard[1])
