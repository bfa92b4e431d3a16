"""The trainer's transport as the weights API uses it: the sender pool, owned buckets,
kept registrations.

Owns the calls into ``ray_rdt_pool._ray.transport`` on the sender's side: pool
statistics and waits for room (:func:`wait_for_pool`), stream buckets put as objects a
stream owns and freed by id (:func:`owned_bucket`, :func:`free_bucket`), and the
storage registrations kept for by-reference buckets (:func:`release_registrations`).
Each imports the transport when called, so importing ``ray_rdt_pool.weights`` loads no
Ray. Called from the stream's thread and from the late-bucket thread (frees only).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from ray_rdt_pool.errors import PoolExhaustedError, WeightSyncTimeoutError, fmt_bytes
from ray_rdt_pool.weights.manifest import Bucket, PoolBucket, TensorEntry
from ray_rdt_pool.weights.planning import conversions, quantized


def pool_stats() -> Any:
    from ray_rdt_pool import stats

    return stats()


def count_ray_calls(n: int) -> None:
    """Count ``n`` Ray task calls this process made for a weight sync (``stats()``)."""
    from ray_rdt_pool._ray.runtime import runtime

    runtime().events.add("weight_sync_ray_calls", n)


def sender_pool_capacity() -> int:
    s = pool_stats()
    if s.pool_capacity:
        return int(s.pool_capacity)
    from ray_rdt_pool._ray.runtime import runtime

    return int(runtime().config.pool_capacity)


def registration_cache_bytes() -> int:
    from ray_rdt_pool._ray.runtime import runtime

    return int(runtime().config.registration_cache_bytes)


def release_registrations(keys: set[Any]) -> None:
    if keys:
        from ray_rdt_pool._ray.owned import forget_registrations

        forget_registrations(keys)


def free_bucket(obj_ids: Sequence[str | None]) -> None:
    from ray_rdt_pool._ray.owned import free_owned

    for oid in obj_ids:
        if oid is not None:
            free_owned(oid)


def owned_bucket(obj_id: str, tensors: list[torch.Tensor], entries: Sequence[TensorEntry],
                  by_reference: bool = False) -> PoolBucket:
    """Put one stream bucket as an object the stream owns: packed into the pool (a
    snapshot; tensors whose entry names another dtype are converted by the pack copy
    itself), or ``by_reference`` with no pack, receivers READ the tensors where they lie
    and the sender keeps them, unchanged, until every receiver acknowledged it."""
    from ray_rdt_pool._ray.owned import put_owned

    if not by_reference:
        tensors = quantized(tensors, entries)
    convert = None if by_reference else conversions(tensors, entries) or None
    wire, device = put_owned(obj_id, tensors, convert, by_reference=by_reference)
    return PoolBucket(obj_id, wire, device)


def too_big(b: Bucket, capacity: int) -> PoolExhaustedError:
    s = pool_stats()
    return PoolExhaustedError(
        b.nbytes, int(s.pool_free) if s.pool_capacity else capacity,
        int(s.pool_largest_free_block) if s.pool_capacity else capacity,
        capacity, what=f"sender pool (bucket {b.index}: {b.names[:3]}...)",
        remedy="streaming never falls back: lower bucket_bytes or raise "
               "pool_bytes (RAY_RDT_POOL_POOL_BYTES) above the largest tensor")


def bucket_fits(s: Any, nbytes: int, limit: int, capacity: int, one_block: bool = False) -> bool:
    """Does a pack of ``nbytes`` fit the pool (stats ``s``) with its use within ``limit``?"""
    used = s.pool_used if s.pool_capacity else 0
    if not s.pool_capacity:
        free = capacity
    elif one_block or s.pool_device == "cuda":
        free = s.pool_largest_free_block  # a CUDA or converting pack takes one block
    else:
        free = s.pool_free
    return bool(free >= nbytes and used + nbytes <= limit)


def wait_for_pool(nbytes: int, limit: int, capacity: int, timeout_s: float,
                   one_block: bool = False) -> float:
    """Block until ``nbytes`` fit the sender pool with its use staying within ``limit``.

    Returns the seconds waited.
    """
    from ray_rdt_pool._ray.runtime import runtime

    def fits(s: Any) -> bool:
        return bucket_fits(s, nbytes, limit, capacity, one_block)

    t0 = time.monotonic()
    if runtime().wait_for(fits, timeout_s) is None:
        s = pool_stats()
        used = s.pool_used if s.pool_capacity else 0
        raise WeightSyncTimeoutError(
            f"for {timeout_s}s the sender pool had {fmt_bytes(int(used))} in use of "
            f"{fmt_bytes(capacity)} (this stream may use up to {fmt_bytes(limit)}), but "
            f"the next bucket needs {fmt_bytes(nbytes)}"
            + (f" in one block (the largest free one has "
               f"{fmt_bytes(int(s.pool_largest_free_block))})" if one_block else "")
            + "; other objects hold the pool (drop their refs, or raise pool_bytes) or a "
            "same-node receiver still maps this stream's blocks")
    return time.monotonic() - t0
