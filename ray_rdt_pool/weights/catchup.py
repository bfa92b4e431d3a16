"""Catch-up from a peer engine: :func:`catch_up`, a sync whose source is another engine.

An engine that restarted, or joined late, gets the weights of a running engine at its
version, without the trainer (which may be busy, or dead). The peer's receiver serves
its destination tensors by their names, as a stream (:class:`~.stream.StreamSession`,
plain or relayed) of the peer's version: a receiver refuses a version that is not
newer than its own (:class:`~ray_rdt_pool.errors.StaleVersionError`), and writes each
tensor into its own destination tensor of that name (no ``name_map``, no
``load_weights``: the names are the engines' own).

While it serves, the peer holds its receiver's write lock: its weights do not change
under the peers' reads, and a trainer's sync into it waits for the catch-up to end (up
to that sync's ``timeout_s``). A peer that a sync has written in part (in place, in
progress or failed, not committed) refuses to serve: no version names its weights then.
Stateless; :func:`catch_up` runs on the driver's thread, :func:`_remote_serve_peer` on
the peer actor's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.errors import InvalidInputError, WeightSyncError
from ray_rdt_pool.weights.manifest import DEFAULT_BUCKET_BYTES
from ray_rdt_pool.weights.remote import (
    RECEIVER_ATTR,
    actor_handles,
    check_timeout,
    find_attr,
    is_actor,
    wait_moving,
)
from ray_rdt_pool.weights.reports import StreamReport, SyncReport

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def _remote_serve_peer(actor: Any, attr: str, receivers: list[Any], max_inflight: int,
                       timeout_s: float, relay: str | None, relay_order: str,
                       bucket_bytes: int, beat_key: str | None,
                       session: str = "") -> StreamReport:
    """On the peer: stream its receiver's destination at its version (see module)."""
    from ray_rdt_pool._ray.beats import Beat
    from ray_rdt_pool.weights.weight_receiver import WeightReceiver
    from ray_rdt_pool.weights.weight_sender import WeightSender

    rec = find_attr(actor, attr, WeightReceiver)
    if rec.dest is None:
        raise WeightSyncError(
            "the peer engine's receiver has no destination tensors (load_weights only): "
            "it holds no weights by name to serve; catch up from an engine with a dest, "
            "or from the trainer")
    beat = Beat(beat_key, timeout_s / 4)
    try:
        # Its weights must not change while the others read them: a load or stream into
        # this receiver waits until the catch-up has ended.
        with rec._writing:
            if not rec._loaded:
                raise WeightSyncError("the peer engine has loaded no version yet: it has "
                                      "nothing to serve")
            if rec._torn:
                raise WeightSyncError(
                    f"the peer engine's weights were written in part by a sync that has "
                    f"not committed (in progress, or failed) over version {rec.version}: "
                    "no version names them; catch up once a sync has committed on it, or "
                    "from another engine")
            if rec.select is not None and rec._shard is None:
                raise WeightSyncError(
                    "the peer engine holds a shard (select=) but cannot tell which part of "
                    "the full weights it is (its version came from a lazy stream); catch up "
                    "from another engine, or from the trainer")
            sender = WeightSender(rec.dest, bucket_bytes=bucket_bytes)
            try:
                return sender._stream(receivers, version=rec.version, receiver_attr=attr,
                                      max_inflight=max_inflight, timeout_s=timeout_s,
                                      relay=relay, relay_order=relay_order, beat=beat,
                                      peer=True, session=session,
                                      peer_shard=rec._held_shard()
                                      if rec.select is not None else None)
            finally:
                sender.close()  # a one-off: its registrations need not stay
    finally:
        beat.close()


def catch_up(peer: ActorHandle, receivers: Sequence[ActorHandle], *,
             receiver_attr: str = RECEIVER_ATTR, timeout_s: float = 300.0,
             max_inflight: int = 2, relay: str | None = None, relay_order: str = "caller",
             bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncReport:
    """Driver-side: bring ``receivers`` to the version of engine ``peer``, from its
    weights, without the trainer (guide: docs/weight-sync.md, "Catch-up from a peer
    engine").

    The peer's :class:`WeightReceiver` (at ``receiver_attr``, with destination tensors)
    streams them by name at its version; each receiver writes them into its destination
    tensors of the same names and commits that version, or refuses it as not newer
    (:class:`StaleVersionError`). Options as for :func:`sync`. While it serves, the
    peer's weights do not change: a trainer's sync into it waits.
    """
    from ray_rdt_pool._ray.beats import new_key
    from ray_rdt_pool.weights.pool import count_ray_calls
    from ray_rdt_pool.weights.remote import source_watch
    from ray_rdt_pool.weights.stream import check_relay, new_session

    timeout_s = check_timeout(timeout_s)
    check_relay(relay, relay_order)
    if not is_actor(peer):
        raise InvalidInputError(f"catch_up() takes the peer engine's actor handle first, "
                                f"got {type(peer).__name__}")
    receivers = actor_handles(receivers, "catch_up()")
    if any(r._actor_id.hex() == peer._actor_id.hex() for r in receivers):
        raise InvalidInputError("catch_up() got the peer among its receivers: an engine "
                                "cannot catch up from itself")
    if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
        raise InvalidInputError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
    import time

    t0 = time.perf_counter()
    key = new_key()
    count_ray_calls(1)
    session = new_session(0)
    with source_watch(receivers, receiver_attr, session, timeout_s, "the peer engine"):
        rep: StreamReport = wait_moving(
            [peer.__ray_call__.remote(_remote_serve_peer, receiver_attr, list(receivers),
                                      max_inflight, timeout_s, relay, relay_order,
                                      bucket_bytes, key, session)],
            [key], timeout_s, f"the catch-up from the peer engine (its WeightReceiver at "
                              f"{receiver_attr!r})")[0]
    return SyncReport("stream", rep.version, time.perf_counter() - t0, rep.nbytes,
                      rep.buckets, rep.loads, rep, rep.peak_pool_used,
                      ray_calls=rep.ray_calls + 1)
