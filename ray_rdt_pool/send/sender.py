"""The sender: the pool and every object this process has sent.

Role: ``put`` turns one object's tensors into a :class:`Placement` (where its packed bytes
live) plus wire metadata; ``free`` returns the placement when Ray garbage-collects the
object. A put is always a snapshot: the tensors' bytes are copied before the metadata
exists, except for tensors inside storages the user registered with
``register_memory()``, which are read by reference because the user opted in.

Where an object goes (one placement each, decided under the sender lock):

* **pool**: blocks of the pool region (one contiguous block when a CUDA copy is
  involved, otherwise as few blocks as the allocator can find);
* **overflow**: when the pool cannot hold it and ``overflow`` is on, blocks of an
  overflow region (:mod:`ray_rdt_pool.send.overflow`). Still a snapshot. ``overflow=False``
  raises ``PoolExhaustedError`` instead;
* either of those **mixed** with by-reference tensors of ``register_memory()`` storages;
* **by reference** (``put_by_reference``, the weights API's stream across nodes): no
  placement at all; the tensors' storages are registered through the storage cache and
  the caller keeps them unchanged until it frees the object.

Lifetime: the pool is made (registered and, where same-node receivers may map it, shared)
on the first put and lives until the process exits. A placement's blocks may be reused
as soon as ``free(obj_id)`` returns: Ray calls ``garbage_collect`` only once no process
holds the object's ref, so no receiver will start a READ of it again (a READ posted by a
receiver that has since died writes to that receiver's memory, never to ours). The one
exception, a block a same-node receiver still maps, waits in
:mod:`ray_rdt_pool.send.leased`. This module is the only place that frees blocks.

Threads: ``put`` runs on Ray's task thread (or the driver's thread), ``free`` on
``_ray_system``, ``reap`` on the progress thread. The lock guards the pool's and the
overflow regions' allocators, ``sent`` and ``leased``; copies run outside it. Imports no
Ray and no NIXL.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.clock import SYSTEM_CLOCK, Clock
from ray_rdt_pool.core.codec import WireMeta, encode
from ray_rdt_pool.core.descriptors import merge_segments
from ray_rdt_pool.core.layout import BlockMap, packed_offsets, run_layout
from ray_rdt_pool.core.runs import Runs, TensorRun, runs_from
from ray_rdt_pool.errors import InvalidInputError, PoolExhaustedError, RegistrationError
from ray_rdt_pool.registry import Directory, RegEntry, Region, Registry
from ray_rdt_pool.send.leased import RECHECK_S, SWEEP_S, Leased
from ray_rdt_pool.send.overflow import Overflow

if TYPE_CHECKING:
    import torch

    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.memory.describe import Described
    from ray_rdt_pool.obs.events import Events
    from ray_rdt_pool.same_node.leases import LeaseTable

logger = logging.getLogger(__name__)

__all__ = ["Placement", "Sender", "run_offsets"]


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

    The same layout functions the receiver uses. For the :class:`~ray_rdt_pool.core.runs.Runs`
    that ``runs_from`` returns, the offsets come group by group from its cached
    :func:`~ray_rdt_pool.core.layout.group_layout`, with C-level range fills instead of a
    Python step per tensor or per run; any other sequence of runs goes through
    :func:`~ray_rdt_pool.core.layout.run_layout` (the offsets are the same either way).
    """
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
                 node_id: Callable[[], str | None] | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.registry = registry
        self.events = events
        self._agent_name = agent_name
        self._directory = directory
        self._node_id = node_id or (lambda: None)
        # Guards the pool's and the overflow regions' allocators, `sent` and `leased`; an
        # RLock because wait_for() holds it while reading stats.
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # notified by every free
        self._create_lock = threading.Lock()  # serialises creating the pool
        self.pool: Region | None = None  # created on first put, lives until shutdown
        self.overflow = Overflow(config, registry, self.lock, clock)
        self.sent: dict[str, Placement] = {}  # obj_id -> placement, until free()
        self.cuda_stream: Any = None  # set_cuda_stream(): the producer of sent tensors
        self._warned_overflow = False
        self._keys = itertools.count()
        # Placements Ray freed whose blocks wait for same-node receivers' leases to drop.
        self.leased = Leased()
        # The pid of the process that shared the pool (0: not shared). In a process forked
        # from it the pool is still that process's shared memory: no put may write it.
        self.shared_by = 0

    @property
    def leases(self) -> LeaseTable | None:
        """The lease table of the shared pool (None: not shared)."""
        return self.leased.table

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
        """Make a shared pool reachable for same-node receivers (see
        :meth:`Leased.publish`), before any object names it.

        Never fails the put: where any step fails (a GCS error publishing the entry, a
        CUDA export torch refuses), the pool stays private and same-node receivers read
        it with NIXL, as receivers on other nodes do."""
        from ray_rdt_pool.memory.allocations import CudaMemory
        from ray_rdt_pool.same_node.memfd import SharedHostMemory

        node = self._node_id()
        directory = self._directory
        if node is None or directory is None or self.config.same_node == "off":
            return
        if not isinstance(pool.mem, (CudaMemory, SharedHostMemory)):
            return
        try:
            self.leased.publish(pool, node, directory, self._agent_name())
            self.shared_by = os.getpid()
        except Exception as e:
            logger.warning(
                "could not share the sender pool with same-node receivers (%s: %s); they "
                "will read it with NIXL for the life of this process", type(e).__name__, e)
        else:
            # Objects naming the pool get a newer version than any put while the entry
            # was missing, at which receivers that found no entry ask again.
            self.registry.advance()

    def reshare(self) -> None:
        """A new Ray session in this process (``ray.shutdown()``, then ``ray.init()``):
        publish the shared pool's same-node entry again, with this node's new ID, in the
        new session's GCS, which starts empty. Call before any object of the new session
        is put. Never fails the put: where publishing fails, same-node receivers of that
        session read the pool with NIXL."""
        with self._create_lock:  # not while ensure_pool() is sharing a new pool
            node = self._node_id()
            directory = self._directory
            # Not shared, or shared by the parent of this forked child: nothing to publish.
            if node is None or directory is None or self.shared_by != os.getpid():
                return
            try:
                self.leased.republish(node, directory, self._agent_name())
            except Exception as e:
                logger.warning(
                    "could not publish the sender pool for same-node receivers of the new "
                    "Ray session (%s: %s); they will read it with NIXL", type(e).__name__, e)

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
                    if not self._reap_leased_locked(full_every=SWEEP_S):
                        raise
                    blocks = pool.alloc.allocate(key, nbytes, max_blocks=max_blocks)
                return Placement(obj_id, pool, tuple(blocks), nbytes, False, key=key)
            except PoolExhaustedError as e:
                leased = self.leased.note_locked()
                if not self.config.overflow:
                    raise PoolExhaustedError(
                        e.needed, e.free, e.largest_free, e.capacity, what="sender pool",
                        remedy=f"{leased + '; or ' if leased else ''}raise pool_bytes "
                               "(RAY_RDT_POOL_POOL_BYTES), or leave overflow=True to copy "
                               "oversized objects into overflow memory") from None
                self._warn_overflow(nbytes, e, leased)
        region, blocks = self.overflow.place(key, nbytes, max_blocks)
        return Placement(obj_id, region, blocks, nbytes, True, key=key)

    def _replace(self, obj_id: str) -> None:
        """A retried put replaces its first try: release that placement (or leave it to
        the leases of the same-node receivers that map it)."""
        with self.lock:
            old = self.sent.pop(obj_id, None)
            pinned = self.leased.hold_locked(old, self.pool) if old is not None else None
        if old is not None:
            self._retired(old, pinned)

    def _retired(self, p: Placement, pinned: list[RegEntry] | None) -> None:
        """After :meth:`Leased.hold_locked`, outside the lock: release ``p`` whole, or
        only the uses it returned."""
        if pinned is None:
            self._release(p)
        else:
            self._release_entries(pinned)

    def _warn_overflow(self, nbytes: int, e: PoolExhaustedError, leased: str = "") -> None:
        if self._warned_overflow:
            return
        self._warned_overflow = True
        logger.warning(
            "an object of %s bytes does not fit the nixl_pool sender pool (%s bytes free, "
            "largest block %s of %s); it is copied into overflow memory registered for it, "
            "which costs a NIXL registration and makes receivers reload this sender's "
            "metadata. %sRaise pool_bytes (RAY_RDT_POOL_POOL_BYTES) to keep objects in the pool, "
            "or set overflow=False to raise instead. This warning is shown once per process.",
            f"{nbytes:,}", f"{e.free:,}", f"{e.largest_free:,}", f"{e.capacity:,}",
            leased + ". " if leased else "")

    def _release_locked(self, p: Placement) -> list[RegEntry]:
        if p.region is not None:
            p.region.alloc.free(p.key)
        pinned, p.pinned = p.pinned, []
        return pinned

    def _release(self, p: Placement) -> None:
        with self.lock:
            pinned = self._release_locked(p)
            empty = self.overflow.empty_locked()
            self.changed.notify_all()
        for entry in pinned:
            self.registry.release(entry)
        self.overflow.drop(empty)

    # -- put / free -----------------------------------------------------------------------

    def put(self, obj_id: str, tensors: Sequence[torch.Tensor],
            convert: Mapping[int, torch.dtype] | None = None) -> tuple[WireMeta, bytes]:
        """Snapshot ``tensors`` for ``obj_id``; returns the wire metadata and its bytes.

        ``convert`` maps ``id(tensor)`` to the dtype it is packed as: the conversion is
        the pack copy itself (one pass), and the metadata names the new dtype.
        """
        from ray_rdt_pool.memory.describe import describe
        from ray_rdt_pool.memory.pack import pack_into, pack_torch

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
                    _pack_cuda(tensors, d, local_offsets, p.blocks, region, copy_idx,
                               self.cuda_stream)
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
        from ray_rdt_pool.memory.describe import describe

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

    # -- leases of same-node receivers ----------------------------------------------------

    def _reap_leased_locked(self, full_every: float | None = None) -> bool:
        """Return the blocks of freed placements no receiver holds any more; True if any
        (see :meth:`Leased.reap_locked`)."""
        done = self.leased.reap_locked(full_every)
        for p in done:
            self._release_locked(p)  # no uses left to return: they went when it was leased
        if done:
            self.changed.notify_all()
        return bool(done)

    def reap(self) -> None:
        """Progress-thread tick: overflow regions past their linger go, the lease rows of
        receivers that died are cleared, and blocks whose last lease dropped go back to
        the pool."""
        self.overflow.reap()
        self.leased.sweep()
        if self.leased:
            with self.lock:
                self._reap_leased_locked(full_every=RECHECK_S)

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
            pinned = self.leased.hold_locked(p, self.pool) if p is not None else None
        if p is None:
            return False
        self._retired(p, pinned)
        self.events.add("objects_freed")
        self.events.notify("free")
        return True

    def overflow_stats(self) -> tuple[int, int, int]:
        """(objects, bytes, registered capacity) in overflow regions now."""
        return self.overflow.stats()

    def end_lingering(self) -> None:
        """At shutdown: every empty overflow region goes now, later ones with their last
        object."""
        self.overflow.end_lingering()


