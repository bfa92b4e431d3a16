"""Configuration of ray_rdt_pool: one frozen object and one table of environment variables.

Pure module (no torch, Ray or NIXL). A process builds its :class:`PoolConfig` once, from
``configure()`` keyword arguments layered over the environment variables in
:data:`ENV_VARS` layered over the defaults. The transport reads only this object.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from ray_rdt_pool.errors import ConfigurationError
from ray_rdt_pool.layout import BLOCK_ALIGN

__all__ = [
    "DEFAULT_POOL_BYTES", "DEFAULT_REGISTRATION_CACHE_BYTES", "ENV_VARS", "PoolConfig",
    "from_env",
]

#: 1 GiB: holds a 7B-parameter bf16 shard in a few buckets, or two copies of the
#: ~500 MiB weight sets the benchmark moves, while leaving a 24 GiB host room for
#: several actors.
DEFAULT_POOL_BYTES = 1 << 30

#: 8 GiB: the receive buffers of a 4B-parameter bf16 model stay registered across syncs.
DEFAULT_REGISTRATION_CACHE_BYTES = 8 << 30

_DEVICES = ("cpu", "cuda")
_SAME_NODE = ("map", "copy", "off")

#: Most threads a pack copy uses when ``pack_threads`` is 0 (automatic).
MAX_AUTO_PACK_THREADS = 4

#: Most read lanes (NIXL agents) ``read_lanes`` may ask for; 0 picks min(cores, this).
MAX_AUTO_READ_LANES = 2
MAX_READ_LANES = 16


#: Longest ``overflow_linger_s``: an hour.
MAX_OVERFLOW_LINGER_S = 3600.0

#: The default of ``PoolConfig.progress_idle_interval_s``.
_IDLE_DEFAULT_S = 0.02


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


class _Follows(float):
    """An idle interval nobody set: ``_IDLE_DEFAULT_S``, or a longer
    ``progress_interval_s``. Its type marks it, so that a copy with another
    ``progress_interval_s`` (``with_overrides``, ``configure()`` over the environment)
    follows the new value instead of keeping one followed from the old, and an explicit
    0.02 is checked like any value given."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Follows, (float(self),))


