"""A fake NIXL for tests: :class:`World` and its :class:`FakeBackend` agents.

:class:`FakeBackend` implements :class:`ray_rdt_pool.nixl.protocol.Backend` by ``memmove``
inside one process, the way httpx's ``MockTransport`` stands in for a network: the
owners (registry, sender, receiver) run against it with no Ray cluster and no NIXL.
Use it for tests of the transport's logic only; integration tests use real NIXL. It
exists to make failure paths deterministic and to *check* the transport's discipline,
so it models what real NIXL may do, not what is convenient. Every fault is staged on
the :class:`World`:

* ``mode = "PROC"``: a READ stalls, in flight until the test calls
  :meth:`FakeBackend.complete` (its bytes land then: a *late write* if it was given up
  on) or :meth:`FakeBackend.fail`. ``mode = "ERR"``: a READ fails once posted.
  ``mode = "STUCK"``: the post fails part-way (a part of the READ started and could be
  neither cancelled nor cut off): ``start_read`` raises
  :class:`~ray_rdt_pool.errors.ReadStillRunningError` carrying its handle, which stalls.
* ``cancel = "fail"`` (the default, as NIXL documents for a transfer that cannot be
  cancelled): releasing a READ still in flight raises and the handle stays valid, so
  the READ may still complete and write later. With ``"ok"`` the cancel succeeds and
  nothing is written.
* ``release_errors``: releasing even an ended handle raises; ``remove_errors``:
  removing a remote agent raises and leaves its READs running.
* Loading an agent's metadata again *merges* its sections, as NIXL does; only
  ``remove_remote`` drops them, and it ends every READ from that agent with ERR. A
  section names its registration: one the remote agent has deregistered since stays in
  the merged view (stale), and a READ whose remote bytes overlap a stale section is a
  violation (NIXL may resolve it to that registration), even when memory registered
  anew covers the same bytes.
* Read lanes: a backend made with ``lanes=K > 1`` decides to split a READ as the real
  one does (``split=True`` and at least ``split_bytes``) and then calls ``on_split``,
  but still moves the bytes as one READ with one handle, so every fault above applies
  unchanged. A split READ into memory not registered with ``lanes=True`` is a violation
  (the extra lanes could not write there).

Violations the transport must never commit are collected in ``World.violations``: a
READ touching memory not registered (locally) or not loaded (remotely), a READ
completing or polled after its handle was released; a late write into memory that is
no longer that READ's shows in the bytes, which the tests check.

A :class:`World` is also the agents' directory (the GCS-like store the real transport
publishes metadata to), so the owners take it as their ``directory``. With the owners::

    >>> import torch
    >>> from ray_rdt_pool.config import PoolConfig
    >>> from ray_rdt_pool.obs.events import Events
    >>> from ray_rdt_pool.receive.receiver import Receiver
    >>> from ray_rdt_pool.registry import Registry
    >>> from ray_rdt_pool.send.sender import Sender
    >>> from ray_rdt_pool.testing import World
    >>> world = World()
    >>> config = PoolConfig().with_overrides(pool_bytes=1 << 20, arena_bytes=1 << 20,
    ...                                      metrics=False)
    >>> def process(name):  # one process's owners, on its own fake agent
    ...     backend = world.factory(name, 0.01)
    ...     events = Events()
    ...     registry = Registry(lambda: backend, world, config.registration_cache_bytes,
    ...                         events)
    ...     return (Sender(config, registry, events, lambda: name, world),
    ...             Receiver(config, registry, events, lambda: backend, world))
    >>> sender, _ = process("sender")
    >>> _, receiver = process("receiver")
    >>> meta, _wire = sender.put("obj-1", [torch.arange(6)])
    >>> receiver.wait(receiver.fetch("obj-1", meta, "cpu", None), 5.0)
    [tensor([0, 1, 2, 3, 4, 5])]

    Stage a fault: the next READ stalls, and its cancel is refused.

    >>> world.mode = "PROC"
    >>> meta, _wire = sender.put("obj-2", [torch.ones(3)])
    >>> receiver.wait(receiver.fetch("obj-2", meta, "cpu", None), 0.1)
    Traceback (most recent call last):
    ...
    TimeoutError: READ of object obj-2 from sender not done within the caller's timeout of 0.100s
    >>> [late] = world.agents["receiver"].in_flight()
    >>> world.agents["receiver"].complete(late)  # the late write lands in memory kept for it
    >>> world.violations
    []

``tests/unit/_ray/test_runtime_logic.py`` does the same through the runtime:
``Runtime(config, backend_factory=world.factory, directory=world)``. Pass
``clock=FakeClock()`` as well to drive the transport's deadlines (overflow linger,
``fetch_timeout_s``, idle peers) with :meth:`FakeClock.advance` instead of sleeping.

Imports no torch, Ray or NIXL at import; a READ's bytes move with ``memmove`` (torch
only for device memory). Thread-safe only as far as the tests need: each test drives
one world.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray_rdt_pool.nixl.protocol import Backend

__all__ = ["FakeBackend", "FakeClock", "FakeSignals", "World"]


class FakeClock:
    """A :class:`ray_rdt_pool.core.clock.Clock` that moves only when told: by
    :meth:`advance`, or by :meth:`sleep`, which moves it by the time slept at once (so
    a wait for a deadline on it takes no wall time). Thread-safe."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` (>= 0) forward."""
        if not seconds >= 0:
            raise ValueError(f"a clock moves forward only, not by {seconds!r} seconds")
        with self._lock:
            self._now += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(max(seconds, 0.0))
        time.sleep(0)  # let the other threads run, as a real sleep would


