"""The sender: the pool, the overflow regions and every object this process has sent.

Role: ``put`` turns one object's tensors into a :class:`Placement` (where its packed bytes
live) plus wire metadata; ``free`` returns the placement when Ray garbage-collects the
object. A put is always a snapshot: the tensors' bytes are copied before the metadata
exists, except for tensors inside storages the user registered with
``register_memory()``, which are read by reference because the user opted in.

Where an object goes (one placement each, decided under the sender lock):

* **pool**: blocks of the pool region (one contiguous block when a CUDA copy is
  involved, otherwise as few blocks as the allocator can find);
* **overflow**: when the pool cannot hold it and ``strict`` is off, blocks of an
  overflow region: host (or device) memory registered for the purpose, reused by later
  oversized objects, and deregistered and freed once it has held no object for
  ``overflow_linger_s`` (checked by :meth:`Sender.reap` and at every free). Still a
  snapshot. ``strict=True`` raises ``PoolExhaustedError`` instead;
* either of those **mixed** with by-reference tensors of ``register_memory()`` storages;
* **by reference** (``put_by_reference``, the weights API's stream across nodes): no
  placement at all; the tensors' storages are registered through the storage cache and
  the caller keeps them unchanged until it frees the object.

Ownership: this module creates the pool and the overflow regions (through the registry,
which registers them) and is the only place that frees their blocks. A block may be
reused as soon as ``free(obj_id)`` returns: Ray calls ``garbage_collect`` only once no
process holds the object's ref, so no receiver will start a READ of it again. (A READ
already posted by a receiver that has since died can still be running; its bytes go to
that receiver's memory, never to ours, so reuse on our side is safe.)

Threads: ``put`` runs on Ray's task thread (or the driver's thread), ``free`` on
``_ray_system``. The lock guards ``pool``/``overflow`` allocators and ``sent``; copies run
outside it. Imports no Ray and no NIXL.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.descriptors import merge_segments
from ray_rdt_pool.core.layout import BlockMap, align_up, packed_offsets, run_layout
from ray_rdt_pool.core.wire import TensorRun, WireMeta, encode, runs_from
from ray_rdt_pool.errors import InvalidInputError, PoolExhaustedError, RegistrationError
from ray_rdt_pool.registry import Directory, RegEntry, Region, Registry

if TYPE_CHECKING:
    import torch

    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.memory.tensors import Described
    from ray_rdt_pool.obs.events import Events
    from ray_rdt_pool.same_node.shared import HostInfo, LeaseTable

logger = logging.getLogger(__name__)

__all__ = ["Placement", "Sender", "run_offsets"]

#: Smallest overflow region: oversized objects of a few MiB share one registration.
MIN_OVERFLOW_BYTES = 64 << 20
_OVERFLOW_ALIGN = 1 << 20
#: How often the lease table is swept for rows of dead receivers while a freed placement
#: waits for leases (a killed receiver's leases go within about this long)...
SWEEP_S = 1.0
#: ...and while none waits (the rows themselves must come back).
IDLE_SWEEP_S = 5.0
#: How often every leased placement is checked, not only those whose slot a release log
#: names: on hardware that orders stores more weakly than x86, a log entry may be read
#: before the count it follows, and that release would wait for this check.
RECHECK_S = 10.0


@dataclass
class Placement:
    """Where one object's packed bytes live; released exactly once by :meth:`Sender.free`.

    ``region``/``blocks``: the copied part (None/() when nothing is copied).
    ``pinned``: ``register_memory()`` storages read by reference, one use held on each.
    """

    obj_id: str
    region: Region | None
    blocks: tuple[tuple[int, int], ...]
    nbytes: int
    overflow: bool
    pinned: list[RegEntry] = field(default_factory=list)
    key: Any = None  # the allocator key: unique per placement, even for a retried put
    meta: WireMeta | None = None  # what the put sent (a Ray object-store get copies it)


def run_offsets(runs: Sequence[TensorRun]) -> tuple[list[int], int]:
    """Packed offset of every tensor and the packed total, from the runs alone.

    The same layout functions the receiver uses. For the :class:`~ray_rdt_pool.core.wire.Runs`
    that ``runs_from`` returns, the offsets come group by group from its cached
    :func:`~ray_rdt_pool.core.layout.group_layout`, with C-level range fills instead of a
    Python step per tensor or per run; any other sequence of runs goes through
    :func:`~ray_rdt_pool.core.layout.run_layout` (the offsets are the same either way).
    """
    from ray_rdt_pool.core.wire import Runs

    if isinstance(runs, Runs):
        return runs.tensor_offsets(), runs.layout()[1]
    starts, total = run_layout([(r.nbytes_each, r.itemsize, r.count) for r in runs])
    offsets: list[int] = []
    for run, start in zip(runs, starts):
        n = run.nbytes_each
        offsets.extend(range(start, start + n * run.count, n) if n else [start] * run.count)
    return offsets, total


class Sender:
    """The sending half of one process's transport."""

    def __init__(self, config: PoolConfig, registry: Registry, events: Events,
                 agent_name: Callable[[], str], directory: Directory | None = None,
                 node_id: Callable[[], str | None] | None = None) -> None:
        self.config = config
        self.registry = registry
        self.events = events
        self._agent_name = agent_name
        self._directory = directory
        self._node_id = node_id or (lambda: None)
        # Guards pool/overflow allocators and `sent`; RLock because wait_for() holds it
        # while reading stats.
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # notified by every free
        self._create_lock = threading.Lock()  # serialises creating the pool
        self.pool: Region | None = None  # created on first put, lives until shutdown
        # Each dropped once it has stayed empty for overflow_linger_s (see _idle_overflow).
        self.overflow: list[Region] = []
        # Overflow regions with no object, and since when (monotonic seconds); the first
        # moment one of them may be due (reap() takes the lock only from then on).
        self._idle_overflow: dict[Region, float] = {}
        self._linger_due = math.inf
        self._linger_off = False  # set by end_lingering() at shutdown
        self.sent: dict[str, Placement] = {}  # obj_id -> placement, until free()
        self.cuda_stream: Any = None  # set_cuda_stream(): the producer of sent tensors
        self._warned_overflow = False
        self._keys = itertools.count()
        # Same-node receivers: the lease table of the shared pool (None: not shared), and
        # placements Ray freed whose blocks wait for receivers' leases to drop.
        self.leases: LeaseTable | None = None
        self.leased: dict[Any, Placement] = {}
        self._leased_at: dict[int, list[Any]] = {}  # lease slot -> keys in `leased`
        self._last_full = -math.inf  # when every leased placement was last checked
        # The pid of the process that shared the pool (0: not shared). In a process forked
        # from it the pool is still that process's shared memory: no put may write it.
        self.shared_by = 0
        self._last_sweep = -math.inf  # when reap() last swept the lease table
        # The same-node entry last published for the pool (see reshare): its node ID is
        # the Ray session's, published again in each new one.
        self.host_info: HostInfo | None = None

    # -- placement ------------------------------------------------------------------------

    def ensure_pool(self) -> Region:
        pool = self.pool
        if pool is not None:
            if self.shared_by and self.shared_by != os.getpid():
                raise RegistrationError(
                    f"this process ({os.getpid()}) was forked from process {self.shared_by} "
                    "after nixl_pool made its sender pool there, in memory shared with "
                    "same-node receivers: a put here would write into that process's pool. "
                    "Put from that process, or start this one with the 'spawn' or "
                    "'forkserver' start method")
            return pool
        # Its own lock: registering and publishing take a NIXL call and a GCS round trip,
        # which must not hold up frees on _ray_system.
        with self._create_lock:
            if self.pool is None:
                cfg = self.config
                # Raises RegistrationError, having let the memory go, if NIXL refuses it.
                pool = self.registry.new_region(
                    cfg.pool_capacity, cfg.device, "sender pool", cfg.prefault,
                    shared=cfg.same_node != "off" and cfg.device == "cpu",
                    sized_by="pool_bytes (RAY_RDT_POOL_POOL_BYTES)")
                try:
                    self._share(pool)
                except BaseException:  # an interrupt: no second pool on the next put
                    self.registry.drop_region(pool)
                    raise
                with self.lock:
                    self.pool = pool
            return self.pool

    def _share(self, pool: Region) -> None:
        """Make a shared pool reachable for same-node receivers: its lease table, and
        the directory entry they look up (published before any object names the pool).
        A host pool is shared as its memfd; a CUDA pool through CUDA IPC.

        Never fails the put: where any step fails (a GCS error publishing the entry, a
        CUDA export torch refuses), the pool stays private and same-node receivers read
        it with NIXL, as receivers on other nodes do."""
        from ray_rdt_pool.memory.tensors import CudaRegion
        from ray_rdt_pool.same_node.shared import SharedHostRegion

        node = self._node_id()
        directory = self._directory
        if node is None or directory is None or self.config.same_node == "off":
            return
        if not isinstance(pool.mem, (CudaRegion, SharedHostRegion)):
            return
        try:
            self.leases = self._publish_shared(pool, node, directory)
            self.shared_by = os.getpid()
        except Exception as e:
            logger.warning(
                "could not share the sender pool with same-node receivers (%s: %s); they "
                "will read it with NIXL for the life of this process", type(e).__name__, e)
        else:
            # Objects naming the pool get a newer version than any put while the entry
            # was missing, at which receivers that found no entry ask again.
            self.registry.advance()

    def _publish_shared(self, pool: Region, node: str, directory: Directory) -> LeaseTable:
        """The lease table of ``pool``, once its entry is published; raises (closing the
        table) if any step fails."""
        from ray_rdt_pool.memory.tensors import CudaRegion
        from ray_rdt_pool.same_node.shared import (
            HostInfo,
            LeaseTable,
            export_cuda_pool,
            lease_slots,
            process_start,
        )

        mem = pool.mem
        cuda = export_cuda_pool(mem.tensor) if isinstance(mem, CudaRegion) else None
        start = process_start(os.getpid())
        if start is None:
            raise OSError("this process's start time cannot be read")
        table = LeaseTable(lease_slots(mem.nbytes))
        try:
            if cuda is None:
                fd, ino = mem.fd, mem.ino
            else:
                fd, ino = 0, 0  # no descriptor: receivers open the pool with its IPC handle
            info = HostInfo(node, os.getpid(), start, fd, ino, pool.addr, mem.nbytes,
                            table.fd, table.ino, table.rows, table.slots, cuda)
            directory.publish_host(self._agent_name(), info.encode())
        except BaseException:
            table.close()
            raise
        self.host_info = info
        return table

    def reshare(self) -> None:
        """A new Ray session in this process (``ray.shutdown()``, then ``ray.init()``):
        publish the shared pool's same-node entry again, with this node's new ID, in the
        new session's GCS, which starts empty. Call before any object of the new session
        is put. Never fails the put: where publishing fails, same-node receivers of that
        session read the pool with NIXL."""
        from dataclasses import replace

        with self._create_lock:  # not while ensure_pool() is sharing a new pool
            info = self.host_info
            node = self._node_id()
            directory = self._directory
            if info is None or node is None or directory is None:
                return
            if self.shared_by != os.getpid():  # a forked child: the pool is its parent's
                return
            info = replace(info, node_id=node)
            try:
                directory.publish_host(self._agent_name(), info.encode())
            except Exception as e:
                logger.warning(
                    "could not publish the sender pool for same-node receivers of the new "
                    "Ray session (%s: %s); they will read it with NIXL", type(e).__name__, e)
                return
            self.host_info = info

    def _place(self, obj_id: str, nbytes: int, one_block: bool) -> Placement:
        """Blocks for ``nbytes`` in the pool, else in an overflow region (made if needed)."""
        max_blocks = 1 if one_block else None
        pool = self.ensure_pool()
        self._replace(obj_id)
        with self.lock:
            key = (obj_id, next(self._keys))
            try:
                try:
                    blocks = pool.alloc.allocate(key, nbytes, max_blocks=max_blocks)
                except PoolExhaustedError:
                    # Checks every leased placement too, at most once a SWEEP_S.
                    if not self._reap_leased_locked(
                            full=time.monotonic() >= self._last_full + SWEEP_S):
                        raise
                    blocks = pool.alloc.allocate(key, nbytes, max_blocks=max_blocks)
                return Placement(obj_id, pool, tuple(blocks), nbytes, False, key=key)
            except PoolExhaustedError as e:
                leased = self._leased_note_locked()
                if self.config.strict:
                    raise PoolExhaustedError(
                        e.needed, e.free, e.largest_free, e.capacity, what="sender pool",
                        remedy=f"{leased + '; or ' if leased else ''}raise pool_bytes "
                               "(RAY_RDT_POOL_POOL_BYTES), or turn strict mode off to copy "
                               "oversized objects into overflow memory") from None
                self._warn_overflow(nbytes, e, leased)
        made: Region | None = None  # the region this put registered, if any
        while True:
            spare: list[Region] = []
            with self.lock:
                for region in self.overflow:
                    try:
                        blocks = region.alloc.allocate(key, nbytes, max_blocks=max_blocks)
                    except PoolExhaustedError:
                        continue
                    if made is not None and made is not region:
                        # Another put made a region at the same time, and this object
                        # went there: ours may hold nothing. It lingers like an emptied
                        # one (and goes at once with overflow_linger_s=0), instead of
                        # staying registered until some free happened to look at it.
                        spare = self._empty_overflow_locked()
                    # In use again: its linger restarts when it next empties, or a region
                    # reused steadily would go overflow_linger_s after it first emptied.
                    self._idle_overflow.pop(region, None)
                    placed = Placement(obj_id, region, tuple(blocks), nbytes, True, key=key)
                    break
                else:
                    placed = None
            if placed is not None:
                self._drop_regions(spare)
                return placed
            # Registering a region takes milliseconds: not under the lock.
            # Whole MiBs: a quarter of a pool size (a multiple of 64 only) is often not
            # one, and the allocator refused it for every overflow put.
            size = align_up(max(nbytes, 1, MIN_OVERFLOW_BYTES, self.config.pool_capacity // 4),
                            _OVERFLOW_ALIGN)
            try:
                region = self.registry.new_region(size, self.config.device,
                                                  "overflow region", False)
            except (OSError, OverflowError, MemoryError) as e:
                # The memory itself could not be had (ENOMEM, or a size no mapping takes).
                raise PoolExhaustedError(
                    nbytes, 0, 0, size, what="overflow memory",
                    remedy=f"no {size:,} bytes of {self.config.device} memory could be "
                           f"mapped ({type(e).__name__}: {e}); send a smaller object"
                ) from e
            with self.lock:
                self.overflow.append(region)
            made = region

    def _replace(self, obj_id: str) -> None:
        """A retried put replaces its first try: release that placement (or leave it to
        the leases of the same-node receivers that map it)."""
        with self.lock:
            old = self.sent.pop(obj_id, None)
            pinned = self._lease_if_held_locked(old) if old is not None else None
        if old is not None:
            self._retired(old, pinned)

    def _lease_if_held_locked(self, p: Placement) -> list[RegEntry] | None:
        """A placement Ray no longer names (freed, or replaced by a retry): if a same-node
        receiver maps it, keep its blocks until the last lease drops and return its
        ``register_memory()`` uses (nothing maps those: they go back now); else None."""
        slot = self._lease_slot(p)
        if slot is None or self.leases is None or not self.leases.held(slot):
            return None
        self.leased[p.key] = p
        self._leased_at.setdefault(slot, []).append(p.key)
        pinned, p.pinned = p.pinned, []
        return pinned

    def _retired(self, p: Placement, pinned: list[RegEntry] | None) -> None:
        """After :meth:`_lease_if_held_locked`, outside the lock: release ``p`` whole, or
        only the uses it returned."""
        if pinned is None:
            self._release(p)
        else:
            self._release_entries(pinned)

    def _leased_note_locked(self) -> str:
        """What of a full pool same-node receivers hold (their views of objects Ray
        freed), and the fix, for the message of a put that does not fit; "" if none."""
        if not self.leased:
            return ""
        n = sum(p.nbytes for p in self.leased.values())
        return (f"{n:,} bytes of it are objects already freed whose blocks same-node "
                f"receivers still hold views of ({len(self.leased)} objects): drop those "
                "views sooner, or set same_node='copy' on those receivers (their tensors "
                "then hold no lease)")

    def _warn_overflow(self, nbytes: int, e: PoolExhaustedError, leased: str = "") -> None:
        if self._warned_overflow:
            return
        self._warned_overflow = True
        logger.warning(
            "an object of %s bytes does not fit the nixl_pool sender pool (%s bytes free, "
            "largest block %s of %s); it is copied into overflow memory registered for it, "
            "which costs a NIXL registration and makes receivers reload this sender's "
            "metadata. %sRaise pool_bytes (RAY_RDT_POOL_POOL_BYTES) to keep objects in the pool, "
            "or set strict=True to raise instead. This warning is shown once per process.",
            f"{nbytes:,}", f"{e.free:,}", f"{e.largest_free:,}", f"{e.capacity:,}",
            leased + ". " if leased else "")

    def _release_locked(self, p: Placement) -> list[RegEntry]:
        if p.region is not None:
            p.region.alloc.free(p.key)
        pinned, p.pinned = p.pinned, []
        return pinned

    def _empty_overflow_locked(self) -> list[Region]:
        """Overflow regions to deregister now: those empty for ``overflow_linger_s``.

        An emptied region lingers, registered, for the next oversized objects: every
        deregistration makes each receiver replace its view of this agent (a remove and
        a re-add), which with NIXL 1.5.1 leaves a TCP connection per read lane open in
        both processes, so a pool that overflows now and then would leak one per object.
        """
        now = time.monotonic()
        linger = 0.0 if self._linger_off else self.config.overflow_linger_s
        idle = self._idle_overflow
        drop: list[Region] = []
        for r in self.overflow:
            if len(r.alloc):
                idle.pop(r, None)
            elif now - idle.setdefault(r, now) >= linger:
                drop.append(r)
        if drop:
            self.overflow = [r for r in self.overflow if r not in drop]
            for r in drop:
                del idle[r]
        self._linger_due = min(idle.values(), default=math.inf) + linger
        return drop

    def end_lingering(self) -> None:
        """At shutdown: no put can reuse an overflow region any more, so every empty one
        goes now, and later ones with their last object."""
        with self.lock:
            self._linger_off = True
            empty = self._empty_overflow_locked()
        self._drop_regions(empty)

    def _drop_regions(self, regions: Sequence[Region]) -> None:
        for region in regions:
            self.registry.drop_region(region)

    def _release(self, p: Placement) -> None:
        with self.lock:
            pinned = self._release_locked(p)
            empty = self._empty_overflow_locked()
            self.changed.notify_all()
        for entry in pinned:
            self.registry.release(entry)
        self._drop_regions(empty)

    # -- put / free -----------------------------------------------------------------------

    def put(self, obj_id: str, tensors: Sequence[torch.Tensor],
            convert: Mapping[int, torch.dtype] | None = None) -> tuple[WireMeta, bytes]:
        """Snapshot ``tensors`` for ``obj_id``; returns the wire metadata and its bytes.

        ``convert`` maps ``id(tensor)`` to the dtype it is packed as: the conversion is
        the pack copy itself (one pass), and the metadata names the new dtype.
        """
        from ray_rdt_pool.memory.tensors import describe, pack_into, pack_torch

        t_start = time.perf_counter()
        d = describe(tensors, allow_cuda=True, native=self.config.tuning.native)
        converted = _apply_conversions(d, tensors, convert) if convert else []
        runs = runs_from(d.shapes, d.dtypes)
        offsets, total = run_offsets(runs)
        pool_device = self.config.device
        pinned = None if converted else self._pinned_entries(d, pool_device)
        if pinned is None:
            copy_idx = None
            local_offsets, local_total = offsets, total
        else:
            copy_idx = [i for i, e in enumerate(pinned) if e is None]
            sub, local_total = packed_offsets([d.nbytes[i] for i in copy_idx],
                                              [d.aligns[i] for i in copy_idx])
            local_offsets = [0] * len(tensors)
            for i, off in zip(copy_idx, sub):
                local_offsets[i] = off
        # memmove reaches host memory only; CUDA on either side packs with one torch op
        # into one contiguous block.
        torch_path = d.device == "cuda" or pool_device == "cuda"
        try:
            p = self._place(obj_id, local_total, torch_path or bool(converted))
        except BaseException:
            self._release_entries(pinned)
            raise
        try:
            p.pinned.extend(e for e in pinned or () if e is not None)
            t_copy = time.perf_counter()
            region = p.region
            if p.blocks and region is not None:
                region.populate(max(o + n for o, n in p.blocks))
                if torch_path:
                    self._pack_cuda(tensors, d, local_offsets, p.blocks, region, copy_idx)
                elif converted:  # one contiguous block: torch converts, memmove the rest
                    (off, length), = p.blocks
                    pack_torch(tensors, d, local_offsets, region.mem.tensor[off:off + length],
                               converted, threads=self.config.tuning.pack_thread_count,
                               threshold=self.config.tuning.pack_threshold_bytes)
                    conv = set(converted)
                    pack_into(tensors, d, local_offsets, p.blocks, region.mem,
                              [i for i in range(len(tensors)) if i not in conv],
                              stream_min=self.config.tuning.stream_copy_bytes)
                else:
                    cfg = self.config.tuning
                    pack_into(tensors, d, local_offsets, p.blocks, region.mem, copy_idx,
                              threads=cfg.pack_thread_count,
                              threshold=cfg.pack_threshold_bytes,
                              stream_min=cfg.stream_copy_bytes)
            pack_s = time.perf_counter() - t_copy
            base = region.addr if region is not None else 0
            if pinned is None:
                segments = _block_segments(p.blocks, base, total)
            else:
                segments = _mixed_segments(d, offsets, local_offsets, pinned, p.blocks, base)
            version = self.registry.publish(self._agent_name())
            if p.blocks and region is not None:
                where, where_id = region.device, int(region.mem.device_id)
            else:
                where, where_id = d.device or "cpu", _device_index(tensors)
            meta = WireMeta(self._agent_name(), version, where, where_id, total, runs,
                            tuple(segments))
            wire = encode(meta)
            p.meta = meta
            with self.lock:
                self.sent[obj_id] = p
        except BaseException:
            self._release(p)
            raise
        ev = self.events
        ev.add("objects_put")
        ev.add("bytes_packed", local_total)
        if p.overflow:
            ev.add("fallbacks")
        if p.pinned:
            ev.add("zero_copy_tensors", sum(e is not None for e in pinned or ()))
        if self.config.debug_transfers:
            logger.debug("put %s: %d tensors, %d bytes, %d segments, overflow=%s, wire %d B",
                         obj_id, len(tensors), total, len(segments), p.overflow, len(wire))
        ev.notify("put", total, time.perf_counter() - t_start, pack_s, p.overflow)
        return meta, wire

    def put_by_reference(self, obj_id: str, tensors: Sequence[torch.Tensor]
                         ) -> tuple[WireMeta, bytes]:
        """Send ``tensors`` as they lie, with no copy: each storage is registered through
        the registry's storage cache (a miss registers it; the entry holds the storage)
        and one use of it is held until :meth:`free`. Not a snapshot: the caller keeps
        the tensors unchanged until every receiver has read them (the weights API's
        stream does, until its acknowledgements). Every tensor must be copyable as it
        lies (contiguous, no lazy conjugate or negation bit), else InvalidInputError."""
        from ray_rdt_pool.errors import InvalidInputError
        from ray_rdt_pool.memory.tensors import describe

        d = describe(tensors, allow_cuda=True, native=self.config.tuning.native)
        if not all(d.plain):
            i = d.plain.index(False)
            raise InvalidInputError(
                f"tensor {i} cannot be sent by reference (not contiguous, or a lazy "
                "conjugate or negation); send a contiguous copy, or use a snapshot put")
        runs = runs_from(d.shapes, d.dtypes)
        offsets, total = run_offsets(runs)
        self._replace(obj_id)
        entries: list[RegEntry] = []
        try:
            for t, n in zip(tensors, d.nbytes):
                if n:
                    entries.append(self.registry.acquire(t))
            segments = merge_segments([(off, ptr, n) for off, ptr, n
                                       in zip(offsets, d.ptrs, d.nbytes) if n])
            version = self.registry.publish(self._agent_name())
            meta = WireMeta(self._agent_name(), version, d.device or "cpu",
                            _device_index(tensors), total, runs, tuple(segments))
            wire = encode(meta)
            p = Placement(obj_id, None, (), 0, False, pinned=entries)
            with self.lock:
                self.sent[obj_id] = p
        except BaseException:
            for e in entries:
                self.registry.release(e)
            raise
        self.events.add("objects_put")
        self.events.add("zero_copy_tensors", len(entries))
        return meta, wire

    def _pinned_entries(self, d: Described, pool_device: str) -> list[RegEntry | None] | None:
        """Per tensor, the register_memory() storage it is read from, or None (copied).
        Each entry found comes with one use taken (see Registry.pinned_entry): the
        caller hands them to the placement or releases them."""
        if not self.registry.has_pins():
            return None
        found = [self.registry.pinned_entry(p, n, use=True) if n > 0 and ok else None
                 for n, ok, p in zip(d.nbytes, d.plain, d.ptrs)]
        if not any(e is not None for e in found):
            return None
        copied = any(e is None and n > 0 for e, n in zip(found, d.nbytes))
        if copied and d.device != pool_device:
            # One object names one device on the wire: copy everything to the pool's.
            self._release_entries(found)
            return None
        return found

    def _release_entries(self, entries: Sequence[RegEntry | None] | None) -> None:
        for e in entries or ():
            if e is not None:
                self.registry.release(e)

    def _pack_cuda(self, tensors: Sequence[torch.Tensor], d: Described,
                   offsets: Sequence[int], blocks: Sequence[tuple[int, int]], region: Region,
                   which: Sequence[int] | None) -> None:
        """Pack where CUDA is involved, ordered after the producer and finished before
        the metadata exists, so a one-sided READ never sees bytes still being written."""
        import torch

        from ray_rdt_pool.memory.tensors import pack_torch

        (off, length), = blocks
        block = region.mem.tensor[off:off + length]
        cuda_dev = next((t.device for t in tensors if t.is_cuda), None) or block.device
        producer = self.cuda_stream or torch.cuda.current_stream(cuda_dev)
        side = torch.cuda.Stream(device=cuda_dev)  # type: ignore[no-untyped-call]
        side.wait_stream(producer)  # the tensors' producer has finished writing them
        with torch.cuda.stream(side):
            pack_torch(tensors, d, offsets, block, which)
        side.synchronize()  # the pool bytes are in place before anyone can read them

    # -- leases of same-node receivers ----------------------------------------------------

    def _lease_slot(self, p: Placement) -> int | None:
        """The lease slot of a placement in the shared pool (None: nothing can map it)."""
        region = p.region
        if self.leases is None or region is None or region is not self.pool or not p.blocks:
            return None
        return self.leases.slot(p.blocks[0][0])

    def _reap_leased_locked(self, full: bool = False) -> bool:
        """Return the blocks of freed placements no receiver holds any more; True if any.

        Only the slots the receivers' release logs name are checked, unless the table
        asks for a full check or ``full``: then every leased placement."""
        table = self.leases
        if table is None or not self.leased:
            return False
        released = table.released()
        if released is None or full:
            slots = list(self._leased_at)
            self._last_full = time.monotonic()
        else:
            slots = [s for s in released if s in self._leased_at]
        done: list[Any] = []
        for slot, held in zip(slots, table.held_many(slots)):
            if not held:
                done.extend(self._leased_at.pop(slot))
        for k in done:
            p = self.leased.pop(k)
            self._release_locked(p)  # no uses left to return: they went when it was leased
        if done:
            self.changed.notify_all()
        return bool(done)

    def reap(self) -> None:
        """Progress-thread tick: blocks whose last lease dropped go back to the pool, and
        rows of receivers that died are cleared: every second while some placement waits,
        every :data:`IDLE_SWEEP_S` otherwise (receivers come and go with nothing leased,
        copy-mode ones always; their rows must come back or the table fills up)."""
        if time.monotonic() >= self._linger_due:
            with self.lock:
                empty = self._empty_overflow_locked()
            self._drop_regions(empty)
        leases = self.leases
        if leases is None:
            return
        now = time.monotonic()
        if now >= self._last_sweep + (SWEEP_S if self.leased else IDLE_SWEEP_S):
            self._last_sweep = now
            try:
                cleared = leases.sweep()
            except OSError:
                logger.debug("sweeping the lease table failed", exc_info=True)
            else:
                if cleared:
                    logger.info("cleared the lease rows of %d same-node receiver(s) that "
                                "exited", cleared)
        if self.leased:
            with self.lock:
                self._reap_leased_locked(full=now >= self._last_full + RECHECK_S)

    def live_ids(self) -> list[str]:
        """The objects held now (put and not freed)."""
        with self.lock:
            return list(self.sent)

    def leased_stats(self) -> tuple[int, int]:
        """(objects, bytes) freed by Ray whose blocks wait for receivers' leases."""
        with self.lock:
            return len(self.leased), sum(p.nbytes for p in self.leased.values())

    # -- free -----------------------------------------------------------------------------

    def free(self, obj_id: str) -> bool:
        """Ray garbage-collected ``obj_id``: return its placement (at once, or once the
        last same-node receiver's lease on it drops). False if unknown. Never blocks."""
        with self.lock:
            p = self.sent.pop(obj_id, None)
            pinned = self._lease_if_held_locked(p) if p is not None else None
        if p is None:
            return False
        self._retired(p, pinned)
        self.events.add("objects_freed")
        self.events.notify("free")
        return True

    def overflow_stats(self) -> tuple[int, int, int]:
        """(objects, bytes, registered capacity) in overflow regions now."""
        with self.lock:
            objs = sum(len(r.alloc) for r in self.overflow)
            used = sum(r.alloc.stats().used for r in self.overflow)
            cap = sum(r.capacity for r in self.overflow)
        return objs, used, cap


def _apply_conversions(d: Described, tensors: Sequence[torch.Tensor],
                       convert: Mapping[int, torch.dtype]) -> list[int]:
    """Describe the tensors named in ``convert`` as their packed dtype; their indices."""
    from ray_rdt_pool.memory.tensors import dtype_name

    out: list[int] = []
    for i, t in enumerate(tensors):
        dt = convert.get(id(t))
        if dt is None or dt == t.dtype:
            continue
        name = dtype_name(dt)  # raises InvalidInputError for a dtype the wire lacks
        if not _converts(t.dtype, dt):
            raise InvalidInputError(
                f"tensor {i} cannot be packed as {dt}: torch has no conversion from "
                f"{t.dtype} to {dt} (sub-byte dtypes such as float4_e2m1fn_x2 have none); "
                "leave it out of pack_as, or convert it yourself first")
        item = int(dt.itemsize)
        d.dtypes[i] = name
        d.aligns[i] = item
        d.nbytes[i] = t.numel() * item
        d.plain[i] = False
        out.append(i)
    return out


@functools.cache
def _converts(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether torch can copy ``src`` elements into a ``dst`` tensor (asked once per pair:
    the pack's copy would otherwise raise torch's untyped error half-way)."""
    import torch

    try:
        torch.empty(1, dtype=dst).copy_(torch.zeros(1, dtype=src))
    except (NotImplementedError, RuntimeError, TypeError):
        return False
    return True


def _device_index(tensors: Sequence[torch.Tensor]) -> int:
    t = tensors[0]
    return (t.device.index or 0) if t.is_cuda else 0


def _block_segments(blocks: Sequence[tuple[int, int]], base: int, total: int
                    ) -> list[tuple[int, int, int]]:
    segs: list[tuple[int, int, int]] = []
    v = 0
    for off, length in blocks:
        n = min(length, total - v)
        if n <= 0:
            break
        segs.append((v, base + off, n))
        v += n
    return merge_segments(segs)


def _mixed_segments(d: Described, offsets: Sequence[int], local_offsets: Sequence[int],
                    pinned: Sequence[RegEntry | None], blocks: Sequence[tuple[int, int]],
                    base: int) -> list[tuple[int, int, int]]:
    bmap = BlockMap(blocks)
    segs: list[tuple[int, int, int]] = []
    for p, off, loff, n, e in zip(d.ptrs, offsets, local_offsets, d.nbytes, pinned):
        if n == 0:
            continue
        if e is not None:
            segs.append((off, p, n))
            continue
        v = off
        for phys, m in bmap.map(loff, n):
            segs.append((v, base + phys, m))
            v += m
    return merge_segments(segs)
