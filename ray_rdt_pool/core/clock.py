"""The clock the transport's timed logic reads: linger, idle peers, cut-offs, waits.

Injected so that tests drive those deadlines with
:class:`ray_rdt_pool.testing.FakeClock` instead of sleeping; everything else uses
:data:`SYSTEM_CLOCK`. Also owns :class:`Backoff`, the pauses of a wait that polls
(nothing wakes a waiter when a NIXL notification lands or a READ ends).
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["FIRST_PAUSE_S", "HOT_PAUSE_S", "HOT_S", "SLOW_PAUSE_S", "SYSTEM_CLOCK",
           "Backoff", "Clock", "SystemClock"]

#: A polling wait's first pause after finding nothing (seconds); each next one doubles.
FIRST_PAUSE_S = 20e-6
#: The longest pause while a wait is younger than HOT_S: a bucket's signal or READ
#: lands within milliseconds, and a longer pause would add itself to every bucket.
HOT_PAUSE_S = 100e-6
HOT_S = 0.01
#: The longest pause of an older wait: an idle wait costs little CPU.
SLOW_PAUSE_S = 1e-3


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


class Backoff:
    """The pauses of one polling wait: from FIRST_PAUSE_S, doubling, at most HOT_PAUSE_S
    for the wait's first HOT_S and SLOW_PAUSE_S after. One per wait, on its thread."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.start = clock.monotonic()
        self.pause = FIRST_PAUSE_S

    def next(self) -> float:
        """The next pause (seconds)."""
        p = self.pause
        cap = HOT_PAUSE_S if self.clock.monotonic() - self.start < HOT_S else SLOW_PAUSE_S
        self.pause = min(p * 2, cap)
        return p
