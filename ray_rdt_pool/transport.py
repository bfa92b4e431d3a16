"""The ``nixl_pool`` tensor transport: Ray RDT on one NIXL-registered pool per process.

This is the only module that touches Ray (and, through :mod:`ray_rdt_pool._nixl`, NIXL).

Lifecycle of one object (see docs/architecture.md):

* **Sender** (``extract_tensor_transport_metadata``, task thread): lays the tensors out
  with :mod:`ray_rdt_pool.layout`, reserves blocks of the pool by object ID, copies the
  tensors' own bytes in as few memmoves as their memory allows, and returns compact wire
  metadata (:mod:`ray_rdt_pool.wire`). The agent's NIXL metadata is published once per
  registration change in Ray's GCS key-value store, never inside an object.
* **Receiver** (``fetch_multiple_tensors`` / ``wait_fetch_complete`` on the thread that
  calls ``ray.get``; ``recv_multiple_tensors`` on ``_ray_system`` for task arguments):
  decodes the wire metadata, loads the sender's agent metadata on first contact, reserves
  one block of its pre-registered receive arena, reads the object one-sided, and rebuilds
  the tensors as views of that block. The block returns to the arena when the last view
  dies.
* **Sender again** (``garbage_collect``, ``_ray_system``): the blocks return to the pool.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportManager,
    TensorTransportMetadata,
)

from ray_rdt_pool import _nixl
from ray_rdt_pool.allocator import BlockAllocator
from ray_rdt_pool.config import PoolConfig, from_env
from ray_rdt_pool.errors import (
    ConfigurationError,
    InvalidInputError,
    PoolExhaustedError,
    RdtPoolError,
    TransferError,
)
from ray_rdt_pool.layout import BlockMap, packed_offsets, run_layout
from ray_rdt_pool.merge import merge_descriptors, merge_segments
from ray_rdt_pool.snapshot import TransportStats
from ray_rdt_pool.tensors import (
    CudaRegion,
    Described,
    HostRegion,
    describe,
    device_block,
    empty_like_run_list,
    pack_into,
    pack_torch,
    rebuild,
    unpack_into,
)
from ray_rdt_pool.wire import WireMeta, decode, encode, runs_from

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

TRANSPORT = "NIXL_POOL"
_KV_NAMESPACE = "ray_rdt_pool"
_MAX_REMOTE_AGENTS = 256
_MEM = {"cpu": "DRAM", "cuda": "VRAM"}


# ---------------------------------------------------------------------------------------
# Metadata that crosses processes
# ---------------------------------------------------------------------------------------


class LazyTensorMeta(Sequence):  # type: ignore[type-arg]
    """Ray's ``tensor_meta`` list, materialised from the wire bytes only when used.

    Ray calls ``len()`` on it for every receive and indexes it only to validate target
    buffers, so ten thousand ``(torch.Size, dtype)`` pairs are never pickled, and a
    corrupted message surfaces as WireFormatError where the receiver first reads it.
    """

    __slots__ = ("_items", "_owner")

    def __init__(self, owner: PoolTransportMetadata) -> None:
        self._owner = owner
        self._items: list[tuple[Any, Any]] | None = None

    def __len__(self) -> int:
        return self._owner.decoded().num_tensors

    def _materialise(self) -> list[tuple[Any, Any]]:
        if self._items is None:
            import torch

            from ray_rdt_pool.tensors import torch_dtype

            meta = self._owner.decoded()
            self._items = [(torch.Size(s), torch_dtype(d)) for s, d in meta.shapes_dtypes()]
        return self._items

    def __getitem__(self, i: Any) -> Any:
        return self._materialise()[i]


def _meta_from_wire(wire: bytes | None, device: str | None) -> PoolTransportMetadata:
    return PoolTransportMetadata(tensor_meta=[], tensor_device=device, wire=wire)


@dataclass(eq=False)
class PoolTransportMetadata(TensorTransportMetadata):
    """Per-object metadata: the versioned wire bytes and nothing else.

    Pickles as ``(wire, device)``; ``tensor_meta`` is rebuilt lazily from the wire.
    """

    wire: bytes | None = None
    _decoded: WireMeta | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.wire is not None and not self.tensor_meta:
            self.tensor_meta = LazyTensorMeta(self)  # type: ignore[assignment]

    def decoded(self) -> WireMeta:
        """The validated wire metadata (decoded once per process)."""
        if self._decoded is None:
            if self.wire is None:
                raise TransferError("object metadata carries no wire bytes")
            self._decoded = decode(self.wire)
        return self._decoded

    def __reduce__(self) -> tuple[Any, ...]:
        return (_meta_from_wire, (self.wire, self.tensor_device))


# ---------------------------------------------------------------------------------------
# Where agents find each other: Ray's GCS key-value store
# ---------------------------------------------------------------------------------------


class KVDirectory:
    """Agent metadata, published once per registration change, read once per peer."""

    def publish(self, name: str, version: int, reset_version: int, md: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        value = version.to_bytes(8, "little") + reset_version.to_bytes(8, "little") + md
        _internal_kv_put(f"agent/{name}", value, overwrite=True, namespace=_KV_NAMESPACE)

    def lookup(self, name: str) -> tuple[int, int, bytes] | None:
        from ray.experimental.internal_kv import _internal_kv_get

        value = _internal_kv_get(f"agent/{name}", namespace=_KV_NAMESPACE)
        if value is None or len(value) < 16:
            return None
        return (int.from_bytes(value[:8], "little"), int.from_bytes(value[8:16], "little"),
                bytes(value[16:]))

    def remove(self, name: str) -> None:
        try:
            from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_initialized

            if _internal_kv_initialized():
                _internal_kv_del(f"agent/{name}", namespace=_KV_NAMESPACE)
        except Exception:  # best effort at shutdown
            pass


# ---------------------------------------------------------------------------------------
# Registrations keyed by whole extents
# ---------------------------------------------------------------------------------------


_SEEN_TAG = -1  # marks a dead first-sighting in the release queue (ids are never negative)


class _RegEntry:
    __slots__ = ("handle", "key", "pins", "users")

    def __init__(self, key: tuple[int, int, str, int], handle: Any) -> None:
        self.key = key
        self.handle = handle
        self.users = 0  # live tracked tensors whose storage is this extent
        self.pins: list[Any] = []  # tensors held by register_memory()


class RegistrationCache:
    """NIXL registrations of tensor storages, keyed by the whole extent.

    A key is (address, size, device type, device index) of a storage, never a pointer
    alone, so a recycled address of another size misses. An entry lives while any
    tensor that used it is alive: a weakref finalizer on each such tensor queues a
    release, and queued releases are applied before every lookup, so memory freed and
    reused at the same extent never meets a stale registration. Finalizers only queue,
    because they can run inside any of our own critical sections.
    """

    def __init__(self, register: Callable[[int, int, str, int], Any],
                 deregister: Callable[[Any], None]) -> None:
        self._register = register
        self._deregister = deregister
        self._entries: dict[tuple[int, int, str, int], _RegEntry] = {}
        self._tracked: dict[int, tuple[int, int, str, int]] = {}
        self._dead: deque[tuple[int, tuple[int, int, str, int]]] = deque()
        self._seen: set[tuple[int, int, str, int]] = set()
        self._pinned_sorted: list[tuple[int, int]] = []  # (start, end) of pinned extents

    @staticmethod
    def key_of(t: torch.Tensor) -> tuple[int, int, str, int]:
        s = t.untyped_storage()
        return (s.data_ptr(), s.nbytes(), t.device.type, t.device.index or 0)

    def drain(self) -> bool:
        """Apply queued releases; True if any registration was dropped."""
        changed = False
        while self._dead:
            tid, key = self._dead.popleft()
            if tid == _SEEN_TAG:
                self._seen.discard(key)
                continue
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.users -= 1
            if entry.users <= 0 and not entry.pins:
                del self._entries[key]
                try:
                    self._deregister(entry.handle)
                except Exception:
                    logger.warning("deregistering %s failed", key, exc_info=True)
                changed = True
        return changed

    def _on_dead(self, tid: int, key: tuple[int, int, str, int]) -> None:
        self._tracked.pop(tid, None)
        self._dead.append((tid, key))

    def acquire(self, t: torch.Tensor) -> tuple[_RegEntry, bool]:
        """The entry covering ``t``'s storage, registering it on a miss. Returns (entry, new)."""
        key = self.key_of(t)
        entry = self._entries.get(key)
        new = False
        if entry is None:
            handle = self._register(key[0], key[1], _MEM[key[2]], key[3])
            entry = self._entries[key] = _RegEntry(key, handle)
            new = True
        tid = id(t)
        if self._tracked.get(tid) != key:
            self._tracked[tid] = key
            entry.users += 1
            weakref.finalize(t, self._on_dead, tid, key)
        return entry, new

    def acquire_if_seen(self, t: torch.Tensor) -> bool:
        """Register ``t``'s storage if it is registered already or was seen before.

        The first sighting is only noted (until the tensor dies), so one-off buffers
        never pay a registration; a buffer that comes back is registered and cached.
        """
        key = self.key_of(t)
        if key in self._entries or key in self._seen:
            self.acquire(t)
            return True
        self._seen.add(key)
        weakref.finalize(t, self._dead.append, (_SEEN_TAG, key))
        return False

    def pin(self, t: torch.Tensor) -> bool:
        entry, new = self.acquire(t)
        entry.pins.append(t)
        self._reindex()
        return new

    def unpin(self, t: torch.Tensor) -> bool:
        """Drop a pin made by :meth:`pin`; True if the registration went away."""
        key = self.key_of(t)
        entry = self._entries.get(key)
        if entry is None or not entry.pins:
            return False
        entry.pins.pop()
        self._reindex()
        if not entry.pins and entry.users <= 0:
            del self._entries[key]
            self._deregister(entry.handle)
            return True
        return False

    def _reindex(self) -> None:
        self._pinned_sorted = sorted(
            (e.key[0], e.key[0] + e.key[1]) for e in self._entries.values() if e.pins
        )

    def has_pins(self) -> bool:
        return bool(self._pinned_sorted)

    def pinned_covers(self, addr: int, nbytes: int) -> bool:
        """True if ``[addr, addr+nbytes)`` lies inside an extent held by register_memory()."""
        spans = self._pinned_sorted
        if not spans:
            return False
        i = bisect.bisect_right(spans, (addr, 1 << 64)) - 1
        return i >= 0 and spans[i][0] <= addr and addr + nbytes <= spans[i][1]

    def __len__(self) -> int:
        return len(self._entries)


