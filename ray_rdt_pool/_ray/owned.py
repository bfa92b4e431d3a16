"""Pool objects outside Ray's object model, for the weights API's stream.

Owns nothing of its own: these functions put, free and fetch *owned* objects (pool
objects that never become Ray objects, whose wire bytes the caller hands to receivers
itself), read part of a Ray object (:func:`fetch_selected`), and pass same-node direct
reads through to the receiver. The state stays in the process's runtime.

Lifetime: an owned object lives from :func:`put_owned` until :func:`free_owned` (Ray's
``garbage_collect`` never runs for it). Threads: the caller's (the weights API's sender
and receiver threads, or an actor's task thread).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ray_rdt_pool._ray.directory import ray_node_id
from ray_rdt_pool._ray.metadata import PoolTransportMetadata, as_pool_meta
from ray_rdt_pool._ray.patches import lookup_rdt_object
from ray_rdt_pool._ray.runtime import current, runtime
from ray_rdt_pool.core.selection import check_selection_count, selection_bounds
from ray_rdt_pool.errors import InvalidInputError

if TYPE_CHECKING:
    import ray
    import torch

    from ray_rdt_pool.same_node.peer_memory import SourceProcess


def put_owned(obj_id: str, tensors: Sequence[torch.Tensor],
              convert: Mapping[int, torch.dtype] | None = None, *,
              by_reference: bool = False) -> tuple[bytes, str]:
    """Put ``tensors`` as pool object ``obj_id`` and return its wire bytes and device
    type, with no Ray object behind it: the caller hands the wire bytes to the receivers
    itself and must call :func:`free_owned` once no receiver will read it any more
    (Ray's ``garbage_collect`` never runs for it). ``obj_id`` must not clash with a Ray
    object ID (the weights stream prefixes ``ws:``).

    By default a snapshot into the pool, with the same packing, placement and lease rules
    as ``ray.put``; ``convert`` as for :func:`pack_as`. ``by_reference=True``: no copy,
    receivers READ the tensors where they lie (their storages registered through the
    storage cache, a use held until :func:`free_owned`); not a snapshot, so the caller
    keeps them unchanged until every receiver has read them.
    """
    if not tensors:
        raise InvalidInputError("put_owned() needs at least one tensor")
    rt = runtime()
    rt.sending()
    if by_reference:
        _meta, wire = rt.sender.put_by_reference(obj_id, tensors)
    else:
        _meta, wire = rt.sender.put(obj_id, tensors, convert)
    return wire, tensors[0].device.type


def forget_registrations(keys: Iterable[Any]) -> int:
    """Deregister the storage-cache entries of these storage keys (``registry.storage_key``)
    that nothing uses or pins now; see ``Registry.forget``. Creates nothing."""
    rt = current()
    return 0 if rt is None else rt.registry.forget(keys)


def free_owned(obj_id: str) -> bool:
    """Return an object of :func:`put_owned` (at once, or when the last same-node lease
    on it drops). False if it is unknown (already freed)."""
    return runtime().sender.free(obj_id)


def fetch_owned(obj_id: str, wire: bytes, device: str | None,
                targets: Sequence[torch.Tensor] | None = None,
                selection: Sequence[Any] | None = None,
                timeout_s: float | None = None) -> list[torch.Tensor]:
    """Receiver side of :func:`put_owned`: decode (and validate) ``wire``, then map,
    READ or copy the object exactly as a ``ray.get`` of a ``nixl_pool`` object would,
    into ``targets`` when given, or only ``selection`` (see :func:`fetch_selected`).
    Blocks until the bytes are in place; raises what a fetch raises."""
    rt = runtime()
    pmeta = PoolTransportMetadata(tensor_meta=[], tensor_device=device, wire=wire)
    if selection is not None:
        return rt.fetch_selected(obj_id, pmeta, selection, timeout_s)
    return rt.wait(rt.fetch(obj_id, pmeta, targets), timeout_s)


def fetch_selected(ref: ray.ObjectRef[Any], selection: Sequence[tuple[slice, ...] | None],
                   timeout_s: float | None = None) -> list[torch.Tensor]:
    """READ only part of each tensor of a ``nixl_pool`` object this process holds a ref to.

    ``selection[i]`` is a tuple of slices (step 1) applied to tensor ``i``, or None for
    the whole tensor; an empty slice on dim 0 skips a tensor. Only the selected bytes
    are read: a dim-0 slice is one contiguous range, slices of later dims become one
    range per row, merged where they touch. Returns, per tensor, a contiguous tensor of
    the selected shape; they are views of one receive block, which returns when the last
    of them dies. ``stats().bytes_received`` grows by the selected bytes only. Unlike
    ``ray.get``, this bypasses Ray's check of target buffers against the full shapes.

    Raises ``InvalidInputError`` for a selection that does not fit the object (before
    anything is read), and what a fetch raises otherwise.
    """
    obj_id = ref.hex()
    wait = timeout_s if timeout_s is not None else 60.0
    found = lookup_rdt_object(obj_id, wait)
    if found is None:
        raise InvalidInputError(f"{ref} is not an RDT object this process knows; pass a ref "
                                "made with _tensor_transport='nixl_pool'")
    held, tmeta = found
    if held is not None:  # this process holds the object itself: no READ
        check_selection_count(selection, len(held))
        # The same checks as a READ's (a step, too many slices: refused, not indexed).
        return [t[tuple(slice(a, b) for a, b in
                        selection_bounds(i, tuple(t.shape), sel))].contiguous()
                for i, (t, sel) in enumerate(zip(held, selection))]
    if tmeta is None:
        raise TimeoutError(f"the metadata of {ref} did not arrive within {wait}s")
    return runtime().fetch_selected(obj_id, as_pool_meta(tmeta), selection, timeout_s)


def source_process() -> SourceProcess | None:
    """This process as a source of direct reads by same-node receivers (the weights
    API's stream), or None outside a Ray worker or driver, or where ``same_node`` is
    ``"off"``."""
    from ray_rdt_pool.same_node.peer_memory import this_process

    node = ray_node_id()
    if node is None or runtime().config.same_node == "off":
        return None
    return this_process(node)


def can_read_source(src: SourceProcess) -> bool:
    """Receiver side of :func:`source_process`: see
    :meth:`~ray_rdt_pool.receive.source.SourceReader.can_read`."""
    return runtime().receiver.sources.can_read(src)


def read_source(src: SourceProcess, tensors: Sequence[tuple[int, tuple[int, ...], str]],
                selection: Sequence[Any] | None = None,
                targets: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Copy tensors out of a same-node source process, in this process's runtime: see
    :meth:`~ray_rdt_pool.receive.source.SourceReader.read`."""
    rt = runtime()
    rt.admit()
    return rt.receiver.sources.read(src, tensors, selection, targets)

