"""Buckets of failed streams that a receiver may still read: freed once its calls end.

Owns :data:`LATE`, the one per process, and :class:`InFlight`, the record of buckets
in flight that a stream hands over to it. Lifetime: the process; a stream's clean-up
adds what it could not free, and a daemon thread frees each bucket once every receiver
call for it has ended (or Ray was shut down), then ends when nothing is left.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, NamedTuple

import torch

from ray_rdt_pool.weights.pool import free_bucket
from ray_rdt_pool.weights.remote import calls_ended

logger = logging.getLogger(__name__)


class InFlight(NamedTuple):
    """Stream buckets in flight (one, or a run sent together)."""

    acks: list[Any]  #: one receiver call per receiver, in receiver order
    #: the source tensors of buckets read in place or by reference, kept (so unmoved)
    #: until every receiver has read them; None for a pool bucket
    kept: list[torch.Tensor] | None
    owned: list[str]  #: ids of the pool objects the stream owns, freed only then


class _LateBuckets:
    """Buckets of failed streams that a receiver's call may still read (it had not ended
    when the stream's clean-up gave up waiting): each is freed, and its kept source
    tensors dropped, only once every receiver call for it has ended: freed at once, a
    queued call would READ a block the pool may have handed to another object, and load
    those bytes. Holds at most ``max_inflight`` buckets per failed stream.

    Threads: the stream's thread adds; one daemon thread, started on demand and ended
    when nothing is left, polls twice a second and frees."""

    POLL_S = 0.5

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[InFlight] = []
        self._thread: threading.Thread | None = None

    def add(self, items: list[InFlight], session: str) -> None:
        logger.warning("stream %s failed while %d bucket(s) were still being read by a "
                       "receiver; they stay in the sender pool until those calls end",
                       session, len(items))
        with self._lock:
            self._items.extend(items)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="ray_rdt_pool-late-buckets")
                self._thread.start()

    def held(self) -> int:
        with self._lock:
            return len(self._items)

    def _run(self) -> None:
        import ray

        while True:
            time.sleep(self.POLL_S)
            with self._lock:
                items = list(self._items)
            # After ray.shutdown() no receiver call runs any more, and none ends either.
            down = not ray.is_initialized()
            for item in items:
                if not down and not calls_ended(item.acks):
                    continue
                with self._lock:  # by identity: == on tensors is elementwise
                    self._items = [i for i in self._items if i is not item]
                if item.kept is not None:
                    item.kept.clear()
                try:
                    free_bucket(item.owned)
                except Exception:
                    logger.warning("freeing a late stream bucket failed", exc_info=True)
            with self._lock:
                if not self._items:
                    self._thread = None
                    return


LATE = _LateBuckets()
