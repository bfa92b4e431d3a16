"""The threaded copy of large packs: units of work, and the helper threads that share them.

Owns :class:`PackJob` (one copy cut into units; lives for one call of :func:`run_job`)
and the process's pool of daemon helper threads: none at import, started by the first
threaded copy that needs them, idle (blocked on a queue) in between, stopped by
:func:`stop_pack_helpers` (the transport's shutdown), started anew by a later copy or in
a forked child. Threads: the thread that calls :func:`run_job` or :func:`copy_moves` (Ray's
task thread, or the driver's) cuts the copy into units, queues one share per helper,
copies units itself and waits for the helpers; helper threads only ever run
:meth:`PackJob.help`.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PACK_CHUNK", "Move", "PackJob", "array_units", "copy_moves", "pack_units",
           "run_job", "run_moves", "stop_pack_helpers"]

_memmove = ctypes.memmove

#: Bytes per unit of work of a threaded pack. Big spans are cut into units of this size
#: and small spans grouped up to it. Threads take units one at a time, so one slowed by
#: another process on the same core simply takes fewer, and a unit costs one lock round
#: trip, not one per tensor.
PACK_CHUNK = 4 << 20
#: Most helper threads the pool starts (``pack_threads`` is at most 64, caller included).
_PACK_MAX_HELPERS = 63

#: One memmove: (destination address, source address, bytes).
Move = tuple[int, int, int]


class PackJob:
    """The units of one threaded pack, shared by the calling thread and its helpers.

    The calling thread, and each helper that reaches the job before it is closed, take
    units one at a time until none is left or a failure stopped the job. The caller then
    closes the job and waits only for the helpers inside it: a helper still busy with
    another job finds this one closed later and drops it, so it never delays the caller.
    """

    __slots__ = ("_active", "_batch", "_closed", "_copy", "_idle", "_lock", "_next", "error",
                 "stopped", "units")

    def __init__(self, units: Sequence[Sequence[Move]],
                 copy: Callable[[int, int, int], Any] = _memmove,
                 batch: Callable[[Sequence[Move]], Any] | None = None) -> None:
        self.units = units
        self._copy = copy  # memmove, or a read from another process (releases the GIL)
        self._batch = batch  # or one call per unit (vectored reads of another process)
        self._next = 0  # index of the next unit to take
        self._lock = threading.Lock()
        self._active = 0  # helpers inside work()
        self._closed = False
        self._idle = threading.Event()  # set once closed with no helper inside
        self.stopped = False  # a failure in any thread: take no more units
        self.error: BaseException | None = None  # a helper's first failure

    def work(self) -> None:
        """Copy units until none is left or the job stopped (caller and helpers)."""
        units = self.units
        lock = self._lock
        copy = self._copy
        batch = self._batch
        while True:
            with lock:
                i = self._next
                if self.stopped or i >= len(units):
                    return
                self._next = i + 1
            if batch is not None:
                batch(units[i])
                continue
            for dst, src, n in units[i]:
                copy(dst, src, n)  # releases the GIL: the threads copy in parallel

    def help(self) -> None:
        """One helper's share (helper thread): never raises, failures go to ``error``."""
        with self._lock:
            if self._closed:
                return
            self._active += 1
        try:
            self.work()
        except BaseException as exc:  # re-raised by the caller in its own thread
            self.stop(exc)
        finally:
            with self._lock:
                self._active -= 1
                if self._closed and not self._active:
                    self._idle.set()

    def stop(self, exc: BaseException | None = None) -> None:
        """Let nobody take another unit; remember the first helper failure (any thread)."""
        with self._lock:
            self.stopped = True
            if exc is not None and self.error is None:
                self.error = exc

    def close(self) -> None:
        """Let no more helpers in and wait for those inside (calling thread).

        After this returns no helper writes into the destination any more, so the caller
        may free it (the sender does when the pack failed).
        """
        with self._lock:
            self._closed = True
            if not self._active:
                return
        self._idle.wait()


class _PackPool:
    """The daemon helper threads of threaded packs: started on demand, stopped by
    :func:`stop_pack_helpers` (the transport's ``shutdown``).

    An idle helper blocks in ``SimpleQueue.get`` (no CPU, no polling); each queued item is
    one helper's share of one job.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child inherits this object but not its threads
        self.jobs: queue.SimpleQueue[PackJob | None] = queue.SimpleQueue()
        self.helpers = 0  # threads started and not yet told to stop: len(self.threads)
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # guards helpers and threads

    def submit(self, job: PackJob, helpers: int) -> None:
        """Queue ``helpers`` shares of ``job``, starting threads up to that many (caller).

        If the system refuses a new thread the job runs with fewer helpers: the caller
        copies every unit nobody else takes.
        """
        with self._lock:
            while self.helpers < helpers:
                t = threading.Thread(target=self._serve, daemon=True,
                                     name=f"ray_rdt_pool-pack-{self.helpers}")
                try:
                    t.start()
                except RuntimeError:
                    break
                self.helpers += 1
                self.threads.append(t)
            helpers = min(helpers, self.helpers)
        for _ in range(helpers):
            self.jobs.put(job)

    def _serve(self) -> None:
        """A helper thread's whole life: one share of one job at a time, until None."""
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job.help()

    def stop(self, timeout: float) -> None:
        """End every helper once the shares queued before this are done."""
        with self._lock:
            threads, self.threads = self.threads, []
            self.helpers = 0
        for _ in threads:
            self.jobs.put(None)
        for t in threads:
            t.join(timeout)


