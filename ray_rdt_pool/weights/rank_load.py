"""A receiver's side of a many-rank sync (see :mod:`.ranks`): its job and its load.

Owns nothing past one call: :class:`RankedLoad` (what the driver hands each receiver)
is validated whole by :func:`load_ranks`, which reads each bucket from the rank that
holds it, on up to :data:`MAX_RANK_READS` threads (one per rank), and commits only once
every byte landed. Runs on the receiver actor's task thread, holding its write lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ray_rdt_pool.core.selection import Slices
from ray_rdt_pool.errors import (
    InvalidInputError,
    ManifestMismatchError,
    TrainerRankError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from ray_rdt_pool.weights.links import (
    ABORT,
    BYE,
    DONE,
    FAIL,
    GO,
    HELLO,
    READY,
    Link,
    body_box,
    box_body,
)
from ray_rdt_pool.weights.loadplan import BucketPlan, plan_load
from ray_rdt_pool.weights.manifest import PoolBucket, SourceBucket, WeightLayout
from ray_rdt_pool.weights.rank_offer import piece_name
from ray_rdt_pool.weights.receiving import Relayed
from ray_rdt_pool.weights.reports import BucketReport, LoadReport, summarise
from ray_rdt_pool.weights.validate import ReceiverOptions, dest_targets, mapper, normalize_select

if TYPE_CHECKING:
    from ray_rdt_pool.same_node.peer_memory import SourceProcess
    from ray_rdt_pool.weights.weight_receiver import WeightReceiver


@dataclass(frozen=True)
class Sharded:
    """A name held by every rank as dim-0 shards: its full shape and, per rank, the rows
    ``[start, stop)`` of the full tensor it holds."""

    shape: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RankedLoad:
    """One receiver's part of a many-rank sync (what :func:`load_ranks` runs)."""

    group: str  #: the sync's id: the receiver's stream session, the signals' topic
    index: int  #: this receiver's position in the sync's receivers
    version: int
    layout: WeightLayout  #: the merged layout, buckets in this receiver's read order
    boxes: tuple[Any, ...]  #: per merged bucket, its rank's message
    addrs: tuple[tuple[int, ...] | None, ...]
    rank_of: tuple[int, ...]  #: per merged bucket, the rank that holds it
    local: tuple[int, ...]  #: per merged bucket, its index on that rank
    sources: tuple[SourceProcess | None, ...]  #: per rank
    sharded: Mapping[str, Sharded]
    ranks: int
    counts: tuple[int, ...]  #: per rank, its bucket count
    mds: tuple[bytes, ...]  #: per rank, its signal endpoint
    timeout_s: float
    #: per rank, this receiver's place in that rank's relay chain (None: no relay)
    chains: tuple[Chain | None, ...] = ()
    max_inflight: int = 2  #: snapshots a relaying receiver holds at once, per chain


@dataclass(frozen=True)
class Chain:
    """This receiver's place in one rank's relay chain: the receivers before and after
    it (signal endpoints; ``up`` None: it reads from the rank itself)."""

    up: bytes | None
    down: bytes | None


