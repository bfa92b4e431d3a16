"""Logging of ray_rdt_pool: one standard ``logging`` logger per module, nothing on stdout.

Role: every module logs to ``logging.getLogger(__name__)``, so all records live under the
``ray_rdt_pool`` logger (``ray_rdt_pool._ray.transport``, ``ray_rdt_pool.obs.metrics``, ...). The
library installs no handler of its own except through :func:`enable_debug_logging`,
which ``RAY_RDT_POOL_DEBUG_TRANSFERS=1`` (``PoolConfig.debug_transfers``) triggers when the
process's runtime is created (see :func:`ray_rdt_pool.obs.metrics.observer_for`). With it the
transport logs every put and fetch at DEBUG with the object ID, sizes and descriptor
counts. Records go to stderr, which Ray writes to the worker's ``.err`` log file and,
with ``log_to_driver``, echoes on the driver's console.

Without a handler, Python's last-resort handler still prints WARNING and above to stderr
(for example the once-per-process pool fallback warning).

NIXL's Python package configures its own ``nixl`` logger with a console handler on
*stdout* (INFO: two lines per agent created). :func:`quiet_nixl_stdout` moves that
handler to stderr; the NIXL backend should call it right after importing ``nixl._api``.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = [
    "LOGGER_NAME", "debug_handler", "disable_debug_logging", "enable_debug_logging",
    "quiet_nixl_stdout",
]

#: The package logger; every module's logger is a child of it.
LOGGER_NAME = "ray_rdt_pool"

_FORMAT = "%(asctime)s %(levelname)s %(name)s [pid %(process)d %(threadName)s] %(message)s"
_MARK = "_ray_rdt_pool_debug_handler"


def enable_debug_logging(stream: TextIO | None = None) -> logging.Handler:
    """Attach a DEBUG handler writing to ``stream`` (stderr) to the ``ray_rdt_pool`` logger.

    Idempotent: a second call returns the handler installed by the first. Records still
    propagate to the root logger, so an application that configured its own handlers
    sees them too. The logger's level is set to DEBUG until :func:`disable_debug_logging`
    puts back the one it had.
    """
    pkg = logging.getLogger(LOGGER_NAME)
    found = debug_handler()
    if found is not None:
        return found
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(_FORMAT))
    setattr(handler, _MARK, pkg.level)  # the level to put back
    pkg.addHandler(handler)
    pkg.setLevel(logging.DEBUG)
    return handler


def debug_handler() -> logging.Handler | None:
    """The handler :func:`enable_debug_logging` installed, or None."""
    for h in logging.getLogger(LOGGER_NAME).handlers:
        if hasattr(h, _MARK):
            return h
    return None


def disable_debug_logging(handler: logging.Handler | None = None) -> None:
    """Remove the handler of :func:`enable_debug_logging` (only if it is ``handler``,
    when given) and give the logger back the level it had before."""
    pkg = logging.getLogger(LOGGER_NAME)
    for h in list(pkg.handlers):
        if hasattr(h, _MARK) and (handler is None or h is handler):
            pkg.removeHandler(h)
            pkg.setLevel(getattr(h, _MARK))


def quiet_nixl_stdout() -> int:
    """Point the console handlers of NIXL's ``nixl`` logger at stderr instead of stdout.

    NIXL sets them up when ``nixl._api`` is first imported, so call this after that
    import. Levels (``NIXL_LOG_LEVEL``) are left alone. Returns how many handlers moved.
    """
    moved = 0
    for h in logging.getLogger("nixl").handlers:
        # Exactly StreamHandler: FileHandler and friends write where they were told to.
        if type(h) is logging.StreamHandler and h.stream not in (sys.stderr, sys.__stderr__):
            try:
                h.setStream(sys.stderr)
            except ValueError:  # the old stream is closed already: nothing to flush
                h.stream = sys.stderr
            moved += 1
    return moved
