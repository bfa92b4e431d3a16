"""One streamed sync on the trainer: :class:`StreamSession`, what
``WeightSender.stream`` runs, plain or relayed down a chain (``relay="chain"``).

A stream costs each receiver three Ray calls whatever its bucket count: ``begin``
(validate and reserve the version), ``receive`` (its bucket loop, one call for the
whole sync: :mod:`.receiving`) and ``finish`` (commit). Inside, the buckets travel on
the data plane (:mod:`.links`): the trainer packs bucket ``k`` and signals ``READY``
to the receivers that read from it (every receiver, or the chain's first), each of
them signals ``DONE`` when it wrote the bucket, and the trainer reuses a bucket's pool
memory once every reader is done with it. At most ``max_inflight`` buckets are out at
once: the trainer packs bucket ``k+1`` while ``k`` is read, and waits on ``DONE``
credits, not on Ray. Every receiver also tells the trainer its progress, so a receiver
that stops answering for ``timeout_s`` is named; one that dies is named from its Ray
call.

Owns the stream's buckets from the moment they are made until every reader signalled
``DONE`` (or, on failure, until every receiver call that may read them ended: then
freed at once, or handed to :data:`~ray_rdt_pool.weights.late.LATE`), and the
session's signals on the trainer. A session is made for one ``stream()`` call, runs
once and is dropped when it returns or raises. Only the calling thread touches it.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ray_rdt_pool._ray.beats import Beat
from ray_rdt_pool.errors import (
    CommitHookError,
    DuplicateNameError,
    InvalidInputError,
    ReceiverError,
    RelayReceiverError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from ray_rdt_pool.registry import storage_key
from ray_rdt_pool.weights.fp8 import WireScale
from ray_rdt_pool.weights.late import LATE, InFlight
from ray_rdt_pool.weights.links import (
    ABORT,
    DONE,
    END,
    FAIL,
    HELLO,
    PROGRESS,
    READY,
    Link,
    box_body,
    spec_body,
)
from ray_rdt_pool.weights.manifest import (
    DEFAULT_WIRE_SCALE,
    BucketLayout,
    SourceBucket,
    TensorEntry,
    WeightLayout,
    dtype_str,
)
from ray_rdt_pool.weights.planning import (
    LayoutMemo,
    conversions,
    iter_buckets,
    plan_layout,
)
from ray_rdt_pool.weights.pool import (
    bucket_fits,
    count_ray_calls,
    free_bucket,
    owned_bucket,
    pool_stats,
    registration_cache_bytes,
    sender_pool_capacity,
    too_big,
    wait_for_pool,
)
from ray_rdt_pool.weights.remote import (
    Began,
    Role,
    calls_ended,
    get_all,
    remote_abort,
    remote_begin,
    remote_finish,
    remote_receive,
    wait_quietly,
)
from ray_rdt_pool.weights.reports import BucketReport, StreamReport, ranges, summarise
from ray_rdt_pool.weights.state import StateLike, WireDtype

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from ray_rdt_pool.same_node.peer_memory import SourceProcess

#: The relays :meth:`WeightSender.stream` offers.
RELAYS = ("chain",)
#: How a chain is ordered: as the caller listed the receivers, or by Ray node.
ORDERS = ("caller", "placement")
#: How often a wait for signals also asks Ray whether a receiver's call failed (s).
CHECK_CALLS_S = 0.05

#: One bucket to send: its packed bytes, its tensors, its layout (a lazy source's; None
#: for a module or mapping, whose receivers have the whole layout) and its entries.
_Item = tuple[int, list[torch.Tensor], BucketLayout | None, Sequence[TensorEntry]]


def commit_all(finishes: list[Any], version: int, timeout_s: float,
               named: Callable[[int, BaseException], BaseException]) -> list[Any]:
    """The answers of a sync's commit calls (one per receiver, each committing by
    ``timeout_s`` from now or never). The first failure is raised, as ``named(i, e)``
    makes it, with the receivers that did commit (``.committed`` where the error has it,
    and in its message: commits are one by one, with no atomicity across receivers). A
    receiver whose ``on_commit`` raised committed: its :class:`CommitHookError` is
    raised only if nothing else failed."""
    import ray

    ray.wait(finishes, num_returns=len(finishes), timeout=timeout_s + min(timeout_s, 30.0))
    out: list[Any] = []
    first: BaseException | None = None
    hook: BaseException | None = None
    committed: list[int] = []
    for i, ref in enumerate(finishes):
        try:
            out.append(ray.get(ref, timeout=0))
            committed.append(i)
        except CommitHookError as e:
            committed.append(i)
            if hook is None:
                hook = _own(e)
                hook.receiver = i  # type: ignore[attr-defined]
        except BaseException as e:
            first = first or named(i, e)
    first = first or hook
    if first is None:
        return out
    if committed:
        first = _own(first)
        if hasattr(first, "committed"):
            first.committed = tuple(committed)
        if isinstance(first, WeightSyncError) and first.args:
            first.args = (f"{first.args[0]}; receiver(s) {committed} committed version "
                          f"{version}", *first.args[1:])
    raise first


def _own(e: BaseException) -> BaseException:
    """A receiver's own exception out of Ray's task error: what to amend and raise again
    (Ray rebuilds a task error from its cause, dropping what was set on the wrapper)."""
    from ray.exceptions import RayTaskError

    cause = getattr(e, "cause", None)
    return cause if isinstance(e, RayTaskError) and isinstance(cause, BaseException) else e


def new_session(version: int) -> str:
    """A new stream's id, unique across the cluster (receivers and signals know it)."""
    return f"{os.getpid()}-{version}-{uuid.uuid4().hex[:8]}"