class _Feed:
    """One rank's buckets as this receiver reads them in a relayed many-rank sync: from
    the rank's offer (the chain's first receiver), or from the receiver before it in
    that rank's chain once it signals each bucket READY; and, unless it is last,
    published as they arrived and signalled READY to the receiver after it, which says
    HELLO first (a late one gets nothing). Lives for one load; one thread reads it."""

    def __init__(self, job: RankedLoad, r: int, chain: Chain) -> None:
        self.topic = f"{job.group}/{r}"
        self.link = Link(self.topic)
        self.up = self.link.connect(chain.up) if chain.up is not None else None
        self.down = self.link.connect(chain.down) if chain.down is not None else None
        self.relayed = Relayed(self.topic, self.link.name) if self.down else None
        self.timeout = job.timeout_s + min(job.timeout_s, 30.0)
        self.max_inflight = job.max_inflight
        self.ready: dict[int, Any] = {}
        self.down_hello = False
        self.queued: list[int] = []  # buckets to signal READY once the next says HELLO
        self.down_done = -1

    def start(self) -> None:
        if self.up is not None:
            self.link.send(self.up, HELLO, 0, self.link.md)

    def _take(self, left: float) -> None:
        msg = self.link.get(left)
        while msg is not None:
            if msg.kind == ABORT:
                raise WeightSyncError(f"the relayed sync was given up ({msg.body})")
            if msg.sender == self.up and msg.kind == READY:
                self.ready[msg.item] = msg.body
            elif msg.sender == self.down and msg.kind == HELLO:
                self.down_hello = True
                for k in self.queued:
                    self._forward(k)
                self.queued.clear()
            elif msg.sender == self.down and msg.kind == DONE:
                self.down_done = max(self.down_done, msg.item)
                assert self.relayed is not None
                self.relayed.free(self.down_done)
            msg = self.link.get(0.0)

    def _until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightSyncTimeoutError(f"nothing moved for {self.timeout}s: waiting "
                                             f"until {what} ({self.topic})")
            moved = (len(self.ready), self.down_done, self.down_hello)
            self._take(min(left, 0.05))
            if (len(self.ready), self.down_done, self.down_hello) != moved:
                deadline = time.monotonic() + self.timeout

    def box(self, k: int) -> PoolBucket:
        """Bucket ``k`` as the receiver before this one signalled it."""
        self._until(lambda: k in self.ready, f"the receiver before this one relays bucket {k}")
        return body_box(self.ready.pop(k)[0], None)  # type: ignore[return-value]

    def room(self) -> None:
        """Before a bucket that may become a snapshot: at most ``max_inflight`` held."""
        if self.relayed is not None:
            relayed = self.relayed
            self._until(lambda: len(relayed.snapshots) < self.max_inflight,
                        "the receiver after this one reads a relayed bucket")

    def after(self, k: int) -> None:
        """Bucket ``k`` is written here: tell the one before, signal the one after."""
        if self.up is not None:
            self.link.send(self.up, DONE, k)
        if self.down is not None:
            if self.down_hello:
                self._forward(k)
            else:
                self.queued.append(k)
        self._take(0.0)

    def _forward(self, k: int) -> None:
        assert self.relayed is not None and self.down is not None
        with self.relayed.lock:
            mine = self.relayed.held[k]
        self.link.send(self.down, READY, k, [box_body(mine), None])

    def finish(self, count: int) -> None:
        """Wait until the receiver after this one read every bucket relayed to it."""
        if self.down is not None:
            self._until(lambda: self.down_done >= count - 1,
                        "the receiver after this one read every relayed bucket")

    def close(self) -> None:
        if self.relayed is not None:
            self.relayed.free()
        self.link.close()




