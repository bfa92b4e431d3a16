"""The receiver: arenas, peers, READs in flight, and aborts.

Role: ``fetch`` starts the one-sided READ of one object and returns a :class:`Fetch`;
``wait`` waits for it and rebuilds the tensors. A fetch is made of three parts, each
released exactly once:

* a **transfer** (:class:`Transfer`): the NIXL handle. It is released when NIXL reports
  the READ ``DONE`` or ``ERR``, when a cancel succeeds, or when the peer's agent is
  removed (which ends every READ from it);
* a **landing** (:class:`Landing`): where the bytes go, a block of the arena of the
  landing device, a one-off registered buffer when that arena is full, or the caller's
  target buffers. A landing goes back (block reused, buffer deregistered, target
  registrations released) **only after its transfer has ended**. A fetch that fails,
  times out, is aborted or is dropped by Ray before its READ ended is *abandoned*: its
  landing stays reserved while NIXL may still write into it, and the progress thread
  polls the transfer until it ends. A READ that has not ended ``fetch_timeout_s`` after
  it started is cut off by removing the peer's agent; only then does its landing return
  (a removal NIXL refuses ends nothing: it is tried again, and the landing stays). A READ
  that failed to post but left a part running (``ReadStillRunningError``) is abandoned
  the same way.
* a **peer lease**: one count on the sender's :class:`Peer` while the transfer has not
  ended. A peer's agent is removed only with no lease held, except to cut off a READ
  that never ends.

Landing device: the target buffers' device; else the device of the sender's tensors
(Ray's ``set_target_device_for_ref`` arrives as target buffers on that device). A
receiver without that device raises ``TransferError`` before anything is reserved.

Peers: a sender's metadata is loaded when an object names a newer registration epoch
than the loaded view (see :mod:`ray_rdt_pool.registry`). NIXL merges a reload into the
known view, so a reload never removes an agent that has READs in flight; a view that may
hold deregistered memory is replaced (remove, then add) at the next fetch that finds the
peer idle. ``fetch`` never waits for other fetches. Peers that failed a READ, or stayed
idle for :data:`PEER_IDLE_S` (an hour), are removed by the progress thread once idle, and
the least recently used idle ones beyond :data:`MAX_PEERS`.

Same-node senders: objects in a sender's shared pool are views of this process's one
private mapping of that pool (or copied out of it) under a lease instead of READ (see
:mod:`ray_rdt_pool.same_node.shared`). At ``os.fork()`` (hooks registered with the first handle)
the parent holds an extra lease on every object whose views live until the child has
copied their pages into memory of its own; the child forgets every handle (their lease
rows are the parent's).

Threads: ``fetch``/``wait`` on the thread calling ``ray.get`` or on ``_ray_system``
(task arguments); ``abort`` on ``_ray_system_error``; ``reap`` on the agent's progress
thread; arena blocks come back from whatever thread drops the last view; the fork hooks
on the forking thread, holding every watched receiver's lock across the fork. Lock order:
a transfer's lock, then the receiver lock. NIXL and GCS calls never run under the
receiver lock. Imports no Ray.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.descriptors import merge_descriptors
from ray_rdt_pool.core.selection import SelectionPlan, plan_for_object, plan_selection
from ray_rdt_pool.errors import (
    InvalidInputError,
    PoolExhaustedError,
    ReadStillRunningError,
    TransferError,
    WireFormatError,
    shut_down_error,
)
from ray_rdt_pool.receive.targets import check_targets, read_pieces, target_descs
from ray_rdt_pool.registry import MEM_TYPE, Directory, RegEntry, Region, Registry
from ray_rdt_pool.same_node.shared import (
    ChildLeases,
    HostInfo,
    MappedPool,
    NotVisibleError,
    SourceProcess,
    lease_slot,
    mappable_spans,
    peer_batch_reader,
    privatize,
    probe_source,
)

if TYPE_CHECKING:
    import torch

    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.core.wire import WireMeta
    from ray_rdt_pool.obs.events import Events

logger = logging.getLogger(__name__)

__all__ = ["PEER_IDLE_S", "Fetch", "Landing", "Peer", "Receiver", "Transfer"]
# re-exported for other packages until the lead rewires them
__all__ += ["target_descs"]

#: A peer unused this long, with nothing in flight, is removed (its process may be gone).
#: Long: with NIXL 1.5.1 (UCX) a removed agent's connection stays open in both processes,
#: so a peer removed while its sender lives and added again at its next object leaks a
#: TCP connection per read lane each time (it was 120 s: a trainer syncing every few
#: minutes leaked at every sync). Removing a dead sender's agent frees no socket either;
#: it only lets its view, and the remote_agents gauge, go.
PEER_IDLE_S = 3600.0
#: Most peers kept loaded; the least recently used idle ones go first.
MAX_PEERS = 256
#: Senders remembered by agent name for the same-node path (mapped or not).
MAX_HOSTS = 1024
#: An idle peer whose removal NIXL refused this many times in a row is forgotten.
MAX_REMOVE_TRIES = 3
#: Aborts remembered for fetches that have not started (bounded; see Receiver.abort).
MAX_PENDING_ABORTS = 1024
_FINISHED_IDS = 4096
_HOUSEKEEPING_S = 1.0
#: A same-node sender whose pool could not be opened (no free lease row, a GCS error) is
#: asked again after this long; its objects are read with NIXL meanwhile.
HOST_RETRY_S = 10.0


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


@dataclass(eq=False)
class Landing:
    """Where one READ's bytes land. ``release`` runs once, after the transfer ended."""

    kind: str  # "arena", "temp" or "targets"
    addr: int = 0
    device: str = "cpu"
    device_id: int = 0
    region: Region | None = None
    key: int = -1
    offset: int = 0
    temp: Any = None  # the one-off buffer (a tensor)
    temp_handle: Any = None
    entries: list[RegEntry] = field(default_factory=list)
    # Storages of targets that lie in our arena: held, so that their arena blocks stay
    # theirs until the READ has ended even if the caller drops the targets meanwhile.
    keep: list[Any] = field(default_factory=list)
    released: bool = False


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


class Fetch:
    """The receiver's side of one ``fetch``/``wait`` pair (see transport.PoolFetch)."""

    def __init__(self, obj_id: str, meta: WireMeta) -> None:
        self.obj_id = obj_id
        self.meta = meta
        self.transfer: Transfer | None = None
        self.copy_into: list[torch.Tensor] | None = None
        self.targets: list[torch.Tensor] | None = None
        self.selected: SelectionPlan | None = None  # a partial READ (fetch_selected)
        self.selection: Sequence[Any] | None = None  # its slices, as the caller gave them
        self.tensors: list[torch.Tensor] = []
        self.t_start = time.perf_counter()
        self.ndescs = 0
        self.settled = False  # wait() returned or raised: the transfer is accounted for