@dataclass(frozen=True)
class PoolConfig:
    """Settings of one process's transport. Immutable once the pool exists.

    Attributes:
        pool_bytes: Size of the sender pool, registered with NIXL once.
        arena_bytes: Size of the receive arena, registered once on first receive.
        device: Where the sender pool lives, ``"cpu"`` or ``"cuda"``.
        strict: Raise ``PoolExhaustedError`` for an object that does not fit the
            pool, instead of copying it into overflow memory (still a snapshot).
        prefault: Touch every page of the pool and arena when they are created,
            so the first transfers pay no page faults.
        progress_interval_s: How often the background thread progresses the NIXL
            agent so peers can connect; the thread sleeps in between instead of
            spinning (NIXL's own progress thread busy-polls a whole core). This
            interval holds for a second after each put, when new receivers connect.
        progress_idle_interval_s: The same once the process has sent nothing for a
            second. A peer's first READ waits for about four progress calls of the
            sender (the connection handshake); later READs need none. So a receiver
            that first reads from a sender idle for over a second connects about 50 ms
            slower (90 ms instead of 40 on a 2-core VM), and the thread of an idle actor
            costs a third as much (0.009 against 0.027 core there). Equal to
            ``progress_interval_s``: always the fast interval. Never shorter than
            ``progress_interval_s``; the default (0.02 s) becomes
            ``progress_interval_s`` when that is longer.
        fetch_timeout_s: Upper bound for one READ on the receiver; Ray's own
            ``RAY_rdt_fetch_fail_timeout_milliseconds`` applies on top.
        metrics: Export gauges, counters and histograms through ``ray.util.metrics``.
        debug_transfers: Log every put and fetch at DEBUG level with sizes and
            descriptor counts.
        registration_cache_bytes: Most bytes of user storages (receive target buffers
            seen more than once) kept registered with NIXL, and held alive, while no
            transfer uses them; least recently used ones are deregistered first.
            Storages pinned by ``register_memory()`` do not count and are never evicted.
        same_node: How a receiver gets objects from a sender on the same Ray node.
            ``"map"``: map the sender's shared pool and return views of it (no copy;
            a lease keeps the block until the views die). ``"copy"``: map it and copy
            into the receive arena at once (for results kept a long time). ``"off"``:
            always read with NIXL. On a sender, ``"off"`` keeps the pool in private
            memory, so no receiver can map it.
        pack_threads: Threads that copy one large object into the pool; 0 picks the
            number of cores, at most :data:`MAX_AUTO_PACK_THREADS`.
        pack_threshold_bytes: Objects smaller than this are packed by one thread (on
            a 2-core VM two threads gain 1.3x at 6 MiB and 1.6x from 8 MiB, and lose
            below 4 MiB, where a thread hand-off costs as much as the copy).
        stream_copy_bytes: Host copies (a pack, a copy out of a mapping into the arena
            or into target buffers) of at least this many bytes in all write with
            streaming stores (no read of the destination first) where the compiled helper
            was built (:mod:`ray_rdt_pool.fastcopy`), one move of at least 128 KiB at a
            time (of at least 1 KiB in a pack of many tensors, whose moves run in one
            call with one fence); smaller copies and moves use memmove and keep their
            bytes in cache for the reader. 0 turns streaming stores off.
        read_lanes: NIXL agents a receiver reads with; a READ into the receive arena of
            at least ``read_split_bytes`` is cut into one part per lane, posted
            concurrently (with UCX over cma each agent copies on its own thread). 0
            picks min(cores, :data:`MAX_AUTO_READ_LANES`); 1 disables splitting.
        read_split_bytes: The smallest READ that is split over the read lanes.
        overflow_linger_s: How long an overflow region stays registered once its last
            object is freed, for the next oversized objects to reuse (at most an hour;
            0: deregistered with its last object). Every deregistration makes each
            receiver of this sender replace its view of the sender's agent, and with
            NIXL 1.5.1 every such replacement leaves a TCP connection per read lane
            open in both processes, for good: a sender whose pool overflows now and
            then would leak one per object. Its memory stays held (and counted in
            ``overflow_capacity``) that long.
        native: Read the facts of an object's tensors (dtype, shape, address, ...) in
            C++ where the optional helper is built for this torch (``python -m
            ray_rdt_pool.native build``; :mod:`ray_rdt_pool.native`); False: always the
            Python loop. Both give the same facts; the helper is several times faster
            for objects of thousands of tensors.
    """

    pool_bytes: int = DEFAULT_POOL_BYTES
    arena_bytes: int = DEFAULT_POOL_BYTES
    device: str = "cpu"
    strict: bool = False
    prefault: bool = False
    progress_interval_s: float = 0.005
    progress_idle_interval_s: float = _Follows(_IDLE_DEFAULT_S)
    fetch_timeout_s: float = 60.0
    metrics: bool = True
    debug_transfers: bool = False
    registration_cache_bytes: int = DEFAULT_REGISTRATION_CACHE_BYTES
    same_node: str = "map"
    pack_threads: int = 0
    pack_threshold_bytes: int = 8 << 20
    stream_copy_bytes: int = 16 << 20
    read_lanes: int = 0
    read_split_bytes: int = 8 << 20
    native: bool = True
    overflow_linger_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("strict", "prefault", "metrics", "debug_transfers", "native"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # a string such as "no" is truthy
                raise ConfigurationError(
                    f"{name} must be True or False, got {value!r}; pass e.g. {name}=False")
        for name in ("progress_interval_s", "progress_idle_interval_s", "fetch_timeout_s",
                     "overflow_linger_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not _finite(value):
                raise ConfigurationError(
                    f"{name} must be a finite number of seconds, got {value!r}; pass e.g. "
                    f"{name}={getattr(PoolConfig, name)!r}")
        for name in ("pool_bytes", "arena_bytes", "registration_cache_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigurationError(
                    f"{name} must be a positive number of bytes, got {value!r}; "
                    f"pass e.g. {name}=1 << 30 (1 GiB)"
                )
        if self.device not in _DEVICES:
            raise ConfigurationError(
                f"device must be one of {_DEVICES}, got {self.device!r}"
            )
        if self.same_node not in _SAME_NODE:
            raise ConfigurationError(
                f"same_node must be one of {_SAME_NODE}, got {self.same_node!r}; "
                "'map' is the default"
            )
        if isinstance(self.pack_threads, bool) or not isinstance(self.pack_threads, int) or (
                not 0 <= self.pack_threads <= 64):
            raise ConfigurationError(
                f"pack_threads must be an int in [0, 64] (0: automatic), got "
                f"{self.pack_threads!r}"
            )
        if isinstance(self.pack_threshold_bytes, bool) or not isinstance(
                self.pack_threshold_bytes, int) or self.pack_threshold_bytes < 0:
            raise ConfigurationError(
                f"pack_threshold_bytes must be a non-negative number of bytes, got "
                f"{self.pack_threshold_bytes!r}"
            )
        if isinstance(self.stream_copy_bytes, bool) or not isinstance(
                self.stream_copy_bytes, int) or self.stream_copy_bytes < 0:
            raise ConfigurationError(
                f"stream_copy_bytes must be a non-negative number of bytes (0: off), got "
                f"{self.stream_copy_bytes!r}; pass e.g. stream_copy_bytes=16 << 20 (16 MiB)"
            )
        if isinstance(self.read_lanes, bool) or not isinstance(self.read_lanes, int) or (
                not 0 <= self.read_lanes <= MAX_READ_LANES):
            raise ConfigurationError(
                f"read_lanes must be an int in [0, {MAX_READ_LANES}] (0: automatic, 1: no "
                f"split READs), got {self.read_lanes!r}; pass e.g. read_lanes=2"
            )
        if isinstance(self.read_split_bytes, bool) or not isinstance(
                self.read_split_bytes, int) or self.read_split_bytes <= 0:
            raise ConfigurationError(
                f"read_split_bytes must be a positive number of bytes, got "
                f"{self.read_split_bytes!r}; pass e.g. read_split_bytes=8 << 20 (8 MiB)"
            )
        if not (0 < self.progress_interval_s <= 1.0):
            raise ConfigurationError(
                f"progress_interval_s must be in (0, 1] seconds, got {self.progress_interval_s!r}"
            )
        if isinstance(self.progress_idle_interval_s, _Follows):
            # The default idle interval follows a longer active one (setting only the
            # active interval is what one expects to need).
            object.__setattr__(self, "progress_idle_interval_s", _Follows(
                max(_IDLE_DEFAULT_S, self.progress_interval_s)))
        if not (self.progress_interval_s <= self.progress_idle_interval_s <= 1.0):
            raise ConfigurationError(
                "progress_idle_interval_s must be between progress_interval_s "
                f"({self.progress_interval_s!r}) and 1 second, got "
                f"{self.progress_idle_interval_s!r}; pass e.g. progress_idle_interval_s="
                f"{max(_IDLE_DEFAULT_S, self.progress_interval_s)!r}"
            )
        if not self.fetch_timeout_s > 0:
            raise ConfigurationError(
                f"fetch_timeout_s must be positive, got {self.fetch_timeout_s!r}"
            )
        if not 0 <= self.overflow_linger_s <= MAX_OVERFLOW_LINGER_S:
            raise ConfigurationError(
                f"overflow_linger_s must be in [0, {MAX_OVERFLOW_LINGER_S:g}] seconds (0: "
                f"deregister with the last object), got {self.overflow_linger_s!r}; pass "
                "e.g. overflow_linger_s=10.0"
            )

    @property
    def pool_capacity(self) -> int:
        """The pool size rounded up to whole blocks, as the allocator sees it."""
        return -(-self.pool_bytes // BLOCK_ALIGN) * BLOCK_ALIGN

    @property
    def arena_capacity(self) -> int:
        """The arena size rounded up to whole blocks."""
        return -(-self.arena_bytes // BLOCK_ALIGN) * BLOCK_ALIGN

    @property
    def pack_thread_count(self) -> int:
        """Threads a large pack uses: ``pack_threads``, or the cores (capped) when 0."""
        if self.pack_threads:
            return self.pack_threads
        return max(1, min(os.cpu_count() or 1, MAX_AUTO_PACK_THREADS))

    @property
    def read_lane_count(self) -> int:
        """NIXL agents a receiver uses: ``read_lanes``, or the cores (capped) when 0."""
        if self.read_lanes:
            return self.read_lanes
        return max(1, min(os.cpu_count() or 1, MAX_AUTO_READ_LANES))

    def with_overrides(self, **overrides: Any) -> PoolConfig:
        """Return a copy with ``overrides`` applied; unknown names raise ConfigurationError."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigurationError(
                f"unknown configuration option(s) {unknown}; known options are {sorted(known)}"
            )
        return replace(self, **overrides)


#: Environment variable -> (PoolConfig field, parser, meaning). The README's table is
#: generated from the same facts; keep both in step.
ENV_VARS: dict[str, tuple[str, str]] = {
    "RAY_RDT_POOL_BYTES": ("pool_bytes", "sender pool size in bytes (suffixes K, M, G allowed)"),
    "RAY_RDT_POOL_ARENA_BYTES": ("arena_bytes", "receive arena size in bytes (K, M, G allowed)"),
    "RAY_RDT_POOL_DEVICE": ("device", "where the sender pool lives: cpu or cuda"),
    "RAY_RDT_POOL_STRICT": ("strict", "1: raise instead of using overflow memory for oversized "
                            "objects"),
    "RAY_RDT_POOL_PREFAULT": ("prefault", "1: touch every pool and arena page up front"),
    "RAY_RDT_POOL_PROGRESS_INTERVAL_S": (
        "progress_interval_s", "seconds between background NIXL progress calls"),
    "RAY_RDT_POOL_PROGRESS_IDLE_INTERVAL_S": (
        "progress_idle_interval_s",
        "the same, once nothing was sent for a second (new peers connect slower)"),
    "RAY_RDT_POOL_FETCH_TIMEOUT_S": ("fetch_timeout_s", "upper bound for one READ, seconds"),
    "RAY_RDT_POOL_METRICS": ("metrics", "0: do not export Ray metrics"),
    "RAY_RDT_POOL_DEBUG": ("debug_transfers", "1: DEBUG-log every put and fetch"),
    "RAY_RDT_POOL_REG_CACHE_BYTES": (
        "registration_cache_bytes", "bytes of user storages kept registered (K, M, G allowed)"),
    "RAY_RDT_POOL_SAME_NODE": (
        "same_node", "same-node receivers: map (views of the sender's pool), copy, or off"),
    "RAY_RDT_POOL_PACK_THREADS": ("pack_threads", "threads per large pack copy (0: automatic)"),
    "RAY_RDT_POOL_PACK_THRESHOLD": (
        "pack_threshold_bytes", "objects below this size pack on one thread (K, M, G allowed)"),
    "RAY_RDT_POOL_STREAM_COPY": (
        "stream_copy_bytes", "host copies of at least this size use streaming stores "
        "(K, M, G allowed; 0: off)"),
    "RAY_RDT_POOL_READ_LANES": (
        "read_lanes", "NIXL agents a receiver reads with (0: automatic, 1: no split READs)"),
    "RAY_RDT_POOL_READ_SPLIT": (
        "read_split_bytes", "READs of at least this size are split over the read lanes "
        "(K, M, G allowed)"),
    "RAY_RDT_POOL_OVERFLOW_LINGER_S": (
        "overflow_linger_s", "seconds an emptied overflow region stays registered for reuse "
        "(0: deregistered with its last object)"),
    "RAY_RDT_POOL_NATIVE": (
        "native", "0: read tensor facts in Python even where the compiled helper is built"),
}

_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _parse_size(var: str, text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = 1
    if t and t[-1] in _SUFFIX:
        mult, t = _SUFFIX[t[-1]], t[:-1]
    try:
        return int(float(t) * mult) if "." in t else int(t) * mult
    except (ValueError, OverflowError) as e:  # OverflowError: "1e400"
        raise ConfigurationError(
            f"{var}={text!r} is not a size; use bytes or a K/M/G suffix, e.g. {var}=512M"
        ) from e


#: Fields that count things, not bytes: no size suffixes.
_COUNTS = ("pack_threads", "read_lanes")


def _parse_count(var: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError as e:
        raise ConfigurationError(
            f"{var}={text!r} is not a whole number; e.g. {var}=2 (0: automatic)") from e


def _parse_bool(var: str, text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ConfigurationError(f"{var}={text!r} is not a boolean; use 1 or 0")


def _parse_float(var: str, text: str) -> float:
    try:
        return float(text)
    except ValueError as e:
        raise ConfigurationError(f"{var}={text!r} is not a number of seconds") from e


def from_env(environ: Mapping[str, str] | None = None) -> PoolConfig:
    """Build the config from the defaults overlaid with the variables in :data:`ENV_VARS`."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for var, (field_name, _doc) in ENV_VARS.items():
        if var not in env:
            continue
        text = env[var]
        default = getattr(PoolConfig, field_name)
        if isinstance(default, bool):
            values[field_name] = _parse_bool(var, text)
        elif field_name in _COUNTS:
            values[field_name] = _parse_count(var, text)
        elif isinstance(default, int):
            values[field_name] = _parse_size(var, text)
        elif isinstance(default, float):
            values[field_name] = _parse_float(var, text)
        else:
            values[field_name] = text.strip().lower()
    try:
        return PoolConfig(**values)
    except ConfigurationError as e:
        # Name the variable that set the refused field, not only the field.
        set_by = [f"{var}={env[var]!r}" for var, (name, _d) in ENV_VARS.items()
                  if name in values and var in env and name in str(e)]
        if not set_by:
            raise
        raise ConfigurationError(f"{e} (set by {', '.join(set_by)})") from e
