"""``pack_as``: the dtypes this thread's puts pack tensors as.

Owns the per-thread state of a ``pack_as`` block: the mapping the block was given, and
the notes the serializer hooks in :mod:`ray_rdt_pool._ray.patches` make of Parameters
while a value is serialized (read and cleared by the put that follows).

Lifetime: a block's state lives for the ``with`` block; the notes of one put live from
its serialization to its extract. Threads: each thread has its own state (the thread
that calls ``ray.put`` or returns from a method); nothing is shared.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

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
    from ray_rdt_pool._ray.patches import parameters_seen_through  # patches imports us

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
