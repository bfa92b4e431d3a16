"""The parts of the CUDA path that need no device, checked on any machine. The tests
that need a CUDA device are in tests/gpu/test_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

import ray_rdt_pool
from ray_rdt_pool.errors import InvalidInputError, RegistrationError
from ray_rdt_pool.memory.allocations import CudaMemory
from ray_rdt_pool.memory.blocks import device_block
from ray_rdt_pool.memory.describe import describe

HAS_CUDA = torch.cuda.is_available()


def test_expandable_segments_is_refused_with_the_setting_named(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(RegistrationError, match="expandable_segments"):
        CudaMemory(1 << 20)


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised where no CUDA device exists")
def test_cuda_pool_without_a_device_names_the_fix(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with pytest.raises(ray_rdt_pool.ConfigurationError, match="device='cpu'"):
        CudaMemory(1 << 20)


def test_cuda_tensors_are_refused_when_the_cuda_path_is_off():
    # describe() is the gate; on a CPU-only build a meta tensor stands in for "not CPU".
    with pytest.raises(InvalidInputError, match="device"):
        describe([torch.ones(2), torch.empty(2, device="meta")], allow_cuda=True)


def test_device_block_frees_when_the_last_view_dies():
    import gc

    buf = torch.zeros(4096, dtype=torch.uint8)
    freed: list[int] = []
    block = device_block(buf.data_ptr() + 64, 1024, "cpu", 0, lambda: freed.append(1))
    assert block.untyped_storage().nbytes() == 1024
    view = block[8:16].view(torch.float32)
    view.fill_(1.5)
    del block
    gc.collect()
    assert not freed
    assert buf[64 + 8:64 + 16].view(torch.float32).tolist() == [1.5, 1.5]
    del view
    gc.collect()
    assert freed == [1]


def test_cuda_ipc_entry_round_trips_and_rejects_malformed_fields():
    """The directory entry of a CUDA pool (no device needed: it is bytes and ints)."""
    from ray_rdt_pool.errors import WireFormatError
    from ray_rdt_pool.same_node._libc import PAGE
    from ray_rdt_pool.same_node.cuda import CudaExport
    from ray_rdt_pool.same_node.info import HostInfo

    cuda = CudaExport("GPU-1234", b"\x01" * 64, PAGE * 8, 0, b"/torch_1", 16, b"\x02" * 64,
                      True)
    good = HostInfo("n", 1, 2, 0, 0, PAGE, PAGE * 8, 5, 6, 4, 8, cuda)
    assert HostInfo.decode(good.encode()) == good
    bad = [
        CudaExport("GPU-1234", b"", PAGE * 8, 0, b"", 0, b"", True),  # no IPC handle
        CudaExport("GPU-1234", b"\x01", PAGE * 4, 0, b"", 0, b"", True),  # storage < pool
        CudaExport("", b"\x01", PAGE * 8, 0, b"", 0, b"", True),  # no uuid
        CudaExport("GPU-1234", b"\x01" * 2000, PAGE * 8, 0, b"", 0, b"", True),  # huge
        CudaExport("GPU-1234", b"\x01", PAGE * 8, 0, b"", 0, b"", 1),  # type: ignore[arg-type]
    ]
    for c in bad:
        with pytest.raises(WireFormatError):
            HostInfo.decode(HostInfo("n", 1, 2, 0, 0, PAGE, PAGE * 8, 5, 6, 4, 8, c).encode())
