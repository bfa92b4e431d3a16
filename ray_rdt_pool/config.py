"""Configuration of ray_rdt_pool: one frozen object and one table of environment variables.

Pure module (no torch, Ray or NIXL). A process builds its :class:`PoolConfig` once, from
``configure()`` keyword arguments layered over the environment variables in
:data:`ENV_VARS` layered over the defaults. The transport reads only this object.

:class:`PoolConfig` holds what a user sizes and decides; the measured tuning values sit
in :class:`Tuning`, reachable as ``PoolConfig.tuning``. Every option, tuning ones
included, is set by the variable ``RAY_RDT_POOL_`` + its name in upper case
(:func:`env_name`).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypedDict

from ray_rdt_pool.core.layout import BLOCK_ALIGN
from ray_rdt_pool.errors import ConfigurationError

__all__ = [
    "DEFAULT_POOL_BYTES", "DEFAULT_REGISTRATION_CACHE_BYTES",
    "ENV_PREFIX", "ENV_VARS", "OPTIONS", "TRANSPORT", "TUNING_OPTIONS", "Options",
    "PoolConfig", "Tuning", "env_name", "from_env",
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

#: The default of ``Tuning.progress_idle_interval_s``.
_IDLE_DEFAULT_S = 0.02

#: What users pass: ``tensor_transport="nixl_pool"`` (Ray keys transports by the
#: upper-cased name, ``NIXL_POOL``, which its errors show).
TRANSPORT = "nixl_pool"

#: Every environment variable of an option is this prefix plus the option's name.
ENV_PREFIX = "RAY_RDT_POOL_"


def env_name(option: str) -> str:
    """The environment variable that sets ``option``: ``RAY_RDT_POOL_`` + ``OPTION``."""
    return ENV_PREFIX + option.upper()


def _env(meaning: str) -> dict[str, str]:
    """A field's metadata: the one-line meaning its environment variable is listed with."""
    return {"env": meaning}


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


def _check_bools(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):  # a string such as "no" is truthy
            raise ConfigurationError(
                f"{name} must be True or False, got {value!r}; pass e.g. {name}=False")


