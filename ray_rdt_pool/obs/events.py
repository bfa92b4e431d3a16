"""Counters, the observer interface, and the one place failures are mapped and counted.

Pure (stdlib only). The registry, the sender and the receiver share one
:class:`Events` per process: they add to its counters, report to its observer (the
metrics exporter, or nothing), and run every step that can fail inside
:meth:`Events.failures`, which turns a foreign exception into a typed one, counts it
once and reports it once. ``stats()`` reads the counters from here.

Threads: any; the counters take their own small lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from ray_rdt_pool.errors import ConfigurationError, InvalidInputError, RdtPoolError, TransferError

__all__ = ["COUNTER_NAMES", "Events", "Observer"]

logger = logging.getLogger(__name__)

#: Every counter; all start at 0 and only grow, except ``in_flight`` and
#: ``staging_bytes``.
COUNTER_NAMES = (
    "registrations", "deregistrations", "registration_evictions", "objects_put",
    "objects_freed", "bytes_packed", "zero_copy_tensors", "fallbacks", "objects_received",
    "bytes_received", "receive_fallbacks", "transfer_errors", "metadata_loads", "in_flight",
    "peers_removed", "transfers_cut", "late_completions", "mapped_gets", "reads_posted",
    "split_reads", "source_reads", "weight_sync_ray_calls", "signals_sent", "staging_bytes",
)


class Observer(Protocol):
    """What the transport tells the metrics exporter (see :mod:`ray_rdt_pool.obs.metrics`).

    ``source`` is the object whose ``stats()`` and ``config`` the observer may read.
    """

    def on_put(self, source: Any, nbytes: int, seconds: float, pack_seconds: float | None,
               fallback: bool) -> None: ...
    def on_free(self, source: Any) -> None: ...
    def on_fetch(self, source: Any, nbytes: int, seconds: float) -> None: ...
    def on_error(self, source: Any, kind: str) -> None: ...
    def on_change(self, source: Any) -> None: ...


class Events:
    """Counters plus the observer hook of one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.c: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self.observer: Observer | None = None  # set once by the runtime after creation
        self.source: Any = None  # what the observer's stats() calls read

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.c[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.c)

    def notify(self, event: str, *args: Any) -> None:
        """Call the observer's ``on_<event>(source, *args)``, if there is an observer.
        Never raises: the put, free or fetch it reports has happened, and an exporter's
        failure (its thread not starting, Ray going down) must not turn it into an error
        (a put Ray then never frees, or a free left half done)."""
        obs = self.observer
        if obs is None:
            return
        try:
            getattr(obs, "on_" + event)(self.source, *args)
        except Exception:
            logger.warning("the nixl_pool metrics observer failed on %s", event,
                           exc_info=True)

    def error(self, kind: str) -> None:
        """One failed transfer: counted and reported (``kind``: err, timeout, aborted)."""
        self.add("transfer_errors")
        self.notify("error", kind)

    @contextmanager
    def failures(self, what: str, hint: str) -> Iterator[None]:
        """Run a step of a transfer: every failure leaves as a typed, counted error.

        * ``InvalidInputError`` and ``ConfigurationError`` pass through uncounted: the
          caller's input or the process's configuration was wrong, not a transfer.
        * Other ``RdtPoolError`` pass through and are counted once, here, unless the
          raise site counted it already (``counted`` attribute set).
        * ``TimeoutError`` passes through (Ray expects it) and is counted.
        * Anything else becomes a ``TransferError`` naming ``what`` and ``hint``,
          chained with ``from``.
        """
        try:
            yield
        except (InvalidInputError, ConfigurationError):
            raise
        except (RdtPoolError, TimeoutError) as e:
            if not getattr(e, "counted", False):
                self.error("timeout" if isinstance(e, TimeoutError) else "err")
                _mark(e)
            raise
        except Exception as e:
            self.error("err")
            err = TransferError(f"{what} failed: {type(e).__name__}: {e}; {hint}")
            _mark(err)
            try:
                raise err from e
            finally:
                del err  # no cycle through the traceback (see allocator.allocate)


def _mark(e: BaseException) -> None:
    try:
        e.counted = True  # type: ignore[attr-defined]
    except AttributeError:
        pass