class Receiver:
    """The receiving half of one process's transport."""

    def __init__(self, config: PoolConfig, registry: Registry, events: Events,
                 backend: Callable[[], Any], directory: Directory,
                 node_id: Callable[[], str | None] | None = None) -> None:
        self.config = config
        self._node_id = node_id or (lambda: None)
        # Same-node senders by agent name: our handle on their shared pool, or None when
        # their objects are read with NIXL (another node, no shared pool, or no access).
        self.hosts: OrderedDict[str, MappedPool | None] = OrderedDict()
        self._host_retry: dict[str, float] = {}  # agent -> when to ask again (see _host)
        # agent -> the registration epoch at which its directory held no same-node entry:
        # its pool may be made later, and is asked for again at a newer epoch (see _host).
        self._host_absent: dict[str, int] = {}
        # Objects whose views died: (pool, slot, address, length, bytes); appended by
        # deleters from any thread, their pages given back and unleased under the lock.
        self._unmaps: deque[_Unmap] = deque()
        # Leases this process holds (object mappings whose views live, copies running),
        # counted here: a sender's handle is dropped when it exits, its leases are not.
        self.mapped_objects = 0
        self.mapped_bytes = 0
        # No progress thread drains for us any more (after shutdown(), in a forked child):
        # a deleter drains itself. _draining guards against a drain inside a drain (a
        # deleter run by GC) and keeps drains out while a fork is prepared.
        self._self_drain = False
        self._shut = False  # shutdown() ran: no new sender handle is kept
        self._draining = False
        self._later_lock = threading.Lock()  # guards _later_pending (see _drain_later)
        self._later_pending = False
        # Objects of a pool mapping that views may still use, by address: (pool, slot,
        # length). Changed under the lock; a forked child copies each into memory of its
        # own.
        self._live: dict[int, tuple[MappedPool, int, int]] = {}
        # Forks in progress or done whose child may not have copied its mappings yet: the
        # read end of a pipe the child closes once it has, and the extra lease this
        # process took on each mapping's slot for it (see _before_fork).
        self._forks: list[tuple[int, list[tuple[MappedPool, int]]]] = []
        # (pipe read end, write end, extra leases, parent pid) between the fork hooks
        self._fork_prep: tuple[int, int, list[tuple[MappedPool, int]], int] | None = None
        self._fork_locked = False  # _before_fork took the lock: the after-hooks release it
        self._fork_draining = False
        # In a forked child whose copy of an inherited mapping failed: its own leases
        # on their blocks, kept until it exits (its row is swept then).
        self._uncopied_leases: ChildLeases | None = None
        self.registry = registry
        self.events = events
        self._backend = backend
        self.directory = directory
        self.lock = threading.RLock()
        self.arenas: dict[str, Region] = {}  # device type -> arena; created on first use
        self._keys = itertools.count()
        # (device, key) of arena blocks whose views died; appended from any thread
        # (deleters may fire inside our own critical sections), drained under the lock.
        self._arena_dead: deque[tuple[str, int]] = deque()
        self.peers: OrderedDict[str, Peer] = OrderedDict()
        self.outstanding: dict[int, Transfer] = {}  # id -> transfer not yet ended
        self._dropped: deque[Transfer] = deque()  # from Fetch objects Ray never waited on
        self.pending_aborts: OrderedDict[str, float] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._next_housekeeping = 0.0

    # -- arenas ---------------------------------------------------------------------------

    def _drain_locked(self) -> None:
        if self._draining:
            return  # a deleter run by GC inside a drain: the loop below picks it up
        while True:
            self._drain_once_locked()
            # A deleter that ran (GC) after the loops below but before _draining was
            # cleared saw a drain in progress and left its release queued: take it too.
            if not (self._unmaps or self._arena_dead):
                return

    def _drain_once_locked(self) -> None:
        self._draining = True
        try:
            while self._unmaps:
                host, slot, addr, length, nbytes = self._unmaps.popleft()
                if length:  # 0: a copy, no pages of ours to give back
                    self._live.pop(addr, None)
                    # First: no copy-on-write page outlives the lease.
                    if not host.drop_view(slot, addr, length):
                        continue  # those pages stay ours: the block must stay leased
                self._unlease_locked(host, slot, nbytes)
            if self._forks:
                self._settle_forks_locked()
            while self._arena_dead:
                device, key = self._arena_dead.popleft()
                arena = self.arenas.get(device)
                if arena is not None:
                    arena.alloc.free(key)
        finally:
            self._draining = False

    def _mapping_died(self, release: _Unmap) -> None:
        """The deleter of an object mapping's views (any thread, maybe inside GC): queue
        its release for the next drain, or drain now when no progress thread will."""
        self._unmaps.append(release)
        while self._self_drain and self._unmaps and not self._draining:
            # Never wait: this may run inside GC in a thread holding any lock. Another
            # thread holds ours and need not drain before it lets go, so a helper thread
            # waits for the lock and drains (the lease would be stranded otherwise).
            # The lock is re-entrant: this thread may hold it already, in the middle of
            # changing what a drain changes (an allocation carving a block), so a drain
            # here would run inside that change. The helper drains once it is let go.
            if self.lock._is_owned() or not self.lock.acquire(blocking=False):  # type: ignore[attr-defined]
                self._drain_later()
                return
            try:
                self._drain_locked()
            finally:
                self.lock.release()

    def _drain_later(self) -> None:
        """Start one thread that waits for the lock and drains (self-drain mode only)."""
        with self._later_lock:
            if self._later_pending:
                return
            self._later_pending = True

        def drain() -> None:
            try:
                with self.lock:
                    with self._later_lock:
                        self._later_pending = False
                    self._drain_locked()
            except Exception:
                logger.warning("returning leases of dead views failed", exc_info=True)

        try:
            threading.Thread(target=drain, name="rdt-pool-drain", daemon=True).start()
        except RuntimeError:  # interpreter shutting down: the process exits anyway
            with self._later_lock:
                self._later_pending = False

    def _arena(self, device: str) -> Region:
        with self.lock:
            arena = self.arenas.get(device)
        if arena is None:
            arena = self.registry.new_region(self.config.arena_capacity, device,
                                             f"{device} receive arena", self.config.prefault,
                                             lanes=True,
                                             sized_by="arena_bytes (RAY_RDT_POOL_ARENA_BYTES)",
                                             named=False)
            with self.lock:
                if device in self.arenas:  # another thread won the race
                    extra, arena = arena, self.arenas[device]
                else:
                    self.arenas[device] = arena
                    extra = None
            if extra is not None:
                self.registry.drop_region(extra)
        return arena

    def _land(self, f: Fetch, device: str, targets: Sequence[torch.Tensor] | None
              ) -> tuple[Landing, list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """Reserve the landing of ``f``; returns it with the READ's (local, remote)."""
        meta = f.meta
        total = meta.total if f.selected is None else f.selected.total
        if targets:
            entries: list[RegEntry] = []
            keep: list[Any] = []
            storages = [t.untyped_storage() for t in targets]
            with self.lock:
                arenas = dict(self.arenas)
                live = self._live
                # Views of a same-node mapping: no registration covers them, and a cached
                # one would hold the mapping, and the sender's lease on its block, for as
                # long as the cache keeps it. Then all are copied into, from the arena.
                mapped = bool(live) and any(st.data_ptr() in live for st in storages)
            try:
                for t, st in zip(targets, [] if mapped else storages):
                    if _in_arena(t, st, arenas):
                        # Our received tensors reused as targets: the arena's registration
                        # covers them. Caching a registration of them would hold the
                        # storage, and so the arena block, for as long as the cache keeps
                        # it.
                        keep.append(st)
                        continue
                    e = self.registry.acquire_if_seen(t)
                    if e is not None:
                        entries.append(e)
            except BaseException:
                for e in entries:  # a registration refused: the ones taken go back
                    self.registry.release(e)
                raise
            if not mapped and len(entries) + len(keep) == len(targets):
                landing = Landing("targets", device=device, entries=entries, keep=keep)
                f.targets = list(targets)
                return (landing, *target_descs(targets, meta))
            for e in entries:
                self.registry.release(e)
            # Buffers seen for the first time: registering each storage costs more than
            # one copy, so read into the arena and copy out.
            f.copy_into = list(targets)
        arena = self._arena(device)
        dev_id = int(arena.mem.device_id)
        found = self._arena_block(arena, device, total)
        if found is not None:
            landing = found
        else:
            import torch

            self.events.add("receive_fallbacks")
            buf = torch.empty(total, dtype=torch.uint8, device=arena.mem.torch_device)
            handle = self.registry.register_buffer(buf.data_ptr(), total, device, dev_id)
            landing = Landing("temp", buf.data_ptr(), device, dev_id, temp=buf,
                              temp_handle=handle)
        if f.selected is not None:
            return (landing, *read_pieces(
                meta, [(p, landing.addr + lo, n) for lo, p, n in f.selected.runs], dev_id))
        local = [(landing.addr + v, n, dev_id) for v, _a, n in meta.segments]
        remote = [(a, n, meta.device_id) for _v, a, n in meta.segments]
        return landing, local, remote

    def release_landing(self, landing: Landing) -> None:
        """Return a landing. Only ever called once its transfer has ended (or none ran)."""
        if landing.released:
            return
        landing.released = True
        if landing.kind == "arena":
            self._arena_dead.append((landing.device, landing.key))
            with self.lock:
                self._drain_locked()
        elif landing.kind == "temp":
            if landing.temp_handle is not None:
                self.registry.deregister_buffer(landing.temp_handle, landing.temp)
                landing.temp_handle = None
            landing.temp = None
        else:
            entries, landing.entries = landing.entries, []
            landing.keep = []
            for e in entries:
                self.registry.release(e)

    # -- peers ----------------------------------------------------------------------------

    def _lease_peer(self, meta: WireMeta) -> Peer:
        """One lease on the sender's peer, loading its metadata first if needed."""
        name, need = meta.agent, meta.agent_version
        while True:
            with self.lock:
                peer = self.peers.get(name)
                if peer is None:
                    peer = self.peers[name] = Peer(name)
                if not peer.busy and peer.loaded >= need and not (
                        peer.stale and peer.in_flight == 0):
                    peer.in_flight += 1
                    peer.last_used = time.monotonic()
                    self.peers.move_to_end(name)
                    self.events.add("in_flight")
                    return peer
            self._load_peer(peer, need)

    def _lookup(self, name: str, need: int) -> tuple[int, int, bytes]:
        deadline = time.monotonic() + self.config.fetch_timeout_s
        delay = 0.002
        while True:
            found = self.directory.lookup(name)
            if found is not None and found[0] >= need:
                return found
            if time.monotonic() > deadline:
                raise TransferError(
                    f"no NIXL metadata of version >= {need} for sender agent {name!r} in "
                    f"Ray's GCS after {self.config.fetch_timeout_s}s; the sender process may "
                    "have exited. Fetch objects from a live sender")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _load_peer(self, peer: Peer, need: int) -> None:
        """Bring NIXL's view of ``peer`` to epoch >= ``need`` without waiting for READs."""
        backend = self._backend()
        with peer.load_lock:
            with self.lock:
                if self.peers.get(peer.name) is not peer:
                    return  # removed meanwhile: the caller retries with the current one
                if peer.loaded >= need and not (peer.stale and peer.in_flight == 0):
                    return
            try:
                version, reset, md = self._lookup(peer.name, max(need, peer.loaded, 0))
            except BaseException:
                with self.lock:
                    if (not peer.in_nixl and peer.in_flight == 0
                            and self.peers.get(peer.name) is peer):
                        del self.peers[peer.name]  # not in NIXL: nothing to remove
                    else:
                        self._suspect(peer)
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
                    self._suspect(peer)
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

    def _suspect(self, peer: Peer) -> None:
        """A READ from ``peer`` failed: remove it at the next housekeeping once idle."""
        peer.suspect = True
        self._next_housekeeping = 0.0

    def _remove_peer(self, peer: Peer, cut: bool) -> None:
        """Remove ``peer``'s agent: when idle, or (``cut``) to end READs that never end.

        Runs on the progress thread and never waits: a load of the same peer (which may
        wait on the GCS for up to ``fetch_timeout_s``) holds ``load_lock``, and then the
        removal is tried again at a later reap. A removal NIXL refuses leaves every READ
        from the peer in flight, their landings reserved (NIXL may still write there);
        it is tried again after :data:`_HOUSEKEEPING_S`. An idle peer whose removal was
        refused :data:`MAX_REMOVE_TRIES` times is forgotten (its agent may stay loaded).
        """
        backend = self._backend()
        if not peer.load_lock.acquire(blocking=False):
            return
        try:
            with self.lock:
                if self.peers.get(peer.name) is not peer or (peer.in_flight and not cut):
                    return
                if time.monotonic() < peer.retry_at:
                    return
                peer.busy = True
                victims = [t for t in self.outstanding.values() if t.peer is peer]
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
                with t.lock:
                    if t.final is None:
                        self._end_locked(t, "CUT")
            with self.lock:
                peer.loaded = peer.view_since = -1
                peer.stale = peer.busy = peer.in_nixl = False
                peer.remove_failures = 0
                if peer.in_flight == 0 and self.peers.get(peer.name) is peer:
                    del self.peers[peer.name]
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
            peer.retry_at = time.monotonic() + _HOUSEKEEPING_S
            self._suspect(peer)
            forget = (not cut and peer.in_flight == 0
                      and peer.remove_failures >= MAX_REMOVE_TRIES
                      and self.peers.get(peer.name) is peer)
            if forget:
                del self.peers[peer.name]
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

    # -- transfers ------------------------------------------------------------------------

    def _end_locked(self, t: Transfer, state: str, release_handle: bool = True) -> None:
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
            t.peer.in_flight -= 1
            if state != "DONE":
                self._suspect(t.peer)
            self.events.add("in_flight", -1)
        if t.abandoned:
            if state == "DONE":
                self.events.add("late_completions")
            self.release_landing(t.landing)

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
                self._end_locked(t, state)
            return state

    def abandon(self, t: Transfer) -> None:
        """Nobody will consume ``t``: its landing returns once the READ has ended."""
        with t.lock:
            if t.final is not None:
                self.release_landing(t.landing)
                return
            t.abandoned = True
            try:
                self._backend().release(t.handle)
            except Exception:
                # NIXL could not cancel it: the handle stays valid and the READ may still
                # write into the landing. reap() polls it until it ends or is cut off.
                logger.debug("cancelling an in-flight READ failed; polling it", exc_info=True)
                return
            self._end_locked(t, "CANCELLED", release_handle=False)

    def reap(self) -> None:
        """Progress-thread housekeeping: end abandoned READs, cut overdue ones, drop
        dead peers. Cheap when there is nothing to do."""
        while True:
            try:  # another thread (a fetch, the progress thread) may take the last one
                t = self._dropped.popleft()
            except IndexError:
                break
            self.abandon(t)
        now = time.monotonic()
        with self.lock:
            waiting = [t for t in self.outstanding.values() if t.abandoned]
            housekeeping = now >= self._next_housekeeping and bool(self.peers or self.hosts)
            self._drain_locked()
        for t in waiting:
            if self.poll(t) == "PROC" and now > t.started + self.config.fetch_timeout_s:
                self._remove_peer(t.peer, cut=True)
        if housekeeping:
            self._next_housekeeping = now + _HOUSEKEEPING_S
            with self.lock:
                idle = [p for p in self.peers.values() if p.in_flight == 0 and not p.busy]
                victims = [p for p in idle if p.suspect or now - p.last_used > PEER_IDLE_S]
                extra = len(self.peers) - MAX_PEERS
                victims += [p for p in idle if p not in victims][:max(0, extra)]
            for p in victims:
                self._remove_peer(p, cut=False)
            self._close_dead_hosts()

    def dropped(self, t: Transfer) -> None:
        """A Fetch died unconsumed (any thread, maybe inside GC): abandon it later."""
        self._dropped.append(t)

    # -- same-node senders: private mappings of their shared pool ------------------------

    def _host(self, agent: str, version: int) -> MappedPool | None:
        """Our handle on ``agent``'s shared pool if it runs on this node, else None
        (looked up outside the lock: a GCS round trip). ``version``: the registration
        epoch of the object being fetched.

        A definite answer (another node, a pool that is not shared, a GPU we do not land
        on) is kept. No entry at all (the sender has no pool yet) holds for objects of
        that epoch or older: a sender moves its epoch once the entry is published, before
        any object names the pool (see ``Sender._share``), so only an object of a newer
        epoch can name a pool made since, and it is asked again then (lookups stay
        bounded by the sender's registrations). A failure that may pass (the GCS did not
        answer, every lease row of the sender was taken, its pool could not be opened) is
        asked again after :data:`HOST_RETRY_S`; meanwhile the objects are read with
        NIXL."""
        with self.lock:
            host = self.hosts.get(agent)
            if host is not None:
                self.hosts.move_to_end(agent)  # least recently used goes first
                return host
            if agent in self.hosts:
                absent = self._host_absent.get(agent)
                if absent is not None:
                    if version <= absent:
                        return None
                else:
                    retry = self._host_retry.get(agent)
                    if retry is None or time.monotonic() < retry:
                        return None
                    del self._host_retry[agent]
            first = agent not in self.hosts
        node = self._node_id()
        failed = False
        blob = None
        try:
            blob = self.directory.lookup_host(agent) if node is not None else None
            if blob is not None:
                info = HostInfo.decode(blob)
                if info.node_id == node and not (info.cuda is not None
                                                 and not _cuda_available()):
                    host = MappedPool(info)
        except NotVisibleError as e:
            logger.debug("same-node sender %s: %s; its objects are read with NIXL", agent, e)
        except WireFormatError as e:  # a peer of another version: that will not change
            logger.warning("cannot map the pool of same-node sender %s (%s); its objects "
                           "are read with NIXL", agent, e)
        except Exception as e:
            failed = True
            logger.log(logging.WARNING if first else logging.DEBUG,
                       "cannot map the pool of same-node sender %s (%s: %s); its objects are "
                       "read with NIXL, and it is asked again in %.0f s", agent,
                       type(e).__name__, e, HOST_RETRY_S)
        with self.lock:
            if self._shut:  # shutdown() closed the handles meanwhile: nothing may keep one
                if host is not None:
                    host.close()
                raise shut_down_error()
            current = self.hosts.get(agent)
            if current is not None:  # another thread opened it meanwhile
                if host is not None:
                    host.close()
                return current
            self.hosts[agent] = host
            self.hosts.move_to_end(agent)
            if host is not None:
                _watch_forks(self)
                self._host_absent.pop(agent, None)
            elif blob is None and not failed:
                self._host_absent[agent] = max(version, self._host_absent.get(agent, -1))
            else:  # a definite answer, or a failure asked again by time
                self._host_absent.pop(agent, None)
            if failed:
                self._host_retry[agent] = time.monotonic() + HOST_RETRY_S
            while len(self.hosts) > MAX_HOSTS:
                name, old = self.hosts.popitem(last=False)
                self._host_retry.pop(name, None)
                self._host_absent.pop(name, None)
                if old is not None:
                    old.close()  # its views keep their leases (and the table) until they die
        return host

    def _unlease_locked(self, host: MappedPool, slot: int, nbytes: int) -> None:
        host.release_one(slot)
        self.mapped_objects -= 1
        self.mapped_bytes -= nbytes

    def _close_dead_hosts(self) -> None:
        with self.lock:
            hosts = [(n, h) for n, h in self.hosts.items() if h is not None]
        dead = [(n, h) for n, h in hosts if not h.alive()]  # reads /proc: not under the lock
        with self.lock:
            for n, h in dead:
                if self.hosts.get(n) is h:
                    self.hosts[n] = None
                h.close()  # mappings of its objects stay valid while their views live

    def _try_map(self, f: Fetch, device: str, targets: Sequence[torch.Tensor] | None
                 ) -> bool:
        """Serve ``f`` from a same-node sender's shared pool, with no NIXL READ.

        ``map``: the tensors are views of a private mapping that holds a lease until they
        die (of a selection, the pieces contiguous in their tensor; strided ones are
        copied out). ``copy``, or target buffers: one copy out of the mapping, and the
        lease drops at once. False when the object cannot be mapped (another node,
        overflow or ``register_memory()`` memory, no access): then NIXL reads it."""
        meta = f.meta
        if self.config.same_node == "off" or meta.device != device:
            return False
        if targets and any(t.device.type != device for t in targets):
            return False
        for _attempt in range(2):
            host = self._host(meta.agent, meta.agent_version)
            if host is None or (host.cuda is not None) != (device == "cuda"):
                return False
            if not host.alive():
                # Its memory would still be readable through our descriptors, but Ray holds
                # the object lost with its process, as a READ from it would find.
                with self.lock:
                    if self.hosts.get(meta.agent) is host:
                        self.hosts[meta.agent] = None
                    host.close()
                self.events.error("err")
                raise TransferError(
                    f"the sender of object {f.obj_id} ({meta.agent}, pid {host.info.pid}) "
                    "has exited; its objects are gone. Fetch objects from a live sender")
            spans = mappable_spans(meta.segments, meta.total, host.info)
            if spans is None or spans[0][0] != 0:
                return False
            slot = lease_slot(spans[0][1])
            self._backend()  # the progress thread returns dead views' leases
            with self.lock:
                self._drain_locked()
                # Closed by another thread since _host() (evicted, or its sender exited):
                # close() and lease() both run under this lock, so this check holds.
                if host.closed:
                    continue
                host.lease(slot)
                self.mapped_objects += 1
                self.mapped_bytes += meta.total
            break
        else:
            return False
        # CUDA memory opened through IPC cannot be mapped copy-on-write: views of it would
        # let one receiver's in-place write change what every later receiver reads, so a
        # CUDA object is always copied out (one device-to-device copy) and the lease drops
        # at once.
        copy_out = bool(targets) or device == "cuda" or self.config.same_node == "copy"
        dev_id = 0
        addr = length = 0
        pieces: list[tuple[int, int, int]] | None = None  # a fragmented object's spans
        try:
            if device == "cuda":
                # CUDA IPC: the sender's pool is opened once; an object is an offset in it.
                if len(spans) != 1:
                    raise OSError("a CUDA object spans several blocks")
                _d, dev_id, addr = host.device_addr(spans[0][1])
            else:
                with self.lock:
                    if copy_out or len(spans) > 1 or slot in host.viewing:
                        # A copy never writes the pool: it reads the shared read-only view
                        # (made under the lock: two first copies would each map the pool).
                        # In map mode a fragmented object is copied too (views of its
                        # blocks would need a mapping of their own), and so is an object
                        # whose pages views of an earlier get may have written.
                        base = host.shared_view()
                        addr = base + spans[0][1]
                        if len(spans) > 1:
                            pieces = [(v, base + off, n) for v, off, n in spans]
                    else:
                        addr, length = host.map(spans, meta.total)
                        # Before any view exists (see _before_fork).
                        self._live[addr] = (host, slot, length)
                        host.viewing.add(slot)
        except BaseException as e:
            with self.lock:
                if length and self._live.pop(addr, None) is not None:
                    host.drop_view(slot, addr, length)
                self._unlease_locked(host, slot, meta.total)
            if not isinstance(e, OSError):  # a Ctrl-C: the lease goes back all the same
                raise
            logger.warning("mapping object %s of same-node sender %s failed (%s); reading "
                           "it with NIXL", f.obj_id, meta.agent, e)
            return False
        release: _Unmap = (host, slot, addr, length, meta.total)
        # From here the lease is released by _from_mapping (or the views' deleter) on
        # every path; a failure leaves as a counted TransferError.
        what = (f"serving object {f.obj_id} ({meta.total:,} bytes) from the shared pool of "
                f"same-node sender {meta.agent}")
        try:
            with self.events.failures(what, "fetch again while the ref is in scope, or set "
                                            "same_node='off' to read with NIXL"):
                f.tensors = self._from_mapping(f, addr, release, targets, device, dev_id,
                                               pieces)
        finally:
            with self.lock:
                self._drain_locked()
        f.settled = True
        self._finish_id(f.obj_id)
        ev = self.events
        ev.add("objects_received")
        ev.add("mapped_gets")
        ev.add("bytes_received", meta.total if f.selected is None else f.selected.nbytes)
        if self.config.debug_transfers:
            logger.debug("fetched %s: %d tensors, %d bytes, mapped from the same-node "
                         "sender's pool (%s)", f.obj_id, meta.num_tensors, meta.total,
                         self.config.same_node)
        ev.notify("fetch", meta.total, time.perf_counter() - f.t_start)
        return True

    def _from_mapping(self, f: Fetch, addr: int, release: _Unmap,
                      targets: Sequence[torch.Tensor] | None, device: str, dev_id: int,
                      pieces: Sequence[tuple[int, int, int]] | None = None
                      ) -> list[torch.Tensor]:
        """The tensors of ``f``: views of the pool mapping at ``addr`` when ``release``
        names a mapped length, else one copy out of the object at ``addr`` (or of its
        ``pieces``, (packed offset, address, length) each, when it is fragmented)."""
        from ray_rdt_pool.memory.tensors import copy_bytes, device_block, rebuild, unpack_into

        meta = f.meta
        unmaps = self._unmaps
        if release[3]:
            # From here the block owns the mapping: its deleter releases it, even if the
            # rebuild below fails.
            block = device_block(addr, meta.total, "cpu", 0,
                                 lambda: self._mapping_died(release))
            out = rebuild(block, meta.runs, meta.run_starts())
            if f.selection is None:
                return out
            # A selection that is contiguous in the tensor is a view of the selected part:
            # only its pages are touched (the mapping faults pages in on first use) and
            # nothing is copied. A strided one is copied out, as every other path returns
            # it (transport.fetch_selected promises contiguous tensors); when every piece
            # is a copy, the mapping and its lease go as soon as this returns.
            return [t if s is None else _contiguous(t[s if isinstance(s, tuple) else (s,)])
                    for t, s in zip(out, f.selection)]
        # One copy out of the mapping (finished before returning); the mapping and its
        # lease go right after.
        sel = f.selected
        landing: Landing | None = None
        stream = self.config.tuning.stream_copy_bytes
        try:
            if targets and pieces is None:
                unpack_into(targets, meta.tensor_offsets(), addr, meta.total, device, dev_id,
                            stream)
                return list(targets)
            if targets and pieces is not None:
                copy_bytes(_piece_moves(pieces, [
                    (t.data_ptr(), off, t.numel() * t.element_size())
                    for t, off in zip(targets, meta.tensor_offsets())]), device, dev_id,
                    stream)
                return list(targets)
            size = meta.total if sel is None else sel.total
            landing = self._local_landing(size, device)
            moves = ([(landing.addr, 0, meta.total)] if sel is None else
                     [(landing.addr + lo, p, n) for lo, p, n in sel.runs])
            if pieces is None:
                copy_bytes([(d, addr + p, n) for d, p, n in moves], device, dev_id, stream)
            else:
                copy_bytes(_piece_moves(pieces, moves), device, dev_id, stream)
        except BaseException:
            if landing is not None:
                self.release_landing(landing)
            raise
        finally:
            unmaps.append(release)
        assert landing is not None
        if sel is not None:
            return self._rebuild_selected(landing, sel)
        landing.released = True  # ownership passes to the views
        if landing.kind == "arena":
            dead, key = self._arena_dead, (landing.device, landing.key)
            block = device_block(landing.addr, size, device, landing.device_id,
                                 lambda: dead.append(key))
        else:
            block = landing.temp
        return rebuild(block, meta.runs, meta.run_starts())

    def _arena_block(self, arena: Region, device: str, size: int) -> Landing | None:
        """One contiguous block of ``arena`` as a landing, or None when it is full."""
        key = next(self._keys)
        with self.lock:
            self._drain_locked()
            try:
                (block,) = arena.alloc.allocate(key, size, max_blocks=1)
            except PoolExhaustedError:
                return None
        arena.populate(block[0] + block[1])
        return Landing("arena", arena.addr + block[0], device, int(arena.mem.device_id),
                       arena, key, block[0])

    def _local_landing(self, size: int, device: str = "cpu") -> Landing:
        """A block for a copy out of a mapping: the arena of ``device``, else a plain
        buffer (no NIXL registration: nothing reads into it remotely)."""
        arena = self._arena(device)
        found = self._arena_block(arena, device, size)
        if found is not None:
            return found
        import torch

        self.events.add("receive_fallbacks")
        buf = torch.empty(size, dtype=torch.uint8, device=arena.mem.torch_device)
        return Landing("temp", buf.data_ptr(), device, int(arena.mem.device_id), temp=buf)

    # -- fork: a child keeps the bytes of its inherited mappings, and no lease row ---------

    def _before_fork(self) -> None:
        """In the parent, before ``fork()``: hold the lock across it (the child inherits a
        consistent state and a lock nobody else holds), and take one more lease on every
        live mapping's slot. The child copies its inherited mappings into memory of its
        own first thing; until it has (it closes the pipe made here, or exits), this
        process keeps those leases, so the sender cannot reuse a block the child is still
        reading, whatever this process's views do meanwhile."""
        self.lock.acquire()
        self._fork_locked = True
        self._fork_draining = self._draining
        self._draining = True  # no drain (a deleter's) between here and the fork
        live = list(self._live.values())
        if not live:
            return
        try:
            r, w = os.pipe()
        except OSError as e:
            # Nothing to wait on: the child copies at once, unguarded. It still never
            # touches our row.
            logger.warning("no pipe for a fork (%s): the child's copies of %d same-node "
                           "mapping(s) are not guarded by a lease", e, len(live))
            return
        extra = [(host, slot) for host, slot, _n in live if host.counts is not None]
        for host, slot in extra:
            host.lease(slot)
        self._fork_prep = (r, w, extra, os.getpid())

    def _after_fork_parent(self) -> None:
        prep, self._fork_prep = self._fork_prep, None
        if prep is not None:
            r, w, extra, _parent = prep
            os.close(w)  # the child's copy of it is the one whose close we wait for
            os.set_blocking(r, False)
            self._forks.append((r, extra))
        self._release_fork_lock()

    def _after_fork_child(self) -> None:
        """In the child: copy every inherited object mapping into anonymous memory at the
        same address, and forget every handle (their rows are the parent's: nothing here
        may take or return a lease through them). Then tell the parent."""
        prep, self._fork_prep = self._fork_prep, None
        own = None
        if prep is not None and self._live:
            own = ChildLeases([(host, slot) for host, slot, _n in self._live.values()],
                              prep[3])
            if not own.parent_ran:
                logger.error("the parent of this forked child exited before the child "
                             "held its inherited same-node mappings; the bytes of %d "
                             "inherited view(s) may be those of a later object",
                             len(self._live))
        copied = True
        kept: dict[int, list[tuple[int, int]]] = {}  # handle -> its ranges views use
        for addr, (host, _slot, length) in self._live.items():
            kept.setdefault(id(host), []).append((addr, length))
            if not privatize(addr, length):
                copied = False
                logger.error("a forked child could not copy a same-node mapping of %d "
                             "bytes; it and its parent hold its block until this process exits",
                             length)
        if own is not None:
            if copied:
                own.end()
            else:  # the mappings still show the pool: hold their blocks until we exit
                self._uncopied_leases = own
        handles = {id(h): h for h in self.hosts.values() if h is not None}
        handles.update((id(h), h) for h, _s, _n in self._live.values())
        handles.update((id(u[0]), u[0]) for u in self._unmaps)
        for h in handles.values():
            h.forget(kept.get(id(h), ()))
        self.hosts.clear()
        self._host_retry.clear()
        self._live.clear()
        for r, _extra in self._forks:  # the parent's to settle
            os.close(r)
        self._forks.clear()
        self._self_drain = True  # no progress thread here
        self._later_lock = threading.Lock()  # another thread may have held it at the fork
        self._later_pending = False
        if prep is not None:
            r, w, _extra, _parent = prep
            os.close(r)
            if copied:
                os.close(w)
            # else: w stays open, so the parent holds the leases until this process exits
        self._release_fork_lock()

    def _release_fork_lock(self) -> None:
        if self._fork_locked:
            self._fork_locked = False
            self._draining = self._fork_draining
            if self._self_drain and not self._draining:
                # Deleters that ran during the fork found drains held off; with no
                # progress thread, nobody else would return their leases.
                self._drain_locked()
            self.lock.release()

    def _settle_forks_locked(self) -> None:
        """Drop the extra leases of forks whose child has copied its mappings (closed
        its end of the pipe) or exited."""
        pending = []
        for r, extra in self._forks:
            try:
                if os.read(r, 1):
                    pending.append((r, extra))  # nothing is ever written: keep waiting
                    continue
            except BlockingIOError:
                pending.append((r, extra))
                continue
            except OSError:
                pass
            os.close(r)
            for host, slot in extra:
                host.release_one(slot)
        self._forks = pending

    # -- source reads (the weights API's stream) -------------------------------------------

    def can_read_source(self, src: SourceProcess) -> bool:
        """Whether tensors of ``src`` can be read straight out of its memory: it runs on
        this Ray node, ``same_node`` is not ``"off"`` here, and a read of its probe
        succeeds (the kernel may forbid reading another process)."""
        if self.config.same_node == "off" or not isinstance(src, SourceProcess):
            return False
        node = self._node_id()
        return node is not None and node == src.node and probe_source(src)

    def read_source(self, src: SourceProcess, tensors: Sequence[tuple[int, tuple[int, ...],
                                                                      str]],
                    selection: Sequence[Any] | None = None,
                    targets: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Copy tensors, given as ``(address, shape, dtype name)`` in ``src``, out of that
        process's memory: into ``targets`` (contiguous CPU tensors of exactly those
        sizes), or else into a block of the receive arena whose views are returned (a
        temporary buffer when the arena is full), only the ``selection`` of each if given
        (as :func:`plan_selection`). One copy, no NIXL. Runs on the calling thread and
        up to ``read_lanes - 1`` pack helpers for ``read_split_bytes`` or more.

        Raises TransferError when the source process is gone or the kernel refuses a
        read (nothing is returned; a target may hold part of the bytes), and
        InvalidInputError for targets that do not match.
        """
        from ray_rdt_pool.core.wire import DTYPES
        from ray_rdt_pool.memory.tensors import copy_moves

        t_start = time.perf_counter()

        sizes = []
        for _addr, shape, dt in tensors:
            if dt not in DTYPES:
                raise InvalidInputError(f"unknown dtype {dt!r} in a source read")
            sizes.append(math.prod(shape) * DTYPES[dt][1])
        landing: Landing | None = None
        sel: SelectionPlan | None = None
        if targets is not None:
            if len(targets) != len(tensors) or selection is not None:
                raise InvalidInputError(
                    f"{len(targets)} targets for {len(tensors)} source tensors (and no "
                    "selection): pass one contiguous CPU target per tensor")
            for i, (t, n) in enumerate(zip(targets, sizes)):
                if t.device.type != "cpu" or not t.is_contiguous() or t.nbytes != n:
                    raise InvalidInputError(
                        f"target {i} ({tuple(t.shape)}, {t.dtype}, {t.device}) cannot hold "
                        f"source tensor {i} ({n} bytes): pass a contiguous CPU tensor of "
                        "that size")
            moves = [(t.data_ptr(), addr, n)
                     for t, (addr, _s, _d), n in zip(targets, tensors, sizes) if n]
        else:
            sel = plan_selection([(shape, dt) for _a, shape, dt in tensors],
                                 [addr for addr, _s, _d in tensors],
                                 selection if selection is not None else [None] * len(tensors))
            if sel.total == 0:  # this receiver takes nothing of these tensors
                from ray_rdt_pool.memory.tensors import empty_tensor, torch_dtype

                return [empty_tensor(shape, torch_dtype(dt))
                        for shape, dt in zip(sel.shapes, sel.dtypes)]
            landing = self._local_landing(sel.total)
            moves = [(landing.addr + lo, addr, n) for lo, addr, n in sel.runs]
        nbytes = sum(n for _d, _s, n in moves)
        tuning = self.config.tuning
        threads = tuning.read_lane_count if nbytes >= tuning.read_split_bytes else 1
        try:
            if not src.alive():
                raise OSError(3, f"process {src.pid} has exited")
            copy_moves(moves, threads, batch=peer_batch_reader(src.pid))
        except OSError as e:
            if landing is not None:
                self.release_landing(landing)
            self.events.error("err")
            raise TransferError(
                f"reading {nbytes} bytes of {len(tensors)} tensor(s) out of sender process "
                f"{src.pid} failed ({e}); it has probably exited. Sync again from a live "
                "sender") from e
        except BaseException:
            if landing is not None:
                self.release_landing(landing)
            raise
        self.events.add("source_reads")
        self.events.add("bytes_received", nbytes)
        if self.config.debug_transfers:
            logger.debug("read %d tensors, %d bytes in place from pid %d", len(tensors),
                         nbytes, src.pid)
        self.events.notify("fetch", nbytes, time.perf_counter() - t_start)
        if targets is not None:
            return list(targets)
        assert landing is not None and sel is not None
        return self._rebuild_selected(landing, sel)

    # -- fetch / wait ---------------------------------------------------------------------

    def fetch(self, obj_id: str, meta: WireMeta, device_hint: str | None,
              targets: Sequence[torch.Tensor] | None,
              selection: Sequence[Any] | None = None) -> Fetch:
        """Start reading ``obj_id`` (or, with ``selection``, only part of each tensor:
        see :func:`~ray_rdt_pool.core.selection.plan_for_object`); never waits for other fetches."""
        from ray_rdt_pool.memory.tensors import empty_like_run_list, empty_tensor, torch_dtype

        f = Fetch(obj_id, meta)
        if targets:
            check_targets(targets, meta, self.config.tuning.native)
            device = targets[0].device.type
        else:
            device = device_hint if device_hint in MEM_TYPE else meta.device
        if device == "cuda" and not targets and not _cuda_available():
            # Checked before the empty-object shortcuts too: they build tensors on
            # ``device``, which torch refuses with an untyped error in such a process.
            self.events.error("err")
            raise TransferError(
                f"object {obj_id} holds CUDA tensors but this process has no CUDA device; "
                "give the actor a GPU (num_gpus=1), or land it in host memory with "
                "ray.experimental.set_target_device_for_ref(ref, 'cpu') before ray.get")
        if selection is not None:
            f.selected = plan_for_object(meta, selection)
            f.selection = selection
            if f.selected.total == 0:
                f.tensors = [empty_tensor(s, torch_dtype(d), device)
                             for s, d in zip(f.selected.shapes, f.selected.dtypes)]
                f.settled = True
                return f
        if meta.num_tensors == 0 or not meta.segments:
            f.tensors = list(targets) if targets else empty_like_run_list(meta.runs, device)
            f.settled = True
            return f
        self.reap()
        with self.lock:
            self._forget_finished(obj_id)
            if self._pending_abort(obj_id):
                self.events.error("aborted")
                raise TransferError(f"the transfer of object {obj_id} was aborted")
        if self._try_map(f, device, targets):
            return f
        what = f"starting the READ of object {obj_id} ({meta.total:,} bytes) from {meta.agent}"
        with self.events.failures(what, "the sender may have exited; fetch again while the "
                                        "ref is in scope"):
            peer: Peer | None = None
            landing: Landing | None = None
            try:
                peer = self._lease_peer(meta)
                landing, local, remote = self._land(f, device, targets)
                local, remote = merge_descriptors(local, remote)
                f.ndescs = len(local)
                handle = self._backend().start_read(local, remote, meta.agent,
                                                    MEM_TYPE[landing.device],
                                                    MEM_TYPE[meta.device],
                                                    split=landing.kind == "arena")
                # Tracked before anything else can raise (a Ctrl-C): reap() must be able
                # to end it, or its landing and the peer's lease stay held for good.
                t = Transfer(obj_id, handle, peer, landing, time.monotonic())
                with self.lock:
                    self.outstanding[id(t)] = t
                    if self._pending_abort(obj_id):  # arrived while the READ was posted
                        t.aborted = True
                f.transfer = t
                self.events.add("reads_posted")
            except BaseException as e:
                if f.transfer is not None:
                    # Posted, then interrupted: nobody will wait for it.
                    f.settled = True
                    self._finish_id(obj_id)
                    self.abandon(f.transfer)
                    raise
                if (isinstance(e, ReadStillRunningError) and e.running is not None
                        and landing is not None and peer is not None):
                    # Part of it may still write: keep the landing and the lease until
                    # it ends (reap polls it; cut off at fetch_timeout_s).
                    running, e.running = e.running, None
                    self._adopt_running(obj_id, running, peer, landing)
                    raise
                # Nothing was posted: the landing and the lease can go back at once.
                if landing is not None:
                    self.release_landing(landing)
                if peer is not None:
                    with self.lock:
                        peer.in_flight -= 1
                        self._suspect(peer)
                        self.events.add("in_flight", -1)
                raise
        return f

    def _adopt_running(self, obj_id: str, handle: Any, peer: Peer, landing: Landing) -> None:
        """A READ that failed to post left ``handle`` writing into ``landing``: make it
        an abandoned transfer holding ``peer``'s lease, which reap() ends or cuts off."""
        t = Transfer(obj_id, handle, peer, landing, time.monotonic(), abandoned=True)
        with self.lock:
            self.outstanding[id(t)] = t
            self._suspect(peer)

    def wait(self, f: Fetch, timeout: float | None) -> list[torch.Tensor]:
        """Wait for ``f``'s READ and return the tensors; see the module doc for failures."""
        if f.settled:
            return f.tensors
        t = f.transfer
        assert t is not None
        user_limit = timeout is not None and 0 <= timeout < self.config.fetch_timeout_s
        own = timeout if timeout is not None and user_limit else float("inf")
        deadline = min(t.started + self.config.fetch_timeout_s, time.monotonic() + own)
        delay = 20e-6
        try:
            while True:
                state = self.poll(t)
                if state != "PROC":
                    break
                if t.aborted:
                    state = "ABORTED"
                    break
                if time.monotonic() >= deadline:
                    state = "TIMEOUT"
                    break
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
        except BaseException:
            # Interrupted (Ctrl-C in the sleep, a failing poll): nobody will consume this
            # READ, so hand it to reap(), which ends it or cuts it at fetch_timeout_s.
            # Without this a plain Fetch (fetch_selected has no __del__ safety net) kept
            # its landing and its peer lease for the life of the process.
            f.settled = True
            self._finish_id(f.obj_id)
            self.abandon(t)
            raise
        f.settled = True
        self._finish_id(f.obj_id)
        if state == "DONE":
            return self._finish(f, t)
        meta = f.meta
        if state in ("TIMEOUT", "ABORTED"):
            self.abandon(t)
        else:
            self.release_landing(t.landing)
        self.events.error({"TIMEOUT": "timeout", "ABORTED": "aborted"}.get(state, "err"))
        if state == "TIMEOUT" and user_limit and time.monotonic() < (
                t.started + self.config.fetch_timeout_s):
            raise TimeoutError(f"READ of object {f.obj_id} from {t.peer.name} not done "
                               f"within the caller's timeout of {timeout:.3f}s")
        if state == "TIMEOUT":
            raise TransferError(
                f"READ of object {f.obj_id} ({meta.total:,} bytes) from {t.peer.name} did "
                f"not finish within fetch_timeout_s={self.config.fetch_timeout_s}s; the "
                "sender may be dead or stalled. Raise RAY_RDT_POOL_FETCH_TIMEOUT_S if the "
                "transfer is just slow")
        what = "was aborted" if state == "ABORTED" else f"failed ({state})"
        raise TransferError(
            f"READ of object {f.obj_id} ({meta.total:,} bytes) from {t.peer.name} {what}; "
            "the sender actor may have died. Fetch again while the ref is in scope")

    def _finish(self, f: Fetch, t: Transfer) -> list[torch.Tensor]:
        from ray_rdt_pool.memory.tensors import device_block, rebuild

        meta = f.meta
        landing = t.landing
        sel = f.selected
        self.events.add("objects_received")
        self.events.add("bytes_received", meta.total if sel is None else sel.nbytes)
        if sel is not None:
            f.tensors = self._rebuild_selected(landing, sel)
        elif f.copy_into is not None:
            f.tensors = self._copy_out(f, landing)
        elif landing.kind == "targets":
            assert f.targets is not None
            f.tensors = f.targets
            self.release_landing(landing)
        elif landing.kind == "arena":
            landing.released = True  # ownership passes to the views
            dead, key = self._arena_dead, (landing.device, landing.key)
            block = device_block(landing.addr, meta.total, landing.device, landing.device_id,
                                 lambda: dead.append(key))
            f.tensors = rebuild(block, meta.runs, meta.run_starts())
        else:
            buf = landing.temp
            self.release_landing(landing)  # deregisters; the buffer itself lives on
            f.tensors = rebuild(buf, meta.runs, meta.run_starts())
        if self.config.debug_transfers:
            logger.debug("fetched %s: %d tensors, %d bytes, %d descriptors", f.obj_id,
                         meta.num_tensors, meta.total, f.ndescs)
        self.events.notify("fetch", meta.total, time.perf_counter() - f.t_start)
        return f.tensors

    def _rebuild_selected(self, landing: Landing, sel: SelectionPlan) -> list[torch.Tensor]:
        from ray_rdt_pool.memory.tensors import device_block, torch_dtype

        if landing.kind == "arena":
            landing.released = True  # ownership passes to the views
            dead, key = self._arena_dead, (landing.device, landing.key)
            block = device_block(landing.addr, sel.total, landing.device, landing.device_id,
                                 lambda: dead.append(key))
        else:
            block = landing.temp
            self.release_landing(landing)
        out = []
        for shape, dt, off in zip(sel.shapes, sel.dtypes, sel.offsets):
            n = 1
            for x in shape:
                n *= x
            tdt = torch_dtype(dt)
            out.append(block[off:off + n * tdt.itemsize].view(tdt).view(shape))
        return out

    def _copy_out(self, f: Fetch, landing: Landing) -> list[torch.Tensor]:
        """Copy a received object from its landing into the caller's buffers."""
        import torch

        from ray_rdt_pool.memory.tensors import unpack_into

        targets = f.copy_into
        assert targets is not None
        try:
            with torch.no_grad():  # a requires_grad Parameter is a fine target
                unpack_into(targets, f.meta.tensor_offsets(), landing.addr, f.meta.total,
                            landing.device, landing.device_id,
                            self.config.tuning.stream_copy_bytes)
        except Exception as e:
            self.events.error("err")
            raise TransferError(
                f"copying object {f.obj_id} into its {len(targets)} target buffers failed: "
                f"{type(e).__name__}: {e}; pass contiguous tensors of the object's shapes "
                "and dtypes on one device") from e
        finally:
            self.release_landing(landing)
        return targets

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
            if hit or obj_id in self._finished:
                return
            self.pending_aborts[obj_id] = time.monotonic()
            self.pending_aborts.move_to_end(obj_id)
            self._expire_aborts()

    def _expire_aborts(self) -> None:
        cutoff = time.monotonic() - self.config.fetch_timeout_s
        pa = self.pending_aborts
        while pa and (len(pa) > MAX_PENDING_ABORTS or next(iter(pa.values())) < cutoff):
            pa.popitem(last=False)

    def _pending_abort(self, obj_id: str) -> bool:
        self._expire_aborts()
        return self.pending_aborts.pop(obj_id, None) is not None

    def _forget_finished(self, obj_id: str) -> None:
        self._finished.pop(obj_id, None)

    def _finish_id(self, obj_id: str) -> None:
        with self.lock:
            self.pending_aborts.pop(obj_id, None)
            self._finished[obj_id] = None
            while len(self._finished) > _FINISHED_IDS:
                self._finished.popitem(last=False)

    # -- introspection and exit -----------------------------------------------------------

    def counts(self) -> dict[str, int]:
        with self.lock:
            self._drain_locked()
            return {
                "mapped_objects": self.mapped_objects,
                "mapped_bytes": self.mapped_bytes,
                "abandoned": sum(t.abandoned for t in self.outstanding.values()),
                "pending_aborts": len(self.pending_aborts),
                "peers": len(self.peers),
            }

    def shutdown(self) -> None:
        """Abandon what is in flight and remove every peer (process exit, or
        ``ray_rdt_pool.shutdown()`` in a process that keeps running). Views of same-node
        mappings still alive keep them, and their leases, until they die; then their
        deleters return the leases themselves (no progress thread runs any more)."""
        with self.lock:
            self._drain_locked()
            live = list(self.outstanding.values())
            peers = list(self.peers.values())
            for h in self.hosts.values():
                if h is not None:
                    h.close()
            self.hosts.clear()
            self._self_drain = True
            self._shut = True
        for t in live:
            self.abandon(t)
        for p in peers:
            self._remove_peer(p, cut=True)


#: An object whose views died: (pool, slot, address, length of its pages in the pool
#: mapping or 0 for a copy, bytes); see ``Receiver._unmaps``.
_Unmap = tuple[MappedPool, int, int, int, int]


def _in_arena(t: torch.Tensor, st: Any, arenas: dict[str, Region]) -> bool:
    """Whether ``t``'s storage ``st`` lies in one of ``arenas`` (a tensor we returned,
    used again as a target buffer)."""
    arena = arenas.get(t.device.type)
    if arena is None or int(arena.mem.device_id) != (t.device.index or 0):
        return False
    lo = int(st.data_ptr())
    return arena.addr <= lo and lo + int(st.nbytes()) <= arena.addr + arena.capacity


#: Receivers that have opened a same-node sender's pool: each takes part in every fork.
_fork_receivers: weakref.WeakSet[Receiver] = weakref.WeakSet()
_fork_hooks_registered = False


def _watch_forks(receiver: Receiver) -> None:
    """From its first same-node handle on, ``receiver`` is prepared for ``os.fork()``
    (the hooks are registered once per process, then; never at import)."""
    global _fork_hooks_registered
    _fork_receivers.add(receiver)
    if not _fork_hooks_registered:
        _fork_hooks_registered = True
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                            after_in_child=_after_fork_child)


