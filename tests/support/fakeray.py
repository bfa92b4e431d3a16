"""A stand-in for Ray that runs weight syncs in one process (no cluster).

Each :class:`Handle` is an actor: its own thread runs its ``__ray_call__`` calls one
at a time, in order, as a plain actor runs them, with a signal endpoint of its own (as
its own process would have); Ray's ``get``, ``wait`` and ``cancel`` wait on those
threads. The transport is one ``Runtime`` over the fake NIXL of
:mod:`ray_rdt_pool.testing` (``same_node="off"``: every bucket is READ), shared by the
test (the trainer) and every actor. Tests stage interleavings and failures that real Ray
makes hard to hit on demand.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import ray_rdt_pool._ray.runtime as T
from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.config import PoolConfig
from ray_rdt_pool.core.mailbox import Mailbox
from ray_rdt_pool.testing import World
from ray_rdt_pool.weights import WeightReceiver, links


class _Ref:
    """A call's result, once its actor's thread ran it: its value or its error."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


def _get(ref: Any, timeout: float | None = None) -> Any:
    if isinstance(ref, list):
        return [_get(r, timeout) for r in ref]
    if not isinstance(ref, _Ref):
        return ref  # a manifest bucket's "ref" is its tensor list
    if not ref.done.wait(30.0 if timeout is None else timeout):
        from ray.exceptions import GetTimeoutError

        raise GetTimeoutError("the call has not ended")
    if ref.error is not None:
        raise ref.error
    return ref.value


def _wait(refs: list[Any], num_returns: int = 1, timeout: float | None = None
          ) -> tuple[list[Any], list[Any]]:
    deadline = time.monotonic() + (30.0 if timeout is None else timeout)
    while True:
        ready = [r for r in refs if not isinstance(r, _Ref) or r.done.is_set()]
        if len(ready) >= num_returns or time.monotonic() >= deadline:
            ready = ready[:num_returns]
            return ready, [r for r in refs if not any(r is x for x in ready)]
        time.sleep(0.001)


class Actor:
    """An actor instance: holds a ``weight_receiver``."""

    weight_receiver: WeightReceiver


def receiver_node(dest: Any, cls: type[WeightReceiver] = WeightReceiver, **opts: Any
                  ) -> tuple[Actor, Handle]:
    """An actor holding ``cls(dest, **opts)``, and its handle."""
    a = Actor()
    a.weight_receiver = cls(dest, **opts)
    return a, Handle(a)


_WORLD: list[World] = []  # the fake NIXL world of the test running now
_HANDLES: list[Handle] = []  # the actors of the test running now


class Handle:
    """An actor handle: ``__ray_call__.remote(fn, *args)`` queues ``fn(actor, *args)`` on
    the actor's own thread, which runs its calls one at a time, in order, as a plain
    actor does, with a signal endpoint of its own (as its own process would have).
    ``busy()`` holds every call from then on until ``free()``: an actor stuck in a long
    method."""

    _count = 0

    def __init__(self, actor: Actor) -> None:
        Handle._count += 1
        n = Handle._count
        self._actor_id = type("Id", (), {"hex": lambda self: f"{n:032x}"})()
        self.actor = actor
        world = _WORLD[-1] if _WORLD else World()
        self.mailbox = Mailbox(world.signals(f"actor-{n}"))
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._free = threading.Event()
        self._free.set()
        self.hold: Callable[[str], bool] = lambda name: False  # calls that wait for free()
        threading.Thread(target=self._serve, daemon=True, name=f"actor-{n}").start()
        _HANDLES.append(self)
        handle = self

        class Call:
            @staticmethod
            def remote(fn: Callable[..., Any], *args: Any) -> _Ref:
                # Ray pickles a task's arguments: the receiver gets its own lists.
                copied = tuple(list(a) if isinstance(a, list) else a for a in args)
                ref = _Ref()
                handle._jobs.put((fn, copied, ref))
                return ref

        self.__ray_call__ = Call

    def busy(self, hold: Callable[[str], bool] = lambda name: True) -> None:
        """Calls for which ``hold(function name)`` is true wait for :meth:`free`."""
        self.hold = hold
        self._free.clear()

    def free(self) -> None:
        self._free.set()

    def stop(self) -> None:
        """End the actor's thread once its queued calls ran."""
        self._free.set()
        self._jobs.put(None)

    def _serve(self) -> None:
        links.bind(self.mailbox)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, ref = job
            if self.hold(fn.__name__):
                self._free.wait()
            try:
                ref.value = fn(self.actor, *args)
            except BaseException as e:
                ref.error = e
            ref.done.set()


def make_runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Runtime]]:
    """For a fixture: yields ``make(**config)``, this process's transport over the fake
    NIXL, with Ray's ``get`` and ``wait`` standing in for the actors' threads."""
    import ray

    monkeypatch.setattr(ray, "get", _get)
    monkeypatch.setattr(ray, "wait", _wait)
    monkeypatch.setattr(ray, "cancel", lambda ref: None)
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: type("Ctx", (), {"get_node_id": lambda self: "n1"})())
    made: list[Runtime] = []

    def make(**cfg: Any) -> Runtime:
        cfg.setdefault("pool_bytes", 1 << 20)
        cfg.setdefault("arena_bytes", 1 << 20)
        world = World()
        _WORLD.append(world)
        rt = Runtime(PoolConfig(metrics=False, same_node="off", **cfg),
                     backend_factory=world.factory, directory=world, node_id=lambda: "n1",
                     signals_factory=world.signals)
        monkeypatch.setattr(T, "_runtime", rt)
        made.append(rt)
        return rt

    yield make
    while _HANDLES:
        _HANDLES.pop().stop()
    for rt in made:
        rt.shutdown()
    _WORLD.clear()
