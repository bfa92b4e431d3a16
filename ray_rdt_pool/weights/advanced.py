"""The weight-sync types below the everyday API, for tools that inspect or drive a sync
themselves: the layout a manifest carries (:class:`WeightLayout`, its
:class:`Bucket` and :class:`TensorEntry` rows), a lazily streamed bucket's layout
(:class:`BucketLayout`), a receiver's plan of a load (:class:`LoadPlan`,
:class:`BucketPlan`), the planner itself (:func:`plan_layout`) and the helpers a
receiver validates with (:func:`can_cast`, :func:`named_tensors`).

Most users need none of it: :mod:`ray_rdt_pool.weights` is the API.
"""

from __future__ import annotations

from ray_rdt_pool.weights.loadplan import BucketPlan, LoadPlan
from ray_rdt_pool.weights.manifest import (
    Bucket,
    BucketLayout,
    PoolBucket,
    SourceBucket,
    TensorEntry,
    WeightLayout,
)
from ray_rdt_pool.weights.planning import plan_layout
from ray_rdt_pool.weights.state import named_tensors
from ray_rdt_pool.weights.validate import can_cast

__all__ = [
    "Bucket",
    "BucketLayout",
    "BucketPlan",
    "LoadPlan",
    "PoolBucket",
    "SourceBucket",
    "TensorEntry",
    "WeightLayout",
    "can_cast",
    "named_tensors",
    "plan_layout",
]
