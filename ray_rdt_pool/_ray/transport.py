"""The ``nixl_pool`` tensor transport: the Ray glue.

Role: the only module that imports Ray. It turns Ray's calls into calls on the
process's :class:`Runtime`, which wires the three owners together:
:mod:`ray_rdt_pool.registry` (every NIXL registration), :mod:`ray_rdt_pool.send.sender`
(the pool and the objects sent) and :mod:`ray_rdt_pool.receive.receiver` (arenas, peers and
READs). It also owns the two Ray-side pieces: the per-object metadata Ray pickles
(:class:`PoolTransportMetadata`) and the agent directory in Ray's GCS
(:class:`KVDirectory`), the process-wide lifecycle (``configure``, ``runtime``,
``shutdown``, registered with ``atexit``), and the adjustments it makes to Ray for this
transport's objects: two to Ray's serializer made by ``register()`` (a flat value as one
object; a tensor reducer pickled by name) and one by ``pack_as`` (an ``nn.Parameter``
reducer that notes the tensor Ray lists for it), which run in whichever thread calls
``ray.put`` or returns from a method, and, on the receiver, in the thread that
deserializes the value; Ray's ``__ray_fetch_rdt_object__`` replaced by ``register()``
(a get through Ray's object store returns the put's snapshot; sender, ``_ray_system``);
and the RDT store entry of a put whose extract failed, popped on the thread of the put.

Where Ray calls in (Ray 2.60), see :class:`NixlPoolTransport`; docs/architecture.md
walks through one object's life.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import ray
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportManager,
    TensorTransportMetadata,
)

from ray_rdt_pool.config import PoolConfig, Tuning, from_env
from ray_rdt_pool.core.wire import WireMeta, decode
from ray_rdt_pool.errors import (
    ConfigurationError,
    InvalidInputError,
    RdtPoolError,
    TransferError,
    WireFormatError,
    shut_down_error,
)
from ray_rdt_pool.nixl import backend as _nixl
from ray_rdt_pool.obs.events import Events
from ray_rdt_pool.obs.stats import TransportStats
from ray_rdt_pool.receive.receiver import Fetch, Receiver
from ray_rdt_pool.registry import Registry
from ray_rdt_pool.send.sender import Sender

if TYPE_CHECKING:
    import torch

    from ray_rdt_pool.same_node.shared import SourceProcess

logger = logging.getLogger(__name__)

TRANSPORT = "NIXL_POOL"
_KV_NAMESPACE = "ray_rdt_pool"


def _nothing() -> None:
    """Stands in for a backend method a fake backend lacks."""


# ---------------------------------------------------------------------------------------
# Metadata that crosses processes
# ---------------------------------------------------------------------------------------


class LazyTensorMeta(Sequence[Any]):
    """Ray's ``tensor_meta`` list, materialised from the wire bytes only when used.

    Ray calls ``len()`` on it for every receive and indexes it only to validate target
    buffers, so ten thousand ``(torch.Size, dtype)`` pairs are never pickled, and a
    corrupted message surfaces as WireFormatError where the receiver first reads it.
    """

    __slots__ = ("_items", "_owner")

    def __init__(self, owner: PoolTransportMetadata) -> None:
        self._owner = owner
        self._items: list[tuple[Any, Any]] | None = None

    def __len__(self) -> int:
        return self._owner.decoded().num_tensors

    def _materialise(self) -> list[tuple[Any, Any]]:
        if self._items is None:
            import torch

            from ray_rdt_pool.memory.tensors import torch_dtype

            meta = self._owner.decoded()
            # One (Size, dtype) pair per run of a pattern, replicated per tensor: an
            # object sent per sample (thousands of tensors, a handful of runs) costs no
            # torch call per tensor here.
            self._items = meta.map_tensors(
                lambda run: (torch.Size(run.shape), torch_dtype(run.dtype)))
        return self._items

    def __getitem__(self, i: Any) -> Any:
        return self._materialise()[i]


def _meta_from_wire(wire: bytes | None, device: str | None) -> PoolTransportMetadata:
    return PoolTransportMetadata(tensor_meta=[], tensor_device=device, wire=wire)


@dataclass(eq=False)
class PoolTransportMetadata(TensorTransportMetadata):
    """Per-object metadata: the versioned wire bytes and nothing else.

    Pickles as ``(wire, device)``; ``tensor_meta`` is rebuilt lazily from the wire.
    """

    wire: bytes | None = None
    _decoded: WireMeta | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.wire is not None and not self.tensor_meta:
            self.tensor_meta = LazyTensorMeta(self)  # type: ignore[assignment]

    def decoded(self) -> WireMeta:
        """The validated wire metadata (decoded once per process)."""
        if self._decoded is None:
            if self.wire is None:
                raise TransferError("object metadata carries no wire bytes")
            self._decoded = decode(self.wire)
        return self._decoded

    def __reduce__(self) -> tuple[Any, ...]:
        return (_meta_from_wire, (self.wire, self.tensor_device))


# ---------------------------------------------------------------------------------------
# Where agents find each other: Ray's GCS key-value store
# ---------------------------------------------------------------------------------------


class KVDirectory:
    """Agent metadata, published once per registration change, read once per peer."""

    @staticmethod
    def session() -> object:
        """Which Ray connection the store belongs to: a new ``ray.init`` in this process
        (after ``ray.shutdown``) reaches a new GCS, so what was published must be again."""
        return getattr(getattr(ray._private.worker, "_global_node", None), "session_name", None)

    def publish(self, name: str, version: int, reset_version: int, md: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        value = version.to_bytes(8, "little") + reset_version.to_bytes(8, "little") + md
        _internal_kv_put(f"agent/{name}", value, overwrite=True, namespace=_KV_NAMESPACE)

    def lookup(self, name: str) -> tuple[int, int, bytes] | None:
        from ray.experimental.internal_kv import _internal_kv_get

        value = _internal_kv_get(f"agent/{name}", namespace=_KV_NAMESPACE)
        if value is None or len(value) < 16:
            return None
        return (int.from_bytes(value[:8], "little"), int.from_bytes(value[8:16], "little"),
                bytes(value[16:]))

    def remove(self, name: str) -> None:
        try:
            from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_initialized

            if _internal_kv_initialized():
                _internal_kv_del(f"agent/{name}", namespace=_KV_NAMESPACE)
                _internal_kv_del(f"host/{name}", namespace=_KV_NAMESPACE)
        except Exception:  # best effort at shutdown
            pass

    def publish_host(self, name: str, info: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(f"host/{name}", info, overwrite=True, namespace=_KV_NAMESPACE)

    def lookup_host(self, name: str) -> bytes | None:
        from ray.experimental.internal_kv import _internal_kv_get

        value = _internal_kv_get(f"host/{name}", namespace=_KV_NAMESPACE)
        return None if value is None else bytes(value)


def _ray_node_id() -> str | None:
    """This process's Ray node ID (same-node receivers map; others read with NIXL)."""
    try:
        if not ray.is_initialized():
            return None
        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return None


# ---------------------------------------------------------------------------------------
# The per-process runtime: the registry, the sender and the receiver, wired together
# ---------------------------------------------------------------------------------------


