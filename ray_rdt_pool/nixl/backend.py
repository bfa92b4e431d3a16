"""The NIXL side of the transport: the agents of one process, their locks, quiet progress.

Only this module and :mod:`ray_rdt_pool._ray.transport` touch NIXL. Everything above it talks
to the small :class:`Backend` interface, which a fake can implement for unit tests of
the transport's logic (never for integration tests).

**Read lanes.** With UCX over cma (two processes on one host) the copy of a READ runs
inside ``transfer()`` on the calling thread, and two threads posting on *one* agent
serialize. Several agents in one process (each its own UCX context and worker) copy
concurrently. So :class:`NixlBackend` may hold ``lanes`` agents: lane 0 is the agent
senders publish and peers load; lanes 1.. are extra agents used only to initiate READs,
created when the process first acts as a receiver (so a process that only sends never
pays for them). A large READ into memory registered with every lane (the receive
arenas) is cut into one part per lane, posted concurrently, and tracked by one
composite handle.

**Quiet progress.** A peer's first READ needs this process's lane 0 to progress its UCX
worker a few times (the connection handshake; measured here: about four progress
intervals). Later READs are one-sided and need nothing from it. So the progress thread
runs at ``interval_s`` for :data:`PROGRESS_HOLD_S` after this process last sent something
(:meth:`NixlBackend.active`), when peers connect, and at ``idle_interval_s`` otherwise.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, NoReturn, Protocol

from ray_rdt_pool.errors import ReadStillRunningError, RegistrationError, TransferError

logger = logging.getLogger(__name__)

__all__ = ["Backend", "NixlBackend", "SplitRead", "new_agent_name", "split_pairs"]

Desc = tuple[int, int, int]

#: Cut points of a split READ fall on multiples of this many bytes of the READ's stream,
#: so two lanes rarely share a page (the arena blocks themselves are aligned).
SPLIT_ALIGN = 4096

#: Seconds the progress thread keeps its fast interval after :meth:`NixlBackend.active`:
#: the receivers of an object connect (if they are new) within moments of its put.
PROGRESS_HOLD_S = 1.0


def new_agent_name() -> str:
    """A name unique per process incarnation, so a restarted actor is a new peer."""
    return f"rdtpool-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class Backend(Protocol):
    """What the transport needs from NIXL. All methods are thread-safe."""

    name: str

    def register(self, addr: int, nbytes: int, mem: str, dev: int,
                 lanes: bool = False) -> Any: ...
    def deregister(self, handle: Any) -> None: ...
    def metadata(self) -> bytes: ...
    def load_remote(self, md: bytes) -> str: ...
    def remove_remote(self, name: str) -> None: ...
    def start_read(self, local: Sequence[Desc], remote: Sequence[Desc], remote_name: str,
                   local_mem: str, remote_mem: str, split: bool = False) -> Any: ...
    def state(self, xfer: Any) -> str: ...
    def release(self, xfer: Any) -> None: ...
    def add_tick(self, fn: Any) -> None: ...
    def close(self) -> None: ...


def _dlist(agent: Any, descs: Sequence[Desc], mem: str) -> Any:
    if len(descs) > 64:
        import numpy as np

        # NIXL builds an Nx3 array in C; a list of tuples is converted in Python.
        return agent.get_xfer_descs(np.array(descs, dtype=np.uint64), mem)
    return agent.get_xfer_descs(list(descs), mem)


def split_pairs(local: Sequence[Desc], remote: Sequence[Desc], parts: int,
                align: int = SPLIT_ALIGN) -> list[tuple[list[Desc], list[Desc]]]:
    """Cut paired descriptors into at most ``parts`` groups of about equal bytes.

    The pairs are read as one stream of bytes (pair 0's, then pair 1's, ...); the cut
    points are the multiples of ``align`` nearest to ``total * i / parts``, and a pair
    that straddles a cut is split at the same byte offset on both sides, so every
    group is again a list of pairs of equal length. Every byte is in exactly one group,
    groups keep the order of the stream, and each holds ``total / parts`` bytes give or
    take ``align``. Fewer groups come back when the READ is too small for ``parts``
    (fewer than ``parts * align`` bytes). Zero-length pairs are dropped.

    Pure: runs on the thread calling ``start_read``.

    Raises:
        ValueError: the lists differ in length or a pair differs in length.
    """
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local descriptors but {len(remote)} remote ones")
    total = 0
    for i, (ld, rd) in enumerate(zip(local, remote)):
        if ld[1] != rd[1] or ld[1] < 0:
            raise ValueError(f"descriptor {i}: local length {ld[1]}, remote length {rd[1]}")
        total += ld[1]
    k = max(1, int(parts))
    align = max(1, int(align))
    cuts: list[int] = []
    for i in range(1, k):
        c = (total * i // k + align // 2) // align * align
        cuts.append(min(max(c, cuts[-1] if cuts else 0), total))
    cuts.append(total)
    groups: list[tuple[list[Desc], list[Desc]]] = []
    cur_l: list[Desc] = []
    cur_r: list[Desc] = []
    pos = 0  # stream offset of the next byte to place
    ci = 0  # index of the next cut ahead of pos
    for (la, n, ldev), (ra, _m, rdev) in zip(local, remote):
        off = 0
        while off < n:
            # pos < total here and cuts[-1] == total, so ci stays in range.
            while pos >= cuts[ci]:
                if cur_l:
                    groups.append((cur_l, cur_r))
                    cur_l, cur_r = [], []
                ci += 1
            take = min(n - off, cuts[ci] - pos)
            cur_l.append((la + off, take, ldev))
            cur_r.append((ra + off, take, rdev))
            off += take
            pos += take
    if cur_l:
        groups.append((cur_l, cur_r))
    return groups


class _LaneWorker:
    """A daemon thread that posts READ parts for one lane.

    It blocks on its queue while idle (no CPU), and is created on the first split READ.
    Jobs run in the order submitted; a job's outcome goes to its :class:`Future`.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._jobs.put((fut, fn))
        return fut

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # the poster re-raises it on its own thread
                fut.set_exception(e)

    def stop(self, timeout: float) -> None:
        """Let queued jobs finish, then end the thread (waits at most ``timeout``)."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class _Lane:
    """One NIXL agent, its re-entrant lock, and (lanes >= 1) its posting thread.

    Every call into ``agent`` holds ``lock``: NIXL's default sync mode (progress thread
    off) does no locking of its own, and the agent is used from several of Ray's threads.
    """

    __slots__ = ("_worker", "agent", "index", "lock", "name")

    def __init__(self, index: int, name: str, agent: Any) -> None:
        self.index = index
        self.name = name
        self.agent = agent
        self.lock = threading.RLock()
        self._worker: _LaneWorker | None = None

    def worker(self, guard: threading.Lock) -> _LaneWorker:
        """This lane's posting thread, started on first use (under ``guard``)."""
        w = self._worker
        if w is None:
            with guard:
                w = self._worker
                if w is None:
                    w = self._worker = _LaneWorker(f"ray_rdt_pool-lane{self.index}")
        return w

    def stop_worker(self, timeout: float) -> None:
        w, self._worker = self._worker, None
        if w is not None:
            w.stop(timeout)