def _check_seconds(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not _finite(value):
            raise ConfigurationError(
                f"{name} must be a finite number of seconds, got {value!r}; pass e.g. "
                f"{name}={getattr(type(obj), name)!r}")


def _bad_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


@dataclass(frozen=True)
class Tuning:
    """Measured tuning values: advanced settings, reachable as ``PoolConfig.tuning``.

    The defaults were measured with the benchmarks in :mod:`ray_rdt_pool.bench` (on 2-core
    VMs; ``docs/benchmarks.md`` has the figures). Each one trades speed against CPU or
    latency; none changes what a transfer delivers. Leave them alone unless a benchmark
    on your own hardware (``ray-rdt-pool bench``, ``python -m ray_rdt_pool.bench.pack_threads``
    or ``python -m ray_rdt_pool.bench.floor``) shows a gain. Set them like any option:
    ``configure(read_lanes=4)``, ``configure(tuning=Tuning(read_lanes=4))`` or
    ``RAY_RDT_POOL_READ_LANES=4``.

    Attributes:
        progress_interval_s: How often the background thread progresses the NIXL
            agent so peers can connect; the thread sleeps in between instead of
            spinning (NIXL's own progress thread busy-polls a whole core). This
            interval holds for a second after each put, when new receivers connect.
            At most 1 s.
        progress_idle_interval_s: The same once the process has sent nothing for a
            second. A peer's first READ waits for about four progress calls of the
            sender (the connection handshake); later READs need none. So a longer idle
            interval makes an idle actor's thread cheaper and a receiver's first READ
            from a long-idle sender slower. Equal to ``progress_interval_s``: always
            the fast interval. Never shorter than ``progress_interval_s``; the default
            (0.02 s) becomes ``progress_interval_s`` when that is longer.
        pack_threads: Threads that copy one large object into the pool; 0 picks the
            number of cores, at most :data:`MAX_AUTO_PACK_THREADS`.
        pack_threshold_bytes: Objects smaller than this are packed by one thread
            (below it a thread hand-off costs as much as the copy).
        stream_copy_bytes: Host copies (a pack, a copy out of a mapping into the arena
            or into target buffers) of at least this many bytes in all write with
            streaming stores (no read of the destination first) where the compiled helper
            was built (:mod:`ray_rdt_pool.memory.fastcopy`), one move of at least 128 KiB at a
            time (of at least 1 KiB in a pack of many tensors, whose moves run in one
            call with one fence); smaller copies and moves use memmove and keep their
            bytes in cache for the reader. 0 turns streaming stores off.
        read_lanes: NIXL agents a receiver reads with; a READ into the receive arena of
            at least ``read_split_bytes`` is cut into one part per lane, posted
            concurrently (with UCX over cma each agent copies on its own thread). 0
            picks min(cores, :data:`MAX_AUTO_READ_LANES`); 1 disables splitting.
        read_split_bytes: The smallest READ that is split over the read lanes.
        native: Read the facts of an object's tensors (dtype, shape, address, ...) in
            C++ where the optional helper is built for this torch (``python -m
            ray_rdt_pool.memory.native build``); False: always the Python loop. Both
            give the same facts; the helper is several times faster for objects of
            thousands of tensors.
    """

    progress_interval_s: float = field(default=0.005, metadata=_env(
        "seconds between background NIXL progress calls"))
    progress_idle_interval_s: float = field(default=_Follows(_IDLE_DEFAULT_S), metadata=_env(
        "the same, once nothing was sent for a second (new peers connect slower)"))
    pack_threads: int = field(default=0, metadata=_env(
        "threads per large pack copy (0: automatic)"))
    pack_threshold_bytes: int = field(default=8 << 20, metadata=_env(
        "objects below this size pack on one thread (K, M, G allowed)"))
    stream_copy_bytes: int = field(default=16 << 20, metadata=_env(
        "host copies of at least this size use streaming stores (K, M, G allowed; 0: off)"))
    read_lanes: int = field(default=0, metadata=_env(
        "NIXL agents a receiver reads with (0: automatic, 1: no split READs)"))
    read_split_bytes: int = field(default=8 << 20, metadata=_env(
        "READs of at least this size are split over the read lanes (K, M, G allowed)"))
    native: bool = field(default=True, metadata=_env(
        "0: read tensor facts in Python even where the compiled helper is built"))

    def __post_init__(self) -> None:
        _check_bools(self, ("native",))
        _check_seconds(self, ("progress_interval_s", "progress_idle_interval_s"))
        if _bad_int(self.pack_threads) or not 0 <= self.pack_threads <= 64:
            raise ConfigurationError(
                f"pack_threads must be an int in [0, 64] (0: automatic), got "
                f"{self.pack_threads!r}"
            )
        if _bad_int(self.pack_threshold_bytes) or self.pack_threshold_bytes < 0:
            raise ConfigurationError(
                f"pack_threshold_bytes must be a non-negative number of bytes, got "
                f"{self.pack_threshold_bytes!r}"
            )
        if _bad_int(self.stream_copy_bytes) or self.stream_copy_bytes < 0:
            raise ConfigurationError(
                f"stream_copy_bytes must be a non-negative number of bytes (0: off), got "
                f"{self.stream_copy_bytes!r}; pass e.g. stream_copy_bytes=16 << 20 (16 MiB)"
            )
        if _bad_int(self.read_lanes) or not 0 <= self.read_lanes <= MAX_READ_LANES:
            raise ConfigurationError(
                f"read_lanes must be an int in [0, {MAX_READ_LANES}] (0: automatic, 1: no "
                f"split READs), got {self.read_lanes!r}; pass e.g. read_lanes=2"
            )
        if _bad_int(self.read_split_bytes) or self.read_split_bytes <= 0:
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


#: The options that live in :class:`Tuning`; ``configure()`` takes them by these names.
TUNING_OPTIONS: frozenset[str] = frozenset(f.name for f in fields(Tuning))


@dataclass(frozen=True)
class PoolConfig:
    """Settings of one process's transport. Immutable once the pool exists.

    Attributes:
        pool_bytes: Size of the sender pool, registered with NIXL once.
        arena_bytes: Size of the receive arena, registered once on first receive.
        device: Where the sender pool lives, ``"cpu"`` or ``"cuda"``.
        overflow: Copy an object that does not fit the pool into overflow memory
            registered for it (still a snapshot); ``False`` raises
            ``PoolExhaustedError`` instead.
        prefault: Touch every page of the pool and arena when they are created,
            so the first transfers pay no page faults.
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
        overflow_linger_s: How long an overflow region stays registered once its last
            object is freed, for the next oversized objects to reuse (at most an hour;
            0: deregistered with its last object). Every deregistration makes each
            receiver of this sender replace its view of the sender's agent, and with
            NIXL 1.5.1 every such replacement leaves a TCP connection per read lane
            open in both processes, for good: a sender whose pool overflows now and
            then would leak one per object. Its memory stays held (and counted in
            ``overflow_capacity``) that long.
        tuning: The measured tuning values (:class:`Tuning`): progress intervals, pack
            threads, streaming stores, read lanes, the compiled describe helper.
    """

    pool_bytes: int = field(default=DEFAULT_POOL_BYTES, metadata=_env(
        "sender pool size in bytes (suffixes K, M, G allowed)"))
    arena_bytes: int = field(default=DEFAULT_POOL_BYTES, metadata=_env(
        "receive arena size in bytes (K, M, G allowed)"))
    device: str = field(default="cpu", metadata=_env("where the sender pool lives: cpu or cuda"))
    overflow: bool = field(default=True, metadata=_env(
        "0: raise PoolExhaustedError instead of using overflow memory for oversized objects"))
    prefault: bool = field(default=False, metadata=_env(
        "1: touch every pool and arena page up front"))
    fetch_timeout_s: float = field(default=60.0, metadata=_env(
        "upper bound for one READ, seconds"))
    metrics: bool = field(default=True, metadata=_env("0: do not export Ray metrics"))
    debug_transfers: bool = field(default=False, metadata=_env(
        "1: DEBUG-log every put and fetch"))
    registration_cache_bytes: int = field(default=DEFAULT_REGISTRATION_CACHE_BYTES, metadata=_env(
        "bytes of user storages kept registered (K, M, G allowed)"))
    same_node: str = field(default="map", metadata=_env(
        "same-node receivers: map (views of the sender's pool), copy, or off"))
    overflow_linger_s: float = field(default=10.0, metadata=_env(
        "seconds an emptied overflow region stays registered for reuse "
        "(0: deregistered with its last object)"))
    # No variable of its own: each of its fields has one.
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self) -> None:
        _check_bools(self, ("overflow", "prefault", "metrics", "debug_transfers"))
        _check_seconds(self, ("fetch_timeout_s", "overflow_linger_s"))
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
        if not isinstance(self.tuning, Tuning):
            raise ConfigurationError(
                f"tuning must be a ray_rdt_pool.config.Tuning, got {self.tuning!r}; pass "
                "e.g. tuning=Tuning(read_lanes=2)")

    @property
    def pool_capacity(self) -> int:
        """The pool size rounded up to whole blocks, as the allocator sees it."""
        return -(-self.pool_bytes // BLOCK_ALIGN) * BLOCK_ALIGN

    @property
    def arena_capacity(self) -> int:
        """The arena size rounded up to whole blocks."""
        return -(-self.arena_bytes // BLOCK_ALIGN) * BLOCK_ALIGN

    def options(self) -> dict[str, Any]:
        """Every option by its ``configure()`` name, the tuning ones included."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tuning"}
        out.update((name, getattr(self.tuning, name)) for name in _TUNING_ORDER)
        return out

    def with_overrides(self, **overrides: Any) -> PoolConfig:
        """Return a copy with ``overrides`` applied, by ``configure()``'s names: the
        fields, ``tuning`` (a whole :class:`Tuning`) and each tuning field, which applies
        over ``tuning``. Unknown names raise ConfigurationError."""
        unknown = sorted(set(overrides) - set(OPTIONS) - {"tuning"})
        if unknown:
            raise ConfigurationError(_unknown_message(unknown))
        tuned = {k: overrides.pop(k) for k in [k for k in overrides if k in TUNING_OPTIONS]}
        tuning = overrides.pop("tuning", self.tuning)
        if not isinstance(tuning, Tuning):
            raise ConfigurationError(
                f"tuning must be a ray_rdt_pool.config.Tuning, got {tuning!r}; pass e.g. "
                "tuning=Tuning(read_lanes=2), or the tuning options themselves "
                "(read_lanes=2)")
        return replace(self, tuning=replace(tuning, **tuned), **overrides)


_TUNING_ORDER = tuple(f.name for f in fields(Tuning))

#: Every option ``configure()`` takes by name (besides ``tuning``), in table order.
OPTIONS: tuple[str, ...] = (
    *(f.name for f in fields(PoolConfig) if f.name != "tuning"), *_TUNING_ORDER)


class Options(TypedDict, total=False):
    """The keywords of ``configure()``, for editors and type checkers: every option of
    :class:`PoolConfig` and :class:`Tuning` (None leaves it unset) and ``tuning`` whole.
    A test keeps it in step with :data:`OPTIONS`."""

    pool_bytes: int | None
    arena_bytes: int | None
    device: str | None
    overflow: bool | None
    prefault: bool | None
    fetch_timeout_s: float | None
    metrics: bool | None
    debug_transfers: bool | None
    registration_cache_bytes: int | None
    same_node: str | None
    overflow_linger_s: float | None
    tuning: Tuning | None
    progress_interval_s: float | None
    progress_idle_interval_s: float | None
    pack_threads: int | None
    pack_threshold_bytes: int | None
    stream_copy_bytes: int | None
    read_lanes: int | None
    read_split_bytes: int | None
    native: bool | None


def _unknown_message(unknown: list[str]) -> str:
    hints = [f"{u!r}: did you mean {m[0]!r}?" for u in unknown
             if (m := difflib.get_close_matches(u, OPTIONS, n=1))]
    return (f"unknown configuration option(s) {unknown}; "
            + (" ".join(hints) + " " if hints else "")
            + f"known options are {sorted(OPTIONS)} and tuning (a ray_rdt_pool.config.Tuning)")


#: Environment variable -> (option, meaning), one per option: ``env_name(option)``.
#: The README's table is generated from the same facts; keep both in step.
ENV_VARS: dict[str, tuple[str, str]] = {
    env_name(f.name): (f.name, f.metadata.get("env", ""))
    for f in (*fields(PoolConfig), *fields(Tuning)) if f.name != "tuning"
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


def parse_bool(var: str, text: str) -> bool:
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


def _option_default(option: str) -> Any:
    return getattr(Tuning if option in TUNING_OPTIONS else PoolConfig, option)


def _parse(option: str, var: str, text: str) -> Any:
    default = _option_default(option)
    if isinstance(default, bool):
        return parse_bool(var, text)
    if option in _COUNTS:
        return _parse_count(var, text)
    if isinstance(default, int):
        return _parse_size(var, text)
    if isinstance(default, float):
        return _parse_float(var, text)
    return text.strip().lower()


def from_env(environ: Mapping[str, str] | None = None) -> PoolConfig:
    """Build the config from the defaults overlaid with the variables in :data:`ENV_VARS`."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    tuned: dict[str, Any] = {}
    set_by: dict[str, str] = {}  # option -> the variable that set it
    for var, (option, _doc) in ENV_VARS.items():
        if var not in env:
            continue
        (tuned if option in TUNING_OPTIONS else values)[option] = _parse(option, var, env[var])
        set_by[option] = var
    try:
        return PoolConfig(**values, tuning=Tuning(**tuned))
    except ConfigurationError as e:
        # Name the variable that set the refused field, not only the field.
        named = [f"{var}={env[var]!r}" for option, var in set_by.items() if option in str(e)]
        if not named:
            raise
        raise ConfigurationError(f"{e} (set by {', '.join(named)})") from e
