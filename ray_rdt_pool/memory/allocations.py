"""The memory a pool or receive arena lives in: one host mapping or one CUDA allocation each.

Owns :class:`HostMemory` and :class:`CudaMemory`. Each is the memory of one region
(:class:`~ray_rdt_pool.registry.Region`: the sender's pool, a receiver's arena, a
same-node pool), made by the region's owner on that owner's thread, registered with NIXL
once, and closed by the same owner after its registration is gone; blocks of it are
handed out by the region's allocator, never by the memory.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["CudaMemory", "HostMemory"]

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class HostMemory:
    """One page-aligned anonymous mapping of host memory, viewed as a uint8 tensor.

    The pool and the receive arena are each one region, registered with NIXL once.
    An anonymous mapping rather than ``torch.empty`` keeps the region out of glibc's
    heap, so its pages, once faulted, are never handed back and re-faulted.
    """

    def __init__(self, nbytes: int, *, prefault: bool = False) -> None:
        import numpy as np
        import torch

        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if prefault and hasattr(mmap, "MAP_POPULATE"):
            flags |= mmap.MAP_POPULATE
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=flags)
        # No MADV_HUGEPAGE: first touches of huge pages can stall for memory compaction.
        self._populated = nbytes if prefault else 0
        self.array: np.ndarray = np.frombuffer(self._map, dtype=np.uint8)
        self.tensor: torch.Tensor = torch.from_numpy(self.array)
        self.addr: int = self.tensor.data_ptr()
        self.device = "cpu"
        self.device_id = 0
        self.torch_device = "cpu"

    def populate(self, end: int) -> None:
        """Fault in pages up to ``end`` in one kernel call, ahead of a copy or READ.

        Blocks are handed out lowest offset first and pages are never returned, so a
        high-water mark is enough. ``MADV_POPULATE_WRITE`` (Linux 5.14) faults faster
        than first touches one page at a time; where it is missing, pages simply fault
        on first use.
        """
        if end <= self._populated:
            return
        page = mmap.PAGESIZE
        start = self._populated // page * page
        stop = min(self.nbytes, -(-end // page) * page)
        try:
            self._map.madvise(_MADV_POPULATE_WRITE, start, stop - start)
        except (OSError, ValueError):
            pass
        self._populated = stop

    def close(self) -> None:
        """Unmap the region (its registration is already gone, and no view is left)."""
        self.tensor = None  # type: ignore[assignment]
        self.array = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: unmapped when it dies
            pass


class CudaMemory:
    """One allocation of CUDA memory for a pool or arena, viewed as a uint8 tensor.

    Memory from ``expandable_segments`` cannot be registered for RDMA, so that allocator
    setting is refused up front with the fix, instead of failing inside NIXL.

    Blocks are whole 4 KiB pages, as in a shared host pool: same-node receivers lease a
    sender's CUDA pool by page (see :mod:`ray_rdt_pool.same_node.leases`).
    """

    align = 4096

    def __init__(self, nbytes: int) -> None:
        import os

        import torch

        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            from ray_rdt_pool.errors import RegistrationError

            raise RegistrationError(
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is set: CUDA memory from "
                "expandable segments cannot be registered with NIXL for RDMA. Unset it (or set "
                "expandable_segments:False) in processes that use a CUDA nixl_pool")
        if not torch.cuda.is_available():
            from ray_rdt_pool.errors import ConfigurationError

            raise ConfigurationError(
                "device='cuda' was configured but this process sees no CUDA device; "
                "configure device='cpu' or give the actor a GPU (num_gpus=1)")
        self.nbytes = nbytes = -(-nbytes // self.align) * self.align
        self.device_id = torch.cuda.current_device()
        self.torch_device = f"cuda:{self.device_id}"
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
        self.addr = self.tensor.data_ptr()
        self.device = "cuda"

    def close(self) -> None:
        """Give the memory back to torch's caching allocator."""
        self.tensor = None  # type: ignore[assignment]
