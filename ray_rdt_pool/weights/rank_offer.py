"""A trainer rank's side of a many-rank sync (see :mod:`.ranks`): its offer and its
serve.

Owns the offers a rank holds, per sync, in its :class:`WeightSender` (``_offers``),
from :func:`remote_offer` (its layout and one message per bucket, read in place or
packed) until its :func:`remote_serve` ends: the serve answers each receiver's
``HELLO`` with ``GO`` (only then may it read), takes their progress, and frees the offer
once every receiver said ``BYE``. A serve that fails (a receiver failed or died,
nothing moved for ``timeout_s``) signals ``ABORT``, and lets go of what a receiver that
got ``GO`` may still read only once that receiver's call ends. An offer whose serve never
came (its driver died) is freed after ``2 * timeout_s``, at this sender's next offer or
stream. The sender keeps the offers and its versions itself (its ``_hold_offer``,
``_take_offer``, ``_served``); this module only makes and serves them. Also the name a
dim-0 shard travels under (:func:`piece_name`). Runs on the rank's task thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ray_rdt_pool.errors import (
    InvalidInputError,
    PoolExhaustedError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from ray_rdt_pool.weights.late import LATE, InFlight
from ray_rdt_pool.weights.links import ABORT, BYE, DONE, FAIL, GO, HELLO, Link, mailbox
from ray_rdt_pool.weights.manifest import PoolBucket, TensorEntry, WeightLayout

if TYPE_CHECKING:
    from ray_rdt_pool.same_node.peer_memory import SourceProcess
    from ray_rdt_pool.weights.weight_sender import WeightSender

#: How often a serve asks Ray whether a receiver's call ended (s).
CHECK_CALLS_S = 0.05


def piece_name(name: str, rank: int) -> str:
    """The name rank ``rank``'s dim-0 shard of ``name`` travels under."""
    return f"{name}@rank{rank}"


@dataclass(frozen=True)
class Offer:
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
    md: bytes  #: the rank's signal endpoint


@dataclass
class _Held:
    """A rank's offer until its serve ends: the tensors receivers read in place (kept
    alive, so unmoved), the owned objects (or published refs) to drop, the storages
    sent by reference, and until when it waits for its serve."""

    group: str
    version: int
    deadline: float  #: monotonic: freed by the sender after this, if not served
    kept: list[torch.Tensor] = field(default_factory=list)
    owned: list[str] = field(default_factory=list)
    refs: list[Any] = field(default_factory=list)
    ref_keys: set[Any] = field(default_factory=set)
    serving: bool = False

    def release(self) -> None:
        from ray_rdt_pool.weights.pool import free_bucket

        self.kept.clear()
        self.refs.clear()
        free_bucket(self.owned)
        self.owned.clear()


def remote_offer(actor: Any, attr: str, group: str, version: int | None, mode: str,
                  timeout_s: float) -> Offer:
    """On a trainer rank: plan its part and make every bucket's message (see module)."""
    from ray_rdt_pool.registry import storage_key
    from ray_rdt_pool.weights.pool import (
        owned_bucket,
        pool_stats,
        registration_cache_bytes,
        sender_pool_capacity,
        too_big,
    )
    from ray_rdt_pool.weights.remote import find_attr
    from ray_rdt_pool.weights.stream import source_readable
    from ray_rdt_pool.weights.weight_sender import WeightSender

    sender: WeightSender = find_attr(actor, attr, WeightSender)
    sender._release_stale_offers()
    md = mailbox().metadata()
    v = sender._next_version(version)
    held = _Held(group, v, time.monotonic() + 2 * timeout_s)
    if mode == "publish":
        m = sender._publish(None, v, False)
        held.refs.extend(m.refs)
        sender._hold_offer(group, held)
        return Offer(v, m.layout, sender.shard, tuple(m.refs), (None,) * len(m.refs),
                      None, m.sender_pool_used, 0, md)
    from ray_rdt_pool.weights.planning import plan_layout

    eager, _pairs = sender._acquire(None)
    if eager is None:
        raise InvalidInputError(
            "a trainer rank of a many-rank sync needs a module or mapping as its source "
            "(the receivers validate the whole model before any byte moves); a lazy "
            "source is bucketed as it goes. Pass WeightSender(model) or a dict")
    layout, groups = plan_layout(eager, sender.bucket_bytes, sender.wire_dtype,
                                 sender.wire_scale)
    per_bucket: list[list[TensorEntry]] = [[] for _ in layout.buckets]
    for e in layout.entries:
        per_bucket[e.bucket].append(e)
    by_ref = (sender.source_reads
              and layout.total_bytes <= registration_cache_bytes())
    packed = [b for b, g, es in zip(layout.buckets, groups, per_bucket)
              if not (by_ref and source_readable(g, es))]
    capacity = sender_pool_capacity()
    free = capacity - int(pool_stats().pool_used)
    need = sum(b.nbytes for b in packed)
    for b in packed:
        if b.nbytes > capacity:
            raise too_big(b, capacity)
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
    boxes: list[PoolBucket] = []
    addrs: list[tuple[int, ...] | None] = []
    try:
        for k, (g, es) in enumerate(zip(groups, per_bucket)):
            oid = f"wr:{group}/{k}"
            ref = by_ref and source_readable(g, es)
            boxes.append(owned_bucket(oid, g, es, by_reference=ref))
            held.owned.append(oid)
            if ref:
                held.kept.extend(g)
                held.ref_keys.update(storage_key(t) for t in g if t.numel())
                addrs.append(tuple(t.data_ptr() for t in g))
            else:
                addrs.append(None)
    except BaseException:
        held.release()
        raise
    groups.clear()
    sender._hold_offer(group, held, v)
    return Offer(v, layout, sender.shard, tuple(boxes), tuple(addrs), src,
                  int(pool_stats().pool_used), sum(a is not None for a in addrs), md)


