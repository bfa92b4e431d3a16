"""NIXL notifications as the weight sync's signals: :class:`NixlSignals`, the real
:class:`~.protocol.Signals`.

One NIXL agent per process, made on a weight sync's first use and destroyed by
``ray_rdt_pool.shutdown()``. It registers no memory and has no progress thread: whoever
waits for a signal polls it (``get_new_notifs`` progresses its UCX worker). Kept apart
from the transport's agents (:mod:`.backend`), whose remote agents come and go with the
objects they read, so that no such removal ever drops a peer a sync still signals.

Threads: any; one lock guards the agent.
"""

from __future__ import annotations

import threading
from typing import Any

from ray_rdt_pool.errors import RegistrationError

__all__ = ["NixlSignals"]


class NixlSignals:
    """A process's signal endpoint over a NIXL agent (UCX active messages)."""

    def __init__(self, name: str) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as e:  # ImportError, or a broken CUDA probe inside nixl
            raise RegistrationError(
                f"NIXL is not usable in this process ({type(e).__name__}: {e}); a weight "
                "sync signals its buckets over NIXL: `pip install nixl` on every node") from e
        from ray_rdt_pool.obs.logs import quiet_nixl_stdout

        quiet_nixl_stdout()
        try:
            self._agent: Any = nixl_agent(
                name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as e:
            raise RegistrationError(
                f"could not create the NIXL signal agent {name!r}: {e}") from e
        self.name = name
        self._lock = threading.Lock()
        self._md: bytes | None = None

    def metadata(self) -> bytes:
        with self._lock:
            if self._md is None:
                self._md = bytes(self._agent.get_agent_metadata())
            return self._md

    def connect(self, md: bytes) -> str:
        with self._lock:
            name = self._agent.add_remote_agent(md)
        return name.decode() if isinstance(name, bytes) else str(name)

    def send(self, name: str, msg: bytes) -> None:
        with self._lock:
            self._agent.send_notif(name, msg)

    def poll(self) -> list[tuple[str, bytes]]:
        with self._lock:
            if self._agent is None:
                return []
            got = self._agent.get_new_notifs()
        out: list[tuple[str, bytes]] = []
        for sender, msgs in got.items():
            s = sender.decode() if isinstance(sender, bytes) else str(sender)
            out.extend((s, bytes(m)) for m in msgs)
        return out

    def close(self) -> None:
        with self._lock:
            agent, self._agent = self._agent, None
        del agent  # the destructor closes the UCX worker here, not at interpreter exit
