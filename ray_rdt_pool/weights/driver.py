"""The driver's side of a sync: :func:`sync` runs one between a trainer actor and its
inference actors, in ``"stream"`` or ``"publish"`` mode.

Owns :func:`sync` and the trainer's entry points it runs through ``__ray_call__``
(``_remote_publish``, ``_remote_stream``: each finds the actor's :class:`WeightSender`
by attribute name). Stateless; :func:`sync` runs on the driver's thread, and drops its
copy of a published manifest before it returns or raises, so nothing it held pins the
trainer's pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ray_rdt_pool.errors import (
    CommitHookError,
    InvalidInputError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from ray_rdt_pool.weights.manifest import Manifest
from ray_rdt_pool.weights.pool import count_ray_calls
from ray_rdt_pool.weights.remote import (
    RECEIVER_ATTR,
    SENDER_ATTR,
    actor_handles,
    check_timeout,
    find_attr,
    get_all,
    is_actor,
    remote_load,
    source_watch,
    wait_moving,
)
from ray_rdt_pool.weights.reports import StreamReport, SyncReport
from ray_rdt_pool.weights.state import check_flag
from ray_rdt_pool.weights.stream import check_relay, new_session
from ray_rdt_pool.weights.weight_sender import WeightSender

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def _remote_publish(actor: Any, attr: str, version: int | None = None) -> Manifest:
    return find_attr(actor, attr, WeightSender).publish(version=version)


def _remote_stream(actor: Any, attr: str, receivers: list[ActorHandle], receiver_attr: str,
                   max_inflight: int, timeout_s: float, version: int | None = None,
                   relay: str | None = None, relay_order: str = "caller",
                   beat_key: str | None = None, session: str = "") -> StreamReport:
    from ray_rdt_pool._ray.beats import Beat

    beat = Beat(beat_key, timeout_s / 4)
    try:
        return find_attr(actor, attr, WeightSender)._stream(
            receivers, version=version, receiver_attr=receiver_attr,
            max_inflight=max_inflight, timeout_s=timeout_s, relay=relay,
            relay_order=relay_order, beat=beat, session=session)
    finally:
        beat.close()


class SyncHandle:
    """A sync running in the background: what ``sync(..., wait=False)`` returns.

    The driver goes on (the next rollout) while the sync runs on a thread of its own.
    Errors come out of :meth:`result`, typed as :func:`sync` raises them."""

    def __init__(self, run: Callable[[_Control], SyncReport]) -> None:
        self._control = _Control()
        self._done = threading.Event()
        self._report: SyncReport | None = None
        self._error: BaseException | None = None

        def main() -> None:
            try:
                self._report = run(self._control)
            except BaseException as e:
                self._error = e
            finally:
                self._done.set()

        self._thread = threading.Thread(target=main, daemon=True, name="ray_rdt_pool-sync")
        self._thread.start()

    def done(self) -> bool:
        """Whether the sync has ended (well or not)."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> SyncReport:
        """The sync's report, waiting up to ``timeout`` seconds (None: until it ends);
        raises its error, or :class:`WeightSyncTimeoutError` if it has not ended by
        then (it goes on; ask again)."""
        if not self._done.wait(timeout):
            raise WeightSyncTimeoutError(f"the sync has not ended within {timeout}s; it "
                                         "goes on (call result() again, or cancel())")
        if self._error is not None:
            # A cancel that came too late (the commit had begun) did not cause the error:
            # one that says who committed is the truth, and is raised as it is.
            committed = isinstance(self._error, CommitHookError) or bool(
                getattr(self._error, "committed", ()))
            if self._control.cancelled.is_set() and not committed:
                raise WeightSyncError("the sync was cancelled before it committed; every "
                                      "receiver keeps its version") from self._error
            raise self._error
        assert self._report is not None
        return self._report

    def cancel(self) -> bool:
        """Ask the sync to stop: it commits nothing if it has not begun to commit (then
        :meth:`result` raises :class:`WeightSyncError`); False if it had ended."""
        if self._done.is_set():
            return False
        self._control.cancel()
        return True


