"""Every NIXL registration of this process, the registration epoch, and its publication.

Role: the only module that calls the backend's ``register`` and ``deregister``. It owns

* **regions**: the sender pool, the overflow regions and the receive arenas. They are
  created by :meth:`Registry.new_region` (which registers them, or lets the memory go
  again and raises ``RegistrationError``) and dropped by :meth:`Registry.drop_region`
  (which deregisters them). The sender and the receiver own
  the *contents* of their regions; this module owns their registration.
* **the storage cache**: registrations of user storages, made by ``register_memory()``
  (pins) and for receive target buffers seen more than once. An entry is keyed by the
  storage's extent and *holds the storage*, so its memory cannot be freed and reused
  under a live registration. Unpinned entries nobody uses are evicted least recently
  used first once their bytes exceed ``registration_cache_bytes``. An entry in use by a
  transfer (``users > 0``) or pinned by ``register_memory()`` is never evicted.
* **the epoch** (``version``, ``reset_version``) and publishing the agent metadata.

Memory whose deregistration NIXL refuses (a region's, a cached storage, a one-off receive
buffer) is kept, never freed, until the process exits: NIXL may still hold the
registration, and freed memory could be handed to anyone under it.

The epoch rule, the one contract a receiver relies on:

* ``version`` grows by one at every registration and every deregistration of memory an
  object may name (the sender pool, overflow regions, ``register_memory()`` pins, storages
  sent by reference).
* ``version`` also grows by one when the sender pool's same-node entry is published
  (:meth:`Registry.advance`), so every object that names the pool has a newer version
  than any object put before the entry existed: a receiver that found no entry while
  fetching an object of version ``V`` asks again only for a newer one.
* ``reset_version`` is the ``version`` of the latest deregistration of such memory.
* An object put at version ``V`` names only memory that was registered at or before ``V``
  and stays registered while the object lives. A receiver whose view of this agent was
  loaded at ``L >= V`` can read it; with ``L < V`` it loads the metadata again.
* NIXL *merges* metadata loaded again for a known agent, so a view loaded before
  ``reset_version`` may still hold sections of deregistered memory. Such a view is stale:
  the receiver replaces it (remove, then add) the next time no READ from that agent is in
  flight, and never while one is.

Receive-side memory (the receive arenas, one-off receive buffers, target buffers cached
for READs) is named by no object this process sends, so registering and deregistering it
leaves the epoch alone: a process that both receives and sends would otherwise make the
receivers of its objects reload its metadata (and replace their view: a remove and
re-add of its agent) after every receive outside its arena. Such memory still appears in
the metadata published while it is registered, so a receiver's view may keep a section
of it after it is gone; the first later registration of nameable memory that overlaps
one of those ranges counts as a deregistration (``reset_version`` moves), so that view
is replaced before any object names the overlapping memory. The ranges are kept until
the next reset, at most :data:`_GONE_LIMIT` of them (one more forces a reset).

Threads: any of Ray's threads (task thread, ``_ray_system``, ``_ray_system_error``), the
thread of ``ray.get`` and the progress thread may call in. One lock guards the maps and
the epoch; publishing to the directory (a GCS round trip) runs outside it, serialised by
its own lock so that an older version never overwrites a newer one.

Imports no Ray and no NIXL: the backend and the directory are protocols.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ray_rdt_pool.core.allocator import BlockAllocator
from ray_rdt_pool.core.layout import BLOCK_ALIGN
from ray_rdt_pool.errors import (
    ConfigurationError,
    RdtPoolError,
    RegistrationError,
    shut_down_error,
)

if TYPE_CHECKING:
    import torch

    from ray_rdt_pool.memory.allocations import CudaMemory, HostMemory

logger = logging.getLogger(__name__)

__all__ = ["MEM_TYPE", "Directory", "RegEntry", "Region", "Registry"]

#: NIXL memory type of each device type.
MEM_TYPE = {"cpu": "DRAM", "cuda": "VRAM"}

#: First sightings of receive target buffers remembered (keys only, nothing held).
_SEEN_LIMIT = 4096
#: Receive-side ranges deregistered since the last reset remembered; one more resets.
_GONE_LIMIT = 1024


class Directory(Protocol):
    """Where agents publish their NIXL metadata and find each other's (Ray's GCS)."""

    def publish(self, name: str, version: int, reset_version: int, md: bytes) -> None: ...
    def lookup(self, name: str) -> tuple[int, int, bytes] | None: ...
    def remove(self, name: str) -> None: ...
    def publish_host(self, name: str, info: bytes) -> None: ...
    def lookup_host(self, name: str) -> bytes | None: ...


def _default_region(capacity: int, device: str, prefault: bool) -> HostMemory | CudaMemory:
    from ray_rdt_pool.memory.allocations import CudaMemory, HostMemory

    return CudaMemory(capacity) if device == "cuda" else HostMemory(capacity, prefault=prefault)


class Region:
    """One region registered once with NIXL, carved into blocks by a :class:`BlockAllocator`.

    ``alloc`` is changed only by the region's owner (sender or receiver) under that
    owner's lock; ``handle`` only by the registry.
    """

    def __init__(self, mem: Any, name: str, named: bool = True) -> None:
        self.mem = mem  # HostMemory or CudaMemory (or a test double with the same fields)
        self.named = named  # objects may name it (not a receive arena): see the epoch
        # A shared pool hands out whole pages (see shared.SharedHostMemory).
        self.alloc = BlockAllocator(mem.nbytes, align=getattr(mem, "align", BLOCK_ALIGN),
                                    name=name)
        self.handle: Any = None

    @property
    def device(self) -> str:
        return str(self.mem.device)

    @property
    def addr(self) -> int:
        return int(self.mem.addr)

    @property
    def capacity(self) -> int:
        return self.alloc.capacity

    @property
    def mem_type(self) -> str:
        return MEM_TYPE[self.device]

    def populate(self, end: int) -> None:
        """Fault host pages in ahead of a copy or READ (no-op for device memory)."""
        populate = getattr(self.mem, "populate", None)
        if populate is not None:
            populate(end)


Key = tuple[int, int, str, int]


class RegEntry:
    """A registration of one user storage.

    ``users`` counts transfers and sent objects using it now; ``pins`` counts
    ``register_memory()`` calls not yet undone. Both change under the registry lock.
    """

    __slots__ = ("handle", "key", "named", "pins", "storage", "unpinned", "users")

    def __init__(self, key: Key, handle: Any, storage: Any) -> None:
        self.key = key
        self.handle = handle
        self.storage = storage  # held: the memory cannot be freed under the registration
        self.users = 0
        self.pins = 0
        # The last pin was undone while objects still used it: deregister with the last
        # of them (the user asked for the memory back), not whenever the cache evicts.
        self.unpinned = False
        # An object may name it (pinned, or sent by reference); False while it only ever
        # was a receive target (see the epoch in the module doc).
        self.named = False

    @property
    def nbytes(self) -> int:
        return self.key[1]


def storage_key(t: torch.Tensor) -> Key:
    """The extent of ``t``'s storage: (address, bytes, device type, device index)."""
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes(), t.device.type, t.device.index or 0)