def check_relay(relay: Any, order: Any) -> None:
    """InvalidInputError unless ``relay`` is None or one of :data:`RELAYS` and ``order``
    one of :data:`ORDERS`."""
    if relay is not None and relay not in RELAYS:
        raise InvalidInputError(f"relay must be None or one of {RELAYS}, got {relay!r}")
    if order not in ORDERS:
        raise InvalidInputError(f"relay_order must be one of {ORDERS}, got {order!r}")


def chain_order(began: Sequence[Began], order: str, here: str | None) -> list[int]:
    """The receivers' indices in chain order: as given, or grouped by Ray node (this
    node's first, then in order of first appearance)."""
    idx = list(range(len(began)))
    if order == "caller":
        return idx
    first: dict[str, int] = {}
    for i, b in enumerate(began):
        first.setdefault(b.node, i)
    return sorted(idx, key=lambda i: (began[i].node != here, first[began[i].node], i))


def source_readable(tensors: Sequence[torch.Tensor], entries: Sequence[TensorEntry]) -> bool:
    """Can receivers copy these bytes as they lie (CPU, contiguous, no lazy bit, no
    wire-dtype conversion)? Otherwise the bucket goes through the pool."""
    return len(tensors) == len(entries) and all(
        t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()
        and dtype_str(t.dtype) == e.dtype for t, e in zip(tensors, entries))


class _Out(NamedTuple):
    """A bucket out for reading: its message (a READY's body) and what must outlive the
    reads (the pool object, or the source tensors read in place)."""

    k: int
    body: list[Any]
    spec: list[Any] | None
    held: InFlight


