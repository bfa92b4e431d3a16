"""A relayed stream (``relay="chain"``): the trainer sends each bucket once, to the
first receiver of a chain, and each receiver reads it from the one before it.

Owns both halves of the relay. On the trainer, :class:`RelaySession` (a
:class:`~ray_rdt_pool.weights.stream.StreamSession` that sends each bucket to the chain
instead of to every receiver): it orders the chain, submits every receiver's call for a
bucket at once, each call taking the previous receiver's ack as an argument (so Ray
starts it when that receiver has the bucket), and names the receiver that broke the
chain. On each receiver, ``_remote_relay_*`` (run through ``__ray_call__``) and
:class:`_Relayed`, the buckets it published for its successor: once a bucket is
written, the receiver publishes the memory that holds it, by reference (its destination
tensors, when the bucket landed there: no copy) or as a snapshot into its own sender
pool (a bucket that went through its arena), and hands the object's descriptor back in
its ack. A receiver frees its published buckets when its successor has read them (a
snapshot), or at the stream's end (by reference: no memory beyond its own weights).

Lifetime: a :class:`RelaySession` lives for one ``stream()`` call, on the trainer's
thread. A :class:`_Relayed` lives from a receiver's relay begin until its finish or
abort (or until a newer relayed stream begins on that receiver); its lock guards it
across the actor's threads.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ray_rdt_pool.errors import (
    InvalidInputError,
    RelayReceiverError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from ray_rdt_pool.weights.manifest import BucketLayout, PoolBucket, WeightLayout
from ray_rdt_pool.weights.pool import _free_owned, _registration_cache_bytes
from ray_rdt_pool.weights.receiver import WeightReceiver
from ray_rdt_pool.weights.remote import _ended, _find, _get_all, _wait_quietly
from ray_rdt_pool.weights.reports import BucketReport
from ray_rdt_pool.weights.stream import StreamSession

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from ray_rdt_pool.same_node.source import SourceProcess
    from ray_rdt_pool.weights.loadplan import BucketPlan

#: The relays :meth:`WeightSender.stream` offers.
RELAYS = ("chain",)
#: How a chain is ordered: as the caller listed the receivers, or by Ray node.
ORDERS = ("caller", "placement")


def check_relay(relay: Any, order: Any) -> None:
    """InvalidInputError unless ``relay`` is None or one of :data:`RELAYS` and ``order``
    one of :data:`ORDERS`."""
    if relay is not None and relay not in RELAYS:
        raise InvalidInputError(f"relay must be None or one of {RELAYS}, got {relay!r}")
    if order not in ORDERS:
        raise InvalidInputError(f"relay_order must be one of {ORDERS}, got {order!r}")


# ---------------------------------------------------------------------- receiver side


@dataclass
class _Relayed:
    """What one receiver published for its successor in one relayed stream."""

    session: str
    relays: bool = False  # this receiver has a successor (set by its bucket calls)
    held: dict[int, PoolBucket] = field(default_factory=dict)  # bucket -> its object
    peak: int = 0  # the most buckets held at once
    cond: threading.Condition = field(default_factory=threading.Condition)

    def publish(self, plan: BucketPlan, src: Sequence[torch.Tensor]) -> None:
        """The relay hook: publish bucket ``plan.index`` as it lies here, once written."""
        from ray_rdt_pool._ray.owned import put_owned

        if not self.relays:
            return
        if plan.select is not None:
            raise WeightSyncError(
                f"bucket {plan.index} was read in part (select=), so this receiver cannot "
                "relay it; put receivers with a select last in the chain, or sync them "
                "without relay")
        oid = f"wr:{self.session}/{plan.index}"
        # Landed in the destination: its bytes are the bucket's, as sent (no copy).
        in_place = plan.targets is not None
        tensors = list(plan.targets if plan.targets is not None else src)
        wire, device = put_owned(oid, tensors, by_reference=in_place)
        with self.cond:
            self.held[plan.index] = PoolBucket(oid, wire, device)
            self.peak = max(self.peak, len(self.held))
            self.cond.notify_all()

    def wait(self, k: int, timeout_s: float) -> PoolBucket:
        with self.cond:
            if not self.cond.wait_for(lambda: k in self.held, timeout_s):
                raise WeightSyncTimeoutError(
                    f"bucket {k} was not loaded on this receiver within {timeout_s}s")
            return self.held[k]

    def free(self, upto: int | None = None) -> None:
        """Free the buckets held up to ``upto`` (None: all)."""
        with self.cond:
            gone = [k for k in self.held if upto is None or k <= upto]
            oids = [self.held.pop(k).obj_id for k in gone]
        _free_owned(oids)


_LOCK = threading.Lock()
_SESSIONS: dict[str, _Relayed] = {}
#: The most buckets a receiver held for its successor in its last relayed stream.
_LAST_PEAK = [0]


def _drop(session: str | None) -> None:
    """Free and forget relayed stream ``session`` (None: every one) on this receiver."""
    with _LOCK:
        gone = [s for s in _SESSIONS if session is None or s == session]
        states = [_SESSIONS.pop(s) for s in gone]
    for st in states:
        _LAST_PEAK[0] = st.peak
        st.free()


def relay_held() -> tuple[int, int]:
    """This process's relay buckets: (held now, the most held at once in its last
    finished relayed stream). For tests and diagnosis."""
    with _LOCK:
        now = sum(len(s.held) for s in _SESSIONS.values())
    return now, _LAST_PEAK[0]


class _Began(NamedTuple):
    """A receiver's answer to a relay begin."""

    skipped: int  #: manifest tensors it skips
    source_ok: bool  #: it can read the trainer's process (source reads)
    node: str  #: its Ray node id
    #: per bucket, whether it lands in the destination (None: a lazy stream)
    in_place: tuple[bool, ...] | None
    partial: bool  #: it reads only part of some bucket (select=)


