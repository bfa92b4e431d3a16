"""Read lanes: READs posted on one of several NIXL agents of this process, and undone.

With UCX over cma (two processes on one host) the copy of a READ runs inside
``transfer()`` on the calling thread, and two threads posting on *one* agent serialize;
several agents in one process (each its own UCX context and worker) copy concurrently.
So a :class:`~.backend.NixlBackend` may hold several lanes: lane 0 is the agent senders
publish and peers load; lanes 1.. are extra agents used only to initiate READs. A large
READ into memory registered with every lane (the receive arenas) is cut into one part
per lane (:func:`split_pairs`), posted concurrently (:func:`start_split`), and tracked by
one composite handle (:class:`SplitRead`). A READ that fails to post is unwound: every
part already posted is released, or waited for and cut off, before the error is raised.

Lifetimes: a :class:`Lane` lives as long as its backend (its agent goes with
``close()``); its posting thread starts on the first split READ. A :class:`SplitRead`
lives until the receiver released every part. Threads: any of the backend's callers;
parts for lanes 1.. are posted on the lanes' own threads; every call into an agent holds
its lane's lock.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, NoReturn

from ray_rdt_pool.errors import ReadStillRunningError, TransferError
from ray_rdt_pool.nixl.protocol import Desc

logger = logging.getLogger(__name__)

__all__ = ["SPLIT_ALIGN", "Lane", "LaneRegs", "SplitRead", "post", "release_split",
           "split_pairs", "split_state", "start_split"]

#: Cut points of a split READ fall on multiples of this many bytes of the READ's stream,
#: so two lanes rarely share a page (the arena blocks themselves are aligned).
SPLIT_ALIGN = 4096


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


class LaneWorker:
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


class Lane:
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
        self._worker: LaneWorker | None = None

    def worker(self, guard: threading.Lock) -> LaneWorker:
        """This lane's posting thread, started on first use (under ``guard``)."""
        w = self._worker
        if w is None:
            with guard:
                w = self._worker
                if w is None:
                    w = self._worker = LaneWorker(f"ray_rdt_pool-lane{self.index}")
        return w

    def stop_worker(self, timeout: float) -> None:
        w, self._worker = self._worker, None
        if w is not None:
            w.stop(timeout)


class Part:
    """One lane's share of a split READ. ``handle`` is None once released."""

    __slots__ = ("handle", "lane", "state")

    def __init__(self, lane: Lane, handle: Any, state: str) -> None:
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

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return "SplitRead(" + ", ".join(
            f"lane{p.lane.index}:{p.state}{'' if p.handle is not None else '/released'}"
            for p in self.parts) + ")"


class LaneRegs:
    """The registrations of one memory range on several lanes (see ``register``)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[Lane, Any]]) -> None:
        self.pairs = pairs


def _parts_of(e: ReadStillRunningError) -> list[Part]:
    running = e.running
    return list(running.parts) if isinstance(running, SplitRead) else []


# -- posting -------------------------------------------------------------------------------


def post(lane: Lane, local: Sequence[Desc], remote: Sequence[Desc], remote_name: str,
         local_mem: str, remote_mem: str, post_timeout: float) -> tuple[Any, str]:
    """Post one READ on ``lane``; returns (handle, "DONE" or "PROC").

    Runs on the caller's thread (lane 0) or on the lane's worker. With cma the copy
    itself happens inside ``transfer()``, under the lane's lock. A failed post is
    unwound (see :func:`_unwind`, with ``post_timeout``) before it raises.
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
    _raise_unwound([Part(lane, handle, "PROC")], [], remote_name, failed, post_timeout)


def start_split(lanes: list[Lane], groups: list[tuple[list[Desc], list[Desc]]],
                remote_name: str, local_mem: str, remote_mem: str, post_timeout: float,
                worker_guard: threading.Lock,
                on_split: Callable[[], None] | None) -> SplitRead:
    """Post group ``k`` of a split READ on ``lanes[k]``: group 0 on the calling thread,
    the others on the lanes' threads at the same time; returns once every part is
    posted, then calls ``on_split()``. If any part fails to post, the parts already
    posted are unwound before the error is raised."""
    futures: list[tuple[Lane, Future[Any]]] = []
    for k in range(1, len(groups)):
        lane = lanes[k]
        gl, gr = groups[k]
        job = functools.partial(post, lane, gl, gr, remote_name, local_mem, remote_mem,
                                post_timeout)
        futures.append((lane, lane.worker(worker_guard).submit(job)))
    parts: list[Part] = []
    errors: list[BaseException] = []
    try:
        h, s = post(lanes[0], groups[0][0], groups[0][1], remote_name, local_mem,
                    remote_mem, post_timeout)
        parts.append(Part(lanes[0], h, s))
    except BaseException as e:
        errors.append(e)
    # Every worker must be heard from, even after an error: until its transfer()
    # returns it may be copying into the local memory.
    for lane, fut in futures:
        while True:
            try:
                h, s = fut.result()
                parts.append(Part(lane, h, s))
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
        _raise_unwound(parts, running, remote_name, error, post_timeout)
    if on_split is not None:
        try:
            on_split()
        except Exception:
            logger.debug("on_split callback failed", exc_info=True)
    return SplitRead(parts)