class _Buffer(NamedTuple):
    """A one-off receive buffer's registration (see :meth:`Registry.register_buffer`)."""

    handle: Any
    addr: int
    nbytes: int


class Registry:
    """NIXL registrations, the storage cache and the epoch of one process's agent."""

    def __init__(self, backend: Callable[[], Any], directory: Directory, cache_bytes: int,
                 counters: Any, region_factory: Callable[[int, str, bool], Any] | None = None
                 ) -> None:
        self._backend = backend  # returns the process's agent, created on first use
        self.directory = directory
        self.cache_bytes = cache_bytes
        self._c = counters
        self._region_factory = region_factory or _default_region
        self._lock = threading.RLock()
        self._publish_lock = threading.Lock()
        self._unpublished = False  # unpublish() ran: never write the key again
        # Epoch: changed only by _changed(), under _lock.
        self.version = 0
        self.reset_version = 0
        self._published = -1  # the version last written to the directory (_publish_lock)
        # ...and the directory session it went to: a driver that calls ray.shutdown() and
        # ray.init() again talks to a new, empty GCS, where it must publish anew.
        self._published_session: object = None
        # Storage cache, in LRU order (least recent first); changed under _lock.
        self._entries: OrderedDict[Key, RegEntry] = OrderedDict()
        self._cached_bytes = 0  # bytes of unpinned entries
        # Sorted (start, end) of the pinned extents, and the furthest end up to each.
        self._pinned: tuple[list[tuple[int, int]], list[int]] = ([], [])
        # Memory NIXL refused to deregister: never freed (see _deregister).
        self._stranded: list[Any] = []
        self._seen: OrderedDict[Key, None] = OrderedDict()
        # Receive-side (start, end) deregistered since the last reset (see the module doc).
        self._gone: list[tuple[int, int]] = []
        self.regions = 0  # live regions, for stats

    # -- the epoch ------------------------------------------------------------------------

    def _changed(self, deregistered: bool) -> None:
        self.version += 1
        if deregistered:
            self.reset_version = self.version
            self._gone.clear()  # views replaced from here on hold none of them

    def advance(self) -> None:
        """A new version with no registration: something receivers key on by version (the
        same-node entry of the sender pool) was published (see the epoch rule)."""
        with self._lock:
            self._changed(False)

    def _named(self, addr: int, nbytes: int) -> None:
        """Memory objects may name is registered (or becomes nameable) at ``addr``: a new
        version; a reset if it overlaps receive-side memory deregistered since the last
        one, which receivers' views may still hold a section of."""
        end = addr + nbytes
        self._changed(any(s < end and addr < e for s, e in self._gone))

    def _receive_side_gone(self, addr: int, nbytes: int) -> None:
        span = (addr, addr + nbytes)
        if span in self._gone:
            return
        self._gone.append(span)
        if len(self._gone) > _GONE_LIMIT:
            self._changed(True)

    def _register(self, addr: int, nbytes: int, mem: str, dev: int, lanes: bool = False,
                  named: bool = True) -> Any:
        # lanes: register with every read lane of the backend (one handle for all).
        # named: memory an object may name (see the epoch in the module doc).
        backend = self._backend()
        handle = (backend.register(addr, nbytes, mem, dev, lanes=True) if lanes
                  else backend.register(addr, nbytes, mem, dev))
        self._c.add("registrations")
        if named:
            self._named(addr, nbytes)
        return handle

    def _deregister(self, handle: Any, what: str, memory: Any = None,
                    span: tuple[int, int] | None = None) -> bool:
        """Deregister ``handle``; False if NIXL refused. ``memory`` (what holds the bytes
        registered) is then kept until the process exits: NIXL may still hold the
        registration, and memory freed under it could be handed out again, a stale
        registration over someone else's bytes. A leak of a registration, never a stale
        one. ``span``: ``(address, bytes)`` of receive-side memory, which leaves the
        epoch alone (its range is remembered instead); None for nameable memory."""
        ok = True
        try:
            backend = self._backend()
        except RdtPoolError:
            # Shut down: destroying the agent dropped every registration it held.
            backend = None
        try:
            if backend is not None:
                backend.deregister(handle)
        except Exception:
            ok = False
            logger.warning("deregistering %s failed; its memory is kept until this process "
                           "exits", what, exc_info=True)
            if memory is not None:
                self._stranded.append(memory)
        self._c.add("deregistrations")
        if span is None:
            self._changed(True)
        else:
            self._receive_side_gone(*span)
        return ok

    def publish(self, agent_name: str) -> int:
        """Make the current metadata visible to receivers; returns the version published.

        Cheap when nothing changed. The GCS write runs outside the state lock.
        """
        session = getattr(self.directory, "session", None)
        now = session() if session is not None else None
        if self._published == self.version and self._published_session == now:
            return self._published
        with self._publish_lock:
            if self._unpublished:
                raise shut_down_error()
            with self._lock:
                version, reset = self.version, self.reset_version
                if self._published == version and self._published_session == now:
                    return version
                md = self._backend().metadata()
            self.directory.publish(agent_name, version, reset, md)
            self._published = version
            self._published_session = now
            return version

    def unpublish(self, agent_name: str) -> None:
        """At shutdown: delete the agent's key, and refuse every later :meth:`publish`
        (a put still registering memory would otherwise write the key back for an agent
        about to be destroyed)."""
        with self._publish_lock:
            self._unpublished = True
            self.directory.remove(agent_name)

    # -- regions --------------------------------------------------------------------------

    def new_region(self, capacity: int, device: str, name: str, prefault: bool,
                   shared: bool = False, lanes: bool = False,
                   sized_by: str | None = None, named: bool = True) -> Region:
        """Create and register a region; the caller owns it until :meth:`drop_region`.

        ``shared``: host memory in a memfd that same-node receivers may map (the sender
        pool); falls back to private memory where a memfd cannot be made. ``lanes``:
        register it with every read lane of the backend (the receive arenas, which
        large READs land in in parallel parts); one registration all the same.
        ``sized_by``: the option that set ``capacity`` (e.g. ``"pool_bytes
        (RAY_RDT_POOL_POOL_BYTES)"``): memory that cannot be had at that size is then a
        ConfigurationError naming it; without it the OSError, OverflowError or
        MemoryError reaches the caller. ``named``: False for a receive arena, which no
        object names (it leaves the epoch alone)."""
        mem: Any = None
        try:
            if shared and device == "cpu" and self._region_factory is _default_region:
                try:
                    from ray_rdt_pool.same_node.memfd import SharedHostMemory

                    mem = SharedHostMemory(capacity, prefault=prefault)
                except OSError as e:
                    logger.warning("no shared memory for the sender pool (%s); same-node "
                                   "receivers will read it with NIXL", e)
            if mem is None:
                mem = self._region_factory(capacity, device, prefault)
        except (OSError, OverflowError, MemoryError) as e:
            if sized_by is None or isinstance(e, RdtPoolError):
                raise
            raise ConfigurationError(
                f"the {name} of {capacity:,} bytes of {device} memory could not be "
                f"mapped ({type(e).__name__}: {e}); lower {sized_by} to what this host "
                "can spare") from e
        try:
            region = Region(mem, name, named)
            with self._lock:
                region.handle = self._register(region.addr, mem.nbytes, region.mem_type,
                                               int(mem.device_id), lanes=lanes, named=named)
                self.regions += 1
        except BaseException as e:
            # Nothing was registered: the memory goes now, or every retried put would
            # leave one more region (a pool-sized mapping, and its memfd) behind.
            close = getattr(mem, "close", None)
            if close is not None:
                close()
            if isinstance(e, RdtPoolError) or not isinstance(e, Exception):
                raise
            raise RegistrationError(
                f"registering the {name} ({mem.nbytes:,} bytes of {device} memory) with "
                f"NIXL failed: {type(e).__name__}: {e}; check that NIXL can register "
                "this memory (its UCX backend and the memlock limit, ulimit -l), or lower "
                "its size") from e
        return region

    def drop_region(self, region: Region) -> None:
        """Deregister a region whose every block is free, then let its memory go."""
        ok = True
        with self._lock:
            if region.handle is not None:
                ok = self._deregister(
                    region.handle, f"region {region.alloc.name}", region.mem,
                    None if region.named else (region.addr, int(region.mem.nbytes)))
                region.handle = None
                self.regions -= 1
        close = getattr(region.mem, "close", None)
        if ok and close is not None:
            close()

    def register_buffer(self, addr: int, nbytes: int, device: str, dev: int) -> Any:
        """Register a one-off buffer (a receive buffer when the arena is full): receive-side
        memory, which leaves the epoch alone. The handle goes to :meth:`deregister_buffer`."""
        with self._lock:
            handle = self._register(addr, nbytes, MEM_TYPE[device], dev, named=False)
        return _Buffer(handle, addr, nbytes)

    def deregister_buffer(self, handle: Any, buffer: Any = None) -> None:
        """Undo :meth:`register_buffer`; only once nothing can write into the buffer.
        ``buffer`` (what holds its memory) is kept if NIXL refuses."""
        with self._lock:
            self._deregister(handle.handle, "receive buffer", buffer,
                             (handle.addr, handle.nbytes))

    # -- the storage cache ----------------------------------------------------------------

    def acquire(self, t: torch.Tensor, named: bool = True) -> RegEntry:
        """The registration covering ``t``'s storage, made on a miss; one more user.

        ``named``: an object this process sends may name the storage (it is sent by
        reference, or pinned); False for a receive target. An entry that becomes
        nameable moves the epoch then (receivers must reload a view that holds it)."""
        key = storage_key(t)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                handle = self._register(key[0], key[1], MEM_TYPE[key[2]], key[3],
                                        named=named)
                entry = RegEntry(key, handle, t.untyped_storage())
                entry.named = named
                self._entries[key] = entry
                self._cached_bytes += entry.nbytes
            else:
                self._entries.move_to_end(key)
                if named and not entry.named:
                    entry.named = True
                    self._named(key[0], key[1])
            entry.users += 1
            entry.unpinned = False  # wanted again: an ordinary cache entry from now on
            self._evict()
            return entry

    def acquire_if_seen(self, t: torch.Tensor) -> RegEntry | None:
        """Like :meth:`acquire`, but only from the second sighting of the storage on.

        One-off receive buffers never pay a registration; a buffer that comes back (a
        weight-sync loop) is registered and read in place from then on.
        """
        key = storage_key(t)
        with self._lock:
            if key in self._entries or key in self._seen:
                self._seen.pop(key, None)
                return self.acquire(t, named=False)
            self._seen[key] = None
            while len(self._seen) > _SEEN_LIMIT:
                self._seen.popitem(last=False)
            return None

    def release(self, entry: RegEntry) -> None:
        """Drop one user taken by :meth:`acquire`."""
        with self._lock:
            entry.users -= 1
            if (entry.unpinned and entry.users == 0 and not entry.pins
                    and self._entries.get(entry.key) is entry):
                self._drop(entry)
                return
            self._evict()

    def pin(self, t: torch.Tensor) -> None:
        """``register_memory()``: register ``t``'s storage and keep it until unpinned."""
        with self._lock:
            entry = self.acquire(t)
            entry.users -= 1
            if entry.pins == 0:
                self._cached_bytes -= entry.nbytes
            entry.pins += 1
            self._reindex()

    def unpin(self, t: torch.Tensor) -> bool:
        """Undo one :meth:`pin`; deregisters at once when nothing uses the storage.

        Returns True if the registration went away.
        """
        key = storage_key(t)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.pins == 0:
                return False
            entry.pins -= 1
            if entry.pins:
                return False
            self._cached_bytes += entry.nbytes
            self._reindex()
            if entry.users == 0:
                self._drop(entry)
                return True
            entry.unpinned = True
            return False

    def forget(self, keys: Iterable[Key]) -> int:
        """Deregister the entries of ``keys`` that nobody uses or pins now, letting their
        storages go (an owner that knows it will not send them again, e.g. a weights
        stream whose source replaced a tensor). Returns how many went."""
        n = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.users == 0 and entry.pins == 0:
                    self._drop(entry)
                    n += 1
        return n

    def _drop(self, entry: RegEntry) -> None:
        del self._entries[entry.key]
        if not entry.pins:
            self._cached_bytes -= entry.nbytes
        self._deregister(entry.handle, f"storage at {entry.key[0]:#x}", entry.storage,
                         None if entry.named else (entry.key[0], entry.key[1]))
        entry.storage = None

    def _evict(self) -> None:
        if self._cached_bytes <= self.cache_bytes:
            return
        for entry in list(self._entries.values()):
            if self._cached_bytes <= self.cache_bytes:
                break
            if entry.users == 0 and entry.pins == 0:
                self._drop(entry)
                self._c.add("registration_evictions")

    def _reindex(self) -> None:
        spans = sorted((e.key[0], e.key[0] + e.key[1])
                       for e in self._entries.values() if e.pins)
        reach, top = [], 0
        for _start, end in spans:
            top = max(top, end)
            reach.append(top)  # the furthest end of the spans up to this one
        # One assignment: pinned_entry() reads both without the lock.
        self._pinned = (spans, reach)

    def has_pins(self) -> bool:
        return bool(self._pinned[0])

    def pinned_entry(self, addr: int, nbytes: int, use: bool = False) -> RegEntry | None:
        """The pinned entry holding ``[addr, addr+nbytes)``, if one does; with ``use``,
        one more user of it is taken under the same lock (the caller releases it), so a
        ``deregister_memory()`` on another thread cannot drop it in between."""
        spans, reach = self._pinned
        if not spans:
            return None
        end = addr + nbytes
        i = bisect.bisect_right(spans, (addr, 1 << 64)) - 1
        # The span starting last at or before addr may be nested in a larger one (a
        # numpy array and a slice of it) that holds the bytes: look further back while
        # an earlier span still reaches that far.
        while i >= 0 and spans[i][1] < end and reach[i] >= end:
            i -= 1
        if i < 0 or not (spans[i][0] <= addr and end <= spans[i][1]):
            return None
        with self._lock:
            # The entry of exactly that extent: two pinned storages may start at one
            # address (a numpy array and a slice of it), and the smaller one does not
            # hold these bytes.
            start, end = spans[i]
            for e in self._entries.values():
                if e.pins and e.key[0] == start and e.key[0] + e.key[1] == end:
                    if use:
                        e.users += 1
                    return e
        return None

    def cached(self) -> tuple[int, int]:
        """(entries, bytes held) of the storage cache."""
        with self._lock:
            return len(self._entries), sum(e.nbytes for e in self._entries.values())
