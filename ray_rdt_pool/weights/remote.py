"""Calls between actors: the receiver's entry points run through ``__ray_call__``, and
the checks and waits around such calls.

Owns the functions a trainer's stream (and the driver's :func:`~ray_rdt_pool.weights.sync`)
runs on a receiver actor through ``ActorHandle.__ray_call__`` (``_remote_*``: each finds
the actor's :class:`WeightReceiver` by attribute name), the actor-handle and timeout
checks, and the waits on such calls (:func:`get_all` raises a typed timeout,
:func:`wait_quietly` never raises, :func:`calls_ended` never blocks). Stateless. The
``_remote_*`` functions run on the receiver actor's task thread (or event loop); the
rest on the caller's thread.
"""

from __future__ import annotations

import contextlib
import logging
import math
import traceback
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ray_rdt_pool.errors import (
    InvalidInputError,
    TrainerRankError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from ray_rdt_pool.weights.manifest import Manifest, WeightLayout
from ray_rdt_pool.weights.reports import BucketReport, LoadReport
from ray_rdt_pool.weights.weight_receiver import WeightReceiver

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from ray_rdt_pool.same_node.peer_memory import SourceProcess

logger = logging.getLogger(__name__)

#: Attribute names :func:`~ray_rdt_pool.weights.sync` looks up on the trainer and
#: inference actors.
SENDER_ATTR = "weight_sender"
RECEIVER_ATTR = "weight_receiver"


def actor_handles(receivers: Any, what: str) -> list[ActorHandle]:
    """``receivers`` as a list of distinct actor handles, or InvalidInputError: anything
    else would fail later as an AttributeError deep in a Ray call, after the stream's
    version was used."""
    if is_actor(receivers):
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
        if not is_actor(r):
            raise InvalidInputError(f"{what}: receiver {i} is a {type(r).__name__}, not an "
                                    f"actor handle; pass the handles that .remote() on an "
                                    f"actor class returned")
    ids = [r._actor_id.hex() for r in handles]
    if len(set(ids)) != len(ids):
        raise InvalidInputError(f"{what} got the same receiver actor twice")
    return handles


def is_actor(obj: Any) -> bool:
    """Whether ``obj`` can be called as an actor here (what a stream uses of a handle)."""
    return hasattr(obj, "__ray_call__") and hasattr(obj, "_actor_id")


def check_timeout(timeout_s: Any) -> float:
    """``timeout_s`` as a float, or InvalidInputError: Ray's waits refuse a negative one
    and overflow on an infinite one, which would surface half-way through a stream."""
    import numbers

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) \
            or not 0 < float(timeout_s) < math.inf:
        raise InvalidInputError(f"timeout_s must be a finite number of seconds > 0, got "
                                f"{timeout_s!r}; pass e.g. timeout_s=300.0")
    return float(timeout_s)


def get_all(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as e:
        # Ray's frames in the traceback hold the refs waited for: a held error must not
        # keep them alive (nor what a late result pins, a publish's buckets).
        traceback.clear_frames(e.__traceback__)
        raise WeightSyncTimeoutError(f"{what} took longer than {timeout_s}s") from e


def wait_moving(refs: list[Any], keys: list[str], timeout_s: float, what: str) -> list[Any]:
    """``ray.get`` of ``refs``, calls that beat under ``keys`` (one each, see
    :mod:`ray_rdt_pool._ray.beats`): waits as long as they move. Once none ended and
    none beat for ``timeout_s`` plus a grace of ``min(timeout_s, 30)`` seconds, it
    cancels them (a call not started yet never starts; one that runs stops at its next
    beat and never commits), waits the grace once more for them to end, and raises
    :class:`WeightSyncTimeoutError`, or what they raised. The calls apply ``timeout_s``
    themselves and name what stalled, so their own error usually comes first. A call's
    error is raised as soon as it ends with one."""
    import time

    import ray

    from ray_rdt_pool._ray.beats import cancel, read

    pending = list(refs)
    beats: dict[str, bytes | None] = dict.fromkeys(keys)
    owner = dict(zip(refs, keys))
    grace = min(timeout_s, 30.0)
    deadline = time.monotonic() + timeout_s + grace
    pause = max(0.05, min(1.0, timeout_s / 8))
    while pending and time.monotonic() < deadline:
        left = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(pause, left)))
        for ref in ready:
            ray.get(ref, timeout=0)  # raises the call's error
            beats.pop(owner[ref], None)
            deadline = time.monotonic() + timeout_s + grace
        for k in [] if ready else list(beats):
            now = read(k)
            if now != beats[k]:
                beats[k] = now
                deadline = time.monotonic() + timeout_s + grace
    if pending:
        for ref in pending:
            cancel(owner[ref])
            if beats.get(owner[ref]) is None:
                try:
                    ray.cancel(ref)  # never started: it must not start now
                except Exception:
                    pass
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=grace)
        for ref in done:
            try:
                ray.get(ref, timeout=0)  # raises the call's error (it stopped, or failed)
            except ray.exceptions.TaskCancelledError:
                pending.append(ref)
        if pending:
            raise WeightSyncTimeoutError(
                f"{what} took longer than {timeout_s}s without progress (and a grace of "
                f"{grace}s); it was told to stop and commit nothing")
    return ray.get(list(refs), timeout=0)