# -- unwinding a failed post ---------------------------------------------------------------


def _raise_unwound(parts: list[Part], running: list[Part], remote_name: str,
                   error: BaseException, post_timeout: float) -> NoReturn:
    """Unwind ``parts`` (see :func:`_unwind`) and raise ``error``; or, if a part may
    still write (``running``: parts a lane's own unwind could not stop), raise
    :class:`ReadStillRunningError` holding them, so that the caller keeps the local
    memory reserved until they end."""
    running = running + _unwind(parts, remote_name, post_timeout)
    if running:
        raise ReadStillRunningError(
            f"a READ from {remote_name} failed to post ({error}), and {len(running)} "
            "part(s) of it NIXL could neither cancel nor cut off may still write; the "
            "memory it reads into stays reserved until they end",
            SplitRead(running)) from error
    raise error


def _unwind(parts: list[Part], remote_name: str, post_timeout: float) -> list[Part]:
    """Release the posted parts of a READ that failed to post as a whole; returns the
    parts that may still write.

    A part NIXL cannot cancel is polled until it ends; one still running after
    ``post_timeout`` seconds is cut off by removing the remote agent from its lane (the
    receiver's peer then fails on that lane and is removed and reloaded later). A part
    whose cut-off and release both fail keeps its handle and is returned: only NIXL
    reporting its end makes its memory safe to reuse.
    Runs on the thread that posted: the caller of ``start_read``, or a lane's thread
    for its own failed post.
    """
    left: list[Part] = []
    for p in parts:
        if _try_release(p):
            continue
        deadline = time.monotonic() + post_timeout
        delay = 20e-6
        while p.state == "PROC" and time.monotonic() < deadline:
            _poll_part(p)
            if p.state == "PROC":
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
        if p.state == "PROC":
            logger.warning("a part of a failed split READ from %s still ran after %ss; "
                           "cutting it off by removing the agent from %s", remote_name,
                           post_timeout, p.lane.name)
            try:
                with p.lane.lock:
                    p.lane.agent.remove_remote_agent(remote_name)
            except Exception:
                logger.warning("cutting off the READ part on %s failed", p.lane.name,
                               exc_info=True)
            else:
                p.state = "ERR"  # removing the agent ended it
        if _try_release(p):
            continue
        if p.state == "PROC":
            left.append(p)  # neither cut off nor cancelled: it may still write
        else:
            # Ended (DONE/ERR/cut), so nothing writes; only the handle leaks.
            logger.warning("releasing an ended READ part on %s failed", p.lane.name)
    return left


def _poll_part(p: Part) -> None:
    """Refresh a running part's state; NIXL raising counts as ``ERR`` (ended)."""
    try:
        with p.lane.lock:
            p.state = str(p.lane.agent.check_xfer_state(p.handle))
    except Exception as e:
        logger.debug("READ part on %s ended in error: %s", p.lane.name, e)
        p.state = "ERR"


def _try_release(p: Part) -> bool:
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


# -- a posted split READ -------------------------------------------------------------------


def split_state(x: SplitRead) -> str:
    """The state of a split READ (see :class:`SplitRead`)."""
    with x.lock:
        for p in x.parts:
            if p.running:
                _poll_part(p)
        if any(p.state == "ERR" for p in x.parts):
            # The READ failed: stop the rest now if NIXL can, rather than wait for it.
            for p in x.parts:
                if p.running:
                    _try_release(p)
        if any(p.running for p in x.parts):
            return "PROC"
        if all(p.state == "DONE" for p in x.parts):
            return "DONE"
        return "ERR"


def release_split(x: SplitRead) -> None:
    """Release every part ``x`` still holds; raises after trying all if any part
    refused (those parts stay pollable)."""
    with x.lock:
        first: BaseException | None = None
        for p in x.parts:
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
