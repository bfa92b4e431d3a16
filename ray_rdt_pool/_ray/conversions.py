"""``pack_as``: the dtypes this thread's puts pack tensors as.

Owns the per-thread state of a ``pack_as`` block: the mapping the block was given, and
the notes made of Parameters while a value is serialized (read and cleared by the put
that follows), by the Parameter reducer below and the serializer changes in
:mod:`ray_rdt_pool._ray.patches`. The reducer is the one change to Ray's pickling that
lives outside ``patches``: it belongs to the state it writes, and ``patches`` reads it.

Lifetime: a block's state lives for the ``with`` block; the notes of one put live from
its serialization to its extract. Threads: each thread has its own state (the thread
that calls ``ray.put`` or returns from a method); nothing is shared.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

#: Per thread: ``dtypes``, the block's mapping (None outside a block); ``aliases``, for
#: the value being serialized, id of the tensor Ray lists for a mapped Parameter -> dtype
#: (None when no notes are being made).
state = threading.local()


@contextmanager
def pack_as(dtypes: Mapping[int, torch.dtype]) -> Iterator[None]:
    """Within the block, puts on this thread pack tensor ``t`` as ``dtypes[id(t)]``.

    The conversion is the pack copy itself (no separate cast), and the object's metadata
    names the new dtype, so receivers get tensors of that dtype: for example fp32 master
    weights sent as bf16, half the bytes on the wire. Tensors not in the mapping are
    packed as they are; an ``nn.Parameter`` is matched by its own ``id`` and arrives as
    a Parameter of the new dtype. Blocks do not nest.
    """
    if getattr(state, "dtypes", None) is not None:
        raise InvalidInputError("pack_as() blocks do not nest; merge the mappings instead")
    parameters_seen_through()
    state.dtypes = dtypes
    state.aliases = None
    try:
        yield
    finally:
        state.dtypes = None
        state.aliases = None


def put_conversions() -> Mapping[int, torch.dtype] | None:
    """The dtypes of this thread's pack_as block for the put Ray is making now,
    Parameters' listed tensors included; None outside a block."""
    dtypes = getattr(state, "dtypes", None)
    if dtypes is None:
        return None
    aliases = state.aliases
    state.aliases = None
    return {**dtypes, **aliases} if aliases else dtypes


# ---------------------------------------------------------------------------------------
# The nn.Parameter reducer that pack_as needs
# ---------------------------------------------------------------------------------------
# Not a change to Ray's code but to its pickler's dispatch table (Ray 2.60's
# ``ray.cloudpickle``). Why: a Parameter reduces through ``Parameter.__reduce_ex__`` to a
# new tensor over ``p.data``, which is the tensor Ray lists for the object, so a pack_as
# mapping keyed by ``id(p)`` would never match it. While a pack_as block serializes a
# value of this transport, this reducer notes the dtype each mapped Parameter's listed
# tensor is to be packed as; outside such a block it is ``Parameter.__reduce_ex__``.
# Upstream issue: none (torch's reduction, not a Ray defect). Can go: when Ray hands the
# transport the objects the user put rather than the tensors pickle made of them.


def _reduce_parameter(p: Any) -> Any:
    red = p.__reduce_ex__(5)
    aliases = getattr(state, "aliases", None)
    if aliases is not None:
        dt = state.dtypes.get(id(p))
        if dt is not None and type(red) is tuple and len(red) > 1 and red[1]:
            aliases[id(red[1][0])] = dt
    return red


def parameters_seen_through() -> None:
    """Install :func:`_reduce_parameter` for ``nn.Parameter`` in Ray's pickler, once,
    unless a reducer of someone else's is there."""
    import torch
    from ray import cloudpickle

    dispatch = cloudpickle.CloudPickler.dispatch
    if dispatch.get(torch.nn.Parameter) is None:
        dispatch[torch.nn.Parameter] = _reduce_parameter
