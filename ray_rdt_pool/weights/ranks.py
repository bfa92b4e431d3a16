"""Many trainer ranks: one sync whose model is spread over several trainer actors.

Owns :func:`sync_ranks` (what :func:`~ray_rdt_pool.weights.sync` runs for a list of
trainers) and its three steps. Each rank *offers* its part (:func:`_remote_offer`: its
layout and one message per bucket, read in place or packed). The driver merges the
offers into one model (:func:`_merge`: names held by one rank, dim-0 shards of a name
held by every rank of a ``shard=(rank, world)`` world) and hands every receiver its
load (:class:`_RankedLoad`), which :func:`load_ranks` validates whole, reads bucket by
bucket from the rank that holds it, and commits only once every byte landed. Each rank
meanwhile *holds* (:func:`_remote_hold`): it waits for the receivers' loads, so its
tensors stay unchanged under their reads, then frees what it offered.

A shard of name ``n`` from rank ``r`` travels as its own tensor, named
:func:`_piece_name`; a receiver writes it into rows of its destination tensor (or the
part of them its ``select`` keeps), and reads nothing of a shard it does not need.

The rank's side lives in :mod:`.rank_offer`, the receiver's in :mod:`.rank_load`; this
module is the driver's (the merge, and :func:`sync_ranks`), stateless and per call, on
the driver's thread.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ray_rdt_pool.errors import (
    RankMissingError,
    RankOverlapError,
    TrainerRankError,
    WeightSyncTimeoutError,
)
from ray_rdt_pool.weights.manifest import Bucket, TensorEntry, WeightLayout
from ray_rdt_pool.weights.rank_load import _RankedLoad, _remote_load_ranks, _Sharded
from ray_rdt_pool.weights.rank_offer import _Offer, _piece_name, _remote_hold, _remote_offer
from ray_rdt_pool.weights.reports import LoadReport, SyncReport

if TYPE_CHECKING:
    from ray.actor import ActorHandle


@dataclass
class _Merged:
    """The ranks' offers as one model: per rank, the entries renamed (shards become
    pieces), and the sharded names."""

    entries: list[list[TensorEntry]]
    aliases: list[list[tuple[str, str]]]
    sharded: dict[str, _Sharded]
    total_bytes: int


def _merge(offers: Sequence[_Offer]) -> _Merged:
    """Check that the ranks' parts add up to one model and rename shards to pieces;
    RankOverlapError / RankMissingError name the tensor and the ranks."""
    m = len(offers)
    shards = [o.shard for o in offers]
    for r, sh in enumerate(shards):
        if sh is not None and sh != (r, m):
            raise RankMissingError(
                f"trainer rank {r} (position {r} in the list passed to sync) declares "
                f"shard={sh}, but sync got {m} rank(s): pass every rank of the world, in "
                "rank order", "", (r,))
    holders: dict[str, list[int]] = {}
    facts: dict[tuple[str, int], tuple[tuple[int, ...], str]] = {}
    for r, o in enumerate(offers):
        by_name = o.layout.by_name()
        for e in o.layout.entries:
            holders.setdefault(e.name, []).append(r)
            facts[(e.name, r)] = (e.shape, e.dtype)
        for a, c in o.layout.aliases:
            holders.setdefault(a, []).append(r)
            ce = by_name[c]
            facts[(a, r)] = (ce.shape, ce.dtype)
    sharded: dict[str, _Sharded] = {}
    for name, rs in holders.items():
        if len(rs) == 1:
            continue
        plain = [r for r in rs if shards[r] is None]
        if plain:
            raise RankOverlapError(
                f"tensor {name!r} is held by trainer ranks {rs}, and rank(s) {plain} "
                "hold it whole (no shard=(rank, world) on their WeightSender): each name "
                "must come from one rank, or from every rank as dim-0 shards", name, rs)
        if len(rs) != m:
            missing = [r for r in range(m) if r not in rs]
            raise RankMissingError(
                f"tensor {name!r} is sharded over trainer ranks {rs}, but rank(s) "
                f"{missing} hold no shard of it; every rank of the world holds its rows "
                "of a sharded name (an empty shard is a tensor of 0 rows)", name, missing)
        shapes = [facts[(name, r)] for r in rs]
        s0, d0 = shapes[0]
        bad = [r for r, (s, d) in zip(rs, shapes) if not s or s[1:] != s0[1:] or d != d0]
        if bad or not s0:
            r = bad[0] if bad else rs[0]
            raise RankOverlapError(
                f"tensor {name!r}: the shards of trainer ranks {rs} do not stack along "
                f"dim 0 (rank {rs[0]} holds {s0} {d0}, rank {r} holds "
                f"{facts[(name, r)][0]} {facts[(name, r)][1]}); shards need at least one "
                "dimension, one dtype and the same trailing dimensions", name, [rs[0], r])
        rows, start = [], 0
        for s, _d in shapes:
            rows.append((start, start + s[0]))
            start += s[0]
        sharded[name] = _Sharded((start, *s0[1:]), tuple(rows))
    pieces = {_piece_name(n, r) for n in sharded for r in range(m)}
    clash = sorted(pieces & set(holders))
    if clash:
        raise RankOverlapError(f"tensor {clash[0]!r} has the name a shard travels under; "
                               "rename it", clash[0], holders[clash[0]])
    entries: list[list[TensorEntry]] = []
    aliases: list[list[tuple[str, str]]] = []
    total = 0
    for r, o in enumerate(offers):

        def rename(n: str, r: int = r) -> str:
            return _piece_name(n, r) if n in sharded else n

        entries.append([TensorEntry(rename(e.name), e.shape, e.dtype, e.bucket, e.index,
                                    e.nbytes) for e in o.layout.entries])
        aliases.append([(rename(a), rename(c)) for a, c in o.layout.aliases])
        total += o.layout.total_bytes
    return _Merged(entries, aliases, sharded, total)


def _order(counts: Sequence[int], j: int) -> list[tuple[int, int]]:
    """Receiver ``j``'s read order, as (rank, bucket): round-robin over the ranks,
    starting at rank ``j``, so that receivers reading in step read from different ranks
    and every rank's link carries one copy at a time."""
    m = len(counts)
    out = []
    for s in range(max(counts, default=0)):
        for t in range(m):
            r = (j + t) % m
            if s < counts[r]:
                out.append((r, s))
    return out


