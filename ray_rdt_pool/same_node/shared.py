"""The names of same-node sharing under their former module path.

Each now lives in the module that owns its lifetime (see the package docstring).
"""

# re-exported for other packages until the lead rewires them
from ray_rdt_pool.same_node._libc import PAGE, unmap
from ray_rdt_pool.same_node.cuda import CudaExport, NotVisibleError, export_cuda_pool
from ray_rdt_pool.same_node.fork import ChildLeases, privatize
from ray_rdt_pool.same_node.info import (
    HOST_INFO_VERSION,
    HostInfo,
    process_start,
    still_running,
)
from ray_rdt_pool.same_node.leases import LeaseTable, lease_slot, lease_slots
from ray_rdt_pool.same_node.mapped import MappedPool, mappable_spans
from ray_rdt_pool.same_node.regions import SharedHostRegion
from ray_rdt_pool.same_node.source import (
    SourceProcess,
    peer_batch_reader,
    peer_reader,
    probe_source,
    this_process,
)

__all__ = [
    "HOST_INFO_VERSION", "PAGE", "ChildLeases", "CudaExport", "HostInfo", "LeaseTable",
    "MappedPool", "NotVisibleError", "SharedHostRegion", "SourceProcess", "export_cuda_pool",
    "lease_slot", "lease_slots", "mappable_spans", "peer_batch_reader", "peer_reader",
    "privatize", "probe_source", "process_start", "still_running", "this_process", "unmap",
]
