"""The test actors of the cluster modules: one sender and one receiver of nixl_pool objects.

Plain classes: a module makes its actor class with ``ray.remote`` over one of them, with
its settings (``runtime_env``), resources and concurrency, and adds the methods only it
needs (or overrides one whose meaning differs there)::

    @ray.remote(enable_tensor_transport=True, runtime_env=actor_env(ENV))
    class Sender(actors.Sender):
        def put_odd(self): ...

Each registers the transport in its ``__init__`` (Ray registers it on the actor
asynchronously, so a put there could otherwise come first) and takes ``configure()``
options: ``Sender.remote(pool_bytes=4 << 20)``. Values are compared by
:func:`tests.support.raycluster.digest` (dtype, shape and every byte).
"""

from __future__ import annotations

import os
from typing import Any

import ray

import ray_rdt_pool
from tests.support.raycluster import digest

# @ray.method(tensor_transport=...) validates the name when the class is defined.
ray_rdt_pool.register()


class Actor:
    """What every test actor does: register, configure, and report on itself."""

    def __init__(self, **config: Any) -> None:
        ray_rdt_pool.register()
        if config:
            ray_rdt_pool.configure(**config)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def stats(self) -> Any:
        return ray_rdt_pool.stats()


class Sender(Actor):
    """Puts objects; keeps the tensors of a put under a key on request (to change them
    after the put, or to keep them alive)."""

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.kept: dict[str, Any] = {}

    def put(self, tensors: Any, keep: str | None = None) -> tuple[list[Any], list[str]]:
        """``ray.put`` of ``tensors``: the ref (in a list, so the caller borrows it rather
        than Ray resolving it) and the tensors' digests."""
        ref = ray.put(tensors, _tensor_transport="nixl_pool")
        if keep:
            self.kept[keep] = tensors
        return [ref], digest(tensors)

    def drop(self, *keys: str) -> None:
        """Let go of the tensors kept under ``keys`` (all without any)."""
        for k in keys or list(self.kept):
            self.kept.pop(k, None)

    @ray.method(tensor_transport="nixl_pool")
    def echo(self, value: Any) -> Any:
        """A method return through the transport."""
        return value


class Receiver(Actor):
    """Gets objects by ``ray.get`` of a ref and as task arguments."""

    def get(self, refs: list[Any]) -> list[str]:
        """``ray.get`` of ``refs[0]``: the digests of its tensors."""
        return digest(ray.get(refs[0]))

    def take(self, value: Any) -> list[str]:
        """A task argument (Ray's receive on ``_ray_system``): the digests of its tensors."""
        return digest(value if isinstance(value, list) else [value])
