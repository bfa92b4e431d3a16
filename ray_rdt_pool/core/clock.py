"""The clock the transport's timed logic reads: linger, idle peers, cut-offs, waits.

Injected so that tests drive those deadlines with
:class:`ray_rdt_pool.testing.FakeClock` instead of sleeping; everything else uses
:data:`SYSTEM_CLOCK`.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock"]


class Clock(Protocol):
    """Monotonic seconds, and a sleep measured on the same clock."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """``time.monotonic`` and ``time.sleep``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_CLOCK: Clock = SystemClock()