# ---------------------------------------------------------------------------------------
# The per-process runtime
# ---------------------------------------------------------------------------------------


@dataclass
class _Sent:
    blocks: tuple[tuple[int, int], ...]
    keepalive: list[Any]
    nbytes: int
    fallback: bool


@dataclass
class _Remote:
    version: int = -1
    in_flight: int = 0


class _Region:
    """One region registered once with NIXL (host mmap or CUDA), carved by a BlockAllocator."""

    def __init__(self, capacity: int, prefault: bool, name: str, device: str) -> None:
        self.mem: HostRegion | CudaRegion = (
            CudaRegion(capacity) if device == "cuda" else HostRegion(capacity, prefault=prefault))
        self.alloc = BlockAllocator(capacity, name=name)
        self.handle: Any = None

    @property
    def device(self) -> str:
        return self.mem.device

    @property
    def mem_type(self) -> str:
        return _MEM[self.mem.device]


class Runtime:
    """All transport state of one process, shared by the threads Ray calls us on.

    One re-entrant lock guards the allocator, the maps and the counters; the NIXL agent
    has its own lock. Copies and READs run outside the state lock.
    """

    def __init__(self, config: PoolConfig, backend_factory: Callable[[str, float], Any]
                 | None = None, directory: Any = None) -> None:
        self.config = config
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._backend_factory = backend_factory or _nixl.NixlBackend
        self.directory = directory if directory is not None else KVDirectory()
        self._backend: Any = None
        self.agent_name = ""
        self.version = 0
        self.reset_version = 0
        self._published = -1
        self.pool: _Region | None = None
        self.arena: _Region | None = None
        self._arena_keys = itertools.count()
        self._arena_dead: deque[int] = deque()
        self.sent: dict[str, _Sent] = {}
        self.remotes: OrderedDict[str, _Remote] = OrderedDict()
        self.aborted: set[str] = set()
        self.regs = RegistrationCache(self._register, self._deregister)
        self.c: dict[str, int] = dict.fromkeys(
            ("registrations", "deregistrations", "objects_put", "objects_freed", "bytes_packed",
             "zero_copy_tensors", "fallbacks", "objects_received", "bytes_received",
             "receive_fallbacks", "transfer_errors", "metadata_loads", "in_flight"), 0)
        self._warned_fallback = False
        self.observer: Any = None  # metrics hook, see ray_rdt_pool.metrics
        self.cuda_stream: Any = None  # set_cuda_stream(): the stream producing sent tensors
        if config.debug_transfers:
            from ray_rdt_pool.logs import enable_debug_logging

            enable_debug_logging()

    # -- NIXL plumbing ------------------------------------------------------------------

    def backend(self) -> Any:
        with self.lock:
            if self._backend is None:
                name = _nixl.new_agent_name()
                self._backend = self._backend_factory(name, self.config.progress_interval_s)
                self.agent_name = name
            return self._backend

    def _register(self, addr: int, nbytes: int, mem: str, dev: int) -> Any:
        handle = self.backend().register(addr, nbytes, mem, dev)
        self.c["registrations"] += 1
        self.version += 1
        return handle

    def _deregister(self, handle: Any) -> None:
        self.backend().deregister(handle)
        self.c["deregistrations"] += 1
        self.version += 1
        self.reset_version = self.version

    def _publish(self) -> None:
        """Make the current agent metadata visible to receivers (once per change)."""
        if self._published != self.version:
            self.directory.publish(self.agent_name, self.version, self.reset_version,
                                   self.backend().metadata())
            self._published = self.version

    def _new_region(self, capacity: int, name: str) -> _Region:
        backend = self.backend()
        region = _Region(capacity, self.config.prefault, name, self.config.device)
        region.handle = backend.register(region.mem.addr, region.mem.nbytes, region.mem_type,
                                         region.mem.device_id)
        self.c["registrations"] += 1
        self.version += 1
        return region

    def _ensure_pool(self) -> _Region:
        if self.pool is None:
            self.pool = self._new_region(self.config.pool_capacity, "pool")
        return self.pool

    def _ensure_arena(self) -> _Region:
        if self.arena is None:
            self.arena = self._new_region(self.config.arena_capacity, "receive arena")
        return self.arena

    def _drain(self) -> None:
        self.regs.drain()  # a dropped registration bumps the version in _deregister
        arena = self.arena
        while self._arena_dead:
            key = self._arena_dead.popleft()
            if arena is not None:
                arena.alloc.free(key)

    # -- sender -------------------------------------------------------------------------

    def put(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> PoolTransportMetadata:
        t_start = time.perf_counter()
        if not tensors:
            return PoolTransportMetadata(tensor_meta=[], tensor_device=None, wire=None)
        d = describe(tensors, allow_cuda=True)
        runs = runs_from(d.shapes, d.dtypes)
        offsets, total = run_offsets(runs)
        with self.lock:
            self._drain()
            pool = self._ensure_pool()
            zero_copy = [
                n > 0 and ok and self.regs.pinned_covers(p, n)
                for n, ok, p in zip(d.nbytes, d.plain, d.ptrs)
            ] if self.regs.has_pins() else None
            if zero_copy is None:
                copy_idx = None
                local_offsets, local_total = offsets, total
            else:
                copy_idx = [i for i, z in enumerate(zero_copy) if not z]
                local_offsets_sub, local_total = packed_offsets(
                    [d.nbytes[i] for i in copy_idx], [d.aligns[i] for i in copy_idx])
                local_offsets = [0] * len(tensors)
                for i, off in zip(copy_idx, local_offsets_sub):
                    local_offsets[i] = off
            fallback = False
            # memmove reaches host memory only; a CUDA side packs with one torch op into
            # one contiguous block.
            torch_path = d.device == "cuda" or pool.device == "cuda"
            try:
                blocks = tuple(pool.alloc.allocate(obj_id, local_total,
                                                   max_blocks=1 if torch_path else None))
            except PoolExhaustedError as e:
                if self.config.strict:
                    raise PoolExhaustedError(
                        e.needed, e.free, e.largest_free, e.capacity, what="sender pool",
                        remedy="raise pool_bytes (RAY_RDT_POOL_BYTES) or turn strict mode off "
                               "to register oversized objects directly") from None
                pool.alloc.free(obj_id)  # a retried put may have held blocks
                blocks = ()
                fallback = True
        segments: list[tuple[int, int, int]]
        keepalive: list[Any] = []
        try:
            if fallback:
                segments = self._register_fallback(tensors, offsets, d.nbytes, keepalive)
            else:
                t_copy = time.perf_counter()
                if blocks and isinstance(pool.mem, HostRegion):
                    pool.mem.populate(max(o + n for o, n in blocks))
                if torch_path:
                    self._pack_cuda(tensors, d, local_offsets, blocks, pool, copy_idx)
                else:
                    pack_into(tensors, d, local_offsets, blocks, pool.mem, copy_idx)
                if copy_idx is None:
                    segments = _block_segments(blocks, pool.mem.addr, total)
                else:
                    segments = self._mixed_segments(d, offsets, local_offsets, zero_copy or [],
                                                    blocks, pool.mem.addr)
                pack_s = time.perf_counter() - t_copy
            with self.lock:
                self._publish()
                if fallback:
                    where, where_id = d.device or "cpu", _device_index(tensors)
                else:
                    where, where_id = pool.device, pool.mem.device_id
                meta = WireMeta(self.agent_name, self.version, where, where_id, total, runs,
                                tuple(segments))
                wire = encode(meta)
                self.sent[obj_id] = _Sent(blocks, keepalive, local_total, fallback)
                self.c["objects_put"] += 1
                self.c["bytes_packed"] += 0 if fallback else local_total
                if zero_copy is not None:
                    self.c["zero_copy_tensors"] += sum(zero_copy)
        except BaseException:
            with self.lock:
                if not fallback:
                    pool.alloc.free(obj_id)
                self.sent.pop(obj_id, None)
            keepalive.clear()
            raise
        if self.config.debug_transfers:
            logger.debug("put %s: %d tensors, %d bytes, %d segments, fallback=%s, wire %d B",
                         obj_id, len(tensors), total, len(segments), fallback, len(wire))
        if self.observer is not None:
            self.observer.on_put(self, total, time.perf_counter() - t_start,
                                 None if fallback else pack_s, fallback)
        out = PoolTransportMetadata(tensor_meta=[], tensor_device=d.device, wire=wire)
        out._decoded = meta
        return out

    def _pack_cuda(self, tensors: Sequence[torch.Tensor], d: Described,
                   offsets: Sequence[int], blocks: Sequence[tuple[int, int]], pool: _Region,
                   which: Sequence[int] | None) -> None:
        """Pack where CUDA is involved, ordered after the producer and finished before
        the metadata exists, so a one-sided READ never sees bytes still being written."""
        import torch

        (off, length), = blocks
        block = pool.mem.tensor[off:off + length]
        cuda_dev = next((t.device for t in tensors if t.is_cuda), None) or block.device
        producer = self.cuda_stream or torch.cuda.current_stream(cuda_dev)
        side = torch.cuda.Stream(device=cuda_dev)
        side.wait_stream(producer)  # the tensors' producer has finished writing them
        with torch.cuda.stream(side):
            pack_torch(tensors, d, offsets, block, which)
        side.synchronize()  # the pool bytes are in place before anyone can read them

    def _register_fallback(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
                           nbytes: Sequence[int], keepalive: list[Any]
                           ) -> list[tuple[int, int, int]]:
        segs: list[tuple[int, int, int]] = []
        with self.lock:
            self.c["fallbacks"] += 1
            if not self._warned_fallback:
                self._warned_fallback = True
                pool = self.pool
                st = pool.alloc.stats() if pool else None
                logger.warning(
                    "an object of %s bytes does not fit the nixl_pool sender pool (%s bytes "
                    "free, largest block %s); registering its tensors with NIXL directly. "
                    "Objects sent this way are read by reference, not snapshotted. Raise "
                    "pool_bytes (RAY_RDT_POOL_BYTES) to keep them in the pool. This warning "
                    "is shown once per process.", f"{sum(nbytes):,}",
                    f"{st.free:,}" if st else "?", f"{st.largest_free_block:,}" if st else "?")
            for t, off, n in zip(tensors, offsets, nbytes):
                if n == 0:
                    continue
                if not t.is_contiguous() or t.is_conj() or t.is_neg():
                    t = t.resolve_conj().resolve_neg().contiguous()
                keepalive.append(t)
                self.regs.acquire(t)
                segs.append((off, t.data_ptr(), n))
        return merge_segments(segs)

    def _mixed_segments(self, d: Described, offsets: Sequence[int],
                        local_offsets: Sequence[int], zero_copy: Sequence[bool],
                        blocks: Sequence[tuple[int, int]], base: int
                        ) -> list[tuple[int, int, int]]:
        bmap = BlockMap(blocks)
        segs: list[tuple[int, int, int]] = []
        for p, off, loff, n, z in zip(d.ptrs, offsets, local_offsets, d.nbytes, zero_copy):
            if n == 0:
                continue
            if z:
                segs.append((off, p, n))
                continue
            v = off
            for phys, m in bmap.map(loff, n):
                segs.append((v, base + phys, m))
                v += m
        return merge_segments(segs)

    def free(self, obj_id: str) -> None:
        with self.lock:
            rec = self.sent.pop(obj_id, None)
            if rec is None:
                return
            if self.pool is not None and not rec.fallback:
                self.pool.alloc.free(obj_id)
            self.c["objects_freed"] += 1
            rec.keepalive.clear()
            self._drain()
            self.changed.notify_all()
        if self.observer is not None:
            self.observer.on_free(self)

    # -- receiver -----------------------------------------------------------------------

    def _acquire_remote(self, meta: WireMeta) -> None:
        """Load the sender's agent metadata if needed and count one transfer in flight."""
        name = meta.agent
        deadline = time.monotonic() + self.config.fetch_timeout_s
        with self.lock:
            rem = self.remotes.get(name)
            while rem is None or rem.version < meta.agent_version:
                found = self.directory.lookup(name)
                if found is None or found[0] < meta.agent_version:
                    if time.monotonic() > deadline:
                        raise TransferError(
                            f"no NIXL metadata of version >= {meta.agent_version} for sender "
                            f"agent {name!r} in Ray's GCS; the sender process may have exited")
                    self.changed.wait(0.01)
                    rem = self.remotes.get(name)
                    continue
                version, reset_version, md = found
                if rem is not None and rem.version < reset_version:
                    # Memory was deregistered since we loaded this peer: its sections must
                    # be dropped, which NIXL only does by removing the agent, and that must
                    # not happen under a READ still in flight from it.
                    while rem.in_flight > 0:
                        if not self.changed.wait(max(0.0, deadline - time.monotonic())):
                            raise TransferError(
                                f"timed out waiting for transfers from {name!r} to drain "
                                "before refreshing its metadata")
                    self._call_peer(name, self.backend().remove_remote, name)
                self._call_peer(name, self.backend().load_remote, md)
                self.c["metadata_loads"] += 1
                rem = self.remotes.get(name) or _Remote()
                rem.version = version
                self.remotes[name] = rem
                self._evict_remotes()
            rem.in_flight += 1
            self.c["in_flight"] += 1
            self.remotes.move_to_end(name)

    def _call_peer(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a NIXL call about peer ``name``; its failure is a TransferError."""
        try:
            return fn(*args)
        except Exception as e:
            self.c["transfer_errors"] += 1
            if self.observer is not None:
                self.observer.on_error(self, "err")
            raise TransferError(
                f"loading the NIXL metadata of sender agent {name!r} failed ({e}); the sender "
                "may have exited. Fetch objects from a live sender") from e

    def _evict_remotes(self) -> None:
        while len(self.remotes) > _MAX_REMOTE_AGENTS:
            victim = next((n for n, r in self.remotes.items() if r.in_flight == 0), None)
            if victim is None:
                return
            del self.remotes[victim]
            try:
                self.backend().remove_remote(victim)
            except Exception:
                logger.debug("removing remote agent %s failed", victim, exc_info=True)

    def _release_remote(self, name: str) -> None:
        with self.lock:
            rem = self.remotes.get(name)
            if rem is not None and rem.in_flight > 0:
                rem.in_flight -= 1
            self.c["in_flight"] = max(0, self.c["in_flight"] - 1)
            self.changed.notify_all()

    def fetch(self, obj_id: str, pmeta: PoolTransportMetadata,
              targets: Sequence[torch.Tensor] | None) -> PoolFetch:
        t_start = time.perf_counter()
        meta = pmeta.decoded()
        req = PoolFetch(obj_id=obj_id, tensors=[])
        req.runtime = self
        req.meta = meta
        req.t_start = t_start
        if meta.num_tensors == 0 or not meta.segments:
            req.tensors = list(targets) if targets else empty_like_run_list(meta.runs)
            req.done = True
            return req
        if targets:
            _check_targets(targets, meta)
        with self.lock:
            if obj_id in self.aborted:
                self.aborted.discard(obj_id)
                raise TransferError(f"the transfer of object {obj_id} was aborted")
        self._acquire_remote(meta)
        req.remote = meta.agent
        try:
            if targets and self._targets_registered(targets):
                local, remote = self._target_descs(targets, meta)
                req.tensors = list(targets)
                local_mem = _MEM[targets[0].device.type]
            else:
                if targets:
                    # Buffers seen for the first time: registering each storage would cost
                    # more than one copy, so read into the arena and copy out. Buffers that
                    # come back (a weight-sync loop) are registered and read in place.
                    req.copy_into = list(targets)
                base, local_mem, dev = self._reserve_receive(req, meta.total)
                local = [(base + v, n, dev) for v, _a, n in meta.segments]
                remote = [(a, n, meta.device_id) for _v, a, n in meta.segments]
            local, remote = merge_descriptors(local, remote)
            req.ndescs = len(local)
            req.xfer = self.backend().start_read(local, remote, meta.agent, local_mem,
                                                 _MEM[meta.device])
        except BaseException as e:
            req.release(failed=True)
            if not isinstance(e, InvalidInputError):
                with self.lock:
                    self.c["transfer_errors"] += 1
                if self.observer is not None:
                    self.observer.on_error(self, "err")
            if isinstance(e, RdtPoolError):
                raise
            raise TransferError(
                f"starting the READ of object {obj_id} ({meta.total:,} bytes) from "
                f"{meta.agent} failed: {e}; the sender may have exited") from e
        return req

    def _reserve_receive(self, req: PoolFetch, total: int) -> tuple[int, str, int]:
        """A block of the arena for one object, or a one-off registered buffer.

        Returns (address, NIXL memory type, device index) of where the bytes land.
        """
        with self.lock:
            self._drain()
            arena = self._ensure_arena()
            key = next(self._arena_keys)
            try:
                (block,) = arena.alloc.allocate(key, total, max_blocks=1)
            except PoolExhaustedError:
                block = None
            if block is not None:
                if isinstance(arena.mem, HostRegion):
                    arena.mem.populate(block[0] + block[1])
                req.arena_key = key
                req.arena_offset = block[0]
                return arena.mem.addr + block[0], arena.mem_type, arena.mem.device_id
            self.c["receive_fallbacks"] += 1
        import torch

        buf = torch.empty(total, dtype=torch.uint8, device=arena.mem.torch_device)
        req.temp = buf
        req.temp_handle = self._register_counted(buf.data_ptr(), total, arena.mem_type,
                                                 arena.mem.device_id)
        return buf.data_ptr(), arena.mem_type, arena.mem.device_id

    def _register_counted(self, addr: int, nbytes: int, mem: str, dev: int) -> Any:
        with self.lock:
            handle = self.backend().register(addr, nbytes, mem, dev)
            self.c["registrations"] += 1
            return handle

    def _targets_registered(self, targets: Sequence[torch.Tensor]) -> bool:
        """True when every target's storage is (now) registered: on its second sighting."""
        with self.lock:
            self._drain()
            seen = [self.regs.acquire_if_seen(t) for t in targets]
        return all(seen)

    def _target_descs(self, targets: Sequence[torch.Tensor], meta: WireMeta
                      ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        seg_starts = [s[0] for s in meta.segments]
        local: list[tuple[int, int, int]] = []
        remote: list[tuple[int, int, int]] = []
        dev = meta.device_id
        for t, off in zip(targets, meta.tensor_offsets()):
            n = t.numel() * t.element_size()
            if n == 0:
                continue
            addr = t.data_ptr()
            ldev = t.device.index or 0
            for v, raddr, m in _segment_pieces(meta.segments, seg_starts, off, n):
                local.append((addr + (v - off), m, ldev))
                remote.append((raddr, m, dev))
        return local, remote

    def wait(self, req: PoolFetch, timeout: float) -> list[torch.Tensor]:
        if req.done:
            return req.tensors
        remote = req.remote  # release() clears it; the messages below name the sender
        backend = self.backend()
        limit = self.config.fetch_timeout_s if timeout is None or timeout < 0 else min(
            timeout, self.config.fetch_timeout_s)

        def aborted() -> bool:
            return req.obj_id in self.aborted

        try:
            state = _nixl.wait_until(lambda: backend.state(req.xfer), limit, aborted)
        except Exception as e:
            state = "ERR"
            err: Exception | None = e
        else:
            err = None
        if state != "DONE" and self.observer is not None:
            self.observer.on_error(self, state.lower())
        if state == "TIMEOUT":
            with self.lock:
                self.c["transfer_errors"] += 1
            req.release(failed=True)
            if timeout is not None and 0 <= timeout < self.config.fetch_timeout_s:
                raise TimeoutError(
                    f"READ of object {req.obj_id} not done after {limit:.3f}s")
            raise TransferError(
                f"READ of object {req.obj_id} ({req.meta.total:,} bytes) from {remote} did "
                f"not finish within fetch_timeout_s={limit}s; the sender may be dead or stalled. "
                "Raise RAY_RDT_POOL_FETCH_TIMEOUT_S if the transfer is just slow")
        if state != "DONE":
            with self.lock:
                self.c["transfer_errors"] += 1
                self.aborted.discard(req.obj_id)
            req.release(failed=True)
            what = "was aborted" if state == "ABORTED" else f"failed ({state}: {err})"
            raise TransferError(
                f"READ of object {req.obj_id} ({req.meta.total:,} bytes) from {remote} "
                f"{what}; the sender actor may have died. Fetch again while the ref is "
                "in scope") from err
        tensors = req.finish()
        if self.observer is not None:
            self.observer.on_fetch(self, req.meta.total, time.perf_counter() - req.t_start)
        return tensors

    def wait_for(self, predicate: Callable[[TransportStats], bool], timeout_s: float
                 ) -> TransportStats | None:
        """Block until ``predicate(stats())`` holds; None after ``timeout_s``.

        Woken by every free, so a sender that streams buckets waits for pool space
        without polling.
        """
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while True:
                st = self.stats()
                if predicate(st):
                    return st
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                # Bounded: arena blocks return through finalizers, which do not notify.
                self.changed.wait(min(remaining, 0.05))

    def abort(self, obj_id: str) -> None:
        """Make a READ of ``obj_id`` in progress (or about to start) give up."""
        with self.lock:
            self.aborted.add(obj_id)

    def stats(self) -> TransportStats:
        with self.lock:
            self._drain()
            p = self.pool.alloc.stats() if self.pool else None
            a = self.arena.alloc.stats() if self.arena else None
            c = self.c
            return TransportStats(
                pool_device=self.config.device,
                pool_capacity=p.capacity if p else 0,
                pool_used=p.used if p else 0,
                pool_free=p.free if p else 0,
                pool_largest_free_block=p.largest_free_block if p else 0,
                pool_free_blocks=p.free_blocks if p else 0,
                live_objects=len(self.sent),
                arena_capacity=a.capacity if a else 0,
                arena_used=a.used if a else 0,
                arena_free=a.free if a else 0,
                arena_largest_free_block=a.largest_free_block if a else 0,
                arena_free_blocks=a.free_blocks if a else 0,
                arena_live_blocks=a.live_objects if a else 0,
                nixl_registrations=c["registrations"],
                nixl_deregistrations=c["deregistrations"],
                registered_regions=(self.pool is not None) + (self.arena is not None)
                + len(self.regs),
                objects_put=c["objects_put"],
                objects_freed=c["objects_freed"],
                bytes_packed=c["bytes_packed"],
                zero_copy_tensors=c["zero_copy_tensors"],
                fallbacks=c["fallbacks"],
                objects_received=c["objects_received"],
                bytes_received=c["bytes_received"],
                receive_fallbacks=c["receive_fallbacks"],
                transfers_in_flight=c["in_flight"],
                transfer_errors=c["transfer_errors"],
                remote_agents=len(self.remotes),
                remote_metadata_loads=c["metadata_loads"],
                agent_name=self.agent_name,
            )

    def shutdown(self) -> None:
        with self.lock:
            if self._backend is not None:
                self.directory.remove(self.agent_name)
                self._backend.close()
            if self.observer is not None and hasattr(self.observer, "close"):
                self.observer.close()


def run_offsets(runs: Sequence[Any]) -> tuple[list[int], int]:
    """Packed offset of every tensor and the packed total, from the runs alone.

    The same :func:`ray_rdt_pool.layout.run_layout` the receiver uses; tensors inside a
    run follow each other with no padding, so their offsets are a ``range``.
    """
    starts, total = run_layout([(r.nbytes_each, r.itemsize, r.count) for r in runs])
    offsets: list[int] = []
    for run, start in zip(runs, starts):
        n = run.nbytes_each
        offsets.extend(range(start, start + n * run.count, n) if n else [start] * run.count)
    return offsets, total


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


def _segment_pieces(segments: Sequence[tuple[int, int, int]], starts: Sequence[int],
                    virt: int, n: int) -> list[tuple[int, int, int]]:
    """(virt, remote_addr, length) pieces of packed range [virt, virt+n) (wire-validated)."""
    i = bisect.bisect_right(starts, virt) - 1
    out: list[tuple[int, int, int]] = []
    end = virt + n
    pos = virt
    while pos < end:
        v, a, m = segments[i]
        take = min(v + m, end) - pos
        out.append((pos, a + (pos - v), take))
        pos += take
        i += 1
    return out


def _check_targets(targets: Sequence[torch.Tensor], meta: WireMeta) -> None:
    from ray_rdt_pool.tensors import dtype_name

    if len(targets) != meta.num_tensors:
        raise InvalidInputError(
            f"{len(targets)} target buffers for an object of {meta.num_tensors} tensors; "
            "pass one buffer per tensor, in the order they were sent")
    import torch

    for i, (t, (shape, dt)) in enumerate(zip(targets, meta.shapes_dtypes())):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(
                f"target buffer {i} is a {type(t).__name__}, not a torch.Tensor; pass "
                "preallocated tensors, one per tensor of the object")
        if tuple(t.shape) != shape or dtype_name(t.dtype) != dt:
            raise InvalidInputError(
                f"target buffer {i} is {tuple(t.shape)} {t.dtype} but the object holds "
                f"{shape} {dt}; allocate it with that shape and dtype")
        if not t.is_contiguous() or t.device.type != targets[0].device.type:
            raise InvalidInputError(
                f"target buffer {i} must be contiguous and on the same device type as buffer "
                f"0 (is_contiguous={t.is_contiguous()}, device={t.device}); use "
                "torch.empty(...) or .contiguous()")


@dataclass
class PoolFetch(FetchRequest):
    """One READ in progress. Releases its handle, block and remote count exactly once,
    also when Ray drops it without waiting (``__del__``)."""

    runtime: Any = None
    meta: Any = None
    remote: str | None = None
    xfer: Any = None
    arena_key: int | None = None
    arena_offset: int = 0
    temp: Any = None
    temp_handle: Any = None
    ndescs: int = 0
    copy_into: Any = None
    t_start: float = 0.0
    done: bool = False
    released: bool = False

    def release(self, failed: bool) -> None:
        if self.released:
            return
        self.released = True
        rt: Runtime = self.runtime
        if rt is None:
            return
        try:
            if self.xfer is not None:
                rt.backend().release(self.xfer)
                self.xfer = None
        except Exception:
            logger.debug("releasing a transfer handle failed", exc_info=True)
        if self.temp_handle is not None:
            try:
                with rt.lock:
                    rt.backend().deregister(self.temp_handle)
                    rt.c["deregistrations"] += 1
            except Exception:
                logger.debug("deregistering a receive buffer failed", exc_info=True)
            self.temp_handle = None
        if failed and self.arena_key is not None:
            rt._arena_dead.append(self.arena_key)
            self.arena_key = None
        if self.remote is not None:
            rt._release_remote(self.remote)
            self.remote = None

    def finish(self) -> list[torch.Tensor]:
        rt: Runtime = self.runtime
        meta: WireMeta = self.meta
        self.release(failed=False)
        with rt.lock:
            rt.c["objects_received"] += 1
            rt.c["bytes_received"] += meta.total
        if self.copy_into is not None:
            self._copy_out(rt, meta)
        elif not self.tensors:
            if self.arena_key is not None:
                key = self.arena_key
                self.arena_key = None
                dead = rt._arena_dead
                mem = rt.arena.mem  # type: ignore[union-attr]
                block = device_block(mem.addr + self.arena_offset, meta.total, mem.device,
                                     mem.device_id, lambda: dead.append(key))
            else:
                block = self.temp
                self.temp = None
            self.tensors = rebuild(block, meta.runs, meta.run_starts())
        self.done = True
        if rt.config.debug_transfers:
            logger.debug("fetched %s: %d tensors, %d bytes, %d descriptors", self.obj_id,
                         meta.num_tensors, meta.total, self.ndescs)
        return self.tensors

    def _copy_out(self, rt: Runtime, meta: WireMeta) -> None:
        """Copy a received object from its arena block into the caller's buffers."""
        if self.arena_key is not None:
            mem = rt.arena.mem  # type: ignore[union-attr]
            base, device, dev_id = mem.addr + self.arena_offset, mem.device, mem.device_id
        else:
            base, device, dev_id = self.temp.data_ptr(), self.temp.device.type, 0
        unpack_into(self.copy_into, meta.tensor_offsets(), base, meta.total, device, dev_id)
        self.tensors = self.copy_into
        self.copy_into = None
        self.temp = None
        if self.arena_key is not None:
            rt._arena_dead.append(self.arena_key)
            self.arena_key = None

    def __del__(self) -> None:
        if not self.released:
            try:
                self.release(failed=True)
            except Exception:
                pass


# ---------------------------------------------------------------------------------------
# Process-wide runtime and the Ray-facing class
# ---------------------------------------------------------------------------------------

_runtime: Runtime | None = None
_runtime_lock = threading.Lock()
_config: PoolConfig | None = None


def configure(**options: Any) -> PoolConfig:
    """Set this process's configuration before its first put or get."""
    global _config
    with _runtime_lock:
        base = _config if _config is not None else from_env()
        new = base.with_overrides(**options)
        if _runtime is not None and new != _runtime.config:
            raise ConfigurationError(
                "configure() was called after nixl_pool was first used in this process "
                f"(pool of {_runtime.config.pool_bytes:,} bytes already exists); call it "
                "before the first ray.put or ray.get, e.g. at the top of the actor's __init__")
        if _config is not None and new != _config:
            changed = {k: (getattr(_config, k), v) for k, v in options.items()
                       if getattr(_config, k) != v}
            raise ConfigurationError(
                f"configure() was already called in this process with other values {changed} "
                "(old, new); configure once per process")
        _config = new
        return new


def runtime() -> Runtime:
    """The process's runtime, created with the configured (or default) settings."""
    global _runtime, _config
    rt = _runtime
    if rt is not None:
        return rt
    with _runtime_lock:
        if _runtime is None:
            if _config is None:
                _config = from_env()
            _runtime = Runtime(_config)
            try:
                from ray_rdt_pool import metrics

                _runtime.observer = metrics.observer_for(_runtime)
            except Exception:
                logger.debug("metrics unavailable", exc_info=True)
        return _runtime


def _probe_actor(self: Any) -> bool:
    try:
        import nixl._api  # noqa: F401
    except Exception:
        return False
    return True


class NixlPoolTransport(TensorTransportManager):
    """Ray's entry points for the ``nixl_pool`` transport; one instance per process.

    Where each method runs (Ray 2.60):

    * ``actor_has_tensor_transport`` — caller of ``.remote()``, caller's thread. The
      answer is cached per actor.
    * ``extract_tensor_transport_metadata`` — sender, task thread (or the driver's
      thread for ``ray.put`` in the driver). Packs the object into the pool.
    * ``get_communicator_metadata`` — owner. Nothing to agree on: returns empty metadata.
    * ``fetch_multiple_tensors`` / ``wait_fetch_complete`` — receiver, the thread that
      calls ``ray.get``. Starts the READ, then waits for it and rebuilds the tensors.
    * ``recv_multiple_tensors`` — receiver, ``_ray_system`` thread (task arguments).
    * ``garbage_collect`` — sender, ``_ray_system`` thread. Returns the blocks.
    * ``abort_transport`` — receiver, ``_ray_system_error`` thread. Marks the object so
      the waiting READ gives up and releases everything.

    State lives in the process-wide :class:`Runtime`, so ``stats()`` sees it too.
    """

    def __init__(self) -> None:
        self._has_transport: dict[str, bool] = {}

    def tensor_transport_backend(self) -> str:
        return TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: ray.actor.ActorHandle) -> bool:
        key = actor._actor_id.hex()
        cached = self._has_transport.get(key)
        if cached is None:
            cached = bool(ray.get(actor.__ray_call__.options(
                concurrency_group="_ray_system").remote(_probe_actor)))
            self._has_transport[key] = cached
        return cached

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]
                                          ) -> PoolTransportMetadata:
        return runtime().put(obj_id, rdt_object)

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any,
                                  backend: str | None = None) -> CommunicatorMetadata:
        return CommunicatorMetadata()

    def fetch_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any,
                               communicator_metadata: CommunicatorMetadata,
                               target_buffers: list[Any] | None = None) -> FetchRequest:
        return runtime().fetch(obj_id, _as_pool_meta(tensor_transport_metadata),
                               target_buffers)

    def wait_fetch_complete(self, fetch_request: FetchRequest, timeout: float = -1
                            ) -> list[Any]:
        if not isinstance(fetch_request, PoolFetch):
            return fetch_request.tensors
        return runtime().wait(fetch_request, timeout)

    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any,
                              communicator_metadata: CommunicatorMetadata,
                              target_buffers: list[Any] | None = None) -> list[Any]:
        req = self.fetch_multiple_tensors(obj_id, tensor_transport_metadata,
                                          communicator_metadata, target_buffers)
        return self.wait_fetch_complete(req)

    def send_multiple_tensors(self, tensors: list[Any], tensor_transport_metadata: Any,
                              communicator_metadata: CommunicatorMetadata) -> None:
        raise NotImplementedError("nixl_pool is one-sided: receivers read, senders never send")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any,
                        tensors: list[Any]) -> None:
        runtime().free(obj_id)

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata
                        ) -> None:
        runtime().abort(obj_id)