class Runtime:
    """All transport state of one process: one owner per lifetime.

    * :class:`~ray_rdt_pool.registry.Registry`: every NIXL registration and the epoch;
    * :class:`~ray_rdt_pool.send.sender.Sender`: the pool, overflow regions, sent objects;
    * :class:`~ray_rdt_pool.receive.receiver.Receiver`: arenas, peers, READs, aborts;
    * :class:`~ray_rdt_pool.obs.events.Events`: counters and the metrics observer.

    This class only wires them together and answers ``stats()``. The NIXL agent is
    created on first use; until then ``configure()`` may still replace the runtime.
    """

    def __init__(self, config: PoolConfig, backend_factory: Callable[..., Any]
                 | None = None, directory: Any = None,
                 region_factory: Callable[[int, str, bool], Any] | None = None,
                 node_id: Callable[[], str | None] | None = None) -> None:
        self.config = config
        self.events = Events()
        self.events.source = self
        self._backend_factory = backend_factory or _nixl.NixlBackend
        self._backend: Any = None
        self._active: Callable[[], None] = _nothing  # the backend's active(), once made
        self._backend_lock = threading.Lock()
        self.agent_name = ""
        self.directory = directory if directory is not None else KVDirectory()
        self.registry = Registry(self.backend, self.directory,
                                 config.registration_cache_bytes, self.events, region_factory)
        node = node_id or _ray_node_id
        self.sender = Sender(config, self.registry, self.events, lambda: self.agent_name,
                             self.directory, node)
        self.receiver = Receiver(config, self.registry, self.events, self.backend,
                                 self.directory, node)
        # shutdown() began (or configure() retired this runtime before its first use):
        # no new put, fetch or agent is admitted. ``closed`` is set only once the agent
        # is destroyed: until then READs may still write, so they are not "ended" early.
        self._closing = False
        self.closed = False
        self._retired = False
        # The Ray session of the latest put (see _objects_of_ended_sessions).
        self._session: object = None
        self._session_lock = threading.Lock()
        self._shut = threading.Event()  # set when the first shutdown() has finished
        # The process that made it: a forked child inherits this object, and its agent,
        # agent name and GCS key are the parent's (see the module-level shutdown()).
        self.pid = os.getpid()
        # The handler this runtime added (None: it added none), which retire() takes
        # away again: the runtime configure() makes instead may not want it.
        self._debug_handler: Any = None
        if config.debug_transfers:
            from ray_rdt_pool.obs.logs import debug_handler, enable_debug_logging

            if debug_handler() is None:
                self._debug_handler = enable_debug_logging()

    @property
    def observer(self) -> Any:
        return self.events.observer

    @observer.setter
    def observer(self, obs: Any) -> None:
        self.events.observer = obs

    def backend(self) -> Any:
        """The process's NIXL agent, created on first use."""
        b = self._backend
        if b is not None and not self.closed:
            return b
        with self._backend_lock:
            if self.closed or (self._backend is None and self._closing):
                raise self._gone()
            if self._backend is None:
                name = _nixl.new_agent_name()
                cfg = self.config
                # Read lanes: extra NIXL agents for concurrent parts of large READs.
                b = self._backend_factory(
                    name, cfg.tuning.progress_interval_s, lanes=cfg.tuning.read_lane_count,
                    split_bytes=cfg.tuning.read_split_bytes,
                    on_split=lambda: self.events.add("split_reads"),
                    post_timeout_s=cfg.fetch_timeout_s,
                    idle_interval_s=cfg.tuning.progress_idle_interval_s)
                self._active = getattr(b, "active", None) or _nothing
                add_tick = getattr(b, "add_tick", None)
                if add_tick is not None:
                    add_tick(self.receiver.reap)
                    add_tick(self.sender.reap)
                self.agent_name = name
                self._backend = b
            return self._backend

    def _gone(self) -> RdtPoolError:
        if self._retired:
            return ConfigurationError(
                "configure() replaced nixl_pool's configuration while this operation was "
                "starting it in another thread; call configure() before the first "
                "ray.put or ray.get, e.g. at the top of the actor's __init__")
        return shut_down_error()

    def admit(self) -> None:
        """Before a put or a fetch: refuse new work once shutdown() began."""
        if self._closing:
            raise self._gone()

    def started(self) -> bool:
        """True once the NIXL agent exists (the configuration is fixed from then on)."""
        return self._backend is not None

    def shut_down(self) -> bool:
        """shutdown() was called on this runtime (configure()'s retire() does not count)."""
        return self._closing and not self._retired

    def retire(self) -> bool:
        """For configure(): close this runtime if its agent does not exist yet, so no
        operation can start it any more; False (nothing done) if it exists already.
        Taken under the agent's lock, so an agent being made meanwhile counts as
        existing."""
        with self._backend_lock:
            if self._backend is not None:
                return False
            if self._closing:
                return True
            self._closing = self._retired = True
        try:
            if self.observer is not None and hasattr(self.observer, "close"):
                self.observer.close()
            if self._debug_handler is not None:
                from ray_rdt_pool.obs.logs import disable_debug_logging

                disable_debug_logging(self._debug_handler)
        finally:
            self.closed = True
            self._shut.set()
        return True

    def _objects_of_ended_sessions(self) -> None:
        """At the first put after ``ray.shutdown()`` and a new ``ray.init()`` in this
        process (a notebook, a test harness): free the objects put in the ended session.
        Ray never frees those whose refs were alive at its shutdown, and no ref of the
        new session can name them, so their blocks would stay taken for the life of the
        process (with ``strict``, every later put that needs them fails). Blocks that
        same-node receivers still hold views of wait for their leases, as on any free.
        The shared pool's same-node entry is published again in the new session."""
        session = getattr(self.directory, "session", None)
        now = session() if session is not None else None
        if now is None or now == self._session:
            return
        with self._session_lock:
            if now == self._session:
                return
            # Listed with the session switched under one lock: a put of the new session
            # on another thread comes after and is not among them.
            ended = self.sender.live_ids() if self._session is not None else []
            # The new session's GCS starts empty: the same-node entry goes there before
            # any of its objects names the pool (puts of the new session wait on the lock).
            self.sender.reshare()
            self._session = now
        freed = sum(self.sender.free(obj_id) for obj_id in ended)
        if freed:
            logger.info("freed %d nixl_pool object(s) of an ended Ray session (their refs "
                        "were alive at ray.shutdown(), so Ray never freed them)", freed)

    def sending(self) -> None:
        """Before a put: the agent exists, and its progress thread runs at the fast
        interval for a while, since the object's readers may connect for the first time
        (a connection needs this side's progress calls)."""
        self.admit()
        self._objects_of_ended_sessions()
        self.backend()
        self._active()

    # -- the Ray-facing operations --------------------------------------------------------

    def put(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> PoolTransportMetadata:
        if not tensors:
            return PoolTransportMetadata(tensor_meta=[], tensor_device=None, wire=None)
        self.sending()
        meta, wire = self.sender.put(obj_id, tensors, _put_conversions())
        out = PoolTransportMetadata(tensor_meta=[], tensor_device=tensors[0].device.type,
                                    wire=wire)
        out._decoded = meta
        return out

    def free(self, obj_id: str) -> None:
        self.sender.free(obj_id)

    def get_snapshot(self, obj_id: str) -> list[torch.Tensor] | None:
        """The tensors of an object this process put, as the put copied them: new tensors,
        each with its own storage (pickled one by one, none carries the others' bytes),
        never views of the pool. None for an object this transport does not hold."""
        from ray_rdt_pool.memory.tensors import copy_bytes, empty_tensor, torch_dtype
        from ray_rdt_pool.receive.receiver import target_descs

        with self.sender.lock:  # the blocks cannot be freed (and reused) meanwhile
            p = self.sender.sent.get(obj_id)
            meta = p.meta if p is not None else None
            if meta is None:
                return None
            where = meta.device if meta.device == "cpu" else f"cuda:{meta.device_id}"
            # One copy, byte for byte, straight out of the blocks into each tensor's own
            # storage (clone would make every nonzero byte of a bool 1).
            out = [empty_tensor(shape, torch_dtype(dt), where)
                   for shape, dt in meta.shapes_dtypes()]
            if any(t.numel() for t in out):
                local, remote = target_descs(out, meta)
                copy_bytes([(d, s, n) for (d, n, _), (s, _m, _r) in zip(local, remote)],
                           meta.device, meta.device_id)
        return out

    def fetch(self, obj_id: str, pmeta: PoolTransportMetadata,
              targets: Sequence[torch.Tensor] | None) -> PoolFetch:
        if pmeta.wire is None:
            # An object with no tensors (a method return such as ``(1, "x")``: Ray stores
            # and fetches it all the same): nothing to read, as Ray's own nixl returns.
            return PoolFetch(obj_id=obj_id, tensors=[])
        self.admit()
        meta = pmeta.decoded()
        inner = self.receiver.fetch(obj_id, meta, pmeta.tensor_device, targets)
        try:
            return PoolFetch(obj_id=obj_id, tensors=inner.tensors, inner=inner,
                             receiver=self.receiver)
        except BaseException:  # a Ctrl-C before the request's __del__ net exists
            if inner.transfer is not None and not inner.settled:
                self.receiver.dropped(inner.transfer)
            raise

    def fetch_selected(self, obj_id: str, pmeta: PoolTransportMetadata,
                       selection: Sequence[tuple[slice, ...] | None],
                       timeout_s: float | None) -> list[torch.Tensor]:
        if pmeta.wire is None:  # no tensors (see fetch)
            _check_selection_count(selection, 0)
            return []
        self.admit()
        inner = self.receiver.fetch(obj_id, pmeta.decoded(), pmeta.tensor_device, None,
                                    selection=selection)
        return self.receiver.wait(inner, timeout_s)

    def wait(self, req: PoolFetch, timeout: float | None) -> list[torch.Tensor]:
        if req.inner is None:  # an object with no tensors: nothing was read
            return req.tensors
        tensors = self.receiver.wait(req.inner, timeout)
        req.tensors = tensors
        return tensors

    def abort(self, obj_id: str) -> None:
        self.receiver.abort(obj_id)

    def wait_for(self, predicate: Callable[[TransportStats], bool], timeout_s: float
                 ) -> TransportStats | None:
        """Block until ``predicate(stats())`` holds; None after ``timeout_s``.

        Woken by every free, so a sender that streams buckets waits for pool space
        without polling.
        """
        deadline = time.monotonic() + timeout_s
        with self.sender.changed:
            while True:
                st = self.stats()
                if predicate(st):
                    return st
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                # Bounded: arena blocks return through deleters, which do not notify.
                self.sender.changed.wait(min(remaining, 0.05))

    def stats(self) -> TransportStats:
        s, r = self.sender, self.receiver
        with s.lock:
            p = s.pool.alloc.stats() if s.pool else None
            live = len(s.sent)
        o_objs, o_bytes, o_cap = s.overflow_stats()
        l_objs, l_bytes = s.leased_stats()
        rc = r.counts()
        with r.lock:
            arenas = [a.alloc.stats() for a in r.arenas.values()]
        entries, cached = self.registry.cached()
        c = self.events.snapshot()
        return TransportStats(
            pool_device=self.config.device,
            pool_capacity=p.capacity if p else 0,
            pool_used=p.used if p else 0,
            pool_free=p.free if p else 0,
            pool_largest_free_block=p.largest_free_block if p else 0,
            pool_free_blocks=p.free_blocks if p else 0,
            live_objects=live,
            arena_capacity=sum(a.capacity for a in arenas),
            arena_used=sum(a.used for a in arenas),
            arena_free=sum(a.free for a in arenas),
            arena_largest_free_block=max((a.largest_free_block for a in arenas), default=0),
            arena_free_blocks=sum(a.free_blocks for a in arenas),
            arena_live_blocks=sum(a.live_objects for a in arenas),
            nixl_registrations=c["registrations"],
            nixl_deregistrations=c["deregistrations"],
            registered_regions=self.registry.regions + entries,
            objects_put=c["objects_put"],
            objects_freed=c["objects_freed"],
            bytes_packed=c["bytes_packed"],
            zero_copy_tensors=c["zero_copy_tensors"],
            fallbacks=c["fallbacks"],
            objects_received=c["objects_received"],
            bytes_received=c["bytes_received"],
            receive_fallbacks=c["receive_fallbacks"],
            transfers_in_flight=c["in_flight"],
            transfer_errors=c["transfer_errors"],
            remote_agents=rc["peers"],
            remote_metadata_loads=c["metadata_loads"],
            agent_name=self.agent_name,
            overflow_objects=o_objs,
            overflow_bytes=o_bytes,
            overflow_capacity=o_cap,
            abandoned_transfers=rc["abandoned"],
            late_completions=c["late_completions"],
            transfers_cut=c["transfers_cut"],
            remote_agents_removed=c["peers_removed"],
            pending_aborts=rc["pending_aborts"],
            registration_cache_entries=entries,
            registration_cache_bytes=cached,
            registration_evictions=c["registration_evictions"],
            mapped_gets=c["mapped_gets"],
            reads_posted=c["reads_posted"],
            split_reads=c["split_reads"],
            source_reads=c["source_reads"],
            mapped_objects=rc["mapped_objects"],
            mapped_bytes=rc["mapped_bytes"],
            leased_objects=l_objs,
            leased_bytes=l_bytes,
        )

    def shutdown(self) -> None:
        """Stop everything this process started with NIXL; safe to call twice.

        Abandons READs in flight and removes every peer, stops the progress thread and
        destroys the agent, and deletes the agent's key from Ray's GCS. Overflow regions
        that hold no object are deregistered and unmapped first; other regions are not
        deregistered one by one: destroying the agent drops their registrations.
        Objects already sent stay counted in ``stats()`` until Ray frees them (no
        receiver can read them any more); their blocks go back then, and an overflow
        region is unmapped with its last object.

        New puts and fetches are refused from the start; a second call (another thread,
        atexit) returns once the first one has finished, waiting up to
        :data:`SHUTDOWN_WAIT_S`. READs still running are not taken for ended until the
        agent is destroyed, so their memory is never given back under a late write.
        """
        with self._backend_lock:
            first = not self._closing
            self._closing = True
            backend = self._backend
        if not first:
            if not self._shut.wait(SHUTDOWN_WAIT_S):
                logger.warning("ray_rdt_pool.shutdown(): another thread's shutdown has not "
                               "finished after %.0f s; returning without it", SHUTDOWN_WAIT_S)
            return
        try:
            if self.observer is not None and hasattr(self.observer, "close"):
                self.observer.close()
            if backend is None:
                return
            try:
                self.receiver.shutdown()
            except Exception:
                logger.debug("receiver shutdown failed", exc_info=True)
            try:
                # After this no put's registration can publish the agent's key again.
                self.registry.unpublish(self.agent_name)
            except Exception:
                logger.debug("removing the directory entry failed", exc_info=True)
            try:
                # Empty overflow regions kept for reuse go now (no put will come), while
                # the agent that must deregister them still exists.
                self.sender.end_lingering()
            except Exception:
                logger.debug("dropping idle overflow regions failed", exc_info=True)
            backend.close()
        finally:
            self.closed = True
            self._shut.set()


# ---------------------------------------------------------------------------------------
# Process-wide runtime and the Ray-facing class
# ---------------------------------------------------------------------------------------

@dataclass
class PoolFetch(FetchRequest):
    """What Ray holds between ``fetch_multiple_tensors`` and ``wait_fetch_complete``.

    If Ray drops it without waiting (another ref of the same ``ray.get`` failed, or the
    caller's deadline passed first), ``__del__`` hands the READ to the receiver, which
    returns its memory only once NIXL has ended the READ.
    """

    inner: Fetch | None = None
    receiver: Receiver | None = field(default=None, repr=False)

    def __del__(self) -> None:
        f, r = self.inner, self.receiver
        if f is not None and r is not None and not f.settled and f.transfer is not None:
            try:
                r.dropped(f.transfer)
            except Exception:
                pass


# ---------------------------------------------------------------------------------------
# Process-wide runtime and the Ray-facing class
# ---------------------------------------------------------------------------------------

_runtime: Runtime | None = None
_runtime_lock = threading.Lock()
_config: PoolConfig | None = None
_atexit_registered = False
_configured = False  # configure() was called: later calls must agree with it
# set_cuda_stream()'s stream, for every runtime this process makes: a configure() after it
# replaces a runtime not started yet, and the setting must not go with it.
_cuda_stream: Any = None


def configure(
    *,
    pool_bytes: int | None = None,
    arena_bytes: int | None = None,
    device: str | None = None,
    strict: bool | None = None,
    prefault: bool | None = None,
    fetch_timeout_s: float | None = None,
    metrics: bool | None = None,
    debug_transfers: bool | None = None,
    registration_cache_bytes: int | None = None,
    same_node: str | None = None,
    overflow_linger_s: float | None = None,
    tuning: Tuning | None = None,
    progress_interval_s: float | None = None,
    progress_idle_interval_s: float | None = None,
    pack_threads: int | None = None,
    pack_threshold_bytes: int | None = None,
    stream_copy_bytes: int | None = None,
    read_lanes: int | None = None,
    read_split_bytes: int | None = None,
    native: bool | None = None,
    **unknown: NoReturn,
) -> PoolConfig:
    """Set this process's configuration before its first put or get.

    The options are ``ray_rdt_pool.configure()``'s (documented there); None leaves one
    unset. Accepted until the NIXL agent exists (``stats()`` does not create it); raises
    ``ConfigurationError`` after that if the values differ, and for an unknown option.
    """
    given = dict(locals())  # the parameters, before any other name is bound
    options = {k: v for k, v in given.items() if k != "unknown" and v is not None}
    options.update(unknown)  # for with_overrides to refuse by name
    global _config, _runtime, _configured
    with _runtime_lock:
        base = _config if _config is not None else from_env()
        new = base.with_overrides(**options)
        if _runtime is not None and _runtime.started() and new != _runtime.config:
            raise ConfigurationError(
                "configure() was called after nixl_pool was first used in this process "
                f"(pool of {_runtime.config.pool_bytes:,} bytes already exists); call it "
                "before the first ray.put or ray.get, e.g. at the top of the actor's "
                "__init__")
        if _configured and new != _config:
            assert _config is not None
            was, now = _config.options(), new.options()
            changed = {k: (v, now[k]) for k, v in was.items() if v != now[k]}
            raise ConfigurationError(
                f"configure() was already called in this process with other values {changed} "
                "(old, new); configure once per process")
        if _runtime is not None and _runtime.shut_down():
            raise ConfigurationError(
                "configure() was called after ray_rdt_pool.shutdown() in this process; the "
                "transport cannot be used again here. Configure it before the first use, "
                "and shut it down last")
        if _runtime is not None and new != _runtime.config:
            # Nothing was created yet: start afresh (a set_cuda_stream() stays set, see
            # _cuda_stream). An agent made meanwhile by another thread's first put wins.
            if not _runtime.retire():
                raise ConfigurationError(
                    "configure() was called while nixl_pool was first used in another "
                    f"thread (a pool of {_runtime.config.pool_bytes:,} bytes now exists); "
                    "call it before the first ray.put or ray.get, e.g. at the top of the "
                    "actor's __init__")
            _runtime = None
        _config = new
        _configured = True
        return new


def runtime() -> Runtime:
    """The process's runtime, created with the configured (or default) settings."""
    global _runtime, _config, _atexit_registered
    rt = _runtime
    if rt is not None:
        return rt
    with _runtime_lock:
        if _runtime is None:
            if _config is None:
                _config = from_env()
            _runtime = Runtime(_config)
            _runtime.sender.cuda_stream = _cuda_stream
            try:
                from ray_rdt_pool.obs import metrics

                _runtime.observer = metrics.observer_for(_runtime)
            except Exception:
                logger.debug("metrics unavailable", exc_info=True)
            if not _atexit_registered:
                from ray_rdt_pool.memory.tensors import install_exit_hook

                install_exit_hook()  # atexit runs it last: after shutdown below
                atexit.register(shutdown)
                _atexit_registered = True
        return _runtime


def shutdown() -> None:
    """Release this process's transport: stop the progress thread, destroy the NIXL
    agent and remove its key from Ray's GCS. Registered with ``atexit``; call it
    yourself before tearing Ray down in a long-lived process. Safe to call twice; the
    transport cannot be used again in this process afterwards."""
    with _runtime_lock:
        rt = _runtime
    if rt is not None and rt.pid == os.getpid():
        rt.shutdown()
    # else: a runtime this process inherited through fork() (a DataLoader worker, say)
    # is the parent's: shutting it down here would remove the parent's agent key from
    # Ray's GCS (its receivers could no longer find it) and tear down NIXL state the
    # parent still uses. The child leaves it alone; its memory goes with the process.
    from ray_rdt_pool.memory.tensors import stop_pack_helpers

    stop_pack_helpers()


_pack_as = threading.local()


@contextmanager
def pack_as(dtypes: Mapping[int, torch.dtype]) -> Iterator[None]:
    """Within the block, puts on this thread pack tensor ``t`` as ``dtypes[id(t)]``.

    The conversion is the pack copy itself (no separate cast), and the object's metadata
    names the new dtype, so receivers get tensors of that dtype: for example fp32 master
    weights sent as bf16, half the bytes on the wire. Tensors not in the mapping are
    packed as they are; an ``nn.Parameter`` is matched by its own ``id`` and arrives as
    a Parameter of the new dtype. Blocks do not nest.
    """
    if getattr(_pack_as, "dtypes", None) is not None:
        raise InvalidInputError("pack_as() blocks do not nest; merge the mappings instead")
    _parameters_seen_through()
    _pack_as.dtypes = dtypes
    _pack_as.aliases = None
    try:
        yield
    finally:
        _pack_as.dtypes = None
        _pack_as.aliases = None


# An nn.Parameter is not a plain tensor, so its value takes Ray's serializer, and pickle
# reduces it through ``Parameter.__reduce_ex__``, which hands on ``p.data``: a new tensor
# object over the same storage. That is the tensor Ray lists for the object, so a pack_as
# mapping keyed by ``id(p)`` never matched it (the Parameter went as it was, silently).
# While a pack_as block serializes a value of this transport, the reducer below notes,
# for each mapped Parameter, the dtype its listed tensor is to be packed as
# (``_pack_as.aliases``: id of the listed tensor -> dtype); that tensor stays alive in
# Ray's list of the object's tensors until our put, which reads and clears the notes.
# Outside such a block the reducer is exactly ``Parameter.__reduce_ex__``.


def _reduce_parameter(p: Any) -> Any:
    red = p.__reduce_ex__(5)
    aliases = getattr(_pack_as, "aliases", None)
    if aliases is not None:
        dt = _pack_as.dtypes.get(id(p))
        if dt is not None and type(red) is tuple and len(red) > 1 and red[1]:
            aliases[id(red[1][0])] = dt
    return red


def _parameters_seen_through() -> None:
    """Install :func:`_reduce_parameter` for ``nn.Parameter`` in Ray's pickler, once,
    unless a reducer of someone else's is there."""
    import torch
    from ray import cloudpickle

    dispatch = cloudpickle.CloudPickler.dispatch
    if dispatch.get(torch.nn.Parameter) is None:
        dispatch[torch.nn.Parameter] = _reduce_parameter


def _put_conversions() -> Mapping[int, torch.dtype] | None:
    """The dtypes of this thread's pack_as block for the put Ray is making now,
    Parameters' listed tensors included (see above); None outside a block."""
    dtypes = getattr(_pack_as, "dtypes", None)
    if dtypes is None:
        return None
    aliases = _pack_as.aliases
    _pack_as.aliases = None
    return {**dtypes, **aliases} if aliases else dtypes


def fetch_selected(ref: ray.ObjectRef, selection: Sequence[tuple[slice, ...] | None],
                   timeout_s: float | None = None) -> list[torch.Tensor]:
    """READ only part of each tensor of a ``nixl_pool`` object this process holds a ref to.

    ``selection[i]`` is a tuple of slices (step 1) applied to tensor ``i``, or None for
    the whole tensor; an empty slice on dim 0 skips a tensor. Only the selected bytes
    are read: a dim-0 slice is one contiguous range, slices of later dims become one
    range per row, merged where they touch. Returns, per tensor, a contiguous tensor of
    the selected shape; they are views of one receive block, which returns when the last
    of them dies. ``stats().bytes_received`` grows by the selected bytes only. Unlike
    ``ray.get``, this bypasses Ray's check of target buffers against the full shapes.

    Raises ``InvalidInputError`` for a selection that does not fit the object (before
    anything is read), and what a fetch raises otherwise.
    """
    mgr = ray._private.worker.global_worker.rdt_manager
    obj_id = ref.hex()
    info = mgr.get_rdt_metadata(obj_id)
    if info is None:
        raise InvalidInputError(f"{ref} is not an RDT object this process knows; pass a ref "
                                "made with _tensor_transport='nixl_pool'")
    store = mgr.rdt_store
    if store.has_object(obj_id):  # this process holds the object itself: no READ
        from ray_rdt_pool.core.selection import selection_bounds

        held = store.get_object(obj_id)
        _check_selection_count(selection, len(held))
        # The same checks as a READ's (a step, too many slices: refused, not indexed).
        return [t[tuple(slice(a, b) for a, b in
                        selection_bounds(i, tuple(t.shape), sel))].contiguous()
                for i, (t, sel) in enumerate(zip(held, selection))]
    tmeta = info.tensor_transport_meta
    if tmeta is None:
        wait = timeout_s if timeout_s is not None else 60.0
        tmeta = mgr.wait_for_tensor_transport_metadata(obj_id, wait)
        if tmeta is None:
            raise TimeoutError(f"the metadata of {ref} did not arrive within {wait}s")
    return runtime().fetch_selected(obj_id, _as_pool_meta(tmeta), selection, timeout_s)


def source_process() -> SourceProcess | None:
    """This process as a source of direct reads by same-node receivers (the weights
    API's stream), or None outside a Ray worker or driver, or where ``same_node`` is
    ``"off"``."""
    from ray_rdt_pool.same_node.shared import this_process

    node = _ray_node_id()
    if node is None or runtime().config.same_node == "off":
        return None
    return this_process(node)


def can_read_source(src: SourceProcess) -> bool:
    """Receiver side of :func:`source_process`: see ``Receiver.can_read_source``."""
    return runtime().receiver.can_read_source(src)


def read_source(src: SourceProcess, tensors: Sequence[tuple[int, tuple[int, ...], str]],
                selection: Sequence[Any] | None = None,
                targets: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Copy tensors out of a same-node source process: see ``Receiver.read_source``."""
    rt = runtime()
    rt.admit()
    return rt.receiver.read_source(src, tensors, selection, targets)


# ---------------------------------------------------------------------------------------
# Owned objects: pool objects that never become Ray objects (the weights API's stream)
# ---------------------------------------------------------------------------------------


def put_owned(obj_id: str, tensors: Sequence[torch.Tensor],
              convert: Mapping[int, torch.dtype] | None = None, *,
              by_reference: bool = False) -> tuple[bytes, str]:
    """Put ``tensors`` as pool object ``obj_id`` and return its wire bytes and device
    type, with no Ray object behind it: the caller hands the wire bytes to the receivers
    itself and must call :func:`free_owned` once no receiver will read it any more
    (Ray's ``garbage_collect`` never runs for it). ``obj_id`` must not clash with a Ray
    object ID (the weights stream prefixes ``ws:``).

    By default a snapshot into the pool, with the same packing, placement and lease rules
    as ``ray.put``; ``convert`` as for :func:`pack_as`. ``by_reference=True``: no copy,
    receivers READ the tensors where they lie (their storages registered through the
    storage cache, a use held until :func:`free_owned`); not a snapshot, so the caller
    keeps them unchanged until every receiver has read them.
    """
    if not tensors:
        raise InvalidInputError("put_owned() needs at least one tensor")
    rt = runtime()
    rt.sending()
    if by_reference:
        _meta, wire = rt.sender.put_by_reference(obj_id, tensors)
    else:
        _meta, wire = rt.sender.put(obj_id, tensors, convert)
    return wire, tensors[0].device.type


def forget_registrations(keys: Iterable[Any]) -> int:
    """Deregister the storage-cache entries of these storage keys (``registry.storage_key``)
    that nothing uses or pins now; see ``Registry.forget``. Creates nothing."""
    rt = _runtime
    return 0 if rt is None else rt.registry.forget(keys)


def free_owned(obj_id: str) -> bool:
    """Return an object of :func:`put_owned` (at once, or when the last same-node lease
    on it drops). False if it is unknown (already freed)."""
    return runtime().sender.free(obj_id)


def fetch_owned(obj_id: str, wire: bytes, device: str | None,
                targets: Sequence[torch.Tensor] | None = None,
                selection: Sequence[Any] | None = None,
                timeout_s: float | None = None) -> list[torch.Tensor]:
    """Receiver side of :func:`put_owned`: decode (and validate) ``wire``, then map,
    READ or copy the object exactly as a ``ray.get`` of a ``nixl_pool`` object would,
    into ``targets`` when given, or only ``selection`` (see :func:`fetch_selected`).
    Blocks until the bytes are in place; raises what a fetch raises."""
    rt = runtime()
    pmeta = PoolTransportMetadata(tensor_meta=[], tensor_device=device, wire=wire)
    if selection is not None:
        return rt.fetch_selected(obj_id, pmeta, selection, timeout_s)
    return rt.wait(rt.fetch(obj_id, pmeta, targets), timeout_s)


def _check_selection_count(selection: Sequence[Any], n: int) -> None:
    if len(selection) != n:
        raise InvalidInputError(f"{len(selection)} selections for an object of {n} tensors; "
                                "pass one (a tuple of slices, or None) per tensor")


def _noop(self: Any) -> None:
    return None


def _probe_actor(self: Any) -> bool:
    try:
        import nixl._api  # noqa: F401
    except Exception:
        return False
    return True


class NixlPoolTransport(TensorTransportManager):
    """Ray's entry points for the ``nixl_pool`` transport; one instance per process.

    Where each method runs (Ray 2.60):

    * ``actor_has_tensor_transport`` — caller of ``.remote()``, caller's thread. The
      answer is cached per actor.
    * ``extract_tensor_transport_metadata`` — sender, task thread (or the driver's
      thread for ``ray.put`` in the driver). Packs the object into the pool.
    * ``get_communicator_metadata`` — owner. Nothing to agree on: returns empty metadata.
    * ``fetch_multiple_tensors`` / ``wait_fetch_complete`` — receiver, the thread that
      calls ``ray.get``. Starts the READ, then waits for it and rebuilds the tensors.
    * ``recv_multiple_tensors`` — receiver, ``_ray_system`` thread (task arguments).
    * ``garbage_collect`` — sender, ``_ray_system`` thread. Returns the blocks.
    * ``abort_transport`` — receiver, ``_ray_system_error`` thread. Marks the object so
      the waiting READ gives up and releases everything.

    State lives in the process-wide :class:`Runtime`, so ``stats()`` sees it too.
    """

    def __init__(self) -> None:
        self._has_transport: dict[str, bool] = {}

    def tensor_transport_backend(self) -> str:
        return TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: ray.actor.ActorHandle) -> bool:
        key = actor._actor_id.hex()
        cached = self._has_transport.get(key)
        if cached is None:
            cached = bool(ray.get(actor.__ray_call__.options(
                concurrency_group="_ray_system").remote(_probe_actor)))
            self._has_transport[key] = cached
        return cached

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]
                                          ) -> PoolTransportMetadata:
        _by_reference_tensor_reducer()
        rt = runtime()
        retry = obj_id in rt.sender.sent  # a task retried after its reply was lost
        try:
            return rt.put(obj_id, rdt_object)
        except BaseException:
            if not retry:
                _drop_primary_copy(obj_id, rdt_object)
            raise

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any,
                                  backend: str | None = None) -> CommunicatorMetadata:
        return CommunicatorMetadata()

    def fetch_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any,
                               communicator_metadata: CommunicatorMetadata,
                               target_buffers: list[Any] | None = None) -> FetchRequest:
        return runtime().fetch(obj_id, _as_pool_meta(tensor_transport_metadata),
                               target_buffers)

    def wait_fetch_complete(self, fetch_request: FetchRequest, timeout: float = -1
                            ) -> list[Any]:
        if not isinstance(fetch_request, PoolFetch):
            return fetch_request.tensors
        return runtime().wait(fetch_request, timeout)

    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any,
                              communicator_metadata: CommunicatorMetadata,
                              target_buffers: list[Any] | None = None) -> list[Any]:
        req = self.fetch_multiple_tensors(obj_id, tensor_transport_metadata,
                                          communicator_metadata, target_buffers)
        return self.wait_fetch_complete(req)

    def send_multiple_tensors(self, tensors: list[Any], tensor_transport_metadata: Any,
                              communicator_metadata: CommunicatorMetadata) -> None:
        raise NotImplementedError("nixl_pool is one-sided: receivers read, senders never send")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any,
                        tensors: list[Any]) -> None:
        runtime().free(obj_id)

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata
                        ) -> None:
        runtime().abort(obj_id)


def _drop_primary_copy(obj_id: str, tensors: list[Any]) -> None:
    """Undo Ray's store of an object whose put failed.

    Ray 2.60 (``RDTStore.add_object_primary``) adds the primary copy, the caller's tensors,
    to this process's RDT store *before* it calls our extract, and registers the ref only
    after extract returned. When extract raises (``PoolExhaustedError`` with
    ``strict=True``, ``InvalidInputError``), nothing ever pops that entry: the ref's free
    finds no metadata (``ray.put``), or waits for metadata that never comes (a method
    return), so the tensors stayed referenced for the life of the process. This pops the
    entry the failed call made: the only one for ``obj_id``, primary, holding exactly
    ``tensors``. Best effort: a Ray laid out otherwise is left alone."""
    try:
        store = ray._private.worker.global_worker.rdt_manager.rdt_store
        with store._lock:
            queue = store._rdt_store.get(obj_id)
            if (queue is not None and len(queue) == 1 and queue[0].is_primary
                    and queue[0].data is tensors):
                store.pop_object(obj_id)
    except Exception:
        logger.debug("could not drop the RDT store entry of failed put %s", obj_id,
                     exc_info=True)


def _as_pool_meta(meta: Any) -> PoolTransportMetadata:
    if not isinstance(meta, PoolTransportMetadata):
        raise InvalidInputError(
            f"nixl_pool received metadata of type {type(meta).__name__}; the object was "
            "produced by another transport")
    return meta


# ---------------------------------------------------------------------------------------
# Ray's tensor reducer, pickled by reference
# ---------------------------------------------------------------------------------------
#
# Ray 2.60 serializes an RDT object's value with a torch.Tensor reducer whose deserializer
# is a function defined inside ``SerializationContext.serialize_rdt_objects``. cloudpickle
# cannot name such a function, so it pickles it by value into every object, and doing so
# scans ``sys.modules`` (thousands of modules once torch is imported): about 1.4 ms of each
# ``ray.put`` on the 2-core dev machine, more than the pack of a 25 MB object. The two
# functions below keep Ray's contract exactly (a tensor of an RDT object becomes its index
# in the context's out-of-band list; any other tensor, plain pickle bytes) but live at
# module level, so each object carries only their name. Installed by our own put, in the
# process that serializes, once Ray has installed its reducer; every receiver of such an
# object imports this module to resolve the name, as it imports it to receive at all.


def _rdt_context_local() -> Any:
    return ray._private.worker.global_worker.get_serialization_context()._thread_local


def _tensor_to_rdt(tensor: Any) -> int | bytes:
    local = _rdt_context_local()
    if getattr(local, "use_external_transport", False):
        local.rdt_tensors.append(tensor)
        return len(local.rdt_tensors) - 1
    import pickle

    return pickle.dumps(tensor)


def _tensor_from_rdt(val: int | bytes) -> Any:
    if isinstance(val, int):
        return _rdt_context_local().rdt_tensors[val]
    import pickle

    return pickle.loads(val)


def _reduce_tensor(tensor: Any) -> tuple[Any, tuple[int | bytes]]:
    return _tensor_from_rdt, (_tensor_to_rdt(tensor),)


#: The qualified name of the deserializer Ray's RDT serializer defines per call.
_RAY_RDT_DESERIALIZER = "SerializationContext.serialize_rdt_objects.<locals>.deserialize"


def _by_reference_tensor_reducer() -> None:
    """Put :func:`_reduce_tensor` in Ray's place, once Ray's RDT reducer is installed.

    Only that reducer is replaced (recognised by its deserializer's name): a Ray whose
    serializer looks different, or a reducer someone else installed, is left alone. Ray
    installs its reducer again in a new serialization context (``ray.shutdown`` then
    ``ray.init`` in a driver); the next put replaces it again. A dict lookup per put."""
    import torch
    from ray import cloudpickle

    dispatch = cloudpickle.CloudPickler.dispatch
    current = dispatch.get(torch.Tensor)
    if current is _reduce_tensor or current is None:
        return
    for cell in getattr(current, "__closure__", None) or ():
        try:
            name = getattr(cell.cell_contents, "__qualname__", None)
        except ValueError:  # an empty cell
            continue
        if name == _RAY_RDT_DESERIALIZER:
            dispatch[torch.Tensor] = _reduce_tensor
            return


# ---------------------------------------------------------------------------------------
# A flat list, tuple or dict of tensors: one Python object for Ray's serializer
# ---------------------------------------------------------------------------------------
#
# Ray serializes an RDT object's value with msgpack, handing every tensor to its Python
# fallback one by one: an extension record, a pickled entry and a reducer call per tensor,
# and the same again on the receiver. That is about 9 us a tensor on the dev machine, 45 ms
# of a put of 5,120 tensors, where our own put takes 23 ms. The value users put is mostly
# a flat list, tuple or str-keyed dict of plain tensors; for those, and only for objects
# of this transport, Ray is handed one small object that stands for the whole container,
# and the tensors directly, in the order Ray's own walk would list them (each distinct
# tensor once, in first-seen order, so a tensor that appears twice comes back as one
# object twice, as it does through Ray's pickler). Anything else goes Ray's way.


class _FlatTensors:
    """Stands for a list, tuple or dict of tensors in Ray's serialized value. ``order``:
    for each item, its index among the object's distinct tensors (None when every item
    is a distinct tensor); ``keys``: a dict's keys, in order."""

    __slots__ = ("keys", "kind", "n", "order")

    def __init__(self, kind: str, n: int, keys: list[str] | None,
                 order: list[int] | None) -> None:
        self.kind, self.n, self.keys, self.order = kind, n, keys, order

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _flat_from_rdt, (self.kind, self.n, self.keys, self.order)


def _flat_from_rdt(kind: str, n: int, keys: list[str] | None,
                   order: list[int] | None) -> Any:
    """The receiver's side: the container, rebuilt from the tensors Ray received."""
    got = _rdt_context_local().rdt_tensors
    if len(got) != n:
        raise WireFormatError(
            f"a nixl_pool object's value names {n} tensors but {len(got)} arrived; run "
            "the same ray_rdt_pool version on the sender and the receiver")
    if order is not None:
        _check_order(order, n)
    items = got if order is None else [got[i] for i in order]
    if kind == "list":
        return list(items)
    if kind == "tuple":
        return tuple(items)
    if keys is None or len(keys) != len(items):
        raise WireFormatError(f"a nixl_pool object's dict value of {len(items)} tensors "
                              f"carries {None if keys is None else len(keys)} keys")
    return dict(zip(keys, items))


def _check_order(order: Sequence[Any], n: int) -> None:
    """WireFormatError unless ``order`` is what :func:`flat_tensors` makes for ``n``
    distinct tensors: each of 0..n-1 at least once, first seen in increasing order (a
    repeat names one seen before)."""
    seen = 0
    for i in order:
        if type(i) is not int or not 0 <= i <= seen or i >= n:
            raise WireFormatError(
                f"a nixl_pool object's value places tensor {i!r} where only tensors 0 to "
                f"{min(seen, n - 1)} of its {n} may come; run the same ray_rdt_pool version "
                "on the sender and the receiver")
        seen += i == seen
    if seen != n:
        raise WireFormatError(
            f"a nixl_pool object's value places {seen} of its {n} tensors; run the same "
            "ray_rdt_pool version on the sender and the receiver")


def flat_tensors(value: Any, tensor_type: type) -> tuple[_FlatTensors, list[Any]] | None:
    """``value`` as (its stand-in, its distinct tensors) when it is a non-empty list,
    tuple or str-keyed dict of tensors of exactly ``tensor_type``; None otherwise."""
    kind = type(value)
    keys: list[str] | None = None
    if kind is list or kind is tuple:
        items = value
    elif kind is dict:
        keys = list(value)
        if not all(type(k) is str for k in keys):
            return None
        items = list(value.values())
    else:
        return None
    # C-level passes (map, set): this runs on every put of up to thousands of tensors.
    if not items or set(map(type, items)) != {tensor_type}:
        return None
    name = "list" if kind is list else "tuple" if kind is tuple else "dict"
    if len(set(map(id, items))) == len(items):
        return _FlatTensors(name, len(items), keys, None), list(items)
    first: dict[int, int] = {}
    order = [first.setdefault(id(t), len(first)) for t in items]
    tensors: list[Any] = [None] * len(first)
    for t, i in zip(items, order):
        tensors[i] = t
    return _FlatTensors(name, len(tensors), keys, order), tensors


def _flat_values_as_one_object() -> None:
    """Route this transport's flat values past Ray's per-tensor serializer (see above).

    Wraps ``SerializationContext.serialize_rdt_objects`` once per process (``ray.put``
    and method returns both call it); other transports and other values are untouched."""
    import torch
    from ray._private.serialization import SerializationContext

    if getattr(SerializationContext, "_nixl_pool_flat", False):
        return
    if not all(callable(getattr(SerializationContext, name, None))
               for name in ("serialize_rdt_objects", "_serialize_to_msgpack")):
        return  # a Ray laid out otherwise: its own serializer handles every value
    through_ray = SerializationContext.serialize_rdt_objects
    tensor_type = torch.Tensor

    def serialize_rdt_objects(self: Any, value: Any, tensor_transport: str) -> Any:
        ours = tensor_transport == TRANSPORT
        noting = getattr(_pack_as, "dtypes", None) is not None
        if noting:  # notes of Parameters are for the put being serialized now only
            _pack_as.aliases = None
        if ours:
            flat = flat_tensors(value, tensor_type)
            if flat is not None:
                return self._serialize_to_msgpack(flat[0]), flat[1]
            if noting:
                _pack_as.aliases = {}
        try:
            return through_ray(self, value, tensor_transport)
        except BaseException:
            if noting:
                _pack_as.aliases = None
            raise

    SerializationContext.serialize_rdt_objects = serialize_rdt_objects  # type: ignore[method-assign]
    SerializationContext._nixl_pool_flat = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------
# A get through Ray's object store: the snapshot, not the caller's live tensors
# ---------------------------------------------------------------------------------------
#
# ``ray.get(ref, _use_object_store=True)`` runs Ray's ``__ray_fetch_rdt_object__`` in the
# sender (on ``_ray_system``), which returns the tensors of the object's primary copy in
# Ray's RDT store for Ray's object store to pickle: the caller's own tensors, as they are
# at that moment, so a change made after the put reached the receiver. ``register()``
# puts the function below in that name's place: the receiver finds it under that name
# and pickles it by reference to this module, so the sender runs this function even
# where it never called ``register()`` (it then falls back to Ray's own). For an
# object this transport holds it returns copies of the pool's snapshot, each host tensor
# wrapped so that it pickles as its dtype's wire name, its shape and its bytes (a uint8
# array Ray keeps out of band): torch cannot load back its own pickle of a tensor of
# several wire dtypes (uint16/32/64, complex32, the float8 kinds, float4_e2m1fn_x2; its
# legacy storage loader raises AttributeError), which failed such gets with Ray's
# RaySystemError for either transport. Otherwise it is Ray's function. Ray's RDT store
# is left as it is, so an actor's plain ``ray.get`` of its own ref still returns its
# original tensors, and nobody gets a view of the pool.
# The one gap: a get that reaches the sender while the put itself is still packing (a
# ref of a method return that is still running) finds no snapshot yet and gets the
# tensors as they are then; their task is inside the put, so only another thread of
# that actor could have changed them.

_rays_fetch_rdt_object: Callable[[Any, str], Any] | None = None


def _fetch_rdt_object(self: Any, obj_id: str) -> Any:
    from ray.experimental.rdt import rdt_store

    # Ray's function: kept when register() replaced it, else (a process that never
    # registered, reached through a receiver that did) still under its name.
    fetch = _rays_fetch_rdt_object or rdt_store.__ray_fetch_rdt_object__
    live = fetch(self, obj_id)  # waits until the object exists, raises its error
    rt = _runtime
    snapshot = rt.get_snapshot(obj_id) if rt is not None else None
    if snapshot is None:
        return live
    return [_StoredTensor(t) if t.device.type == "cpu" else t for t in snapshot]


class _StoredTensor:
    """A host tensor of a snapshot on its way through Ray's object store: pickled as its
    dtype's wire name, its shape and its bytes, whatever its dtype (see above)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        import torch

        from ray_rdt_pool.memory.tensors import dtype_name

        t = self.tensor
        return _tensor_from_store, (dtype_name(t.dtype), tuple(t.shape),
                                    t.reshape(-1).view(torch.uint8).numpy())


def _tensor_from_store(dtype: str, shape: tuple[int, ...], raw: Any) -> Any:
    """The receiver's side of :class:`_StoredTensor`: a new tensor with a storage of its
    own (Ray's buffer is read-only and shared), holding ``raw`` byte for byte."""
    import numpy
    import torch

    from ray_rdt_pool.memory.tensors import empty_tensor, torch_dtype

    out = empty_tensor(shape, torch_dtype(dtype))
    want = out.numel() * out.element_size()
    if getattr(raw, "nbytes", None) != want:
        # copyto would broadcast a short array over the tensor: never fill it so.
        raise WireFormatError(
            f"a snapshot tensor of shape {tuple(shape)} and dtype {dtype} came through "
            f"Ray's object store with {getattr(raw, 'nbytes', None)} bytes, not {want}; "
            "the sender runs another ray_rdt_pool version: install the same one on both")
    if want:
        numpy.copyto(out.reshape(-1).view(torch.uint8).numpy(), raw)
    return out


def _snapshots_through_the_object_store() -> None:
    """Put :func:`_fetch_rdt_object` in place of Ray's ``__ray_fetch_rdt_object__``, once;
    a Ray without that function is left alone."""
    global _rays_fetch_rdt_object
    from ray.experimental.rdt import rdt_store

    current = getattr(rdt_store, "__ray_fetch_rdt_object__", None)
    if current is None or current is _fetch_rdt_object:
        return
    _rays_fetch_rdt_object = current
    rdt_store.__ray_fetch_rdt_object__ = _fetch_rdt_object


#: Longest a second shutdown() waits for the first one (another thread's) to finish.
SHUTDOWN_WAIT_S = 30.0

#: Longest a ``.remote()`` waits for the producer of a nixl_pool argument (see below).
ORDER_WAIT_S = 10.0


def _transfers_before_their_tasks() -> None:
    """Work around a Ray 2.60 deadlock of out-of-order receivers (async or concurrent).

    Such an actor waits for an RDT task argument *inside* the task's executor (for an
    async actor, on its event loop) until Ray's ``__ray_recv__`` has stored the tensors,
    while the core worker hands tasks to every concurrency group from one thread. In a
    burst of tasks that thread can block handing a task to the busy default group, so a
    ``__ray_recv__`` that reaches the actor *after* its consuming task is never
    dispatched, and the wait ends only at ``RAY_rdt_fetch_fail_timeout_milliseconds``
    ("not found in RDT object store"). Ray's own ``nixl`` fails the same way when its
    transfers arrive late; ours arrive early only because our puts are fast.

    Ray submits the transfer (a ``__ray_recv__`` task on the receiver's one-thread
    ``_ray_system`` group) when the consuming task is submitted if the argument's metadata
    is known, and queues it otherwise. So a ``.remote()`` to an out-of-order actor with a
    ``nixl_pool`` argument first waits for the argument's producer, lets Ray submit the
    transfer, and then waits for a no-op task queued behind it on ``_ray_system``: the
    tensors are in the receiver's store before the task that uses them is even sent.
    Each wait is bounded by :data:`ORDER_WAIT_S`. Other destinations and other
    transports are untouched, and so is an argument that a method of the calling actor
    produces and that does not exist yet: that method is queued behind the very task
    making the call, so waiting for it could only time out.
    """
    from ray._raylet import ObjectRef
    from ray.experimental.rdt.rdt_manager import RDTManager

    if getattr(RDTManager, "_nixl_pool_ordered", False):
        return
    submit = RDTManager.queue_or_trigger_out_of_band_tensor_transfer

    def ordered(self: Any, dst_actor: Any, task_args: Any) -> Any:
        if not getattr(dst_actor, "_ray_allow_out_of_order_execution", False):
            return submit(self, dst_actor, task_args)
        ours = False
        for arg in task_args:
            if not isinstance(arg, ObjectRef):
                continue
            info = self.get_rdt_metadata(arg.hex())
            if info is None or info.tensor_transport_backend != TRANSPORT:
                continue
            if info.tensor_transport_meta is None and _made_by_this_actor(arg):
                # Its producer is queued behind the task running this very call (on an
                # async actor's event loop, or the one thread of a plain actor): a wait
                # here would hold it for ORDER_WAIT_S and help nothing. Ray queues the
                # transfer until the producer is done, as without this workaround.
                continue
            ours = True
            if info.tensor_transport_meta is None:
                ready, _ = ray.wait([arg], timeout=ORDER_WAIT_S)
                # A failed producer's return is its error: no metadata ever comes for it.
                if ready and not _holds_an_error(arg):
                    self.wait_for_tensor_transport_metadata(arg.hex(), ORDER_WAIT_S)
        out = submit(self, dst_actor, task_args)
        if ours:
            behind = dst_actor.__ray_call__.options(concurrency_group="_ray_system").remote(
                _noop)
            ray.wait([behind], timeout=ORDER_WAIT_S)
        return out

    RDTManager.queue_or_trigger_out_of_band_tensor_transfer = ordered  # type: ignore[method-assign]
    RDTManager._nixl_pool_ordered = True  # type: ignore[attr-defined]


def _holds_an_error(ref: Any) -> bool:
    """Whether the finished object ``ref`` is an error (its task failed) rather than a
    value, read from its metadata as Ray's own get does before it fetches RDT tensors,
    without deserializing (which would fetch them). False where that cannot be told."""
    try:
        from ray._private import ray_constants

        core = ray._private.worker.global_worker.core_worker  # type: ignore[attr-defined]
        meta = core.get_objects([ref], 0)[0][1]
        return bool(meta) and meta.split(b",")[0] != ray_constants.OBJECT_METADATA_TYPE_PYTHON
    except Exception:  # not local, or a Ray laid out otherwise: wait as before
        return False


def _made_by_this_actor(ref: Any) -> bool:
    """Whether ``ref`` is the return of a task of the actor this process runs (False on a
    driver, or where Ray's ids do not tell)."""
    try:
        me = ray._private.worker.global_worker.actor_id
        if me is None or me.is_nil():
            return False
        return bool(ref.task_id().actor_id() == me)
    except Exception:  # an id layout this Ray does not have: assume not
        return False


def register() -> str:
    """Register the transport with Ray in this process; safe to call again."""
    import torch
    from ray.experimental import register_tensor_transport
    from ray.experimental.rdt import util as rdt_util

    _transfers_before_their_tasks()
    _flat_values_as_one_object()
    _snapshots_through_the_object_store()

    info = rdt_util.transport_manager_info.get(TRANSPORT)
    if info is not None:
        if info.transport_manager_class is not NixlPoolTransport:
            raise ConfigurationError(
                f"another class ({info.transport_manager_class.__name__}) is already "
                f"registered as Ray tensor transport {TRANSPORT}")
        return TRANSPORT
    try:
        register_tensor_transport(TRANSPORT, ["cpu", "cuda"], NixlPoolTransport, torch.Tensor)
    except ValueError:
        # Ray registered it on this actor concurrently (on _ray_system); same class.
        info = rdt_util.transport_manager_info.get(TRANSPORT)
        if info is None or info.transport_manager_class is not NixlPoolTransport:
            raise
    return TRANSPORT


def register_memory(tensor: torch.Tensor) -> None:
    """Register ``tensor``'s storage with NIXL so objects holding it are sent zero-copy.

    Tensors inside a registered storage are read in place by receivers (no snapshot):
    do not modify them until the objects holding them are freed.
    """

    _check_memory(tensor, "register_memory")
    rt = runtime()
    rt.backend()
    rt.registry.pin(tensor)


def deregister_memory(tensor: torch.Tensor) -> None:
    """Undo one :func:`register_memory` of the same tensor's storage."""
    # The type only: a storage FSDP has resized to 0 since is no error here (it finds
    # no registration, as before).
    _check_tensor(tensor, "deregister_memory")
    runtime().registry.unpin(tensor)


def _check_tensor(tensor: Any, what: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.device.type not in ("cpu", "cuda"):
        raise InvalidInputError(f"{what}() takes a CPU or CUDA torch.Tensor, got "
                                f"{type(tensor).__name__}")


def _check_memory(tensor: Any, what: str) -> None:
    """InvalidInputError unless ``tensor`` is a CPU or CUDA tensor with memory of its own
    behind its storage (not a ZeroTensor, a storage resized to 0, or a DTensor)."""
    from ray_rdt_pool.memory.tensors import storage_base

    _check_tensor(tensor, what)
    if tensor._is_zerotensor():
        raise InvalidInputError(f"{what}() got a ZeroTensor, which has no memory; pass a "
                                "real tensor (t.clone())")
    storage, base = storage_base(tensor, 0)
    if not base or not storage.nbytes():
        raise InvalidInputError(
            f"{what}() got a tensor whose storage holds no memory ({storage.nbytes()} bytes "
            "at address 0, e.g. resized to 0 as FSDP does); register it while its storage "
            "is allocated")


def set_cuda_stream(stream: Any) -> None:
    """Name the CUDA stream that produces the tensors this process sends.

    The pack copy waits for that stream instead of the current one. ``None`` restores
    the default (the current stream of the tensors' device).
    """
    global _cuda_stream
    _cuda_stream = stream
    runtime().sender.cuda_stream = stream


def stats() -> TransportStats:
    """A snapshot of this process's transport (zeros before first use).

    Creates nothing: ``configure()`` is still accepted afterwards.
    """
    return runtime().stats()


__all__ = [
    "TRANSPORT",
    "NixlPoolTransport",
    "PoolTransportMetadata",
    "Runtime",
    "can_read_source",
    "configure",
    "deregister_memory",
    "fetch_selected",
    "pack_as",
    "read_source",
    "register",
    "register_memory",
    "runtime",
    "set_cuda_stream",
    "shutdown",
    "source_process",
    "stats",
]