# This process's pool: None until the first threaded copy, and again after
# stop_pack_helpers(); replaced under the lock, read without it.
_pack_pool: _PackPool | None = None
_pack_pool_lock = threading.Lock()


def _get_pack_pool() -> _PackPool:
    """This process's helper pool, created on first use (and anew in a forked child)."""
    global _pack_pool
    pool = _pack_pool
    if pool is None or pool.pid != os.getpid():
        with _pack_pool_lock:
            pool = _pack_pool
            if pool is None or pool.pid != os.getpid():
                pool = _pack_pool = _PackPool()
    return pool


def stop_pack_helpers(timeout: float = 5.0) -> None:
    """Stop this process's pack helper threads (none is left running); a later threaded
    pack starts new ones. Called by the transport's ``shutdown``."""
    global _pack_pool
    with _pack_pool_lock:
        pool, _pack_pool = _pack_pool, None
    if pool is not None and pool.pid == os.getpid():
        pool.stop(timeout)


def pack_units(moves: Sequence[Move], chunk: int) -> list[list[Move]]:
    """Cut and group ``moves`` into units of at most ``chunk`` bytes (calling thread).

    A move is cut only where its destination crosses a 64-byte boundary, so the threads
    do not write halves of one cache line.
    """
    chunk = max(chunk, 128)  # room for at least one cache-line boundary: always progress
    units: list[list[Move]] = []
    unit: list[Move] = []
    room = chunk
    for dst, src, n in moves:
        while n > room:
            take = ((dst + room) & ~63) - dst
            if take > 0:
                unit.append((dst, src, take))
                dst, src, n = dst + take, src + take, n - take
            if unit:
                units.append(unit)
            unit, room = [], chunk
        if n:
            unit.append((dst, src, n))
            room -= n
            if not room:
                units.append(unit)
                unit, room = [], chunk
    if unit:
        units.append(unit)
    return units


def array_units(moves: Any, chunk: int) -> list[Any]:
    """:func:`pack_units` for an ``(n, 3)`` int64 array of moves (a threaded pack of
    many tensors), without a Python step per move: a move above ``chunk`` bytes is cut
    on 64-byte destination boundaries into pieces of at most ``chunk``, then moves are
    grouped by the ``chunk``-sized stretch of the stream their last byte falls in, so a
    unit holds at most twice ``chunk`` bytes. Returns row slices in order
    (tests/unit/memory/test_pack.py holds both rules)."""
    import numpy as np

    chunk = max(chunk, 128)  # a cut always moves forward: (at + chunk) & ~63 > at
    big = np.flatnonzero(moves[:, 2] > chunk).tolist()
    if big:
        parts = []
        prev = 0
        for i in big:
            parts.append(moves[prev:i])
            dst, src, n = moves[i].tolist()
            cuts = [dst]
            while (nxt := (cuts[-1] + chunk) & ~63) < dst + n:
                cuts.append(nxt)
            starts = np.array(cuts, dtype=np.int64)
            piece = np.empty((len(cuts), 3), dtype=np.int64)
            piece[:, 0] = starts
            piece[:, 1] = starts + (src - dst)
            piece[:, 2] = np.diff(starts, append=dst + n)
            parts.append(piece)
            prev = i + 1
        parts.append(moves[prev:])
        moves = np.concatenate(parts)
    if not len(moves):
        return []
    stretch = (np.cumsum(moves[:, 2]) - 1) // chunk
    return np.split(moves, (np.flatnonzero(stretch[1:] != stretch[:-1]) + 1).tolist())


def copy_moves(moves: Sequence[Move], threads: int,
               copy: Callable[[int, int, int], Any] = _memmove,
               batch: Callable[[Sequence[Move]], Any] | None = None) -> None:
    """Run ``copy(dst, src, n)`` over ``moves`` on up to ``threads`` threads (the calling
    thread and pack helpers), cut into units of a few MiB; returns once every unit is
    done and no helper is inside any more, and re-raises the first failure of any
    thread. ``batch``, if given, copies a whole unit (a list of moves) in one call
    instead. Either must release the GIL for the threads to overlap (``memmove`` and
    ``process_vm_readv`` through ctypes do)."""
    if threads <= 1 or len(moves) == 0:
        if batch is not None:
            batch(moves)
            return
        for dst, src, n in moves:
            copy(dst, src, n)
        return
    run_moves(moves, threads, copy, None, batch)


def run_moves(moves: Sequence[Move], threads: int, copy: Callable[[int, int, int], Any],
              first: Callable[[], None] | None,
              batch: Callable[[Sequence[Move]], Any] | None = None) -> None:
    """The threaded copy of :func:`copy_moves`; ``first`` runs on the calling thread
    while the helpers start (the pack's torch materialisations)."""
    run_job(PackJob(pack_units(moves, PACK_CHUNK), copy, batch), threads, first)


def run_job(job: PackJob, threads: int, first: Callable[[], None] | None = None) -> None:
    """Run ``job`` on the calling thread and up to ``threads - 1`` helpers; returns once
    no helper is inside it, re-raising the first failure of any thread."""
    helpers = min(threads - 1, len(job.units) - 1, _PACK_MAX_HELPERS)
    if helpers > 0:
        _get_pack_pool().submit(job, helpers)
    try:
        if first is not None:
            first()
        job.work()
    except BaseException:
        job.stop()  # helpers finish the unit in hand and take no other
        raise
    finally:
        job.close()
    if job.error is not None:
        raise job.error
