"""Giving back what died: releases queued from any thread, applied under the receiver lock.

Owns: the drain of the receiver's release queues (dead arena views, dead same-node
mappings), in the order of :attr:`Drain.parts`, and the self-drain mode used where no
progress thread drains (after ``shutdown()``, in a forked child). Lifetime: the
receiver's. Threads: any; deleters may queue a release inside GC, while their thread
holds any lock, even the receiver lock in the middle of a change a drain would touch.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

logger = logging.getLogger(__name__)

__all__ = ["Drain", "Drained"]


class Drained(Protocol):
    """A part of the receiver with a release queue."""

    def drain_locked(self) -> None:
        """Apply the queued releases (caller holds the receiver lock)."""

    def queued(self) -> bool:
        """Whether releases wait in the queue."""


class Drain:
    """Runs the parts' drains under the receiver lock, never one inside another."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.parts: tuple[Drained, ...] = ()  # drained in this order; set once by the receiver
        # No progress thread drains for us any more (after shutdown(), in a forked child):
        # a deleter drains itself.
        self.self_drain = False
        # A drain is running (a deleter run by GC inside it must not start another), or a
        # fork is being prepared (no drain until the fork is done).
        self.running = False
        self._later_lock = threading.Lock()  # guards _later_pending (see later)
        self._later_pending = False

    def run_locked(self) -> None:
        """Drain every part (caller holds the receiver lock)."""
        if self.running:
            return  # a deleter run by GC inside a drain: the loop below picks it up
        while True:
            self.running = True
            try:
                for part in self.parts:
                    part.drain_locked()
            finally:
                self.running = False
            # A deleter that ran (GC) after a part's loop but before running was cleared
            # saw a drain in progress and left its release queued: take it too.
            if not any(part.queued() for part in self.parts):
                return

    def from_deleter(self, queued: Drained) -> None:
        """A deleter queued a release on ``queued`` (any thread, maybe inside GC): drain
        now when no progress thread will."""
        while self.self_drain and queued.queued() and not self.running:
            # Never wait: this may run inside GC in a thread holding any lock. Another
            # thread holds ours and need not drain before it lets go, so a helper thread
            # waits for the lock and drains (the lease would be stranded otherwise).
            # The lock is re-entrant: this thread may hold it already, in the middle of
            # changing what a drain changes (an allocation carving a block), so a drain
            # here would run inside that change. The helper drains once it is let go.
            if self.lock._is_owned() or not self.lock.acquire(blocking=False):  # type: ignore[attr-defined]
                self.later()
                return
            try:
                self.run_locked()
            finally:
                self.lock.release()

    def later(self) -> None:
        """Start one thread that waits for the lock and drains (self-drain mode only)."""
        with self._later_lock:
            if self._later_pending:
                return
            self._later_pending = True

        def drain() -> None:
            try:
                with self.lock:
                    with self._later_lock:
                        self._later_pending = False
                    self.run_locked()
            except Exception:
                logger.warning("returning leases of dead views failed", exc_info=True)

        try:
            threading.Thread(target=drain, name="rdt-pool-drain", daemon=True).start()
        except RuntimeError:  # interpreter shutting down: the process exits anyway
            with self._later_lock:
                self._later_pending = False

    def after_fork_child(self) -> None:
        """In a forked child: no progress thread here, and the helper's lock may have
        been held by another thread at the fork."""
        self.self_drain = True
        self._later_lock = threading.Lock()
        self._later_pending = False
