"""The NIXL side of the transport: one agent per process, its lock, and its quiet progress.

Only this module and :mod:`ray_rdt_pool.transport` touch NIXL. Everything above it talks
to the small :class:`Backend` interface, which a fake can implement for unit tests of
the transport's logic (never for integration tests).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from ray_rdt_pool.errors import RegistrationError, TransferError

logger = logging.getLogger(__name__)

__all__ = ["Backend", "NixlBackend", "new_agent_name"]

Desc = tuple[int, int, int]


def new_agent_name() -> str:
    """A name unique per process incarnation, so a restarted actor is a new peer."""
    return f"rdtpool-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class Backend(Protocol):
    """What the transport needs from NIXL. All methods are thread-safe."""

    name: str

    def register(self, addr: int, nbytes: int, mem: str, dev: int) -> Any: ...
    def deregister(self, handle: Any) -> None: ...
    def metadata(self) -> bytes: ...
    def load_remote(self, md: bytes) -> str: ...
    def remove_remote(self, name: str) -> None: ...
    def start_read(self, local: Sequence[Desc], remote: Sequence[Desc], remote_name: str,
                   local_mem: str, remote_mem: str) -> Any: ...
    def state(self, xfer: Any) -> str: ...
    def release(self, xfer: Any) -> None: ...
    def add_tick(self, fn: Any) -> None: ...
    def close(self) -> None: ...


def _dlist(agent: Any, descs: Sequence[Desc], mem: str) -> Any:
    if len(descs) > 64:
        import numpy as np

        # NIXL builds an Nx3 array in C; a list of tuples is converted in Python.
        return agent.get_xfer_descs(np.array(descs, dtype=np.uint64), mem)
    return agent.get_xfer_descs(list(descs), mem)


class NixlBackend:
    """A NIXL agent with UCX, its progress thread replaced by a sleeping one.

    NIXL's own progress thread polls with no delay and burns a whole core while idle.
    One-sided READs here complete inside ``transfer()`` once two agents are connected,
    but the connection itself needs the *target* to progress its UCX worker. So the
    agent runs without NIXL's thread, and a daemon thread of ours progresses it every
    ``interval_s`` (a few ms), which costs a few percent of a core.

    Every NIXL call goes through one re-entrant lock: the agent is used from Ray's task
    thread, ``_ray_system`` and ``_ray_system_error``, and NIXL's default sync mode
    does no locking of its own.
    """

    def __init__(self, name: str, interval_s: float) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as e:  # ImportError, or a broken CUDA probe inside nixl
            raise RegistrationError(
                f"NIXL is not usable in this process ({type(e).__name__}: {e}); install "
                "it with `pip install nixl` on every node that sends or receives nixl_pool "
                "objects"
            ) from e
        from ray_rdt_pool.logs import quiet_nixl_stdout

        quiet_nixl_stdout()  # NIXL's logger prints INFO lines to stdout per agent
        try:
            self._agent = nixl_agent(
                name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as e:
            raise RegistrationError(
                f"could not create the NIXL agent {name!r} with the UCX backend: {e}"
            ) from e
        self.name = name
        self.lock = threading.RLock()
        self._interval = interval_s
        self._ticks: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._progress_loop, name="ray_rdt_pool-progress", daemon=True)
        self._thread.start()

    def add_tick(self, fn: Any) -> None:
        """Call ``fn()`` on the progress thread after every progress call."""
        self._ticks.append(fn)

    def _progress_loop(self) -> None:
        while not self._stop.wait(self._interval):
            if sys.is_finalizing():
                return  # a binding call now could re-take the GIL during finalization
            # Skip a beat rather than queue behind a long transfer.
            if self.lock.acquire(blocking=False):
                try:
                    self._agent.get_new_notifs()
                except Exception:  # a dying peer must not kill the progress thread
                    logger.debug("NIXL progress call failed", exc_info=True)
                finally:
                    self.lock.release()
            for tick in self._ticks:
                try:
                    tick()
                except Exception:
                    logger.debug("progress tick failed", exc_info=True)

    def register(self, addr: int, nbytes: int, mem: str, dev: int) -> Any:
        try:
            with self.lock:
                return self._agent.register_memory([(addr, nbytes, dev, "")], mem)
        except Exception as e:
            hint = ""
            alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower()
            if mem == "VRAM" and "expandable_segments:true" in alloc_conf:
                hint = (" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is set: memory from "
                        "expandable segments cannot be registered for RDMA; unset it.")
            raise RegistrationError(
                f"NIXL could not register {nbytes:,} bytes of {mem} memory at {addr:#x} "
                f"(device {dev}): {e}.{hint}"
            ) from e

    def deregister(self, handle: Any) -> None:
        with self.lock:
            self._agent.deregister_memory(handle)

    def metadata(self) -> bytes:
        with self.lock:
            return bytes(self._agent.get_agent_metadata())

    def load_remote(self, md: bytes) -> str:
        with self.lock:
            name = self._agent.add_remote_agent(md)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        with self.lock:
            self._agent.remove_remote_agent(name)

    def start_read(self, local: Sequence[Desc], remote: Sequence[Desc], remote_name: str,
                   local_mem: str, remote_mem: str) -> Any:
        with self.lock:
            ldl = _dlist(self._agent, local, local_mem)
            rdl = _dlist(self._agent, remote, remote_mem)
            handle = self._agent.initialize_xfer("READ", ldl, rdl, remote_name, b"")
            try:
                state = self._agent.transfer(handle)
            except Exception:
                self._agent.release_xfer_handle(handle)
                raise
            if state == "ERR":
                self._agent.release_xfer_handle(handle)
                raise TransferError(f"NIXL refused to post a READ from {remote_name}")
            return handle

    def state(self, xfer: Any) -> str:
        with self.lock:
            return str(self._agent.check_xfer_state(xfer))

    def release(self, xfer: Any) -> None:
        with self.lock:
            self._agent.release_xfer_handle(xfer)

    def close(self) -> None:
        """Stop the progress thread and destroy the agent; safe to call twice.

        Runs from ``ray_rdt_pool.shutdown()`` (also registered with ``atexit``), before
        the interpreter finalizes: a thread still inside a NIXL binding at finalization
        re-takes the GIL and aborts the process.
        """
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 20 * self._interval))
        self._ticks = []
        with self.lock:
            agent, self._agent = getattr(self, "_agent", None), None
        del agent  # the agent's destructor closes its UCX workers here, not at exit
