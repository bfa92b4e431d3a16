"""NIXL's agents for one process: :class:`NixlBackend`, the real :class:`~.protocol.Backend`.

Only this package and :mod:`ray_rdt_pool._ray.transport` touch NIXL. The backend owns
the process's agents (lane 0, and the read lanes of :mod:`.lanes`), one lock per agent,
and a quiet progress thread. Lifetime: made on first use by the runtime, closed by
``ray_rdt_pool.shutdown()``. Threads: any of Ray's threads and the progress thread.

**Quiet progress.** A peer's first READ needs this process's lane 0 to progress its UCX
worker a few times (the connection handshake). Later READs are one-sided and need
nothing from it. So the progress thread runs at ``interval_s`` for
:data:`PROGRESS_HOLD_S` after this process last sent something
(:meth:`NixlBackend.active`), when peers connect, and at ``idle_interval_s`` otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ray_rdt_pool.errors import RegistrationError
from ray_rdt_pool.nixl.lanes import (
    Lane,
    LaneRegs,
    SplitRead,
    post,
    release_split,
    split_pairs,
    split_state,
    start_split,
)
from ray_rdt_pool.nixl.protocol import Desc

logger = logging.getLogger(__name__)

__all__ = ["PROGRESS_HOLD_S", "NixlBackend", "new_agent_name"]

#: Seconds the progress thread keeps its fast interval after :meth:`NixlBackend.active`:
#: the receivers of an object connect (if they are new) within moments of its put.
PROGRESS_HOLD_S = 1.0


def new_agent_name() -> str:
    """A name unique per process incarnation, so a restarted actor is a new peer."""
    return f"rdtpool-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class NixlBackend:
    """The NIXL agents of one process (UCX), their progress thread replaced by a sleeping one.

    NIXL's own progress thread polls with no delay and burns a whole core while idle.
    One-sided READs here complete inside ``transfer()`` once two agents are connected,
    but the connection itself needs the *target* to progress its UCX worker. So lane 0's
    agent runs without NIXL's thread, and a daemon thread of ours progresses it every
    ``interval_s`` (a few ms) while peers may be connecting, which costs a few percent of
    a core, and every ``idle_interval_s`` otherwise (see the module doc). Lanes 1.. are made
    when the process first loads a remote agent or registers memory with ``lanes=True``
    (first use as a receiver). They are never targets (nobody loads their metadata) and
    get no progress thread: whoever polls one of their READs progresses them, and the
    sender's handshake is progressed by the sender's own thread.

    Threads: any of Ray's threads (task thread, ``_ray_system``, ``_ray_system_error``)
    and the receiver's progress tick call in. Each lane has its own re-entrant lock; an
    operation on lane k takes lock k; operations on several lanes (register with
    ``lanes=True``, deregister, load/remove a remote) take them one at a time, in lane
    order. Parts of a split READ for lanes 1.. are posted on the lanes' own threads.
    """

    def __init__(self, name: str, interval_s: float, lanes: int = 1,
                 split_bytes: int = 8 << 20, on_split: Callable[[], None] | None = None,
                 post_timeout_s: float = 60.0,
                 agent_factory: Callable[[str], Any] | None = None,
                 idle_interval_s: float | None = None) -> None:
        """``lanes``: agents in this process (1 disables splitting); ``split_bytes``: the
        smallest READ that is split; ``on_split()`` runs after each split READ is posted;
        ``post_timeout_s``: how long a posted part of a split READ that failed elsewhere
        may run before it is cut off; ``agent_factory(name)`` makes an agent (tests);
        ``idle_interval_s``: the progress interval once nothing was sent for
        :data:`PROGRESS_HOLD_S` (None, or anything below ``interval_s``: always
        ``interval_s``)."""
        self._make = agent_factory or self._nixl_agent
        agent = self._make(name)  # lane 0: a failure here is the process's failure
        self.name = name
        # Replaced (never mutated) when lanes 1.. are made, so readers need no lock.
        self._lanes: list[Lane] = [Lane(0, name, agent)]
        self._want_lanes = max(1, int(lanes))
        self._lanes_made = self._want_lanes == 1
        self._lanes_guard = threading.Lock()
        self.lock = self._lanes[0].lock  # lane 0's lock (the progress thread takes it)
        self._split_bytes = max(1, int(split_bytes))
        self._on_split = on_split
        self._post_timeout = post_timeout_s
        self._worker_guard = threading.Lock()
        self._interval = interval_s
        self._idle_interval = max(interval_s, idle_interval_s or 0.0)
        # Until when the fast interval holds (monotonic seconds): set by active(), read by
        # the progress thread; a float attribute, so neither side needs a lock.
        self._fast_until = time.monotonic() + PROGRESS_HOLD_S
        self._ticks: list[Any] = []
        self._stop = threading.Event()
        self._wake = threading.Event()  # cuts an idle sleep short (active(), close())
        self._thread = threading.Thread(
            target=self._progress_loop, name="ray_rdt_pool-progress", daemon=True)
        self._thread.start()

    @staticmethod
    def _nixl_agent(name: str) -> Any:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as e:  # ImportError, or a broken CUDA probe inside nixl
            raise RegistrationError(
                f"NIXL is not usable in this process ({type(e).__name__}: {e}); install "
                "it with `pip install nixl` on every node that sends or receives nixl_pool "
                "objects"
            ) from e
        from ray_rdt_pool.obs.logs import quiet_nixl_stdout

        quiet_nixl_stdout()  # NIXL's logger prints INFO lines to stdout per agent
        try:
            return nixl_agent(
                name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as e:
            raise RegistrationError(
                f"could not create the NIXL agent {name!r} with the UCX backend: {e}"
            ) from e

    @property
    def lanes(self) -> int:
        """How many agents this process has now (1: no split READs, or none yet)."""
        return len(self._lanes)

    def _ensure_lanes(self) -> None:
        """Make lanes 1.. on first use as a receiver (any thread; once).

        Called before the first remote is loaded and before the first registration with
        ``lanes=True``, so a new lane never misses a remote agent or a lane registration
        made before it existed: there was none.
        """
        if self._lanes_made:
            return
        with self._lanes_guard:
            if self._lanes_made:
                return
            lanes = list(self._lanes)
            for k in range(1, self._want_lanes):
                lane_name = f"{self.name}-lane{k}"
                try:
                    lanes.append(Lane(k, lane_name, self._make(lane_name)))
                except Exception as e:  # lanes are an optimisation: run with fewer
                    logger.warning("could not create read lane %s (%s); using %d lane(s)",
                                   lane_name, e, len(lanes))
                    break
            self._lanes = lanes
            self._lanes_made = True

    def add_tick(self, fn: Any) -> None:
        """Call ``fn()`` on the progress thread after every progress call."""
        self._ticks.append(fn)

    def active(self) -> None:
        """This process is sending something whose readers may be new peers: progress at
        the fast interval for the next :data:`PROGRESS_HOLD_S` (any thread; cheap)."""
        now = time.monotonic()
        idle = now >= self._fast_until
        self._fast_until = now + PROGRESS_HOLD_S
        if idle:
            self._wake.set()  # the thread may be in an idle sleep

    def _progress_loop(self) -> None:
        """The progress thread: progress lane 0 every interval, then run the ticks."""
        lane0 = self._lanes[0]
        while True:
            fast = time.monotonic() < self._fast_until
            self._wake.wait(self._interval if fast else self._idle_interval)
            if self._stop.is_set():
                return
            self._wake.clear()
            if sys.is_finalizing():
                return  # a binding call now could re-take the GIL during finalization
            # Skip a beat rather than queue behind a long transfer.
            if lane0.lock.acquire(blocking=False):
                try:
                    if lane0.agent is not None:
                        lane0.agent.get_new_notifs()
                except Exception:  # a dying peer must not kill the progress thread
                    logger.debug("NIXL progress call failed", exc_info=True)
                finally:
                    lane0.lock.release()
            for tick in self._ticks:
                try:
                    tick()
                except Exception:
                    logger.debug("progress tick failed", exc_info=True)

    # -- registrations --------------------------------------------------------------------

    def register(self, addr: int, nbytes: int, mem: str, dev: int,
                 lanes: bool = False) -> Any:
        """Register memory with lane 0, or (``lanes``) with every lane.

        With several lanes the handle is a list of (lane, handle) that
        :meth:`deregister` undoes on every lane; if one lane refuses, the lanes already
        registered are rolled back before the error is raised.
        """
        if lanes:
            self._ensure_lanes()
        targets = self._lanes if lanes else self._lanes[:1]
        done: list[tuple[Lane, Any]] = []
        try:
            for lane in targets:
                with lane.lock:
                    done.append((lane, lane.agent.register_memory(
                        [(addr, nbytes, dev, "")], mem)))
        except Exception as e:
            for lane, h in reversed(done):
                try:
                    with lane.lock:
                        lane.agent.deregister_memory(h)
                except Exception:
                    logger.warning("rolling back the registration on %s failed", lane.name,
                                   exc_info=True)
            hint = ""
            alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower()
            if mem == "VRAM" and "expandable_segments:true" in alloc_conf:
                hint = (" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is set: memory from "
                        "expandable segments cannot be registered for RDMA; unset it.")
            where = "" if len(done) == 0 else f" on read lane {len(done)}"
            raise RegistrationError(
                f"NIXL could not register {nbytes:,} bytes of {mem} memory at {addr:#x} "
                f"(device {dev}){where}: {e}.{hint}"
            ) from e
        if len(done) == 1:
            return done[0][1]
        return LaneRegs(done)

    def deregister(self, handle: Any) -> None:
        """Undo :meth:`register` on every lane it registered with; raises the first
        failure after trying every lane. A lane whose agent :meth:`close` destroyed is
        skipped: destroying it dropped every registration it held."""
        pairs = handle.pairs if isinstance(handle, LaneRegs) else [(self._lanes[0], handle)]
        first: BaseException | None = None
        for lane, h in pairs:
            try:
                with lane.lock:
                    if lane.agent is not None:
                        lane.agent.deregister_memory(h)
            except Exception as e:
                logger.debug("deregistering on %s failed", lane.name, exc_info=True)
                first = first or e
        if first is not None:
            raise first

    # -- remote agents --------------------------------------------------------------------

    def metadata(self) -> bytes:
        """Lane 0's metadata: the only agent senders publish and peers load."""
        lane0 = self._lanes[0]
        with lane0.lock:
            return bytes(lane0.agent.get_agent_metadata())

    def load_remote(self, md: bytes) -> str:
        """Add (or merge) a remote agent's metadata into every lane; returns its name."""
        self._ensure_lanes()
        names = []
        for lane in self._lanes:
            with lane.lock:
                names.append(lane.agent.add_remote_agent(md))
        name = names[0]
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        """Remove a remote agent from every lane, which ends every READ from it.

        A lane that fails does not stop the others; the first error is raised after."""
        first: BaseException | None = None
        for lane in self._lanes:
            try:
                with lane.lock:
                    lane.agent.remove_remote_agent(name)
            except Exception as e:
                logger.debug("removing %s from %s failed", name, lane.name, exc_info=True)
                first = first or e
        if first is not None:
            raise first

    # -- READs ----------------------------------------------------------------------------

    def start_read(self, local: Sequence[Desc], remote: Sequence[Desc], remote_name: str,
                   local_mem: str, remote_mem: str, split: bool = False) -> Any:
        """Post a READ; returns a handle for :meth:`state` and :meth:`release`.

        ``split``: the local memory is registered with every lane (a receive arena), so
        a READ of at least ``split_bytes`` may be cut into one part per lane. Part 0 is
        posted on the calling thread, the others on the lanes' threads at the same time,
        and this returns once every part is posted. If any part fails to post, the parts
        already posted are released (a part still running is waited for, and cut off
        after ``post_timeout_s``) before the error is raised: nothing writes into the
        local memory once this raises.
        """
        lanes = self._lanes
        if split and len(lanes) > 1:
            total = 0
            for d in local:
                total += d[1]
            if total >= self._split_bytes:
                groups = split_pairs(local, remote, len(lanes))
                if len(groups) > 1:
                    return start_split(lanes, groups, remote_name, local_mem, remote_mem,
                                       self._post_timeout, self._worker_guard,
                                       self._on_split)
        handle, _state = post(lanes[0], local, remote, remote_name, local_mem, remote_mem,
                              self._post_timeout)
        return handle

    def state(self, xfer: Any) -> str:
        """``DONE``, ``PROC`` or ``ERR`` (NIXL's words); for a :class:`SplitRead` see there."""
        if isinstance(xfer, SplitRead):
            return split_state(xfer)
        lane0 = self._lanes[0]
        with lane0.lock:
            return str(lane0.agent.check_xfer_state(xfer))

    def release(self, xfer: Any) -> None:
        """Release a handle; a running READ is cancelled if NIXL can, else this raises and
        the handle stays valid. A :class:`SplitRead` releases every part it still holds
        and raises after trying all if any part refused; those parts stay pollable."""
        if not isinstance(xfer, SplitRead):
            lane0 = self._lanes[0]
            with lane0.lock:
                lane0.agent.release_xfer_handle(xfer)
            return
        release_split(xfer)

    def close(self) -> None:
        """Stop the threads and destroy every lane's agent; safe to call twice.

        Runs from ``ray_rdt_pool.shutdown()`` (also registered with ``atexit``), before
        the interpreter finalizes: a thread still inside a NIXL binding at finalization
        re-takes the GIL and aborts the process.
        """
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 20 * self._interval))
        for lane in self._lanes[1:]:
            lane.stop_worker(timeout=5.0)
        self._ticks = []
        for lane in reversed(self._lanes):
            with lane.lock:
                agent, lane.agent = lane.agent, None
            del agent  # the agent's destructor closes its UCX workers here, not at exit