@dataclass
class _Xfer:
    """One posted READ of a :class:`FakeBackend`."""

    local: list[tuple[int, int, int]]
    remote: list[tuple[int, int, int]]
    remote_name: str
    state: str = "PROC"
    released: bool = False
    devices: tuple[str, str] = ("cpu", "cpu")  # (local, remote): memmove reaches host only


_DEVICE = {"DRAM": "cpu", "VRAM": "cuda"}


@dataclass
class World:
    """All fake agents of one test, the faults their READs stage, and the GCS-like
    directory they publish to (pass it as the owners' ``directory``).

    Set a fault field at any time: it applies to what the agents do from then on."""

    #: every agent made by :meth:`factory`, by name
    agents: dict[str, FakeBackend] = field(default_factory=dict)
    #: published agent metadata: name -> (version, reset version, metadata)
    kv: dict[str, tuple[int, int, bytes]] = field(default_factory=dict)
    #: same-node entries of senders (transport.KVDirectory.publish_host)
    hosts: dict[str, bytes] = field(default_factory=dict)
    #: what new READs do: "DONE" (copy at once), "PROC" (stall), "ERR" (fail), or
    #: "STUCK": the post fails, but a part of the READ started and could be neither
    #: cancelled nor cut off (ReadStillRunningError carrying its handle, as the real
    #: backend raises); it stalls like "PROC"
    mode: str = "DONE"
    #: releasing a READ still in flight: "fail" (cannot cancel; it may write later) or "ok"
    cancel: str = "fail"
    #: release() of any handle raises (models errors on release)
    release_errors: bool = False
    #: remove_remote() raises and changes nothing (the agent stays, its READs run on)
    remove_errors: bool = False
    #: what the transport did that real NIXL could punish (see the module doc)
    violations: list[str] = field(default_factory=list)
    #: remote agents removed while READs from them were in flight (a deliberate cut-off)
    cuts: list[str] = field(default_factory=list)
    #: every signal endpoint made by :meth:`signals`, by name
    endpoints: dict[str, FakeSignals] = field(default_factory=dict)
    #: signals to endpoints in this set are lost (a peer that is gone: no error)
    lost: set[str] = field(default_factory=set)

    def factory(self, name: str, interval: float, lanes: int = 1,
                split_bytes: int = 8 << 20, on_split: Any = None,
                **_ignored: Any) -> FakeBackend:
        """A new agent named ``name``; the signature of
        :class:`~ray_rdt_pool.nixl.backend.NixlBackend`, so it is a runtime's
        ``backend_factory`` (``interval`` and the other tuning arguments are ignored)."""
        b = FakeBackend(self, name, lanes=lanes, split_bytes=split_bytes, on_split=on_split)
        self.agents[name] = b
        return b

    def signals(self, name: str) -> FakeSignals:
        """A new signal endpoint named ``name`` (a runtime's ``signals_factory``)."""
        e = FakeSignals(self, name)
        self.endpoints[name] = e
        return e

    # The directory interface of the runtime's KVDirectory.
    def publish(self, name: str, version: int, reset_version: int, md: bytes) -> None:
        self.kv[name] = (version, reset_version, md)

    def lookup(self, name: str) -> tuple[int, int, bytes] | None:
        return self.kv.get(name)

    def remove(self, name: str) -> None:
        self.kv.pop(name, None)
        self.hosts.pop(name, None)

    def publish_host(self, name: str, info: bytes) -> None:
        self.hosts[name] = info

    def lookup_host(self, name: str) -> bytes | None:
        return self.hosts.get(name)