#: Held from the first before-hook to the last after-hook: two threads forking at once
#: take the receivers' locks one fork after the other, never crosswise.
_fork_lock = threading.Lock()
_forking: list[Receiver] = []  # the receivers prepared for the fork under way


def _before_fork() -> None:
    _fork_lock.acquire()
    _forking[:] = sorted(_fork_receivers, key=id)
    for receiver in _forking:
        try:
            receiver._before_fork()
        except Exception:  # never keep the others from their step
            logger.exception("preparing a same-node receiver for fork() failed")


def _after_fork(step: Callable[[Receiver], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            for receiver in _forking:
                try:
                    step(receiver)
                except Exception:
                    logger.exception("a same-node receiver's step after fork() failed")
        finally:
            _forking.clear()
            _fork_lock.release()
    return run


_after_fork_parent = _after_fork(Receiver._after_fork_parent)
_after_fork_child = _after_fork(Receiver._after_fork_child)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _piece_moves(pieces: Sequence[tuple[int, int, int]],
                 moves: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(destination, source address, bytes)`` copies of ``moves`` given as
    ``(destination, packed offset, bytes)`` out of an object that lies in ``pieces``
    ((packed offset, address, length) each, one after another from offset 0)."""
    from ray_rdt_pool.core.layout import BlockMap

    where = BlockMap([(a, n) for _v, a, n in pieces])
    out: list[tuple[int, int, int]] = []
    for dst, p, n in moves:
        for src, m in where.map(p, n):
            out.append((dst, src, m))
            dst += m
    return out


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is a contiguous view with elements, else a contiguous tensor of its
    own (no reference to the mapping it came from)."""
    from ray_rdt_pool.memory.tensors import empty_tensor

    if t.numel() == 0:
        return empty_tensor(t.shape, t.dtype)
    return t if t.is_contiguous() else t.contiguous()
