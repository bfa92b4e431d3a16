"""A trainer rank's side of a many-rank sync (see :mod:`.ranks`): its offer and its hold.

Owns the offers a rank holds between its offer (:func:`_remote_offer`: its layout and
one message per bucket) and its hold (:func:`_remote_hold`: it waits for the receivers'
loads, then frees what it offered), in ``_HELD``: one per sender, in the trainer
process, touched by its task thread only. Also the ``shard=`` check and the name a
dim-0 shard travels under (:func:`_piece_name`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ray_rdt_pool.errors import InvalidInputError, PoolExhaustedError
from ray_rdt_pool.weights.manifest import PoolBucket, TensorEntry, WeightLayout

if TYPE_CHECKING:
    from ray_rdt_pool.same_node.source import SourceProcess


def _check_shard(shard: Any) -> tuple[int, int] | None:
    """``WeightSender(shard=)`` as ``(rank, world)``, or InvalidInputError."""
    if shard is None:
        return None
    ok = (isinstance(shard, (tuple, list)) and len(shard) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) for x in shard)
          and 0 <= shard[0] < shard[1])
    if not ok:
        raise InvalidInputError(f"shard must be (rank, world) with 0 <= rank < world, got "
                                f"{shard!r}; e.g. shard=(dist.get_rank(), "
                                "dist.get_world_size())")
    return int(shard[0]), int(shard[1])


def _piece_name(name: str, rank: int) -> str:
    """The name rank ``rank``'s dim-0 shard of ``name`` travels under."""
    return f"{name}@rank{rank}"


@dataclass(frozen=True)
class _Offer:
    """What one rank offers for a sync: its layout and one message per bucket."""

    version: int  #: the version this rank would use (the driver takes the highest)
    layout: WeightLayout
    shard: tuple[int, int] | None
    #: per bucket: a PoolBucket (stream) or ``[ref]`` of a published bucket (publish)
    boxes: tuple[Any, ...]
    #: per bucket read in place: the tensors' addresses in the rank's process, for
    #: receivers on its node that may read it (else None)
    addrs: tuple[tuple[int, ...] | None, ...]
    source: SourceProcess | None
    pool_used: int
    by_reference: int  #: buckets read in place (not packed)


@dataclass
class _Held:
    """A rank's offer until its hold ends: the tensors receivers read in place (kept
    alive, so unmoved), the owned objects to free, and the storages sent by reference."""

    group: str
    kept: list[torch.Tensor] = field(default_factory=list)
    owned: list[str] = field(default_factory=list)
    ref_keys: set[Any] = field(default_factory=set)


#: id(WeightSender) -> its offer not yet released (one at a time per sender).
_HELD: dict[int, _Held] = {}


def _release(sender: Any) -> _Held | None:
    from ray_rdt_pool.weights.pool import _free_owned

    held = _HELD.pop(id(sender), None)
    if held is not None:
        held.kept.clear()
        _free_owned(held.owned)
        held.owned.clear()
    return held


def _remote_offer(actor: Any, attr: str, group: str, version: int | None,
                  mode: str) -> _Offer:
    """On a trainer rank: plan its part and make every bucket's message (see module)."""
    from ray_rdt_pool.registry import storage_key
    from ray_rdt_pool.weights.pool import (
        _owned_bucket,
        _pool_capacity,
        _registration_cache_bytes,
        _stats,
        _too_big,
    )
    from ray_rdt_pool.weights.remote import _find
    from ray_rdt_pool.weights.sender import WeightSender
    from ray_rdt_pool.weights.stream import _source_readable

    sender = _find(actor, attr, WeightSender)
    _release(sender)  # an offer whose hold never came (its driver died)
    v = sender._next_version(version)
    if mode == "publish":
        m = sender.publish(version=v)
        return _Offer(v, m.layout, sender.shard, tuple(m.refs), (None,) * len(m.refs),
                      None, m.sender_pool_used, 0)
    from ray_rdt_pool.weights.planning import plan_layout

    eager, _pairs = sender._acquire(None)
    if eager is None:
        raise InvalidInputError(
            "a trainer rank of a many-rank sync needs a module or mapping as its source "
            "(the receivers validate the whole model before any byte moves); a lazy "
            "source is bucketed as it goes. Pass WeightSender(model) or a dict")
    layout, groups = plan_layout(eager, sender.bucket_bytes, sender.wire_dtype)
    per_bucket: list[list[TensorEntry]] = [[] for _ in layout.buckets]
    for e in layout.entries:
        per_bucket[e.bucket].append(e)
    by_ref = (sender.source_reads
              and layout.total_bytes <= _registration_cache_bytes())
    packed = [b for b, g, es in zip(layout.buckets, groups, per_bucket)
              if not (by_ref and _source_readable(g, es))]
    capacity = _pool_capacity()
    free = capacity - int(_stats().pool_used)
    need = sum(b.nbytes for b in packed)
    for b in packed:
        if b.nbytes > capacity:
            raise _too_big(b, capacity)
    if need > free:
        raise PoolExhaustedError(
            need, free, free, capacity,
            what=f"sender pool ({len(packed)} bucket(s) this rank packs for a many-rank "
                 "sync, all offered at once)",
            remedy="raise pool_bytes (RAY_RDT_POOL_POOL_BYTES), or send tensors that lie "
                   "as they are sent (CPU, contiguous, no wire_dtype: read in place)")
    src = None
    if sender.source_reads:
        from ray_rdt_pool._ray.owned import source_process

        src = source_process()
    held = _Held(group)
    boxes: list[PoolBucket] = []
    addrs: list[tuple[int, ...] | None] = []
    try:
        for k, (g, es) in enumerate(zip(groups, per_bucket)):
            oid = f"wr:{group}/{k}"
            ref = by_ref and _source_readable(g, es)
            boxes.append(_owned_bucket(oid, g, es, by_reference=ref))
            held.owned.append(oid)
            if ref:
                held.kept.extend(g)
                held.ref_keys.update(storage_key(t) for t in g if t.numel())
                addrs.append(tuple(t.data_ptr() for t in g))
            else:
                addrs.append(None)
    except BaseException:
        _HELD[id(sender)] = held
        _release(sender)
        raise
    groups.clear()
    _HELD[id(sender)] = held
    sender._used = max(sender._used, v)
    return _Offer(v, layout, sender.shard, tuple(boxes), tuple(addrs), src,
                  int(_stats().pool_used), sum(a is not None for a in addrs))


def _remote_hold(actor: Any, attr: str, group: str, loads: list[list[Any]], version: int,
                 timeout_s: float) -> None:
    """On a trainer rank: wait until every receiver's load has ended (its tensors must
    not change under their reads), then free what it offered."""
    import ray

    from ray_rdt_pool.weights.pool import _forget_registrations
    from ray_rdt_pool.weights.remote import _find
    from ray_rdt_pool.weights.sender import WeightSender

    sender = _find(actor, attr, WeightSender)
    refs = loads[0]
    try:
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    finally:
        held = _HELD.get(id(sender))
        if held is not None and held.group == group:
            _release(sender)
            # Storages no longer sent by reference (replaced tensors) need not stay
            # registered; the rest stay for the next sync.
            _forget_registrations(sender._ref_keys - held.ref_keys)
            sender._ref_keys = held.ref_keys
        sender._used = max(sender._used, version)
    try:
        ray.get(refs, timeout=0)
    except Exception:
        return
    sender.version = max(sender.version, version)