def _receiver_load(merged: _Merged, offers: Sequence[_Offer], version: int, j: int,
                   bucket_bytes: int) -> _RankedLoad:
    counts = [len(o.layout.buckets) for o in offers]
    order = _order(counts, j)
    entries: list[TensorEntry] = []
    buckets: list[Bucket] = []
    for g, (r, k) in enumerate(order):
        es = sorted((e for e in merged.entries[r] if e.bucket == k), key=lambda e: e.index)
        buckets.append(Bucket(g, tuple(e.name for e in es), offers[r].layout.buckets[k].nbytes))
        entries.extend(TensorEntry(e.name, e.shape, e.dtype, g, e.index, e.nbytes) for e in es)
    layout = WeightLayout(tuple(entries), tuple(buckets),
                          tuple(a for al in merged.aliases for a in al), bucket_bytes)
    return _RankedLoad(version, layout,
                       tuple(offers[r].boxes[k] for r, k in order),
                       tuple(offers[r].addrs[k] for r, k in order),
                       tuple(r for r, _k in order), tuple(k for _r, k in order),
                       tuple(o.source for o in offers), dict(merged.sharded), len(offers))


def _noop(actor: Any) -> None:
    return None


def _dead(trainers: Sequence[ActorHandle], timeout_s: float) -> list[int]:
    """The ranks whose actors are gone (a no-op call to each fails as an actor error)."""
    import ray
    from ray.exceptions import RayActorError

    refs = [t.__ray_call__.remote(_noop) for t in trainers]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    out = []
    for r, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except RayActorError:
            out.append(r)
        except Exception:
            pass
    return out


