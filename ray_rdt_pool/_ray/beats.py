"""Heartbeats of long calls, so that a caller can wait for "no progress for this long"
rather than for a total time.

A weight sync's trainer (or receiver) call runs for as long as its buckets take. The
driver that waits for it learns that it still moves from a counter the call writes to
Ray's GCS key-value store under a key the driver chose: at the call's start, then at
most every ``every_s`` seconds while it makes progress (a sync shorter than that writes
once). The driver reads the key only when a wait ends without a result. A driver that
gives up writes a second key (:func:`cancel`), which the call reads at its beats and
before it commits (:meth:`Beat.cancelled`): a call its driver gave up on never commits.

Lifetime: a key and its cancel mark live until the call ends (:meth:`Beat.close`
deletes both; a call that dies leaves a few bytes). Threads: the call's thread beats;
the driver's thread reads and cancels.
"""

from __future__ import annotations

import time
import uuid

__all__ = ["Beat", "cancel", "new_key", "read"]

_NAMESPACE = "ray_rdt_pool"
_CANCEL = "/cancel"
#: Least seconds between two reads of a call's cancel mark (each is a GCS round trip).
CANCEL_CHECK_S = 0.5


def new_key() -> str:
    """A key for one call's beats."""
    return f"beat/{uuid.uuid4().hex}"


class Beat:
    """The beating side: :meth:`tick` after each step of progress (cheap: a clock read
    unless a beat is due)."""

    def __init__(self, key: str | None, every_s: float) -> None:
        self.key = key
        self.every_s = max(0.2, float(every_s))
        self.count = 0
        self._last = 0.0
        self._checked = time.monotonic()
        if key is not None:
            self._put()

    def tick(self) -> None:
        """A step of progress: a beat when one is due; and, at most every
        :data:`CANCEL_CHECK_S`, WeightSyncTimeoutError if the driver gave up."""
        if self.key is None:
            return
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._put()
        if now - self._checked >= CANCEL_CHECK_S:
            self._checked = now
            self.check()

    def cancelled(self) -> bool:
        """Whether the driver gave up on this call (one GCS read)."""
        return self.key is not None and read(self.key + _CANCEL) is not None

    def _put(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        assert self.key is not None
        self.count += 1
        self._last = time.monotonic()
        try:
            _internal_kv_put(self.key, str(self.count).encode(), overwrite=True,
                             namespace=_NAMESPACE)
        except Exception:  # a beat is advice: the call itself goes on
            pass

    def check(self) -> None:
        """Raise WeightSyncTimeoutError if the driver gave up (before a commit)."""
        if self.cancelled():
            from ray_rdt_pool.errors import WeightSyncTimeoutError

            raise WeightSyncTimeoutError(
                "the driver gave up on this call (it saw no progress for longer than "
                "timeout_s, or the sync was cancelled); nothing was committed")

    def close(self) -> None:
        if self.key is None:
            return
        try:
            from ray.experimental.internal_kv import _internal_kv_del

            _internal_kv_del(self.key, namespace=_NAMESPACE)
            _internal_kv_del(self.key + _CANCEL, namespace=_NAMESPACE)
        except Exception:
            pass
        self.key = None


def cancel(key: str) -> None:
    """The driver gave up on the call beating under ``key``."""
    from ray.experimental.internal_kv import _internal_kv_put

    try:
        _internal_kv_put(key + _CANCEL, b"1", overwrite=True, namespace=_NAMESPACE)
    except Exception:
        pass


def read(key: str) -> bytes | None:
    """The last beat under ``key`` (None: none yet, or the call ended)."""
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        value = _internal_kv_get(key, namespace=_NAMESPACE)
    except Exception:
        return None
    return None if value is None else bytes(value)
