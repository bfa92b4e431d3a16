"""The driver's side of a sync: :func:`sync` runs one between a trainer actor and its
inference actors, in ``"stream"`` or ``"publish"`` mode.

Owns :func:`sync` and the trainer's entry points it runs through ``__ray_call__``
(``_remote_publish``, ``_remote_stream``: each finds the actor's :class:`WeightSender`
by attribute name). Stateless; :func:`sync` runs on the driver's thread, and drops its
copy of a published manifest before it returns or raises, so nothing it held pins the
trainer's pool.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from ray_rdt_pool.errors import InvalidInputError
from ray_rdt_pool.weights.manifest import Manifest
from ray_rdt_pool.weights.pool import count_ray_calls
from ray_rdt_pool.weights.remote import (
    RECEIVER_ATTR,
    SENDER_ATTR,
    _actor_handles,
    _find,
    _get_all,
    _is_actor,
    _remote_load,
    _timeout,
    _wait_moving,
)
from ray_rdt_pool.weights.reports import StreamReport, SyncReport
from ray_rdt_pool.weights.sender import WeightSender
from ray_rdt_pool.weights.stream import check_relay

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def _remote_publish(actor: Any, attr: str, version: int | None = None) -> Manifest:
    return _find(actor, attr, WeightSender).publish(version=version)


def _remote_stream(actor: Any, attr: str, receivers: list[ActorHandle], receiver_attr: str,
                   max_inflight: int, timeout_s: float, version: int | None = None,
                   relay: str | None = None, relay_order: str = "caller",
                   beat_key: str | None = None) -> StreamReport:
    from ray_rdt_pool._ray.beats import Beat

    beat = Beat(beat_key, timeout_s / 4)
    try:
        return _find(actor, attr, WeightSender)._stream(
            receivers, version=version, receiver_attr=receiver_attr,
            max_inflight=max_inflight, timeout_s=timeout_s, relay=relay,
            relay_order=relay_order, beat=beat)
    finally:
        beat.close()


def sync(trainer: ActorHandle | Sequence[ActorHandle], receivers: Sequence[ActorHandle], *,
         mode: Literal["stream", "publish"] = "stream", max_inflight: int = 2,
         sender_attr: str = SENDER_ATTR, receiver_attr: str = RECEIVER_ATTR,
         timeout_s: float = 300.0, version: int | None = None, relay: str | None = None,
         relay_order: str = "caller") -> SyncReport:
    """Driver-side: sync the trainer's weights to every receiver and wait for it.

    The trainer actor holds a :class:`WeightSender` at ``sender_attr``; each receiver a
    :class:`WeightReceiver` at ``receiver_attr``. ``mode="stream"`` runs
    :meth:`WeightSender.stream` in the trainer (bounded pool memory, pipelined with
    ``max_inflight >= 2``; a few Ray calls per receiver, the buckets signalled on the
    data plane). ``mode="publish"`` puts every bucket, hands the manifest to all
    receivers at once (they load concurrently), then drops the driver's copy, so the
    sender frees the pool when the last receiver is done. ``version`` is passed to
    ``publish``/``stream`` (default: one more than the highest version the sender
    used, successful or not).

    ``timeout_s`` is "no progress for this long", everywhere: a sync may take as long
    as its buckets need, and raises :class:`WeightSyncTimeoutError` naming what it
    waited for once nothing moved for ``timeout_s`` (the trainer's and receivers' calls
    tell the driver they move).

    ``trainer`` may be a list of trainer ranks, each holding part of the model (disjoint
    names, or dim-0 shards with ``WeightSender(shard=(rank, world))``): every receiver
    then reads each part from the rank that holds it, and the driver commits the
    version on every receiver once every receiver has every byte
    (:mod:`ray_rdt_pool.weights.ranks`; ``max_inflight`` does not apply).

    ``relay="chain"`` (stream only): the trainer sends each bucket once and each receiver
    reads it from the one before it; ``relay_order`` is ``"caller"`` or ``"placement"``
    (see :meth:`WeightSender.stream`). With trainer ranks, each rank's part travels its
    own chain, each chain starting at another receiver (in the order given), so each
    rank sends its part once and no receiver's link carries more than the model.
    """
    timeout_s = _timeout(timeout_s)
    check_relay(relay, relay_order)
    if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
        raise InvalidInputError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
    if relay is not None and mode != "stream":
        raise InvalidInputError(f"relay={relay!r} needs mode='stream', got mode={mode!r}")
    if (not _is_actor(trainer) and isinstance(trainer, Sequence)
            and not isinstance(trainer, (str, bytes))):
        from ray_rdt_pool.weights.ranks import sync_ranks

        ranks = _actor_handles(trainer, "sync() (trainer ranks)")
        receivers = _actor_handles(receivers, "sync()")
        if mode not in ("stream", "publish"):
            raise InvalidInputError(f"mode must be 'stream' or 'publish', got {mode!r}")
        if len(ranks) == 1:
            trainer = ranks[0]
        else:
            if relay is not None and relay_order != "caller":
                raise InvalidInputError(
                    f"relay_order={relay_order!r} takes one trainer; with {len(ranks)} "
                    "trainer ranks each rank's chain starts at another receiver, in the "
                    "order given (relay_order='caller')")
            return sync_ranks(ranks, receivers, mode=mode, sender_attr=sender_attr,
                              receiver_attr=receiver_attr, timeout_s=timeout_s,
                              version=version, relay=relay, max_inflight=max_inflight)
    if not _is_actor(trainer) or isinstance(trainer, Sequence):
        raise InvalidInputError(f"sync() takes the trainer's actor handle first, got "
                                f"{type(trainer).__name__}")
    receivers = _actor_handles(receivers, "sync()")
    if mode not in ("stream", "publish"):
        raise InvalidInputError(f"mode must be 'stream' or 'publish', got {mode!r}")
    from ray_rdt_pool._ray.beats import new_key

    t0 = time.perf_counter()
    if mode == "stream":
        count_ray_calls(1)
        key = new_key()
        rep: StreamReport = _wait_moving(
            [trainer.__ray_call__.remote(_remote_stream, sender_attr, receivers,
                                         receiver_attr, max_inflight, timeout_s, version,
                                         relay, relay_order, key)],
            [key], timeout_s, f"the streaming sync (WeightSender.stream at {sender_attr!r} "
                              "on the trainer)")[0]
        return SyncReport("stream", rep.version, time.perf_counter() - t0, rep.nbytes,
                          rep.buckets, rep.loads, rep, rep.peak_pool_used,
                          ray_calls=rep.ray_calls + 1)
    count_ray_calls(1 + len(receivers))
    published = [trainer.__ray_call__.remote(_remote_publish, sender_attr, version)]
    try:
        manifest: Manifest = _get_all(
            published, timeout_s,
            f"publishing on the trainer (WeightSender.publish at {sender_attr!r})")[0]
    finally:
        # A held timeout's traceback must not keep the ref, and through it the buckets
        # of a publish that ends later, in the trainer's pool.
        published.clear()
    layout, version, used = manifest.layout, manifest.version, manifest.sender_pool_used
    try:
        keys = [new_key() for _ in receivers]
        loads = tuple(_wait_moving(
            [r.__ray_call__.remote(_remote_load, receiver_attr, manifest, k, timeout_s / 4)
             for r, k in zip(receivers, keys)], keys, timeout_s,
            "loading the manifest on the receivers"))
    finally:
        manifest.release()  # even on error: a held traceback must not pin the pool
        del manifest
    return SyncReport("publish", version, time.perf_counter() - t0, layout.total_bytes,
                      len(layout.buckets), loads, None, used,
                      ray_calls=1 + len(receivers))
