"""The former home of the torch layer, now split into modules that each own one thing
(see :mod:`ray_rdt_pool.memory`); it only re-exports their names for other packages."""

# re-exported for other packages until the lead rewires them
from ray_rdt_pool.memory.blocks import device_block, freeze_blocks_at_exit, install_exit_hook
from ray_rdt_pool.memory.describe import Described, describe, native_active
from ray_rdt_pool.memory.dtypes import dtype_name, empty_tensor, torch_dtype
from ray_rdt_pool.memory.extent import MAX_SPANNED_RUNS as MAX_BYTE_RUNS
from ray_rdt_pool.memory.extent import memory_problem, reach, runs_meet, storage_base
from ray_rdt_pool.memory.extent import spanned_runs as byte_runs
from ray_rdt_pool.memory.pack import pack_into, pack_torch
from ray_rdt_pool.memory.pack_pool import copy_moves, stop_pack_helpers
from ray_rdt_pool.memory.rebuild import copy_bytes, empty_like_run_list, rebuild, unpack_into
from ray_rdt_pool.memory.regions import CudaRegion, HostRegion

__all__ = [
    "MAX_BYTE_RUNS",
    "CudaRegion",
    "Described",
    "HostRegion",
    "byte_runs",
    "copy_bytes",
    "copy_moves",
    "describe",
    "device_block",
    "dtype_name",
    "empty_like_run_list",
    "empty_tensor",
    "freeze_blocks_at_exit",
    "install_exit_hook",
    "memory_problem",
    "native_active",
    "pack_into",
    "pack_torch",
    "reach",
    "rebuild",
    "runs_meet",
    "stop_pack_helpers",
    "storage_base",
    "torch_dtype",
    "unpack_into",
]
