"""The small interface the owners (registry, sender, receiver) use to reach NIXL.

Owns nothing: the protocol and its contract only. :class:`~.backend.NixlBackend` implements
it over real NIXL agents; :class:`ray_rdt_pool.testing.FakeBackend` implements it in one
process and can stage each fault the contract allows (tests/unit/nixl/test_backend_contract.py runs
the same checks against both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["Backend", "Desc", "Signals"]

#: One descriptor: (address, length in bytes, device index).
Desc = tuple[int, int, int]


class Backend(Protocol):
    """One process's NIXL agent(s), as the owners use them. Every method is thread-safe.

    The contract each method honours, and what real NIXL may do within it:

    * ``register(addr, nbytes, mem, dev, lanes=False)``: make ``nbytes`` at ``addr``
      (``mem`` ``"DRAM"`` or ``"VRAM"``, device ``dev``) a READ's local side and readable
      by peers; returns an opaque handle. ``lanes``: register with every read lane too
      (a receive arena), so a READ into it may be split. Raises
      :class:`~ray_rdt_pool.errors.RegistrationError`, with nothing left registered.
    * ``deregister(handle)``: undo it (may raise). A peer that loaded this agent's
      metadata before keeps the section in its view until it removes the agent: a READ
      of those bytes may still resolve to the old registration, so owners never read a
      range through a view older than its registration.
    * ``metadata()``: bytes a peer passes to ``load_remote``: this agent's name and its
      registrations now.
    * ``load_remote(md)``: add a peer's metadata; returns its agent name. Loading the same
      agent again *merges* the new sections into the ones loaded before; only
      ``remove_remote`` drops them.
    * ``remove_remote(name)``: drop a peer and all its sections, which ends every READ
      from it (state ``"ERR"``). May raise and change nothing: its READs then run on.
    * ``start_read(local, remote, remote_name, local_mem, remote_mem, split=False)``: post
      a one-sided READ of paired descriptors (equal lengths) from a loaded peer into
      registered local memory; returns a handle for ``state`` and ``release``. ``split``:
      the local memory was registered with ``lanes=True``, so the READ may be cut into
      one part per lane. Raises when the post fails (peer not loaded, a remote range
      outside its loaded sections, a refused post): then nothing writes, unless it raises
      :class:`~ray_rdt_pool.errors.ReadStillRunningError`, whose ``running`` handle a
      part that started may still write through, until ``state`` says it ended.
    * ``state(xfer)``: ``"PROC"`` while the READ may still write, ``"DONE"`` once every
      byte landed, ``"ERR"`` once it failed and writes no more (any state but ``"PROC"``
      means nothing writes). A READ may stay ``"PROC"`` for good (a stalled peer). May
      raise, which the owners take as ``"ERR"``. Never asked after ``release``.
    * ``release(xfer)``: free the handle. On a READ still in flight it is a cancel, which
      NIXL may refuse: it raises, the handle stays valid, and the READ may still complete
      and write later (a *late write*). It may raise on an ended READ too; the handle
      then stays valid as well.
    * ``add_tick(fn)``: call ``fn()`` after each step of the agent's progress thread.
    * ``close()``: destroy the agent(s); no READ writes after it returns.
    """

    name: str

    def register(self, addr: int, nbytes: int, mem: str, dev: int,
                 lanes: bool = False) -> Any: ...
    def deregister(self, handle: Any) -> None: ...
    def metadata(self) -> bytes: ...
    def load_remote(self, md: bytes) -> str: ...
    def remove_remote(self, name: str) -> None: ...
    def start_read(self, local: Sequence[Desc], remote: Sequence[Desc], remote_name: str,
                   local_mem: str, remote_mem: str, split: bool = False) -> Any: ...
    def state(self, xfer: Any) -> str: ...
    def release(self, xfer: Any) -> None: ...
    def add_tick(self, fn: Callable[[], Any]) -> None: ...
    def close(self) -> None: ...


class Signals(Protocol):
    """One process's endpoint for small messages to other processes: the signals a weight
    sync's data plane runs on (NIXL notifications, on an agent of their own so that no
    peer bookkeeping of the transport's agent ever drops a signal peer). Every method is
    thread-safe. The contract, and what real NIXL may do within it:

    * ``metadata()``: bytes a peer passes to ``connect`` to send here.
    * ``connect(md)``: make that endpoint a destination of ``send``; returns its name.
      Connecting again is a no-op. The receiving side connects nothing to receive.
    * ``send(name, msg)``: queue ``msg`` for a connected peer. Messages from one sender
      arrive in order. A message to a peer that is gone is lost without an error (a
      peer's death is learnt elsewhere, from Ray). Raises for a name never connected.
    * ``poll()``: the messages that arrived since the last call, as ``(sender name,
      bytes)``; it also progresses the endpoint (connections being made). Never blocks.
    * ``close()``: destroy the endpoint; messages not yet polled are lost.
    """

    name: str

    def metadata(self) -> bytes: ...
    def connect(self, md: bytes) -> str: ...
    def send(self, name: str, msg: bytes) -> None: ...
    def poll(self) -> list[tuple[str, bytes]]: ...
    def close(self) -> None: ...