class _Part:
    """One lane's share of a split READ. ``handle`` is None once released."""

    __slots__ = ("handle", "lane", "state")

    def __init__(self, lane: _Lane, handle: Any, state: str) -> None:
        self.lane = lane
        self.handle = handle
        self.state = state  # "PROC", "DONE", "ERR", or "CANCELLED" (released in flight)

    @property
    def running(self) -> bool:
        """True while NIXL may still write for this part."""
        return self.handle is not None and self.state == "PROC"


class SplitRead:
    """The composite handle of a READ posted as one part per lane.

    Its state is ``DONE`` once every part is, ``ERR`` once a part failed and none is
    still running (the others are cancelled where NIXL can), else ``PROC``: the
    receiver takes any state but ``PROC`` to mean that nothing writes any more. A part
    whose release failed stays here and pollable. Used from whichever thread holds the
    receiver's transfer lock; ``lock`` makes it safe from any thread regardless.
    """

    __slots__ = ("lock", "parts")

    def __init__(self, parts: list[_Part]) -> None:
        self.parts = parts
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return "SplitRead(" + ", ".join(
            f"lane{p.lane.index}:{p.state}{'' if p.handle is not None else '/released'}"
            for p in self.parts) + ")"


def _parts_of(e: ReadStillRunningError) -> list[_Part]:
    running = e.running
    return list(running.parts) if isinstance(running, SplitRead) else []


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
        self._lanes: list[_Lane] = [_Lane(0, name, agent)]
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
                    lanes.append(_Lane(k, lane_name, self._make(lane_name)))
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
        done: list[tuple[_Lane, Any]] = []
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
        return _LaneRegs(done)

    def deregister(self, handle: Any) -> None:
        """Undo :meth:`register` on every lane it registered with; raises the first
        failure after trying every lane. A lane whose agent :meth:`close` destroyed is
        skipped: destroying it dropped every registration it held."""
        pairs = handle.pairs if isinstance(handle, _LaneRegs) else [(self._lanes[0], handle)]
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

    def _post(self, lane: _Lane, local: Sequence[Desc], remote: Sequence[Desc],
              remote_name: str, local_mem: str, remote_mem: str) -> tuple[Any, str]:
        """Post one READ on ``lane``; returns (handle, "DONE" or "PROC").

        Runs on the caller's thread (lane 0) or on the lane's worker. With cma the copy
        itself happens inside ``transfer()``, under the lane's lock.
        """
        with lane.lock:
            agent = lane.agent
            ldl = _dlist(agent, local, local_mem)
            rdl = _dlist(agent, remote, remote_mem)
            handle = agent.initialize_xfer("READ", ldl, rdl, remote_name, b"")
            try:
                state = str(agent.transfer(handle))
            except BaseException as e:
                # A Ctrl-C raised as transfer() returns leaves the READ posted, and maybe
                # running: it is unwound like a failed post, then re-raised.
                failed: BaseException = e
            else:
                if state != "ERR":
                    return handle, state
                failed = TransferError(
                    f"NIXL refused to post a READ from {remote_name}"
                    + (f" on read lane {lane.index}" if lane.index else ""))
        # The post failed. Release the handle; should NIXL refuse (the READ may be
        # running after all), wait for it to end outside the lane's lock first, so that
        # nothing writes into the local memory once this raises.
        self._raise_unwound([_Part(lane, handle, "PROC")], [], remote_name, failed)

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
                    return self._start_split(lanes, groups, remote_name, local_mem,
                                             remote_mem)
        handle, _state = self._post(lanes[0], local, remote, remote_name, local_mem,
                                    remote_mem)
        return handle

    def _start_split(self, lanes: list[_Lane], groups: list[tuple[list[Desc], list[Desc]]],
                     remote_name: str, local_mem: str, remote_mem: str) -> SplitRead:
        futures: list[tuple[_Lane, Future[Any]]] = []
        for k in range(1, len(groups)):
            lane = lanes[k]
            gl, gr = groups[k]
            job = functools.partial(self._post, lane, gl, gr, remote_name, local_mem,
                                    remote_mem)
            futures.append((lane, lane.worker(self._worker_guard).submit(job)))
        parts: list[_Part] = []
        errors: list[BaseException] = []
        try:
            h, s = self._post(lanes[0], groups[0][0], groups[0][1], remote_name, local_mem,
                              remote_mem)
            parts.append(_Part(lanes[0], h, s))
        except BaseException as e:
            errors.append(e)
        # Every worker must be heard from, even after an error: until its transfer()
        # returns it may be copying into the local memory.
        for lane, fut in futures:
            while True:
                try:
                    h, s = fut.result()
                    parts.append(_Part(lane, h, s))
                    break
                except BaseException as e:
                    if fut.done():
                        errors.append(e)
                        break
                    # Interrupted while waiting (KeyboardInterrupt): keep waiting, and
                    # raise the interrupt rather than a lane's error.
                    errors.insert(0, e)
        error = errors[0] if errors else None
        if error is not None:
            running = [p for e in errors if isinstance(e, ReadStillRunningError)
                       for p in _parts_of(e)]
            self._raise_unwound(parts, running, remote_name, error)
        if self._on_split is not None:
            try:
                self._on_split()
            except Exception:
                logger.debug("on_split callback failed", exc_info=True)
        return SplitRead(parts)

    def _raise_unwound(self, parts: list[_Part], running: list[_Part], remote_name: str,
                       error: BaseException) -> NoReturn:
        """Unwind ``parts`` (see :meth:`_unwind`) and raise ``error``; or, if a part may
        still write (``running``: parts a lane's own unwind could not stop), raise
        :class:`ReadStillRunningError` holding them, so that the caller keeps the local
        memory reserved until they end."""
        running = running + self._unwind(parts, remote_name)
        if running:
            raise ReadStillRunningError(
                f"a READ from {remote_name} failed to post ({error}), and {len(running)} "
                "part(s) of it NIXL could neither cancel nor cut off may still write; the "
                "memory it reads into stays reserved until they end",
                SplitRead(running)) from error
        raise error

    def _unwind(self, parts: list[_Part], remote_name: str) -> list[_Part]:
        """Release the posted parts of a READ that failed to post as a whole; returns the
        parts that may still write.

        A part NIXL cannot cancel is polled until it ends; one still running after
        ``post_timeout_s`` is cut off by removing the remote agent from its lane (the
        receiver's peer then fails on that lane and is removed and reloaded later). A
        part whose cut-off and release both fail keeps its handle and is returned: only
        NIXL reporting its end makes its memory safe to reuse.
        Runs on the thread that posted: the caller of ``start_read``, or a lane's thread
        for its own failed post.
        """
        left: list[_Part] = []
        for p in parts:
            if self._try_release(p):
                continue
            deadline = time.monotonic() + self._post_timeout
            delay = 20e-6
            while p.state == "PROC" and time.monotonic() < deadline:
                self._poll_part(p)
                if p.state == "PROC":
                    time.sleep(delay)
                    delay = min(delay * 2, 1e-3)
            if p.state == "PROC":
                logger.warning("a part of a failed split READ from %s still ran after %ss; "
                               "cutting it off by removing the agent from %s", remote_name,
                               self._post_timeout, p.lane.name)
                try:
                    with p.lane.lock:
                        p.lane.agent.remove_remote_agent(remote_name)
                except Exception:
                    logger.warning("cutting off the READ part on %s failed", p.lane.name,
                                   exc_info=True)
                else:
                    p.state = "ERR"  # removing the agent ended it
            if self._try_release(p):
                continue
            if p.state == "PROC":
                left.append(p)  # neither cut off nor cancelled: it may still write
            else:
                # Ended (DONE/ERR/cut), so nothing writes; only the handle leaks.
                logger.warning("releasing an ended READ part on %s failed", p.lane.name)
        return left

    @staticmethod
    def _poll_part(p: _Part) -> None:
        """Refresh a running part's state; NIXL raising counts as ``ERR`` (ended)."""
        try:
            with p.lane.lock:
                p.state = str(p.lane.agent.check_xfer_state(p.handle))
        except Exception as e:
            logger.debug("READ part on %s ended in error: %s", p.lane.name, e)
            p.state = "ERR"

    @staticmethod
    def _try_release(p: _Part) -> bool:
        """Release one part (a cancel if it is running); False if NIXL refused."""
        if p.handle is None:
            return True
        try:
            with p.lane.lock:
                p.lane.agent.release_xfer_handle(p.handle)
        except Exception:
            logger.debug("releasing a READ part on %s failed", p.lane.name, exc_info=True)
            return False
        p.handle = None
        if p.state == "PROC":
            p.state = "CANCELLED"
        return True

    def state(self, xfer: Any) -> str:
        """``DONE``, ``PROC`` or ``ERR`` (NIXL's words); for a :class:`SplitRead` see there."""
        if isinstance(xfer, SplitRead):
            return self._split_state(xfer)
        lane0 = self._lanes[0]
        with lane0.lock:
            return str(lane0.agent.check_xfer_state(xfer))

    def _split_state(self, x: SplitRead) -> str:
        with x.lock:
            for p in x.parts:
                if p.running:
                    self._poll_part(p)
            if any(p.state == "ERR" for p in x.parts):
                # The READ failed: stop the rest now if NIXL can, rather than wait for it.
                for p in x.parts:
                    if p.running:
                        self._try_release(p)
            if any(p.running for p in x.parts):
                return "PROC"
            if all(p.state == "DONE" for p in x.parts):
                return "DONE"
            return "ERR"

    def release(self, xfer: Any) -> None:
        """Release a handle; a running READ is cancelled if NIXL can, else this raises and
        the handle stays valid. A :class:`SplitRead` releases every part it still holds
        and raises after trying all if any part refused; those parts stay pollable."""
        if not isinstance(xfer, SplitRead):
            lane0 = self._lanes[0]
            with lane0.lock:
                lane0.agent.release_xfer_handle(xfer)
            return
        with xfer.lock:
            first: BaseException | None = None
            for p in xfer.parts:
                if p.handle is None:
                    continue
                try:
                    with p.lane.lock:
                        p.lane.agent.release_xfer_handle(p.handle)
                except Exception as e:
                    first = first or e
                    continue
                p.handle = None
                if p.state == "PROC":
                    p.state = "CANCELLED"
            if first is not None:
                raise first

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


class _LaneRegs:
    """The registrations of one memory range on several lanes (see ``register``)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[_Lane, Any]]) -> None:
        self.pairs = pairs