class FakeBackend:
    """One fake agent: implements :class:`~ray_rdt_pool.nixl.protocol.Backend` by
    ``memmove`` inside one process, with the faults its :class:`World` stages.

    Besides the protocol, a test drives it with :meth:`complete`, :meth:`fail`,
    :meth:`tick` and :meth:`in_flight`, and may read what it holds: ``regions``
    (registration id -> (address, bytes)), ``loaded`` (remote agent -> its sections),
    ``xfers`` (READ handle -> the READ), ``removed`` (remote agents removed, in order),
    ``registrations`` (how many ``register`` calls) and ``splits`` (READs the real
    backend would have split)."""

    def __init__(self, world: World, name: str, lanes: int = 1, split_bytes: int = 8 << 20,
                 on_split: Any = None) -> None:
        self.world = world
        self.name = name
        self.lanes = lanes
        self.split_bytes = split_bytes
        self.on_split = on_split
        self.lane_handles: set[int] = set()  # registrations made with lanes=True
        self.splits = 0  # READs that the real backend would have split
        self.lock = threading.RLock()
        self._ids = itertools.count(1)
        self.regions: dict[int, tuple[int, int]] = {}
        # remote agent -> its sections as loaded: (registration id, address, bytes)
        self.loaded: dict[str, list[tuple[int, int, int]]] = {}
        self.xfers: dict[int, _Xfer] = {}
        self.removed: list[str] = []
        self.registrations = 0
        self.ticks: list[Any] = []
        self.closed = False  # close() ran: READs write nothing any more

    def register(self, addr: int, nbytes: int, mem: str, dev: int, lanes: bool = False) -> Any:
        h = next(self._ids)
        self.regions[h] = (addr, nbytes)
        if lanes:
            self.lane_handles.add(h)
        self.registrations += 1
        return h

    def deregister(self, handle: Any) -> None:
        del self.regions[handle]
        self.lane_handles.discard(handle)

    def add_tick(self, fn: Any) -> None:
        self.ticks.append(fn)

    def tick(self) -> None:
        """What the progress thread does every interval (tests call it by hand)."""
        for fn in self.ticks:
            fn()

    def metadata(self) -> bytes:
        return repr((self.name, sorted((a, n, h) for h, (a, n) in self.regions.items()))
                    ).encode()

    def load_remote(self, md: bytes) -> str:
        import ast

        name, regions = ast.literal_eval(md.decode())
        # A re-load adds sections; dropping them takes remove_remote (as in NIXL).
        sections = {(h, a, n) for a, n, h in regions}
        self.loaded[name] = sorted(set(self.loaded.get(name, [])) | sections)
        return name

    def remove_remote(self, name: str) -> None:
        if self.world.remove_errors:
            raise RuntimeError(f"NIXL_ERR_BACKEND: removing {name} failed")
        busy = [x for x in self.xfers.values()
                if x.remote_name == name and not x.released and x.state == "PROC"]
        if busy:
            self.world.cuts.append(name)
            for x in busy:
                x.state = "ERR"  # removing the agent ends its READs
        self.loaded.pop(name, None)
        self.removed.append(name)

    @staticmethod
    def _inside(addr: int, n: int, regions: Any) -> bool:
        return any(a <= addr and addr + n <= a + m for a, m in regions)

    def start_read(self, local: Any, remote: Any, remote_name: str, local_mem: str,
                   remote_mem: str, split: bool = False) -> Any:
        if remote_name not in self.loaded:
            raise RuntimeError(f"NIXL_ERR_NOT_FOUND: remote agent {remote_name} not loaded")
        for a, n, _ in local:
            if not self._inside(a, n, self.regions.values()):
                self.world.violations.append(f"local desc {a:#x}+{n} not registered")
        view = self.loaded[remote_name]
        for a, n, _ in remote:
            if not self._inside(a, n, [(s, m) for _h, s, m in view]):
                raise RuntimeError(f"NIXL_ERR_NOT_FOUND: remote desc {a:#x}+{n}")
        owner = self.world.agents.get(remote_name)
        if owner is not None:
            stale = [(s, m) for h, s, m in view if h not in owner.regions]
            for a, n, _ in remote:
                if any(s < a + n and a < s + m for s, m in stale):
                    self.world.violations.append(
                        f"remote desc {a:#x}+{n} overlaps a section of {remote_name} "
                        "deregistered since this view loaded it")
        if split and self.lanes > 1 and sum(n for _a, n, _d in local) >= self.split_bytes:
            laned = [self.regions[h] for h in self.lane_handles]
            for a, n, _ in local:
                if not self._inside(a, n, laned):
                    self.world.violations.append(
                        f"split READ into {a:#x}+{n}, not registered with every lane")
            self.splits += 1
            if self.on_split is not None:
                self.on_split()
        h = next(self._ids)
        x = self.xfers[h] = _Xfer(list(local), list(remote), remote_name,
                                  devices=(_DEVICE[local_mem], _DEVICE[remote_mem]))
        if self.world.mode == "DONE":
            self.complete(h)
        elif self.world.mode == "ERR":
            x.state = "ERR"
        elif self.world.mode == "STUCK":
            from ray_rdt_pool.errors import ReadStillRunningError

            raise ReadStillRunningError("NIXL_ERR_BACKEND: post failed, a part runs on", h)
        return h

    def complete(self, h: int) -> None:
        """The READ finishes now: its bytes land (late, if it was given up on)."""
        x = self.xfers[h]
        if x.state != "PROC" or self.closed:
            return
        if x.released:
            self.world.violations.append(f"READ {h} completed after its handle was released")
        import torch

        # Without a GPU, tests that fake a "cuda" arena back it with host memory.
        if x.devices == ("cpu", "cpu") or not torch.cuda.is_available():
            for (la, n, _), (ra, m, _) in zip(x.local, x.remote):
                assert n == m
                ctypes.memmove(la, ra, n)
        else:  # device memory on either side (the gpu tests): a torch copy
            from ray_rdt_pool.memory.blocks import device_block

            (ld, rd) = x.devices
            for (la, n, li), (ra, m, ri) in zip(x.local, x.remote):
                assert n == m
                device_block(la, n, ld, li, None).copy_(device_block(ra, m, rd, ri, None))
            torch.cuda.synchronize()
        x.state = "DONE"

    def fail(self, h: int) -> None:
        """The READ ``h`` fails now (state ``ERR``); nothing of it lands."""
        self.xfers[h].state = "ERR"

    def state(self, xfer: Any) -> str:
        x = self.xfers[xfer]
        if x.released:
            self.world.violations.append(f"state of READ {xfer} asked after its release")
            raise RuntimeError("NIXL_ERR_INVALID_PARAM: released handle")
        return x.state

    def release(self, xfer: Any) -> None:
        x = self.xfers[xfer]
        if x.released:
            raise RuntimeError("NIXL_ERR_INVALID_PARAM: handle released twice")
        if x.state == "PROC" and self.world.cancel == "fail":
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: transfer in progress, cannot cancel")
        if self.world.release_errors:  # the handle stays valid, as NIXL documents
            raise RuntimeError("NIXL_ERR_BACKEND: release failed")
        if x.state == "PROC":
            x.state = "CANCELLED"
        x.released = True

    def in_flight(self) -> list[int]:
        """Handles of READs not released yet (running or ended)."""
        return [h for h, x in self.xfers.items() if not x.released]

    def close(self) -> None:
        # The agent is destroyed: its READs make no progress and write nothing any more.
        self.closed = True


