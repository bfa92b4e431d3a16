"""What a sync reports: per bucket, per receiver's load, per stream, per driver's sync.

Owns the frozen report records the API returns (:class:`BucketReport`,
:class:`LoadReport`, :class:`StreamReport`, :class:`SyncReport`) and their summaries.
Pure (no torch, Ray or NIXL) and immutable: safe to pickle and share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketReport:
    """One bucket loaded on one receiver."""

    bucket: int
    nbytes: int
    direct: bool  #: landed in the destination tensors (no receiver-side copy)
    seconds: float


@dataclass(frozen=True)
class LoadReport:
    """One receiver's load of one version."""

    version: int
    buckets: int
    nbytes: int
    direct_buckets: int
    copied_buckets: int
    skipped: int  #: manifest tensors not written (mapped to None, or extra with strict=False)
    seconds: float


@dataclass(frozen=True)
class StreamReport:
    """One streaming sync as the sender saw it.

    ``pool_used_samples[k]`` is the sender's ``stats().pool_used`` right after bucket
    ``k`` was put; pool use only grows at a put, so their maximum is the peak.
    """

    version: int
    buckets: int
    #: payload bytes the sender sent (every bucket, in the wire dtype, without padding),
    #: whatever each receiver selected of them (its ``loads[i].nbytes``)
    nbytes: int
    receivers: int
    max_inflight: int
    seconds: float
    pool_capacity: int
    peak_pool_used: int
    pool_used_samples: tuple[int, ...]
    fallbacks: int  #: fallback registrations during the stream (0 by design)
    pool_wait_seconds: float  #: time spent waiting for the pool to free a bucket
    loads: tuple[LoadReport, ...] = ()
    #: buckets every receiver copied straight out of the sender's tensors (same node,
    #: ``source_reads``): no pool, no NIXL READ; the others went through the pool
    source_read_buckets: int = 0
    #: buckets receivers READ over NIXL straight from the sender's tensors (a module or
    #: mapping, receivers not all able to read in place): no pack, no pool
    reference_buckets: int = 0
    #: Ray task calls the stream made (a few per receiver, whatever the bucket count)
    ray_calls: int = 0


@dataclass(frozen=True)
class SyncReport:
    """One :func:`sync` as the driver saw it."""

    mode: str
    version: int
    seconds: float
    nbytes: int
    buckets: int
    loads: tuple[LoadReport, ...]
    stream: StreamReport | None = None
    sender_pool_used: int = 0  #: peak (stream) or after-publish (publish) sender pool bytes
    #: Ray task calls the sync made, the driver's and the trainer's (a few per receiver
    #: and per rank, whatever the bucket count)
    ray_calls: int = 0

    @property
    def gbps(self) -> float:
        """Payload GB/s per receiver (bytes of one copy over the sync's wall time)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def summarise(version: int, reports: Sequence[BucketReport], skipped: int = 0) -> LoadReport:
    direct = sum(r.direct for r in reports)
    return LoadReport(version, len(reports), sum(r.nbytes for r in reports), direct,
                      len(reports) - direct, skipped, sum(r.seconds for r in reports))


def ranges(ks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``; ``"none"`` when empty."""
    if not ks:
        return "none"
    out: list[str] = []
    start = prev = ks[0]
    for x in [*ks[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)
