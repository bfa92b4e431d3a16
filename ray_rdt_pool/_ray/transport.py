"""The ``nixl_pool`` tensor transport: the class Ray instantiates, and ``register()``.

Owns :class:`NixlPoolTransport`, which turns each of Ray's calls into a call on the
process's :class:`~ray_rdt_pool._ray.runtime.Runtime`, and :func:`register`, which checks
the installed Ray, applies :mod:`ray_rdt_pool._ray.patches` and registers the class.

Lifetime: Ray makes one instance per process, lazily; it holds only a per-actor cache of
``actor_has_tensor_transport``, and all state lives in the runtime. Threads: see the
class docstring; ARCHITECTURE.md walks through one object's life.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportManager,
)

from ray_rdt_pool._ray import patches
from ray_rdt_pool._ray.metadata import PoolFetch, PoolTransportMetadata, as_pool_meta
from ray_rdt_pool._ray.patches import RAY_NAME
from ray_rdt_pool._ray.runtime import runtime
from ray_rdt_pool.config import TRANSPORT
from ray_rdt_pool.errors import ConfigurationError


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
        return RAY_NAME

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: ray.actor.ActorHandle[Any]) -> bool:
        key = actor._actor_id.hex()
        cached = self._has_transport.get(key)
        if cached is None:
            cached = bool(ray.get(actor.__ray_call__.options(
                concurrency_group="_ray_system").remote(_probe_actor)))
            self._has_transport[key] = cached
        return cached

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]
                                          ) -> PoolTransportMetadata:
        patches.by_reference_tensor_reducer()
        rt = runtime()
        retry = obj_id in rt.sender.sent  # a task retried after its reply was lost
        try:
            return rt.put(obj_id, rdt_object)
        except BaseException:
            if not retry:
                patches.drop_primary_copy(obj_id, rdt_object)
            raise

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any,
                                  backend: str | None = None) -> CommunicatorMetadata:
        return CommunicatorMetadata()

    def fetch_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any,
                               communicator_metadata: CommunicatorMetadata,
                               target_buffers: list[Any] | None = None) -> FetchRequest:
        return runtime().fetch(obj_id, as_pool_meta(tensor_transport_metadata),
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




def register() -> str:
    """Register the transport with Ray in this process; safe to call again.

    Raises ConfigurationError on a Ray other than the tested minor release (unless
    ``RAY_RDT_POOL_ALLOW_UNTESTED_RAY=1``), or when another class holds the name.
    """
    import torch
    from ray.experimental import register_tensor_transport

    patches.check_ray_version()
    patches.apply(_snapshot_of)

    registered = patches.registered_transport_class(RAY_NAME)
    if registered is not None:
        if registered is not NixlPoolTransport:
            raise ConfigurationError(
                f"another class ({registered.__name__}) is already "
                f"registered as Ray tensor transport {TRANSPORT}")
        return TRANSPORT
    try:
        register_tensor_transport(TRANSPORT, ["cpu", "cuda"], NixlPoolTransport, torch.Tensor)
    except ValueError:
        # Ray registered it on this actor concurrently (on _ray_system); same class.
        if patches.registered_transport_class(RAY_NAME) is not NixlPoolTransport:
            raise
    return TRANSPORT


def _snapshot_of(obj_id: str) -> Any:
    """The copy this process's put made of ``obj_id``, or None (see ``patches.apply``)."""
    from ray_rdt_pool._ray.runtime import current

    rt = current()
    return rt.get_snapshot(obj_id) if rt is not None else None


__all__ = ["NixlPoolTransport", "register"]