def _remote_relay_begin(actor: Any, attr: str, session: str, layout: WeightLayout | None,
                        version: int, source: SourceProcess | None) -> _Began:
    import ray

    from ray_rdt_pool.weights.remote import _remote_begin

    _drop(None)  # a newer stream supersedes any older one on this receiver
    skipped, ok = _remote_begin(actor, attr, session, layout, version, source)
    state = _Relayed(session)
    plan = _find(actor, attr, WeightReceiver)._relay_stream(session, state.publish)
    with _LOCK:
        _SESSIONS[session] = state
    in_place = None if plan is None else tuple(
        b.targets is not None and b.select is None for b in plan.buckets)
    partial = plan is not None and any(b.select is not None for b in plan.buckets)
    return _Began(skipped, ok, ray.get_runtime_context().get_node_id(), in_place, partial)


def _after(refs: list[Any], k: int, what: str, limit_s: float) -> list[Any]:
    """The values of ``refs`` (acks of other receivers), waited for here rather than by
    Ray: a call whose argument failed, or that was cancelled before it was sent, leaves
    a gap in the actor's call order that blocks its later calls for half a minute. A
    ``ray.cancel`` of this call (the stream failed) ends the wait."""
    import ray

    ctx = ray.get_runtime_context()
    deadline = time.monotonic() + limit_s
    while True:
        ready, _rest = ray.wait(refs, num_returns=len(refs),
                                timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        if len(ready) == len(refs):
            try:
                return list(ray.get(refs))
            except Exception as e:
                raise WeightSyncError(f"bucket {k}: {what} failed: {type(e).__name__}; "
                                      "this receiver wrote nothing of it") from e
        try:
            canceled = ctx.is_canceled()
        except RuntimeError:  # an async actor: it cannot tell
            canceled = False
        if canceled:
            raise WeightSyncError(f"bucket {k}: the relayed stream was given up while this "
                                  f"receiver waited for {what}")
        if time.monotonic() >= deadline:
            raise WeightSyncTimeoutError(f"bucket {k}: {what} took longer than {limit_s}s")


def _remote_relay_bucket(actor: Any, attr: str, session: str, k: int, src: list[Any],
                         prev: list[Any], spec: BucketLayout | None, relays: bool,
                         free_upto: int, after: list[Any], timeout_s: float
                         ) -> tuple[list[BucketReport], PoolBucket | None]:
    """Load bucket ``k`` from ``src`` (the trainer's box), or from the bucket the previous
    receiver published (``prev``: its ack); with ``relays``, publish it and return its
    descriptor with the reports. First free the buckets up to ``free_upto``, once the
    successor's ack ``after`` says it read them."""
    rec = _find(actor, attr, WeightReceiver)
    with _LOCK:
        state = _SESSIONS.get(session)
    # The trainer waits timeout_s for any progress, then names the stalled receiver:
    # a receiver waiting for it must not give up first and be named instead.
    limit = 2 * timeout_s + 30.0
    if after:
        _after(after, k, "the next receiver reading an earlier bucket", limit)
        if state is not None:
            state.free(free_upto)
    if prev:
        src = [_after(prev, k, "the previous receiver in the chain", limit)[0][1]]
    if state is not None:
        state.relays = relays
    reports = rec.load_stream_bucket(session, k, src, spec)
    if not relays:
        return reports, None
    if state is None:
        raise WeightSyncError(f"relayed stream {session} is not in progress on this receiver")
    return reports, state.wait(k, timeout_s)


def _noop(actor: Any) -> None:
    return None


def _remote_relay_finish(actor: Any, attr: str, session: str, buckets: int) -> int:
    _drop(session)  # every successor acknowledged every bucket
    return _find(actor, attr, WeightReceiver).finish_stream(session, buckets)


def _remote_relay_abort(actor: Any, attr: str, session: str) -> None:
    _drop(session)
    rec = getattr(actor, attr, None)
    if isinstance(rec, WeightReceiver):
        rec.abort_stream(session)


# ---------------------------------------------------------------------- trainer side


def _chain(began: Sequence[_Began], order: str, here: str | None) -> list[int]:
    """The receivers' indices in chain order: as given, or grouped by Ray node (this
    node's first, then in order of first appearance)."""
    idx = list(range(len(began)))
    if order == "caller":
        return idx
    first: dict[str, int] = {}
    for i, b in enumerate(began):
        first.setdefault(b.node, i)
    return sorted(idx, key=lambda i: (began[i].node != here, first[began[i].node], i))


class RelaySession(StreamSession):
    """One relayed run of :meth:`~ray_rdt_pool.weights.WeightSender.stream`: as a
    :class:`StreamSession`, except that each bucket goes to the first receiver of the
    chain only, and every other receiver reads it from the one before it.

    Every receiver's call for bucket ``b`` is submitted when the trainer makes the
    bucket, with the previous receiver's ack of ``b`` as an argument. A receiver that
    holds a snapshot of ``b - max_inflight`` for its successor frees it at its call for
    ``b``, which takes the successor's ack of ``b - max_inflight`` as an argument: so it
    holds at most ``max_inflight`` buckets. The trainer keeps its own buckets until the
    first receiver acknowledged them, as a stream does; it collects every other ack as
    it arrives and names the receiver that broke the chain.
    """

    BEGIN = staticmethod(_remote_relay_begin)

    def __init__(self, receivers: list[Any], version: int, *, order: str = "caller",
                 **kw: Any) -> None:
        super().__init__(receivers, version, **kw)
        self.gather = False
        self.order = order
        self.chain: list[int] = list(range(len(receivers)))  # receiver indices, in order
        self.in_place: list[tuple[bool, ...] | None] = []  # per chain position
        self.rows: list[list[Any]] = []  # per bucket, each chain position's ack (or None)
        self.specs: list[BucketLayout | None] = []  # per bucket, a lazy source's layout
        self.next: list[int] = [0] * len(receivers)  # per position, its next bucket to call
        self.unchecked: dict[Any, tuple[int, int]] = {}  # ack -> (bucket, position)
        self.stuck = -1  # the position that stopped answering, if one did

    def _negotiate(self) -> None:
        import ray

        began: list[_Began] = self._get_named(self.begins, "beginning the relayed stream")
        here = ray.get_runtime_context().get_node_id()
        self.chain = _chain(began, self.order, here)
        for pos, i in enumerate(self.chain[:-1]):
            if began[i].partial:
                raise InvalidInputError(
                    f"receiver {i} reads only part of the weights (select=), so it cannot "
                    f"relay them to the next receiver (position {pos} of "
                    f"{len(self.chain)} in the chain); sync it without relay, or make it "
                    "the last receiver (relay_order='caller')")
        self.in_place = [began[i].in_place for i in self.chain]
        first = began[self.chain[0]]
        self.direct = self.src_proc is not None and first.source_ok
        self.by_ref = (self.source_reads and not self.direct and self.layout is not None
                       and self.by_reference
                       and self.layout.total_bytes <= _registration_cache_bytes())

    def _get_named(self, refs: list[Any], what: str) -> list[Any]:
        """``ray.get`` of one call per receiver; a receiver that died is named."""
        from ray.exceptions import RayActorError

        try:
            return _get_all(refs, self.timeout_s, what)
        except RayActorError as e:
            i = self._index_of(getattr(e, "actor_id", None))
            raise RelayReceiverError(
                f"{what}: receiver {i} (actor {e.actor_id}) died; no receiver committed "
                f"version {self.version}", i, str(e.actor_id or "")) from e

    def _index_of(self, actor_id: str | None) -> int:
        for i, r in enumerate(self.receivers):
            if actor_id is not None and r._actor_id.hex() == actor_id:
                return i
        return -1

    # -- sending --

    def _send(self, acks: list[Any], ks: list[int], boxes: list[list[Any]],
              spec: BucketLayout | None = None, together: bool = False) -> None:
        """Submit the first receiver's call for bucket ``ks[0]`` (it alone reads the
        trainer's bucket; ``acks`` gets it), then every later call that can go now."""
        assert not together and len(ks) == 1
        b = ks[0]
        self.rows.append([None] * len(self.chain))
        self.specs.append(spec)
        self._call(0, b, boxes[0])
        acks.append(self.rows[b][0])
        self._advance()

    def _advance(self) -> None:
        """Submit, down the chain, the calls that can go: receiver ``pos``'s call for
        bucket ``j`` once the previous receiver's call for ``j`` exists, and, when it
        waits for it, its successor's call for ``j - max_inflight``. Only the ack of
        ``j`` rides along: fetching the next one ahead costs a nested ref and a thread
        per call, more than the round trip it saves."""
        m, n = self.max_inflight, len(self.chain)
        moved = True
        while moved:
            moved = False
            for pos in range(1, n):
                while True:
                    j = self.next[pos]
                    if j >= self.next[pos - 1]:
                        break
                    if self._frees(pos, j) and self.rows[j - m][pos + 1] is None:
                        break
                    self._call(pos, j, None)
                    moved = True

    def _frees(self, pos: int, j: int) -> bool:
        """Whether receiver ``pos`` holds a snapshot of bucket ``j - max_inflight`` that
        it frees at its call for ``j``, once its successor read it."""
        m, places = self.max_inflight, self.in_place[pos]
        return (pos < len(self.chain) - 1 and j >= m
                and not (places is not None and places[j - m]))

    def _call(self, pos: int, j: int, box: list[Any] | None) -> None:
        m, last = self.max_inflight, len(self.chain) - 1
        after: list[Any] = []
        free_upto = -1
        if self._frees(pos, j):
            after, free_upto = [self.rows[j - m][pos + 1]], j - m
        # Refs inside lists: the receiver waits for them itself (see _after).
        prev = [] if box is not None else [self.rows[j][pos - 1]]
        ref = self.receivers[self.chain[pos]].__ray_call__.remote(
            _remote_relay_bucket, self.attr, self.session, j, box or [], prev,
            self.specs[j], pos < last, free_upto, after, self.timeout_s)
        self.rows[j][pos] = ref
        self.unchecked[ref] = (j, pos)
        self.next[pos] = j + 1

    def _collect(self, acks: list[Any]) -> None:
        self._await(acks, "waiting for the first receiver to load a bucket")

    def _commit(self) -> None:
        self._advance()
        while self.inflight:
            self._retire()
        self._await(list(self.unchecked), "waiting for the chain to load every bucket")
        self.finishes = [r.__ray_call__.remote(_remote_relay_finish, self.attr, self.session,
                                               self.k) for r in self.receivers]
        self.skipped = self._get_named(self.finishes, "committing the relayed stream")

    def _await(self, refs: list[Any], what: str) -> None:
        """Wait until every call of ``refs`` is done, taking in every ack that arrives
        meanwhile; raise for the receiver that broke the chain, or that made no
        progress for ``timeout_s``."""
        import ray

        want = set(refs)
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._check():
                deadline = time.monotonic() + self.timeout_s  # the chain moves
            if not want & self.unchecked.keys():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._stalled(what)
            ray.wait(list(self.unchecked), num_returns=1, timeout=left)

    def _check(self) -> bool:
        """Take in every ack that is done; raise for the first failed one (the earliest
        bucket, then the earliest in the chain: a failure travels only down the chain
        and to later buckets). True if any was done."""
        import ray

        if not self.unchecked:
            return False
        ready, _rest = ray.wait(list(self.unchecked), num_returns=len(self.unchecked),
                                timeout=0)
        failed = self._take(ready)
        if failed:
            raise self._broken(failed + self._settle())
        return bool(ready)

    def _settle(self) -> list[tuple[int, int, BaseException]]:
        """After a failure: cancel every call not done (a queued one would only wait for
        what failed; one waiting for another receiver's ack ends), give the rest a
        moment to end, and return the failed ones among them."""
        import ray

        pending = list(self.unchecked)
        for ref in pending:
            try:
                ray.cancel(ref)
            except Exception:  # already done, or its actor is gone
                pass
        done, _rest = ray.wait(pending, num_returns=len(pending),
                               timeout=min(self.timeout_s, 10.0)) if pending else ([], [])
        return self._take(done)

    def _take(self, ready: list[Any]) -> list[tuple[int, int, BaseException]]:
        """Take in these done acks; returns the failed ones as (bucket, position, error)."""
        import ray

        failed: list[tuple[int, int, BaseException]] = []
        for ref in ready:
            b, pos = self.unchecked.pop(ref)
            try:
                reports, _desc = ray.get(ref, timeout=0)
            except Exception as e:
                failed.append((b, pos, e))
                continue
            self.acked[self.chain[pos]].extend(reports)
        return failed

    def _broken(self, failed: list[tuple[int, int, BaseException]]) -> BaseException:
        """The error to raise for these failed calls (bucket, position, error): for a
        receiver that died (asked directly: its calls may have failed as cancelled, or
        its successor's READ from it first), at the first bucket it did not load; else
        the first failure in chain order of the earliest bucket (a later one only
        echoes it)."""
        from ray.exceptions import RayActorError, TaskCancelledError

        dead = self._dead()
        if not dead:
            own = [f for f in failed if not isinstance(f[2], TaskCancelledError)] or failed
            return min(own, key=lambda f: (f[0], f[1]))[2]
        i, e = min(dead, key=lambda d: self.chain.index(d[0]))
        loaded = {r.bucket for r in self.acked[i]}
        b = min((j for j in range(self.k) if j not in loaded), default=self.k)
        aid = self.receivers[i]._actor_id.hex()
        err = RelayReceiverError(
            f"receiver {i} (actor {aid}, position {self.chain.index(i)} of "
            f"{len(self.chain)} in the relay chain) died at bucket {b}: {type(e).__name__}; "
            f"no receiver committed version {self.version}, the others keep their previous "
            "version", i, aid, b)
        err.__cause__ = e
        assert isinstance(e, RayActorError)
        return err

    def _dead(self) -> list[tuple[int, BaseException]]:
        """The receivers whose actor is gone, with Ray's error, by one empty call each
        (a live one answers once the calls cancelled before it are gone)."""
        import ray
        from ray.exceptions import RayActorError

        pings = [r.__ray_call__.remote(_noop) for r in self.receivers]
        ready, _rest = ray.wait(pings, num_returns=len(pings),
                                timeout=min(self.timeout_s, 5.0))
        out: list[tuple[int, BaseException]] = []
        for i, p in enumerate(pings):
            if p in ready:
                try:
                    ray.get(p, timeout=0)
                except RayActorError as e:
                    out.append((i, e))
                except Exception:  # only deaths count here
                    pass
        return out

    def _stalled(self, what: str) -> RelayReceiverError:
        """The receiver the chain waits for: of the oldest bucket not done everywhere,
        the first receiver not done (every one after it waits for it)."""
        b, pos = min(self.unchecked.values())
        i = self.chain[pos]
        self.stuck = pos
        return RelayReceiverError(
            f"{what}: receiver {i} (actor {self.receivers[i]._actor_id.hex()}, position "
            f"{pos} of {len(self.chain)} in the relay chain) did not finish bucket {b} "
            f"within {self.timeout_s}s; no receiver committed version {self.version}, the "
            "others keep their previous version", i, self.receivers[i]._actor_id.hex(), b,
            stalled=True)

    # -- failure --

    def _clean_up(self) -> None:
        """After a failure: cancel the calls that have not started (they wait for the
        receiver that failed, and hold up the survivors' queues), let the others end,
        have every receiver drop the stream and free what it relays, then free the
        trainer's buckets (those a call may still read only once it ends)."""
        import ray

        pending = dict(self.unchecked)
        for ref in pending:
            try:
                ray.cancel(ref)
            except Exception:  # already done, or its actor is gone
                pass
        # Not the calls of a receiver that stopped answering: they may never end.
        ending = [r for r, (_b, pos) in pending.items() if pos != self.stuck]
        _wait_quietly([*ending, *self.begins, *self.finishes], min(self.timeout_s, 10.0))
        aborts = [r.__ray_call__.remote(_remote_relay_abort, self.attr, self.session)
                  for r in self.receivers]
        # A receiver whose calls have not ended gets its abort when they do; no one
        # waits for it (it may never answer).
        stuck = {self.chain[pos] for ref, (_b, pos) in pending.items()
                 if not _ended([ref])}
        _wait_quietly([a for i, a in enumerate(aborts) if i not in stuck],
                      min(self.timeout_s, 30.0))
        self._release_inflight()
        self.unchecked.clear()
        self.rows.clear()
