"""An in-process stand-in for NIXL, for unit tests of the transport's logic only.

Integration tests use real NIXL; this fake exists to make failure paths deterministic
(stalled, failed and aborted READs, stale metadata) and to *check* the transport's
discipline: every READ must touch only memory registered on both sides as the reader
last loaded it, and no remote agent may be removed while a READ from it is in flight.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Xfer:
    local: list[tuple[int, int, int]]
    remote: list[tuple[int, int, int]]
    remote_name: str
    state: str = "PROC"
    released: bool = False


@dataclass
class World:
    """All fake agents of one test, plus the GCS-like directory they publish to."""

    agents: dict[str, FakeBackend] = field(default_factory=dict)
    kv: dict[str, tuple[int, int, bytes]] = field(default_factory=dict)
    #: what new READs do: "DONE" (copy at once), "PROC" (stall), "ERR" (fail)
    mode: str = "DONE"
    violations: list[str] = field(default_factory=list)

    def factory(self, name: str, interval: float) -> FakeBackend:
        b = FakeBackend(self, name)
        self.agents[name] = b
        return b

    # the directory interface of transport.KVDirectory
    def publish(self, name: str, version: int, reset_version: int, md: bytes) -> None:
        self.kv[name] = (version, reset_version, md)

    def lookup(self, name: str) -> tuple[int, int, bytes] | None:
        return self.kv.get(name)

    def remove(self, name: str) -> None:
        self.kv.pop(name, None)


class FakeBackend:
    """Implements ray_rdt_pool._nixl.Backend by memmove inside one process."""

    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.name = name
        self.lock = threading.RLock()
        self._ids = itertools.count(1)
        self.regions: dict[int, tuple[int, int]] = {}
        self.loaded: dict[str, list[tuple[int, int]]] = {}
        self.xfers: dict[int, _Xfer] = {}
        self.removed: list[str] = []
        self.registrations = 0

    def register(self, addr: int, nbytes: int, mem: str, dev: int) -> Any:
        h = next(self._ids)
        self.regions[h] = (addr, nbytes)
        self.registrations += 1
        return h

    def deregister(self, handle: Any) -> None:
        del self.regions[handle]

    def metadata(self) -> bytes:
        return repr((self.name, sorted(self.regions.values()))).encode()

    def load_remote(self, md: bytes) -> str:
        import ast

        name, regions = ast.literal_eval(md.decode())
        # A re-load adds sections; dropping them takes remove_remote (as in NIXL).
        self.loaded[name] = sorted(set(self.loaded.get(name, [])) | set(regions))
        return name

    def remove_remote(self, name: str) -> None:
        busy = [x for x in self.xfers.values() if x.remote_name == name and not x.released]
        if busy:
            self.world.violations.append(f"removed {name} with {len(busy)} READs in flight")
        self.loaded.pop(name, None)
        self.removed.append(name)

    @staticmethod
    def _inside(addr: int, n: int, regions: Any) -> bool:
        return any(a <= addr and addr + n <= a + m for a, m in regions)

    def start_read(self, local: Any, remote: Any, remote_name: str, local_mem: str,
                   remote_mem: str) -> Any:
        if remote_name not in self.loaded:
            raise RuntimeError(f"NIXL_ERR_NOT_FOUND: remote agent {remote_name} not loaded")
        for a, n, _ in local:
            if not self._inside(a, n, self.regions.values()):
                self.world.violations.append(f"local desc {a:#x}+{n} not registered")
        for a, n, _ in remote:
            if not self._inside(a, n, self.loaded[remote_name]):
                raise RuntimeError(f"NIXL_ERR_NOT_FOUND: remote desc {a:#x}+{n}")
        h = next(self._ids)
        x = self.xfers[h] = _Xfer(list(local), list(remote), remote_name)
        if self.world.mode == "DONE":
            self.complete(h)
        elif self.world.mode == "ERR":
            x.state = "ERR"
        return h

    def complete(self, h: int) -> None:
        x = self.xfers[h]
        for (la, n, _), (ra, m, _) in zip(x.local, x.remote):
            assert n == m
            ctypes.memmove(la, ra, n)
        x.state = "DONE"

    def state(self, xfer: Any) -> str:
        return self.xfers[xfer].state

    def release(self, xfer: Any) -> None:
        self.xfers[xfer].released = True

    def in_flight(self) -> list[int]:
        return [h for h, x in self.xfers.items() if not x.released]

    def close(self) -> None:
        pass