def _as_pool_meta(meta: Any) -> PoolTransportMetadata:
    if not isinstance(meta, PoolTransportMetadata):
        raise InvalidInputError(
            f"nixl_pool received metadata of type {type(meta).__name__}; the object was "
            "produced by another transport")
    return meta


def register() -> str:
    """Register the transport with Ray in this process; safe to call again."""
    import torch
    from ray.experimental import register_tensor_transport
    from ray.experimental.rdt import util as rdt_util

    info = rdt_util.transport_manager_info.get(TRANSPORT)
    if info is not None:
        if info.transport_manager_class is not NixlPoolTransport:
            raise ConfigurationError(
                f"another class ({info.transport_manager_class.__name__}) is already "
                f"registered as Ray tensor transport {TRANSPORT}")
        return TRANSPORT
    try:
        register_tensor_transport(TRANSPORT, ["cpu", "cuda"], NixlPoolTransport, torch.Tensor)
    except ValueError:
        # Ray registered it on this actor concurrently (on _ray_system); same class.
        info = rdt_util.transport_manager_info.get(TRANSPORT)
        if info is None or info.transport_manager_class is not NixlPoolTransport:
            raise
    return TRANSPORT


def register_memory(tensor: torch.Tensor) -> None:
    """Register ``tensor``'s storage with NIXL so objects holding it are sent zero-copy.

    Tensors inside a registered storage are read in place by receivers (no snapshot):
    do not modify them until the objects holding them are freed.
    """
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.device.type not in ("cpu", "cuda"):
        raise InvalidInputError("register_memory() takes a CPU or CUDA torch.Tensor")
    rt = runtime()
    with rt.lock:
        rt.regs.pin(tensor)
        rt._ensure_pool()


def deregister_memory(tensor: torch.Tensor) -> None:
    """Undo one :func:`register_memory` of the same tensor's storage."""
    rt = runtime()
    with rt.lock:
        rt.regs.unpin(tensor)


def set_cuda_stream(stream: Any) -> None:
    """Name the CUDA stream that produces the tensors this process sends.

    The pack copy waits for that stream instead of the current one. ``None`` restores
    the default (the current stream of the tensors' device).
    """
    runtime().cuda_stream = stream


def stats() -> TransportStats:
    """A snapshot of this process's transport (zeros before first use)."""
    return runtime().stats()


__all__ = [
    "TRANSPORT",
    "NixlPoolTransport",
    "PoolTransportMetadata",
    "Runtime",
    "configure",
    "deregister_memory",
    "register",
    "register_memory",
    "runtime",
    "set_cuda_stream",
    "stats",
]

