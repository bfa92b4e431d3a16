"""The signals of a weight sync's data plane: what the trainer, the ranks and the
receivers tell each other per bucket, over the process's signal endpoint.

A sync costs each receiver a few Ray calls (begin, run, commit) whatever its bucket
count; inside its run, bucket by bucket, the processes signal each other with NIXL
notifications (:mod:`ray_rdt_pool.core.mailbox` sorts them by session):

* ``HELLO`` (downstream to upstream, body: its endpoint's metadata): I run this
  session; send me its buckets. A receiver that starts after the sync was given up
  finds ``ABORT`` waiting instead, or no answer, and reads nothing.
* ``READY`` (upstream to downstream, index ``k``, body: the bucket's message): bucket
  ``k`` can be read now. ``END`` (index: the bucket count): no bucket follows.
* ``GO`` (a trainer rank to a receiver): every bucket the rank offered can be read.
* ``DONE`` (downstream to upstream, and to the coordinator): bucket ``k`` was read and
  written here; the upstream may reuse its memory (a credit). ``BYE``: every bucket of
  the session was read from you.
* ``FAIL`` (a receiver to its upstream and coordinator, body: why): its run failed;
  ``ABORT`` (the coordinator to everyone): the sync was given up.

Why notifications and not a sequence word in registered memory: a notification is
pushed (no remote polling READ per bucket, which across nodes costs a round trip each),
carries the bucket's message itself (so a lazy source's layout and a by-reference
descriptor need no second channel), and needs no registered memory of its own.

Owns :class:`Link` (one session's inbox on this process, and the peers it sends to) and
the codec of bucket messages (msgpack, never pickle). A link lives for one session's
call on one process. Threads: one caller at a time per link.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.mailbox import Mailbox, Message
from ray_rdt_pool.errors import WeightSyncError
from ray_rdt_pool.weights.manifest import (
    Bucket,
    BucketLayout,
    PoolBucket,
    SourceBucket,
    TensorEntry,
)

if TYPE_CHECKING:
    from ray_rdt_pool.same_node.peer_memory import SourceProcess

HELLO, READY, END, GO, DONE, BYE, FAIL, ABORT = range(1, 9)

#: Kinds that show progress (a coordinator's "no progress for timeout_s" restarts).
PROGRESS = frozenset((HELLO, DONE, BYE, READY, GO, END))


_THREAD = threading.local()


def mailbox() -> Mailbox:
    """This process's mailbox (its signal endpoint is made on first use), or the one
    this thread was bound to (:func:`bind`)."""
    bound = getattr(_THREAD, "mailbox", None)
    if bound is not None:
        return bound
    from ray_rdt_pool._ray.runtime import runtime

    return runtime().mailbox()


def forget(topic: str) -> None:
    """Drop the messages waiting for ``topic`` in this process's mailbox, and its later
    ones (a session aborted before it began here); nothing if there is no mailbox yet."""
    bound = getattr(_THREAD, "mailbox", None)
    if bound is None:
        from ray_rdt_pool._ray.runtime import current

        rt = current()
        bound = rt.current_mailbox() if rt is not None else None
    if bound is not None:
        bound.forget(topic)


def bind(box: Mailbox | None) -> None:
    """Give this thread a mailbox of its own (None: the process's again). Tests that run
    several actors' sides of a sync in one process give each actor's thread its own
    endpoint, as separate processes have."""
    _THREAD.mailbox = box


class Link:
    """One session's signals on this process: its inbox and the peers it sends to."""

    def __init__(self, session: str) -> None:
        self.mailbox = mailbox()
        self.session = session
        self.inbox = self.mailbox.open(session)
        self.name = self.mailbox.name
        self.sent = 0  #: messages sent on this link

    @property
    def md(self) -> bytes:
        return self.mailbox.metadata()

    def connect(self, md: bytes) -> str:
        return self.mailbox.connect(md)

    def send(self, peer: str, kind: int, item: int = 0, body: Any = None) -> None:
        self.mailbox.send(peer, self.session, kind, item, body)
        self.sent += 1

    def tell(self, peers: Sequence[str], kind: int, item: int = 0, body: Any = None) -> None:
        """Send to each of ``peers``, best effort: a failure path's signals must not
        replace the error being raised."""
        for p in dict.fromkeys(peers):
            try:
                self.send(p, kind, item, body)
            except Exception:
                pass

    def get(self, timeout_s: float) -> Message | None:
        return self.inbox.get(timeout_s)

    def close(self) -> None:
        self.inbox.close()


# -- bucket messages: what a READY carries ---------------------------------------------


def box_body(box: PoolBucket | SourceBucket) -> list[Any]:
    if isinstance(box, PoolBucket):
        return ["p", box.obj_id, box.wire, box.device]
    return ["s", list(box.addrs)]


def body_box(body: Any, source: SourceProcess | None) -> PoolBucket | SourceBucket:
    """The bucket message of a READY's body; ``source``: the sender process this
    receiver accepted source reads from (a source-read message names only addresses)."""
    try:
        if body[0] == "p":
            return PoolBucket(str(body[1]), bytes(body[2]), body[3])
        if body[0] == "s" and source is not None:
            return SourceBucket(source, tuple(int(a) for a in body[1]))
    except (TypeError, IndexError, ValueError):
        pass
    raise WeightSyncError(f"a bucket message this receiver cannot read: {str(body)[:80]}; "
                          "run the same ray_rdt_pool version on every actor")


def spec_body(spec: BucketLayout | None) -> list[Any] | None:
    if spec is None:
        return None
    b = spec.bucket
    return [b.index, list(b.names), b.nbytes,
            [[e.name, list(e.shape), e.dtype, e.bucket, e.index, e.nbytes,
              None if e.block is None else list(e.block), e.orig, e.scale_of]
             for e in spec.entries],
            [list(a) for a in spec.aliases]]


def body_spec(body: Any) -> BucketLayout | None:
    if body is None:
        return None
    index, names, nbytes, entries, aliases = body
    return BucketLayout(
        Bucket(int(index), tuple(names), int(nbytes)),
        tuple(TensorEntry(n, tuple(s), d, int(bk), int(i), int(nb),
                          None if blk is None else tuple(blk), orig, of)
              for n, s, d, bk, i, nb, blk, orig, of in entries),
        tuple((str(a), str(c)) for a, c in aliases))
