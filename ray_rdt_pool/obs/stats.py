"""The public introspection record of one process's transport (pure: plain ints).

Tests, the benchmark and the metrics exporter read :class:`TransportStats`, never the
transport's private fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

__all__ = ["StatsSource", "TransportStats"]


class StatsSource(Protocol):
    """What an observer may read of the transport: its config and its stats."""

    @property
    def config(self) -> Any: ...

    def stats(self) -> TransportStats: ...


@dataclass(frozen=True)
class TransportStats:
    """A snapshot of one process's sender pool, receive arena and NIXL activity.

    Pool fields describe the sender side, arena fields the receive side (all arenas,
    one per device type); both are zero until first use. Counters only grow over the
    life of the process. Defaults exist only so that older readers of this record keep
    working; the transport always fills every field.
    """

    pool_device: str
    pool_capacity: int
    pool_used: int
    pool_free: int
    pool_largest_free_block: int
    pool_free_blocks: int
    live_objects: int
    arena_capacity: int
    arena_used: int
    arena_free: int
    arena_largest_free_block: int
    arena_free_blocks: int
    arena_live_blocks: int
    nixl_registrations: int
    nixl_deregistrations: int
    registered_regions: int
    objects_put: int
    objects_freed: int
    bytes_packed: int
    zero_copy_tensors: int
    fallbacks: int
    objects_received: int
    bytes_received: int
    receive_fallbacks: int
    transfers_in_flight: int
    transfer_errors: int
    remote_agents: int
    remote_metadata_loads: int
    agent_name: str
    #: objects living in overflow memory now (they did not fit the pool; snapshots all the same)
    overflow_objects: int = 0
    #: bytes of those objects
    overflow_bytes: int = 0
    #: bytes of overflow memory registered now (a region goes once it has held no object
    #: for overflow_linger_s)
    overflow_capacity: int = 0
    #: READs given up on (timeout, abort, dropped) whose landing is held until NIXL ends them
    abandoned_transfers: int = 0
    #: READs that ended after being given up on (their landing came back then)
    late_completions: int = 0
    #: READs ended by removing their peer's agent after fetch_timeout_s
    transfers_cut: int = 0
    #: remote agents removed (failed, idle, or to cut off a READ)
    remote_agents_removed: int = 0
    #: aborts remembered for fetches that have not started (bounded)
    pending_aborts: int = 0
    #: user storages registered in the registration cache, and their bytes: those kept
    #: for reuse (bounded by the option ``registration_cache_bytes``) and those pinned by
    #: ``register_memory()`` (outside that bound, until unregistered)
    registration_cache_entries: int = 0
    registration_cache_bytes: int = 0
    #: cache entries deregistered by its LRU bound
    registration_evictions: int = 0
    #: gets served from a same-node sender's shared pool (no NIXL READ)
    mapped_gets: int = 0
    #: NIXL READs posted by this process
    reads_posted: int = 0
    #: of those, READs split over several read lanes (NIXL agents) and posted concurrently
    split_reads: int = 0
    #: receiver: buckets of a weights stream copied straight out of a same-node sender's
    #: memory (no pool, no NIXL READ); their bytes count in ``bytes_received``
    source_reads: int = 0
    #: receiver: objects of same-node senders mapped here whose views are alive (each
    #: holds a lease on its sender's block), and their bytes
    mapped_objects: int = 0
    mapped_bytes: int = 0
    #: sender: objects Ray freed whose blocks wait for same-node receivers' leases
    leased_objects: int = 0
    leased_bytes: int = 0
    #: weight syncs: Ray task calls this process made for them (a few per receiver and
    #: per sync, whatever the bucket count), and the data-plane signals it sent
    weight_sync_ray_calls: int = 0
    signals_sent: int = 0
    #: weight syncs: sessions with an open signal inbox here now, and signals waiting for
    #: a session that has not opened (both 0 between syncs)
    signal_sessions: int = 0
    signals_waiting: int = 0
    #: weight syncs: bytes of the staging copies of this process's receivers with
    #: ``staging="shadow"`` (one more copy of their weights each)
    weight_staging_bytes: int = 0

    @property
    def pool_fragmentation(self) -> float:
        """1 - largest free block / free bytes: 0 when the free space is one block."""
        if self.pool_free == 0:
            return 0.0
        return 1.0 - self.pool_largest_free_block / self.pool_free

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (for JSON and tables)."""
        d = asdict(self)
        d["pool_fragmentation"] = self.pool_fragmentation
        return d
