"""Many trainer ranks: one sync whose model is spread over several trainer actors.

Owns :func:`sync_ranks` (what :func:`~ray_rdt_pool.weights.sync` runs for a list of
trainers) and its three steps. Each rank *offers* its part (:func:`remote_offer`: its
layout and one message per bucket, read in place or packed). The driver merges the
offers into one model (:func:`_merge`: names held by one rank, dim-0 shards of a name
held by every rank of a ``shard=(rank, world)`` world) and hands every receiver its
load (:class:`RankedLoad`), which :func:`load_ranks` validates whole, reads bucket by
bucket from the rank that holds it, and commits only once every byte landed. Each rank
meanwhile *holds* (:func:`_remote_hold`): it waits for the receivers' loads, so its
tensors stay unchanged under their reads, then frees what it offered.

A shard of name ``n`` from rank ``r`` travels as its own tensor, named
:func:`piece_name`; a receiver writes it into rows of its destination tensor (or the
part of them its ``select`` keeps), and reads nothing of a shard it does not need.

The rank's side lives in :mod:`.rank_offer`, the receiver's in :mod:`.rank_load`; this
module is the driver's (the merge, and :func:`sync_ranks`), stateless and per call, on
the driver's thread.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ray_rdt_pool.errors import (
    RankMissingError,
    RankOverlapError,
    ReceiverError,
    TrainerRankError,
    WeightSyncTimeoutError,
)
from ray_rdt_pool.weights.fp8 import SCALE_SUFFIX
from ray_rdt_pool.weights.manifest import Bucket, TensorEntry, WeightLayout
from ray_rdt_pool.weights.pool import count_ray_calls
from ray_rdt_pool.weights.rank_load import Chain, RankedLoad, Sharded, remote_load_ranks
from ray_rdt_pool.weights.rank_offer import (
    Offer,
    piece_name,
    remote_offer,
    remote_release,
    remote_serve,
)
from ray_rdt_pool.weights.remote import (
    get_all,
    remote_abort,
    remote_finish,
    remote_md,
    wait_quietly,
)
from ray_rdt_pool.weights.reports import LoadReport, SyncReport
from ray_rdt_pool.weights.stream import commit_all

if TYPE_CHECKING:
    from ray.actor import ActorHandle


@dataclass
class _Merged:
    """The ranks' offers as one model: per rank, the entries renamed (shards become
    pieces), and the sharded names."""

    entries: list[list[TensorEntry]]
    aliases: list[list[tuple[str, str]]]
    sharded: dict[str, Sharded]
    total_bytes: int


def _merge(offers: Sequence[Offer]) -> _Merged:
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
            if e.scale_of is not None:
                continue  # an FP8 weight's scales go where the weight goes
            holders.setdefault(e.name, []).append(r)
            facts[(e.name, r)] = (e.shape, e.dtype)
        for a, c in o.layout.aliases:
            holders.setdefault(a, []).append(r)
            ce = by_name[c]
            facts[(a, r)] = (ce.shape, ce.dtype)
    sharded: dict[str, Sharded] = {}
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
        sharded[name] = Sharded((start, *s0[1:]), tuple(rows))
    pieces = {piece_name(n, r) for n in sharded for r in range(m)}
    clash = sorted(pieces & set(holders))
    if clash:
        raise RankOverlapError(f"tensor {clash[0]!r} has the name a shard travels under; "
                               "rename it", clash[0], holders[clash[0]])
    entries: list[list[TensorEntry]] = []
    aliases: list[list[tuple[str, str]]] = []
    total = 0
    for r, o in enumerate(offers):

        def rename(n: str, r: int = r) -> str:
            if n.endswith(SCALE_SUFFIX) and n[:-len(SCALE_SUFFIX)] in sharded:
                return piece_name(n[:-len(SCALE_SUFFIX)], r) + SCALE_SUFFIX
            return piece_name(n, r) if n in sharded else n

        entries.append([dataclasses.replace(
            e, name=rename(e.name), scale_of=None if e.scale_of is None else rename(e.scale_of))
            for e in o.layout.entries])
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


def chains(m: int, n: int) -> list[list[int]]:
    """Per rank of ``m``, the order of the ``n`` receivers in its relay chain: each chain
    starts at another receiver (rank ``r`` at ``r * n // m``), so no receiver's link
    carries the start of more chains than its share, and each rank sends its part once."""
    return [[(r * n // m + p) % n for p in range(n)] for r in range(m)]


def _receiver_load(merged: _Merged, offers: Sequence[Offer], version: int, j: int,
                   bucket_bytes: int, group: str, timeout_s: float,
                   roles: tuple[Chain | None, ...], max_inflight: int) -> RankedLoad:
    counts = [len(o.layout.buckets) for o in offers]
    order = _order(counts, j)
    entries: list[TensorEntry] = []
    buckets: list[Bucket] = []
    for g, (r, k) in enumerate(order):
        es = sorted((e for e in merged.entries[r] if e.bucket == k), key=lambda e: e.index)
        buckets.append(Bucket(g, tuple(e.name for e in es), offers[r].layout.buckets[k].nbytes))
        entries.extend(dataclasses.replace(e, bucket=g) for e in es)
    layout = WeightLayout(tuple(entries), tuple(buckets),
                          tuple(a for al in merged.aliases for a in al), bucket_bytes)
    return RankedLoad(group, j, version, layout,
                       tuple(offers[r].boxes[k] for r, k in order),
                       tuple(offers[r].addrs[k] for r, k in order),
                       tuple(r for r, _k in order), tuple(k for _r, k in order),
                       tuple(o.source for o in offers), dict(merged.sharded), len(offers),
                       tuple(counts), tuple(o.md for o in offers), timeout_s, roles,
                       max_inflight)


def _rank_error(r: int, cause: BaseException, version: int, n: int) -> TrainerRankError:
    return TrainerRankError(
        f"trainer rank {r} died during the many-rank sync of version {version} "
        f"({type(cause).__name__}); the {n} receiver(s) did not commit it and keep their "
        "previous version; restart the rank and sync again", r, True, ())


def _receiver_died(j: int, actor: Any, cause: BaseException, version: int) -> ReceiverError:
    aid = actor._actor_id.hex()
    err = ReceiverError(
        f"receiver {j} (actor {aid}) died during the many-rank sync of version {version} "
        f"({type(cause).__name__}); no receiver committed it, the others keep their "
        "previous version", j, aid)
    err.__cause__ = cause
    return err


def sync_ranks(trainers: Sequence[ActorHandle], receivers: list[ActorHandle], *,
               mode: Literal["stream", "publish"], sender_attr: str, receiver_attr: str,
               timeout_s: float, version: int | None, relay: str | None = None,
               max_inflight: int = 2,
               cancelled: Callable[[], None] | None = None) -> SyncReport:
    """:func:`~ray_rdt_pool.weights.sync` for a list of trainer ranks (see module)."""
    import ray
    from ray.exceptions import RayActorError

    t0 = time.perf_counter()
    group = uuid.uuid4().hex[:12]
    calls = [t.__ray_call__.remote(remote_offer, sender_attr, group, version, mode,
                                   timeout_s)
             for t in trainers]
    ray_calls = len(calls)
    ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
    offers: list[Offer | None] = []
    failure: BaseException | None = None
    for r, c in enumerate(calls):
        try:
            offers.append(ray.get(c, timeout=0))
        except RayActorError as e:
            offers.append(None)
            failure = failure or _rank_error(r, e, version or 0, len(receivers))
        except ray.exceptions.GetTimeoutError:
            offers.append(None)
            failure = failure or WeightSyncTimeoutError(
                f"trainer rank {r} did not offer its buckets within {timeout_s}s; a late "
                "offer is freed by the rank itself after 2 * timeout_s")
        except Exception as e:
            offers.append(None)
            failure = failure or e
    del calls
    v = max((o.version for o in offers if o is not None), default=0)
    offered = [(r, t) for r, (t, o) in enumerate(zip(trainers, offers)) if o is not None]
    try:
        if failure is not None:
            raise failure
        ok = [o for o in offers if o is not None]
        merged = _merge(ok)
    except BaseException:
        wait_quietly([t.__ray_call__.remote(remote_release, sender_attr, group)
                       for _r, t in offered], min(timeout_s, 30.0))
        raise
    bb = max(o.layout.bucket_bytes for o in ok)
    n, m = len(receivers), len(ok)
    roles: list[list[Chain | None]] = [[None] * m for _ in receivers]
    expect = [list(range(n)) for _ in ok]
    if relay is not None:
        try:
            mds = get_all([r.__ray_call__.remote(remote_md) for r in receivers],
                           timeout_s, "asking the receivers for their signal endpoints")
        except BaseException:
            wait_quietly([t.__ray_call__.remote(remote_release, sender_attr, group)
                           for _r, t in offered], min(timeout_s, 30.0))
            raise
        ray_calls += n
        for r, chain in enumerate(chains(m, n)):
            expect[r] = chain[:1]
            for p, j in enumerate(chain):
                roles[j][r] = Chain(mds[chain[p - 1]] if p else None,
                                     mds[chain[p + 1]] if p < n - 1 else None)
    loads = [rec.__ray_call__.remote(
        remote_load_ranks, receiver_attr,
        _receiver_load(merged, ok, v, j, bb, group, timeout_s,
                       tuple(roles[j]) if relay is not None else (), max_inflight))
        for j, rec in enumerate(receivers)]
    serves = [t.__ray_call__.remote(remote_serve, sender_attr, group, [loads], expect[r],
                                    timeout_s)
              for r, t in enumerate(trainers)]
    ray_calls += len(loads) + len(serves)
    results = _await(trainers, receivers, loads, serves, v, timeout_s, receiver_attr, group)
    if cancelled is not None:
        try:
            cancelled()  # a caller who cancelled gets no commit
        except BaseException:
            _abort(receivers, serves, receiver_attr, group, timeout_s)
            raise
    count = sum(len(o.layout.buckets) for o in ok)
    # A receiver commits by then or never (see StreamSession._commit).
    deadline = time.time() + timeout_s
    finishes = [rec.__ray_call__.remote(remote_finish, receiver_attr, group, count,
                                        deadline)
                for rec in receivers]
    ray_calls += len(finishes)

    def named(j: int, e: BaseException) -> BaseException:
        if isinstance(e, RayActorError):
            return _receiver_died(j, receivers[j], e, v)
        if isinstance(e, (ray.exceptions.GetTimeoutError, WeightSyncTimeoutError)):
            err = ReceiverError(f"receiver {j} (actor {receivers[j]._actor_id.hex()}) did "
                                f"not commit version {v} within timeout_s={timeout_s}s "
                                f"({e})", j, receivers[j]._actor_id.hex(), count,
                                stalled=True)
            err.__cause__ = e
            return err
        return e

    commit_all(finishes, v, timeout_s, named)
    count_ray_calls(ray_calls)
    return SyncReport(mode, v, time.perf_counter() - t0, merged.total_bytes, count,
                      tuple(results), None, max(o.pool_used for o in ok),
                      ray_calls=ray_calls)


def _await(trainers: Sequence[ActorHandle], receivers: Sequence[ActorHandle],
           loads: list[Any], serves: list[Any], version: int, timeout_s: float,
           receiver_attr: str, group: str) -> list[LoadReport]:
    """Wait for every load and serve; on the first failure, tell every receiver to drop
    the sync and raise the error that names its cause (a dead rank, a dead receiver, a
    receiver's own error, a timeout). Every call ends on its own within ``timeout_s`` of
    its last progress, so the wait itself has no bound."""
    import ray
    from ray.exceptions import RayActorError

    pending = list(loads) + list(serves)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except BaseException as e:
                _abort(receivers, serves, receiver_attr, group, timeout_s)
                raise _cause(trainers, receivers, loads, serves, version, ref, e,
                             RayActorError, min(timeout_s, 10.0)) from None
    return [ray.get(ref, timeout=0) for ref in loads]


def _abort(receivers: Sequence[ActorHandle], serves: list[Any], receiver_attr: str,
           group: str, timeout_s: float) -> None:
    """After a failure: let the serves end (a rank signals ABORT to the receivers it
    served, and keeps what one may still read until its load ends), then have every
    receiver drop the sync (after its load: nothing commits it)."""
    wait_quietly(serves, min(timeout_s, 30.0))
    for rec in receivers:
        try:
            rec.__ray_call__.remote(remote_abort, receiver_attr, group)
        except Exception:
            pass


def _cause(trainers: Sequence[ActorHandle], receivers: Sequence[ActorHandle],
           loads: list[Any], serves: list[Any], version: int, ref: Any,
           e: BaseException, actor_error: type[BaseException], wait_s: float = 0.0
           ) -> BaseException:
    """The error to raise for a failed sync: a dead rank first, then a dead receiver,
    then the receiver's own error (a mismatch, its loader), then the rank's. A rank's
    serve may fail on a receiver's signal before that receiver's call has ended: its
    error is waited for up to ``wait_s``."""
    import ray

    def died(refs: list[Any]) -> list[tuple[int, BaseException]]:
        ready, _rest = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for i, x in enumerate(refs):
            if x in ready:
                try:
                    ray.get(x, timeout=0)
                except actor_error as err:
                    out.append((i, err))
                except Exception:
                    pass
        return out

    ranks_dead = died(serves)
    if ranks_dead:
        r, err = ranks_dead[0]
        return _rank_error(r, err, version, len(receivers))
    recs_dead = died(loads)
    if recs_dead:
        j, err = recs_dead[0]
        return _receiver_died(j, receivers[j], err, version)
    if isinstance(e, TrainerRankError) or ref in loads:
        return e
    # A rank's serve failed: the receivers' own errors say more, if there are any (the
    # serves have ended, so the loads they fed are ending too).
    import time

    deadline = time.monotonic() + wait_s
    left = list(loads)
    while left:
        ready, left = ray.wait(left, num_returns=1,
                               timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for x in ready:
            try:
                ray.get(x, timeout=0)
            except Exception as err:
                return err
    return e
