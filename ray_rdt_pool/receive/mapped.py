"""Same-node gets: our handles on same-node senders' shared pools, and mapped objects.

Owns: one handle (:class:`~ray_rdt_pool.same_node.pool_handle.MappedPool`) per same-node
sender agent, and a lease on the sender's block for every object served out of its pool:
its tensors are views of this process's one private mapping of the pool (or copied out
of it) instead of a READ. Lifetime: a copy's lease drops as soon as the copy is done; a
mapping's lease when its last view dies (the deleter queues it, the next drain unmaps
the pages, then drops the lease). A handle goes with its sender's exit, the LRU bound
:data:`MAX_HOSTS`, or shutdown; views keep their leases until they die. Threads:
fetching threads map; the progress thread drains and closes dead senders' handles;
deleters on any thread; the fork hooks (:mod:`ray_rdt_pool.receive.fork`) on the
forking thread. Imports no Ray.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.errors import TransferError, WireFormatError, shut_down_error
from ray_rdt_pool.receive import fork
from ray_rdt_pool.receive.arena import Landing, Landings
from ray_rdt_pool.registry import Directory
from ray_rdt_pool.same_node.cuda import NotVisibleError
from ray_rdt_pool.same_node.info import HostInfo
from ray_rdt_pool.same_node.leases import lease_slot
from ray_rdt_pool.same_node.pool_handle import MappedPool, mappable_spans

if TYPE_CHECKING:
    import threading

    import torch

    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.obs.events import Events
    from ray_rdt_pool.receive.drain import Drain
    from ray_rdt_pool.receive.receiver import Fetch

logger = logging.getLogger(__name__)

__all__ = ["HOST_RETRY_S", "MAX_HOSTS", "Mapped", "Unmap", "cuda_available"]

#: Senders remembered by agent name for the same-node path (mapped or not).
MAX_HOSTS = 1024
#: A same-node sender whose pool could not be opened (no free lease row, a GCS error) is
#: asked again after this long; its objects are read with NIXL meanwhile.
HOST_RETRY_S = 10.0

#: An object whose views died: (pool, slot, address, length of its pages in the pool
#: mapping or 0 for a copy, bytes); see ``Mapped.unmaps``.
Unmap = tuple[MappedPool, int, int, int, int]


class Mapped:
    """Handles on same-node senders' pools, and the leases this process holds in them
    (a part of the receiver)."""

    def __init__(self, config: PoolConfig, events: Events, lock: threading.RLock,
                 backend: Callable[[], Any], directory: Directory,
                 node_id: Callable[[], str | None], landings: Landings, drain: Drain
                 ) -> None:
        self.config = config
        self.events = events
        self.lock = lock  # the receiver lock
        self._backend = backend
        self.directory = directory
        self._node_id = node_id
        self.landings = landings
        self.drain = drain
        # Same-node senders by agent name: our handle on their shared pool, or None when
        # their objects are read with NIXL (another node, no shared pool, or no access).
        self.hosts: OrderedDict[str, MappedPool | None] = OrderedDict()
        self.host_retry: dict[str, float] = {}  # agent -> when to ask again (see host)
        # agent -> the registration epoch at which its directory held no same-node entry:
        # its pool may be made later, and is asked for again at a newer epoch (see host).
        self.host_absent: dict[str, int] = {}
        # Objects whose views died: appended by deleters from any thread, their pages
        # given back and unleased under the lock.
        self.unmaps: deque[Unmap] = deque()
        # Leases this process holds (object mappings whose views live, copies running),
        # counted here: a sender's handle is dropped when it exits, its leases are not.
        self.objects = 0
        self.nbytes = 0
        # Objects of a pool mapping that views may still use, by address: (pool, slot,
        # length). Changed under the lock; a forked child copies each into memory of its
        # own.
        self.live: dict[int, tuple[MappedPool, int, int]] = {}
        self.forks = fork.Forks()  # forks whose child may not have copied its mappings yet
        self.shut = False  # the receiver shut down: no new sender handle is kept

    def host(self, agent: str, version: int) -> MappedPool | None:
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
                absent = self.host_absent.get(agent)
                if absent is not None:
                    if version <= absent:
                        return None
                else:
                    retry = self.host_retry.get(agent)
                    if retry is None or time.monotonic() < retry:
                        return None
                    del self.host_retry[agent]
            first = agent not in self.hosts
        node = self._node_id()
        failed = False
        blob = None
        try:
            blob = self.directory.lookup_host(agent) if node is not None else None
            if blob is not None:
                info = HostInfo.decode(blob)
                if info.node_id == node and not (info.cuda is not None
                                                 and not cuda_available()):
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
            if self.shut:  # shutdown() closed the handles meanwhile: nothing may keep one
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
                fork.watch(self)
                self.host_absent.pop(agent, None)
            elif blob is None and not failed:
                self.host_absent[agent] = max(version, self.host_absent.get(agent, -1))
            else:  # a definite answer, or a failure asked again by time
                self.host_absent.pop(agent, None)
            if failed:
                self.host_retry[agent] = time.monotonic() + HOST_RETRY_S
            while len(self.hosts) > MAX_HOSTS:
                name, old = self.hosts.popitem(last=False)
                self.host_retry.pop(name, None)
                self.host_absent.pop(name, None)
                if old is not None:
                    old.close()  # its views keep their leases (and the table) until they die
        return host

    def unlease_locked(self, host: MappedPool, slot: int, nbytes: int) -> None:
        """Drop one lease of ours (caller holds the receiver lock)."""
        host.release_one(slot)
        self.objects -= 1
        self.nbytes -= nbytes

    def close_dead_hosts(self) -> None:
        """Close the handles of senders that exited (the progress thread's housekeeping)."""
        with self.lock:
            hosts = [(n, h) for n, h in self.hosts.items() if h is not None]
        dead = [(n, h) for n, h in hosts if not h.alive()]  # reads /proc: not under the lock
        with self.lock:
            for n, h in dead:
                if self.hosts.get(n) is h:
                    self.hosts[n] = None
                h.close()  # mappings of its objects stay valid while their views live

    def try_map(self, f: Fetch, device: str, targets: Sequence[torch.Tensor] | None
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
            host = self.host(meta.agent, meta.agent_version)
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
                self.drain.run_locked()
                # Closed by another thread since host() (evicted, or its sender exited):
                # close() and lease() both run under this lock, so this check holds.
                if host.closed:
                    continue
                host.lease(slot)
                self.objects += 1
                self.nbytes += meta.total
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
                        # Before any view exists (see fork.before).
                        self.live[addr] = (host, slot, length)
                        host.viewing.add(slot)
        except BaseException as e:
            with self.lock:
                if length and self.live.pop(addr, None) is not None:
                    host.drop_view(slot, addr, length)
                self.unlease_locked(host, slot, meta.total)
            if not isinstance(e, OSError):  # a Ctrl-C: the lease goes back all the same
                raise
            logger.warning("mapping object %s of same-node sender %s failed (%s); reading "
                           "it with NIXL", f.obj_id, meta.agent, e)
            return False
        release: Unmap = (host, slot, addr, length, meta.total)
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
                self.drain.run_locked()
        return True

    def _from_mapping(self, f: Fetch, addr: int, release: Unmap,
                      targets: Sequence[torch.Tensor] | None, device: str, dev_id: int,
                      pieces: Sequence[tuple[int, int, int]] | None = None
                      ) -> list[torch.Tensor]:
        """The tensors of ``f``: views of the pool mapping at ``addr`` when ``release``
        names a mapped length, else one copy out of the object at ``addr`` (or of its
        ``pieces``, (packed offset, address, length) each, when it is fragmented)."""
        from ray_rdt_pool.memory.blocks import device_block
        from ray_rdt_pool.memory.rebuild import copy_bytes, rebuild, unpack_into

        meta = f.meta
        unmaps = self.unmaps
        if release[3]:
            # From here the block owns the mapping: its deleter releases it, even if the
            # rebuild below fails.
            block = device_block(addr, meta.total, "cpu", 0,
                                 lambda: self.mapping_died(release))
            out = rebuild(block, meta.runs, meta.run_starts())
            if f.selection is None:
                return out
            # A selection that is contiguous in the tensor is a view of the selected part:
            # only its pages are touched (the mapping faults pages in on first use) and
            # nothing is copied. A strided one is copied out, as every other path returns
            # it (transport.fetch_selected promises contiguous tensors); when every piece
            # is a copy, the mapping and its lease go as soon as this returns.
            return [t if s is None else contiguous(t[s if isinstance(s, tuple) else (s,)])
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
                copy_bytes(piece_moves(pieces, [
                    (t.data_ptr(), off, t.numel() * t.element_size())
                    for t, off in zip(targets, meta.tensor_offsets())]), device, dev_id,
                    stream)
                return list(targets)
            size = meta.total if sel is None else sel.total
            landing = self.landings.local(size, device)
            moves = ([(landing.addr, 0, meta.total)] if sel is None else
                     [(landing.addr + lo, p, n) for lo, p, n in sel.ranges])
            if pieces is None:
                copy_bytes([(d, addr + p, n) for d, p, n in moves], device, dev_id, stream)
            else:
                copy_bytes(piece_moves(pieces, moves), device, dev_id, stream)
        except BaseException:
            if landing is not None:
                self.landings.release(landing)
            raise
        finally:
            unmaps.append(release)
        assert landing is not None
        if sel is not None:
            return self.landings.selected_views(landing, sel)
        return rebuild(self.landings.hand_over(landing, size), meta.runs, meta.run_starts())

    def mapping_died(self, release: Unmap) -> None:
        """The deleter of an object mapping's views (any thread, maybe inside GC): queue
        its release for the next drain, or drain now when no progress thread will."""
        self.unmaps.append(release)
        self.drain.from_deleter(self)

    def drain_locked(self) -> None:
        """Give back the pages and leases of objects whose views died, and the extra
        leases of settled forks (caller holds the receiver lock)."""
        while self.unmaps:
            host, slot, addr, length, nbytes = self.unmaps.popleft()
            if length:  # 0: a copy, no pages of ours to give back
                self.live.pop(addr, None)
                # First: no copy-on-write page outlives the lease.
                if not host.drop_view(slot, addr, length):
                    continue  # those pages stay ours: the block must stay leased
            self.unlease_locked(host, slot, nbytes)
        if self.forks.pending:
            self.forks.settle_locked()

    def queued(self) -> bool:
        return bool(self.unmaps)

    def close_all_locked(self) -> None:
        """Shutdown: close every handle and keep no new one; views still alive keep their
        mappings and leases until they die, and their deleters drain themselves."""
        for h in self.hosts.values():
            if h is not None:
                h.close()
        self.hosts.clear()
        self.drain.self_drain = True
        self.shut = True


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def piece_moves(pieces: Sequence[tuple[int, int, int]],
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


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is a contiguous view with elements, else a contiguous tensor of its
    own (no reference to the mapping it came from)."""
    from ray_rdt_pool.memory.dtypes import empty_tensor

    if t.numel() == 0:
        return empty_tensor(t.shape, t.dtype)
    return t if t.is_contiguous() else t.contiguous()
