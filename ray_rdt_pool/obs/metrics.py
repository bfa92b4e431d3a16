"""Ray metrics of the nixl_pool transport: gauges, counters and histograms per process.

Role: :func:`observer_for` gives the transport's runtime a :class:`MetricsExporter`, the
implementation of the :class:`ray_rdt_pool.obs.events.Observer` protocol; the runtime is
seen only through :class:`ray_rdt_pool.obs.stats.StatsSource` (``config`` and
``stats()``), so this module never imports the transport. The runtime calls the exporter
once per put, free, completed fetch and failed fetch, never per tensor. It exports through
``ray.util.metrics``, which Ray serves on its Prometheus endpoint under a ``ray_`` prefix
(``ray_rdt_pool_sender_used_bytes``, ...). docs/observability.md lists every metric.

Cost model (bounded, independent of the number of tensors):

* Per event, on the caller's thread: at most two histogram observations (put latency and
  pack time, or fetch latency) or one counter increment (a failed transfer), plus setting
  a flag. No ``stats()`` call, no lock of the runtime.
* Gauges and counters are refreshed by one daemon thread per process, from one
  ``stats()`` snapshot of the runtime, at most every :data:`REFRESH_INTERVAL_S` (100 ms)
  after an event. The refresh is trailing: the state after the *last* event of a burst (for
  example the return of the pool to empty after a free) is always exported. Counters are
  increased by the difference to the previous snapshot, and a gauge is only re-set when
  its value changed. While objects, arena blocks or transfers are alive the thread also
  re-polls every :data:`POLL_INTERVAL_S` (1 s), because receive-arena blocks return to
  the arena when the receiver's tensors die, which is not an event the exporter sees.

Switch: ``RAY_RDT_POOL_METRICS=0`` or ``ray_rdt_pool.configure(metrics=False)`` makes
:func:`observer_for` return None, so the transport pays nothing.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray_rdt_pool.obs.stats import StatsSource, TransportStats

__all__ = [
    "COUNTERS",
    "ERROR_KINDS",
    "GAUGES",
    "HISTOGRAMS",
    "LATENCY_BUCKETS_S",
    "POLL_INTERVAL_S",
    "PREFIX",
    "REFRESH_INTERVAL_S",
    "MetricsExporter",
    "observer_for",
]

logger = logging.getLogger(__name__)

#: Prefix of every metric name; Ray's Prometheus export adds ``ray_`` in front.
PREFIX = "rdt_pool_"

#: Minimum spacing of two gauge/counter refreshes (seconds).
REFRESH_INTERVAL_S = 0.1
#: Re-poll period while anything is alive (seconds).
POLL_INTERVAL_S = 1.0

#: Histogram boundaries (seconds) shared by the three latency histograms: 50 us, a tiny
#: READ, up to 10 s, a multi-GB object on a slow link, in 1-2.5-5 steps.
LATENCY_BUCKETS_S: list[float] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
]

#: Tag keys of every metric (``transfer_errors`` adds ``kind``).
TAG_KEYS: tuple[str, ...] = ("actor", "device")

#: Kinds of failed transfers, as passed to :meth:`MetricsExporter.on_error`.
ERROR_KINDS: tuple[str, ...] = ("err", "timeout", "aborted")


def _arena_fragmentation(s: TransportStats) -> float:
    if s.arena_free == 0:
        return 0.0
    return 1.0 - s.arena_largest_free_block / s.arena_free


#: Gauges: (name without prefix, description, value from a stats snapshot).
GAUGES: tuple[tuple[str, str, Callable[[TransportStats], float]], ...] = (
    ("sender_capacity_bytes", "Size of the NIXL-registered sender pool.",
     lambda s: s.pool_capacity),
    ("sender_used_bytes", "Bytes of the sender pool held by live objects.",
     lambda s: s.pool_used),
    ("sender_free_bytes", "Free bytes of the sender pool.", lambda s: s.pool_free),
    ("sender_largest_free_block_bytes",
     "Largest contiguous free block of the sender pool.", lambda s: s.pool_largest_free_block),
    ("sender_free_blocks", "Number of free blocks (holes) in the sender pool.",
     lambda s: s.pool_free_blocks),
    ("sender_fragmentation_ratio",
     "1 - largest free block / free bytes of the sender pool (0: one free block).",
     lambda s: s.pool_fragmentation),
    ("sender_live_objects", "Objects put by this process and not yet freed.",
     lambda s: s.live_objects),
    ("arena_capacity_bytes", "Size of the NIXL-registered receive arena.",
     lambda s: s.arena_capacity),
    ("arena_used_bytes", "Bytes of the receive arena held by received tensors.",
     lambda s: s.arena_used),
    ("arena_free_bytes", "Free bytes of the receive arena.", lambda s: s.arena_free),
    ("arena_largest_free_block_bytes",
     "Largest contiguous free block of the receive arena.",
     lambda s: s.arena_largest_free_block),
    ("arena_free_blocks", "Number of free blocks (holes) in the receive arena.",
     lambda s: s.arena_free_blocks),
    ("arena_fragmentation_ratio",
     "1 - largest free block / free bytes of the receive arena.", _arena_fragmentation),
    ("arena_live_objects", "Received objects whose tensors still hold an arena block.",
     lambda s: s.arena_live_blocks),
    ("registered_regions", "Memory regions registered with NIXL right now.",
     lambda s: s.registered_regions),
    ("transfers_in_flight", "READs started by this process and not yet finished.",
     lambda s: s.transfers_in_flight),
    ("remote_agents", "Sender agents whose NIXL metadata this process holds.",
     lambda s: s.remote_agents),
    ("sender_overflow_bytes", "Bytes of live objects in overflow memory (not in the pool).",
     lambda s: s.overflow_bytes),
    ("abandoned_transfers", "READs given up on whose memory waits for NIXL to end them.",
     lambda s: s.abandoned_transfers),
    ("sender_leased_bytes",
     "Bytes of freed objects whose pool blocks wait for same-node receivers' leases.",
     lambda s: s.leased_bytes),
    ("mapped_bytes", "Bytes of same-node senders' pools mapped here by live received views.",
     lambda s: s.mapped_bytes),
    ("signal_sessions", "Weight syncs with an open signal inbox in this process.",
     lambda s: s.signal_sessions),
    ("signals_waiting", "Weight-sync signals waiting for a sync that has not started here.",
     lambda s: s.signals_waiting),
    ("weight_staging_bytes", "Bytes of the staging copies of receivers with "
     "staging='shadow'.", lambda s: s.weight_staging_bytes),
)

#: Counters: (name without prefix, description, TransportStats field). Prometheus shows
#: them with a ``_total`` suffix.
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("objects_put", "Objects put by this process (ray.put, method returns, weight-stream "
     "buckets not read in place).", "objects_put"),
    ("objects_freed", "Objects Ray freed (garbage_collect) and weight-stream buckets freed; "
     "leased blocks return later.", "objects_freed"),
    ("bytes_packed", "Bytes copied into the sender pool.", "bytes_packed"),
    ("zero_copy_tensors", "Tensors sent without a copy (register_memory(), by-reference "
     "stream buckets).",
     "zero_copy_tensors"),
    ("fallbacks", "Objects the pool could not hold, copied into overflow memory.",
     "fallbacks"),
    ("objects_received", "Objects read by this process as a receiver.", "objects_received"),
    ("bytes_received", "Bytes read by this process as a receiver.", "bytes_received"),
    ("receive_fallbacks",
     "Receives that did not fit the arena and used a one-off registered buffer.",
     "receive_fallbacks"),
    ("nixl_registrations", "NIXL memory registrations made by this process.",
     "nixl_registrations"),
    ("nixl_deregistrations", "NIXL memory deregistrations made by this process.",
     "nixl_deregistrations"),
    ("remote_metadata_loads", "Loads of a sender agent's NIXL metadata.",
     "remote_metadata_loads"),
    ("late_completions", "READs that ended after they were given up on.",
     "late_completions"),
    ("transfers_cut", "READs ended by removing the sender's agent after fetch_timeout_s.",
     "transfers_cut"),
    ("remote_agents_removed", "Sender agents removed (failed, idle, or to cut off a READ).",
     "remote_agents_removed"),
    ("mapped_gets", "Gets served from a same-node sender's shared pool (no NIXL READ).",
     "mapped_gets"),
    ("reads_posted", "NIXL READs posted by this process.", "reads_posted"),
    ("split_reads", "READs split over several read lanes (NIXL agents) that copy in parallel.",
     "split_reads"),
    ("source_reads", "Weight-stream buckets copied straight out of a same-node sender's memory.",
     "source_reads"),
    ("weight_sync_ray_calls", "Ray task calls this process made for weight syncs (a few "
     "per receiver and sync, whatever the bucket count).", "weight_sync_ray_calls"),
    ("signals_sent", "Weight-sync data-plane signals (NIXL notifications) sent.",
     "signals_sent"),
)

#: Histograms: (name without prefix, description), all with :data:`LATENCY_BUCKETS_S`.
HISTOGRAMS: tuple[tuple[str, str], ...] = (
    ("put_seconds", "Time to pack one object and build its metadata (sender)."),
    ("pack_seconds", "Time of the copy into the sender pool or overflow memory, per object."),
    ("fetch_seconds", "Time from the start of a READ to the rebuilt tensors (receiver)."),
)

#: The transfer error counter, tagged additionally by ``kind`` (one of ERROR_KINDS).
ERRORS_NAME = "transfer_errors"


# ---------------------------------------------------------------------------------------
# Metric objects: created once per process, shared by every exporter
# ---------------------------------------------------------------------------------------


@dataclass
class _Instruments:
    gauges: list[tuple[Any, Callable[[TransportStats], float]]]
    counters: list[tuple[Any, str]]
    put_seconds: Any
    pack_seconds: Any
    fetch_seconds: Any
    errors: Any


_instruments: _Instruments | None = None
_instruments_lock = threading.Lock()


def _make_instruments() -> _Instruments:
    global _instruments
    with _instruments_lock:
        if _instruments is None:
            from ray.util.metrics import Counter, Gauge, Histogram

            gauges = [(Gauge(PREFIX + n, d, tag_keys=TAG_KEYS), f) for n, d, f in GAUGES]
            counters = [(Counter(PREFIX + n, d, tag_keys=TAG_KEYS), f) for n, d, f in COUNTERS]
            hist = {
                n: Histogram(PREFIX + n, d, boundaries=LATENCY_BUCKETS_S, tag_keys=TAG_KEYS)
                for n, d in HISTOGRAMS
            }
            errors = Counter(PREFIX + ERRORS_NAME,
                             "Failed READs on the receiver, by kind (err, timeout, aborted).",
                             tag_keys=(*TAG_KEYS, "kind"))
            _instruments = _Instruments(gauges, counters, hist["put_seconds"],
                                        hist["pack_seconds"], hist["fetch_seconds"], errors)
        return _instruments


def _actor_tag() -> str:
    """The actor ID (hex) of this process, or ``"driver"`` outside an actor."""
    import ray

    try:
        actor_id = ray.get_runtime_context().get_actor_id()
    except Exception:
        actor_id = None
    return actor_id or "driver"


# ---------------------------------------------------------------------------------------
# The exporter
# ---------------------------------------------------------------------------------------


class MetricsExporter:
    """Turns the transport's events and ``stats()`` snapshots into Ray metrics.

    Thread-safe: the runtime calls it from the task thread, ``_ray_system`` and the
    thread of ``ray.get``. Ray readiness is checked at each event until it holds
    (``ray.is_initialized()``), because the driver's runtime can exist before ``ray.init``.
    """

    def __init__(self, runtime: StatsSource, refresh_interval_s: float = REFRESH_INTERVAL_S,
                 poll_interval_s: float = POLL_INTERVAL_S) -> None:
        self._rt = weakref.ref(runtime)
        self.refresh_interval_s = refresh_interval_s
        self.poll_interval_s = poll_interval_s
        self._m: _Instruments | None = None
        self._tags: dict[str, str] = {}
        self._lock = threading.Lock()  # guards the last values and the flush itself
        self._last_counters: dict[str, int] = {}
        self._last_gauges: list[float | None] = []
        self._last_flush = 0.0
        self._active = False  # something alive at the last snapshot: keep polling
        self._pending = False
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._closed = False
        self.flushes = 0  # number of snapshots exported, for tests and the benchmark

    # -- readiness -----------------------------------------------------------------------

    def _ready(self) -> bool:
        if self._m is not None:
            return True
        import ray

        if not ray.is_initialized():
            return False
        rt = self._rt()
        device = rt.config.device if rt is not None else "cpu"
        self._tags = {"actor": _actor_tag(), "device": device}
        m = _make_instruments()
        self._last_gauges = [None] * len(m.gauges)
        self._m = m
        return True

    @property
    def tags(self) -> dict[str, str]:
        """The tags of this process's series (empty until Ray is initialized)."""
        return dict(self._tags)

    # -- events (called by the transport) ---------------------------------------------------

    def on_put(self, rt: StatsSource, nbytes: int, seconds: float, pack_seconds: float | None,
               fallback: bool) -> None:
        """One object was packed (or registered, for a fallback) in ``seconds``."""
        if not self._ready():
            return
        m = self._m
        assert m is not None
        m.put_seconds.observe(seconds, self._tags)
        if pack_seconds is not None:
            m.pack_seconds.observe(pack_seconds, self._tags)
        self._schedule()

    def on_free(self, rt: StatsSource) -> None:
        """One object's blocks went back to the pool."""
        if self._ready():
            self._schedule()

    def on_fetch(self, rt: StatsSource, nbytes: int, seconds: float) -> None:
        """One READ of ``nbytes`` completed in ``seconds``."""
        if not self._ready():
            return
        m = self._m
        assert m is not None
        m.fetch_seconds.observe(seconds, self._tags)
        self._schedule()

    def on_change(self, rt: StatsSource) -> None:
        """State changed with no put, free or fetch (a peer removed by housekeeping)."""
        if self._ready():
            self._schedule()

    def on_error(self, rt: StatsSource, kind: str) -> None:
        """One READ failed: ``kind`` is ``"err"``, ``"timeout"`` or ``"aborted"``."""
        if not self._ready():
            return
        m = self._m
        assert m is not None
        kind = kind if kind in ERROR_KINDS else "err"
        m.errors.inc(1, {**self._tags, "kind": kind})
        self._schedule()

    # -- refresh ------------------------------------------------------------------------

    def _schedule(self) -> None:
        if self._pending or self._closed:
            return
        self._pending = True
        if self._thread is None:
            self._start_thread()
        self._wake.set()

    def _start_thread(self) -> None:
        with self._thread_lock:
            if self._thread is None:
                t = threading.Thread(target=self._run, name="ray_rdt_pool-metrics", daemon=True)
                self._thread = t
                t.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(None if not self._active else self.poll_interval_s)
            self._wake.clear()
            delay = self._last_flush + self.refresh_interval_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if self._closed or self._rt() is None:
                return
            try:
                self.flush()
            except Exception:
                logger.debug("exporting nixl_pool metrics failed", exc_info=True)

    def close(self) -> None:
        """Stop the refresh thread (events after this only record histograms)."""
        self._closed = True
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)

    def flush(self) -> bool:
        """Export one ``stats()`` snapshot now; False when Ray is not ready.

        The background thread calls this; tests and tools may call it directly.
        """
        rt = self._rt()
        if rt is None or not self._ready():
            return False
        import ray

        if not ray.is_initialized():  # the driver called ray.shutdown()
            # Keep polling, so a ray.init() later gets the current values: with the
            # event left pending, no later event would wake the thread again.
            self._pending, self._active = False, True
            return False
        m = self._m
        assert m is not None
        with self._lock:
            self._pending = False
            s = rt.stats()
            tags = self._tags
            last_g = self._last_gauges
            for i, (gauge, value_of) in enumerate(m.gauges):
                v = float(value_of(s))
                if last_g[i] != v:
                    gauge.set(v, tags)
                    last_g[i] = v
            last_c = self._last_counters
            for counter, name in m.counters:
                v = getattr(s, name)
                delta = v - last_c.get(name, 0)
                if delta > 0:
                    counter.inc(delta, tags)
                last_c[name] = v
            # Poll while anything can change with no event: leases drop on the sender's
            # ticks, same-node mappings go when their views die.
            self._active = bool(s.live_objects or s.arena_live_blocks or s.transfers_in_flight
                                or s.leased_objects or s.mapped_objects)
            self._last_flush = time.monotonic()
            self.flushes += 1
        return True


def observer_for(runtime: StatsSource) -> MetricsExporter | None:
    """The metrics exporter for ``runtime``, or None when metrics are off or unavailable.

    Called by ``transport.runtime()`` when the process's runtime is created.
    """
    config = runtime.config
    if not config.metrics:
        return None
    try:
        import ray.util.metrics  # noqa: F401
    except Exception:
        logger.debug("ray.util.metrics cannot be imported; nixl_pool metrics are off",
                     exc_info=True)
        return None
    return MetricsExporter(runtime)
