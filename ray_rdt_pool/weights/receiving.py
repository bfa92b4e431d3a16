"""A receiver's side of a stream: its one ``receive`` call, which loads every bucket as
the data plane signals it (see :mod:`.stream` for the trainer's side).

Owns :func:`receive`, the bucket loop a receiver runs inside its one Ray call of a
stream, and :class:`Relayed`, what a receiver in a relay chain publishes for its
successor. The loop says ``HELLO`` to its upstream (the trainer, or the receiver before
it in the chain), loads each bucket once ``READY`` names it, signals ``DONE`` to its
upstream and to the trainer, and, relaying, publishes the bucket as it arrived and
signals it ``READY`` to its successor. It ends after ``END`` once every bucket is
loaded (and, relaying, once the successor read every one), on ``ABORT``, or when
nothing moved for ``timeout_s``. It commits nothing: the trainer's commit call does,
once every receiver has every bucket.

Lifetime: everything here lives for one receive call, on the receiver actor's task
thread; whatever the call published for its successor is freed when it returns or
raises, so nothing of a failed stream outlives it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.errors import WeightSyncError, WeightSyncTimeoutError
from ray_rdt_pool.weights.links import (
    ABORT,
    DONE,
    END,
    FAIL,
    HELLO,
    READY,
    Link,
    body_box,
    body_spec,
    box_body,
)
from ray_rdt_pool.weights.manifest import PoolBucket
from ray_rdt_pool.weights.pool import free_bucket

if TYPE_CHECKING:
    import torch

    from ray_rdt_pool.weights.loadplan import BucketPlan
    from ray_rdt_pool.weights.remote import Role
    from ray_rdt_pool.weights.reports import BucketReport
    from ray_rdt_pool.weights.weight_receiver import WeightReceiver

#: Longest single wait for a signal before the loop looks at its deadline again (s).
POLL_S = 0.05


@dataclass
class Relayed:
    """What one receiver published for its successor in one relayed stream: per bucket,
    the object its successor reads (its destination tensors when the bucket landed
    there, by reference; else a snapshot in its own pool, taken as the bucket arrived,
    before ``load_weights`` could change it)."""

    session: str
    me: str  # this receiver's endpoint: its objects' ids are its own
    held: dict[int, PoolBucket] = field(default_factory=dict)
    snapshots: set[int] = field(default_factory=set)  # the held buckets copied into the pool
    peak: int = 0  # the most snapshots held at once
    lock: threading.Lock = field(default_factory=threading.Lock)

    def publish(self, plan: BucketPlan, src: Sequence[torch.Tensor],
                key: int | None = None) -> None:
        """The relay hook: publish bucket ``plan.index`` as it lies here, once written,
        as bucket ``key`` (default: ``plan.index``) of what this receiver relays."""
        from ray_rdt_pool._ray.owned import put_owned

        if plan.select is not None:
            raise WeightSyncError(
                f"bucket {plan.index} was read in part (select=), so this receiver cannot "
                "relay it; put receivers with a select last in the chain, or sync them "
                "without relay")
        k = plan.index if key is None else key
        oid = f"wr:{self.session}/{self.me}/{k}"
        # Landed in the destination: its bytes are the bucket's, as sent (no copy).
        in_place = plan.targets is not None
        tensors = list(plan.targets if plan.targets is not None else src)
        wire, device = put_owned(oid, tensors, by_reference=in_place)
        with self.lock:
            self.held[k] = PoolBucket(oid, wire, device)
            if not in_place:
                self.snapshots.add(k)
                self.peak = max(self.peak, len(self.snapshots))

    def free(self, upto: int | None = None) -> None:
        """Free the buckets held up to ``upto`` (None: all)."""
        with self.lock:
            gone = [k for k in self.held if upto is None or k <= upto]
            oids = [self.held.pop(k).obj_id for k in gone]
            self.snapshots.difference_update(gone)
        free_bucket(oids)


#: The most snapshots a receiver held for its successor in its last relayed stream.
_LAST_PEAK = [0]


def relay_peak() -> int:
    """The most buckets this process held for its successor at once in its last
    relayed stream (for tests and diagnosis)."""
    return _LAST_PEAK[0]


def receive(rec: WeightReceiver, session: str, role: Role) -> list[BucketReport]:
    """Run stream ``session``'s bucket loop on ``rec`` (begun already); returns the
    reports of the buckets it loaded. Raises on ``ABORT``, on a bucket that fails here
    (after signalling ``FAIL``), and when nothing moved for ``role.timeout_s``."""
    link = Link(session)
    relayed: Relayed | None = None
    up = coord = ""
    down: str | None = None
    try:
        up = link.connect(role.up)
        coord = link.connect(role.coord)
        down = link.connect(role.down) if role.down is not None else None
        source = rec._accepted_source(session)
        if down is not None:
            relayed = Relayed(session, link.name)
            rec._relay_stream(session, relayed.publish)
        link.send(up, HELLO, 0, link.md)
        return _loop(rec, session, role, link, up, coord, down, source, relayed)
    except BaseException as e:
        why = f"{type(e).__name__}: {e}"[:2000]
        # The stream can never commit here now: a retry of its version must find the
        # receiver free, and the chain after it must not wait out its timeout.
        rec._abort_stream(session)
        link.tell([p for p in (coord, up) if p], FAIL, 0, why)
        if down is not None:
            link.tell([down], ABORT, 0, f"the receiver before it in the chain failed: {why}")
        raise
    finally:
        if relayed is not None:
            _LAST_PEAK[0] = relayed.peak
            relayed.free()
        link.close()


def _loop(rec: WeightReceiver, session: str, role: Role, link: Link, up: str, coord: str,
          down: str | None, source: Any, relayed: Relayed | None) -> list[BucketReport]:
    reports: list[BucketReport] = []
    ready: dict[int, Any] = {}  # bucket -> [message, layout] as READY gave it
    count: int | None = None
    k = 0
    down_done = -1
    # The trainer applies timeout_s and names who stalled; a receiver starved by a
    # stalled predecessor waits longer, so that it is not the one named.
    timeout = role.timeout_s + min(role.timeout_s, 30.0)
    deadline = time.monotonic() + timeout
    while True:
        while k in ready and (relayed is None
                              or len(relayed.snapshots) < role.max_inflight):
            body, spec = ready.pop(k)
            box = body_box(body, source)
            reports.extend(rec._load_stream_bucket(session, k, [box], body_spec(spec)))
            link.send(up, DONE, k)
            if coord != up:
                link.send(coord, DONE, k)
            if relayed is not None and down is not None:
                with relayed.lock:
                    mine = relayed.held[k]
                link.send(down, READY, k, [box_body(mine), spec])
            k += 1
            deadline = time.monotonic() + timeout
        if count is not None and k >= count:
            if down is None or down_done >= count - 1:
                return reports
        left = deadline - time.monotonic()
        if left <= 0:
            raise _starved(k, count, down_done, relayed is not None, timeout)
        msg = link.get(min(left, POLL_S))
        if msg is None:
            if not rec._holds(session):  # aborted by the driver: its source died
                raise WeightSyncError(f"stream {session} was aborted (its source died or "
                                      f"gave up); this receiver loaded {k} bucket(s) of "
                                      f"it and keeps its version {rec.version}")
            continue
        if msg.kind == ABORT:
            raise WeightSyncError(f"stream {session} was given up ({msg.body}); this "
                                  f"receiver loaded {k} bucket(s) of it and keeps its "
                                  f"version {rec.version}")
        if msg.sender == up and msg.kind == READY:
            ready[msg.item] = msg.body
        elif msg.sender == up and msg.kind == END:
            count = msg.item
            if down is not None:
                link.send(down, END, count)
        elif down is not None and msg.sender == down and msg.kind == DONE:
            down_done = max(down_done, msg.item)
            assert relayed is not None
            relayed.free(down_done)
        else:
            continue
        deadline = time.monotonic() + timeout


def _starved(k: int, count: int | None, down_done: int, relays: bool,
             timeout_s: float) -> WeightSyncTimeoutError:
    if count is not None and k >= count and relays:
        what = (f"the next receiver in the chain read bucket {down_done + 1} of {count} "
                "from here")
    else:
        what = f"bucket {k} was signalled ready to this receiver"
    return WeightSyncTimeoutError(
        f"nothing moved for {timeout_s}s: waiting until {what}; the receiver keeps its "
        "version (the trainer, or the receiver before it, may have died)")