class StreamSession:
    """One run of :meth:`~ray_rdt_pool.weights.WeightSender.stream` (its docstring gives
    the semantics): :meth:`plan` buckets the weights, :meth:`run` begins the stream on
    every receiver, starts their receive calls, sends every bucket on the data plane,
    then commits, or cleans up; :meth:`report` sums it up.
    """

    def __init__(self, receivers: list[ActorHandle], version: int, *, receiver_attr: str,
                 max_inflight: int, timeout_s: float, bucket_bytes: int,
                 wire_dtype: WireDtype, source_reads: bool, by_reference: bool,
                 wire_scale: WireScale = DEFAULT_WIRE_SCALE,
                 relay: str | None = None, order: str = "caller",
                 beat: Beat | None = None, peer: bool = False, session: str = "",
                 peer_shard: Any = None) -> None:
        self.receivers = receivers
        self.version = version
        self.attr = receiver_attr
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.wire_dtype = wire_dtype
        self.wire_scale = wire_scale
        self.source_reads = source_reads
        # The sender's own module or mapping (not a state= or a callable's state, which
        # may be new memory each sync, registered and kept every time) may go by reference.
        self.by_reference = by_reference
        self.relay = relay
        self.order = order
        self.peer = peer  # an engine's receiver serves its weights (catch_up)
        self.peer_shard = peer_shard  # which shard it holds (see WeightReceiver._shard)
        # The driver's wait: progress is told to it, and it may cancel (no commit then).
        self.beat = beat if beat is not None else Beat(None, 1.0)
        # The id receivers know this stream by: the driver's, so that it can abort the
        # stream on them if this process dies; else one of its own (set by plan).
        self.session = session
        self.capacity = 0  # the sender pool's bytes
        self.layout: WeightLayout | None = None  # None: a lazy source, bucketed as it comes
        self.items: Iterator[_Item] = iter(())
        self.biggest = 0  # the largest bucket so far (all of them for a module or mapping)
        self.src_proc: SourceProcess | None = None  # this process, for source reads
        self.link: Link | None = None
        n = len(receivers)
        self.began: list[Began] = []
        self.begins: list[Any] = []
        self.calls: list[Any] = [None] * n  # each receiver's receive call
        self.finishes: list[Any] = []
        self.ray_calls = 0
        self.names: list[str] = [""] * n  # each receiver's signal endpoint
        self.index: dict[str, int] = {}  # endpoint name -> receiver
        self.chain: list[int] = list(range(n))  # receiver indices in chain order
        self.first: list[int] = list(range(n))  # the receivers that read from the trainer
        self.hello = [False] * n
        self.done = [-1] * n  # per receiver, the last bucket it signalled DONE
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
        # Buckets out for reading, oldest first, until every first-hop reader is done:
        # at most max_inflight.
        self.out: deque[_Out] = deque()
        self.owned: str | None = None  # a pool bucket packed but not yet in ``out``
        self.acked: list[list[BucketReport]] = [[] for _ in receivers]  # per receiver
        self.skipped: list[int] = []  # per receiver, from its commit
        self.k = 0  # buckets made so far
        self.count: int | None = None  # buckets in all, once the last was made
        self.sent = 0  # payload bytes of every bucket sent (a module's layout.total_bytes)
        self.stuck: int | None = None  # the receiver that stopped answering, if one did
        self.failed: BaseException | None = None
        self._next_check = 0.0

    # -- before any receiver is called --

    def plan(self, state: StateLike | None, pairs: Iterator[tuple[str, torch.Tensor]] | None,
             memo: LayoutMemo | None = None) -> None:
        """Bucket ``state`` now (a bucket larger than the pool raises here; ``memo``: the
        sender's last layout, reused if nothing changed), or get ready to bucket the lazy
        ``pairs`` as they come."""
        self.capacity = capacity = sender_pool_capacity()
        bb = self.bucket_bytes
        if state is not None:
            layout, groups = (memo.plan(state, bb, self.wire_dtype, self.wire_scale)
                              if memo is not None
                              else plan_layout(state, bb, self.wire_dtype, self.wire_scale))
            for b in layout.buckets:
                if b.nbytes > capacity:
                    raise too_big(b, capacity)
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
                          for p in iter_buckets(pairs, bb, self.wire_dtype,
                                                 self.wire_scale))
        self.session = self.session or new_session(self.version)
        if self.source_reads:
            from ray_rdt_pool._ray.owned import source_process

            self.src_proc = source_process()

    # -- the stream --

    def run(self) -> None:
        """Begin the stream on every receiver, start their receive calls, send every
        bucket, then commit. On any error: signal ABORT, let the receivers' calls end,
        abort on every receiver, free every bucket (see :meth:`_clean_up`), raise it."""
        self.link = link = Link(self.session)
        # Each phase that ends is progress: a first sync in a fresh process spends
        # seconds of a loaded host creating its signal agent before any bucket moves.
        self._beat_quietly()
        try:
            st0 = pool_stats()
            self.fallbacks0 = st0.fallbacks
            self.used0 = int(st0.pool_used)
            relay = self.relay is not None
            self.begins = [r.__ray_call__.remote(remote_begin, self.attr, self.session,
                                                 self.layout, self.version, self.src_proc,
                                                 relay, self.peer, self.peer_shard)
                           for r in self.receivers]
            self.ray_calls += len(self.begins)
            self._negotiate()
            self.beat.tick()
            self._start()
            self._send_all()
            self._drain()
            self._commit()
        except BaseException as first:
            self.failed = first
            self._clean_up()
            e = self._root_cause(first)
            if isinstance(e, DuplicateNameError):
                applied = list(range(min(self.done, default=-1) + 1))
                raise DuplicateNameError(
                    e.name, e.bucket, applied,
                    f"bucket(s) {ranges(applied)} were loaded on every receiver before it; "
                    f"no receiver committed version {self.version} (their versions are "
                    "unchanged)") from None
            if e is first:
                raise
            raise e from None
        finally:
            link.close()
            count_ray_calls(self.ray_calls)

    def _negotiate(self) -> None:
        """Wait for every receiver to begin, connect to their signal endpoints, order the
        chain, then choose how buckets travel."""
        import ray

        began: list[Began] = self._get_named(self.begins, "validating the layout on the "
                                                          "receivers")
        self.began = began
        assert self.link is not None
        for i, b in enumerate(began):
            self.names[i] = self.link.connect(b.md)
            self.index[self.names[i]] = i
        if self.relay is not None:
            here = ray.get_runtime_context().get_node_id()
            self.chain = chain_order(began, self.order, here)
            for pos, i in enumerate(self.chain[:-1]):
                if began[i].partial:
                    raise InvalidInputError(
                        f"receiver {i} reads only part of the weights (select=), so it "
                        f"cannot relay them to the next receiver (position {pos} of "
                        f"{len(self.chain)} in the chain); sync it without relay, or make "
                        "it the last receiver (relay_order='caller')")
            self.first = self.chain[:1]
        self.direct = self.src_proc is not None and all(began[i].source_ok
                                                        for i in self.first)
        # Otherwise, for the module or mapping this sender holds, receivers READ the
        # tensors where they lie over NIXL: their storages stay registered between
        # syncs (so the metadata does not change) without holding memory the source
        # does not hold itself.
        self.by_ref = (self.source_reads and not self.direct and self.layout is not None
                       and self.by_reference
                       and self.layout.total_bytes <= registration_cache_bytes())

    def _start(self) -> None:
        """One receive call per receiver: each runs its bucket loop until the end."""
        assert self.link is not None
        me = self.link.md
        n = len(self.chain)
        for pos, i in enumerate(self.chain):
            relayed = self.relay is not None
            up = me if not relayed or pos == 0 else self.began[self.chain[pos - 1]].md
            down = self.began[self.chain[pos + 1]].md if relayed and pos < n - 1 else None
            role = Role(up, me, down, self.max_inflight, self.timeout_s)
            call = self.receivers[i].__ray_call__
            if self.began[i].asyncio:
                # Off the engine's event loop: it serves while the buckets load (the
                # begin and the commit are short and run on it).
                try:
                    call = call.options(concurrency_group="_ray_system")
                except Exception:  # an actor without the transport's group
                    pass
            self.calls[i] = call.remote(remote_receive, self.attr, self.session, role)
            self.ray_calls += 1

    def _send_all(self) -> None:
        while True:
            while len(self.out) >= self.max_inflight:
                self._retire()
            if self.layout is None and not self.direct:
                # Lazy: pull the next bucket's tensors only once a full bucket fits.
                self.wait_s += self._make_room(min(self.bucket_bytes, self.capacity),
                                               self._limit())
            item = next(self.items, None)
            if item is None:
                self.count = self.k
                self._signal_first(END, self.k)
                return
            nbytes, tensors, spec, entries = item
            del item
            self._send_bucket(nbytes, tensors, spec, entries)
            del tensors
            self._take(0.0)

    def _limit(self) -> int:
        """Double buffering in bytes: this stream's buckets may hold at most max_inflight
        buckets' worth of the pool, counting freed buckets whose blocks a same-node
        receiver's mapping still leases."""
        return min(self.capacity,
                   self.used0 + self.max_inflight * max(self.bucket_bytes, self.biggest))

    def _send_bucket(self, nbytes: int, tensors: list[torch.Tensor],
                     spec: BucketLayout | None, entries: Sequence[TensorEntry]) -> None:
        """Make bucket ``self.k`` (a source address, a by-reference object or a pool
        object) and signal it READY to its readers."""
        k = self.k
        self.sent += sum(e.nbytes for e in entries)
        if nbytes > self.capacity:
            assert spec is not None
            raise too_big(spec.bucket, self.capacity)
        self.biggest = max(self.biggest, nbytes)
        keep: list[torch.Tensor] | None = None
        if self.direct and source_readable(tensors, entries):
            assert self.src_proc is not None
            box: Any = SourceBucket(self.src_proc, tuple(t.data_ptr() for t in tensors))
            keep = tensors
            self.direct_buckets += 1
        elif self.by_ref and source_readable(tensors, entries):
            self.owned = f"ws:{self.session}/{k}"
            self.ref_keys.update(storage_key(t) for t in tensors if t.numel())
            box = owned_bucket(self.owned, tensors, entries, by_reference=True)
            keep = tensors
            self.ref_buckets += 1
        else:
            # A conversion or a CUDA tensor packs into one contiguous block.
            one_block = any(t.is_cuda for t in tensors) or bool(conversions(tensors, entries))
            self.wait_s += self._make_room(nbytes, self._limit(), one_block)
            self.owned = f"ws:{self.session}/{k}"
            box = owned_bucket(self.owned, tensors, entries)
            tensors.clear()  # the pool holds the snapshot; drop the source's tensors
        del tensors
        if keep is not None and self.samples:
            # A bucket read in place adds nothing to the pool: the last sample stands
            # (a stats() call per bucket costs as much as describing it).
            self.samples.append(self.samples[-1])
        else:
            self.samples.append(int(pool_stats().pool_used))
        out = _Out(k, box_body(box), spec_body(spec),
                   InFlight([], keep, [self.owned] if self.owned else []))
        self.owned = None
        self.out.append(out)
        self.k += 1
        for i in self.first:
            if self.hello[i]:
                self._ready(i, out)

    def _ready(self, i: int, out: _Out) -> None:
        """Signal bucket ``out`` READY to receiver ``i``; its receive call may read it
        from now on (so the bucket must outlive that call, or its DONE)."""
        assert self.link is not None
        out.held.acks.append(self.calls[i])
        self.link.send(self.names[i], READY, out.k, [out.body, out.spec])

    def _signal_first(self, kind: int, index: int) -> None:
        assert self.link is not None
        for i in self.first:
            if self.hello[i]:
                self.link.send(self.names[i], kind, index)

    # -- waiting on the data plane --

    def _take(self, timeout_s: float) -> bool:
        """Handle the signals that arrive within ``timeout_s``; True if one showed
        progress. Every :data:`CHECK_CALLS_S` it also asks Ray whether a receiver's
        call ended (a failure, or a death, is raised here)."""
        assert self.link is not None
        moved = False
        msg = self.link.get(timeout_s)
        while msg is not None:
            moved = self._on(msg) or moved
            msg = self.link.get(0.0)
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + CHECK_CALLS_S
            self._check_calls()
        if moved:
            self.beat.tick()
        return moved

    def _on(self, msg: Any) -> bool:
        i = self.index.get(msg.sender)
        if i is None:
            return False
        if msg.kind == HELLO:
            if not self.hello[i]:
                self.hello[i] = True
                if i in self.first:
                    for out in self.out:
                        self._ready(i, out)
                    if self.count is not None:
                        self.link.send(self.names[i], END, self.count)  # type: ignore[union-attr]
        elif msg.kind == DONE:
            self.done[i] = max(self.done[i], msg.item)
        elif msg.kind == FAIL:
            self._fail_from(i, str(msg.body))
        return msg.kind in PROGRESS

    def _check_calls(self) -> None:
        """Raise for a receive call that ended early: a receiver that died, or failed."""
        import ray

        pending = [c for c in self.calls if c is not None]
        if not pending:
            return
        ready, _rest = ray.wait(pending, num_returns=len(pending), timeout=0)
        for ref in ready:
            i = self.calls.index(ref)
            if self.count is not None and self.done[i] >= self.count - 1:
                continue  # a receive that finished: its result is taken by _drain
            self._raise_call(i, ref)
            # It returned: it loaded every bucket (its last DONE is on its way).
            if self.count is not None:
                self.done[i] = max(self.done[i], self.count - 1)

    def _fail_from(self, i: int, why: str) -> None:
        """Receiver ``i`` signalled that its receive failed: raise its own error."""
        import ray

        ref = self.calls[i]
        if ref is not None:
            ray.wait([ref], timeout=min(self.timeout_s, 10.0))
            self._raise_call(i, ref)
        raise WeightSyncError(f"receiver {i} failed: {why}")

    def _raise_call(self, i: int, ref: Any) -> None:
        import ray
        from ray.exceptions import RayActorError

        try:
            ray.get(ref, timeout=0)
        except RayActorError as e:
            raise self._died(i, e) from e
        except ray.exceptions.GetTimeoutError:
            return
        if self.count is None:
            raise WeightSyncError(f"receiver {i}'s receive call ended before the stream "
                                  "did")

    def _wait(self, until: Callable[[], bool], what: str) -> None:
        """Handle signals until ``until()``; raise once nothing moved for ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._stalled(what)
            if self._take(min(left, CHECK_CALLS_S)):
                deadline = time.monotonic() + self.timeout_s

    def _retire(self) -> None:
        """Wait until every first-hop reader is done with the oldest bucket out, then
        free it (its pool object, or the source tensors kept unmoved)."""
        k = self.out[0].k
        self._wait(lambda: all(self.done[i] >= k for i in self.first),
                   f"waiting for the receivers to load bucket {k}")
        out = self.out.popleft()
        if out.held.kept is not None:
            out.held.kept.clear()
        free_bucket(out.held.owned)

    def _make_room(self, nbytes: int, limit: int, one_block: bool = False) -> float:
        """Block until ``nbytes`` fit the sender pool (see :func:`bucket_fits`), retiring this
        stream's buckets out, oldest first, while they do not: their blocks are what
        usually holds the room, and only this thread frees them (a pool of fewer than
        ``max_inflight`` buckets would otherwise wait for itself). Then wait for the rest
        (blocks a same-node receiver still maps, other objects). Returns the seconds
        waited."""
        t0 = time.monotonic()
        while self.out and not bucket_fits(pool_stats(), nbytes, limit, self.capacity, one_block):
            self._retire()
        wait_for_pool(nbytes, limit, self.capacity, self.timeout_s, one_block)
        return time.monotonic() - t0

    def _drain(self) -> None:
        """Wait until every receiver signalled DONE for the last bucket, then for their
        receive calls' reports."""
        last = (self.count or 0) - 1
        self._wait(lambda: all(d >= last for d in self.done),
                   "waiting for the receivers to load the last bucket")
        while self.out:
            self._retire()
        results = self._get_named(self.calls, "waiting for the receivers' reports")
        for i, reps in enumerate(results):
            self.acked[i].extend(reps)

    def _commit(self) -> None:
        # Every receiver has every bucket: only now may they commit (a receiver that
        # commits at its last bucket would commit a stream this sender gave up on), and
        # only if the driver still waits for this stream.
        self.beat.check()
        # A receiver commits by this time or never: serving sections may hold its commit
        # off, and a commit after the sender stopped waiting would go unreported.
        deadline = time.time() + self.timeout_s
        self.finishes = [r.__ray_call__.remote(remote_finish, self.attr, self.session,
                                               self.count or 0, deadline)
                         for r in self.receivers]
        self.ray_calls += len(self.finishes)
        self.skipped = commit_all(self.finishes, self.version, self.timeout_s,
                                  self._at_commit)

    def _at_commit(self, i: int, e: BaseException) -> BaseException:
        """The error of receiver ``i``'s commit call: Ray's if it died or never answered."""
        import ray
        from ray.exceptions import RayActorError

        if isinstance(e, RayActorError):
            return self._died(i, e, "committing the stream")
        if isinstance(e, (ray.exceptions.GetTimeoutError, WeightSyncTimeoutError)):
            cls = RelayReceiverError if self.relay is not None else ReceiverError
            err = cls(f"{self._where(i)} did not commit version {self.version} within "
                      f"timeout_s={self.timeout_s}s ({e})", i,
                      self.receivers[i]._actor_id.hex(), self.count or 0, stalled=True)
            err.__cause__ = e
            return err
        return e

    def _get_named(self, refs: list[Any], what: str) -> list[Any]:
        """``ray.get`` of one call per receiver, each within ``timeout_s``; a receiver
        that died is named."""
        from ray.exceptions import RayActorError

        try:
            return get_all(refs, self.timeout_s, what)
        except RayActorError as e:
            i = self._index_of(getattr(e, "actor_id", None))
            raise self._died(i, e, what) from e

    def _index_of(self, actor_id: str | None) -> int:
        for i, r in enumerate(self.receivers):
            if actor_id is not None and r._actor_id.hex() == actor_id:
                return i
        return -1

    # -- naming who broke the stream --

    def _where(self, i: int) -> str:
        aid = self.receivers[i]._actor_id.hex() if i >= 0 else "?"
        if self.relay is None or i < 0:
            return f"receiver {i} (actor {aid})"
        return (f"receiver {i} (actor {aid}, position {self.chain.index(i)} of "
                f"{len(self.chain)} in the relay chain)")

    def _died(self, i: int, e: BaseException, what: str = "") -> ReceiverError:
        """The error for receiver ``i``, whose actor died (``e``: Ray's error)."""
        b = self.done[i] + 1 if i >= 0 else 0
        aid = self.receivers[i]._actor_id.hex() if i >= 0 else ""
        when = "while committing" if self.finishes else f"at bucket {b}"
        rest = ("" if self.finishes else
                f"; no receiver committed version {self.version}, the others keep their "
                "previous version")
        cls = RelayReceiverError if self.relay is not None else ReceiverError
        err = cls(f"{what + ': ' if what else ''}{self._where(i)} died {when}: "
                  f"{type(e).__name__}{rest}", i, aid, b)
        err.__cause__ = e
        return err

    def _root_cause(self, e: BaseException) -> BaseException:
        """After the clean-up let every receive call end: a receiver that died is the
        cause of what the others saw (a READ from it that failed, a successor that
        starved), so the first one to die in chain order is named instead."""
        import ray
        from ray.exceptions import RayActorError

        if isinstance(e, ReceiverError) and not e.stalled:
            return e
        for i in self.chain:
            ref = self.calls[i]
            if ref is None or not calls_ended([ref]):
                continue
            try:
                ray.get(ref, timeout=0)
            except RayActorError as dead:
                return self._died(i, dead)
            except Exception:
                pass
        return e

    def _stalled(self, what: str) -> WeightSyncError:
        """The receiver the stream waits for: in a chain, the first one behind what its
        predecessor (or the trainer) gave it; else every receiver behind the others."""
        sent = self.k - 1
        if self.relay is None:
            need = min(self.out[0].k if self.out else sent, sent)
            late = [i for i in self.first if not self.hello[i] or self.done[i] < need]
            self.stuck = late[0] if late else None
            who = "; ".join(self._where(i) + (", whose receive call never started"
                                              if not self.hello[i] else
                                              f", done up to bucket {self.done[i]}")
                            for i in late)
            return WeightSyncTimeoutError(
                f"{what}: nothing moved for {self.timeout_s}s; waiting for "
                f"{who or 'the trainer pool'}; no receiver committed version "
                f"{self.version}")
        supply = sent
        i = self.chain[0]
        for i in self.chain:
            if not self.hello[i] or self.done[i] < supply:
                break
            supply = self.done[i]
        self.stuck = i
        b = self.done[i] + 1
        return RelayReceiverError(
            f"{what}: {self._where(i)} did not finish bucket {b} within {self.timeout_s}s; "
            f"no receiver committed version {self.version}, the others keep their "
            "previous version", i, self.receivers[i]._actor_id.hex(), b, stalled=True)

    # -- failure --

    def _clean_up(self) -> None:
        """After a failure: signal ABORT to every receiver (a receive call that has not
        started finds it waiting and reads nothing), let the receive calls end (not a
        stalled receiver's: it may never answer), have every receiver that began drop
        the stream, then free the buckets: at once those no receive call may still read,
        the others once their calls end."""
        self._beat_quietly()  # the driver's wait: the clean-up is progress too
        if self.link is not None:
            self.link.tell([n for n in self.names if n], ABORT, 0,
                           f"the trainer gave up: {type(self.failed).__name__}")
        ending = [c for i, c in enumerate(self.calls) if c is not None and i != self.stuck]
        wait_quietly([*ending, *self.begins, *self.finishes], min(self.timeout_s, 10.0))
        self._beat_quietly()
        self._take_done()
        aborts = [r.__ray_call__.remote(remote_abort, self.attr, self.session)
                  for r in self.receivers]
        self.ray_calls += len(aborts)
        live = [a for i, a in enumerate(aborts)
                if self.calls[i] is None or calls_ended([self.calls[i]])]
        wait_quietly(live, min(self.timeout_s, 10.0))
        self._release_out()

    def _take_done(self) -> None:
        """Take in the DONE signals that came before the receive calls ended (what
        every receiver loaded, for the error)."""
        if self.link is None:
            return
        msg = self.link.get(0.0)
        while msg is not None:
            i = self.index.get(msg.sender)
            if i is not None and msg.kind == DONE:
                self.done[i] = max(self.done[i], msg.item)
            msg = self.link.get(0.0)

    def _beat_quietly(self) -> None:
        try:
            self.beat.tick()
        except Exception:  # cancelled: the clean-up goes on all the same
            pass

    def _release_out(self) -> None:
        """Free the buckets out whose readers' calls have all ended; those a call may
        still read go to the late list, freed when those calls end."""
        late = [o.held for o in self.out if o.held.acks and not calls_ended(o.held.acks)]
        gone = {id(h) for h in late}
        for o in self.out:
            if id(o.held) not in gone:
                if o.held.kept is not None:
                    o.held.kept.clear()
                free_bucket(o.held.owned)
        free_bucket([self.owned])
        if late:
            LATE.add(late, self.session)
        self.out.clear()

    def report(self, t0: float) -> StreamReport:
        """The stream as the sender saw it, from ``t0`` (``time.perf_counter()``) on."""
        loads = tuple(summarise(self.version, sorted(reps, key=lambda r: r.bucket), sk)
                      for reps, sk in zip(self.acked, self.skipped))
        return StreamReport(
            version=self.version, buckets=self.k, nbytes=self.sent,
            receivers=len(self.receivers), max_inflight=self.max_inflight,
            seconds=time.perf_counter() - t0, pool_capacity=self.capacity,
            peak_pool_used=max(self.samples, default=0), pool_used_samples=tuple(self.samples),
            fallbacks=int(pool_stats().fallbacks - self.fallbacks0), pool_wait_seconds=self.wait_s,
            loads=loads, source_read_buckets=self.direct_buckets,
            reference_buckets=self.ref_buckets, ray_calls=self.ray_calls)
