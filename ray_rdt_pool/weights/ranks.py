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

State: the offers a rank holds between its offer and its hold (``_HELD``, one per
sender, in the trainer process, touched by its task thread only). Everything else is
per call.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from ray_rdt_pool.core.selection import Slices
from ray_rdt_pool.errors import (
    InvalidInputError,
    ManifestMismatchError,
    PoolExhaustedError,
    RankMissingError,
    RankOverlapError,
    TrainerRankError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from ray_rdt_pool.weights.loadplan import BucketPlan, plan_load
from ray_rdt_pool.weights.manifest import (
    Bucket,
    PoolBucket,
    SourceBucket,
    TensorEntry,
    WeightLayout,
)
from ray_rdt_pool.weights.reports import BucketReport, LoadReport, SyncReport, _summarise
from ray_rdt_pool.weights.state import Casting, LoadWeights, NameMap, Select, StateLike
from ray_rdt_pool.weights.validate import _dests, _mapper, _normalize_select

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from ray_rdt_pool.same_node.source import SourceProcess
    from ray_rdt_pool.weights.receiver import WeightReceiver


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


# -- the rank's side --------------------------------------------------------------


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


# -- the driver's merge -----------------------------------------------------------


@dataclass(frozen=True)
class _Sharded:
    """A name held by every rank as dim-0 shards: its full shape and, per rank, the rows
    ``[start, stop)`` of the full tensor it holds."""

    shape: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _RankedLoad:
    """One receiver's part of a many-rank sync (what :func:`load_ranks` runs)."""

    version: int
    layout: WeightLayout  #: the merged layout, buckets in this receiver's read order
    boxes: tuple[Any, ...]  #: per merged bucket, its rank's message
    addrs: tuple[tuple[int, ...] | None, ...]
    rank_of: tuple[int, ...]  #: per merged bucket, the rank that holds it
    local: tuple[int, ...]  #: per merged bucket, its index on that rank
    sources: tuple[SourceProcess | None, ...]  #: per rank
    sharded: Mapping[str, _Sharded]
    ranks: int


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


# -- the receiver's side ----------------------------------------------------------


class _RankOptions:
    """A receiver's options as a many-rank load sees them: each piece of a sharded
    name maps to the rows of its destination tensor that the piece holds (and the
    receiver's ``select`` keeps), with the part of the piece to read; a piece it needs
    nothing of maps to None (never read). Other names are the receiver's own."""

    dest: StateLike | None
    load_weights: LoadWeights | None
    name_map: NameMap
    casting: Casting
    strict: bool
    direct: bool
    select: Select | None

    def __init__(self, rec: WeightReceiver, job: _RankedLoad,
                 problems: list[tuple[str, str, str]]) -> None:
        self.load_weights = rec.load_weights
        self.casting = rec.casting
        self.strict = rec.strict
        self.direct = rec.direct
        base = _mapper(rec.name_map)
        dests = _dests(rec)
        dest: dict[str, torch.Tensor] = dict(dests)
        pieces: dict[str, str | None] = {}
        parts: dict[str, Slices | None] = {}
        for name, sh in job.sharded.items():
            names = [_piece_name(name, r) for r in range(job.ranks)]
            pieces.update(dict.fromkeys(names))
            dn = base(name)
            if dn is None:
                continue
            d = dests.get(dn)
            if d is None:
                problems.append(("unexpected", name, (
                    f"{name!r} (as {dn!r}) comes from {job.ranks} trainer ranks as dim-0 "
                    "shards, which only a destination tensor takes (not load_weights); "
                    "give the receiver a dest tensor for it, or map it to None")))
                continue
            sel = None
            if rec.select is not None:
                try:
                    sel = _normalize_select(rec.select(name, sh.shape), sh.shape)
                except Exception as err:
                    problems.append(("select", name, f"select({name!r}, {sh.shape}) "
                                     f"failed: {err}"))
                    continue
            lo, hi = (sel[0].start, sel[0].stop) if sel is not None else (0, sh.shape[0])
            want = (hi - lo, *(s.stop - s.start for s in sel[1:])) if sel else sh.shape
            if tuple(d.shape) != want:
                problems.append(("shape", name, f"{name!r} is {want} as selected (of "
                                 f"{sh.shape} across the ranks) but {dn!r} is "
                                 f"{tuple(d.shape)} in the destination"))
                continue
            del dest[dn]
            for r, (a, b) in enumerate(sh.rows):
                x, y = max(a, lo), min(b, hi)
                if x >= y:
                    continue  # this receiver needs none of rank r's rows
                key = _piece_name(dn, r)
                dest[key] = d[x - lo:y - lo]
                pieces[names[r]] = key
                part = (slice(x - a, y - a), *(sel[1:] if sel else ()))
                parts[names[r]] = _normalize_select(part, (b - a, *sh.shape[1:]))
        self.dest = dest
        self.name_map = lambda n: pieces[n] if n in pieces else base(n)
        user = rec.select
        if user is None and not any(p is not None for p in parts.values()):
            self.select = None
        else:
            def select(n: str, shape: tuple[int, ...]) -> Any:
                if n in pieces:
                    return parts.get(n)
                return user(n, shape) if user is not None else None

            self.select = select


def _remote_load_ranks(actor: Any, attr: str, job: _RankedLoad) -> LoadReport:
    from ray_rdt_pool.weights.receiver import WeightReceiver
    from ray_rdt_pool.weights.remote import _find

    return load_ranks(_find(actor, attr, WeightReceiver), job)


def load_ranks(rec: WeightReceiver, job: _RankedLoad) -> LoadReport:
    """Validate the merged layout whole, then read each bucket from its rank, in the
    job's order, and commit the version once every one landed; a failure leaves the
    version as it was (buckets before it stay written, as for any load)."""
    from ray_rdt_pool.weights.validate import _raise

    v = job.version
    what = "many-rank sync"
    rec._reserve(v, what)
    try:
        problems: list[tuple[str, str, str]] = []
        opts = _RankOptions(rec, job, problems)
        _raise(problems)
        try:
            plan = plan_load(opts, job.layout)
        except ManifestMismatchError as e:
            raise type(e)(f"{e} (the model is the union of {job.ranks} trainer ranks)",
                          e.problems) from None
        readable = {r: src is not None and rec.can_read_source(src)
                    for r, src in enumerate(job.sources)}
        # Per rank, its buckets this receiver needs, in order (a bucket it needs nothing
        # of is not read: its rank is not asked).
        todo: dict[int, list[BucketPlan]] = {}
        for bp in plan.buckets:
            if not (bp.select is not None and bp.nbytes == 0 and not bp.loads):
                todo.setdefault(job.rank_of[bp.index], []).append(bp)
        with rec._writing:
            with rec._lock:
                rec._take_over_locked(v, what)
            reports = _read_ranks(rec, job, todo, readable)
            with rec._lock:
                rec._commit_locked(v, what)
    finally:
        rec._unreserve(v)
    return _summarise(v, sorted(reports, key=lambda x: x.bucket), plan.skipped)


def _read_ranks(rec: WeightReceiver, job: _RankedLoad, todo: Mapping[int, list[BucketPlan]],
                readable: Mapping[int, bool]) -> list[BucketReport]:
    """Load every bucket of ``todo``: one thread per rank (at most
    :data:`MAX_RANK_READS`), each reading its rank's buckets in order, so a receiver
    reads from several ranks at once and no rank's link waits for another's. Buckets
    that go to ``load_weights`` take turns (a loader need not be thread-safe). The
    first failure stops every thread at its next bucket; all have ended on return."""
    import concurrent.futures
    import threading

    reports: list[BucketReport] = []
    loader = threading.Lock()
    stop = threading.Event()

    def one(bp: BucketPlan) -> BucketReport:
        g = bp.index
        r = job.rank_of[g]
        addrs = job.addrs[g]
        ref: Any = job.boxes[g]
        source = None
        if readable[r] and addrs is not None:
            source = job.sources[r]
            ref = SourceBucket(source, addrs)  # type: ignore[arg-type]
        if isinstance(ref, list):
            ref = ref[0]
        try:
            if bp.loads:
                with loader:
                    return rec._load_bucket(bp, ref, source)
            return rec._load_bucket(bp, ref, source)
        except WeightSyncError:
            raise
        except Exception as e:
            raise TrainerRankError(
                f"reading bucket {job.local[g]} of trainer rank {r} failed "
                f"({type(e).__name__}: {e}); this receiver keeps version {rec.version}",
                r) from e

    def rank(bps: list[BucketPlan]) -> list[BucketReport]:
        out = []
        for bp in bps:
            if stop.is_set():
                break
            try:
                out.append(one(bp))
            except BaseException:
                stop.set()
                raise
        return out

    if len(todo) <= 1:
        for bps in todo.values():
            reports.extend(rank(bps))
        return reports
    with concurrent.futures.ThreadPoolExecutor(
            min(len(todo), MAX_RANK_READS), thread_name_prefix="rdt-rank-read") as pool:
        futures = [pool.submit(rank, bps) for bps in todo.values()]
        concurrent.futures.wait(futures)
    for f in futures:
        if f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    for f in futures:
        reports.extend(f.result())
    return reports


#: Most ranks one receiver reads from at once (each READ may take an arena bucket).
MAX_RANK_READS = 8


# -- the driver -------------------------------------------------------------------


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