def wait_quietly(refs: list[Any], timeout_s: float) -> None:
    """Wait for ``refs`` during a failed stream's clean-up, whose aborts and frees must run
    whatever the wait raises (the stream's own error is the one raised)."""
    import ray

    try:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    except Exception as e:  # the stream's error is the one that counts
        logger.warning("waiting for receivers while a stream failed raised %r", e)


def calls_ended(refs: list[Any]) -> bool:
    """Whether every call of ``refs`` has ended (done or failed); False if that cannot be
    told now."""
    import ray

    try:
        ready, _rest = ray.wait(refs, num_returns=len(refs), timeout=0)
    except Exception:
        return False
    return len(ready) == len(refs)


def find_attr(actor: Any, attr: str, cls: type) -> Any:
    obj = getattr(actor, attr, None)
    if not isinstance(obj, cls):
        raise WeightSyncError(
            f"actor {type(actor).__name__} has no {cls.__name__} at attribute {attr!r} (found "
            f"{type(obj).__name__}); create one in __init__, e.g. self.{attr} = "
            f"{cls.__name__}(self.model)")
    return obj


class Began(NamedTuple):
    """A receiver's answer to a stream's begin."""

    skipped: int  #: manifest tensors it skips
    source_ok: bool  #: it can read the trainer's process (source reads)
    node: str  #: its Ray node id
    md: bytes  #: its signal endpoint's metadata
    #: per bucket, whether it lands in the destination (None: a lazy stream)
    in_place: tuple[bool, ...] | None
    partial: bool  #: it reads only part of some bucket (select=)
    #: an async actor: its receive call goes off its event loop (the ``_ray_system``
    #: concurrency group), so the engine keeps serving while it loads
    asyncio: bool = False


class Role(NamedTuple):
    """A receiver's place in a stream: whom it reads from and tells (signal endpoints'
    metadata), whom it relays to, and its bounds."""

    up: bytes  #: the trainer, or the receiver before it in the chain
    coord: bytes  #: the trainer, told of every bucket's progress
    down: bytes | None  #: the receiver after it in the chain, if it relays
    max_inflight: int  #: snapshots it may hold for its successor at once
    timeout_s: float  #: no progress for this long ends the receive


def remote_begin(actor: Any, attr: str, session: str, layout: WeightLayout | None,
                  version: int, source: SourceProcess | None = None,
                  relay: bool = False, peer: bool = False, peer_shard: Any = None) -> Began:
    """Begin a stream on a receiver (see :class:`Began`); ``peer``: from another
    engine's receiver, whose names are destination names."""
    import ray

    from ray_rdt_pool.weights.links import mailbox

    rec = find_attr(actor, attr, WeightReceiver)
    md = mailbox().metadata()  # before the stream holds the receiver: this may fail
    skipped = rec._begin_stream(session, layout, version, peer, peer_shard)
    ok = source is not None and rec._accept_source(session, source)
    plan = rec._stream_plan(session)
    in_place = None if plan is None else tuple(
        b.targets is not None and b.select is None for b in plan.buckets)
    partial = plan is not None and any(b.select is not None for b in plan.buckets)
    from ray_rdt_pool._ray.patches import actor_is_asyncio

    return Began(skipped, ok, ray.get_runtime_context().get_node_id(), md, in_place, partial,
                 actor_is_asyncio())


