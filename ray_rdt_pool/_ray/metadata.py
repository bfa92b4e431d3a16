"""What Ray carries for one object of this transport.

Owns :class:`PoolTransportMetadata` (the per-object metadata Ray pickles from the sender
to the owner and the receivers), its lazy ``tensor_meta`` list, and :class:`PoolFetch`
(what Ray holds between starting a READ and waiting for it).

Lifetime: a metadata object lives as long as Ray keeps it (with the ref); it decodes its
wire bytes at most once per process. A PoolFetch lives from ``fetch_multiple_tensors``
until ``wait_fetch_complete`` or until Ray drops it. Threads: any thread that serializes
or receives an object (task thread, ``_ray_system``, the caller of ``ray.get``); nothing
here is shared between threads except the decoded wire, which is immutable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.experimental.rdt.tensor_transport_manager import (
    FetchRequest,
    TensorTransportMetadata,
)

from ray_rdt_pool.core.codec import WireMeta, decode
from ray_rdt_pool.errors import InvalidInputError, TransferError
from ray_rdt_pool.receive.receiver import Fetch, Receiver


class LazyTensorMeta(Sequence[Any]):
    """Ray's ``tensor_meta`` list, materialised from the wire bytes only when used.

    Ray calls ``len()`` on it for every receive and indexes it only to validate target
    buffers, so ten thousand ``(torch.Size, dtype)`` pairs are never pickled, and a
    corrupted message surfaces as WireFormatError where the receiver first reads it.
    """

    __slots__ = ("_items", "_owner")

    def __init__(self, owner: PoolTransportMetadata) -> None:
        self._owner = owner
        self._items: list[tuple[Any, Any]] | None = None  # built on first index

    def __len__(self) -> int:
        return self._owner.decoded().num_tensors

    def _materialise(self) -> list[tuple[Any, Any]]:
        if self._items is None:
            import torch

            from ray_rdt_pool.memory.dtypes import torch_dtype

            meta = self._owner.decoded()
            # One (Size, dtype) pair per run of a pattern, replicated per tensor: an
            # object of thousands of same-shaped tensors costs no torch call per tensor.
            self._items = meta.map_tensors(
                lambda run: (torch.Size(run.shape), torch_dtype(run.dtype)))
        return self._items

    def __getitem__(self, i: Any) -> Any:
        return self._materialise()[i]


def _meta_from_wire(wire: bytes | None, device: str | None) -> PoolTransportMetadata:
    return PoolTransportMetadata(tensor_meta=[], tensor_device=device, wire=wire)


@dataclass(eq=False)
class PoolTransportMetadata(TensorTransportMetadata):
    """Per-object metadata: the versioned wire bytes and nothing else.

    Pickles as ``(wire, device)``; ``tensor_meta`` is rebuilt lazily from the wire.
    """

    wire: bytes | None = None  # None: an object with no tensors
    _decoded: WireMeta | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.wire is not None and not self.tensor_meta:
            self.tensor_meta = LazyTensorMeta(self)  # type: ignore[assignment]

    def decoded(self) -> WireMeta:
        """The validated wire metadata (decoded once per process)."""
        if self._decoded is None:
            if self.wire is None:
                raise TransferError("object metadata carries no wire bytes")
            self._decoded = decode(self.wire)
        return self._decoded

    def __reduce__(self) -> tuple[Any, ...]:
        return (_meta_from_wire, (self.wire, self.tensor_device))


def as_pool_meta(meta: Any) -> PoolTransportMetadata:
    """``meta`` if it is this transport's metadata; InvalidInputError otherwise."""
    if not isinstance(meta, PoolTransportMetadata):
        raise InvalidInputError(
            f"nixl_pool received metadata of type {type(meta).__name__}; the object was "
            "produced by another transport")
    return meta


@dataclass
class PoolFetch(FetchRequest):
    """What Ray holds between ``fetch_multiple_tensors`` and ``wait_fetch_complete``.

    If Ray drops it without waiting (another ref of the same ``ray.get`` failed, or the
    caller's deadline passed first), ``__del__`` hands the READ to the receiver, which
    returns its memory only once NIXL has ended the READ.
    """

    inner: Fetch | None = None  # None: an object with no tensors, nothing read
    receiver: Receiver | None = field(default=None, repr=False)

    def __del__(self) -> None:
        f, r = self.inner, self.receiver
        if f is not None and r is not None and not f.settled and f.transfer is not None:
            try:
                r.dropped(f.transfer)
            except Exception:
                pass
