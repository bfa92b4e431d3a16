"""The shared sender pool's lease table, and the freed placements that wait on it.

Role: a same-node receiver maps the shared sender pool and holds a lease on the page slot
of each object it keeps a view of (see :class:`~ray_rdt_pool.same_node.leases.LeaseTable`).
:meth:`Leased.publish` makes the table and publishes the pool's same-node entry, which
names it. When Ray frees an object a lease still holds, or a retried put replaces it,
:meth:`Leased.hold_locked` keeps its placement here instead of letting its blocks be
reused under the view; :meth:`Leased.reap_locked` hands back those whose last lease
dropped, for the sender to release, and :meth:`Leased.sweep` clears the lease rows of
receivers that died.

Lifetime: the table lives from the pool's sharing until the process exits (its entry is
published again in each new Ray session); a placement stays here from its free until the
last lease on its slot drops.

Threads: hold and reap run under the sender's lock (``free`` on ``_ray_system``, a put on
the task thread, the progress thread's tick); the sweep runs on the progress thread and
publishing under the sender's pool-creation lock, both outside it. Imports no Ray and no
NIXL.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray_rdt_pool.registry import Directory, RegEntry, Region
    from ray_rdt_pool.same_node.info import HostInfo
    from ray_rdt_pool.same_node.leases import LeaseTable
    from ray_rdt_pool.send.sender import Placement

__all__ = ["IDLE_SWEEP_S", "RECHECK_S", "SWEEP_S", "Leased"]

logger = logging.getLogger(__name__)

#: How often the lease table is swept for rows of dead receivers while a freed placement
#: waits for leases (a killed receiver's leases go within about this long)...
SWEEP_S = 1.0
#: ...and while none waits (the rows themselves must come back).
IDLE_SWEEP_S = 5.0
#: How often every leased placement is checked, not only those whose slot a release log
#: names: on hardware that orders stores more weakly than x86, a log entry may be read
#: before the count it follows, and that release would wait for this check.
RECHECK_S = 10.0


class Leased(Mapping[Hashable, "Placement"]):
    """The placements waiting for leases, by allocator key (read under the sender's lock)."""

    def __init__(self) -> None:
        self.table: LeaseTable | None = None  # set once the pool is shared, then kept
        # The same-node entry last published for the pool: its node ID is the Ray
        # session's, published again in each new one.
        self.host_info: HostInfo | None = None
        self._waiting: dict[Hashable, Placement] = {}
        # Lease slot -> the keys in `_waiting` whose first block lies in it.
        self._at: dict[int, list[Hashable]] = {}
        self._last_full = -math.inf  # when every waiting placement was last checked
        self._last_sweep = -math.inf  # when sweep() last swept the table

    def __getitem__(self, key: Hashable) -> Placement:
        return self._waiting[key]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def publish(self, pool: Region, node: str, directory: Directory, agent: str) -> None:
        """Make the lease table of ``pool`` and publish the pool's same-node entry under
        ``agent``. A host pool is shared as its memfd, a CUDA pool through CUDA IPC.
        Raises (closing the new table) if any step fails."""
        from ray_rdt_pool.memory.allocations import CudaMemory
        from ray_rdt_pool.same_node.cuda import export_cuda_pool
        from ray_rdt_pool.same_node.info import HostInfo, process_start
        from ray_rdt_pool.same_node.leases import LeaseTable, lease_slots

        mem = pool.mem
        cuda = export_cuda_pool(mem.tensor) if isinstance(mem, CudaMemory) else None
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
            directory.publish_host(agent, info.encode())
        except BaseException:
            table.close()
            raise
        self.host_info = info
        self.table = table

    def republish(self, node: str, directory: Directory, agent: str) -> None:
        """A new Ray session: publish the entry again with this node's new ID, in the
        new session's directory, which starts empty. Raises if publishing fails."""
        info = self.host_info
        if info is None:
            return
        info = replace(info, node_id=node)
        directory.publish_host(agent, info.encode())
        self.host_info = info

    def hold_locked(self, p: Placement, pool: Region | None) -> list[RegEntry] | None:
        """A placement Ray no longer names (freed, or replaced by a retry): if a same-node
        receiver maps it, keep its blocks until the last lease drops and return its
        ``register_memory()`` uses (nothing maps those: they go back now); else None."""
        table, region = self.table, p.region
        if table is None or region is None or region is not pool or not p.blocks:
            return None
        slot = table.slot(p.blocks[0][0])
        if not table.held(slot):
            return None
        self._waiting[p.key] = p
        self._at.setdefault(slot, []).append(p.key)
        pinned, p.pinned = p.pinned, []
        return pinned

    def reap_locked(self, full_every: float | None = None) -> list[Placement]:
        """The placements no receiver holds any more, taken out of here for the sender
        to release.

        Only the slots the receivers' release logs name are checked, unless the table
        asks for a full check or the last one is ``full_every`` seconds old: then every
        waiting placement."""
        table = self.table
        if table is None or not self._waiting:
            return []
        released = table.released()
        full = full_every is not None and time.monotonic() >= self._last_full + full_every
        if released is None or full:
            slots = list(self._at)
            self._last_full = time.monotonic()
        else:
            slots = [s for s in released if s in self._at]
        done: list[Placement] = []
        for slot, held in zip(slots, table.held_many(slots)):
            if not held:
                done.extend(self._waiting.pop(k) for k in self._at.pop(slot))
        return done

    def sweep(self) -> None:
        """Progress-thread tick: clear the rows of receivers that died, every
        :data:`SWEEP_S` while some placement waits, every :data:`IDLE_SWEEP_S` otherwise
        (receivers come and go with nothing leased, copy-mode ones always; their rows
        must come back or the table fills up)."""
        table = self.table
        if table is None:
            return
        now = time.monotonic()
        if now < self._last_sweep + (SWEEP_S if self._waiting else IDLE_SWEEP_S):
            return
        self._last_sweep = now
        try:
            cleared = table.sweep()
        except OSError:
            logger.debug("sweeping the lease table failed", exc_info=True)
            return
        if cleared:
            logger.info("cleared the lease rows of %d same-node receiver(s) that exited",
                        cleared)

    def note_locked(self) -> str:
        """What of a full pool same-node receivers hold (their views of objects Ray
        freed), and the fix, for the message of a put that does not fit; "" if none."""
        if not self._waiting:
            return ""
        n = sum(p.nbytes for p in self._waiting.values())
        return (f"{n:,} bytes of it are objects already freed whose blocks same-node "
                f"receivers still hold views of ({len(self._waiting)} objects): drop those "
                "views sooner, or set same_node='copy' on those receivers (their tensors "
                "then hold no lease)")
