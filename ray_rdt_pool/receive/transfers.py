"""READs in flight: posting, polling, abandoning, cutting off, and aborts.

Owns: every posted READ (a :class:`Transfer`, holding the NIXL handle, a lease on its
peer and its landing) until it has ended, and Ray's aborts. Lifetime: a transfer ends
exactly once (``final`` set under its lock): when NIXL reports ``DONE`` or ``ERR``, when
a cancel succeeds, or when its peer's agent is removed; then its handle and peer lease
go, and an abandoned one's landing too. A fetch that fails, times out, is aborted or is
dropped by Ray before its READ ended is *abandoned*: its landing stays reserved while
NIXL may still write into it, the progress thread polls it until it ends, and one that
has not ended ``fetch_timeout_s`` after it started is cut off by removing its peer.
Threads: fetching and waiting threads; ``abort`` on ``_ray_system_error``; ``dropped``
on any thread (maybe inside GC); the rest of the abandoned on the progress thread. Lock
order: a transfer's lock, then the receiver lock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.clock import SYSTEM_CLOCK, Clock
from ray_rdt_pool.receive.arena import Landing
from ray_rdt_pool.receive.peers import Peer
from ray_rdt_pool.registry import MEM_TYPE

if TYPE_CHECKING:
    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.core.codec import WireMeta
    from ray_rdt_pool.obs.events import Events
    from ray_rdt_pool.receive.arena import Descs, Landings
    from ray_rdt_pool.receive.peers import Peers

logger = logging.getLogger(__name__)

__all__ = ["MAX_PENDING_ABORTS", "Transfer", "Transfers"]

#: Aborts remembered for fetches that have not started (bounded; see Transfers.abort).
MAX_PENDING_ABORTS = 1024
#: Objects remembered as fetched, so that a late abort for one is ignored.
_FINISHED_IDS = 4096


@dataclass(eq=False)
class Transfer:
    """One posted READ. ``final`` is set once, under ``lock``, when it has ended."""

    obj_id: str
    handle: Any
    peer: Peer
    landing: Landing
    started: float
    final: str | None = None
    abandoned: bool = False  # nobody will consume it: its end returns the landing
    aborted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class Transfers:
    """The READs that have not ended, and the aborts (a part of the receiver)."""

    def __init__(self, config: PoolConfig, events: Events, lock: threading.RLock,
                 backend: Callable[[], Any], peers: Peers, landings: Landings,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.clock = clock  # when READs started, for fetch_timeout_s
        self.events = events
        self.lock = lock  # the receiver lock
        self._backend = backend
        self.peers = peers
        self.landings = landings
        self.outstanding: dict[int, Transfer] = {}  # id -> transfer not yet ended
        self.dropped_reads: deque[Transfer] = deque()  # of Fetch objects Ray never waited on
        self.pending_aborts: OrderedDict[str, float] = OrderedDict()  # obj_id -> when
        self.finished: OrderedDict[str, None] = OrderedDict()  # fetched objects, oldest first

    # -- posting and ending ---------------------------------------------------------------

    def post(self, obj_id: str, meta: WireMeta, peer: Peer, landing: Landing, local: Descs,
             remote: Descs) -> Transfer:
        """Post the READ of ``obj_id`` from ``peer`` (whose lease it takes over) into
        ``landing``."""
        handle = self._backend().start_read(local, remote, meta.agent,
                                            MEM_TYPE[landing.device], MEM_TYPE[meta.device],
                                            split=landing.kind == "arena")
        # Tracked before anything else can raise (a Ctrl-C): reap() must be able to end
        # it, or its landing and the peer's lease stay held for good.
        t = Transfer(obj_id, handle, peer, landing, self.clock.monotonic())
        with self.lock:
            self.outstanding[id(t)] = t
            if self._pending_abort_locked(obj_id):  # arrived while the READ was posted
                t.aborted = True
        return t

    def adopt_running(self, obj_id: str, handle: Any, peer: Peer, landing: Landing) -> None:
        """A READ that failed to post left ``handle`` writing into ``landing``: make it
        an abandoned transfer holding ``peer``'s lease, which reap() ends or cuts off."""
        t = Transfer(obj_id, handle, peer, landing, self.clock.monotonic(), abandoned=True)
        with self.lock:
            self.outstanding[id(t)] = t
            self.peers.suspect_locked(peer)

    def end_locked(self, t: Transfer, state: str, release_handle: bool = True) -> None:
        """Mark ``t`` ended (caller holds ``t.lock``): handle, lease, maybe landing."""
        if release_handle and t.handle is not None:
            try:
                self._backend().release(t.handle)
            except Exception:
                # The READ is over (DONE, ERR, or its peer removed): nothing writes into
                # the landing any more, so a failing release leaks at most a handle.
                logger.debug("releasing an ended transfer handle failed", exc_info=True)
        t.handle = None
        t.final = state
        with self.lock:
            self.outstanding.pop(id(t), None)
            self.peers.unlease_locked(t.peer, failed=state != "DONE")
        if t.abandoned:
            if state == "DONE":
                self.events.add("late_completions")
            self.landings.release(t.landing)

    def poll(self, t: Transfer) -> str:
        """The transfer's state; ends it (exactly once) when NIXL says it is over.

        NIXL's binding raises for an error status (a peer that disconnected, say): that
        is NIXL reporting the READ ended in error, so it counts as ``ERR``.
        """
        with t.lock:
            if t.final is not None:
                return t.final
            try:
                state = str(self._backend().state(t.handle))
            except Exception as e:
                logger.debug("transfer of %s ended in error: %s", t.obj_id, e)
                state = "ERR"
            if state != "PROC":
                self.end_locked(t, state)
            return state

    def cut(self, t: Transfer) -> None:
        """``t``'s peer was removed to cut it off: it has ended."""
        with t.lock:
            if t.final is None:
                self.end_locked(t, "CUT")

    # -- abandoned READs ------------------------------------------------------------------

    def abandon(self, t: Transfer) -> None:
        """Nobody will consume ``t``: its landing returns once the READ has ended."""
        with t.lock:
            if t.final is not None:
                self.landings.release(t.landing)
                return
            t.abandoned = True
            try:
                self._backend().release(t.handle)
            except Exception:
                # NIXL could not cancel it: the handle stays valid and the READ may still
                # write into the landing. reap() polls it until it ends or is cut off.
                logger.debug("cancelling an in-flight READ failed; polling it", exc_info=True)
                return
            self.end_locked(t, "CANCELLED", release_handle=False)

    def dropped(self, t: Transfer) -> None:
        """A Fetch died unconsumed (any thread, maybe inside GC): abandon it later."""
        self.dropped_reads.append(t)

    def abandon_dropped(self) -> None:
        """Abandon the READs of the Fetch objects that died unconsumed."""
        while True:
            try:  # another thread (a fetch, the progress thread) may take the last one
                t = self.dropped_reads.popleft()
            except IndexError:
                return
            self.abandon(t)

    def abandoned_locked(self) -> list[Transfer]:
        """The abandoned READs not ended yet (caller holds the receiver lock)."""
        return [t for t in self.outstanding.values() if t.abandoned]

    def from_peer_locked(self, peer: Peer) -> list[Transfer]:
        """The READs from ``peer`` not ended yet (caller holds the receiver lock)."""
        return [t for t in self.outstanding.values() if t.peer is peer]

    # -- aborts ---------------------------------------------------------------------------

    def abort(self, obj_id: str) -> None:
        """Ray gave up on ``obj_id``: a READ of it in flight stops being waited for.

        An abort for a fetch that already finished is ignored; one for a fetch that has
        not started is remembered (at most :data:`MAX_PENDING_ABORTS`, each for at most
        ``fetch_timeout_s``). Senders receive aborts too; those are bounded the same way.
        """
        with self.lock:
            hit = [t for t in self.outstanding.values() if t.obj_id == obj_id]
            for t in hit:
                t.aborted = True
            if hit or obj_id in self.finished:
                return
            self.pending_aborts[obj_id] = self.clock.monotonic()
            self.pending_aborts.move_to_end(obj_id)
            self._expire_aborts_locked()

    def _expire_aborts_locked(self) -> None:
        cutoff = self.clock.monotonic() - self.config.fetch_timeout_s
        pa = self.pending_aborts
        while pa and (len(pa) > MAX_PENDING_ABORTS or next(iter(pa.values())) < cutoff):
            pa.popitem(last=False)

    def _pending_abort_locked(self, obj_id: str) -> bool:
        self._expire_aborts_locked()
        return self.pending_aborts.pop(obj_id, None) is not None

    def aborted_before_start(self, obj_id: str) -> bool:
        """A fetch of ``obj_id`` starts: whether Ray aborted it before."""
        with self.lock:
            self.finished.pop(obj_id, None)
            return self._pending_abort_locked(obj_id)

    def finish_id(self, obj_id: str) -> None:
        """The fetch of ``obj_id`` is settled: a later abort for it is ignored."""
        with self.lock:
            self.pending_aborts.pop(obj_id, None)
            self.finished[obj_id] = None
            while len(self.finished) > _FINISHED_IDS:
                self.finished.popitem(last=False)
