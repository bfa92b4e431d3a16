"""Calls between actors: the receiver's entry points run through ``__ray_call__``, and
the checks and waits around such calls.

Owns the functions a trainer's stream (and the driver's :func:`~ray_rdt_pool.weights.sync`)
runs on a receiver actor through ``ActorHandle.__ray_call__`` (``_remote_*``: each finds
the actor's :class:`WeightReceiver` by attribute name), the actor-handle and timeout
checks, and the waits on such calls (:func:`_get_all` raises a typed timeout,
:func:`_wait_quietly` never raises, :func:`_ended` never blocks). Stateless. The
``_remote_*`` functions run on the receiver actor's task thread (or event loop); the
rest on the caller's thread.
"""

from __future__ import annotations

import logging
import math
import traceback
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.errors import InvalidInputError, WeightSyncError, WeightSyncTimeoutError
from ray_rdt_pool.weights.manifest import BucketLayout, Manifest, WeightLayout
from ray_rdt_pool.weights.receiver import WeightReceiver
from ray_rdt_pool.weights.reports import BucketReport, LoadReport

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from ray_rdt_pool.same_node.source import SourceProcess

logger = logging.getLogger(__name__)

#: Attribute names :func:`~ray_rdt_pool.weights.sync` looks up on the trainer and
#: inference actors.
SENDER_ATTR = "weight_sender"
RECEIVER_ATTR = "weight_receiver"


def _actor_handles(receivers: Any, what: str) -> list[ActorHandle]:
    """``receivers`` as a list of distinct actor handles, or InvalidInputError: anything
    else would fail later as an AttributeError deep in a Ray call, after the stream's
    version was used."""
    if _is_actor(receivers):
        raise InvalidInputError(f"{what} takes a list of receiver actors, got one actor "
                                f"handle; pass [handle]")
    try:
        handles = list(receivers)
    except TypeError:
        raise InvalidInputError(f"{what} takes a list of receiver actors, got "
                                f"{type(receivers).__name__}") from None
    if not handles:
        raise InvalidInputError(f"{what} needs at least one receiver actor")
    for i, r in enumerate(handles):
        if not _is_actor(r):
            raise InvalidInputError(f"{what}: receiver {i} is a {type(r).__name__}, not an "
                                    f"actor handle; pass the handles that .remote() on an "
                                    f"actor class returned")
    ids = [r._actor_id.hex() for r in handles]
    if len(set(ids)) != len(ids):
        raise InvalidInputError(f"{what} got the same receiver actor twice")
    return handles


def _is_actor(obj: Any) -> bool:
    """Whether ``obj`` can be called as an actor here (what a stream uses of a handle)."""
    return hasattr(obj, "__ray_call__") and hasattr(obj, "_actor_id")


def _timeout(timeout_s: Any) -> float:
    """``timeout_s`` as a float, or InvalidInputError: Ray's waits refuse a negative one
    and overflow on an infinite one, which would surface half-way through a stream."""
    import numbers

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) \
            or not 0 < float(timeout_s) < math.inf:
        raise InvalidInputError(f"timeout_s must be a finite number of seconds > 0, got "
                                f"{timeout_s!r}; pass e.g. timeout_s=300.0")
    return float(timeout_s)


def _get_all(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as e:
        # Ray's frames in the traceback hold the refs waited for: a held error must not
        # keep them alive (nor what a late result pins, a publish's buckets).
        traceback.clear_frames(e.__traceback__)
        raise WeightSyncTimeoutError(f"{what} took longer than {timeout_s}s") from e


def _wait_quietly(refs: list[Any], timeout_s: float) -> None:
    """Wait for ``refs`` during a failed stream's clean-up, whose aborts and frees must run
    whatever the wait raises (the stream's own error is the one raised)."""
    import ray

    try:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    except Exception as e:  # the stream's error is the one that counts
        logger.warning("waiting for receivers while a stream failed raised %r", e)


def _ended(refs: list[Any]) -> bool:
    """Whether every call of ``refs`` has ended (done or failed); False if that cannot be
    told now."""
    import ray

    try:
        ready, _rest = ray.wait(refs, num_returns=len(refs), timeout=0)
    except Exception:
        return False
    return len(ready) == len(refs)


def _find(actor: Any, attr: str, cls: type) -> Any:
    obj = getattr(actor, attr, None)
    if not isinstance(obj, cls):
        raise WeightSyncError(
            f"actor {type(actor).__name__} has no {cls.__name__} at attribute {attr!r} (found "
            f"{type(obj).__name__}); create one in __init__, e.g. self.{attr} = "
            f"{cls.__name__}(self.model)")
    return obj


def _remote_begin(actor: Any, attr: str, session: str, layout: WeightLayout | None,
                  version: int, source: SourceProcess | None = None) -> tuple[int, bool]:
    """Begin a stream on a receiver: (tensors it skips, whether it can read ``source``)."""
    rec = _find(actor, attr, WeightReceiver)
    skipped = rec.begin_stream(session, layout, version)
    return skipped, source is not None and rec.accept_source(session, source)


def _remote_bucket(actor: Any, attr: str, session: str, k: int, box: list[ObjectRef],
                   spec: BucketLayout | None = None) -> list[BucketReport]:
    # On an async actor this runs on its event loop (Ray runs a sync __ray_call__
    # there), so it blocks the loop for one bucket; it still works, in any order.
    return _find(actor, attr, WeightReceiver).load_stream_bucket(session, k, box, spec)


def _remote_run(actor: Any, attr: str, session: str, ks: list[int],
                boxes: list[list[Any]]) -> list[BucketReport]:
    """Load a run of consecutive buckets (read in place or by reference), in order."""
    rec = _find(actor, attr, WeightReceiver)
    out: list[BucketReport] = []
    try:
        for k, box in zip(ks, boxes):
            out.extend(rec.load_stream_bucket(session, k, box))
    finally:
        boxes.clear()
    return out


def _remote_finish(actor: Any, attr: str, session: str, buckets: int) -> int:
    return _find(actor, attr, WeightReceiver).finish_stream(session, buckets)


def _remote_abort(actor: Any, attr: str, session: str) -> None:
    rec = getattr(actor, attr, None)
    if isinstance(rec, WeightReceiver):
        rec.abort_stream(session)


def _remote_load(actor: Any, attr: str, manifest: Manifest) -> LoadReport:
    return _find(actor, attr, WeightReceiver).load(manifest)