if TYPE_CHECKING:
    def _implements_the_protocol(b: FakeBackend) -> Backend:
        return b  # mypy checks here that FakeBackend is a Backend


class FakeSignals:
    """One fake signal endpoint: implements :class:`~ray_rdt_pool.nixl.protocol.Signals`
    inside one process. A message lands in the destination's queue at once, in order; to
    an endpoint in ``World.lost`` or one that closed, it is lost without an error, as
    NIXL loses a notification to a peer that died. Sending to a name never connected
    raises, as NIXL does (``NIXL_ERR_NOT_FOUND``)."""

    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.name = name
        self.sent = 0  #: messages sent, for tests
        self._lock = threading.Lock()
        self._queue: list[tuple[str, bytes]] = []
        self._peers: set[str] = set()
        self.closed = False

    def metadata(self) -> bytes:
        return self.name.encode()

    def connect(self, md: bytes) -> str:
        name = bytes(md).decode()
        with self._lock:
            self._peers.add(name)
        return name

    def send(self, name: str, msg: bytes) -> None:
        with self._lock:
            if self.closed:
                raise RuntimeError(f"signal endpoint {self.name} is closed")
            if name not in self._peers:
                raise RuntimeError(f"NIXL_ERR_NOT_FOUND: {name} was never connected")
            self.sent += 1
        dest = self.world.endpoints.get(name)
        if dest is None or name in self.world.lost:
            return
        with dest._lock:
            if not dest.closed:
                dest._queue.append((self.name, bytes(msg)))

    def poll(self) -> list[tuple[str, bytes]]:
        with self._lock:
            out, self._queue = self._queue, []
        return out

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._queue = []