def remote_md(actor: Any) -> bytes:
    """This actor's signal endpoint (a relayed many-rank sync chains its receivers)."""
    from ray_rdt_pool.weights.links import mailbox

    return mailbox().metadata()


def remote_receive(actor: Any, attr: str, session: str, role: Role) -> list[BucketReport]:
    """A receiver's one call of a stream's buckets (see :mod:`.receiving`)."""
    from ray_rdt_pool.weights.receiving import receive

    return receive(find_attr(actor, attr, WeightReceiver), session, role)


def remote_finish(actor: Any, attr: str, session: str, buckets: int,
                   deadline: float | None = None) -> int:
    return find_attr(actor, attr, WeightReceiver)._finish_stream(session, buckets, deadline)


def remote_abort(actor: Any, attr: str, session: str) -> bool:
    """Drop stream ``session`` on this receiver; True if it had committed it already."""
    rec = getattr(actor, attr, None)
    if isinstance(rec, WeightReceiver):
        return rec._abort_stream(session)
    return False


@contextlib.contextmanager
def source_watch(receivers: Sequence[ActorHandle], attr: str, session: str,
                 timeout_s: float, source: str) -> Iterator[None]:
    """Around the driver's wait for stream ``session``'s source (``source``: "the
    trainer", or "the peer engine"): if the wait fails, every receiver drops the stream
    (:func:`_abort_session`), and a source that died is a typed error naming the
    receivers that had committed (a trainer's: :class:`TrainerRankError`, rank 0)."""
    from ray.exceptions import RayActorError

    try:
        yield
    except BaseException as e:
        # As long as a commit may still run there (serving sections may hold it off for
        # timeout_s): only then does each answer say whether it committed.
        committed = _abort_session(receivers, attr, session, timeout_s + min(timeout_s, 30.0))
        if not isinstance(e, RayActorError):
            raise
        kept = (f"receiver(s) {committed} had committed the version, the others keep "
                "their previous one" if committed
                else "no receiver committed it; each keeps its previous version")
        msg = f"{source} died during the sync ({type(e).__name__}); {kept}"
        if source == "the trainer":
            raise TrainerRankError(f"{msg}; restart it and sync again", 0, True,
                                   committed) from e
        raise WeightSyncError(f"{msg}; catch up from another engine, or sync from the "
                              "trainer") from e


def _abort_session(receivers: Sequence[ActorHandle], attr: str, session: str,
                   timeout_s: float) -> list[int]:
    """The driver's clean-up once a stream's source (the trainer, or a peer engine) died
    or gave up without its own clean-up: every receiver drops stream ``session`` (on
    Ray's error-path thread, beside a receive loop that holds the actor, which then
    ends), so a retry of the same version finds them free. Returns the receivers that
    had committed it. Best effort: a receiver that is gone or slow is skipped."""
    import ray

    from ray_rdt_pool._ray.patches import error_path_call

    refs: list[Any] = []
    for r in receivers:
        try:
            refs.append(error_path_call(r).remote(remote_abort, attr, session))
        except Exception as e:  # a handle that cannot be called: nothing to drop there
            logger.warning("could not abort stream %s on a receiver: %r", session, e)
            refs.append(None)
    wait_quietly([r for r in refs if r is not None], timeout_s)
    committed = []
    for i, ref in enumerate(refs):
        try:
            if ref is not None and ray.get(ref, timeout=0):
                committed.append(i)
        except Exception:
            pass
    return committed


def remote_load(actor: Any, attr: str, manifest: Manifest, beat_key: str | None = None,
                 every_s: float = 60.0, commit_wait_s: float | None = None) -> LoadReport:
    from ray_rdt_pool._ray.beats import Beat

    beat = Beat(beat_key, every_s)
    try:
        return find_attr(actor, attr, WeightReceiver)._load_manifest(
            manifest, True, beat.tick, beat.check, commit_wait_s)
    finally:
        beat.close()
