"""One streamed sync on the sender: :class:`StreamSession`, what ``WeightSender.stream``
runs.

Owns the stream's buckets from the moment they are made until every receiver
acknowledged them (or, on failure, until they are freed or handed to
:data:`~ray_rdt_pool.weights.late._LATE`), and the stream's protocol with its receivers:
begin, one call per bucket (or run of buckets), commit, and abort on failure. A session
is made for one ``stream()`` call, runs once and is dropped when the call returns or
raises. Only the calling thread (the trainer's task thread) touches it.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ray_rdt_pool.errors import DuplicateNameError
from ray_rdt_pool.registry import storage_key
from ray_rdt_pool.weights.late import _LATE, _InFlight
from ray_rdt_pool.weights.manifest import (
    BucketLayout,
    SourceBucket,
    TensorEntry,
    WeightLayout,
    _dtype_str,
)
from ray_rdt_pool.weights.planning import (
    LayoutMemo,
    _conversions,
    _iter_buckets,
    plan_layout,
)
from ray_rdt_pool.weights.pool import (
    _fits,
    _free_owned,
    _owned_bucket,
    _pool_capacity,
    _registration_cache_bytes,
    _stats,
    _too_big,
    _wait_for_pool,
)
from ray_rdt_pool.weights.remote import (
    _ended,
    _get_all,
    _remote_abort,
    _remote_begin,
    _remote_bucket,
    _remote_finish,
    _remote_run,
    _wait_quietly,
)
from ray_rdt_pool.weights.reports import BucketReport, StreamReport, _ranges, _summarise
from ray_rdt_pool.weights.state import StateLike, WireDtype

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from ray_rdt_pool.same_node.source import SourceProcess

#: One bucket to send: its packed bytes, its tensors, its layout (a lazy source's; None
#: for a module or mapping, whose receivers have the whole layout) and its entries.
_Item = tuple[int, list[torch.Tensor], BucketLayout | None, Sequence[TensorEntry]]


@dataclass
class _Run:
    """Consecutive buckets of a module or mapping that are not packed, gathered to go to
    each receiver in one task: their indices, boxes and kept tensors."""

    ks: list[int] = field(default_factory=list)
    boxes: list[list[Any]] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)

    def add(self, k: int, box: list[Any], kept: list[torch.Tensor]) -> None:
        self.ks.append(k)
        self.boxes.append(box)
        self.kept.extend(kept)


def _source_readable(tensors: Sequence[torch.Tensor], entries: Sequence[TensorEntry]) -> bool:
    """Can receivers copy these bytes as they lie (CPU, contiguous, no lazy bit, no
    wire-dtype conversion)? Otherwise the bucket goes through the pool."""
    return len(tensors) == len(entries) and all(
        t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()
        and _dtype_str(t.dtype) == e.dtype for t, e in zip(tensors, entries))


class StreamSession:
    """One run of :meth:`~ray_rdt_pool.weights.WeightSender.stream` (its docstring gives
    the semantics): :meth:`plan` buckets the weights, :meth:`run` begins the stream on
    every receiver, sends every bucket and commits, or cleans up; :meth:`report` sums it
    up. Each bucket goes to the receivers through :meth:`_send`, the one place that
    talks to them per bucket.
    """

    #: What begins the stream on each receiver (a relay begins it its own way).
    BEGIN: Any = staticmethod(_remote_begin)

    def __init__(self, receivers: list[ActorHandle], version: int, *, receiver_attr: str,
                 max_inflight: int, timeout_s: float, bucket_bytes: int,
                 wire_dtype: WireDtype, source_reads: bool, by_reference: bool) -> None:
        self.receivers = receivers
        self.version = version
        self.attr = receiver_attr
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.wire_dtype = wire_dtype
        self.source_reads = source_reads
        # The sender's own module or mapping (not a state= or a callable's state, which
        # may be new memory each sync, registered and kept every time) may go by reference.
        self.by_reference = by_reference
        self.session = ""  # the id receivers know this stream by (set by plan)
        self.capacity = 0  # the sender pool's bytes
        self.layout: WeightLayout | None = None  # None: a lazy source, bucketed as it comes
        self.items: Iterator[_Item] = iter(())
        self.biggest = 0  # the largest bucket so far (all of them for a module or mapping)
        self.src_proc: SourceProcess | None = None  # this process, for source reads
        self.begins: list[Any] = []
        self.finishes: list[Any] = []
        # Source reads only when every receiver can: a bucket is then never packed.
        self.direct = False
        # Receivers READ the source's tensors where they lie, over NIXL (see _negotiate).
        self.by_ref = False
        self.direct_buckets = 0
        self.ref_buckets = 0
        self.ref_keys: set[Any] = set()  # storages sent by reference, kept registered
        self.fallbacks0 = 0
        self.used0 = 0  # pool_used when the stream began
        #: pool_used right after each bucket was made (it only grows then: the peak)
        self.samples: list[int] = []
        self.wait_s = 0.0  # seconds spent waiting for pool room
        # Per bucket (or run) in flight, oldest first: the receivers' acks, a source-read
        # or by-reference bucket's tensors, kept alive (so unmoved) until every receiver
        # has read them, and a pool bucket's object id, freed only then. At most
        # max_inflight entries.
        self.inflight: deque[_InFlight] = deque()
        self.owned: str | None = None  # a pool bucket packed but not yet in ``inflight``
        # A module's or mapping's buckets read in place go out together, one task per
        # receiver for a run of them: the tensors they keep are the source's own (no
        # memory beyond the model), describing them costs nothing, and each task costs a
        # Ray round trip of its own. (Buckets by reference are described one by one, a
        # registration lookup and the wire bytes each: sent as they are made, the
        # receivers READ one while the next is described.)
        self.gathered = _Run()
        self.gather = True  # a relay sends every bucket on its own, to pipeline the chain
        self.acked: list[list[BucketReport]] = [[] for _ in receivers]  # per receiver
        self.skipped: list[int] = []  # per receiver, from its commit
        self.k = 0  # buckets made so far
        self.sent = 0  # payload bytes of every bucket sent (a module's layout.total_bytes)

    # -- before any receiver is called --

    def plan(self, state: StateLike | None, pairs: Iterator[tuple[str, torch.Tensor]] | None,
             memo: LayoutMemo | None = None) -> None:
        """Bucket ``state`` now (a bucket larger than the pool raises here; ``memo``: the
        sender's last layout, reused if nothing changed), or get ready to bucket the lazy
        ``pairs`` as they come."""
        self.capacity = capacity = _pool_capacity()
        bb = self.bucket_bytes
        if state is not None:
            layout, groups = (memo.plan(state, bb, self.wire_dtype) if memo is not None
                              else plan_layout(state, bb, self.wire_dtype))
            for b in layout.buckets:
                if b.nbytes > capacity:
                    raise _too_big(b, capacity)
            self.biggest = max((b.nbytes for b in layout.buckets), default=0)
            per_bucket: list[list[TensorEntry]] = [[] for _ in layout.buckets]
            for e in layout.entries:
                per_bucket[e.bucket].append(e)
            self.layout = layout
            self.items = ((b.nbytes, g, None, es)
                          for b, g, es in zip(layout.buckets, groups, per_bucket))
        else:
            assert pairs is not None
            self.items = ((p.spec.bucket.nbytes, p.tensors, p.spec, p.spec.entries)
                          for p in _iter_buckets(pairs, bb, self.wire_dtype))
        self.session = f"{os.getpid()}-{self.version}-{uuid.uuid4().hex[:8]}"
        if self.source_reads:
            from ray_rdt_pool._ray.owned import source_process

            self.src_proc = source_process()

    # -- the stream --

    def run(self) -> None:
        """Begin the stream on every receiver, send every bucket, then commit. On any
        error: drain, abort on every receiver, free every bucket (see :meth:`_clean_up`),
        then raise it."""
        self.begins = [r.__ray_call__.remote(self.BEGIN, self.attr, self.session,
                                             self.layout, self.version, self.src_proc)
                       for r in self.receivers]
        st0 = _stats()
        self.fallbacks0 = st0.fallbacks
        self.used0 = int(st0.pool_used)
        try:
            self._negotiate()
            self._send_all()
            self._commit()
        except BaseException as e:
            self._clean_up()
            if isinstance(e, DuplicateNameError):
                applied = sorted(set.intersection(*[{r.bucket for r in a} for a in self.acked]))
                raise DuplicateNameError(
                    e.name, e.bucket, applied,
                    f"bucket(s) {_ranges(applied)} were loaded on every receiver before it; "
                    f"no receiver committed version {self.version} (their versions are "
                    "unchanged)") from None
            raise

    def _negotiate(self) -> None:
        """Wait for every receiver to begin, then choose how buckets travel."""
        began = _get_all(self.begins, self.timeout_s, "validating the layout on the receivers")
        self.direct = self.src_proc is not None and all(ok for _sk, ok in began)
        # Otherwise, for the module or mapping this sender holds, receivers READ the
        # tensors where they lie over NIXL: their storages stay registered between
        # syncs (so the metadata does not change) without holding memory the source
        # does not hold itself.
        self.by_ref = (self.source_reads and not self.direct and self.layout is not None
                       and self.by_reference
                       and self.layout.total_bytes <= _registration_cache_bytes())

    def _send_all(self) -> None:
        while True:
            while len(self.inflight) >= self.max_inflight:
                self._retire()
            if self.layout is None and not self.direct:
                # Lazy: pull the next bucket's tensors only once a full bucket fits.
                self.wait_s += self._make_room(min(self.bucket_bytes, self.capacity),
                                               self._limit())
            item = next(self.items, None)
            if item is None:
                self._send_gathered()
                return
            nbytes, tensors, spec, entries = item
            del item
            self._send_bucket(nbytes, tensors, spec, entries)
            del tensors

    def _limit(self) -> int:
        """Double buffering in bytes: this stream's buckets may hold at most max_inflight
        buckets' worth of the pool, counting freed buckets whose blocks a same-node
        receiver's mapping still leases."""
        return min(self.capacity,
                   self.used0 + self.max_inflight * max(self.bucket_bytes, self.biggest))

    def _send_bucket(self, nbytes: int, tensors: list[torch.Tensor],
                     spec: BucketLayout | None, entries: Sequence[TensorEntry]) -> None:
        """Make bucket ``self.k`` (a source address, a by-reference object or a pool
        object) and send it, or gather it into the run to send."""
        k = self.k
        self.sent += sum(e.nbytes for e in entries)
        if nbytes > self.capacity:
            assert spec is not None
            raise _too_big(spec.bucket, self.capacity)
        self.biggest = max(self.biggest, nbytes)
        keep: list[torch.Tensor] | None = None
        box: list[Any]
        if self.direct and _source_readable(tensors, entries):
            assert self.src_proc is not None
            box = [SourceBucket(self.src_proc, tuple(t.data_ptr() for t in tensors))]
            keep = tensors
            self.direct_buckets += 1
        elif self.by_ref and _source_readable(tensors, entries):
            self.owned = f"ws:{self.session}/{k}"
            self.ref_keys.update(storage_key(t) for t in tensors if t.numel())
            box = [_owned_bucket(self.owned, tensors, entries, by_reference=True)]
            keep = tensors
            self.ref_buckets += 1
        else:
            self._send_gathered()
            # A conversion or a CUDA tensor packs into one contiguous block.
            one_block = any(t.is_cuda for t in tensors) or bool(_conversions(tensors, entries))
            self.wait_s += self._make_room(nbytes, self._limit(), one_block)
            self.owned = f"ws:{self.session}/{k}"
            box = [_owned_bucket(self.owned, tensors, entries)]
            tensors.clear()  # the pool holds the snapshot; drop the source's tensors
        del tensors
        if keep is not None and self.layout is not None and self.owned is None and self.gather:
            # A bucket read in place adds nothing to the pool: the last sample stands
            # (a stats() call per bucket costs as much as describing it).
            self.samples.append(self.samples[-1] if self.samples else int(_stats().pool_used))
            self.gathered.add(k, box, keep)
            del keep, box
            self.k += 1
            return
        try:
            self.samples.append(int(_stats().pool_used))
            # In flight before the first call: if a later receiver's call cannot even be
            # made, the clean-up still sees the earlier calls, which may read the bucket.
            acks: list[Any] = []
            self.inflight.append(_InFlight(acks, keep, [self.owned] if self.owned else []))
            self.owned = None
            self._send(acks, [k], [box], spec)
        finally:
            box.clear()
            del keep
        self.k += 1

    def _send_gathered(self) -> None:
        """Send the run gathered so far, if any, as one call per receiver."""
        run = self.gathered
        if not run.ks:
            return
        acks: list[Any] = []
        self.inflight.append(_InFlight(acks, run.kept, []))  # before the first call
        self.gathered = _Run()
        self._send(acks, run.ks, run.boxes, together=True)

    def _send(self, acks: list[Any], ks: list[int], boxes: list[list[Any]],
              spec: BucketLayout | None = None, together: bool = False) -> None:
        """Ask every receiver to load buckets ``ks`` (``boxes[i]`` holds the message of
        bucket ``ks[i]``), one call per receiver, appending each call to ``acks`` as soon
        as it is made (``acks[i]`` answers for ``receivers[i]``: the reports of the
        buckets it loaded). ``together``: a run, loaded in order by one
        ``_remote_run`` call; else one bucket, with a lazy source's ``spec``, by
        ``_remote_bucket``.

        Every receiver reads each bucket from this process. This is the one method that
        decides which receiver reads what from where: a relay replaces it (and keeps the
        contract on ``acks``), the rest of the session is the same.
        """
        for r in self.receivers:
            if together:
                acks.append(r.__ray_call__.remote(_remote_run, self.attr, self.session, ks,
                                                  boxes))
            else:
                acks.append(r.__ray_call__.remote(_remote_bucket, self.attr, self.session,
                                                  ks[0], boxes[0], spec))

    def _retire(self) -> None:
        """Wait for the oldest bucket in flight on every receiver, then drop it. Its acks are
        collected before it leaves ``inflight``: a source-read bucket's tensors and a pool
        bucket's block must outlive the receivers' reads (a receiver's failure leaves it in
        ``inflight`` for the clean-up). The list is emptied, not just dropped, since the
        lazy bucket iterator still refers to it until it has made the next bucket's
        tensors."""
        self._collect(self.inflight[0].acks)
        _acks, kept, oids = self.inflight.popleft()
        if kept is not None:
            kept.clear()
        _free_owned(oids)

    def _collect(self, acks: list[Any]) -> None:
        import ray

        # Wait for every receiver first, so one receiver's error is raised only after the
        # others are done with this bucket too (their refs drain before we give up).
        ray.wait(acks, num_returns=len(acks), timeout=self.timeout_s)
        for i, reps in enumerate(_get_all(acks, self.timeout_s,
                                          "waiting for receivers to load a bucket")):
            self.acked[i].extend(reps)  # a receiver may load buckets that arrived early

    def _make_room(self, nbytes: int, limit: int, one_block: bool = False) -> float:
        """Block until ``nbytes`` fit the sender pool (see :func:`_fits`), retiring this
        stream's buckets in flight, oldest first, while they do not: their blocks are what
        usually holds the room, and only this thread frees them (a pool of fewer than
        ``max_inflight`` buckets would otherwise wait for itself). Then wait for the rest
        (blocks a same-node receiver still maps, other objects). Returns the seconds
        waited."""
        t0 = time.monotonic()
        while self.inflight and not _fits(_stats(), nbytes, limit, self.capacity, one_block):
            self._retire()
        _wait_for_pool(nbytes, limit, self.capacity, self.timeout_s, one_block)
        return time.monotonic() - t0

    def _commit(self) -> None:
        while self.inflight:
            self._retire()
        # Every receiver has every bucket: only now may they commit (a receiver that
        # commits at its last bucket would commit a stream this sender gave up on).
        self.finishes = [r.__ray_call__.remote(_remote_finish, self.attr, self.session, self.k)
                         for r in self.receivers]
        self.skipped = _get_all(self.finishes, self.timeout_s,
                                "committing the stream on the receivers")

    def _release_inflight(self) -> None:
        """Free the in-flight buckets whose receiver calls have all ended; those still
        being read go to the late list, to be freed when their calls end."""
        late = [f for f in self.inflight if not _ended(f.acks)]
        gone = {id(f) for f in late}
        _free_owned([o for f in self.inflight if id(f) not in gone for o in f.owned]
                    + [self.owned])
        if late:
            _LATE.add(late, self.session)
        self.inflight.clear()

    def _clean_up(self) -> None:
        """After a failure: let the receivers finish (or fail) what they hold so every
        ref drains, then have every receiver that began drop the stream (and any bucket
        it holds out of order: one that was refused, or that failed, holds nothing to
        drop), then free the buckets."""
        import ray

        pending = [a for f in self.inflight for a in f.acks] + self.begins + self.finishes
        if pending:
            _wait_quietly(pending, self.timeout_s)
            for f in self.inflight:
                for i, a in enumerate(f.acks):
                    try:
                        self.acked[i].extend(ray.get(a, timeout=0))
                    except Exception:  # the error that counts is the stream's
                        pass
        aborts = [r.__ray_call__.remote(_remote_abort, self.attr, self.session)
                  for r in self.receivers]
        _wait_quietly(aborts, min(self.timeout_s, 30.0))
        # Only now: a receiver still loading a bucket reads its pool block (or the
        # source's kept tensors). One whose call has not ended even so (a plain actor
        # runs the bucket calls queued before the abort; a stuck receiver) may still
        # read it: such buckets are let go only once that call ends.
        self._release_inflight()
        self.gathered = _Run()

    def report(self, t0: float) -> StreamReport:
        """The stream as the sender saw it, from ``t0`` (``time.perf_counter()``) on."""
        loads = tuple(_summarise(self.version, sorted(reps, key=lambda r: r.bucket), sk)
                      for reps, sk in zip(self.acked, self.skipped))
        return StreamReport(
            version=self.version, buckets=self.k, nbytes=self.sent,
            receivers=len(self.receivers), max_inflight=self.max_inflight,
            seconds=time.perf_counter() - t0, pool_capacity=self.capacity,
            peak_pool_used=max(self.samples, default=0), pool_used_samples=tuple(self.samples),
            fallbacks=int(_stats().fallbacks - self.fallbacks0), pool_wait_seconds=self.wait_s,
            loads=loads, source_read_buckets=self.direct_buckets,
            reference_buckets=self.ref_buckets)
