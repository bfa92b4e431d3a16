"""The sender's shared pool memory: a pool region in a ``memfd``.

A :class:`SharedHostMemory` is created and closed by the registry for the sender, like
any region (it is one); same-node receivers open its descriptor through
``/proc/<pid>/fd`` (a memfd has no name in any file system, so nothing is left behind
when the sender crashes). Its blocks are whole pages. Called under the registry's lock.
"""

from __future__ import annotations

import mmap
import os

from ray_rdt_pool.memory.allocations import HostMemory
from ray_rdt_pool.same_node._libc import PAGE, PROT_RW, page_up

__all__ = ["SharedHostMemory"]


class SharedHostMemory(HostMemory):
    """A pool region in a ``memfd``, mapped shared; its blocks are whole pages, so each
    object's pages are its own (a receiver's copy-on-write page never holds a
    neighbour's bytes)."""

    align = PAGE

    def __init__(self, nbytes: int, *, prefault: bool = False) -> None:
        import numpy as np
        import torch

        nbytes = page_up(nbytes)
        self.fd = os.memfd_create("ray_rdt_pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            flags = mmap.MAP_SHARED
            if prefault and hasattr(mmap, "MAP_POPULATE"):
                flags |= mmap.MAP_POPULATE
            self._map = mmap.mmap(self.fd, nbytes, flags=flags, prot=PROT_RW)
        except BaseException:
            os.close(self.fd)
            raise
        self.ino = os.fstat(self.fd).st_ino
        self.nbytes = nbytes
        self._populated = nbytes if prefault else 0
        self.array: np.ndarray = np.frombuffer(self._map, dtype=np.uint8)
        self.tensor: torch.Tensor = torch.from_numpy(self.array)
        self.addr = self.tensor.data_ptr()
        self.device = "cpu"
        self.device_id = 0
        self.torch_device = "cpu"

    def close(self) -> None:
        super().close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