class _Control:
    """What a background sync's caller can do to it: cancel it (every call it waits
    for is told through its heartbeat key, and the driver commits nothing after)."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.keys: list[str] = []
        self._lock = threading.Lock()

    def watch(self, keys: Sequence[str]) -> None:
        from ray_rdt_pool._ray.beats import cancel

        with self._lock:
            self.keys.extend(keys)
            if self.cancelled.is_set():
                for k in keys:
                    cancel(k)

    def cancel(self) -> None:
        from ray_rdt_pool._ray.beats import cancel

        with self._lock:
            self.cancelled.set()
            for k in self.keys:
                cancel(k)

    def check(self) -> None:
        if self.cancelled.is_set():
            raise WeightSyncError("the sync was cancelled")


def sync(trainer: ActorHandle | Sequence[ActorHandle], receivers: Sequence[ActorHandle], *,
         mode: Literal["stream", "publish"] = "stream", max_inflight: int = 2,
         sender_attr: str = SENDER_ATTR, receiver_attr: str = RECEIVER_ATTR,
         timeout_s: float = 300.0, version: int | None = None, relay: str | None = None,
         relay_order: str = "caller", wait: bool = True) -> Any:
    """Driver-side: sync the trainer's weights to every receiver (guide:
    docs/weight-sync.md).

    The trainer actor holds a :class:`WeightSender` at ``sender_attr``, each receiver a
    :class:`WeightReceiver` at ``receiver_attr``. ``mode="stream"`` streams bucket by
    bucket with bounded pool memory (``max_inflight`` buckets out); ``"publish"`` puts
    every bucket, then every receiver loads the manifest. ``version`` defaults to one
    more than the highest the sender used. ``timeout_s`` is "no progress for this
    long". ``trainer`` may be a list of trainer ranks, each holding part of the model
    (disjoint names, or dim-0 shards). ``relay="chain"`` sends each bucket once: each
    receiver reads it from the one before it (``relay_order``: ``"caller"`` or
    ``"placement"``; one chain per rank with many ranks). ``wait=False`` returns a
    :class:`SyncHandle` at once.
    """
    timeout_s = check_timeout(timeout_s)
    check_relay(relay, relay_order)
    check_flag("wait", wait)
    if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
        raise InvalidInputError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
    if relay is not None and mode != "stream":
        raise InvalidInputError(f"relay={relay!r} needs mode='stream', got mode={mode!r}")
    if (not is_actor(trainer) and isinstance(trainer, Sequence)
            and not isinstance(trainer, (str, bytes))):
        from ray_rdt_pool.weights.ranks import sync_ranks

        ranks = actor_handles(trainer, "sync() (trainer ranks)")
        receivers = actor_handles(receivers, "sync()")
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

            engines = list(receivers)

            def run_ranks(control: _Control) -> SyncReport:
                return sync_ranks(ranks, engines, mode=mode, sender_attr=sender_attr,
                                  receiver_attr=receiver_attr, timeout_s=timeout_s,
                                  version=version, relay=relay, max_inflight=max_inflight,
                                  cancelled=control.check)

            return run_ranks(_Control()) if wait else SyncHandle(run_ranks)
    if not is_actor(trainer) or isinstance(trainer, Sequence):
        raise InvalidInputError(f"sync() takes the trainer's actor handle first, got "
                                f"{type(trainer).__name__}")
    receivers = actor_handles(receivers, "sync()")
    if mode not in ("stream", "publish"):
        raise InvalidInputError(f"mode must be 'stream' or 'publish', got {mode!r}")

    def run(control: _Control) -> SyncReport:
        return _sync_one(trainer, receivers, mode, max_inflight, sender_attr, receiver_attr,
                         timeout_s, version, relay, relay_order, control)

    return run(_Control()) if wait else SyncHandle(run)


def _sync_one(trainer: ActorHandle, receivers: list[ActorHandle], mode: str,
              max_inflight: int, sender_attr: str, receiver_attr: str, timeout_s: float,
              version: int | None, relay: str | None, relay_order: str,
              control: _Control) -> SyncReport:
    """:func:`sync` from one trainer, its options checked."""
    from ray_rdt_pool._ray.beats import new_key

    control.check()
    t0 = time.perf_counter()
    if mode == "stream":
        count_ray_calls(1)
        key = new_key()
        control.watch([key])
        session = new_session(version or 0)
        with source_watch(receivers, receiver_attr, session, timeout_s, "the trainer"):
            rep: StreamReport = wait_moving(
                [trainer.__ray_call__.remote(_remote_stream, sender_attr, receivers,
                                             receiver_attr, max_inflight, timeout_s, version,
                                             relay, relay_order, key, session)],
                [key], timeout_s, f"the streaming sync (WeightSender.stream at "
                                  f"{sender_attr!r} on the trainer)")[0]
        return SyncReport("stream", rep.version, time.perf_counter() - t0, rep.nbytes,
                          rep.buckets, rep.loads, rep, rep.peak_pool_used,
                          ray_calls=rep.ray_calls + 1)
    count_ray_calls(1 + len(receivers))
    published = [trainer.__ray_call__.remote(_remote_publish, sender_attr, version)]
    try:
        manifest: Manifest = get_all(
            published, timeout_s,
            f"publishing on the trainer (WeightSender.publish at {sender_attr!r})")[0]
    finally:
        # A held timeout's traceback must not keep the ref, and through it the buckets
        # of a publish that ends later, in the trainer's pool.
        published.clear()
    layout, version, used = manifest.layout, manifest.version, manifest.sender_pool_used
    try:
        control.check()
        keys = [new_key() for _ in receivers]
        control.watch(keys)
        refs = [r.__ray_call__.remote(remote_load, receiver_attr, manifest, k,
                                      timeout_s / 4, timeout_s)
                for r, k in zip(receivers, keys)]
        try:
            loads = tuple(wait_moving(refs, keys, timeout_s,
                                       "loading the manifest on the receivers"))
        except CommitHookError as e:
            # That receiver committed: wait for the others, to say who else did.
            _who_committed(e, refs, timeout_s)
            raise
    finally:
        manifest.release()  # even on error: a held traceback must not pin the pool
        del manifest
    return SyncReport("publish", version, time.perf_counter() - t0, layout.total_bytes,
                      len(layout.buckets), loads, None, used,
                      ray_calls=1 + len(receivers))


def _who_committed(e: CommitHookError, loads: list[Any], timeout_s: float) -> None:
    """Fill in ``e.receiver`` and ``e.committed`` from a publish's load calls, once they
    ended (within ``timeout_s``): a load that returned, or whose hook raised, committed."""
    import ray

    ray.wait(loads, num_returns=len(loads), timeout=timeout_s)
    committed = []
    for i, ref in enumerate(loads):
        try:
            ray.get(ref, timeout=0)
        except CommitHookError:
            if e.receiver < 0:
                e.receiver = i
        except Exception:
            continue
        committed.append(i)
    e.committed = tuple(committed)
