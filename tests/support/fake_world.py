"""Helpers for the in-process tests of the transport with the fake NIXL world
(:mod:`ray_rdt_pool.testing`): runtimes of one process that send to each other, the
metadata as the owner and the receiver see it, byte comparison, and the progress ticks
the fake backend does not run by itself. The ``world`` fixture is in tests/unit/conftest.py.
"""

from __future__ import annotations

import gc
import pickle
import threading
from typing import Any

import torch

from ray_rdt_pool._ray.metadata import PoolTransportMetadata
from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.config import PoolConfig
from ray_rdt_pool.core.clock import SYSTEM_CLOCK
from ray_rdt_pool.testing import World


def make(world: World, region_factory: Any = None, clock: Any = SYSTEM_CLOCK,
         **cfg: Any) -> Runtime:
    """A runtime of ``world`` with 1 MiB pool and arena, no metrics, and no Ray node."""
    cfg.setdefault("pool_bytes", 1 << 20)
    cfg.setdefault("arena_bytes", 1 << 20)
    cfg.setdefault("metrics", False)
    return Runtime(PoolConfig().with_overrides(**cfg), backend_factory=world.factory,
                   directory=world, region_factory=region_factory, clock=clock)


def make_on_node(world: World, node: str | None = "node-a", **cfg: Any) -> Runtime:
    """A runtime of ``world`` on Ray node ``node`` (same-node paths between runtimes of one
    node), with 4 MiB pool and arena and no metrics."""
    cfg.setdefault("pool_bytes", 4 << 20)
    cfg.setdefault("arena_bytes", 4 << 20)
    cfg.setdefault("metrics", False)
    return Runtime(PoolConfig(**cfg), backend_factory=world.factory, directory=world,
                   node_id=lambda: node)


def ship(meta: PoolTransportMetadata) -> PoolTransportMetadata:
    """What the owner and receiver see: the metadata after a pickle round trip."""
    return pickle.loads(pickle.dumps(meta))


def roundtrip(sender: Runtime, receiver: Runtime, obj_id: str, tensors: Any,
              targets: Any = None) -> Any:
    """``sender`` puts ``tensors``, ``receiver`` fetches and waits for them."""
    meta = ship(sender.put(obj_id, tensors))
    req = receiver.fetch(obj_id, meta, targets)
    return receiver.wait(req, -1)


def get(sender: Runtime, receiver: Runtime, obj_id: str, tensors: Any, targets: Any = None,
        sel: Any = None) -> Any:
    """:func:`roundtrip`, or with ``sel`` a partial read (``fetch_selected``)."""
    meta = ship(sender.put(obj_id, tensors))
    if sel is not None:
        return receiver.fetch_selected(obj_id, meta, sel, None)
    return receiver.wait(receiver.fetch(obj_id, meta, targets), -1)


def settle(*rts: Runtime) -> None:
    """What the progress threads do on their ticks (the fake backend has none)."""
    gc.collect()
    for rt in rts:
        rt.receiver.reap()
    for rt in rts:
        rt.sender.reap()


def same(a: Any, b: Any) -> bool:
    """The same tensors, byte for byte, with the same dtypes and shapes."""
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8))
        for x, y in zip(a, b)) and len(a) == len(b)


class Gate(threading.Event):
    """Holds stalled GCS lookups; ``entered`` is set once one waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()


def stall_lookups(world: World) -> tuple[Gate, Any]:
    """Make every metadata lookup of ``world`` wait on the returned gate (set it to let
    them through); returns the gate and the real lookup, to put back."""
    gate, real = Gate(), world.lookup

    def slow_lookup(name: str) -> Any:
        gate.entered.set()
        gate.wait(10)
        return real(name)

    world.lookup = slow_lookup  # type: ignore[method-assign]
    return gate, real


def fetch_stalled(r: Runtime, meta: PoolTransportMetadata, gate: Gate
                  ) -> tuple[list[Any], threading.Thread]:
    """Fetch ``meta`` on a thread until its lookup waits on ``gate``; returns the list
    its result lands in and the thread."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(r.wait(r.fetch("a", meta, None), -1)))
    t.start()
    assert gate.entered.wait(10)
    return out, t
