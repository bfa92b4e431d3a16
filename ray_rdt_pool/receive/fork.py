"""``os.fork()`` with same-node mappings alive: what the parent and the child do.

Owns: the process's at-fork hooks (registered with the first same-node handle, never at
import), the receivers they prepare (their :class:`~ray_rdt_pool.receive.mapped.Mapped`
parts), and per receiver the forks whose child may not have copied its inherited
mappings yet, with the extra lease the parent holds on each mapping's slot for it.
Lifetime: those extra leases go once the child has copied (it closes its end of a pipe)
or exited; the child forgets every handle (their lease rows are the parent's). Threads:
the forking thread, holding every watched receiver's lock across the fork;
:meth:`Forks.settle_locked` under the receiver lock (a drain).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ray_rdt_pool.same_node.pool_handle import MappedPool
from ray_rdt_pool.same_node.privatize import ChildLeases, privatize

if TYPE_CHECKING:
    from ray_rdt_pool.receive.mapped import Mapped

logger = logging.getLogger(__name__)

__all__ = ["Forks", "after_child", "after_parent", "before", "watch"]

#: (pool, slot) of each lease the parent holds for a child.
Extra = list[tuple[MappedPool, int]]


@dataclass(eq=False)
class Forks:
    """One receiver's forks in progress or done (fields change under its lock)."""

    # The read end of a pipe the child closes once it has copied its mappings, and the
    # extra leases this process took for it (see before).
    pending: list[tuple[int, Extra]] = field(default_factory=list)
    # (pipe read end, write end, extra leases, parent pid) between the fork hooks
    prep: tuple[int, int, Extra, int] | None = None
    locked: bool = False  # before() took the lock: the after-hooks release it
    was_draining: bool = False
    # In a forked child whose copy of an inherited mapping failed: its own leases on
    # their blocks, kept until it exits (its row is swept then).
    uncopied_leases: ChildLeases | None = None

    def settle_locked(self) -> None:
        """Drop the extra leases of forks whose child has copied its mappings (closed
        its end of the pipe) or exited (caller holds the receiver lock)."""
        pending = []
        for r, extra in self.pending:
            try:
                if os.read(r, 1):
                    pending.append((r, extra))  # nothing is ever written: keep waiting
                    continue
            except BlockingIOError:
                pending.append((r, extra))
                continue
            except OSError:
                pass
            os.close(r)
            for host, slot in extra:
                host.release_one(slot)
        self.pending = pending


def before(m: Mapped) -> None:
    """In the parent, before ``fork()``: hold the lock across it (the child inherits a
    consistent state and a lock nobody else holds), and take one more lease on every
    live mapping's slot. The child copies its inherited mappings into memory of its own
    first thing; until it has (it closes the pipe made here, or exits), this process
    keeps those leases, so the sender cannot reuse a block the child is still reading,
    whatever this process's views do meanwhile."""
    m.lock.acquire()
    forks = m.forks
    forks.locked = True
    forks.was_draining = m.drain.running
    m.drain.running = True  # no drain (a deleter's) between here and the fork
    live = list(m.live.values())
    if not live:
        return
    try:
        r, w = os.pipe()
    except OSError as e:
        # Nothing to wait on: the child copies at once, unguarded. It still never
        # touches our row.
        logger.warning("no pipe for a fork (%s): the child's copies of %d same-node "
                       "mapping(s) are not guarded by a lease", e, len(live))
        return
    extra = [(host, slot) for host, slot, _n in live if host.counts is not None]
    for host, slot in extra:
        host.lease(slot)
    forks.prep = (r, w, extra, os.getpid())


def after_parent(m: Mapped) -> None:
    forks = m.forks
    prep, forks.prep = forks.prep, None
    if prep is not None:
        r, w, extra, _parent = prep
        os.close(w)  # the child's copy of it is the one whose close we wait for
        os.set_blocking(r, False)
        forks.pending.append((r, extra))
    _release(m)


def after_child(m: Mapped) -> None:
    """In the child: copy every inherited object mapping into anonymous memory at the
    same address, and forget every handle (their rows are the parent's: nothing here
    may take or return a lease through them). Then tell the parent."""
    forks = m.forks
    prep, forks.prep = forks.prep, None
    own = None
    if prep is not None and m.live:
        own = ChildLeases([(host, slot) for host, slot, _n in m.live.values()], prep[3])
        if not own.parent_ran:
            logger.error("the parent of this forked child exited before the child "
                         "held its inherited same-node mappings; the bytes of %d "
                         "inherited view(s) may be those of a later object", len(m.live))
    copied = True
    kept: dict[int, list[tuple[int, int]]] = {}  # handle -> its ranges views use
    for addr, (host, _slot, length) in m.live.items():
        kept.setdefault(id(host), []).append((addr, length))
        if not privatize(addr, length):
            copied = False
            logger.error("a forked child could not copy a same-node mapping of %d "
                         "bytes; it and its parent hold its block until this process exits",
                         length)
    if own is not None:
        if copied:
            own.end()
        else:  # the mappings still show the pool: hold their blocks until we exit
            forks.uncopied_leases = own
    handles = {id(h): h for h in m.hosts.values() if h is not None}
    handles.update((id(h), h) for h, _s, _n in m.live.values())
    handles.update((id(u[0]), u[0]) for u in m.unmaps)
    for h in handles.values():
        h.forget(kept.get(id(h), ()))
    m.hosts.clear()
    m.host_retry.clear()
    m.live.clear()
    for r, _extra in forks.pending:  # the parent's to settle
        os.close(r)
    forks.pending.clear()
    m.drain.after_fork_child()  # no progress thread here
    if prep is not None:
        r, w, _extra, _parent = prep
        os.close(r)
        if copied:
            os.close(w)
        # else: w stays open, so the parent holds the leases until this process exits
    _release(m)


def _release(m: Mapped) -> None:
    forks = m.forks
    if forks.locked:
        forks.locked = False
        m.drain.running = forks.was_draining
        if m.drain.self_drain and not m.drain.running:
            # Deleters that ran during the fork found drains held off; with no
            # progress thread, nobody else would return their leases.
            m.drain.run_locked()
        m.lock.release()


#: Receivers that have opened a same-node sender's pool: each takes part in every fork.
_watched: weakref.WeakSet[Mapped] = weakref.WeakSet()
_hooks_registered = False


def watch(m: Mapped) -> None:
    """From its first same-node handle on, a receiver is prepared for ``os.fork()``
    (the hooks are registered once per process, then; never at import)."""
    global _hooks_registered
    _watched.add(m)
    if not _hooks_registered:
        _hooks_registered = True
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                            after_in_child=_after_fork_child)


#: Held from the first before-hook to the last after-hook: two threads forking at once
#: take the receivers' locks one fork after the other, never crosswise.
_fork_lock = threading.Lock()
_forking: list[Mapped] = []  # the receivers prepared for the fork under way


def _before_fork() -> None:
    _fork_lock.acquire()
    _forking[:] = sorted(_watched, key=id)
    for m in _forking:
        try:
            before(m)
        except Exception:  # never keep the others from their step
            logger.exception("preparing a same-node receiver for fork() failed")


def _after_fork(step: Callable[[Mapped], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            for m in _forking:
                try:
                    step(m)
                except Exception:
                    logger.exception("a same-node receiver's step after fork() failed")
        finally:
            _forking.clear()
            _fork_lock.release()
    return run


_after_fork_parent = _after_fork(after_parent)
_after_fork_child = _after_fork(after_child)
