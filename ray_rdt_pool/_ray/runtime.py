"""The process's transport state (:class:`Runtime`) and its process-wide lifecycle.

:class:`Runtime` wires the three owners together: :mod:`ray_rdt_pool.registry` (every
NIXL registration), :mod:`ray_rdt_pool.send.sender` (the pool and the objects sent) and
:mod:`ray_rdt_pool.receive.receiver` (arenas, peers and READs), plus the event counters.
The module-level functions own the one runtime of the process: ``configure`` (before
first use), ``runtime()`` (made on first use), ``shutdown`` (registered with ``atexit``),
and the memory registration and CUDA stream settings.

Lifetime: one runtime per process, replaced only by a ``configure()`` before its NIXL
agent exists; after ``shutdown()`` the process cannot use the transport again. A forked
child inherits its parent's runtime and never shuts it down. Threads: the task thread,
``_ray_system`` and ``_ray_system_error`` (Ray's calls), the progress thread (reaping),
and any thread calling ``stats()``; ``_runtime_lock`` guards the module state, the
owners guard their own.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ray_rdt_pool._ray.collect import collect
from ray_rdt_pool._ray.conversions import put_conversions
from ray_rdt_pool._ray.directory import KVDirectory, ray_node_id
from ray_rdt_pool._ray.metadata import PoolFetch, PoolTransportMetadata
from ray_rdt_pool.config import Options, PoolConfig, from_env
from ray_rdt_pool.core.clock import SYSTEM_CLOCK, Clock
from ray_rdt_pool.core.mailbox import Mailbox
from ray_rdt_pool.core.selection import check_selection_count
from ray_rdt_pool.errors import (
    ConfigurationError,
    InvalidInputError,
    RdtPoolError,
    shut_down_error,
)
from ray_rdt_pool.nixl import backend as _nixl
from ray_rdt_pool.obs.events import Events
from ray_rdt_pool.receive.receiver import Receiver
from ray_rdt_pool.registry import Registry
from ray_rdt_pool.send.sender import Sender

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

    from ray_rdt_pool.obs.stats import TransportStats

logger = logging.getLogger(__name__)

def _nothing() -> None:
    """Stands in for a backend method a fake backend lacks."""


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
                 node_id: Callable[[], str | None] | None = None,
                 clock: Clock = SYSTEM_CLOCK,
                 signals_factory: Callable[[str], Any] | None = None) -> None:
        self.config = config
        self.clock = clock
        self.events = Events()
        self.events.source = self
        self._backend_factory = backend_factory or _nixl.NixlBackend
        self._backend: Any = None
        self._active: Callable[[], None] = _nothing  # the backend's active(), once made
        self._backend_lock = threading.Lock()
        self.agent_name = ""
        # The weight sync's signal endpoint and its mailbox, made on first use.
        self._signals_factory = signals_factory
        self._mailbox: Mailbox | None = None
        self.directory = directory if directory is not None else KVDirectory()
        self.registry = Registry(self.backend, self.directory,
                                 config.registration_cache_bytes, self.events, region_factory)
        node = node_id or ray_node_id
        self.sender = Sender(config, self.registry, self.events, lambda: self.agent_name,
                             self.directory, node, clock=clock)
        self.receiver = Receiver(config, self.registry, self.events, self.backend,
                                 self.directory, node, clock=clock)
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

    def current_mailbox(self) -> Mailbox | None:
        """The mailbox if one was made; creates nothing."""
        return self._mailbox

    def mailbox(self) -> Mailbox:
        """The process's signal endpoint (its own NIXL agent) and the mailbox that sorts
        its messages, created on first use (a weight sync's)."""
        box = self._mailbox
        if box is not None and not self.closed:
            return box
        with self._backend_lock:
            if self.closed or self._closing:
                raise self._gone()
            if self._mailbox is None:
                if self._signals_factory is not None:
                    make = self._signals_factory
                else:
                    from ray_rdt_pool.nixl.signals import NixlSignals

                    make = NixlSignals
                self._mailbox = Mailbox(make(_nixl.new_agent_name() + "-sig"), self.clock,
                                        lambda: self.events.add("signals_sent"))
            return self._mailbox

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
        process (with ``overflow=False``, every later put that needs them fails). Blocks that
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
        meta, wire = self.sender.put(obj_id, tensors, put_conversions())
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
        from ray_rdt_pool.memory.dtypes import empty_tensor, torch_dtype
        from ray_rdt_pool.memory.rebuild import copy_bytes
        from ray_rdt_pool.receive.targets import target_descs

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
            check_selection_count(selection, 0)
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
        return collect(self)

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
            mailbox, self._mailbox = self._mailbox, None
        if mailbox is not None and first:
            try:
                mailbox.endpoint.close()
            except Exception:
                logger.debug("closing the signal endpoint failed", exc_info=True)
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
# The process's runtime
# ---------------------------------------------------------------------------------------

#: Longest a second shutdown() waits for the first one (another thread's) to finish.
SHUTDOWN_WAIT_S = 30.0

_runtime: Runtime | None = None  # replaced only by configure() before its agent exists
_runtime_lock = threading.Lock()
_config: PoolConfig | None = None
_atexit_registered = False
_configured = False  # configure() was called: later calls must agree with it
# set_cuda_stream()'s stream, for every runtime this process makes: a configure() after it
# replaces a runtime not started yet, and the setting must not go with it.
_cuda_stream: Any = None


def configure(**options: Unpack[Options]) -> PoolConfig:
    """Set this process's configuration before its first put or get.

    The options are ``ray_rdt_pool.configure()``'s (documented there); None leaves one
    unset. Accepted until the NIXL agent exists (``stats()`` does not create it); raises
    ``ConfigurationError`` after that if the values differ, and for an unknown option.
    """
    given = {k: v for k, v in options.items() if v is not None}
    global _config, _runtime, _configured
    with _runtime_lock:
        base = _config if _config is not None else from_env()
        new = base.with_overrides(**given)  # it refuses an unknown name, by name
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
                from ray_rdt_pool.memory.blocks import install_exit_hook

                install_exit_hook()  # atexit runs it last: after shutdown below
                atexit.register(shutdown)
                _atexit_registered = True
        return _runtime


def current() -> Runtime | None:
    """The process's runtime if one was made; creates nothing."""
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
    from ray_rdt_pool.memory.pack_pool import stop_pack_helpers

    stop_pack_helpers()


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
    # no registration).
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
    from ray_rdt_pool.memory.extent import storage_base

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