class _RankOptions(ReceiverOptions):
    """A receiver's options as a many-rank load sees them: each piece of a sharded
    name maps to the rows of its destination tensor that the piece holds (and the
    receiver's ``select`` keeps), with the part of the piece to read; a piece it needs
    nothing of maps to None (never read). Other names are the receiver's own."""

    def __init__(self, rec: WeightReceiver, job: RankedLoad,
                 problems: list[tuple[str, str, str]]) -> None:
        view = rec._view()
        self.load_weights = view.load_weights
        self.casting = rec.casting
        self.strict = rec.strict
        self.direct = rec.direct
        self.keep_fp8 = rec.keep_fp8
        self.scale_name = rec.scale_name
        base = mapper(rec.name_map)
        dests = dest_targets(view)
        dest: dict[str, torch.Tensor] = dict(dests)
        pieces: dict[str, str | None] = {}
        parts: dict[str, Slices | None] = {}
        taken: dict[str, str] = {}  # destination name -> the sharded name mapped to it
        for name, sh in job.sharded.items():
            names = [piece_name(name, r) for r in range(job.ranks)]
            pieces.update(dict.fromkeys(names))
            try:
                dn = base(name)
                if dn is not None and not isinstance(dn, str):
                    raise TypeError(f"returned a {type(dn).__name__}")
            except Exception as err:
                problems.append(("unexpected", name, (
                    f"name_map({name!r}) failed ({type(err).__name__}: {err}); make it "
                    "return a destination name (a str), or None to skip the tensor")))
                continue
            if dn is None:
                continue
            d = dests.get(dn)
            if d is None:
                if rec.strict:
                    problems.append(("unexpected", name, (
                        f"{name!r} (as {dn!r}) comes from {job.ranks} trainer ranks as "
                        "dim-0 shards, which only a destination tensor takes (not "
                        "load_weights); give the receiver a dest tensor for it, map it to "
                        "None, or pass strict=False to skip it")))
                continue
            if dn in taken:
                problems.append(("duplicate", name, (
                    f"{name!r} and {taken[dn]!r} both map to destination {dn!r}; map one "
                    "of them elsewhere or to None")))
                continue
            taken[dn] = name
            sel = None
            if rec.select is not None:
                try:
                    sel = normalize_select(rec.select(name, sh.shape), sh.shape)
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
                key = piece_name(dn, r)
                dest[key] = d[x - lo:y - lo]
                pieces[names[r]] = key
                part = (slice(x - a, y - a), *(sel[1:] if sel else ()))
                parts[names[r]] = normalize_select(part, (b - a, *sh.shape[1:]))
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


def remote_load_ranks(actor: Any, attr: str, job: RankedLoad) -> LoadReport:
    from ray_rdt_pool.weights.remote import find_attr
    from ray_rdt_pool.weights.weight_receiver import WeightReceiver

    return load_ranks(find_attr(actor, attr, WeightReceiver), job)


def load_ranks(rec: WeightReceiver, job: RankedLoad) -> LoadReport:
    """Validate the merged layout whole, say HELLO to every rank and wait for its GO,
    then read each bucket from its rank and say BYE. Commits nothing: the receiver holds
    the sync as a stream (``job.group``) that the driver's commit call finishes once
    every receiver and rank is done. A failure signals FAIL to the ranks; buckets read
    before it stay written, the version stays."""
    from ray_rdt_pool.weights.validate import raise_problems

    link = Link(job.group)
    ranks = [link.connect(md) for md in job.mds]
    v = job.version
    what = "many-rank sync"
    try:
        rec._reserve(v, what)
        try:
            problems: list[tuple[str, str, str]] = []
            opts = _RankOptions(rec, job, problems)
            raise_problems(problems)
            try:
                plan = plan_load(opts, job.layout)
            except ManifestMismatchError as e:
                raise type(e)(f"{e} (the model is the union of {job.ranks} trainer ranks)",
                              e.problems) from None
            readable = {r: src is not None and rec._can_read_source(src)
                        for r, src in enumerate(job.sources)}
            # Per rank, its buckets this receiver needs, in order (a bucket it needs
            # nothing of is not read).
            todo: dict[int, list[BucketPlan]] = {}
            for bp in plan.buckets:
                if not (bp.select is not None and bp.nbytes == 0 and not bp.loads):
                    todo.setdefault(job.rank_of[bp.index], []).append(bp)
            heads = [ranks[r] for r in range(job.ranks)
                     if not job.chains or (job.chains[r] is not None
                                           and job.chains[r].up is None)]  # type: ignore[union-attr]
            if job.chains and any(bp.select is not None for bp in plan.buckets):
                raise InvalidInputError(
                    "a relayed many-rank sync has every receiver relay some rank's part "
                    "to the next, so none may read only part of it (select=); sync "
                    "receivers with a select without relay")
            feeds = {r: _Feed(job, r, c) for r, c in enumerate(job.chains) if c is not None}
            try:
                _hello(link, heads, job)
                for feed in feeds.values():
                    feed.start()
                with rec._writing:
                    with rec._lock:
                        rec._take_over_locked(v, what)
                        rec._hold_locked(job.group, v, plan, rec._shard_of(
                            job.layout, {n: sh.shape for n, sh in job.sharded.items()}))
                    rec._begin_writing()
                    reports = _read_ranks(rec, job, todo, readable,
                                          lambda r, k: link.send(ranks[r], DONE, k), feeds)
                    for r, feed in feeds.items():
                        feed.finish(job.counts[r])
                    rec._all_loaded(job.group, len(plan.buckets))
            finally:
                for feed in feeds.values():
                    feed.close()
        except BaseException:
            rec._unreserve_unheld(job.group, v)
            raise
        link.tell(heads, BYE, job.index)
    except BaseException as e:
        link.tell(ranks, FAIL, job.index, f"{type(e).__name__}: {e}"[:2000])
        rec._abort_stream(job.group)
        raise
    finally:
        link.close()
    return summarise(v, sorted(reports, key=lambda x: x.bucket), plan.skipped)


