"""Measurement hooks the benchmark's actors install in their own process.

Two hooks are installed on the sender's own RDT store instance (nothing in
Ray's code is changed): ``add_object_primary`` is wrapped to keep the transport
metadata of the last object (its pickled size is reported after the timed transfer),
and ``pop_object`` to timestamp when Ray's ``__ray_free__`` has run the transport's
``garbage_collect`` and dropped the object. That timestamp is the end of ``release``.
The receiver of ``sync_stream`` times its buckets with :func:`timed_weight_receiver`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ray_rdt_pool.bench.variants import ZERO_COPY_ENV, Variant


def process_info(variant: Variant) -> dict[str, Any]:
    import ray
    import torch

    from ray_rdt_pool._ray.patches import serialization_context
    from ray_rdt_pool.memory.describe import native_active

    ctx = serialization_context()
    return {
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "torch_threads": torch.get_num_threads(),
        "zero_copy_env": os.environ.get(ZERO_COPY_ENV),
        # The flag is read once, when ray._private.ray_constants is imported; this is
        # the value the serializer really uses.
        "zero_copy_active": bool(getattr(ctx, "_zero_copy_tensors_enabled", False)),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "native_describe": native_active(),
    }


class PutTimer:
    """Sums the wall time of every ``ray.put`` made in this process while active.

    A measurement hook for ``sync_stream``: the weights API calls ``ray.put`` once per
    bucket inside ``WeightSender.stream``; Ray's variants call it in our own loop. Both
    look ``ray.put`` up on the ``ray`` module at call time, so swapping the module
    attribute for the duration of one stream times every bucket's put the same way for
    every variant (nothing in Ray's code changes; the original is restored on exit).
    """

    def __init__(self) -> None:
        self.total_s = 0.0
        self.count = 0
        self._orig: Any = None

    def __enter__(self) -> PutTimer:
        import ray

        self._orig = orig = ray.put

        def timed_put(*args: Any, **kwargs: Any) -> Any:
            t = time.monotonic()
            try:
                return orig(*args, **kwargs)
            finally:
                self.total_s += time.monotonic() - t
                self.count += 1

        ray.put = timed_put
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        ray.put = self._orig


def install_transport_timer() -> dict[str, float] | None:
    """Time spent inside our transport's own code in this process, summed.

    Wraps, on this process's ``ray_rdt_pool`` runtime object (instance attributes, the
    way the RDT store hooks above work; the package is not changed), the sender's
    ``put`` and ``put_by_reference`` (what Ray's ``ray.put`` and a weights stream call
    to lay out, copy into the pool and describe an object) into ``put_s``, and ``fetch``
    + ``wait`` (what ``ray.get`` calls to start the READ and rebuild the tensors) and the
    receiver's ``sources.read`` (a weights stream's source reads) into ``get_s``. What is
    left of a ``ray.put`` or ``ray.get`` call is Ray's own serializer and bookkeeping.
    Returns None, and times nothing, where the runtime has no such methods.
    """
    try:
        from ray_rdt_pool._ray.runtime import runtime

        rt = runtime()
    except Exception:
        return None
    names = {"put": "put_s", "fetch": "get_s", "wait": "get_s"}
    if not all(callable(getattr(rt, n, None)) for n in names):
        return None
    sender = rt.sender
    # The pack itself, wherever it is called from: ray.put (through Runtime.put) or a
    # weights stream (owned objects: Sender.put, or Sender.put_by_reference with no copy).
    names.pop("put")
    acc = {"put_s": 0.0, "get_s": 0.0}

    def timed(orig: Any, key: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.monotonic()
            try:
                return orig(*args, **kwargs)
            finally:
                acc[key] += time.monotonic() - t
        return call

    for name, key in names.items():
        setattr(rt, name, timed(getattr(rt, name), key))
    for name in ("put", "put_by_reference"):
        if callable(getattr(sender, name, None)):
            setattr(sender, name, timed(getattr(sender, name), "put_s"))
    # A weights stream on one node reads buckets straight out of the trainer instead.
    sources = getattr(rt.receiver, "sources", None)
    read = getattr(sources, "read", None)
    if callable(read):
        setattr(sources, "read", timed(read, "get_s"))  # noqa: B010
    return acc


_TIMED_RECEIVER_CLS: Any = None


def timed_weight_receiver(dest: dict[str, Any]) -> Any:
    """A ``ray_rdt_pool.weights.WeightReceiver`` for ``dest`` that also records, per
    stream, the seconds spent in its bucket loads and when the last bucket landed.

    The subclass only wraps :meth:`_load_stream_bucket` (what ``WeightSender.stream``
    calls on the receiver for each bucket, through ``__ray_call__``); it is made on
    first use so that importing this module never imports our package.
    """
    global _TIMED_RECEIVER_CLS
    if _TIMED_RECEIVER_CLS is None:
        from ray_rdt_pool.weights import WeightReceiver

        class TimedWeightReceiver(WeightReceiver):
            fetch_s = 0.0
            last_loaded: float | None = None

            def _load_stream_bucket(self, session: str, k: int, box: list[Any],
                                   spec: Any = None) -> Any:
                t = time.monotonic()
                reports = super()._load_stream_bucket(session, k, box, spec)
                now = time.monotonic()
                self.fetch_s += now - t
                if reports:  # [] when the bucket waits for an earlier one
                    self.last_loaded = now
                return reports

        _TIMED_RECEIVER_CLS = TimedWeightReceiver
    return _TIMED_RECEIVER_CLS(dest)
