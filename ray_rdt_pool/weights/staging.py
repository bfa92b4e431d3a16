"""A receiver that serves while it syncs: the staging copy a sync lands in
(``staging="shadow"``) and the serving lock the engine's forward passes read under.

Owns :class:`ServingLock` (many readers, one writer that waits for the readers in
progress and holds new ones off while it writes) and :class:`Shadow`: one more copy of
the receiver's destination tensors (tied names share one copy), made on first use, and,
for a ``load_weights`` engine, the copies of what each bucket brought, handed to the
loader at the commit. Syncs write into the shadow; the commit copies it into the live
tensors under the serving lock, so a forward pass sees one version or the next, never
a mix. A sync that fails leaves the live tensors untouched; the next version's first
write refreshes the shadow from them.

Lifetime: as long as its receiver. Threads: the receiver's writer (under its write
lock) fills and commits; any thread reads under :meth:`ServingLock.read`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ray_rdt_pool.errors import WeightSyncTimeoutError
from ray_rdt_pool.weights.state import StateLike, identity_key, named_tensors

#: The stagings a receiver may use.
STAGINGS = ("inplace", "shadow")


def _count_staging(nbytes: int) -> None:
    """The process's staging bytes (``stats().weight_staging_bytes``) change by ``nbytes``."""
    from ray_rdt_pool._ray.runtime import current

    rt = current()
    if rt is not None:
        rt.events.add("staging_bytes", nbytes)


class ServingLock:
    """Readers (forward passes) share it; a writer (a commit, or an in-place bucket)
    waits for the readers in progress, and new readers wait while a writer waits or
    writes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writers = 0  # waiting or writing

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._writers == 0)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def write(self, wait_s: float | None = None) -> Iterator[None]:
        """Write alone; ``wait_s``: the longest wait for the sections in progress, after
        which :class:`WeightSyncTimeoutError` (nothing written)."""
        with self._cond:
            self._writers += 1
            if not self._cond.wait_for(lambda: self._readers == 0, wait_s):
                self._writers -= 1
                self._cond.notify_all()
                raise WeightSyncTimeoutError(
                    f"serving() sections in progress held the commit off for {wait_s:.1f}s "
                    f"(the sync's timeout_s); it was not committed: end each section "
                    "within a forward pass, or raise timeout_s")
        try:
            yield
        finally:
            with self._cond:
                self._writers -= 1
                self._cond.notify_all()


class Shadow:
    """The staging copy of one receiver (see the module)."""

    def __init__(self, dest: StateLike | None, loader: bool) -> None:
        self._dest = dest
        self._loader = loader
        self._copies: dict[str, torch.Tensor] | None = None
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (shadow, live)
        self.staged: list[tuple[str, torch.Tensor]] = []  # a loader's, until the commit
        self.clean = False  # the copies equal the live tensors (after a commit)
        self.last_pause_s = 0.0  # how long the last commit held the serving lock

    @property
    def nbytes(self) -> int:
        """Bytes of memory the staging holds now (copies, and a loader's tensors)."""
        held = sum(s.untyped_storage().nbytes() for s, _live in self._pairs)
        return held + sum(t.untyped_storage().nbytes() for _n, t in self.staged)

    def dest(self) -> dict[str, torch.Tensor] | None:
        """The destination a sync plans against: the copies, by the live names."""
        if self._dest is None:
            return None
        if self._copies is None:
            copies: dict[str, torch.Tensor] = {}
            made: dict[Any, torch.Tensor] = {}
            for name, t in named_tensors(self._dest, "destination tensor"):
                key = identity_key(t)
                c = made.get(key)
                if c is None:
                    with torch.no_grad():
                        c = made[key] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                    self._pairs.append((c, t))
                copies[name] = c
            self._copies = copies
            held = sum(c.untyped_storage().nbytes() for c, _live in self._pairs)
            _count_staging(held)
            weakref.finalize(self, _count_staging, -held)
        return self._copies

    def stage(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The loader a sync calls: keep copies until the commit hands them over."""
        for name, t in pairs:
            self.staged.append((name, t.detach().clone()))

    def begin(self) -> None:
        """Before a version's first write (under the receiver's write lock): the copies
        start from the live tensors (after a failed version they do not), and no
        staged tensor of an earlier version is handed over."""
        self.dest()
        if not self.clean:
            with torch.no_grad():
                for c, live in self._pairs:
                    c.copy_(live)
        self.clean = False
        self.staged.clear()

    def commit(self, lock: ServingLock, load_weights: Callable[[Any], Any] | None,
               on_commit: Callable[[], None], wait_s: float | None = None) -> None:
        """Make the staged version the live one, under the serving lock (waiting at most
        ``wait_s`` for the sections in progress): hand a loader what it staged, copy
        every tensor over, then ``on_commit()``. A loader that raises is a
        :class:`LoaderError`, with the live tensors untouched and nothing committed."""
        from ray_rdt_pool.weights.loading import copy_all

        with lock.write(wait_s):
            t0 = time.perf_counter()
            try:
                # The loader first: if it refuses the version, the live tensors still
                # hold the old one, as the version number says.
                if load_weights is not None and self.staged:
                    _hand_over(load_weights, self.staged)
                copy_all((live, c) for c, live in self._pairs)
                self.clean = True
            finally:
                self.staged.clear()
            try:
                on_commit()
            finally:
                self.last_pause_s = time.perf_counter() - t0


def _hand_over(load_weights: Callable[[Any], Any], staged: list[tuple[str, torch.Tensor]]
               ) -> None:
    """A commit hands a ``load_weights`` engine every staged tensor in one call."""
    try:
        with torch.no_grad():
            load_weights(list(staged))
    except Exception as e:
        from ray_rdt_pool.weights.loading import loader_error

        raise loader_error(e, [n for n, _t in staged], "at the commit",
                           "nothing was committed: the live tensors and the version are "
                           "unchanged (what the loader applied before it raised is its "
                           "own)") from e
