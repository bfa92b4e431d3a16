"""The receive arenas and the landings of READs and copies.

Owns: one registered arena per device type (made on first use), and every
:class:`Landing`: a block of an arena, a one-off buffer when that arena is full, or the
caller's target buffers. Lifetime: a landing goes back (:meth:`Landings.release`) exactly
once, and only after its transfer has ended (or none ran); an arena block handed over to
views goes back when the last view dies (its deleter queues it, the next drain frees it).
Threads: fetching and waiting threads and the progress thread; deleters on any thread.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.errors import PoolExhaustedError
from ray_rdt_pool.receive.targets import read_pieces, target_descs
from ray_rdt_pool.registry import RegEntry, Region, Registry

if TYPE_CHECKING:
    import threading

    import torch

    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.core.selection import SelectionPlan
    from ray_rdt_pool.obs.events import Events
    from ray_rdt_pool.receive.drain import Drain
    from ray_rdt_pool.receive.receiver import Fetch

__all__ = ["Landing", "Landings"]

Descs = list[tuple[int, int, int]]


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


class Landings:
    """The arenas and the landings carved from them (a part of the receiver)."""

    def __init__(self, config: PoolConfig, registry: Registry, events: Events,
                 lock: threading.RLock, drain: Drain) -> None:
        self.config = config
        self.registry = registry
        self.events = events
        self.lock = lock  # the receiver lock
        self.drain = drain
        self.arenas: dict[str, Region] = {}  # device type -> arena; changed under the lock
        self._keys = itertools.count()
        # (device, key) of arena blocks whose views died; appended from any thread
        # (deleters may fire inside our own critical sections), drained under the lock.
        self.dead: deque[tuple[str, int]] = deque()

    def arena(self, device: str) -> Region:
        """The arena of ``device``, registered on first use (outside the lock)."""
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

    def for_read(self, f: Fetch, device: str, targets: Sequence[torch.Tensor] | None,
                 live: dict[int, Any]) -> tuple[Landing, Descs, Descs]:
        """Reserve the landing of ``f``'s READ; returns it with the READ's (local,
        remote). ``live``: the addresses of same-node mappings views may still use."""
        meta = f.meta
        total = meta.total if f.selected is None else f.selected.total
        if targets:
            entries: list[RegEntry] = []
            keep: list[Any] = []
            storages = [t.untyped_storage() for t in targets]
            with self.lock:
                arenas = dict(self.arenas)
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
        arena = self.arena(device)
        dev_id = int(arena.mem.device_id)
        found = self.block(arena, device, total)
        landing = found if found is not None else self._one_off(arena, device, total, True)
        if f.selected is not None:
            return (landing, *read_pieces(
                meta, [(p, landing.addr + lo, n) for lo, p, n in f.selected.ranges], dev_id))
        local = [(landing.addr + v, n, dev_id) for v, _a, n in meta.segments]
        remote = [(a, n, meta.device_id) for _v, a, n in meta.segments]
        return landing, local, remote

    def block(self, arena: Region, device: str, size: int) -> Landing | None:
        """One contiguous block of ``arena`` as a landing, or None when it is full."""
        key = next(self._keys)
        with self.lock:
            self.drain.run_locked()
            try:
                (block,) = arena.alloc.allocate(key, size, max_blocks=1)
            except PoolExhaustedError:
                return None
        arena.populate(block[0] + block[1])
        return Landing("arena", arena.addr + block[0], device, int(arena.mem.device_id),
                       arena, key, block[0])

    def local(self, size: int, device: str = "cpu") -> Landing:
        """A block for a copy out of a mapping or a source process: the arena of
        ``device``, else a plain buffer (no NIXL registration: nothing reads into it
        remotely)."""
        arena = self.arena(device)
        found = self.block(arena, device, size)
        return found if found is not None else self._one_off(arena, device, size, False)

    def _one_off(self, arena: Region, device: str, size: int, register: bool) -> Landing:
        """A buffer of its own for a landing that does not fit in ``arena``; registered
        with NIXL when a READ lands in it."""
        import torch

        self.events.add("receive_fallbacks")
        buf = torch.empty(size, dtype=torch.uint8, device=arena.mem.torch_device)
        dev_id = int(arena.mem.device_id)
        handle = (self.registry.register_buffer(buf.data_ptr(), size, device, dev_id)
                  if register else None)
        return Landing("temp", buf.data_ptr(), device, dev_id, temp=buf, temp_handle=handle)

    def release(self, landing: Landing) -> None:
        """Return a landing. Only ever called once its transfer has ended (or none ran)."""
        if landing.released:
            return
        landing.released = True
        if landing.kind == "arena":
            self.dead.append((landing.device, landing.key))
            with self.lock:
                self.drain.run_locked()
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

    def hand_over(self, landing: Landing, size: int) -> torch.Tensor:
        """The ``size`` bytes of an arena or one-off landing as a uint8 tensor that owns
        them from now on: an arena block goes back when its last view dies."""
        from ray_rdt_pool.memory.blocks import device_block

        if landing.kind == "arena":
            landing.released = True  # ownership passes to the views
            dead, key = self.dead, (landing.device, landing.key)
            return device_block(landing.addr, size, landing.device, landing.device_id,
                                lambda: dead.append(key))
        buf: torch.Tensor = landing.temp
        self.release(landing)  # deregisters; the buffer itself lives on
        return buf

    def selected_views(self, landing: Landing, sel: SelectionPlan) -> list[torch.Tensor]:
        """The tensors of a selection landed packed in ``landing`` (which they own)."""
        from ray_rdt_pool.memory.dtypes import torch_dtype

        block = self.hand_over(landing, sel.total)
        out = []
        for shape, dt, off in zip(sel.shapes, sel.dtypes, sel.offsets):
            n = 1
            for x in shape:
                n *= x
            tdt = torch_dtype(dt)
            out.append(block[off:off + n * tdt.itemsize].view(tdt).view(shape))
        return out

    def drain_locked(self) -> None:
        """Free the blocks whose views died (caller holds the receiver lock)."""
        while self.dead:
            device, key = self.dead.popleft()
            arena = self.arenas.get(device)
            if arena is not None:
                arena.alloc.free(key)

    def queued(self) -> bool:
        return bool(self.dead)


def _in_arena(t: torch.Tensor, st: Any, arenas: dict[str, Region]) -> bool:
    """Whether ``t``'s storage ``st`` lies in one of ``arenas`` (a tensor we returned,
    used again as a target buffer)."""
    arena = arenas.get(t.device.type)
    if arena is None or int(arena.mem.device_id) != (t.device.index or 0):
        return False
    lo = int(st.data_ptr())
    return arena.addr <= lo and lo + int(st.nbytes()) <= arena.addr + arena.capacity