def _apply_conversions(d: Described, tensors: Sequence[torch.Tensor],
                       convert: Mapping[int, torch.dtype]) -> list[int]:
    """Describe the tensors named in ``convert`` as their packed dtype; their indices."""
    from ray_rdt_pool.memory.dtypes import dtype_name

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


def _pack_cuda(tensors: Sequence[torch.Tensor], d: Described, offsets: Sequence[int],
               blocks: Sequence[tuple[int, int]], region: Region,
               which: Sequence[int] | None, producer: Any) -> None:
    """Pack where CUDA is involved, ordered after ``producer`` (the stream that wrote the
    tensors, None: the current one) and finished before the metadata exists, so a
    one-sided READ never sees bytes still being written."""
    import torch

    from ray_rdt_pool.memory.pack import pack_torch

    (off, length), = blocks
    block = region.mem.tensor[off:off + length]
    cuda_dev = next((t.device for t in tensors if t.is_cuda), None) or block.device
    producer = producer or torch.cuda.current_stream(cuda_dev)
    side = torch.cuda.Stream(device=cuda_dev)  # type: ignore[no-untyped-call]
    side.wait_stream(producer)  # the tensors' producer has finished writing them
    with torch.cuda.stream(side):
        pack_torch(tensors, d, offsets, block, which)
    side.synchronize()  # the pool bytes are in place before anyone can read them


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
