"""CUDA pools shared on one node: a sender's CUDA IPC export of its pool, and a
receiver's opening of it.

:class:`CudaExport` is published inside the sender's :class:`~.info.HostInfo` and lives
with it. A :class:`CudaMapping` is made and held by a receiver's
:class:`~.pool_handle.MappedPool` (one per sender, via torch's IPC cache) and goes with that
handle's last lease. The receiver copies each object out of it, device to device, under
a lease held only for the copy: IPC memory cannot be mapped copy-on-write, so views of it
would not be private. Called under the receiver's lock; torch is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray_rdt_pool.errors import WireFormatError
from ray_rdt_pool.same_node._libc import PAGE

__all__ = ["CudaExport", "CudaMapping", "NotVisibleError", "export_cuda_pool"]


@dataclass(frozen=True)
class CudaExport:
    """How a same-node receiver opens a sender's CUDA pool through CUDA IPC.

    The fields are those of torch's IPC export of the pool's storage (``_share_cuda_``):
    the allocation's IPC handle, the pool's size and offset inside it, torch's shared
    reference counter (which keeps the sender's allocation alive while a receiver has it
    open) and the event the opener waits on. ``uuid`` names the physical GPU, since each
    process numbers only the GPUs it sees.
    """

    uuid: str
    handle: bytes
    size: int
    offset: int
    ref_handle: bytes
    ref_offset: int
    event_handle: bytes
    event_sync: bool

    def items(self) -> list[Any]:
        return [self.uuid, self.handle, self.size, self.offset, self.ref_handle,
                self.ref_offset, self.event_handle, self.event_sync]

    @staticmethod
    def parse(items: Any) -> CudaExport:
        if not isinstance(items, list) or len(items) != 8:
            raise WireFormatError("same-node CUDA entry must be a list of 8 items")
        uuid, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = items
        if not isinstance(uuid, str) or not 0 < len(uuid) <= 128:
            raise WireFormatError("same-node CUDA entry has no valid GPU uuid")
        for b in (handle, ref_handle, event_handle):
            if not isinstance(b, bytes) or len(b) > 1024:
                raise WireFormatError("same-node CUDA entry handles must be bytes (<= 1 KiB)")
        if not handle:
            raise WireFormatError("same-node CUDA entry has an empty IPC handle")
        for x in (size, offset, ref_offset):
            if type(x) is not int or not 0 <= x < 1 << 63:
                raise WireFormatError("same-node CUDA entry sizes must be non-negative ints")
        if type(event_sync) is not bool:
            raise WireFormatError("same-node CUDA entry event flag must be a bool")
        return CudaExport(uuid, handle, size, offset, ref_handle, ref_offset, event_handle,
                          event_sync)


def export_cuda_pool(tensor: Any) -> CudaExport:
    """The CUDA IPC export of a sender's pool tensor (it must start its storage).

    Raises OSError (the caller falls back to NIXL for same-node receivers) where torch
    cannot export it, e.g. memory from another allocator."""
    import torch

    if tensor.storage_offset() != 0 or tensor.data_ptr() % PAGE:
        # Receivers find the pool at the start of the storage they open, in pages.
        raise OSError("the CUDA pool does not start a page-aligned storage")
    storage = tensor.untyped_storage()
    try:
        dev, handle, size, offset, ref_handle, ref_offset, ev, ev_sync = (
            storage._share_cuda_())
        uuid = str(torch.cuda.get_device_properties(int(dev)).uuid)
    except Exception as e:  # torch raises RuntimeError/TypeError of its own kinds
        raise OSError(f"CUDA IPC export of the pool failed: {e}") from e
    return CudaExport(uuid, bytes(handle), int(size), int(offset), bytes(ref_handle or b""),
                      int(ref_offset or 0), bytes(ev or b""), bool(ev_sync))


class CudaMapping:
    """A receiver's opening of a sender's CUDA pool (one per sender, via torch's IPC
    cache): the storage and the pool's device address in this process."""

    def __init__(self, cuda: CudaExport, pool_bytes: int) -> None:
        import torch

        index = _visible_index(cuda.uuid)
        if index is None:
            raise NotVisibleError("the sender's GPU is not visible in this process")
        if index != torch.cuda.current_device():
            raise NotVisibleError(f"the sender's GPU is cuda:{index}, this process lands "
                              f"objects on cuda:{torch.cuda.current_device()}")
        try:
            self.storage = torch.UntypedStorage._new_shared_cuda(
                index, cuda.handle, cuda.size, cuda.offset, cuda.ref_handle,
                cuda.ref_offset, cuda.event_handle, cuda.event_sync)
        except Exception as e:
            raise OSError(f"opening the sender's CUDA pool failed: {e}") from e
        if self.storage.nbytes() < pool_bytes:
            raise OSError("the sender's CUDA pool is smaller than published")
        self.index = index
        self.base = int(self.storage.data_ptr())


class NotVisibleError(OSError):
    """The sender's GPU is not this process's landing GPU: NIXL reads its objects."""


def _visible_index(uuid: str) -> int | None:
    import torch

    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None

