"""Peers: the senders' agents loaded into ours, and their leases.

Owns: one :class:`Peer` per sender agent read from, and NIXL's view of it. A sender's
metadata is loaded when an object names a newer registration epoch than the loaded view
(see :mod:`ray_rdt_pool.registry`). NIXL merges a reload into the known view, so a reload
never removes an agent that has READs in flight; a view that may hold deregistered memory
is replaced (remove, then add) at the next fetch that finds the peer idle. Lifetime: a
peer holds one lease per transfer that has not ended; its agent is removed only with no
lease held (a failed READ, :data:`PEER_IDLE_S` idle, or least recently used beyond
:data:`MAX_PEERS`), except to cut off a READ that never ends. Threads: fetching threads
lease and load; the progress thread removes. NIXL and GCS calls run outside the receiver
lock, under the peer's ``load_lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.clock import SYSTEM_CLOCK, Clock
from ray_rdt_pool.errors import TransferError
from ray_rdt_pool.registry import Directory

if TYPE_CHECKING:
    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.core.codec import WireMeta
    from ray_rdt_pool.obs.events import Events
    from ray_rdt_pool.receive.transfers import Transfer, Transfers

logger = logging.getLogger(__name__)

__all__ = ["HOUSEKEEPING_S", "MAX_PEERS", "MAX_REMOVE_TRIES", "PEER_IDLE_S", "Peer", "Peers"]

#: A peer unused this long, with nothing in flight, is removed (its process may be gone).
#: Long: with NIXL 1.5.1 (UCX) a removed agent's connection stays open in both processes,
#: so a peer removed while its sender lives and added again at its next object leaks a
#: TCP connection per read lane each time. Removing a dead sender's agent frees no socket
#: either; it only lets its view, and the remote_agents gauge, go.
PEER_IDLE_S = 3600.0
#: Most peers kept loaded; the least recently used idle ones go first.
MAX_PEERS = 256
#: An idle peer whose removal NIXL refused this many times in a row is forgotten.
MAX_REMOVE_TRIES = 3
#: How often the progress thread looks for peers to remove (and same-node senders gone).
HOUSEKEEPING_S = 1.0


@dataclass(eq=False)
class Peer:
    """A sender agent loaded into ours. Fields change under the receiver lock;
    ``load_lock`` serialises NIXL add/remove calls about this peer."""

    name: str
    loaded: int = -1  # epoch of the view NIXL holds; -1: not loaded
    view_since: int = -1  # epoch of the last clean load (remove + add, or first add)
    stale: bool = False  # the view may hold deregistered memory: replace it when idle
    in_flight: int = 0  # transfers from this peer that have not ended
    busy: bool = False  # an add/remove is running: take no new lease
    suspect: bool = False  # a READ from it failed: remove it once idle
    # Made now: a peer whose first load waits on the GCS is not "idle since 0".
    last_used: float = field(default_factory=time.monotonic)
    remove_failures: int = 0  # removals NIXL refused in a row
    # NIXL may hold its agent on some lane: a load was tried since the last removal that
    # worked (``loaded`` is -1 too after a refused removal or a load failing part-way).
    in_nixl: bool = False
    retry_at: float = 0.0  # after a refused removal: when to try again
    load_lock: threading.Lock = field(default_factory=threading.Lock)


class Peers:
    """The loaded peers, by agent name (a part of the receiver)."""

    def __init__(self, config: PoolConfig, events: Events, lock: threading.RLock,
                 backend: Callable[[], Any], directory: Directory,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.clock = clock  # idle times, retries and the wait for a first metadata
        self.events = events
        self.lock = lock  # the receiver lock
        self._backend = backend
        self.directory = directory
        self.by_name: OrderedDict[str, Peer] = OrderedDict()  # least recently used first
        self.next_housekeeping = 0.0  # set to 0 to run the next housekeeping at once

    def lease(self, meta: WireMeta) -> Peer:
        """One lease on the sender's peer, loading its metadata first if needed."""
        name, need = meta.agent, meta.agent_version
        while True:
            with self.lock:
                peer = self.by_name.get(name)
                if peer is None:
                    peer = self.by_name[name] = Peer(name, last_used=self.clock.monotonic())
                if not peer.busy and peer.loaded >= need and not (
                        peer.stale and peer.in_flight == 0):
                    peer.in_flight += 1
                    peer.last_used = self.clock.monotonic()
                    self.by_name.move_to_end(name)
                    self.events.add("in_flight")
                    return peer
            self._load(peer, need)

    def unlease_locked(self, peer: Peer, failed: bool) -> None:
        """Drop one lease (caller holds the receiver lock); ``failed``: suspect the peer."""
        peer.in_flight -= 1
        if failed:
            self.suspect_locked(peer)
        self.events.add("in_flight", -1)

    def suspect_locked(self, peer: Peer) -> None:
        """A READ from ``peer`` failed: remove it at the next housekeeping once idle
        (caller holds the receiver lock)."""
        peer.suspect = True
        self.next_housekeeping = 0.0

    def _lookup(self, name: str, need: int) -> tuple[int, int, bytes]:
        deadline = self.clock.monotonic() + self.config.fetch_timeout_s
        delay = 0.002
        while True:
            found = self.directory.lookup(name)
            if found is not None and found[0] >= need:
                return found
            if self.clock.monotonic() > deadline:
                raise TransferError(
                    f"no NIXL metadata of version >= {need} for sender agent {name!r} in "
                    f"Ray's GCS after {self.config.fetch_timeout_s}s; the sender process may "
                    "have exited. Fetch objects from a live sender")
            self.clock.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _load(self, peer: Peer, need: int) -> None:
        """Bring NIXL's view of ``peer`` to epoch >= ``need`` without waiting for READs."""
        backend = self._backend()
        with peer.load_lock:
            with self.lock:
                if self.by_name.get(peer.name) is not peer:
                    return  # removed meanwhile: the caller retries with the current one
                if peer.loaded >= need and not (peer.stale and peer.in_flight == 0):
                    return
            try:
                version, reset, md = self._lookup(peer.name, max(need, peer.loaded, 0))
            except BaseException:
                with self.lock:
                    if (not peer.in_nixl and peer.in_flight == 0
                            and self.by_name.get(peer.name) is peer):
                        del self.by_name[peer.name]  # not in NIXL: nothing to remove
                    else:
                        self.suspect_locked(peer)
                raise
            with self.lock:
                replace = peer.loaded >= 0 and peer.view_since < reset
                idle = peer.in_flight == 0
                clean = replace and idle
                peer.busy = True
                peer.in_nixl = True  # from the load below on, even if it fails part-way
            removed = False
            try:
                if clean:
                    backend.remove_remote(peer.name)
                    removed = True
                backend.load_remote(md)
            except Exception as e:
                with self.lock:
                    peer.busy = False
                    self.suspect_locked(peer)
                    if removed:
                        peer.loaded = peer.view_since = -1
                raise TransferError(
                    f"loading the NIXL metadata of sender agent {peer.name!r} failed ({e}); "
                    "the sender may have exited. Fetch objects from a live sender") from e
            self.events.add("metadata_loads")
            with self.lock:
                if clean or peer.loaded < 0:
                    peer.view_since = version
                peer.loaded = version
                peer.stale = replace and not idle
                peer.busy = False

    def housekeeping_due_locked(self, now: float, hosts: bool) -> bool:
        """Whether the progress thread's housekeeping runs now: at most every
        :data:`HOUSEKEEPING_S`, and only with peers or same-node ``hosts`` to look at
        (caller holds the receiver lock)."""
        return now >= self.next_housekeeping and bool(self.by_name or hosts)

    def housekeep(self, now: float, reads: Transfers) -> None:
        """Remove the idle peers that failed a READ, stayed idle for :data:`PEER_IDLE_S`,
        or are the least recently used beyond :data:`MAX_PEERS`."""
        self.next_housekeeping = now + HOUSEKEEPING_S
        with self.lock:
            idle = [p for p in self.by_name.values() if p.in_flight == 0 and not p.busy]
            victims = [p for p in idle if p.suspect or now - p.last_used > PEER_IDLE_S]
            extra = len(self.by_name) - MAX_PEERS
            victims += [p for p in idle if p not in victims][:max(0, extra)]
        for p in victims:
            self.remove(p, cut=False, reads=reads)

    def remove(self, peer: Peer, cut: bool, reads: Transfers) -> None:
        """Remove ``peer``'s agent: when idle, or (``cut``) to end its ``reads`` that
        never end.

        Runs on the progress thread and never waits: a load of the same peer (which may
        wait on the GCS for up to ``fetch_timeout_s``) holds ``load_lock``, and then the
        removal is tried again at a later reap. A removal NIXL refuses leaves every READ
        from the peer in flight, their landings reserved (NIXL may still write there);
        it is tried again after :data:`HOUSEKEEPING_S`. An idle peer whose removal was
        refused :data:`MAX_REMOVE_TRIES` times is forgotten (its agent may stay loaded).
        """
        backend = self._backend()
        if not peer.load_lock.acquire(blocking=False):
            return
        try:
            with self.lock:
                if self.by_name.get(peer.name) is not peer or (peer.in_flight and not cut):
                    return
                if self.clock.monotonic() < peer.retry_at:
                    return
                peer.busy = True
                victims = reads.from_peer_locked(peer)
            try:
                backend.remove_remote(peer.name)
            except Exception as e:
                self._removal_refused(peer, victims, cut, e)
                return
            self.events.add("peers_removed")
            self.events.notify("change")  # housekeeping's removals come with no event
            if cut and victims:
                self.events.add("transfers_cut", len(victims))
                logger.warning(
                    "cut off %d READ(s) from %s that did not end within fetch_timeout_s=%ss "
                    "by removing its agent", len(victims), peer.name,
                    self.config.fetch_timeout_s)
            for t in victims:
                reads.cut(t)
            with self.lock:
                peer.loaded = peer.view_since = -1
                peer.stale = peer.busy = peer.in_nixl = False
                peer.remove_failures = 0
                if peer.in_flight == 0 and self.by_name.get(peer.name) is peer:
                    del self.by_name[peer.name]
        finally:
            peer.load_lock.release()

    def _removal_refused(self, peer: Peer, victims: list[Transfer], cut: bool,
                         e: Exception) -> None:
        """NIXL refused to remove ``peer``'s agent (caller holds ``load_lock``)."""
        with self.lock:
            peer.remove_failures += 1
            # Some lanes may have dropped it: the next fetch reloads it on every lane.
            peer.loaded = peer.view_since = -1
            peer.busy = False
            peer.retry_at = self.clock.monotonic() + HOUSEKEEPING_S
            self.suspect_locked(peer)
            forget = (not cut and peer.in_flight == 0
                      and peer.remove_failures >= MAX_REMOVE_TRIES
                      and self.by_name.get(peer.name) is peer)
            if forget:
                del self.by_name[peer.name]
        if cut and victims and peer.remove_failures == 1:
            logger.warning(
                "cutting off %d READ(s) from %s that did not end within fetch_timeout_s=%ss "
                "failed (%s); their memory stays reserved while NIXL may write into it, "
                "and the cut-off is tried again", len(victims), peer.name,
                self.config.fetch_timeout_s, e)
        elif forget:
            logger.warning("NIXL refused to remove remote agent %s %d times (%s); "
                           "forgetting it (its agent may stay loaded)", peer.name,
                           peer.remove_failures, e)
        else:
            logger.debug("removing remote agent %s failed", peer.name, exc_info=e)
