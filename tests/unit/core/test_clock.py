"""A polling wait's pauses (core/clock.py Backoff): short while the wait is young, so a
bucket's signal or READ is seen within HOT_PAUSE_S of landing; long once it is old, so
an idle wait costs little."""

from __future__ import annotations

from ray_rdt_pool.core.clock import (
    FIRST_PAUSE_S,
    HOT_PAUSE_S,
    HOT_S,
    SLOW_PAUSE_S,
    Backoff,
)
from ray_rdt_pool.testing import FakeClock


def test_pauses_stay_short_while_young_and_grow_once_old() -> None:
    clock = FakeClock()
    t0 = clock.monotonic()
    b = Backoff(clock)
    young = []
    while clock.monotonic() - t0 < HOT_S:
        p = b.next()
        young.append(p)
        clock.sleep(p)
    assert young[0] == FIRST_PAUSE_S and young[1] == 2 * FIRST_PAUSE_S
    assert max(young) == HOT_PAUSE_S
    old = []
    for _ in range(20):
        p = b.next()
        old.append(p)
        clock.sleep(p)
    assert max(old) == SLOW_PAUSE_S and old == sorted(old)
