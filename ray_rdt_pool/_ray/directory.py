"""Where agents find each other: Ray's GCS key-value store, and this process's node.

Owns :class:`KVDirectory`, the directory the registry publishes this process's NIXL agent
metadata (and the sender its same-node pool entry) to, and receivers read peers from,
under the ``ray_rdt_pool`` namespace; and :func:`ray_node_id`.

Lifetime: one directory per runtime; its keys live until ``shutdown()`` removes them (or
the Ray session ends). Threads: whichever thread publishes (a put, the registry) or looks
up (a fetch); Ray's KV client is thread-safe, and the directory keeps no state.
"""

from __future__ import annotations

import ray

from ray_rdt_pool._ray.patches import ray_session

_KV_NAMESPACE = "ray_rdt_pool"


class KVDirectory:
    """Agent metadata, published once per registration change, read once per peer."""

    @staticmethod
    def session() -> object:
        """Which Ray connection the store belongs to: a new ``ray.init`` in this process
        (after ``ray.shutdown``) reaches a new GCS, so what was published must be again."""
        return ray_session()

    def publish(self, name: str, version: int, reset_version: int, md: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        value = version.to_bytes(8, "little") + reset_version.to_bytes(8, "little") + md
        _internal_kv_put(f"agent/{name}", value, overwrite=True, namespace=_KV_NAMESPACE)

    def lookup(self, name: str) -> tuple[int, int, bytes] | None:
        from ray.experimental.internal_kv import _internal_kv_get

        value = _internal_kv_get(f"agent/{name}", namespace=_KV_NAMESPACE)
        if value is None or len(value) < 16:
            return None
        return (int.from_bytes(value[:8], "little"), int.from_bytes(value[8:16], "little"),
                bytes(value[16:]))

    def remove(self, name: str) -> None:
        try:
            from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_initialized

            if _internal_kv_initialized():  # type: ignore[no-untyped-call]
                _internal_kv_del(f"agent/{name}", namespace=_KV_NAMESPACE)
                _internal_kv_del(f"host/{name}", namespace=_KV_NAMESPACE)
        except Exception:  # best effort at shutdown
            pass

    def publish_host(self, name: str, info: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(f"host/{name}", info, overwrite=True, namespace=_KV_NAMESPACE)

    def lookup_host(self, name: str) -> bytes | None:
        from ray.experimental.internal_kv import _internal_kv_get

        value = _internal_kv_get(f"host/{name}", namespace=_KV_NAMESPACE)
        return None if value is None else bytes(value)


def ray_node_id() -> str | None:
    """This process's Ray node ID (same-node receivers map; others read with NIXL)."""
    try:
        if not ray.is_initialized():
            return None
        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return None
