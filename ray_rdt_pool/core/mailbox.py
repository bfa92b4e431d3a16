"""Small messages between processes, sorted by topic: the data plane's signals.

Pure (stdlib and msgpack). A :class:`Mailbox` sits on one process's signal endpoint
(:class:`~ray_rdt_pool.nixl.protocol.Signals`: NIXL notifications, or the fake in
:mod:`ray_rdt_pool.testing`) and sorts what arrives into one :class:`Inbox` per topic
(a weight sync's session id). A message may arrive before its topic's inbox is open
(the sender ran ahead): it waits, for :data:`PENDING_S` at most. Once an inbox is
closed, later messages of its topic are dropped.

Nothing wakes a waiter when a notification lands, so a wait polls the endpoint with the
pauses of a :class:`~ray_rdt_pool.core.clock.Backoff` (a sync's hot loop stays fast, an
idle wait costs little).

Lifetime: one mailbox per process, made with the endpoint, closed with it. An inbox
lives for one session on one process. Threads: any; one lock guards the routing, and
each inbox is read by one thread at a time.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

from ray_rdt_pool.core.clock import SYSTEM_CLOCK, Backoff, Clock

__all__ = ["PENDING_S", "Inbox", "Mailbox", "Message",
           "decode", "encode"]

#: How long a message waits for its topic's inbox to open.
PENDING_S = 600.0
#: Closed topics remembered, so their late messages are dropped rather than kept.
CLOSED_KEPT = 4096


class Message(NamedTuple):
    """One message: who sent it (its endpoint's name), what it says, about which item."""

    sender: str
    kind: int
    item: int
    body: Any


def encode(topic: str, kind: int, item: int = 0, body: Any = None) -> bytes:
    """One message's bytes: a msgpack array (never pickle: a peer's bytes run no code)."""
    return bytes(msgpack.packb([topic, kind, item, body], use_bin_type=True))


def decode(raw: bytes) -> tuple[str, int, int, Any] | None:
    """``(topic, kind, item, body)``, or None for bytes that are not a message."""
    try:
        topic, kind, item, body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:
        return None
    if not isinstance(topic, str) or not isinstance(kind, int) or not isinstance(item, int):
        return None
    return topic, kind, item, body


class Inbox:
    """The messages of one topic, in arrival order (per sender, in sending order)."""

    def __init__(self, mailbox: Mailbox, topic: str) -> None:
        self.mailbox = mailbox
        self.topic = topic
        self._queue: deque[Message] = deque()

    def get(self, timeout_s: float) -> Message | None:
        """The next message, waiting up to ``timeout_s``; None if none came."""
        return self.mailbox.wait(self, timeout_s)

    def get_nowait(self) -> Message | None:
        return self.mailbox.wait(self, 0.0)

    def close(self) -> None:
        self.mailbox.close(self.topic)


class Mailbox:
    """One process's endpoint, its messages sorted by topic (see the module)."""

    def __init__(self, endpoint: Any, clock: Clock = SYSTEM_CLOCK,
                 on_send: Callable[[], None] | None = None) -> None:
        self.endpoint = endpoint
        self._on_send = on_send
        self.name: str = endpoint.name
        self.clock = clock
        self._lock = threading.Lock()
        self._inboxes: dict[str, Inbox] = {}
        self._pending: dict[str, deque[tuple[float, Message]]] = {}
        self._closed: dict[str, None] = {}  # insertion-ordered: the oldest goes first
        self._peers: dict[bytes, str] = {}  # metadata -> peer name, once connected
        self._md: bytes | None = None

    # -- peers --

    def metadata(self) -> bytes:
        """What a peer passes to :meth:`connect` to send here."""
        if self._md is None:
            self._md = bytes(self.endpoint.metadata())
        return self._md

    def connect(self, md: bytes) -> str:
        """Make a peer reachable by :meth:`send`; returns its name (cheap when known)."""
        md = bytes(md)
        name = self._peers.get(md)
        if name is None:
            name = self.endpoint.connect(md)
            self._peers[md] = name
        return name

    def send(self, peer: str, topic: str, kind: int, item: int = 0,
             body: Any = None) -> None:
        """Send one message to a connected peer (raises what the endpoint raises)."""
        self.endpoint.send(peer, encode(topic, kind, item, body))
        if self._on_send is not None:
            self._on_send()

    # -- receiving --

    def open(self, topic: str) -> Inbox:
        """The inbox of ``topic``, with what arrived for it already."""
        with self._lock:
            box = self._inboxes.get(topic)
            if box is None:
                box = self._inboxes[topic] = Inbox(self, topic)
                self._closed.pop(topic, None)
                for _t, m in self._pending.pop(topic, ()):
                    box._queue.append(m)
            return box

    def close(self, topic: str) -> None:
        """Drop ``topic``'s inbox and whatever it holds; its later messages are dropped."""
        with self._lock:
            self._inboxes.pop(topic, None)
            self._pending.pop(topic, None)
            self._closed[topic] = None
            while len(self._closed) > CLOSED_KEPT:
                self._closed.pop(next(iter(self._closed)))

    def forget(self, topic: str) -> None:
        """A topic that will never open here (its session was given up before it began):
        drop what waits for it and what comes later. An open inbox is left alone."""
        with self._lock:
            if topic in self._inboxes:
                return
            self._pending.pop(topic, None)
            self._closed[topic] = None
            while len(self._closed) > CLOSED_KEPT:
                self._closed.pop(next(iter(self._closed)))

    def pump(self) -> int:
        """Sort what the endpoint has now into the inboxes; returns how many arrived."""
        with self._lock:
            return self._pump_locked()

    def _pump_locked(self) -> int:
        got = self.endpoint.poll()
        now = self.clock.monotonic()
        for sender, raw in got:
            msg = decode(raw)
            if msg is None:
                continue
            topic, kind, item, body = msg
            m = Message(sender, kind, item, body)
            box = self._inboxes.get(topic)
            if box is not None:
                box._queue.append(m)
            elif topic not in self._closed:
                self._pending.setdefault(topic, deque()).append((now, m))
        if self._pending:
            for topic in [t for t, q in self._pending.items() if now - q[0][0] > PENDING_S]:
                del self._pending[topic]
        return len(got)

    def pending(self) -> int:
        """Messages waiting for a topic to open."""
        with self._lock:
            return sum(len(q) for q in self._pending.values())

    def sessions(self) -> int:
        """Topics open now."""
        with self._lock:
            return len(self._inboxes)

    def wait(self, box: Inbox, timeout_s: float,
             stop: Callable[[], bool] | None = None) -> Message | None:
        """The next message of ``box``, polling the endpoint for up to ``timeout_s``."""
        clock = self.clock
        deadline = clock.monotonic() + timeout_s
        backoff = Backoff(clock)
        while True:
            with self._lock:
                if not box._queue:
                    self._pump_locked()
                if box._queue:
                    return box._queue.popleft()
            left = deadline - clock.monotonic()
            if left <= 0 or (stop is not None and stop()):
                return None
            clock.sleep(min(backoff.next(), left))