def remote_release(actor: Any, attr: str, group: str) -> None:
    """On a trainer rank: drop the offer of a sync that ended before it was served
    (nothing was signalled ``GO``, so no receiver reads it)."""
    from ray_rdt_pool.weights.remote import find_attr
    from ray_rdt_pool.weights.weight_sender import WeightSender

    sender = find_attr(actor, attr, WeightSender)
    held = sender._take_offer(group)
    if held is not None:
        held.release()


def remote_serve(actor: Any, attr: str, group: str, calls: list[list[Any]],
                  expect: list[int], timeout_s: float) -> None:
    """On a trainer rank: serve its offer to the receivers ``expect`` of sync ``group``
    (``calls[0]``: every receiver's load call, in receiver order; a relay's chain reads
    from its first receiver only), then free it (see module)."""
    from ray_rdt_pool.weights.remote import find_attr
    from ray_rdt_pool.weights.weight_sender import WeightSender

    sender: WeightSender = find_attr(actor, attr, WeightSender)
    held = sender._offer(group)
    if held is None:
        raise WeightSyncError(
            f"the offer of many-rank sync {group} is gone from this rank: it waited more "
            f"than {2 * timeout_s}s for the driver to serve it, or was released")
    held.serving = True
    serve = _Serve(group, calls[0], expect, timeout_s)
    try:
        serve.run()
    except BaseException:
        sender._take_offer(group)
        serve.abort(held)
        raise
    finally:
        serve.link.close()
    sender._take_offer(group)
    held.release()
    sender._served(held.version, held.ref_keys)


class _Serve:
    """One serve's bookkeeping: who said HELLO (and got GO), who is done (BYE)."""

    def __init__(self, group: str, calls: list[Any], expect: list[int],
                 timeout_s: float) -> None:
        self.link = Link(group)
        self.calls = calls
        self.expect = set(expect)
        self.timeout_s = timeout_s
        self.names: dict[int, str] = {}  # receiver -> its endpoint, once it said HELLO
        self.bye: set[int] = set()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        next_check = 0.0
        while not self.expect <= self.bye:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._stalled()
            msg = self.link.get(min(left, CHECK_CALLS_S))
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_CALLS_S
                self._check_calls()
            if msg is None:
                continue
            j = msg.item
            if msg.kind == HELLO and j in self.expect and j not in self.names:
                self.names[j] = self.link.connect(bytes(msg.body))
                self.link.send(self.names[j], GO, j)
            elif msg.kind == BYE:
                self.bye.add(j)
            elif msg.kind == FAIL:
                raise WeightSyncError(f"receiver {j} failed: {msg.body}")
            elif msg.kind != DONE:
                continue
            deadline = time.monotonic() + self.timeout_s

    def _check_calls(self) -> None:
        """A receiver's load call that ended without BYE failed (or its actor died)."""
        import ray

        ready, _rest = ray.wait(self.calls, num_returns=len(self.calls), timeout=0)
        for ref in ready:
            j = self.calls.index(ref)
            if j in self.bye or j not in self.expect:
                continue
            try:
                ray.get(ref, timeout=0)
            except Exception as e:
                raise WeightSyncError(f"receiver {j}'s load failed: {type(e).__name__}") from e
            self.bye.add(j)  # it said BYE before it returned; the signal is on its way

    def _stalled(self) -> WeightSyncTimeoutError:
        quiet = sorted(j for j in self.expect if j not in self.names)
        slow = [j for j in self.names if j not in self.bye]
        return WeightSyncTimeoutError(
            f"serving a many-rank sync: nothing moved for {self.timeout_s}s; receiver(s) "
            f"{quiet} never started their load, receiver(s) {slow} did not finish it")

    def abort(self, held: _Held) -> None:
        """After a failure: signal ABORT, and let go of the offer once no receiver that
        got GO may read it any more."""
        self.link.tell([self.names[j] for j in self.names], ABORT, 0,
                       "a trainer rank gave up the sync")
        readers = [self.calls[j] for j in self.names if j not in self.bye]
        if not readers:
            held.release()
            return
        LATE.add([InFlight(readers, held.kept, held.owned)], held.group)
        held.refs.clear()
