"""``stats()``: one frozen :class:`~ray_rdt_pool.obs.stats.TransportStats` of a runtime.

Owns nothing: it reads the pool, the arenas, the registry's cache and the event
counters, each under its owner's lock, and assembles them. Callable from any thread
(``stats()``, the metrics observer, ``Runtime.wait_for``); the fields are each
consistent, not all taken at one instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_rdt_pool.obs.stats import TransportStats

if TYPE_CHECKING:
    from ray_rdt_pool._ray.runtime import Runtime


def collect(rt: Runtime) -> TransportStats:
    """The counters of ``rt``'s sender, receiver, registry and events, as one snapshot."""
    s, r = rt.sender, rt.receiver
    with s.lock:
        p = s.pool.alloc.stats() if s.pool else None
        live = len(s.sent)
    o_objs, o_bytes, o_cap = s.overflow_stats()
    l_objs, l_bytes = s.leased_stats()
    rc = r.counts()
    with r.lock:
        arenas = [a.alloc.stats() for a in r.arenas.values()]
    entries, cached = rt.registry.cached()
    c = rt.events.snapshot()
    box = rt.current_mailbox()
    return TransportStats(
        pool_device=rt.config.device,
        pool_capacity=p.capacity if p else 0,
        pool_used=p.used if p else 0,
        pool_free=p.free if p else 0,
        pool_largest_free_block=p.largest_free_block if p else 0,
        pool_free_blocks=p.free_blocks if p else 0,
        live_objects=live,
        arena_capacity=sum(a.capacity for a in arenas),
        arena_used=sum(a.used for a in arenas),
        arena_free=sum(a.free for a in arenas),
        arena_largest_free_block=max((a.largest_free_block for a in arenas), default=0),
        arena_free_blocks=sum(a.free_blocks for a in arenas),
        arena_live_blocks=sum(a.live_objects for a in arenas),
        nixl_registrations=c["registrations"],
        nixl_deregistrations=c["deregistrations"],
        registered_regions=rt.registry.regions + entries,
        objects_put=c["objects_put"],
        objects_freed=c["objects_freed"],
        bytes_packed=c["bytes_packed"],
        zero_copy_tensors=c["zero_copy_tensors"],
        fallbacks=c["fallbacks"],
        objects_received=c["objects_received"],
        bytes_received=c["bytes_received"],
        receive_fallbacks=c["receive_fallbacks"],
        transfers_in_flight=c["in_flight"],
        transfer_errors=c["transfer_errors"],
        remote_agents=rc["peers"],
        remote_metadata_loads=c["metadata_loads"],
        agent_name=rt.agent_name,
        overflow_objects=o_objs,
        overflow_bytes=o_bytes,
        overflow_capacity=o_cap,
        abandoned_transfers=rc["abandoned"],
        late_completions=c["late_completions"],
        transfers_cut=c["transfers_cut"],
        remote_agents_removed=c["peers_removed"],
        pending_aborts=rc["pending_aborts"],
        registration_cache_entries=entries,
        registration_cache_bytes=cached,
        registration_evictions=c["registration_evictions"],
        mapped_gets=c["mapped_gets"],
        reads_posted=c["reads_posted"],
        split_reads=c["split_reads"],
        source_reads=c["source_reads"],
        mapped_objects=rc["mapped_objects"],
        mapped_bytes=rc["mapped_bytes"],
        leased_objects=l_objs,
        leased_bytes=l_bytes,
        weight_sync_ray_calls=c["weight_sync_ray_calls"],
        signals_sent=c["signals_sent"],
        signal_sessions=box.sessions() if box is not None else 0,
        signals_waiting=box.pending() if box is not None else 0,
        weight_staging_bytes=c["staging_bytes"],
    )
