"""The chaos test, small: 60 transfers from 2 senders to 3 receivers with random faults.

The engine is :mod:`tests.stress.chaos` (its docstring lists the fault kinds); the
500-transfer run is ``python -m tests.stress.chaos --transfers 500 --seed 0`` (a local
cluster of its own); here it runs on the test process's shared cluster. One run serves
every test below, so each property fails on its own; ``pytest -s`` prints the run's table.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.stress import chaos
from tests.support.raycluster import driver_rdt_fetch_timeout

pytestmark = pytest.mark.ray

TRANSFERS = 60
SEED = 0


@pytest.fixture(scope="module")
def report(ray_cluster: str) -> dict[str, Any]:
    # On the test process's shared cluster: every setting is in the chaos actors' own
    # runtime_env, and the driver bounds the transfers of task arguments as they do.
    with driver_rdt_fetch_timeout(chaos.RAY_FETCH_TIMEOUT_S):
        rep = chaos.run_chaos(transfers=TRANSFERS, seed=SEED, settle_s=30.0,
                              manage_cluster=False)
    print("\n" + chaos.format_report(rep))
    return rep


def _problems(rep: dict[str, Any], *outcomes: str) -> list[str]:
    return [f"#{p['index']} {p['fault']} {p['path']}/{p['owner']} oversized={p['oversized']}: "
            f"{p['outcome']} {p['error']} {p['message'][-300:]}"
            for p in rep["problems"] if not outcomes or p["outcome"] in outcomes]


def test_the_schedule_is_deterministic():
    a, kill_a, victim_a = chaos.draw_schedule(TRANSFERS, SEED)
    b, kill_b, victim_b = chaos.draw_schedule(TRANSFERS, SEED)
    assert (a, kill_a, victim_a) == (b, kill_b, victim_b)
    tensors, _ = chaos.build_payload(123, oversized=True)
    assert chaos.checksum(tensors) == chaos.checksum(chaos.build_payload(123, True)[0])
    assert chaos.nbytes_of(tensors) > chaos.POOL_BYTES


def test_every_fault_kind_occurred(report):
    assert report["transfers"] == TRANSFERS
    for fault in chaos.FAULTS:
        assert report["faults"].get(fault, 0) >= 1, (fault, report["faults"])


def test_no_corrupt_bytes(report):
    """Every transfer that returned has exactly the bytes that were put, though the sender
    changed every source byte right after the put: objects are snapshots, also when they
    are larger than the pool."""
    assert report["corrupt"] == 0, _problems(report, "corrupt")


def test_every_failure_is_a_typed_error(report):
    assert report["untyped_error"] == 0, _problems(report, "untyped_error")
    assert report["hung"] == 0, _problems(report, "hung")


def test_some_transfers_succeed(report):
    assert report["outcomes"]["ok"] >= TRANSFERS // 3, report["outcomes"]


def test_fault_free_and_oversized_transfers_succeed(report):
    """No fault injected (plain, or only too big for the pool): byte-exact, no error. The
    warm-up (every sender to every receiver, by ray.get and as a task argument, before the
    faults start) too."""
    assert report["warmup_problems"] == [], report["warmup_problems"]
    for fault in ("none", "oversized"):
        assert set(report["by_fault"][fault]) == {"ok"}, (fault, report["by_fault"][fault],
                                                         _problems(report))


def test_transfers_from_the_killed_sender_raise(report):
    assert report["from_killed_after_death"] >= 1, report["kill"]
    assert report["kill"]["reaped"], report["kill"]
    assert report["from_killed_raised"] == report["from_killed_after_death"], (
        report["errors"]["sender_killed"], _problems(report))
    assert report["from_killed_typed"] == report["from_killed_after_death"]


def test_no_leak(report):
    """Pools, arenas and NIXL registrations of every live actor back at their baseline.

    The one thing left is what Ray itself keeps: a task argument received for a task that
    was then cancelled stays in Ray's RDT store (Ray 2.60 never pops it), holding its
    arena block. Those are counted apart, and only cancelled transfers may cause them."""
    assert report["leaked_bytes"] == 0, (report["leaks"], report["leak_diagnosis"])
    assert report["leaks"] == {}, report["leak_diagnosis"]
    assert report["held_by_ray_objects"] <= report["by_fault"]["abort"].get("typed_error", 0)