def _hello(link: Link, ranks: list[str], job: RankedLoad) -> None:
    """Say HELLO to every rank and wait for each one's GO: a rank that gave the sync up
    (this receiver came late) answers nothing, or ABORT, and nothing is read."""
    import time

    for name in ranks:
        link.send(name, HELLO, job.index, link.md)
    waiting = set(ranks)
    # Longer than a rank's serve waits for a receiver: two syncs of the same ranks may
    # each hold a rank and a receiver the other needs (a plain actor runs one call at a
    # time), and then the serve gives up first, so the receiver's sync can go on.
    patience = job.timeout_s + min(job.timeout_s, 30.0)
    deadline = time.monotonic() + patience
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WeightSyncTimeoutError(
                f"{len(waiting)} trainer rank(s) did not answer this receiver's start of "
                f"many-rank sync {job.group} within {patience}s (the sync was given up "
                "before this receiver got to it?); nothing was read, the version stays "
                "as it was")
        msg = link.get(left)
        if msg is None:
            continue
        if msg.kind == ABORT:
            raise WeightSyncError(f"many-rank sync {job.group} was given up before this "
                                  "receiver read anything; its version stays as it was")
        if msg.kind == GO:
            waiting.discard(msg.sender)
            deadline = time.monotonic() + patience


def _read_ranks(rec: WeightReceiver, job: RankedLoad, todo: Mapping[int, list[BucketPlan]],
                readable: Mapping[int, bool], done: Callable[[int, int], None],
                feeds: Mapping[int, _Feed]) -> list[BucketReport]:
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
        r, k = job.rank_of[g], job.local[g]
        feed = feeds.get(r)
        addrs = job.addrs[g]
        ref: Any = job.boxes[g]
        source = None
        if feed is not None and feed.up is not None:
            ref = feed.box(k)  # from the receiver before this one in rank r's chain
        elif readable[r] and addrs is not None:
            source = job.sources[r]
            ref = SourceBucket(source, addrs)  # type: ignore[arg-type]
        if isinstance(ref, list):
            ref = ref[0]
        relay = None
        if feed is not None and feed.relayed is not None:
            feed.room()
            relayed = feed.relayed

            def relay(plan: BucketPlan, src: Any) -> None:
                relayed.publish(plan, src, k)  # as bucket k of rank r's chain
        try:
            if bp.loads:
                with loader:
                    out = rec._load_bucket(bp, ref, source, relay)
            else:
                out = rec._load_bucket(bp, ref, source, relay)
            if feed is None or feed.up is None:
                done(r, k)
            if feed is not None:
                feed.after(k)
            return out
        except WeightSyncError:
            raise
        except Exception as e:
            if feed is not None and feed.up is not None:
                raise WeightSyncError(
                    f"reading bucket {k} of trainer rank {r} from the receiver before "
                    f"this one in its relay chain failed ({type(e).__name__}: {e})") from e
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