def _rank_error(r: int, cause: BaseException, committed: Sequence[int], version: int,
                n: int) -> TrainerRankError:
    keep = [i for i in range(n) if i not in committed]
    return TrainerRankError(
        f"trainer rank {r} died during the many-rank sync of version {version} "
        f"({type(cause).__name__}); receiver(s) {keep} did not commit it and keep their "
        f"previous version" + (f" (receiver(s) {list(committed)} had every byte and "
                               "committed)" if committed else "") +
        "; restart the rank and sync again", r, True, committed)


def sync_ranks(trainers: Sequence[ActorHandle], receivers: list[ActorHandle], *,
               mode: Literal["stream", "publish"], sender_attr: str, receiver_attr: str,
               timeout_s: float, version: int | None) -> SyncReport:
    """:func:`~ray_rdt_pool.weights.sync` for a list of trainer ranks (see module)."""
    import ray
    from ray.exceptions import RayActorError

    t0 = time.perf_counter()
    group = uuid.uuid4().hex[:12]
    calls = [t.__ray_call__.remote(_remote_offer, sender_attr, group, version, mode)
             for t in trainers]
    ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
    offers: list[_Offer | None] = []
    failure: BaseException | None = None
    for r, c in enumerate(calls):
        try:
            offers.append(ray.get(c, timeout=0))
        except RayActorError as e:
            offers.append(None)
            failure = failure or _rank_error(r, e, (), version or 0, len(receivers))
        except Exception as e:
            offers.append(None)
            failure = failure or e
    del calls
    loads: list[Any] = []
    holds: list[Any] = []
    v = max((o.version for o in offers if o is not None), default=0)
    try:
        if failure is not None:
            if isinstance(failure, ray.exceptions.GetTimeoutError):
                raise WeightSyncTimeoutError(
                    f"offering the trainer ranks' buckets took longer than {timeout_s}s")
            raise failure
        ok = [o for o in offers if o is not None]
        merged = _merge(ok)
        bb = max(o.layout.bucket_bytes for o in ok)
        jobs = [_receiver_load(merged, ok, v, j, bb) for j in range(len(receivers))]
        loads = [rec.__ray_call__.remote(_remote_load_ranks, receiver_attr, job)
                 for rec, job in zip(receivers, jobs)]
        del jobs
    finally:
        # Every rank that offered holds until the loads end (none: at once), then frees.
        holds = [t.__ray_call__.remote(_remote_hold, sender_attr, group, [loads], v,
                                       timeout_s)
                 for t, o in zip(trainers, offers) if o is not None]
        if not loads:
            ray.wait(holds, num_returns=len(holds), timeout=timeout_s)
    ray.wait(loads + holds, num_returns=len(loads) + len(holds), timeout=timeout_s)
    results: list[LoadReport | None] = []
    errors: list[BaseException] = []
    for ref in loads:
        try:
            results.append(ray.get(ref, timeout=0))
        except Exception as e:
            results.append(None)
            errors.append(e)
    committed = [i for i, x in enumerate(results) if x is not None]
    held = [t for t, o in zip(trainers, offers) if o is not None]
    for r, h in zip([r for r, o in enumerate(offers) if o is not None], holds):
        try:
            ray.get(h, timeout=0)
        except RayActorError as e:
            raise _rank_error(r, e, committed, v, len(receivers)) from None
        except Exception:
            pass
    if errors:
        dead = _dead(held, min(timeout_s, 30.0))
        if dead:
            raise _rank_error(dead[0], errors[0], committed, v, len(receivers)) from None
        if any(isinstance(e, ray.exceptions.GetTimeoutError) for e in errors):
            raise WeightSyncTimeoutError(
                f"loading from {len(trainers)} trainer ranks took longer than {timeout_s}s")
        raise errors[0]
    reports = tuple(x for x in results if x is not None)
    nbytes = merged.total_bytes
    return SyncReport(mode, v, time.perf_counter() - t0, nbytes,
                      sum(len(o.layout.buckets) for o in ok), reports, None,
                      max(o.pool_used for o in ok))
