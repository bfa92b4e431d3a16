"""The receiver: one object's fetch and wait, over parts that each own one lifetime.

``fetch`` starts reading one object and returns a :class:`Fetch`; ``wait`` waits for it
and rebuilds the tensors. An object of a same-node sender's shared pool is served out of
this process's mapping of that pool (:mod:`.mapped`); any other is read with one
one-sided NIXL READ (:mod:`.transfers`) under a lease on the sender's peer
(:mod:`.peers`) into a landing (:mod:`.arena`). Transfer, landing and peer lease are each
released exactly once, a landing only after its transfer has ended.

Landing device: the target buffers' device; else the device of the sender's tensors
(Ray's ``set_target_device_for_ref`` arrives as target buffers on that device). A
receiver without that device raises ``TransferError`` before anything is reserved.

Threads: ``fetch``/``wait`` on the thread calling ``ray.get`` or on ``_ray_system``
(task arguments); ``abort`` on ``_ray_system_error``; ``reap`` on the agent's progress
thread; arena blocks and mappings come back from whatever thread drops the last view
(:mod:`.drain`); the fork hooks (:mod:`.fork`) on the forking thread, holding every
watched receiver's lock across the fork. Lock order: a transfer's lock, then the
receiver lock. NIXL and GCS calls never run under the receiver lock. Imports no Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.clock import SYSTEM_CLOCK, Backoff, Clock
from ray_rdt_pool.core.descriptors import merge_descriptors
from ray_rdt_pool.core.selection import SelectionPlan, plan_for_object
from ray_rdt_pool.errors import ReadStillRunningError, TransferError
from ray_rdt_pool.receive.arena import Landing, Landings
from ray_rdt_pool.receive.drain import Drain
from ray_rdt_pool.receive.mapped import Mapped, cuda_available
from ray_rdt_pool.receive.peers import Peer, Peers
from ray_rdt_pool.receive.source import SourceReader
from ray_rdt_pool.receive.targets import check_targets
from ray_rdt_pool.receive.transfers import Transfer, Transfers
from ray_rdt_pool.registry import MEM_TYPE, Directory, Region, Registry

if TYPE_CHECKING:
    import torch

    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.core.codec import WireMeta
    from ray_rdt_pool.obs.events import Events

logger = logging.getLogger(__name__)

__all__ = ["Fetch", "Receiver"]


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
    """The receiving half of one process's transport: the receiver lock, and the parts
    that share it."""

    def __init__(self, config: PoolConfig, registry: Registry, events: Events,
                 backend: Callable[[], Any], directory: Directory,
                 node_id: Callable[[], str | None] | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.clock = clock  # fetch_timeout_s, the caller's timeouts and housekeeping
        self.registry = registry
        self.events = events
        self.directory = directory
        node = node_id or (lambda: None)
        # Guards the state of every part below; a transfer's lock is taken before it.
        self.lock = threading.RLock()
        self.drain = Drain(self.lock)
        self.landings = Landings(config, registry, events, self.lock, self.drain)
        self.peers = Peers(config, events, self.lock, backend, directory, clock)
        self.transfers = Transfers(config, events, self.lock, backend, self.peers,
                                   self.landings, clock)
        self.mapped = Mapped(config, events, self.lock, backend, directory, node,
                             self.landings, self.drain)
        self.sources = SourceReader(config, events, self.landings, node)
        # Leases and forks first, then arena blocks.
        self.drain.parts = (self.mapped, self.landings)

    @property
    def arenas(self) -> dict[str, Region]:
        """The receive arenas by device type (changed under the lock)."""
        return self.landings.arenas

    # -- fetch / wait ---------------------------------------------------------------------

    def fetch(self, obj_id: str, meta: WireMeta, device_hint: str | None,
              targets: Sequence[torch.Tensor] | None,
              selection: Sequence[Any] | None = None) -> Fetch:
        """Start reading ``obj_id`` (or, with ``selection``, only part of each tensor:
        see :func:`~ray_rdt_pool.core.selection.plan_for_object`); never waits for other
        fetches."""
        from ray_rdt_pool.memory.dtypes import empty_tensor, torch_dtype
        from ray_rdt_pool.memory.rebuild import empty_like_run_list

        f = Fetch(obj_id, meta)
        if targets:
            check_targets(targets, meta, self.config.tuning.native)
            device = targets[0].device.type
        else:
            device = device_hint if device_hint in MEM_TYPE else meta.device
        if device == "cuda" and not targets and not cuda_available():
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
        if self.transfers.aborted_before_start(obj_id):
            self.events.error("aborted")
            raise TransferError(f"the transfer of object {obj_id} was aborted")
        if self.mapped.try_map(f, device, targets):
            self._mapped_get_done(f)
            return f
        what = f"starting the READ of object {obj_id} ({meta.total:,} bytes) from {meta.agent}"
        with self.events.failures(what, "the sender may have exited; fetch again while the "
                                        "ref is in scope"):
            peer: Peer | None = None
            landing: Landing | None = None
            try:
                peer = self.peers.lease(meta)
                landing, local, remote = self.landings.for_read(f, device, targets,
                                                                self.mapped.live)
                local, remote = merge_descriptors(local, remote)
                f.ndescs = len(local)
                f.transfer = self.transfers.post(obj_id, meta, peer, landing, local, remote)
                self.events.add("reads_posted")
            except BaseException as e:
                if f.transfer is not None:
                    # Posted, then interrupted: nobody will wait for it.
                    f.settled = True
                    self.transfers.finish_id(obj_id)
                    self.transfers.abandon(f.transfer)
                    raise
                if (isinstance(e, ReadStillRunningError) and e.running is not None
                        and landing is not None and peer is not None):
                    # Part of it may still write: keep the landing and the lease until
                    # it ends (reap polls it; cut off at fetch_timeout_s).
                    running, e.running = e.running, None
                    self.transfers.adopt_running(obj_id, running, peer, landing)
                    raise
                # Nothing was posted: the landing and the lease can go back at once.
                if landing is not None:
                    self.landings.release(landing)
                if peer is not None:
                    with self.lock:
                        self.peers.unlease_locked(peer, failed=True)
                raise
        return f

    def _mapped_get_done(self, f: Fetch) -> None:
        """``f`` was served out of a same-node sender's pool: account for it."""
        meta = f.meta
        f.settled = True
        self.transfers.finish_id(f.obj_id)
        ev = self.events
        ev.add("objects_received")
        ev.add("mapped_gets")
        ev.add("bytes_received", meta.total if f.selected is None else f.selected.nbytes)
        if self.config.debug_transfers:
            logger.debug("fetched %s: %d tensors, %d bytes, mapped from the same-node "
                         "sender's pool (%s)", f.obj_id, meta.num_tensors, meta.total,
                         self.config.same_node)
        ev.notify("fetch", meta.total, time.perf_counter() - f.t_start)

    def wait(self, f: Fetch, timeout: float | None) -> list[torch.Tensor]:
        """Wait for ``f``'s READ and return the tensors (see :mod:`.transfers` for what
        a READ that fails, times out or is aborted leaves behind)."""
        if f.settled:
            return f.tensors
        t = f.transfer
        assert t is not None
        user_limit = timeout is not None and 0 <= timeout < self.config.fetch_timeout_s
        own = timeout if timeout is not None and user_limit else float("inf")
        clock = self.clock
        deadline = min(t.started + self.config.fetch_timeout_s, clock.monotonic() + own)
        backoff = Backoff(clock)
        try:
            while True:
                state = self.transfers.poll(t)
                if state != "PROC":
                    break
                if t.aborted:
                    state = "ABORTED"
                    break
                if clock.monotonic() >= deadline:
                    state = "TIMEOUT"
                    break
                clock.sleep(backoff.next())
        except BaseException:
            # Interrupted (Ctrl-C in the sleep, a failing poll): nobody will consume this
            # READ, so hand it to reap(), which ends it or cuts it at fetch_timeout_s (a
            # plain Fetch, as fetch_selected's, has no __del__ safety net).
            f.settled = True
            self.transfers.finish_id(f.obj_id)
            self.transfers.abandon(t)
            raise
        f.settled = True
        self.transfers.finish_id(f.obj_id)
        if state == "DONE":
            return self._finish(f, t)
        meta = f.meta
        if state in ("TIMEOUT", "ABORTED"):
            self.transfers.abandon(t)
        else:
            self.landings.release(t.landing)
        self.events.error({"TIMEOUT": "timeout", "ABORTED": "aborted"}.get(state, "err"))
        if state == "TIMEOUT" and user_limit and clock.monotonic() < (
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
        from ray_rdt_pool.memory.rebuild import rebuild

        meta = f.meta
        landing = t.landing
        sel = f.selected
        self.events.add("objects_received")
        self.events.add("bytes_received", meta.total if sel is None else sel.nbytes)
        if sel is not None:
            f.tensors = self.landings.selected_views(landing, sel)
        elif f.copy_into is not None:
            f.tensors = self._copy_out(f, landing)
        elif landing.kind == "targets":
            assert f.targets is not None
            f.tensors = f.targets
            self.landings.release(landing)
        else:
            block = self.landings.hand_over(landing, meta.total)
            f.tensors = rebuild(block, meta.runs, meta.run_starts())
        if self.config.debug_transfers:
            logger.debug("fetched %s: %d tensors, %d bytes, %d descriptors", f.obj_id,
                         meta.num_tensors, meta.total, f.ndescs)
        self.events.notify("fetch", meta.total, time.perf_counter() - f.t_start)
        return f.tensors

    def _copy_out(self, f: Fetch, landing: Landing) -> list[torch.Tensor]:
        """Copy a received object from its landing into the caller's buffers."""
        import torch

        from ray_rdt_pool.memory.rebuild import unpack_into

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
            self.landings.release(landing)
        return targets

    # -- the progress thread, Ray's aborts and drops ----------------------------------------

    def reap(self) -> None:
        """Progress-thread housekeeping: end abandoned READs, cut overdue ones, drop
        dead peers and same-node senders. Cheap when there is nothing to do."""
        self.transfers.abandon_dropped()
        now = self.clock.monotonic()
        with self.lock:
            waiting = self.transfers.abandoned_locked()
            housekeeping = self.peers.housekeeping_due_locked(now, bool(self.mapped.hosts))
            self.drain.run_locked()
        for t in waiting:
            if (self.transfers.poll(t) == "PROC"
                    and now > t.started + self.config.fetch_timeout_s):
                self.peers.remove(t.peer, cut=True, reads=self.transfers)
        if housekeeping:
            self.peers.housekeep(now, self.transfers)
            self.mapped.close_dead_hosts()

    def abort(self, obj_id: str) -> None:
        """Ray gave up on ``obj_id`` (see :meth:`.transfers.Transfers.abort`)."""
        self.transfers.abort(obj_id)

    def dropped(self, t: Transfer) -> None:
        """A Fetch died unconsumed (any thread, maybe inside GC): abandon it later."""
        self.transfers.dropped(t)

    # -- introspection and exit -----------------------------------------------------------

    def counts(self) -> dict[str, int]:
        with self.lock:
            self.drain.run_locked()
            return {
                "mapped_objects": self.mapped.objects,
                "mapped_bytes": self.mapped.nbytes,
                "abandoned": len(self.transfers.abandoned_locked()),
                "pending_aborts": len(self.transfers.pending_aborts),
                "peers": len(self.peers.by_name),
            }

    def shutdown(self) -> None:
        """Abandon what is in flight and remove every peer (process exit, or
        ``ray_rdt_pool.shutdown()`` in a process that keeps running). Views of same-node
        mappings still alive keep them, and their leases, until they die; then their
        deleters return the leases themselves (no progress thread runs any more)."""
        with self.lock:
            self.drain.run_locked()
            live = list(self.transfers.outstanding.values())
            peers = list(self.peers.by_name.values())
            self.mapped.close_all_locked()
        for t in live:
            self.transfers.abandon(t)
        for p in peers:
            self.peers.remove(p, cut=True, reads=self.transfers)
