"""Weight sync over ``nixl_pool``: a trainer's weights into many inference actors, in
buckets, written in place. Guide: docs/weight-sync.md.

Usage::

    from ray_rdt_pool.weights import sync, WeightReceiver, WeightSender

    @ray.remote(enable_tensor_transport=True)
    class Trainer:
        def __init__(self):
            self.model = build_model()
            self.weight_sender = WeightSender(self.model)

    @ray.remote(enable_tensor_transport=True)
    class Engine:
        def __init__(self):
            self.model = build_model()
            self.weight_receiver = WeightReceiver(self.model)

    trainer, engines = Trainer.remote(), [Engine.remote() for _ in range(4)]
    report = sync(trainer, engines)  # after each optimizer step

The modules, sender side first: ``state`` (what the API takes in), ``manifest`` (the
picklable layouts and bucket messages), ``planning`` (bucketing), ``pool`` (the sender
pool), ``sender`` (:class:`WeightSender`), ``stream`` (one streamed sync), ``relay`` (a
stream relayed down a chain of receivers), ``late`` (buckets of failed streams),
``validate`` and ``loadplan`` (checking and planning a load), ``loading`` (one bucket),
``receiver`` (:class:`WeightReceiver`), ``remote`` (the calls between actors),
``driver`` (:func:`sync`), ``ranks`` (a sync from many trainer ranks), ``reports``. The
errors live in :mod:`ray_rdt_pool.errors`; the layout and planning types a tool may
inspect are in :mod:`ray_rdt_pool.weights.advanced`.
"""

from __future__ import annotations

from ray_rdt_pool.errors import (
    CommitHookError,
    DuplicateNameError,
    LoaderError,
    ManifestMismatchError,
    ManifestReleasedError,
    RankLayoutError,
    ReceiverError,
    RelayReceiverError,
    SourceExhaustedError,
    StaleVersionError,
    TrainerRankError,
    WeightSyncError,
    WeightSyncTimeoutError,
    WireDtypeError,
)
from ray_rdt_pool.weights import manifest as _manifest
from ray_rdt_pool.weights import remote as _remote
from ray_rdt_pool.weights.catchup import catch_up
from ray_rdt_pool.weights.driver import SyncHandle, sync
from ray_rdt_pool.weights.manifest import Manifest
from ray_rdt_pool.weights.reports import BucketReport, LoadReport, StreamReport, SyncReport
from ray_rdt_pool.weights.weight_receiver import WeightReceiver, load_manifest
from ray_rdt_pool.weights.weight_sender import WeightSender

#: What a user calls or catches. The layout and planning types are in
#: :mod:`ray_rdt_pool.weights.advanced`; every error (the mismatch kinds included) is in
#: :mod:`ray_rdt_pool.errors`.
__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "RECEIVER_ATTR",
    "SENDER_ATTR",
    "BucketReport",
    "CommitHookError",
    "DuplicateNameError",
    "LoadReport",
    "LoaderError",
    "Manifest",
    "ManifestMismatchError",
    "ManifestReleasedError",
    "RankLayoutError",
    "ReceiverError",
    "RelayReceiverError",
    "SourceExhaustedError",
    "StaleVersionError",
    "StreamReport",
    "SyncHandle",
    "SyncReport",
    "TrainerRankError",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "WireDtypeError",
    "catch_up",
    "load_manifest",
    "sync",
]

# The public constants are documented here (tools/gen_docs.py reads these comments).

#: 32 MiB: small enough that two buckets (double buffering) fit a modest sender pool
#: and a receive arena, large enough that per-bucket costs (a signal each way, one READ)
#: are small next to the copy.
DEFAULT_BUCKET_BYTES = _manifest.DEFAULT_BUCKET_BYTES

#: Attribute names :func:`sync` looks up on the trainer and inference actors.
SENDER_ATTR = _remote.SENDER_ATTR
RECEIVER_ATTR = _remote.RECEIVER_ATTR
