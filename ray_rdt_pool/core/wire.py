"""The wire metadata's public names, from :mod:`ray_rdt_pool.core.runs` (the tensors as
runs and repeated groups) and :mod:`ray_rdt_pool.core.codec` (``WireMeta`` and its
msgpack codec).

Pure: it imports those two modules only.
"""

from __future__ import annotations

# re-exported for other packages until the lead rewires them
from ray_rdt_pool.core.codec import MAX_TENSORS, WIRE_VERSION, WireMeta, decode, encode

# re-exported for other packages until the lead rewires them
from ray_rdt_pool.core.runs import (
    DTYPE_BY_CODE,
    DTYPES,
    MAX_DIMS,
    RunGroup,
    Runs,
    TensorRun,
    group_runs,
    runs_from,
)

__all__ = [
    "DTYPES",
    "DTYPE_BY_CODE",
    "MAX_DIMS",
    "MAX_TENSORS",
    "WIRE_VERSION",
    "RunGroup",
    "Runs",
    "TensorRun",
    "WireMeta",
    "decode",
    "encode",
    "group_runs",
    "runs_from",
]
